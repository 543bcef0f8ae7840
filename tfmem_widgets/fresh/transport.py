"""What crosses between this process and a fresh one: the job (the code, its checked setup, the
names to bring back), the child's result (its values, or how it failed), and each value, pickled
with a refusal of what would come back wrong (a TensorFlow object, a class the cell defined)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

from ..errors import FreshRunError


def write_job(work_dir: Path, code: str, setup: dict | None, returns: list[str], start_when: str | None = None) -> None:
    """start_when: a file whose appearance starts the job (the child imports what it needs, then waits while
    this process, its parent, lives)."""
    # By pickle: the setup's values arrive as they were checked ({0: 4096} keeps its int key).
    (work_dir / "job.pickle").write_bytes(pickle.dumps({"code": code, "setup": setup, "returns": list(returns),
                                                        "start_when": start_when, "parent": os.getpid()}))


def read_job(work_dir: Path) -> dict:
    return pickle.loads((work_dir / "job.pickle").read_bytes())


def tell_batch(path: Path, batch: int) -> None:
    """A batch for another process (a warm probe's start, a closing plan's aim), written to `path` whole, at
    once: the reader, which waits for the file, never sees half a number."""
    written = path.with_name(path.name + ".part")
    written.write_text(str(batch))
    written.replace(path)


def write_result(work_dir: Path, **result) -> None:
    """The child's outcome: values=[names], error=<exception name>, or setup_error=<its line> with
    setup_error_class=<the refusal's class in tfmem_widgets.errors>."""
    (work_dir / "result.json").write_text(json.dumps(result))


def read_result(work_dir: Path) -> dict:
    path = work_dir / "result.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _refusal(obj) -> str | None:
    """Why `obj` must not be sent back, or None."""
    if isinstance(obj, type) or callable(obj) and hasattr(obj, "__module__") and hasattr(obj, "__qualname__"):
        module = getattr(obj, "__module__", None) or ""
        if module == "__main__":
            return f"{getattr(obj, '__qualname__', obj)!s} is defined in the cell, so this kernel cannot rebuild it"
        return None
    module = type(obj).__module__ or ""
    top = module.split(".")[0]
    if top in ("tensorflow", "keras", "tf_keras"):
        return (f"it holds a TensorFlow object ({type(obj).__name__}), which would start TensorFlow's runtime "
                "in this kernel; bring back .numpy() of it, or plain numbers")
    if module == "__main__":
        return (f"it holds a {type(obj).__name__}, a class the cell defined, which this kernel cannot rebuild; "
                "bring back its fields as plain values")
    return None


class CheckedPickler:
    """pickle, refusing what would come back wrong (see _refusal)."""

    @staticmethod
    def dumps(value) -> bytes:
        import io

        class Pickler(pickle.Pickler):
            def reducer_override(self, obj):
                why = _refusal(obj)
                if why is not None:
                    raise _Refused(why)
                return NotImplemented

        buffer = io.BytesIO()
        Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        return buffer.getvalue()


class _Refused(Exception):
    pass


def encode(name: str, value: Any, work_dir: Path) -> None:
    try:
        data = CheckedPickler.dumps(value)
    except _Refused as exc:
        raise TypeError(f"cannot bring back {name}: {exc}") from None
    except Exception as exc:
        raise TypeError(f"cannot bring back {name} ({type(value).__name__}): it cannot be sent between processes "
                        f"({type(exc).__name__}: {exc}); bring back numbers, text, containers, NumPy arrays, "
                        "a Trace or a Measurement") from None
    (work_dir / f"{name}.value").write_bytes(data)


def decode(name: str, work_dir: Path) -> Any:
    try:
        return pickle.loads((work_dir / f"{name}.value").read_bytes())
    except Exception as exc:
        raise FreshRunError(f"cannot bring back {name}: this kernel cannot rebuild it "
                            f"({type(exc).__name__}: {exc}).") from None
