"""TensorFlow's process state, read without ever starting its runtime.

TensorFlow's device setup is possible only until its runtime starts (the first op,
``list_logical_devices``, ``get_memory_info``...). Everything here answers from the
configuration alone while the runtime has not started, so reading never takes that
chance away from the user.
"""


from __future__ import annotations

import importlib.abc
import os
import sys
import threading

from .options import SETUP_ENV_VARS


def tensorflow():
    """Import TensorFlow on first need (importing it does not start its runtime)."""
    import tensorflow as tf

    return tf


def runtime_started() -> bool:
    """Whether TensorFlow's runtime (its eager context) has started in this process."""
    if "tensorflow" not in sys.modules:
        return False
    from tensorflow.python.eager import context

    ctx = context.context_safe()
    # The handle exists from ensure_initialized() on; TensorFlow itself refuses device
    # changes from that moment ("... cannot be modified after being initialized").
    started = ctx is not None and getattr(ctx, "_context_handle", None) is not None
    if started and _read_at_start is None:
        _remember_setup_env(known=False)
    return started


# -- what TensorFlow read when its runtime started ---------------------------------------------
#
# TensorFlow reads the setup variables once, when its eager context is created (a lab limit
# changed after tf.config.list_logical_devices() and before the first tensor has no effect).
# Figures about what is in force must come from that moment, not from the environment now,
# which the user may have changed since. The moment is caught by wrapping
# Context.ensure_initialized as soon as TensorFlow's context module exists.

_read_at_start: dict[str, str | None] | None = None
_read_at_start_known = False  # False: first seen after the start, so it may differ from what TF read
_remember_lock = threading.Lock()


def _remember_setup_env(known: bool) -> None:
    global _read_at_start, _read_at_start_known
    with _remember_lock:
        if _read_at_start is None:
            _read_at_start = {name: os.environ.get(name) for name in SETUP_ENV_VARS}
            _read_at_start_known = known


def _wrap_context(module) -> None:
    cls = getattr(module, "Context", None)
    original = getattr(cls, "ensure_initialized", None)
    if original is None or getattr(original, "_tfmem_wrapped", False):
        return

    def ensure_initialized(self):
        if self._context_handle is None:
            _remember_setup_env(known=True)
        return original(self)

    ensure_initialized._tfmem_wrapped = True
    ensure_initialized.__wrapped__ = original
    ensure_initialized.__doc__ = original.__doc__
    cls.ensure_initialized = ensure_initialized


_CONTEXT_MODULE = "tensorflow.python.eager.context"


class _ContextWatcher(importlib.abc.MetaPathFinder):
    """Wraps TensorFlow's context module the moment it is imported (and then leaves)."""

    def find_spec(self, name, path, target=None):
        if name != _CONTEXT_MODULE:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_wrap(module):
            _remember_import_env()
            exec_module(module)
            _wrap_context(module)

        loader.exec_module = exec_and_wrap
        return spec


ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"
_onednn_at_import: str | None = None
_onednn_known = False


def _remember_import_env() -> None:
    """TensorFlow reads TF_ENABLE_ONEDNN_OPTS once, while it is imported (set after the import it
    changes nothing): remember the value it saw."""
    global _onednn_at_import, _onednn_known
    if not _onednn_known:
        _onednn_at_import, _onednn_known = os.environ.get(ONEDNN_ENV), True


def onednn_enabled() -> bool:
    """Whether TensorFlow's oneDNN kernels are on in this process (x86 Linux default), as read
    when TensorFlow was imported (or, before that, as it will read them)."""
    value = _onednn_at_import if _onednn_known else os.environ.get(ONEDNN_ENV)
    if not _onednn_known and "tensorflow" in sys.modules:
        value = os.environ.get(ONEDNN_ENV)  # imported before this package: the best guess
    return (value or "").strip().lower() not in ("0", "false")


def watch_runtime_start() -> None:
    """Remember the setup variables TensorFlow reads when its runtime starts (called on import)."""
    module = sys.modules.get(_CONTEXT_MODULE)
    if module is not None:
        _wrap_context(module)
        runtime_started()  # already started before this package was imported: remember now
    elif not any(isinstance(f, _ContextWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _ContextWatcher())


def setup_env() -> dict[str, str | None]:
    """The setup variables in force: as TensorFlow read them when its runtime started, or, before
    that, as it will read them (the environment now)."""
    if runtime_started() and _read_at_start is not None:
        return dict(_read_at_start)
    return {name: os.environ.get(name) for name in SETUP_ENV_VARS}


def setup_env_changed() -> list[str]:
    """One line per setup variable changed in the environment since TensorFlow read it."""
    if not runtime_started() or _read_at_start is None:
        return []
    lines = []
    for name, then in _read_at_start.items():
        now = os.environ.get(name)
        if now != then:
            was = "unset" if then is None else repr(then)
            lines.append(
                f"{name} is {'unset' if now is None else repr(now)} in the environment now, but TensorFlow "
                f"read it ({was}) when its runtime started and keeps that until the process restarts"
                + ("" if _read_at_start_known else " (as first seen here, after the start)")
            )
    return lines
