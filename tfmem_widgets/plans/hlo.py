"""XLA's own plan of a program, read from its optimized HLO module: the buffer assignment.

``get_compiler_ir(..., stage="optimized_hlo_proto_serialized")`` gives an ``HloProto``: the module's
instructions (each with the TensorFlow op name it came from) and its buffer assignment (every
allocation with its size and kind, the logical buffers placed in it, and the heap simulator's trace
of when each buffer lives). Which allocations a run of the program takes from TensorFlow's allocator:

- entry parameters: the batch and the variables, already allocated; a variable the step updates is
  an output aliased to its parameter and is written in place (no new bytes);
- thread-local allocations: XLA:CPU's stack, never the allocator's;
- constants: emitted into the code (XLA:CPU) or allocated once at load (XLA:GPU), not per run;
- the rest: the temporary allocation and the outputs that are not parameters (the loss, metrics,
  the output tuple's table), each taken whole at the start of a run and given back at its end.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

PARAMETER, THREAD_LOCAL, CONSTANT, OUTPUT, TEMP = "parameter", "thread-local", "constant", "output", "temp"
PER_RUN = (TEMP, OUTPUT)  # the kinds a run takes from the allocator


def hlo_proto(serialized: bytes):
    """The HloProto of `get_compiler_ir(stage="optimized_hlo_proto_serialized")`."""
    from tensorflow.compiler.xla.service import hlo_pb2

    proto = hlo_pb2.HloProto()
    proto.ParseFromString(serialized)
    return proto


@dataclass(frozen=True)
class Allocation:
    """One of XLA's buffer allocations: its size, kind, entry parameter number and buffers."""

    index: int
    size: int
    kind: str
    parameter: int | None
    buffers: tuple[int, ...]  # logical buffer ids placed in it


def allocations(proto) -> list[Allocation]:
    found = []
    for a in proto.buffer_assignment.buffer_allocations:
        if a.is_entry_computation_parameter:
            kind = PARAMETER
        elif a.is_thread_local:
            kind = THREAD_LOCAL
        elif a.is_constant:
            kind = CONSTANT
        elif a.maybe_live_out:
            kind = OUTPUT
        else:
            kind = TEMP
        found.append(Allocation(a.index, a.size, kind, a.parameter_number if kind == PARAMETER else None,
                                tuple(x.logical_buffer_id for x in a.assigned)))
    return found


class HloIndex:
    """The module's instructions by id and name, their users, and the logical buffers."""

    def __init__(self, proto):
        self.proto = proto
        self.by_id, self.by_name, self.computations = {}, {}, {}
        self.users = defaultdict(list)
        for computation in proto.hlo_module.computations:
            self.computations[computation.id] = computation
            for ins in computation.instructions:
                self.by_id[ins.id] = ins
                self.by_name[ins.name] = ins
                for operand in ins.operand_ids:
                    self.users[operand].append(ins)
        self.entry = self.computations.get(proto.hlo_module.entry_computation_id)
        self.buffers = {b.id: b for b in proto.buffer_assignment.logical_buffers}

    def op_name(self, ins) -> str:
        """The TensorFlow op an instruction came from; a fusion's (or call's) from inside it."""
        for _ in range(8):
            if ins is None or ins.metadata.op_name:
                break
            called = list(ins.called_computation_ids)
            computation = self.computations.get(called[0]) if called else None
            if computation is None:
                break
            root = self.by_id.get(computation.root_id)
            if root is not None and root.metadata.op_name:
                return root.metadata.op_name
            named = [i for i in computation.instructions if i.metadata.op_name]
            if named:
                return named[-1].metadata.op_name
            ins = root
        return ins.metadata.op_name if ins is not None else ""

    def instruction_of(self, buffer_id: int):
        """The instruction that defines a logical buffer (its id: the name is often empty)."""
        buffer = self.buffers.get(buffer_id)
        if buffer is None:
            return None
        defined = buffer.defined_at
        return self.by_name.get(defined.instruction_name) if defined.instruction_name else \
            self.by_id.get(defined.instruction_id)


def _place_changes(proto, allocation: Allocation, holders: dict, until: int | None = None):
    """The heap simulator's trace of `allocation` (all its events, or up to `until`) as places taken
    and given back: (event number, taken, place, buffer id) where a buffer takes a place no buffer
    holds, or the last holder frees it; buffers that share a place (SHARE_WITH) hold it together.
    `holders` (the buffers holding each place) is kept up to date. Its allocation index predates XLA's
    combining of temporary allocations, so the trace is matched by the buffers placed in it."""
    from tensorflow.compiler.xla.service import hlo_pb2

    free = hlo_pb2.HeapSimulatorTrace.Event.FREE
    placed = next(({x.logical_buffer_id: (x.offset, x.size) for x in a.assigned}
                   for a in proto.buffer_assignment.buffer_allocations if a.index == allocation.index), {})
    ours = set(allocation.buffers)
    events = [e for trace in proto.buffer_assignment.heap_simulator_traces
              if any(e.buffer_id in ours for e in trace.events) for e in trace.events if e.buffer_id in ours]
    for k, event in enumerate(events[:None if until is None else until + 1]):
        place = placed.get(event.buffer_id, (0, 0))
        if event.kind == free:
            held = holders.get(place)
            if held and event.buffer_id in held:
                held.remove(event.buffer_id)
                if not held:
                    del holders[place]
                    yield k, False, place, event.buffer_id
            continue
        taken = place not in holders
        held = holders.setdefault(place, [])
        if event.buffer_id not in held:
            held.append(event.buffer_id)
        if taken:
            yield k, True, place, event.buffer_id


def live_at_peak(proto, temp: Allocation) -> tuple[int, dict[int, int]]:
    """(the most bytes live at once in the temporary allocation, {buffer id: bytes} live then), from
    the heap simulator's trace (_place_changes). One pass finds the moment, a second replays the
    trace up to it."""
    def replay(until: int | None = None):
        """Run the events (all, or up to `until`): (the highest total and the event reaching it, the
        buffers holding each place at the end)."""
        holders: dict[tuple[int, int], list[int]] = {}
        total, best, best_at = 0, -1, -1
        for k, taken, place, _ in _place_changes(proto, temp, holders, until):
            total += place[1] if taken else -place[1]
            if taken and total > best:
                best, best_at = total, k
        return best, best_at, holders

    best, best_at, _ = replay()
    if best_at < 0:
        return 0, {}
    _, _, holders = replay(best_at)
    return best, {held[0]: place[1] for place, held in holders.items()}


def _subshape(shape, index):
    for i in index:
        shape = shape.tuple_shapes[i]
    return shape


def batch_profile(proto, allocation: Allocation, batch: int, index: HloIndex | None = None,
                  fixed_shapes: frozenset = frozenset()) -> tuple[tuple[int, int], ...]:
    """How `allocation`'s bytes move with the batch: the heap simulator's trace replayed with each
    buffer counted as scaling with the batch (an axis of its shape a multiple of `batch`) or not, as
    (fixed, scaled) bytes live at each moment, only the moments that can be the largest at some batch
    kept (the upper envelope). At another batch B the allocation holds about
    size × max(fixed + scaled × B / batch) / max(fixed + scaled) while XLA lays the program out the
    same way; where it lays it out otherwise the figure misses. An output is one buffer.
    A buffer shaped as one of `fixed_shapes` (the model's variables: gradients, updates) never scales,
    whatever its axes. Empty where the batch cannot be told from a layer's width (fewer than 8 rows)."""
    if batch < 8 or allocation.kind not in PER_RUN:
        return ()
    index = index or HloIndex(proto)

    def scales(buffer_id: int) -> bool:
        buffer, ins = index.buffers.get(buffer_id), index.instruction_of(buffer_id)
        if buffer is None or ins is None:
            return False
        dims = tuple(_subshape(ins.shape, buffer.defined_at.shape_index).dimensions)
        return dims not in fixed_shapes and any(d >= batch and d % batch == 0 for d in dims)

    if allocation.kind == OUTPUT:
        scaled = bool(allocation.buffers) and scales(allocation.buffers[0])
        return ((0, allocation.size),) if scaled else ((allocation.size, 0),)
    scaled_place: dict[tuple[int, int], bool] = {}
    live = [0, 0]  # fixed, scaled
    moments = set()
    for _, taken, place, buffer_id in _place_changes(proto, allocation, {}):
        if taken:
            scaled_place[place] = scales(buffer_id)
            live[scaled_place[place]] += place[1]
            moments.add((live[0], live[1]))
        else:
            live[scaled_place.pop(place)] -= place[1]
    envelope: list[tuple[int, int]] = []
    for fixed, scaled in sorted(moments, key=lambda m: (-m[1], -m[0])):  # most scaled first
        if not envelope or fixed > envelope[-1][0]:
            envelope.append((fixed, scaled))
    return tuple(envelope)


def bytes_at(size: int, profile: tuple[tuple[int, int], ...], ratio: float) -> int:
    """An allocation of `size` bytes with this batch_profile, at `ratio` times the batch."""
    if not profile:
        return size
    now = max(f + s for f, s in profile)
    then = max(f + s * ratio for f, s in profile)
    return max(1, round(size * then / now)) if now else size


def widths_of(model) -> frozenset[int]:
    """The model's variables' axes and sizes: a batch that divides one of these (and is no larger) cannot
    be told from it in a buffer's shape (hlo.batch_profile)."""
    widths = set()
    for variable in model.variables:
        shape = [int(d) for d in variable.shape]
        widths.update(shape)
        widths.add(math.prod(shape))
    return frozenset(widths)


def told_apart(batch: int, widths: frozenset[int]) -> bool:
    """Whether a plan at `batch` rows tells its batch axis from the model's widths (widths_of)."""
    return not any(w >= batch and w % batch == 0 for w in widths)
