"""Lab mode as TensorFlow reads it: TF_CPU_ALLOCATOR_USE_BFC and TF_CPU_BFC_MEM_LIMIT_IN_MB make the
CPU allocator TensorFlow's own BFC allocator with a limit; what TensorFlow makes of each spelling."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..units import MiB
from .options import LAB_LIMIT_ENV, LAB_USE_BFC_ENV
from .runtime import setup_env

LAB_DEFAULT_LIMIT_MB = 64 * 1024  # TensorFlow's own default when only the switch is set

_BOOL_TRUE = ("1", "true")
_BOOL_FALSE = ("0", "false")
_INT_PREFIX = re.compile(r"\s*([+-]?)(\d*)")
_INT_CLEAN = re.compile(r"\s*[+-]?\d+\s*")


@dataclass(frozen=True)
class LabSetting:
    """What TensorFlow makes of TF_CPU_ALLOCATOR_USE_BFC and TF_CPU_BFC_MEM_LIMIT_IN_MB.

    As TensorFlow 2.21 reads them (tests/test_environment.py checks it against TensorFlow): the
    switch takes 1, 0, true or false in any case and nothing else (not ' true', 'yes', 'on');
    the limit is read as the whole number at its start ('64MB' is 64, '32.5' is 32, ' 64' and
    '+64' are 64), although TensorFlow logs that it uses its default; a limit of 0 (also '',
    'abc', '0x40') makes the process crash at its first allocation; a negative one is no limit.
    """

    enabled: bool
    limit_mb: int | None  # the limit TensorFlow enforces, in MB; None: no practical limit
    problems: tuple[str, ...] = ()  # one line each: a value TensorFlow reads otherwise than written

    @property
    def limit_bytes(self) -> int | None:
        """The CPU BFC allocator's limit as TensorFlow holds it (no practical limit: 2**64 - 1); None
        where lab mode is off."""
        if not self.enabled:
            return None
        return (1 << 64) - 1 if self.limit_mb is None else self.limit_mb * MiB

    @property
    def crashes(self) -> bool:
        """TensorFlow's process dies (segmentation fault) at its first allocation."""
        return self.enabled and self.limit_mb == 0

    def describe(self) -> str:
        if not self.enabled:
            return "TensorFlow's default CPU allocator"
        if self.limit_mb is None:
            return "lab mode with no practical limit"
        return f"lab mode with {self.limit_mb} MB"


def lab_setting(env: Mapping[str, str | None] | None = None) -> LabSetting:
    """Lab mode as TensorFlow reads `env` (default: the variables in force, see setup_env)."""
    env = setup_env() if env is None else env
    problems = []
    switch = env.get(LAB_USE_BFC_ENV)
    enabled = False
    if switch is not None:
        if switch.lower() in _BOOL_TRUE:
            enabled = True
        elif switch.lower() not in _BOOL_FALSE:
            problems.append(
                f"{LAB_USE_BFC_ENV}={switch!r} is not a value TensorFlow reads (1, 0, true or false, "
                "nothing around them): it keeps its default CPU allocator, so lab mode is off"
            )
    raw = env.get(LAB_LIMIT_ENV)
    limit: int | None = LAB_DEFAULT_LIMIT_MB
    if raw is not None:
        sign, digits = _INT_PREFIX.match(raw).groups()
        value = int(sign + digits) if digits else 0
        if value < 0 or value * MiB >= 1 << 63:
            limit = None
        else:
            limit = value
        if not enabled:
            pass
        elif limit is None:
            problems.append(
                f"{LAB_LIMIT_ENV}={raw!r}: TensorFlow takes {'a negative' if value < 0 else 'so large a'} "
                "limit as no practical limit, so no OOM will come from lab mode"
            )
        elif limit == 0:
            problems.append(
                f"{LAB_LIMIT_ENV}={raw!r} is read by TensorFlow as 0 MB: its process crashes (segmentation "
                "fault) at the first allocation; give a whole number of MB, e.g. 256"
            )
        elif not _INT_CLEAN.fullmatch(raw):
            problems.append(
                f"{LAB_LIMIT_ENV}={raw!r} is not a whole number of MB: TensorFlow enforces {limit} MB (the "
                f"number it reads at the start), although its log says it uses its default of "
                f"{LAB_DEFAULT_LIMIT_MB}"
            )
    return LabSetting(enabled, limit, tuple(problems))


def lab_limit_bytes(env: Mapping[str, str | None] | None = None) -> int | None:
    """The CPU BFC allocator's limit if lab mode is configured, else None (LabSetting.limit_bytes)."""
    return lab_setting(env).limit_bytes
