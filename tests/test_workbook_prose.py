"""A sentence about a run is printed by the run: every figure a notebook's markdown quotes (bytes, seconds,
percentages, ratios, large counts, "N of M") is found in an output of that notebook, or in its code (a figure
the notebook sets), or is one of TensorFlow's constants below. A re-recorded notebook whose prose kept the
previous run's story fails here, without running anything.
"""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))

# Figures that hold on every run and machine, from TensorFlow's source (or arithmetic on a type's size):
# markdown may state them without a cell printing them.
CONSTANTS = {
    "128 MiB": "bfc_allocator.cc: a chunk of 128 MiB or more is split (max_internal_fragmentation_bytes)",
    "256 B": "bfc_allocator.h: kMinAllocationSize, every request is rounded up to it",
    "10 s": "bfc_allocator.cc / gpu_device.cc: an allocation that fails is retried for 10 s (kMaxMillisToWait)",
    "4 B": "a float32",
}

NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())}
_WORDS = "|".join(NUMBER_WORDS)
_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_UNIT = r"B|KiB|MiB|GiB|TiB|KB|MB|GB|TB|s|ms|%"
BYTES = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
         "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}
_FIGURE = re.compile(
    rf"(?<![\w.^/-])(?:(?P<value>{_NUM}) ?(?P<unit>{_UNIT})|x(?P<ratio>{_NUM})|(?P<ratio2>{_NUM})x"
    rf"|(?P<count>\d{{1,3}}(?:,\d{{3}})+|\d+\.\d+)|(?P<of>(?:\d+|{_WORDS}) of (?:\d+|{_WORDS})))(?![\w])",
    re.IGNORECASE)
# "8 to 10 MiB": both ends carry the unit.
_RANGE = re.compile(rf"(?<![\w.])({_NUM}) ?(to|and|or|-) ?({_NUM}) ?({_UNIT})(?![\w])")


# A version ("Keras 3.15", "CUDA 12.5.1", "compute capability 9.0") is no figure of a run.
_VERSION = re.compile(r"(?:Keras|TensorFlow|CUDA|cuDNN|Python|driver|capability|version) $")


def _plain(number: str) -> str:
    return number.replace(",", "")


def _of(text: str) -> str:
    a, b = text.lower().split(" of ")
    return f"{NUMBER_WORDS.get(a, a)} of {NUMBER_WORDS.get(b, b)}"


def figures(text: str) -> list[tuple[str, str, str]]:
    """(kind, value, unit) of each figure in a text; kinds: amount (value with a unit), ratio, count, of."""
    text = _RANGE.sub(r"\1 \4 \2 \3 \4", text)
    found = []
    for m in _FIGURE.finditer(text):
        if _VERSION.search(text, 0, m.start()):
            continue
        if m["value"]:
            found.append(("amount", _plain(m["value"]), m["unit"]))
        elif m["ratio"] or m["ratio2"]:
            found.append(("ratio", _plain(m["ratio"] or m["ratio2"]), "x"))
        elif m["count"]:
            found.append(("count", _plain(m["count"]), ""))
        else:
            found.append(("of", _of(m["of"]), ""))
    return found


def _agrees(figure: tuple[str, str, str], shown: list[tuple[str, str, str]], plain_text: str, code: str) -> bool:
    """Whether a figure of the prose is one of `shown` (at the prose's own precision) or in `plain_text`."""
    kind, value, unit = figure
    if kind == "amount" and _set_by_code(value, unit, code):
        return True
    if kind in ("count", "of"):
        return re.search(rf"(?<![\d.]){re.escape(value)}(?![\d]|\.\d)", plain_text) is not None
    decimals = len(value.split(".")[1]) if "." in value else 0
    want = float(value)
    for other_kind, other_value, other_unit in shown:
        if other_kind != kind:
            continue
        if unit in BYTES and other_unit in BYTES:
            got = float(other_value) * BYTES[other_unit] / BYTES[unit]
        elif unit.lower() == other_unit.lower():
            got = float(other_value)
        else:
            continue
        if round(got, decimals) == want:
            return True
    return False


def _set_by_code(value: str, unit: str, code: str) -> bool:
    """A figure the notebook's code sets: a limit in MB (its setup's unit), `40 * GiB`, a tolerance `0.02` for 2%."""
    if not re.fullmatch(r"\d+", value):
        return False
    if unit == "MB":
        return re.search(rf"(?<![\w.]){value}(?![\w.])", code) is not None
    if unit == "%":
        return re.search(rf"(?<![\w.]){int(value) / 100}(?![\d])", code) is not None
    return re.search(rf"(?<![\w.]){value} \* {unit}\b", code) is not None


def _cell_text(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _outputs(notebook: dict) -> str:
    texts = []
    for cell in notebook["cells"]:
        for out in cell.get("outputs", []):
            if "text" in out:
                texts.append("".join(out["text"]))
            for kind, data in out.get("data", {}).items():
                if kind.startswith("text/") and kind != "text/html":
                    texts.append("".join(data))
            if out.get("output_type") == "error":
                texts.append(out.get("evalue", ""))
    return "\n".join(texts)


def unprinted_figures(notebook: dict) -> list[str]:
    """'cell N: figure' for each figure of the markdown that no output, code cell or constant holds."""
    code = "\n".join(_cell_text(c) for c in notebook["cells"] if c["cell_type"] == "code")
    outputs = _outputs(notebook)
    shown = figures(outputs) + figures(code) + [f for c in CONSTANTS for f in figures(c)]
    plain = _plain(outputs) + "\n" + code.replace("_", "")
    missing = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        prose = re.sub(r"`[^`\n]*`", "", _cell_text(cell))  # code spans name code, not results
        for figure in figures(prose):
            if not _agrees(figure, shown, plain, code):
                kind, value, unit = figure
                missing.append(f"cell {index}: {value}{' ' + unit if kind == 'amount' else unit}")
    return missing


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_figure_the_prose_quotes_is_printed_by_the_notebook(path):
    missing = unprinted_figures(json.loads(path.read_text()))
    assert not missing, (f"{path.name}: markdown quotes figures no output of the notebook shows (print them "
                         f"from the cell that measured them, or say what holds on every run): {missing}")


def _notebook(markdown: str, output: str) -> dict:
    return {"cells": [{"cell_type": "code", "source": "print(peak)",
                       "outputs": [{"output_type": "stream", "name": "stdout", "text": output}]},
                      {"cell_type": "markdown", "source": markdown}]}


def test_a_planted_disagreement_is_found_and_agreement_passes():
    printed = "batch 4,096: trained, peak 86.09 MiB (2.3 s); in this run 0 of 5 batches above the first failure trained\n"
    assert unprinted_figures(_notebook("At 4,096 the peak was 86.09 MiB, about 86 MiB; 0 of 5 trained.",
                                       printed)) == []
    planted = _notebook("At 4,096 nine processes peaked from 88 to 105 MiB; four of five trained.", printed)
    assert unprinted_figures(planted) == ["cell 1: 88 MiB", "cell 1: 105 MiB", "cell 1: 4 of 5"]
    # other units of the same bytes agree at the prose's precision, and a figure the code sets needs no print
    assert unprinted_figures(_notebook("1.5 KiB in use, and a `tf.zeros((1536,))` of 1,536 rows.",
                                       "in use: 1,536 B")) == []
    assert unprinted_figures(_notebook("a 64 MB lab", "nothing")) == ["cell 1: 64 MB"]  # print(peak) sets no 64
