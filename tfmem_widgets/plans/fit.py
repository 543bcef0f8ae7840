"""What ``model.fit`` holds at its peak beyond the planned step, share by share, and that peak placed.

Keras' array adapter converts the NumPy arrays a fit is given with ``tf.convert_to_tensor``: the whole data set
lands on the model's device before the first step, each array one buffer (tensors already there are used as they
are). Its ``tf.data`` pipeline (an index permutation, a parallel gather of each batch, a prefetch) runs on the
host: on a GPU the device holds the step's own copy of the batch and no more. In lab mode the pipeline runs on
the same device as the step, so its buffers are in the pool: the permutation twice and, at most, every batch of
an epoch at once (tf.data autotunes how many it makes ahead; on the machines measured, all of them were held).

The peak is placed the way the fit will place it: its allocations, in the fit's order and sizes, taken from this
process's pool by TensorFlow's own allocator (uninitialized buffers: nothing is computed and no batch is made),
the bytes in use read, and each given back at once. Freed chunks merge back with their neighbours and regions
made on the way stay for the fit, which finds them so. A fresh process's pool is modelled instead
(``GrowingPool``: the allocator's rules), without the compile a fresh fit runs first, which the plan measured
around its own compile (``compile_bytes``: with XLA's GPU autotuner on, the kernels it tries on scratch buffers).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..text import THIS_MACHINE, marked
from ..units import MiB, format_bytes

INDEX_BYTES = 8  # Keras' permutation of the rows: int64


@dataclass(frozen=True)
class FitPlan:
    """A fit's shares beside its step (bytes as asked, one entry per buffer) and the peak they reach."""

    rows: int | None  # the data's length (the sample's), None: the sample holds no data (TensorSpecs)
    form: str  # 'arrays' (converted on the device), 'tensors' (held already), 'specs' or 'short' (no data)
    data: tuple[int, ...]  # the data the fit puts on the device
    data_held: tuple[int, ...]  # the sample's tensors, on the device already (a fresh process makes them first)
    pipeline: tuple[int, ...]  # the input pipeline's buffers on the device (lab mode)
    batch_copy: tuple[int, ...]  # the step's own copy of the batch (a GPU: its pipeline is on the host)
    batches: int = 0  # how many batches pipeline holds at once
    sample_rows: int = 0  # form 'short': the sample's rows, fewer than a batch
    in_use_bytes: int | None = None  # in use on the device when planned (measured)
    peak_bytes: int | None = None  # the fit's peak in this process, its allocations placed by its allocator
    fresh_peak_bytes: int = 0  # the same in a fresh process's pool, modelled
    compile_bytes: int | None = None  # the most the plan's compile held beyond what was in use (measured)

    def handed_out_beyond(self, planned) -> int:
        """What the fit's peak holds beyond the bytes its shares ask: whole chunks, the allocator's rounding."""
        first = self.in_use_bytes if self.peak_bytes is not None else (planned.resident_bytes + sum(self.data_held))
        asked = first + sum((*self.data, *self.pipeline, *self.batch_copy)) + planned.step_bytes
        return (self.peak_bytes if self.peak_bytes is not None else self.fresh_peak_bytes) - asked

    def lines(self, planned) -> list[str]:
        varies = planned.device.startswith("CPU")
        out = []
        if self.peak_bytes is not None:
            out.append(f"  the fit's peak in this process {marked(format_bytes(self.peak_bytes), varies)} (measured: its "
                       "allocations placed by this process's allocator, then given back), of which:")
            out.append(f"    in use when planned {marked(format_bytes(self.in_use_bytes or 0), varies)} (measured: the "
                       "model's variables and what else the process holds)")
        else:
            fresh = marked(format_bytes(self.fresh_peak_bytes), varies)
            out.append(f"  the fit's peak in a fresh process {fresh} (modelled: the allocator's rules), of which the "
                       "model's variables as planned above")
        if self.form in ("specs", "short"):
            what = "is TensorSpecs" if self.form == "specs" else f"has {self.sample_rows:,} rows, fewer than a batch"
            out.append(f"    the data: not known (the sample {what}: pass the fit's arrays for its share)")
        elif self.form == "tensors":
            out.append(f"    the data {format_bytes(sum(self.data_held))} (the sample's tensors, on the device already)")
        else:
            out.append(f"    the data {format_bytes(sum(self.data))} ({self.rows:,} rows; planned: Keras converts each "
                       f"array to one tensor on {planned.device})")
        if self.pipeline:
            held = marked(format_bytes(sum(self.pipeline)), True, THIS_MACHINE)
            out.append(f"    the input pipeline up to {held} (assumed: the row permutation twice and the batches it "
                       f"holds at once, {marked(str(self.batches), True, THIS_MACHINE)}: every batch of an epoch, at most "
                       "one per core for tf.data's map, one for its prefetch and the step's)")
        elif self.rows is not None:
            out.append("    the input pipeline: on the host (Keras' tf.data pipeline), none of it on the device")
        if self.batch_copy:
            out.append(f"    the step's copy of the batch {format_bytes(sum(self.batch_copy))} (planned)")
        out.append(f"    the step {marked(format_bytes(planned.step_bytes), varies)} (planned: XLA's buffers)")
        beyond = self.handed_out_beyond(planned)
        if beyond > 0:
            out.append(f"    handed out beyond those bytes {marked(format_bytes(beyond), varies)} (whole chunks under the "
                       "allocator's no-split rule, its 256-byte steps)")
        if self.compile_bytes and self.compile_bytes >= MiB:
            what = ": the autotuner's trials" if not varies else ""
            out.append(f"  its compile held up to {format_bytes(self.compile_bytes)} more at once (measured{what}); a "
                       "fit in a fresh process compiles first and may peak there")
        return out


def shares(planned, sample, dtypes) -> FitPlan:
    """The fit's shares from the sample (its full length: the fit's data), the plan's batch and the dtype of each of
    its batch's tensors, as Keras casts them."""
    import keras
    import tensorflow as tf

    def kind(leaf):
        return None if leaf is None else (
            "specs" if isinstance(leaf, tf.TensorSpec) else "tensors" if tf.is_tensor(leaf) else "arrays")

    kinds = [k for k in keras.tree.flatten(keras.tree.map_structure(kind, sample)) if k is not None]
    if not kinds or "specs" in kinds:
        return FitPlan(None, "specs", (), (), (), planned.batch_sizes)
    rows = int(next(leaf for leaf in keras.tree.flatten(sample) if leaf is not None).shape[0])
    if rows < planned.batch_size:  # a sample of the shapes, not the fit's data (a fit would make smaller batches)
        return FitPlan(None, "short", (), (), (), planned.batch_sizes, sample_rows=rows)
    batch, gpu = planned.batch_size, _on_gpu(planned)
    per_row = [size // batch for size in planned.batch_sizes]
    # (on a GPU, TensorFlow keeps int32 tensors in host memory: such an array is converted there)
    on_device = [not (gpu and dtype == tf.int32) for dtype in dtypes]
    data = tuple(row * rows for row, k, here in zip(per_row, kinds, on_device) if k == "arrays" and here)
    held = tuple(row * rows for row, k, here in zip(per_row, kinds, on_device) if k == "tensors" and here)
    form = "arrays" if "arrays" in kinds else "tensors"
    if gpu:
        return FitPlan(rows, form, data, held, (), planned.batch_sizes)
    full, rest = divmod(rows, batch)
    count = min(full + bool(rest), in_flight())
    if count == full + bool(rest):  # every batch of the epoch at once, the last one short
        batches = (*(planned.batch_sizes * full), *(row * rest for row in per_row if rest))
    else:
        batches = planned.batch_sizes * count
    pipeline = (INDEX_BYTES * rows, INDEX_BYTES * rows, *batches)
    return FitPlan(rows, form, data, held, tuple(s for s in pipeline if s), (), count)


def held_beside(planned, data_sizes: tuple[int, ...] = ()) -> tuple[int, ...]:
    """What a fit holds on the device beside its step's batch and allocations (StepPlan.fits' `held`, in the
    pool a fresh process makes): the data as it lands there and the pipeline's buffers on the step's device,
    from the plan's shares where its sample was the fit's data; else the arrays as the fit was given them
    (`data_sizes`) and, in lab mode, the batches Keras' pipeline holds at once beside the step's."""
    fit = planned.fit
    if fit is not None and fit.rows is not None:
        pipeline = list(fit.pipeline)
        for size in planned.batch_sizes if pipeline else ():  # (the step's batch is one of the pipeline's)
            if size in pipeline:
                pipeline.remove(size)
        return (*fit.data_held, *fit.data, *pipeline)
    ahead = () if _on_gpu(planned) else planned.batch_sizes * (in_flight() - 1)
    return (*data_sizes, *ahead)


def in_flight() -> int:
    """The batches Keras' pipeline holds at once where it runs on the step's device (lab mode): its map's
    autotuned parallelism (one per core this process may run on) and the prefetch's, one ahead, and the batch
    the step reads. Measured in lab mode on one core (3) and two (4); assumed beyond."""
    import os

    return len(os.sched_getaffinity(0)) + 2 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) + 2


def planned_fit(planned, sample, dtypes, compile_seen: list[int], place: bool = True) -> FitPlan:
    """The fit's plan beside `planned`: its shares, its peak placed in this process where the sample holds the
    data and the device keeps figures, and modelled in a fresh process's pool."""
    from dataclasses import replace

    fit = shares(planned, sample, dtypes)
    now, peak = placed(planned.device, fit_sizes(planned, fit), planned.limit_bytes) if fit.rows and place else (
        None, None)
    return replace(fit, in_use_bytes=now, peak_bytes=peak, fresh_peak_bytes=fresh_peak(planned, fit),
                   compile_bytes=compile_seen[0] if compile_seen else None)


def _on_gpu(planned) -> bool:
    return not planned.device.startswith("CPU")


def fresh_peak(planned, fit: FitPlan) -> int:
    """The fit's peak in a fresh process's pool (the allocator's rules, GrowingPool): the model's variables as
    the plan holds them, then the fit's data, its pipeline, the batch, the step; in use at the end."""
    from ..tf.allocator import GrowingPool

    limit = planned.limit_bytes or 1 << 50
    pool = GrowingPool(limit) if planned.growth or planned.limit_bytes is None else GrowingPool(limit, limit)
    sizes = (*planned.resident_sizes, *fit.data_held, *fit_sizes(planned, fit))
    taken = [pool.take(size) for size in sizes if size]
    unlimited = GrowingPool(1 << 50)  # where the limit refuses a request, the bytes it would have taken
    return sum(taken) if None not in taken else sum(unlimited.take(size) for size in sizes if size)


def fit_sizes(planned, fit: FitPlan) -> tuple[int, ...]:
    """The fit's allocations beside what is in use, in the order it makes them."""
    return (*fit.data, *fit.pipeline, *fit.batch_copy, *planned.step_allocations)


def placed(device: str, sizes: tuple[int, ...], limit: int | None) -> tuple[int | None, int | None]:
    """(in use now, in use with `sizes` taken from this process's pool as its allocator places them); the
    buffers are uninitialized and given back at once. None for the second where they do not all fit (by their
    bytes, or the allocator refuses one): the fit would not either. (None, None): the device keeps no figures."""
    import tensorflow as tf

    from ..tf.allocator import worst_take

    try:
        now = int(tf.config.experimental.get_memory_info(device)["current"])
    except (ValueError, RuntimeError):
        return None, None
    if limit is not None and now + sum(worst_take(s) for s in sizes) > limit:
        return now, None  # (never near the limit: a refusal would log the allocator's dump, as an OOM does)
    held = []
    with peak_kept(device):
        try:
            with tf.device(device):  # (float32 of the bytes rounded up: the same 256-byte chunk)
                held.extend(tf.raw_ops.Empty(shape=[-(-size // 4)], dtype=tf.float32) for size in sizes if size)
            if any(not t.device.endswith(device) for t in held):
                return None, None  # (placed elsewhere: this device's pool was not asked)
            return now, int(tf.config.experimental.get_memory_info(device)["current"])
        except tf.errors.ResourceExhaustedError:
            return now, None
        finally:
            held.clear()


@contextlib.contextmanager
def peak_kept(device: str, keep: bool = True):
    """TensorFlow's peak counter of `device` reset for what runs inside, the peak before it and the one inside
    folded into every measure() block running and into the process's peak (readings/measure.py), and the counter
    reset again after; yields a list that receives the most in use inside beyond what was in use at its start
    (nothing where the device keeps no figures, or keep=False: nothing is touched)."""
    import tensorflow as tf

    from ..readings.measure import _reset_peak

    seen: list[int] = []
    if not keep:  # (this process's allocator untouched: a plan made beside a refused request, a search's)
        yield seen
        return
    try:
        info = tf.config.experimental.get_memory_info(device)
        _reset_peak(device, int(info["peak"]))
    except (ValueError, RuntimeError):
        yield seen
        return
    try:
        yield seen
    finally:
        after = tf.config.experimental.get_memory_info(device)
        seen.append(int(after["peak"]) - int(info["current"]))
        _reset_peak(device, int(after["peak"]))


def slots_shared_by_fit(model, planned) -> tuple[tuple[int, ...], ...]:
    """StepPlan.shared_slots for a fit that builds the optimizer's slots itself (a fresh process's, where
    build_model() left them unbuilt; plan() builds them one by one, each its own buffer): the optimizer's
    variables grouped by shape and dtype, as indices into planned.resident_sizes, the groups of two or more."""
    groups: dict[tuple, list[int]] = {}
    for i, variable in enumerate(model.optimizer.variables, planned.weight_count):
        groups.setdefault((tuple(int(d) for d in variable.shape), str(variable.dtype)), []).append(i)
    return tuple(tuple(group) for group in groups.values() if len(group) > 1)
