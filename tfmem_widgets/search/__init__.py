"""What fits: the largest batch a Keras model trains with, found by probes in fresh processes.

The probes, where the next one goes, processes started ahead of their batch, the search that plans
first, and its progress."""
