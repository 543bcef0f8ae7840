"""The copy of a process's file descriptor 2 that outlives it: a small child process reads what is
written to fd 2 (through a pipe that replaces it), writes it to a log and on to where fd 2 went before
(a terminal, Jupyter's capture of it). The child is in a session of its own (an interrupt or a kill of
the kernel's process group leaves it), ends when the last holder of the pipe is gone, and keeps the
log's tail: two files of at most KEEP bytes, written in turn.

A dying process's words are in the pipe once written; the child reads them after the death, so
nothing depends on the dying process writing anything after the signal."""

from __future__ import annotations

import os
import subprocess
import sys

KEEP = 1 << 20  # bytes a log file holds before the other one is written (the tail: up to twice this)

_CHILD = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
base, out, keep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
turn, size = 0, 0
log = os.open(base + ".0", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
while True:
    try:
        data = os.read(0, 65536)
    except InterruptedError:
        continue
    except OSError:
        break
    if not data:
        break
    if size + len(data) > keep and size:
        os.close(log)
        turn, size = 1 - turn, 0
        log = os.open(base + "." + str(turn), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(log, data)
        size += len(data)
    except OSError:
        pass
    if out >= 0:
        try:
            os.write(out, data)
        except OSError:
            out = -1
"""


class Fd2Copy:
    """fd 2 replaced by a pipe to the copying child, until `restore()`."""

    def __init__(self, base: str):
        self.base = base
        self._saved = os.dup(2)
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _CHILD, base, str(self._saved), str(KEEP)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(self._saved,), start_new_session=True)
            sys.stderr.flush()
            os.dup2(self._child.stdin.fileno(), 2)
        except BaseException:
            os.close(self._saved)
            raise

    @property
    def pid(self) -> int:
        return self._child.pid

    def restore(self) -> None:
        """fd 2 back where it went; the child ends once no process holds the pipe (at once where none
        of this process's children does)."""
        if self._saved is None:
            return
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._saved = None
        self._child.stdin.close()
        try:
            self._child.wait(timeout=2)
        except subprocess.TimeoutExpired:  # a child process of ours holds the pipe: it ends with that one
            pass


def read_log(base: str) -> str:
    """The log's tail: the older file, then the newer."""
    parts = []
    for name in (base + ".0", base + ".1"):
        try:
            parts.append((os.path.getmtime(name), open(name, "rb").read()))
        except OSError:
            pass
    return b"".join(data for _, data in sorted(parts)).decode(errors="replace")
