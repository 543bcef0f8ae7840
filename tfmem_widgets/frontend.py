"""What a frontend lends the core, in one object: the user's namespace (where Keras models are looked
for), a batch search's progress shown its way, and whether this process runs a ``%%tfmem fresh`` cell.

``%load_ext tfmem_widgets`` installs the notebook's (``use_frontend``) and ``%unload_ext`` puts the plain
one back; the core asks ``frontend()`` and never imports the notebook layer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Frontend:
    namespace: Callable[[], dict] | None = None  # the user's objects; None: __main__'s
    progress: Callable[[int, bool], object] | None = None  # (most probes, a bar asked for) -> a progress, or None
    fresh_child: bool = False  # a %%tfmem fresh child: its stderr reaches the user only when it ends

    def user_namespace(self) -> dict:
        """The namespace a user's objects live in: the frontend's, else __main__'s."""
        if self.namespace is not None:
            return self.namespace()
        main = sys.modules.get("__main__")
        return dict(vars(main)) if main is not None else {}


_PLAIN = Frontend()
_current = _PLAIN


def frontend() -> Frontend:
    """The frontend in use: the notebook's while the extension is loaded, else the plain one."""
    return _current


def use_frontend(chosen: Frontend | None) -> None:
    """Install a frontend (None: the plain one again)."""
    global _current
    _current = chosen if chosen is not None else _PLAIN
