"""The rebuilt allocator against TensorFlow's own record of it, for three fragmentation OOMs.

Each pattern runs in a fresh process in lab mode (TensorFlow's real BFC allocator on the CPU):
(a) traced from the allocator's first allocation to the OOM: the map rebuilt from the events
alone must equal TensorFlow's dump of that OOM chunk for chunk, and the fragmentation after
every event must equal TensorFlow's own figure on that event; (b) then, after more work
outside any trace, a second trace to a second OOM: every chunk allocated inside it must
match the dump's chunk at its address, and the memory from before it must have its exact
total. The three processes run side by side (each OOM waits 10 s in TensorFlow's retry).
"""

import pytest

from conftest import finish_fresh, run_fresh, start_fresh

HARNESS = """
import json, numpy as np, tfmem_widgets
tfmem_widgets.setup(lab_mb=LAB_MB)
import tensorflow as tf
from tfmem_widgets import trace

def fill(n_floats):
    with tf.device("CPU:0"):
        return tf.zeros((n_floats,))

def chunks(m, in_use_only=False):
    return [(c.address, c.size, c.in_use) for c in m.chunks if c.in_use or not in_use_only]

def oom(block):
    try:
        block()
    except tf.errors.ResourceExhaustedError:
        return True
    return False

def traced(block):
    # block() under a trace: (trace, whether it ended in an OOM, its events, the map
    # rebuilt from the events alone, TensorFlow's dump).
    raised = False
    try:
        with trace() as t:
            block()
    except tf.errors.ResourceExhaustedError:
        raised = True
    events = t.events()
    rebuilt = t.replay(events.allocator, len(events) - 1).snapshot()
    return t, raised, events, rebuilt, t.dumps.get(events.allocator)

out = {}
# (a) from the allocator's first allocation
def block_a():
    global kept
    kept = PATTERN(1)
    fill(REQUEST)
a, out["a_raised"], events, rebuilt, dump = traced(block_a)
ours = a.fragmentation_series()
theirs = events.fragmentation
out["a_events"] = len(events)
out["a_fresh"] = a.is_fresh(events.allocator)
out["a_chunks_equal"] = chunks(rebuilt) == chunks(dump)
out["a_chunk_count"] = len(dump.chunks)
out["a_frag_nan_agree"] = bool(np.array_equal(np.isnan(ours), np.isnan(theirs)))
out["a_frag_max_diff"] = float(np.nanmax(np.abs(ours - theirs)))
out["a_dump_frag"] = dump.reported_fragmentation
out["a_rebuilt_frag"] = rebuilt.fragmentation
out["a_text_equal"] = a.text_dump is not None and chunks(a.text_dump) == chunks(dump)
out["a_text_regions_equal"] = a.text_dump is not None and a.text_dump.regions == rebuilt.regions
final = a.map()
out["a_final_source"] = final.source
out["a_failed_request"] = final.failed_request_bytes
out["a_largest_free"] = final.largest_free_bytes
out["a_free"] = final.free_bytes
out["a_ops_known"] = all(c.op for c in final.chunks if c.in_use and c.size > 256)
out["a_log"] = a.log
out["a_last_oom_is_the_traces"] = tfmem_widgets.last_oom() is a.oom_report() is not None
out["a_verdict"] = a.oom_report().verdict
import tempfile, os
saved = os.path.join(tempfile.mkdtemp(), "a.json")
a.to_json(saved)
loaded = tfmem_widgets.Trace.load(saved)  # from its file: explained again, by its own map
out["a_loaded_before"] = loaded.oom_report() is None and "verdict" not in repr(loaded)
out["a_loaded_verdict"] = tfmem_widgets.explain_oom(loaded).verdict
out["a_loaded_text_says_it"] = "verdict: " + a.oom_report().verdict in repr(loaded)
out["a_text"] = repr(a)
out["a_dump_chunks"] = chunks(dump)

# (b) after earlier work outside any trace
del kept
earlier = PATTERN(2)
with tf.device("CPU:0"):
    in_use_at_start = int(tf.config.experimental.get_memory_info("CPU:0")["current"])
def block_b():
    global earlier, later
    earlier = earlier[len(earlier) // 2:]           # frees chunks the trace never saw allocated
    later = PATTERN(3)
    fill(LAB_MB << 18)                              # the whole limit: no hole can hold it
b, out["b_raised"], events, rebuilt, dump = traced(block_b)
by_address = {c.address: c for c in dump.chunks}
inside = [c for c in rebuilt.chunks if c.in_use]
out["b_fresh"] = b.is_fresh(events.allocator)
out["b_inside_count"] = len(inside)
out["b_inside_match"] = all(
    c.address in by_address and by_address[c.address].size == c.size and by_address[c.address].in_use
    for c in inside
)
out["b_before_at_start"] = events.in_use_before()
out["b_in_use_at_start"] = in_use_at_start
out["b_before_total"] = rebuilt.before_trace_bytes
out["b_dump_in_use"] = sum(c.size for c in dump.chunks if c.in_use)
out["b_rebuilt_in_use"] = rebuilt.in_use_bytes
out["b_complete"] = rebuilt.complete
out["b_map_source"] = b.map().source
print(json.dumps(out))
"""

PATTERNS = {
    # Keep every other 2 MiB tensor: 24 MiB in use, no hole of 16 MiB.
    "alternate": dict(lab_mb=64, request=4 << 20, pattern="""
def PATTERN(seed):
    ts = [fill(1 << 19) for _ in range(24)]
    return ts[1::2]
"""),
    # Growing sizes, keep the odd ones: the holes grow too, but none reaches the request.
    # (pool 62 MiB, 40 MiB free, the largest hole 21.5 MiB)
    "growing": dict(lab_mb=64, request=(24 << 20) // 4, pattern="""
def PATTERN(seed):
    ts = [fill(k * (1 << 17)) for k in range(1, 13)]
    return ts[0::2]
"""),
    # Mixed sizes, a seeded random half kept (pool 30 MiB, 13.5 MiB free, largest hole 3 MiB).
    "random": dict(lab_mb=32, request=(8 << 20) // 4, pattern="""
def PATTERN(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.choice([1 << 16, 1 << 17, 1 << 18, 3 << 17], size=30)
    ts = [fill(int(n)) for n in sizes]
    keep = rng.random(30) < 0.5
    return [t for t, k in zip(ts, keep) if k]
"""),
}


@pytest.fixture(scope="module")
def outcomes():
    procs = {}
    for name, p in PATTERNS.items():
        code = p["pattern"] + HARNESS.replace("LAB_MB", str(p["lab_mb"])).replace("REQUEST", str(p["request"]))
        # INFO level, so the allocator's text dump reaches fd 2 and the trace captures it.
        procs[name] = start_fresh(code, env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    return {name: finish_fresh(proc, timeout=300) for name, proc in procs.items()}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_traced_from_the_first_allocation_the_rebuilt_map_is_tensorflows(outcomes, pattern):
    out = outcomes[pattern]
    assert out["a_raised"], "the pattern must end in an OOM"
    assert out["a_fresh"]
    assert out["a_chunks_equal"], "events alone give the dump's chunks: address, size, in use"
    assert out["a_chunk_count"] > 4
    assert out["a_frag_nan_agree"] and out["a_frag_max_diff"] <= 1e-6
    assert out["a_rebuilt_frag"] == pytest.approx(out["a_dump_frag"], abs=1e-6)
    assert out["a_text_equal"], "the captured text dump parses to the same chunks"
    assert out["a_text_regions_equal"], "and the regions the replay inferred are the ones TensorFlow logged"
    assert out["a_final_source"] == "dump" and out["a_ops_known"]
    # A fragmentation OOM: enough free memory in total, no hole big enough.
    assert out["a_largest_free"] < out["a_failed_request"] <= out["a_free"]


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_traced_after_earlier_work_chunks_match_and_earlier_memory_is_exact(outcomes, pattern):
    out = outcomes[pattern]
    assert out["b_raised"] and not out["b_fresh"] and not out["b_complete"]
    assert out["b_inside_count"] > 0 and out["b_inside_match"]
    assert out["b_before_at_start"] == out["b_in_use_at_start"]
    assert out["b_rebuilt_in_use"] == out["b_dump_in_use"], "chunks inside + memory from before = the dump"
    assert out["b_map_source"] == "dump"


@pytest.fixture(scope="module")
def real_log(outcomes):
    """TensorFlow's own log of the 'alternate' OOM, captured from fd 2 by the trace."""
    return outcomes["alternate"]["a_log"], [tuple(c) for c in outcomes["alternate"]["a_dump_chunks"]]


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_a_traced_oom_is_an_oom_its_verdict_and_fixes_shown_and_kept_as_last_oom(outcomes, pattern):
    out = outcomes[pattern]
    assert out["a_last_oom_is_the_traces"]
    assert out["a_verdict"] == "fragmentation"            # every pattern leaves holes, none big enough
    assert out["a_loaded_before"] and out["a_loaded_verdict"] == "fragmentation" and out["a_loaded_text_says_it"]
    assert "  verdict: fragmentation" in out["a_text"] and "  fixes:" in out["a_text"]


def test_a_pasted_log_parses_to_the_dumps_chunks(real_log):
    import tfmem_widgets

    log, dump_chunks = real_log
    parsed = tfmem_widgets.parse_bfc_dump(log)
    assert [(c.address, c.size, c.in_use) for c in parsed.chunks] == dump_chunks
    assert parsed.allocator == "bfc_cpu_allocator_for_gpu"
    assert parsed.failed_request_bytes == 16 << 20 and parsed.limit_bytes == 64 << 20
    assert sorted(r.size >> 20 for r in parsed.regions) == [2, 4, 8, 16, 32]


def test_a_log_with_missing_lines_is_refused_in_one_line(real_log):
    import tfmem_widgets

    log, _ = real_log
    lines = log.splitlines()
    chunk_lines = [i for i, line in enumerate(lines) if "InUse at" in line or "Free  at" in line]
    region_lines = [i for i, line in enumerate(lines) if "Next region of size" in line]
    broken = {
        "a chunk line dropped": lines[: chunk_lines[5]] + lines[chunk_lines[5] + 1:],
        "the last chunk dropped": lines[: chunk_lines[-1]] + lines[chunk_lines[-1] + 1:],
        "a region header dropped": lines[: region_lines[1]] + lines[region_lines[1] + 1:],
        "no dump at all": [line for line in lines if "at " not in line and "region" not in line],
    }
    for what, text in broken.items():
        with pytest.raises(tfmem_widgets.TraceDataError) as info:
            tfmem_widgets.parse_bfc_dump("\n".join(text))
        assert "\n" not in str(info.value), what


def test_an_oom_that_python_unwinds_is_placed_at_the_failed_allocation():
    # The OOM strikes inside a list comprehension: while the error unwinds, Python frees the
    # tensors made so far, so the trace ends after the moment TensorFlow dumped the allocator.
    out = run_fresh(
        """
        import json, tfmem_widgets
        tfmem_widgets.setup(lab_mb=64)
        import tensorflow as tf
        try:
            with tfmem_widgets.trace() as t:
                with tf.device("CPU:0"):
                    everything = [tf.zeros((1 << 19,)) for _ in range(40)]   # 80 MiB in 64
        except tf.errors.ResourceExhaustedError:
            pass
        events = t.events()
        at = t.dump_index()
        dump_map = t.map()
        rebuilt = t.map(at)
        chunks = lambda m: [(c.address, c.size, c.in_use) for c in m.chunks]
        print(json.dumps({"at": at, "last": len(events) - 1, "event_index": dump_map.event_index,
                          "equal": chunks(dump_map) == chunks(rebuilt), "source": dump_map.source,
                          "ops": all(c.op == "Fill" for c in dump_map.chunks if c.in_use and c.size > 256),
                          "end_in_use": int(events.in_use[-1]), "dump_in_use": dump_map.in_use_bytes}))
        """
    )
    assert out["source"] == "dump" and out["at"] < out["last"] and out["event_index"] == out["at"]
    assert out["end_in_use"] < out["dump_in_use"], "the frees while unwinding come after the dump"
    assert out["equal"], "the dump equals the pool rebuilt from the events at the failed allocation"
    assert out["ops"]
