"""The Keras fit a thread is inside, read from its Python frames: the model, the batch size and the
specs of one batch, so that an OOM in the fit can be told in terms of its step (``fit/need.py``).

Read while the fit waits on a refused request (TensorFlow's allocator retries for 10 s before it
raises): once raised, Keras has cut its own frames from the traceback. Nothing is allocated: the
specs are the dataset's ``element_spec``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class FitContext:
    """A running Keras fit: its model, global batch size, one batch's specs and replicas."""

    model: object
    batch_size: int
    sample: object  # the dataset's element_spec: (x, y[, sample_weight]) as tf.TensorSpecs
    replicas: int = 1
    data_sizes: tuple[int, ...] = ()  # the arrays fit was given (x, y, sample_weight): Keras holds each as a tensor


def fit_context(frame) -> FitContext | None:
    """The innermost Keras fit among `frame` and its callers, or None."""
    while frame is not None:
        if frame.f_code.co_name == "fit":
            found = _of_fit_locals(frame.f_locals)
            if found is not None:
                return found
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
        batch = getattr(iterator.data_adapter, "batch_size", None)
        dataset = getattr(iterator, "_distributed_dataset", None)
        spec = getattr(dataset, "element_spec", None)
        replicas = int(model.distribute_strategy.num_replicas_in_sync)
    except Exception:  # a Keras whose internals moved: no context, never a failure
        return None
    leaves = tf.nest.flatten(spec) if spec is not None else []
    if not batch or not leaves or not all(isinstance(leaf, tf.TensorSpec) for leaf in leaves):
        return None
    sizes = tuple(int(getattr(a, "nbytes", 0) or 0) for name in ("x", "y", "sample_weight")
                  for a in tf.nest.flatten(local.get(name)) if hasattr(a, "nbytes") and hasattr(a, "shape"))
    return FitContext(model, int(batch), spec, replicas, tuple(s for s in sizes if s))
