"""What a live gauge costs a training loop: sampling at 10 Hz against no gauge.

    python3 dev.py bench          # or: .venv/bin/python benchmarks/gauge_overhead.py

A real Jupyter kernel (so widget updates are real messages on its iopub channel) trains a
small Keras model in lab mode, one epoch per run. Runs alternate in pairs, off/on then on/off
(ABBA, so a drift of the machine hits both sides alike); the figure is the median of the
per-pair ratios (time with the gauge / time without), as a slowdown in percent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from _workloads import keras_classifier

ROOT = Path(__file__).resolve().parents[1]

SETUP = keras_classifier(lab_mb=1024, width=256, rows=131072) + """
import time
from tfmem_widgets import Gauge
model.fit(x, y, batch_size=128, epochs=1, verbose=0)   # warm-up: tracing, first allocations

from tfmem_widgets.readings.sampler import sampler

def timed(with_gauge, bare=False):
    gauge = token = None
    if with_gauge and bare:
        token = sampler.subscribe(lambda sample: None, 0.1)   # readings only, no widget
    elif with_gauge:
        gauge = Gauge(interval=0.1)
    start = time.perf_counter()
    model.fit(x, y, batch_size=128, epochs=1, verbose=0)
    seconds = time.perf_counter() - start
    samples = gauge.samples if gauge is not None else 0
    if gauge is not None:
        gauge.close()
    if token is not None:
        sampler.unsubscribe(token)
    return seconds, samples
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--bare", action="store_true", help="the sampler thread alone, without a widget")
    args = parser.parse_args()
    from jupyter_client.manager import start_new_kernel

    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    manager, client = start_new_kernel(kernel_name="python3", env=env, cwd=str(ROOT))
    try:
        def run(code: str) -> str:
            reply_text = []

            def on_output(msg):
                if msg["msg_type"] == "stream":
                    reply_text.append(msg["content"]["text"])
                elif msg["msg_type"] == "error":
                    reply_text.append("\n".join(msg["content"]["traceback"]))

            reply = client.execute_interactive(code, timeout=600, output_hook=on_output)
            if reply["content"]["status"] != "ok":
                sys.exit("benchmark kernel failed:\n" + "".join(reply_text))
            return "".join(reply_text)

        run(SETUP)
        ratios, samples, plain = [], [], []
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            times = {}
            for with_gauge in order:
                out = json.loads(run(f"import json; print(json.dumps(timed({with_gauge}, {args.bare})))").strip())
                times[with_gauge] = out[0]
                if with_gauge:
                    samples.append(out[1])
            ratios.append(times[True] / times[False])
            plain.append(times[False])
        slowdown = (statistics.median(ratios) - 1) * 100
        what = "sampler thread alone" if args.bare else "gauge"
        print(f"{what} at 10 Hz during a Keras epoch ({statistics.median(plain):.2f} s without it, "
              f"{statistics.median(samples):.0f} readings with it): slowdown {slowdown:+.2f}% "
              f"(median of {len(ratios)} ABBA pairs; pair ratios {min(ratios):.3f} to {max(ratios):.3f})")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


if __name__ == "__main__":
    main()
