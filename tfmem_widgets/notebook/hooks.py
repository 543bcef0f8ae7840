"""What widgets ask of the shell's cells: a refresh after each cell (frontends that do not show updates
made while a cell runs still get the figures) and a stop when the extension is unloaded. The
extension runs them; widgets register here, so neither imports the other."""

from __future__ import annotations

from collections.abc import Callable

_after_cell: list[Callable[[], None]] = []
_on_unload: list[Callable[[], object]] = []


def on_after_cell(callback: Callable[[], None]) -> None:
    """Run `callback` after each cell (once registered, for the life of the process)."""
    if callback not in _after_cell:
        _after_cell.append(callback)


def on_unload(callback: Callable[[], object]) -> None:
    """Run `callback` when the extension is unloaded (gauges stop)."""
    if callback not in _on_unload:
        _on_unload.append(callback)


def after_cell(result=None) -> None:
    """post_run_cell: every registered refresh, each kept from the others' faults."""
    from ..readings.sampler import sampler

    for callback in list(_after_cell):
        try:
            callback()
        except Exception:
            sampler.errors += 1


def run_unload_hooks() -> None:
    for callback in list(_on_unload):
        callback()
