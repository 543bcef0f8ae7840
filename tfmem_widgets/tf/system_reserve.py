"""How TensorFlow chooses a GPU's memory limit when none is set.

TensorFlow takes the free memory it reads when it creates the device and keeps a
system reserve back (``MinSystemMemory`` in tensorflow/core/common_runtime/gpu/gpu_device.cc):
225 MiB when less than 2 GiB is free, otherwise by compute capability. The environment
variable TF_DEVICE_MIN_SYS_MEMORY_IN_MB replaces the table.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..units import GiB, MiB
from .options import MIN_SYS_MEMORY_ENV

_RESERVE_MB_BY_CC_MAJOR = ((6, 500), (7, 1050), (8, 1536))
_RESERVE_MB_NEWEST = 1800
_RESERVE_MB_LOW_MEMORY = 225


def system_reserve(
    free_bytes: int, cc_major: int | None, env: Mapping[str, str] | None = None
) -> tuple[int | None, str]:
    """(bytes TensorFlow keeps back, why): the reserve for a GPU with this much free.

    >>> system_reserve(100 * GiB, 9, env={})
    (1887436800, 'system reserve for compute capability 9 (1800 MiB)')
    """
    env = os.environ if env is None else env
    override = env.get(MIN_SYS_MEMORY_ENV, "").strip()
    if override.isdigit():
        return int(override) * MiB, f"system reserve set by {MIN_SYS_MEMORY_ENV}={override}"
    if free_bytes < 2 * GiB:
        return _RESERVE_MB_LOW_MEMORY * MiB, "system reserve when under 2 GiB is free (225 MiB)"
    if cc_major is None:
        return None, "system reserve unknown: compute capability not reported"
    for highest_major, reserve_mb in _RESERVE_MB_BY_CC_MAJOR:  # noqa: B007 - the row found is kept
        if cc_major <= highest_major:
            break
    else:
        reserve_mb = _RESERVE_MB_NEWEST
    return reserve_mb * MiB, f"system reserve for compute capability {cc_major} ({reserve_mb} MiB)"


def reserve_behind_limit(limit_bytes: int, cc_major: int | None, env: Mapping[str, str] | None = None
                         ) -> tuple[int | None, str]:
    """system_reserve read back from a default limit (free - reserve): the low-memory reserve where limit + that
    reserve is under 2 GiB (a limit there may also be a card's reserve taken from just over 2 GiB free: the
    limit alone cannot tell the two apart, and the low-memory one is taken)."""
    return system_reserve(limit_bytes + _RESERVE_MB_LOW_MEMORY * MiB, cc_major, env)
