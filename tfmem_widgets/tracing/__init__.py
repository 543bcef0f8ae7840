"""Every allocation of a block: the profiler and the recorder, its events, the XSpace decoder, attribution of unnamed allocations, the pool rebuilt, dumps, the trace and its files."""
