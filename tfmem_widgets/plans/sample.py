"""A plan's model and sample checked before anything is built or traced, each fault in one line that says
what is wrong with it: a model built under a strategy, a sample that is not (x, y), targets that are None, a
ragged or unknown axis, a width the model does not take, an unbuilt model the sample would build. TensorFlow's
and XLA's own words there are raw or point elsewhere, and a model built from a wrong sample stays wrong for the
user's fit."""

from __future__ import annotations

import numbers

from ..errors import ArgumentError


def check_sample(model, sample, batch_size, build: bool) -> int:
    """The batch size as an int (NumPy's integers too); ArgumentError (one line) where `sample` cannot stand
    for the fit's data, or the model cannot be planned as it is."""
    import keras
    import tensorflow as tf

    if not isinstance(model, keras.Model) or getattr(model, "optimizer", None) is None:
        unbuilt = " with no optimizer (compile it first)" if not getattr(model, "compiled", False) else (
            " compiled without an optimizer: a train step needs one (compile(optimizer=...))")
        raise ArgumentError(f"plan: model must be a compiled Keras model, got {type(model).__name__}"
                            + ("" if not isinstance(model, keras.Model) else unbuilt) + ".")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ArgumentError(f"plan: batch_size must be a whole number of at least 1, got {batch_size!r}.")

    replicas = _replicas(model)
    if replicas > 1:  # (checked before anything of the model is built: a half-built optimizer breaks its fit)
        jit = getattr(model, "jit_compile", None)
        raise ArgumentError(
            f"plan: the model was built under {type(model.distribute_strategy).__name__} ({replicas} replicas), whose "
            "variables live on each replica's device: plan one replica's step instead, the same model built without "
            f"the strategy and compiled with jit_compile={jit!r} as this one was"
            + (" (its step runs without XLA, as Keras compiles one under tf.distribute unless told jit_compile=True: "
               "that plan is an estimate)" if jit is not True else "")
            + f", at the global batch divided by {replicas}; MemoryCallback measures each replica's peak in the fit.")
    if not isinstance(sample, (tuple, list)) or len(sample) not in (2, 3):
        got = f"a {len(sample)}-tuple" if isinstance(sample, (tuple, list)) else type(sample).__name__
        raise ArgumentError(f"plan: sample must be (x, y) or (x, y, sample_weight), as fit takes them; got {got}.")
    if sample[1] is None:
        raise ArgumentError("plan: the sample's y is None: a train step needs the targets (x, y), as fit is given them.")
    for where, part in zip(("x", "y", "sample_weight"), sample):
        for leaf in keras.tree.flatten(part):
            if isinstance(leaf, (tf.RaggedTensor, tf.SparseTensor)):
                kind = "ragged" if isinstance(leaf, tf.RaggedTensor) else "sparse"
                raise ArgumentError(f"plan: the sample's {where} is {kind}: XLA plans fixed shapes; give it padded "
                                    "to the length the fit uses.")
            shape = getattr(leaf, "shape", None)
            dims = list(shape)[1:] if shape is not None and getattr(shape, "rank", len(shape)) else []
            if any(d is None for d in dims):
                raise ArgumentError(f"plan: the sample's {where} has an unknown axis (shape {tf.TensorShape(shape)}): "
                                    "every axis but the batch must be known; give the length the fit uses.")
    if not build and not model.built:
        raise ArgumentError("plan: the model is not built yet (no keras.Input, or a subclassed model never called): a "
                            "plan would build it from the sample's shapes for good; build it on the fit's data first "
                            "(model(x[:1])), or pass build=True.")
    _check_width(model, sample[0])
    return int(batch_size)


def _check_width(model, x) -> None:
    """A one-input model's input against the sample's x: the axes the model fixed must match."""
    inputs = getattr(model, "inputs", None) or []
    shape = getattr(x, "shape", None)
    if len(inputs) != 1 or shape is None or not len(shape):  # (no batch axis: batch_specs says so)
        return
    wanted = tuple(inputs[0].shape)[1:]
    given = tuple(shape)[1:]
    if len(wanted) != len(given) or any(w is not None and g is not None and int(w) != int(g)
                                        for w, g in zip(wanted, given)):
        raise ArgumentError(f"plan: the sample's x has shape {tuple(shape)} where the model takes "
                            f"{tuple(inputs[0].shape)}: give a sample of the fit's data.")


def _replicas(model) -> int:
    try:
        return int(model.distribute_strategy.num_replicas_in_sync)
    except Exception:  # a Keras without the attribute: one device
        return 1
