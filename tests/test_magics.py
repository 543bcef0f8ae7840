"""%tfmem and %%tfmem in a real IPython shell, on TensorFlow's real BFC allocator (lab mode)."""

import os

import pytest
from IPython.core.error import UsageError

import tfmem_widgets
from conftest import PASTED_OOM_LOG
from tfmem_widgets.units import MiB

# Tests here run on the CPU in lab mode, also on a machine with a GPU.
KEEP_8_DROP_16 = """
import tensorflow as tf
with tf.device("CPU:0"):
    kept = tf.zeros((2 << 20,))          # 8 MiB of float32
    transient = tf.zeros((4 << 20,))     # 16 MiB, dropped within the cell
    del transient
"""


def one_line_usage_error(shell, line, cell=None):
    with pytest.raises(UsageError) as info:
        if cell is None:
            shell.run_line_magic("tfmem", line)
        else:
            shell.run_cell_magic("tfmem", line, cell)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def test_cell_magic_reports_exact_peak_and_net(shell, capsys):
    from tfmem_widgets import trace
    from tfmem_widgets.units import format_bytes

    with trace() as t:  # the allocator's own events, to check the figures against
        m = shell.run_cell_magic("tfmem", "-o -d CPU:0", KEEP_8_DROP_16)
    printed = capsys.readouterr().out
    # 8 MiB kept and 16 MiB asked while it lived: the chunks are at least that (the allocator may
    # hand out a larger free chunk whole, as earlier tests leave the pool), and exactly its figures.
    events = t.events("bfc_cpu_allocator_for_gpu")
    assert m.peak_bytes == int(events.in_use.max()) - m.start_bytes >= 24 * MiB
    assert abs(m.delta_bytes - 8 * MiB) <= 4096
    assert m.highest_bytes - m.start_bytes == m.peak_bytes
    assert f"peak {format_bytes(m.peak_bytes, signed=True)}" in printed and "net +8.00 MiB" in printed
    assert "lab mode" in printed
    shell.run_cell("del kept")


def test_quiet_and_variable(shell, capsys):
    result = shell.run_cell_magic(
        "tfmem", "-q -v cell_m -d CPU:0",
        "import tensorflow as tf\nwith tf.device('CPU:0'):\n    z = tf.ones((1 << 18,))\ndel z")
    assert result is None and capsys.readouterr().out == ""
    m = shell.user_ns["cell_m"]
    assert m.delta_bytes == 0 and m.peak_bytes >= 1 * MiB


def test_a_failing_cell_still_reports_and_the_shell_keeps_working(shell, capsys):
    m = shell.run_cell_magic(
        "tfmem", "-o -d CPU:0",
        "import tensorflow as tf\nwith tf.device('CPU:0'):\n    w = tf.zeros((1 << 18,))\n1/0")
    out = capsys.readouterr().out
    assert m.error == "ZeroDivisionError" and "raised ZeroDivisionError" in out
    # w stays. The allocator hands out a whole free chunk when it is under twice the
    # request, so a 1 MiB tensor may hold up to 2 MiB (FACTS: internal fragmentation).
    assert 1 * MiB <= m.delta_bytes <= 2 * MiB
    assert shell.run_cell("1 + 1").result == 2
    shell.run_cell("del w")


def test_nested_measures_keep_the_outer_peak(lab_session):
    import tensorflow as tf

    with tf.device("CPU:0"), tfmem_widgets.measure("CPU:0") as outer:
        big = tf.zeros((4 << 20,))  # 16 MiB, gone before the inner block
        del big
        with tfmem_widgets.measure("CPU:0") as inner:
            small = tf.zeros((1 << 20,))  # 4 MiB
            del small
    # Each peak is the chunk the allocator handed out: the request, or a free chunk under twice it taken whole
    # (its no-split rule), whatever earlier tests left in this process's pool.
    assert 4 * MiB <= inner.peak_bytes < 8 * MiB
    assert 16 * MiB <= outer.peak_bytes < 32 * MiB, "the inner reset must not erase the outer peak"
    assert outer.delta_bytes == inner.delta_bytes == 0


def test_report_shows_lab_mode_and_the_allocator(shell):
    import tensorflow as tf

    with tf.device("CPU:0"):
        keep = tf.zeros((1 << 20,))
    r = shell.run_line_magic("tfmem", "-o")  # %tfmem [options] is %tfmem report [options]
    cpu = r.cpus[0]
    assert r.runtime_started and r.lab_limit_bytes == 256 * MiB
    assert cpu.name == "CPU:0" and cpu.limit_bytes == 256 * MiB and cpu.limit_source == "lab mode"
    assert cpu.in_use_bytes >= 4 * MiB and cpu.peak_bytes >= cpu.in_use_bytes
    text = repr(r)
    assert "lab mode" in text and "CPU:0" in text and "NVML" in text
    assert "<table>" in r._repr_html_()
    del keep


def test_bad_input_is_one_line_and_changes_nothing(shell):
    import tensorflow as tf

    env_before = {k: v for k, v in os.environ.items() if k.startswith("TF_")}
    has_gpu = bool(tf.config.list_physical_devices("GPU"))
    cases = {
        "setup --bogus": "unrecognized arguments: --bogus",
        "setup --lab -5": "positive",
        "setup --lab lots": "whole number",
        "setup --limit 0=abc": "whole number",
        "setup --split 4096": "--limit 4096",
        "setup --gpus 7": "no GPU 7" if has_gpu else "no GPU is visible",
        "setup --growth": "already started" if has_gpu else "no GPU is visible",
        "setup --allocator malloc": "invalid choice",
        "setup --lab 128": "already started",
        "frobnicate": "invalid choice",
    }
    for line, expected in cases.items():
        assert expected in one_line_usage_error(shell, line), line
    assert "no device 'GPU:3'" in one_line_usage_error(shell, "-d GPU:3", "x = 1")
    assert "argument -v: expected a Python name" in one_line_usage_error(shell, "-v 2bad", "x = 1")
    assert {k: v for k, v in os.environ.items() if k.startswith("TF_")} == env_before
    assert shell.run_cell("1 + 1").result == 2


def test_same_setup_after_start_is_accepted_as_in_effect(shell):
    result = shell.run_line_magic("tfmem", "setup --lab 256 -o")
    assert not result.changed and "already in effect" in repr(result)


def test_device_names_are_normalized(lab_session):
    for name in ("cpu", "CPU:0", "/CPU:0", "/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:0"):
        assert tfmem_widgets.measure(name).result.device == "CPU:0"
    with pytest.raises(tfmem_widgets.ArgumentError):
        tfmem_widgets.measure("TPU:0")


def test_help_lists_every_setup_option(shell):
    doc = shell.find_line_magic("tfmem").__doc__
    for option in ("--lab", "--growth", "--limit", "--split", "--gpus", "--allocator", "--reserve", "-o", "-q", "-v"):
        assert option in doc


# -- one convention for every result (IPython's %timeit): -o returns it, -q does not show it, -v NAME stores it

A_CELL = "cell_ran = True\nimport tensorflow as tf\nwith tf.device('CPU:0'):\n    z = tf.ones((1 << 10,))\ndel z"
# Each subcommand that makes a result, as (its line, its cell or None for a line magic, the result's class). plan,
# batch and fresh follow the same convention in tests/test_plan.py, test_batch_search.py and test_fresh_run.py.
RESULT_MAKERS = {
    "report": ("report", None, "MemoryReport"),
    "setup": ("setup --lab 256", None, "SetupResult"),   # this session's setup again: nothing changes
    "oom": ("oom", None, "OomReport"),
    "measure": ("-d CPU:0", A_CELL, "Measurement"),
    "trace": ("trace", A_CELL, "Trace"),
}


@pytest.fixture
def an_oom_explained():
    """A last OOM to report (%tfmem oom): a pasted log's, explained; the one before is put back after."""
    from tfmem_widgets.oom import explain

    before = explain.last_oom()
    explain.remember(tfmem_widgets.explain_oom(PASTED_OOM_LOG))
    yield explain.last_oom()
    explain.remember(before)


@pytest.mark.parametrize("name", list(RESULT_MAKERS))
def test_every_result_follows_timeit(shell, capsys, an_oom_explained, name):
    line, cell, kind = RESULT_MAKERS[name]

    def run(flags: str):
        shell.user_ns.pop("cell_ran", None)
        text = f"{line} {flags}".strip()
        return shell.run_line_magic("tfmem", text) if cell is None else shell.run_cell_magic("tfmem", text, cell)

    capsys.readouterr()
    assert run("-v kept_result") is None  # without -o: shown, not returned
    kept = shell.user_ns.pop("kept_result")
    assert type(kept).__name__ == kind and capsys.readouterr().out.strip() == repr(kept).strip()
    returned = run("-o -q")
    assert type(returned).__name__ == kind and capsys.readouterr().out == ""
    assert (returned is kept) == (name == "oom")  # each run makes its result; oom reports the same last OOM
    assert run("-o").__class__ is returned.__class__ and capsys.readouterr().out.strip()  # -o: shown and returned
    for bad in ("2bad", "class", "a.b"):
        shell.user_ns.pop("cell_ran", None)
        message = one_line_usage_error(shell, f"{line} -v {bad}", cell)
        assert "argument -v: expected a Python name" in message, message
        assert "cell_ran" not in shell.user_ns and capsys.readouterr().out == ""  # refused before anything ran
    assert "given twice" in one_line_usage_error(shell, f"{line} -v a -v b", cell)
    assert (kept is an_oom_explained) == (name == "oom")


def test_oom_with_none_says_so_and_stores_none(shell, capsys):
    from tfmem_widgets.oom import explain

    before = explain.last_oom()
    explain.remember(None)
    try:
        assert shell.run_line_magic("tfmem", "oom -v no_oom") is None
        assert capsys.readouterr().out == "no OOM explained in this process yet\n" and shell.user_ns["no_oom"] is None
    finally:
        explain.remember(before)


def test_a_state_the_core_refuses_is_one_line_in_the_magic(shell):
    with tfmem_widgets.trace():
        message = one_line_usage_error(shell, "trace", "x = 1")
    assert message.startswith("%%tfmem trace: a trace is already running")


def test_help_is_the_parsers_own(shell, capsys):
    from tfmem_widgets.notebook.magic_parsers import CELL_MODES, SUBCOMMANDS, summary_of

    assert set(SUBCOMMANDS) == {"report", "setup", "watch", "panel", "record", "oom", "plan", "guard", "died"}
    assert set(CELL_MODES) == {"measure", "trace", "fresh", "batch"}
    shell.run_line_magic("pinfo", "%tfmem")
    text = capsys.readouterr().out
    for parser in (*SUBCOMMANDS.values(), *CELL_MODES.values()):
        assert parser.format_usage().rstrip() in text and summary_of(parser) in text, parser.prog
    # -h: that parser's help as argparse writes it, and nothing runs
    assert shell.run_line_magic("tfmem", "setup --lab 64 -h") is None
    assert capsys.readouterr().out.strip() == SUBCOMMANDS["setup"].format_help().strip()
    shell.user_ns.pop("cell_ran", None)
    assert shell.run_cell_magic("tfmem", "trace -h", A_CELL) is None and "cell_ran" not in shell.user_ns
    assert capsys.readouterr().out.strip() == CELL_MODES["trace"].format_help().strip()
    assert shell.run_line_magic("tfmem", "-h") is None
    assert capsys.readouterr().out.strip() == shell.find_line_magic("tfmem").__doc__.strip()
    message = one_line_usage_error(shell, "setup --bogus")
    assert message == "%tfmem setup: unrecognized arguments: --bogus. See %tfmem setup -h for its options."
