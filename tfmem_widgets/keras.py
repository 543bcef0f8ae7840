"""Memory across a whole fit: a Keras callback.

``MemoryCallback()`` puts the allocator's exact peak and in-use bytes of each epoch (and, with
``per_batch=True``, of each batch) into Keras' logs, so after ``fit`` they are in
``History.history["tfmem_peak_bytes"]`` and ``["tfmem_in_use_bytes"]``, and a TensorBoard
callback listed after it writes them as scalars (with a default ``tf.summary`` writer the
callback writes them itself). Each epoch is a ``measure()`` block, so it nests correctly with
``%%tfmem`` and other measurements. It warns once when the bytes in use after each epoch (or
after each fit with the same callback) keep rising, by 1 MiB or more each time, and when a peak
comes within 5% of the device's limit.
"""

from __future__ import annotations

import sys

import keras

from .measure import measure
from .units import format_bytes

PEAK_KEY, IN_USE_KEY = "tfmem_peak_bytes", "tfmem_in_use_bytes"
RISES_TO_WARN = 3  # in-use figures rising this many times in a row,
MIN_RISE = 1 << 20  # each by at least this much (Keras leaves a few hundred bytes more after some epochs)
NEAR_LIMIT = 0.05


class MemoryCallback(keras.callbacks.Callback):
    """The allocator's peak and in-use bytes per epoch (and per batch) in Keras' logs.

    device: the device to read ('GPU:0', 'CPU:0' in lab mode); None: the first GPU, else the CPU.
    per_batch: also per batch, in the logs a batch's callbacks see ("tfmem_batch_peak_bytes").
    summaries: write the figures with tf.summary when a default writer is set.
    """

    def __init__(self, device: str | None = None, per_batch: bool = False, summaries: bool = True):
        super().__init__()
        from .runtime import resolve_device

        self.device = resolve_device(device).name  # a bad name fails here, before the fit
        self.per_batch = bool(per_batch)
        self.summaries = bool(summaries)
        self.epochs: list[dict[str, int]] = []  # every epoch this callback saw, across fits
        self.fits_in_use: list[int] = []  # in use at the end of each fit
        self.warnings: list[str] = []
        self._epoch = self._batch = None
        self._said: set[str] = set()

    # -- Keras' hooks ----------------------------------------------------------------------
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = measure(self.device)
        self._epoch.__enter__()

    def on_train_batch_begin(self, batch, logs=None):
        if self.per_batch:
            self._batch = measure(self.device)
            self._batch.__enter__()

    def on_train_batch_end(self, batch, logs=None):
        if self._batch is not None:
            block, self._batch = self._batch, None
            block.__exit__(None, None, None)
            if logs is not None:
                logs["tfmem_batch_peak_bytes"] = block.result.highest_bytes
                logs["tfmem_batch_in_use_bytes"] = block.result.end_bytes

    def on_epoch_end(self, epoch, logs=None):
        if self._epoch is None:
            return
        block, self._epoch = self._epoch, None
        block.__exit__(None, None, None)
        peak, in_use = block.result.highest_bytes, block.result.end_bytes
        self.epochs.append({"epoch": int(epoch), PEAK_KEY: peak, IN_USE_KEY: in_use})
        if logs is not None:
            logs[PEAK_KEY], logs[IN_USE_KEY] = peak, in_use
        if self.summaries:
            self._summary(epoch, peak, in_use)
        self._check(peak)

    def on_train_end(self, logs=None):
        for open_block in (self._batch, self._epoch):  # a fit that stopped inside an epoch
            if open_block is not None:
                open_block.__exit__(None, None, None)
        self._batch = self._epoch = None
        if self.epochs:
            self.fits_in_use.append(self.epochs[-1][IN_USE_KEY])
            self._rising(self.fits_in_use, "fit")

    # -- checks ----------------------------------------------------------------------------
    def limit(self) -> tuple[int | None, str]:
        from .readings import device_limit
        from .runtime import lab_limit_bytes, resolve_device, runtime_started

        found = device_limit(resolve_device(self.device), runtime_started(), lab_limit_bytes())
        return found.bytes, found.source

    def _check(self, peak: int) -> None:
        limit, source = self.limit()
        if limit and peak >= (1 - NEAR_LIMIT) * limit:
            self._say("near", f"the peak of epoch {len(self.epochs)} ({format_bytes(peak)}) is within "
                              f"{NEAR_LIMIT:.0%} of {self.device}'s limit ({format_bytes(limit)}, {source}): a "
                              "larger batch or input will run out of memory")
        self._rising([e[IN_USE_KEY] for e in self.epochs], "epoch")

    def _rising(self, figures: list[int], what: str) -> None:
        tail = figures[-(RISES_TO_WARN + 1):]
        if len(tail) == RISES_TO_WARN + 1 and all(b - a >= MIN_RISE for a, b in zip(tail, tail[1:])):
            self._say(f"rising-{what}", f"the bytes in use on {self.device} after each of the last {RISES_TO_WARN + 1} "
                                        f"{what}s rose: {' -> '.join(format_bytes(f) for f in tail)}: something keeps "
                                        f"tensors from one {what} to the next (a list of outputs or losses, a "
                                        "growing cache, models built again)")

    def _say(self, key: str, text: str) -> None:
        if key in self._said:
            return
        self._said.add(key)
        self.warnings.append(text)
        print(f"tfmem warning: {text}.", file=sys.stderr)

    def _summary(self, epoch: int, peak: int, in_use: int) -> None:
        """As TensorBoard's scalars (its plugin's metadata on a float32 scalar), through TensorFlow's
        own tf.summary.write: tf.summary.scalar needs the tensorboard package. Nothing is written
        without a default writer."""
        import tensorflow as tf
        from tensorflow.core.framework import summary_pb2

        metadata = summary_pb2.SummaryMetadata()
        metadata.plugin_data.plugin_name = "scalars"
        for tag, value in ((PEAK_KEY, peak), (IN_USE_KEY, in_use)):
            tf.summary.write(tag, tf.constant(float(value), tf.float32), step=int(epoch), metadata=metadata)
