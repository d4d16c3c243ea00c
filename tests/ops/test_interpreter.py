"""Triton kernels against their references on CPU, through Triton's interpreter
(TRITON_INTERPRET=1 must be set before Triton compiles, hence a subprocess)."""
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_kernels_match_references_in_interpreter():
    script = pathlib.Path(__file__).with_name("_interpreter_check.py")
    checkout = str(script.parents[2])  # the package of this checkout, as pytest's `pythonpath` gives the tests
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")
