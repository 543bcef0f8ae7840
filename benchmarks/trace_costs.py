"""What a trace costs: memory against the xplane.pb, time for a million events, drawing.

    python3 dev.py bench          # or: .venv/bin/python benchmarks/trace_costs.py

1. A 10-step Keras fit in lab mode is traced; then, in a fresh process, the extra peak
   memory of reading its xplane.pb and rebuilding the allocator is set against the file's size.
2. Reading and rebuilding the pool at the end is timed, side by side with XProf's own
   memory-profile conversion of the same xplane.pb (package tensorboard-plugin-profile),
   alternating, in one process (medians of three each, 41 for the small Keras trace, and their
   ratio), for four traces: the Keras fit above; a Keras fit of 500 steps; an eager loop of 200,000
   tf.fills (about 800,000 allocator events, each allocation named by the op activity around it); a
   million allocator events of a tf.function loop of 500,000 steps, each making and dropping one
   tensor, on TensorFlow's real BFC allocator. The pool is rebuilt as the trace's own map rebuilds
   it (Trace.is_fresh, printed): from the allocator's first allocation where the trace began before
   TensorFlow's runtime, else from the chunks the trace saw allocated.
3. The memory map of the first 100,000 chunks of that trace is drawn (Agg) and timed.

Each measurement runs in its own process, so one does not inflate another's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _workloads import keras_classifier

ROOT = Path(__file__).resolve().parents[1]


def run(code: str, **env) -> dict:
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"benchmark step failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def record_keras(workdir: Path, steps: int = 10) -> dict:
    folder = str(workdir / f"keras-{steps}")
    return run(keras_classifier(lab_mb=2048, width=512, rows=64 * steps) + textwrap.dedent(f"""
        import json
        with tfmem_widgets.trace(keep={folder!r}) as t:
            model.fit(x, y, batch_size=64, epochs=1, verbose=0)    # {steps} steps
        path = __import__("glob").glob({folder!r} + "/*/plugins/profile/*/*.xplane.pb")[0]
        print(json.dumps({{"path": path, "bytes": __import__("os").path.getsize(path),
                          "events": sum(len(t.events(a)) for a in t.allocators),
                          "fresh": t.is_fresh("bfc_cpu_allocator_for_gpu")}}))
    """))


def memory_of_reading(path: str) -> dict:
    """Extra peak memory of reading a trace and rebuilding its maps, in a fresh process.

    The reader's first use in a process costs a fixed few MiB (code paths warming up, numpy's
    caches); that is measured apart, on a one-event trace, so the figure per trace is what
    grows with it.
    """
    return run(f"""
        import json, resource, psutil
        import matplotlib, tensorflow, tfmem_widgets
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
        from tfmem_widgets.tracing.block import Trace
        from tfmem_widgets.tracing.xspace import read_xplane_file, read_xspace

        def peak():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        def tiny():
            space = xplane_pb2.XSpace()
            plane = space.planes.add(name="/host:CPU")
            plane.event_metadata[1].name = "MemoryAllocation"
            for mid, name in ((2, "allocator_name"), (3, "addr"), (4, "allocation_bytes"), (5, "cpu")):
                plane.stat_metadata[mid].name = name
            event = plane.lines.add().events.add(metadata_id=1, offset_ps=1)
            event.stats.add(metadata_id=2, ref_value=5)
            event.stats.add(metadata_id=3, int64_value=4096)
            event.stats.add(metadata_id=4, int64_value=256)
            return space.SerializeToString()

        start = psutil.Process().memory_info().rss
        Trace(read_xspace(tiny()), fresh=False, growth={{}}).map()
        first_use = peak() - start
        baseline = psutil.Process().memory_info().rss
        t = Trace(read_xplane_file({path!r}), fresh=False, growth={{}})
        for name in t.allocators:
            t.map(allocator=name); t.map("peak", allocator=name)
        print(json.dumps({{"extra_bytes": peak() - baseline, "first_use_bytes": first_use}}))
    """)


def record_million(workdir: Path, steps: int) -> dict:
    return run(f"""
        import json, glob, tfmem_widgets
        tfmem_widgets.setup(lab_mb=256)
        import tensorflow as tf
        @tf.function
        def loop(x):
            # tf.while_loop itself: AutoGraph cannot read the source of code run with -c.
            return tf.while_loop(lambda i, x: i < {steps}, lambda i, x: (i + 1, x * 1.0001 + 1.0), (0, x))[1]
        with tfmem_widgets.trace(keep={str(workdir / 'million')!r}) as t:
            with tf.device("CPU:0"):
                loop(tf.zeros((64,)))
        path = glob.glob({str(workdir / 'million')!r} + "/*/plugins/profile/*/*.xplane.pb")[0]
        print(json.dumps({{"path": path, "bytes": __import__("os").path.getsize(path),
                          "events": len(t.events("bfc_cpu_allocator_for_gpu")),
                          "fresh": t.is_fresh("bfc_cpu_allocator_for_gpu")}}))
    """)


def record_eager(workdir: Path, steps: int) -> dict:
    """An eager loop of small tf.fills: each allocation's name comes from the activities around it
    (the op's TraceMe), the case that made reading 4 times slower before it was done with arrays."""
    return run(f"""
        import json, glob, tfmem_widgets
        tfmem_widgets.setup(lab_mb=256)
        import tensorflow as tf
        tf.fill((64,), 1.0)
        with tfmem_widgets.trace(keep={str(workdir / 'eager')!r}) as t:
            for _ in range({steps}):
                tf.fill((64,), 1.0)
        path = glob.glob({str(workdir / 'eager')!r} + "/*/plugins/profile/*/*.xplane.pb")[0]
        print(json.dumps({{"path": path, "bytes": __import__("os").path.getsize(path),
                          "events": len(t.events("bfc_cpu_allocator_for_gpu")),
                          "fresh": t.is_fresh("bfc_cpu_allocator_for_gpu")}}))
    """)


def _pool(trace: dict) -> str:
    return "pool rebuilt from the allocator's first allocation" if trace["fresh"] else "pool rebuilt from mid-run"


def time_million(path: str, rounds: int = 3, fresh: bool = False) -> dict:
    """Reading `path` and rebuilding the pool at its end, against XProf's conversion. fresh: as the
    trace's own map says (Trace.is_fresh: traced from the runtime's start, nothing in use before)."""
    return run(f"""
        import json, statistics, time
        import tensorflow
        from tfmem_widgets.tracing.replay import Replay
        from tfmem_widgets.tracing.xspace import read_xplane_file
        from xprof.convert import raw_to_tool_data
        ours, xprof = [], []
        for _ in range({rounds}):
            start = time.perf_counter()
            events = read_xplane_file({path!r})["bfc_cpu_allocator_for_gpu"]
            Replay(events, fresh={fresh!r}).run_to(len(events) - 1).snapshot()  # as the trace's map
            ours.append(time.perf_counter() - start)
            del events
            start = time.perf_counter()
            raw_to_tool_data.xspace_to_tool_data([{path!r}], "memory_profile", {{}})
            xprof.append(time.perf_counter() - start)
        print(json.dumps({{"ours": statistics.median(ours), "xprof": statistics.median(xprof),
                          "ours_all": ours, "xprof_all": xprof}}))
    """)


def time_render(path: str, chunks: int) -> dict:
    return run(f"""
        import json, statistics, time
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        import tensorflow
        from tfmem_widgets.tracing.block import Trace
        from tfmem_widgets.tracing.xspace import read_xspace
        events = read_xspace(open({path!r}, "rb").read())["bfc_cpu_allocator_for_gpu"]
        allocs = np.cumsum(events.kind > 0)
        stop = min(int(np.searchsorted(allocs, {chunks})) + 1, len(events))   # fewer with a small --steps
        t = Trace({{"bfc_cpu_allocator_for_gpu": events.slice(stop)}}, fresh=True, growth={{}})
        times = []
        for _ in range(3):
            start = time.perf_counter()
            ax = t.plot_map()
            ax.figure.canvas.draw()
            times.append(time.perf_counter() - start)
            plt.close("all")
        print(json.dumps({{"seconds": statistics.median(times), "chunks": int(allocs[stop - 1])}}))
    """)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500_000, help="loop steps (two events each)")
    parser.add_argument("--workdir", default=None, help="where the traces go (default: a temporary folder)")
    parser.add_argument("--reading-only", action="store_true",
                        help="only part 2: the reading times against XProf's, for the three traces")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tfmem-bench-"))
    try:
        measure_all(workdir, args.steps, reading_only=args.reading_only)
    finally:
        if args.workdir is None:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)


def measure_all(workdir: Path, steps: int, reading_only: bool = False) -> None:
    mb = 1 << 20

    keras = record_keras(workdir)
    if not reading_only:
        memory = memory_of_reading(keras["path"])
        print(f"Keras fit, 10 steps: xplane.pb {keras['bytes'] / mb:.1f} MiB, {keras['events']:,} allocator events; "
              f"reading it and rebuilding its maps took {memory['extra_bytes'] / mb:.1f} MiB more memory "
              f"= {memory['extra_bytes'] / keras['bytes']:.2f} x the file (the reader's first use in a process: "
              f"{memory['first_use_bytes'] / mb:.1f} MiB once)", flush=True)

    # milliseconds each: more rounds, for a steady median
    timing = time_million(keras["path"], rounds=41, fresh=keras["fresh"])
    print(f"Keras fit, 10 steps: read + rebuild {timing['ours'] * 1000:.2f} ms; XProf memory_profile conversion "
          f"{timing['xprof'] * 1000:.2f} ms; ratio {timing['ours'] / timing['xprof']:.2f} "
          f"(medians of 41, alternating; {_pool(keras)})",
          flush=True)

    long = record_keras(workdir, 500)
    timing = time_million(long["path"], fresh=long["fresh"])
    print(f"Keras fit, 500 steps, {long['events']:,} allocator events (xplane.pb {long['bytes'] / mb:.0f} MiB): "
          f"read + rebuild {timing['ours']:.2f} s; XProf memory_profile conversion {timing['xprof']:.2f} s; "
          f"ratio {timing['ours'] / timing['xprof']:.2f} (medians of 3, alternating; {_pool(long)})", flush=True)

    eager = record_eager(workdir, steps * 2 // 5)
    timing = time_million(eager["path"], fresh=eager["fresh"])
    print(f"eager loop, {eager['events']:,} allocator events (xplane.pb {eager['bytes'] / mb:.0f} MiB): "
          f"read + rebuild {timing['ours']:.2f} s; XProf memory_profile conversion {timing['xprof']:.2f} s; "
          f"ratio {timing['ours'] / timing['xprof']:.2f} (medians of 3, alternating; {_pool(eager)})", flush=True)

    million = record_million(workdir, steps)
    timing = time_million(million["path"], fresh=million["fresh"])
    print(f"tf.function loop, {million['events']:,} allocator events (xplane.pb {million['bytes'] / mb:.0f} MiB): "
          f"read + rebuild {timing['ours']:.2f} s; XProf memory_profile conversion {timing['xprof']:.2f} s; "
          f"ratio {timing['ours'] / timing['xprof']:.2f} (medians of 3, alternating; {_pool(million)})", flush=True)

    if reading_only:
        return
    render = time_render(million["path"], 100_000)
    print(f"memory map of {render['chunks']:,} chunks drawn in {render['seconds']:.2f} s (Agg, median of 3)")


if __name__ == "__main__":
    main()
