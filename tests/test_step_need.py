"""An OOM told in terms of its step: the report's figures and fixes from what the step needs
(fit/need.py's plans, or an XLA program's one buffer), never a fix from one tensor's bytes.
The maps here are built by hand (a pool of three regions); the lab-mode fit that makes them for
real, and the batch it names trained in a fresh process, are in tests/test_oom_explained.py."""

from tfmem_widgets.oom.layers import ACTIVATIONS, OPTIMIZER_STATE, OTHER, PARAMETERS, LayerAnatomy
from tfmem_widgets.oom.report import FRAGMENTATION, LIMIT, OomReport, StepNeed
from tfmem_widgets.tracing.allocator_map import AllocatorMap, Chunk, Region

MiB = 1 << 20


def _map(in_use_mib: list[int], free_mib: list[int]) -> AllocatorMap:
    chunks, address = [], 0
    for size, used in [(s, True) for s in in_use_mib] + [(s, False) for s in free_mib]:
        chunks.append(Chunk(address, size * MiB, used))
        address += size * MiB
    return AllocatorMap("GPU_0_bfc", tuple(chunks), (Region(0, address),), "dump")


def _report(amap, request_mib, *, need=None, anatomy=None, step="multi_step_on_iterator", limit_mib=320,
            capacity_mib=80 * 1024) -> OomReport:
    return OomReport("GPU_0_bfc", "OOM when allocating tensor", request_mib * MiB, amap, limit_mib * MiB,
                     "logical device limit", capacity_mib * MiB, "card", step=step, anatomy=anatomy, need=need)


def test_a_step_whose_need_is_planned_gets_fixes_in_terms_of_the_step():
    # 319 MiB in use of a 320 MiB logical device, a small request: the H100's case of notebook 6
    amap = _map([300, 19], [1])
    need = StepNeed(8192, peak_bytes=2100 * MiB, resident_bytes=102 * MiB, limit_bytes=320 * MiB, fits_batch=1100,
                    fails_batch=1130, plans=7, seconds=61.0, estimate=True)
    report = _report(amap, 2, need=need)
    assert report.verdict == LIMIT
    text = repr(report)
    assert "at batch 8,192 it needs 2.05 GiB at its peak" in text and "an estimate" in text
    assert "what fits: at most batch 1,100" in text and "1,130 does not" in text and "a probe confirms it" in text
    fixes = report.fixes()
    assert any(f.startswith("raise the limit to at least 2100 MiB (the step's peak at batch 8,192") for f in fixes)
    assert any(f.startswith("a smaller batch: at most 1,100, where the planned step reaches") for f in fixes)
    assert not any("less at this step" in f or "MiB less" in f for f in fixes)


def test_without_a_plan_a_steps_request_is_said_to_be_one_tensor_never_its_need():
    report = _report(_map([300, 19], [1]), 2)
    fixes = report.fixes()
    assert any("is one tensor of the step, not what the step needs" in f for f in fixes)
    assert not any(" less" in f and "use " in f for f in fixes)
    assert any(f.startswith("raise the limit above 321 MiB (in use + this request") and "plan it" in f for f in fixes)


def test_an_op_outside_any_step_is_told_how_much_is_over():
    report = _report(_map([300, 19], [1]), 2, step=None)
    assert any(f.startswith("free 1.00 MiB of what is in use") for f in report.fixes())


def test_fragmentation_with_a_step_that_does_not_fit_puts_the_smaller_batch_first():
    amap = _map([100, 40], [64, 60, 50])
    need = StepNeed(8192, peak_bytes=530 * MiB, resident_bytes=102 * MiB, limit_bytes=320 * MiB, fits_batch=3240,
                    fails_batch=3293, plans=7, seconds=3.2)
    report = _report(amap, 128, need=need)
    assert report.verdict == FRAGMENTATION
    fixes = report.fixes()
    assert fixes[0].startswith("a smaller batch: at most 3,240")
    assert not any("in a new process" in f and "fits the" in f for f in fixes)  # in use + request is not the step


def test_fragmentation_with_a_step_that_fits_a_fresh_pool_says_start_from_an_empty_one():
    need = StepNeed(512, peak_bytes=200 * MiB, resident_bytes=102 * MiB, limit_bytes=320 * MiB, fits_batch=512)
    report = _report(_map([100, 40], [64, 60, 50]), 128, need=need)
    assert report.fixes()[0].startswith("start from an empty pool: the step's planned peak at batch 512, 200.00 MiB")


def test_an_xla_request_need_is_the_least_the_step_needs_and_no_batch_is_guessed():
    need = StepNeed(16384, peak_bytes=96 * 1024 * MiB, resident_bytes=1024 * MiB, limit_bytes=80 * 1024 * MiB,
                    source="xla request")
    report = _report(_map([300, 19], [1]), 2, need=need)
    text = repr(report)
    assert "it needs at least 96.00 GiB at its peak (in use + the XLA program's one buffer of temporaries" in text
    assert "what fits: plan the step in a new process" in text and "about" not in text
    assert any("the XLA program's temporaries" in f or "plan" in f for f in report.fixes())


def test_in_use_by_layer_lists_the_largest_first_and_the_fix_names_it():
    layers = LayerAnatomy({"model/embed": {PARAMETERS: 40 * MiB, OPTIMIZER_STATE: 80 * MiB},
                           "model/attn": {PARAMETERS: 4 * MiB},
                           ACTIVATIONS: {OTHER: 48 * 1024 * MiB}}, 48 * 1024 * MiB + 124 * MiB)
    assert list(layers)[0] == ACTIVATIONS and layers.layers == ["model/embed", "model/attn"]
    report = _report(_map([300, 19], [1]), 2, anatomy=layers)
    assert any(f"largest in use: {ACTIVATIONS} 48.00 GiB" in f for f in report.fixes())
    shown = "\n".join(report.lines())
    assert shown.index(ACTIVATIONS) < shown.index("model/embed")


def test_explain_oom_takes_the_fit_whole_or_not_at_all():
    import pytest

    from tfmem_widgets import SetupError, explain_oom

    error = RuntimeError("OOM when allocating tensor with shape[8192,4096] and type float on /device:CPU:0 by "
                         "allocator bfc_cpu_allocator_for_gpu")
    for kwargs in ({"batch_size": 8192}, {"model": object(), "sample": (1, 2), "batch_size": 0},
                   {"model": object(), "sample": (1, 2), "batch_size": True}):
        with pytest.raises(SetupError) as refused:
            explain_oom(error, **kwargs)
        assert "\n" not in str(refused.value) and "go together" in str(refused.value)
    with pytest.raises(SetupError, match="apply to an error raised in this process"):
        explain_oom("/no/such/dump", model=object(), sample=(1, 2), batch_size=8)


def test_an_xla_programs_request_is_its_temporaries_and_the_fixes_say_so():
    report = _report(_map([84], [32, 26]), 420)
    report.xla = True
    assert report.verdict == LIMIT
    fixes = report.fixes()
    assert fixes[0].startswith("raise the limit to at least 504 MiB (in use + the XLA program's temporaries")
    assert any(f.startswith("the request (420.00 MiB) is the XLA program's temporaries, asked for as one buffer: "
                            "the step needs at least in use + it, 504.00 MiB") for f in fixes)
    assert not any("one tensor of the step" in f for f in fixes)
