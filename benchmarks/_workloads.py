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


def run_keras_rounds(code: str, description: str) -> tuple[dict, int]:
    """Parse --rounds and --gpu, run `code` (ROUNDS filled in) after keras_classifier's setup in
    a fresh process, and return the JSON object it prints last, with the rounds asked for."""
    import argparse
    import json
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--gpu", action="store_true", help="train on the GPU (no lab mode)")
    args = parser.parse_args()
    setup = keras_classifier(lab_mb=1024, width=256, rows=262144)
    if args.gpu:
        setup = setup.replace("tfmem_widgets.setup(lab_mb=1024)", "tfmem_widgets.setup(growth=True)")
    code = setup + textwrap.dedent(code).replace("ROUNDS", str(args.rounds))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        sys.exit(f"benchmark failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), args.rounds
