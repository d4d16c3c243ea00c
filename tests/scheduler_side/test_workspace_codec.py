"""`workspace_codec` against a real vLLM config of SmolLM2: fp8 holds about
twice the host blocks in the same budget, names its codec in the fingerprint
and the NVMe records (another folder, another record codec); over an e4m3
paged cache it keeps the cache's bytes (another fingerprint again), and it is
refused where it cannot."""
import pytest

from vllm_sekv.config import SekvConfig


@pytest.fixture(scope="module")
def vllm_config(model_dir):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_sekv import plugin

    plugin.register()
    return EngineArgs(model=model_dir, max_model_len=2048, kv_transfer_config={
        "kv_connector": "sekv", "kv_role": "kv_both"}).create_engine_config()


def _config(codec, **extra):
    return SekvConfig.from_sources({"host_bytes": "64M", "workspace_codec": codec, **extra}, environ={})


def test_fp8_holds_more_blocks_and_is_another_identity(vllm_config):
    from vllm_sekv import model_identity
    from vllm_sekv.protocol.metadata import host_slots, nvme_layout, record_layout
    from vllm_sekv.store.records import CODEC_EXACT, CODEC_FP8

    exact, fp8 = _config("exact", nvme_dir="/tmp/x"), _config("fp8", nvme_dir="/tmp/x")
    (n_exact, b_exact), (n_fp8, b_fp8) = host_slots(exact, vllm_config), host_slots(fp8, vllm_config)
    assert 0.56 < b_fp8 / b_exact < 0.57  # half, plus each block's scale and centres (32-token blocks, head_dim 64)
    assert n_fp8 >= 1.75 * n_exact
    fp_exact = model_identity.model_fingerprint(vllm_config, 32)
    assert "workspace_codec" not in fp_exact  # exact fingerprints are what they were
    assert model_identity.model_fingerprint(vllm_config, 32, "fp8") == {**fp_exact, "workspace_codec": "fp8"}
    assert nvme_layout(exact, vllm_config).root != nvme_layout(fp8, vllm_config).root
    r_exact, r_fp8 = record_layout(exact, vllm_config, 0), record_layout(fp8, vllm_config, 0)
    assert (r_exact.codec, r_fp8.codec) == (CODEC_EXACT, CODEC_FP8)
    assert r_exact.fingerprint != r_fp8.fingerprint and r_fp8.payload_bytes == b_fp8  # one rank


def test_fp8_over_an_fp8_paged_cache_keeps_its_bytes_and_names_the_cache_in_the_fingerprint(vllm_config):
    """`workspace_codec` fp8 with an e4m3 paged cache is the cache's own bytes:
    accepted, sized as any fp8 pool, and fingerprinted apart from fp8 blocks
    of a model-dtype cache (their values differ)."""
    from vllm_sekv import model_identity
    from vllm_sekv.protocol.metadata import host_slots, keeps_cache_bytes

    fp_fp8 = model_identity.model_fingerprint(vllm_config, 32, "fp8")
    before = vllm_config.cache_config.cache_dtype
    vllm_config.cache_config.cache_dtype = "fp8_e4m3"
    try:
        assert keeps_cache_bytes(_config("fp8"), vllm_config)
        assert not keeps_cache_bytes(_config("exact"), vllm_config)  # exact keeps the model dtype, as before
        assert host_slots(_config("fp8"), vllm_config) == host_slots(_config("fp8"), vllm_config)
        over_cache = model_identity.model_fingerprint(vllm_config, 32, "fp8")
        assert over_cache == {**fp_fp8, "kv_cache_dtype": "fp8_e4m3"}
        assert "kv_cache_dtype" not in model_identity.model_fingerprint(vllm_config, 32)
    finally:
        vllm_config.cache_config.cache_dtype = before


@pytest.mark.parametrize("cache_dtype, setting, value", [
    ("fp8_e5m2", None, None),  # another fp8: quantized twice
    ("fp8", "kv_cache_dtype_skip_layers", ["0"]),  # some layers' caches not fp8
    ("fp8", "calculate_kv_scales", True),  # scales that change after load
])
def test_fp8_is_refused_where_it_cannot_keep_the_caches_bytes_naming_the_key(vllm_config, cache_dtype, setting,
                                                                              value):
    from vllm_sekv.protocol.metadata import host_slots

    cache_config = vllm_config.cache_config
    before = (cache_config.cache_dtype, getattr(cache_config, setting, None) if setting else None)
    cache_config.cache_dtype = cache_dtype
    if setting:
        object.__setattr__(cache_config, setting, value)
    try:
        with pytest.raises(ValueError, match="workspace_codec"):
            host_slots(_config("fp8"), vllm_config)
        host_slots(_config("exact"), vllm_config)  # exact moves the model dtype, as before
    finally:
        cache_config.cache_dtype = before[0]
        if setting:
            object.__setattr__(cache_config, setting, before[1])
