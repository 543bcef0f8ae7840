"""A log as OOMs: each OOM of a log with its own allocator state, read in bounded memory.

TensorFlow logs an OOM as one episode: the allocator's "ran out of memory trying to allocate ...
(rounded to N)" line, its text dump (bins, regions and chunks, totals), then the op's "OOM when
allocating tensor" line. A job's log may hold several; each is explained against its own dump.
A file is read line by line keeping only the lines an OOM is read from; a file that is not a
regular one (a device, a pipe, /proc) is read up to a bound.
"""

from __future__ import annotations

import os
import re
import stat

from ..errors import ArgumentError, TraceDataError

# Where an episode begins: the allocator's refusal before its dump (its non-fatal warnings name no
# rounded size), or XLA's own words where a log has no refusal lines.
_REFUSAL = re.compile(r"ran out of memory trying to allocate [^\n]*?\(rounded to \d+\)")
_XLA = re.compile(r"Out of memory while trying to allocate")
# The lines an OOM is read from (the allocator's text dump, its totals, the OOM lines, the step and node).
_KEPT = re.compile(r"ran out of memory|Out of memory while|BFCAllocator dump for|Allocator \(|Bin \(|Chunks of size|"
                   r"InUse\s+at|Free\s+at|Next region of size|Sum Total|Total (?:size|bytes) in pool|Limit:|"
                   r"memory_limit_|OOM when allocating|\{\{node|\[Op:__inference|Stats:")
SPECIAL_FILE_BYTES = 16 << 20  # read from a file that is not a regular one (it may never end)
STREAM_ABOVE_BYTES = 8 << 20  # a larger log is read line by line, keeping only what an OOM is read from


def episodes(text: str) -> list[str]:
    """The OOM episodes of a log's text, in order (one, the whole text, when it marks fewer than two);
    what comes before the first belongs to it (the job's header, its limits)."""
    starts = [m.start() for m in _REFUSAL.finditer(text)]
    if len(starts) < 2:
        starts = [m.start() for m in _XLA.finditer(text)]
    if len(starts) < 2:
        return [text]
    starts[0] = 0
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]


def read_log(path: str | os.PathLike) -> str | bytes:
    """A file's contents for explain_oom: a large text log kept to the lines an OOM is read from, a
    file that is not a regular one read up to SPECIAL_FILE_BYTES, else the bytes as they are."""
    try:
        info = os.stat(path)
        regular = stat.S_ISREG(info.st_mode) and info.st_size > 0  # /proc's files state a size of 0
        with open(path, "rb") as handle:
            if not regular:
                data = handle.read(SPECIAL_FILE_BYTES + 1)
                if len(data) > SPECIAL_FILE_BYTES:
                    raise ArgumentError(f"explain_oom: {os.fspath(path)} is not a regular file and gives more than "
                                        f"{SPECIAL_FILE_BYTES >> 20} MiB; save the log to a file and pass that.")
                return data
            head = handle.read(4096)
            if info.st_size <= STREAM_ABOVE_BYTES or not _is_text(head):
                return head + handle.read()
            handle.seek(0)
            return "".join(line for line in _text_lines(handle) if _KEPT.search(line))
    except OSError as exc:
        raise TraceDataError(f"cannot read {os.fspath(path)}: {exc.strerror or exc}.") from None


def _is_text(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start > len(head) - 4  # a character cut at the end of the sample
    return b"\x00" not in head


def _text_lines(handle):
    for raw in handle:
        yield raw.decode("utf-8", errors="replace")
