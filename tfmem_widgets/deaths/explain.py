"""What a dead process left, read into a `Death`: its signal, TensorFlow's last words on file
descriptor 2, Python's stack of every thread (``faulthandler`` writes it from the signal handler),
and what it means with the fix.

The causes known: a TensorFlow GPU kernel that meets a tensor of 2^31 elements or more (it counts
elements in a 32-bit int: ``Check failed: work_element_count >= 0``), an XLA program's OOM in lab mode
(TensorFlow aborts while it frees the program's buffers: ``bfc_allocator.cc ... kInvalidChunkHandle``),
a segmentation fault (in lab mode: an OOM inside a CPU kernel), the system's OOM killer (SIGKILL,
with the kernel's memory accounting as evidence), a CUDA error, any other CHECK of TensorFlow's.
"""

from __future__ import annotations

import re
import signal as signals
from dataclasses import dataclass, field

from ..plans.aborts import ELEMENT_LIMIT
from ..units import format_bytes

# faulthandler's first line for each signal it handles
_FAULT_HEADERS = {"Aborted": signals.SIGABRT, "Segmentation fault": signals.SIGSEGV,
                  "Floating-point exception": signals.SIGFPE, "Bus error": signals.SIGBUS,
                  "Illegal instruction": signals.SIGILL}
_FAULT_LINE = re.compile(r"Fatal Python error: (" + "|".join(map(re.escape, _FAULT_HEADERS)) + ")")
# absl's fatal line: F<MMDD or 0000> <time> <thread> <file>:<line>] <message>
_NATIVE_FATAL = re.compile(r"^F\d{4} [\d:.]+\s+\d+ (\S+:\d+)\] (.*)$")
_NATIVE_INFO = re.compile(r"^I\d{4} [\d:.]+\s+\d+ ")  # absl's information lines: not last words
_NATIVE_LOGGED = re.compile(r"^[EW]\d{4} [\d:.]+\s+\d+ ")
_ABSL_PREAMBLE = "WARNING: All log messages before absl::InitializeLog()"
# start-up lines of a process without a GPU (or without CUDA): not an error of the death
_NO_GPU_WORDS = ("failed call to cuInit", "Could not find cuda drivers", "Unable to register cu")
_XLA_OOM_RAISED = re.compile(r"xla_ops\.cc:\d+ : RESOURCE_EXHAUSTED")  # an XLA program's OOM returned as an error
_DATA_OP = re.compile(r"requested by op (\S*(?:Iterator|Dataset)\S*)")  # tf.data's kernels, in the refusal's line
_WORK_COUNT = re.compile(r"work_element_count >= 0 \((-?\d+) vs\. 0\)")
_INT32_FILES = ("gpu_launch_config.h", "conv_2d_gpu.h", "reduction_gpu_kernels.cu.h")
_CUDA_WORDS = ("CUDA_ERROR", "CUDA error", "cudaError", "CUDNN_STATUS", "CUBLAS_STATUS", "illegal memory access")


def signal_name(number: int | None) -> str | None:
    if number is None:
        return None
    try:
        return f"{signals.Signals(number).name} (signal {number})"
    except ValueError:
        return f"signal {number}"


def fault_signal(stacks: str) -> int | None:
    """The signal faulthandler's text names ("Fatal Python error: Aborted"), or None."""
    found = _FAULT_LINE.search(stacks or "")
    return None if found is None else int(_FAULT_HEADERS[found.group(1)])


def python_stacks(text: str) -> str:
    """faulthandler's part of a text: from its "Fatal Python error" line to the end of its frames."""
    found = _FAULT_LINE.search(text or "")
    if found is None:
        return ""
    lines = text[found.start():].splitlines()
    kept = [lines[0]]
    for line in lines[1:]:
        if line and not line.startswith(("  ", "Thread ", "Current thread ", "Stack (most recent", "Extension modules")):
            break
        kept.append(line)
    return "\n".join(kept).strip()


def native_last_words(text: str) -> str:
    """TensorFlow's last words in a process's fd 2: its last fatal line (absl's F-line, a "Check failed",
    a CUDA error), else its last line that says something, leaving out faulthandler's part."""
    lines = [line.strip() for line in (text or "").splitlines()]
    fault = next((i for i, line in enumerate(lines) if _FAULT_LINE.search(line)), len(lines))
    lines = [line for line in lines[:fault] if line and not line.startswith(("@ ", "*** Check failure"))
             and not any(words in line for words in _NO_GPU_WORDS)]
    for line in reversed(lines):
        if _NATIVE_FATAL.match(line) or "Check failed" in line or any(word in line for word in _CUDA_WORDS):
            return line[:400]
    said = [line for line in lines if not _NATIVE_INFO.match(line) and not line.startswith(_ABSL_PREAMBLE)]
    logged = [line for line in said if _NATIVE_LOGGED.match(line)]  # absl's errors and warnings come first
    refused = [line for line in logged if "ran out of memory trying to allocate" in line]  # the allocator's refusal
    return (refused or logged or said or [""])[-1][:400]


@dataclass(frozen=True)
class Death:
    """A process that died, told: what ended it, its last words, and what it means."""

    signal: str | None  # "SIGABRT (signal 6)"; None where not known (a SIGKILL leaves no word)
    last_words: str  # TensorFlow's on fd 2 (a "Check failed" line), or the process's last line
    cause: str  # "2^31", "xla-oom-lab", "segfault", "oom-killer", "cuda", "check", "abort", "killed"
    meaning: str  # what it means, with the fix
    stacks: str = ""  # Python's stack of every thread at the signal (faulthandler), "" where none
    pid: int | None = None
    cell: int | None = None  # the cell that was running (its execution count)
    cell_source: str = ""
    elements: int | None = None  # a 2^31 abort: the tensor's element count, where its words say it
    batch: int | None = None  # the fit's batch where one was running
    batch_under: int | None = None  # the largest batch that keeps the tensor under 2^31 (from the two above)
    notes: tuple[str, ...] = field(default=())

    @property
    def aborted_on_elements(self) -> bool:
        return self.cause == "2^31"

    def lines(self, stacks: bool = True) -> list[str]:
        head = "the process" + (f" {self.pid}" if self.pid else "") + " died: " + \
            (f"killed by {self.signal}" if self.signal else "ended with no word (SIGKILL, or os._exit)")
        out = [head]
        if self.cell is not None:
            first = [line for line in self.cell_source.splitlines() if line.strip()][:3]
            out.append(f"  in cell [{self.cell}]" + (":" if first else ""))
            out.extend(f"      {line[:100]}" for line in first)
        if self.last_words:
            out.append(f"  its last words on fd 2: {self.last_words}")
        out.append(f"  what it means: {self.meaning}")
        out.extend(f"  note: {note}" for note in self.notes)
        if stacks and self.stacks:
            out.append("  Python's stacks at the signal (faulthandler):")
            out.extend(f"    {line}" for line in self.stacks.splitlines()[:60])
        return out

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))


def explain_death(returncode_signal: int | None, fd2_text: str, stacks: str = "", *, pid: int | None = None,
                  cell: int | None = None, cell_source: str = "", batch: int | None = None,
                  lab_mb: int | None = None, oom_killed: bool = False, host: str = "",
                  oom_cell: int | None = None, after_oom: bool = False) -> Death:
    """A Death from what the process left: the signal (its return code's, else faulthandler's), its fd 2
    (TensorFlow's words), faulthandler's stacks; `batch` the fit's batch where one was running, `lab_mb`
    its lab mode's limit where it had one, `oom_killed` where the kernel's memory accounting counted an
    OOM kill since it started, `host` what it held on the host when last seen, `oom_cell` the cell that
    raised an OOM before (in lab mode an XLA program's OOM leaves the allocator broken), `after_oom` where
    the process met one and no cell is known (a fresh process); TensorFlow's own line for an XLA program's OOM
    on fd 2 counts as one too."""
    stacks = stacks or python_stacks(fd2_text)
    number = returncode_signal if returncode_signal is not None else fault_signal(stacks)
    words = native_last_words(fd2_text)
    elements = _wrapped_count(words)
    under = None
    if elements is not None and batch:
        per = elements / batch
        under = max(0, -(-ELEMENT_LIMIT // int(per)) - 1) if per == int(per) else int((ELEMENT_LIMIT - 1) / per)
    cause, meaning = _meaning(number, words, lab_mb, oom_killed, host, elements, batch, under)
    after_oom = after_oom or bool(_XLA_OOM_RAISED.search(fd2_text or ""))  # (one the cell caught, too)
    if lab_mb and (oom_cell is not None or after_oom) and cause in ("segfault", "abort", "xla-oom-lab", "check"):
        which = f" (cell [{oom_cell}]'s)" if oom_cell is not None else ""
        cause, meaning = "xla-oom-lab", (
            f"it died after an OOM in lab mode{which}: an XLA program's OOM in lab mode leaves "
            "TensorFlow's CPU allocator broken, and the process aborts or faults when it next frees or runs a step "
            "(on a GPU too: the OOM raises first, then the process aborts as it frees the program's buffers). "
            "Restart, then lower the batch, raise the lab limit, or run such steps in a fresh process "
            "(%%tfmem fresh, tfmem_widgets.max_batch_size), where a death costs nothing")
    return Death(signal_name(number), words, cause, meaning, stacks, pid, cell, cell_source, elements, batch, under)


def _wrapped_count(words: str) -> int | None:
    """The element count a 32-bit int wrapped in "work_element_count >= 0 (-2147483648 vs. 0)"."""
    found = _WORK_COUNT.search(words)
    if found is None:
        return None
    value = int(found.group(1))
    return value + (1 << 32) if value < 0 else None


def _meaning(number, words, lab_mb, oom_killed, host, elements, batch, under) -> tuple[str, str]:
    if "work_element_count" in words or any(name in words for name in _INT32_FILES):
        size = f"{elements:,} elements" if elements else "2^31 elements or more"
        at = f" at batch {batch:,}" if batch else ""
        fix = (f"A batch of at most {under:,} keeps it under 2^31" if under is not None else
               "tfmem_widgets.plan(model, sample, batch) names the tensor and the largest batch under it")
        return "2^31", (f"a TensorFlow GPU kernel met a tensor{at} of {size}: it counts elements in a 32-bit int and "
                        f"its check ended the process (not an out-of-memory: the card may have room). {fix}; or "
                        "compile with jit_compile=True (XLA indexes with 64 bits where a tensor needs it)")
    if "bfc_allocator" in words and "kInvalidChunkHandle" in words:
        return "xla-oom-lab", ("an XLA program ran out of memory in lab mode and TensorFlow aborted while it freed the "
                               "program's buffers (on a GPU too: ResourceExhaustedError first, then the same abort): "
                               "lower the batch or raise the lab limit, and run such steps in a fresh process (%%tfmem fresh, "
                               "tfmem_widgets.max_batch_size), where a death costs nothing")
    if any(word in words for word in _CUDA_WORDS):
        return "cuda", ("a CUDA error ended it (its words above): after an illegal address or a failed launch the "
                        "GPU's context cannot be used again, so the process ends; the next one starts clean. Look for "
                        "an index out of range in the step, or a driver and CUDA library that do not match")
    if "Check failed" in words or _NATIVE_FATAL.match(words):
        return "check", ("a check in TensorFlow's C++ failed and ended the process (a CHECK aborts; Python cannot "
                         "catch it): its words above say which")
    if number == signals.SIGSEGV:
        data_op = _DATA_OP.search(words)
        if lab_mb and data_op:
            return "segfault", (f"a segmentation fault in lab mode ({lab_mb:,} MB) after tf.data's own kernel "
                                f"{data_op.group(1)} was refused memory: an out-of-memory inside tf.data (its iterator "
                                "taking in from_tensor_slices' arrays, a batch) ends the process instead of raising; "
                                "keep the pipeline's tensors well under the lab limit (build the dataset from files, "
                                "or smaller batches), or run the fit in a fresh process (%%tfmem fresh)")
        if lab_mb:
            return "segfault", (f"a segmentation fault in lab mode ({lab_mb:,} MB): an out-of-memory inside a CPU "
                                "kernel (oneDNN's, or tf.data's) ends the process this way instead of raising; lower "
                                "the batch or raise the lab limit, or find the batch that fits in fresh processes "
                                "(tfmem_widgets.max_batch_size)")
        return "segfault", ("a segmentation fault in native code (TensorFlow's or a library's): Python's stacks say "
                            "where Python was when it happened")
    if number == signals.SIGKILL or number is None:
        held = f" ({host})" if host else ""
        if oom_killed:
            return "oom-killer", (f"the system's OOM killer ended it: the host's memory ran out, not the GPU's{held}. "
                                  "Hold less on the host: the arrays given to fit (feed a tf.data pipeline from "
                                  "files), a dataset's cache() or shuffle buffer, copies of the data")
        return "killed", ("it was killed with no word (SIGKILL: the system's OOM killer when the host's memory runs "
                          f"out, or a forced restart) or it left Python without its exit (os._exit){held}")
    if number == signals.SIGABRT:
        return "abort", "a native library called abort(): the last words above, where there are any, say why"
    return "signal", f"it was ended by {signal_name(number)}"


def held_on_host(rss: int | None, available: int | None) -> str:
    """What a process held on the host and what was left, for a Death's text."""
    parts = []
    if rss:
        parts.append(f"it held {format_bytes(rss)} on the host")
    if available is not None:
        parts.append(f"{format_bytes(available)} was available")
    return ", ".join(parts)
