"""Retrieval heads: the query heads whose attention the re-rank combines.

The token-level re-rank (`worker_side.rerank`) gives each candidate block its
attention mass per (layer, query head) and combines the heads, by default
with a max: a block counts as much as its best head says. Most heads do not
look for what a question asks: they attend by position, by syntax, or to a
sink (one ordinary token holding most of a head's mass whatever the query),
and with a max over all of a model's heads their favourite blocks fill the
top of the ranking ahead of the evidence. A few heads do find a fact from a
question about it (the retrieval heads of the literature: sparse, the same
heads across tasks for one model). `vllm-sekv calibrate-heads MODEL` measures
each head's share of attention on an asked fact offline
(`vllm_sekv.calibrate_heads`) and writes the best heads to a small JSON file;
with config `rerank_heads_path` the re-rank combines over those heads only.

File format (JSON, written atomically): ``{"format": FORMAT, "version":
VERSION, "geometry": RouterGeometry's fields (the model's fingerprint),
"heads": [[layer, query head], ...] best first, "share": per layer, per
query head, the mean share of the questions' attention on the asked fact,
"calibration": how it was measured}``. Reading raises `ValueError` naming
the config key on any defect; loading for a served model also checks the
fingerprint (`RouterGeometry.mismatches`).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from vllm_sekv.index.router import RouterGeometry

FORMAT = "sekv-retrieval-heads"
VERSION = 1
KEY = "rerank_heads_path"


@dataclass(frozen=True)
class RetrievalHeads:
    """A model's heads, best first, with the measurement they came from."""

    geometry: RouterGeometry
    heads: tuple[tuple[int, int], ...]
    share: tuple[tuple[float, ...], ...] = ()
    calibration: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        g = self.geometry
        if not self.heads:
            raise ValueError("retrieval heads: at least one head")
        for layer, head in self.heads:
            if not (0 <= layer < g.num_layers and 0 <= head < g.num_q_heads):
                raise ValueError(f"retrieval heads: head ({layer}, {head}) outside the model's "
                                 f"{g.num_layers} layers of {g.num_q_heads} query heads")
        if len(set(self.heads)) != len(self.heads):
            raise ValueError("retrieval heads: a head is listed twice")

    def flat(self) -> list[int]:
        """The heads as indices into a ``[layers * query heads]`` flattening."""
        return [layer * self.geometry.num_q_heads + head for layer, head in self.heads]

    def write(self, path: str) -> None:
        doc = {"format": FORMAT, "version": VERSION, "geometry": asdict(self.geometry),
               "heads": [list(h) for h in self.heads], "share": [list(r) for r in self.share],
               "calibration": self.calibration}
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, path)


def read_heads_file(path: str) -> RetrievalHeads:
    """The file at `path`; ValueError naming the config key if it is missing or malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"sekv config '{KEY}': {path!r} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(f"sekv config '{KEY}': {path!r} is not a retrieval-heads file of version {VERSION} "
                         "(write one with `vllm-sekv calibrate-heads MODEL --out PATH`)")
    geo, heads = doc.get("geometry"), doc.get("heads")
    names = {f.name for f in fields(RouterGeometry)}
    if not isinstance(geo, dict) or set(geo) != names:
        raise ValueError(f"sekv config '{KEY}': {path!r}: 'geometry' must have the fields {sorted(names)}")
    if not isinstance(heads, list) or not all(
            isinstance(h, list) and len(h) == 2 and all(type(x) is int for x in h) for h in heads):
        raise ValueError(f"sekv config '{KEY}': {path!r}: 'heads' must be a list of [layer, head] integer pairs")
    try:
        return RetrievalHeads(RouterGeometry(**geo), tuple((a, b) for a, b in heads),
                              tuple(tuple(r) for r in doc.get("share", [])), doc.get("calibration", {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"sekv config '{KEY}': {path!r}: {e}") from None


def load_heads(config: Any, geometry: RouterGeometry) -> list[int] | None:
    """The heads of ``config.rerank_heads_path`` for the served model whose
    fingerprint is `geometry`, flattened (`RetrievalHeads.flat`); None with no
    file. ValueError naming the config key where the file was measured on
    another model."""
    path = getattr(config, KEY)
    if not path:
        return None
    found = read_heads_file(path)
    diff = found.geometry.mismatches(geometry)
    if diff:
        raise ValueError(f"sekv config '{KEY}': {path!r} was calibrated on another model ({'; '.join(diff)})")
    return found.flat()
