"""Markdown report of the sekv-views run (placeholder, replaced below)."""
from __future__ import annotations
import views_eval as V
from pathlib import Path


def write(out: Path, data: dict, base: dict, base_path: str) -> None:
    cells = data["cells"]
    print(V.plot_views(Path(str(out) + ".png"), cells, V.baseline_cells(base, list({c["task"] for c in cells}))) or "plot written")
