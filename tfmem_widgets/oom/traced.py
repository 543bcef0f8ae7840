"""``trace()`` as the package gives it: the tracing block whose OOM is explained with the trace's own
map (each chunk named by its op) and kept as the process's ``last_oom()``."""

from __future__ import annotations

from ..tracing import block
from .explain import explain_trace, explained


class trace(block.trace):
    __doc__ = block.trace.__doc__

    def explain(self, exc, result):
        """The block's OOM explained in this process, and kept as last_oom(); the error carries that it was
        (a cell's hook does not say it again)."""
        return explained(exc, explain_trace(result, live=True))
