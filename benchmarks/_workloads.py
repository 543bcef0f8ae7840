"""The workload the benchmarks time: code for a fresh process or kernel, built in one place."""


def keras_classifier(lab_mb: int, width: int, rows: int) -> str:
    """Code that turns lab mode on with `lab_mb`, then defines `model` (64 -> width -> width -> 10,
    compiled) and seeded data `x`, `y` of `rows` examples."""
    return f"""
import numpy as np, tfmem_widgets
tfmem_widgets.setup(lab_mb={lab_mb})
import tensorflow as tf
model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense({width}, activation="relu"),
                             tf.keras.layers.Dense({width}, activation="relu"), tf.keras.layers.Dense(10)])
model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(0).normal(size=({rows}, 64)).astype("float32")
y = np.random.default_rng(1).integers(0, 10, size={rows})
"""
