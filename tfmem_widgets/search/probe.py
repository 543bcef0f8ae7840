"""One probe of a batch search: a fresh process builds the model the user's way, fits `steps` steps of
one batch, and measures the allocator's exact highest in-use figure, or meets the OOM.

The probe's result crosses the process boundary as a ``Probe`` (or a ``ProbeRefused`` saying in one
line why the user's functions could not be probed); how a process died is a field of the error
``run_fresh`` raises, never read back out of its message; a probe never changes the kernel's
``last_oom()``.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ArgumentError, FreshRunError

# What a search's probe reads of its plans (search/warm.SharedAutotune publishes it, on a GPU): XLA's autotune
# results, in the file this variable names (read as the probe's work begins: XLA reads its flags at its first
# compile), and beside them the batches the plans compiled.
SHARED_AUTOTUNE_ENV = "TFMEM_AUTOTUNE_FROM"
DUMP_AUTOTUNE, LOAD_AUTOTUNE = "--xla_gpu_dump_autotune_results_to", "--xla_gpu_load_autotune_results_from"
PLANNED_BATCHES = "autotune-batches.txt"


@dataclass(frozen=True)
class Probe:
    """One fresh process: `batch` examples, `steps` train steps."""

    batch: int
    peak_bytes: int | None  # the allocator's highest in use during the steps; None: out of memory
    seconds: float
    verdict: str | None = None  # the OOM report's verdict
    request_bytes: int | None = None  # the request that failed
    died: str | None = None  # how the process ended where it died (an XLA program's OOM, a signal), and why
    stage: str = "train"  # "build": build_model() itself ran out of memory
    limit_bytes: int | None = None  # the limit the probe ran under (its process's reading)
    limit_source: str = "unknown"
    replicas: int = 1  # the model's strategy's replicas (its batches divide by them: Keras' fit refuses others)

    @property
    def fits(self) -> bool:
        return self.peak_bytes is not None


@dataclass(frozen=True)
class ProbeRefused:
    """The user's functions could not be probed: why, in one line."""

    message: str
    replicas: int = 0  # a model built under a strategy whose replicas the batch does not divide by (0: not so)


class TooFewRows(ArgumentError):
    """A probe's batch gives a replica of the model's strategy no row, or does not divide by the replicas: Keras'
    fit under a strategy reduces its first batch across them to build the model, which needs their rows alike."""

    def __init__(self, message: str, replicas: int):
        super().__init__(message)
        self.replicas = replicas


PROBE_CODE = """
from tfmem_widgets.search.probe import run_probe
probe = run_probe({path!r}, {batch}, {steps})
"""


def _rows(part) -> tuple[int | None, str]:
    """How many rows one part of a batch (x or y) holds, and what it is for a message: an array or
    tensor (ragged too) by its leading axis, a Python list by its length, a dict by its first value."""
    if isinstance(part, Mapping):
        part = next(iter(part.values()), None)
    if isinstance(part, (list, tuple)):
        return len(part), f"a {type(part).__name__} of {len(part)}"
    shape = getattr(part, "shape", None)
    if shape is None or len(shape) == 0 or shape[0] is None:
        return None, f"a {type(part).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else "")
    return int(shape[0]), f"a {type(part).__name__} of shape {tuple(None if d is None else int(d) for d in shape)}"


def _check_batch(data, batch: int) -> str | None:
    """What is wrong with make_batch's result, in words (None: a batch of `batch` rows)."""
    if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        return f"make_batch({batch}) returned a {type(data).__name__}; it must return (x, y)"
    for name, part in zip(("x", "y", "sample_weight"), data):
        if part is None and name != "x":
            continue
        count, what = _rows(part)
        if count != batch:
            return (f"make_batch({batch}) returned {name} as {what}: "
                    + (f"{count} rows" if count is not None else "no rows it can count")
                    + f"; x and y must hold exactly {batch} rows each")
    return None


def probe_dataset(data, steps: int):
    """The data a probe fits on: make_batch's arrays as one element, repeated for each step (Keras'
    array adapter makes its dataset with from_tensors too). On a GPU the arrays become a constant on
    the device, held through the fit besides the step's own copy of the batch (search/plan_first.py)."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensors(tuple(data)).repeat(steps)


def run_probe(path: str, batch: int, steps: int) -> Probe | ProbeRefused:
    """In the probe's process: build, make the batch, fit `steps` steps of it, measure."""
    build_model, make_batch = pickle.loads(Path(path).read_bytes())

    from ..oom.explain import explain_exception
    from ..readings.measure import measure
    from ..tf.allocator import allocator_of_device
    from ..tf.limits import allocator_limit
    from ..tf.messages import is_oom

    try:
        model = build_model()
    except BaseException as exc:
        if isinstance(exc, Exception) and is_oom(exc):  # the model alone does not fit
            report = explain_exception(exc, layers=False)
            return Probe(batch, None, 0.0, report.verdict, report.request_bytes, stage="build",
                         limit_bytes=report.limit_bytes, limit_source=report.limit_source)
        return ProbeRefused(f"build_model() raised {type(exc).__name__}"
                            + (f": {cause_line(exc)}" if cause_line(exc) else ""))
    if not hasattr(model, "train_on_batch"):
        return ProbeRefused(f"build_model() returned a {type(model).__name__}, not a compiled Keras model")
    from ..plans.replicas import replicas_of

    replicas = replicas_of(model)
    if batch < replicas:  # (its fit would fail on an empty replica's batch, in an AddN of the gradients)
        return ProbeRefused(f"a batch of {batch:,} leaves a replica without a row: the model was built under a "
                            f"strategy of {replicas} replicas; give low={replicas} or more", replicas=replicas)
    if batch % replicas:  # (Keras' fit reduces its first batch across the replicas: AddN refuses rows unlike)
        return ProbeRefused(f"a batch of {batch:,} does not divide by the {replicas} replicas of the model's strategy, "
                            "and Keras' fit cannot start it (it reduces the first batch across the replicas); give "
                            f"a multiple of {replicas}", replicas=replicas)
    try:
        data = make_batch(batch)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt too: said, not a silent death
        return ProbeRefused(f"make_batch({batch}) raised {type(exc).__name__}"
                            + (f": {cause_line(exc)}" if cause_line(exc) else ""))
    wrong = _check_batch(data, batch)
    if wrong:
        return ProbeRefused(wrong)
    try:
        # fit, as the user trains: Keras' input pipeline holds a batch on the device next to the step's,
        # so a batch that train_on_batch fits can run out of memory in fit.
        steps_data = probe_dataset(data, steps)
    except Exception as exc:
        return ProbeRefused(f"make_batch({batch}) returned what a tf.data.Dataset cannot hold "
                            f"({type(exc).__name__}: {cause_line(exc)}); return arrays or tensors")
    started = time.perf_counter()
    ending = _end_at_first_refusal(batch) if getattr(model, "jit_compile", None) is True else None
    try:
        with measure() as m:
            model.fit(steps_data, epochs=1, verbose=0)
    except Exception as exc:
        if ending is not None:
            ending.set()
        if not is_oom(exc):
            return ProbeRefused(f"the train step at batch {batch} raised {type(exc).__name__}: {cause_line(exc)}")
        report = explain_exception(exc, layers=False)  # the verdict and request; no layers, nothing kept
        del exc
        found = allocator_limit(report.allocator)
        return Probe(batch, None, time.perf_counter() - started, report.verdict, report.request_bytes,
                     limit_bytes=found.limit_bytes, limit_source=found.source, replicas=replicas)
    finally:
        if ending is not None:
            ending.set()
    found = allocator_limit(allocator_of_device(m.device))
    return Probe(batch, m.highest_bytes, time.perf_counter() - started, limit_bytes=found.limit_bytes,
                 limit_source=found.source, replicas=replicas)


_planned_here: frozenset[int] = frozenset()  # the batches whose every kernel this process reads timed


def read_shared_autotune() -> None:
    """In a search's fresh process as its work begins: XLA told to read the autotune results of the
    search's plans, where they were published (warm.SharedAutotune), before its first compile; the batches
    the plans compiled kept for timed_by_plans."""
    global _planned_here
    _planned_here = frozenset()
    shared = os.environ.pop(SHARED_AUTOTUNE_ENV, None)
    if shared and os.path.isfile(shared):
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} {LOAD_AUTOTUNE}={shared}".strip()
        planned = Path(shared).with_name(PLANNED_BATCHES)
        _planned_here = frozenset(int(line) for line in planned.read_text().split()) if planned.is_file() else frozenset()


def timed_by_plans(batch: int) -> bool:
    """Whether this process reads the timing of every kernel of its step at `batch`: the search's plans
    compiled that batch's program and their results were published before this probe began (its
    compile then times nothing, nor takes the autotuner's scratch on the card)."""
    return batch in _planned_here


REFUSED_EXIT = 75  # an XLA probe's process ends with this code at its allocator's first refusal (see below)
REFUSED = "ended at the allocator's first refusal"


def _end_at_first_refusal(batch: int):
    """For a step that is one XLA program, in lab mode or on a GPU where XLA times no kernel of it (its
    autotuner off, or every kernel at `batch` timed by the search's plans: timed_by_plans): end the
    probe's process at the allocator's first refusal (its first dump), not after TensorFlow's 10 s
    retry: nothing else of the step runs while the program waits, so nothing frees memory for the
    retry. A graph step's other ops do free memory meanwhile (its probes keep the retry), and on a GPU
    where the autotuner times a kernel, XLA can be refused scratch while it compiles and go on with
    another (its probes run to TensorFlow's own end). Returns the event that stops the watch (None: none)."""
    import threading

    from ..tf import dump_place
    from ..tf.devices import xla_autotune_level
    from ..tf.lab import lab_limit_bytes

    prefix = dump_place.current_prefix()
    if not prefix or (lab_limit_bytes() is None and xla_autotune_level() != "0" and not timed_by_plans(batch)):
        return None
    before = set(dump_place.dump_files(prefix))
    done = threading.Event()

    def watch():
        while not done.wait(0.1):
            if set(dump_place.dump_files(prefix)) - before:
                os._exit(REFUSED_EXIT)

    threading.Thread(target=watch, name="tfmem-probe-refusal", daemon=True).start()
    return done


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


# Keras' error frames: lines that name the call, not the cause.
_FRAME_LINES = ("Exception encountered when calling", "Arguments received by", "•", "File ", "Traceback",
                "Call arguments received")


def cause_line(exc: BaseException) -> str:
    """The line of an error that says its cause: Keras wraps it in lines that name the call
    ('Exception encountered when calling Sequential.call().'); the first other line, else the first."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if lines and lines[0].startswith("Graph execution error"):  # TensorFlow's: the cause is the line before the
        node = next((i for i, line in enumerate(lines) if line.startswith("[[")), None)  # failed node's [[...]]
        if node and not lines[node - 1].startswith(("File ", "Detected at node", "Graph execution error")):
            return lines[node - 1][:300]
    for line in lines:
        if not line.startswith(_FRAME_LINES):
            return line[:300]
    return lines[0][:300] if lines else ""




def probe_in_fresh_process(path: Path, batch: int, steps: int, setup: dict | None, env: dict,
                            timeout: float | None) -> Probe:
    """One probe in a fresh process set up with the (checked) `setup`; the kernel's last_oom() is left
    alone. Raises ArgumentError when the user's functions cannot be probed, FreshRunError when the probe
    ran too long or its process died."""
    from ..fresh.run import run_checked

    started = time.perf_counter()
    code = PROBE_CODE.format(path=str(path), batch=batch, steps=steps)
    return probe_outcome(batch, timeout, started, lambda: run_checked(
        code, setup=setup, env=env, returns=["probe"], timeout=timeout, echo=False, remember_oom=False))


def ran_past(batch: int, timeout: float) -> FreshRunError:
    return FreshRunError(f"max_batch_size: the probe at batch {batch:,} ran past {timeout:g} s and was stopped "
                         "with every process it started; raise probe_timeout (a probe builds the model, compiles its "
                         "step and trains: this one needed longer).",
                         how=f"ran past {timeout:g} s and was stopped", timed_out=True)


def probe_outcome(batch: int, timeout: float | None, started: float, run, ended: float | None = None) -> Probe:
    """The Probe that run() (a probe's run_checked) leaves, its seconds counted from `started` to
    `ended` (its process's end; None: now). Raises ArgumentError where the functions could not be probed,
    FreshRunError where the process failed otherwise."""
    try:
        done = run()
    except FreshRunError as exc:
        seconds = (ended or time.perf_counter()) - started
        if exc.how == f"ended with exit code {REFUSED_EXIT}":  # its first refusal ended it (_end_at_first_refusal)
            oom = exc.oom  # read from the refusal's dump, which does not say the request
            return Probe(batch, None, seconds, died=REFUSED, limit_bytes=oom.limit_bytes if oom else None,
                         limit_source=oom.limit_source if oom else "unknown")
        if exc.oom is not None:  # the OOM ended the process (an XLA program's): its dump was read
            return Probe(batch, None, seconds, exc.oom.verdict, exc.oom.request_bytes, died=exc.how,
                         limit_bytes=exc.oom.limit_bytes, limit_source=exc.oom.limit_source)
        if exc.timed_out:
            raise ran_past(batch, timeout) from None
        if exc.death is not None:  # a signal ended it (a TensorFlow CHECK, a segmentation fault): this batch does not train
            return Probe(batch, None, seconds, "abort: 2^31 elements" if exc.death.aborted_on_elements else "died",
                         died=f"{exc.how}: {exc.death.meaning}" + (
                             f" (its last words: {exc.death.last_words})" if exc.death.last_words else ""))
        said = f"; it last wrote: {exc.last_words}" if exc.last_words else "; it wrote nothing"
        raise FreshRunError(f"max_batch_size: the probe at batch {batch:,} failed: its process {exc.how}{said}.",
                            how=exc.how, raised=exc.raised, last_words=exc.last_words) from None
    value = done.values["probe"]
    if isinstance(value, ProbeRefused):
        if value.replicas:
            raise TooFewRows(f"max_batch_size: {value.message}.", value.replicas)
        raise ArgumentError(f"max_batch_size: {value.message}.")
    return replace(value, seconds=(ended or time.perf_counter()) - started)  # the process's start counted too
