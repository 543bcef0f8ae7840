"""A kernel's record, so that the next kernel started in the same folder can explain its death.

``arm()`` (on ``%load_ext tfmem_widgets``) makes a folder for this process under the place of its
working directory: who it is, fd 2's copy (tee.py), faulthandler's stacks at a fatal signal, and,
before each cell, the cell (its number and text) and what the process held; a Keras fit running notes
its batch. All of it is written before the death: nothing depends on the dying process writing after
the signal, except Python's stacks (faulthandler writes them from the signal handler). A process that
exits normally removes its folder; ``deaths()`` in another process reads every folder whose process is
gone into a Death, once (then kept, explained, for a week), and removes records of processes long gone.
Kernels side by side have folders of their own (their process ids and start times).
"""

from __future__ import annotations

import atexit
import faulthandler
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from .explain import Death, explain_death, held_on_host
from .tee import Fd2Copy, read_log

PLACE_ENV = "TFMEM_KERNELS_DIR"  # where the records of every working directory are (default: the temporary folder)
RECORD_ENV = "TFMEM_KERNEL_RECORD"  # "0": no record (the test suite's own process)
KEPT_SECONDS = 7 * 24 * 3600  # explained deaths, and records of processes gone unexplained, are kept a week
_EXPLAINED = "explained-"


def place(cwd: str | None = None, root: str | os.PathLike | None = None) -> Path:
    """The folder of the records of kernels started in `cwd` (default: this process's), under `root`
    (default: PLACE_ENV, else the temporary folder)."""
    root = root or os.environ.get(PLACE_ENV) or os.path.join(tempfile.gettempdir(), f"tfmem-kernels-{_user()}")
    where = os.path.realpath(cwd or os.getcwd())
    return Path(root) / hashlib.sha1(where.encode()).hexdigest()[:16]


def _user() -> str:
    return str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")


def _started(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _write_json(path: Path, value: dict) -> None:
    """Written whole or not at all (a death between the two steps leaves the previous one)."""
    part = path.with_suffix(".part")
    part.write_text(json.dumps(value))
    os.replace(part, path)


def oom_kills() -> int | None:
    """The OOM killer's count in this process's memory cgroup (cgroup v2), None where not readable."""
    try:
        group = Path("/proc/self/cgroup").read_text().strip().splitlines()[-1].split(":", 2)[2]
        for line in (Path("/sys/fs/cgroup") / group.lstrip("/") / "memory.events").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, IndexError, ValueError):
        return None
    return None


class KernelRecord:
    """This process's record; one per process (`armed`)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._copy: Fd2Copy | None = None
        self._stacks = None
        self._had_faulthandler = False

    def arm(self) -> None:
        import sys

        self.folder.mkdir(parents=True, exist_ok=True)
        _write_json(self.folder / "info.json", {
            "pid": os.getpid(), "started": _started(os.getpid()), "cwd": os.getcwd(), "argv": sys.argv[:4],
            "oom_kills": oom_kills(), "armed": time.time()})
        self._copy = Fd2Copy(str(self.folder / "fd2"))
        self._had_faulthandler = faulthandler.is_enabled()
        self._stacks = open(self.folder / "stacks.txt", "w")
        faulthandler.enable(file=self._stacks, all_threads=True)

    def note_cell(self, count: int | None, source: str) -> None:
        """Before a cell: the cell, what the process holds on the host, its lab mode."""
        import psutil

        from ..tf.lab import lab_limit_bytes

        lab = lab_limit_bytes()
        _write_json(self.folder / "cell.json", {
            "count": count, "source": source[:2000], "rss": psutil.Process().memory_info().rss,
            "available": psutil.virtual_memory().available, "lab_mb": None if lab is None else lab >> 20,
            "at": time.time()})

    def note_oom(self, count: int | None) -> None:
        """A cell raised an OOM (the OOM watcher explained it): lab mode's allocator may be left broken after one."""
        _write_json(self.folder / "oom.json", {"count": count, "at": time.time()})

    def note_fit(self, batch: int | None, model: str) -> None:
        _write_json(self.folder / "fit.json", {"batch": batch, "model": model, "at": time.time()})

    def fit_ended(self) -> None:
        try:
            os.unlink(self.folder / "fit.json")
        except OSError:
            pass

    def disarm(self) -> None:
        """The process goes on or exits normally: its record is removed, fd 2 and faulthandler restored."""
        if self._stacks is not None:
            faulthandler.disable()
            if self._had_faulthandler:
                import sys

                faulthandler.enable(file=sys.__stderr__, all_threads=True)
            self._stacks.close()
            self._stacks = None
        if self._copy is not None:
            self._copy.restore()
            self._copy = None
        shutil.rmtree(self.folder, ignore_errors=True)


armed: KernelRecord | None = None


def arm() -> KernelRecord | None:
    """This process's record, made once (None where RECORD_ENV is "0" or the place cannot be written)."""
    global armed
    if armed is not None or os.environ.get(RECORD_ENV) == "0":
        return armed
    record = KernelRecord(place() / f"{os.getpid()}-{int((_started(os.getpid()) or time.time()) * 1000)}")
    try:
        record.arm()
    except OSError:
        record.disarm()
        return None
    armed = record
    atexit.register(disarm)
    return armed


def disarm() -> None:
    global armed
    if armed is not None:
        armed.disarm()
        armed = None


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _alive(info: dict) -> bool:
    pid, started = info.get("pid"), info.get("started")
    if not pid:
        return False
    now = _started(pid)
    return now is not None and (started is None or abs(now - started) < 1.0)


def death_of(folder: Path) -> Death:
    """The Death a record tells (its process gone)."""
    info, cell, fit, oom = (_read(folder / name) for name in ("info.json", "cell.json", "fit.json", "oom.json"))
    try:
        stacks = (folder / "stacks.txt").read_text(errors="replace")
    except OSError:
        stacks = ""
    kills, before = oom_kills(), info.get("oom_kills")
    death = explain_death(None, read_log(str(folder / "fd2")), stacks, pid=info.get("pid"), cell=cell.get("count"),
                          cell_source=cell.get("source", ""), batch=fit.get("batch") if fit else None,
                          lab_mb=cell.get("lab_mb"), oom_killed=kills is not None and before is not None and kills > before,
                          host=held_on_host(cell.get("rss"), cell.get("available")),
                          oom_cell=oom.get("count") if oom else None)
    return death


def deaths(cwd: str | None = None, again: bool = False) -> list[Death]:
    """The deaths of kernels started in `cwd` not told yet (again: those told in the last week too, the
    newest last); each told is kept, explained, for a week. Records of processes gone a week are removed."""
    folder = place(cwd)
    found: list[tuple[float, Death]] = []
    if not folder.is_dir():
        return []
    now = time.time()
    for record in folder.iterdir():
        if not record.is_dir() or (armed is not None and record == armed.folder):
            continue
        info = _read(record / "info.json")
        age = now - (record.stat().st_mtime if record.exists() else now)
        if record.name.startswith(_EXPLAINED):
            if age > KEPT_SECONDS:
                shutil.rmtree(record, ignore_errors=True)
            elif again:
                found.append((info.get("armed", 0), death_of(record)))
            continue
        if _alive(info) or (not info and age < 60):
            continue  # a kernel side by side, or one making its record now
        if age > KEPT_SECONDS or not info:
            shutil.rmtree(record, ignore_errors=True)
            continue
        found.append((info.get("armed", 0), death_of(record)))
        try:
            record.rename(record.with_name(_EXPLAINED + record.name))
        except OSError:
            shutil.rmtree(record, ignore_errors=True)
    return [death for _, death in sorted(found, key=lambda pair: pair[0])]
