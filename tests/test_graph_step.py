"""The graph executor's walk of a traced step (plans/graphstep.py) against the lab pool running the same graph.

Chains of ops run in one order on any executor, so the lab pool's peak over them is the walk's to the byte
where grappler leaves the graph as traced (on a CPU it fuses some elementwise pairs, which the walk does not
see); a Keras step's order on the CPU's threads is not one order (the walk stands for a GPU's inline order,
checked in tests/test_gpu.py).
"""

import gc

import pytest

from tfmem_widgets.plans.graphstep import graph_step_peak, tensor_bytes

MiB = 1 << 20


def measured_beyond_inputs(concrete, *args) -> int:
    import tensorflow as tf

    concrete(*args)  # (its constants made, once)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    concrete(*args)
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


def test_the_walk_forwards_elementwise_outputs_and_aliases_reshapes_and_equals_the_lab_peak():
    import tensorflow as tf

    rows = MiB // 4  # (one MiB of float32)

    @tf.function
    def chain(x):
        y = x * 2.0  # a new buffer: x is the caller's
        z = tf.reshape(tf.nn.relu(y), [512, 512])  # relu writes into y, which nothing else reads; reshape is y again
        return tf.reduce_sum(tf.matmul(z, tf.reshape(x, [512, 512])))  # a new buffer while y is read

    concrete = chain.get_concrete_function(tf.TensorSpec([rows], tf.float32))
    walked = graph_step_peak(concrete.graph)
    assert walked.unsized == 0 and walked.after_op == "MatMul"
    assert [size for _, size in walked.live] == [MiB, MiB]  # y's (relu and reshape in it), the product's
    assert walked.bytes == measured_beyond_inputs(concrete, tf.ones([rows]))


def test_a_buffer_read_again_is_not_written_into_and_two_new_buffers_add_up():
    import tensorflow as tf

    rows = MiB // 4

    @tf.function
    def branches(x):
        y = x + 1.0
        a = tf.nn.relu(y)  # y is read again below: relu cannot write into it
        b = a * y  # written into a (its last reader); y goes back after it
        return tf.reduce_max(b)

    @tf.function
    def two(x):
        return tf.reduce_max(tf.exp(x) + tf.sqrt(x))  # exp's and sqrt's buffers, the sum in one of them

    for function, after in ((branches, "Relu"), (two, "Sqrt")):
        concrete = function.get_concrete_function(tf.TensorSpec([rows], tf.float32))
        walked = graph_step_peak(concrete.graph)
        assert (walked.after_op, walked.bytes) == (after, 2 * MiB)
        assert walked.bytes == measured_beyond_inputs(concrete, tf.ones([rows]))


@pytest.mark.parametrize("spec, expected", [(([3, 4], "float32"), 48), (([2], "int64"), 16), (([None, 4], "float32"), None)])
def test_a_tensors_bytes_come_from_its_traced_shape_and_an_unknown_shape_is_said(spec, expected):
    import tensorflow as tf

    shape, dtype = spec
    graph = tf.function(lambda x: x).get_concrete_function(tf.TensorSpec(shape, dtype)).graph
    assert tensor_bytes(graph.inputs[0]) == expected


def test_a_dense_replicas_step_walks_to_the_four_tensors_a_gpu_trace_holds_at_its_peak():
    # What plan_replicas reads on a GPU (plans/replicas.py _graph_step), here traced on the lab's CPU: the step
    # of Dense 1024-2048-2048-10 at 2,048 rows. At its peak an H100 trace of that replica (docs/plans.md) held
    # four 2048 x 2048 float32 tensors (the first layer's output, two input gradients, the second kernel's
    # gradient) and bytes beside. (Narrower, the optimizer's phase is the peak: the walk stops there.)
    import keras
    import numpy as np
    import tensorflow as tf

    from tfmem_widgets.plans.replicas import _graph_step

    width = 2048
    L = keras.layers
    gc.collect()  # (what earlier tests in this process left in reference cycles goes now, not inside the measures)
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model = keras.Sequential([keras.Input((1024,)), L.Dense(width, activation="relu"), L.Dense(width, activation="relu"),
                              L.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    model.optimizer.build(model.trainable_variables)
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    sample = (np.zeros((8, 1024), "float32"), np.zeros(8, "int64"))
    walked = _graph_step(model, sample, width, "CPU:0")
    four = 4 * width * width * 4
    assert four <= walked < four + width * width, walked
    # Traced only: no step ran (its smallest tensor here is 16 MiB; the process's own small tensors may come and go)
    assert abs(tf.config.experimental.get_memory_info("CPU:0")["current"] - before) < MiB
    # The model's 72 MiB of weights and slots sit in reference cycles of its traced step: freed here, not by a
    # collection in a later test (which then measured 72 MiB given back in its own cell)
    del model
    gc.collect()
    assert abs(tf.config.experimental.get_memory_info("CPU:0")["current"] - start) < MiB
