"""The panels in a real browser: JupyterLab 4 and Jupyter Notebook 7 (one server serves both), Debian's
Chromium, driven by Playwright.

A notebook is opened and run in each frontend; the test checks in the page that the gauge renders, that its
in-use figure changes while a training cell runs, that the setup panel shows a conflict for a
conflicting choice, and that a traced OOM shows the map viewer; and that a kernel that dies (TensorFlow's words
on fd 2, then abort) is explained when the kernel the server restarted loads the extension. Screenshots go to
ci-artifacts/screenshots/. Every wait has a deadline, and the server is stopped at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "ci-artifacts" / "screenshots"
TOKEN = "tfmem-browser-test"

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="needs Chromium (Debian package 'chromium'; .ci/run installs it)"
)

# A search's probes as max_batch_size records them: peaks on a line, one failure above.
SEARCH_CODE = """BatchSearch([Probe(b, (10 << 20) + b * 20 * 1024, 5.0) for b in (256, 1024, 4096)]
                     + [Probe(4608, None, 15.0, verdict="limit")], low=1, high=16384, steps=2, margin=0.05,
                     resolution=0.02, limit_bytes=96 << 20, limit_source="lab mode", lab=True, where="lab mode 96 MB")"""

CELLS = [
    "%load_ext tfmem_widgets\n%tfmem setup --lab 192",
    "%tfmem watch --interval 0.2",
    # A training cell long enough to watch: the gauge must move while it runs.
    """import numpy as np, tensorflow as tf, time
model = tf.keras.Sequential([tf.keras.Input((32,)), tf.keras.layers.Dense(256, activation="relu"),
                             tf.keras.layers.Dense(10)])
model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(0).normal(size=(4096, 32)).astype("float32")
y = np.random.default_rng(1).integers(0, 10, size=4096)
held = []
for step in range(16):
    model.fit(x, y, batch_size=256, epochs=1, verbose=0)
    with tf.device("CPU:0"):
        held.append(tf.zeros((1 << 20,)))      # 4 MiB more each round
    time.sleep(0.3)
print("trained")""",
    "%tfmem panel",
    """%%tfmem trace
with tf.device("CPU:0"):
    del held
    ts = [tf.zeros((1 << 21,)) for _ in range(20)]     # 8 MiB each
    ts = ts[1::2]                                       # free every other one
    too_big = tf.zeros((12 << 20,))                     # 48 MiB: no hole is that large""",
    # The panel reading a batch search (the search itself is tested in test_batch_search.py).
    "from tfmem_widgets.search.batch_search import BatchSearch, Probe\nsearch = " + SEARCH_CODE
    + "\n%tfmem panel --search search",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHECK_LINE = ("F0000 00:00:1764000000.000000   12345 gpu_launch_config.h:160] Check failed: "
              "work_element_count >= 0 (-2147483648 vs. 0)")
# A kernel that dies as TensorFlow's check ends a process: its words on fd 2, then abort().
DEATH_CELLS = ["%load_ext tfmem_widgets",
               f"import os\nos.write(2, {(CHECK_LINE + chr(10)).encode()!r})\nos.abort()"]


def _write_notebook(folder: Path, cells=CELLS, name="browser_check.ipynb") -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / name
    nbformat.write(nb, path)
    return path


@pytest.fixture
def jupyterlab(tmp_path):
    port = _free_port()
    _write_notebook(tmp_path)
    _write_notebook(tmp_path, DEATH_CELLS, "browser_death.ipynb")
    from tfmem_widgets.deaths.record import PLACE_ENV, RECORD_ENV

    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_") and k not in ("IPYTHONDIR", RECORD_ENV)}
    env[PLACE_ENV] = str(tmp_path / "records")  # the kernels keep records, as a user's do
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "config")
    args = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
            f"--ServerApp.token={TOKEN}", f"--ServerApp.root_dir={tmp_path}",
            f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}", "--LabApp.expose_app_in_browser=True",
            "--JupyterNotebookApp.expose_app_in_browser=True", "--ServerApp.open_browser=False"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-root")
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=2)
            break
        except OSError:
            if server.poll() is not None:
                raise AssertionError(server.stdout.read().decode(errors="replace")[-3000:]) from None
            time.sleep(0.5)
    else:
        server.kill()
        raise AssertionError("JupyterLab did not start within 90 s")
    try:
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


def _in_use_bytes(page) -> int | None:
    text = page.locator(".tfmem-gauge .tfmem-in-use").first.get_attribute("data-bytes", timeout=5_000)
    return None if text in (None, "None") else int(text)


# The same notebook in each frontend: JupyterLab's document page, and Notebook 7's.
FRONTENDS = {"jupyterlab": "/lab/tree/browser_check.ipynb", "notebook7": "/notebooks/browser_check.ipynb"}


@pytest.mark.parametrize("frontend", sorted(FRONTENDS))
def test_panels_in_each_frontend(jupyterlab, frontend):
    from playwright.sync_api import sync_playwright

    prefix = "" if frontend == "jupyterlab" else f"{frontend}_"

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"{jupyterlab}{FRONTENDS[frontend]}?token={TOKEN}")
            page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget", timeout=90_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            page.wait_for_function(
                "() => { const w = window.jupyterapp.shell.currentWidget;"
                " return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel"
                " && w.sessionContext.session.kernel.status === 'idle'; }", timeout=120_000)
            # Not awaited: the command's promise settles only when every cell has run.
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")

            # The gauge renders, and its in-use figure changes while the training cell runs.
            page.wait_for_function(
                "() => { const e = document.querySelector('.tfmem-gauge .tfmem-in-use');"
                " return e && e.dataset.bytes && e.dataset.bytes !== 'None'; }", timeout=120_000)
            first = _in_use_bytes(page)
            seen = [(0.0, first, None)]
            started_at = time.monotonic()
            deadline = time.monotonic() + 60
            changed_while_running = False
            shot_taken = False
            while time.monotonic() < deadline:
                now = _in_use_bytes(page)
                running = page.locator(".jp-OutputArea-output", has_text="trained").count() == 0
                seen.append((round(time.monotonic() - started_at, 2), now, running))
                if now != first and running:
                    changed_while_running = True
                    if not shot_taken:
                        page.locator(".tfmem-gauge").first.screenshot(path=str(SHOTS / f"{prefix}gauge.png"))
                        shot_taken = True
                    if now is not None and first is not None and now - first >= 16 << 20:
                        break
                if not running:
                    break
                time.sleep(0.25)
            if not changed_while_running:
                page.screenshot(path=str(SHOTS / f"{prefix}failure.png"), full_page=True)
            assert changed_while_running, f"the gauge's in-use figure did not change while the cell ran: {seen}"
            page.locator(".tfmem-gauge").first.screenshot(path=str(SHOTS / f"{prefix}gauge.png"))

            # The setup panel: a limit for lab mode after the runtime has started is refused.
            panel = page.locator(".tfmem-setup-panel").first
            panel.wait_for(timeout=120_000)
            # Every label whole (none cut to an ellipsis by the frontend's width), and a disabled
            # control shows no made-up figure (no GPU here: the GPU limit slider has no card to size by).
            cut = panel.evaluate("""el => [...el.querySelectorAll('*')].filter(e => e.textContent.trim()
                && e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1
                && ['ellipsis', 'clip'].includes(getComputedStyle(e).textOverflow)
                && getComputedStyle(e).overflowX !== 'visible').map(e => e.textContent.trim())""")
            assert cut == [], cut
            readouts = panel.evaluate("""el => [...el.querySelectorAll('.widget-slider')].filter(
                sl => sl.querySelector('.noUi-target[disabled], .noUi-target[disabled=""]')
                || sl.classList.contains('mod-disabled') || sl.querySelector('input:disabled'))
                .map(sl => [...sl.querySelectorAll('.widget-readout')].filter(r => r.offsetParent !== null)
                .map(r => r.textContent.trim())).flat()""")
            assert readouts == [], readouts
            # A click on the lab limit's track (the last slider; the GPU limit's is off here) moves it:
            # a keyboard press would go to the frontend's own shortcuts in Notebook 7.
            track = panel.locator(".noUi-target").last
            track.scroll_into_view_if_needed()
            box = track.bounding_box()
            page.mouse.click(box["x"] + box["width"] * 0.5, box["y"] + box["height"] / 2)
            try:
                page.wait_for_selector(".tfmem-setup-panel .tfmem-conflict", timeout=30_000)
            except Exception:
                page.screenshot(path=str(SHOTS / f"{prefix}failure.png"), full_page=True)
                panel.screenshot(path=str(SHOTS / f"{prefix}setup_panel_failure.png"))
                raise
            assert "already started" in panel.locator(".tfmem-conflict").inner_text()
            panel.screenshot(path=str(SHOTS / f"{prefix}setup_panel.png"))

            # The traced OOM shows the map viewer, marked as an OOM.
            viewer = page.locator(".tfmem-map-viewer").first
            viewer.wait_for(timeout=120_000)
            assert "ended in an OOM" in viewer.inner_text()
            assert viewer.locator("svg.tfmem-map rect.tfmem-chunk").count() > 3
            viewer.screenshot(path=str(SHOTS / f"{prefix}map_viewer.png"))

            # The panel with a batch search: a batch typed in shows the limit it needs; "set this limit" moves
            # the lab slider there, and the batch that fits at the new limit follows.
            from tfmem_widgets.search.batch_search import BatchSearch, Probe

            search = eval(SEARCH_CODE, {"BatchSearch": BatchSearch, "Probe": Probe})  # the notebook's search
            needed = -(-search.limit_needed_bytes(8000) // (1 << 20))
            fits_at = search.batch_for(-(-needed // 16) * 16 << 20)
            chooser = page.locator(".tfmem-setup-panel:has(.tfmem-fit-box)").first
            chooser.wait_for(timeout=120_000)
            chooser.scroll_into_view_if_needed()
            assert chooser.locator(".tfmem-fit-box img").count() == 1
            box = chooser.locator(".tfmem-fit-box input[type=number]").first
            box.fill("8000")
            box.press("Enter")
            try:
                page.wait_for_selector(f".tfmem-needed-mb[data-mb='{needed}']", timeout=30_000)
                chooser.locator("button", has_text="set this limit").click()
                page.wait_for_selector(f".tfmem-fits-batch[data-batch='{fits_at}']", timeout=30_000)
            except Exception:
                chooser.screenshot(path=str(SHOTS / f"{prefix}limit_chooser_failure.png"))
                raise
            chooser.screenshot(path=str(SHOTS / f"{prefix}limit_chooser.png"))
        finally:
            browser.close()


_KERNEL_IDLE = ("() => { const w = window.jupyterapp.shell.currentWidget;"
                " return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel"
                " && w.sessionContext.session.kernel.status === 'idle'; }")


@pytest.mark.parametrize("frontend", sorted(FRONTENDS))
def test_a_kernel_that_dies_is_explained_when_its_restarted_kernel_loads_the_extension(jupyterlab, frontend):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"{jupyterlab}{FRONTENDS[frontend].replace('browser_check', 'browser_death')}?token={TOKEN}")
            page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget", timeout=90_000)
            page.wait_for_function(_KERNEL_IDLE, timeout=120_000)
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            # The kernel dies in the second cell; the server starts it again and JupyterLab says so.
            page.wait_for_selector("text=appears to have died", timeout=120_000)
            page.screenshot(path=str(SHOTS / f"{frontend}_kernel_died.png"))
            page.keyboard.press("Escape")
            page.wait_for_function(_KERNEL_IDLE, timeout=120_000)
            page.evaluate("() => { const w = window.jupyterapp.shell.currentWidget; w.content.activeCellIndex = 0;"
                          " window.jupyterapp.commands.execute('notebook:run-cell'); }")
            told = page.locator(".jp-OutputArea-output", has_text="before this one died").first
            try:
                told.wait_for(timeout=120_000)
            except Exception:
                page.screenshot(path=str(SHOTS / f"{frontend}_kernel_death_failure.png"), full_page=True)
                raise
            text = told.inner_text()
            page.screenshot(path=str(SHOTS / f"{frontend}_kernel_death_explained.png"), full_page=True)
        finally:
            browser.close()
    assert "killed by SIGABRT (signal 6)" in text and "in cell [2]:" in text and "os.abort()" in text and CHECK_LINE in text
    assert "32-bit int" in text and "Python's stacks at the signal (faulthandler):" in text
