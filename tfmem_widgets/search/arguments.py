"""The checks of a batch search's arguments, each one line that says what was wrong (ArgumentError), and
the words for where its probes run."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from ..errors import ArgumentError


def check_count(name: str, value, least: int, who: str = "max_batch_size") -> int:
    """A whole number of at least `least` (low, high, steps, a probe's batch), or one line."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ArgumentError(f"{who + ': ' if who else ''}{name} must be a whole number of at least {least}, got {value!r}.")
    return int(value)


def check_fraction(name: str, value, top: float, who: str = "max_batch_size") -> float:
    """A number from 0 to under `top` (margin, resolution), or one line."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < top \
            or not math.isfinite(value):
        raise ArgumentError(f"{who + ': ' if who else ''}{name} must be a number from 0 to under {top:g}, got {value!r}.")
    return float(value)


def where_words(setup: Mapping | None) -> str:
    setup = setup or {}
    if setup.get("lab_mb"):
        return f"lab mode {setup['lab_mb']} MB, CPU kernels (a GPU's workspaces differ)"
    if setup.get("limit_mb"):
        limit = setup["limit_mb"]
        size = limit if not isinstance(limit, Mapping) else ", ".join(f"GPU {k}: {v}" for k, v in limit.items())
        return f"as if on a card of {size} MB (a logical device limit)"
    return "the default device, set up by TensorFlow's defaults"
