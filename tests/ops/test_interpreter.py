"""Triton kernels against their references on CPU, through Triton's interpreter
(TRITON_INTERPRET=1 must be set before Triton compiles, hence a subprocess)."""
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_kernels_match_references_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = pathlib.Path(__file__).with_name("_interpreter_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")
