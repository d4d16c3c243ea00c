"""The package installs what it needs: the kernels as part of `vllm_sekv.ops`,
nothing at the top level beside `vllm_sekv`: not the checkout's `testbed`
(helpers of the tests and benchmarks), and no `triton_kernels` (that would
shadow OpenAI's package of that name, which vLLM imports)."""
import subprocess
import sys
import tempfile
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parents[1])


def _find(module: str) -> str:
    code = (
        "import importlib.util as u; s = u.find_spec(%r); "
        "print(s.origin if s and s.origin else (list(s.submodule_search_locations) if s else None))"
    ) % module
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tempfile.gettempdir(), check=True)
    return out.stdout.strip()


def test_kernels_are_importable_under_the_plugin_namespace():
    assert "vllm_sekv" in _find("vllm_sekv.ops.rope.scatter")


def test_no_top_level_triton_kernels_from_this_project():
    found = _find("triton_kernels")
    assert found == "None" or (CHECKOUT not in found and "vllm_sekv" not in found), found


def test_the_test_helpers_are_not_installed():
    assert _find("testbed") == "None"


def test_plugin_entry_point_is_registered():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("sekv") == "vllm_sekv.plugin:register"
