"""Every OOM explained in the cell that raised it, without a trace (issue: any OOM, any cell).

Each scenario runs in its own lab-mode process through a real IPython shell with the
extension loaded, as a notebook's kernel would run the cells; the processes run side by side
(an OOM waits 10 s in TensorFlow's retry).
"""

import math
import os

import pytest

from conftest import PASTED_OOM_LOG, finish_fresh, run_fresh, start_fresh

MiB = 1 << 20

SHELL = """
import json, os, sys, glob, contextlib, io
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
shown, said = io.StringIO(), io.StringIO()
def cell(source):
    with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(said):
        return ip.run_cell(source)
"""

# Three allocation patterns that end in an OOM in a plain cell, no trace.
PATTERNS = {
    # every other 2 MiB tensor freed, then 16 MiB: the FACTS.md fragmentation case
    "alternate": ("ts = [tf.fill((512 * 1024,), float(i)) for i in range(24)]\ndel ts[::2]",
                  "big = tf.zeros((4 << 20,))"),
    # growing tensors kept, then more than the rest of the limit
    "growing": ("ts = [tf.zeros((k * 256 * 1024,)) for k in range(1, 7)]",
                "big = tf.zeros((12 << 20,))"),
    # small and large interleaved, the large ones freed
    "mixed": ("ts = [tf.zeros(((1 if i % 3 else 5) * 256 * 1024,)) for i in range(15)]\n"
              "ts = [t for t in ts if t.shape[0] < 1024 * 1024]",
              "big = tf.zeros((9 << 20,))"),
}

PLAIN = SHELL + """
user_dumps = os.path.join(os.environ["WORK"], "mine")
if os.environ.get("USER_DUMP"):
    os.environ["TF_BFC_MEMORY_DUMP"] = user_dumps
cell("%load_ext tfmem_widgets")
cell("%tfmem setup --lab 64")
watch_folder = os.environ.get("TF_BFC_MEMORY_DUMP")
cell("import tensorflow as tf\\n" + PREPARE)
result = cell(REQUEST)
import tfmem_widgets
from tensorflow.core.protobuf import bfc_memory_map_pb2
r = tfmem_widgets.last_oom()
out = {"raised": type(result.error_in_exec).__name__, "shown": shown.getvalue(), "said": said.getvalue()}
dump = bfc_memory_map_pb2.MemoryDump()
dump.ParseFromString(open(r.dump_path, "rb").read())
out["theirs"] = sorted([c.address, c.size, c.in_use] for c in dump.chunk)
out["ours"] = sorted([c.address, c.size, c.in_use] for c in r.map.chunks)
out.update(request=r.request_bytes, largest=r.largest_free_bytes, verdict=r.verdict,
           in_use=r.in_use_bytes, limit=r.limit_bytes, stats_in_use=dump.stats.bytes_in_use,
           largest_free_theirs=max(c.size for c in dump.chunk if not c.in_use),
           dump_path=r.dump_path, watch_folder=watch_folder,
           user_files=sorted(glob.glob(user_dumps + "_*")))
import threading
out["watch_threads"] = [t.name for t in threading.enumerate() if t.name == "tfmem-refusals"]
cell("%unload_ext tfmem_widgets")
out["after_unload"] = os.environ.get("TF_BFC_MEMORY_DUMP")
out["own_folder_left"] = os.path.exists(os.path.dirname(watch_folder)) if watch_folder else None
print(json.dumps(out))
"""


# An OOM caught by the user's code, which raises its own error: not an OOM, after a refusal.
WRAPPED = ("ts = [tf.zeros((k * 256 * 1024,)) for k in range(1, 7)]",
           "try:\n    big = tf.zeros((12 << 20,))\nexcept tf.errors.ResourceExhaustedError:\n"
           "    raise RuntimeError('the job could not load its data')")


def _plain(name, tmp_path, user_dump=False):
    prepare, request = WRAPPED if name == "wrapped" else PATTERNS[name]
    code = PLAIN.replace("PREPARE", repr(prepare)).replace("REQUEST", repr(request))
    env = {"WORK": str(tmp_path)}
    if user_dump:
        env["USER_DUMP"] = "1"
    return start_fresh(code, env)


@pytest.fixture(scope="module")
def plain_cells(tmp_path_factory):
    procs = {name: _plain(name, tmp_path_factory.mktemp(name)) for name in PATTERNS}
    user = tmp_path_factory.mktemp("user")
    procs["user"] = _plain("alternate", user, user_dump=True)
    procs["wrapped"] = _plain("wrapped", tmp_path_factory.mktemp("wrapped"))
    return {name: finish_fresh(p, timeout=300) for name, p in procs.items()}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_an_oom_in_a_plain_cell_is_explained_with_tensorflows_own_dump(plain_cells, name):
    out = plain_cells[name]
    assert out["raised"] == "ResourceExhaustedError"          # the traceback stays: the cell still failed
    assert out["ours"] == out["theirs"]                       # the report's map is TensorFlow's dump, chunk for chunk
    assert out["in_use"] == out["stats_in_use"]
    assert out["largest"] == out["largest_free_theirs"] < out["request"]
    assert out["limit"] == 64 << 20
    shown = out["shown"]
    assert "OOM in bfc_cpu_allocator_for_gpu" in shown and "verdict:" in shown   # in the cell's own output
    assert f"largest hole {out['largest'] / (1 << 20):.2f} MiB" in shown
    assert f"needs {out['request'] / (1 << 20):.2f} MiB" in shown
    # the extension's own folder: dumps there while loaded, gone after unload, variable restored
    assert out["dump_path"].startswith(os.path.dirname(out["watch_folder"]))
    assert out["after_unload"] is None and out["own_folder_left"] is False


def test_no_watch_outlives_its_cell(plain_cells):
    out = plain_cells["alternate"]
    assert out["watch_threads"] == []  # the cell's watch ended with the cell
    assert "tfmem: still refused" not in out["said"]  # no XLA fit here: a plain OOM's wait is not said


def test_the_verdicts_follow_the_numbers(plain_cells):
    alternate = plain_cells["alternate"]
    # 24 MiB in use of 64: 40 MiB free under the limit, the largest hole 12 MiB
    assert alternate["verdict"] == "fragmentation" and alternate["in_use"] + alternate["request"] <= alternate["limit"]
    growing = plain_cells["growing"]
    assert growing["verdict"] == "limit"  # short under a lab limit far below the host's memory
    assert growing["in_use"] + growing["request"] > growing["limit"]
    assert "the limit, not the hardware" in growing["shown"] and "raise the limit to at least" in growing["shown"]


def test_an_error_raised_after_a_refusal_is_explained_from_the_cells_dump(plain_cells):
    # (an XLA fit whose autotuner was refused for two minutes ended in an InternalError on an H100)
    out = plain_cells["wrapped"]
    assert out["raised"] == "RuntimeError"
    assert "TensorFlow raised RuntimeError, not an out-of-memory error, after its allocator refused" in out["shown"]
    assert out["ours"] == out["theirs"] and out["in_use"] == out["stats_in_use"]   # the cell's own dump, read


def test_a_users_own_dump_place_is_theirs(plain_cells):
    out = plain_cells["user"]
    assert out["ours"] == out["theirs"]
    assert out["user_files"] and out["dump_path"] in out["user_files"]   # read where TensorFlow wrote them
    assert all(os.path.exists(p) for p in out["user_files"])            # never moved or deleted
    assert out["after_unload"].endswith("mine")                           # their variable left as it was


KERAS = SHELL + """
cell("%load_ext tfmem_widgets")
cell("%tfmem setup --lab 160")
assert os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0"
cell('''
import tensorflow as tf, keras, numpy as np
model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(2048, activation="relu", name="wide"),
                          keras.layers.Dense(4096, name="wider"), keras.layers.Dense(1, name="out")])
model.compile("adam", "mse", jit_compile=False)
x = np.random.rand(8192, 256).astype("float32"); y = np.random.rand(8192, 1).astype("float32")
''')
if os.environ.get("RECORD"):
    cell("%tfmem record")
result = cell("model.fit(x, y, batch_size=4096, epochs=1, verbose=0)")
import tfmem_widgets
r = tfmem_widgets.last_oom()
layers = r.by_layer()
need = r.need
print(json.dumps({"raised": type(result.error_in_exec).__name__, "keys": list(layers),
                  "phases": {k: layers.phases(k) for k in layers}, "total": layers.total_bytes,
                  "in_use": r.in_use_bytes, "verdict": r.verdict, "shown": shown.getvalue(),
                  "need": need and {"batch": need.batch_size, "peak": need.peak_bytes, "fits": need.fits_batch,
                                    "fails": need.fails_batch, "estimate": need.estimate, "limit": need.limit_bytes,
                                    "plans": need.plans, "source": need.source,
                                    "drawn": need.plan is not None and need.plan.batch_size == need.batch_size
                                    and need.plan.timeline is not None}, "fixes": r.fixes(),
                  "said": said.getvalue()}))
"""

# The same fit with its step an XLA program (Keras' default on a GPU). After an XLA program's OOM the
# allocator is inconsistent and the process aborts when its tensors are freed: it ends at once.
KERAS_XLA = KERAS.replace('jit_compile=False', 'jit_compile=True') + "sys.stdout.flush(); os._exit(0)\n"


# The same model trained at 32 rows in a 256 MB lab, its validation at 8,192: the OOM comes in the validation step.
KERAS_VALIDATION = KERAS.replace('"%tfmem setup --lab 160"', '"%tfmem setup --lab 256"').replace(
    'result = cell("model.fit(x, y, batch_size=4096, epochs=1, verbose=0)")',
    'result = cell("model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0, validation_data=(x, y), '
    'validation_batch_size=8192)")')
assert KERAS_VALIDATION.count("validation_batch_size=8192") == 1 and "--lab 256" in KERAS_VALIDATION


# A batch an OOM report names, tried in a fresh process at the same limit.
TRAIN_AT = """
import json, os, tfmem_widgets
tfmem_widgets.setup(lab_mb=160)
import keras, numpy as np
model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(2048, activation="relu", name="wide"),
                          keras.layers.Dense(4096, name="wider"), keras.layers.Dense(1, name="out")])
model.compile("adam", "mse", jit_compile=False)
x = np.random.rand(8192, 256).astype("float32"); y = np.random.rand(8192, 1).astype("float32")
try:
    model.fit(x, y, batch_size=int(os.environ["BATCH"]), epochs=1, verbose=0)
    raised = None
except Exception as error:
    raised = type(error).__name__
print(json.dumps({"raised": raised}), flush=True)
os._exit(0)   # after an XLA program's OOM the process aborts when its tensors are freed
"""


XLA_TRACE = """
import json, tfmem_widgets
tfmem_widgets.setup(lab_mb=400)
import keras, numpy as np
model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(2048, activation="relu", name="wide"),
                          keras.layers.Dense(4096, name="wider"), keras.layers.Dense(1, name="out")])
model.compile("adam", "mse", jit_compile=True)   # the train step is an XLA program, as Keras makes it on a GPU
x = np.random.rand(8192, 256).astype("float32"); y = np.random.rand(8192, 1).astype("float32")
with tfmem_widgets.trace() as t:
    model.fit(x, y, batch_size=1024, epochs=1, verbose=0)
layers = t.by_layer("peak")
print(json.dumps({"keys": list(layers), "totals": dict(layers.items()), "total": layers.total_bytes,
                  "unattributed": layers.unattributed_bytes, "jit": bool(model.jit_compile),
                  "phases": {k: layers.phases(k) for k in layers}, "notes": list(t.notes),
                  "spotters": [th.name for th in __import__("threading").enumerate() if th.name == "tfmem-fit-spotter"]}))
"""


@pytest.fixture(scope="module")
def keras_ooms():
    procs = {"plain": start_fresh(KERAS), "recorded": start_fresh(KERAS, {"RECORD": "1"}),
             "xla": start_fresh(XLA_TRACE), "xla_oom": start_fresh(KERAS_XLA),
             "validation": start_fresh(KERAS_VALIDATION)}
    return {name: finish_fresh(p, timeout=300) for name, p in procs.items()}


def test_a_keras_fit_oom_lists_the_largest_in_use_first(keras_ooms):
    out = keras_ooms["plain"]
    assert out["raised"] == "ResourceExhaustedError"
    totals = [sum(out["phases"][k].values()) for k in out["keys"]]
    assert totals == sorted(totals, reverse=True)
    layers = [k for k in out["keys"] if not k.startswith("(")]
    assert layers[0] == "sequential/wider"          # 2048 x 4096 kernel and its Adam slots
    wider = out["phases"]["sequential/wider"]
    kernel = 2048 * 4096 * 4
    assert wider["parameters"] >= kernel and wider["optimizer state"] >= kernel
    assert sum(sum(p.values()) for p in out["phases"].values()) == out["total"] == out["in_use"]
    assert "(activations and temporaries)" in out["keys"]  # no trace: the rest, said plainly
    assert "in use by layer" in out["shown"]


def test_a_keras_fit_oom_says_what_the_step_needs_and_the_most_that_can_fit(keras_ooms):
    out = keras_ooms["plain"]
    need = out["need"]
    # read from the fit while TensorFlow waited on the refused request: its batch, planned from specs
    assert need["batch"] == 4096 and need["estimate"]          # jit_compile=False: XLA's plan of the same step
    assert need["peak"] > need["limit"] == 160 << 20            # the step's need, not the failed tensor's
    assert need["peak"] > out["in_use"] + 64 * MiB              # more than in use + the request (64 MiB)
    assert need["fits"] is not None and need["fits"] < need["fails"] <= 4096 and need["plans"] >= 3
    assert need["fails"] - need["fits"] <= max(1, math.ceil(0.02 * need["fits"]))   # to the search's resolution
    assert f"what fits: at most batch {need['fits']:,}" in out["shown"]
    # the plan at the fit's batch is kept: its program drawn (StepPlan.plot), as the report's line says
    assert need["drawn"] and "tfmem_widgets.last_oom().need.plan.plot() draws its program" in out["shown"]
    assert any(f.startswith(f"a smaller batch: at most {need['fits']:,}") for f in out["fixes"])
    assert not any("less at this step" in f for f in out["fixes"])
    # An upper bound, and here an estimate: the graph step runs other kernels than XLA's program (its
    # optimizer update's temporaries are not fused). The batch just past it does not train.
    past = finish_fresh(start_fresh(TRAIN_AT, {"BATCH": str(need["fails"])}), timeout=300)
    assert past["raised"] == "ResourceExhaustedError"


def test_an_oom_in_the_fits_validation_is_told_as_the_validation_with_its_batch_and_fixes(keras_ooms):
    out = keras_ooms["validation"]
    assert out["raised"] == "ResourceExhaustedError"
    need = out["need"]
    assert need["batch"] == 8192 and need["source"] == "validation" and need["peak"] is None and need["fits"] is None
    assert "the fit's validation (the evaluate Keras runs at an epoch's end) at its batch of 8,192" in out["shown"]
    assert "what fits" not in out["shown"] and "at batch 32" not in out["shown"]
    assert out["fixes"][0].startswith("a smaller validation batch: validation_batch_size")
    assert not any("start from an empty pool" in fix for fix in out["fixes"])


def test_an_xla_fit_refused_is_planned_while_it_waits_and_told_what_fits(keras_ooms):
    # An XLA program's OOM leaves nothing to plan in its process: the step is planned at the first
    # refusal, while TensorFlow still waits, and the report keeps that need.
    out = keras_ooms["xla_oom"]
    assert out["raised"] == "ResourceExhaustedError"
    need = out["need"]
    assert need["source"] == "plan" and not need["estimate"]    # XLA's plan of the program the fit runs
    assert need["batch"] == 4096 and need["peak"] > need["limit"] == 160 << 20
    # At 160 MB the weights and Adam's slots (102 MiB) and the data leave no region the step's one buffer
    # of temporaries fits in, at any batch: the plans say so, and the smallest batch they tried fails too.
    assert need["fits"] is None and need["fails"] < 4096
    # (a compiled step's OOM on a CPU: the plans' figures are this CPU's, marked so; oom/report.py CPU_STEP_NOTE)
    assert f"what fits: no batch planned fits this limit (down to {need['fails']:,} (this CPU))" in out["shown"]
    assert any(f.startswith("no batch fits this limit") for f in out["fixes"])
    # Said while the cell waits when the plans end first (here TensorFlow raises 10 s after the refusal;
    # on a GPU its autotuner waits minutes: tests/test_gpu.py); else the report says it.
    if "tfmem: this fit's XLA step was refused memory; planned in" in out["said"]:
        assert "what fits: no batch planned fits this limit" in out["said"]
    assert "autotuner" not in out["said"] and "for minutes" not in out["said"]  # a GPU's; XLA on a CPU has none
    smallest = finish_fresh(start_fresh(TRAIN_AT.replace("jit_compile=False", "jit_compile=True"),
                                        {"BATCH": str(need["fails"])}), timeout=300)
    assert smallest["raised"] == "ResourceExhaustedError"


def test_the_recorder_names_the_failed_steps_activations(keras_ooms):
    out = keras_ooms["recorded"]
    assert [k for k in out["keys"] if not k.startswith("(")][0] == "sequential/wider"
    assert out["phases"]["sequential/wide"].get("forward activations", 0) >= 4096 * 2048 * 4  # the Relu output
    assert "(input pipeline)" in out["keys"]
    assert "(activations and temporaries)" not in out["keys"]
    assert sum(sum(p.values()) for p in out["phases"].values()) == out["in_use"]


def test_a_traced_xla_fit_leaves_at_most_5_percent_unattributed_at_its_peak(keras_ooms):
    out = keras_ooms["xla"]
    assert out["jit"]
    assert out["unattributed"] <= 0.05 * out["total"]
    # The program's one buffer of temporaries, read by the plan of the same program (made when the
    # trace was read, from the fit it saw): its pieces live at the program's peak by layer and phase.
    wider = out["phases"]["sequential/wider"]
    assert wider.get("forward activations", 0) >= 1024 * 4096 * 4            # the 1024 x 4096 output
    assert wider.get("backward (gradients, temporaries)", 0) > 0
    assert out["phases"]["sequential/out"].get("backward (gradients, temporaries)", 0) > 0
    assert out["totals"].get("(XLA program in multi_step_on_iterator)", 0) <= 0.01 * out["total"]  # its outputs
    assert not out["notes"] and out["spotters"] == []    # the fit's watcher ended with the trace
    assert sum(out["totals"].values()) == out["total"]


WITHOUT_WATCH = """
import json, tfmem_widgets
tfmem_widgets.setup(lab_mb=160)
import keras, numpy as np
model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(2048, activation="relu", name="wide"),
                          keras.layers.Dense(4096, name="wider"), keras.layers.Dense(1, name="out")])
model.compile("adam", "mse", jit_compile=False)
x, y = np.ones((8192, 256), "float32"), np.ones((8192, 1), "float32")
try:
    model.fit(x, y, batch_size=4096, epochs=1, verbose=0)
except Exception as error:   # a script: no extension, no watch_oom(), so TensorFlow wrote no dump
    report = tfmem_widgets.explain_oom(error, model=model, sample=(x, y), batch_size=4096)
    need = report.need
    print(json.dumps({"map": report.map is not None, "batch": need and need.batch_size,
                      "peak": need and need.peak_bytes, "text": repr(report)}))
"""


def test_explain_oom_with_the_fits_arguments_plans_the_step_even_without_a_dump():
    out = finish_fresh(start_fresh(WITHOUT_WATCH), timeout=300)
    assert not out["map"] and out["batch"] == 4096 and out["peak"] > 160 << 20
    assert "the step: at batch 4,096 it needs" in out["text"] and "TF_BFC_MEMORY_DUMP was not set" in out["text"]


def test_explain_oom_reads_a_pasted_log_and_refuses_what_is_not_one(tmp_path):
    import tfmem_widgets
    from tfmem_widgets.errors import ArgumentError

    log = PASTED_OOM_LOG
    report = tfmem_widgets.explain_oom(log)
    assert report.allocator == "GPU_0_bfc" and report.request_bytes == 16 << 20
    assert report.largest_free_bytes == 2 << 20 and report.limit_bytes == 8 << 20
    assert report.verdict == "shortage"  # 2 MiB in use of 8: 6 MiB free, 16 asked
    path = tmp_path / "job.log"
    path.write_text(log)
    assert tfmem_widgets.explain_oom(path).map.chunks == report.map.chunks
    for bad in ("", str(tmp_path / "missing"), 42, ValueError("not memory")):
        with pytest.raises(ArgumentError) as caught:
            tfmem_widgets.explain_oom(bad)
        assert "\n" not in str(caught.value) and "explain_oom" in str(caught.value)


HAZARDS = SHELL + """
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"   # as a user who imported TensorFlow before the setup
cell("import tensorflow as tf")
cell("%load_ext tfmem_widgets")
cell("%tfmem setup --lab 64")
cell("f = tf.function(lambda a: a, jit_compile=True)")
cell("g = tf.function(lambda a: a, jit_compile=True)")
said.write("|before the fits|")
cell("import keras, numpy as np\\nm = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])\\n"
     "m.compile('sgd', 'mse')\\nds = tf.data.Dataset.from_tensor_slices((np.ones((8, 4), 'float32'), "
     "np.ones((8, 1), 'float32'))).batch(4)")
cell("m.fit(ds, verbose=0)")   # a pipeline made in an earlier cell: told as its fit starts
cell("m.fit(tf.data.Dataset.from_tensor_slices((np.ones((8, 4)), np.ones((8, 1)))).batch(4), verbose=0)")
print(json.dumps({"err": said.getvalue(), "shown": shown.getvalue()}))
"""


def test_lab_mode_hazards_are_said_before_the_cell_runs_once_each():
    done = finish_fresh(start_fresh(HAZARDS))
    out = done["err"]
    assert out.count("kills the whole process") == 1 and "%%tfmem fresh" in out
    assert out.count("an OOM inside a oneDNN fused kernel") == 1
    before, fits = out.split("|before the fits|")
    assert "tf.data" not in before and fits.count("a fit on a tf.data pipeline: an OOM inside tf.data's own") == 1
    # and at the setup itself, when it can still be acted on: TensorFlow was imported first
    assert "oneDNN's kernels stay on: TensorFlow was imported before this setup" in done["shown"]


def test_the_recorder_refuses_a_bad_window_in_one_line_and_starts_nothing(shell):
    from IPython.core.error import UsageError

    import tfmem_widgets
    from tfmem_widgets.errors import ArgumentError
    from tfmem_widgets.tracing.recorder import current

    for bad in (0, 0.5, 4000, "5", True, float("nan")):
        with pytest.raises(ArgumentError) as caught:
            tfmem_widgets.record(window=bad)
        assert "\n" not in str(caught.value) and "between 1 and 3600" in str(caught.value)
    for bad in ("0", "abc", "4000"):
        with pytest.raises(UsageError) as caught:
            shell.run_line_magic("tfmem", f"record --window {bad}")
        assert "\n" not in str(caught.value) and "--window" in str(caught.value)
    assert current() is None


FRESH_OOMS = SHELL + """
import tempfile
cell("%load_ext tfmem_widgets")
cell("%tfmem setup --lab 64")
cell("import tensorflow as tf, tfmem_widgets")
import tfmem_widgets
ALTERNATE = '''import tensorflow as tf
ts = [tf.fill((512 * 1024,), float(i)) for i in range(24)]
del ts[::2]
'''
out = {}
# 1. the child raises its OOM: its own shell explains it, the report comes back here
result = cell("%%tfmem fresh --lab 64\\n" + ALTERNATE + "big = tf.zeros((4 << 20,))")
r = tfmem_widgets.last_oom()
out["raised"] = [type(result.error_in_exec).__name__, str(result.error_in_exec)]
out["raised_report"] = [r.verdict, r.request_bytes, r.largest_free_bytes, r.in_use_bytes, r.limit_bytes,
                        r.limit_source, r.dump_path]
# 2. the child dies after its OOM (as an XLA program's OOM ends a process): its dump is read here
cell("tfmem_widgets.oom.explain.remember(None)")
said_before = len(said.getvalue())
result = cell("%%tfmem fresh --lab 64\\n" + ALTERNATE + '''try:
    big = tf.zeros((4 << 20,))
except tf.errors.ResourceExhaustedError as error:
    print(str(error).splitlines()[0])
import os
os.abort()''')
r = tfmem_widgets.last_oom()
out["died"] = str(result.error_in_exec)
out["died_report"] = None if r is None else [r.verdict, r.request_bytes, r.largest_free_bytes, r.in_use_bytes,
                                             r.limit_bytes, r.limit_source, list(r.notes), len(r.map.chunks)]
# 3. a cell that sends its XLA work to a fresh process is not warned about it
said_before = len(said.getvalue())
cell("code = 'f = tf.function(lambda a: a, jit_compile=True)'\\n"
     "tfmem_widgets.run_fresh('import tensorflow as tf\\\\n' + code, setup={'lab_mb': 64}, echo=False)")
out["warned_for_fresh"] = said.getvalue()[said_before:]
out["left"] = sorted(os.listdir(tempfile.gettempdir()))
print(json.dumps(out))
"""


def test_an_oom_in_a_fresh_process_is_explained_here_even_when_it_kills_the_process(tmp_path):
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    out = finish_fresh(start_fresh(FRESH_OOMS, {"TMPDIR": str(own_tmp)}), timeout=300)
    kind, message = out["raised"]
    assert kind == "UsageError" and "last_oom()" in message and "\n" not in message
    verdict, request, largest, in_use, limit, source, path = out["raised_report"]
    # the child's own report: 12 tensors of 2 MiB kept (and a scalar), 16 MiB asked, 12 MiB the largest hole
    assert (verdict, request, largest) == ("fragmentation", 16 << 20, 12 << 20)
    assert 12 * (2 << 20) <= in_use < 12 * (2 << 20) + 4096
    assert (limit, source, path) == (64 << 20, "lab mode", None)  # its dump went with its folder
    assert "SIGABRT" in out["died"] and "last_oom()" in out["died"]
    verdict, request, largest, in_use, limit, source, notes, chunks = out["died_report"]
    assert (verdict, request, largest) == ("fragmentation", 16 << 20, 12 << 20)
    assert 12 * (2 << 20) <= in_use < 12 * (2 << 20) + 4096
    assert (limit, source) == (64 << 20, "lab mode") and chunks > 12
    assert any("killed by SIGABRT" in n and "dump" in n for n in notes)
    assert out["warned_for_fresh"] == ""
    # the children's dumps went with their folders, the killed one's too; the kernel's own folder is there
    # while the extension is loaded
    assert not [name for name in out["left"] if name.startswith("tfmem-fresh-")]
    assert len([name for name in out["left"] if name.startswith("tfmem-oom-")]) == 1


def test_a_compiled_steps_oom_names_its_step_and_node_and_on_a_cpu_says_what_varies():
    from tfmem_widgets.oom.explain import report_from_dump
    from tfmem_widgets.oom.report import CPU_STEP_NOTE
    from tfmem_widgets.tracing.allocator_map import AllocatorMap

    text = ("Graph execution error:\n\nOOM when allocating tensor with shape[8192,4096] and type float on "
            "/job:localhost/replica:0/task:0/device:CPU:0 by allocator bfc_cpu_allocator_for_gpu\n"
            "\t [[{{node sequential_1/wider_1/BiasAdd}}]]\n [Op:__inference_multi_step_on_iterator_1189]")
    empty = AllocatorMap("bfc_cpu_allocator_for_gpu", (), (), "dump")
    cpu = report_from_dump(empty, "OOM when allocating ...", 8192 * 4096 * 4, text=text)
    assert (cpu.step, cpu.node) == ("multi_step_on_iterator", "sequential_1/wider_1/BiasAdd")
    assert "(compiled step multi_step_on_iterator, node sequential_1/wider_1/BiasAdd)" in repr(cpu).splitlines()[0]
    assert repr(cpu).splitlines()[-1] == f"  note: {CPU_STEP_NOTE}"  # last: what is above it varies
    gpu = report_from_dump(AllocatorMap("GPU_0_bfc", (), (), "dump"), "OOM ...", 1 << 20, text=text)
    eager = report_from_dump(empty, "OOM ...", 1 << 20, text="OOM when allocating tensor ... [Op:Fill]")
    assert CPU_STEP_NOTE not in repr(gpu) and CPU_STEP_NOTE not in repr(eager) and eager.step is None


HOSTILE = SHELL + """
cell("%load_ext tfmem_widgets")
cell("%tfmem setup --lab 64")
cell("import tensorflow as tf, threading, tfmem_widgets")
import tfmem_widgets
out = {}
# an OOM in a thread the user started
cell('''
def work():
    kept = [tf.zeros((4 << 20,)) for _ in range(3)]
    tf.zeros((6 << 20,))
t = threading.Thread(target=work, name="loader"); t.start(); t.join()
''')
r = tfmem_widgets.last_oom()
out["thread"] = {"said": said.getvalue(), "request": r and r.request_bytes, "verdict": r and r.verdict}
# two OOMs in different states (the first's request fits the second's largest hole), then the
# first explained after the second: its own dump, not the newer one's
cell('''
errors = []
for count, size in ((3, 5 << 20), (1, 13 << 20)):
    kept = [tf.zeros((4 << 20,)) for _ in range(count)]
    try:
        tf.zeros((size,))
    except tf.errors.ResourceExhaustedError as e:
        errors.append(e)
    del kept
''')
e1, e2 = ip.user_ns["errors"]
r2, r1 = tfmem_widgets.explain_oom(e2), tfmem_widgets.explain_oom(e1)
out["again"] = {"r1": [r1.request_bytes, r1.verdict, r1.dump_path], "r2": [r2.request_bytes, r2.verdict, r2.dump_path]}
# TensorFlow cannot write where TF_BFC_MEMORY_DUMP points
os.environ["TF_BFC_MEMORY_DUMP"] = "/nonexistent/dir/x"
shown.truncate(0); shown.seek(0)
cell("kept = [tf.zeros((4 << 20,)) for _ in range(3)]\\nbig = tf.zeros((7 << 20,))")
out["unwritable"] = {"notes": list(tfmem_widgets.last_oom().notes), "shown": shown.getvalue()}
print(json.dumps(out))
"""


def test_an_oom_in_a_thread_the_same_oom_again_and_an_unwritable_dump_place_are_each_told_right():
    out = finish_fresh(start_fresh(HOSTILE))
    thread = out["thread"]
    assert "tfmem: an OOM in thread 'loader', explained" in thread["said"] and "verdict:" in thread["said"]
    assert thread["request"] == 24 << 20 and thread["verdict"] in ("shortage", "limit")
    r1, r2 = out["again"]["r1"], out["again"]["r2"]
    assert r1[0] == 20 << 20 and r2[0] == 52 << 20
    assert r1[1] != "not explained by the dump" and r1[2] != r2[2]      # each error read its own dump
    notes = " ".join(out["unwritable"]["notes"])
    assert "TF_BFC_MEMORY_DUMP=/nonexistent/dir/x points into /nonexistent/dir" in notes
    assert "was not set" not in notes and "another allocator" not in notes


FRESH_OOM = """
import json, contextlib, io, tfmem_widgets
shown = io.StringIO()
with contextlib.redirect_stdout(shown):
    try:
        tfmem_widgets.run_fresh("import tensorflow as tf\\nkept = tf.zeros((4 << 20,))\\nbig = tf.zeros((12 << 20,))",
                                setup={"lab_mb": 48})
    except tfmem_widgets.FreshRunError:
        pass
r = tfmem_widgets.last_oom()
print(json.dumps({"shown": shown.getvalue(), "dump_path": r.dump_path}))
"""


def test_a_fresh_processs_report_says_its_dump_goes_with_the_process():
    out = finish_fresh(start_fresh(FRESH_OOM))
    line = next(text for text in out["shown"].splitlines() if "TensorFlow's dump:" in text)
    assert line.endswith("(in the fresh process's folder, removed when it ends)")
    assert out["dump_path"] is None                   # the report that came back points nowhere gone


USERS_PROFILER = """
import json, logging, io, os, tempfile
import tfmem_widgets
tfmem_widgets.setup(lab_mb=256)
import keras, numpy as np, tensorflow as tf
out = {}
recorder = tfmem_widgets.record()
logdir = tempfile.mkdtemp()
for name, call in (("start", lambda: tf.profiler.experimental.start(logdir)), ("stop", tf.profiler.experimental.stop)):
    try:
        call()
        out[name] = "ran"
    except tf.errors.OpError as e:
        out[name] = [type(e).__name__, e.message]
# Keras' TensorBoard callback profiles batches with the same start: it logs TensorFlow's error
caught = io.StringIO()
handler = logging.StreamHandler(caught)
logging.getLogger().addHandler(handler)
import absl.logging
absl.logging.get_absl_logger().addHandler(handler)
# (the callback's own method, as its profile_batch calls it: its scalars need the tensorboard package)
board = keras.callbacks.TensorBoard(log_dir=tempfile.mkdtemp(), profile_batch=(2, 3))
board._start_profiler(logdir=tempfile.mkdtemp())
out["board_started"] = board._profiler_started
out["tensorboard"] = caught.getvalue()
out["recorder_windows_lost"] = [n for n in recorder.notes if "lost" in n]
recorder.stop()
tf.profiler.experimental.start(logdir)      # the user's own, once the recorder is stopped
tf.profiler.experimental.stop()
out["after"] = sorted(os.listdir(os.path.join(logdir, "plugins", "profile")))
print(json.dumps(out))
"""


def test_the_users_own_profiler_while_recording_is_refused_in_one_line_and_cuts_nothing_short():
    out = finish_fresh(start_fresh(USERS_PROFILER))
    assert out["start"][0] == "AlreadyExistsError" and "%tfmem record stop" in out["start"][1]
    assert out["stop"][0] == "UnavailableError" and "no profiler session of yours" in out["stop"][1]
    assert "the tfmem recorder (%tfmem record) holds TensorFlow's profiler" in out["tensorboard"]
    assert out["board_started"] is False
    assert out["recorder_windows_lost"] == []          # the recorder's window was not cut short
    assert len(out["after"]) == 1                        # and the user's own session works once it stops


# A Dense model under MirroredStrategy over the two logical CPUs of a 256 MB lab, and its data.
MIRRORED_FIT = """
import keras, numpy as np, tensorflow as tf
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096, activation="relu", name="wide"),
                              keras.layers.Dense(10, name="out")])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x, y = np.ones((8192, 1024), "float32"), np.zeros((8192,), "int64")
"""

MIRRORED_OOM = """
import json
import tfmem_widgets
tfmem_widgets.setup(lab_mb=256, cpus=2)
tfmem_widgets.watch_oom()  # TensorFlow writes its allocator's dump at the OOM (the extension does this in a notebook)
""" + MIRRORED_FIT + """
model.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0)  # each replica writes its own copy of every variable
try:
    model.fit(x, y, batch_size=4096, epochs=1, verbose=0)
    report = None
except tf.errors.ResourceExhaustedError as error:
    report = tfmem_widgets.explain_oom(error)
layers = report.by_layer()
print(json.dumps({"wide": layers.phases("sequential/wide"), "keys": list(layers), "text": repr(report)}))
"""


def test_a_mirrored_fits_oom_counts_each_replicas_copy_of_the_weights_and_names_its_layers():
    # Under MirroredStrategy every replica holds a copy of each variable, in its own buffer once written: on the
    # logical CPUs of lab mode both are in the one pool, and both are the layer's parameters and optimizer state,
    # not activations. The second replica's ops are scoped replica_1/: still the model's layers.
    out = run_fresh(MIRRORED_OOM, timeout=300)
    wide = (1024 * 4096 + 4096) * 4  # the layer's kernel and bias, float32
    assert out["wide"]["parameters"] == 2 * wide and out["wide"]["optimizer state"] == 4 * wide, out["wide"]
    assert not any(key.startswith("(op replica_") for key in out["keys"]), out["keys"]


MIRRORED_SHELL = SHELL + """
cell("%load_ext tfmem_widgets")
cell("%tfmem setup --lab 256 --cpus 2")
cell('''""" + MIRRORED_FIT + """''')
result = cell("model.fit(x, y, batch_size=4096, epochs=1, verbose=0)")
import tfmem_widgets
need = tfmem_widgets.last_oom().need
model, x, y = (ip.user_ns[k] for k in ("model", "x", "y"))
plans = {b: tfmem_widgets.plan(model, (x, y), b) for b in (4096, need.fits_batch, need.fails_batch)}
uneven = cell("model.fit(x[:63], y[:63], batch_size=63, epochs=1, verbose=0)")
print(json.dumps({"raised": type(result.error_in_exec).__name__, "shown": shown.getvalue(),
                  "need": {"batch": need.batch_size, "peak": need.peak_bytes, "fits": need.fits_batch,
                           "fails": need.fails_batch, "source": need.source, "limit": need.limit_bytes,
                           "shares": repr(need.plan)},
                  "planned": {b: [p.peak_bytes, p.fits()] for b, p in plans.items()},
                  "uneven": type(uneven.error_in_exec).__name__,
                  "uneven_plan": repr(tfmem_widgets.plan(model, (x[:63], y[:63]), 63))}))
"""


def test_a_mirrored_fits_oom_is_told_its_replicas_need_and_a_global_batch_that_divides_by_them():
    # Read from the fit's frames while TensorFlow waited: its global batch, its arrays' shapes (the replicas' plan
    # places the data on the first device), its strategy's replicas. The need is plan()'s of the same model and data.
    out = run_fresh(MIRRORED_SHELL, timeout=300)
    need, planned = out["need"], out["planned"]
    assert out["raised"] == "ResourceExhaustedError" and need["source"] == "replica plan"
    assert need["batch"] == 4096 and need["peak"] == planned["4096"][0] > need["limit"] == 256 << 20
    fits, fails = need["fits"], need["fails"]
    assert fits % 2 == 0 and fails % 2 == 0 and fits < fails <= 4096  # (an uneven global batch cannot start)
    assert planned[str(fits)][1] and not planned[str(fails)][1]
    assert fails - fits <= 2 * max(1, math.ceil(0.02 * fits / 2))  # to the search's resolution, in rows per replica
    assert "the plan of its 2 replicas' shares, all of them in the one shared pool" in out["shown"]
    assert f"what fits: at most batch {fits:,}" in out["shown"] and "draws each replica's shares" in out["shown"]
    assert "CPU:0 (2,048 rows)" in need["shares"] and "the data 32.06 MiB" in need["shares"]
    # Keras' fit reduces its first batch across the replicas to build the model: 63 rows over 2 cannot start, and
    # the plan of that fit says so before it runs.
    assert out["uneven"] == "InvalidArgumentError"
    assert "FAILS before its first step" in out["uneven_plan"] and "32 and 31" in out["uneven_plan"]
