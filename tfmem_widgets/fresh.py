"""Run code in a new Python process, set up its own way: ``%%tfmem fresh`` / ``run_fresh``.

TensorFlow's devices can be set up once per process, before its runtime starts. To compare
setups (growth or not, two call orders, a 64 MB lab against a 256 MB one) without restarting
the kernel, each one runs in a process of its own: a real IPython shell with the extension
loaded, whose output is shown as it comes and whose named results come back (numbers, text,
lists and dicts as they are; a ``Trace`` or ``Measurement`` as that object).

The child starts as a reader's fresh kernel would: without the setup variables of this
process (lab mode, growth, allocator), only with those the caller passes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import SetupError
from .runtime import SETUP_ENV_VARS

# TensorFlow's C++ start-up lines ("I0000 00:00:... cuda_dnn.cc:...]") and absl's notice come
# before its log level applies; they say nothing about the cell.
_NATIVE_LOG = re.compile(r"^(?:[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\]|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] "
                         r"|WARNING: All log messages before absl::InitializeLog\(\))")
# What Python itself writes to stderr (a traceback, a warning): never taken for a log line's tail.
_PYTHON_TEXT = re.compile(r"^(?:Traceback|\s+File |\S+\.py:\d+: |[A-Za-z_][\w.]*(?:Error|Warning|Exception)\b)")
_CHILD = "import sys\nfrom tfmem_widgets.fresh import _child_main\nsys.exit(_child_main(sys.argv[1]))\n"


class FreshRunError(RuntimeError):
    """The code raised, or the process died, in the fresh process (its output was shown)."""


@dataclass
class FreshRun:
    """What a fresh process left: its exit code, its output and the values it returned."""

    returncode: int
    output: str
    values: dict[str, Any] = field(default_factory=dict)
    stderr: str = ""

    def __repr__(self) -> str:
        names = ", ".join(self.values) or "nothing"
        return f"FreshRun(exit {self.returncode}, returned {names})"


def child_environment(env: Mapping[str, str] | None = None, path: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment without its setup variables, plus `env`: a fresh start.

    The module path only grows: the folders in `path` and any PYTHONPATH in `env` come first,
    then this package's location, then this process's own PYTHONPATH (where a cluster's
    environment modules or a carried install put TensorFlow), so nothing the user had is lost.
    """
    child = {k: v for k, v in os.environ.items() if k not in SETUP_ENV_VARS}
    extra = {str(k): str(v) for k, v in (env or {}).items()}
    added = [str(folder) for folder in path] + extra.pop("PYTHONPATH", "").split(os.pathsep)
    child.update(extra)
    child["PYTHONUNBUFFERED"] = "1"  # lines appear as the child prints them
    # The child imports this package from wherever this process does (an editable
    # install, or a checkout on sys.path).
    here = str(Path(__file__).resolve().parent.parent)
    folders = [*added, here, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    child["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(f for f in folders if f))
    return child


def _without_native_logs(lines) -> str:
    """The child's stderr without TensorFlow's C++ log lines (and their continuation lines)."""
    kept, in_log = [], False
    for line in lines:
        if _NATIVE_LOG.match(line):
            in_log = True
        elif in_log and line.strip() and not _PYTHON_TEXT.match(line):
            continue
        else:
            in_log = False
            kept.append(line)
    return "".join(kept)


def run_fresh(
    code: str,
    *,
    setup: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    returns: Sequence[str] = (),
    timeout: float | None = 600,
    echo: bool = True,
    path: Sequence[str] = (),
) -> FreshRun:
    """Run `code` (a cell: Python with %magics) in a new Python process and return its results.

    setup:   keyword arguments for tfmem_widgets.setup() in the child, before the code runs
             (None: no setup, TensorFlow as it starts by default)
    env:     environment variables for the child (e.g. {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}); a
             PYTHONPATH here is added in front of this process's, never replaces it
    returns: names the code defines, brought back as FreshRun.values
    echo:    print the child's output here as it comes
    path:    folders to import from first in the child (e.g. where a module of the notebook's is)

    Raises SetupError when the child refuses the setup, FreshRunError when the code raises
    or the process dies or runs past `timeout` seconds (it is then killed).

    >>> run = run_fresh("import tensorflow as tf\\nx = tf.zeros((256,))\\npeak = ...",
    ...                 setup={"lab_mb": 64}, returns=["peak"])
    >>> run.values["peak"]
    """
    bad = [name for name in returns if not str(name).isidentifier()]
    if bad:
        raise SetupError(f"returns must be Python names; {bad[0]!r} is not one.")
    with tempfile.TemporaryDirectory(prefix="tfmem-fresh-") as work:
        work_dir = Path(work)
        (work_dir / "job.json").write_text(json.dumps(
            {"code": code, "setup": None if setup is None else dict(setup), "returns": list(returns)}))
        with open(work_dir / "stderr.txt", "w+") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(work_dir)], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=stderr, text=True, env=child_environment(env, path),
            )
            timer = threading.Timer(timeout, proc.kill) if timeout else None
            output: list[str] = []
            try:
                if timer is not None:
                    timer.start()
                for line in proc.stdout:
                    output.append(line)
                    if echo:
                        sys.stdout.write(line)
                        sys.stdout.flush()
                proc.wait()
            finally:  # Ctrl-C or any error here: the child does not outlive the call
                if timer is not None:
                    timer.cancel()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()
            stderr.seek(0)
            errors = _without_native_logs(stderr)
        if errors and echo:
            sys.stderr.write(errors)
        result_file = work_dir / "result.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        if "setup_error" in result:
            raise SetupError(result["setup_error"])
        if proc.returncode != 0 or "values" not in result:
            if timeout and proc.returncode == -9 and "values" not in result:
                why = f"ran past {timeout:g} s and was stopped"
            elif "error" in result:
                why = f"raised {result['error']}"
            else:
                why = f"ended with exit code {proc.returncode}"
            raise FreshRunError(f"the fresh process {why}; its output is above.")
        values = {name: _decode(value, work_dir) for name, value in result["values"].items()}
        return FreshRun(proc.returncode, "".join(output), values, errors)


# -- the child's side ------------------------------------------------------------------------

def _encode(name: str, value: Any, work_dir: Path) -> Any:
    from .measure import Measurement
    from .trace import Trace, trace

    if isinstance(value, trace):  # `with tfmem_widgets.trace() as t:` gives the block
        value = value.result
    if isinstance(value, Trace):
        path = work_dir / f"{name}.trace.json"
        value.to_json(path)
        return {"__tfmem__": "trace", "path": path.name}
    if isinstance(value, Measurement):
        return {"__tfmem__": "measurement", "fields": dataclasses.asdict(value)}
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        value = value.tolist()
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise TypeError(f"cannot bring back {name} ({type(value).__name__}): return numbers, text, "
                        "lists, dicts, a Trace or a Measurement") from None
    return value


def _decode(value: Any, work_dir: Path) -> Any:
    if isinstance(value, dict) and "__tfmem__" in value:
        if value["__tfmem__"] == "trace":
            from .trace import Trace

            return Trace.load(work_dir / value["path"])
        from .measure import Measurement

        return Measurement(**value["fields"])
    return value


def _child_main(work: str) -> int:
    work_dir = Path(work)
    job = json.loads((work_dir / "job.json").read_text())
    result_file = work_dir / "result.json"

    if job["setup"] is not None:
        import tfmem_widgets

        try:
            tfmem_widgets.setup(**job["setup"])
        except SetupError as exc:
            result_file.write_text(json.dumps({"setup_error": str(exc)}))
            return 2

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance(colors="nocolor")
    shell.displayhook.write_output_prompt = lambda: None  # values print bare, as in a notebook
    shell.run_line_magic("load_ext", "tfmem_widgets")
    outcome = shell.run_cell(job["code"], store_history=False)
    failure = outcome.error_before_exec or outcome.error_in_exec
    if failure is not None:
        result_file.write_text(json.dumps({"error": type(failure).__name__}))
        return 1
    values = {}
    for name in job["returns"]:
        if name not in shell.user_ns:
            print(f"{name} was not defined by the cell; nothing to bring back.")
            result_file.write_text(json.dumps({"error": "NameError"}))
            return 1
        try:
            values[name] = _encode(name, shell.user_ns[name], work_dir)
        except TypeError as exc:
            print(exc)
            result_file.write_text(json.dumps({"error": "TypeError"}))
            return 1
    result_file.write_text(json.dumps({"values": values}))
    sys.stdout.flush()
    return 0
