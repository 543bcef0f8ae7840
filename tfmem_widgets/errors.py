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
    """The code raised, or the process died, in the fresh process (its output was shown).

    how: how the process ended, in words ('raised ValueError', 'was killed by SIGABRT (signal 6)');
    raised: the name of the exception the code raised there (None: it died or was stopped);
    timed_out: it ran past its timeout; oom: the report of an OOM it met (None: none);
    oom_shown: that report was already shown by the process's own shell; last_words: the last line
    it wrote that says something.
    """

    def __init__(self, message: str, *, how: str = "", raised: str | None = None, timed_out: bool = False,
                 oom=None, oom_shown: bool = False, last_words: str = ""):
        super().__init__(message)
        self.how, self.raised, self.timed_out = how, raised, timed_out
        self.oom, self.oom_shown = oom, oom_shown
        self.last_words = last_words  # the last line it wrote that says something (its error)
