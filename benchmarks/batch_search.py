"""How many probes and how long the batch search takes, and its picture.

    .venv/bin/python benchmarks/batch_search.py [--lab MB] [--high N] [--plot PATH]

A Keras model of three Dense layers (512 -> 1024 -> 1024 -> 1, Adam, no XLA) searched in lab
mode between 1 and 16,384 examples, each probe a fresh process running two train steps. Prints
the search (every probe, its peak or OOM, its seconds), the wall time, and saves the plot of
peak against batch (docs/batch_search.png by default).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import tfmem_widgets

ROOT = Path(__file__).resolve().parents[1]


def build_model():
    import keras

    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=False)
    return model


def make_batch(n):
    import numpy as np

    return np.ones((n, 512), "float32"), np.ones((n, 1), "float32")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lab", type=int, default=128, help="lab mode's limit in MB")
    parser.add_argument("--high", type=int, default=16384)
    parser.add_argument("--plot", default=str(ROOT / "docs" / "batch_search.png"))
    args = parser.parse_args()
    started = time.perf_counter()
    search = tfmem_widgets.max_batch_size(build_model, make_batch, setup={"lab_mb": args.lab}, high=args.high,
                                          margin=0.1, progress="lines")
    wall = time.perf_counter() - started
    print(search)
    print(f"wall time {wall:.0f} s for {len(search.probes)} probes")
    import matplotlib

    matplotlib.use("Agg")
    ax = search.plot(pick=search.recommended)
    ax.figure.tight_layout()
    ax.figure.savefig(args.plot, dpi=90)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    import cloudpickle

    import __main__

    cloudpickle.register_pickle_by_value(__main__)  # a script's functions travel by value, as a notebook's do
    main()
