"""TensorFlow's allocator events, read straight from the profiler's xplane.pb.

The profiler records every allocation and deallocation of every BFC allocator as
``MemoryAllocation`` / ``MemoryDeallocation`` events in the ``/host:CPU`` plane (GPU
allocators included), each with the chunk's address and size, the op, and the
allocator's own figures after the event. The protobuf module ships inside TensorFlow:
no TensorBoard or XProf needed. The record itself is events.AllocatorEvents.
"""

from __future__ import annotations

from ..errors import TraceDataError
from .attribution import name_unnamed_allocations
from .events import ALLOC, FREE, AllocatorEvents, events_from_columns
from .lines import read_memory_columns

__all__ = ["ALLOC", "FREE", "AllocatorEvents", "read_xspace", "read_xplane_file"]


def read_xspace(data: bytes, source: str = "xplane.pb") -> dict[str, AllocatorEvents]:
    """All allocator events in an XSpace, by allocator name (e.g. 'GPU_0_bfc').

    Decodes the memory events in bulk with numpy (see xplane_wire); a million events take
    seconds, not minutes.
    """
    return _events(data, source)


def read_xplane_file(path) -> dict[str, AllocatorEvents]:
    """read_xspace for a file, holding its bytes only while protobuf parses them."""
    return _events(None, str(path))


def _events(data: bytes | None, source: str) -> dict[str, AllocatorEvents]:
    columns_by_allocator, texts, intern, lines = read_memory_columns(data, source)
    try:
        name_unnamed_allocations(columns_by_allocator, lines, intern)  # an XLA program's, a tf.function's
    except ValueError as exc:
        raise TraceDataError(f"{source} has a damaged event ({exc}).") from None
    return events_from_columns(columns_by_allocator, texts)
