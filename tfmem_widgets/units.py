"""Byte counts: integers everywhere in the core, humanized only for display."""

MiB = 1 << 20
GiB = 1 << 30


def format_bytes(count: int | None, signed: bool = False) -> str:
    """Human-readable bytes with binary units, e.g. ``format_bytes(25165824) == '24.00 MiB'``."""
    if count is None:
        return "-"
    sign = ""
    if signed:
        sign = "+" if count >= 0 else "-"
    elif count < 0:
        sign = "-"
    value = float(abs(count))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_exact(count: int | None, signed: bool = False) -> str:
    """Bytes with thousands separators, e.g. ``'25,166,336 B'``."""
    if count is None:
        return "-"
    return f"{count:+,} B" if signed else f"{count:,} B"
