"""A BaseException at each step of an operation, one step at a time.

A step is a call the package's own code makes (to Python or to C: ``os.dup2``, the profiler's
start, ``tempfile.mkdtemp``...), identified by where it is made and what it calls. Undoing is
not a step: calls made inside ``finally:`` and ``except:`` blocks, inside the functions named as
cleanup, and to ``__exit__`` are left alone (no Python code can undo anything if the undoing
itself is interrupted at every point).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable


class Injected(KeyboardInterrupt):
    """The interrupt raised at a step (a KeyboardInterrupt, as Ctrl-C would raise)."""


def _undo_lines(path: str) -> set[int]:
    tree = ast.parse(open(path).read())
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            for block in [node.finalbody, *[h.body for h in node.handlers]]:
                for statement in block:
                    lines.update(range(statement.lineno, statement.end_lineno + 1))
    return lines


class Steps:
    def __init__(self, modules, cleanup: tuple[str, ...] = ()):
        self.files = {m.__file__: _undo_lines(m.__file__) for m in modules}
        self.cleanup = set(cleanup)

    def _site(self, caller, callee: str):
        if caller is None or caller.f_code.co_filename not in self.files or callee == "__exit__":
            return None
        frame = caller
        while frame is not None:
            undo = self.files.get(frame.f_code.co_filename)
            if undo is not None and (frame.f_code.co_name in self.cleanup or frame.f_lineno in undo):
                return None
            frame = frame.f_back
        return (caller.f_code.co_filename.rsplit("/", 1)[-1], caller.f_code.co_name, caller.f_lineno, callee)

    def _run(self, operation: Callable[[], object], at=None):
        seen: list = []
        fired = []

        def profile(frame, event, arg):
            if event == "call":
                site = self._site(frame.f_back, frame.f_code.co_name)
            elif event == "c_call":
                site = self._site(frame, getattr(arg, "__name__", "?"))
            else:
                return
            if site is None or site in seen:
                return
            seen.append(site)
            if site == at and not fired:
                fired.append(site)
                sys.setprofile(None)
                raise Injected(f"at {site}")

        sys.setprofile(profile)
        try:
            operation()
        except Injected:
            if not fired:
                raise
        finally:
            sys.setprofile(None)
        return seen, bool(fired)

    def sites(self, operation: Callable[[], object]) -> list:
        """Every step the operation takes, in order, each once."""
        return self._run(operation)[0]

    def interrupt(self, operation: Callable[[], object], site) -> bool:
        """Run the operation with a KeyboardInterrupt at `site`; whether it was reached."""
        return self._run(operation, site)[1]
