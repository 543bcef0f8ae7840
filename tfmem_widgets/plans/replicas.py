"""A model built under ``tf.distribute.MirroredStrategy``, planned per replica.

Each replica holds the model's variables and its optimizer's slots (mirrored), runs the train step on its share
of the global batch, then all-reduces the gradients before each replica applies them. ``plan()`` of such a model
plans one replica's step from a copy of the model made outside the strategy on the first replica's device
(plans/copy.py: the user's model and its optimizer are left unbuilt, as its fit expects them), at each replica's
rows, and adds what a replica holds beside its step:

- the all-reduce's buffers, by the strategy's cross-device ops (tensorflow/python/distribute/cross_device_utils.py
  and cross_device_ops.py): a packed all-reduce (``CollectiveAllReduce``, TensorFlow's default since 2.x, RING on
  CPUs and on logical GPUs, NCCL on physical GPUs; ``NcclAllReduce``, ``HierarchicalCopyAllReduce``) flattens
  every gradient into one pack (a concat), reduces it and splits it back: the gradients and their pack, then the
  pack and its split, at most twice the gradients at once. ``ReductionToOneDevice`` copies every replica's
  gradients to one device (the first replica's unless told) and adds them there: that device holds them all and
  their sum, the others their own and the sum sent back;
- the data, where Keras converts the fit's arrays, on the default device, the first replica's;
- each replica's batch, and the next one the distributed dataset fetches to its device ahead; where the replicas
  share one allocator (logical CPUs in lab mode) a replica's batch is a slice of the input pipeline's global batch,
  the same buffer (a trace of such a fit shows no copy), counted once in the pipeline's share.

Keras compiles the step under ``tf.distribute`` without XLA (its ``jit_compile="auto"`` resolves to False
there): the step each replica runs is TensorFlow's graph. On a GPU the replica's step is the graph executor's
walk of the traced step (plans/graphstep.py: it equals the step's tensors a trace of the fit shows at the peak
on an H100); on logical CPUs, whose executor runs ops side by side on its threads, it is XLA's plan of the same
step (lab graph steps peaked from 0.3% under it to 15% over it: no one order bounds the threads'). The first GPU also holds,
as traces of such a fit show there (an H100, docs/plans.md), one more global batch kept as a constant beside the
data and a third batch fetched ahead: measured, not derived, and said so. The shares are assumed from
TensorFlow's sources, each said so. In lab mode the logical CPUs share one allocator: the pool holds every
replica's share at once, and that sum is the figure a limit is judged by.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

from ..errors import ArgumentError
from ..text import LinesText, marked
from ..units import format_bytes
from .copy import model_copy
from .fit import INDEX_BYTES, in_flight
from .sample import batch_specs

PACKED = ("CollectiveAllReduce", "NcclAllReduce", "HierarchicalCopyAllReduce", "AllReduceCrossDeviceOps")
TO_ONE = "ReductionToOneDevice"


@dataclass(frozen=True)
class ReplicaShare:
    """What one replica's device holds at its peak, share by share (bytes as asked)."""

    device: str  # 'GPU:1', 'CPU:0'
    rows: int  # its share of the global batch
    resident_bytes: int  # its copy of the variables: weights, optimizer slots, metrics
    batch_bytes: int  # its batch, the step's inputs
    step_bytes: int  # the replica's step at its rows beyond its inputs (an estimate: see step_source)
    reduce_bytes: int  # held while the gradients are all-reduced (assumed: the activations are given back by then)
    ahead_bytes: int = 0  # the next batch the distributed dataset fetched to this device
    data_bytes: int = 0  # the fit's data converted on this device (the first replica's: the default device)
    pipeline_bytes: int = 0  # the input pipeline's buffers here (lab mode: its tf.data runs in the same pool)
    batch_in_pipeline: bool = False  # its batches are slices of the pipeline's (a shared pool): counted there
    step_source: str = "XLA's plan"  # or "the graph's walk" (a GPU: plans/graphstep.py)
    first_extra_bytes: int = 0  # the first GPU: one more global batch and a third batch (measured in traces)

    @property
    def peak_bytes(self) -> int:
        """Resident, data, pipeline, its batches, and the larger of its step and its all-reduce."""
        batches = 0 if self.batch_in_pipeline else self.batch_bytes + self.ahead_bytes
        return (self.resident_bytes + self.data_bytes + self.pipeline_bytes + batches + self.first_extra_bytes
                + max(self.step_bytes, self.reduce_bytes))


@dataclass(repr=False)
class ReplicaPlan(LinesText):
    """A MirroredStrategy fit's train step at `global_batch`, planned per replica."""

    strategy: str
    cross_device_ops: str
    global_batch: int
    replicas: tuple[ReplicaShare, ...]
    gradient_bytes: int  # the gradients one replica all-reduces: its trainable weights' bytes
    reduce_rule: str  # how the all-reduce's bytes were counted, in words
    shared_pool: bool  # the replicas' devices share one allocator (logical CPUs in lab mode)
    limit_bytes: int | None = None  # the busiest replica's device's limit (the shared pool's in lab mode)
    limit_source: str = ""
    plans: dict = field(default_factory=dict)  # rows -> the StepPlan of one replica's step (the model's copy)
    jit_compile: bool | None = None  # the model's own setting
    first_rows: tuple[int, ...] = ()  # the fit's first batch per replica where they differ (its fit fails: uneven)

    @property
    def estimate(self) -> bool:
        return True  # (a graph step each, and the all-reduce's shares assumed)

    @property
    def xla_refused(self) -> bool:
        """The fit cannot start: compiled with jit_compile=True, Keras' fit under MirroredStrategy raises before its
        first step (TensorFlow 2.21, Keras 3.15: on two logical CPUs and on two logical GPUs of an H100)."""
        return self.jit_compile is True

    @property
    def uneven(self) -> bool:
        """The fit cannot start: Keras' fit under a strategy reduces its first batch across the replicas (a MEAN, to
        build the model: keras/src/backend/tensorflow/trainer.py, _maybe_symbolic_build), which needs every replica's
        rows alike; a first batch that does not divide by the replicas raises InvalidArgumentError (Keras 3.15)."""
        return len(set(self.first_rows)) > 1

    def uneven_text(self) -> str:
        """Why an uneven first batch cannot start, and what can: a global batch, or where the data is the first
        batch (fewer rows than the batch), a number of rows, that divides by the replicas."""
        n, first = len(self.replicas), sum(self.first_rows)
        split = " and ".join(f"{r:,}" for r in self.first_rows)
        what = (f"give a global batch that divides by {n}, such as {max(n, first - first % n):,}"
                if first == self.global_batch else
                f"its data has {first:,} rows, fewer than the batch of {self.global_batch:,}, so they are the first "
                f"batch: give a number of rows that divides by {n}, such as {max(n, first - first % n):,}")
        return (f"its first batch splits {split} over the {n} replicas, and Keras' fit, which reduces that batch "
                f"across them to build the model, cannot start it; {what}")

    @property
    def busiest(self) -> ReplicaShare:
        return max(self.replicas, key=lambda r: r.peak_bytes)

    @property
    def peak_bytes(self) -> int:
        """What decides whether the fit fits: the busiest replica's peak on its device, or, where the replicas
        share one allocator, the sum of theirs."""
        return sum(r.peak_bytes for r in self.replicas) if self.shared_pool else self.busiest.peak_bytes

    fit_peak_bytes = peak_bytes

    def fits(self, limit_bytes: int | None = None) -> bool:
        limit = self.limit_bytes if limit_bytes is None else limit_bytes
        if limit is None:
            raise ArgumentError("this plan knows no limit of its devices: pass limit_bytes.")
        return self.peak_bytes <= limit

    def plot(self, ax=None, limit_bytes: int | None = None):
        """Each replica's peak as a stacked bar of its shares, the limit drawn (views/plans.py)."""
        from ..views.plans import plot_replicas

        return plot_replicas(self, ax, limit_bytes)

    def lines(self) -> list[str]:
        varies = self.replicas[0].device.startswith("CPU")
        devices = ", ".join(r.device for r in self.replicas)
        rows = sorted({r.rows for r in self.replicas}, reverse=True)
        each = " or ".join(f"{n:,}" for n in rows)
        how = ("the graph executor's walk of one replica's traced step" if self.replicas[0].step_source != "XLA's plan"
               else "XLA's plan of one replica's step")
        jit = ("ESTIMATE: Keras runs a step under tf.distribute without XLA (jit_compile resolves to False there), "
               f"each replica's step is {how}" if self.jit_compile is not True else f"ESTIMATE: each replica's step is {how}")
        out = [f"tfmem plan: {self.strategy} over {len(self.replicas)} replicas ({devices}), global batch "
               f"{self.global_batch:,}: {each} rows each ({jit}, on a copy of the model)"]
        out.append(f"  the gradients: {format_bytes(self.gradient_bytes)} per replica, all-reduced by "
                   f"{self.cross_device_ops} ({self.reduce_rule})")
        for r in self.replicas:
            parts = [f"resident {format_bytes(r.resident_bytes)}"]
            if r.batch_in_pipeline:
                parts.append(f"batch {format_bytes(r.batch_bytes)} (a slice of the input pipeline's global batch: counted "
                             "there)")
            else:
                parts.append(f"batch {format_bytes(r.batch_bytes)}")
            if r.ahead_bytes and not r.batch_in_pipeline:
                parts.append(f"the next batch {format_bytes(r.ahead_bytes)} (assumed)")
            if r.data_bytes:
                parts.append(f"the data {format_bytes(r.data_bytes)} (assumed: the default device's)")
            if r.pipeline_bytes:
                parts.append(f"the input pipeline {marked(format_bytes(r.pipeline_bytes), True, '(this machine)')}"
                             " (assumed)")
            if r.first_extra_bytes:
                parts.append(f"one more global batch and a third batch {format_bytes(r.first_extra_bytes)} (measured in "
                             "traces of such fits on an H100, assumed here)")
            larger = "step" if r.step_bytes >= r.reduce_bytes else "all-reduce"
            source = "planned" if r.step_source == "XLA's plan" else "walked"
            parts.append(f"the larger of its step {marked(format_bytes(r.step_bytes), varies)} ({source}) and its "
                         f"all-reduce {format_bytes(r.reduce_bytes)} (assumed): the {larger}")
            out.append(f"  {r.device} ({r.rows:,} rows): peak {marked(format_bytes(r.peak_bytes), varies)} = "
                       + " + ".join(parts))
        out.append(self._verdict(varies))
        if self.uneven:
            out.append(f"  FAILS before its first step: {self.uneven_text()} (TensorFlow: 'Inputs to operation AddN ... "
                       "must have the same size and shape')")
        if self.xla_refused:
            out.append("  FAILS before its first step: Keras' fit with jit_compile=True under MirroredStrategy has XLA compile "
                       "the replicas' step on the first replica's device, which cannot read the other replicas' variables "
                       "(TensorFlow: 'Trying to access resource ... located in device ...'); compile with jit_compile=False "
                       "(or \"auto\", which is False here)")
        return out

    def _verdict(self, varies: bool) -> str:
        peak = marked(format_bytes(self.peak_bytes), varies)
        what = (f"  the shared pool (the logical CPUs share one allocator) holds every replica's: {peak}"
                if self.shared_pool else f"  the busiest replica, {self.busiest.device}: {peak}")
        if self.limit_bytes is None:
            return what + " (its device's limit is not known)"
        spare = self.limit_bytes - self.peak_bytes
        left = marked(format_bytes(abs(spare)), varies)  # (from the planned step: it varies as the step does)
        verdict = f"fits, {left} to spare" if spare >= 0 else f"does not fit, {left} short"
        return f"{what} of the {format_bytes(self.limit_bytes)} limit ({self.limit_source}): {verdict}"


def replicas_text(planned: ReplicaPlan) -> str:
    """How the need of a fit over replicas was planned, in words (StepNeed.lines)."""
    where = ("all of them in the one shared pool" if planned.shared_pool
             else f"the busiest replica's, {planned.busiest.device}")
    return (f"the plan of its {len(planned.replicas)} replicas' shares, {where}; an estimate: a graph step on each "
            f"replica, the all-reduce of {format_bytes(planned.gradient_bytes)} of gradients assumed")


def replicas_of(model) -> int:
    try:
        return int(model.distribute_strategy.num_replicas_in_sync)
    except Exception:  # a Keras without the attribute: one device
        return 1


def split_rows(global_batch: int, replicas: int) -> list[int]:
    """The global batch's rows per replica as tf.distribute splits a batch: evenly, the first replicas one
    more where it does not divide (7 over 2: 4 and 3)."""
    base, rest = divmod(global_batch, replicas)
    return [base + (k < rest) for k in range(replicas)]


def reduce_bytes(kind: str, gradients: int, replicas: int, first: bool) -> tuple[int, str]:
    """What a replica holds while the gradients are all-reduced, beyond its variables and batch, and the rule."""
    if kind == TO_ONE:
        rule = ("every replica's gradients copied to the first replica's device and added there, the sum sent back: "
                f"{replicas + 1} times the gradients there, twice elsewhere; assumed")
        return (replicas + 1) * gradients if first else 2 * gradients, rule
    known = kind in PACKED
    rule = ("one pack of every gradient, reduced and split back: the gradients and their pack, then the pack and its "
            "split, twice the gradients at once; assumed" + ("" if known else f" for {kind} as for a packed all-reduce"))
    return 2 * gradients, rule


def cross_device_ops_of(strategy) -> str:
    extended = strategy.extended
    ops = getattr(extended, "_cross_device_ops", None) or getattr(extended, "_inferred_cross_device_ops", None)
    return type(ops).__name__ if ops is not None else "CollectiveAllReduce"


def _check_strategy(model) -> tuple[object, list[str]]:
    import tensorflow as tf

    strategy = model.distribute_strategy
    name = type(strategy).__name__
    if not isinstance(strategy, tf.distribute.MirroredStrategy):
        raise ArgumentError(f"plan: the model was built under {name}, which plan() does not plan (one host's "
                            "MirroredStrategy only): plan one replica's step, the same model built without the "
                            "strategy, at its share of the global batch.")
    if tf.distribute.has_strategy():
        raise ArgumentError("plan: called inside a strategy's scope: call it outside `with strategy.scope()`, as fit is "
                            "called (the replica's copy is made without the strategy).")
    from ..tf.devices import resolve_device

    return strategy, [resolve_device(d).name for d in strategy.extended.worker_devices]


def plan_replicas(model, sample, global_batch: int, planner) -> ReplicaPlan:
    """The step of a model built under MirroredStrategy at `global_batch`, per replica: `planner` (plan()) makes
    the plan of one replica's step at each replica's rows from a copy of the model on the first replica's device."""
    from ..tf.limits import limit_of

    strategy, devices = _check_strategy(model)
    first = devices[0]
    copy = model_copy(model, f"/{first}", f"on {first} without the strategy")
    rows_each = split_rows(global_batch, len(devices))
    plans = {rows: planner(copy, batch_specs(sample, rows), rows, build=True, place=False)
             for rows in sorted(set(rows_each)) if rows}
    if not plans:
        raise ArgumentError(f"plan: a global batch of {global_batch:,} gives no replica of {len(devices)} a row.")
    kind = cross_device_ops_of(strategy)
    gradients = plans[max(plans)].resident_parts["weights"]  # (the trainable variables' bytes: one gradient each)
    shared = all(d.startswith("CPU") for d in devices)
    walked = {} if shared else {rows: _graph_step(copy, sample, rows, first) for rows in plans}
    data, pipeline = _data_shares(sample, plans[max(plans)], global_batch, shared)
    replicas = []
    for k, (device, rows) in enumerate(zip(devices, rows_each)):
        planned = plans.get(rows)
        held, rule = reduce_bytes(kind, gradients, len(devices), k == 0)
        if planned is None:  # (a replica with no row: its variables, its share of the all-reduce)
            replicas.append(ReplicaShare(device, 0, plans[max(plans)].resident_bytes, 0, 0, held))
            continue
        extra = 0
        if k == 0 and data is not None and not shared:  # (one more global batch, a third batch: measured)
            extra = global_batch * sum(size // rows for size in planned.batch_sizes) + planned.batch_bytes
        replicas.append(ReplicaShare(
            device, rows, planned.resident_bytes, planned.batch_bytes, walked.get(rows, planned.step_bytes), held,
            ahead_bytes=planned.batch_bytes if data is not None else 0, batch_in_pipeline=shared and data is not None,
            data_bytes=(data or 0) if k == 0 else 0, pipeline_bytes=pipeline if k == 0 else 0,
            step_source="the graph's walk" if rows in walked else "XLA's plan", first_extra_bytes=extra))
    del copy
    gc.collect()  # (the copy's variables, held in reference cycles of its traced step, leave the pool now, before a fit)
    busiest = max(replicas, key=lambda r: r.peak_bytes).device
    limit = limit_of(first if shared else busiest)
    first = split_rows(min(global_batch, rows_of(sample) or global_batch), len(devices))
    return ReplicaPlan(type(strategy).__name__, kind, global_batch, tuple(replicas), gradients, rule, shared,
                       limit.bytes, limit.source, plans, model.jit_compile, tuple(first) if len(set(first)) > 1 else ())


def _graph_step(copy, sample, rows: int, device: str) -> int:
    """One replica's graph step at `rows` on a GPU: the executor's walk of the traced step (no XLA compile)."""
    from .graphstep import graph_step_peak
    from .step import compile_step

    _, concrete, _, _, _ = compile_step(copy, batch_specs(sample, rows), f"/{device}", compile=False)
    return graph_step_peak(concrete.graph).bytes


def _data_shares(sample, planned, global_batch: int, shared: bool) -> tuple:
    """(the fit's arrays as they land on the first replica's device, the input pipeline's buffers there); (None, 0)
    where the sample holds no data (TensorSpecs, or fewer rows than a batch)."""
    import keras
    import tensorflow as tf

    rows = rows_of(sample)
    if rows is None or rows < global_batch:
        return None, 0
    leaves = [leaf for leaf in keras.tree.flatten(sample) if leaf is not None]
    per_row = [size // planned.batch_size for size in planned.batch_sizes]
    gpu = not shared
    arrays = sum(row * rows for row, leaf in zip(per_row, leaves)
                 if not tf.is_tensor(leaf) and not (gpu and planned.batch_sizes and _int32(leaf)))
    if not shared:
        return arrays, 0
    full, rest = divmod(rows, global_batch)
    count = min(full + bool(rest), in_flight())
    batch = sum(per_row) * global_batch
    return arrays, 2 * INDEX_BYTES * rows + count * batch


def rows_of(sample) -> int | None:
    """The rows of the fit's data where the sample holds it (arrays or tensors), else None (TensorSpecs)."""
    import keras
    import tensorflow as tf

    leaves = [leaf for leaf in keras.tree.flatten(sample) if leaf is not None]
    if not leaves or any(isinstance(leaf, tf.TensorSpec) for leaf in leaves) or not getattr(leaves[0], "shape", None):
        return None
    return int(leaves[0].shape[0])


def _int32(leaf) -> bool:
    return str(getattr(leaf, "dtype", "")) in ("int32", "<dtype: 'int32'>")
