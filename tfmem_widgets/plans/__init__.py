"""XLA's plan of a Keras train step, before it runs.

The step traced from specs and compiled (nothing allocated), its buffers read back to layers and
phases, plans at other batches, the largest batch whose plan fits, and an OOM's need in plans."""
