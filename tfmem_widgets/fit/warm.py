"""A batch search's probes, each in a process started before its batch is known.

A probe's fresh process spends most of a small probe importing Python's and TensorFlow's modules
(in lab mode here 2.6 s of a 3.5 s probe). ``WarmProbes`` keeps the next probe's process started
ahead: it imports TensorFlow, Keras and IPython and waits, starting nothing of TensorFlow's
runtime (no device made, no memory taken: a GPU's default limit is read when its probe begins, as
in a cold probe, and a waiting process holds nothing on the card). When the batch is known the
process goes on exactly as a cold probe does, from its setup on; meanwhile the next one starts.
The search's plans (fit/plan_search.py) run while the first one imports.

The processes are the search's: closing it (the search's end, an error, Ctrl-C) kills every one
it started, waiting or probing; a waiting process also ends by itself when its parent is gone.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

from .probe import Probe, probe_outcome, ran_past

WARM_CODE = """
from pathlib import Path
from tfmem_widgets.fit.probe import run_probe
probe = run_probe({path!r}, int(Path({start!r}).read_text()), {steps})
"""


class _Waiting:
    """One probe process, started and waiting for its batch in the file `start`."""

    def __init__(self, path: Path, steps: int, setup: dict | None, env: dict):
        from .fresh import run_checked

        self.start = path.parent / f"start-{uuid.uuid4().hex}"  # the batch is written there when it is known
        self.process: subprocess.Popen | None = None
        self.closed = threading.Event()
        self.outcome: tuple = ()
        code = WARM_CODE.format(path=str(path), start=str(self.start), steps=steps)

        def run():
            try:
                self.outcome = ("run", run_checked(code, setup=setup, env=env, returns=["probe"], timeout=None,
                                                   echo=False, remember_oom=False, start_when=str(self.start),
                                                   on_start=self._started))
            except BaseException as exc:  # handed to the caller of probe(), in its thread
                self.outcome = ("error", exc)

        self.thread = threading.Thread(target=run, name="tfmem-warm-probe", daemon=True)
        self.thread.start()

    def _started(self, process: subprocess.Popen) -> None:
        from .fresh import _kill_group

        self.process = process
        if self.closed.is_set():  # closed before its process had started: it ends now
            _kill_group(process)

    def probe(self, batch: int, timeout: float | None) -> Probe:
        started = time.perf_counter()
        written = self.start.with_name(self.start.name + ".part")
        written.write_text(str(batch))
        written.replace(self.start)  # whole, at once: the child never reads half a number
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.kill()
            raise ran_past(batch, timeout)

        def result():
            kind, value = self.outcome
            if kind == "error":
                raise value
            return value

        return probe_outcome(batch, timeout, started, result)

    def kill(self) -> None:
        from .fresh import _kill_group

        self.closed.set()  # set before the process is read; _started reads them the other way round
        if self.process is not None:
            _kill_group(self.process)
            try:  # gone before this returns: a join that Ctrl-C broke off may not wait for the thread
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.thread.join(10)


class WarmProbes:
    """probe(batch): one probe, in a process started ahead; the next one starts meanwhile.
    close(): every process these probes started ended (waiting or probing), the functions' file
    removed. path: the pickled functions (build_model, make_batch), for a process of the same setup."""

    def __init__(self, functions: bytes, steps: int, setup: dict | None, env: dict, timeout: float | None):
        self._work = tempfile.mkdtemp(prefix="tfmem-batch-")
        self._current: _Waiting | None = None
        self._ready: _Waiting | None = None
        try:
            self.path = Path(self._work) / "functions.pickle"
            self.path.write_bytes(functions)
            self._args = (self.path, steps, setup, env)
            self._timeout = timeout
            self._ready = _Waiting(*self._args)
        except BaseException:
            self.close()
            raise

    def probe(self, batch: int) -> Probe:
        current = self._current = self._ready or _Waiting(*self._args)
        self._ready = None
        self._ready = _Waiting(*self._args)  # imports while this one probes
        try:
            return current.probe(batch, self._timeout)
        except BaseException:  # Ctrl-C or an error here: the probe in flight ends with it
            current.kill()
            raise
        finally:
            self._current = None

    def close(self) -> None:
        for waiting in (self._current, self._ready):
            if waiting is not None:
                waiting.kill()
        self._current = self._ready = None
        shutil.rmtree(self._work, ignore_errors=True)
