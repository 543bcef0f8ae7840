"""What XLA's autotuner timed while a search's plans compiled, read by the probes begun after them
(search/warm.SharedAutotune): which searches share, the flags each process is given, and what a probe's
process reads as its work begins (search/probe.read_shared_autotune). XLA's own dump and load run on a GPU
only (tests/test_gpu.py)."""

import os

import pytest

from tfmem_widgets.search.probe import (
    DUMP_AUTOTUNE,
    LOAD_AUTOTUNE,
    SHARED_AUTOTUNE_ENV,
    read_shared_autotune,
    timed_by_plans,
)
from tfmem_widgets.search.warm import SharedAutotune

RESULTS = 'version: 3\nresults {\n  device: "CUDA: 9.0"\n  hlo: "a"\n}\nresults {\n  device: "CUDA: 9.0"\n  hlo: "b"\n}\n'


@pytest.mark.parametrize("env, setup", [
    ({}, {"lab_mb": 128}),  # XLA on a CPU tunes nothing
    ({"XLA_FLAGS": "--xla_gpu_autotune_level=0"}, {"limit_mb": 1000}),  # nothing is timed
    ({"XLA_FLAGS": f"{DUMP_AUTOTUNE}=/mine.txt"}, None),  # the user's own results: left alone
    ({"XLA_FLAGS": f"--xla_gpu_autotune_level=4 {LOAD_AUTOTUNE}=/mine.pb"}, None),
    ({"XLA_FLAGS": "--xla_gpu_autotune_level=4 --xla_gpu_autotune_level=0"}, None),  # XLA takes the last
])
def test_a_search_shares_nothing_where_nothing_is_timed_or_the_user_keeps_the_results(tmp_path, env, setup):
    assert SharedAutotune.of(env, setup, tmp_path) is None


def test_a_search_on_a_gpu_whose_autotuner_is_on_shares(tmp_path):
    assert SharedAutotune.of({"XLA_FLAGS": "--xla_gpu_autotune_level=0 --xla_gpu_autotune_level=4"}, None,
                             tmp_path) is not None


def test_the_plans_write_the_results_and_the_probes_read_them_only_once_the_plans_have_ended(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4")
    shared = SharedAutotune.of({}, {"limit_mb": 1000}, tmp_path)
    assert shared is not None
    plans = shared.plans_env({"A": "1"})
    # the user's flags first, XLA told to write what the plans' compiles time
    assert plans == {"A": "1", "XLA_FLAGS": f"--xla_gpu_autotune_level=4 {DUMP_AUTOTUNE}={shared.written}"}
    probes = shared.probes_env({"A": "1"})
    assert probes == {"A": "1", SHARED_AUTOTUNE_ENV: str(shared.shared)} and "XLA_FLAGS" not in probes
    shared.publish()
    assert shared.kernels == 0 and not shared.shared.exists()  # the plans' process wrote nothing
    shared.written.write_text(RESULTS)
    shared.publish()
    assert shared.kernels == 2  # kernels timed: the file's results
    assert shared.shared.read_text() == RESULTS and not shared.written.exists()  # moved whole, not copied


def test_a_probe_reads_the_results_where_they_were_published_as_its_work_begins(tmp_path, monkeypatch):
    results = tmp_path / "autotune.txt"
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4")
    monkeypatch.setenv(SHARED_AUTOTUNE_ENV, str(results))
    read_shared_autotune()  # begun while the plans compiled: nothing published, it times its own kernels
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=4" and SHARED_AUTOTUNE_ENV not in os.environ
    results.write_text(RESULTS)
    monkeypatch.setenv(SHARED_AUTOTUNE_ENV, str(results))
    read_shared_autotune()
    assert os.environ["XLA_FLAGS"] == f"--xla_gpu_autotune_level=4 {LOAD_AUTOTUNE}={results}"
    assert SHARED_AUTOTUNE_ENV not in os.environ  # (a process it starts is not a probe of the search)


def test_a_probe_at_a_batch_the_plans_compiled_knows_every_kernel_of_its_step_is_timed(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4")
    shared = SharedAutotune.of({}, {"limit_mb": 1000}, tmp_path)
    shared.written.write_text(RESULTS)
    shared.publish([509, 45_569, 69_867])  # the plans' batches, with what their compiles timed
    monkeypatch.setenv(SHARED_AUTOTUNE_ENV, str(shared.shared))
    read_shared_autotune()
    assert [timed_by_plans(b) for b in (69_867, 71_265, 509)] == [True, False, True]
    monkeypatch.setenv(SHARED_AUTOTUNE_ENV, str(tmp_path / "none.txt"))  # nothing published when this one began
    read_shared_autotune()
    assert not timed_by_plans(69_867)


def test_a_gpu_probe_ends_at_its_first_refusal_only_where_xla_times_no_kernel_of_its_step(tmp_path, monkeypatch):
    # On a GPU (no lab limit) whose autotuner is on, XLA can be refused scratch while it times a kernel and go on
    # with another: the probe keeps TensorFlow's retry, unless the plans timed every kernel of its batch. The
    # device is the seam (this machine has no GPU); the watch itself ends lab mode's probes (test_batch_search.py).
    import tfmem_widgets.search.probe as probe
    import tfmem_widgets.tf.devices as devices
    import tfmem_widgets.tf.lab as lab
    from tfmem_widgets.tf.dump_place import DUMP_ENV

    monkeypatch.setenv(DUMP_ENV, str(tmp_path / "dump"))
    monkeypatch.setattr(lab, "lab_limit_bytes", lambda: None)
    monkeypatch.setattr(devices, "xla_autotune_level", lambda flags=None: None)  # (XLA's default: on)
    monkeypatch.setattr(probe, "_planned_here", frozenset({69_867}))
    assert probe._end_at_first_refusal(71_265) is None
    watch = probe._end_at_first_refusal(69_867)
    assert watch is not None
    watch.set()  # (the watch ends with the probe's fit)
    monkeypatch.setattr(devices, "xla_autotune_level", lambda flags=None: "0")
    watch = probe._end_at_first_refusal(71_265)
    assert watch is not None
    watch.set()
