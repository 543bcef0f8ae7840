"""The fresh process's side of ``run_fresh``: set up, then run the cell in a real IPython shell with
the extension loaded (so %magics work and an OOM is explained there, where its limits and Keras
layers are known), and write back the values asked for."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import TfmemError
from ..fresh.transport import CheckedPickler, encode, read_job, write_result


def main(work: str) -> int:
    """The fresh process: its setup, then the cell in an IPython shell with the extension loaded;
    the named values written back; the exit code."""
    import faulthandler

    faulthandler.enable(all_threads=True)  # Python's stacks at a fatal signal, on fd 2 (the parent's file)
    work_dir = Path(work)
    job = read_job(work_dir)
    from ..tf import dump_place

    prefix = dump_place.current_prefix()
    if prefix and Path(prefix).parent == work_dir:  # the call's own folder: its dumps go with it
        dump_place.claim(prefix, dump_place.FRESH_CALL)

    if job.get("start_when") is not None and not wait_warm(Path(job["start_when"]), job["setup"], job["parent"]):
        return 3  # the process that started this one is gone: nothing to do
    from ..search.probe import read_shared_autotune

    read_shared_autotune()  # a search's probe: what its plans' compiles timed, where published by now
    if job["setup"] is not None:
        from ..tf.device_setup import setup

        try:
            setup(**job["setup"])
        except TfmemError as exc:  # a setup this machine refuses (its rules, its devices)
            write_result(work_dir, setup_error=str(exc), setup_error_class=type(exc).__name__)
            return 2

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance(colors="nocolor")
    shell.displayhook.write_output_prompt = lambda: None  # values print bare, as in a notebook
    shell.run_line_magic("load_ext", "tfmem_widgets")
    from dataclasses import replace

    from ..frontend import frontend, use_frontend
    from ..oom import explain

    use_frontend(replace(frontend(), fresh_child=True))  # its stderr reaches the user only when it ends
    outcome = shell.run_cell(job["code"], store_history=False)
    failure = outcome.error_before_exec or outcome.error_in_exec
    if failure is not None:
        report = explain.last_oom()
        if report is not None:  # explained here, where its limits and Keras layers are known
            try:
                (work_dir / "oom.value").write_bytes(CheckedPickler.dumps(report))
            except Exception:
                pass
        code = f"({failure.code!r})" if isinstance(failure, SystemExit) else ""  # sys.exit(3): its code said
        write_result(work_dir, error=type(failure).__name__ + code)
        return 1
    for name in job["returns"]:
        if name not in shell.user_ns:
            print(f"{name} was not defined by the cell; nothing to bring back.")
            write_result(work_dir, error="NameError")
            return 1
        try:
            encode(name, shell.user_ns[name], work_dir)
        except TypeError as exc:
            print(exc)
            write_result(work_dir, error="TypeError")
            return 1
    write_result(work_dir, values=job["returns"])
    sys.stdout.flush()
    return 0


def wait_warm(start: Path, setup: dict | None, parent: int, poll: float = 0.01) -> bool:
    """A process started ahead of its work (search/warm.py): import TensorFlow, Keras and IPython now,
    start nothing of TensorFlow's runtime (no device is made, no memory taken, so a GPU's default
    limit is read when the work starts, not now), then wait until `start` exists. Lab mode's
    oneDNN switch is made first, as setup() makes it before TensorFlow's import. False: the process
    that started this one (pid `parent`, written in the job: a parent that died before this process read
    its own parent's pid is told so too) is gone."""
    import os
    import time

    if setup is not None:
        from ..tf.device_setup import before_import

        before_import(setup)
    import keras  # noqa: F401  (TensorFlow with it)
    from IPython.core import interactiveshell  # noqa: F401

    from ..oom import explain  # noqa: F401
    from ..search import probe  # noqa: F401

    while not start.exists():
        if os.getppid() != parent:
            return False
        time.sleep(poll)
    return True
