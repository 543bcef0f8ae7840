"""Every OOM explained where it happens.

``watch_oom()`` (run by ``%load_ext tfmem_widgets``) makes TensorFlow write its binary
MemoryDump at every OOM: TF_BFC_MEMORY_DUMP is pointed into a folder this package owns,
removed at exit (TensorFlow reads the variable when it writes a dump, so this works after
its runtime started). A TF_BFC_MEMORY_DUMP the user set is theirs: their files land where
they asked and are read, never moved or deleted.

After a cell that raised an OOM, the cell's output gets the explanation under the
traceback; ``last_oom()`` returns it, ``explain_oom()`` explains an error, a dump file or a
pasted log anywhere (a script, a job's log).
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import tempfile
import threading
from pathlib import Path

from ..errors import SetupError
from .report import (OomReport, explain_path, explain_text, failed_request, is_oom,
                         report_from_dump, step_of)

DUMP_ENV = "TF_BFC_MEMORY_DUMP"

_lock = threading.RLock()
_folder: str | None = None  # the folder this package made (None: not watching, or the user's own)
_prefix: str | None = None  # the prefix this package set
_cell_dumps: set[str] = set()  # the dump files that existed when the cell began
_last: OomReport | None = None
_atexit_registered = False


def watch_oom() -> str:
    """Make TensorFlow write its allocator dump at every OOM; returns where. Idempotent."""
    global _folder, _prefix, _atexit_registered
    with _lock:
        user = os.environ.get(DUMP_ENV)
        if user and user != _prefix:
            return user  # the user's own place: used as it is
        if _prefix is None:
            _folder = tempfile.mkdtemp(prefix="tfmem-oom-")
            _prefix = os.path.join(_folder, "dump")
            if not _atexit_registered:
                atexit.register(unwatch_oom)
                _atexit_registered = True
        os.environ[DUMP_ENV] = _prefix
        return _prefix


def unwatch_oom() -> None:
    """Undo watch_oom: the variable as it was, the package's folder removed (never a user's)."""
    global _folder, _prefix
    _stop_refusals()
    with _lock:
        if _prefix is not None and os.environ.get(DUMP_ENV) == _prefix:
            os.environ.pop(DUMP_ENV, None)
        if _folder is not None:
            shutil.rmtree(_folder, ignore_errors=True)
        _folder = _prefix = None


def owned_prefix() -> str | None:
    """TF_BFC_MEMORY_DUMP as this package set it (a fresh process must not write there)."""
    return _prefix


def watched_prefix() -> str | None:
    """Where dumps land now: the package's prefix or the user's own; None when unset."""
    return os.environ.get(DUMP_ENV) or None


def _dump_files(prefix: str | None, allocator: str | None = None) -> list[str]:
    if not prefix:
        return []
    pattern = glob.escape(prefix) + (f"_{glob.escape(allocator)}.*" if allocator else "_*")
    # TensorFlow names each file <prefix>_<allocator>.<microseconds>: the last is the newest.
    return sorted(glob.glob(pattern), key=lambda p: (len(p.rsplit(".", 1)[-1]), p.rsplit(".", 1)[-1], p))


def cell_started() -> None:
    """pre_run_cell: note the dumps that exist, so an OOM reads only the ones its cell wrote; and
    watch for refusals while the cell runs."""
    global _cell_dumps, _refusals
    _cell_dumps = set(_dump_files(watched_prefix()))
    _stop_refusals()
    if watched_prefix() and say_refusals:
        _refusals = _RefusalWatch(watched_prefix(), _cell_dumps)
        _refusals.start()


# -- refusals while a cell runs ---------------------------------------------------------------
#
# TensorFlow's allocator waits 10 s after refusing a request before it gives up, and writes a
# dump each time. Measured on an H200: an XLA fit under a 1024 MB limit had its GEMM autotuner
# (compiling, before the first step) refused scratch buffers of 256, 160 and then 64 MiB over
# and over, 10 s each, for minutes, with nothing raised. A cell that is refused is told so as
# it happens, not minutes later.

REFUSAL_POLL_S = 1.0
say_refusals = True  # off in a fresh process: its stderr is shown only when it ends, so a live notice says nothing
HINT_AFTER_S = 30.0  # a plain OOM raises 10 s after its refusal; refused for longer is something else, said every 30 s
AUTOTUNE_HINT = ("this Keras fit's step is an XLA program (jit_compile, Keras' default on a GPU): its compiler's "
                 "GEMM autotuner is trying kernels whose scratch memory does not fit, 10 s a refusal, for minutes; "
                 "interrupt the cell, then set XLA_FLAGS=--xla_gpu_autotune_level=0 before TensorFlow starts "
                 "(measured on an H200: the same fit then trained), lower the batch, or compile with "
                 "jit_compile=False")
_refusals = None


class _RefusalWatch(threading.Thread):
    """Polls the dump place while a cell runs; says each new refusal once, with its figures."""

    def __init__(self, prefix: str, existing: set[str]):
        super().__init__(name="tfmem-refusals", daemon=True)
        self.prefix, self.seen = prefix, set(existing)
        self.stop_event = threading.Event()
        self.refusals = 0  # dumps TensorFlow wrote: one when it refuses, one when its 10 s retry fails
        self.times: list[float] = []
        self.said_after = 0  # the "still refused" lines said so far, one per HINT_AFTER_S
        self.first: str | None = None  # the first refusal's figures
        self.said_first = False
        self.main_thread = threading.get_ident()  # the cell's thread

    def run(self) -> None:
        while not self.stop_event.wait(REFUSAL_POLL_S):
            self.poll()

    def poll(self, final: bool = False) -> None:
        """Note new refusals; during an XLA fit say a wait that goes on; at the cell's end (final)
        say the first refusal if nothing was said."""
        import sys
        import time

        new = sorted(set(_dump_files(self.prefix)) - self.seen)
        if not new and not (final and self.first is not None and not self.said_first):
            return
        self.seen.update(new)
        self.refusals += len(new)
        now = time.time()
        self.times.append(now)
        waited = now - self.times[0]
        if self.first is None:
            self.first = _refusal_figures(new[-1])
        if final:
            return  # a refusal the cell got over (or raised on) is the report's, or nothing to say
        if waited >= HINT_AFTER_S * (self.said_after + 1) and _xla_fit_running(self.main_thread):
            # A plain OOM raises 10 s after its refusal; an XLA fit's compiler is refused for minutes:
            # that wait is said while it lasts.
            self.said_after += 1
            line = (f"tfmem: still refused ({self.refusals} dumps in {waited:.0f} s, nothing raised yet; "
                    f"first: {self.first})")
            if self.said_after == 1:
                line += f"; {AUTOTUNE_HINT}"
        else:
            return
        self.said_first = True
        print(line, file=sys.stderr, flush=True)

    def stop(self) -> None:
        """Stop polling; a refusal not yet said is said now (a request beyond the limit can fail
        and be caught within the poll's second: the cell's output is the same either way)."""
        self.stop_event.set()
        if self is not threading.current_thread():
            self.join(timeout=5)
        self.poll(final=True)


def _xla_fit_running(thread_id: int) -> bool:
    """Whether the cell's thread is inside a Keras fit (or evaluate, predict) of a model whose step
    is an XLA program: read from its Python frames, never from TensorFlow."""
    import sys

    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name in ("fit", "evaluate", "predict") else None
        if owner is not None and getattr(owner, "jit_compile", False) is True:
            return True
        frame = frame.f_back
    return False


def _refusal_figures(path: str) -> str:
    from ..tracing.dumps import load_memory_dump
    from ..errors import TraceDataError
    from ..units import format_bytes

    try:
        dump = load_memory_dump(path)
    except (TraceDataError, OSError):
        return os.path.basename(path)
    return (f"{dump.allocator}: {format_bytes(dump.in_use_bytes)} in use in a {format_bytes(dump.pool_bytes)} pool, "
            f"largest free chunk {format_bytes(dump.largest_free_bytes)}")


def _stop_refusals() -> int:
    global _refusals
    watch, _refusals = _refusals, None
    if watch is None:
        return 0
    watch.stop()
    return watch.refusals


def _tidy_own_folder(keep: str | None) -> None:
    """The package's folder keeps only the dump the last report points to."""
    if _folder is None:
        return
    for path in _dump_files(_prefix):
        if path != keep:
            try:
                os.remove(path)
            except OSError:
                pass


def explain_exception(exc: BaseException, new_since: set[str] | None = None,
                      namespace: dict | None = None) -> OomReport:
    """The report for an OOM raised in this process: the newest dump of the allocator it names
    (among files not in new_since), read with this process's limits and Keras variables."""
    from ..tracing.dumps import load_memory_dump
    from ..errors import TraceDataError

    text = str(exc)
    allocator, request, line, xla = failed_request(text)
    step, node = step_of(text)
    prefix = watched_prefix()
    candidates = [p for p in _dump_files(prefix, allocator) if new_since is None or p not in new_since]
    notes = []
    if xla and allocator is None:
        notes.append("XLA's message names no allocator: the newest dump written by this cell is used")
    if not candidates:
        why = ("TF_BFC_MEMORY_DUMP was not set when it failed: %load_ext tfmem_widgets (or "
               "tfmem_widgets.watch_oom()) before the run makes TensorFlow write one"
               if not prefix else "TensorFlow wrote no allocator dump for it (an allocator other than BFC, "
               "or the failure was not the allocator's)")
        return OomReport(allocator or "unknown", line, request, None, xla=xla, notes=(why, *notes), step=step,
                         node=node)
    path = candidates[-1]
    try:
        dump = load_memory_dump(path)
    except TraceDataError as error:
        return OomReport(allocator or "unknown", line, request, None, xla=xla,
                         notes=(f"TensorFlow's dump could not be read: {error}", *notes), step=step, node=node)
    if prefix == _prefix:
        _tidy_own_folder(keep=path)
    return report_from_dump(dump, line, request, xla=xla, dump_path=path, live=True, namespace=namespace,
                            notes=notes, text=text)


def cell_finished(result=None) -> OomReport | None:
    """post_run_cell: an OOM the cell raised is explained under its traceback."""
    global _last
    from ..tracing.profiler import TRACE_LOCK

    _stop_refusals()  # the cell's watch ends with it (its first refusal said now)
    exc = getattr(result, "error_in_exec", None)
    if not is_oom(exc) or getattr(exc, "_tfmem_explained", False) or TRACE_LOCK.locked():
        return None  # a %%tfmem trace shows its own OOM map
    report = explain_exception(exc, _cell_dumps)
    with _lock:
        _last = report
    try:
        exc._tfmem_explained = True
    except AttributeError:
        pass
    from IPython.display import display

    display(report)
    return report


def remember(report: OomReport) -> None:
    global _last
    with _lock:
        _last = report


def last_oom() -> OomReport | None:
    """The report of the most recent OOM explained in this process (None: none yet)."""
    return _last


def explain_oom(source) -> OomReport:
    """Explain an OOM: a ResourceExhaustedError caught in a script, the path of TensorFlow's
    binary dump or of a log file, or a log's text pasted from a job."""
    if isinstance(source, BaseException):
        if not is_oom(source):
            raise SetupError(f"explain_oom: {type(source).__name__} is not an out-of-memory error; pass a "
                             "ResourceExhaustedError, a dump file's path or a log's text.")
        report = explain_exception(source)
        remember(report)
        return report
    if isinstance(source, bytes):
        source = source.decode("utf-8", errors="replace")
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if isinstance(source, str) and ("\n" in text or "OOM when allocating" in text or "Out of memory" in text
                                        or "Next region of size" in text):
            return explain_text(text)
        if not text.strip():
            raise SetupError("explain_oom: got an empty text; pass an error, a dump file's path or a log's text.")
        if not Path(text).exists():
            raise SetupError(f"explain_oom: no file {text!r}, and it is not a log's text; pass an error, a dump "
                             "file's path or a log's text.")
        return explain_path(text)
    raise SetupError(f"explain_oom: got {type(source).__name__}; pass an error, a dump file's path or a log's text.")
