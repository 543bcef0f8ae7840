"""Every exception type the package raises, in one place.

Each message is one line: what was wrong and what to do instead.
"""


class SetupError(ValueError):
    """A request that was refused before anything changed.

    The message is one line: what was wrong and what to do instead.
    """


class TraceDataError(SetupError):
    """A trace file or dump that cannot be read; the message says which and why."""


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine; the message says why in one line."""


class FreshRunError(RuntimeError):
    """The code raised, or the process died, in the fresh process (its output was shown)."""
