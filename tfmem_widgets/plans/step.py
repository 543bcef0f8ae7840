"""The train step as ``fit`` runs it (Keras' own ``train_step`` under the model's strategy), traced from
``tf.TensorSpec``s and, unless told otherwise, compiled by XLA for a device: what ``plan()`` reads, and
what the guard traces alone to find a graph step's tensors of 2^31 elements."""

from __future__ import annotations

import contextlib
import time

from . import hlo


def compile_step(model, specs, device: str, compile: bool = True):
    """The step traced from specs and compiled by XLA for `device`: (HloProto, the concrete function,
    trace seconds, compile seconds, the scopes Keras entered); compile=False: traced only (no HloProto).
    The context's get_compiler_ir is called directly: the public experimental_get_compiler_ir takes no nested specs and runs an op
    (an allocation) to find its device."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    from .owners import ScopeRecorder

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):  # Keras' own step function, as TensorFlowTrainer makes it, compiled by XLA
        return model.distribute_strategy.run(model.train_step, args=(data,))

    function = tf.function(one_step_on_data, jit_compile=compile, reduce_retracing=False)
    with tf.device(device), ScopeRecorder() as scopes:
        started = time.perf_counter()
        with custom_gradients_let_go():
            concrete = function.get_concrete_function(specs)
        traced = time.perf_counter()
        if not compile:
            return None, concrete, traced - started, 0.0, scopes.scopes
        serialized = context.context().get_compiler_ir(
            device_name=device, platform_name=None, function_name=concrete.name,
            flat_args=tf.nest.flatten(concrete.structured_input_signature), captured_inputs=concrete.captured_inputs,
            stage="optimized_hlo_proto_serialized")
        compiled = time.perf_counter()
    return hlo.hlo_proto(serialized), concrete, traced - started, compiled - traced, scopes.scopes


@contextlib.contextmanager
def custom_gradients_let_go():
    """TensorFlow registers each graph-mode ``tf.custom_gradient`` (Keras' losses and activations use it) under a
    fresh name in its process-wide gradient registry (tensorflow/python/ops/custom_gradient.py), and that
    registered function holds the traced graph, its captures and so the model's variables: a planned copy of a
    model would stay in the pool for the process's life. The names registered while the step is traced are
    dropped after it: its gradients were taken in the trace, and nothing differentiates the planned step again."""
    from tensorflow.python.framework import ops

    registry = getattr(getattr(ops, "_gradient_registry", None), "_registry", None)
    before = set(registry) if isinstance(registry, dict) else None
    try:
        yield
    finally:
        if before is not None:
            for name in [n for n in registry if n not in before and n.startswith("CustomGradient-")]:
                registry.pop(name, None)
