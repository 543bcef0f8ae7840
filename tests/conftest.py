"""Shared test set-up.

Lab mode (TensorFlow's real BFC allocator on the CPU) is set up once for this pytest
process, before anything starts TensorFlow's runtime; tests that need a fresh runtime
(setup rules before/after start, import side effects) run in a fresh interpreter with
``run_fresh``.
"""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# The workbook's GPU experiments live next to the notebooks (they are not part of the package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))


SESSION_LAB_MB = 256

# For fresh-process scripts: a real IPython shell with the extension, and the cell of the
# foundation's done-when (an 8 MiB tensor kept, a 16 MiB one made and dropped while it exists).
FRESH_SHELL = """
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
ip.run_line_magic("load_ext", "tfmem_widgets")
KEEP_8_DROP_16 = "\\n".join(["import tensorflow as tf",
                             "x = tf.zeros((2 << 20,))           # kept: 8 MiB",
                             "y = tf.zeros((4 << 20,)); del y    # 16 MiB while x exists"])
"""


# An OOM as a job's log shows it (a GPU's BFC allocator: 2 MiB in use of 8, 16 MiB asked), for explain_oom.
PASTED_OOM_LOG = (
    "W bfc_allocator.cc:502] Allocator (GPU_0_bfc) ran out of memory trying to allocate 16.00MiB "
    "(rounded to 16777216)requested by op Fill\n"
    "I bfc_allocator.cc:1085] Next region of size 4194304\n"
    "I bfc_allocator.cc:1105] InUse at 7f0000000000 of size 2097152 next 1\n"
    "I bfc_allocator.cc:1105] Free  at 7f0000200000 of size 2097152 next 2\n"
    "I bfc_allocator.cc:1119] Total size in pool: 4.00MiB memory_limit_: 8.00MiB available size: 4.00MiB "
    "curr_region_allocation_bytes_: 8.00MiB\n"
    "OOM when allocating tensor with shape[4194304] and type float on /job:localhost/replica:0/task:0/"
    "device:GPU:0 by allocator GPU_0_bfc\n"
)


def start_fresh(code: str, env: dict | None = None) -> subprocess.Popen:
    """Start `code` in a new Python process, as a reader's would start: without this
    process's setup variables. finish_fresh gives the JSON object it prints last."""
    from tfmem_widgets.fresh.run import child_environment

    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_environment(env),
    )


def finish_fresh(proc: subprocess.Popen, timeout: float = 240) -> dict:
    stdout, stderr = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"fresh process failed ({proc.returncode}):\n{stdout}\n{stderr[-5000:]}")
    lines = [line for line in stdout.splitlines() if line.strip()]
    return json.loads(lines[-1])


def search_functions(width=1024, jit=False, replicas=0):
    """A batch search's build_model and make_batch (Dense 512-width-width-1, Adam, mse): defined inside
    this function, as in a notebook, so they travel to a probe's process by value. replicas: the model
    built under a MirroredStrategy over that many logical CPUs."""
    def build_model():
        import contextlib

        import keras
        import tensorflow as tf

        scope = tf.distribute.MirroredStrategy([f"/cpu:{k}" for k in range(replicas)]).scope() if replicas \
            else contextlib.nullcontext()
        with scope:
            model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(width, activation="relu"),
                                      keras.layers.Dense(width, activation="relu"), keras.layers.Dense(1)])
            model.compile("adam", "mse", jit_compile=jit)
        return model

    def make_batch(n):
        import numpy as np

        return np.ones((n, 512), "float32"), np.ones((n, 1), "float32")

    return build_model, make_batch


# A probe's data against its plan (tests/test_plan.py in lab mode, tests/test_gpu.py on a GPU): the
# search's Dense model and make_batch; data_on_device(make_batch, model) measures the share of its data the
# device holds besides the step's batch.
PROBE_DATA_MODEL = """
import keras, numpy as np, tensorflow as tf
from tfmem_widgets.search.plan_first import data_on_device
from tfmem_widgets.search.probe import probe_dataset
def make_batch(n):
    return np.ones((n, 512), "float32"), np.ones((n, 1), "float32")
model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="relu"),
                          keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1)])
model.compile("adam", "mse", jit_compile=True)
"""



def trains_like_a_probe(batch: int, setup: dict, env: dict | None = None) -> bool:
    """The search's model (PROBE_DATA_MODEL) fitted as its probes fit it, in a fresh process set up by `setup`:
    whether it trained (its OOM is not made this process's last_oom(), as a probe's is not)."""
    from tfmem_widgets.errors import FreshRunError
    from tfmem_widgets.fresh.run import check_request, run_checked

    code = PROBE_DATA_MODEL + f"model.fit(probe_dataset(make_batch({batch}), 2), epochs=1, verbose=0)"
    try:
        run_checked(code, setup=check_request(setup, None), env=env, echo=False, remember_oom=False)
        return True
    except FreshRunError:
        return False

def run_fresh(code: str, env: dict | None = None, timeout: float = 240) -> dict:
    """Run `code` in a new Python process; it must print one JSON object as its last line."""
    return finish_fresh(start_fresh(code, env), timeout)


# A Dense model `width` wide built under MirroredStrategy over `devices`, and `rows` rows of data (x, y): fitted
# on two logical CPUs (tests/test_plan.py) and on two logical GPUs (tests/test_gpu.py).
MIRRORED_MODEL = """
import keras, numpy as np, tensorflow as tf
keras.utils.set_random_seed(0)
strategy = tf.distribute.MirroredStrategy({devices!r})
L = keras.layers
with strategy.scope():
    model = keras.Sequential([keras.Input((1024,)), L.Dense({width}, activation="relu"), L.Dense({width}, activation="relu"),
                              L.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x, y = rng.normal(size=({rows}, 1024)).astype("float32"), rng.integers(0, 10, {rows})
"""


# A model planned, then fit on its data in the same process (tests/test_fit_plan.py in lab mode, test_gpu.py on a
# card): FACTS section 8's three (an MLP, an attention model, two Conv2D) and our own (Dense, two inputs), each
# at `scale` of its batch; `form` is how the fit is given its data: NumPy arrays, tensors, or a tf.data pipeline.
PLAN_THEN_FIT = """
import json, sys
import numpy as np
import tfmem_widgets
kind, form, scale, setup = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
tfmem_widgets.setup(growth=True) if setup == "gpu" else tfmem_widgets.setup(lab_mb=int(setup))
import keras, tensorflow as tf
L = keras.layers
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
if kind == "mlp":
    B = 6000; model = keras.Sequential([keras.Input((1536,)), L.Dense(3072, activation="relu"),
                                        L.Dense(6144, activation="relu"), L.Dense(12)])
    x = rng.normal(size=(2 * B, 1536)).astype("float32"); y = rng.integers(0, 12, 2 * B)
elif kind == "attention":
    B = 384; i = keras.Input((192,), dtype="int32"); h = L.Embedding(8000, 256)(i)
    h = L.LayerNormalization()(h + L.MultiHeadAttention(4, 64)(h, h))
    h = L.LayerNormalization()(h + L.Dense(256)(L.Dense(1024, activation="relu")(h)))
    model = keras.Model(i, L.Dense(10)(L.GlobalAveragePooling1D()(h)))
    x = rng.integers(0, 8000, (2 * B, 192)).astype("int32"); y = rng.integers(0, 10, 2 * B)
elif kind == "conv":
    B = 256; model = keras.Sequential([keras.Input((64, 64, 3)), L.Conv2D(64, 3, activation="relu", padding="same"),
                                       L.Conv2D(128, 3, activation="relu", padding="same"),
                                       L.GlobalAveragePooling2D(), L.Dense(10)])
    x = rng.normal(size=(2 * B, 64, 64, 3)).astype("float32"); y = rng.integers(0, 10, 2 * B)
elif kind in ("dense", "long"):  # (long: an epoch of 40 batches, more than Keras' pipeline holds at once)
    B = 8192; model = keras.Sequential([keras.Input((512,)), L.Dense(1024, activation="relu"),
                                        L.Dense(1024, activation="relu"), L.Dense(1)])
    R = 40 if kind == "long" else 3
    x = rng.normal(size=(R * B + 100, 512)).astype("float32"); y = rng.normal(size=(R * B + 100, 1)).astype("float32")
else:  # two inputs
    B = 4096; a = keras.Input((300,), name="a"); b = keras.Input((40,), dtype="int32", name="b")
    h = L.Concatenate()([L.Dense(1024, activation="relu")(a), L.Flatten()(L.Embedding(1000, 16)(b))])
    model = keras.Model([a, b], L.Dense(5)(L.Dense(512, activation="relu")(h)))
    x = [rng.normal(size=(2 * B, 300)).astype("float32"), rng.integers(0, 1000, (2 * B, 40)).astype("int32")]
    y = rng.integers(0, 5, 2 * B)
loss = "mse" if kind in ("dense", "long") else keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model.compile("adam", loss, jit_compile=True)
if scale != 1:
    B = max(8, int(B * scale)); n = R * B + 100 if kind in ("dense", "long") else 2 * B
    x = [a[:n] for a in x] if isinstance(x, list) else x[:n]; y = y[:n]
if form == "tensors":
    x, y = tf.nest.map_structure(tf.constant, x), tf.constant(y)
planned = tfmem_widgets.plan(model, (x, y), B)
device = planned.device
tf.config.experimental.reset_memory_stats(device)
if form == "tfdata":
    model.fit(tf.data.Dataset.from_tensor_slices((tuple(x) if isinstance(x, list) else x, y)).batch(B)
              .prefetch(tf.data.AUTOTUNE), epochs=1, verbose=0)
else:
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
peak = tf.config.experimental.get_memory_info(device)["peak"]
print(json.dumps({"planned": planned.fit_peak_bytes, "peak": peak, "fresh": planned.fit.fresh_peak_bytes,
                  "in_use": planned.fit.in_use_bytes, "text": repr(planned)}))
"""


def plan_then_fit(kind: str, form: str = "arrays", scale: float = 1.0, setup: str = "1024") -> dict:
    """PLAN_THEN_FIT in a fresh process (setup: 'gpu' for growth on a card, else lab mode's MB)."""
    from tfmem_widgets.fresh.run import child_environment

    proc = subprocess.Popen([sys.executable, "-c", PLAN_THEN_FIT, kind, form, str(scale), setup],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_environment())
    return finish_fresh(proc, 400)


def _gpu_available() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


# The tier of each test file (docs/development.md: `python3 dev.py test -m "not slow"` for a fast loop).
TIERS = {
    "test_setup_rules.py": "unit", "test_units_and_reserve.py": "unit", "test_xplane_wire.py": "unit",
    "test_nvml_here.py": "unit", "test_damaged_files.py": "process", "test_environment.py": "process",
    "test_magics.py": "magic", "test_trace.py": "magic", "test_fresh_run.py": "process",
    "test_fresh_transport.py": "process", "test_fresh_process.py": "process", "test_trace_oom.py": "process",
    "test_trace_files.py": "process", "test_start_stop.py": "process", "test_widgets.py": "widget",
    "test_browser.py": "browser", "test_gpu.py": "gpu", "test_workbook.py": "notebook", "test_wheel.py": "process",
    "test_package_shape.py": "unit", "test_oom_explained.py": "process", "test_batch_search.py": "process",
    "test_memory_callback.py": "process", "test_plan.py": "process", "test_step_need.py": "unit", "test_oom_logs.py": "process",
    "test_warm_probes.py": "process", "test_plan_aims.py": "unit", "test_bfc_pool.py": "unit",
    "test_errors.py": "magic", "test_readme.py": "process", "test_deaths.py": "process",
    "test_workbook_prose.py": "notebook", "test_fit_plan.py": "process", "test_shared_autotune.py": "unit",
    "test_graph_step.py": "unit",
}
SLOW_TIERS = {"process", "notebook", "browser", "gpu"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        tier = "notebook" if name.endswith(".ipynb") else TIERS.get(name)
        if tier is None:
            raise pytest.UsageError(f"{name} has no tier in tests/conftest.py TIERS: add it")
        item.add_marker(getattr(pytest.mark, tier))
        if tier in SLOW_TIERS:
            item.add_marker(pytest.mark.slow)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU visible to TensorFlow; none here")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def lab_session():
    """This process in lab mode with a 256 MB limit; returns the setup result."""
    import tfmem_widgets

    return tfmem_widgets.setup(lab_mb=SESSION_LAB_MB)


@pytest.fixture(scope="session")
def shell(lab_session):
    """A real IPython shell (no kernel) with the extension loaded."""
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "tfmem_widgets")
    yield ip


# Real Jupyter kernels (tests/test_deaths.py; tests/test_gpu.py on a card)
def kernel_env(records) -> dict:
    """A reader's environment with kernel records on, kept under `records` (tfmem_widgets/deaths/record.py)."""
    from tfmem_widgets.deaths.record import PLACE_ENV, RECORD_ENV
    from tfmem_widgets.fresh.run import child_environment

    env = child_environment()
    env.pop(RECORD_ENV, None)  # records on, as in a user's kernel
    env[PLACE_ENV] = str(records)
    return env


def start_kernel(folder, records, **env):
    """A real Jupyter kernel started in `folder`, its records under `records` (`env`: more variables):
    (manager, client)."""
    from jupyter_client.manager import start_new_kernel

    return start_new_kernel(kernel_name="python3", cwd=str(folder), env={**kernel_env(records), **env},
                            startup_timeout=120)


def run_in_kernel(client, code: str, timeout: float = 300) -> str:
    """Run `code` in the kernel; its streams and results as text."""
    out = []

    def hook(message):
        content = message["content"]
        if message["msg_type"] == "stream":
            out.append(content["text"])
        elif message["msg_type"] in ("execute_result", "display_data"):
            out.append(content["data"].get("text/plain", ""))
        elif message["msg_type"] == "error":
            out.append("\n".join(content["traceback"]))

    client.execute_interactive(code, output_hook=hook, timeout=timeout)
    return "".join(out)


def until_kernel_dies(manager, client, code: str, timeout: float = 300) -> None:
    """Run `code` in the kernel and wait until the kernel's process is gone."""
    client.execute(code)
    deadline = time.monotonic() + timeout
    while manager.is_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not manager.is_alive(), "the kernel did not die"


def told_by_the_next_kernel(folder, records, then: tuple[str, ...] = ()) -> list[str]:
    """A new kernel started in `folder`: what `%load_ext tfmem_widgets` says there, then each cell of `then`'s
    output; the kernel is then shut down as Jupyter does (a shutdown request: it exits normally)."""
    manager, client = start_kernel(folder, records)
    try:
        return [run_in_kernel(client, code) for code in ("%load_ext tfmem_widgets", *then)]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
