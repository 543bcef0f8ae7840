"""The bulk wire decoder against the plain one, on real traces and on every layout the
protobuf format allows for an event (built with TensorFlow's own message classes)."""

import numpy as np
import pytest
from xspace_reference import read_xspace_reference

from tfmem_widgets.tracing.xspace import read_xspace

COLUMNS = ("time_ns", "kind", "address", "size", "requested", "in_use", "peak", "available",
           "fragmentation", "data_type")


def assert_same(fast, reference):
    assert fast.keys() == reference.keys()
    for name in fast:
        a, b = fast[name], reference[name]
        for column in COLUMNS:
            assert np.array_equal(getattr(a, column), getattr(b, column)), (name, column)
        for column in ("op", "shape", "region"):
            assert [a.texts[i] for i in getattr(a, column)] == [b.texts[i] for i in getattr(b, column)]


def test_real_trace_decodes_the_same_both_ways(lab_session, tmp_path):
    import tensorflow as tf

    from tfmem_widgets import trace as run_trace

    with run_trace(keep=tmp_path / "k"):
        with tf.device("CPU:0"):
            xs = [tf.fill((k * 997,), 1.5) + 2.0 for k in range(1, 200)]
            del xs[::2]
    data = next((tmp_path / "k").rglob("*.xplane.pb")).read_bytes()
    fast = read_xspace(data)
    assert len(fast["bfc_cpu_allocator_for_gpu"]) >= 400
    assert_same(fast, read_xspace_reference(data))
    del xs


def _space(layouts):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    # Metadata ids past 127 take two varint bytes; id 0 is left out of the wire entirely.
    ids = {"MemoryAllocation": 300, "MemoryDeallocation": 5, "Other": 7}
    for name, mid in ids.items():
        plane.event_metadata[mid].id = mid
        plane.event_metadata[mid].name = name
    stat_ids = {"allocator_name": 0, "addr": 200, "allocation_bytes": 3, "requested_bytes": 4,
                "bytes_allocated": 130, "peak_bytes_in_use": 6, "bytes_available": 7, "fragmentation": 8,
                "tf_op": 9, "shape": 10, "region_type": 11, "data_type": 12, "bfc": 13, "Fill": 14}
    for name, mid in stat_ids.items():
        plane.stat_metadata[mid].id = mid
        plane.stat_metadata[mid].name = name
    line = plane.lines.add(timestamp_ns=1_000)
    in_use = 0
    for k, layout in enumerate(layouts):
        kind = "MemoryAllocation" if k % 2 == 0 else "MemoryDeallocation"
        in_use += 512 if kind == "MemoryAllocation" else -512
        event = line.events.add(metadata_id=ids[kind])
        if layout == "occurrences":
            event.num_occurrences = 3
        else:
            event.offset_ps = 1_000 * (k + 1)
        if layout == "duration":
            event.duration_ps = 77
        line.events.add(metadata_id=ids["Other"], offset_ps=5)  # not a memory event
        def stat(name, event=event):
            s = event.stats.add()
            s.metadata_id = stat_ids[name]
            return s
        stat("allocator_name").ref_value = stat_ids["bfc"]
        stat("addr").uint64_value = (1 << 63) + 4096 * k if layout == "uint64" else 4096 * (k // 2)
        stat("allocation_bytes").int64_value = 512
        stat("requested_bytes").int64_value = 500
        stat("bytes_allocated").int64_value = in_use
        stat("peak_bytes_in_use").int64_value = 512
        stat("bytes_available").int64_value = (1 << 20) - in_use
        if layout == "int_fragmentation":
            stat("fragmentation").int64_value = 0
        else:
            stat("fragmentation").double_value = 0.125 * k
        stat("tf_op").ref_value = stat_ids["Fill"]
        if layout == "long_string":
            stat("shape").str_value = "[" + ",".join(["7"] * 60) + "]"  # over 127 bytes
        else:
            stat("shape").str_value = f"[{k}]"
        stat("data_type").int64_value = 1
    return space.SerializeToString()


@pytest.mark.parametrize("layouts", [
    ["plain"] * 6,
    ["occurrences", "plain", "duration", "plain"],
    ["uint64", "plain", "int_fragmentation", "plain", "long_string", "plain"],
])
def test_every_event_layout_decodes_the_same_both_ways(layouts):
    data = _space(layouts)
    fast = read_xspace(data)
    assert fast["bfc"].kind.tolist() == [1, -1] * (len(layouts) // 2)
    assert_same(fast, read_xspace_reference(data))


def test_allocations_without_an_op_are_named_by_the_activity_around_them(lab_session, tmp_path):
    # An XLA program allocates through TensorFlow's allocator without an op: both decoders name
    # each such allocation by the XLA executable and the tf.function running it.
    import tensorflow as tf

    from tfmem_widgets import trace as run_trace

    @tf.function(jit_compile=True)
    def scaled_sum(a):
        return tf.reduce_sum(tf.sin(a) * tf.cos(a) + a * a, axis=0)

    @tf.function  # as Keras calls its XLA train step from a plain tf.function
    def step(a):
        return scaled_sum(a) + 1.0

    with tf.device("CPU:0"):
        a = tf.ones((512, 1024))
        step(a)
        with run_trace(keep=tmp_path / "x"):
            step(a)
    data = next((tmp_path / "x").rglob("*.xplane.pb")).read_bytes()
    fast = read_xspace(data)
    assert_same(fast, read_xspace_reference(data))
    events = fast["bfc_cpu_allocator_for_gpu"]
    labels = {events.texts[i] for i, kind in zip(events.op, events.kind) if kind > 0}
    assert "(XLA program in step)" in labels
    assert "" not in labels


def _unnamed_space(overlap=True):
    """Allocations without an op under activities on three threads: nested ones (a tf.function, an
    XLA launch inside it), two that begin together, two that overlap without nesting (overlap=False:
    one after the other), and a tf.function on another thread. Times in nanoseconds, as memory
    events carry them."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    names = ["MemoryAllocation", "MemoryDeallocation", "__inference_step_12", "XlaLaunch", "Inner", "A", "B",
             "__inference_other_3", "P", "Q"]
    ids = {name: k + 1 for k, name in enumerate(names)}
    for name, mid in ids.items():
        plane.event_metadata[mid].id = mid
        plane.event_metadata[mid].name = name
    stat_ids = {"allocator_name": 1, "addr": 2, "allocation_bytes": 3, "requested_bytes": 4, "bytes_allocated": 5,
                "peak_bytes_in_use": 6, "bytes_available": 7, "fragmentation": 8, "bfc": 9}
    for name, mid in stat_ids.items():
        plane.stat_metadata[mid].id = mid
        plane.stat_metadata[mid].name = name
    ns = 1000  # picoseconds
    lines = {k: plane.lines.add(id=k, timestamp_ns=0) for k in (1, 2, 3)}
    spans = {1: [("__inference_step_12", 100, 10_000), ("XlaLaunch", 200, 5_000), ("Inner", 300, 400),
                 ("A", 12_000, 12_500), ("B", 12_000, 12_200)],
             2: [("__inference_other_3", 15_000, 30_000)],
             3: [("P", 50_000, 50_300), ("Q", 50_200 if overlap else 50_300, 50_400)]}
    for k, items in spans.items():
        for name, begin, end in items:
            lines[k].events.add(metadata_id=ids[name], offset_ps=begin * ns, duration_ps=(end - begin) * ns)
    in_use = 0
    allocations = [(1, 350), (1, 4_500), (1, 8_000), (1, 12_100), (1, 20_000), (1, 40_000), (3, 50_250)]
    for n, (k, t) in enumerate(allocations):
        for kind, at in (("MemoryAllocation", t), ("MemoryDeallocation", t + 1)):
            in_use += 256 if kind == "MemoryAllocation" else -256
            event = lines[k].events.add(metadata_id=ids[kind], offset_ps=at * ns)
            for name, value in (("addr", 4096 * n), ("allocation_bytes", 256), ("requested_bytes", 200),
                                ("bytes_allocated", in_use), ("peak_bytes_in_use", 256),
                                ("bytes_available", (1 << 20) - in_use)):
                stat = event.stats.add(metadata_id=stat_ids[name])
                stat.int64_value = value
            event.stats.add(metadata_id=stat_ids["allocator_name"]).ref_value = stat_ids["bfc"]
            event.stats.add(metadata_id=stat_ids["fragmentation"]).double_value = 0.0
    return space.SerializeToString()


def test_allocations_without_an_op_are_named_by_their_thread_and_the_functions_running():
    data = _unnamed_space()
    fast = read_xspace(data)
    assert_same(fast, read_xspace_reference(data))
    events = fast["bfc"]
    labels = [events.texts[i] for i, kind in zip(events.op, events.kind) if kind > 0]
    assert labels == ["(XLA program in step)", "(XLA program in step)", "(in step)",
                      "(in B)",        # of two that begin together the shorter is the inner
                      "(in other)",    # nothing around it on its thread: the tf.function another runs
                      "",              # nothing at all
                      "(in Q)"]        # overlapping without nesting: read one by one, the later begun


def test_allocations_on_threads_whose_activities_all_nest_are_named_the_same_read_together():
    # Threads 1 and 3 of one plane are labelled in one pass (each in a time window of its own) where
    # all their activities nest; where one thread's overlap (above) each is read on its own.
    data = _unnamed_space(overlap=False)
    fast = read_xspace(data)
    assert_same(fast, read_xspace_reference(data))
    events = fast["bfc"]
    labels = [events.texts[i] for i, kind in zip(events.op, events.kind) if kind > 0]
    assert labels == ["(XLA program in step)", "(XLA program in step)", "(in step)", "(in B)", "(in other)", "",
                      "(in P)"]


def test_threads_go_into_time_windows_only_where_their_times_stay_there():
    from tfmem_widgets.tracing.attribution import _windows

    nested = (np.array([10, 20]), np.array([15, 30]), np.array([1, 2]))
    other = (np.array([5]), np.array([9]), np.array([3]))
    empty = (np.zeros(0, np.int64),) * 3  # a thread with allocations and no activity
    begin, end, meta, times = _windows([(nested, np.array([12])), (empty, np.array([7])), (other, np.array([6]))])
    assert begin.tolist() == [0, 10, 22] and end.tolist() == [5, 20, 26] and meta.tolist() == [1, 2, 3]
    assert times.tolist() == [2, 21, 23]  # each thread after the last, its order kept
    damaged = (np.array([10]), np.array([4]), np.array([1]))  # ends before it begins
    assert _windows([(nested, np.array([12])), (damaged, np.array([11]))]) is None
    assert _windows([(nested, np.array([12])), (other, np.array([-(1 << 62) - 5]))]) is None
