"""The package as users get it: a wheel built from the repo, installed into a clean virtual
environment, loads the extension and runs a %%tfmem cell in lab mode.

The clean environment has no packages of its own but the wheel (installed without
dependencies); TensorFlow, IPython and the rest are taken from this environment's
site-packages through a plain path entry, which does not carry this checkout's editable install,
so the package imported there is the wheel's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CELL = """
import json, sys
from IPython.testing.globalipapp import start_ipython
import tfmem_widgets
ip = start_ipython()
ip.run_line_magic("load_ext", "tfmem_widgets")
ip.run_line_magic("tfmem", "setup --lab 64")
m = ip.run_cell_magic("tfmem", "-o -q -d CPU:0", "import tensorflow as tf\\nx = tf.zeros((1 << 20,))")
print(json.dumps({"file": tfmem_widgets.__file__, "delta": m.delta_bytes, "lab": m.lab_limit_bytes}))
"""


def test_a_wheel_in_a_clean_environment_runs_a_cell_in_lab_mode(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(dist)],
                   check=True, timeout=600)
    wheel = next(dist.glob("tfmem_widgets-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert not any(n.endswith((".json", ".ipynb")) or "workbook" in n or "gpu_experiments" in n for n in names), \
        "the workbook's content ships with the notebooks, not in the wheel"
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "notebooks/")) for n in names)

    env_dir = tmp_path / "clean"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", purelib, str(wheel)],
                   check=True, timeout=300)
    # Dependencies from here, by a plain path entry (no .pth processing: no editable install).
    Path(purelib, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run = subprocess.run([str(python), "-c", CELL], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(out["file"]).is_relative_to(env_dir), f"imported {out['file']}, not the wheel's"
    assert out["delta"] == 4 << 20 and out["lab"] == 64 << 20
