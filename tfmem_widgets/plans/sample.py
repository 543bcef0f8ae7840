"""A plan's model and sample checked before anything is built or traced, each fault in one line that says
what is wrong with it: a sample that is not (x, y), targets that are None, a
ragged or unknown axis, a width the model does not take, an unbuilt model the sample would build. TensorFlow's
and XLA's own words there are raw or point elsewhere, and a model built from a wrong sample stays wrong for the
user's fit."""

from __future__ import annotations

import numbers

from ..errors import ArgumentError


def check_sample(model, sample, batch_size, build: bool) -> int:
    """The batch size as an int (NumPy's integers too); ArgumentError (one line) where `sample` cannot stand
    for the fit's data, or the model cannot be planned as it is. Nothing of the model is built here."""
    import keras
    import tensorflow as tf

    if not isinstance(model, keras.Model) or getattr(model, "optimizer", None) is None:
        unbuilt = " with no optimizer (compile it first)" if not getattr(model, "compiled", False) else (
            " compiled without an optimizer: a train step needs one (compile(optimizer=...))")
        raise ArgumentError(f"plan: model must be a compiled Keras model, got {type(model).__name__}"
                            + ("" if not isinstance(model, keras.Model) else unbuilt) + ".")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ArgumentError(f"plan: batch_size must be a whole number of at least 1, got {batch_size!r}.")

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


def batch_specs(sample, batch_size: int):
    """`sample` (x, y) in any structure Keras takes, as TensorSpecs of `batch_size` rows. Floating
    arrays become Keras' floatx, as its array adapter casts them; TensorSpecs keep their dtype."""
    import keras
    import numpy as np
    import tensorflow as tf

    def spec(leaf):
        if leaf is None:
            return None
        if isinstance(leaf, tf.TensorSpec):
            shape, dtype = leaf.shape, leaf.dtype
        else:
            leaf = leaf if hasattr(leaf, "shape") and hasattr(leaf, "dtype") else np.asarray(leaf)
            shape, dtype = tf.TensorShape(leaf.shape), tf.as_dtype(leaf.dtype)
            if dtype.is_floating and dtype.name != keras.config.floatx():
                dtype = tf.as_dtype(keras.config.floatx())
        if shape.rank is None or shape.rank == 0:
            raise ArgumentError(f"plan: each part of the sample needs a leading (batch) axis; one has shape {shape}.")
        return tf.TensorSpec([batch_size, *shape.as_list()[1:]], dtype)

    return keras.tree.map_structure(spec, sample)
