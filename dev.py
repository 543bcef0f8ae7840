#!/usr/bin/env python3
"""Set everything up in ./.venv, then open the workbook or run every test.

    python3 dev.py lab     # JupyterLab on notebooks/ (lab mode where there is no GPU)
    python3 dev.py test    # ruff, then pytest: unit, magic, fresh-process and notebook (nbval) tests
    python3 dev.py record  # re-run the notebooks in place, storing their outputs for nbval
    python3 dev.py bench   # the figures docs/measurements.md quotes (benchmarks/*.py)

Needs only Python 3.10+. Extra arguments go to jupyter lab / pytest. On a machine where
`nvidia-smi` answers, TensorFlow's CUDA libraries are installed too (extra 'gpu').
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")


def _has_nvidia_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _run(*args) -> None:
    print("+", " ".join(str(a) for a in args), flush=True)
    subprocess.run([str(a) for a in args], check=True, cwd=ROOT)


def ensure_environment(extras: list[str]) -> None:
    """Create .venv if needed and install the package with `extras` (quick when done)."""
    if sys.version_info < (3, 10):  # noqa: UP036 - dev.py runs before anything is installed
        sys.exit(f"tfmem_widgets needs Python 3.10 or newer; this is {sys.version.split()[0]}.")
    if not PYTHON.exists():
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
        _run(PYTHON, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    if _has_nvidia_gpu():
        extras = extras + ["gpu"]
    _run(PYTHON, "-m", "pip", "install", "--quiet", "-e", f".[{','.join(extras)}]")


# TensorFlow's C++ start-up lines ("Could not find cuda drivers...", timestamps, process ids) and
# the profiler's session lines go to file descriptor 2, before or beside its log level, and
# ipykernel forwards fd 2 into the notebook. The workbook's kernels leave fd 2 to the terminal, so
# a reader sees what the stored notebooks show; Python's own stderr (warnings, tracebacks) stays.
KERNEL_CONFIG = "c.IPKernelApp.capture_fd_output = False\n"


# Lab mode's regions come from the C library's malloc, and their addresses decide which of two
# equal free chunks the allocator picks. glibc serves large blocks from the heap or from mmap by a
# threshold it raises as the process frees large blocks, so the same notebook laid its pool out
# differently on two machines. A fixed threshold (glibc's own starting value) gives every region
# its own mmap, in the same order everywhere: the workbook's maps are the same on every machine.
MALLOC_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def quiet_kernel_environment(ipython_dir: Path | None = None, tf_log_level: str | None = "3") -> dict:
    """Environment variables for the workbook's kernels: fd 2 left to the terminal (an IPython
    profile in `ipython_dir`, a new temporary one by default), `tf_log_level` for
    TF_CPP_MIN_LOG_LEVEL, and the fixed malloc threshold above."""
    ipython_dir = Path(tempfile.mkdtemp(prefix="tfmem-ipython-")) if ipython_dir is None else ipython_dir
    profile = ipython_dir / "profile_default"
    profile.mkdir(parents=True, exist_ok=True)
    (profile / "ipython_kernel_config.py").write_text(KERNEL_CONFIG)
    # No kernel records (tfmem_widgets/deaths/record.py): a recorded notebook's first cell would tell of a
    # kernel that died in that folder before, and the kernels would copy fd 2 through a process of their own.
    env = {"IPYTHONDIR": str(ipython_dir), "TFMEM_KERNEL_RECORD": "0", **MALLOC_ENVIRONMENT}
    if tf_log_level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL", tf_log_level)
    return env


def record_notebooks(paths: list[str]) -> int:
    """Execute notebooks in place with the same kernel settings as the nbval tests."""
    env = {**os.environ, **quiet_kernel_environment()}
    notebooks = paths or sorted(str(p) for p in (ROOT / "notebooks").glob("*.ipynb"))
    for notebook in notebooks:
        print("recording", notebook, flush=True)
        subprocess.run(
            [str(PYTHON), "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", "--inplace",
             "--ExecutePreprocessor.timeout=600", notebook],
            check=True, cwd=ROOT, env=env,
        )
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("lab", "test", "record", "bench"):
        print(__doc__.strip())
        return 2
    command, rest = argv[0], argv[1:]
    if command == "lab":
        ensure_environment(["lab"])
        # Containers and CI often run as root, which JupyterLab refuses unless told.
        as_root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        # TensorFlow's native log lines go to this terminal, not into the notebooks.
        env = {**os.environ, **quiet_kernel_environment(VENV / "ipython", tf_log_level=None)}
        return subprocess.run(
            [str(PYTHON), "-m", "jupyter", "lab", "--notebook-dir", str(ROOT / "notebooks"), *as_root, *rest],
            cwd=ROOT, env=env,
        ).returncode
    if command == "bench":
        ensure_environment(["bench"])
        for script in sorted((ROOT / "benchmarks").glob("[!_]*.py")):  # _*.py: shared by the scripts
            print(f"== {script.name}", flush=True)
            code = subprocess.run([str(PYTHON), str(script), *rest], cwd=ROOT).returncode
            if code:
                return code
        return 0
    ensure_environment(["test"])
    if command == "record":
        return record_notebooks(rest)
    # The linter first (its rules in pyproject.toml): a failing check fails the test command.
    lint = subprocess.run([str(PYTHON), "-m", "ruff", "check", "."], cwd=ROOT).returncode
    if lint:
        print("dev.py: ruff found problems (above); `.venv/bin/ruff check . --fix` mends the simple ones",
              file=sys.stderr)
        return lint
    code = subprocess.run([str(PYTHON), "-m", "pytest", *rest], cwd=ROOT,
                          env={**os.environ, **MALLOC_ENVIRONMENT}).returncode
    if code == 5:  # pytest: no tests were collected, which must never pass
        print("dev.py: pytest collected no tests", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
