"""Figures at one moment and over a block: the allocator's counters, exact peaks (measure), the whole report, the sampler's thread."""
