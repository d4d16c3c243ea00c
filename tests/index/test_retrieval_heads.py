"""The retrieval-heads file (`index.retrieval_heads`) and its config key
`rerank_heads_path`: written and read back, refused at start-up naming the
key when missing, malformed, without a re-rank, or measured on another model."""
import json

import pytest

from vllm_sekv.config import SekvConfig
from vllm_sekv.index.retrieval_heads import RetrievalHeads, load_heads, read_heads_file
from vllm_sekv.index.router import RouterGeometry

GEO = RouterGeometry(num_layers=4, num_q_heads=6, num_kv_heads=2, head_dim=16, model_params=1000, name="m")


def _write(tmp_path, heads=((3, 1), (0, 5)), geometry=GEO) -> str:
    path = str(tmp_path / "heads.json")
    RetrievalHeads(geometry, tuple(heads), ((0.1,) * 6,) * 4, {"texts": 2}).write(path)
    return path


def test_a_written_file_reads_back_and_flattens_layer_major(tmp_path):
    path = _write(tmp_path)
    found = read_heads_file(path)
    assert found.heads == ((3, 1), (0, 5)) and found.geometry == GEO and found.calibration == {"texts": 2}
    cfg = SekvConfig.from_sources({"rerank_blocks": 64, "rerank_heads_path": path}, environ={})
    assert load_heads(cfg, GEO) == [3 * 6 + 1, 5]
    assert load_heads(SekvConfig.from_sources({}, environ={}), GEO) is None


def test_a_file_measured_on_another_model_is_refused_naming_the_key(tmp_path):
    cfg = SekvConfig.from_sources({"rerank_blocks": 64, "rerank_heads_path": _write(tmp_path)}, environ={})
    other = RouterGeometry(num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=16, model_params=1000, name="m")
    with pytest.raises(ValueError, match="'rerank_heads_path'.*num_q_heads: file 6, model 8"):
        load_heads(cfg, other)


@pytest.mark.parametrize("content, match", [
    (None, "cannot be read"),
    ("not json", "cannot be read"),
    ({"format": "something else", "version": 1}, "not a retrieval-heads file"),
    ({"format": "sekv-retrieval-heads", "version": 1, "geometry": {"num_layers": 4}, "heads": []}, "'geometry'"),
    ({"format": "sekv-retrieval-heads", "version": 1, "geometry": None, "heads": [[0, 1]]}, "'geometry'"),
    ("heads-outside", "outside the model"),
    ("heads-twice", "listed twice"),
    ("heads-floats", "integer pairs"),
])
def test_a_bad_file_fails_at_start_up_naming_the_key(tmp_path, content, match):
    path = tmp_path / "heads.json"
    if isinstance(content, str) and content.startswith("heads-"):
        doc = json.loads(open(_write(tmp_path)).read())
        doc["heads"] = {"heads-outside": [[4, 0]], "heads-twice": [[1, 1], [1, 1]],
                        "heads-floats": [[1.0, 2]]}[content]
        path.write_text(json.dumps(doc))
    elif isinstance(content, dict):
        path.write_text(json.dumps(content))
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"'rerank_heads_path'.*{match}"):
        SekvConfig.from_sources({"rerank_blocks": 64, "rerank_heads_path": str(path)}, environ={})


def test_heads_without_a_rerank_fail_at_start_up_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="'rerank_heads_path'.*'rerank_blocks'"):
        SekvConfig.from_sources({"rerank_heads_path": _write(tmp_path)}, environ={})
