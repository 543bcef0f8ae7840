"""What will fit: the largest batch, found in fresh lab-mode processes (issue: what will fit).

The searches run real Keras models in real processes; the functions are defined inside each
test, as in a notebook, so they travel by value.
"""

import time

import psutil
import pytest

import tfmem_widgets
from conftest import search_functions
from tfmem_widgets.errors import ArgumentError, FreshRunError
from tfmem_widgets.search.batch_search import BatchSearch, Probe
from tfmem_widgets.search.next_probe import MARGIN_PROBES

MiB = 1 << 20


def _children():
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def test_the_largest_batch_is_found_near_the_edge_in_few_probes(monkeypatch):
    from tfmem_widgets.search import warm

    build_model, make_batch = search_functions()
    search = tfmem_widgets.max_batch_size(build_model, make_batch, setup={"lab_mb": 128}, high=16384,
                                          progress=False, margin=0.1)
    safe, failure = search.edge  # where fitting was first lost: a batch that trained, a larger one that did not
    assert safe is not None and failure is not None and safe < failure

    def step(batch):
        return max(1, -(-batch * search.resolution // 1))

    # The search converged: a batch that trained and one that did not, within the resolution of each other. Where
    # fitting is monotone that is the edge; where it is not (fresh-clone CI saw a margin's probe at 4,960 run out of
    # memory after 6,000 had trained, which made the edge 4,374 / 4,960), the search says so.
    assert any(0 < f.batch - p.batch <= step(p.batch) for p in search.fitted for f in search.failed)
    assert failure - safe <= step(safe) if search.monotone else "warning: not monotone" in repr(search)
    trained = next(p for p in search.probes if p.batch == safe)
    assert trained.fits and 0 < trained.peak_bytes <= 128 * MiB  # the allocator's exact peak, under the limit
    assert (search.limit_bytes, search.limit_source) == (128 * MiB, "lab mode")
    assert all(p.verdict in ("fragmentation", "shortage", "limit") and not p.died for p in search.failed)
    # one probe past the edge; if it trained, fitting is not monotone there and the search says so
    past = max(p.batch for p in search.probes)
    assert past > failure
    if search.largest > failure:
        assert not search.monotone and "warning: not monotone" in repr(search)
    text = repr(search)
    assert f"largest batch that trained: {search.largest:,}" in text and "lab mode 128 MB, CPU kernels" in text
    # With a margin, the recommended batch (measured: its peak left 10% free, 10% below every failure; a probe is
    # aimed there where none was near) was probed again in another process of the same setup before the search
    # ended; its peaks left 10% free in both. A
    # batch recommended by one probe is not enough: fresh-clone CI saw a recommended batch 2% under the first
    # failure, whose probe had peaked at 84% of the limit, run out of memory in the next process; without a
    # margin the edge itself (5,890) did the same, and the line's 10% margin (5,094) ran out of memory here too.
    # Only where every margin probe was spent (two second processes disagreeing with the first) may it stand on
    # one probe, and then its text says so.
    recommended = search.recommended
    assert recommended is not None and recommended <= 0.9 * failure
    assert search.trained_at(recommended) >= 2 or (
        search.margin_probes == MARGIN_PROBES and f"the recommended batch {recommended:,} was measured by one probe only"
        in repr(search))
    assert all(p.peak_bytes <= 0.9 * 128 * MiB for p in search.fitted if p.batch == recommended)
    assert len(search.probes) - search.margin_probes <= 12 and search.margin_probes <= MARGIN_PROBES
    search.margin = 0.0
    assert search.recommended == safe  # no margin: below every failure
    # More probes join the search, each in a fresh process; none is started to wait after the last.
    started = []
    waiting = warm._Waiting.__init__
    monkeypatch.setattr(warm._Waiting, "__init__", lambda self, *args: (started.append(1), waiting(self, *args))[1])
    count = len(search.probes)
    (again,) = search.probe(safe // 2)
    assert again.batch == safe // 2 and again.fits and len(search.probes) == count + 1
    assert len(started) == 1  # its own process only
    assert not _children()


def test_the_probes_say_what_they_show():
    # A search's figures from its probes (no process): the edge, the line, a margin, non-monotone.
    probes = [Probe(1, 30 * MiB, 1.0), Probe(1000, 50 * MiB, 1.0), Probe(4000, None, 2.0, "limit", 8 * MiB),
              Probe(2000, 70 * MiB, 1.0), Probe(3000, None, 2.0, "fragmentation", 6 * MiB),
              Probe(3500, 100 * MiB, 1.0)]
    search = BatchSearch(probes, 1, 8192, 2, 0.1, 0.02, limit_bytes=128 * MiB, limit_source="lab mode",
                         where="lab mode 128 MB")
    assert (search.largest, search.first_failure, search.edge) == (3500, 4000, (2000, 3000))
    assert search.not_monotone == [(3000, 3500)] and not search.monotone
    fixed, per_example = search.peak_model()
    assert per_example > 0 and search.needs_bytes(2000) == int(fixed + per_example * 2000)
    # with a 10% margin: the largest batch measured to peak under 90% of the limit (115.2 MiB), below every
    # failure: 2,000 (70 MiB); 3,500 (100 MiB) is above the failure at 3,000
    assert search.recommended == 2000
    search.probes.append(Probe(2500, 120 * MiB, 1.0))  # trained, but its peak leaves less than 10%
    assert search.edge == (2500, 3000) and search.recommended == 2000
    search.probes.append(Probe(2800, 100 * MiB, 1.0))  # its peak leaves 10%, but it lies within 10% of the failure
    assert search.recommended == 2000
    search.probes.append(Probe(2650, 100 * MiB, 1.0))  # 10% below the failure at 3,000 (2,700)
    assert search.recommended == 2650
    search.probes.append(Probe(2650, 117 * MiB, 1.0))  # another process's peak took the margin there
    assert search.recommended == 2000 and search.measured_peak(2650) == 117 * MiB
    del search.probes[-3:]
    search.margin = 0.8  # no probe left 80% of the limit free (the smallest peak, 30 MiB, is 23%)
    assert search.recommended is None and "no batch whose probes' peaks left 80% of the limit free, 80% below every " \
        "failure" in repr(search)
    search.margin = 0.1
    text = repr(search)
    assert "warning: not monotone: 3,500 trained although 3,000 ran out of memory" in text
    assert "recommended, its measured peaks leaving 10% of the limit free, 10% below every failure: 2,000" in text
    # One batch that trained in one fresh process and ran out of memory in another is not monotone either.
    search.probes[:] = [Probe(1, 30 * MiB, 1.0), Probe(2000, 70 * MiB, 1.0), Probe(2000, None, 2.0, "limit"),
                        Probe(2040, None, 2.0, "limit"), Probe(2000, None, 2.0, "limit")]
    assert search.not_monotone == [(2000, 2000)] and search.edge == (1, 2000)  # the batch once, for its two failures
    text = repr(search)
    assert text.count("warning: not monotone") == 1
    assert "warning: not monotone: 2,000 trained in one fresh process and ran out of memory in another" in text
    search.probes.append(Probe(2100, 80 * MiB, 1.0))  # a larger batch trained too: the pair names it
    assert search.not_monotone == [(2000, 2100), (2040, 2100)]
    assert "warning: not monotone: 2,100 trained although 2,000 ran out of memory" in repr(search)
    search.probes[:] = [p for p in search.probes if p.batch != 2100 and (p.fits or p.batch != 2000)]
    assert search.monotone and "not monotone" not in repr(search)


def test_with_a_margin_a_probe_is_aimed_at_it_and_the_recommended_batch_is_probed_again():
    # The search's own rule on made-up probes (a fresh process each stands behind the real ones, as the
    # first test runs them): one probe's peak does not make a batch safe, a second process's must agree.
    from tfmem_widgets.search.next_probe import margin_aim, settle_recommended
    from tfmem_widgets.search.progress import LineProgress

    def settled(measured, peaks, max_probes=16):
        search = BatchSearch([Probe(b, peak * MiB, 1.0) for b, peak in measured] + [Probe(3400, None, 2.0, "limit")],
                             1, 8192, 2, 0.1, 0.02, limit_bytes=128 * MiB, limit_source="lab mode",
                             where="lab mode 128 MB")
        asked = []

        def probe_one(batch, ahead=True):
            asked.append((batch, ahead))
            peak = peaks.pop(0)
            search.probes.append(Probe(batch, peak * MiB, 1.0) if peak else Probe(batch, None, 2.0, "fragmentation"))
            return search.probes[-1]

        settle_recommended(search, probe_one, LineProgress(quiet=True), max_probes)
        return search, asked

    # Measured far below the margin (1,000 at 50 MiB): a probe aimed at it, a 2% step under 10% below the
    # failure at 3,400 (the line puts 90% of the limit higher, at 4,256), then that batch again, in another process.
    search, asked = settled([(1, 30), (1000, 50)], [100, 101])
    assert margin_aim(search)[0] == 2998 and (search.recommended, asked) == (2998, [(2998, True), (2998, False)])
    assert "10% below every failure: 2,998 (in each of 2 fresh processes)" in repr(search)
    assert "batch 2,998 was probed for the 10% margin: a 2% step under 10% below the smallest failure" in repr(search)
    # The aimed batch's peak takes the margin: a second probe halfway down to the batch recommended, then that again.
    search, asked = settled([(1, 30), (1000, 50)], [120, 110, 111])
    assert (search.recommended, asked) == (1999, [(2998, True), (1999, True), (1999, False)])
    assert "batch 1,999 was probed for the 10% margin: halfway from 1,000 to 2,998, whose peak took the margin" \
        in repr(search)
    # A batch at or under the aim took the margin already (near the limit peaks stop following the line):
    # halfway from the batch recommended to it.
    search, asked = settled([(1, 30), (1000, 50), (2000, 118)], [100, 101])
    assert (search.recommended, [b for b, _ in asked]) == (1500, [1500, 1500])
    assert "batch 1,500 was probed for the 10% margin: halfway from 1,000 to 2,000, whose peak took the margin" \
        in repr(search)
    # Its second probe runs out of memory: a failure now, 10% below which a second aim lands, probed twice.
    search, asked = settled([(1, 30), (1000, 50)], [100, None, 95, 96])
    second = asked[2][0]
    assert second <= 0.9 * 2998 and (search.recommended, [b for b, _ in asked]) == (second, [2998, 2998, second, second])
    assert "batch 2,998, recommended by its first probe, ran out of memory in a second fresh process" in repr(search)
    assert search.edge == (second, 2998)
    # Its second peak takes the margin: the highest of its peaks counts, and a second aim lands lower.
    search, asked = settled([(1, 30), (1000, 50), (1000, 51)], [100, 118, 90, 91])
    assert search.limit_needed_bytes(2998) == int(118 * MiB / 0.9)
    assert "batch 2,998, recommended by its first probe, peaked at 118.00 MiB in a second fresh process, over " \
        "90% of the limit" in repr(search)
    assert search.recommended == asked[2][0] == asked[3][0] < 2998 and len(asked) == 4
    # Seen in fresh-clone CI: the first aim's peak took the margin, the second's held once and not in its second
    # process, a third aim landed between: it too is probed again, the last probe being kept for that.
    search, asked = settled([(1, 30), (1000, 50)], [120, 110, 118, 105, 106])
    third = asked[3][0]
    assert [b for b, _ in asked] == [2998, asked[1][0], asked[1][0], third, third] and 1000 < third < asked[1][0]
    assert search.recommended == third and search.trained_at(third) == 2 and search.margin_probes == MARGIN_PROBES
    assert "was measured by one probe only" not in repr(search)
    # Its second process disagrees too and no probe is left: the batch below stands on one probe, and says so.
    search, asked = settled([(1, 30), (1000, 50)], [120, 110, 118, 105, 117])
    assert search.recommended == 1000 and "the recommended batch 1,000 was measured by one probe only" in repr(search)
    # No aim takes the last probe max_probes leaves: it goes to the recommended batch's second process.
    search, asked = settled([(1, 30), (1000, 50)], [120, 51], max_probes=5)  # (3 made: 2 left)
    assert [b for b, _ in asked] == [2998, 1000] and search.recommended == 1000 and search.trained_at(1000) == 2
    # Measured within a step of the margin's batch already: only probed again.
    search, asked = settled([(1, 30), (3000, 110)], [109])
    assert (search.recommended, asked) == (3000, [(3000, False)])
    search, asked = settled([(1, 30), (1000, 50)], [], max_probes=3)  # no probe left: said, not probed
    assert (search.recommended, asked) == (1000, [])
    assert "the recommended batch again was not probed: max_probes=3 reached" in repr(search)
    search.margin = 0.0  # (no margin: the search adds nothing; the recommended batch is the edge)
    assert margin_aim(search) is None and search.recommended == 1000
    # A batch below the recommended one whose peak took the margin (near the edge peaks need not rise with the
    # batch) does not hold the aim down: it aims 10% below the failure, a step under.
    search, asked = settled([(1, 30), (1000, 120), (2000, 60), (2500, 80)], [90, 91])
    assert (search.recommended, [b for b, _ in asked]) == (2998, [2998, 2998]) and search.margin_probes == 2
    # Nothing measured within the margin, no line (one batch trained, as after a plan search) and that batch
    # under the aim: the aim goes the margin below it.
    search, asked = settled([(1000, 120)], [100, 101])
    assert (search.recommended, asked) == (900, [(900, True), (900, False)])
    assert "batch 900 was probed for the 10% margin: 10% below 1,000, whose peak took the margin" in repr(search)
    # A batch's peak that took the margin above the aim leaves the aim where the line and the failure put it.
    search, asked = settled([(1, 30), (1000, 50), (3300, 126)], [100, 101])
    assert asked[0][0] > (1000 + 3300) // 2 and "a 2% step under where the line through the peaks" in repr(search)
    # Peaks that count a chunk taken whole (measured on an H200 under a 1000 MB limit: 51,628 and 54,367 rows both
    # at 992.2 MiB): alike at two batches, the line through them is not used, nothing left the margin free,
    # and the search says why rather than aim at a batch of 1.
    search, asked = settled([(3300, 125)], [125, 125])
    assert (search.recommended, [b for b, _ in asked]) == (None, [2998, int(2998 * 0.9)])
    assert "batches 2,698 and 2,998 peaked alike, at 125.00 MiB: a step's buffer took a free chunk whole" \
        in repr(search)


def _made_up_search(monkeypatch, edge, peak, raise_at=None):
    """max_batch_size itself, its fresh processes made up (the real ones: the first test): a batch up to `edge`
    trains with the peak peak(batch), one above runs out of memory; the probe that would be the `raise_at`th
    raises that exception instead."""
    import contextlib

    import tfmem_widgets.search.batch_search as search_module

    @contextlib.contextmanager
    def probing(search, pairs=False):
        def probe_one(batch, ahead=True):
            if raise_at is not None and len(search.probes) + 1 == raise_at[0]:
                raise raise_at[1]
            probe = Probe(batch, peak(batch), 1.0) if batch <= edge else Probe(batch, None, 2.0, "limit")
            if search.limit_bytes is None:
                search.limit_bytes, search.limit_source = 128 * MiB, "lab mode"
            search.probes.append(probe)
            return probe

        probe_one.pair = probe_one.begin_pair = None
        yield probe_one

    monkeypatch.setattr(search_module, "probing", probing)
    return tfmem_widgets.max_batch_size(lambda: None, lambda n: None, setup={"lab_mb": 128}, high=16384,
                                        margin=0.1, progress=False, method="probe")


def test_the_margins_probes_follow_the_edge_and_a_stop_there_keeps_the_edge(monkeypatch):
    def peak(batch):
        return int(30 * MiB + batch * 24 * 1024)  # 128 MiB at 4,266 rows

    search = _made_up_search(monkeypatch, 4200, peak)
    own = len(search.probes) - search.margin_probes
    safe, failure = search.edge
    assert failure - safe <= max(1, -(-safe * search.resolution // 1)) and own <= 12
    recommended = search.recommended
    assert search.margin_probes == 2 and search.trained_at(recommended) == 2 and recommended <= 0.9 * failure
    # a lab search marks what its probes measured (search/search_text.py): another run on this CPU differs
    assert f"{len(search.probes)} (this CPU) probes in" in repr(search) and "(2 (this CPU) of them for the margin" \
        in repr(search)
    # Ctrl-C in the margin's second probe: the edge stands, the search says where it stopped.
    search = _made_up_search(monkeypatch, 4200, peak, raise_at=(own + 2, KeyboardInterrupt()))
    assert search.interrupted and search.edge == (safe, failure) and search.margin_probes == 1
    assert "interrupted while probing for the margin, after the edge was known: the recommended batch was " \
        "measured by 1 probe(s)" in repr(search)
    # Ctrl-C before the first probe ended: nothing was measured, and nothing is said to have run out of memory.
    search = _made_up_search(monkeypatch, 4200, peak, raise_at=(1, KeyboardInterrupt()))
    assert search.interrupted and search.probes == [] and search.largest is None
    assert "nothing measured: the search was interrupted before its first probe ended" in repr(search)
    assert "out of memory" not in repr(search).split("note:")[0]
    # A margin probe's process failing (not an OOM) ends the margin's probes with a note; the edge stands.
    search = _made_up_search(monkeypatch, 4200, peak, raise_at=(own + 2, FreshRunError("max_batch_size: the probe "
                                                                                       "at batch 3,600 ran past 600 s")))
    assert not search.interrupted and search.edge == (safe, failure)
    assert "the margin's probes stopped: max_batch_size: the probe at batch 3,600 ran past 600 s" in repr(search)
    assert f"the recommended batch {search.recommended:,} was measured by one probe only" in repr(search)


def test_an_xla_steps_probe_ends_at_the_allocators_first_refusal():
    # One XLA program: nothing else runs to free memory while TensorFlow retries for 10 s, so the probe's
    # process ends at the first refusal (a graph step's probes keep the retry: other ops free memory then).
    from tfmem_widgets.search.probe import REFUSED

    build_model, make_batch = search_functions(jit=True)
    search = tfmem_widgets.max_batch_size(build_model, make_batch, setup={"lab_mb": 128}, high=16384,
                                          progress=False, method="probe")
    safe, failure = search.edge
    assert safe is not None and failure is not None and failure - safe <= max(1, -(-safe * search.resolution // 1))
    # (how each ended is read from its exit code, which only the refusal's watcher gives; no timing asserted)
    assert search.failed and all(p.died == REFUSED for p in search.failed), [(p.batch, p.died) for p in search.failed]
    assert "the process ended at the allocator's first refusal" in repr(search)
    assert not _children()


def test_a_probe_killed_after_its_oom_says_how_and_a_search_leaves_last_oom_alone():
    # A process that dies after an OOM (as an XLA program's OOM ends one in lab mode): the probe's death is
    # a field of the probe, read from how the process ended (never from a message), its OOM from the dump
    # the process left; and the kernel's last_oom() is not the search's to change.
    build_model, _ = search_functions()

    def make_batch(n):
        import os

        import numpy as np

        if n > 8:
            import tensorflow as tf

            try:
                tf.zeros((128 << 18,))  # 128 MiB in a 64 MB lab: an OOM, and TensorFlow's dump of it
            except tf.errors.ResourceExhaustedError:
                os.abort()
        return np.ones((n, 512), "float32"), np.ones((n, 1), "float32")

    before = tfmem_widgets.last_oom()
    search = tfmem_widgets.max_batch_size(build_model, make_batch, setup={"lab_mb": 64}, low=8, high=8,
                                          progress=False)
    assert search.largest == 8
    (killed,) = search.probe(16)
    assert not killed.fits and killed.died == "was killed by SIGABRT (signal 6)", killed
    assert killed.verdict is not None and killed.limit_bytes == 64 * MiB  # the dump, read with the probe's setup
    assert tfmem_widgets.last_oom() is before
    assert not _children()


def test_bad_input_is_one_line_and_starts_nothing():
    build_model, make_batch = search_functions()
    for kwargs, words in (({"low": 8, "high": 4}, "low (8) is above high (4)"),
                          ({"margin": 1.5}, "margin must be"), ({"steps": 0}, "steps must be"),
                          ({"setup": {"lab": 64}}, "unknown setup option"), ({"progress": "yes"}, "progress must")):
        with pytest.raises(ArgumentError) as caught:
            tfmem_widgets.max_batch_size(build_model, make_batch, **kwargs)
        assert words in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ArgumentError) as caught:
        tfmem_widgets.max_batch_size("model", make_batch)
    assert "build_model must be a function" in str(caught.value)
    assert not _children()


def test_a_failing_function_a_wrong_batch_a_model_too_big_and_a_hang_are_one_line_each():
    build_model, make_batch = search_functions()

    def raising_model():
        raise ValueError("no such layer")

    def short_batch(n):
        import numpy as np

        return np.ones((max(1, n // 2), 512), "float32"), np.ones((max(1, n // 2), 1), "float32")

    def hanging_model():
        import time as clock

        clock.sleep(600)

    big_model, _ = search_functions(width=4096)   # 64 MiB of kernel: more than the 48 MB lab
    wide_model, _ = search_functions(width=1536)  # it is built; with Adam's slots and gradients a step is not
    cases = [
        (dict(build_model=raising_model, make_batch=make_batch), ArgumentError,
         "build_model() raised ValueError: no such layer"),
        (dict(build_model=build_model, make_batch=short_batch, low=8), ArgumentError,
         "make_batch(8) returned x as a ndarray of shape (4, 512): 4 rows; x and y must hold exactly 8 rows each"),
        (dict(build_model=big_model, make_batch=make_batch), ArgumentError, "the model alone does not fit"),
        (dict(build_model=wide_model, make_batch=make_batch), ArgumentError, "a batch of 1 does not fit"),
        (dict(build_model=hanging_model, make_batch=make_batch, probe_timeout=20), FreshRunError,
         "ran past 20 s and was stopped"),
    ]
    for kwargs, kind, words in cases:
        started = time.monotonic()
        with pytest.raises(kind) as caught:
            tfmem_widgets.max_batch_size(setup={"lab_mb": 48}, progress=False, **kwargs)
        assert words in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
        assert time.monotonic() - started < 120
        assert not _children()  # no probe process left behind


def test_a_model_built_under_a_strategy_is_searched_from_a_row_per_replica():
    # A batch of 1 over two replicas gives the second an empty batch, which tf.distribute's step cannot add up
    # (an AddN of [1, 512] and [0, 512]): the search begins at one row per replica and says so; the plan search
    # plans one device's step, so for such a model it says why the probes alone decide.
    build_model, make_batch = search_functions(width=256, replicas=2)
    setup = {"lab_mb": 64, "cpus": 2}
    search = tfmem_widgets.max_batch_size(build_model, make_batch, setup=setup, high=64, progress=False, method="plan")
    assert search.probes[0].batch == 2 and search.low == 2 and search.largest == 64 and not search.failed
    notes = [str(note) for note in search.notes]
    assert any("runs 2 replicas, and Keras' fit takes a global batch that divides by them: the search began at 2, "
               "not 1" in note for note in notes), notes
    assert any("built under a strategy of 2 replicas" in note for note in notes), notes
    assert not search.plans
    with pytest.raises(ArgumentError) as caught:  # no batch to go on with: one line
        tfmem_widgets.max_batch_size(build_model, make_batch, setup=setup, high=1, progress=False, method="probe")
    text = str(caught.value)
    assert "a batch of 1 leaves a replica without a row" in text and "give low=2" in text and "\n" not in text, text
    assert not _children()


def test_a_strategy_models_search_probes_only_global_batches_that_divide_by_its_replicas():
    # Keras' fit under a strategy reduces its first batch across the replicas to build the model: 3 rows over 2
    # replicas (or any odd batch) raise InvalidArgumentError before a step, which no search can read as fitting or
    # not. The search begins at the next multiple and probes only multiples, to the edge.
    build_model, make_batch = search_functions(width=256, replicas=2)
    search = tfmem_widgets.max_batch_size(build_model, make_batch, setup={"lab_mb": 64, "cpus": 2}, low=3, high=16384,
                                          resolution=0.1, progress=False, method="probe")
    assert search.low == 4 and search.replicas == 2
    assert all(p.batch % 2 == 0 for p in search.probes), [p.batch for p in search.probes]
    assert search.failed and search.largest < search.first_failure <= search.largest + max(2, 0.1 * search.largest)
    assert "batches of 2 replicas' multiples" in repr(search)
    with pytest.raises(ArgumentError) as caught:  # asked by hand: one line, nothing probed
        search.probe(4097)
    assert "does not divide by the 2 replicas" in str(caught.value) and "\n" not in str(caught.value)
    assert not _children()


def test_a_graph_errors_cause_is_its_line_before_the_failed_node_not_graph_execution_error():
    import tensorflow as tf

    from tfmem_widgets.search.probe import cause_line

    @tf.function(input_signature=[tf.TensorSpec(None), tf.TensorSpec(None)])
    def product(a, b):
        return tf.matmul(a, b)

    with pytest.raises(tf.errors.InvalidArgumentError) as caught:  # shapes known only when it runs
        product(tf.ones((8, 3)), tf.ones((4, 2)))
    assert str(caught.value).startswith("Graph execution error")
    assert "Matrix size-incompatible" in cause_line(caught.value) and "\n" not in cause_line(caught.value)


def test_every_probe_failure_names_its_cause_in_one_line():
    # (defined here: the probe's process gets the functions by value, as it gets a notebook's)
    build_model, _ = search_functions()

    def _ragged(n):
        import numpy as np
        import tensorflow as tf

        return tf.ragged.constant([[1.0] * (1 + k % 3) for k in range(n)]), np.ones((n, 1), "float32")


    def _exits(n):
        raise SystemExit(2)


    def _interrupted(n):
        raise KeyboardInterrupt


    def _dies(n):
        import os

        os._exit(3)


    def _more_labels(n):
        import numpy as np

        return np.ones((n, 512), "float32"), np.ones((2 * n, 1), "float32")


    def _narrow(n):
        import numpy as np

        return np.ones((n, 128), "float32"), np.ones((n, 1), "float32")


    def _lists(n):
        return [[0.5] * 512 for _ in range(n)], [[1.0] for _ in range(n)]

    cases = [
        (_ragged, ArgumentError, "the train step at batch 8 raised"),
        (_exits, ArgumentError, "make_batch(8) raised SystemExit: 2"),
        (_interrupted, ArgumentError, "make_batch(8) raised KeyboardInterrupt"),
        (_dies, FreshRunError, "its process ended with exit code 3; it wrote nothing"),
        (_more_labels, ArgumentError, "make_batch(8) returned y as a ndarray of shape (16, 1): 16 rows"),
        (_narrow, ArgumentError, "incompatible"),   # Keras' cause, not its 'Exception encountered when calling' line
    ]
    for make_batch, kind, words in cases:
        with pytest.raises(kind) as caught:
            tfmem_widgets.max_batch_size(build_model, make_batch, setup={"lab_mb": 64}, low=8, high=8,
                                         progress=False, method="probe")
        said = str(caught.value)
        assert words in said and "\n" not in said and "output is above" not in said, said
        assert not _children()
    found = tfmem_widgets.max_batch_size(build_model, _lists, setup={"lab_mb": 64}, low=8, high=8, progress=False,
                                         method="probe")
    assert found.largest == 8 and found.probes[0].fits   # Python lists are a batch Keras takes


def test_the_batch_magic_needs_both_functions_and_changes_no_name(shell):
    from IPython.core.error import UsageError

    shell.user_ns.pop("build_model", None)
    with pytest.raises(UsageError) as caught:
        shell.run_cell_magic("tfmem", "batch --lab 64", "def build_model():\n    return None\n")
    assert "must define make_batch()" in str(caught.value) and "\n" not in str(caught.value)
    assert "build_model" not in shell.user_ns  # the cell ran in a namespace of its own
    with pytest.raises(UsageError) as caught:
        shell.run_cell_magic("tfmem", "batch --low 9 --high 3", "def build_model(): pass\ndef make_batch(n): pass\n")
    assert "low (9) is above high (3)" in str(caught.value)
    with pytest.raises(UsageError) as caught:
        shell.run_cell_magic("tfmem", "batch --margin 2", "def build_model(): pass\n")
    assert "--margin" in str(caught.value)


def test_the_batch_magic_follows_timeit(shell, capsys):
    from IPython.core.error import UsageError

    cell = """
def build_model():
    import keras
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    return model

def make_batch(n):
    import numpy as np
    return np.ones((n, 16), "float32"), np.ones((n, 1), "float32")
"""
    capsys.readouterr()
    found = shell.run_cell_magic("tfmem", "batch --lab 64 --low 8 --high 8 --probe -o -q -v found_search", cell)
    assert isinstance(found, BatchSearch) and shell.user_ns["found_search"] is found and found.largest == 8
    assert "tfmem batch search" not in capsys.readouterr().out  # -q: not shown (its probes' lines are the search's)
    with pytest.raises(UsageError) as caught:
        shell.run_cell_magic("tfmem", "batch --lab 64 -v 2bad", cell)
    assert "argument -v: expected a Python name" in str(caught.value) and "\n" not in str(caught.value)
    assert not _children() and capsys.readouterr().out == ""


def test_a_batch_whose_plan_needs_more_than_the_limit_by_its_bytes_is_a_failure_without_a_probe():
    # A search's figures (no process): a failure known from a plan, not probed, bounds the edge like one.
    search = BatchSearch([Probe(1, 30 * MiB, 1.0), Probe(3000, 100 * MiB, 1.0)], 1, 8192, 2, 0.0, 0.02,
                         limit_bytes=128 * MiB, limit_source="logical device limit", where="GPU:0")
    assert search.edge == (3000, None)
    search.planned_failure = 3050
    assert (search.largest, search.first_failure, search.edge) == (3000, 3050, (3000, 3050))
    assert search.failed == [] and "3,050 cannot train by its plan (not probed)" in repr(search)
    search.probes.append(Probe(3050, None, 2.0, "limit", 8 * MiB))  # probed after all: said as measured
    assert search.edge == (3000, 3050) and "3,050 ran out of memory" in repr(search)


def test_two_probes_side_by_side_count_their_shared_seconds_once():
    # A pair's probes each count their own seconds from their common start; the search's time counts the
    # seconds they shared once (search/warm.probing adds the shorter one to overlap_seconds).
    search = BatchSearch([Probe(100, 10 * MiB, 7.0), Probe(102, None, 7.4, "limit")], 1, 8192, 2, 0.0, 0.02,
                         where="GPU:0", overlap_seconds=7.0)
    assert search.seconds == pytest.approx(7.4)
    assert "2 probes in 7 s, each in a fresh process (two side by side):" in repr(search)


def test_the_plans_answer_is_probed_once_where_the_batch_past_it_is_proven_not_to_fit(monkeypatch, tmp_path):
    # The planning process (a fresh TensorFlow process, on a GPU in this case) is the seam: what it returns
    # is given here; the decision after it is the real code. A preallocated GPU pool (a logical device
    # limit) judges a plan by its bytes, and a step never takes less than its plan.
    from types import SimpleNamespace

    import tfmem_widgets.fresh.run as fresh
    from tfmem_widgets.plans.largest import PlanSearch
    from tfmem_widgets.search.plan_first import DONE, UP, plan_first
    from tfmem_widgets.search.progress import LineProgress

    def searched(proven, margin=0.0):
        found = PlanSearch(117_000, 119_000, [], 30.0, True, 2000 * 1_000_000, "logical device limit",
                           proven_failure=proven, proven_bytes=None if proven is None else 2_001_000_000)
        monkeypatch.setattr(fresh, "run_checked", lambda *a, **k: SimpleNamespace(values={"found": found}))
        search = BatchSearch([], 1, 262144, 2, margin, 0.02, where="GPU:0", _run=(b"", {}, {}, 60))
        probed = []

        def probe_one(batch, ahead=True):
            probed.append((batch, ahead))  # ahead: a process is started to wait for a probe after this one
            probe = Probe(batch, 1_900_000_000, 15.0) if batch <= 117_000 else Probe(batch, None, 25.0, "limit")
            search.probes.append(probe)
            return probe

        probe_one.path = tmp_path / "functions.pickle"
        return search, plan_first(search, probe_one, LineProgress(quiet=True), auto=False, max_probes=16), probed

    search, then, probed = searched(119_000)
    assert (then, probed, search.edge) == (DONE, [(117_000, False)], (117_000, 119_000))  # the only probe: none ahead
    assert "batch 119,000 was not probed: its plan needs 1.86 GiB by its bytes alone" in repr(search)
    search, then, probed = searched(None)  # an autotuner or the pool's regions decide: the probe past it runs
    assert (then, probed, search.edge) == (DONE, [(117_000, True), (119_340, False)], (117_000, 119_340))
    assert then != UP and search.planned_failure is None
    # With a margin its probes follow the edge: a process waits after each of these (its import done ahead).
    search, then, probed = searched(119_000, margin=0.05)
    assert (then, probed) == (DONE, [(117_000, True)])
    search, then, probed = searched(None, margin=0.05)
    assert (then, probed) == (DONE, [(117_000, True), (119_340, True)])


def _gpu_probes(search, edge):
    """Made-up probes (a fresh process each stands behind the real ones): a batch up to `edge` trains, one above
    it runs out of memory. Returns probe(batch), probe_one(batch, ahead=True) as warm.probing gives it, the
    batches probe_one probed, and their `ahead` flags (a process started to wait for a probe after each)."""
    single, aheads = [], []

    def probe(batch):
        probe = Probe(batch, 1_900_000_000, 15.0) if batch <= edge else Probe(batch, None, 25.0, "limit")
        search.probes.append(probe)
        return probe

    def probe_one(batch, ahead=True):
        single.append(batch)
        aheads.append(ahead)
        return probe(batch)

    return probe, probe_one, single, aheads


def test_the_plans_answer_and_the_batch_past_it_are_probed_side_by_side_where_there_is_room(monkeypatch, tmp_path):
    # The planning process is the seam, as above; probe_one.pair stands for two processes side by side
    # (tests/test_warm_probes.py runs them): where it runs the pair, the plans stop without a plan past
    # the answer (the probe past it is the check), and the outcome follows both probes.
    from types import SimpleNamespace

    import tfmem_widgets.fresh.run as fresh
    from tfmem_widgets.plans.largest import PlanSearch
    from tfmem_widgets.search.plan_first import BETWEEN, DONE, FROM_LOW, UP, plan_first
    from tfmem_widgets.search.progress import LineProgress

    def searched(edge, room=True, max_probes=16):
        found = PlanSearch(117_000, 160_000, [], 30.0, True, 2000 * 1_000_000, "logical device limit")
        codes = []

        def planning(code, **kwargs):
            codes.append(code)
            return SimpleNamespace(values={"found": found})

        monkeypatch.setattr(fresh, "run_checked", planning)
        search = BatchSearch([], 1, 262144, 2, 0.0, 0.02, where="GPU:0", _run=(b"", {}, {}, 60))
        probe, probe_one, single, aheads = _gpu_probes(search, edge)
        pairs = []

        def pair(first, second):
            if not room:
                return None
            pairs.append((first, second))
            return [probe(first), probe(second)]

        probe_one.path, probe_one.pair = tmp_path / "functions.pickle", pair
        then = plan_first(search, probe_one, LineProgress(quiet=True), auto=False, max_probes=max_probes)
        return then, single, pairs, codes[0], search, aheads

    then, single, pairs, code, search, _ = searched(118_000)
    assert (then, single, pairs, search.edge) == (DONE, [], [(117_000, 119_340)], (117_000, 119_340))
    assert "closing_plan=False" in code
    then, single, pairs, _, _, _ = searched(200_000)  # both trained: the plans were low, the probes go up
    assert (then, single, pairs) == (UP, [], [(117_000, 119_340)])
    then, single, pairs, _, search, aheads = searched(110_000)  # the answer failed: the probes step down from it
    assert (then, pairs, single, search.edge) == (BETWEEN, [(117_000, 119_340)], [112_320, 102_960], (102_960, 112_320))
    assert aheads == [True, True]  # stepping down, more probes may follow
    then, single, pairs, _, search, _ = searched(110_000, max_probes=3)  # stepping down stops at max_probes
    assert (then, single, len(search.probes)) == (FROM_LOW, [112_320], 3)
    then, single, pairs, _, _, aheads = searched(118_000, room=False)  # the card got fuller: one after the other
    assert (then, single, pairs, aheads) == (DONE, [117_000, 119_340], [], [True, False])  # none after the last


def test_where_the_probes_read_the_plans_timings_the_batch_past_the_answer_is_planned_and_probed(monkeypatch, tmp_path):
    # A GPU whose autotuner is on (warm.SharedAutotune: probe_one.plans_env): the planning process is told to plan
    # the batch past its answer too, and to tell no closing plan (a probe begun before the plans end would read
    # no timings); the pair follows the published plans, and the batch past the answer is the plans' failure where
    # that lies within a step of it (a batch they compiled: its probe times no kernel). The planning process is
    # the seam, as above.
    from types import SimpleNamespace

    import tfmem_widgets.fresh.run as fresh
    from tfmem_widgets.plans.largest import PlanSearch
    from tfmem_widgets.search.plan_first import DONE, plan_first
    from tfmem_widgets.search.progress import LineProgress

    def searched(failure):
        found = PlanSearch(117_000, failure, [], 30.0, True, 2000 * 1_000_000, "logical device limit")
        events = []

        def planning(code, **kwargs):
            events.append(("planned", "closing_plan=True" in code, "closing_aim=None" in code, kwargs["env"]))
            return SimpleNamespace(values={"found": found})

        monkeypatch.setattr(fresh, "run_checked", planning)
        search = BatchSearch([], 1, 262144, 2, 0.0, 0.02, where="GPU:0", _run=(b"", {}, {}, 60))
        probe, probe_one, single, _ = _gpu_probes(search, 118_000)

        def pair(first, second):
            events.append(("pair", first, second))
            return [probe(first), probe(second)]

        def begin_pair(first, second):
            raise AssertionError("no probe begins while the plans compile")

        probe_one.path, probe_one.pair, probe_one.begin_pair = tmp_path / "functions.pickle", pair, begin_pair
        probe_one.plans_env = {"XLA_FLAGS": "--xla_gpu_dump_autotune_results_to=/plans.txt"}
        probe_one.plans_done = lambda planned: events.append(("published", planned))
        then = plan_first(search, probe_one, LineProgress(quiet=True), auto=False, max_probes=16)
        return then, events, single, search, found

    then, events, single, search, found = searched(118_500)  # the plan past the answer failed within a step
    assert events == [("planned", True, True, {"XLA_FLAGS": "--xla_gpu_dump_autotune_results_to=/plans.txt"}),
                      ("published", found), ("pair", 117_000, 118_500)]
    assert (then, single, search.edge) == (DONE, [], (117_000, 118_500))
    then, events, single, search, _ = searched(160_000)  # no plan within a step past it: a step past it is probed
    assert events[-1] == ("pair", 117_000, 119_340) and search.edge == (117_000, 119_340)


def test_a_search_sharing_its_plans_timings_plans_and_probes_the_batch_past_its_answer_in_real_processes(monkeypatch):
    # Lab mode stands in for a GPU whose autotuner is on: warm.SharedAutotune is forced on, and since XLA on a CPU
    # writes no autotune results, its publish() first writes one as XLA on a GPU would. In real processes the plans
    # compile the batch past their answer, the probes begin after them, and what they read names the plans' batches.
    from tfmem_widgets.search import warm

    published = []
    publish = warm.SharedAutotune.publish

    def written_then_published(self, batches=()):
        self.written.write_text('results {\n  hlo: "a"\n}\n')
        publish(self, batches)
        published.append(self.planned.read_text().split())

    monkeypatch.setattr(warm.SharedAutotune, "of", staticmethod(lambda env, setup, work: warm.SharedAutotune(work)))
    monkeypatch.setattr(warm.SharedAutotune, "publish", written_then_published)
    search = tfmem_widgets.max_batch_size(*search_functions(jit=True), setup={"lab_mb": 128}, high=16384,
                                          progress=False, method="plan")
    planned = [p.batch_size for p in search.plans]
    answer, past = (p.batch for p in search.probes[:2])
    assert answer == search.plan_answer and answer < past <= answer + -(-answer * search.resolution // 1)
    assert past in planned, (planned, past)  # the closing plan at the batch past the answer
    assert published == [[str(b) for b in planned]]  # once, after the plans, with every batch they compiled
    assert any(note.startswith("the probes begun after the plans read the 1 kernel timings") for note in search.notes)
    assert not any("probed while the plan at" in note for note in search.notes)  # none begun while they compiled
    assert not _children()


def test_a_closing_plans_two_probes_begin_while_it_compiles_and_stand_whatever_it_says(monkeypatch, tmp_path):
    # The planning process is the seam, as above: the fake one tells its closing plan where
    # search_in_process does (largest_planned_batch's closing()), lets the search look (each_tick), then
    # "compiles" for 0.2 s and returns. probe_one.begin_pair stands for two processes begun side by side
    # (tests/test_warm_probes.py runs them); what follows the probes is the real code.
    import time
    from types import SimpleNamespace

    import tfmem_widgets.fresh.run as fresh
    from tfmem_widgets.fresh.transport import tell_batch
    from tfmem_widgets.plans.largest import PlanSearch
    from tfmem_widgets.search.plan_first import BETWEEN, DONE, FROM_LOW, UP, plan_first
    from tfmem_widgets.search.progress import LineProgress

    def searched(edge, plans_answer=118_332, planning_fails=False, room_then=True, max_probes=16):
        events = []

        def planning(code, **kwargs):
            assert f"closing_aim={str(tmp_path / 'closing-aim')!r}" in code and "closing_plan=False" in code
            kwargs["each_tick"]()  # nothing told yet: nothing begun
            tell_batch(tmp_path / "closing-aim", 118_332)
            kwargs["each_tick"]()
            kwargs["each_tick"]()  # (read once)
            time.sleep(0.2)
            events.append("compiled")
            if planning_fails:
                raise FreshRunError("the fresh process was killed", how="was killed by SIGKILL (signal 9)")
            found = PlanSearch(plans_answer, 118_440, [], 30.0, True, 2000 * 1_000_000, "logical device limit")
            return SimpleNamespace(values={"found": found})

        monkeypatch.setattr(fresh, "run_checked", planning)
        search = BatchSearch([], 1, 262144, 2, 0.0, 0.02, where="GPU:0", _run=(b"", {}, {}, 60))
        probe, probe_one, single, _ = _gpu_probes(search, edge)

        def begin_pair(first, second):
            events.append(("begun", first, second) if room_then else ("no room", first, second))
            return (lambda: (events.append("read"), [probe(first), probe(second)])[1]) if room_then else None

        def pair(first, second):
            events.append(("pair", first, second))
            return [probe(first), probe(second)]

        probe_one.path, probe_one.pair, probe_one.begin_pair = tmp_path / "functions.pickle", pair, begin_pair
        then = plan_first(search, probe_one, LineProgress(quiet=True), auto=False, max_probes=max_probes)
        (tmp_path / "closing-aim").unlink()
        return then, events, single, search

    then, events, single, search = searched(119_000)
    assert events == [("begun", 118_332, 120_699), "compiled", "read"]  # begun before the plan was done
    assert (then, single, search.edge, search.plan_answer) == (DONE, [], (118_332, 120_699), 118_332)
    assert "batches 118,332 and 120,699 were probed while the plan at 118,332 compiled" in repr(search)
    # The probes ran beside the plans for the 0.2 s the plan took after they began: counted once.
    assert 0.15 < search.beside_plans_seconds < search.plan_seconds < 1.0
    # (the two probes' own shared seconds are counted by warm.probing's begin_pair, not by this made-up one)
    assert search.seconds == pytest.approx(search.plan_seconds + 15.0 + 25.0 - search.beside_plans_seconds)
    then, events, single, _ = searched(200_000)  # both trained: the plans were low
    assert (then, single) == (UP, [])
    # The plan at 118,332 did not fit after all (the plans' answer is 117,000) and its probe did not train either:
    # the plans' answer is probed next. It trains: the edge lies within a step (BETWEEN ends the search there).
    then, events, single, search = searched(118_000, plans_answer=117_000)
    assert (then, single, search.edge, search.plan_answer) == (BETWEEN, [117_000], (117_000, 118_332), 117_000)
    assert "the plan at 118,332 did not fit: the plans' answer 117,000 probed next" in repr(search)
    # It does not train either: the search steps down from it as from any answer that did not train.
    then, events, single, search = searched(110_000, plans_answer=117_000)
    assert (then, single, search.edge) == (BETWEEN, [117_000, 112_320, 102_960], (102_960, 112_320))
    then, events, single, search = searched(110_000, plans_answer=117_000, max_probes=2)  # none past max_probes
    assert (then, single, len(search.probes)) == (FROM_LOW, [], 2)
    # No room for two when the plan was told: the plans go on alone, and the pair runs after them.
    then, events, single, search = searched(119_000, room_then=False)
    assert events == [("no room", 118_332, 120_699), "compiled", ("pair", 118_332, 120_699)]
    assert (then, single, search.beside_plans_seconds) == (DONE, [], 0.0)
    # The planning process died after it told its closing plan: the two probes begun stand.
    then, events, single, search = searched(119_000, planning_fails=True)
    assert (then, single, search.edge, search.plans) == (DONE, [], (118_332, 120_699), [])
    assert "the plans could not be made (the process was killed by SIGKILL (signal 9)): the probes begun " \
        "meanwhile decide" in repr(search)


def _model_without_xla():
    from types import SimpleNamespace

    return SimpleNamespace(jit_compile=False)


def _no_batch_wanted(n):
    raise AssertionError("a model without XLA is not planned: make_batch is not called")


def test_auto_plans_nothing_for_a_step_without_xla_and_the_search_says_what_the_planning_process_cost(monkeypatch,
                                                                                                       tmp_path):
    # method="auto" probes a graph step only: its planning process returns once the model is built (before
    # any batch or compile), and the search's text counts that process's seconds.
    import pickle
    from types import SimpleNamespace

    import tfmem_widgets.fresh.run as fresh
    from tfmem_widgets.search.plan_first import FROM_LOW, plan_first, search_in_process
    from tfmem_widgets.search.progress import LineProgress

    path = tmp_path / "functions.pickle"
    path.write_bytes(pickle.dumps((_model_without_xla, _no_batch_wanted)))
    found = search_in_process(str(path), 1, 16384, 0.02, 14, xla_only=True)
    assert (found.batch, found.plans, found.jit_compile) == (None, [], False)

    codes = []

    def planning_process(code, **kwargs):
        codes.append(code)
        return SimpleNamespace(values={"found": found})

    monkeypatch.setattr(fresh, "run_checked", planning_process)
    search = BatchSearch([], 1, 16384, 2, 0.0, 0.02, where="lab mode 128 MB", _run=(b"", {}, {}, 60))

    def probe_one(batch):
        raise AssertionError("plan_first probes nothing here")

    probe_one.path = path
    assert plan_first(search, probe_one, LineProgress(quiet=True), auto=True, max_probes=16) == FROM_LOW
    assert "xla_only=True" in codes[0] and search.plans == [] and search.plan_seconds > 0
    assert "a fresh process to plan first" in repr(search) and "so the search probed only" in repr(search)
