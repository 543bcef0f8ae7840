"""Figures at one moment and over a block.

The allocator's counters, exact peaks (measure), the whole report, the sampler's thread."""
