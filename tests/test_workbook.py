"""The workbook's shape: ten notebooks in reading order, each with learning goals, an exercise
with a check cell, a summary of claims, outputs stored, and nothing excused from nbval."""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
EXPECTED = ["00_tour", "01_reserved_limits", "02_fragmentation", "03_allow_growth",
            "04_gradient_accumulation", "05_many_devices", "06_keras_oom", "07_what_fits", "08_plan_before_you_run",
            "09_when_the_kernel_dies"]
# nbval's markers that would excuse a cell from the comparison or from running.
EXCUSES = {"nbval-skip", "nbval-ignore-output", "nbval-check-output"}


def _cells(path):
    return json.loads(path.read_text())["cells"]


def _text(cell):
    return "".join(cell["source"])


def test_the_notebooks_in_reading_order():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_has_goals_an_exercise_with_a_check_and_a_summary_of_claims(path):
    cells = _cells(path)
    assert cells[0]["cell_type"] == "markdown" and "You will learn" in _text(cells[0])
    summary = _text(cells[-1])
    assert summary.startswith("## Summary") and "| claim | measured in |" in summary
    claims = [line for line in summary.splitlines() if line.startswith("| ") and not line.startswith("| claim")]
    assert len(claims) >= 3
    exercises = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and "Exercise" in _text(c)]
    assert exercises, "no exercise"
    checks = [c for c in cells if c["cell_type"] == "code" and re.search(r"['\"]right['\"]", _text(c))
              and "not quite" in _text(c)]
    assert checks, "no check cell that says right / not quite"
    # The stored answers are placeholders: every stored check says "not quite", none says "right".
    for check in checks:
        shown = "".join("".join(o.get("text", "")) for o in check["outputs"])
        assert "not quite" in shown and "\nright" not in "\n" + shown


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_are_stored_and_no_cell_is_excused_from_the_comparison(path):
    code = [c for c in _cells(path) if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in code), "a code cell was never run: record the notebook"
    for cell in code:
        assert not EXCUSES & set(cell.get("metadata", {}).get("tags", [])), _text(cell)[:80]
        assert "# NBVAL_" not in _text(cell), _text(cell)[:80]
    assert sum(1 for c in code if c["outputs"]) >= len(code) // 2


def test_a_recording_shown_beside_a_notebooks_run_ran_the_notebooks_own_code():
    """Notebook 7's `edge_above` recording searched with the functions notebook 7 defines, and notebook 4's
    `lab_kernels` ran the step notebook 4 runs (its cell formats gpu_experiments.FLOAT16_STEP and prints
    whether its sizes are the recording's)."""
    import gpu_experiments

    what_fits = "\n".join(_text(c) for c in _cells(NOTEBOOKS[7]) if c["cell_type"] == "code")
    assert gpu_experiments.WHAT_FITS_FUNCTIONS.strip() in what_fits
    accumulation = "\n".join(_text(c) for c in _cells(NOTEBOOKS[4]) if c["cell_type"] == "code")
    assert "FLOAT16_STEP.format(**SIZES)" in accumulation and "SIZES == FLOAT16_SIZES" in accumulation
    recorded = json.loads(gpu_experiments.RECORDED.read_text())["experiments"]
    assert "the recording below ran the same step: True" in "".join(
        "".join(o.get("text", "")) for c in _cells(NOTEBOOKS[4]) for o in c.get("outputs", []))
    assert {"edge_above", "lab_kernels"} <= set(recorded)
