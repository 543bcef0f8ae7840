"""NVML on this machine: the real library, whatever it finds."""


from tfmem_widgets import nvml


def test_read_gpus_answers_or_says_why_in_one_line():
    try:
        gpus = nvml.read_gpus()
    except nvml.NvmlUnavailable as exc:
        assert str(exc).startswith("NVML not available") and "\n" not in str(exc)
        return
    for gpu in gpus:
        assert gpu.total_bytes > 0 and 0 <= gpu.used_bytes <= gpu.total_bytes
