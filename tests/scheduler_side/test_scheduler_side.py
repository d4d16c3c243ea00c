"""The scheduler side's start-up on an NVMe folder it cannot use: the error
names `nvme_dir`, never a bare OSError; a damaged manifest is set aside."""
import subprocess

import pytest

from vllm_sekv.config import SekvConfig


@pytest.fixture(scope="module")
def vllm_config(model_dir):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_sekv import plugin

    plugin.register()
    return EngineArgs(model=model_dir, max_model_len=2048, kv_transfer_config={
        "kv_connector": "sekv", "kv_role": "kv_both"}).create_engine_config()


def side(vllm_config, nvme_dir):
    from vllm_sekv.scheduler_side.scheduler_connector import SekvSchedulerSide

    return SekvSchedulerSide(SekvConfig.from_sources(
        {"host_bytes": "64M", "nvme_dir": str(nvme_dir), "nvme_bytes": "256M"}, environ={}), vllm_config)


def test_a_folder_that_is_a_file_is_refused_naming_nvme_dir(vllm_config, tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with pytest.raises(ValueError, match="'nvme_dir'"):
        side(vllm_config, not_a_folder)


def test_a_read_only_folder_is_refused_naming_nvme_dir(vllm_config, tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(root)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(ValueError, match="'nvme_dir'"):
            side(vllm_config, root)
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


def test_a_second_server_on_the_folder_is_refused_and_a_damaged_manifest_only_set_aside(vllm_config, tmp_path):
    first = side(vllm_config, tmp_path)
    with pytest.raises(Exception, match="'nvme_dir'.*in use"):
        side(vllm_config, tmp_path)
    first.shutdown()
    (manifest,) = tmp_path.glob("fp-*/manifest.sqlite")
    manifest.write_bytes(b"[]")  # what a JSON manifest of an old server, or garbage, looks like
    again = side(vllm_config, tmp_path)
    again.shutdown()
    assert list(tmp_path.glob("fp-*/manifest.sqlite.unreadable-*"))


def test_a_remote_tier_that_is_down_at_start_up_does_not_stop_the_server(vllm_config):
    from vllm_sekv.scheduler_side.scheduler_connector import SekvSchedulerSide
    from testbed.serving import free_port

    config = SekvConfig.from_sources({"host_bytes": "64M", "remote_url": f"redis://127.0.0.1:{free_port()}/0",
                                      "hash_secret": "sixteen bytes at least"}, environ={})
    side = SekvSchedulerSide(config, vllm_config)  # nothing listens there
    try:
        assert side.remote.lookup([b"\x01" * 16], "tenant", None) == 0  # a miss, not an error
        assert side.remote.failures == 1
    finally:
        side.shutdown()


def test_a_remote_tier_needs_the_shared_secret():
    with pytest.raises(ValueError, match="'remote_url'.*hash_secret"):
        SekvConfig(remote_url="redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="'remote_url'"):
        SekvConfig(remote_url="memcached://x", hash_secret="sixteen bytes at least")
