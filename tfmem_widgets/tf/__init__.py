"""TensorFlow's facts and rules, read without starting its runtime: its process state, allocators, limits, dump place, setup options and rules, device setup, the driver (NVML)."""
