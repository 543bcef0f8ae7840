"""Keras' fit, seen as it starts while the extension is loaded: its batch noted in the kernel's record
(a death in the step is told with it), and, with the guard on (``%tfmem guard``), planned at that batch
before its first step: a fit whose step cannot fit the device, or whose graph step makes a tensor of
2^31 elements (an abort on a GPU), is stopped with the reason and the batch that fits, before anything
runs; a fit under MirroredStrategy by its replicas' plan (over the limit, or a first batch that does not divide
by the replicas). One plan per model, batch and shapes; a fit that fits runs as it would.

``keras.Model.fit`` is wrapped once Keras is imported (the extension imports neither TensorFlow nor
Keras itself); unloading the extension puts it back.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import weakref

from ..errors import FitStopped
from ..readings.fit_context import batch_of_dataset
from .hazards import warn_at_fit

_original = None
_guard = False
_judged: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(batch, specs): None (fits) or why not}


def guard(on: bool = True) -> bool:
    """Turn the guard on or off; returns whether it is on."""
    global _guard
    _guard = bool(on)
    if not _guard:
        _judged.clear()
    hook_fit()
    return _guard


def guarding() -> bool:
    return _guard


class _AfterKerasImport(importlib.abc.MetaPathFinder):
    """Wraps fit the moment Keras is imported (a cell that imports Keras and fits is seen too)."""

    def find_spec(self, name, path=None, target=None):
        if name != "keras":
            return None
        sys.meta_path.remove(self)  # the real finders find it
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            hook_fit()

        loader.exec_module = exec_module
        return spec


_finder = _AfterKerasImport()


def hook_fit() -> None:
    """keras.Model.fit wrapped, where Keras is imported and it is not yet; else at its import."""
    global _original
    keras = sys.modules.get("keras")
    model = getattr(keras, "Model", None) if keras is not None else None
    if model is None:
        if keras is None and _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        return
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    if _original is not None:
        return
    _original = model.fit

    @functools.wraps(_original)
    def fit(self, *args, **kwargs):
        _seen(self, args, kwargs)
        try:
            return _original(self, *args, **kwargs)
        finally:
            _ended()

    fit._tfmem_hook = True
    model.fit = fit


def unhook_fit() -> None:
    global _original, _guard
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    keras = sys.modules.get("keras")
    if _original is not None and keras is not None and getattr(keras.Model.fit, "_tfmem_hook", False):
        keras.Model.fit = _original
    _original, _guard = None, False
    _judged.clear()


def _argument(args, kwargs, name: str, index: int, default=None):
    return kwargs[name] if name in kwargs else args[index] if len(args) > index else default


def batch_of(x, batch_size) -> int | None:
    """The fit's global batch: batch_size (Keras' 32 for arrays), a dataset's batch (its static batch axis,
    else its batch step's); None for a generator, or a pipeline with no batch step."""
    if batch_size is not None:
        return int(batch_size)
    spec = getattr(x, "element_spec", None)
    if spec is not None:
        import tensorflow as tf

        leaves = tf.nest.flatten(spec)
        first = leaves[0].shape[0] if leaves and getattr(leaves[0], "shape", None) is not None and \
            leaves[0].shape.rank else None
        return batch_of_dataset(x) if first is None else int(first)
    return 32 if hasattr(x, "shape") else None


def _seen(model, args, kwargs) -> None:
    """The fit noted, and judged with the guard on. Nothing here may break the user's fit but the guard's
    own stop: anything else it meets is said in one line, and the fit runs."""
    from ..deaths import record

    try:
        x, y = _argument(args, kwargs, "x", 0), _argument(args, kwargs, "y", 1)
        batch = batch_of(x, _argument(args, kwargs, "batch_size", 2))
        if record.armed is not None:
            record.armed.note_fit(batch, getattr(model, "name", type(model).__name__))
        warn_at_fit(x)
        if _guard and batch is not None:
            _judge(model, x, y, batch)
    except FitStopped:
        raise
    except Exception as exc:
        print(f"tfmem guard: the fit runs unplanned ({type(exc).__name__}: {str(exc)[:200]})", file=sys.stderr)


def _ended() -> None:
    from ..deaths import record

    if record.armed is not None:
        record.armed.fit_ended()


def _sample(x, y):
    spec = getattr(x, "element_spec", None)
    if spec is not None:
        return spec if isinstance(spec, tuple) else (spec,)
    return (x, y) if y is not None else (x,)


def _judge(model, x, y, batch: int) -> None:
    """Plan the fit's step at its batch (once per model, batch and shapes); raise FitStopped where it
    cannot fit or would abort."""
    from ..plans.plan import batch_specs
    from ..plans.replicas import replicas_of, rows_of

    sample, replicas = _sample(x, y), replicas_of(model)
    try:  # (over replicas the data's rows count too: where fewer than the batch, they are the first batch)
        key = (batch, repr(batch_specs(sample, batch)), rows_of(sample) if replicas > 1 else None)
    except Exception:  # a sample the plan cannot read (a generator's): the fit runs unguarded
        return
    seen = _judged.setdefault(model, {})
    if key not in seen:
        seen[key] = _verdict(model, sample, x, y, batch) if replicas == 1 else _replicas_verdict(model, sample, batch,
                                                                                                 replicas)
    if seen[key] is not None:
        raise FitStopped(seen[key])


def _verdict(model, sample, x, y, batch: int) -> str | None:
    """None where the step fits; else the reason and the batch that fits, in one text. A graph step's
    tensors of 2^31 elements are looked for first, from the traced step alone (no XLA compile); then the
    step is planned at its batch (or, past the abort, at the batch under it)."""
    import keras

    from ..errors import ArgumentError
    from ..plans import plan as plans

    sizes = tuple(int(a.nbytes) for a in keras.tree.flatten((x, y)) if hasattr(a, "nbytes") and hasattr(a, "shape"))
    risks, under = [], None
    try:
        risks, under = plans.graph_abort_risks(model, sample, batch)
        planned = plans.plan(model, sample, under if risks and under else batch, build=True, place=False)
    except ArgumentError as exc:
        if risks:
            return _stopped(batch, risks, under, None)
        print(f"tfmem guard: the fit runs unplanned: {str(exc).removeprefix('plan: ')}", file=sys.stderr)
        return None
    fits = _fits(model, sample, planned, sizes)
    if not risks and fits is True:
        return None
    return _stopped(batch, risks, under if fits is True else fits, planned)


def _replicas_verdict(model, sample, batch: int, replicas: int) -> str | None:
    """None where the replicas' plan fits its devices (plans/replicas.py); else why not and the global batch that
    does: a first batch that does not divide by the replicas cannot start, a plan over the limit cannot fit."""
    from ..errors import ArgumentError
    from ..plans.need import NEED_SECONDS, replica_need
    from ..plans.plan import plan
    from ..readings.fit_context import FitContext
    from ..text import marked

    try:
        planned = plan(model, sample, batch, build=True)  # (its copy built, as fit would build it: the model is not)
    except ArgumentError as exc:
        print(f"tfmem guard: the fit runs unplanned: {str(exc).removeprefix('plan: ')}", file=sys.stderr)
        return None
    if planned.uneven:
        return (f"tfmem guard stopped this fit before its first step: {planned.uneven_text()}. %tfmem guard off "
                "lets it run.")
    if planned.limit_bytes is None or planned.fits():
        return None
    need = replica_need(FitContext(model, batch, sample, replicas), planned.limit_bytes, seconds=NEED_SECONDS,
                        first=planned)
    varies = planned.replicas[0].device.startswith("CPU")  # (a step planned for this processor: ReplicaPlan.lines)
    where = "the shared pool of its replicas" if planned.shared_pool else f"its busiest replica, {planned.busiest.device},"
    what = (f"A global batch of at most {marked(f'{need.fits_batch:,}', varies)} fits by the replicas' plan"
            if need.fits_batch else f"No global batch was found to fit: {need.note}" if need.note else
            f"No global batch planned fits, down to {need.fails_batch:,}")
    return (f"tfmem guard stopped this fit before its first step: at a global batch of {batch:,} {where} needs "
            f"{marked(_bytes(planned.peak_bytes), varies)} at its peak against the limit of "
            f"{_bytes(planned.limit_bytes)} (the replicas' plan, an estimate). {what}. %tfmem guard off lets it run.")


def _fits(model, sample, planned, sizes) -> bool | int | None:
    """True where `planned` fits its device with the fit's data; else the largest batch below it whose plan
    does (None: none, or no limit known)."""
    from ..plans.fit import held_beside
    from ..plans.need import step_need
    from ..plans.plan import batch_specs, plan
    from ..readings.fit_context import FitContext

    held = held_beside(planned, sizes)
    if planned.limit_bytes is None or planned.fits(held=held, regions=False if planned.estimate else None):
        return True
    context = FitContext(model, planned.batch_size, batch_specs(sample, planned.batch_size), 1, sizes)

    def planner(model, sample, batch: int):  # the plan made already is not compiled again
        return planned if batch == planned.batch_size else plan(model, sample, batch, build=True, place=False)

    return step_need(context, planned.limit_bytes, planner=planner).fits_batch


def _stopped(batch: int, risks: list, fits: int | None, planned) -> str:
    if risks:
        first = risks[0]
        why = (f"at batch {batch:,} its graph step makes {len(risks)} tensor{'s' if len(risks) != 1 else ''} of 2^31 "
               f"elements or more (the first: {first.line()}): on a GPU a TensorFlow kernel counts elements in 32 "
               "bits and its check ends the process")
    else:
        why = (f"at batch {batch:,} its step needs {_bytes(planned.peak_bytes)} at its peak against the limit of "
               f"{_bytes(planned.limit_bytes)}")
    what = f"A batch of at most {fits:,} fits by its plan" if fits else "No batch planned fits"
    if risks and planned is None:
        what = f"A batch of at most {fits:,} stays under 2^31 (its memory could not be planned)" if fits else what
    return (f"tfmem guard stopped this fit before its first step: {why}. {what}"
            + ("; or compile with jit_compile=True (XLA indexes with 64 bits)" if risks else "")
            + ". %tfmem guard off lets it run.")


def _bytes(count: int) -> str:
    from ..units import format_bytes

    return format_bytes(count)
