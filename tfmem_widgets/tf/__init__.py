"""TensorFlow's facts and rules, read without starting its runtime.

Its process state, allocators, limits, dump place, setup options and rules, device setup, and the
driver's view (NVML)."""
