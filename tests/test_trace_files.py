"""Whose files are whose: a trace reads only the files it made, and leaves the user's alone.

Faults 1 to 4 and 17 of the hostile-user review: a reused --keep folder, a fresh process run
inside a trace, a user's own TF_BFC_MEMORY_DUMP, a quoted --keep path, and a refused trace.
The OOMs run in fresh processes in lab mode (each waits 10 s in TensorFlow's retry), side by side.
"""

import glob
import os
import tempfile
from pathlib import Path

import pytest

import tfmem_widgets
from conftest import finish_fresh, start_fresh
from tfmem_widgets import ArgumentError, StateError, trace

CPU = "bfc_cpu_allocator_for_gpu"

OWNERSHIP = """
import glob, json, os, shutil, sys, tensorflow as tf, tfmem_widgets
from tfmem_widgets import trace
tfmem_widgets.setup(lab_mb=64)
work = sys.argv[1]
keep = os.path.join(work, "kept")
out = {}

def oom():
    try:
        with tf.device("CPU:0"):
            tf.zeros((100 << 18,))          # 100 MiB in a 64 MB lab
    except tf.errors.ResourceExhaustedError:
        return True
    return False

# Fault 1: a --keep folder reused, with an old OOM in it and a user's files named like ours.
held = [tf.zeros((6 << 18,)) for _ in range(4)]   # 24 MiB in use at the first OOM
with trace(keep=keep) as first:
    out["first_oom"] = oom()
out["first_dumps"] = sorted(first.dumps)
out["first_in_use"] = first.map().in_use_bytes
del held
with open(os.path.join(keep, "bfc_dump_notes.txt"), "w") as f:
    f.write("my notes")
os.makedirs(os.path.join(keep, "plugins", "profile", "old"))
with open(os.path.join(keep, "plugins", "profile", "old", "host.xplane.pb"), "wb") as f:
    f.write(b"damaged")
with trace(keep=keep) as second:
    with tf.device("CPU:0"):
        small = tf.zeros((1024,))
out["second_dumps"] = sorted(second.dumps)
out["second_source"] = second.map().source
out["second_in_use_now"] = int(second.events().in_use[-1])
out["allocator_in_use_now"] = int(tf.config.experimental.get_memory_info("CPU:0")["current"])
out["distinct_folders"] = first.logdir != second.logdir and os.path.dirname(second.logdir) == keep
out["user_file_kept"] = open(os.path.join(keep, "bfc_dump_notes.txt")).read() == "my notes"

# Fault 3: the user's own TF_BFC_MEMORY_DUMP: their files land where they asked, and stay.
mine = os.path.join(work, "mine")
os.makedirs(mine)
prefix = os.path.join(mine, "oom")
old = os.path.join(mine, "oom_" + "bfc_cpu_allocator_for_gpu" + ".1")
shutil.copy(sorted(glob.glob(os.path.join(first.logdir, "bfc_dump_*")))[-1], old)  # an earlier dump
os.environ["TF_BFC_MEMORY_DUMP"] = prefix
with trace() as third:
    out["env_inside"] = os.environ["TF_BFC_MEMORY_DUMP"]
    out["third_oom"] = oom()
out["env_after"] = os.environ["TF_BFC_MEMORY_DUMP"]
out["user_dumps"] = sorted(os.path.basename(p) for p in glob.glob(prefix + "_*"))
out["third_dumps"] = sorted(third.dumps)
dump = third.dumps.get("bfc_cpu_allocator_for_gpu")
out["third_dump_in_use"] = None if dump is None else sum(c.size for c in dump.chunks if c.in_use)
out["third_in_use_at_oom"] = int(third.events().in_use[third.dump_index()])
print(json.dumps(out))
"""

CHILD_INSIDE = """
import json, os, sys, tensorflow as tf, tfmem_widgets
from tfmem_widgets import run_fresh, trace
tfmem_widgets.setup(lab_mb=64)
with trace() as t:
    x = tf.zeros((1024,))
    parent_env = os.environ.get("TF_BFC_MEMORY_DUMP")
    child = run_fresh(
        "import os, tensorflow as tf\\n"
        "dump_env = os.environ.get('TF_BFC_MEMORY_DUMP')\\n"
        "try:\\n    tf.zeros((40 << 18,))\\nexcept tf.errors.ResourceExhaustedError:\\n    pass\\n",
        setup={"lab_mb": 32}, returns=["dump_env"], echo=False)
print(json.dumps({"child_env": child.values["dump_env"], "parent_env": parent_env, "dumps": sorted(t.dumps),
                  "source": t.map().source, "in_use": t.map().in_use_bytes,
                  "allocator_in_use": int(tf.config.experimental.get_memory_info("CPU:0")["current"])}))
"""


@pytest.fixture(scope="module")
def ownership(tmp_path_factory):
    work = tmp_path_factory.mktemp("ownership")
    procs = [start_fresh(OWNERSHIP.replace("sys.argv[1]", repr(str(work)))),
             start_fresh(CHILD_INSIDE)]
    return [finish_fresh(p, timeout=300) for p in procs]


def test_a_reused_keep_folder_gives_each_trace_only_its_own_files(ownership):
    out = ownership[0]
    assert out["first_oom"] and out["first_dumps"] == [CPU] and out["first_in_use"] >= 24 << 20
    # The second trace ran out of nothing: no dump, its map is its own pool now.
    assert out["second_dumps"] == [] and out["second_source"] != "dump"
    assert out["second_in_use_now"] == out["allocator_in_use_now"] < 1 << 20
    assert out["distinct_folders"] and out["user_file_kept"]


def test_a_users_own_dump_place_gets_the_files_and_keeps_them(ownership):
    out = ownership[0]
    assert out["third_oom"]
    assert out["env_inside"].endswith(os.path.join("mine", "oom")) and out["env_after"] == out["env_inside"]
    assert len(out["user_dumps"]) >= 2, "the earlier dump and at least one of this OOM's, none deleted"
    # The trace read this OOM's dump, not the earlier one in the same place.
    assert out["third_dumps"] == [CPU] and out["third_dump_in_use"] == out["third_in_use_at_oom"]


def test_a_fresh_process_inside_a_trace_does_not_write_into_it(ownership):
    out = ownership[1]
    # The child's dumps go to the fresh call's own folder (removed with it, even when the child is
    # killed), never to the place the parent's trace set.
    assert out["parent_env"] and out["child_env"] != out["parent_env"]
    assert os.path.basename(os.path.dirname(out["child_env"])).startswith("tfmem-fresh-")
    assert out["dumps"] == [] and out["source"] != "dump"
    assert out["in_use"] == out["allocator_in_use"] < 1 << 20


def test_keep_with_a_quoted_path_is_that_path(shell, tmp_path, capsys):
    folder = tmp_path / "with space"
    shell.run_cell_magic("tfmem", f'trace -q --keep "{folder}"',
                         "import tensorflow as tf\nwith tf.device('CPU:0'):\n    tf.zeros((10,))")
    assert list(folder.rglob("*.xplane.pb"))
    assert not Path('"').exists() and not list(Path.cwd().glob('"*'))


@pytest.mark.parametrize("where", ["a_file", "/proc/forbidden", "long"])
def test_keep_that_cannot_be_a_folder_is_one_line_and_changes_nothing(lab_session, tmp_path, where):
    target = {"a_file": tmp_path / "a_file", "/proc/forbidden": Path("/proc/forbidden/x"),
              "long": tmp_path / ("x" * 300)}[where]
    if where == "a_file":
        target.write_text("not a folder")
    before = os.environ.get("TF_BFC_MEMORY_DUMP")
    with pytest.raises(ArgumentError) as info:
        with trace(keep=target):
            pass
    assert "\n" not in str(info.value) and "cannot keep the trace" in str(info.value)
    assert os.environ.get("TF_BFC_MEMORY_DUMP") == before
    with trace():  # nothing held: the next trace starts
        pass


def test_a_refused_trace_leaves_no_folder(lab_session, tmp_path):
    import tensorflow as tf

    pattern = os.path.join(tempfile.gettempdir(), "tfmem-trace-*")
    before = set(glob.glob(pattern))
    tf.profiler.experimental.start(str(tmp_path / "someone_elses"))
    try:
        for _ in range(3):
            with pytest.raises(StateError, match="another profiler"):
                with trace():
                    pass
            with pytest.raises(StateError, match="another profiler"):
                with trace(keep=tmp_path / "kept"):
                    pass
    finally:
        tf.profiler.experimental.stop()
    assert set(glob.glob(pattern)) == before
    assert list((tmp_path / "kept").iterdir()) == []


def test_a_cell_that_stops_the_profiler_keeps_what_was_traced(lab_session):
    import tensorflow as tf

    with trace() as t:
        with tf.device("CPU:0"):
            x = tf.zeros((1024,))
        tf.profiler.experimental.stop()
        y = tf.zeros((2048,))
    assert len(t.events(CPU)) >= 1
    assert any("stopped inside the block" in n for n in t.notes) and "note: TensorFlow's profiler" in repr(t)
    del x, y


def test_a_trace_object_runs_once(lab_session):
    block = trace()
    with block:
        pass
    with pytest.raises(StateError, match="already run"):
        with block:
            pass
    with pytest.raises(ArgumentError, match="folder's path"):
        trace(keep=42)
    assert tfmem_widgets.trace is trace


def test_a_trace_that_cannot_be_read_keeps_the_blocks_exception_and_the_kept_files(lab_session, tmp_path,
                                                                                       monkeypatch):
    import importlib

    import tensorflow as tf

    from tfmem_widgets import TraceDataError

    trace_module = importlib.import_module("tfmem_widgets.tracing.block")

    def damaged(path):
        raise TraceDataError(f"{path} is not a readable profiler trace (truncated).")

    monkeypatch.setattr(trace_module, "read_xplane_file", damaged)
    with pytest.raises(ZeroDivisionError):  # the block's own error, not the trace's
        with trace(keep=tmp_path / "kept") as t:
            with tf.device("CPU:0"):
                tf.zeros((16,))
            _ = 1 / 0
    assert t.done and any("could not be read" in n for n in t.notes)
    with pytest.raises(TraceDataError):  # a block that ended well: the trace's failure is the error
        with trace(keep=tmp_path / "again"):
            with tf.device("CPU:0"):
                tf.zeros((16,))
    # Neither kept folder was deleted: the files are the user's to look at.
    assert list((tmp_path / "kept").rglob("*.xplane.pb")) and list((tmp_path / "again").rglob("*.xplane.pb"))
