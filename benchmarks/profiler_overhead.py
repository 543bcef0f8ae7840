"""What recording allocator events costs a Keras fit: the recorder and a trace against nothing.

    python3 dev.py bench          # or: .venv/bin/python benchmarks/profiler_overhead.py [--gpu]

One process trains a small Keras model (about 5 s an epoch in lab mode here) (lab mode on a CPU; the first GPU with --gpu), one
epoch per run, four ways: bare, with ``tfmem_widgets.record(window=1)`` running (host tracer
only, its options now taken; its windows end every second in its own thread; the fit's own time is measured, as a
cell sees it), under ``tfmem_widgets.trace()`` (host tracer only, the events read at its
end), and under TensorFlow's profiler with its default options (device tracer on: what
``%%tfmem trace`` ran before), for scale. Runs rotate in rounds so a drift of the machine
hits every way alike; each figure is the median over rounds of (time with / time bare).
The time of a trace includes reading its events when the block ends.
"""

from __future__ import annotations

import sys

from _workloads import run_keras_rounds

CODE = """
import json, statistics, tempfile, time, shutil
from tfmem_widgets.tracing import recorder
model.fit(x, y, batch_size=128, epochs=1, verbose=0)   # warm-up: tracing, first allocations

def fit():
    model.fit(x, y, batch_size=128, epochs=1, verbose=0)

def bare():
    start = time.perf_counter(); fit(); return time.perf_counter() - start

def recorded():
    # As a cell sees it: the recorder runs (started in an earlier cell), its windows end every
    # second in its own thread during the fit; stopping it later is another cell.
    r = recorder.record(window=1)
    start = time.perf_counter()
    fit()
    seconds = time.perf_counter() - start
    r.stop()
    assert r.windows >= 2 and r.events > 1000
    return seconds

def traced():
    start = time.perf_counter()
    with tfmem_widgets.trace() as t:
        fit()
    seconds = time.perf_counter() - start
    assert sum(len(t.events(a)) for a in t.allocators) > 1000
    return seconds

def default_profiler():
    folder = tempfile.mkdtemp()
    start = time.perf_counter()
    tf.profiler.experimental.start(folder)
    fit()
    tf.profiler.experimental.stop()
    seconds = time.perf_counter() - start
    shutil.rmtree(folder)
    return seconds

ways = {"record": recorded, "trace": traced, "default profiler": default_profiler}
ratios = {name: [] for name in ways}
bares = []
for round_ in range(ROUNDS):
    names = list(ways)[round_ % 3:] + list(ways)[:round_ % 3]
    base = bare()
    bares.append(base)
    for name in names:
        ratios[name].append(ways[name]() / base)
    bares.append(bare())
print(json.dumps({"bare_s": statistics.median(bares),
                  "ratios": {k: statistics.median(v) for k, v in ratios.items()},
                  "all": ratios, "device": "GPU" if tf.config.list_physical_devices("GPU") else "CPU (lab mode)"}))
"""


def main() -> int:
    out, rounds = run_keras_rounds(CODE, __doc__.splitlines()[0])
    print(f"Keras fit, one epoch, {out['device']}: bare {out['bare_s']:.2f} s (median of {2 * rounds})")
    for name, ratio in out["ratios"].items():
        print(f"  {name:<17} x{ratio:.2f}  (median of {rounds} rounds)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
