"""Run code in a new Python process, set up its own way: ``%%tfmem fresh`` / ``run_fresh``.

TensorFlow's devices can be set up once per process, before its runtime starts. To compare
setups (growth or not, two call orders, a 64 MB lab against a 256 MB one) without restarting
the kernel, each one runs in a process of its own: a real IPython shell with the extension
loaded, whose output is shown as it comes and whose named results come back (numbers, text,
lists and dicts as they are; a ``Trace`` or ``Measurement`` as that object).

The child starts as a reader's fresh kernel would: without the setup variables of this
process (lab mode, growth, allocator), only with those the caller passes.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ArgumentError, FreshRunError, SetupError, StateError
from ..tf.options import OPTION_NAMES, SETUP_ENV_VARS, SETUP_OPTIONS
from .transport import decode, read_result, write_job

# TensorFlow's C++ start-up lines ("I0000 00:00:... cuda_dnn.cc:...]") and absl's notice come
# before its log level applies; they say nothing about the cell.
_NATIVE_LOG = re.compile(r"^(?:[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\]|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] "
                         r"|WARNING: All log messages before absl::InitializeLog\(\))")
# What Python itself writes to stderr (a traceback, a warning), and this package's own lines (a
# refusal said while the cell waits): never taken for a log line's tail.
_PYTHON_TEXT = re.compile(r"^(?:Traceback|\s+File |\S+\.py:\d+: |[A-Za-z_][\w.]*(?:Error|Warning|Exception)\b|tfmem[: ])")
# The child ends as soon as its results are written: a thread the cell left running, or a slow
# exit of TensorFlow's, cannot hold the results back until the timeout.
# A recorder the cell left running is stopped first (os._exit runs no atexit): its folder goes with it.
_CHILD = ("import os, sys\nfrom tfmem_widgets.notebook.fresh_child import main\ncode = main(sys.argv[1])\n"
          "try:\n    from tfmem_widgets.tracing.recorder import stop\n    stop()\nexcept Exception:\n    pass\n"
          "sys.stdout.flush(); sys.stderr.flush()\nos._exit(code)\n")


@dataclass
class FreshRun:
    """What a fresh process left: its exit code, its output and the values it returned."""

    returncode: int
    output: str
    values: dict[str, Any] = field(default_factory=dict)
    stderr: str = ""

    def __repr__(self) -> str:
        names = ", ".join(self.values) or "nothing"
        return f"FreshRun(exit {self.returncode}, returned {names})"


# The classes a child's setup may refuse with, by name (the child writes its refusal's class name).
_REFUSALS = {kind.__name__: kind for kind in (ArgumentError, SetupError, StateError)}

QUIET_TAIL_CHARS = 1 << 20  # what is kept of the output of a process run with echo=False


def child_environment(env: Mapping[str, str] | None = None, path: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment without its setup variables, plus `env`: a fresh start.

    The module path only grows: the folders in `path` and any PYTHONPATH in `env` come first,
    then this package's location, then this process's own PYTHONPATH (where a cluster's
    environment modules or a carried install put TensorFlow), so nothing the user had is lost.
    """
    child = {k: v for k, v in os.environ.items() if k not in SETUP_ENV_VARS}
    from ..tf.dump_place import DUMP_ENV, owned

    if owned(child.get(DUMP_ENV)):
        del child[DUMP_ENV]  # the trace's or the OOM watcher's dump place is this process's, not the child's
    from ..tf import device_setup
    from ..tf.runtime import ONEDNN_ENV

    if device_setup.onednn_switched_off and child.get(ONEDNN_ENV) == "0":
        del child[ONEDNN_ENV]  # this kernel's lab setup chose it; the child's setup chooses its own
    extra = {str(k): str(v) for k, v in (env or {}).items()}
    added = [str(folder) for folder in path] + extra.pop("PYTHONPATH", "").split(os.pathsep)
    child.update(extra)
    child["PYTHONUNBUFFERED"] = "1"  # lines appear as the child prints them
    from ..deaths.record import RECORD_ENV

    child[RECORD_ENV] = "0"  # no kernel record: this process tells the child's death itself
    # The child imports this package from wherever this process does (an editable
    # install, or a checkout on sys.path).
    here = str(Path(__file__).resolve().parents[2])
    folders = [*added, here, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    child["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(f for f in folders if f))
    return child


def without_native_logs(lines) -> str:
    """The child's stderr without TensorFlow's C++ log lines (and their continuation lines)."""
    kept, in_log = [], False
    for line in lines:
        if _NATIVE_LOG.match(line):
            in_log = True
        elif in_log and line.strip() and not _PYTHON_TEXT.match(line):
            continue
        else:
            in_log = False
            kept.append(line)
    return "".join(kept)


_GRACE = 2.0  # seconds to drain output once the child has exited or been killed


def check_timeout(timeout, no_limit: str = "None") -> float | None:
    """Seconds (at least 0.01), or None for no limit (`no_limit`: how a caller spells it)."""
    import math
    import numbers

    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout):
        raise ArgumentError(f"timeout must be a number of seconds, or {no_limit} for no limit; got {timeout!r}.")
    if timeout < 0.01:
        raise ArgumentError(f"timeout must be at least 0.01 seconds ({no_limit}: no limit); got {timeout!r}.")
    return float(timeout)


def check_request(setup: Mapping[str, Any] | None, env: Mapping[str, str] | None) -> dict | None:
    """The setup and environment asked for, checked here before a process is started; returns the
    setup as setup()'s keywords, normalized (plain ints, GPU indices as int keys)."""
    if setup is None:
        return None
    if not isinstance(setup, Mapping):
        raise ArgumentError(f"setup must be a dict of tfmem_widgets.setup() options, got {setup!r}.")
    unknown = [key for key in setup if key not in OPTION_NAMES]
    if unknown:
        raise ArgumentError(f"unknown setup option {unknown[0]!r}: setup takes {', '.join(OPTION_NAMES)}.")
    from ..tf.options import SetupRequest

    request = SetupRequest(**setup)  # the values, checked as setup() checks them (the machine's rules: in the child)
    for option in SETUP_OPTIONS:  # --env may not set what a setup option writes too
        clash = [name for name in option.env if setup.get(option.name) is not None and name in (env or {})]
        if clash:
            raise ArgumentError(f"{clash[0]} is set in env and by the setup option {option.name}: give one of them.")
    return {key: value for key, value in vars(request).items() if value is not None}


def _kill_group(proc: subprocess.Popen) -> None:
    """The child and everything it started (its own process group)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.kill()


def run_fresh(
    code: str,
    *,
    setup: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    returns: Sequence[str] = (),
    timeout: float | None = 600,
    echo: bool = True,
    path: Sequence[str] = (),
) -> FreshRun:
    """Run `code` (a cell: Python with %magics) in a new Python process and return its results.

    setup:   keyword arguments for tfmem_widgets.setup() in the child, before the code runs
             (None: no setup, TensorFlow as it starts by default)
    env:     environment variables for the child (e.g. {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}); a
             PYTHONPATH here is added in front of this process's, never replaces it
    returns: names the code defines, brought back as FreshRun.values, equal to what they were
             there (any value Python can pickle whose type this process can import; a Trace or a
             Measurement); a TensorFlow tensor, or an object of a class the cell defined, is
             refused in one line
    timeout: seconds before the process, and every process it started, is killed (None: no limit)
    echo:    print the child's output here as it comes
    path:    folders to import from first in the child (e.g. where a module of the notebook's is)

    Raises ArgumentError for a malformed argument, SetupError when the setup is refused (here or by
    the child), FreshRunError when the code raises, a value cannot come back, or the process dies
    or runs past `timeout` seconds.

    >>> run = run_fresh("import tensorflow as tf\\nx = tf.zeros((256,))\\npeak = ...",
    ...                 setup={"lab_mb": 64}, returns=["peak"])
    >>> run.values["peak"]
    """
    if not isinstance(code, str):
        raise ArgumentError(f"code must be the cell's text, got {type(code).__name__}.")
    if isinstance(returns, str):
        raise ArgumentError(f"returns must be a list of names, got the text {returns!r}: use [{returns!r}].")
    bad = [name for name in returns if not str(name).isidentifier()]
    if bad:
        raise ArgumentError(f"returns must be Python names; {bad[0]!r} is not one.")
    return run_checked(code, setup=check_request(setup, env), env=env, returns=returns, timeout=check_timeout(timeout),
                       echo=echo, path=path)


def run_checked(code: str, *, setup: dict | None, env: Mapping[str, str] | None = None, returns: Sequence[str] = (),
                timeout: float | None = 600, echo: bool = True, path: Sequence[str] = (),
                remember_oom: bool = True, start_when: str | None = None,
                on_start: Callable[[subprocess.Popen], None] | None = None,
                each_tick: Callable[[], None] | None = None) -> FreshRun:
    """run_fresh for a setup already checked (check_request) and a timeout already read (check_timeout).
    remember_oom: an OOM the process met becomes this process's last_oom() (a batch search's probes
    leave it alone). start_when: a file; the child imports TensorFlow, Keras and IPython, starts
    nothing of TensorFlow's runtime, and waits until the file exists before its setup and code
    (search/warm.py). on_start(process): called once the child is started (who may kill its group).
    each_tick(): called in this thread while the child runs, at least every 0.1 s (an error in it ends
    the child)."""
    from ..tf.dump_place import DUMP_ENV, dump_files

    # mkdtemp, then try at once: an interrupt between the two cannot leave the folder (a
    # TemporaryDirectory interrupted in its __enter__ is removed only when collected).
    work = tempfile.mkdtemp(prefix="tfmem-fresh-")
    try:
        work_dir = Path(work)
        write_job(work_dir, code, setup, list(returns), start_when)
        environment = child_environment(env, path)
        # The child's OOM dumps land in this call's folder (gone with it, even when the child is
        # killed before its exit handlers run), unless the user chose a place of their own.
        environment.setdefault(DUMP_ENV, str(work_dir / "dump"))
        if "TMPDIR" not in (env or {}):  # its temporary files (a trace's folder) too: a child killed leaves none
            (work_dir / "tmp").mkdir()
            environment["TMPDIR"] = str(work_dir / "tmp")
        dumps_before = set(dump_files(environment[DUMP_ENV]))
        with open(work_dir / "stderr.txt", "w+b") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(work_dir)], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=stderr, env=environment,
                start_new_session=True,  # its own process group: a timeout kills what it started too
            )
            try:
                if on_start is not None:
                    on_start(proc)
                output, timed_out = _follow(proc, timeout, echo, each_tick)
            finally:  # Ctrl-C, an error here, or the end: nothing the child started outlives the call
                _kill_group(proc)
                proc.wait()
                proc.stdout.close()
            size = stderr.seek(0, os.SEEK_END)
            stderr.seek(0 if echo else max(0, size - QUIET_TAIL_CHARS))  # unseen: its tail
            raw_errors = stderr.read().decode(errors="replace")
            errors = without_native_logs(raw_errors.splitlines(keepends=True))
        if errors and echo:
            sys.stderr.write(errors)
        result = read_result(work_dir)
        if "setup_error" in result:  # refused by the child's machine: the class it raised there
            raise _REFUSALS.get(result.get("setup_error_class"), SetupError)(result["setup_error"])
        if proc.returncode != 0 or "values" not in result:
            raise _failure(proc, result, timed_out=timed_out, timeout=timeout, work_dir=work_dir,
                           dump_prefix=environment[DUMP_ENV], dumps_before=dumps_before, output=output,
                           raw_errors=raw_errors, errors=errors, setup=setup, echo=echo, remember_oom=remember_oom)
        values = {name: decode(name, work_dir) for name in result["values"]}
        return FreshRun(proc.returncode, output, values, errors)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _failure(proc, result: dict, *, timed_out: bool, timeout, work_dir: Path, dump_prefix: str, dumps_before: set,
             output: str, raw_errors: str, errors: str, setup, echo: bool, remember_oom: bool) -> FreshRunError:
    """The FreshRunError of a child that raised, died, or ran past its timeout: how it ended, the OOM it
    met (remembered as this process's last_oom() where asked), a death's words and meaning."""
    death = None
    if timed_out and "values" not in result:
        why = f"ran past {timeout:g} s and was stopped, with every process it started"
    elif "error" in result:
        why = f"raised {result['error']}"
    elif proc.returncode < 0:
        from ..deaths.explain import signal_name

        why = f"was killed by {signal_name(-proc.returncode)}"
    else:
        why = f"ended with exit code {proc.returncode}"
    oom = None if timed_out else _oom_of_child(
        work_dir, dump_prefix, dumps_before, output + raw_errors, setup, why,
        died="error" not in result)
    if proc.returncode < 0 and not why.startswith("ran past"):
        death = _death(proc, raw_errors, setup, after_oom=oom is not None)
    how = why
    if oom is not None and remember_oom:
        from ..oom.explain import remember

        remember(oom)
        why += (" after an OOM, explained by tfmem_widgets.last_oom()" if "error" in result else
                " after an OOM: TensorFlow's dump of it is explained by tfmem_widgets.last_oom()")
    last = last_words(errors) or last_words(output)  # a traceback's last line is on stderr
    said = ("its output is above" if echo else f"it last wrote: {last}" if last else "it wrote nothing")
    if str(result.get("error", "")).startswith("SystemExit"):
        said = "the code called sys.exit (a fresh process's code ends by its end, or raises)"
    if death is not None:  # TensorFlow's words (its native lines, not faulthandler's), what they mean
        last = death.last_words or last
        said = (f"its last words on fd 2: {death.last_words}; " if death.last_words else "") + \
            f"what it means: {death.meaning}"
    return FreshRunError(f"the fresh process {why}; {said}.", how=how, raised=result.get("error"),
                         timed_out=timed_out, oom=oom, last_words=last, death=death,
                         oom_shown="error" in result)  # the child's own shell showed its report


def last_words(text: str) -> str:
    """The last line a process wrote that says something (a traceback's last line: the error)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line and not line.startswith(("^", "~")):
            return line[:300]
    return ""


def _death(proc, fd2_text: str, setup: Mapping | None, after_oom: bool):
    """How a child a signal ended died, told (deaths/explain.py)."""
    from ..deaths.explain import explain_death

    lab = (setup or {}).get("lab_mb")
    return explain_death(-proc.returncode, fd2_text, pid=proc.pid, lab_mb=lab if isinstance(lab, int) else None,
                         after_oom=after_oom)


def _oom_of_child(work_dir: Path, prefix: str, before: set[str], text: str, setup: Mapping | None, how: str,
                  died: bool):
    """The OOM a failed child met: the report its own shell made (with its limits and Keras
    layers), or, when it died before making one, TensorFlow's dump it left, read here."""
    from ..oom.explain import report_from_dump
    from ..tf.messages import failed_request

    made = work_dir / "oom.value"
    if made.exists():
        try:
            report = pickle.loads(made.read_bytes())
        except Exception:
            report = None
        if report is not None:
            return _without_gone_path(report, work_dir)
    if not died:
        return None  # it raised something else: a refusal it got over is no OOM
    from ..tf.dump_place import dump_files, dump_of_allocator

    new = [p for p in dump_files(prefix) if p not in before]
    if not new:
        return None
    from ..errors import TraceDataError
    from ..tracing.dumps import load_memory_dump

    allocator, request, line, xla = failed_request(text)
    path = ([p for p in new if allocator and dump_of_allocator(p, prefix, allocator)] or new)[-1]
    try:
        dump = load_memory_dump(path)
    except TraceDataError:
        return None
    if request is None:
        line = f"TensorFlow's dump of {dump.allocator}"
    from ..tf.limits import setup_limit

    limit, source = setup_limit(setup, dump.allocator)
    report = report_from_dump(dump, line, request, xla=xla, dump_path=path, text=text, notes=(
        f"the fresh process {how} before it could explain this OOM: TensorFlow's dump of it is read here, "
        "without its Keras variables",))
    from dataclasses import replace

    if limit is not None:
        report = replace(report, limit_bytes=limit, limit_source=source)
    return _without_gone_path(report, work_dir)


def _without_gone_path(report, work_dir: Path):
    """A dump in the call's own folder is removed with it: the report does not point there."""
    from dataclasses import replace

    if report.dump_path and Path(report.dump_path).resolve().is_relative_to(work_dir.resolve()):
        return replace(report, dump_path=None)
    return report


def _follow(proc: subprocess.Popen, timeout: float | None, echo: bool,
            each_tick: Callable[[], None] | None = None) -> tuple[str, bool]:
    """Show the child's output as it comes, until it ends; kill its group at the timeout. each_tick()
    is called between reads, at least every 0.1 s.

    The wait is bounded: a process it started that keeps the output open (in another session)
    gets _GRACE seconds after the child has gone. Bytes that are not UTF-8 are replaced.
    """
    import codecs
    import selectors
    import time

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd = proc.stdout.fileno()
    pieces: list[str] = []
    kept = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    ended_at = None
    timed_out = False
    # poll/epoll: any descriptor number (select() stops at 1024, which a long-lived kernel passes)
    selector = selectors.DefaultSelector()
    try:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            if each_tick is not None:
                each_tick()
            now = time.monotonic()
            if deadline is not None and not timed_out and now >= deadline:
                timed_out = True
                _kill_group(proc)
            if ended_at is None and proc.poll() is not None:
                ended_at = now
            if ended_at is not None and now - ended_at > _GRACE:
                break
            wait = 0.1 if deadline is None or timed_out else max(0.0, min(0.1, deadline - now))
            if not selector.select(wait):
                continue
            data = os.read(fd, 65536)
            if not data:
                break
            text = decoder.decode(data)
            if text:
                pieces.append(text)
                if echo:
                    sys.stdout.write(text)
                    sys.stdout.flush()
                else:  # output nobody sees: only its tail is kept (the OOM line, the last words)
                    kept += len(text)
                    while kept > QUIET_TAIL_CHARS and len(pieces) > 1:
                        kept -= len(pieces.pop(0))
    finally:
        selector.close()
    tail = decoder.decode(b"", final=True)
    if tail:
        pieces.append(tail)
        if echo:
            sys.stdout.write(tail)
    return "".join(pieces), timed_out
