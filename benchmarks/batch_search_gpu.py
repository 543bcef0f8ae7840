"""The batch search on a GPU as if on a smaller card, then one epoch at the recommended batch.

    python3 benchmarks/batch_search_gpu.py [--limit MB] [--high N] [--margin F] [--no-xla]

A Keras model of three Dense layers (4096 -> 8192 -> 8192 -> 1, Adam), compiled with XLA unless
--no-xla (Keras' default on a GPU is XLA), searched under a logical-device limit of --limit MB
(16000 by default: as if on a card of 16 GB), XLA's GEMM autotuner off in every probe. Then a whole
epoch (4 batches from a tf.data pipeline built on the host) at the recommended batch, in a fresh
process under the same limit: its peak and how close to the limit it came.
"""

from __future__ import annotations

import argparse
import json
import time

import tfmem_widgets

ENV = {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}
JIT = True


def build_model():
    import keras

    model = keras.Sequential([keras.Input((4096,)), keras.layers.Dense(8192, activation="relu"),
                              keras.layers.Dense(8192, activation="relu"), keras.layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=JIT)
    return model


def make_batch(n):
    import numpy as np

    return np.ones((n, 4096), "float32"), np.ones((n, 1), "float32")


EPOCH = """
import json, time
import cloudpickle, tensorflow as tf
import tfmem_widgets
build_model, make_batch = cloudpickle.loads(bytes.fromhex(FUNCTIONS))
model = build_model()
x, y = make_batch(BATCH)
with tf.device("CPU:0"):
    data = tf.data.Dataset.from_tensors((x, y)).repeat(4)
started = time.perf_counter()
with tfmem_widgets.measure() as epoch:
    model.fit(data, epochs=1, verbose=0)
print("epoch:", json.dumps({"batch": BATCH, "peak": epoch.highest_bytes, "seconds": time.perf_counter() - started,
                            "xla": bool(model.jit_compile)}))
"""


def main() -> None:
    global JIT
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=16000, help="the logical device's limit in MB")
    parser.add_argument("--high", type=int, default=262144)
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument("--no-xla", action="store_true")
    args = parser.parse_args()
    from tfmem_widgets.tf import nvml

    try:
        gpus = nvml.read_gpus()
    except tfmem_widgets.NvmlUnavailable:
        gpus = []
    if not gpus:
        print("batch_search_gpu.py: needs an NVIDIA GPU (a logical device's limit); none here, so nothing was measured")
        return
    JIT = not args.no_xla
    setup = {"limit_mb": args.limit}
    started = time.perf_counter()
    search = tfmem_widgets.max_batch_size(build_model, make_batch, setup=setup, high=args.high, margin=args.margin,
                                          progress="lines", env=ENV)
    print(search)
    print(f"search: {time.perf_counter() - started:.0f} s")
    import cloudpickle

    from tfmem_widgets.fresh.run import run_fresh

    code = (EPOCH.replace("FUNCTIONS", repr(cloudpickle.dumps((build_model, make_batch)).hex()))
            .replace("BATCH", str(search.recommended)))
    run_fresh(code, setup=setup, env=ENV, timeout=600)
    print(json.dumps({"limit_bytes": search.limit_bytes}))


if __name__ == "__main__":
    main()
