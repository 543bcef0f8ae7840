"""The model rebuilt for planning on a device of our choosing: its layers from its config (weights made anew,
never copied), compiled the way it was. A GPU model's step planned on the CPU after its OOM (plans/need.py) and
one replica of a model built under a strategy (plans/replicas.py) are planned from such a copy; the user's model
is left as it was (a half-built optimizer breaks its fit)."""

from __future__ import annotations

from ..errors import ArgumentError


def model_copy(model, device: str = "/CPU:0", where: str = "on the CPU"):
    """`model` rebuilt under tf.device(`device`), outside any strategy (its variables are plain ones), compiled
    from its compile config. ArgumentError (one line, saying `where` it was to be rebuilt) for a model Keras
    cannot rebuild from its config or recompile."""
    import keras
    import tensorflow as tf

    try:
        config = model.get_compile_config()
        with tf.device(device):
            copy = keras.models.clone_model(model)
            if config:
                copy.compile_from_config(config)
    except tf.errors.ResourceExhaustedError:  # refused memory for the copy's variables: said as such by the caller
        raise
    except Exception as exc:  # a subclassed model without get_config, a custom compile
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ArgumentError(f"plan: the model could not be rebuilt {where} to plan it ({type(exc).__name__}: "
                            f"{first})") from None
    if getattr(copy, "optimizer", None) is None:
        raise ArgumentError(f"plan: the model's copy {where} has no optimizer (a compile Keras cannot repeat)")
    return copy
