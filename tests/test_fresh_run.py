"""%%tfmem fresh / run_fresh: a cell in a new process set up its own way, results brought back;
and the GPU experiments that the workbook shows live on a GPU or as recorded."""

import json
import os
import threading

import gpu_experiments  # notebooks/, put on the path by tests/conftest.py
import pytest
from IPython.core.error import UsageError

import tfmem_widgets
from tfmem_widgets.fresh.run import FreshRunError, run_fresh, without_native_logs
from tfmem_widgets.readings.measure import Measurement
from tfmem_widgets.tf.options import LAB_LIMIT_ENV
from tfmem_widgets.tracing.result import Trace

FRAGMENTING_OOM = """
import tensorflow as tf, tfmem_widgets
try:
    with tfmem_widgets.trace() as t:
        ts = [tf.zeros((1 << 19,)) for _ in range(24)]      # 24 x 2 MiB
        for i in range(0, 24, 2):
            ts[i] = None
        big = tf.zeros((4 << 20,))                          # 16 MiB
except tf.errors.ResourceExhaustedError:
    pass
largest = t.map().largest_free_bytes
"""


def test_the_cell_runs_in_its_own_lab_and_its_results_come_back(shell, capsys):
    shell.run_cell_magic("tfmem", "fresh --lab 64 -r m,peak,limit", """
import os, tensorflow as tf, tfmem_widgets
with tfmem_widgets.measure() as m:
    x = tf.zeros((1 << 20,))
peak = m.peak_bytes
limit = os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]
print("child says", peak)
""")
    out = capsys.readouterr().out
    assert "child says 4194560" in out
    assert shell.user_ns["peak"] == 4194560           # 4 MiB + a 256-byte shape chunk
    assert shell.user_ns["limit"] == "64"              # the child's lab, not this process's 256
    assert isinstance(shell.user_ns["m"], Measurement)
    assert shell.user_ns["m"].lab_limit_bytes == 64 << 20
    assert os.environ[LAB_LIMIT_ENV] == "256"          # this process's setup is untouched


def test_fresh_follows_timeit_with_its_fresh_run(shell, capsys):
    capsys.readouterr()
    assert shell.run_cell_magic("tfmem", "fresh -r answer -v fresh_run", "answer = 42") is None
    run = shell.user_ns["fresh_run"]  # -v: the FreshRun, shown without -o
    assert isinstance(run, tfmem_widgets.FreshRun) and run.values == {"answer": 42} and shell.user_ns["answer"] == 42
    assert capsys.readouterr().out.strip() == repr(run) == "FreshRun(exit 0, returned answer)"
    returned = shell.run_cell_magic("tfmem", "fresh -o -q", "pass")
    assert isinstance(returned, tfmem_widgets.FreshRun) and returned.returncode == 0 and capsys.readouterr().out == ""
    with pytest.raises(UsageError) as info:
        shell.run_cell_magic("tfmem", "fresh -v 2bad", "print('ran')")
    assert "argument -v: expected a Python name" in str(info.value) and "\n" not in str(info.value)
    assert capsys.readouterr().out == ""  # refused before a process started


def test_a_traced_oom_comes_back_as_a_trace_with_its_dump():
    run = run_fresh(FRAGMENTING_OOM, setup={"lab_mb": 64}, returns=["t", "largest"], echo=False)
    trace = run.values["t"]
    assert isinstance(trace, Trace)
    assert trace.oom is not None and "bfc_cpu_allocator_for_gpu" in trace.oom.message
    assert run.values["largest"] == 12 << 20           # FACTS section 1: the largest hole is 12 MiB
    assert trace.map().largest_free_bytes == 12 << 20


def test_no_setup_means_tensorflow_as_it_starts(shell):
    shell.run_cell_magic("tfmem", "fresh -r lab", "import os\nlab = os.environ.get('TF_CPU_ALLOCATOR_USE_BFC')")
    assert shell.user_ns["lab"] is None


def test_environment_variables_reach_the_child(shell):
    shell.run_cell_magic("tfmem", "fresh --env TF_FORCE_GPU_ALLOW_GROWTH=true --env A_B=1=2 -r seen",
                         "import os\nseen = [os.environ['TF_FORCE_GPU_ALLOW_GROWTH'], os.environ['A_B']]")
    assert shell.user_ns["seen"] == ["true", "1=2"]


def test_a_refused_setup_is_one_line_and_runs_nothing(shell, capsys):
    with pytest.raises(UsageError) as info:
        shell.run_cell_magic("tfmem", "fresh --growth -r x", "print('ran'); x = 1")
    message = str(info.value)
    assert message.startswith("%%tfmem fresh: ") and "\n" not in message
    assert "no GPU is visible" in message
    assert "ran" not in capsys.readouterr().out


@pytest.mark.parametrize("line, expected", [
    ("fresh --env NOEQUALS", "--env: expected NAME=VALUE"),
    ("fresh -r 1x", "-r: expected Python names"),
    ("fresh --lab -5", "--lab"),
    ("fresh --timeout 0", "--timeout: timeout must be at least 0.01 seconds (none: no limit)"),
    # conflicting or repeated options: refused, never silently the last one
    ("fresh --lab 64 --env TF_CPU_BFC_MEM_LIMIT_IN_MB=32", "set in env and by the setup option lab_mb"),
    ("fresh --lab 64 --lab 128", "--lab given twice"),
    ("fresh --env A=1 --env A=2", "--env A given twice"),
    ("fresh --cpus 0", "expected a count of at least 1"),
    ("fresh --split 0", "expected a count of at least 1"),
    ('fresh --path "unclosed', "cannot split the options"),
])
def test_bad_options_are_one_line(shell, line, expected):
    with pytest.raises(UsageError) as info:
        shell.run_cell_magic("tfmem", line, "x = 1")
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_an_error_in_the_cell_shows_its_traceback_and_fails_the_cell(shell, capsys):
    with pytest.raises(UsageError, match="raised ZeroDivisionError"):
        shell.run_cell_magic("tfmem", "fresh", "print('before')\n1 / 0")
    out = capsys.readouterr().out
    assert "before" in out and "ZeroDivisionError" in out
    with pytest.raises(UsageError, match=r"raised SystemExit\(3\); the code called sys.exit"):
        shell.run_cell_magic("tfmem", "fresh", "import sys\nsys.exit(3)")


def test_what_cannot_come_back_is_named(shell, capsys):
    with pytest.raises(UsageError, match="raised TypeError"):
        shell.run_cell_magic("tfmem", "fresh -r thing", "thing = (i for i in range(3))")
    assert "cannot bring back thing (generator)" in capsys.readouterr().out
    with pytest.raises(UsageError, match="raised NameError"):
        shell.run_cell_magic("tfmem", "fresh -r missing", "x = 1")


def test_a_process_past_its_timeout_is_stopped_and_nothing_is_left(tmp_path):
    threads = threading.active_count()
    marker = tmp_path / "pid"
    # (a folder it made in the temporary folder, as a trace does, goes with it: the child never removes it)
    with pytest.raises(FreshRunError, match="ran past 2 s"):
        run_fresh(f"import os, tempfile, time\nmade = tempfile.mkdtemp(prefix='tfmem-trace-')\n"
                  f"open({str(marker)!r}, 'w').write(f'{{os.getpid()}} {{made}}')\ntime.sleep(60)",
                  timeout=2, echo=False)
    pid, made = marker.read_text().split()
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)
    assert threading.active_count() == threads
    assert "tfmem-fresh-" in made and not os.path.exists(made)


def test_tensorflow_native_log_lines_are_dropped_and_python_text_kept():
    text = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
        "I0000 00:00:1795686225.830646   31869 cpu_feature_guard.cc:227] This TensorFlow binary is optimized.\n",
        "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow.\n",
        "2026-11-26 09:43:47.618479: W tensorflow/core/framework/op_kernel.cc:1857] OP_REQUIRES failed\n",
        "/work/x.py:3: UserWarning: look at this\n",
        "  warnings.warn('look at this')\n",
        "W0000 00:00:1795728180.576190    4223 bfc_allocator.cc:513] ___****__****\n",
        "tfmem: the allocator refused a request (bfc_cpu_allocator_for_gpu: 256 B in use)\n",
    ]
    # the package's own line right after a native log line is the package's, not the log's tail
    assert without_native_logs(text) == text[4] + text[5] + text[7]


def test_recorded_gpu_results_cover_every_experiment_and_say_where_they_come_from():
    recorded = json.loads(gpu_experiments.RECORDED.read_text())
    assert set(recorded["experiments"]) == set(gpu_experiments.EXPERIMENTS)
    env = recorded["environment"]
    result = gpu_experiments.gpu_result("growth_then_logical", live=False)
    assert not result.live
    assert f"recorded on {env['device']}" in repr(result) and env["tensorflow"] in repr(result)
    assert env["date"] in repr(result)
    # ... with the Keras version and the CUDA and cuDNN TensorFlow was built for, and the driver's CUDA
    for key in ("keras", "cuda", "cudnn", "driver_cuda"):
        assert env[key] and str(env[key]) in repr(result), key
    # The figures agree with the text printed next to them: the 1024 MB logical device took
    # its whole limit although growth was asked.
    assert result.values["nvml_delta"] >= 1000 << 20
    # The label says which GPU math libraries were real when it was recorded.
    libraries = env["libraries"]
    assert set(libraries) == {"cuBLAS", "cuFFT", "cuSOLVER", "cuSPARSE", "cuDNN"}
    assert set(libraries.values()) <= {"real", "stand-in", "not loaded"}
    assert gpu_experiments.libraries_label(libraries) in repr(result)
    assert gpu_experiments.libraries_label({"cuBLAS": "real", "cuFFT": "stand-in", "cuSOLVER": "stand-in",
                                             "cuDNN": "not loaded"}) == (
        "cuBLAS real; cuFFT, cuSOLVER empty stand-ins; cuDNN not loaded")
    # The later experiments' figures agree with what they print: a second process gets free memory
    # minus the low-memory reserve; limits adding up past the card are accepted and the second
    # logical device runs out below its own; an empty region goes back before an OOM, not at del.
    second = gpu_experiments.gpu_result("second_process", live=False).values
    assert abs(second["free"] - second["limit"] - second["reserve"]) <= 4 << 20
    assert second["outcomes"] == {"a 1 KiB tensor": "fitted", "half its limit": "fitted", "twice its limit": "OOM"}
    cap = gpu_experiments.gpu_result("logical_cap", live=False).values
    assert 2 * (cap["limit_mb"] << 20) > cap["free"] and cap["second_bytes"] < cap["limit_mb"] << 20 and cap["oom"]
    collected = gpu_experiments.gpu_result("garbage_collection", live=False).values
    assert collected["after_del"] == collected["with_first"] and collected["with_second"] < collected["with_first"] + (3500 << 20)
    assert collected["without_gc"] == "OOM"
    # Recorded alone, later, on another card: its own label; what it prints agrees with its values.
    death = gpu_experiments.gpu_result("kernel_death", live=False)
    label = recorded["experiments"]["kernel_death"]["environment"]
    assert f"recorded on {label['device']}" in repr(death) and label["date"] in repr(death)
    assert death.values["risks"]["4095"] == 0 and death.values["risks"]["4096"] > 0
    assert death.values["died"] == -6 and death.values["xla"] == 0  # SIGABRT without XLA; with XLA it trained
    assert "killed by SIGABRT" in death.values["told"] and "Check failed: work_element_count" in death.values["told"]
    assert "A batch of at most 4,095" in death.values["told"] and "with jit_compile=True at 4,096: trained" in death.output
    with pytest.raises(KeyError, match="no GPU experiment 'nope'"):
        gpu_experiments.gpu_result("nope")


def test_run_fresh_is_exported():
    assert tfmem_widgets.run_fresh is run_fresh


def test_the_child_keeps_the_kernels_module_path_and_adds_to_it(tmp_path, monkeypatch, shell):
    # Where TensorFlow itself comes from PYTHONPATH (environment modules on a cluster), a
    # PYTHONPATH for the child must add to the kernel's, never replace it.
    inherited, added, by_path = (tmp_path / name for name in ("inherited", "added", "by_path"))
    for folder, module in ((inherited, "from_the_kernel"), (added, "from_env"), (by_path, "from_path")):
        folder.mkdir()
        (folder / f"{module}.py").write_text(f"WHERE = {module!r}\n")
    monkeypatch.setenv("PYTHONPATH", str(inherited))
    shell.run_cell_magic("tfmem", f"fresh --env PYTHONPATH={added} --path {by_path} -r found", """
import from_the_kernel, from_env, from_path
found = [from_the_kernel.WHERE, from_env.WHERE, from_path.WHERE]
""")
    assert shell.user_ns["found"] == ["from_the_kernel", "from_env", "from_path"]
    run = run_fresh("import from_the_kernel, from_env\nfound = 2", env={"PYTHONPATH": str(added)},
                    returns=["found"], echo=False)
    assert run.values["found"] == 2


def test_output_nobody_sees_is_kept_to_its_tail_and_a_death_names_its_last_words():
    import tracemalloc

    noisy = ("import sys\n"
             "for _ in range(64):\n"
             "    sys.stdout.write('x' * (1 << 20) + '\\n'); sys.stderr.write('e' * (1 << 20) + '\\n')\n"
             "print('the last words', file=sys.stderr)\n"
             "import os; sys.stdout.flush(); sys.stderr.flush(); os._exit(3)\n")
    tracemalloc.start()
    try:
        with pytest.raises(FreshRunError) as caught:
            run_fresh(noisy, echo=False, timeout=120)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20                 # 128 MiB written, unseen: only a tail of each kept here
    error = caught.value
    assert error.how == "ended with exit code 3" and error.last_words == "the last words"
    assert "it last wrote: the last words" in str(error) and "output is above" not in str(error)
