"""Configuration values from their sources: sizes with binary units,
integers, numbers and choices, each error naming the key it was given for.

Sources hand values as JSON values or strings (`kv_connector_extra_config`,
`vllm-sekv serve` flags, `SEKV_*` environment variables); a value of the
wrong kind raises ValueError with the key and what it accepts.
"""
from __future__ import annotations

import re
from typing import Any

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size_bytes(key: str, value: Any) -> int:
    """`8G` -> 8 * 2**30. Raises ValueError naming `key` on anything else."""
    if isinstance(value, bool):
        raise ValueError(f"sekv config '{key}': expected a size like 8G or 512M, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ValueError(
                f"sekv config '{key}': expected a size like 8G, 512M or a byte count, got {value!r}"
            )
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 0:
        raise ValueError(f"sekv config '{key}': must not be negative, got {value!r}")
    return n


def parse_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"sekv config '{key}': expected an integer, got {value!r}")
    try:
        return int(str(value), 10) if not isinstance(value, int) else value
    except ValueError:
        raise ValueError(f"sekv config '{key}': expected an integer, got {value!r}") from None


def parse_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"sekv config '{key}': expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"sekv config '{key}': expected a number, got {value!r}") from None


def parse_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if str(value) not in choices:
        raise ValueError(f"sekv config '{key}': expected one of {', '.join(choices)}, got {value!r}")
    return str(value)
