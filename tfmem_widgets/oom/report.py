"""An OOM explained: the failed request against the allocator's state at that moment, a
verdict with the numbers behind it, and the fixes that apply.

The state is TensorFlow's own binary MemoryDump (exact), or the text dump of a pasted log.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from ..tracing.allocator_map import AllocatorMap
from ..errors import TraceDataError
from .message import oom_info_of_text, rounded
from ..text import LinesText
from ..units import MiB, format_bytes

FRAGMENTATION = "fragmentation"
SHORTAGE = "shortage"
LIMIT = "limit"
UNEXPLAINED = "not explained by the dump"

# XLA's own words: "Out of memory while trying to allocate 1.56GiB." (an H200) or "... 123 bytes"
_XLA_OOM = re.compile(r"Out of memory while trying to allocate ([\d.]+)\s*(bytes|B|KiB|MiB|GiB|TiB)\b")
_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
XLA_AFTER_OOM = ("after an XLA program's OOM TensorFlow's allocator is left inconsistent: measured with TensorFlow "
                 "2.21 on an H200 and in lab mode, the process aborts later, when tensors are freed "
                 "(bfc_allocator.cc 'Check failed'), so this kernel will die; keep what you need now, restart, "
                 "and run fits near the limit with %%tfmem fresh")
# A compiled step's OOM on a CPU (lab mode): its kernels' scratch buffers come from the same
# allocator, sized by the processor's caches, and its ops run on several threads in an order
# that differs between runs.
CPU_STEP_NOTE = ("a compiled step on a CPU: its kernels' scratch buffers (sized by this processor's caches) and "
                 "the order its threads ran ops in shape the holes, the pool and the activations' bytes, so "
                 "these differ between runs and CPUs; the request and the variables' bytes do not")
_STEP = re.compile(r"\[Op:__inference_(\w+?)_\d+\]")
_NODE = re.compile(r"\[\[\{\{node ([^}]+)\}\}\]\]")
_LIMIT_SOURCES_CAPPED = ("lab mode", "logical device limit", "memory fraction")


def _of_map(name: str) -> property:
    return property(lambda self: None if self.map is None else getattr(self.map, name))


@dataclass(repr=False)
class OomReport(LinesText):
    """What failed, what the allocator held, and why the request did not fit.

    map: the allocator's state at the failure (TensorFlow's dump, chunk for chunk).
    limit_bytes / limit_source: the allocator's limit and where it comes from.
    capacity_bytes / capacity_source: what the card (or the host, in lab mode) has: a limit
    below it that the request would fit under is the verdict 'limit'.
    """

    allocator: str
    message: str
    request_bytes: int | None
    map: AllocatorMap | None
    limit_bytes: int | None = None
    limit_source: str = "unknown"
    capacity_bytes: int | None = None
    capacity_source: str = ""
    dump_path: str | None = None
    xla: bool = False
    anatomy: object | None = None  # LayerAnatomy, taken at the failure (the variables then alive)
    notes: tuple[str, ...] = field(default=())
    step: str | None = None  # the compiled function the OOM came from ("multi_step_on_iterator": Keras' train step)
    node: str | None = None  # its op that asked ("sequential_1/wider_1/BiasAdd")

    # -- figures -----------------------------------------------------------------------
    # Figures of the allocator's state at the failure (None without a dump).
    in_use_bytes = _of_map("in_use_bytes")
    pool_bytes = _of_map("pool_bytes")
    largest_free_bytes = _of_map("largest_free_bytes")
    free_in_pool_bytes = _of_map("free_bytes")
    fragmentation = _of_map("fragmentation")

    @property
    def holes(self) -> int:
        return 0 if self.map is None else sum(1 for c in self.map.chunks if not c.in_use)

    @property
    def unclaimed_bytes(self) -> int | None:
        """Under the limit but never taken into the pool (room for a new region)."""
        if self.map is None or self.limit_bytes is None:
            return None
        return max(0, self.limit_bytes - self.map.pool_bytes)

    @property
    def free_under_limit_bytes(self) -> int | None:
        if self.map is None or self.limit_bytes is None:
            return None
        return max(0, self.limit_bytes - self.map.in_use_bytes)

    @property
    def capped(self) -> bool:
        """A limit set below what the card or host has, that the request would fit under."""
        return (self.limit_source in _LIMIT_SOURCES_CAPPED and self.capacity_bytes is not None
                and self.limit_bytes is not None and self.limit_bytes < self.capacity_bytes
                and self.request_bytes is not None and self.map is not None
                and self.map.in_use_bytes + self.request_bytes <= self.capacity_bytes)

    @property
    def verdict(self) -> str:
        """'fragmentation': enough free under the limit, but no hole (nor room for a region)
        big enough; 'limit': not enough under a limit set below what the card has; 'shortage':
        not enough free in total; or 'not explained by the dump'."""
        if self.map is None or self.request_bytes is None:
            return UNEXPLAINED
        if self.request_bytes <= self.map.largest_free_bytes:
            return UNEXPLAINED
        free_total = self.free_under_limit_bytes
        if free_total is None:
            free_total = self.map.free_bytes
        if self.request_bytes <= free_total:
            return FRAGMENTATION
        return LIMIT if self.capped else SHORTAGE

    def _needs_line(self) -> str:
        parts = [f"needs {format_bytes(self.request_bytes)}",
                 f"largest hole {format_bytes(self.largest_free_bytes)}",
                 f"{format_bytes(self.free_in_pool_bytes)} free in {self.holes} hole{'s' if self.holes != 1 else ''}"]
        if self.unclaimed_bytes:
            parts.append(f"{format_bytes(self.unclaimed_bytes)} under the limit not yet in the pool "
                         "(too little for the region it would need)")
        return "; ".join(parts)

    def reasons(self) -> list[str]:
        """The verdict's numbers, in words."""
        verdict = self.verdict
        if verdict == UNEXPLAINED:
            if self.map is None:
                return ["no allocator dump to read: TensorFlow writes one only when TF_BFC_MEMORY_DUMP is set "
                        "before the OOM (%load_ext tfmem_widgets or tfmem_widgets.watch_oom() sets it)"]
            if self.request_bytes is None:
                return ["the error does not say how many bytes were asked for"]
            return [f"the request ({format_bytes(self.request_bytes)}) fits the largest hole "
                    f"({format_bytes(self.largest_free_bytes)}) of this dump: it was written at another moment"]
        lines = [self._needs_line()]
        if verdict == FRAGMENTATION:
            lines.append(
                f"fragmentation: {format_bytes(self.free_under_limit_bytes if self.limit_bytes else self.free_in_pool_bytes)}"
                f" free in total, more than the request, but no single hole is big enough "
                f"(TensorFlow's fragmentation figure {self.fragmentation:.2f})")
        else:
            short = self.map.in_use_bytes + self.request_bytes - (self.limit_bytes or self.map.pool_bytes)
            lines.append(
                f"{'shortage' if verdict == SHORTAGE else 'a limit'}: {format_bytes(self.map.in_use_bytes)} in use "
                f"of {format_bytes(self.limit_bytes)} ({self.limit_source}): only "
                f"{format_bytes(self.free_under_limit_bytes)} free in total, {format_bytes(short)} short")
            if verdict == LIMIT:
                lines.append(f"the {self.capacity_source} has {format_bytes(self.capacity_bytes)}: "
                             f"the limit, not the hardware, stops this request")
        return lines

    def fixes(self) -> list[str]:
        """What would make the request fit, each with its numbers."""
        verdict = self.verdict
        out = []
        if self.map is None or self.request_bytes is None:
            return out
        need = self.map.in_use_bytes + self.request_bytes
        if verdict == FRAGMENTATION:
            out.append(f"if earlier work left these holes (an earlier fit or cell, tensors since freed), start from "
                       f"an empty pool: in a new process {format_bytes(self.map.in_use_bytes)} in use "
                       f"+ {format_bytes(self.request_bytes)} = {format_bytes(need)} fits the "
                       f"{format_bytes(self.limit_bytes)} limit (the pool is never given back: restart the kernel "
                       "and run the setup again, or run the cell with %%tfmem fresh)")
            if self.step:
                out.append(f"if this step made the holes itself, a new process makes them again: a smaller batch "
                           f"shrinks the request ({format_bytes(self.request_bytes)}) toward the largest hole "
                           f"({format_bytes(self.largest_free_bytes)}); gradient accumulation keeps the effective "
                           "batch (workbook notebook 4)")
            out.append("make the large, long-lived tensors first (model and optimizer before the data, buffers "
                       "reused instead of re-created): small chunks kept between them are what splits the pool")
            if self.allocator.startswith("GPU"):
                out.append("TF_GPU_ALLOCATOR=cuda_malloc_async (before TensorFlow starts) lets CUDA's pool place "
                           "tensors instead of the BFC allocator")
        if verdict == LIMIT:
            out.append(f"raise the limit to at least {_mib_up(need)} MiB (in use + request; the {self.capacity_source} "
                       f"has {format_bytes(self.capacity_bytes)}): restart, then %tfmem setup with the new limit")
        if verdict in (SHORTAGE, LIMIT):
            short = need - (self.limit_bytes or self.map.pool_bytes)
            top = None
            if self.anatomy is not None and len(self.anatomy):
                key = next(iter(self.anatomy))
                top = f"; largest in use: {key} {format_bytes(self.anatomy[key])}"
            out.append(f"use {format_bytes(short)} less at this step: a smaller batch (activations scale with it), "
                       f"or mixed precision (keras.mixed_precision.set_global_policy('mixed_float16') halves "
                       f"activations){top or ''}")
            out.append("gradient accumulation keeps the effective batch with a smaller step (workbook notebook 4)")
        return out

    def by_layer(self):
        """Bytes in use at the failure per Keras layer and phase (see anatomy.LayerAnatomy)."""
        if self.anatomy is not None:
            return self.anatomy
        from .layers import anatomy

        if self.map is None:
            raise TraceDataError("this OOM has no allocator dump: there is nothing to break down.")
        self.anatomy = anatomy(self.map, live=False)
        return self.anatomy

    # -- text and rich ------------------------------------------------------------------
    def _where(self) -> str:
        parts = ["an XLA program"] if self.xla else []
        if self.step:
            parts.append(f"compiled step {self.step}")
        if self.node and not self.xla:  # an XLA program's node is the call of the whole program
            parts.append(f"node {self.node}")
        return f" ({', '.join(parts)})" if parts else ""

    def lines(self) -> list[str]:
        lines = [f"OOM in {self.allocator}{self._where()}: {self.message}"]
        if self.map is not None:
            lines.append(
                f"  request {format_bytes(self.request_bytes)} vs largest free chunk "
                f"{format_bytes(self.largest_free_bytes)}; in use {format_bytes(self.in_use_bytes)}, pool "
                f"{format_bytes(self.pool_bytes)}, limit {format_bytes(self.limit_bytes)} ({self.limit_source})"
                + ("" if self.fragmentation is None or self.fragmentation != self.fragmentation
                   else f"; fragmentation {self.fragmentation:.4f}"))
        lines.append(f"  verdict: {self.verdict}")
        lines += [f"    {r}" for r in self.reasons()]
        picture = self.map.occupancy() if self.map is not None else ""
        if picture:
            lines.append(f"  pool [{picture}]  (* in use, _ free, | region)")
        fixes = self.fixes()
        if fixes:
            lines.append("  fixes:")
            lines += [f"    - {f}" for f in fixes]
        if self.anatomy is not None and len(self.anatomy):
            lines.append("  in use by layer:")
            lines += ["  " + line for line in self.anatomy.lines(top=8)]
            lines += [f"    note: {n}" for n in self.anatomy.notes]
        if self.dump_path:
            lines.append(f"  TensorFlow's dump: {self.dump_path}")
        lines += [f"  note: {n}" for n in self._all_notes()]
        return lines

    def _all_notes(self) -> tuple[str, ...]:
        notes = (*self.notes, XLA_AFTER_OOM) if self.xla else self.notes
        if self.step and self.map is not None and "cpu" in self.allocator.lower():
            notes = (*notes, CPU_STEP_NOTE)  # said last: what is above it varies
        return notes

    def _repr_html_(self) -> str:
        color = {FRAGMENTATION: "#b36b00", SHORTAGE: "#b00", LIMIT: "#6a1b9a"}.get(self.verdict, "#555")
        parts = [f"<div class='tfmem-oom'><b>OOM in {escape(self.allocator)}</b>"
                 f"{escape(self._where())}: <code>{escape(self.message)}</code>"]
        if self.map is not None:
            rows = [("request", format_bytes(self.request_bytes)),
                    ("largest free chunk", format_bytes(self.largest_free_bytes)),
                    ("free in the pool", f"{format_bytes(self.free_in_pool_bytes)} in {self.holes} holes"),
                    ("in use", format_bytes(self.in_use_bytes)),
                    ("pool", format_bytes(self.pool_bytes)),
                    ("limit", f"{format_bytes(self.limit_bytes)} ({escape(self.limit_source)})")]
            parts.append("<table>" + "".join(f"<tr><td>{k}</td><td style='text-align:right'>{v}</td></tr>"
                                             for k, v in rows) + "</table>")
            parts.append(_svg_map(self))
        parts.append(f"<p><b style='color:{color}'>verdict: {escape(self.verdict)}</b><br>"
                     + "<br>".join(escape(r) for r in self.reasons()) + "</p>")
        fixes = self.fixes()
        if fixes:
            parts.append("<b>fixes</b><ul>" + "".join(f"<li>{escape(f)}</li>" for f in fixes) + "</ul>")
        if self.anatomy is not None and len(self.anatomy):
            parts.append("<b>in use by layer</b><pre>" + escape("\n".join(self.anatomy.lines(top=8))) + "</pre>")
            parts += [f"<i>{escape(n)}</i><br>" for n in self.anatomy.notes]
        parts += [f"<i>note: {escape(n)}</i><br>" for n in self._all_notes()]
        return "".join(parts) + "</div>"


def _mib_up(n: int) -> int:
    return -(-n // MiB)


def _svg_map(report: OomReport, width: int = 640) -> str:
    """The pool region by region (blue in use, white free), and the request against the
    largest hole, on one scale."""
    amap = report.map
    regions = list(amap.regions)
    scale = width / max([r.size for r in regions] + [report.request_bytes or 0, 1])
    row = 16
    height = row * (len(regions) + 1) + 4
    shapes = []
    for k, region in enumerate(regions):
        y = k * row + 2
        shapes.append(f"<rect x='0' y='{y}' width='{region.size * scale:.1f}' height='{row - 4}' "
                      "fill='white' stroke='#1f77b4' stroke-width='0.6'/>")
        for c in amap.chunks:
            if c.in_use and region.address <= c.address < region.address + region.size:
                shapes.append(f"<rect x='{(c.address - region.address) * scale:.1f}' y='{y}' "
                              f"width='{max(c.size * scale, 0.5):.1f}' height='{row - 4}' fill='#1f77b4'/>")
    y = len(regions) * row + 2
    if report.request_bytes:
        shapes.append(f"<rect x='0' y='{y}' width='{report.request_bytes * scale:.1f}' height='{row - 4}' fill='#d62728'/>")
        shapes.append(f"<rect x='0' y='{y}' width='{(report.largest_free_bytes or 0) * scale:.1f}' height='{row - 4}' "
                      "fill='none' stroke='black' stroke-width='1.2'/>")
    return (f"<svg width='{width + 2}' height='{height}' xmlns='http://www.w3.org/2000/svg'>{''.join(shapes)}</svg>"
            "<br><small>one row per region (blue in use, white free); red: the request, black: the largest hole</small>")


# -- building a report ----------------------------------------------------------------------

def step_of(text: str) -> tuple[str | None, str | None]:
    """(compiled function, node) an error's text names: '[Op:__inference_NAME_N]', '[[{{node X}}]]'."""
    step, node = _STEP.search(text), _NODE.search(text)
    return (step.group(1) if step else None), (node.group(1) if node else None)


def failed_request(text: str) -> tuple[str | None, int | None, str, bool]:
    """(allocator, request bytes, TensorFlow's line, from XLA) from an error's text or a log."""
    info = oom_info_of_text(text, text)
    if info is not None:
        return info.allocator, info.request_bytes, info.message, False
    found = _XLA_OOM.search(text)
    if found:
        line = text[found.start():].splitlines()[0]
        return None, rounded(int(float(found.group(1)) * _UNITS[found.group(2)])), line, True
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
    return oom_info_of_text(text) is not None or bool(_XLA_OOM.search(text))


def limits_for(allocator: str) -> tuple[int | None, str, int | None, str]:
    """(limit, its source, capacity, what has it) for an allocator of this process."""
    from ..readings.allocator import device_limit
    from ..tf.runtime import LAB_ALLOCATOR_NAME, lab_limit_bytes, logical_devices, runtime_started

    if allocator == LAB_ALLOCATOR_NAME:
        limit = lab_limit_bytes()
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            total = None
        return limit, "lab mode", total, "host's memory"
    found = re.fullmatch(r"GPU_(\d+)_bfc", allocator)
    if not found:
        return None, "unknown", None, ""
    index = int(found.group(1))
    devices = [d for d in logical_devices() if d.device_type == "GPU"]
    if index >= len(devices):
        return None, "unknown", None, ""
    device = devices[index]
    limit = device_limit(device, runtime_started(), None)
    capacity, capacity_source = None, ""
    try:
        from ..readings.allocator import driver_view
        from ..tf.runtime import physical_gpus

        view = driver_view(physical_gpus())
        memory = view.by_gpu.get(device.physical_index)
        if memory is not None:
            capacity, capacity_source = memory.total_bytes, "card"
    except Exception:
        pass
    return limit.bytes, limit.source, capacity, capacity_source


def report_from_dump(dump: AllocatorMap, message: str, request: int | None, *, xla: bool = False,
                     dump_path: str | None = None, live: bool = False, namespace: dict | None = None,
                     notes=(), text: str = "") -> OomReport:
    """An OomReport for a dump. live: the dump is of this process's allocator, so its limit is
    read from this process and the Keras variables of the namespace name their chunks. text: the
    error's whole text (the compiled step and node it names)."""
    limit, source, capacity, capacity_source = (None, "unknown", None, "")
    if dump.limit_bytes is not None:
        limit, source = dump.limit_bytes, "the allocator's log"
    if live:
        found = limits_for(dump.allocator)
        if found[0] is not None or limit is None:
            limit, source = found[0], found[1]
        capacity, capacity_source = found[2], found[3]
    anatomy = None
    if live:
        from .layers import anatomy as make_anatomy
        from ..tracing.recorder import name_chunks

        dump, recorded = name_chunks(dump, _dump_time_ns(dump_path))
        if recorded:
            notes = (*notes, "ops from the recorder (%tfmem record): chunks made before it started carry none")

        try:
            anatomy = make_anatomy(dump, namespace=namespace, live=True)
        except Exception as exc:  # the namespace's objects are the user's: never fail the report
            notes = (*notes, f"the layers could not be read ({type(exc).__name__})")
    amap = dump
    if request is not None and dump.failed_request_bytes is None:
        from dataclasses import replace

        amap = replace(dump, failed_request_bytes=request)
    step, node = step_of(text)
    return OomReport(dump.allocator, message, request, amap, limit, source, capacity, capacity_source,
                     dump_path, xla, anatomy, tuple(notes), step, node)


def _dump_time_ns(path: str | None) -> int | None:
    """TensorFlow names a dump <prefix>_<allocator>.<microseconds since the epoch>."""
    suffix = (path or "").rsplit(".", 1)[-1]
    return int(suffix) * 1000 if suffix.isdigit() and len(suffix) >= 15 else None


def explain_text(text: str) -> OomReport:
    """A log pasted from a job: TensorFlow's text dump and its OOM line."""
    from ..tracing.dumps import parse_bfc_dump

    allocator, request, line, xla = failed_request(text)
    if "Next region of size" not in text:
        return OomReport(allocator or "unknown", line, request, None, xla=xla,
                         notes=("the text holds no allocator dump (the 'Next region of size' lines TensorFlow "
                                "logs at an OOM): paste the whole log",))
    dump = parse_bfc_dump(text)
    return report_from_dump(dump, line, request if request is not None else dump.failed_request_bytes, xla=xla,
                            text=text)


def explain_path(path: str | os.PathLike) -> OomReport:
    """A file: TensorFlow's binary MemoryDump, or a text log."""
    from ..tracing.dumps import load_memory_dump

    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise TraceDataError(f"cannot read {path}: {exc.strerror or exc}.") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and ("Next region of size" in text or "OOM when allocating" in text
                             or "Out of memory" in text):
        return explain_text(text)
    dump = load_memory_dump(p)
    return report_from_dump(dump, f"TensorFlow's dump of {dump.allocator}", dump.failed_request_bytes,
                            dump_path=str(p),
                            notes=("a dump alone does not say the failed request: pass the error or the log "
                                   "for the verdict",))
