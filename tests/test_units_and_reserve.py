from tfmem_widgets.tf.limits import setup_device_mb, setup_gpu_mb, setup_limit
from tfmem_widgets.tf.nvml import GpuMemory, nvml_index_for_cuda_ordinal
from tfmem_widgets.tf.system_reserve import reserve_behind_limit, system_reserve
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


def test_the_reserve_read_back_from_a_default_limit():
    # free = limit + reserve: a limit under 2 GiB - 225 MiB came from a free figure under 2 GiB
    assert reserve_behind_limit(2 * GiB - 226 * MiB, 9, env={})[0] == 225 * MiB
    assert reserve_behind_limit(2 * GiB - 225 * MiB, 9, env={})[0] == 1800 * MiB
    assert reserve_behind_limit(140 * GiB, 8, env={})[0] == 1536 * MiB


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


def test_a_setups_limit_per_gpu_is_its_logical_devices_together():
    assert setup_gpu_mb({"limit_mb": 4096}, 1) == 4096
    assert setup_gpu_mb({"limit_mb": {1: 2048}}, 1) == 2048 and setup_gpu_mb({"limit_mb": {1: 2048}}, 0) is None
    assert setup_gpu_mb({"split": [1024, 3072]}, 0) == 4096
    assert setup_gpu_mb({"limit_mb": 4096, "split": 2}, 0) == 4096
    assert setup_gpu_mb({"split": 2}, 0) is None  # the count divides what the process finds free
    assert setup_gpu_mb({"lab_mb": 256}, 0) is None and setup_gpu_mb(None, 0) is None


def test_a_setups_limit_per_logical_device_counts_them_gpu_after_gpu():
    sizes = {"split": [1024, 3072]}
    assert [setup_device_mb(sizes, k) for k in range(4)] == [1024, 3072, 1024, 3072]
    assert [setup_device_mb({"limit_mb": {0: 4096, 1: 2048}, "split": 2}, k) for k in range(4)] == [2048, 2048, 1024, 1024]
    assert setup_device_mb({"gpus": [1], "limit_mb": {1: 2048}}, 0) == 2048  # GPU 1 alone is logical GPU 0
    assert setup_device_mb({"gpus": [1], "split": [512, 512]}, 2) is None  # no third logical device
    assert setup_device_mb({"split": 2}, 0) is None


def test_the_limit_a_dump_is_read_with_comes_from_the_same_rule():
    assert setup_limit({"lab_mb": 256}, "bfc_cpu_allocator_for_gpu") == (256 * MiB, "lab mode")
    assert setup_limit({"split": [1024, 3072]}, "GPU_1_bfc") == (3072 * MiB, "logical device limit")
    assert setup_limit({"limit_mb": 2000}, "GPU_0_bfc") == (2000 * MiB, "logical device limit")
    assert setup_limit({"split": 2}, "GPU_0_bfc") == (None, "unknown")
    assert setup_limit({"limit_mb": 2000}, "bfc_cpu_allocator_for_gpu") == (None, "unknown")
