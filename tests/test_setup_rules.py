"""TensorFlow's setup rules, checked on machine states written out by hand.

plan_setup is pure: it gets the state of a machine (GPUs, their configuration, NVML's
figures) as data, so the rules for 1, 2 or 8 GPUs are tested here without a GPU. The same
rules against a real GPU runtime are in test_gpu.py.
"""

import pytest

from tfmem_widgets.errors import ArgumentError, SetupError, StateError
from tfmem_widgets.tf.devices import PhysicalGpu
from tfmem_widgets.tf.nvml import GpuMemory, ProcessGpuMemory
from tfmem_widgets.tf.options import DEFAULT_LAB_MB, SetupRequest
from tfmem_widgets.tf.setup_rules import CUDA_CONTEXT_ALLOWANCE, DeviceState, plan_setup
from tfmem_widgets.units import GiB, MiB


def gpu(index, growth=False, logical=None, visible=True, cc=(9, 0)):
    return PhysicalGpu(index, f"/physical_device:GPU:{index}", "NVIDIA H200", cc, visible, growth, logical)


def memory(index, total=80 * GiB, used=1 * GiB):
    return GpuMemory(index, "NVIDIA H200", f"GPU-{index}", total, used, total - used,
                     (ProcessGpuMemory(999, 512 * MiB),))


def state(gpus=(), started=False, env=None, nvml=True, host=24 * GiB):
    gpus = tuple(gpus)
    return DeviceState(
        gpus=gpus,
        gpu_memory={g.index: (memory(g.index) if nvml else None) for g in gpus},
        nvml_note=None if nvml else "NVML not available: no NVIDIA driver answered",
        cpu_logical=1,
        host_total_bytes=host,
        env=env or {},
        runtime_started=started,
    )


def refused(request, st, kind=SetupError) -> str:
    with pytest.raises(kind) as info:
        plan_setup(request, st)
    message = str(info.value)
    assert "\n" not in message, "refusals are one line"
    return message


def test_no_gpu_and_nothing_asked_means_default_lab_mode():
    plan = plan_setup(SetupRequest(), state())
    assert plan.lab_mb == DEFAULT_LAB_MB
    assert [(s.target, s.value) for s in plan.steps] == [
        ("TF_CPU_ALLOCATOR_USE_BFC", "true"),
        ("TF_CPU_BFC_MEM_LIMIT_IN_MB", str(DEFAULT_LAB_MB)),
    ]
    assert any("no GPU is visible" in n for n in plan.notes)


def test_gpu_options_without_gpu_are_refused_with_the_lab_route():
    message = refused(SetupRequest(growth=True, limit_mb=100), state())
    assert "growth, limit_mb" in message and "--lab" in message


def test_growth_with_a_limit_is_refused_and_force_growth_offered():
    message = refused(SetupRequest(growth=True, limit_mb=4096), state([gpu(0)]))
    assert "silently drop" in message and "--force-growth" in message


def test_force_growth_with_a_limit_is_the_working_combination():
    plan = plan_setup(SetupRequest(force_growth=True, limit_mb=4096), state([gpu(0)]))
    code = plan.code()
    assert 'os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"' in code
    assert "LogicalDeviceConfiguration(memory_limit=4096)" in code
    assert code.index("os.environ") < code.index("set_logical_device_configuration")


def test_limit_on_a_gpu_whose_growth_was_set_earlier_is_refused():
    # The popular snippet's order: growth first, logical devices after: TensorFlow says
    # nothing and drops growth, so we refuse and say how to get either.
    message = refused(SetupRequest(limit_mb=1024), state([gpu(0, growth=True)]))
    assert "set earlier" in message and "--no-growth" in message and "--force-growth" in message
    plan = plan_setup(SetupRequest(limit_mb=1024, growth=False), state([gpu(0, growth=True)]))
    kinds = [s.kind for s in plan.steps]
    assert kinds == ["growth", "logical"], "growth is switched off before the logical devices"


def test_growth_on_a_gpu_with_logical_devices_is_refused():
    message = refused(SetupRequest(growth=True), state([gpu(0, logical=(1024,))]))
    assert "already has logical devices" in message


def test_logical_devices_on_one_gpu_drop_growth_on_every_gpu():
    # context.py computes allow_growth only when no GPU has virtual devices.
    st = state([gpu(0, growth=True), gpu(1, growth=True)])
    message = refused(SetupRequest(limit_mb={0: 2048}), st)
    assert "GPU 0" in message


def test_growth_must_match_across_gpus():
    message = refused(SetupRequest(gpus=[0, 1]), state([gpu(0, growth=True), gpu(1, visible=False)]))
    assert "cannot differ" in message


def test_limit_larger_than_the_card_is_refused_with_the_most_allowed():
    message = refused(SetupRequest(limit_mb=100_000), state([gpu(0)]))
    assert "80.00 GiB" in message and "at most 81920 MB" in message


def test_split_sizes_larger_than_the_card_in_sum_are_refused():
    refused(SetupRequest(split=[50_000, 40_000]), state([gpu(0)]))
    plan = plan_setup(SetupRequest(split=[40_000, 40_000]), state([gpu(0)]))
    assert plan.steps[0].value == (40_000, 40_000)


def test_limit_not_checked_without_nvml_says_so():
    plan = plan_setup(SetupRequest(limit_mb=4096), state([gpu(0)], nvml=False))
    assert any("not checked" in n for n in plan.notes)


def test_unknown_gpu_index_names_the_gpus_that_exist():
    message = refused(SetupRequest(gpus=[0, 3]), state([gpu(0), gpu(1)]))
    assert "no GPU 3" in message and "0, 1" in message


def test_limit_for_a_hidden_gpu_is_refused():
    message = refused(SetupRequest(gpus=[0], limit_mb={1: 1024}), state([gpu(0), gpu(1)]))
    assert "GPU 1" in message and "not among the GPUs in use" in message


def test_sizes_and_limit_together_are_refused():
    refused(SetupRequest(split=[1024, 1024], limit_mb=4096), state([gpu(0)]))


def test_split_count_divides_the_limit():
    plan = plan_setup(SetupRequest(limit_mb=8192, split=2), state([gpu(0)]))
    assert plan.steps[0].value == (4096, 4096)


def test_split_count_without_limit_divides_free_memory_minus_reserve_and_context():
    plan = plan_setup(SetupRequest(split=2), state([gpu(0)]))
    free = 80 * GiB - 1 * GiB
    expected_total = (free - 1800 * MiB - CUDA_CONTEXT_ALLOWANCE) // MiB
    assert plan.steps[0].value == (expected_total // 2,) * 2


def test_split_count_without_limit_needs_nvml():
    message = refused(SetupRequest(split=2), state([gpu(0)], nvml=False))
    assert "--limit" in message


def test_no_growth_and_force_growth_contradict():
    refused(SetupRequest(growth=False, force_growth=True), state([gpu(0)]))


def test_visible_gpus_and_growth_code_in_order():
    plan = plan_setup(SetupRequest(gpus=[1], growth=True), state([gpu(0), gpu(1)]))
    assert plan.code().splitlines() == [
        "import tensorflow as tf",
        'gpus = tf.config.list_physical_devices("GPU")',
        'tf.config.set_visible_devices([gpus[1]], "GPU")',
        "tf.config.experimental.set_memory_growth(gpus[1], True)",
    ]


def test_allocator_and_reserve_are_environment_variables():
    plan = plan_setup(SetupRequest(allocator="cuda_malloc_async", reserve_mb=500), state([gpu(0)]))
    assert {s.target: s.value for s in plan.steps} == {
        "TF_GPU_ALLOCATOR": "cuda_malloc_async",
        "TF_DEVICE_MIN_SYS_MEMORY_IN_MB": "500",
    }


def test_lab_limit_above_host_memory_is_refused():
    message = refused(SetupRequest(lab_mb=64 * 1024), state(host=24 * GiB))
    assert "smaller --lab" in message


def test_after_start_a_change_is_refused_with_why_and_fix():
    st = state(started=True, env={"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "64"})
    message = refused(SetupRequest(lab_mb=128), st, StateError)
    assert "already started" in message and "lab mode with 64 MB" in message
    assert "restart the kernel" in message and "%tfmem setup --lab 128" in message


def test_after_start_growth_change_points_to_the_environment_route():
    message = refused(SetupRequest(growth=True), state([gpu(0)], started=True), StateError)
    assert "TF_FORCE_GPU_ALLOW_GROWTH=true" in message and "restart the kernel" in message


def test_after_start_the_same_setup_is_a_no_op():
    st = state([gpu(0, growth=True)], started=True)
    plan = plan_setup(SetupRequest(growth=True), st)
    assert plan.steps == ()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lab_mb": -5},
        {"lab_mb": 0},
        {"lab_mb": "64"},
        {"limit_mb": 2.5},
        {"split": 0},
        {"split": []},
        {"split": [1024, -1]},
        {"gpus": [0, 0]},
        {"gpus": "0"},
        {"allocator": "malloc"},
        {"growth": "yes"},
        {"cpus": 0},
    ],
)
def test_bad_values_are_refused_in_one_line(kwargs):
    with pytest.raises(ArgumentError) as info:
        SetupRequest(**kwargs)
    assert "\n" not in str(info.value)


def test_as_magic_round_trips_every_option():
    request = SetupRequest(lab_mb=64, gpus=[0, 1], growth=False, force_growth=True,
                           limit_mb={0: 1024, 1: 2048}, allocator="bfc", reserve_mb=0, cpus=2)
    assert request.as_magic() == (
        "%tfmem setup --lab 64 --gpus 0,1 --no-growth --force-growth --limit 0=1024,1=2048 "
        "--allocator bfc --reserve 0 --cpus 2"
    )


def test_numpy_integers_are_whole_numbers():
    import numpy as np

    request = SetupRequest(lab_mb=np.int64(64), cpus=np.int32(2), split=np.array([2048, 2048]),
                           gpus=(np.int64(0),), limit_mb={np.int64(0): np.int64(4096)})
    assert request.lab_mb == 64 and type(request.lab_mb) is int and request.cpus == 2
    assert request.split == [2048, 2048] and request.gpus == [0] and request.limit_mb == {0: 4096}
    with pytest.raises(ArgumentError, match="whole number"):
        SetupRequest(lab_mb=np.float64(64))


def test_every_setup_option_is_one_keyword_of_setup_and_one_flag_of_the_magic():
    import dataclasses
    import inspect

    from tfmem_widgets import setup
    from tfmem_widgets.tf.options import OPTION_NAMES, SETUP_ENV_VARS, SETUP_OPTIONS, SetupRequest

    assert tuple(inspect.signature(setup).parameters) == OPTION_NAMES
    assert tuple(f.name for f in dataclasses.fields(SetupRequest)) == OPTION_NAMES
    flags = [o.flag for o in SETUP_OPTIONS] + [o.off_flag for o in SETUP_OPTIONS if o.off_flag]
    assert len(set(flags)) == len(flags) and len(set(SETUP_ENV_VARS)) == len(SETUP_ENV_VARS)
    # Every option of the table round-trips through its own flag text.
    request = SetupRequest(lab_mb=64, gpus=[0, 1], growth=False, force_growth=True, limit_mb={0: 1024},
                           split=[512, 512], allocator="bfc", reserve_mb=0, cpus=2)
    for option in SETUP_OPTIONS:
        text = option.as_flag(getattr(request, option.name))
        assert text.split()[0] in (option.flag, option.off_flag), text


@pytest.mark.parametrize("flags, level", [
    (None, None), ("", None), ("--xla_gpu_autotune_level=0", "0"),
    ("--xla_dump_to=/tmp/x --xla_gpu_autotune_level=4", "4"),
    ("--xla_gpu_autotune_level=0 --xla_gpu_autotune_level=2", "2"),  # the last one given, as XLA reads them
])
def test_the_autotuners_level_is_read_from_xla_flags_as_xla_reads_it(monkeypatch, flags, level):
    from tfmem_widgets.tf.devices import xla_autotune_level

    if flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", flags)
    assert xla_autotune_level() == level
