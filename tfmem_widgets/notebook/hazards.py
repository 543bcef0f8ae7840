"""Lab-mode OOMs that kill the process, said before the cell runs.

What TensorFlow 2.21 does on the CPU's BFC allocator (lab mode):
- an XLA program (``jit_compile=True``) that runs out of memory raises, then TensorFlow dies at the
  next step (a segmentation fault) or while freeing a buffer (``bfc_allocator.cc:711 Check failed:
  h != kInvalidChunkHandle``);
- with oneDNN's kernels on (the x86 Linux default), an OOM inside a oneDNN fused kernel (a
  Dense layer's matmul + bias in a tf.function or a Keras fit) is a segmentation fault.
- an OOM inside tf.data's own kernels (the iterator taking in ``from_tensor_slices``' arrays, a
  batch) is a segmentation fault, with oneDNN on or off.
In a notebook each one kills the kernel. ``%tfmem setup --lab N`` made before TensorFlow is
imported turns oneDNN off; XLA has no such switch: such a cell belongs in ``%%tfmem fresh``.
"""

from __future__ import annotations

import re
import sys

from ..frontend import frontend
from ..tf.lab import lab_setting
from ..tf.runtime import onednn_enabled, setup_env

_XLA_IN_CELL = re.compile(r"jit_compile\s*=\s*(True|['\"]auto['\"]|1)\b|experimental_compile\s*=\s*True")
_KERAS_WORK = re.compile(r"\.fit\s*\(|\.train_on_batch\s*\(|\.evaluate\s*\(|\.predict\s*\(|tf\.function|"
                         r"@function\b|keras\.")
_FRESH_CALL = re.compile(r"\brun_fresh\s*\(")
_DATA_IN_CELL = re.compile(r"\btf\.data\b|\bDataset\b|from_tensor_slices|from_generator")
_said: set[str] = set()

XLA_HAZARD = ("lab mode: an XLA program (jit_compile=True) that runs out of memory kills the whole process: "
              "the OOM raises, and TensorFlow, its CPU allocator left broken, dies at the next step or as it frees the "
              "program's buffers (measured with TensorFlow 2.21: a segmentation fault, or bfc_allocator.cc:711's "
              "check); run the cell with %%tfmem fresh (its own process), or compile with jit_compile=False")
DATA_HAZARD = ("lab mode: a fit on a tf.data pipeline: an OOM inside tf.data's own kernels (its iterator taking in "
               "from_tensor_slices' arrays, a batch, a shuffle buffer) is a segmentation fault that kills the kernel, "
               "with oneDNN on or off (measured with TensorFlow 2.21); keep the pipeline's tensors well under the lab "
               "limit, or run the fit with %%tfmem fresh")
ONEDNN_HAZARD = ("lab mode with oneDNN's kernels on: an OOM inside a oneDNN fused kernel (a Dense layer in a "
                 "tf.function or a Keras fit) is a segmentation fault that kills the kernel (measured with "
                 "TensorFlow 2.21); run %tfmem setup --lab N before importing TensorFlow (it turns oneDNN off), or "
                 "run the cell with %%tfmem fresh")


def lab_mode_in_force() -> bool:
    if "tensorflow" not in sys.modules:
        return False
    return lab_setting(setup_env()).enabled


def _xla_models() -> bool:
    """A Keras model in the user's namespace that compiles (or compiled) its step with XLA."""
    from ..readings.layers import _keras_objects

    models, _ = _keras_objects(frontend().user_namespace())
    return any(getattr(m, "jit_compile", False) is True for m in models)


def hazards_for(cell: str) -> list[str]:
    """The lab-mode hazards a cell about to run meets, as one line each."""
    if not lab_mode_in_force():
        return []
    found = []
    if _XLA_IN_CELL.search(cell) or (_KERAS_WORK.search(cell) and _xla_models()):
        found.append(XLA_HAZARD)
    if onednn_enabled() and _KERAS_WORK.search(cell):
        found.append(ONEDNN_HAZARD)
    if _DATA_IN_CELL.search(cell) and re.search(r"\.fit\s*\(", cell):
        found.append(DATA_HAZARD)
    return found


def warn_at_fit(x) -> None:
    """At a fit's start (notebook/fit_hook.py): a tf.data pipeline made in an earlier cell, in lab mode."""
    if frontend().fresh_child or not lab_mode_in_force() or DATA_HAZARD in _said:
        return
    data = sys.modules.get("tensorflow")
    if data is not None and isinstance(x, data.data.Dataset):
        _said.add(DATA_HAZARD)
        print(f"tfmem warning: {DATA_HAZARD}.", file=sys.stderr)


def warn_before_cell(cell: str) -> None:
    """pre_run_cell: each hazard said once per session, before the first cell that meets it."""
    if frontend().fresh_child or cell.lstrip().startswith("%%tfmem fresh") or _FRESH_CALL.search(cell):
        return  # that cell already runs its work in a process of its own
    for line in hazards_for(cell):
        if line in _said:
            continue
        _said.add(line)
        print(f"tfmem warning: {line}.", file=sys.stderr)
