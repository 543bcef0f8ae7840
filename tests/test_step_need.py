"""An OOM told in terms of its step: the report's figures and fixes from what the step needs
(plans/need.py's plans, or an XLA program's one buffer), never a fix from one tensor's bytes.
The maps here are built by hand (a pool of three regions); the lab-mode fit that makes them for
real, and the batch it names trained in a fresh process, are in tests/test_oom_explained.py."""

from dataclasses import replace

from tfmem_widgets.oom.report import FRAGMENTATION, LIMIT, OomReport
from tfmem_widgets.plans.need import StepNeed
from tfmem_widgets.readings.layers import ACTIVATIONS, FORWARD, OPTIMIZER_STATE, OTHER, PARAMETERS, LayerAnatomy
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
    assert any(f"largest activations: {ACTIVATIONS} 48.00 GiB" in f for f in report.fixes())
    shown = "\n".join(report.lines())
    assert shown.index(ACTIVATIONS) < shown.index("model/embed")


def test_the_precision_fix_names_activations_not_weights_and_is_not_given_under_a_mixed_policy(monkeypatch):
    import tfmem_widgets.oom.report as reports

    layers = LayerAnatomy({"model/embed": {PARAMETERS: 400 * MiB, OPTIMIZER_STATE: 800 * MiB},
                           "model/dense": {FORWARD: 64 * MiB, OTHER: 2 * MiB}}, 1266 * MiB)
    report = _report(_map([300, 19], [1]), 2, anatomy=layers)
    fix = next(f for f in report.fixes() if f.startswith("mixed precision"))
    assert fix.endswith("largest activations: model/dense 64.00 MiB")  # not the embedding's weights and slots
    assert "forward activations 64.00 MiB, other 2.00 MiB" in "\n".join(layers.lines())  # the phases add up
    monkeypatch.setattr(reports, "_mixed_policy", lambda: True)  # (Keras' policy is global: not set in this process)
    assert not any(f.startswith("mixed precision") for f in report.fixes())


def test_explain_oom_takes_the_fit_whole_or_not_at_all():
    import pytest

    from tfmem_widgets import ArgumentError, explain_oom

    error = RuntimeError("OOM when allocating tensor with shape[8192,4096] and type float on /device:CPU:0 by "
                         "allocator bfc_cpu_allocator_for_gpu")
    for kwargs in ({"batch_size": 8192}, {"model": object(), "sample": (1, 2), "batch_size": 0},
                   {"model": object(), "sample": (1, 2), "batch_size": True}):
        with pytest.raises(ArgumentError) as refused:
            explain_oom(error, **kwargs)
        assert "\n" not in str(refused.value) and "go together" in str(refused.value)
    with pytest.raises(ArgumentError, match="apply to an error raised in this process"):
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


def _events(rows, texts):
    """AllocatorEvents from (kind, address, size, requested, op index) rows, one microsecond apart."""
    import numpy as np

    from tfmem_widgets.tracing.events import NUMPY_TYPES, AllocatorEvents

    in_use, columns = 0, {name: [] for name in NUMPY_TYPES}
    for k, (kind, address, size, requested, op) in enumerate(rows):
        in_use += kind * size
        for name, value in (("time_ns", 1000 * k), ("kind", kind), ("address", address), ("size", size),
                            ("requested", requested), ("in_use", in_use), ("peak", 0), ("available", 0),
                            ("fragmentation", 0.0), ("op", op), ("shape", 0), ("region", 0), ("data_type", 0)):
            columns[name].append(value)
    arrays = {name: np.array(values, NUMPY_TYPES[name]) for name, values in columns.items()}
    return AllocatorEvents("GPU_0_bfc", texts=texts, **arrays)


def test_an_xla_programs_allocations_before_its_first_run_are_named_its_compiles_scratch(monkeypatch):
    # The H100's pattern (autotuner on): the program's compilation takes hundreds of chunks from the
    # allocator (256 MiB and 32 MiB here) under the program's own name before the first run allocates
    # the planned buffer of temporaries; the trace's peak fell among them.
    from tfmem_widgets.readings import layers

    monkeypatch.setattr(layers, "_PROGRAMS", {})
    program, other = "(XLA program in multi_step_on_iterator)", "(XLA program in another_function)"
    texts = ["", program, other, "adam/zeros"]
    rows = [(1, 0, 32 * MiB, 32 * MiB, 3),                  # a variable's slot
            (1, 32 * MiB, 256 * MiB, 256 * MiB, 1),         # compile: the autotuner's scratch
            (-1, 32 * MiB, 256 * MiB, 256 * MiB, 0),
            (1, 32 * MiB, 32 * MiB, 32 * MiB, 1),
            (-1, 32 * MiB, 32 * MiB, 32 * MiB, 0),
            (1, 128 * MiB, 2 * MiB, 2 * MiB, 1),             # made before the run and still held: not scratch
            (1, 32 * MiB, 80 * MiB, 83_889_192, 1),          # the first run: the planned temporaries
            (-1, 32 * MiB, 80 * MiB, 83_889_192, 0),
            (1, 32 * MiB, 32 * MiB, 32 * MiB, 1),            # after it: the program's own (an output)
            (1, 64 * MiB, 8 * MiB, 8 * MiB, 2)]              # a program never planned: unchanged
    events = _events(rows, texts)
    assert not layers.name_compile_scratch(events)          # nothing planned: nothing renamed
    layers.remember_program(83_889_192, {"sequential/wide": {layers.FORWARD: 1000}})
    assert layers.name_compile_scratch(events)
    names = [events.text(events.op, k) for k in range(len(events))]
    scratch = "(XLA program in multi_step_on_iterator: scratch while compiling, before its first run)"
    assert names == ["adam/zeros", scratch, "", scratch, "", program, program, "", program, other]
    assert not layers.name_compile_scratch(events)          # once


def test_a_chunk_of_a_past_moment_where_a_variable_lives_now_is_not_the_variable():
    from tfmem_widgets.readings.layers import KnownVariable, OpReader, anatomy

    slot = KnownVariable(0, 32 * MiB, "adam/wide_kernel_momentum", "sequential/wide", OPTIMIZER_STATE)
    scratch = "(XLA program in multi_step_on_iterator: scratch while compiling, before its first run)"
    at_the_peak = AllocatorMap("GPU_0_bfc", (Chunk(0, 256 * MiB, True, 256 * MiB, scratch),
                                             Chunk(256 * MiB, 32 * MiB, True, 32 * MiB, "adam/zeros")),
                               (Region(0, 288 * MiB),), "trace")
    rows = anatomy(at_the_peak, variables=[slot], reader=OpReader(), live=True).rows
    assert rows[scratch] == {OTHER: 256 * MiB} and "sequential/wide" not in rows
    now = AllocatorMap("GPU_0_bfc", (Chunk(0, 32 * MiB, True, 32 * MiB, "adam/zeros"),), (Region(0, 32 * MiB),),
                       "trace")
    rows = anatomy(now, variables=[slot], reader=OpReader(), live=True).rows
    assert rows["sequential/wide"] == {OPTIMIZER_STATE: 32 * MiB}


def test_a_gpu_models_step_is_planned_from_its_cpu_copy_never_on_the_refused_card(monkeypatch):
    # On an H100 (1 GiB limit, a jit_compile=False fit's OOM) the report's plan compiled the step on the
    # full card and its GEMM autotuner was refused for minutes: a model on a GPU is planned from its CPU
    # copy. Here the one seam, where the model's variables live, says a GPU.
    import keras
    import numpy as np

    from tfmem_widgets.plans import need
    from tfmem_widgets.readings.fit_context import FitContext

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile("adam", "mse", jit_compile=False)
    monkeypatch.setattr(need, "device_of", lambda m: "GPU:0" if m is model else "CPU:0", raising=False)
    fit = FitContext(model, 64, (np.ones((2, 8), "float32"), np.ones((2, 4), "float32")))
    found = need.step_need(fit, 64 * MiB, seconds=5)
    assert found.source == "cpu plan" and found.estimate and found.peak_bytes, found
    assert "XLA's CPU program of a copy of the model: an estimate of its GPU program" in "\n".join(found.lines("64 MiB"))


# Measured on an H100 (TensorFlow 2.21, Keras 3.15), a Dense 512-1024-1024-1 Adam model under a 2000 MB logical
# device (no growth: one region of the whole limit), XLA's autotuner off, batch 120,298 from a probe's arrays:
# the plan's bytes fit (1,995,153,497 B with the fit's data), the probe ran out of memory on a 4-byte request.
H100_LIMIT = 2000 * MiB
H100_STEP = (1_482_418_216, 176, 4)
H100_WEIGHTS = (512 * 1024 * 4, 1024 * 4, 1024 * 1024 * 4, 1024 * 4, 1024 * 4, 4)


def _h100_plan(growth=False):
    from tfmem_widgets.plans.plan import StepPlan
    from tfmem_widgets.tf.allocator import rounded

    resident = H100_WEIGHTS + H100_WEIGHTS + H100_WEIGHTS + (8, 4)   # weights, Adam's two slots, its counters
    batch = (120_298 * 512 * 4, 120_298 * 4)
    return StepPlan(120_298, "GPU:0", sum(map(rounded, resident)), {}, sum(map(rounded, batch)),
                    sum(map(rounded, H100_STEP)), H100_STEP, 0, LayerAnatomy({}, 0), True, "--xla_gpu_autotune_level=0",
                    "off", 0.0, 0.0, limit_bytes=H100_LIMIT, limit_source="logical device limit", growth=growth,
                    resident_sizes=resident, batch_sizes=batch, weight_count=len(H100_WEIGHTS))


def test_without_growth_the_steps_buffer_takes_the_rest_of_the_one_region_whole_and_the_plan_says_it_does_not_fit():
    planned = _h100_plan()
    held = planned.batch_sizes   # the probe's arrays, a constant on the GPU
    assert planned.peak_bytes + sum(held) < H100_LIMIT            # by its bytes the step fits, with 97 MiB to spare
    assert planned.take_in_fresh_pool(held=held) is None           # the 1.38 GiB buffer takes the rest whole
    assert not planned.fits(held=held)
    assert "in a fresh process's preallocated pool 1.38 GiB" in "\n".join(planned.lines())   # alone, it fits
    tight = replace(planned, limit_bytes=planned.peak_bytes + 64 * MiB)
    assert "does not fit although 64.00 MiB is spare: the pool is one region of the whole limit" in repr(tight)
    least = planned.least_limit_bytes(held)
    assert least > H100_LIMIT and least % MiB == 0
    assert planned.fits(least, held) and not planned.fits(least - MiB, held)
    # the rest of the region must be 128 MiB or more for the allocator to split it: within a MiB of that
    rest_needed = planned.step_allocations[0] + (128 << 20)
    assert abs((least - planned.resident_bytes - 2 * planned.batch_bytes) - rest_needed) <= 2 * MiB


def test_an_oom_after_a_chunk_handed_out_whole_says_so_and_the_limit_it_needs():
    from tfmem_widgets.tf.allocator import rounded

    asked = rounded(H100_STEP[0])
    held = [18 * MiB, 236 * MiB, 236 * MiB]
    whole = H100_LIMIT - sum(held)                                 # the rest of the one region
    chunks, address = [], 0
    for size, requested in [(s, s) for s in held] + [(whole, H100_STEP[0])]:
        chunks.append(Chunk(address, size, True, requested=requested, op="(XLA program in multi_step_on_iterator)"))
        address += size
    amap = AllocatorMap("GPU_0_bfc", tuple(chunks), (Region(0, address),), "dump")
    report = OomReport("GPU_0_bfc", "Out of memory while trying to allocate 4B.", 256, amap, H100_LIMIT,
                       "logical device limit", 80 * 1024 * MiB, "card", step="multi_step_on_iterator", xla=True)
    assert report.verdict == LIMIT and report.whole_chunk()[0].size == whole
    text = repr(report)
    assert "a chunk handed out whole" in text and "without that this request would fit" in text
    least_mib = -(-(H100_LIMIT + asked + (128 << 20) - whole) // MiB)
    fixes = report.fixes()
    assert any(f.startswith(f"raise the limit to at least {least_mib} MiB: then the allocator splits") for f in fixes)
    assert not any("in use + the XLA program's temporaries" in f for f in fixes)
    assert any(f.startswith("a smaller batch shrinks the XLA program's buffer") for f in fixes)
    # a chunk handed out to the byte asked for tells nothing of the kind
    exact = AllocatorMap("GPU_0_bfc", tuple(Chunk(c.address, c.size, True, requested=c.size) for c in chunks),
                         (Region(0, address),), "dump")
    plain = OomReport("GPU_0_bfc", "Out of memory while trying to allocate 4B.", 256, exact, H100_LIMIT,
                      "logical device limit", 80 * 1024 * MiB, "card", xla=True)
    assert plain.whole_chunk() is None and "a chunk handed out whole" not in repr(plain)


def test_a_fresh_fits_first_step_holds_each_shared_slot_buffer_and_writes_the_slots_their_own_after_the_step():
    # StepPlan.shared_slots (a batch search's plans of a fresh fit: plan.slots_shared_by_fit): the two kernels'
    # momentum and velocity each start from one buffer; before the step the pool holds one chunk of each, and
    # after the step's allocations each slot gets its own (tests/test_plan.py measures both in lab mode).
    planned = replace(_h100_plan(growth=True), shared_slots=((6, 12), (8, 14)))
    held = planned.batch_sizes
    rest, fresh = planned.held_before_step()
    slots = planned.resident_sizes[planned.weight_count:]
    assert len(rest) == len(slots) - 2 and fresh == (512 * 1024 * 4,) * 2 + (1024 * 1024 * 4,) * 2
    assert planned.first_step_bytes == 512 * 1024 * 4 + 1024 * 1024 * 4
    # The peak of that first step: the plan's, and the two shared buffers while the step writes the slots' own.
    edge = planned.peak_bytes + sum(held)
    alone = replace(planned, shared_slots=())
    assert alone.fits(edge + MiB, held, regions=False) and not planned.fits(edge + MiB, held, regions=False)
    assert planned.fits(edge + planned.first_step_bytes, held, regions=False)


class _Planned:
    """A replicas' plan as the search reads it: a peak, judged against a limit."""

    def __init__(self, peak: int):
        self.peak_bytes = peak

    def fits(self, limit: int) -> bool:
        return self.peak_bytes <= limit


def test_the_replicas_search_closes_to_one_row_per_replica_and_says_when_time_ran_out():
    import time

    from tfmem_widgets.plans.need import _search

    def planned(rows):  # a straight line: 10 MiB, and 1 MiB a row per replica; made is the plans' rows
        made.append(rows)
        return _Planned(10 * MiB + rows * MiB)

    for limit_rows, high in ((40.5, 2048), (3000.5, 4096)):  # an edge under 50 rows a replica, one far above
        made = []
        ends = {False: (high, planned(high).peak_bytes)}
        assert _search(planned, int(10 * MiB + limit_rows * MiB), ends, time.perf_counter() + 60)
        fits, fails = ends[True][0], ends[False][0]
        assert fits <= limit_rows < fails and fails - fits <= max(1, int(fits * 0.02))
        assert len(made) <= 8 and len(set(made)) == len(made), made
    nothing = {False: (64, 74 * MiB)}
    assert _search(planned, 5 * MiB, nothing, time.perf_counter() + 60) and nothing == {False: (1, 11 * MiB)}
    late = {False: (4096, planned(4096).peak_bytes)}
    assert not _search(planned, 1000 * MiB, late, time.perf_counter() - 1)  # the deadline passed: not closed
    assert late[True][0] == 1 and late[False][0] == 4096
