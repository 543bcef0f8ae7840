"""Figures at one moment and over a block.

The allocator's counters, exact peaks (measure), the whole report, the sampler's thread, bytes by
Keras layer and phase, the fit a thread is inside, and the Keras callback across a whole fit."""
