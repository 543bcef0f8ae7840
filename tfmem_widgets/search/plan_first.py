"""A batch search that plans first: the plans in one fresh process, then probes that confirm them.

``max_batch_size(method="plan")`` runs ``plans/largest.largest_planned_batch`` in one fresh process set
up like the probes, then probes its answer and the batch just past it: side by side where the machine
has room for both (``warm.room_for_two``), begun while the closing plan compiles where the plans close
in from above. On a GPU whose autotuner is on, the probes read what the plans' compiles timed
(``warm.SharedAutotune``): the plans then compile the batch past their answer too, and the probes begin
after them. More probes only where they disagree with the plans.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from ..fresh.transport import tell_batch
from ..plans.largest import FreshFit, PlanSearch, largest_planned_batch
from ..plans.plan import device_of
from ..plans.replicas import replicas_of
from .by_plans import held_beside
from .probe import first_line


def search_in_process(path: str, low: int, high: int, resolution: float, max_plans: int,
                      xla_only: bool = False, closing_plan: bool = True, closing_aim: str | None = None) -> PlanSearch:
    """In a fresh process set up like the probes: build the model the user's way, then plan. xla_only
    (method="auto"): a model whose step runs without XLA is not planned at all, only said to be so
    (its plans would be estimates the search does not use; each costs a compile). closing_aim: a file
    where the batch of a closing plan (largest_planned_batch's `closing`) is written as it compiles, for
    the search to begin its probes meanwhile."""
    import pickle

    from .fit_start import read_fit_start

    started = time.perf_counter()
    build_model, make_batch = pickle.loads(Path(path).read_bytes())
    model, start = read_fit_start(build_model, make_batch)  # lab mode: the pool a probe's fit will meet, read
    jit = getattr(model, "jit_compile", None)
    replicas = replicas_of(model)
    if (xla_only and jit is not True) or replicas > 1:
        return PlanSearch(None, None, seconds=time.perf_counter() - started, jit_compile=jit, replicas=replicas)
    sample = make_batch(min(low, 8))
    # A probe's fit builds the slots itself where build_model() left them unbuilt; on the CPU (lab mode) its first
    # step then writes the slots that shared a buffer their own (fit.slots_shared_by_fit).
    fit_builds_slots = device_of(model).startswith("CPU") and not getattr(model.optimizer, "built", True)
    share = data_on_device(make_batch, model)
    fit = FreshFit(held=lambda planned: held_beside(planned, share),
                   start=start, builds_slots=fit_builds_slots)
    closing = None if closing_aim is None else lambda batch: tell_batch(Path(closing_aim), batch)
    found = largest_planned_batch(model, sample, low=low, high=high, resolution=resolution, max_plans=max_plans,
                                  fit=fit, closing_plan=closing_plan, closing=closing)
    if start is not None:
        found.notes.append(f"each plan placed in the pool a fresh fit meets at its first step: the one build_model() "
                           f"left here, traced, then the fit's data and its iterator's copy ({start.passing_share:.2f} "
                           "of the batch's bytes, measured), the optimizer's slots")
    found.data_share = share
    if share:
        found.notes.append(f"the fit's data sits on {device_of(model)} besides the step's copy of the batch "
                           f"({share:.2f} of the batch's bytes, measured): counted in each plan's peak")
    for planned in found.plans:
        planned.notes = ()  # what goes back: figures, not the process's notes
    return found


def data_on_device(make_batch, model, rows: int = 256) -> float:
    """The bytes a probe's data holds on the model's device besides the step's copy of the batch, per
    byte of batch, measured: make_batch(rows) made into the probe's dataset (``probe.probe_dataset``).
    On a GPU the arrays become a constant on the device, and the step takes its own copy of each batch;
    on the CPU (lab mode) the step reads that constant in place, so nothing is held besides (0.0)."""
    import numpy as np
    import tensorflow as tf

    from .probe import probe_dataset

    device = device_of(model)
    if device.startswith("CPU"):
        return 0.0
    before = tf.config.experimental.get_memory_info(device)["current"]
    data = make_batch(rows)
    dataset = probe_dataset(data, 1)
    held = tf.config.experimental.get_memory_info(device)["current"] - before
    size = sum(np.asarray(part).nbytes for part in tf.nest.flatten(data))
    del dataset, data
    return max(0.0, held / size) if size else 0.0


PLAN_CODE = """
from tfmem_widgets.search.plan_first import search_in_process
found = search_in_process({path!r}, {low}, {high}, {resolution}, {max_plans}, xla_only={xla_only},
                          closing_plan={closing_plan}, closing_aim={closing_aim!r})
"""


DONE, FROM_LOW, UP, BETWEEN = "done", "from low", "up", "between"


def plan_first(search, probe_one, progress, auto: bool, max_probes: int) -> str:
    """A batch search's plans (one fresh process set up like its probes), then the answer confirmed
    by a probe at it and one just past it. Returns how the probe search goes on: DONE (the probes
    agree with the plans), FROM_LOW (no plans, nothing below the answer trained), UP (both trained),
    BETWEEN (the answer did not train, a batch below it did: the probes close in between).

    Where two probes can run side by side, they begin while the planning process compiles a closing
    plan (a plan above it failed within its step, so if it fits it is the answer), and stand whatever
    that plan says. The probes after the pair stop at max_probes (then FROM_LOW). With a margin, a
    process waits after the last probe it expects: the margin's probes follow."""
    probe = _probe_with(search, probe_one, progress)
    found, early = _plans(search, probe_one, progress, auto)
    if found is not None and found.jit_compile is not True and auto:
        return FROM_LOW
    if early is not None and early[2] is not None:  # the pair began while the plans went on: its probes stand
        return _after_early_pair(search, early, progress, probe, max_probes)
    if found is None or found.batch is None:
        return FROM_LOW
    return _confirm(search, found, probe_one, progress, probe, max_probes)


def _step_of(search, batch: int) -> int:
    return max(1, math.ceil(batch * search.resolution))


def _plans(search, probe_one, progress, auto: bool):
    """The plans, made in one fresh process, kept on the search before any probe is read (a Ctrl-C there
    keeps them): (the PlanSearch or None, the pair begun while a closing plan compiled or None)."""
    started = time.perf_counter()
    pair = getattr(probe_one, "pair", None)  # the answer and the batch past it probed side by side
    begin_pair = getattr(probe_one, "begin_pair", None)  # the same, begun now, read later
    aim_file = Path(probe_one.path).with_name("closing-aim")
    early = None  # the pair begun while the closing plan compiles: (its batches, when, what reads it)

    def closing_begun() -> None:  # (called while the planning process runs, every 0.1 s)
        nonlocal early
        if early is not None or begin_pair is None or not aim_file.exists():
            return
        try:
            aim = int(aim_file.read_text())
        except (OSError, ValueError):  # (written whole, at once: not expected)
            return
        batches = (aim, min(search.high, aim + _step_of(search, aim)))  # (the aim is below high)
        read = begin_pair(*batches)  # None: no room for two now, the plans go on alone
        early = (batches, time.perf_counter(), read)
        if read is not None:
            _show_probing(search, progress, batches)

    # Where the probes read what the plans' compiles timed (a GPU's autotuner on: warm.SharedAutotune), the plans
    # compile the batch past their answer too, so that its probe times nothing either, and no probe begins before
    # the plans have ended (it would read nothing).
    shared = getattr(probe_one, "plans_env", None)
    found = _run_plans(search, probe_one.path, xla_only=auto, closing_plan=pair is None or shared is not None,
                       closing_aim=None if begin_pair is None or shared is not None else str(aim_file),
                       each_tick=closing_begun, env=shared,
                       then=lambda: "the probes begun meanwhile decide" if early and early[2] else "probes only")
    getattr(probe_one, "plans_done", lambda found: None)(found)  # (what the plans timed, the probes' from now)
    search.plan_seconds = time.perf_counter() - started
    if early is not None:  # how long the pair ran beside the plans, at most
        batches, began, read = early
        early = (batches, started + search.plan_seconds - began, read)
    if found is not None and not _per_replica(search, found):
        if found.jit_compile is not True:
            search.notes.append("the model's step runs without XLA (jit_compile=False): its plan would be an "
                                "estimate, so the search probed only" if auto else
                                "the model's step runs without XLA (jit_compile=False): the plans are of the same "
                                "step under XLA, an estimate; the probes decide")
            if auto:
                return found, None
            search.plans_estimate = True
        _keep(search, found)
        search.plan_answer = found.batch
        search.planned_failure = found.aborts_from  # a graph step that aborts there: no batch from it is the answer
    return found, early


def _run_plans(search, path, *, xla_only: bool, closing_plan: bool, closing_aim: str | None,
               each_tick=None, then=lambda: "probes only", env=None):
    """The PlanSearch of one fresh process set up like the search's probes (None, and a note that says
    why, where the process failed; then(): what the search goes on with). env: where not None, the
    process's environment instead of the search's (XLA told to write what its autotuner times)."""
    from ..errors import FreshRunError
    from ..fresh.run import run_checked

    _, setup, searched_env, timeout = search._run
    env = searched_env if env is None else env
    code = PLAN_CODE.format(path=str(path), low=search.low, high=search.high, resolution=search.resolution,
                            max_plans=14, xla_only=xla_only, closing_plan=closing_plan, closing_aim=closing_aim)
    try:
        return run_checked(code, setup=setup, env=env, returns=["found"], timeout=timeout, echo=False,
                           remember_oom=False, each_tick=each_tick).values["found"]
    except FreshRunError as exc:
        said = first_line(exc).partition("; ")[2].rstrip(".")  # what it last wrote, or what its death means
        search.notes.append(f"the plans could not be made (the process {exc.how}{'; ' + said if said else ''}): "
                            + then())
        return None


def _per_replica(search, found) -> bool:
    """Whether the model was built under a strategy of several replicas, which a plan search does not plan
    (said in a note); plan() plans such a model per replica (plans/replicas.py)."""
    if found.replicas > 1:
        search.notes.append(f"the model was built under a strategy of {found.replicas} replicas: the plan search plans "
                            "one device's step, so the probes alone decide (tfmem_widgets.plan plans such a model "
                            "per replica)")
    return found.replicas > 1


def _keep(search, found) -> None:
    search.plans, search.data_share = found.plans, found.data_share
    search.notes.extend(found.notes)


def plans_after(search) -> None:
    """A probe search's plans, made once it is asked what fits away from its own limit: the plan search's
    process (one fresh process set up like the probes, the plans closing in on the edge at the search's
    limit), so that its answers elsewhere come from plans placed in a fresh pool under that limit
    (search/by_plans.py), not from a line through the peaks at its edge. Made once; where they cannot be
    made, a note says why and the line answers."""
    import shutil
    import tempfile

    search.plans_tried = True
    if search._run is None or search.plans:
        return
    functions = search._run[0]
    work = Path(tempfile.mkdtemp(prefix="tfmem-batch-"))
    started = time.perf_counter()
    print("tfmem: planning the step in one fresh process, for what fits away from the search's limit ...",
          flush=True)
    try:
        (work / "functions.pickle").write_bytes(functions)
        found = _run_plans(search, work / "functions.pickle", xla_only=False, closing_plan=True, closing_aim=None,
                           then=lambda: "other limits are read off the line through the peaks")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    search.plans_after_seconds = time.perf_counter() - started
    if found is None or _per_replica(search, found):
        return
    if found.jit_compile is not True:
        search.notes.append("the model's step runs without XLA (jit_compile=False): the plans that answer away from "
                            "the search's limit are of the same step under XLA, an estimate")
        search.plans_estimate = True
    _keep(search, found)


def _after_early_pair(search, early, progress, probe, max_probes: int) -> str:
    """The pair begun while the closing plan compiled ((its batches, the seconds it ran beside the plans, what
    reads it)), read: how the search goes on."""
    (answer, past), beside, read = early
    both = read()
    _show_probed(search, progress, both)
    search.beside_plans_seconds += min(beside, max(p.seconds for p in both))
    search.notes.append(f"batches {answer:,} and {past:,} were probed while the plan at {answer:,} compiled: "
                        "if it fitted, it was the plans' answer")
    planned = search.plan_answer
    if both[0].fits or planned is None or planned >= answer:
        return _after_pair(search, both, answer, _step_of(search, answer), probe, max_probes)
    if len(search.probes) >= max_probes:
        return FROM_LOW  # (the search says it stopped at max_probes)
    # The plan at the aim did not fit, nor did its probe train: the plans' answer below it next.
    search.notes.append(f"the plan at {answer:,} did not fit: the plans' answer {planned:,} probed next")
    if probe(planned):
        return BETWEEN  # (within a step of the aim's failure: done; else the probes close in between)
    return _step_down(search, planned, _step_of(search, planned), probe, max_probes)


def _confirm(search, found, probe_one, progress, probe, max_probes: int) -> str:
    """The plans' answer probed, and the batch just past it (side by side where there is room for both)."""
    from ..units import format_bytes

    answer = found.batch
    step = _step_of(search, answer)
    proven, aborts = found.proven_failure, found.aborts_from
    if aborts is not None and answer < aborts <= answer + step and (proven is None or aborts < proven):
        proven, why = aborts, (f"batch {aborts:,} was not probed: at it the step makes a tensor of 2^31 elements, "
                               "which TensorFlow's own GPU kernels cannot count (the process aborts)")
    elif proven is not None:
        why = (f"batch {proven:,} was not probed: its plan needs {format_bytes(found.proven_bytes)} by its bytes alone, "
               f"over the {format_bytes(found.limit_bytes)} limit (a step never takes less than its plan)")
    past = min(search.high, answer + step)
    if getattr(probe_one, "plans_env", None) is not None and found.failure is not None and answer < found.failure < past:
        past = found.failure  # the batch past the answer that the plans compiled: its probe reads every kernel's timing
    last = answer >= search.high or (proven is not None and answer < proven <= answer + step)  # no probe past it
    pair = getattr(probe_one, "pair", None)
    if not last and pair is not None:
        _show_probing(search, progress, (answer, past))
        both = pair(answer, past)  # side by side, where the machine has room for both (else None)
        if both is not None:
            _show_probed(search, progress, both)
            return _after_pair(search, both, answer, step, probe, max_probes)
    margin = bool(search.margin)  # its probes follow the edge (search/next_probe.settle_recommended)
    if probe(answer, ahead=not last or margin):
        if answer >= search.high:
            return DONE
        if last:  # no probe past the answer: its plan fails whatever the process (its bytes, or an abort)
            search.planned_failure = min(b for b in (search.planned_failure, proven) if b)
            search.notes.append(why)
            return DONE
        return UP if probe(past, ahead=margin) else DONE  # trained too: the plans were low
    return _step_down(search, answer, step, probe, max_probes)


def _after_pair(search, both, answer: int, step: int, probe, max_probes: int) -> str:
    """How the search goes on after the answer and the batch past it were probed side by side."""
    if both[0].fits:
        return UP if both[1].fits else DONE
    return _step_down(search, answer, step, probe, max_probes)


def _show_probing(search, progress, batches) -> None:
    """The progress of probes begun side by side: each shown as begun."""
    for count, batch in enumerate(batches, len(search.probes) + 1):
        progress.probing(count, batch)


def _show_probed(search, progress, probes) -> None:
    """The same probes, read (the search's last ones): each shown as done."""
    for count, done in enumerate(probes, len(search.probes) - len(probes) + 1):
        progress.probed(count, done)


def _probe_with(search, probe_one, progress):
    """probe(batch, ahead=True): one probe, shown by the search's progress; whether it trained."""
    def probe(batch: int, ahead: bool = True) -> bool:
        progress.probing(len(search.probes) + 1, batch)
        done = probe_one(batch, ahead)
        progress.probed(len(search.probes), done)
        return done.fits

    return probe


def _step_down(search, answer: int, step: int, probe, max_probes: int) -> str:
    """The answer did not train: probe below it until a batch does (at most max_probes in all)."""
    # The plans were high (in a pool that grows, where its regions fall and the fit's own transients
    # decide): step down from the answer, farther each time, until a batch trains; the probes close in
    # between it and the smallest failure.
    for cut in (2 * step / answer, 0.12, 0.3):
        below = int(answer * (1 - cut))
        if below < search.low or len(search.probes) >= max_probes:
            break
        if probe(below):
            return BETWEEN
    return FROM_LOW
