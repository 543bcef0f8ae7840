"""What the guard (%tfmem guard) costs a Keras fit that fits: its one plan, and nothing after it.

    python3 dev.py bench          # or: .venv/bin/python benchmarks/guard_cost.py [--gpu] [--rounds N]

One process trains a small Keras model (lab mode on a CPU; the first GPU with --gpu), one epoch of 2,048
steps per fit, three ways side by side in each round: the guard off; on, for a model, batch and shapes not
planned yet (it plans the step first); on again (planned already). Rounds rotate so a drift of the machine
hits every way alike; each figure is the median over rounds of (time / time with the guard off), and the guard's
own seconds (its traced step and plan) are timed apart, as the fits' noise can be larger than they are.
"""

from __future__ import annotations

import sys

from _workloads import run_keras_rounds

CODE = """
import json, statistics, time
from tfmem_widgets.notebook import fit_hook
fit_hook.hook_fit()
judged = []  # the guard's own seconds: the traced step and its plan, where a fit was not planned yet
verdict = fit_hook._verdict
def timed_verdict(*args):
    start = time.perf_counter()
    try:
        return verdict(*args)
    finally:
        judged.append(time.perf_counter() - start)
fit_hook._verdict = timed_verdict
model.fit(x, y, batch_size=128, epochs=1, verbose=0)   # warm-up: tracing, first allocations

def timed(on):
    if fit_hook.guarding() != on:
        fit_hook.guard(on)  # (off forgets every plan: the next fit with it on plans again)
    start = time.perf_counter()
    model.fit(x, y, batch_size=128, epochs=1, verbose=0)
    return time.perf_counter() - start

bares, first, again = [], [], []
for round_ in range(ROUNDS):
    base = timed(False)
    bares.append(base)
    first.append(timed(True) / base)
    again.append(timed(True) / base)
assert len(judged) == ROUNDS  # one plan a round: the fit after it planned nothing
print(json.dumps({"bare_s": statistics.median(bares), "first": statistics.median(first),
                  "plan_s": statistics.median(judged),
                  "again": statistics.median(again),
                  "device": "GPU" if tf.config.list_physical_devices("GPU") else "CPU (lab mode)"}))
"""


def main() -> int:
    out, rounds = run_keras_rounds(CODE, __doc__.splitlines()[0])
    print(f"Keras fit, one epoch of 2,048 steps, {out['device']}: guard off {out['bare_s']:.2f} s (median of {rounds})")
    print(f"  guard on, the step planned first: x{out['first']:.3f} ({(out['first'] - 1) * 100:+.1f}%, "
          f"{(out['first'] - 1) * out['bare_s']:.2f} s)")
    print(f"  guard on, planned already:        x{out['again']:.3f} ({(out['again'] - 1) * 100:+.1f}%)")
    print(f"  the guard's own time, a fit not planned yet: {out['plan_s']:.2f} s (median), "
          f"{out['plan_s'] / out['bare_s'] * 100:.1f}% of the fit without it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
