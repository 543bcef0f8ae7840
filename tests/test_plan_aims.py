"""How a plan search aims its compiles: by one plan's shapes, across a change of XLA's layout, clear of
the model's widths. Made-up plans whose bytes follow a known rule stand for XLA's (each real compile is
a second or more; tests/test_plan.py compares real plans with the same aims)."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from tfmem_widgets.plans import largest as plan_search
from tfmem_widgets.plans.aborts import BigTensor
from tfmem_widgets.plans.hlo import told_apart, widths_of
from tfmem_widgets.plans.largest import _aim_by_shapes, largest_below, largest_planned_batch
from tfmem_widgets.plans.plan import StepPlan
from tfmem_widgets.plans.scaled import clear_of_widths, planned_by_shapes
from tfmem_widgets.readings.layers import LayerAnatomy

FIXED = 1024  # (bytes in the allocator's 256-byte steps: the made-up plans are what it hands out)
SWITCH = 5000  # from here XLA lays the program out otherwise: 512 bytes a row where it was 256
LIMIT = FIXED + 256 * 6000  # by the small layout's shapes 6,000 rows fit; the edge is the switch's row before


def per_row(batch: int) -> int:
    return 256 if batch < SWITCH else 512


def made_up(batch: int, scaled: bool = True) -> StepPlan:
    """A step of FIXED bytes and per_row(batch) a row, one allocation, its profile as XLA's would read."""
    rows = per_row(batch) * batch
    return StepPlan(batch_size=batch, device="CPU:0", resident_bytes=0, resident_parts={}, batch_bytes=0,
                    step_bytes=FIXED + rows, step_allocations=(FIXED + rows,), worst_take_bytes=FIXED + rows,
                    layers=LayerAnatomy({}, 0), jit_compile=True, xla_flags="", autotuning="none (XLA on a CPU)",
                    trace_seconds=0.0, compile_seconds=0.0, limit_bytes=LIMIT, growth=False,
                    step_profiles=(((FIXED, rows) if scaled else (FIXED + rows, 0),),))


MODEL = SimpleNamespace(variables=[SimpleNamespace(shape=(512, 1024)), SimpleNamespace(shape=(1024, 1024))])


def planner(calls):
    def plan(model, sample, batch, build=False, place=True):  # (the search builds as fit would: build=True)
        calls.append(batch)
        return made_up(batch)
    return plan


def test_a_plans_shapes_say_its_step_at_another_batch_while_the_layout_holds():
    assert planned_by_shapes(made_up(509), 4000).step_bytes == made_up(4000).step_bytes
    assert planned_by_shapes(made_up(509), 6000).step_bytes < made_up(6000).step_bytes  # the layout changed


def test_a_batch_that_divides_a_width_is_not_aimed_at():
    widths = widths_of(MODEL)  # 512, 1024 and 1,048,576 (the kernel's size)
    assert not told_apart(512, widths) and not told_apart(4096, widths) and told_apart(509, widths)
    assert clear_of_widths(4096, widths, 1) == 4095 and clear_of_widths(4095, widths, 1) == 4095


def test_the_search_aims_by_the_shapes_then_by_the_failing_plans_own(monkeypatch):
    calls = []
    monkeypatch.setattr(plan_search, "plan", planner(calls))
    found = largest_planned_batch(MODEL, None, LIMIT, low=1, high=65536)
    # 509's shapes put the edge at 6,000; the plan there fails (its layout), and its own shapes aim at
    # 3,000; the switch itself no plan's shapes foresee: the plans close in on it by quarters of the gap
    assert calls[:3] == [509, 6000, 3000] and len(set(calls)) == len(calls)
    assert found.batch < SWITCH <= found.failure and found.failure - found.batch <= -(-found.batch * 2 // 100)
    assert len(calls) <= 9, calls

    calls.clear()
    unclosed = largest_planned_batch(MODEL, None, LIMIT, low=1, high=65536, closing_plan=False)
    assert len(calls) < len(found.plans) and made_up(unclosed.batch).fits(LIMIT)  # the probe past it checks


def test_a_closing_plan_is_told_before_it_compiles_and_where_it_fits_the_search_ends_at_it(monkeypatch):
    # closing(batch): the plan about to compile lies within a step below a plan that failed, so if it fits
    # it is the answer (a search's probes of it may begin while it compiles: search/plan_first.plan_first).
    # As on an H200: from 5,500 rows XLA lays the step out a little otherwise (260 bytes a row, not 256), so
    # 509's shapes aim at 6,000, which fails, and its own shapes put the edge 93 rows below it. An autotuner
    # chose the kernels (made up here), so the failure at 6,000 is not proven by its bytes: the batch past
    # the answer is to be probed too.
    monkeypatch.setitem(globals(), "per_row", lambda batch: 256 if batch < 5500 else 260)
    calls = []

    def tuned(model, sample, batch, build=False, place=True):
        calls.append(batch)
        return replace(made_up(batch), autotuning="on (the GPU's autotuner)")

    monkeypatch.setattr(plan_search, "plan", tuned)
    found = largest_planned_batch(MODEL, None, LIMIT, low=1, high=65536, closing_plan=False,
                                  closing=lambda batch: calls.append(("closing", batch)))
    assert calls == [509, 6000, ("closing", 5907), 5907] and (found.batch, found.failure) == (5907, 6000)
    assert found.proven_failure is None

    # The same plans with no autotuner: 6,000 fails by its bytes alone, so only the answer is to be probed
    # (plan_first probes it alone after the plans); nothing is told.
    calls.clear()
    monkeypatch.setattr(plan_search, "plan", planner(calls))
    found = largest_planned_batch(MODEL, None, LIMIT, low=1, high=65536, closing_plan=False,
                                  closing=lambda batch: calls.append(("closing", batch)))
    assert calls == [509, 6000, 5907] and found.proven_failure == 6000

    monkeypatch.setitem(globals(), "per_row", lambda batch: 256 if batch < SWITCH else 512)
    calls.clear()  # the plans close in from below (4,800 fits, 5,000 fails): no plan is a closing one
    monkeypatch.setattr(plan_search, "plan", tuned)
    largest_planned_batch(MODEL, None, LIMIT, low=1, high=65536, closing_plan=False,
                          closing=lambda batch: calls.append(("closing", batch)))
    assert calls == [509, 6000, 3000, 4000, 4500, 4800, 5000]


def test_an_oom_reports_batch_is_aimed_by_the_failing_plans_shapes():
    calls = []
    found = largest_below(MODEL, None, made_up(8192), LIMIT, regions=False, planner=planner(calls))
    # 8,192's own layout puts the edge at 3,000 (512 a row): that fits; then up to the switch
    assert calls[0] == 3000 and len(set(calls)) == len(calls)
    assert found.batch < SWITCH <= found.failure and found.failure - found.batch <= -(-found.batch * 2 // 100)
    assert len(calls) <= 8, calls


@pytest.mark.parametrize("scaled", [True, False])
def test_where_nothing_fails_by_a_plans_shapes_the_next_aim_is_sixteen_times_it_at_most(scaled):
    plans = {509: made_up(509, scaled)}  # unscaled: a profile that read every buffer as fixed
    aim = _aim_by_shapes(plans, 509, None, 1 << 20, 11, lambda p: p.fits(LIMIT))
    assert aim == (6000 if scaled else 16 * 509)


# A graph step (jit_compile=False) whose attention scores are (batch, 8, 256, 256): 2^31 elements at 4,096 rows.
SCORES = BigTensor("model/attn/einsum/Einsum", "Einsum", "model/attn", "forward activations", (509, 8, 256, 256),
                   509, 0)
KERNEL = BigTensor("gradient_tape/model/head/MatMul", "MatMul", "model/head", "backward", (1024, 1024), 509, None)


def test_a_graph_steps_tensor_of_2_to_the_31_elements_is_an_abort_at_its_first_batch_and_not_one_below():
    graph = replace(made_up(509), jit_compile=False, big_tensors=(SCORES, KERNEL))
    below, at = replace(graph, batch_size=4095), replace(graph, batch_size=4096)
    assert below.abort_risks == [] and below.fits(LIMIT * 1000)
    [risk] = at.abort_risks
    assert (risk.shape, risk.elements) == ((4096, 8, 256, 256), 2**31) and not at.fits(LIMIT * 1000)
    assert graph.largest_batch_before_abort == 4095 == at.largest_batch_before_abort
    text = repr(at)
    assert "model/attn/einsum/Einsum (Einsum; model/attn, forward activations): shape [4096, 8, 256, 256], " \
           "2,147,483,648 elements" in text and "a batch of at most 4,095, or compile with jit_compile=True" in text
    # one XLA program indexes in 64 bits: nothing aborts
    xla = replace(at, jit_compile=True)
    assert xla.abort_risks == [] and xla.largest_batch_before_abort is None and "ABORTS" not in repr(xla)


def test_a_plan_search_answers_below_the_batch_whose_graph_step_aborts(monkeypatch):
    calls = []

    def plan(model, sample, batch, build=False, place=True):  # (the search builds as fit would: build=True)
        calls.append(batch)
        return replace(made_up(batch), jit_compile=False, big_tensors=(SCORES, KERNEL), limit_bytes=LIMIT * 1000)

    monkeypatch.setattr(plan_search, "plan", plan)
    found = largest_planned_batch(MODEL, None, LIMIT * 1000, low=1, high=65536)
    assert found.aborts_from == 4096 and max(calls) <= 4095 and found.batch <= 4095
    assert found.batch >= 4095 * 0.98 and any("from batch 4,096" in note for note in found.notes)
