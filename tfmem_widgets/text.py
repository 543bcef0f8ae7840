"""The text form shared by the package's results: a list of lines, shown by repr and by IPython; and the
mark of a figure that varies with the processor."""

from __future__ import annotations

# The mark of a figure measured on this processor that another run or CPU would not repeat: lab mode's
# Keras steps (their kernels' temporary buffers, the order their threads ran ops in). Printed right after
# the figure, one space before it, never padded to a column: tests/nbval_sanitize.cfg replaces such a figure.
THIS_CPU = "(this CPU)"
THIS_MACHINE = "(this machine)"  # the same for a figure of the machine, not of a run: the host's memory


def marked(figure: str, varies: bool, mark: str = THIS_CPU) -> str:
    """`figure`, marked " (this CPU)" (or `mark`) where it varies with the processor (`varies`)."""
    return f"{figure} {mark}" if varies else figure


class RunNote(str):
    """A note that says what a run measured (a batch search's probes, their count): where those vary with
    the processor (lab mode), whether the note is said at all varies with them, and its text says so."""


class LinesText:
    """repr() and IPython's pretty printer show `lines()`, one per line. A dataclass using it
    says repr=False, or its generated repr would take the place of this one."""

    def lines(self) -> list[str]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))
