import json
import subprocess
import sys

import pytest

from vllm_sekv.cli import build_serve_command, main


def test_serve_command_switches_sekv_on_with_one_transfer_config():
    cmd = build_serve_command(["/models/m", "--host-bytes", "2G", "--port", "8001", "--enforce-eager"])
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    transfer = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert transfer == {"kv_connector": "sekv", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"host_bytes": "2G"}}
    assert cmd[-3:] == ["--port", "8001", "--enforce-eager"]  # the rest goes to vLLM untouched


def test_serve_rejects_bad_sekv_values_before_starting_anything():
    with pytest.raises(ValueError, match="host_bytes"):
        build_serve_command(["/models/m", "--host-bytes", "2X"])


def test_serve_refuses_a_second_transfer_config():
    with pytest.raises(SystemExit, match="kv-transfer-config"):
        build_serve_command(["/models/m", "--kv-transfer-config", "{}"])


def test_bad_value_exits_with_a_message(capsys):
    assert main(["serve", "/models/m", "--policy", "fifo"]) == 2
    assert "'policy'" in capsys.readouterr().err


def test_console_script_lists_config_keys():
    out = subprocess.run([sys.executable, "-m", "vllm_sekv.cli", "config"], capture_output=True,
                         text=True, check=True).stdout
    assert "host_bytes" in out and "SEKV_HOST_BYTES" in out
