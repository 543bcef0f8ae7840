"""The text form shared by the package's results: a list of lines, shown by repr and by IPython."""

from __future__ import annotations


class LinesText:
    """repr() and IPython's pretty printer show `lines()`, one per line. A dataclass using it
    says repr=False, or its generated repr would take the place of this one."""

    def lines(self) -> list[str]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))
