"""The extension in a shell: ``%load_ext tfmem_widgets`` registers the magics, the OOM watcher and
the cell hooks; ``%unload_ext`` removes each (hooks come in pairs).

Before a cell: the OOM watcher notes the dumps that exist, lab-mode hazards are said, and the kernel's
record (deaths/record.py) notes the cell. After it: an OOM it raised is explained under its traceback,
and every widget that shows readings refreshes (frontends that do not show updates made while a cell
runs still get the figures). On load, a kernel that died before this one in the same folder is explained.
"""

from __future__ import annotations

import sys
import threading

from .hooks import after_cell, run_unload_hooks


def before_cell(info=None) -> None:
    """pre_run_cell: the OOM watcher notes the dumps that exist; lab-mode hazards are said before
    the cell runs."""
    from ..deaths import record
    from ..oom.watch import cell_started
    from .fit_hook import hook_fit
    from .hazards import warn_before_cell

    cell_started()
    source = getattr(info, "raw_cell", "") or ""
    warn_before_cell(source)
    if record.armed is not None:
        try:
            record.armed.note_cell(_cell_number(info), source)
        except OSError:  # a full or vanished temporary folder: the cell runs unrecorded
            pass
    hook_fit()


def _cell_number(info) -> int | None:
    """The number (In [N]) of the cell about to run; None for a cell kept out of the history. IPython
    has counted it already when pre_run_cell is called."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or not getattr(info, "store_history", False):
        return None
    return shell.execution_count - 1


def tell_deaths() -> None:
    """The deaths of kernels started before this one in this folder, each told once."""
    import os

    from ..deaths.record import RECORD_ENV, deaths

    if os.environ.get(RECORD_ENV) == "0":
        return  # no records here (the workbook's recorded kernels): nothing is told either
    for death in deaths():
        print(f"tfmem: a kernel started in this folder before this one died; %tfmem died shows it again.\n{death!r}")


def explain_cell_oom(result=None) -> None:
    """post_run_cell: an OOM the cell raised is explained in its output."""
    import sys

    from ..oom.watch import cell_finished

    error = getattr(result, "error_in_exec", None)
    if error is not None and "keras" in sys.modules:  # no fit ran where Keras was never imported
        from ..readings.callback import close_open_epochs

        close_open_epochs()  # a fit that raised calls no callback: its epoch's blocks end here
    report = cell_finished(error)
    if report is not None:
        from ..deaths import record

        if record.armed is not None:
            try:
                record.armed.note_oom(getattr(result, "execution_count", None))
            except OSError:
                pass
        from IPython.display import display

        display(report)


_HOOKS = (("post_run_cell", after_cell), ("pre_run_cell", before_cell), ("post_run_cell", explain_cell_oom))


def explain_thread_oom(args) -> None:
    """threading.excepthook while the extension is loaded: an OOM raised in a thread the user
    started is explained (its report said on stderr, where the thread's traceback goes, and kept
    as last_oom()); then the hook that was there runs (the traceback)."""
    from ..oom import explain
    from ..tf.messages import is_oom

    error = args.exc_value
    if isinstance(error, Exception) and is_oom(error) and not getattr(error, "_tfmem_explained", False):
        try:
            report = explain.explained(error, explain.explain_exception(error))
            name = getattr(args.thread, "name", "a thread")
            print(f"tfmem: an OOM in thread {name!r}, explained (tfmem_widgets.last_oom()):\n{report!r}",
                  file=sys.stderr, flush=True)
        except Exception as failure:  # the hook must never hide the thread's own error
            print(f"tfmem: the OOM in a thread could not be explained ({type(failure).__name__}); "
                  "tfmem_widgets.explain_oom(error) explains it", file=sys.stderr, flush=True)
    (_previous_thread_hook or threading.__excepthook__)(args)


_previous_thread_hook = None


def load(ipython) -> None:
    """Register %tfmem / %%tfmem, the OOM watcher (TensorFlow's dump at every OOM, into a folder of
    the extension's own) and the cell hooks; the shell's namespace is where Keras objects are
    looked for, and a batch search shows a bar in a notebook. A kernel that died before this one in
    the same folder is told; this one's record is made (deaths/record.py: fd 2's copy is the one process
    it starts). Starts nothing of TensorFlow's."""
    from ..deaths import record
    from ..frontend import Frontend, use_frontend
    from ..oom.watch import watch_oom
    from .magics import TfmemMagics
    from .progress import notebook_progress

    ipython.register_magics(TfmemMagics)
    tell_deaths()
    record.arm()
    watch_oom(parent=str(record.armed.folder) if record.armed is not None else None)
    use_frontend(Frontend(namespace=lambda: ipython.user_ns, progress=notebook_progress))
    for event, hook in _HOOKS:
        if hook not in ipython.events.callbacks[event]:
            ipython.events.register(event, hook)
    global _previous_thread_hook
    if threading.excepthook is not explain_thread_oom:
        _previous_thread_hook, threading.excepthook = threading.excepthook, explain_thread_oom


def unload(ipython) -> None:
    """Remove what load added; gauges stop, and with them the sampler's thread."""
    from ..deaths import record
    from ..frontend import use_frontend
    from ..oom.watch import unwatch_oom
    from ..readings.sampler import sampler
    from ..tracing.recorder import stop
    from .fit_hook import unhook_fit

    for kind in ("line", "cell"):
        ipython.magics_manager.magics[kind].pop("tfmem", None)
    for event, hook in _HOOKS:
        if hook in ipython.events.callbacks[event]:
            ipython.events.unregister(event, hook)
    global _previous_thread_hook
    if threading.excepthook is explain_thread_oom:
        threading.excepthook = _previous_thread_hook or threading.__excepthook__
    _previous_thread_hook = None
    unwatch_oom()
    use_frontend(None)
    stop()
    run_unload_hooks()
    sampler.stop()
    unhook_fit()
    record.disarm()
