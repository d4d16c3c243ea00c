import json
import subprocess
import sys

import pytest

from vllm_sekv.cli import main
from vllm_sekv.cli.serve_cmd import build_serve_command


def test_serve_command_switches_sekv_on_with_one_transfer_config():
    cmd = build_serve_command(["/models/m", "--host-bytes", "2G", "--port", "8001", "--enforce-eager"])
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    transfer = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert transfer == {"kv_connector": "sekv", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"host_bytes": "2G"}}
    assert cmd[-3:] == ["--port", "8001", "--enforce-eager"]  # the rest goes to vLLM untouched


def test_serve_passes_a_vllm_flag_that_prefixes_a_sekv_flag_to_vllm():
    cmd = build_serve_command(["/models/m", "--host", "0.0.0.0", "--host-bytes=1G"])
    assert cmd[-2:] == ["--host", "0.0.0.0"]
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"] == {"host_bytes": "1G"}


def test_serve_rejects_bad_sekv_values_before_starting_anything():
    with pytest.raises(ValueError, match="host_bytes"):
        build_serve_command(["/models/m", "--host-bytes", "2X"])


def test_serve_refuses_a_second_transfer_config(capsys):
    with pytest.raises(ValueError, match="kv-transfer-config"):
        build_serve_command(["/models/m", "--kv-transfer-config", "{}"])
    assert main(["serve", "/models/m", "--kv-transfer-config={}"]) == 2
    assert "kv-transfer-config" in capsys.readouterr().err


def test_bad_value_exits_with_a_message(capsys):
    assert main(["serve", "/models/m", "--policy", "fifo"]) == 2
    assert "'policy'" in capsys.readouterr().err


def _help(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_the_commands(capsys):
    out = _help(capsys, ["--help"])
    assert out.startswith("usage: vllm-sekv ")
    for command in ("serve", "config", "model", "sessions", "calibrate"):
        assert f"\n    {command}" in out


def test_each_command_prints_only_its_own_help(capsys):
    serve = _help(capsys, ["serve", "--help"])
    assert serve.startswith("usage: vllm-sekv serve MODEL")
    assert "--host-bytes VALUE" in serve and "SEKV_HOST_BYTES" in serve
    assert "--all-of-tenant" not in serve and "calibrate" not in serve and "--parts-dir" not in serve

    sessions = _help(capsys, ["sessions", "--help"])
    assert sessions.startswith("usage: vllm-sekv sessions")
    assert all(action in sessions for action in ("list", "delete", "cleanup"))
    assert "--host-bytes" not in sessions and "calibrate" not in sessions and "MODEL" not in sessions

    delete = _help(capsys, ["sessions", "delete", "--help"])
    assert delete.startswith("usage: vllm-sekv sessions delete")
    assert "--all-of-tenant" in delete and "--older-than" not in delete


@pytest.mark.parametrize("argv", [[], ["bogus"], ["config", "extra"], ["sessions"], ["sessions", "list"],
                                  ["model", "prepare", "--bogus"]])
def test_usage_errors_exit_2_with_a_message(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_console_script_lists_config_keys():
    out = subprocess.run([sys.executable, "-m", "vllm_sekv.cli", "config"], capture_output=True,
                         text=True, check=True).stdout
    assert "host_bytes" in out and "SEKV_HOST_BYTES" in out
