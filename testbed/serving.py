"""Start and stop a local OpenAI-compatible vLLM server, with or without sekv,
and read its `/metrics`.

For the HTTP tests and the benchmarks. The server runs as a child
process on 127.0.0.1, its output goes to a log file, and `stop()` ends its
whole process group. Blocking: `start()` returns once `/health` answers, or
raises with the log's tail when the server dies or does not come up in time.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_sekv import CONNECTOR_NAME


def metrics(url: str, prefix: str = "") -> dict[str, float]:
    """Every sample of a server's `/metrics` whose name starts with `prefix`, summed over labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, value in re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})? (\S+)$", text, re.M):
        if name.startswith(prefix):
            out[name] = out.get(name, 0.0) + float(value)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    def __init__(
        self,
        model: str,
        sekv: dict | None = None,
        vllm_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        """`sekv`: the kv_connector_extra_config, or None for plain vLLM."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(self.port), *(vllm_args or [])]
        if sekv is not None:
            transfer = {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both",
                        "kv_connector_extra_config": sekv}
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        self.cmd = cmd
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 600.0) -> "LocalServer":
        log = open(self.log_path, "wb")
        # Run outside the checkout: the server imports the installed packages only.
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
            start_new_session=True, cwd=tempfile.gettempdir(),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"server did not come up in {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
