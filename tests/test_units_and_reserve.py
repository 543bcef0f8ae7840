from tfmem_widgets.tf.nvml import GpuMemory, nvml_index_for_cuda_ordinal
from tfmem_widgets.tf.system_reserve import system_reserve
from tfmem_widgets.units import GiB, MiB, format_bytes, format_exact


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(24 * MiB) == "24.00 MiB"
    assert format_bytes(-8 * MiB, signed=True) == "-8.00 MiB"
    assert format_bytes(8 * MiB, signed=True) == "+8.00 MiB"
    assert format_bytes(None) == "-"
    assert format_exact(25166080, signed=True) == "+25,166,080 B"


def test_reserve_by_compute_capability():
    free = 100 * GiB
    assert [system_reserve(free, cc, env={})[0] // MiB for cc in (5, 6, 7, 8, 9, 10, 12)] == [
        500, 500, 1050, 1536, 1800, 1800, 1800]


def test_reserve_when_little_is_free_and_when_set_by_environment():
    assert system_reserve(2 * GiB - 1, 9, env={})[0] == 225 * MiB
    reserve, why = system_reserve(100 * GiB, 9, env={"TF_DEVICE_MIN_SYS_MEMORY_IN_MB": "500"})
    assert reserve == 500 * MiB and "TF_DEVICE_MIN_SYS_MEMORY_IN_MB" in why
    assert system_reserve(100 * GiB, None, env={})[0] is None


def _gpus(n):
    return [GpuMemory(i, "G", f"GPU-{i}aaaa", 1, 0, 1, ()) for i in range(n)]


def test_cuda_ordinal_to_nvml_index(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml_index_for_cuda_ordinal(1, _gpus(2)) == 1
    assert nvml_index_for_cuda_ordinal(2, _gpus(2)) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert nvml_index_for_cuda_ordinal(0, _gpus(4)) == 3
    assert nvml_index_for_cuda_ordinal(1, _gpus(4)) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-2")
    assert nvml_index_for_cuda_ordinal(0, _gpus(4)) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-abc")
    assert nvml_index_for_cuda_ordinal(0, _gpus(4)) is None
