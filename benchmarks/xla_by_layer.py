"""A traced XLA fit read by layer: how much of its peak the plan names, on the lab bench or a GPU.

    .venv/bin/python benchmarks/xla_by_layer.py [--gpu] [--autotune-off]

One fresh process trains a Dense 256-2048-4096-1 model (Adam, mse, ``jit_compile=True``: Keras'
default step on a GPU) for two epochs of 8 batches of 1,024 under ``tfmem_widgets.trace()`` (lab mode,
600 MB; with --gpu on the first GPU with memory growth, XLA's GEMM autotuner on unless
--autotune-off), then reads the trace by layer at its peak. Prints the peak by layer, the share no
name reached (``(unattributed)``), the plan's allocations and the chunks the program took while it
compiled (its autotuner's trials, taken and given back before its first run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CODE = """
import json
import numpy as np
import tfmem_widgets
tfmem_widgets.setup(**SETUP)
import keras
from tfmem_widgets.readings.layers import COMPILE_SCRATCH, UNATTRIBUTED, planned_program_sizes

model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(2048, activation="relu", name="wide"),
                          keras.layers.Dense(4096, name="wider"), keras.layers.Dense(1, name="out")])
model.compile("adam", "mse", jit_compile=True)
x = np.random.rand(8192, 256).astype("float32"); y = np.random.rand(8192, 1).astype("float32")
with tfmem_widgets.trace() as t:
    model.fit(x, y, batch_size=1024, epochs=2, verbose=0)
layers = t.by_layer("peak")
allocator = t.allocators[0]
events = t.events(allocator)
scratch = sum(1 for k in range(len(events)) if events.kind[k] > 0 and events.text(events.op, k).endswith(COMPILE_SCRATCH))
print(json.dumps({"text": repr(layers), "total": layers.total_bytes,
                  "unattributed": sum(layers.rows.get(UNATTRIBUTED, {}).values()),
                  "allocator": allocator, "scratch_chunks": scratch, "planned": planned_program_sizes()}))
"""

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="the first GPU with memory growth (no lab mode)")
    parser.add_argument("--autotune-off", action="store_true", help="XLA_FLAGS=--xla_gpu_autotune_level=0")
    args = parser.parse_args()
    setup = {"growth": True} if args.gpu else {"lab_mb": 600}
    code = CODE.replace("SETUP", repr(setup))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    if args.autotune_off:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        sys.exit(f"benchmark failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(out["text"])
    share = out["unattributed"] / out["total"] if out["total"] else 0.0
    print(f"{out['allocator']}: (unattributed) {share:.1%} of {out['total'] / 2**20:.2f} MiB at the peak; "
          f"planned buffers of temporaries: {', '.join(f'{b:,} B' for b in out['planned']) or 'none'}; "
          f"chunks taken while compiling: {out['scratch_chunks']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
