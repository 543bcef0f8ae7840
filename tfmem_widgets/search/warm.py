"""A batch search's probes, each in a process started before its batch is known.

A probe's fresh process spends most of a small probe importing Python's and TensorFlow's modules.
``WarmProbes`` keeps the next probe's process started ahead: it imports TensorFlow, Keras and IPython
and waits, starting nothing of TensorFlow's runtime (no device made, no memory taken: a GPU's default
limit is read when its probe begins, as in a cold probe, and a waiting process holds nothing on the
card). When the batch is known the process goes on exactly as a cold probe does, from its setup on;
meanwhile the next one starts.
The search's plans (search/plan_first.py) run while the first one imports.

Two probes can run side by side (``probe_pair``), each in a process of its own under its own limit,
where the machine has room for both (``room_for_two``): a plan search's answer and the batch just
past it, one probe's time instead of two. Those two are the search's last where its plans were right,
so no process is started after them for a later probe (``ahead=False``): on a small machine its import
would take the cores the two probes run on, and a probe the search needs after all starts its process then.
``begin`` starts them and returns what reads them: a plan search's pair may begin while its last plan
compiles.

On a GPU the probes read what XLA's autotuner timed while the plans compiled (``SharedAutotune``):
a probe at a planned batch then compiles its step without timing its kernels again (the autotuner's
seconds of trials, and its scratch on the card), so it ends at its allocator's first refusal, as in lab
mode (search/probe.py); a kernel of other shapes is timed as before.

The processes are the search's: closing it (the search's end, an error, Ctrl-C) kills every one
it started, waiting or probing; a waiting process also ends by itself when its parent is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

from ..fresh.transport import tell_batch
from ..text import RunNote
from ..units import format_bytes
from .probe import DUMP_AUTOTUNE, LOAD_AUTOTUNE, PLANNED_BATCHES, SHARED_AUTOTUNE_ENV, Probe, probe_outcome, ran_past

# What a TensorFlow process takes beside its allocator's limit: on a GPU its CUDA context and cuBLAS'
# and cuDNN's workspaces, on the host its Python, libraries and kernels' scratch (lab mode's limit is
# its allocator's alone). Two probes side by side need their two limits and this twice.
BESIDES_THE_POOL = 2 << 30
# Two TensorFlow processes share the cores: on 2 a pair still gains a little, where no third process imports
# beside it (ahead=False); on 1 they would only take turns.
MIN_CORES = 2


WARM_CODE = """
from pathlib import Path
from tfmem_widgets.search.probe import run_probe
probe = run_probe({path!r}, int(Path({start!r}).read_text()), {steps})
"""


class _Waiting:
    """One probe process, started and waiting for its batch in the file `start`."""

    def __init__(self, path: Path, steps: int, setup: dict | None, env: dict):
        from ..fresh.run import run_checked

        self.start = path.parent / f"start-{uuid.uuid4().hex}"  # the batch is written there when it is known
        self.process: subprocess.Popen | None = None
        self.closed = threading.Event()
        self.outcome: tuple = ()
        self.ended: float | None = None
        code = WARM_CODE.format(path=str(path), start=str(self.start), steps=steps)

        def run():
            try:
                self.outcome = ("run", run_checked(code, setup=setup, env=env, returns=["probe"], timeout=None,
                                                   echo=False, remember_oom=False, start_when=str(self.start),
                                                   on_start=self._started))
            except BaseException as exc:  # handed to the caller of probe(), in its thread
                self.outcome = ("error", exc)
            self.ended = time.perf_counter()  # a pair's second probe counts to its own end, not the first's

        self.thread = threading.Thread(target=run, name="tfmem-warm-probe", daemon=True)
        self.thread.start()

    def _started(self, process: subprocess.Popen) -> None:
        from ..fresh.run import _kill_group

        self.process = process
        if self.closed.is_set():  # closed before its process had started: it ends now
            _kill_group(process)

    def begin(self, batch: int) -> float:
        """Hand the process its batch; returns when that was (the probe's seconds count from it)."""
        started = time.perf_counter()
        tell_batch(self.start, batch)
        return started

    def probe(self, batch: int, timeout: float | None, started: float | None = None) -> Probe:
        """The probe of `batch` (begun already where `started` is given), once its process has ended."""
        if started is None:
            started = self.begin(batch)
        # In short waits: a Ctrl-C's signal that reached another of this process's threads is raised here
        # at the next one (a long join wakes only for a signal delivered to this thread).
        while self.thread.is_alive() and (timeout is None or time.perf_counter() - started < timeout):
            self.thread.join(0.2 if timeout is None else min(0.2, max(0.0, timeout - (time.perf_counter() - started))))
        if self.thread.is_alive():
            self.kill()
            raise ran_past(batch, timeout)

        def result():
            kind, value = self.outcome
            if kind == "error":
                raise value
            return value

        return probe_outcome(batch, timeout, started, result, ended=self.ended)

    def kill(self) -> None:
        from ..fresh.run import _kill_group

        self.closed.set()  # set before the process is read; _started reads them the other way round
        if self.process is not None:
            _kill_group(self.process)
            try:  # gone before this returns: a join that Ctrl-C broke off may not wait for the thread
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.thread.join(10)


def room_for_two(setup: dict | None, env: dict | None, now: bool = True) -> str | None:
    """Where two probes can run side by side, each in a process of its own under its own limit, how
    (in words, for the search's notes); None where they cannot. Lab mode with no GPU for the probes:
    each under its lab limit, where the host has memory for both. A GPU: only under a limit set
    (limit_mb, or split's sizes), where every GPU the probes see has both limits free and more, by
    the driver's reading (NVML); a fresh process without a limit takes what it finds free, so two would
    split the card. Never on fewer than MIN_CORES cores (those this process may run on). Where NVML
    cannot be read the machine is taken to have no GPU (TensorFlow needs the same driver). now=False:
    whether the setup allows it at all, the free memory (the GPUs' and the host's) left unchecked."""
    import psutil

    from ..tf.limits import setup_gpu_mb
    from ..tf.nvml import NvmlUnavailable, nvml_index_for_cuda_ordinal, read_gpus

    setup, env = setup or {}, env or {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if "CUDA_VISIBLE_DEVICES" in env or cores < MIN_CORES:
        return None  # the probes' GPUs are not this process's to read; too few cores for two
    try:
        gpus = read_gpus()
    except NvmlUnavailable:
        gpus = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = len(gpus) if visible is None else len([e for e in visible.split(",") if e.strip()])
    ordinals = list(setup.get("gpus", range(count))) if gpus else []
    host = psutil.virtual_memory().available
    if not ordinals:
        if not setup.get("lab_mb"):
            return None
        need = 2 * ((setup["lab_mb"] << 20) + BESIDES_THE_POOL)
        if now and host < need:
            return None
        return (f"each under its {setup['lab_mb']} MB lab limit, with {format_bytes(host)} of the host's "
                "memory available")
    limits = {ordinal: setup_gpu_mb(setup, ordinal) for ordinal in ordinals}
    if None in limits.values() or (now and host < 2 * BESIDES_THE_POOL):
        return None
    free = []
    for ordinal, mb in limits.items():
        index = nvml_index_for_cuda_ordinal(ordinal, gpus)
        if index is None:
            return None
        if now and gpus[index].free_bytes < 2 * ((mb << 20) + BESIDES_THE_POOL):
            return None
        free.append(f"GPU {ordinal} had {format_bytes(gpus[index].free_bytes)} free")
    return f"each under its {_said(limits, setup.get('limit_mb'))} limit, where " + ", ".join(free)


def _said(limits: dict, asked) -> str:
    """The probes' limits in words: one figure where one was asked for every GPU, else GPU by GPU."""
    if isinstance(asked, dict) or len(set(limits.values())) > 1:
        return ", ".join(f"GPU {k}: {v} MB" for k, v in sorted(limits.items()))
    return f"{next(iter(limits.values()))} MB"


class WarmProbes:
    """probe(batch): one probe, in a process started ahead; the next one starts meanwhile (ahead=False:
    none, where no probe is expected after this one).
    probe_pair(a, b): two probes side by side, each in a process of its own; begin(a, b) starts them and
    returns what reads them (meanwhile this process is free). ready: how many
    processes wait at once (2 where a pair is to come, so both are imported when it does).
    close(): every process these probes started ended (waiting or probing), the functions' file
    removed. path: the pickled functions (build_model, make_batch), for a process of the same setup;
    autotune: the autotune results the probes read (SharedAutotune; None: none)."""

    def __init__(self, functions: bytes, steps: int, setup: dict | None, env: dict, timeout: float | None,
                 ready: int = 1):
        self._work = tempfile.mkdtemp(prefix="tfmem-batch-")
        self._current: list[_Waiting] = []
        self._ready: list[_Waiting] = []
        try:
            self.path = Path(self._work) / "functions.pickle"
            self.path.write_bytes(functions)
            self.autotune = SharedAutotune.of(env, setup, Path(self._work))
            if self.autotune is not None:
                env = self.autotune.probes_env(env)
            self.env = env
            self._args = (self.path, steps, setup, env)
            self._timeout = timeout
            for _ in range(ready):
                self._ready.append(_Waiting(*self._args))
        except BaseException:
            self.close()
            raise

    def _take(self, count: int, ahead: bool = True) -> list[_Waiting]:
        """`count` processes to probe in (the waiting ones first); ahead: one started to wait for the next
        probe (False: these are expected to be the last)."""
        taken = []
        for _ in range(count):
            waiting = self._ready[0] if self._ready else _Waiting(*self._args)
            self._current.append(waiting)  # the search's as soon as it is taken: close() ends it
            if self._ready and self._ready[0] is waiting:
                self._ready.pop(0)
            taken.append(waiting)
        if ahead and not self._ready:
            self._ready.append(_Waiting(*self._args))  # imports while these probe
        return taken

    def probe(self, batch: int, ahead: bool = True) -> Probe:
        return self.probe_pair(batch, ahead=ahead)[0]

    def probe_pair(self, *batches: int, each=lambda probe: probe, ahead: bool = True) -> list[Probe]:
        """Each batch probed in a process of its own, all at once (one, or two side by side); the
        probes in order of `batches`, each handed to each() as it is read (so an error or Ctrl-C in the
        second keeps the first's). An error in one ends the others too. ahead=False: no process is
        started for a probe after these (none is expected)."""
        return self.begin(*batches, ahead=ahead)(each)

    def begin(self, *batches: int, ahead: bool = True):
        """probe_pair's probes begun now; returns read(each=lambda probe: probe), which waits for them
        and returns them as probe_pair does. Until read, they run beside whatever this process does."""
        processes = self._take(len(batches), ahead)

        def ended(killed: bool) -> None:
            if killed:  # Ctrl-C or an error: the probes in flight end with it
                for process in processes:
                    process.kill()
            self._current = [w for w in self._current if w not in processes]

        try:
            started = [process.begin(batch) for process, batch in zip(processes, batches)]
            if self.autotune is not None and self.autotune.kernels:
                self.autotune.read_by += len(processes)  # (each reads them as its work begins)
        except BaseException:
            ended(killed=True)
            raise

        def read(each=lambda probe: probe) -> list[Probe]:
            try:
                probes = [each(process.probe(batch, self._timeout, begun))
                          for process, batch, begun in zip(processes, batches, started)]
            except BaseException:
                ended(killed=True)
                raise
            ended(killed=False)
            return probes

        return read

    def close(self) -> None:
        for waiting in (*self._current, *self._ready):
            waiting.kill()
        self._current, self._ready = [], []
        shutil.rmtree(self._work, ignore_errors=True)


class SharedAutotune:
    """XLA's autotune results of a search's plans, read by its probes: the planning process writes what
    its compiles timed (plans_env: XLA dumps them after each compile), and once it has ended, publish()
    puts them where every probe begun after that reads them (probes_env; probe.read_shared_autotune in the
    probe's process), whole: a probe begun while the plans compile reads nothing and times its own."""

    def __init__(self, work: Path):
        self.written, self.shared = work / "autotune-plans.txt", work / "autotune.txt"
        self.planned = work / PLANNED_BATCHES  # the batches whose programs the plans compiled (one a line)
        self.kernels = 0  # the kernel timings published (0: none yet)
        self.read_by = 0  # the probes begun since (WarmProbes.begin)

    @staticmethod
    def of(env: dict, setup: dict | None, work: Path) -> SharedAutotune | None:
        """The search's, on a GPU whose autotuner is on; None in lab mode (XLA on a CPU tunes nothing), with
        the autotuner off, and where XLA_FLAGS dumps or loads autotune results already (the user's own)."""
        from ..tf.devices import xla_autotune_level

        flags = _child_flags(env)
        mine = any(flag.startswith((DUMP_AUTOTUNE, LOAD_AUTOTUNE)) for flag in flags.split())
        if (setup or {}).get("lab_mb") or mine or xla_autotune_level(flags) == "0":
            return None
        return SharedAutotune(work)

    def plans_env(self, env: dict) -> dict:
        return {**env, "XLA_FLAGS": f"{_child_flags(env)} {DUMP_AUTOTUNE}={self.written}".strip()}

    def probes_env(self, env: dict) -> dict:
        return {**env, SHARED_AUTOTUNE_ENV: str(self.shared)}

    def publish(self, batches=()) -> None:
        """The plans' results put where the probes read them (nothing where none were written), with the
        batches the plans compiled (a probe at one of them finds every kernel of its step timed), and
        `kernels` set to how many kernel timings they hold."""
        if self.written.is_file():
            self.planned.write_text("".join(f"{batch}\n" for batch in batches))
            os.replace(self.written, self.shared)
            self.kernels = sum(line.startswith("results {") for line in self.shared.read_text().splitlines())


def _child_flags(env: dict) -> str:
    """The XLA_FLAGS a fresh process started with `env` has (env's own, else this process's)."""
    return env.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))


@contextlib.contextmanager
def probing(search, pairs: bool = False):
    """While the functions' file exists: probe_one(batch, ahead=True), one probe of a BatchSearch's in a
    fresh process set up like the others, added to the search's `probes` (ahead=False: the search
    expects no probe after it, so no process is started to wait for one). pairs: a pair of probes is to come (a plan
    search's answer and the batch past it): two processes wait, and probe_one.pair(a, b) runs both side
    by side where the machine has room for both now (room_for_two), else returns None (probe_one.pair is
    None without pairs); probe_one.begin_pair(a, b) begins them and returns a function that waits for
    both (None where there is no room), so they run while this process does something else."""
    functions, setup, env, timeout = search._run
    warm = WarmProbes(functions, search.steps, setup, env, timeout, ready=2 if pairs else 1)
    try:
        def taken(probe: Probe) -> Probe:
            if probe.limit_bytes is not None and search.limit_bytes is None:
                search.limit_bytes, search.limit_source = probe.limit_bytes, probe.limit_source
            search.probes.append(probe)
            return probe

        def probe_one(batch: int, ahead: bool = True) -> Probe:
            return taken(warm.probe(batch, ahead))

        def begin_pair(first: int, second: int):
            how = room_for_two(setup, warm.env)
            if how is None:
                return None
            read = warm.begin(first, second, ahead=False)  # the search's last where its plans hold

            def both() -> list[Probe]:
                probes = read(each=taken)
                search.overlap_seconds += min(probe.seconds for probe in probes)  # counted twice in the probes' sum
                search.notes.append(RunNote(f"batches {first:,} and {second:,} were probed side by side: two processes, "
                                            f"{how}"))
                return probes

            return both

        def pair(first: int, second: int) -> list[Probe] | None:
            both = begin_pair(first, second)
            return None if both is None else both()

        probe_one.path = warm.path  # the functions, for a plan search in a process of the same setup
        probe_one.plans_env = None if warm.autotune is None else warm.autotune.plans_env(env)

        # the planning process has ended: its autotune results are the probes' from now, with its plans' batches
        probe_one.plans_done = (lambda found: None) if warm.autotune is None else \
            (lambda found: warm.autotune.publish(() if found is None else [p.batch_size for p in found.plans]))
        probe_one.pair = pair if pairs else None
        probe_one.begin_pair = begin_pair if pairs else None
        yield probe_one
    finally:
        if warm.autotune is not None and warm.autotune.read_by:
            search.notes.append(RunNote(f"the probes begun after the plans read the {warm.autotune.kernels} kernel timings "
                                        "XLA's autotuner made while the plans compiled, instead of timing those "
                                        "kernels again"))
        warm.close()  # every process it started ended, the functions' file removed
