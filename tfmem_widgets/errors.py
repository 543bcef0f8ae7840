"""The one exception type the package raises for bad requests."""


class SetupError(ValueError):
    """A request that was refused before anything changed.

    The message is one line: what was wrong and what to do instead.
    """
