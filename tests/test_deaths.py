"""A kernel's death, explained by the next kernel started in the same folder; a fresh process's and a
probe's, by the process that started it (issue: the kernel's death).

Real processes die here: plain IPython sessions and Jupyter kernels that abort after TensorFlow's own
words on fd 2 (as a CHECK failure ends a process), and a kernel that TensorFlow itself aborts (an XLA
program's OOM in lab mode). Each test has a folder of records of its own (TFMEM_KERNELS_DIR).
"""

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import kernel_env, run_in_kernel, start_kernel, told_by_the_next_kernel, until_kernel_dies
from tfmem_widgets.deaths.explain import explain_death
from tfmem_widgets.deaths.record import place

CHECK_LINE = ("F0000 00:00:1764000000.000000   12345 gpu_launch_config.h:160] Check failed: "
              "work_element_count >= 0 (-2147483648 vs. 0)")


def _ipython(code: str, folder, records, timeout: float = 120) -> subprocess.CompletedProcess:
    """`code` in a plain IPython session started in `folder` with the extension loaded; its cells are
    run_cell calls, so each is noted as a notebook's would be."""
    script = ("from IPython.testing.globalipapp import start_ipython\nip = start_ipython()\n"
              "ip.run_line_magic('load_ext', 'tfmem_widgets')\n" + textwrap.dedent(code))
    return subprocess.run([sys.executable, "-c", script], cwd=folder, env=kernel_env(records), capture_output=True,
                          text=True, timeout=timeout)


def test_each_cause_is_told_with_its_fix():
    # The 2^31 check: the wrapped count is the tensor's elements; with the fit's batch, the batch under it.
    death = explain_death(6, f"some log\n{CHECK_LINE}\n*** Check failure stack trace: ***\n    @ 0x7f (unknown)\n",
                          batch=4096)
    assert (death.cause, death.elements, death.batch_under, death.signal) == ("2^31", 2**31, 4095, "SIGABRT (signal 6)")
    assert death.last_words == CHECK_LINE and "A batch of at most 4,095" in death.meaning
    assert "jit_compile=True" in death.meaning and "not an out-of-memory" in death.meaning
    # 2^31 + 2^20 elements at batch 4,100: per row 2^31/4096 + 256 elements, the batch under 2^31 is 4,094.
    wrapped = (2**31 + 2**20) - 2**32
    death = explain_death(6, CHECK_LINE.replace("-2147483648", str(wrapped)), batch=4100)
    assert death.elements == 2**31 + 2**20 and death.batch_under * (death.elements / 4100) < 2**31 <= \
        (death.batch_under + 1) * (death.elements / 4100)
    # Another kernel's words for the same limit, without a count: the plan names the tensor.
    death = explain_death(6, "F0000 00:00:1.0  1 conv_2d_gpu.h:1028] Check failed: ... SwapDimension1And2InTensor3")
    assert death.cause == "2^31" and death.elements is None and "tfmem_widgets.plan" in death.meaning
    death = explain_death(6, "F0000 00:00:1.0  1 bfc_allocator.cc:711] Check failed: h != kInvalidChunkHandle")
    assert death.cause == "xla-oom-lab" and "lab mode" in death.meaning
    # faulthandler's header names the signal where no return code does (the next kernel reads a record)
    stacks = "Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n  File \"x\""
    death = explain_death(None, "", stacks, lab_mb=128)
    assert death.signal == "SIGSEGV (signal 11)" and death.cause == "segfault" and "128 MB" in death.meaning
    assert explain_death(11, "").cause == "segfault" and "lab mode" not in explain_death(11, "").meaning
    death = explain_death(None, "", oom_killed=True, host="it held 20.00 GiB on the host")
    assert death.cause == "oom-killer" and "host's memory ran out" in death.meaning and "20.00 GiB" in death.meaning
    assert explain_death(None, "").cause == "killed" and "no word" in repr(explain_death(None, ""))
    death = explain_death(6, "E0000 something\nF0000 00:00:1.0  1 gpu_util.cc:1] CUDA_ERROR_ILLEGAL_ADDRESS: an illegal"
                             " memory access was encountered")
    assert death.cause == "cuda" and "CUDA_ERROR_ILLEGAL_ADDRESS" in death.last_words
    assert explain_death(6, "F0000 00:00:1.0  1 tensor.cc:1] Check failed: IsAligned()").cause == "check"


def test_a_process_without_a_gpu_is_not_told_a_cuda_error_and_a_death_after_an_oom_is_told_as_one():
    # A CPU machine's start-up lines (no driver: cuInit fails) are not last words; absl's warnings come before
    # free text (an error's payload); a fresh process that met an OOM in lab mode and then died is that death.
    fd2 = ("E0000 00:00:1.0  7 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to "
           "cuInit: UNKNOWN ERROR (303)\nW0000 00:00:2.0  7 local_rendezvous.cc:412] Local rendezvous is aborting "
           "with status: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 264.08MiB.\n"
           "[tf-allocator-allocation-error='']\nFatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most "
           "recent call first):\n  File \"x\", line 1 in <module>\n\nExtension modules: numpy (total: 1)\n")
    death = explain_death(11, fd2, lab_mb=160, after_oom=True)
    assert death.cause == "xla-oom-lab" and "it died after an OOM in lab mode:" in death.meaning
    assert death.last_words.startswith("W0000") and "RESOURCE_EXHAUSTED" in death.last_words
    assert explain_death(11, fd2, lab_mb=160).cause == "segfault"  # no OOM met: a CPU kernel's fault
    # tf.data's iterator refused memory, then the fault (issue 43 fault 7): the refusal is its last words
    data = ("W0000 00:00:1.0  7 bfc_allocator.cc:502] Allocator (bfc_cpu_allocator_for_gpu) ran out of memory trying "
            "to allocate 64.00MiB (rounded to 67108864)requested by op MakeIterator\n"
            "W0000 00:00:1.1  7 bfc_allocator.cc:513] ****______*__\nFatal Python error: Segmentation fault\n")
    death = explain_death(11, data, lab_mb=128)
    assert death.cause == "segfault" and "MakeIterator" in death.last_words and "inside tf.data" in death.meaning
    caught = "W0000 00:00:1.0  7 op_kernel.cc:1858] OP_REQUIRES failed at xla_ops.cc:602 : RESOURCE_EXHAUSTED: Out"
    assert explain_death(11, caught + "\n" + fd2, lab_mb=160).cause == "xla-oom-lab"  # an OOM the cell caught
    assert explain_death(6, fd2.split("\n")[0]).cause == "abort"  # cuInit's line alone says nothing of the death


def test_a_kernel_that_aborts_is_explained_by_the_next_one_started_in_its_folder(tmp_path):
    folder, other, records = tmp_path / "work", tmp_path / "elsewhere", tmp_path / "records"
    folder.mkdir()
    other.mkdir()
    cell = f"import os\nos.write(2, {(CHECK_LINE + chr(10)).encode()!r})\nos.abort()"
    died = _ipython(f"""
        ip.run_cell("import os; print('pid', os.getpid())", store_history=True)
        ip.run_cell({cell!r}, store_history=True)
        """, folder, records)
    assert died.returncode == -6 and CHECK_LINE in died.stderr  # fd 2's words still reach where fd 2 went
    elsewhere = _ipython("", other, records)
    assert "died" not in elsewhere.stdout  # a kernel of another folder
    told = _ipython("", folder, records)
    text = told.stdout
    assert "a kernel started in this folder before this one died" in text
    assert "killed by SIGABRT (signal 6)" in text and "  in cell [" in text and "      os.abort()" in text
    assert f"its last words on fd 2: {CHECK_LINE}" in text and "32-bit int" in text
    assert "Python's stacks at the signal (faulthandler):" in text and "Current thread" in text
    pid = int(died.stdout.split("pid ")[1].split()[0])
    assert f"the process {pid} died: killed by SIGABRT (signal 6)" in text
    again = _ipython("ip.run_line_magic('tfmem', 'died')", folder, records)
    assert "before this one died" not in again.stdout  # told once on load
    assert f"the process {pid} died: killed by SIGABRT" in again.stdout  # %tfmem died shows it again
    # Every process that exited normally left nothing but the one told
    assert [p.name.startswith("explained-") for p in place(str(folder), records).iterdir()] == [True]


def test_a_kernel_that_exits_normally_leaves_nothing_and_kernels_side_by_side_keep_their_own(tmp_path):
    records = tmp_path / "records"
    env = kernel_env(records)
    waiting = subprocess.Popen(
        [sys.executable, "-c", "from IPython.testing.globalipapp import start_ipython\nip = start_ipython()\n"
         "ip.run_line_magic('load_ext', 'tfmem_widgets')\nimport sys\nprint('armed', flush=True)\nsys.stdin.read()"],
        cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert waiting.stdout.readline().strip() == "armed"
    ours = list(place(str(tmp_path), records).iterdir())
    assert len(ours) == 1 and ours[0].name.startswith(f"{waiting.pid}-")
    copier = [c for c in psutil.Process(waiting.pid).children() if "-S" in c.cmdline()]
    assert len(copier) == 1 and os.getsid(copier[0].pid) != os.getsid(waiting.pid)  # out of the kernel's group
    # A record of a process gone more than a week ago is removed unexplained.
    old = place(str(tmp_path), records) / "999999999-1"
    old.mkdir(parents=True)
    (old / "info.json").write_text('{"pid": 999999999, "started": 1.0, "armed": 1.0}')
    week = time.time() - 8 * 24 * 3600
    os.utime(old, (week, week))
    beside = _ipython("", tmp_path, records)
    assert "died" not in beside.stdout  # the waiting kernel is alive: its record is its own
    assert not old.exists()
    names = [p.name for p in place(str(tmp_path), records).iterdir()]
    assert len(names) == 1 and names[0].startswith(f"{waiting.pid}-")
    waiting.communicate("", timeout=60)  # it exits normally
    assert waiting.returncode == 0
    assert list(place(str(tmp_path), records).iterdir()) == []
    copier[0].wait(10)  # fd 2's copy ends with it


XLA_OOM_FIT = """
import keras, numpy as np
model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(4096, activation="relu"), keras.layers.Dense(1)])
model.compile("adam", "mse", jit_compile=True)
x, y = np.ones((8192, 512), "float32"), np.ones((8192, 1), "float32")
model.fit(x, y, batch_size=8192, epochs=1, verbose=0)  # an XLA program's OOM: ResourceExhaustedError
"""
SMALLER_BATCH = "model.fit(x, y, batch_size=1024, epochs=1, verbose=0)"  # the next step: the process dies

ABORT_IN_STEP = f"""
import os, keras, numpy as np

class Check(keras.callbacks.Callback):  # dies inside the fit's first step, as TensorFlow's check does
    def on_train_batch_begin(self, batch, logs=None):
        os.write(2, {(CHECK_LINE + chr(10)).encode()!r})
        os.abort()

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
model.fit(np.ones((4096, 4), "float32"), np.ones((4096, 1), "float32"), batch_size=4096, callbacks=[Check()], verbose=0)
"""


@pytest.mark.parametrize("how", ["xla-oom-lab", "check-in-a-fit"])
def test_a_real_jupyter_kernel_that_dies_is_explained_by_the_next_kernel(tmp_path, how):
    folder, records, temporary = tmp_path / "notebooks", tmp_path / "records", tmp_path / "tmp"
    folder.mkdir()
    temporary.mkdir()
    manager, client = start_kernel(folder, records, TMPDIR=str(temporary))
    try:
        assert "died" not in run_in_kernel(client, "%load_ext tfmem_widgets")
        if how == "xla-oom-lab":
            run_in_kernel(client, "%tfmem setup --lab 160")
            assert "ResourceExhaustedError" in run_in_kernel(client, XLA_OOM_FIT)  # explained in its cell, the kernel alive
            until_kernel_dies(manager, client, SMALLER_BATCH)
        else:
            until_kernel_dies(manager, client, ABORT_IN_STEP)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    text, loaded_again, died = told_by_the_next_kernel(folder, records, ("%load_ext tfmem_widgets", "%tfmem died"))
    assert "a kernel started in this folder before this one died" in text
    assert ("killed by SIGSEGV" in text or "killed by SIGABRT" in text) if how == "xla-oom-lab" else \
        "killed by SIGABRT" in text
    if how == "xla-oom-lab":
        count = int(text.split("in cell [")[1].split("]")[0])  # (the kernel's count: the fourth cell run)
        assert "batch_size=1024" in text and f"it died after an OOM in lab mode (cell [{count - 1}]'s)" in text
        assert "fresh process" in text and "cudart_stub" not in text  # (no information line as last words)
    else:
        assert "  in cell [" in text and "      import os, keras, numpy as np" in text and CHECK_LINE in text
        assert "met a tensor at batch 4,096 of 2,147,483,648 elements" in text and "at most 4,095" in text
    assert "died" not in loaded_again  # (loaded already: nothing said twice)
    assert "died: killed by SIG" in died
    # the second kernel exited normally (a shutdown request): only the first's record is left, explained
    assert [p.name.startswith("explained-") for p in place(str(folder), records).iterdir()] == [True]
    # the dead kernel's OOM dumps went into its record (cleaned with it), none into the temporary folder
    assert not list(temporary.glob("tfmem-oom-*"))
    if how == "xla-oom-lab":
        (told,) = place(str(folder), records).iterdir()
        assert list(told.glob("tfmem-oom-*/dump*"))


def test_a_fresh_process_that_aborts_is_explained_where_it_was_started():
    import tfmem_widgets
    from tfmem_widgets.errors import FreshRunError

    with pytest.raises(FreshRunError) as caught:
        tfmem_widgets.run_fresh(f"import os\nos.write(2, {(CHECK_LINE + chr(10)).encode()!r})\nos.abort()", echo=False)
    error = caught.value
    assert error.death is not None and error.death.cause == "2^31" and error.death.signal == "SIGABRT (signal 6)"
    text = str(error)
    assert "\n" not in text and "was killed by SIGABRT (signal 6)" in text and CHECK_LINE in text
    assert "32-bit int" in text and "jit_compile=True" in text
    assert "Current thread" in error.death.stacks  # faulthandler's, from the child's signal handler


def test_a_probe_whose_process_aborts_is_a_batch_that_does_not_train_and_the_search_goes_on():
    import tfmem_widgets

    def build_model():
        import keras

        model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("adam", "mse")
        return model

    def make_batch(n):  # from 3,000 rows the process dies as TensorFlow's GPU kernels do at 2^31 elements
        import os

        import numpy as np

        if n >= 3000:
            os.write(2, b"F0000 00:00:1.0  1 gpu_launch_config.h:160] Check failed: work_element_count >= 0 "
                        b"(-2147483648 vs. 0)\n")
            os.abort()
        return np.ones((n, 512), "float32"), np.ones((n, 1), "float32")

    search = tfmem_widgets.max_batch_size(build_model, make_batch, setup={"lab_mb": 128}, high=8192, progress=False,
                                          method="probe")
    died = [p for p in search.probes if p.verdict == "abort: 2^31 elements"]
    assert died and all(p.batch >= 3000 and not p.fits for p in died)
    assert all(p.fits for p in search.probes if p.batch < 3000)
    safe, failure = search.edge
    assert safe < 3000 <= failure and failure - safe <= max(1, -(-safe * search.resolution // 1))
    assert search.largest == safe and search.recommended == safe  # nothing past the abort
    text = repr(search)
    assert "did not train (abort: 2^31 elements): the process was killed by SIGABRT (signal 6)" in text
    assert f"{failure:,} (this CPU) did not train (abort: 2^31 elements)" in text  # a lab search's figure, marked


GUARDED = """
import json, time
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
import tfmem_widgets
tfmem_widgets.setup(lab_mb=256)
ip.run_line_magic("load_ext", "tfmem_widgets")
ip.run_line_magic("tfmem", "guard")
import keras, numpy as np, tensorflow as tf
import tfmem_widgets.plans.plan as plans
from tfmem_widgets.errors import FitStopped
made = []
planning = plans.plan
plans.plan = lambda *a, **k: (made.append(a[2]), planning(*a, **k))[1]
inputs = keras.Input((256, 16))
scores = keras.layers.MultiHeadAttention(num_heads=8, key_dim=4, name="attn")(inputs, inputs)  # (batch, 8, 256, 256)
model = keras.Model(inputs, keras.layers.Dense(1, name="head")(keras.layers.GlobalAveragePooling1D()(scores)))
model.compile("adam", "mse", jit_compile=False)
out = {}
for batch in (4096, 4095):
    x, y = np.ones((batch, 256, 16), "float32"), np.ones((batch, 1), "float32")
    made.clear()
    started = time.perf_counter()
    try:
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        out[batch] = ["trained"]
    except FitStopped as stop:
        out[batch] = [str(stop), time.perf_counter() - started, made[0], int(model.optimizer.iterations.numpy())]
    del x, y
x, y = np.ones((64, 256, 16), "float32"), np.ones((64, 1), "float32")
times = []
for _ in range(2):  # a fit that fits: one plan for this model, batch and shapes, then none
    made.clear()
    started = time.perf_counter()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    times.append([time.perf_counter() - started, list(made)])
ip.run_line_magic("tfmem", "guard off")
made.clear()
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
out["off"] = list(made)
ip.run_line_magic("tfmem", "guard")
import contextlib, io
said = io.StringIO()
plans.graph_abort_risks = lambda *a, **k: 1 / 0  # a fault in the guard itself: said, and the fit runs
with contextlib.redirect_stderr(said):
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
out["broken"] = said.getvalue()
out["fits"] = times
out["steps"] = int(model.optimizer.iterations.numpy())
print(json.dumps(out))
"""


def test_the_guard_stops_a_fit_that_would_abort_or_not_fit_before_its_first_step():
    from conftest import run_fresh

    out = run_fresh(GUARDED, timeout=600)
    text, seconds, first_plan, steps = out["4096"]
    assert first_plan == 4095 and steps == 0  # the abort seen from the traced step; planned under it; nothing ran
    assert text.startswith("tfmem guard stopped this fit before its first step: at batch 4,096 its graph step makes")
    assert "of 2^31 elements or more (the first: " in text and "[4096, 8, 256, 256], 2,147,483,648 elements" in text
    assert "jit_compile=True" in text and "%tfmem guard off" in text
    below = int(text.split("A batch of at most ")[1].split()[0].replace(",", ""))
    assert 0 < below <= 4095  # under the abort, and within the 256 MB lab by its plan
    text, _, first_plan, steps = out["4095"]
    assert first_plan == 4095 and steps == 0 and "at batch 4,095 its step needs" in text and "2^31" not in text
    assert f"A batch of at most {below:,} fits by its plan" in text
    (first, planned), (second, again) = out["fits"]
    assert planned == [8] and again == []  # one plan per model, batch and shapes
    assert out["off"] == [] and out["steps"] == 64 // 8 * 2 + 64 // 16 + 64 // 4
    assert out["broken"].startswith("tfmem guard: the fit runs unplanned (ZeroDivisionError")


GUARDED_REPLICAS = """
import json
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
import tfmem_widgets
tfmem_widgets.setup(lab_mb=256, cpus=2)
ip.run_line_magic("load_ext", "tfmem_widgets")
ip.run_line_magic("tfmem", "guard")
import keras, numpy as np, tensorflow as tf
from tfmem_widgets.errors import FitStopped
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096, activation="relu"), keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x, y = np.ones((8192, 1024), "float32"), np.zeros((8192,), "int64")
out = {}
for rows, batch in ((8192, 4096), (63, 63), (63, 64), (64, 64)):
    try:
        model.fit(x[:rows], y[:rows], batch_size=batch, epochs=1, verbose=0)
        out[f"{rows}@{batch}"] = "trained"
    except FitStopped as stop:
        out[f"{rows}@{batch}"] = str(stop)
    out[f"{rows}@{batch} steps"] = int(model.optimizer.iterations.numpy())
planned = tfmem_widgets.plan(model, (x, y), 4096)
out["planned"] = [planned.peak_bytes, planned.limit_bytes]
print(json.dumps(out))
"""


def test_the_guard_stops_a_mirrored_fit_that_cannot_fit_or_cannot_start_and_names_a_global_batch_that_can():
    # Under MirroredStrategy the guard plans the replicas (plans/replicas.py): in a 256 MB lab over two logical CPUs
    # a global batch of 4,096 is planned over the limit, and a first batch of 63 rows cannot be split alike over two
    # replicas (Keras' fit reduces the first batch across them); neither runs a step, and a fit that fits trains.
    from conftest import run_fresh

    out = run_fresh(GUARDED_REPLICAS, timeout=600)
    text = out["8192@4096"]
    peak, limit = out["planned"]
    assert peak > limit and out["8192@4096 steps"] == 0
    assert text.startswith("tfmem guard stopped this fit before its first step: at a global batch of 4,096 the shared "
                           "pool of its replicas needs") and "%tfmem guard off" in text
    below = int(text.split("A global batch of at most ")[1].split()[0].replace(",", ""))
    assert 0 < below < 4096 and below % 2 == 0 and f"{below:,} (this CPU) fits" in text  # (a CPU's plan: marked)
    stopped = "tfmem guard stopped this fit before its first step: its first batch splits 32 and 31 over the 2 replicas"
    assert out["63@63"].startswith(stopped) and "give a global batch that divides by 2, such as 62" in out["63@63"]
    # 63 rows at a batch of 64 are the first batch: the rows are to divide. 64 rows at the same batch and shapes are
    # judged anew, and train.
    assert out["63@64"].startswith(stopped) and "its data has 63 rows, fewer than the batch of 64" in out["63@64"]
    assert out["63@63 steps"] == out["63@64 steps"] == 0
    assert out["64@64"] == "trained" and out["64@64 steps"] == 1
