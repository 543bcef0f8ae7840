"""A graph step's peak as TensorFlow's executor runs it on a GPU, from the traced step alone.

Where the train step is not an XLA program (a replica's step under ``tf.distribute``, which Keras compiles
without XLA), its memory is the graph executor's: each op's outputs are allocated when the op runs, and each
buffer goes back when its last consumer has run (tensorflow/core/common_runtime/executor.cc, propagator_state.cc).
This module walks the traced graph as that executor walks it on a GPU and adds up the buffers live after each op:

- order: a GPU kernel only enqueues work, so TensorFlow counts none of them expensive (OpKernel's constructor)
  and the executor runs the ops that become ready inline, first ready first run (its ``inline_ready`` queue);
- aliases allocate nothing: ``ReadVariableOp`` hands out the variable's own buffer, ``Identity``, ``IdentityN``,
  ``Reshape`` and the like hand out their input's;
- forwarding: an elementwise kernel (``Relu``, ``ReluGrad``, ``BiasAdd``, ``AddV2``, ``Mul``...) writes its
  output into an input of the same size that nothing else will read (``forward_input_or_allocate_output``);
- the step's inputs, the variables and constants are held before the step: not counted; the function's
  outputs (the loss, the metrics) are held to its end.

What it leaves out: a kernel's own scratch (cuDNN's convolution workspace, cuBLAS' is its own), shapes the
trace does not know (counted as nothing, and counted in ``unsized``), and ops running side by side where
several start at once (the executor starts each op with no inputs on its own thread). Measured on an H100 (a
Dense model's graph step, docs/plans.md), the walk's peak equals the step's four largest tensors that a trace
shows at the peak.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

ALIASES = frozenset({"Identity", "IdentityN", "ReadVariableOp", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
                     "EnsureShape", "PreventGradient"})
NO_BUFFER = frozenset({"Placeholder", "Const", "NoOp", "VarHandleOp", "Shape", "ShapeN", "Size", "Rank",
                       "BroadcastGradientArgs"})
HELD = frozenset({"Placeholder", "Const", "VarHandleOp"})  # (buffers held before the step)
FORWARDS = frozenset({
    "Relu", "ReluGrad", "Relu6", "Relu6Grad", "Elu", "EluGrad", "Selu", "SeluGrad", "LeakyRelu", "LeakyReluGrad",
    "Sigmoid", "SigmoidGrad", "Tanh", "TanhGrad", "Softplus", "SoftplusGrad", "Gelu", "Erf", "BiasAdd",
    "Add", "AddV2", "AddN", "Sub", "Mul", "RealDiv", "DivNoNan", "Maximum", "Minimum", "SquaredDifference", "Pow",
    "Neg", "Sqrt", "Rsqrt", "Square", "Exp", "Log", "Reciprocal", "Abs", "Sign", "Floor", "Round", "SelectV2",
    "ZerosLike", "OnesLike"})


@dataclass(frozen=True)
class GraphStepPeak:
    """The most a graph step holds at once beyond its inputs and the variables, and what it holds then."""

    bytes: int
    after_op: str  # the op after which the peak was reached
    live: tuple[tuple[str, int], ...]  # (the tensor that made the buffer, bytes) at the peak, largest first
    ops: int
    unsized: int  # outputs whose shape the trace does not know (counted as nothing)


def tensor_bytes(tensor) -> int | None:
    """A tensor's bytes from its traced shape; 0 for a handle or a variant, None for a shape not known."""
    import tensorflow as tf

    dtype = tf.as_dtype(tensor.dtype)
    if dtype in (tf.resource, tf.variant, tf.string):
        return 0
    if not tensor.shape.is_fully_defined():
        return None
    count = 1
    for dim in tensor.shape.as_list():
        count *= dim
    return count * dtype.size


class _Walk:
    """The executor's walk of one graph: buffers, their remaining readers, the live bytes."""

    def __init__(self, graph):
        self.ops = graph.get_operations()
        self.kept = {t.name for t in graph.outputs}
        self.buffer_of: dict[str, str] = {}  # tensor -> its buffer (the tensor that made it)
        self.size: dict[str, int] = {}
        self.readers: dict[str, int] = {}
        self.live: dict[str, int] = {}
        self.bytes = 0
        self.unsized = 0

    def uses(self, tensor) -> int:
        return len(tensor.consumers()) + (tensor.name in self.kept)

    def output(self, op, k: int, tensor) -> None:
        uses = self.uses(tensor)
        if op.type in ALIASES and op.inputs:
            source = self.buffer_of.get(op.inputs[k if op.type == "IdentityN" else 0].name)
            if source is not None:
                self.buffer_of[tensor.name] = source
                self.readers[source] += uses
                return
        size = 0 if op.type in NO_BUFFER else tensor_bytes(tensor)
        if size is None:
            self.unsized += 1
            size = 0
        into = self._forwarded(op, size) if op.type in FORWARDS and size else None
        if into is not None:  # written into an input nobody else reads
            self.buffer_of[tensor.name] = into
            self.readers[into] += uses
            return
        self.buffer_of[tensor.name] = tensor.name
        self.size[tensor.name] = size
        self.readers[tensor.name] = uses
        if size and op.type not in HELD:
            self.live[tensor.name] = size
            self.bytes += size

    def _forwarded(self, op, size: int) -> str | None:
        for tensor in op.inputs:
            buffer = self.buffer_of.get(tensor.name)
            if buffer in self.live and self.readers[buffer] == 1 and self.size[buffer] == size:
                return buffer
        return None

    def release(self, buffer: str) -> None:
        self.readers[buffer] -= 1
        self.free_if_unread(buffer)

    def free_if_unread(self, buffer: str) -> None:
        if self.readers[buffer] <= 0 and buffer in self.live:
            self.bytes -= self.live.pop(buffer)


def graph_step_peak(graph, top: int = 8) -> GraphStepPeak:
    """Walk `graph` (a traced step's FuncGraph) as the executor runs it on a GPU; the peak of its live bytes."""
    walk = _Walk(graph)
    waiting: dict[str, int] = {}
    after: dict[str, list] = {}
    for op in walk.ops:
        before = {t.op.name for t in op.inputs} | {c.name for c in op.control_inputs}
        waiting[op.name] = len(before)
        for name in before:
            after.setdefault(name, []).append(op)
    ready = deque(op for op in walk.ops if not waiting[op.name])
    peak, peak_op, peak_live, ran = 0, "", {}, 0
    while ready:
        op = ready.popleft()
        ran += 1
        for k, tensor in enumerate(op.outputs):
            walk.output(op, k, tensor)
        if walk.bytes > peak:
            peak, peak_op, peak_live = walk.bytes, op.name, dict(walk.live)
        for tensor in op.inputs:
            walk.release(walk.buffer_of[tensor.name])
        for tensor in op.outputs:  # (an output nobody reads goes back at once)
            walk.free_if_unread(walk.buffer_of[tensor.name])
        for successor in after.get(op.name, ()):
            waiting[successor.name] -= 1
            if not waiting[successor.name]:
                ready.append(successor)
    largest = sorted(peak_live.items(), key=lambda kv: -kv[1])[:top]
    return GraphStepPeak(peak, peak_op, tuple(largest), ran, walk.unsized)
