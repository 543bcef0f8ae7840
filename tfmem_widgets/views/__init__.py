"""Pictures of results: matplotlib plots of a trace, the one drawing of a pool."""
