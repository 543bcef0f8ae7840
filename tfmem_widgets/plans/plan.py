"""Plan before you run: what a Keras train step needs, from XLA's own buffer assignment.

``plan(model, sample, batch_size)`` traces the train step the way ``fit`` runs it (the model's own
``train_step``, its optimizer and loss) from ``tf.TensorSpec``s with `batch_size` rows, has XLA
compile it, and reads the buffer assignment (``plans/hlo.py``): the step's bytes are XLA's temporary
allocation and its outputs, each as the allocator rounds it. Nothing runs and no batch is made. What
``fit`` would build before its first step (the optimizer's slots, the weights of a model not built
yet) is built the way ``fit`` builds it, and said.

The step takes the plan's bytes exactly when the pool has a free chunk to split; in a pool that grows,
the allocator hands out whole regions (its no-split rule), between the plan and ``worst_take_bytes``
(tests/test_plan.py checks both).
A model compiled without XLA (``jit_compile=False``, Keras' default on a CPU) runs another program:
its plan is the XLA program's, labelled an estimate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import ArgumentError, StateError
from ..readings.layers import LayerAnatomy, remember_program
from ..text import LinesText
from ..tf.allocator import GrowingPool, rounded, takes_whole, worst_take
from ..tf.devices import xla_autotune_level
from ..units import MiB, format_bytes
from . import aborts, hlo
from .replicas import plan_replicas, replicas_of
from .sample import batch_specs, check_sample
from .step import compile_step


@dataclass(repr=False)
class StepPlan(LinesText):
    """One train step planned at `batch_size` rows. Bytes are what TensorFlow's allocator hands out
    (256-byte steps).

    resident_bytes: the model's variables (weights, optimizer state, metrics), held before the step.
    batch_bytes: the batch on the device (the step's inputs).
    step_bytes: what the step takes beyond its inputs: XLA's temporary allocation and its outputs.
    worst_take_bytes: the most the allocator may hand out for those (no-split rule, region growth).
    """

    batch_size: int
    device: str  # 'CPU:0' (lab mode), 'GPU:0'
    resident_bytes: int
    resident_parts: dict[str, int]
    batch_bytes: int
    step_bytes: int
    step_allocations: tuple[int, ...]  # the step's allocations as XLA sizes them, largest first
    worst_take_bytes: int
    layers: LayerAnatomy  # the step's bytes live at its peak, by Keras layer and phase
    jit_compile: bool | None  # the model's own setting
    xla_flags: str  # XLA_FLAGS when it was compiled ('' for none)
    autotuning: str
    trace_seconds: float
    compile_seconds: float
    limit_bytes: int | None = None  # the device's limit when planned, and where it comes from
    limit_source: str = ""
    growth: bool = True  # the device's pool grows on demand
    resident_sizes: tuple[int, ...] = ()  # each variable's and each input's bytes, for the pool model
    batch_sizes: tuple[int, ...] = ()
    weight_count: int = 0  # how many of resident_sizes are the model's weights (made before a fit's data)
    # each of step_allocations' hlo.batch_profile: how its bytes move with the batch (what aims a search's next plan)
    step_profiles: tuple[tuple[tuple[int, int], ...], ...] = ()
    built: tuple[str, ...] = ()  # what plan() built the way fit would have (the optimizer's slots...)
    # the pool a fresh process's fit meets at its first step, where a search read it (search/fit_start.py: lab mode)
    fit_start: object | None = None
    notes: tuple[str, ...] = field(default=())
    # Where a fit builds the optimizer's slots itself (a batch search's fresh process: fit.slots_shared_by_fit),
    # groups of them (indices into resident_sizes) that start from one buffer. Fit initializes them in one
    # graph function, whose equal constants TensorFlow merges: the slots of one shape and dtype (Adam's
    # momentum and velocity of each kernel, of every kernel so shaped) share one tensor, and XLA, which may
    # update a variable in place only when its buffer is its own, writes each its own buffer at the first
    # step, after the step's own allocations. A GPU's first step was traced asking for its own allocations
    # alone: a search sets these for plans on the CPU only (search/plan_first.py).
    shared_slots: tuple[tuple[int, ...], ...] = ()
    # the step's largest tensors as its graph makes them (plans/aborts.py): where its ops run as TensorFlow's own
    # kernels (jit_compile=False), one of 2^31 elements or more aborts the process on a GPU
    big_tensors: tuple = ()
    # the temporaries' live bytes over the program, by Keras layer and phase (plans/timeline.py): what plot() draws
    timeline: object | None = None
    fit: object | None = None  # what the fit holds beside the step, share by share, and its peak (plans/fit.py)

    @property
    def same_program_anywhere(self) -> bool:
        """The program compiles the same in any process with these flags: no autotuner chooses its kernels
        by timing them (XLA on a CPU, or a GPU's autotuner off), so its buffers are the plan's."""
        return self.autotuning.startswith(("none", "off"))

    @property
    def estimate(self) -> bool:
        """The model runs its step without XLA: the plan is the XLA program's, not the one fit runs."""
        return self.jit_compile is not True

    @property
    def abort_risks(self) -> list:
        """The step's tensors of 2^31 elements or more where its ops run as TensorFlow's own kernels (not one
        XLA program): on a GPU each aborts the process (its kernels count elements in 32 bits). AbortRisks."""
        return [] if self.jit_compile is True else aborts.risks_at(self.big_tensors, self.batch_size)

    @property
    def largest_batch_before_abort(self) -> int | None:
        """The largest batch whose graph step makes no tensor of 2^31 elements (None: no such bound, or XLA)."""
        return None if self.jit_compile is True else aborts.largest_batch_under(self.big_tensors)

    @property
    def peak_bytes(self) -> int:
        """In use at the step's peak, from an empty device: resident + batch + step."""
        return self.resident_bytes + self.batch_bytes + self.step_bytes

    @property
    def fit_peak_bytes(self) -> int:
        """The fit's peak: placed in this process where it could be, else modelled in a fresh one (plans/fit.py);
        a plan not made by plan() knows no fit: its step's peak."""
        if self.fit is None:
            return self.peak_bytes
        return self.fit.peak_bytes if self.fit.peak_bytes is not None else self.fit.fresh_peak_bytes

    @property
    def worst_peak_bytes(self) -> int:
        return self.resident_bytes + self.batch_bytes + self.worst_take_bytes

    @property
    def first_step_bytes(self) -> int:
        """What a fit's first step holds beyond peak_bytes where fit builds the optimizer's slots: each
        shared buffer of shared_slots, held until the step has written every slot of it a buffer of its own."""
        return sum(self.resident_sizes[group[0]] for group in self.shared_slots)

    def held_before_step(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the variables after the weights as a fit holds them before its first step: one buffer for each group
        of shared_slots; the slots' own buffers the first step writes after its allocations)."""
        rest = range(self.weight_count, len(self.resident_sizes))
        later = {i for group in self.shared_slots for i in group[1:]}
        fresh = tuple(self.resident_sizes[i] for group in self.shared_slots for i in group)
        return tuple(self.resident_sizes[i] for i in rest if i not in later), fresh

    def by_layer(self) -> LayerAnatomy:
        """The step's bytes live at its peak by Keras layer and phase (forward activations,
        gradients, optimizer update); the model's variables are resident_parts."""
        return self.layers

    def take_in_fresh_pool(self, limit_bytes: int | None = None, held: tuple[int, ...] = ()) -> int | None:
        """What the allocator hands out for the step in a fresh process's pool: the weights, what the
        process holds besides (`held`: a fit's data, made before the optimizer's slots), the rest of the
        variables and the batch are taken first, then the step's allocations, each a whole free chunk
        where the no-split rule says so. A pool that grows (lab mode, growth on a GPU) makes regions that
        never merge; without growth the first tensor takes the whole limit as one region, and the step's
        largest buffer takes the rest of it whole when less than 128 MiB would remain. Where a search read
        the fit's start in its process (fit_start, lab mode), that start replayed instead. None when a
        request finds no room: the step does not fit there although its bytes might."""
        limit = self._limit(limit_bytes)
        if self.fit_start is not None:  # the process's own start, read: its build's pool and its data's copy
            return self.fit_start.take(self, limit, held)
        pool = GrowingPool(limit) if self.growth else GrowingPool(limit, first_region=limit)
        weights = self.resident_sizes[:self.weight_count]
        rest, fresh = self.held_before_step()
        for size in (*weights, *held, *rest, *self.batch_sizes):
            if pool.take(size) is None:
                return None
        taken = [pool.take(size) for size in self.step_allocations]
        if None in taken or any(pool.take(size) is None for size in fresh):
            return None
        return sum(taken)

    def take_bytes(self, pool, limit_bytes: int | None = None) -> int | None:
        """What the allocator hands out for the step in a pool as it is now: `pool` is an AllocatorMap
        of this device (a trace's map at its end, the recorder's, an OOM's dump). Each of the step's
        allocations takes the smallest free chunk that holds it (the allocator's best fit), whole where
        its no-split rule says so; where none does and the pool grows, a new region (twice its largest,
        as the allocator doubles them, or what the limit leaves). None: a request finds no room there,
        so the step fails in that pool whatever its bytes."""
        from bisect import bisect_left, insort

        if not pool.complete:
            raise StateError("this map's layout before its trace began is unknown (a trace started after "
                             "earlier work): its free chunks cannot be told; trace from the process's start.")
        free = sorted(c.size for c in pool.chunks if not c.in_use)
        limit = limit_bytes if limit_bytes is not None else (pool.limit_bytes or self.limit_bytes)
        grow = GrowingPool.resumed(int(limit), [r.size for r in pool.regions]) if self.growth and limit else None
        total = 0
        for size in self.step_allocations:
            request = rounded(size)
            k = bisect_left(free, request)
            if k < len(free):
                chunk = free.pop(k)
                taken = chunk if takes_whole(chunk, size) else request
                if taken < chunk:
                    insort(free, chunk - taken)
                total += taken
                continue
            taken = grow.take(size) if grow is not None else None
            if taken is None:
                return None
            total += taken
        return total

    def fits(self, limit_bytes: int | None = None, held: tuple[int, ...] = (), regions: bool | None = None) -> bool:
        """Whether the step fits under `limit_bytes` (None: the device's limit when planned): its peak
        (with `held`, bytes the process holds besides) within the limit, and each of its allocations
        finding room in the pool a fresh process has made by then (take_in_fresh_pool: regions that
        never merge where the pool grows, one region of the whole limit where it does not, and whole
        chunks under the no-split rule in both). regions=False judges the bytes alone: an estimate for
        a graph step, which asks for each tensor apart where XLA asks for its temporaries as one buffer
        (None: as the step runs)."""
        limit = self._limit(limit_bytes)
        if self.abort_risks or self.peak_bytes + self.first_step_bytes + sum(held) > limit:
            return False  # (a tensor past 2^31 elements aborts the step at any limit)
        if regions is None:
            regions = not self.estimate
        return not regions or self.take_in_fresh_pool(limit, held) is not None

    def least_limit_bytes(self, held: tuple[int, ...] = (), regions: bool | None = None) -> int:
        """The least limit, to a MiB, under which fits() holds: the peak with `held` where the pool
        places every allocation, more where a buffer takes a whole chunk (the no-split rule) or a
        region falls short; searched up from the peak by doubling steps, then halved back."""
        need = -(-(self.peak_bytes + self.first_step_bytes + sum(held)) // MiB) * MiB
        if self.fits(need, held, regions):
            return need
        low, step = need, MiB
        while not self.fits(need + step, held, regions):
            low, step = need + step, step * 2
            if step > max(need, 1 << 30) * 4:
                return need + step  # nothing near: the pool model finds no room (not expected)
        high = need + step
        while high - low > MiB:
            middle = (low + high) // 2 // MiB * MiB
            if middle <= low:
                break
            if self.fits(middle, held, regions):
                high = middle
            else:
                low = middle
        return high

    def _limit(self, limit_bytes: int | None) -> int:
        limit = self.limit_bytes if limit_bytes is None else limit_bytes
        if limit is None:
            raise ArgumentError("this plan knows no limit of its device: pass limit_bytes.")
        return int(limit)

    # -- text and picture ------------------------------------------------------------------
    def lines(self) -> list[str]:
        how = "an XLA program, as fit runs it" if not self.estimate else (
            "ESTIMATE: the model is compiled with jit_compile=False, so fit runs another program; this is the "
            "same step under XLA")
        out = [f"tfmem plan: the train step at batch {self.batch_size:,} on {self.device} ({how})"]
        parts = ", ".join(f"{name} {format_bytes(b)}" for name, b in self.resident_parts.items() if b)
        out.append(f"  resident {format_bytes(self.resident_bytes)} ({parts or 'no variables'}), "
                   f"batch {format_bytes(self.batch_bytes)}, step {format_bytes(self.step_bytes)}")
        line = f"  peak {format_bytes(self.peak_bytes)}"
        take = self.take_in_fresh_pool() if self.limit_bytes is not None and not self.estimate else None
        if self.limit_bytes is not None:
            spare = self.limit_bytes - self.peak_bytes
            line += f" of the {format_bytes(self.limit_bytes)} limit ({self.limit_source}): "
            if spare < 0:
                line += f"does not fit, {format_bytes(-spare)} short"
            elif self.growth and not self.estimate and take is None:
                line += (f"does not fit although {format_bytes(spare)} is spare: the pool grows in regions that never "
                         "merge, and in a fresh process's pool a request finds no room on the way to the step's peak")
            elif not self.estimate and take is None:
                line += (f"does not fit although {format_bytes(spare)} is spare: the pool is one region of the whole "
                         "limit (no growth), the step's largest buffer takes the rest of it whole (a free chunk is "
                         "split only when 128 MiB or more would remain, or it is twice the request), and the step's "
                         "next allocation finds no room")
            else:
                line += f"fits, {format_bytes(spare)} to spare"
                if take is not None and take != self.step_bytes:  # the same in the pool's terms, said beside it
                    line += f" by its bytes, {format_bytes(spare - (take - self.step_bytes))} as a fresh pool places it"
        out.append(line)
        out.append(f"  the allocator may hand out up to {format_bytes(self.worst_take_bytes)} for the step "
                   "(whole chunks under its no-split rule)"
                   + (f"; in a fresh process's {'growing' if self.growth else 'preallocated'} pool "
                      f"{format_bytes(take)}" if take is not None else ""))
        out += self._abort_lines() + (self.fit.lines(self) if self.fit is not None else [])
        out.append(f"  compiled in {self.compile_seconds:.1f} s (traced in {self.trace_seconds:.1f} s); "
                   f"XLA_FLAGS {self.xla_flags or 'unset'}; autotuning: {self.autotuning}")
        if len(self.layers):
            out.append("  the step at its peak, by layer:")
            out += ["  " + line for line in self.layers.lines(top=8)]
        if self.built:
            out.append(f"  note: built as fit builds it before its first step: {', '.join(self.built)}")
        if self.first_step_bytes:
            out.append(f"  note: a fit's first step holds {format_bytes(self.first_step_bytes)} more: the optimizer's "
                       f"slots of one shape start from one buffer, and the step writes each its own")
        out += [f"  note: {n}" for n in self.notes]
        return out

    def _abort_lines(self) -> list[str]:
        risks = self.abort_risks
        if not risks:
            return []
        below = self.largest_batch_before_abort
        where = "" if self.device.startswith("GPU") else f" (a GPU kernel's limit: on {self.device} the step runs)"
        out = [f"  ABORTS on a GPU{where}: {len(risks)} tensor(s) of the step reach 2^31 elements, more than TensorFlow's "
               "own GPU kernels count in 32 bits: one that meets such a tensor ends the process (SIGABRT), memory or not:"]
        out += [f"    {risk.line()}" for risk in risks[:6]]
        if len(risks) > 6:
            out.append(f"    ... and {len(risks) - 6} more")
        fix = f"a batch of at most {below:,}, or " if below is not None and below < self.batch_size else ""
        out.append(f"  what to do: {fix}compile with jit_compile=True (an XLA program indexes in 64 bits)")
        return out

    def plot(self, ax=None, limit_bytes: int | None = None, top: int = 8):
        """The program's buffers over the program from XLA's heap trace, by Keras layer and phase, the peak
        and the limit marked; without a trace, the step's peak against the limit (resident, batch, step, the
        worst take) and its `top` owners by layer (views/plans.py)."""
        from ..views.plans import plot_program, plot_step_plan

        if self.timeline is not None:
            return plot_program(self, ax, limit_bytes)
        return plot_step_plan(self, ax, limit_bytes, top)


def device_of(model) -> str:
    """Where the model's variables live, in short form: 'CPU:0' (lab mode), 'GPU:0'."""
    from ..tf.devices import resolve_device

    return resolve_device(_device_of(model)).name


def _xla_settings(device: str) -> tuple[str, str]:
    flags = os.environ.get("XLA_FLAGS", "")
    if not device.startswith("GPU"):
        return flags, "none (XLA on a CPU)"
    level = xla_autotune_level()
    if level == "0":
        return flags, "off (--xla_gpu_autotune_level=0): the plan holds for the program compiled with it off"
    return flags, (f"level {level or 'default'}: kernels tried at compile time on the device; the plan holds "
                   "for the program compiled the same way")


def _nbytes(shape, dtype) -> int:
    import tensorflow as tf

    count = 1
    for dim in shape:
        count *= int(dim)
    return count * tf.as_dtype(dtype).size


def _build_like_fit(model, specs) -> tuple[str, ...]:
    """What fit builds before its first step (Trainer._symbolic_build: the layers, the compiled loss
    and metrics, the optimizer's slots), built here from specs the same way; returns what was not
    built yet. Building inside the traced step would fail (variables made inside an XLA function)."""
    unbuilt = [name for name, pending in (
        ("the layers' weights", not all(layer.built for layer in model._flatten_layers())),
        ("the metrics", model._compile_metrics is not None and not model._compile_metrics.built),
        ("the loss", model._compile_loss is not None and not model._compile_loss.built),
        ("the optimizer's slots", model.optimizer is not None and not model.optimizer.built)) if pending]
    if unbuilt:
        model._symbolic_build(data_batch=specs)
    return tuple(unbuilt)


def _device_of(model) -> str:
    """Where the model's variables live, in TensorFlow's full form."""
    for variable in model.variables:
        device = getattr(getattr(variable, "value", variable), "device", "")
        if device:
            return device
    return "/job:localhost/replica:0/task:0/device:CPU:0"


def _profiles(proto, per_run, batch_size: int, index, model) -> tuple:
    """Each allocation's hlo.batch_profile; none where the batch cannot be told from the model's widths
    (hlo.told_apart) or the module cannot be read so: they aim a search, the plan stands alone."""
    if not hlo.told_apart(batch_size, hlo.widths_of(model)):
        return ()
    shapes = frozenset(tuple(int(d) for d in v.shape) for v in model.variables)
    try:
        return tuple(hlo.batch_profile(proto, a, batch_size, index, shapes) for a in per_run)
    except Exception:  # (an HLO module read otherwise than expected: no aim from it, the plan is whole)
        return ()


def plan(model, sample, batch_size: int, *, build: bool = False, place: bool = True):
    """The train step `fit` would run at `batch_size` rows, planned by XLA before it runs, and the fit around it:
    a StepPlan, or, for a model built under MirroredStrategy, a ReplicaPlan of each replica (plans/replicas.py).

    model: a compiled Keras model. sample: (x, y) as fit gets them (arrays, tensors, nested as Keras takes them:
    shapes, types, length read), or tf.TensorSpecs. build: an unbuilt model is built from the sample's shapes, as
    fit would (refused otherwise). place: the fit's peak placed in this process's pool, the compile's measured
    (plans/fit.py); False: neither, this process's allocator untouched (the searches', the OOM report's plans).

    >>> p = tfmem_widgets.plan(model, (x, y), batch_size=4096); p.step_bytes, p.fit_peak_bytes, p.fits()
    """
    batch_size = check_sample(model, sample, batch_size, build)
    if replicas_of(model) > 1:  # (nothing of the model built: its copy is planned, one replica's step)
        return plan_replicas(model, sample, batch_size, plan)
    return _plan_step(model, sample, batch_size, place)


def _plan_step(model, sample, batch_size: int, place: bool) -> StepPlan:
    """plan() of a model on one device, its sample checked."""
    import keras

    from ..tf.allocator import allocator_of_device
    from ..tf.devices import resolve_device
    from ..tf.limits import allocator_growth, limit_of
    from .fit import peak_kept, planned_fit
    from .owners import Owners, parameter_owners
    from .timeline import timeline_of

    specs = batch_specs(sample, batch_size)
    built = _build_like_fit(model, specs)
    device = _device_of(model)
    try:
        with peak_kept(resolve_device(device).name, place) as compile_seen:
            proto, concrete, trace_s, compile_s, scopes = compile_step(model, specs, device)
    except Exception as exc:  # TensorFlow's own words, in one line
        if getattr(model, "loss", None) is None and getattr(model, "_compile_loss", None) is None:
            raise ArgumentError("plan: the model was compiled without a loss: a train step needs one "
                                "(compile(loss=...)).") from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ArgumentError(f"plan: XLA could not compile the step at batch {batch_size:,} ({type(exc).__name__}: "
                            f"{first}).") from None
    allocations = hlo.allocations(proto)
    flat_specs = [s for s in keras.tree.flatten(specs) if s is not None]
    per_run = sorted((a for a in allocations if a.kind in hlo.PER_RUN), key=lambda a: -a.size)
    index = hlo.HloIndex(proto)
    owners = Owners(index, scopes, parameter_owners(model, concrete, len(flat_specs)))
    big = aborts.graph_tensors(concrete.graph, batch_size, owners.of_op)
    rows: dict[str, dict[str, int]] = {}
    for allocation in per_run:
        if allocation.kind == hlo.TEMP:
            _, live = hlo.live_at_peak(proto, allocation)
            pieces = list(live.items())
        else:  # an output: its buffers share it, the first names it
            pieces = [(allocation.buffers[0], allocation.size)] if allocation.buffers else []
        own: dict[str, dict[str, int]] = {}
        for buffer, size in pieces:
            key, phase = owners.of(index.instruction_of(buffer))
            for table in (rows, own):
                table.setdefault(key, {}).setdefault(phase, 0)
                table[key][phase] += size
        if allocation.kind == hlo.TEMP:
            remember_program(allocation.size, own)  # a trace of this program reads its buffer by it
    step = sum(rounded(a.size) for a in per_run)
    temp = next((a for a in per_run if a.kind == hlo.TEMP), None)
    timeline = None if temp is None else timeline_of(proto, temp, index, owners)
    # The model's state in the order fit makes it (weights, then the optimizer's slots), one size each:
    # the resident figures and the pool a fresh process has made before the step.
    state = {"weights": model.trainable_variables, "non-trainable": model.non_trainable_variables,
             "optimizer": model.optimizer.variables, "metrics": model.metrics_variables}
    sizes = {part: [_nbytes(v.shape, v.dtype) for v in variables] for part, variables in state.items()}
    batch_sizes = tuple(_nbytes(s.shape, s.dtype) for s in flat_specs)
    parts = {part: sum(each) for part, each in sizes.items()}
    name = resolve_device(device).name
    limit = limit_of(name)
    flags, autotuning = _xla_settings(name)
    planned = StepPlan(
        batch_size=batch_size, device=name, resident_bytes=sum(parts.values()), resident_parts=parts,
        batch_bytes=sum(batch_sizes), step_bytes=step,
        step_allocations=tuple(a.size for a in per_run),
        step_profiles=_profiles(proto, per_run, batch_size, index, model),
        worst_take_bytes=sum(worst_take(a.size) for a in per_run),
        layers=LayerAnatomy(rows, step), jit_compile=model.jit_compile, xla_flags=flags,
        autotuning=autotuning, trace_seconds=trace_s, compile_seconds=compile_s, limit_bytes=limit.bytes,
        limit_source=limit.source, growth=allocator_growth().get(allocator_of_device(name), True),
        resident_sizes=tuple(size for each in sizes.values() for size in each), batch_sizes=batch_sizes, built=built,
        weight_count=len(sizes["weights"]) + len(sizes["non-trainable"]), big_tensors=big, timeline=timeline)
    planned.fit = planned_fit(planned, sample, [s.dtype for s in flat_specs], compile_seen, place)
    return planned


def graph_abort_risks(model, sample, batch_size: int) -> tuple[list, int | None]:
    """A graph step's (jit_compile not True) tensors of 2^31 elements or more at `batch_size`, the largest
    first, and the largest batch under that limit, from the step traced alone: no XLA compile, so an
    autotuner that cannot compile a too-big program does not stand in the way (the guard asks this first).
    ([], None) for an XLA step. Builds what fit builds first, as plan() does."""
    from .owners import Owners

    if model.jit_compile is True:
        return [], None
    specs = batch_specs(sample, batch_size)
    _build_like_fit(model, specs)
    _, concrete, _, _, scopes = compile_step(model, specs, _device_of(model), compile=False)
    big = aborts.graph_tensors(concrete.graph, batch_size, Owners(None, scopes, {}).of_op)
    return aborts.risks_at(big, batch_size), aborts.largest_batch_under(big)
