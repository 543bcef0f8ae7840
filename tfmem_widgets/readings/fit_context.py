"""The Keras fit a thread is inside, read from its Python frames: the model, the batch size and the
specs of one batch, so that an OOM in the fit can be told in terms of its step (``plans/need.py``).

Read while the fit waits on a refused request (TensorFlow's allocator retries for 10 s before it
raises): once raised, Keras has cut its own frames from the traceback. Nothing is allocated: the
specs are the dataset's ``element_spec``.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class FitContext:
    """A running Keras fit: its model, global batch size, one batch's specs and replicas."""

    model: object
    batch_size: int
    sample: object  # the dataset's element_spec: (x, y[, sample_weight]) as tf.TensorSpecs
    replicas: int = 1
    data_sizes: tuple[int, ...] = ()  # the arrays fit was given (x, y, sample_weight): Keras holds each as a tensor
    phase: str = "train"  # "validation": inside the fit's evaluate (validation_data), its batch and data
    # A fit over replicas: its arrays as fit got them, (x, y[, sample_weight]), each a view of no bytes with the
    # array's shape and type (the replicas' plan reads how much data lands on the first device); None otherwise.
    data: object = None


def fit_context(frame) -> FitContext | None:
    """The innermost Keras fit among `frame` and its callers, or None. Inside the fit's validation (the
    evaluate it calls at an epoch's end) the context is the validation's: its batch, specs and data."""
    validation = None
    while frame is not None:
        name = frame.f_code.co_name
        if name == "evaluate" and validation is None:
            validation = _of_fit_locals(frame.f_locals)
        elif name == "fit":
            found = _of_fit_locals(frame.f_locals)
            if found is not None:
                return found if validation is None else replace(validation, phase="validation")
        frame = frame.f_back
    return None


def fit_context_of_thread(thread_id: int) -> FitContext | None:
    """The Keras fit the thread `thread_id` is inside now, or None."""
    return fit_context(sys._current_frames().get(thread_id))


def _of_fit_locals(local: dict) -> FitContext | None:
    keras, tf = sys.modules.get("keras"), sys.modules.get("tensorflow")
    model, iterator = local.get("self"), local.get("epoch_iterator")
    if keras is None or tf is None or iterator is None or not isinstance(model, keras.Model):
        return None
    try:
        adapter = iterator.data_adapter
        batch = getattr(adapter, "batch_size", None) or batch_of_dataset(getattr(adapter, "_dataset", None))
        dataset = getattr(iterator, "_distributed_dataset", None)
        replicas = int(model.distribute_strategy.num_replicas_in_sync)
        if replicas > 1:  # a distributed dataset's spec is per replica: the global batch's is its input's
            dataset = getattr(dataset, "_original_dataset", dataset)
        spec = getattr(dataset, "element_spec", None)
    except Exception:  # a Keras whose internals moved: no context, never a failure
        return None
    leaves = tf.nest.flatten(spec) if spec is not None else []
    if not batch or not leaves or not all(isinstance(leaf, tf.TensorSpec) for leaf in leaves):
        return None
    sizes = tuple(int(getattr(a, "nbytes", 0) or 0) for name in ("x", "y", "sample_weight")
                  for a in tf.nest.flatten(local.get(name)) if hasattr(a, "nbytes") and hasattr(a, "shape"))
    data = shapes_of_data(local.get("x"), local.get("y"), local.get("sample_weight")) if replicas > 1 else None
    return FitContext(model, int(batch), spec, replicas, tuple(s for s in sizes if s), data=data)


def shapes_of_data(x, y, sample_weight=None):
    """(x, y[, sample_weight]) with each NumPy array a read-only view of no bytes of its shape and type
    (np.broadcast_to of one zero), tensors as they are; None where x is not arrays or tensors (a tf.data
    pipeline, a generator: its batches' specs say all there is)."""
    import numpy as np

    tf = sys.modules["tensorflow"]
    data = (x, y) if sample_weight is None else (x, y, sample_weight)
    leaves = [leaf for leaf in tf.nest.flatten(data) if leaf is not None]
    if x is None or not leaves or not all(isinstance(leaf, np.ndarray) or tf.is_tensor(leaf) for leaf in leaves):
        return None
    return tf.nest.map_structure(
        lambda a: np.broadcast_to(np.zeros((), a.dtype), a.shape) if isinstance(a, np.ndarray) else a, data)


def batch_of_dataset(dataset) -> int | None:
    """A tf.data pipeline's batch where its leading axis is not static (Dataset.batch(B) keeps a smaller last
    batch, so Keras reads no batch size): the B of its batch step, found through the steps after it (map,
    prefetch, ...); None where there is none (a generator's, an unbatched pipeline)."""
    tf = sys.modules.get("tensorflow")
    for _ in range(32):
        if dataset is None or tf is None:
            return None
        size = getattr(dataset, "_batch_size", None)
        if size is not None:
            value = tf.get_static_value(size)
            return int(value) if value is not None and int(value) > 0 else None
        dataset = getattr(dataset, "_input_dataset", None)
    return None


SPOT_EVERY_S = 0.2


class FitSpotter(threading.Thread):
    """Notes the Keras fits a thread runs while it is watched (its frames read every SPOT_EVERY_S):
    each fit's model (weakly: a trace does not keep a model alive), batch size and batch specs, once.
    A trace plans the XLA programs it saw with them (tracing/result.py)."""

    def __init__(self, thread_id: int | None = None):
        super().__init__(name="tfmem-fit-spotter", daemon=True)
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        self.stop_event = threading.Event()
        self.seen: dict[tuple[int, int], tuple[weakref.ref, int, object]] = {}

    def run(self) -> None:
        while not self.stop_event.wait(SPOT_EVERY_S):
            self.spot()

    def spot(self) -> None:
        try:
            found = fit_context_of_thread(self.thread_id)
        except Exception:  # frames that vanish while read: the next look sees them
            return
        if found is not None and found.phase == "train" and len(self.seen) < 8:  # (a validation's is no train step)
            key = (id(found.model), found.batch_size)
            if key not in self.seen:
                self.seen[key] = (weakref.ref(found.model), found.batch_size, found.sample)

    def stop(self) -> list[tuple[weakref.ref, int, object]]:
        """Stop watching; the fits seen: (model's weak reference, batch size, specs)."""
        self.stop_event.set()
        if self is not threading.current_thread() and self.is_alive():
            self.join(timeout=2)
        return list(self.seen.values())
