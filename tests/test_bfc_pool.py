"""The allocator chunk by chunk (tf/allocator.BfcPool) and a fit's start replayed in it
(search/fit_start.FitStart): made-up pools whose every byte follows the BFC allocator's rules
(bfc_allocator.cc: best fit, the no-split rule, regions that double, neighbours merged when freed).
tests/test_plan.py checks the real thing: a lab search whose plans carry the start its probes meet."""

from dataclasses import replace

from tfmem_widgets.plans.plan import StepPlan
from tfmem_widgets.readings.layers import LayerAnatomy
from tfmem_widgets.search.fit_start import FitStart
from tfmem_widgets.tf.allocator import BfcPool
from tfmem_widgets.tracing.allocator_map import AllocatorMap, Chunk, Region

MiB = 1 << 20


def made_up(batch_sizes=(), resident_sizes=(), weight_count=0, step_allocations=()) -> StepPlan:
    """A plan of made-up sizes: what FitStart.take replays (the variables, the batch, the step's allocations)."""
    return StepPlan(1, "CPU:0", sum(resident_sizes), {}, sum(batch_sizes), sum(step_allocations),
                    tuple(step_allocations), sum(step_allocations), LayerAnatomy({}, 0), True, "", "none (XLA on a CPU)",
                    0.0, 0.0, resident_sizes=tuple(resident_sizes), batch_sizes=tuple(batch_sizes),
                    weight_count=weight_count)


def layout(pool: BfcPool) -> list[list[tuple[int, bool]]]:
    return [[(size // MiB, used) for size, used in chunks] for chunks in pool.regions]


def test_a_request_splits_a_chunk_twice_its_size_takes_a_smaller_one_whole_and_a_new_region_doubles():
    pool = BfcPool(128 * MiB)
    first = pool.take(1 * MiB)                # the first region, 2 MiB: split (2 >= 2 x 1)
    assert layout(pool) == [[(1, True), (1, False)]]
    pool.take(1 * MiB)                        # the 1 MiB left is exactly the request
    pool.take(3 * MiB)                        # nothing free: the next region is 4 MiB, not split (4 < 2 x 3)
    assert layout(pool) == [[(1, True), (1, True)], [(4, True)]]
    pool.give(first)
    assert pool.take(5 * MiB)[0] == 8 * MiB   # the next doubles again: 8 MiB, whole (8 < 10)
    assert pool.take(120 * MiB) is None       # 114 MiB is left under the limit: no room, an OOM
    assert pool.take(100 * MiB)[0] == 114 * MiB  # a region of what the limit leaves (the next, 16 MiB, raised to 128 first)


def test_a_chunk_given_back_merges_with_free_chunks_on_both_sides():
    pool = BfcPool(128 * MiB, first_region=16 * MiB)
    a, b, c = (pool.take(4 * MiB) for _ in range(3))
    pool.give(a)
    pool.give(c)                              # merges with the 4 MiB left after it
    assert layout(pool) == [[(4, False), (4, True), (8, False)]]
    pool.give(b)
    assert layout(pool) == [[(16, False)]]
    assert pool.take(6 * MiB)[0] == 6 * MiB   # best fit: the 16 MiB chunk split


def test_the_smallest_free_chunk_that_holds_a_request_wins_wherever_it_is_and_regions_never_merge():
    pool = BfcPool(128 * MiB, first_region=16 * MiB)
    x, y = pool.take(4 * MiB), pool.take(12 * MiB)   # region 1 (16 MiB) full
    first = pool.take(14 * MiB)                       # region 2: 32 MiB, split
    pool.take(6 * MiB)                                # from its 18 MiB left, split
    pool.give(x)
    pool.give(y)                                      # region 1 one free 16 MiB chunk again
    assert layout(pool) == [[(16, False)], [(14, True), (6, True), (12, False)]]
    # Both free chunks hold 6 MiB: the smaller, later one is taken (best fit, not first fit)
    pool.take(6 * MiB)
    assert layout(pool) == [[(16, False)], [(14, True), (6, True), (6, True), (6, False)]]
    pool.give(first)                                  # no free neighbour in its region: stays apart
    assert layout(pool)[1] == [(14, False), (6, True), (6, True), (6, False)]
    assert pool.take(0) == [0, False] and len(pool.regions) == 2  # no bytes, no chunk
    # 16 MiB free in one region and 14 + 6 in the other: none holds 17 MiB, so a third region (64 MiB)
    assert pool.take(17 * MiB)[0] == 17 * MiB and [sum(c[0] for c in r) // MiB for r in pool.regions] == [16, 32, 64]


def test_a_pools_next_region_is_the_traces_where_one_was_raised_to_fit():
    # One 10 MiB tensor in a fresh pool: its region raised from 2 to 16 MiB (taken whole: 16 < 20), and the
    # next region starts from 16 MiB again (a size raised to fit is not doubled after), not twice the largest.
    fresh = BfcPool(128 * MiB)
    fresh.take(10 * MiB)
    fresh.take(12 * MiB)
    built = AllocatorMap("bfc_cpu_allocator_for_gpu", (Chunk(1 << 30, 16 * MiB, True),), (Region(1 << 30, 16 * MiB),),
                         "trace")
    known = BfcPool.of_map(built, 128 * MiB, next_region=16 * MiB)
    known.take(12 * MiB)
    guessed = BfcPool.of_map(built, 128 * MiB)
    guessed.take(12 * MiB)
    assert layout(known) == layout(fresh) == [[(16, True)], [(16, True)]]
    assert layout(guessed) == [[(16, True)], [(12, True), (20, False)]]  # a 32 MiB region, split


def full_regions(*sizes_mib: int) -> AllocatorMap:
    """A pool whose regions (these sizes, in order) are each one chunk in use."""
    regions, chunks, address = [], [], 1 << 30
    for size in sizes_mib:
        regions.append(Region(address, size * MiB))
        chunks.append(Chunk(address, size * MiB, True))
        address += 2 * size * MiB
    return AllocatorMap("bfc_cpu_allocator_for_gpu", tuple(chunks), tuple(regions), "trace")


def test_a_copy_the_data_takes_for_a_while_leaves_a_region_the_step_cannot_grow_past():
    # The build left regions of 2-16 MiB full (30 MiB). The fit's data (20 MiB) takes a new 32 MiB region
    # whole (32 < 40); its iterator's copy takes a new 64 MiB region and gives it back. The step's 65 MiB
    # buffer finds that free 64 MiB chunk too small and 2 MiB left under the 128 MiB limit: it does not fit.
    # Without the copy 66 MiB are left under the limit, a region the buffer takes whole.
    step = made_up(batch_sizes=(20 * MiB,), step_allocations=(65 * MiB,))
    built = full_regions(2, 4, 8, 16)
    assert FitStart(built, 1.0).take(step, 128 * MiB) is None
    assert FitStart(built, 0.0).take(step, 128 * MiB) == 66 * MiB
    # A smaller step takes the copy's free region, whole (64 < 2 x 40)
    smaller = made_up(batch_sizes=(20 * MiB,), step_allocations=(40 * MiB,))
    assert FitStart(built, 1.0).take(smaller, 128 * MiB) == 64 * MiB


def test_the_optimizers_slots_fill_the_holes_the_build_left_before_a_region_grows():
    built = AllocatorMap("bfc_cpu_allocator_for_gpu", (Chunk(1 << 30, 2 * MiB, True), Chunk((1 << 30) + 2 * MiB, 6 * MiB, False)),
                         (Region(1 << 30, 8 * MiB),), "trace")
    plan = made_up(resident_sizes=(2 * MiB, 2 * MiB, 2 * MiB), weight_count=1, step_allocations=(3 * MiB // 2,))
    pool = BfcPool.of_map(built, 64 * MiB)
    assert layout(pool) == [[(2, True), (6, False)]]
    # The two slots split the 6 MiB hole (each chunk at least twice 2 MiB); the step's 1.5 MiB takes the
    # 2 MiB left whole (2 < 3). Had a region grown, it would be 16 MiB, split: 1.5 MiB.
    assert FitStart(built, 0.0).take(plan, 64 * MiB) == 2 * MiB


def test_slots_that_share_one_buffer_hold_one_chunk_before_the_step_and_each_their_own_after_it():
    # StepPlan.shared_slots, as a fresh fit on the CPU has them (tests/test_plan.py traces it): the two slots
    # share one 2 MiB chunk before the step, so the step's 1.5 MiB splits the 4 MiB hole left (4 >= 2 x 1.5)
    # where, with a chunk each, it took the last 2 MiB whole. After the step each slot gets its own buffer:
    # the first takes the 2.5 MiB left whole, the second finds no room in the one region the 8 MiB limit
    # allows. The same plan with a chunk each fits.
    built = AllocatorMap("bfc_cpu_allocator_for_gpu", (Chunk(1 << 30, 2 * MiB, True), Chunk((1 << 30) + 2 * MiB, 6 * MiB, False)),
                         (Region(1 << 30, 8 * MiB),), "trace")
    alone = made_up(resident_sizes=(2 * MiB, 2 * MiB, 2 * MiB), weight_count=1, step_allocations=(3 * MiB // 2,))
    shared = replace(alone, shared_slots=((1, 2),))
    assert shared.held_before_step() == ((2 * MiB,), (2 * MiB, 2 * MiB)) and shared.first_step_bytes == 2 * MiB
    assert FitStart(built, 0.0).take(alone, 8 * MiB) == 2 * MiB
    assert FitStart(built, 0.0).take(shared, 8 * MiB) is None
    assert FitStart(built, 0.0).take(shared, 64 * MiB) == 3 * MiB // 2  # with room for a region more: split

