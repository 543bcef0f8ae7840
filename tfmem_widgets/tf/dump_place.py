"""Where TensorFlow writes its allocator dumps, and who owns that place.

With ``TF_BFC_MEMORY_DUMP=<prefix>`` in the environment at an OOM (TensorFlow reads it then, so it
works after its runtime started), the BFC allocator writes its state as a binary MemoryDump to
``<prefix>_<allocator>.<microseconds since the epoch>``, one file per refusal. The OOM watcher and a
running trace each point the variable into a folder of their own and say so here; any other value
is the user's, whose files are read where they land and never moved or deleted. A fresh process
does not inherit a place this process owns.
"""

from __future__ import annotations

import glob
import os
import threading

DUMP_ENV = "TF_BFC_MEMORY_DUMP"

_lock = threading.Lock()
_owners: dict[str, str] = {}  # prefix -> who set it ('the OOM watcher', 'a trace')
_kept: dict[str, tuple[int, list[str]]] = {}  # prefix -> (how many reports' dumps it keeps, those dumps)


def claim(prefix: str, owner: str, keep_reported: int | None = None) -> None:
    """`owner` of this package points TF_BFC_MEMORY_DUMP at `prefix`. keep_reported: the place keeps only
    the dumps the last that many reports read (``reported``), deleting the others."""
    with _lock:
        _owners[prefix] = owner
        if keep_reported is not None:
            _kept[prefix] = (keep_reported, [])


def release(prefix: str | None) -> None:
    with _lock:
        _owners.pop(prefix, None)
        _kept.pop(prefix, None)


def reported(prefix: str | None, path: str) -> None:
    """A report read the dump at `path`: a place claimed with keep_reported drops the dumps no recent
    report read (an error explained again reads its own)."""
    with _lock:
        if prefix not in _kept:
            return
        most, recent = _kept[prefix]
        if path in recent:
            recent.remove(path)
        recent.append(path)
        del recent[:-most]
        keep = set(recent)
    for other in dump_files(prefix):
        if other not in keep:
            try:
                os.remove(other)
            except OSError:
                pass


def owned(prefix: str | None) -> bool:
    """Whether a prefix is one this package set (not the user's own)."""
    with _lock:
        return prefix is not None and prefix in _owners


FRESH_CALL = "a fresh process's call"  # its folder, and the dumps in it, are removed when the call ends


def removed_with_its_call(path: str | None) -> bool:
    """Whether a dump lies in a fresh process's folder, removed when that call ends."""
    with _lock:
        return bool(path) and any(owner == FRESH_CALL and os.path.dirname(path) == os.path.dirname(prefix)
                                  for prefix, owner in _owners.items())


def current_prefix() -> str | None:
    """Where dumps land now: a place of this package's or the user's own; None when unset."""
    return os.environ.get(DUMP_ENV) or None


def user_prefix() -> str | None:
    """The user's own TF_BFC_MEMORY_DUMP, if one is set."""
    prefix = current_prefix()
    return None if owned(prefix) else prefix


def dump_time_ns(path: str | None) -> int | None:
    """When TensorFlow wrote a dump, from its name (microseconds since the epoch), in nanoseconds."""
    suffix = (path or "").rsplit(".", 1)[-1]
    return int(suffix) * 1000 if suffix.isdigit() and len(suffix) >= 15 else None


def dump_files(prefix: str | None, allocator: str | None = None) -> list[str]:
    """The dumps at a prefix (of one allocator, if named), oldest first."""
    if not prefix:
        return []
    pattern = glob.escape(prefix) + (f"_{glob.escape(allocator)}.*" if allocator else "_*")
    # The suffix is a time in microseconds: by its length, then its digits, the last is the newest.
    return sorted(glob.glob(pattern), key=lambda p: (len(p.rsplit(".", 1)[-1]), p.rsplit(".", 1)[-1], p))


def dump_of_allocator(path: str, prefix: str, allocator: str) -> bool:
    """Whether a dump file at `prefix` is of `allocator`."""
    return os.path.basename(path).startswith(f"{os.path.basename(prefix)}_{allocator}.")


def unwritable(prefix: str) -> str | None:
    """Why TensorFlow cannot write its dumps at `prefix`, in words (None: it can). Tried the way
    TensorFlow writes them: a file next to where its dumps would go, removed at once."""
    folder = os.path.dirname(prefix) or "."
    if not os.path.isdir(folder):
        return f"TF_BFC_MEMORY_DUMP={prefix} points into {folder}, which is not a folder that exists"
    trial = f"{prefix}_tfmem-write-check.{os.getpid()}"
    try:
        with open(trial, "wb"):
            pass
    except OSError as exc:
        return f"TF_BFC_MEMORY_DUMP={prefix}: no file can be written there ({exc.strerror or exc})"
    try:
        os.remove(trial)
    except OSError:
        pass
    return None
