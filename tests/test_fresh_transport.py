"""%%tfmem fresh / run_fresh as a hostile user drives it: timeouts, odd bytes, odd values.

Faults 12 to 15 of the hostile-user review, and the transport class: every value type JSON
would change comes back equal and of the same type, or is refused in one line.
"""

import collections
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
from IPython.core.error import UsageError

from tfmem_widgets import ArgumentError
from tfmem_widgets.fresh.run import FreshRunError, run_fresh


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# -- fault 12: the whole process group, and a bounded wait ------------------------------------

def test_a_timeout_kills_what_the_cell_started_and_returns_on_time(tmp_path):
    marker = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(marker)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    started = time.monotonic()
    with pytest.raises(FreshRunError, match="ran past 3 s"):
        run_fresh(code, timeout=3, echo=False)
    took = time.monotonic() - started
    assert took < 3 + 8, f"returned after {took:.1f} s"
    pid = int(marker.read_text())
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the grandchild outlived the fresh process"


def test_a_process_in_another_session_holding_the_output_does_not_hold_the_call(tmp_path):
    marker = tmp_path / "detached"
    code = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        f"open({str(marker)!r}, 'w').write(str(p.pid))\n"
        "x = 1\n"
    )
    started = time.monotonic()
    try:
        run = run_fresh(code, returns=["x"], timeout=30, echo=False)
        assert run.values == {"x": 1}
        assert time.monotonic() - started < 25, "the wait for output is bounded once the child has gone"
    finally:
        if marker.exists():
            try:
                os.kill(int(marker.read_text()), 9)
            except ProcessLookupError:
                pass


# -- fault 13: bytes that are not UTF-8 -------------------------------------------------------

def test_output_that_is_not_utf8_is_shown_replaced_and_the_results_come_back(capsys):
    code = ("import sys\nsys.stdout.buffer.write(b'before \\xff\\xfe after\\n'); sys.stdout.flush()\n"
            "sys.stderr.buffer.write(b'err \\xc3\\n'); sys.stderr.flush()\nx = 7\n")
    run = run_fresh(code, returns=["x"], echo=True)
    assert run.values == {"x": 7}
    assert "before \ufffd\ufffd after" in run.output and "err \ufffd" in run.stderr
    assert "before" in capsys.readouterr().out


# -- fault 14 and the class: values come back equal, or are refused ---------------------------

VALUES = {
    "int_keys": "{32: 100, 1: 'a'}",
    "a_tuple": "(1, 2, (3, 4))",
    "a_set": "{1, 2, 3}",
    "a_frozenset": "frozenset({'a', 'b'})",
    "some_bytes": "b'\\x00\\xff'",
    "a_bytearray": "bytearray(b'ab')",
    "a_complex": "1 + 2j",
    "not_a_number": "float('nan')",
    "infinite": "float('-inf')",
    "huge": "10 ** 30",
    "a_decimal": "decimal.Decimal('1.10')",
    "a_fraction": "fractions.Fraction(1, 3)",
    "a_datetime": "datetime.datetime(2026, 11, 26, 12, 30)",
    "a_date": "datetime.date(2026, 11, 26)",
    "np_int": "np.int64(5)",
    "np_float": "np.float32(1.5)",
    "np_array": "np.arange(6, dtype=np.int16).reshape(2, 3)",
    "tuple_keys": "{(1, 2): [None, True, False]}",
    "ordered": "collections.OrderedDict([('b', 1), ('a', 2)])",
    "a_counter": "collections.Counter('abca')",
    "a_range": "range(2, 9, 3)",
    "a_path": "PurePosixPath('/a folder/x')",
    "a_region": "Region(4096, 256)",
    "empty": "[[], {}, (), '', None]",
}
IMPORTS = ("import collections, datetime, decimal, fractions\nimport numpy as np\n"
           "from pathlib import PurePosixPath\nfrom tfmem_widgets.tracing.allocator_map import Region\n")


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, collections.OrderedDict):
        return list(a.items()) == list(b.items())
    return a == b


def test_every_value_json_would_change_comes_back_equal_and_of_its_type():
    code = IMPORTS + "\n".join(f"{name} = {expr}" for name, expr in VALUES.items())
    run = run_fresh(code, returns=list(VALUES), echo=False)
    namespace = {}
    exec(IMPORTS, namespace)
    for name, expr in VALUES.items():
        expected = eval(expr, namespace)
        assert same(run.values[name], expected), (name, run.values[name], expected)


@pytest.mark.parametrize("code, why", [
    ("class Mine:\n    pass\nvalue = Mine()", "a class the cell defined"),
    ("def value():\n    return 1", "defined in the cell"),
    ("value = [1, (i for i in range(3))]", "cannot be sent between processes"),
    ("import tensorflow as tf\nvalue = {'t': tf.zeros((2,))}", "would start TensorFlow's runtime"),
])
def test_what_would_come_back_wrong_is_refused_in_one_line(shell, capsys, code, why):
    with pytest.raises(UsageError, match="raised TypeError"):
        shell.run_cell_magic("tfmem", "fresh -r value", code)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "cannot bring back value" in line)
    assert why in line


def test_r_given_twice_brings_back_both(shell):
    shell.run_cell_magic("tfmem", "fresh -r p -r q,p", "p = (1, 2)\nq = {3: 4}")
    assert shell.user_ns["p"] == (1, 2) and shell.user_ns["q"] == {3: 4}


# -- fault 15 and the options: checked before a process starts --------------------------------

@pytest.mark.parametrize("timeout", ["5", -1, 0, float("nan"), True, [5]])
def test_run_fresh_timeout_is_checked_as_the_magic_checks_it(timeout):
    with pytest.raises(ArgumentError) as info:
        run_fresh("x = 1", timeout=timeout, echo=False)
    assert "\n" not in str(info.value) and "timeout" in str(info.value)


def test_no_timeout_is_none_and_the_magic_says_none(shell):
    assert run_fresh("x = 1", returns=["x"], timeout=None, echo=False).values == {"x": 1}
    shell.run_cell_magic("tfmem", "fresh --timeout none -r y", "y = 2")
    assert shell.user_ns["y"] == 2
    shell.run_cell_magic("tfmem", "fresh --timeout 7200 -r y", "y = 3")  # longer than an hour is allowed
    assert shell.user_ns["y"] == 3


@pytest.mark.parametrize("setup, expected", [
    ({"bogus": 1}, "unknown setup option 'bogus'"),
    ({"lab_mb": "64"}, "lab_mb must be a whole number"),
    ({"lab_mb": 64, "cpus": 0}, "cpus must be a count"),
    ("lab_mb=64", "setup must be a dict"),
])
def test_a_bad_setup_is_an_argument_error_here_before_any_process(setup, expected, monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(ArgumentError, match=expected):
        run_fresh("x = 1", setup=setup, echo=False)


def test_the_setup_reaches_the_child_as_checked():
    # NumPy integers are whole numbers (normalized here), and arrive as ints, not as JSON's text.
    run = run_fresh("import tensorflow as tf\nn = len(tf.config.list_logical_devices('CPU'))",
                    setup={"cpus": np.int64(2), "lab_mb": np.int32(64)}, returns=["n"], echo=False)
    assert run.values == {"n": 2}


def test_a_thread_the_cell_leaves_running_does_not_hold_the_results():
    code = ("import threading, time\nthreading.Thread(target=time.sleep, args=(120,)).start()\nx = 5\n")
    started = time.monotonic()
    run = run_fresh(code, returns=["x"], timeout=60, echo=False)
    assert run.values == {"x": 5} and time.monotonic() - started < 30


def test_a_kernel_with_more_than_1024_open_files_still_runs_fresh_cells(tmp_path):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} open files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    opened = [open(tmp_path / "held", "a") for _ in range(1100)]
    try:
        assert max(f.fileno() for f in opened) >= 1024
        assert run_fresh("x = 1", returns=["x"], echo=False).values == {"x": 1}
    finally:
        for f in opened:
            f.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
