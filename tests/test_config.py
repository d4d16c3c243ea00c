from pathlib import Path

import pytest

from vllm_sekv.config import VIEW_PRESETS, SekvConfig
from vllm_sekv.config_values import parse_size_bytes


@pytest.mark.parametrize(
    "text,expected",
    [("8G", 8 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("64k", 64 << 10), (4096, 4096), ("123", 123)],
)
def test_sizes(text, expected):
    assert parse_size_bytes("host_bytes", text) == expected


def test_defaults_and_extra_config():
    cfg = SekvConfig.from_sources({"host_bytes": "2G", "block_tokens": 16}, environ={})
    assert cfg.host_bytes == 2 << 30 and cfg.block_tokens == 16 and cfg.policy == "slru"


def test_environment_overrides_extra_config():
    cfg = SekvConfig.from_sources({"host_bytes": "2G"}, environ={"SEKV_HOST_BYTES": "3G", "SEKV_POLICY": "lru"})
    assert cfg.host_bytes == 3 << 30 and cfg.policy == "lru"


def test_non_config_env_is_ignored():
    assert SekvConfig.from_sources({}, environ={"SEKV_CACHE_DIR": "/tmp/x"}) == SekvConfig()


@pytest.mark.parametrize(
    "extra,env,key",
    [
        ({"host_byte": "1G"}, {}, "host_byte"),
        ({"host_bytes": "8X"}, {}, "host_bytes"),
        ({"host_bytes": True}, {}, "host_bytes"),
        ({"block_tokens": 33}, {}, "block_tokens"),
        ({"block_tokens": "many"}, {}, "block_tokens"),
        ({"policy": "fifo"}, {}, "policy"),
        ({"protected_percent": 120}, {}, "protected_percent"),
        ({}, {"SEKV_HOST_BYTE": "1G"}, "SEKV_HOST_BYTE"),
        ({}, {"SEKV_BLOCK_TOKENS": "7"}, "block_tokens"),
        ({"restore_codec": "lowrank(0)"}, {}, "restore_codec"),
        ({"restore_codec": "router"}, {}, "restore_codec"),  # no router_path
        ({"recompute_blocks": -1}, {}, "recompute_blocks"),
        ({"view_select_blocks": -2}, {}, "view_select_blocks"),
        ({"recompute_blocks": 4, "surprisal": "on", "coarse": "on"}, {}, "recompute_blocks"),
        ({"lexical_weight": -1}, {}, "lexical_weight"),
        ({}, {"SEKV_LEXICAL_WEIGHT": "nan"}, "lexical_weight"),
        ({"workspace_codec": "int8"}, {}, "workspace_codec"),
        ({}, {"SEKV_WORKSPACE_CODEC": "FP8"}, "workspace_codec"),
        ({"resident_bytes": "1G", "restore_mode": "layerwise"}, {}, "resident_bytes"),
        ({"lexical_candidates": 64}, {}, "lexical_candidates"),  # no rerank_blocks
        ({"lexical_candidates": -1, "rerank_blocks": 8}, {}, "lexical_candidates"),
    ],
    ids=["unknown-key", "bad-size", "bool-size", "odd-block", "text-block", "bad-policy",
         "bad-percent", "unknown-env", "bad-env-value", "bad-codec", "router-codec-without-router",
         "negative-recompute", "negative-select", "recompute-with-coarse", "negative-lexical-weight", "nan-lexical-weight",
         "bad-workspace-codec", "bad-workspace-codec-env", "resident-pool-with-layerwise-restores",
         "lexical-candidates-without-rerank", "negative-lexical-candidates"],
)
def test_bad_config_names_the_key(extra, env, key):
    with pytest.raises(ValueError, match=key):
        SekvConfig.from_sources(extra, environ=env)


def test_bad_extra_value_fails_even_when_the_environment_overrides_it():
    with pytest.raises(ValueError, match="host_bytes"):
        SekvConfig.from_sources({"host_bytes": "lots"}, environ={"SEKV_HOST_BYTES": "1G"})


def test_every_key_is_documented_once_and_nothing_else_is():
    """docs/configuration.md has one table row per config key (`| \\`key\\` | default | meaning |`)."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+)` \|", doc, re.M)
    assert sorted(rows) == sorted(SekvConfig.keys())


def test_workspace_codec_fp8_is_accepted_and_exact_is_the_default():
    assert SekvConfig().workspace_codec == "exact"
    assert SekvConfig.from_sources({}, environ={"SEKV_WORKSPACE_CODEC": "fp8"}).workspace_codec == "fp8"


@pytest.mark.parametrize("extra,other", [
    ({"remote_url": "redis://localhost:6379/0", "hash_secret": "s" * 16}, "remote_url"),
    ({"restore_codec": "lowrank(8)"}, "restore_codec"),
], ids=["with-remote", "with-lowrank"])
def test_workspace_codec_fp8_refuses_what_it_cannot_serve_naming_both_keys(extra, other):
    with pytest.raises(ValueError, match="workspace_codec") as e:
        SekvConfig.from_sources({"workspace_codec": "fp8", **extra}, environ={})
    assert other in str(e.value)
    SekvConfig.from_sources({"workspace_codec": "exact", **extra}, environ={})  # exact: both fine


QWEN_HEADS = str(Path(__file__).resolve().parents[1] / "benchmarks/results/fidelity/heads/qwen2.5-coder-1.5b.heads.json")


def test_the_accurate_view_preset_sets_its_keys_where_no_source_gives_them():
    cfg = SekvConfig.from_sources({"view_preset": "accurate", "rerank_heads_path": QWEN_HEADS}, environ={})
    assert VIEW_PRESETS["accurate"] and all(getattr(cfg, k) == v for k, v in VIEW_PRESETS["accurate"].items())
    given = SekvConfig.from_sources({"view_preset": "accurate", "rerank_heads_path": QWEN_HEADS, "probe_hops": 2},
                                    environ={"SEKV_VIEW_SELECT_BLOCKS": "16"})
    assert (given.probe_hops, given.view_select_blocks, given.view_lookalikes) == (2, 16, "drop")
    from_env = SekvConfig.from_sources({"rerank_heads_path": QWEN_HEADS}, environ={"SEKV_VIEW_PRESET": "accurate"})
    assert from_env == cfg
    assert SekvConfig.from_sources({"view_preset": "none"}, environ={}) == SekvConfig()


def test_the_accurate_view_preset_needs_the_retrieval_heads_and_names_the_keys_it_set():
    with pytest.raises(ValueError, match="'view_preset'.*'rerank_heads_path'.*calibrate-heads"):
        SekvConfig.from_sources({"view_preset": "accurate"}, environ={})
    with pytest.raises(ValueError, match="'recompute_blocks'.*view_preset 'accurate' sets 'recompute_blocks'"):
        SekvConfig.from_sources({"view_preset": "accurate", "rerank_heads_path": QWEN_HEADS, "surprisal": "on",
                                 "coarse": "on"}, environ={})
    with pytest.raises(ValueError, match="'view_preset': expected one of none, accurate"):
        SekvConfig.from_sources({"view_preset": "fast"}, environ={})


def test_question_passages_out_of_range_fail_at_start_up_naming_the_key():
    assert SekvConfig(view_question_passages=64).view_question_passages == 64
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="^sekv config 'view_question_passages': expected 0..64"):
            SekvConfig(view_question_passages=bad)
