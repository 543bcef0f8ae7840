"""What recording allocator events costs a Keras fit: the recorder and a trace against nothing.

    python3 dev.py bench          # or: .venv/bin/python benchmarks/profiler_overhead.py [--gpu]

One process trains a small Keras model (about 5 s an epoch in lab mode here) (lab mode on a CPU; the first GPU with --gpu), one
epoch per run, four ways: bare, with ``tfmem_widgets.record(window=1)`` running (host tracer
only, its options now taken; its windows end every second in its own thread; the fit's own time is measured, as a
cell sees it), under ``tfmem_widgets.trace()`` (host tracer only, the events read at its
end), and under TensorFlow's profiler with its default options (device tracer on: what
``%%tfmem trace`` ran before), for scale. Runs rotate in rounds so a drift of the machine
hits every way alike; each figure is the median over rounds of (time with / time bare).
The time of a trace includes reading its events when the block ends; where it goes is printed
too: the fit while the profiler records, TensorFlow's stop (collecting and writing every host
event of the block), and reading the file (medians over rounds, in seconds and as shares of the
bare epoch), with the file's size and its events.
"""

from __future__ import annotations

import sys

from _workloads import run_keras_rounds

CODE = """
import json, statistics, tempfile, time, shutil
from tfmem_widgets.tracing import block, recorder

# Where a trace's time goes: TensorFlow's stop and the read of its file, timed where the block calls them.
parts = {"stop": [], "read": [], "fit": [], "file_mb": [], "events": [], "memory_events": [], "listener_events": [], "rest": []}
_stop, _read = block.profiler_stop, block.read_xplane_file

def timed_stop():
    started = time.perf_counter(); _stop(); parts["stop"].append(time.perf_counter() - started)

def timed_read(path):
    import os
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    started = time.perf_counter(); out = _read(path); parts["read"].append(time.perf_counter() - started)
    counting = time.perf_counter()   # the file's figures: taken off the trace's time below
    space = xplane_pb2.XSpace(); space.ParseFromString(open(path, "rb").read())
    parts["file_mb"].append(os.path.getsize(path) / 1e6)
    parts["events"].append(sum(len(line.events) for plane in space.planes for line in plane.lines))
    parts["listener_events"].append(sum(
        1 for plane in space.planes for line in plane.lines for event in line.events
        if plane.event_metadata[event.metadata_id].name.startswith("ThreadpoolListener")))
    parts["counting"] = time.perf_counter() - counting
    parts["memory_events"].append(sum(len(e) for e in out.values()))
    return out

block.profiler_stop, block.read_xplane_file = timed_stop, timed_read
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
        parts["fit"].append(time.perf_counter() - start)
    seconds = time.perf_counter() - start - parts.pop("counting")
    assert sum(len(t.events(a)) for a in t.allocators) > 1000
    parts["rest"].append(seconds - parts["fit"][-1] - parts["stop"][-1] - parts["read"][-1])
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
print(json.dumps({"bare_s": statistics.median(bares), "trace_rounds": parts,
                  "trace_parts": {k: statistics.median(v) for k, v in parts.items()},
                  "ratios": {k: statistics.median(v) for k, v in ratios.items()},
                  "all": ratios, "device": "GPU" if tf.config.list_physical_devices("GPU") else "CPU (lab mode)"}))
"""


def main() -> int:
    out, rounds = run_keras_rounds(CODE, __doc__.splitlines()[0])
    print(f"Keras fit, one epoch, {out['device']}: bare {out['bare_s']:.2f} s (median of {2 * rounds})")
    for name, ratio in out["ratios"].items():
        print(f"  {name:<17} x{ratio:.2f}  (median of {rounds} rounds)")
    part = out["trace_parts"]
    bare = out["bare_s"]
    print(f"  where a trace's time goes (medians): the fit while recording {part['fit']:.2f} s (x{part['fit'] / bare:.2f}"
          f" of bare), TensorFlow's stop {part['stop']:.2f} s (+{part['stop'] / bare:.2f}), reading the file "
          f"{part['read']:.2f} s (+{part['read'] / bare:.2f}), the rest of the block's end {part['rest']:.2f} s "
          f"(+{part['rest'] / bare:.2f}); the file {part['file_mb']:.1f} MB, "
          f"{part['events']:,.0f} host events, {part['memory_events']:,.0f} of them the allocator's, "
          f"{part['listener_events']:,.0f} the thread pool listener's")
    rounds_ = out["trace_rounds"]
    for k, ratio in enumerate(out["all"]["trace"]):
        print(f"    round {k + 1}: trace x{ratio:.2f} = the fit {rounds_['fit'][k]:.2f} s + stop {rounds_['stop'][k]:.2f} s "
              f"+ read {rounds_['read'][k]:.2f} s + the rest {rounds_['rest'][k]:.2f} s, against that round's bare epoch")
    return 0

if __name__ == "__main__":
    sys.exit(main())
