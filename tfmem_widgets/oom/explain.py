"""Explaining an OOM: an error raised in this process (the newest dump of the allocator it names),
a dump file, or a log's text; the last report of the process.

The report of an error of this process is read with this process's limits and Keras variables;
a dump or log from elsewhere with what it states.
"""

from __future__ import annotations

import numbers
import os
import threading
from dataclasses import replace
from pathlib import Path

from ..errors import ArgumentError, TraceDataError
from ..plans.need import StepNeed
from ..readings.fit_context import FitContext
from ..readings.layers import OPTIMIZER_STATE, PARAMETERS
from ..tf import dump_place
from ..tf.allocator import has_text_dump, looks_like_oom_log
from ..tf.limits import allocator_limit
from ..tf.messages import failed_request, is_oom, step_of
from ..tracing.allocator_map import AllocatorMap
from .report import OomReport

_lock = threading.RLock()
_last: OomReport | None = None


def report_from_dump(dump: AllocatorMap, message: str, request: int | None, *, xla: bool = False,
                     dump_path: str | None = None, live: bool = False, namespace: dict | None = None,
                     notes=(), text: str = "", layers: bool = True) -> OomReport:
    """An OomReport for a dump. live: the dump is of this process's allocator, so its limit is
    read from this process and (with `layers`) the recorder's ops and the Keras variables of the
    namespace name its chunks. text: the error's whole text (the compiled step and node it names)."""
    limit, source, capacity, capacity_source = (None, "unknown", None, "")
    if dump.limit_bytes is not None:
        limit, source = dump.limit_bytes, "the allocator's log"
    if live:
        found = allocator_limit(dump.allocator)
        if found.limit_bytes is not None or limit is None:
            limit, source = found.limit_bytes, found.source
        capacity, capacity_source = found.capacity_bytes, found.capacity_source
    anatomy = None
    if live and layers:
        from ..readings.layers import anatomy as make_anatomy
        from ..tracing.recorder import name_chunks

        dump, recorded = name_chunks(dump, dump_place.dump_time_ns(dump_path))
        if recorded:
            notes = (*notes, "ops from the recorder (%tfmem record): chunks made before it started carry none")

        try:
            anatomy = make_anatomy(dump, namespace=namespace, live=True)
        except Exception as exc:  # the namespace's objects are the user's: never fail the report
            notes = (*notes, f"the layers could not be read ({type(exc).__name__})")
    amap = dump
    if request is not None and dump.failed_request_bytes is None:
        from dataclasses import replace

        amap = replace(dump, failed_request_bytes=request)
    step, node = step_of(text)
    return OomReport(dump.allocator, message, request, amap, limit, source, capacity, capacity_source,
                     dump_path, xla, anatomy, tuple(notes), step, node)


def explain_trace(trace, live: bool = False) -> OomReport | None:
    """The OOM a traced block ended in, from the trace's map at the failure (each chunk named by its op);
    None without one. live: the block ran in this process, so its limits and Keras variables are read here."""
    oom = trace.oom
    if oom is None:
        return None
    if not trace.knows(oom.allocator):
        return OomReport(oom.allocator, oom.message, oom.request_bytes, None,
                         notes=("the trace holds neither events nor a dump of this allocator",))
    return report_from_dump(trace.map(allocator=oom.allocator), oom.message, oom.request_bytes, live=live,
                            text=trace.log)


def explain_text(text: str, each: bool = False):
    """A log pasted from a job: each OOM in it (TensorFlow's refusal, its text dump and its OOM line)
    explained against its own dump. The last OOM's report, or (each) all of them in order."""
    from .logs import episodes

    parts = episodes(text)
    reports = [_explain_episode(part) for part in parts]
    if len(reports) > 1:
        said = (f"the log holds {len(reports)} OOMs, each explained against its own dump: this is the last; "
                "explain_oom(log, each=True) gives them all")
        reports = [replace(r, notes=(*r.notes, said if k == len(reports) - 1 else
                                     f"OOM {k + 1} of the {len(reports)} in the log"))
                   for k, r in enumerate(reports)]
    return reports if each else reports[-1]


def _explain_episode(text: str) -> OomReport:
    from ..tracing.dumps import parse_bfc_dump

    allocator, request, line, xla = failed_request(text)
    if not has_text_dump(text):
        return OomReport(allocator or "unknown", line, request, None, xla=xla,
                         notes=("the text holds no allocator dump (the 'Next region of size' lines TensorFlow "
                                "logs at an OOM): paste the whole log",))
    dump = parse_bfc_dump(text)
    return report_from_dump(dump, line, request if request is not None else dump.failed_request_bytes, xla=xla,
                            text=text)


def explain_path(path: str | os.PathLike, each: bool = False):
    """A file: TensorFlow's binary MemoryDump, or a text log (each OOM in it, as explain_text)."""
    from ..tracing.dumps import load_memory_dump
    from .logs import read_log

    data = read_log(path)
    if isinstance(data, str):
        text = data
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    if text is not None and looks_like_oom_log(text):
        return explain_text(text, each)
    if text is not None and not text.strip():
        raise ArgumentError(f"explain_oom: {os.fspath(path)} is empty; pass an error, a dump file's path or a log.")
    dump = load_memory_dump(Path(path)) if len(data) == os.stat(path).st_size else _dump_of_bytes(data, path)
    report = report_from_dump(dump, f"TensorFlow's dump of {dump.allocator}", dump.failed_request_bytes,
                              dump_path=str(path),
                              notes=("a dump alone does not say the failed request: pass the error or the log "
                                     "for the verdict",))
    return [report] if each else report


def _dump_of_bytes(data: bytes, path) -> AllocatorMap:
    """A binary dump read from a file that is not a regular one (its bytes already read)."""
    import tempfile

    from ..tracing.dumps import load_memory_dump

    with tempfile.TemporaryDirectory(prefix="tfmem-dump-") as folder:
        copy = Path(folder) / "dump"
        copy.write_bytes(data)
        try:
            return load_memory_dump(copy)
        except TraceDataError as exc:
            raise TraceDataError(str(exc).replace(str(copy), os.fspath(path))) from None


def xla_request_need(fit: FitContext, report: OomReport) -> StepNeed | None:
    """An XLA program's OOM in a fit: its request is the program's one buffer of temporaries, so in
    use + the request is the least the step needs at the fit's batch; nothing is planned in this
    process after it."""
    if report.map is None or report.request_bytes is None:
        return None
    resident = None
    if report.anatomy is not None:
        resident = sum(report.anatomy.phases(k).get(p, 0) for k in report.anatomy for p in (PARAMETERS, OPTIMIZER_STATE))
    return StepNeed(fit.batch_size, report.map.in_use_bytes + report.request_bytes, resident, report.limit_bytes,
                    source="xla request")


def with_need(report: OomReport, fit: FitContext | None, early: StepNeed | None = None) -> OomReport:
    """The report of a fit's OOM with what the step needs: planned while the fit waited (`early`), or
    planned here, or from XLA's request."""
    if fit is None:
        return report
    if report.map is None:  # no dump to read (TF_BFC_MEMORY_DUMP unset): the step is planned all the same
        from ..plans.need import step_need

        try:
            report.need = step_need(fit, None) if fit.phase == "train" else StepNeed.of_validation(
                fit.batch_size, sum(fit.data_sizes))
        except Exception as exc:  # the user's model: never fail the report
            report.need = StepNeed(fit.batch_size, note=f"the step could not be planned ({type(exc).__name__})")
        return report
    if fit.phase == "validation":
        report.need = StepNeed.of_validation(fit.batch_size, sum(fit.data_sizes))
    elif early is not None and early.peak_bytes is not None:
        report.need = early
    elif report.xla:
        report.need = xla_request_need(fit, report)
    else:
        from ..plans.need import step_need

        try:
            report.need = step_need(fit, report.limit_bytes)
        except Exception as exc:  # the user's model: never fail the report
            report.need = StepNeed(fit.batch_size, note=f"the step could not be planned ({type(exc).__name__})")
    return report


def explain_exception(exc: BaseException, new_since: set[str] | None = None,
                      namespace: dict | None = None, layers: bool = True) -> OomReport:
    """The report for an OOM raised in this process: the newest dump of the allocator it names
    (among files not in new_since), read with this process's limits and (with `layers`) its
    recorder's ops and Keras variables. It is not kept as last_oom() (remember() keeps it)."""
    from ..errors import TraceDataError

    text = str(exc)
    allocator, request, line, xla = failed_request(text)
    step, node = step_of(text)
    prefix = dump_place.current_prefix()
    candidates = [p for p in dump_place.dump_files(prefix, allocator) if new_since is None or p not in new_since]
    notes = []
    if xla and allocator is None:
        notes.append("XLA's message names no allocator: the newest dump written by this cell is used")
    if not candidates:
        why = ("TF_BFC_MEMORY_DUMP was not set when it failed: %load_ext tfmem_widgets (or "
               "tfmem_widgets.watch_oom()) before the run makes TensorFlow write one"
               if not prefix else (dump_place.unwritable(prefix) or "TensorFlow wrote no allocator dump for it "
               "(an allocator other than BFC, or the failure was not the allocator's)"))
        return OomReport(allocator or "unknown", line, request, None, xla=xla, notes=(why, *notes), step=step,
                         node=node)
    try:
        path, dump = _own_dump(exc, candidates, request)
    except TraceDataError as error:
        return OomReport(allocator or "unknown", line, request, None, xla=xla,
                         notes=(f"TensorFlow's dump could not be read: {error}", *notes), step=step, node=node)
    dump_place.reported(prefix, path)
    return report_from_dump(dump, line, request, xla=xla, dump_path=path, live=True, namespace=namespace,
                            notes=notes, text=text, layers=layers)


def explain_refused(exc: BaseException, new_since: set[str], refused: int, fit: FitContext | None,
                    early: StepNeed | None = None) -> OomReport:
    """An error that is not an OOM, raised after the allocator refused requests in the same cell (an XLA
    fit whose autotuner is refused scratch can end in 'InternalError: Graph execution error'): the newest
    of the cell's dumps, said to be the cause."""
    from dataclasses import replace

    report = explain_exception(exc, new_since)
    why = (f"TensorFlow raised {type(exc).__name__}, not an out-of-memory error, after its allocator refused "
           f"{refused} request{'s' if refused != 1 else ''} in this cell (a dump each): the newest dump is its state "
           "at the last refusal")
    notes = [why]
    jit = getattr(getattr(fit, "model", None), "jit_compile", None) is True
    if early is not None and early.peak_bytes is not None:
        report.need = early
    elif fit is not None and jit:
        notes.append(f"this fit's step is an XLA program at batch {fit.batch_size:,}: its compiler's GEMM autotuner "
                     "asked for scratch that did not fit, so the step does not either; plan it in a new process "
                     "(XLA_FLAGS=--xla_gpu_autotune_level=0 there plans without touching the card): "
                     "max_batch_size(..., method='plan') or %%tfmem batch --plan gives the batch that fits")
    return replace(report, notes=(*notes, *report.notes))


def _own_dump(exc: BaseException, candidates: list[str], request: int | None):
    """The dump written at this error's own refusal: the one its report was read from before (kept
    on the error), else the newest whose state the request does not fit (a newer OOM's dump is of
    another moment), else the newest. (path, AllocatorMap)."""
    from ..tracing.dumps import load_memory_dump

    known = getattr(exc, "_tfmem_dump", None)
    if known in candidates:
        return known, load_memory_dump(known)
    newest = None
    for path in reversed(candidates[-8:]):  # a user's folder may hold many: the newest few
        dump = load_memory_dump(path)
        newest = newest or (path, dump)
        if request is None or request > dump.largest_free_bytes:
            return path, dump
    return newest


def explained(exc: BaseException | None, report: OomReport) -> OomReport:
    """The report becomes last_oom(), and the error carries that it was explained (a cell's hook does
    not say it again) and which dump its report read (explaining it again reads the same)."""
    remember(report)
    if exc is not None:
        try:
            exc._tfmem_explained = True
            exc._tfmem_dump = report.dump_path
        except AttributeError:
            pass
    return report


def remember(report: OomReport) -> None:
    global _last
    with _lock:
        _last = report


def last_oom() -> OomReport | None:
    """The report of the most recent OOM explained in this process (None: none yet)."""
    return _last


def explain_oom(source, *, each: bool = False, model=None, sample=None, batch_size: int | None = None):
    """Explain an OOM: a ResourceExhaustedError caught in a script, the path of TensorFlow's
    binary dump or of a log file, a log's text pasted from a job, or a Trace whose block ran out of memory
    (one loaded from its file too). A log with several OOMs is
    explained OOM by OOM, each against its own dump: the last report, or (each=True) the list.

    model, sample, batch_size: the Keras fit an error of this process came from (its compiled model,
    (x, y) of any leading size, its batch): the report then says what the step needs and the batch
    that fits, from XLA's plans. Without them, an error of a fit in the running cell (with the
    extension loaded) is told with the fit the cell was in when its allocator refused."""
    from . import refusals

    fit = refusals.current_fit() if isinstance(source, BaseException) else None
    if model is not None or sample is not None or batch_size is not None:
        if model is None or sample is None or isinstance(batch_size, bool) or \
                not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ArgumentError("explain_oom: model, sample and batch_size go together (the fit's compiled model, "
                                f"(x, y) and its batch, a whole number of at least 1); got batch_size {batch_size!r}"
                                + ("" if model is not None else ", no model") + ("" if sample is not None else ", no sample")
                                + ".")
        if not isinstance(source, BaseException):
            raise ArgumentError("explain_oom: model, sample and batch_size apply to an error raised in this process, "
                                f"not to {type(source).__name__}.")
        import keras

        if not isinstance(model, keras.Model):
            raise ArgumentError(f"explain_oom: model must be the fit's compiled Keras model, got {type(model).__name__}.")
        from ..plans.replicas import replicas_of

        fit = FitContext(model, int(batch_size), sample, replicas_of(model))  # (a strategy's: its replicas planned)
    if isinstance(source, BaseException):
        if not is_oom(source):
            raise ArgumentError(f"explain_oom: {type(source).__name__} is not an out-of-memory error; pass a "
                                "ResourceExhaustedError, a dump file's path or a log's text.")
        report = explained(source, with_need(explain_exception(source), fit))
        return [report] if each else report
    if hasattr(source, "knows") and hasattr(source, "oom"):  # a Trace: its block's OOM, from its own map
        if source.oom is None:
            raise ArgumentError("explain_oom: this trace's block ended without an OOM; pass a trace that ran out "
                                "of memory, an error, a dump file's path or a log's text.")
        report = source.oom_report() or explain_trace(source)
        source.keep_oom_report(report)
        return [report] if each else report
    if isinstance(source, bytes):
        source = source.decode("utf-8", errors="replace")
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if not text.strip():
            raise ArgumentError("explain_oom: got an empty text; pass an error, a dump file's path or a log's text.")
        if isinstance(source, str) and ("\n" in text or looks_like_oom_log(text)):
            return explain_text(text, each)
        if not Path(text).exists():
            raise ArgumentError(f"explain_oom: no file {text!r}, and it is not a log's text; pass an error, a dump "
                                "file's path or a log's text.")
        return explain_path(text, each)
    raise ArgumentError(f"explain_oom: got {type(source).__name__}; pass an error, a dump file's path or a log's text.")
