"""What XLA's autotuner timed while a search's plans compiled, read by the probes begun after them
(search/warm.SharedAutotune): which searches share, the flags each process is given, and what a probe's
process reads as its work begins. XLA's own dump and load run on a GPU only (tests/test_gpu.py)."""

import os

import pytest

from tfmem_widgets.search.warm import DUMP_AUTOTUNE, LOAD_AUTOTUNE, SHARED_AUTOTUNE_ENV, SharedAutotune, read_shared_autotune

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
