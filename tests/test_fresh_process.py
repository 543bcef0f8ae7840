"""What can only be seen in a fresh process: the runtime's start and lab mode's effect."""

import textwrap

from conftest import FRESH_SHELL, run_fresh


def test_import_and_load_ext_do_not_start_the_runtime_and_setup_still_works():
    out = run_fresh(
        """
        import json, sys
        import tfmem_widgets
        imported = "tensorflow" in sys.modules
        from IPython.testing.globalipapp import start_ipython
        ip = start_ipython()
        ip.run_line_magic("load_ext", "tfmem_widgets")
        report = ip.run_line_magic("tfmem", "-o -q")     # reading must not start it either
        from tfmem_widgets.tf.runtime import runtime_started
        before = runtime_started()
        result = ip.run_line_magic("tfmem", "setup --lab 64 -o -q")
        import tensorflow as tf
        with tf.device("CPU:0"):
            small = tf.zeros((10,))                      # 40 bytes: a 256-byte BFC chunk
        info = tf.config.experimental.get_memory_info("CPU:0")
        print(json.dumps({"imported_tf": imported, "started_before_setup": before,
                          "report_started": report.runtime_started, "changed": result.changed,
                          "current": info["current"], "started_after": runtime_started()}))
        """
    )
    assert out == {"imported_tf": False, "started_before_setup": False, "report_started": False,
                   "changed": True, "current": 256, "started_after": True}


def test_done_when_scenario_in_a_fresh_shell():
    out = run_fresh(FRESH_SHELL + textwrap.dedent(
        """
        import json
        ip.run_line_magic("tfmem", "setup --lab 64")
        m = ip.run_cell_magic("tfmem", "-o -q", KEEP_8_DROP_16)   # no GPU here: the CPU in lab mode
        from IPython.core.error import UsageError
        try:
            ip.run_line_magic("tfmem", "setup --lab 128")
            refusal = None
        except UsageError as exc:
            refusal = str(exc)
        print(json.dumps({"peak": m.peak_bytes, "delta": m.delta_bytes, "refusal": refusal}))
        """
    ))
    MiB = 1 << 20
    assert abs(out["peak"] - 24 * MiB) <= 4096 and abs(out["delta"] - 8 * MiB) <= 4096
    assert "already started" in out["refusal"] and "restart the kernel" in out["refusal"]
    assert "%tfmem setup --lab 128" in out["refusal"]


def test_lab_limit_is_real_an_allocation_over_it_raises_resource_exhausted():
    # TensorFlow retries a failed allocation for 10 s before it raises.
    out = run_fresh(
        """
        import json, tfmem_widgets
        tfmem_widgets.setup(lab_mb=64)
        import tensorflow as tf
        try:
            with tf.device("CPU:0"):
                tf.zeros((20 << 20,))   # 80 MiB
            error = None
        except tf.errors.ResourceExhaustedError as exc:
            error = str(exc).splitlines()[0]
        print(json.dumps({"error": error}))
        """
    )
    assert "OOM when allocating" in out["error"] and "bfc_cpu_allocator_for_gpu" in out["error"]


def test_logical_cpus_and_a_refused_setup_leave_the_configuration_untouched():
    out = run_fresh(
        """
        import json, os, tfmem_widgets
        from tfmem_widgets.tf.devices import logical_devices
        from tfmem_widgets.tf.runtime import runtime_started
        env = {k: v for k, v in os.environ.items() if k.startswith("TF_")}
        try:
            tfmem_widgets.setup(lab_mb=64, gpus=[99])     # no such GPU anywhere: refused
        except tfmem_widgets.SetupError as exc:
            refusal = str(exc)
        unchanged = env == {k: v for k, v in os.environ.items() if k.startswith("TF_")}
        tfmem_widgets.setup(lab_mb=64, cpus=2)
        planned = [d.name for d in logical_devices()]
        import tensorflow as tf
        actual = [d.name.split("device:")[-1] for d in tf.config.list_logical_devices()]
        print(json.dumps({"refusal": refusal, "unchanged": unchanged, "planned": planned, "actual": actual}))
        """
    )
    assert "GPU" in out["refusal"] and out["unchanged"]
    assert out["planned"] == out["actual"]  # predicted without starting the runtime
    assert out["actual"][:2] == ["CPU:0", "CPU:1"]


def test_a_failure_half_way_through_applying_undoes_what_was_done():
    out = run_fresh(
        """
        import json, os
        from tfmem_widgets.tf.device_setup import apply_steps
        from tfmem_widgets.tf.setup_rules import Step
        before = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC")
        steps = [Step("env", "TF_CPU_ALLOCATOR_USE_BFC", "true", ""),
                 Step("cpus", None, 2, ""),
                 Step("no-such-kind", None, None, "")]
        try:
            apply_steps(steps)
        except AssertionError:
            pass
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        print(json.dumps({"env": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"), "before": before,
                          "cpus": tf.config.get_logical_device_configuration(cpu)}))
        """,
    )
    assert out["env"] == out["before"] and out["cpus"] is None


def test_without_lab_mode_the_cpu_figures_carry_a_warning():
    out = run_fresh(
        """
        import json, tfmem_widgets
        import tensorflow as tf
        with tf.device("CPU:0"), tfmem_widgets.measure("CPU") as m:
            x = tf.zeros((1 << 20,))
        print(json.dumps({"text": repr(m)}))
        """
    )
    assert "not lab mode" in out["text"]


def test_a_first_cell_without_tensorflow_work_leaves_the_runtime_unstarted_and_panels_follow_it():
    out = run_fresh(FRESH_SHELL + textwrap.dedent(
        """
        import io, json, contextlib
        import tfmem_widgets
        from tfmem_widgets.tf.runtime import runtime_started
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            ip.run_cell_magic("tfmem", "", "x = 1 + 1")       # no TensorFlow work
        measured = buffer.getvalue()
        started_after_cell = runtime_started()
        panel = tfmem_widgets.SetupPanel()
        panel.lab.value, panel.lab_mb.value = True, 64
        allowed_before = not panel.apply_button.disabled
        ip.run_line_magic("tfmem", "setup --lab 64")          # still possible
        ip.run_cell("import tensorflow as tf\\nwith tf.device('CPU:0'):\\n    y = tf.zeros((10,))")
        panel.lab_mb.value = 128
        print(json.dumps({"measured": measured, "started_after_cell": started_after_cell,
                          "allowed_before": allowed_before, "allowed_after": not panel.apply_button.disabled,
                          "panel_says": repr(panel), "result": panel.result.value}))
        """))
    assert "no TensorFlow work" in out["measured"] and not out["started_after_cell"]
    assert out["allowed_before"] and not out["allowed_after"]
    assert "already started" in out["panel_says"] or "already started" in out["result"]
