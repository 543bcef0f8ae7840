"""A job's log as OOMs: each OOM of a real log (TensorFlow's own text dumps, lab mode) explained
against its own dump; special and large files read in bounded memory; empty text refused."""

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc

import pytest

# Two OOMs in one process, logged at INFO as TensorFlow does in a job: the first in holes (every
# other 2 MiB tensor freed, then 16 MiB), the second after more is kept (12 MiB, short).
TWO_OOMS = """
import json, tfmem_widgets
tfmem_widgets.setup(lab_mb=64)
import tensorflow as tf
asked = []
ts = [tf.fill((512 * 1024,), float(i)) for i in range(24)]
del ts[::2]
try:
    big = tf.zeros((4 << 20,))
except tf.errors.ResourceExhaustedError:
    asked.append(16 << 20)
ts += [tf.zeros((k * 256 * 1024,)) for k in range(1, 5)]
try:
    big = tf.zeros((3 << 20,))
except tf.errors.ResourceExhaustedError:
    asked.append(12 << 20)
print(json.dumps({"asked": asked}))
"""


@pytest.fixture(scope="module")
def two_oom_log(tmp_path_factory):
    from tfmem_widgets.fresh.run import child_environment

    env = child_environment({"TF_CPP_MIN_LOG_LEVEL": "0"})
    env.pop("TF_BFC_MEMORY_DUMP", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(TWO_OOMS)], capture_output=True, text=True,
                          env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    path = tmp_path_factory.mktemp("log") / "job.log"
    path.write_text(done.stderr)
    return path, json.loads(done.stdout.strip().splitlines()[-1])["asked"]


def test_each_oom_of_a_log_is_explained_against_its_own_dump(two_oom_log):
    import tfmem_widgets

    path, asked = two_oom_log
    assert asked == [16 << 20, 12 << 20]
    reports = tfmem_widgets.explain_oom(path, each=True)
    assert [r.request_bytes for r in reports] == asked
    assert all(r.verdict != "not explained by the dump" for r in reports)   # each against its own state
    assert reports[0].verdict == "fragmentation" and reports[1].in_use_bytes > reports[0].in_use_bytes
    last = tfmem_widgets.explain_oom(path.read_text())
    assert last.request_bytes == asked[-1] and last.map.chunks == reports[-1].map.chunks
    assert any("the log holds 2 OOMs" in n for n in last.notes)


def test_a_large_log_is_read_line_by_line_in_less_memory_than_the_file(two_oom_log, tmp_path):
    import tfmem_widgets

    path, asked = two_oom_log
    noise = "I0000 00:00:1.0 12345 some_module.cc:42] a line a job logs that no OOM is read from\n" * 160_000
    big = tmp_path / "big.log"
    big.write_text(noise + path.read_text() + noise)
    size = big.stat().st_size
    assert size > 20 << 20
    tracemalloc.start()
    try:
        report = tfmem_widgets.explain_oom(big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.request_bytes == asked[-1] and report.verdict != "not explained by the dump"
    assert peak < size / 4


def test_empty_text_and_endless_files_are_refused_in_one_line(tmp_path):
    import tfmem_widgets
    from tfmem_widgets.errors import ArgumentError

    empty = tmp_path / "empty.log"
    empty.write_text("")
    for bad in ("\n", "   \n  ", b"\n", empty, "/dev/zero"):
        if bad == "/dev/zero" and not os.path.exists(bad):
            continue
        with pytest.raises(ArgumentError) as refused:
            tfmem_widgets.explain_oom(bad)
        assert "\n" not in str(refused.value) and "explain_oom" in str(refused.value)
