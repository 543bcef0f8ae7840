"""Every exception type the package raises, in one place, named for what happened.

Each is a TfmemError and also the built-in a Python user would catch: a bad value is a ValueError,
a state that forbids the call is a RuntimeError. Each message is one line: what was wrong and what
to do instead.
"""


class TfmemError(Exception):
    """The base of every error tfmem_widgets raises."""


class ArgumentError(TfmemError, ValueError):
    """A bad argument to a function or a magic (a wrong type, a value out of range, a combination
    that admits no answer); nothing was changed."""


class SetupError(TfmemError, ValueError):
    """A device setup that breaks TensorFlow's rules or this machine's facts (a GPU that is not
    there, growth with logical devices, a limit over the card); nothing was changed."""


class TraceDataError(TfmemError, ValueError):
    """A trace file or dump that cannot be read (damaged, cut short, of another kind); the message
    says which and why."""


class StateError(TfmemError, RuntimeError):
    """A state that forbids the call: a trace inside a trace, a block entered twice, a setup after
    TensorFlow's runtime started, TensorFlow's profiler already running, a result not made yet."""


class NvmlUnavailable(TfmemError, RuntimeError):
    """NVML cannot be used on this machine; the message says why in one line."""


class FitStopped(StateError):
    """The guard (%tfmem guard) stopped a Keras fit before its first step: its step cannot fit the device, or
    its graph step makes a tensor of 2^31 elements (an abort on a GPU). The message says why and the batch
    that fits."""


class FreshRunError(TfmemError, RuntimeError):
    """The code raised, or the process died, in the fresh process (its output was shown).

    how: how the process ended, in words ('raised ValueError', 'was killed by SIGABRT (signal 6)');
    raised: the name of the exception the code raised there (None: it died or was stopped);
    timed_out: it ran past its timeout; oom: the report of an OOM it met (None: none);
    oom_shown: that report was already shown by the process's own shell; last_words: the last line
    it wrote that says something; death: where a signal ended it, a deaths.explain.Death (its signal,
    TensorFlow's last words, Python's stacks, what it means).
    """

    def __init__(self, message: str, *, how: str = "", raised: str | None = None, timed_out: bool = False,
                 oom=None, oom_shown: bool = False, last_words: str = "", death=None):
        super().__init__(message)
        self.death = death
        self.how, self.raised, self.timed_out = how, raised, timed_out
        self.oom, self.oom_shown = oom, oom_shown
        self.last_words = last_words  # the last line it wrote that says something (its error)
