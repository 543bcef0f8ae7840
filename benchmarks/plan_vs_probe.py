"""Plans against measured steps, and what fits from plans against the probe search, side by side.

    .venv/bin/python benchmarks/plan_vs_probe.py [--gpu] [--skip-search] [--skip-steps] [--search conv]
                                                 [--method plan|probe]

1. For a Dense, an attention and a convolution model compiled with jit_compile=True, one fresh
   process each: tfmem_widgets.plan() at three batches, then the same step run by Keras' own train
   function with the pool holding a free chunk it can split (a large tensor made and dropped first), its
   peak over in-use before. Prints plan, measured and the error of each plan.
   The plan's own bytes are printed too: what stayed in the allocator and how far its peak rose.
   On a GPU, a CPU copy of the model is planned too (what a fit refused memory is told while it
   waits, plans/need.py): its error against the GPU's measured step.
2. max_batch_size on the same Keras model (Dense 512-1024-1024-1, Adam, jit_compile=True) with
   method="probe" and method="plan", one after the other: the answers, the probes, the seconds and
   their ratio. TensorFlow is imported here first, as in the notebook where the model was written.
   Lab mode (128 MB) on this machine. With --gpu: a Dense 768-2560-1280-6 model compiled as Keras does by
   default (XLA on a GPU, its autotuner on), on the first GPU under a logical device limit of 3000 MB;
   with --gpu --autotune-off: the Dense 512-1024-1024-1 model under 2000 MB, XLA's autotuner off for plans
   and probes alike (XLA_FLAGS=--xla_gpu_autotune_level=0). --search conv: a convolution model
   (Conv2D 128-256-256 on 32x32x3, Adam) under a 256 MB lab instead, whose step's temporaries take a
   free chunk whole at the edge (lab mode only). --method plan (or probe): that search alone, for a
   look at where its seconds go; no ratio is printed (the ratio is of both, side by side in one run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tfmem_widgets  # noqa: E402
from tfmem_widgets.fresh.run import run_fresh  # noqa: E402

MODELS = '''
import keras, numpy as np

def dense():
    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(10)], name="dense_model")
    return model, (np.random.rand(8, 512).astype("float32"), np.random.randint(0, 10, 8)), (256, 1024, 4096)

def attention(seq=64, vocab=1000, dim=64):
    L = keras.layers
    tokens = keras.Input((seq,), dtype="int32")
    h = L.Embedding(vocab, dim, name="embed")(tokens)
    h = L.LayerNormalization(name="ln1")(h + L.MultiHeadAttention(num_heads=4, key_dim=16, name="mha")(h, h))
    f = L.Dense(dim, name="ffn_out")(L.Dense(128, activation="relu", name="ffn_in")(h))
    h = L.LayerNormalization(name="ln2")(h + f)
    model = keras.Model(tokens, L.Dense(10, name="head")(L.GlobalAveragePooling1D()(h)), name="attention_model")
    return model, (np.random.randint(0, vocab, (8, seq)).astype("int32"), np.random.randint(0, 10, 8)), (16, 64, 128)

def conv():
    L = keras.layers
    model = keras.Sequential([keras.Input((32, 32, 3)), L.Conv2D(16, 3, padding="same", activation="relu", name="conv1"),
                              L.MaxPooling2D(name="pool1"), L.Conv2D(32, 3, padding="same", activation="relu", name="conv2"),
                              L.MaxPooling2D(name="pool2"), L.Flatten(), L.Dense(10, name="head")], name="conv_model")
    return model, (np.random.rand(8, 32, 32, 3).astype("float32"), np.random.randint(0, 10, 8)), (32, 128, 256)
'''

STEPS = MODELS + '''
import json, time
import tensorflow as tf
import tfmem_widgets
from tfmem_widgets.plans.need import cpu_copy
device = {device!r}
with tf.device(device):
    spare = tf.zeros([{spare_mb} << 18]); del spare     # a free chunk every step's request is split from
keras.utils.set_random_seed(0)
model, sample, batches = {shape}()
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
rows = []
for batch in batches:
    tf.config.experimental.reset_memory_stats(device)
    held = tf.config.experimental.get_memory_info(device)["current"]
    started = time.perf_counter()
    planned = tfmem_widgets.plan(model, sample, batch)
    seconds = time.perf_counter() - started
    after = tf.config.experimental.get_memory_info(device)
    held, rose = after["current"] - held, after["peak"] - held
    with tf.device(device):
        x = tf.constant(np.resize(sample[0], (batch,) + sample[0].shape[1:])); y = tf.constant(np.resize(sample[1], (batch,)))
    model.make_train_function()
    model.train_function([(x, y)]); model.train_function([(x, y)])   # compiled, warm
    tf.config.experimental.reset_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)["current"]
    model.train_function([(x, y)])
    measured = tf.config.experimental.get_memory_info(device)["peak"] - before
    started = time.perf_counter()
    with tf.device("/CPU:0"):   # what a refused fit is told while it waits: XLA's CPU program of a copy
        cpu = tfmem_widgets.plan(cpu_copy(model), sample, batch).step_bytes if device.startswith("GPU") else None
    cpu_seconds = time.perf_counter() - started
    rows.append(dict(batch=batch, plan=planned.step_bytes, measured=measured, worst=planned.worst_take_bytes,
                     unattributed=planned.layers.unattributed_bytes, seconds=seconds, held=held, rose=rose,
                     cpu=cpu, cpu_seconds=cpu_seconds))
print("ROWS " + json.dumps(rows))
'''

CONV_SEARCH_MODEL = '''
def build_model():
    import keras
    L = keras.layers
    model = keras.Sequential([keras.Input((32, 32, 3)), L.Conv2D(128, 3, padding="same", activation="relu"),
                              L.Conv2D(256, 3, padding="same", activation="relu"),
                              L.Conv2D(256, 3, padding="same", activation="relu"),
                              L.GlobalAveragePooling2D(), L.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    return model

def make_batch(n):
    import numpy as np
    return np.ones((n, 32, 32, 3), "float32"), np.zeros((n,), "int32")
'''

GPU_SEARCH_MODEL = '''
def build_model():
    import keras
    model = keras.Sequential([keras.Input((768,)), keras.layers.Dense(2560, activation="relu"),
                              keras.layers.Dense(1280, activation="relu"), keras.layers.Dense(6)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # XLA on a GPU: Keras' default
    return model

def make_batch(n):
    import numpy as np
    return np.ones((n, 768), "float32"), np.zeros((n,), "int32")
'''

SEARCH_MODEL = '''
def build_model():
    import keras
    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=True)
    return model

def make_batch(n):
    import numpy as np
    return np.ones((n, 512), "float32"), np.ones((n, 1), "float32")
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--skip-search", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--search", choices=("dense", "conv"), default="dense")
    parser.add_argument("--autotune-off", action="store_true", help="with --gpu: XLA's autotuner off")
    parser.add_argument("--method", choices=("plan", "probe"), help="that search alone (no ratio)")
    args = parser.parse_args()
    if args.gpu and args.search == "conv":
        parser.error("--search conv runs in lab mode only")
    if args.autotune_off and not args.gpu:
        parser.error("--autotune-off is for --gpu (XLA on a CPU has no autotuner)")
    setup = {"growth": True} if args.gpu else {"lab_mb": 1024}
    device = "GPU:0" if args.gpu else "CPU:0"
    import os

    print("== plans against measured steps (jit_compile=True), " + ("GPU" if args.gpu else "lab mode 1024 MB")
          + f"; XLA_FLAGS {os.environ.get('XLA_FLAGS') or 'unset'}")
    for shape in () if args.skip_steps else ("dense", "attention", "conv"):
        run = run_fresh(STEPS.format(device=device, spare_mb=768, shape=shape), setup=setup, echo=False,
                        returns=["rows"])
        for row in run.values["rows"]:
            error = (row["measured"] - row["plan"]) / row["measured"]
            print(f"{shape:<10} batch {row['batch']:>5}: plan {row['plan']:>12,} B  measured {row['measured']:>12,} B  "
                  f"error {error:+.4%}  worst take {row['worst']:>12,} B  unattributed {row['unattributed']:,} B  "
                  f"planned in {row['seconds']:.2f} s; the plan held {row['held']:,} B, raised the peak {row['rose']:,} B")
            if row["cpu"] is not None:
                cpu_error = (row["measured"] - row["cpu"]) / row["measured"]
                print(f"{'':<10} a CPU copy's plan {row['cpu']:>12,} B  error {cpu_error:+.2%}"
                      f"  planned in {row['cpu_seconds']:.2f} s")
    if args.skip_search:
        return
    namespace: dict = {}
    keras_default = args.gpu and not args.autotune_off
    exec(CONV_SEARCH_MODEL if args.search == "conv" else GPU_SEARCH_MODEL if keras_default else SEARCH_MODEL, namespace)
    search_setup = ({"limit_mb": 3000 if keras_default else 2000} if args.gpu
                    else {"lab_mb": 256 if args.search == "conv" else 128})
    env = {"XLA_FLAGS": "--xla_gpu_autotune_level=0"} if args.autotune_off else None
    # This process as a notebook's kernel is where the model was written: TensorFlow imported. A probe that ran
    # out of memory is read here with TensorFlow's protobuf, and that import (3-4 s) would otherwise count
    # in whichever search meets its first OOM first (the probe search, run first).
    import tensorflow  # noqa: F401

    which = f"the {args.method} search alone" if args.method else "the probe search and the plan search, one after the other"
    print(f"\n== what fits: {which}, " + json.dumps(search_setup))
    found, cpu = {}, {}
    for method in (args.method,) if args.method else ("probe", "plan"):
        started, before = time.perf_counter(), _cpu_of_children()
        search = tfmem_widgets.max_batch_size(namespace["build_model"], namespace["make_batch"], setup=search_setup,
                                              high=262144 if args.gpu else 16384, progress="lines", method=method,
                                              env=env)
        found[method] = (search, time.perf_counter() - started)
        cpu[method] = _cpu_of_children() - before
        safe, failure = search.edge
        print(f"{method:<6} largest below every failure {safe:,}, smallest failure {failure:,}; "
              f"{len(search.plans)} plans, {len(search.probes)} probes; {found[method][1]:.1f} s; "
              f"its processes' CPU {cpu[method]:.1f} s ({cpu[method] / found[method][1]:.1f} cores busy)")
        if search.plans:
            compiles = sum(p.trace_seconds + p.compile_seconds for p in search.plans)
            print(f"       the planning process {search.plan_seconds:.1f} s, its compiles {compiles:.1f} s, at "
                  + ", ".join(f"{p.batch_size:,}" for p in search.plans))
            print("       the probes " + ", ".join(f"{p.batch:,} {'trained' if p.fits else 'did not'} ({p.seconds:.1f} s)"
                                               for p in search.probes)
                  + "".join(f"; {note}" for note in search.notes if "were probed while the plan" in note
                            or "kernel timings" in note))
    if args.method:
        return
    ratio = found["plan"][1] / found["probe"][1]
    same = abs(found["plan"][0].edge[0] - found["probe"][0].edge[0]) <= max(1, found["probe"][0].edge[0] * 0.02)
    print(f"plan / probe time: x{ratio:.2f}; CPU x{cpu['plan'] / cpu['probe']:.2f}; the same edge within the 2% "
          f"resolution: {same}")


def _cpu_of_children() -> float:
    """The CPU seconds (user and system) of this process's children that have ended: a search's processes."""
    import resource

    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


if __name__ == "__main__":
    main()
