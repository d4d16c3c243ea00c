"""Runs one of the runner scripts beside this file (`session_runner.py`,
`surprisal_runner.py`) in its own process: an offline vLLM engine per
process, so engines never share a process's state."""
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_runner(runner: str, spec: dict, tmp_path: Path, name: str, timeout_s: int = 900) -> dict:
    """Write `spec` to TMP/NAME.json, run `runner` on it, return its JSON output."""
    spec_path, out_path = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(HERE / runner), str(spec_path), str(out_path)],
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out_path.read_text())
