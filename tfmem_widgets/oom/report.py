"""An OOM explained: the failed request against the allocator's state at that moment, a
verdict with the numbers behind it, and the fixes that apply.

The state is TensorFlow's own binary MemoryDump (exact), or the text dump of a pasted log.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from html import escape

from ..errors import TraceDataError
from ..plans.need import StepNeed
from ..readings.layers import ACTIVATIONS, FORWARD, NO_OP_KNOWN, UNATTRIBUTED
from ..text import THIS_MACHINE, LinesText, marked
from ..tf.dump_place import removed_with_its_call
from ..tf.limits import CAPPED_SOURCES
from ..tracing.allocator_map import AllocatorMap
from ..units import MiB, format_bytes
from ..views.pool import occupancy, report_svg

FRAGMENTATION = "fragmentation"
SHORTAGE = "shortage"
LIMIT = "limit"
UNEXPLAINED = "not explained by the dump"

XLA_AFTER_OOM = ("after an XLA program's OOM TensorFlow's allocator is left inconsistent: measured with TensorFlow "
                 "2.21 on H100 and H200 GPUs and in lab mode, the process aborts later, when tensors are freed "
                 "(bfc_allocator.cc 'Check failed'), so this kernel will die; keep what you need now, restart, "
                 "and run fits near the limit with %%tfmem fresh")
# A compiled step's OOM on a CPU (lab mode): its kernels' temporaries come from the same allocator
# (which kernel runs depends on the processor), and its ops run on several threads in an order that
# differs between runs.
# Each figure those shape (the holes, the pool, the bytes no op or layer names) is marked "(this CPU)", as are
# the figures of XLA's plans of the step, made for this processor; the request and the variables' are not.
CPU_STEP_NOTE = ("a compiled step on a CPU: the temporary buffers its kernels ask of the allocator (which kernel "
                 "runs depends on this processor) and "
                 "the order its threads ran ops in shape the holes, the pool and the activations' bytes, so "
                 "these differ between runs and CPUs, as the figures of the step's plans (XLA's, for this CPU) do; "
                 "each such figure is marked (this CPU): the request and the variables' bytes are not")


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
    need: StepNeed | None = None  # what the step needs and the batch that fits, where the fit was seen

    # -- figures -----------------------------------------------------------------------
    # Figures of the allocator's state at the failure (None without a dump).
    in_use_bytes = _of_map("in_use_bytes")
    pool_bytes = _of_map("pool_bytes")
    largest_free_bytes = _of_map("largest_free_bytes")
    free_in_pool_bytes = _of_map("free_bytes")
    fragmentation = _of_map("fragmentation")

    @property
    def cpu_step(self) -> bool:
        """A compiled step's OOM on a CPU (lab mode): its holes, pool and activations vary (CPU_STEP_NOTE)."""
        return bool(self.step) and self.map is not None and "cpu" in self.allocator.lower()

    def _v(self, figure) -> str:
        """Bytes (or a figure in words) that vary in a compiled step's OOM on a CPU, marked there."""
        return marked(figure if isinstance(figure, str) else format_bytes(figure), self.cpu_step and figure is not None)

    def _capacity(self) -> str:
        """What the card or the host has; the host's memory marked: it is the machine's."""
        return marked(format_bytes(self.capacity_bytes), self.capacity_source == "host's memory", THIS_MACHINE)

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
        return (self.limit_source in CAPPED_SOURCES and self.capacity_bytes is not None
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

    def whole_chunk(self) -> tuple[object, int] | None:
        """The in-use chunk the allocator handed out whole for a smaller request (its no-split rule: a
        free chunk is split only when at least twice the request or 128 MiB larger), where that excess
        is at least a MiB, what this request lacks in all and the request itself (split, that excess
        would be one free chunk): (chunk, the bytes it was asked for, rounded). None: no such chunk."""
        if self.map is None or self.request_bytes is None:
            return None
        from ..tf.allocator import rounded

        best = max(((c, rounded(c.requested)) for c in self.map.chunks if c.in_use and c.requested),
                   key=lambda pair: pair[0].size - pair[1], default=None)
        if best is None:
            return None
        excess = best[0].size - best[1]
        short = self.map.in_use_bytes + self.request_bytes - (self.limit_bytes or self.map.pool_bytes)
        return best if excess >= max(MiB, short, rounded(self.request_bytes)) else None

    def _needs_line(self) -> str:
        v = self._v
        parts = [f"needs {format_bytes(self.request_bytes)}", f"largest hole {v(self.largest_free_bytes)}",
                 f"{v(self.free_in_pool_bytes)} free in {v(str(self.holes))} hole{'s' if self.holes != 1 else ''}"]
        if self.unclaimed_bytes:
            parts.append(f"{v(self.unclaimed_bytes)} under the limit not yet in the pool "
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
        lines, v = [self._needs_line()], self._v
        if verdict == FRAGMENTATION:
            lines.append(
                f"fragmentation: {v(self.free_under_limit_bytes if self.limit_bytes else self.free_in_pool_bytes)}"
                f" free in total, more than the request, but no single hole is big enough "
                f"(TensorFlow's fragmentation figure {v(f'{self.fragmentation:.2f}')})")
        else:
            short = self.map.in_use_bytes + self.request_bytes - (self.limit_bytes or self.map.pool_bytes)
            lines.append(
                f"{'shortage' if verdict == SHORTAGE else 'a limit'}: {v(self.map.in_use_bytes)} in use "
                f"of {format_bytes(self.limit_bytes)} ({self.limit_source}): only "
                f"{v(self.free_under_limit_bytes)} free in total, {v(short)} short")
            if verdict == LIMIT:
                lines.append(f"the {self.capacity_source} has {self._capacity()}: "
                             f"the limit, not the hardware, stops this request")
        whole = self.whole_chunk()
        if whole is not None:
            chunk, asked = whole
            owner = f" ({chunk.op.strip('()')})" if chunk.op else ""
            lines.append(f"a chunk handed out whole: {v(asked)} was asked for{owner} and the allocator gave "
                         f"the free chunk of {v(chunk.size)} it found, {v(chunk.size - asked)} more "
                         "(it splits a free chunk only when it is at least twice the request or 128 MiB larger); "
                         "without that this request would fit")
        return lines

    def fixes(self) -> list[str]:
        """What would make the request fit, each with its numbers."""
        verdict = self.verdict
        out = []
        if self.map is None or self.request_bytes is None:
            return out
        if self.need is not None and self.need.phase == "validation":
            return self._validation_fixes()
        need = self.need if self.need is not None and self.need.peak_bytes is not None else None
        v = self._v
        if verdict == FRAGMENTATION:
            total = self.map.in_use_bytes + self.request_bytes
            restart = ("(nothing of the pool comes back at del or gc: restart the kernel and run the setup again, "
                       "or run the cell with %%tfmem fresh)")
            if need is not None and need.fits_batch is not None and need.fits_batch >= need.batch_size:
                out.append(f"start from an empty pool: the step's planned peak at batch {need.batch_size:,}, "
                           f"{v(need.peak_bytes)}, is under the {format_bytes(self.limit_bytes)} limit "
                           f"{restart}")
            elif need is None:
                out.append(f"if earlier work left these holes (an earlier fit or cell, tensors since freed), start "
                           f"from an empty pool: in a new process {v(self.map.in_use_bytes)} in use "
                           f"+ {format_bytes(self.request_bytes)} = {v(total)} fits the "
                           f"{format_bytes(self.limit_bytes)} limit {restart}")
                if self.step:
                    out.append(f"if this step made the holes itself, a new process makes them again: a smaller batch "
                               f"shrinks the request ({format_bytes(self.request_bytes)}) toward the largest hole "
                               f"({v(self.largest_free_bytes)}); gradient accumulation keeps the effective "
                               "batch (workbook notebook 4)")
            out.append("make the large, long-lived tensors first (model and optimizer before the data, buffers "
                       "reused instead of re-created): small chunks kept between them are what splits the pool")
            if self.allocator.startswith("GPU"):
                out.append("TF_GPU_ALLOCATOR=cuda_malloc_async (before TensorFlow starts) lets CUDA's pool place "
                           "tensors instead of the BFC allocator")
        whole = self.whole_chunk()
        if verdict == LIMIT:
            if need is not None and need.least_limit_bytes is not None and need.least_limit_bytes > need.peak_bytes:
                out.append(f"raise the limit to at least {v(f'{_mib_up(need.least_limit_bytes)} MiB')} (the step at "
                           f"batch {need.batch_size:,} with the fit's data, each buffer placed as the allocator places "
                           f"it; its peak alone is {v(need.peak_bytes)}; the {self.capacity_source} has "
                           f"{self._capacity()}): restart, then %tfmem setup with the new limit")
            elif need is not None:
                out.append(f"raise the limit to at least {v(f'{_mib_up(need.peak_bytes)} MiB')} (the step's peak at "
                           f"batch {need.batch_size:,}; the {self.capacity_source} has {self._capacity()}): "
                           "restart, then %tfmem setup with the new limit")
            elif whole is not None and len(self.map.regions) == 1:
                chunk, asked = whole
                least = self.limit_bytes + _split_room(chunk.size, asked, self.request_bytes)
                out.append(f"raise the limit to at least {v(f'{_mib_up(least)} MiB')}: then the allocator splits the "
                           f"rest of its one region for the {v(asked)} buffer and this request finds room (in "
                           f"use + this request is not enough: the {v(chunk.size)} chunk would be handed "
                           f"out whole again; the {self.capacity_source} has {self._capacity()}): "
                           "restart, then %tfmem setup with the new limit")
            elif self.xla:
                out.append(f"raise the limit to at least {v(f'{_mib_up(self.map.in_use_bytes + self.request_bytes)} MiB')}"
                           f" (in use + the XLA program's temporaries; the {self.capacity_source} has "
                           f"{self._capacity()}): restart, then %tfmem setup with the new limit")
            else:
                out.append(f"raise the limit {'above' if self.step else 'to at least'} "
                           f"{v(f'{_mib_up(self.map.in_use_bytes + self.request_bytes)} MiB')} (in use + this request; "
                           f"the {self.capacity_source} has {self._capacity()}"
                           + ("; the rest of the step needs more: plan it" if self.step else "")
                           + "): restart, then %tfmem setup with the new limit")
        if verdict in (SHORTAGE, LIMIT):
            out += self._smaller_step_fixes(need, verdict)
        elif verdict == FRAGMENTATION and need is not None and (need.fits_batch or 0) < need.batch_size:
            out = self._smaller_step_fixes(need, verdict) + out  # the step itself does not fit: first
        return out

    def _validation_fixes(self) -> list[str]:
        """An OOM in the fit's validation: its batch and data are the validation's, and a fresh pool would meet
        the same step."""
        batch = self.need.batch_size
        return [f"a smaller validation batch: validation_batch_size (it defaults to the fit's batch_size; here "
                f"{batch:,}) sizes the validation step, which runs the model forward on that many rows at once",
                "validation_data as a tf.data pipeline built on the host (with tf.device('CPU:0')), batched: Keras "
                "then holds one validation batch on the device, not the whole arrays",
                "an empty pool does not help: a fresh process meets the same validation step"]

    def _smaller_step_fixes(self, need: StepNeed | None, verdict: str) -> list[str]:
        """A smaller step: in terms of the step where its need is known; where it is not, the request
        said to be one tensor of the step, never 'use N less' as if it were the step's need."""
        top = None
        if self.anatomy is not None and len(self.anatomy):  # what mixed precision would halve: activations
            sizes = [(self.anatomy.phases(k).get(FORWARD, 0), k) for k in self.anatomy.layers]
            if ACTIVATIONS in self.anatomy:
                sizes.append((self.anatomy[ACTIVATIONS], ACTIVATIONS))
            size, key = max(sizes, default=(0, ""))
            top = f"largest activations: {key} {self._v(size)}" if size else None
        precision = None if _mixed_policy() else (
            "mixed precision (keras.mixed_precision.set_global_policy('mixed_float16')) halves the activations")
        out = []
        if need is not None and need.fits_batch is None and need.fails_batch is not None:
            out.append(f"no batch fits this limit by the plans (down to batch {self._v(f'{need.fails_batch:,}')}): the model's "
                       f"variables ({format_bytes(need.resident_bytes)}) and the fit's data leave no room for the step; "
                       "raise the limit, or hold less: the data in a tf.data pipeline instead of arrays, an optimizer "
                       "with fewer slots (SGD keeps none, Adam two per weight)")
        elif need is not None and need.fits_batch is not None:
            edge = ("%%tfmem batch probes the edge: over replicas the probes decide" if need.source == "replica plan"
                    else "%%tfmem batch --plan finds the edge, confirmed by a probe")
            out.append(f"a smaller batch: at most {self._v(f'{need.fits_batch:,}')}, where the planned step reaches the "
                       f"{format_bytes(need.limit_bytes)} limit ({edge}); gradient accumulation keeps the effective "
                       f"batch of {need.batch_size:,} (workbook notebook 4)")
        elif self.xla and (whole := self.whole_chunk()) is not None:
            out.append(f"a smaller batch shrinks the XLA program's buffer ({self._v(whole[1])}) until the allocator "
                       "splits the chunk it takes and the rest holds the program's next requests; "
                       "tfmem_widgets.plan(model, (x, y), batch_size) in a new process (or %%tfmem batch --plan) gives "
                       "the batch that fits, placing each buffer as the allocator does")
        elif self.xla:
            out.append(f"the request ({format_bytes(self.request_bytes)}) is the XLA program's temporaries, asked for "
                       f"as one buffer: the step needs at least in use + it, "
                       f"{self._v(self.map.in_use_bytes + self.request_bytes)}, at this batch; a smaller batch "
                       "shrinks it nearly in proportion; tfmem_widgets.plan(model, (x, y), batch_size) in a new process "
                       "(or %%tfmem batch --plan) gives the batch that fits")
        elif self.step or self.anatomy is not None and self.anatomy.layers:
            out.append(f"the request ({format_bytes(self.request_bytes)}) is one tensor of the step, not what the "
                       "step needs: tfmem_widgets.plan(model, (x, y), batch_size) (or %tfmem plan) tells its need, "
                       "max_batch_size(..., method='plan') (or %%tfmem batch --plan) the batch that fits; a "
                       "smaller batch shrinks the activations")
        else:
            short = self.map.in_use_bytes + self.request_bytes - (self.limit_bytes or self.map.pool_bytes)
            if verdict != FRAGMENTATION:
                out.append(f"free {self._v(short)} of what is in use, or ask for that much less: in use + this "
                           "request is that much over")
        if verdict != FRAGMENTATION and precision:
            out.append(precision + (f"; {top}" if top else ""))
            if need is None or need.fits_batch is None:
                out.append("gradient accumulation keeps the effective batch with a smaller step (workbook notebook 4)")
        return out

    def by_layer(self):
        """Bytes in use at the failure per Keras layer and phase (see anatomy.LayerAnatomy)."""
        if self.anatomy is not None:
            return self.anatomy
        from ..readings.layers import anatomy

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
            v = self._v
            lines.append(
                f"  request {format_bytes(self.request_bytes)} vs largest free chunk "
                f"{v(self.largest_free_bytes)}; in use {v(self.in_use_bytes)}, pool "
                f"{v(self.pool_bytes)}, limit {format_bytes(self.limit_bytes)} ({self.limit_source})"
                + ("" if self.fragmentation is None or self.fragmentation != self.fragmentation
                   else f"; fragmentation {v(f'{self.fragmentation:.4f}')}"))
        lines.append(f"  verdict: {self.verdict}")
        lines += [f"    {r}" for r in self.reasons()]
        if self.need is not None:
            lines += [f"  {n}" for n in self.need.lines(format_bytes(self.need.limit_bytes or self.limit_bytes),
                                                        varies=self.cpu_step)]
        picture = occupancy(self.map) if self.map is not None else ""
        if picture:
            lines.append(f"  pool [{picture}]  (* in use, _ free, | region)")
        fixes = self.fixes()
        if fixes:
            lines.append("  fixes:")
            lines += [f"    - {f}" for f in fixes]
        if self.anatomy is not None and len(self.anatomy):
            lines.append("  in use by layer:")
            lines += ["  " + line for line in self.anatomy.lines(top=8, varies=self._varying_keys())]
            lines += [f"    note: {n}" for n in self.anatomy.notes]
        if self.dump_path:
            gone = " (in the fresh process's folder, removed when it ends)" if removed_with_its_call(self.dump_path) else ""
            lines.append(f"  TensorFlow's dump: {self.dump_path}{gone}")
        lines += [f"  note: {n}" for n in self._all_notes()]
        return lines

    def _varying_keys(self) -> tuple[str, ...]:
        """The by-layer keys whose bytes hold the kernels' temporaries, in a compiled step's OOM on a CPU."""
        return (ACTIVATIONS, NO_OP_KNOWN, UNATTRIBUTED) if self.cpu_step else ()

    def _all_notes(self) -> tuple[str, ...]:
        notes = (*self.notes, XLA_AFTER_OOM) if self.xla else self.notes
        if self.cpu_step:
            notes = (*notes, CPU_STEP_NOTE)  # said last: what is above it varies
        return notes

    def _repr_html_(self) -> str:
        color = {FRAGMENTATION: "#b36b00", SHORTAGE: "#b00", LIMIT: "#6a1b9a"}.get(self.verdict, "#555")
        parts = [f"<div class='tfmem-oom'><b>OOM in {escape(self.allocator)}</b>"
                 f"{escape(self._where())}: <code>{escape(self.message)}</code>"]
        if self.map is not None:
            v = self._v
            rows = [("request", format_bytes(self.request_bytes)),
                    ("largest free chunk", v(self.largest_free_bytes)),
                    ("free in the pool", f"{v(self.free_in_pool_bytes)} in {v(str(self.holes))} holes"),
                    ("in use", v(self.in_use_bytes)),
                    ("pool", v(self.pool_bytes)),
                    ("limit", f"{format_bytes(self.limit_bytes)} ({escape(self.limit_source)})")]
            parts.append("<table>" + "".join(f"<tr><td>{k}</td><td style='text-align:right'>{v}</td></tr>"
                                             for k, v in rows) + "</table>")
            parts.append(report_svg(self.map, self.request_bytes, self.largest_free_bytes))
        parts.append(f"<p><b style='color:{color}'>verdict: {escape(self.verdict)}</b><br>"
                     + "<br>".join(escape(r) for r in self.reasons()) + "</p>")
        if self.need is not None:
            parts.append("<p>" + "<br>".join(escape(n) for n in self.need.lines(
                format_bytes(self.need.limit_bytes or self.limit_bytes), varies=self.cpu_step)) + "</p>")
        fixes = self.fixes()
        if fixes:
            parts.append("<b>fixes</b><ul>" + "".join(f"<li>{escape(f)}</li>" for f in fixes) + "</ul>")
        if self.anatomy is not None and len(self.anatomy):
            parts.append("<b>in use by layer</b><pre>"
                         + escape("\n".join(self.anatomy.lines(top=8, varies=self._varying_keys()))) + "</pre>")
            parts += [f"<i>{escape(n)}</i><br>" for n in self.anatomy.notes]
        parts += [f"<i>note: {escape(n)}</i><br>" for n in self._all_notes()]
        return "".join(parts) + "</div>"


def _split_room(chunk_bytes: int, asked_bytes: int, request_bytes: int) -> int:
    """How much larger the chunk handed out whole must be for the allocator to split it and leave
    room for the next request: the rest at least 128 MiB (or the chunk twice the buffer), and at
    least the request."""
    from ..tf.allocator import MAX_WHOLE_CHUNK_EXCESS, rounded

    rest = max(rounded(request_bytes), 0)
    by_excess = asked_bytes + max(MAX_WHOLE_CHUNK_EXCESS, rest)
    by_double = max(2 * asked_bytes, asked_bytes + rest)
    return max(0, min(by_excess, by_double) - chunk_bytes)


def _mib_up(n: int) -> int:
    return -(-n // MiB)


def _mixed_policy() -> bool:
    """Keras' global dtype policy is a mixed one already (mixed_float16, mixed_bfloat16)."""
    keras = sys.modules.get("keras")
    try:
        return keras is not None and keras.mixed_precision.global_policy().name.startswith("mixed")
    except Exception:  # a Keras without it
        return False
