"""What MemoryCallback costs a Keras fit: per epoch, and per batch, against nothing.

    python3 dev.py bench          # or: .venv/bin/python benchmarks/callback_overhead.py [--gpu]

One process trains a small Keras model (lab mode on a CPU; the first GPU with --gpu), one epoch
of 2,048 steps per run, three ways side by side: bare, with ``MemoryCallback()`` (a measure()
block per epoch) and with ``MemoryCallback(per_batch=True)`` (one per step as well). Runs rotate
in rounds so a drift of the machine hits every way alike; each figure is the median over rounds
of (time with / time bare).
"""

from __future__ import annotations

import sys

from _workloads import run_keras_rounds

CODE = """
import json, statistics, time
from tfmem_widgets.readings.callback import MemoryCallback
model.fit(x, y, batch_size=128, epochs=1, verbose=0)   # warm-up: tracing, first allocations

def timed(callbacks):
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=128, epochs=1, verbose=0, callbacks=callbacks)
    seconds = time.perf_counter() - start
    assert not callbacks or history.history["tfmem_peak_bytes"][0] > 0
    return seconds

ways = {"per epoch": lambda: timed([MemoryCallback()]), "per batch": lambda: timed([MemoryCallback(per_batch=True)])}
ratios = {name: [] for name in ways}
bares = []
for round_ in range(ROUNDS):
    names = list(ways)[round_ % 2:] + list(ways)[:round_ % 2]
    base = timed([])
    bares.append(base)
    for name in names:
        ratios[name].append(ways[name]() / base)
    bares.append(timed([]))
print(json.dumps({"bare_s": statistics.median(bares), "ratios": {k: statistics.median(v) for k, v in ratios.items()},
                  "device": "GPU" if tf.config.list_physical_devices("GPU") else "CPU (lab mode)"}))
"""


def main() -> int:
    out, rounds = run_keras_rounds(CODE, __doc__.splitlines()[0])
    print(f"Keras fit, one epoch of 2,048 steps, {out['device']}: bare {out['bare_s']:.2f} s "
          f"(median of {2 * rounds})")
    for name, ratio in out["ratios"].items():
        print(f"  MemoryCallback {name}: x{ratio:.3f} ({(ratio - 1) * 100:+.1f}%)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
