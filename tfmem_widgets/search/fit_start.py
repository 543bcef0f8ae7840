"""The pool a fresh process's fit meets at its first step, read where it can be: lab mode.

A plan's ``fits()`` places the step in a fresh process's pool (``StepPlan.take_in_fresh_pool``).
From the variables alone it lays the weights, the slots and the batch end to end. A real process
gets there otherwise: each weight's initializer makes and frees tensors of its size (a draw, a
product, a sum), a tensor takes a free chunk whole under the no-split rule, and the fit's data
passes through a copy as its iterator starts, so the pool holds other regions and holes when the
step asks: a step the variables' model lets fit can fail there.

``read_fit_start`` reads that start in a search's planning process, set up as its probes are:
``build_model()`` traced from the process's start (its pool is then a probe's after the same call),
and what the probe's data takes for a while as its iterator starts. ``FitStart.take`` replays it
chunk by chunk (``tf/allocator.BfcPool``): that pool, the data (on a CPU the step reads it in place
as its batch), its iterator's copy given back, the optimizer's slots, then the step's allocations.
The slots as fit builds them: those of one shape and dtype share one buffer until the first step, which
writes each its own after the step's allocations (``StepPlan.shared_slots``), where a slot can find no room.
On a GPU the data path differs (search/plan_first.data_on_device) and the variables' model stands.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..tf.allocator import BfcPool


@dataclass(frozen=True)
class FitStart:
    """The pool after build_model() in a fresh process (a trace's map), and what the fit's data takes
    for a while as its iterator starts, per byte of batch (a copy of it: about 1.0)."""

    built: object  # tracing.allocator_map.AllocatorMap
    passing_share: float
    next_region: int | None = None  # the size the pool's next region starts from (the trace's replay)

    def take(self, planned, limit_bytes: int, held: tuple[int, ...] = ()) -> int | None:
        """What the allocator hands out for the step of `planned` after the fit's start, replayed;
        None where a request finds no room on the way (the step does not fit there)."""
        pool = BfcPool.of_map(self.built, limit_bytes, self.next_region)
        kept = [pool.take(size) for size in (*held, *planned.batch_sizes)]
        passing = [pool.take(int(size * self.passing_share)) for size in planned.batch_sizes if self.passing_share]
        if None in kept or None in passing:
            return None
        for chunk in passing:
            pool.give(chunk)
        rest, fresh = planned.held_before_step()
        for size in rest:  # the optimizer's slots, made as fit begins (those of one shape sharing one buffer)
            if pool.take(size) is None:
                return None
        taken = [pool.take(size) for size in planned.step_allocations]
        if None in taken or any(pool.take(size) is None for size in fresh):  # each shared slot its own buffer
            return None
        return sum(chunk[0] for chunk in taken)


def read_fit_start(build_model, make_batch, rows: int = 256):
    """build_model() traced in this fresh process (lab mode, nothing of TensorFlow's made yet), and
    make_batch(rows) made into the probe's data and its iterator started, measured. Returns the model
    and its FitStart; None in its place where the start cannot be read (not lab mode, a model not
    built by build_model or whose optimizer is built already, its device not the CPU, a trace that
    failed)."""
    from ..tf.allocator import LAB_ALLOCATOR_NAME
    from ..tf.lab import lab_limit_bytes

    if lab_limit_bytes() is None:
        return build_model(), None
    try:
        from ..tracing.block import trace

        block = trace()
        traced = block.__enter__()
    except Exception:  # the profiler did not start: the variables' model stands
        return build_model(), None
    try:
        model = build_model()
    except BaseException as exc:  # the user's error, as without the trace; the profiler stopped first
        try:
            block.__exit__(type(exc), exc, exc.__traceback__)
        except Exception:
            pass
        raise
    try:
        block.__exit__(None, None, None)
        built = traced.map(-1, allocator=LAB_ALLOCATOR_NAME)
        next_region = traced.replay(LAB_ALLOCATOR_NAME).next_region_bytes
    except Exception:  # its events could not be read
        return model, None
    optimizer = getattr(model, "optimizer", None)
    if not built.complete or not getattr(model, "built", False) or getattr(optimizer, "built", False):
        return model, None  # (an optimizer built already has its slots in the traced pool: not replayed twice)
    try:
        share = _passing_share(make_batch, model, rows)
    except Exception:  # make_batch failed at these rows: the search's own calls say so where they fail
        return model, None
    return model, (None if share is None else FitStart(built, share, next_region))


def _passing_share(make_batch, model, rows: int) -> float | None:
    """What the probe's data (probe.probe_dataset) takes and gives back as its iterator starts, per
    byte of make_batch(rows)'s arrays, measured on the model's device (None: not the CPU)."""
    import numpy as np
    import tensorflow as tf

    from ..plans.plan import device_of
    from .probe import probe_dataset

    device = device_of(model)
    if not device.startswith("CPU"):
        return None
    data = make_batch(rows)
    size = sum(np.asarray(part).nbytes for part in tf.nest.flatten(data))
    dataset = probe_dataset(data, 1)
    tf.config.experimental.reset_memory_stats(device)
    iterator = iter(dataset)
    info = tf.config.experimental.get_memory_info(device)
    del iterator, dataset, data
    return max(0, info["peak"] - info["current"]) / size if size else 0.0
