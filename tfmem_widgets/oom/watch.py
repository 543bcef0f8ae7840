"""Every OOM explained where it happens.

``watch_oom()`` (run by ``%load_ext tfmem_widgets``) makes TensorFlow write its binary MemoryDump at
every OOM: TF_BFC_MEMORY_DUMP is pointed into a folder this package owns, removed at exit
(TensorFlow reads the variable when it writes a dump, so this works after its runtime started). A
TF_BFC_MEMORY_DUMP the user set is theirs: their files land where they asked and are read, never
moved or deleted.

A cell's start notes the dumps that exist and its end explains an OOM it raised from the ones it
wrote (the notebook layer shows the report under the traceback); ``last_oom()`` returns it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading

from ..tf import dump_place
from ..tf.dump_place import DUMP_ENV
from ..tf.messages import is_oom
from . import explain, refusals
from .report import OomReport

_OWNER = "the OOM watcher"
_lock = threading.RLock()
_folder: str | None = None  # the folder this package made (None: not watching, or the user's own)
_prefix: str | None = None  # the prefix this package set
_cell_dumps: set[str] = set()  # the dump files that existed when the cell began
_atexit_registered = False
KEEP_REPORTED = 4  # the dumps of the last reports the package's folder keeps (an error explained again reads its own)


def watch_oom(parent: str | None = None) -> str:
    """Make TensorFlow write its allocator dump at every OOM; returns where. Idempotent. parent: the folder
    the package's own folder is made in (a kernel's record: if the kernel dies, its dumps go with the record
    when the record is cleaned, not left in the temporary folder)."""
    global _folder, _prefix, _atexit_registered
    with _lock:
        user = os.environ.get(DUMP_ENV)
        if user and user != _prefix:
            return user  # the user's own place: used as it is
        if _prefix is None:
            _folder = tempfile.mkdtemp(prefix="tfmem-oom-", dir=parent)
            _prefix = os.path.join(_folder, "dump")
            dump_place.claim(_prefix, _OWNER, keep_reported=KEEP_REPORTED)
            if not _atexit_registered:
                atexit.register(unwatch_oom)
                _atexit_registered = True
        os.environ[DUMP_ENV] = _prefix
        return _prefix


def unwatch_oom() -> None:
    """Undo watch_oom: the variable as it was, the package's folder removed (never a user's)."""
    global _folder, _prefix
    refusals.stop()
    with _lock:
        if _prefix is not None and os.environ.get(DUMP_ENV) == _prefix:
            os.environ.pop(DUMP_ENV, None)
        if _folder is not None:
            shutil.rmtree(_folder, ignore_errors=True)
        dump_place.release(_prefix)
        _folder = _prefix = None


def cell_started() -> None:
    """Before a cell: note the dumps that exist, so an OOM reads only the ones its cell wrote; and
    watch for refusals while the cell runs."""
    global _cell_dumps
    prefix = dump_place.current_prefix()
    _cell_dumps = set(dump_place.dump_files(prefix))
    refusals.start(prefix, _cell_dumps)


def cell_finished(error: BaseException | None) -> OomReport | None:
    """After a cell: the report of an OOM it raised (None for none, or one already explained or
    shown by a trace), or of another error raised after its allocator refused requests (an XLA
    program's autotuner ends in an InternalError); it becomes last_oom(). A fit's OOM is told in
    terms of its step (what it needs, the batch that fits)."""
    from ..tracing.profiler import TRACE_LOCK

    refused, fit, need = refusals.stop()  # the cell's watch ends with it (its first refusal said now)
    if error is None or getattr(error, "_tfmem_explained", False) or TRACE_LOCK.locked():
        return None  # a %%tfmem trace shows its own OOM map
    if is_oom(error):
        report = explain.with_need(explain.explain_exception(error, _cell_dumps), fit, need)
    elif refused and isinstance(error, Exception):
        report = explain.explain_refused(error, _cell_dumps, refused, fit, need)
    else:
        return None
    return explain.explained(error, report)
