"""The environment and TensorFlow agree: what is shown as in force is what TensorFlow enforces.

TensorFlow reads the lab-mode variables once, when its runtime starts, and reads them its own
way (TF_CPU_ALLOCATOR_USE_BFC=1 is lab mode; TF_CPU_BFC_MEM_LIMIT_IN_MB='32.5' is 32 MB).
The class test writes the settings every way TensorFlow accepts them, and several ways it does
not, and checks the package's reading against what TensorFlow then does in a fresh process.
"""

import json

import pytest

from conftest import FRESH_SHELL, run_fresh, start_fresh
from tfmem_widgets.tf.lab import LAB_DEFAULT_LIMIT_MB, lab_limit_bytes
from tfmem_widgets.tf.options import DEFAULT_LAB_MB, LAB_LIMIT_ENV, LAB_USE_BFC_ENV, SetupRequest
from tfmem_widgets.tf.setup_rules import DeviceState, plan_setup
from tfmem_widgets.units import GiB


def lab_setting(environment):
    from tfmem_widgets.tf.lab import lab_setting

    return lab_setting(environment)


def env(switch, limit=None):
    out = {LAB_USE_BFC_ENV: switch}
    if limit is not None:
        out[LAB_LIMIT_ENV] = limit
    return out


def cpu_state(environment, started=False):
    return DeviceState(gpus=(), gpu_memory={}, nvml_note=None, cpu_logical=1, host_total_bytes=24 * GiB,
                       env=environment, runtime_started=started)


# -- fault 10: a malformed limit is shown as what TensorFlow does with it ----------------------

@pytest.mark.parametrize("raw, enforced", [("64MB", 64), ("32.5", 32), ("64.9", 64), ("1e3", 1)])
def test_a_malformed_limit_reads_as_the_number_tensorflow_enforces_and_says_so(raw, enforced):
    setting = lab_setting(env("true", raw))
    assert setting.enabled and setting.limit_mb == enforced
    assert len(setting.problems) == 1 and f"enforces {enforced} MB" in setting.problems[0]


@pytest.mark.parametrize("environment, held", [
    (env("1", "64"), 64 << 20), (env("true", "-1"), (1 << 64) - 1), (env("1", str(1 << 44)), (1 << 64) - 1),
    (env("1"), LAB_DEFAULT_LIMIT_MB << 20), (env("false", "64"), None), (env("yes", "64"), None), ({}, None)])
def test_the_lab_limit_is_the_one_tensorflow_holds(environment, held):
    assert lab_setting(environment).limit_bytes == lab_limit_bytes(environment) == held


def test_a_limit_tensorflow_reads_as_zero_is_a_crash_and_a_bare_setup_refuses_it():
    for raw in ("0", "", "abc", "0x40"):
        setting = lab_setting(env("true", raw))
        assert setting.crashes, raw
        assert "crashes" in setting.problems[0]
    with pytest.raises(Exception) as info:
        plan_setup(SetupRequest(), cpu_state(env("1", "abc")))
    assert "crashes" in str(info.value) and f"--lab {DEFAULT_LAB_MB}" in str(info.value)


# -- fault 11: a bare setup keeps a lab limit the user exported --------------------------------

def test_a_bare_setup_keeps_the_lab_limit_the_user_exported():
    plan = plan_setup(SetupRequest(), cpu_state(env("1", "64")))
    assert plan.lab_mb == 64 and plan.steps == ()
    assert any("as set in the environment" in n for n in plan.notes)
    # Asked explicitly, it changes.
    plan = plan_setup(SetupRequest(lab_mb=128), cpu_state(env("1", "64")))
    assert plan.lab_mb == 128 and [s.value for s in plan.steps] == ["true", "128"]


def test_a_bare_setup_with_a_misspelt_switch_says_lab_mode_was_off():
    plan = plan_setup(SetupRequest(), cpu_state(env("yes", "64")))
    assert plan.lab_mb == DEFAULT_LAB_MB  # TensorFlow would not have used lab mode
    assert any("no GPU is visible" in n for n in plan.notes)


# -- fault 8: after the start, the same lab mode spelled another way is in effect --------------

@pytest.mark.parametrize("switch", ["1", "TRUE", "True"])
def test_after_start_lab_mode_spelled_another_way_is_already_in_effect(switch):
    plan = plan_setup(SetupRequest(lab_mb=64), cpu_state(env(switch, " 64"), started=True))
    assert plan.steps == () and plan.lab_mb == 64


# -- fault 9 (and 8) in a real process: what TensorFlow read at its start ---------------------

def test_figures_come_from_what_tensorflow_read_at_its_start_not_the_environment_now():
    out = run_fresh(FRESH_SHELL + """
import json, os
import tensorflow as tf
import tfmem_widgets
from tfmem_widgets import StateError, report, setup, measure
x = tf.zeros((256,))                        # the runtime starts with lab mode at 64 MB ("1")
os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = "512"
r = report()
same = setup(lab_mb=64)
try:
    setup(lab_mb=512)
    refused = None
except StateError as exc:
    refused = str(exc)
with measure("CPU:0") as m:
    pass
try:
    big = tf.zeros((100 << 18,))            # 100 MiB: over what TensorFlow enforces
    oom = False
except tf.errors.ResourceExhaustedError:
    oom = True
print(json.dumps({"report_limit": r.lab_limit_bytes, "report_notes": list(r.notes), "same": repr(same),
                  "refused": refused, "measure_limit": m.lab_limit_bytes, "oom": oom}))
""", env={"TF_CPU_ALLOCATOR_USE_BFC": "1", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "64"})
    assert out["oom"], "TensorFlow enforces the limit it read at its start"
    assert out["report_limit"] == 64 << 20 and out["measure_limit"] == 64 << 20
    assert any("'512' in the environment now" in n and "'64'" in n for n in out["report_notes"])
    assert "already in effect" in out["same"] and "'512' in the environment now" in out["same"]
    assert "lab mode with 64 MB, asked 512 MB" in out["refused"] and "\n" not in out["refused"]


# -- the class: lab settings written every way, against what TensorFlow does -------------------

PROBE = """
import json, os, sys
import tfmem_widgets
from tfmem_widgets.tf.lab import lab_setting
import tensorflow as tf
predicted = lab_setting()
print(json.dumps({"enabled": predicted.enabled, "limit_mb": predicted.limit_mb}), flush=True)
def fits(mb):
    try:
        t = tf.zeros((mb << 18,)); t.numpy()
        return True
    except tf.errors.ResourceExhaustedError:
        return False
x = tf.zeros((256,))
out = {"bfc": int(tf.config.experimental.get_memory_info("CPU:0")["current"]) > 0}
if predicted.enabled and predicted.limit_mb and predicted.limit_mb <= 1024:
    # A fresh pool holds one 2 MiB region: a tensor of the limit less 3 MiB fits, less 1 MiB does not.
    out["below"], out["above"] = fits(predicted.limit_mb - 3), fits(predicted.limit_mb - 1)
elif predicted.enabled:
    out["large"] = fits(300)
print(json.dumps(out))
"""

SPELLINGS = [
    ("1", "64"), ("TRUE", " 64"), ("True", "+64"), ("true", "064 "), ("1", "64MB"), ("true", "32.5"),
    ("yes", "64"), (" true", "64"), ("true", "abc"), ("true", "-1"), ("false", "64"), ("1", None),
]


@pytest.fixture(scope="module")
def tensorflow_readings():
    procs = []
    for switch, limit in SPELLINGS:
        procs.append(start_fresh(PROBE, env={"TF_CPP_MIN_LOG_LEVEL": "3", **env(switch, limit)}))
    readings = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=300)
        lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        readings.append((proc.returncode, lines))
    return readings


@pytest.mark.parametrize("index", range(len(SPELLINGS)), ids=[f"{switch!r}-{limit!r}" for switch, limit in SPELLINGS])
def test_every_spelling_reads_as_tensorflow_acts(tensorflow_readings, index):
    switch, limit = SPELLINGS[index]
    returncode, lines = tensorflow_readings[index]
    assert lines, f"the probe printed nothing (exit {returncode})"
    predicted = lines[0]
    assert predicted == {"enabled": lab_setting(env(switch, limit)).enabled,
                         "limit_mb": lab_setting(env(switch, limit)).limit_mb}
    if predicted["enabled"] and predicted["limit_mb"] == 0:
        assert returncode == -11 and len(lines) == 1, "TensorFlow crashes at its first allocation"
        return
    assert returncode == 0
    seen = lines[1]
    assert seen["bfc"] == predicted["enabled"]
    if predicted["enabled"] and predicted["limit_mb"] and predicted["limit_mb"] <= 1024:
        assert (seen["below"], seen["above"]) == (True, False), f"TensorFlow enforces {predicted['limit_mb']} MB"
    elif predicted["enabled"]:
        assert seen["large"], "no limit, or TensorFlow's default of 64 GiB"
    if limit is None:
        assert predicted["limit_mb"] == LAB_DEFAULT_LIMIT_MB


def test_a_bare_setup_keeps_an_exported_lab_switch_even_when_its_default_exceeds_the_host():
    # Only the switch exported: TensorFlow's default of 64 GiB, more than a 24 GiB machine has.
    plan = plan_setup(SetupRequest(), cpu_state(env("true")))
    assert plan.lab_mb == LAB_DEFAULT_LIMIT_MB and plan.steps == ()
    assert any("more than this machine's" in n for n in plan.notes)
    # Asked explicitly, the same limit is refused.
    with pytest.raises(Exception, match="choose a smaller --lab"):
        plan_setup(SetupRequest(lab_mb=LAB_DEFAULT_LIMIT_MB), cpu_state(env("1", "64")))
    plan = plan_setup(SetupRequest(), cpu_state(env("1", "-1")))
    assert len(plan.notes) == len(set(plan.notes)), "each note once"


def test_lab_modes_printed_code_turns_onednn_off_first_as_the_setup_did():
    # Copied as printed, before TensorFlow's import, the code must do all the setup did: lab mode's
    # oneDNN switch too (an OOM inside a oneDNN fused kernel kills the process with nothing said).
    out = run_fresh("""
        import json, os, sys
        import tfmem_widgets
        result = tfmem_widgets.setup(lab_mb=64)
        print(json.dumps({"code": result.code, "text": repr(result), "env": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                          "imported": "tensorflow" in sys.modules}))
    """)
    lines = out["code"].splitlines()
    assert out["env"] == "0"
    assert lines[0] == "import os" and lines[1].startswith('os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"')
    assert [line.split("=")[0] for line in lines[2:4]] == ['os.environ["TF_CPU_ALLOCATOR_USE_BFC"] ',
                                                          'os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] ']
    assert "3 change(s)" in out["text"] and "before TensorFlow is imported" in out["text"]
    # Imported first, TensorFlow has read the switch already: nothing is said to switch it in the code.
    out = run_fresh("""
        import json
        import tensorflow
        import tfmem_widgets
        result = tfmem_widgets.setup(lab_mb=64)
        print(json.dumps({"code": result.code}))
    """, env={"TF_ENABLE_ONEDNN_OPTS": "1"})
    assert "TF_ENABLE_ONEDNN_OPTS" not in out["code"]
