"""The model fingerprint's weights digest: weights swapped under the same
path give another fingerprint (another NVMe folder, records refused)."""
from vllm_sekv.model_identity import weights_digest


def test_swapped_weights_change_the_digest_and_the_same_weights_keep_it(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"a" * 300_000)
    (tmp_path / "config.json").write_text("{}")
    first = weights_digest(str(tmp_path))
    assert weights_digest(str(tmp_path)) == first
    data = bytearray(b"a" * 300_000)
    data[150_000] = ord("b")  # one byte in the middle (the samples cover a file this small whole)
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    assert weights_digest(str(tmp_path)) != first
    (tmp_path / "model.safetensors").write_bytes(b"c" * 300_000)  # a fine-tune of the same size
    assert weights_digest(str(tmp_path)) != first
    assert weights_digest("org/name") == "name:org/name"  # no local folder: its name
    assert weights_digest(str(tmp_path), load_format="dummy") == "dummy"
