"""Layers depend downward only (docs/architecture.md): a lower layer never imports an upper one,
workspace/, index/, store/ and ops/ never import vLLM, and the connector's two sides never
import each other or the facade (they share only `vllm_sekv.protocol`)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("vllm_sekv.scheduler_side", "vllm_sekv.worker_side")
ENTRY = ("vllm_sekv.plugin", "vllm_sekv.cli", "vllm_sekv.attention")
FACADE = ("vllm_sekv.connector",)
UPPER_OF_POLICY = (*FACADE, "vllm_sekv.protocol", "vllm_sekv.compat", "vllm_sekv.model_identity", *SIDES, *ENTRY, "vllm")
# layer -> (folder or module path, imports it must not make)
RULES = {
    "vllm_sekv/ops": ("vllm_sekv.store", "vllm_sekv.index", "vllm_sekv.workspace", *UPPER_OF_POLICY),
    "vllm_sekv/store": ("vllm_sekv.index", "vllm_sekv.workspace", *UPPER_OF_POLICY),
    "vllm_sekv/index": ("vllm_sekv.workspace", *UPPER_OF_POLICY),
    "vllm_sekv/workspace": UPPER_OF_POLICY,
    "vllm_sekv/compat": (*FACADE, "vllm_sekv.protocol", *SIDES, *ENTRY),
    "vllm_sekv/protocol": (*FACADE, *SIDES, *ENTRY),
    "vllm_sekv/scheduler_side": (*FACADE, "vllm_sekv.worker_side", *ENTRY),
    "vllm_sekv/worker_side": (*FACADE, "vllm_sekv.scheduler_side", *ENTRY),
    "vllm_sekv/attention": (*FACADE, "vllm_sekv.protocol", *SIDES, "vllm_sekv.plugin", "vllm_sekv.cli"),
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
    where = ROOT / folder
    for path in [where] if where.is_file() else sorted(where.rglob("*.py")):
        for name in imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


@pytest.mark.parametrize("folder", sorted(RULES))
def test_layer_imports_only_downward(folder):
    assert (ROOT / folder).is_dir()
    assert violations(folder, RULES[folder]) == []


def test_the_facade_sits_on_top():
    """The connector facade dispatches to the two sides; nothing below imports it."""
    assert (ROOT / "vllm_sekv/connector.py").is_file()
    assert violations("vllm_sekv/connector.py", ("vllm_sekv.plugin", "vllm_sekv.cli")) == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    bad = tmp_path / "vllm_sekv" / "store"
    bad.mkdir(parents=True)
    (bad / "x.py").write_text("from vllm_sekv.connector import SekvConnector\nimport vllm\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert len(violations("vllm_sekv/store", RULES["vllm_sekv/store"])) == 2


def test_module_names_are_unique_and_short():
    """A file name says what it holds: no two modules share one, and none
    grows past a reader's page count."""
    names: dict[str, Path] = {}
    for path in sorted((ROOT / "vllm_sekv").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        assert path.name not in names, f"{path.relative_to(ROOT)} and {names[path.name].relative_to(ROOT)}"
        names[path.name] = path
        assert len(path.read_text().splitlines()) <= 500, f"{path.relative_to(ROOT)} is over 500 lines"
