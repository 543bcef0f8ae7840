"""The README as a reader meets it: short, with its install lines, and a five-minute path that runs.

The five-minute path's ```python blocks run in order in one fresh Python process, in an IPython shell
as a reader's notebook would (no lab-mode variables inherited, no GPU visible). A block may raise only
the error its shown output names; the output shown in a ```text fence after a block is what the block
must print: each line in order, `...` standing for any text, a line `...` for any lines. Outputs of
Keras steps vary with the processor and are shown in plain fences, which are not compared. What varies
between runs and machines in any output (host memory, TensorFlow's version, the driver's line, a dump's
folder) is replaced on both sides by tests/nbval_sanitize.cfg's rules, as in the notebooks' checks.
"""

from __future__ import annotations

import configparser
import json
import re
from pathlib import Path

from conftest import finish_fresh, start_fresh

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PATH_SECTION = "## Five minutes in lab mode"
MAX_LINES = 250
SANITIZED = ("host_memory", "tensorflow_version", "driver_line", "dump_path")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SHOWN_ERROR = re.compile(r"^(\w+(?:Error|Exception|Exhausted)): ", re.MULTILINE)
PROMPT = re.compile(r"^Out\[\d+\]: ?")

# One IPython shell for all blocks, as one notebook; each block's stdout and stderr kept apart.
READER = """
import contextlib, io, json
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
ran = []
for block in json.loads(BLOCKS):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = ip.run_cell(block, store_history=True)
    error = result.error_before_exec or result.error_in_exec
    ran.append({"out": out.getvalue(), "err": err.getvalue(), "error": type(error).__name__ if error else None})
print(json.dumps(ran))
"""


def path_blocks(text: str) -> list[dict]:
    """The five-minute path's python blocks, each with the fenced output that follows it (if any)."""
    start = text.index(PATH_SECTION)
    end = text.find("\n## ", start + len(PATH_SECTION))
    section = text[start:] if end < 0 else text[start:end]
    blocks: list[dict] = []
    for fence in FENCE.finditer(section):
        info, body = fence.group(1), fence.group(2)
        if info == "python":
            blocks.append({"code": body, "shown": None, "compared": False})
        elif blocks and blocks[-1]["shown"] is None:
            blocks[-1]["shown"], blocks[-1]["compared"] = body, info == "text"
    return blocks


def sanitizers() -> list[tuple[re.Pattern, str]]:
    rules = configparser.ConfigParser(interpolation=None)
    rules.read(ROOT / "tests" / "nbval_sanitize.cfg")
    return [(re.compile(rules[name]["regex"]), rules[name]["replace"]) for name in SANITIZED]


def clean(text: str, rules) -> list[str]:
    for pattern, replacement in rules:
        text = pattern.sub(replacement, text)
    return [PROMPT.sub("", line).rstrip() for line in text.splitlines() if PROMPT.sub("", line).strip()]


def unmatched(shown: list[str], printed: list[str]) -> str | None:
    """The first shown line that the printed lines do not hold, in order (None: all are there)."""
    at = 0
    for line in shown:
        if line.strip() == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in line.split("...")))
        while at < len(printed) and not pattern.fullmatch(printed[at]):
            at += 1
        if at == len(printed):
            return line
        at += 1
    return None


def test_the_readme_is_a_front_door_with_the_install_lines():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; at most {MAX_LINES}: move detail to docs/"
    stripped = {line.strip() for line in lines}
    assert "python3 dev.py lab" in stripped and "python3 dev.py test" in stripped
    assert any(re.match(r"pip install \.(\s|$)", line) for line in stripped), "pip install . from a clone"
    assert any(re.match(r"pip install '?\.\[gpu\]", line) for line in stripped), "the GPU extra"
    assert any(re.match(r"pip install dist/tfmem_widgets-\*\.whl", line) for line in stripped), "the wheel"
    blocks = path_blocks(text)
    assert len(blocks) >= 5 and sum(b["compared"] for b in blocks) >= 3, "the five-minute path and its outputs"


def test_the_readme_and_docs_link_only_to_what_exists():
    def anchors(page: Path) -> set[str]:
        headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
        return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}

    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            name, _, anchor = target.partition("#")
            linked = (page.parent / name).resolve() if name else page
            assert linked.exists(), f"{page.name} links to {target}, which does not exist"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked), f"{page.name} links to {target}: no such heading"


def test_the_five_minute_path_runs_as_shown():
    blocks = path_blocks(README.read_text())
    code = READER.replace("BLOCKS", repr(json.dumps([b["code"] for b in blocks])))
    # A reader without a GPU: lab mode's figures are then the CPU's, the same on every machine.
    ran = finish_fresh(start_fresh(code, env={"CUDA_VISIBLE_DEVICES": ""}), timeout=600)
    rules = sanitizers()
    for number, (block, result) in enumerate(zip(blocks, ran, strict=True), 1):
        where = f"block {number} ({block['code'].splitlines()[0]!r})"
        shown_error = SHOWN_ERROR.search(block["shown"] or "")
        expected = shown_error.group(1) if shown_error else None
        assert result["error"] == expected, (
            f"{where} raised {result['error']} where the README shows {expected}:\n{result['out'][-3000:]}"
            f"\n{result['err'][-3000:]}")
        if block["compared"]:
            printed = clean(result["out"], rules) + clean(result["err"], rules)
            missing = unmatched(clean(block["shown"], rules), printed)
            assert missing is None, f"{where} does not print the README's line\n  {missing}\nit printed:\n" + \
                "\n".join(printed)
