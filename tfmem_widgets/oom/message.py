"""A failed allocation: what TensorFlow's OOM message says, and the request as the BFC
allocator rounds it (256-byte steps)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

MIN_ALLOCATION = 256  # the BFC allocator's smallest chunk and its rounding step


def rounded(n: int) -> int:
    """Bytes as the BFC allocator hands them out: whole 256-byte steps, at least one."""
    return max(MIN_ALLOCATION, -(-n // MIN_ALLOCATION) * MIN_ALLOCATION)


_DTYPE_BYTES = {
    "float": 4, "double": 8, "half": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "complex64": 8, "complex128": 16,
}
_OOM = re.compile(r"OOM when allocating tensor with shape\[([\d,\s]*)\] and type (\w+).*? by allocator (\S+)")


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
    found = _OOM.search(text)
    if not found:
        return None
    message = text[found.start():].splitlines()[0]
    dims = [int(d) for d in found.group(1).replace(" ", "").split(",") if d]
    count = int(np.prod(dims)) if dims else 1
    request = None
    logged = re.search(r"\(rounded to (\d+)\)", dump_text)
    if logged:
        request = int(logged.group(1))
    elif found.group(2) in _DTYPE_BYTES:
        request = rounded(count * _DTYPE_BYTES[found.group(2)])
    return OomInfo(found.group(3).rstrip(".,"), message, request)
