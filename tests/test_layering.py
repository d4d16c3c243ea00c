"""Layers depend downward only (docs/architecture.md): a lower layer never imports an upper one,
and workspace/, store/, ops and the kernels never import vLLM."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# layer -> (folder or module path, imports it must not make)
UPPER_OF_STORE = ("vllm_sekv.workspace", "vllm_sekv.connector", "vllm_sekv.attention",
                  "vllm_sekv.plugin", "vllm_sekv.cli", "vllm_sekv.compat", "vllm")
RULES = {
    "triton_kernels": ("vllm_sekv.store", *UPPER_OF_STORE),
    "vllm_sekv/ops": ("vllm_sekv.store", *UPPER_OF_STORE),
    "vllm_sekv/store": UPPER_OF_STORE,
    "vllm_sekv/workspace": ("vllm_sekv.connector", "vllm_sekv.attention", "vllm_sekv.plugin",
                            "vllm_sekv.cli", "vllm_sekv.compat", "vllm"),
    "vllm_sekv/connector": ("vllm_sekv.plugin", "vllm_sekv.cli"),
    "vllm_sekv/attention": ("vllm_sekv.connector", "vllm_sekv.plugin", "vllm_sekv.cli"),
}


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


@pytest.mark.parametrize("folder", sorted(RULES))
def test_layer_imports_only_downward(folder):
    assert (ROOT / folder).is_dir()
    assert violations(folder, RULES[folder]) == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    bad = tmp_path / "vllm_sekv" / "store"
    bad.mkdir(parents=True)
    (bad / "x.py").write_text("from vllm_sekv.connector import SekvConnector\nimport vllm\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert len(violations("vllm_sekv/store", RULES["vllm_sekv/store"])) == 2
