"""Memory across a whole fit: a Keras callback.

``MemoryCallback()`` puts the allocator's exact peak and in-use bytes of each epoch (and, with
``per_batch=True``, of each batch) into Keras' logs, so after ``fit`` they are in
``History.history["tfmem_peak_bytes"]`` and ``["tfmem_in_use_bytes"]``, and a TensorBoard
callback listed after it writes them as scalars (with a default ``tf.summary`` writer the
callback writes them itself). Each epoch is a ``measure()`` block, so it nests correctly with
``%%tfmem`` and other measurements. It warns once when the bytes in use after each epoch (or
after each fit with the same callback) keep rising, by 1 MiB or more each time, and when a peak
comes within 5% of the device's limit. A running gauge gets a mark at each epoch's end.

Under a strategy with several replicas (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``)
it reads every replica's device, each with its own allocator: the logs get one key per replica
(``tfmem_peak_bytes/GPU:1``, ``tfmem_peak_bytes/worker1/CPU:0``) and the plain keys hold the
highest replica, the one that decides what fits. The devices of other workers are read by their
own process and gathered with the strategy's own collective (``strategy.gather``, an all-gather
across the workers) at each epoch's end; one worker's devices are read where they are. Peaks that
differ by 10% or more across replicas are said once (imbalance). In lab mode logical CPUs share
one allocator, so their figures are one allocator's, and no imbalance can be told among them.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import keras

from ..text import LinesText
from ..tf.allocator import allocator_of_device
from ..units import MiB, format_bytes
from .allocator import read_allocator
from .measure import _reset_peak, measure

PEAK_KEY, IN_USE_KEY = "tfmem_peak_bytes", "tfmem_in_use_bytes"
RISES_TO_WARN = 3  # in-use figures rising this many times in a row,
MIN_RISE = 1 << 20  # each by at least this much (Keras leaves a few hundred bytes more after some epochs)
NEAR_LIMIT = 0.05
IMBALANCE = 0.10  # replicas' peaks this far apart (of the highest), and at least MIN_RISE
_TYPES = ("CPU", "GPU")  # device types as numbers, for the gathered tensor
NO_STATISTICS = ("TensorFlow's default CPU allocator keeps no statistics (its figures read 0 B): nothing is recorded "
                 "for the CPU; %tfmem setup --lab N (tfmem_widgets.setup(lab_mb=N)) before TensorFlow starts makes "
                 "it TensorFlow's BFC allocator, which keeps them")
_open_callbacks: weakref.WeakSet = weakref.WeakSet()  # callbacks with an epoch's blocks open


def close_open_epochs() -> int:
    """Close the epoch blocks a fit left open when it raised (Keras calls no callback then): the
    notebook layer calls this after a cell that raised. Returns how many callbacks had one."""
    closed = 0
    for callback in list(_open_callbacks):
        if callback._epoch is not None:
            callback._close(callback._epoch)
            callback._epoch = None
            closed += 1
        _open_callbacks.discard(callback)
    return closed


@dataclass(frozen=True)
class ReplicaFigures:
    """One replica's device in one epoch, as its own worker read it."""

    label: str  # 'GPU:1', or 'worker1/CPU:0' with several workers
    peak_bytes: int
    in_use_bytes: int
    limit_bytes: int | None
    allocator: str  # replicas with the same one share an allocator (lab mode's logical CPUs)
    limit_source: str = "its worker's reading"


class MemoryCallback(LinesText, keras.callbacks.Callback):
    """The allocator's peak and in-use bytes per epoch (and per batch) in Keras' logs.

    device: the device to read ('GPU:0', 'CPU:0' in lab mode); None: the first GPU, else the CPU,
        or, under a strategy with several replicas, every replica's device.
    per_batch: also per batch, in the logs a batch's callbacks see ("tfmem_batch_peak_bytes");
        this worker's devices only (no collective per batch).
    summaries: write the figures with tf.summary when a default writer is set.
    """

    def __init__(self, device: str | None = None, per_batch: bool = False, summaries: bool = True):
        super().__init__()
        from ..tf.devices import resolve_device

        self._asked = device
        self.device = resolve_device(device).name  # a bad name fails here, before the fit
        self.per_batch = bool(per_batch)
        self.summaries = bool(summaries)
        self.epochs: list[dict] = []  # every epoch this callback saw, across fits
        self.fits_in_use: list[int] = []  # in use at the end of each fit
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.chief = True
        self._local = [(self.device, self.device)]  # (label, device read) per replica of this worker
        self._strategy = None  # set for a fit whose replicas span several workers
        self._epoch: dict[str, measure] | None = None  # the open blocks, one per allocator
        self._said: set[str] = set()
        self._off = False  # the device keeps no statistics: nothing is recorded
        self.runs: list[dict] = []  # evaluate() and predict() outside a fit: one record each
        self._run: tuple[str, dict[str, measure]] | None = None

    # -- which devices ---------------------------------------------------------------------
    def _replicas(self) -> None:
        """This fit's replica devices, from the model's strategy (unless a device was named)."""
        self._local, self._strategy, self.chief = [(self.device, self.device)], None, True
        strategy = getattr(self.model, "distribute_strategy", None) if self.model is not None else None
        if self._asked is not None and self.device.startswith("CPU"):
            from ..tf.devices import logical_cpu_count

            if logical_cpu_count() > 1:
                self._note(f"{self.device} shares one allocator with every logical CPU (logical CPUs do): its "
                           f"figures are that allocator's, not {self.device}'s own; on GPUs each device has its own")
        if self._asked is not None or strategy is None or strategy.num_replicas_in_sync < 2:
            return
        import tensorflow as tf

        specs = [tf.DeviceSpec.from_string(d) for d in strategy.extended.worker_devices]
        several = strategy.num_replicas_in_sync > len(specs)
        self._local = []
        for spec in specs:
            device = f"{spec.device_type}:{spec.device_index or 0}"
            self._local.append((f"worker{spec.task or 0}/{device}" if several else device, device))
        if several:
            self._strategy = strategy
            self.chief = bool(getattr(strategy.extended, "should_checkpoint", True))
        cpus = [label for label, device in self._local if device.startswith("CPU")]
        if len(cpus) > 1:
            self._note(f"{' and '.join(cpus)} share one allocator (logical CPUs do): their figures are that "
                       "allocator's, not each replica's own; on GPUs each replica has its own")

    def _statistics_missing(self) -> bool:
        """A device read keeps no figures: the CPU outside lab mode (TensorFlow's default allocator)."""
        from ..tf.lab import lab_limit_bytes

        return any(device.startswith("CPU") for _, device in self._local) and lab_limit_bytes() is None

    def _open(self) -> dict[str, measure]:
        _open_callbacks.add(self)
        blocks = {}
        for _, device in self._local:
            key = allocator_of_device(device)
            if key not in blocks:
                blocks[key] = measure(device)
                blocks[key].__enter__()
        return blocks

    @staticmethod
    def _close(blocks: dict[str, measure] | None) -> None:
        for block in (blocks or {}).values():
            if not block.result.done:
                block.__exit__(None, None, None)

    # -- Keras' hooks ----------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        self._close(self._epoch)  # an earlier fit that raised left its epoch open
        self._epoch = None
        self._replicas()
        self._off = self._statistics_missing()
        if self._off:
            self._say("no-statistics", NO_STATISTICS)

    def on_epoch_begin(self, epoch, logs=None):
        if not self._off:
            self._epoch = self._open()

    # evaluate() and predict() on their own (a fit's validation is inside its epoch's blocks)
    def _run_begin(self, kind: str) -> None:
        if self._epoch is not None:
            return
        self._close(self._run[1] if self._run else None)
        self._replicas()
        if self._statistics_missing():
            self._say("no-statistics", NO_STATISTICS)
            self._run = None
            return
        self._run = (kind, self._open())

    def _run_end(self) -> None:
        if self._run is None:
            return
        (kind, blocks), self._run = self._run, None
        self._close(blocks)
        rows = self._rows(blocks)
        self.runs.append({"kind": kind, PEAK_KEY: max(r.peak_bytes for r in rows),
                          IN_USE_KEY: max(r.in_use_bytes for r in rows)})
        for r in rows:
            self._check(r.peak_bytes, r.limit_bytes, r.limit_source, r.label)

    def on_test_begin(self, logs=None):
        self._run_begin("evaluate")

    def on_test_end(self, logs=None):
        self._run_end()

    def on_predict_begin(self, logs=None):
        self._run_begin("predict")

    def on_predict_end(self, logs=None):
        self._run_end()

    def on_train_batch_end(self, batch, logs=None):
        """Two allocator calls per device: the figures since the last reset (the previous batch's
        end, or the epoch's start), then a reset that first folds the peak into the epoch's block
        and any enclosing measurement."""
        if not self.per_batch or self._epoch is None:
            return
        peaks, in_use = {}, {}
        for key, block in self._epoch.items():
            device = block.result.device
            current, peak = read_allocator(device)
            _reset_peak(device, max(peak, current))
            peaks[key], in_use[key] = max(peak, current), current
        if logs is None:
            return
        logs["tfmem_batch_peak_bytes"] = max(peaks.values())
        logs["tfmem_batch_in_use_bytes"] = max(in_use.values())
        if len(self._local) > 1:
            for label, device in self._local:
                logs[f"tfmem_batch_peak_bytes/{label}"] = peaks[allocator_of_device(device)]

    def on_epoch_end(self, epoch, logs=None):
        if self._epoch is None:
            return
        blocks, self._epoch = self._epoch, None
        self._close(blocks)
        rows = self._rows(blocks)
        if self._strategy is not None:
            rows = self._gather(rows)
        peak, in_use = max(r.peak_bytes for r in rows), max(r.in_use_bytes for r in rows)
        record = {"epoch": int(epoch), PEAK_KEY: peak, IN_USE_KEY: in_use}
        if len(rows) > 1:
            record["replicas"] = rows
        self.epochs.append(record)
        if logs is not None:
            logs[PEAK_KEY], logs[IN_USE_KEY] = peak, in_use
            if len(rows) > 1:
                for r in rows:
                    logs[f"{PEAK_KEY}/{r.label}"], logs[f"{IN_USE_KEY}/{r.label}"] = r.peak_bytes, r.in_use_bytes
        if self.summaries and self.chief:
            self._summary(epoch, record)
        for r in rows:
            self._check(r.peak_bytes, r.limit_bytes, r.limit_source, r.label)
        self._rising([e[IN_USE_KEY] for e in self.epochs], "epoch")
        self._balance(rows)
        if self.chief:
            from .sampler import sampler

            sampler.mark(f"epoch {int(epoch) + 1}")  # a running gauge draws it

    def on_train_end(self, logs=None):
        self._close(self._epoch)  # a fit that stopped inside an epoch
        self._epoch = None
        if self.epochs:
            self.fits_in_use.append(self.epochs[-1][IN_USE_KEY])
            self._rising(self.fits_in_use, "fit")

    # -- figures ---------------------------------------------------------------------------
    def _rows(self, blocks: dict[str, measure]) -> list[ReplicaFigures]:
        rows = []
        for label, device in self._local:
            key = allocator_of_device(device)
            result = blocks[key].result
            limit, source = self.limit(device)
            rows.append(ReplicaFigures(label, result.highest_bytes, result.end_bytes, limit,
                                       key if len(self._local) > 1 else device, source))
        return rows

    def _gather(self, rows: list[ReplicaFigures]) -> list[ReplicaFigures]:
        """Every worker's rows, on every worker: one all-gather of the strategy's own."""
        import tensorflow as tf

        strategy = self._strategy
        devices = strategy.extended.worker_devices
        numbers = []
        for name, (_, device), r in zip(devices, self._local, rows):
            spec = tf.DeviceSpec.from_string(name)
            kind, index = device.split(":")
            numbers.append([spec.task or 0, _TYPES.index(kind) if kind in _TYPES else len(_TYPES), int(index),
                            r.peak_bytes, r.in_use_bytes, -1 if r.limit_bytes is None else r.limit_bytes])

        def value(context):
            local = context.replica_id_in_sync_group % len(devices)
            with tf.device(devices[local]):
                return tf.constant([numbers[local]], tf.int64)

        with strategy.scope():
            gathered = strategy.gather(strategy.experimental_distribute_values_from_function(value), axis=0)
        out = []
        for task, kind, index, peak, in_use, limit in gathered.numpy().tolist():
            device = f"{_TYPES[kind] if kind < len(_TYPES) else 'device'}:{index}"
            out.append(ReplicaFigures(f"worker{task}/{device}", peak, in_use, None if limit < 0 else limit,
                                      f"worker{task}/{allocator_of_device(device)}",
                                      "lab mode" if device.startswith("CPU") else "its worker's reading"))
        return out

    def limit(self, device: str | None = None) -> tuple[int | None, str]:
        from ..tf.limits import limit_of

        found = limit_of(device or self.device)
        return found.bytes, found.source

    # -- checks ----------------------------------------------------------------------------
    def _check(self, peak: int, limit: int | None, source: str, label: str | None = None) -> None:
        label = label or self.device
        if limit and peak >= (1 - NEAR_LIMIT) * limit:
            self._say(f"near-{label}", f"the peak of epoch {max(len(self.epochs), 1)} ({format_bytes(peak)}) is "
                                       f"within {NEAR_LIMIT:.0%} of {label}'s limit ({format_bytes(limit)}, "
                                       f"{source}): a larger batch or input will run out of memory")

    def _rising(self, figures: list[int], what: str) -> None:
        tail = figures[-(RISES_TO_WARN + 1):]
        if len(tail) == RISES_TO_WARN + 1 and all(b - a >= MIN_RISE for a, b in zip(tail, tail[1:])):
            self._say(f"rising-{what}", f"the bytes in use on {self._where()} after each of the last "
                                        f"{RISES_TO_WARN + 1} {what}s rose: {' -> '.join(format_bytes(f) for f in tail)}: "
                                        f"something keeps tensors from one {what} to the next (a list of outputs or "
                                        "losses, a growing cache, models built again)")

    def _balance(self, rows: list[ReplicaFigures]) -> None:
        """Replicas with allocators of their own whose peaks differ by IMBALANCE or more."""
        own = {}
        for r in rows:
            own.setdefault(r.allocator, r)
        if len(own) < 2:
            return
        ranked = sorted(own.values(), key=lambda r: r.peak_bytes, reverse=True)
        high, low = ranked[0], ranked[-1]
        if high.peak_bytes - low.peak_bytes >= max(MIN_RISE, IMBALANCE * high.peak_bytes):
            figures = ", ".join(f"{r.label} {format_bytes(r.peak_bytes)}" for r in ranked)
            self._say("imbalance", f"the replicas' peaks differ in epoch {len(self.epochs)}: {figures} "
                                   f"({high.label} {(high.peak_bytes / max(low.peak_bytes, 1) - 1):+.0%}): the "
                                   f"highest decides what fits on every replica; a reduction to one device "
                                   "(tf.distribute.ReductionToOneDevice) or the input's place can make one "
                                   "replica hold more")

    def _where(self) -> str:
        return self.device if len(self._local) < 2 and self._strategy is None else "the busiest replica"

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _say(self, key: str, text: str) -> None:
        if key in self._said:
            return
        self._said.add(key)
        self.warnings.append(text)
        if self.chief:
            print(f"tfmem warning: {text}.", file=sys.stderr)

    def _summary(self, epoch: int, record: dict) -> None:
        """As TensorBoard's scalars (its plugin's metadata on a float32 scalar), through TensorFlow's
        own tf.summary.write: tf.summary.scalar needs the tensorboard package. Nothing is written
        without a default writer."""
        import tensorflow as tf
        from tensorflow.core.framework import summary_pb2

        metadata = summary_pb2.SummaryMetadata()
        metadata.plugin_data.plugin_name = "scalars"
        values = [(PEAK_KEY, record[PEAK_KEY]), (IN_USE_KEY, record[IN_USE_KEY])]
        for r in record.get("replicas", ()):
            values += [(f"{PEAK_KEY}/{r.label}", r.peak_bytes), (f"{IN_USE_KEY}/{r.label}", r.in_use_bytes)]
        for tag, value in values:
            tf.summary.write(tag, tf.constant(float(value), tf.float32), step=int(epoch), metadata=metadata)

    # -- text and picture ------------------------------------------------------------------
    def lines(self) -> list[str]:
        if not self.epochs and not self.runs:
            if self._off:
                return [f"tfmem memory callback: nothing recorded: {NO_STATISTICS}"]
            return ["tfmem memory callback: no epoch yet"]
        out = [f"tfmem memory per epoch ({len(self.epochs)} epoch{'s' if len(self.epochs) != 1 else ''}, "
               f"{self.device if len(self._local) < 2 and self._strategy is None else 'every replica'}):"]
        for e in self.epochs:
            line = f"  epoch {e['epoch'] + 1:>3}: peak {format_bytes(e[PEAK_KEY])}, in use after {format_bytes(e[IN_USE_KEY])}"
            if "replicas" in e:
                line += "; " + ", ".join(f"{r.label} {format_bytes(r.peak_bytes)}" for r in e["replicas"])
            out.append(line)
        out += [f"  {r['kind']}: peak {format_bytes(r[PEAK_KEY])}, in use after {format_bytes(r[IN_USE_KEY])}"
                for r in self.runs]
        out += [f"  warning: {w}" for w in self.warnings]
        out += [f"  note: {n}" for n in self.notes]
        return out

    def plot(self, ax=None):
        """Peak and in-use bytes per epoch (per replica under a strategy), with the limit."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3.6))
        x = list(range(1, len(self.epochs) + 1))
        labels = [r.label for r in self.epochs[0]["replicas"]] if self.epochs and "replicas" in self.epochs[0] else []
        if labels:
            for k, label in enumerate(labels):
                rows = [next(r for r in e["replicas"] if r.label == label) for e in self.epochs]
                ax.plot(x, [r.peak_bytes / MiB for r in rows], "o-", color=f"C{k}", label=f"{label} peak")
                ax.plot(x, [r.in_use_bytes / MiB for r in rows], "s:", color=f"C{k}", label=f"{label} in use after")
        else:
            ax.plot(x, [e[PEAK_KEY] / MiB for e in self.epochs], "o-", label="peak")
            ax.plot(x, [e[IN_USE_KEY] / MiB for e in self.epochs], "s:", label="in use after the epoch")
        limit = self.limit()[0] if self._strategy is None else None
        if limit:
            ax.axhline(limit / MiB, color="#6a1b9a", linestyle=":", label=f"limit {format_bytes(limit)}")
        ax.set_xlabel("epoch")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)
        if x:
            ax.set_xticks(x)
        ax.set_title("TensorFlow's allocator across the fit")
        ax.legend(loc="lower right", fontsize=8)
        return ax
