"""TensorFlow's words: a failed allocation's OOM line (or XLA's), the request as the BFC allocator
rounds it (256-byte steps), the compiled step and node an error names, a tf.function's graph name."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .allocator import OOM_LINE, ROUNDED_REQUEST, UNIT_BYTES, XLA_OOM_LINE, rounded

FUNCTION = re.compile(r"__inference_(.+?)_\d+$")  # a tf.function's graph: __inference_<name>_<n>
_STEP = re.compile(r"\[Op:__inference_(\w+?)_\d+\]")
_NODE = re.compile(r"\[\[\{\{node ([^}]+)\}\}\]\]")
_DTYPE_BYTES = {
    "float": 4, "double": 8, "half": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "complex64": 8, "complex128": 16,
}


@dataclass(frozen=True)
class OomInfo:
    """A failed allocation inside the traced block."""

    allocator: str
    message: str  # TensorFlow's first line
    request_bytes: int | None  # the failed request, rounded as the allocator rounds it


def oom_info(exc: BaseException, dump_text: str) -> OomInfo | None:
    """The failed allocation TensorFlow's error names, with its request in bytes (from the
    allocator's log where it said, else from the shape and type); None for another error."""
    return oom_info_of_text(str(exc), dump_text)


def oom_info_of_text(text: str, dump_text: str = "") -> OomInfo | None:
    """oom_info for an error's text (or a log holding TensorFlow's OOM line)."""
    found = OOM_LINE.search(text)
    if not found:
        return None
    message = text[found.start():].splitlines()[0]
    dims = [int(d) for d in found.group(1).replace(" ", "").split(",") if d]
    count = int(np.prod(dims)) if dims else 1
    request = None
    logged = ROUNDED_REQUEST.search(dump_text)
    if logged:
        request = int(logged.group(1))
    elif found.group(2) in _DTYPE_BYTES:
        request = rounded(count * _DTYPE_BYTES[found.group(2)])
    return OomInfo(found.group(3).rstrip(".,"), message, request)


def step_of(text: str) -> tuple[str | None, str | None]:
    """(compiled function, node) an error's text names: '[Op:__inference_NAME_N]', '[[{{node X}}]]'."""
    step, node = _STEP.search(text), _NODE.search(text)
    return (step.group(1) if step else None), (node.group(1) if node else None)


def failed_request(text: str) -> tuple[str | None, int | None, str, bool]:
    """(allocator, request bytes, TensorFlow's line, from XLA) from an error's text or a log."""
    info = oom_info_of_text(text, text)
    if info is not None:
        return info.allocator, info.request_bytes, info.message, False
    found = XLA_OOM_LINE.search(text)
    if found:
        line = text[found.start():].splitlines()[0]
        return None, rounded(int(float(found.group(1)) * UNIT_BYTES[found.group(2)])), line, True
    return None, None, (text.strip().splitlines() or [""])[0][:300], False


def is_oom(exc: BaseException | None) -> bool:
    """A ResourceExhaustedError (checked by name: TensorFlow need not be imported), or an
    error whose text is an allocator's OOM."""
    if exc is None:
        return False
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "ResourceExhaustedError" in names:
        return True
    text = str(exc)
    return oom_info_of_text(text) is not None or bool(XLA_OOM_LINE.search(text))
