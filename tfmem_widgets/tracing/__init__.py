"""Every allocation of a block, and the pool rebuilt from them.

The profiler and the recorder, the allocator events and the XSpace decoder, allocations without an op
attributed, the replay, TensorFlow's dumps, the trace and its files."""
