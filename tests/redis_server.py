"""A real Redis server for tests: `redis-server` on a free loopback port, in
a temporary folder, no persistence. Started and stopped by the tests."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, folder: Path, maxmemory: str | None = None) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed: scripts/setup.sh installs it")
        self.folder, self.port, self.maxmemory = Path(folder), _free_port(), maxmemory
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        self.folder.mkdir(parents=True, exist_ok=True)
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
               "--save", "", "--appendonly", "no", "--enable-debug-command", "yes"]
        if self.maxmemory:
            cmd += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            if self.cli("PING") == "PONG":
                return self
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def cli(self, *args: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True)
        return out.stdout.strip()

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        self.kill()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
