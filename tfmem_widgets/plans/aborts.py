"""The limits other than memory that end a process: a graph step's tensors of 2^31 elements or more.

TensorFlow's own GPU kernels count a tensor's elements in a 32-bit int (``gpu_launch_config.h``'s check,
tensorflow/tensorflow issue 99894): a step whose ops run as those kernels (``jit_compile=False``) and
makes a tensor of 2^31 elements or more aborts the process (SIGABRT), where an XLA program indexes with
64 bits. The step's graph, traced from specs, gives every tensor's shape: nothing is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ELEMENT_LIMIT = 2**31  # the first element count a 32-bit int cannot hold
_KEPT = 32  # the largest tensors of each kind a plan keeps: those that grow with the batch, those that do not


@dataclass(frozen=True)
class BigTensor:
    """One of a graph step's largest tensors, as traced at `rows` rows."""

    op: str  # the op that makes it, as the step's graph names it
    op_type: str
    layer: str  # the Keras layer (or the key of what has none) and the phase it serves
    phase: str
    shape: tuple[int, ...]  # at `rows`
    rows: int
    batch_axis: int | None  # the axis that grows with the batch (None: a tensor of a fixed size)

    def shape_at(self, batch: int) -> tuple[int, ...]:
        if self.batch_axis is None:
            return self.shape
        return self.shape[:self.batch_axis] + (batch,) + self.shape[self.batch_axis + 1:]

    def elements_at(self, batch: int) -> int:
        return math.prod(self.shape_at(batch))

    def largest_batch_under(self) -> int | None:
        """The largest batch whose tensor stays under ELEMENT_LIMIT (None: its size does not follow the batch)."""
        if self.batch_axis is None:
            return None
        per_row = math.prod(self.shape) // self.rows
        return (ELEMENT_LIMIT - 1) // per_row if per_row else None


@dataclass(frozen=True)
class AbortRisk:
    """A tensor of the step at `batch` with ELEMENT_LIMIT elements or more."""

    tensor: BigTensor
    batch: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape_at(self.batch)

    @property
    def elements(self) -> int:
        return self.tensor.elements_at(self.batch)

    def line(self) -> str:
        t = self.tensor
        return (f"{t.op} ({t.op_type}; {t.layer}, {t.phase}): shape {list(self.shape)}, {self.elements:,} elements")


def graph_tensors(graph, batch_size: int, owner_of) -> tuple[BigTensor, ...]:
    """The largest tensors the ops of `graph` (and the functions it calls) make, traced at `batch_size`
    rows, each with its op, owner (owner_of(op name) -> (layer, phase)) and the axis that is the batch."""
    found: list[tuple[int, object, object]] = []
    seen: set[str] = set()

    def walk(g) -> None:
        for op in g.get_operations():
            for output in op.outputs:
                shape = output.shape
                if shape.rank and shape.is_fully_defined():
                    found.append((math.prod(shape.as_list()), op, tuple(int(d) for d in shape.as_list())))
        for name, function in getattr(g, "_functions", {}).items():
            inner = getattr(function, "graph", None)
            if name not in seen and inner is not None:
                seen.add(name)
                walk(inner)

    walk(graph)
    growing, fixed = [], []
    for elements, op, shape in found:
        batch_axis = next((k for k, size in enumerate(shape) if size == batch_size), None)
        (fixed if batch_axis is None else growing).append((elements, op, shape, batch_axis))
    # The largest of each kind: those that grow with the batch decide the batch past which the step aborts.
    kept = sorted(growing, key=lambda item: -item[0])[:_KEPT] + sorted(fixed, key=lambda item: -item[0])[:_KEPT]
    tensors = []
    for _, op, shape, batch_axis in kept:
        layer, phase = owner_of(op.name)
        tensors.append(BigTensor(op.name, op.type, layer, phase, shape, batch_size, batch_axis))
    return tuple(tensors)


def risks_at(tensors: tuple[BigTensor, ...], batch: int) -> list[AbortRisk]:
    """The tensors with ELEMENT_LIMIT elements or more at `batch`, the largest first."""
    risks = [AbortRisk(t, batch) for t in tensors if t.elements_at(batch) >= ELEMENT_LIMIT]
    return sorted(risks, key=lambda r: -r.elements)


def largest_batch_under(tensors: tuple[BigTensor, ...]) -> int | None:
    """The largest batch at which no tensor reaches ELEMENT_LIMIT (None: none of them follows the batch)."""
    limits = [b for b in (t.largest_batch_under() for t in tensors) if b is not None]
    return min(limits) if limits else None
