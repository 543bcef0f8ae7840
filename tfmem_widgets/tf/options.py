"""The setup options, one list: each option's name (setup()'s keyword), its %tfmem flag and how its
text is read, the environment variables it writes, and whether it means anything without a GPU.

The magic's flags, the setup panel, ``setup()``, a fresh process's ``setup=`` and the environment a
fresh process must not inherit all read ``SETUP_OPTIONS``; ``SetupRequest`` holds one value per
option and checks each where it lives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

from ..errors import ArgumentError

# TensorFlow's environment variables that setup writes (it reads each once, when its runtime starts).
LAB_USE_BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"  # lab mode: the CPU allocator becomes the BFC allocator
LAB_LIMIT_ENV = "TF_CPU_BFC_MEM_LIMIT_IN_MB"  # and its limit
GPU_ALLOCATOR_ENV = "TF_GPU_ALLOCATOR"
FORCE_GROWTH_ENV = "TF_FORCE_GPU_ALLOW_GROWTH"
MIN_SYS_MEMORY_ENV = "TF_DEVICE_MIN_SYS_MEMORY_IN_MB"

ALLOCATORS = ("bfc", "cuda_malloc_async")
# Without a GPU, lab mode is the whole point: this limit runs a small Keras model and
# still shows growth regions and fragmentation within seconds.
DEFAULT_LAB_MB = 1024


def _whole(value):
    """NumPy's integers (np.int64(64)) are whole numbers too: as plain ints, also inside a list, an
    array or a {GPU: MB} mapping; anything else as is (the checks below refuse it in one line)."""
    import numbers

    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if hasattr(value, "tolist"):  # a NumPy array
        value = value.tolist()
    if isinstance(value, Mapping):
        return {_whole(k): _whole(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_whole(v) for v in value]
    return value


def _positive(name: str, value, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{name} must be a whole number of MB, got {value!r}.")
    if value < 0 or (value == 0 and not allow_zero):
        raise ArgumentError(f"{name} must be a positive number of MB, got {value}.")
    return value


# More logical devices than this on one GPU is a typo for sizes ("--split 2048").
MAX_SPLIT_COUNT = 64


# -- the options as text (%tfmem setup, the setup panel): one reading of each -----------------

def parse_mb(text: str) -> int:
    """'4096': a positive whole number of MB."""
    try:
        value = int(text)
    except ValueError:
        raise ArgumentError(f"expected a whole number of MB, got {text!r}") from None
    if value <= 0:
        raise ArgumentError(f"expected a positive number of MB, got {text!r}")
    return value


def parse_count(text: str) -> int:
    """'2': a count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise ArgumentError(f"expected a count (1, 2, ...), got {text!r}") from None
    if value < 1:
        raise ArgumentError(f"expected a count of at least 1, got {text!r}")
    return value


def parse_mb_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else parse_mb(text)


def parse_gpu_index(text: str) -> int:
    if not text.strip().isdigit():
        raise ArgumentError(f"expected a GPU index (0, 1, ...), got {text!r}")
    return int(text)


def parse_limit(text: str) -> int | dict[int, int]:
    """'4096' for every GPU, or '0=4096,1=2048' per GPU."""
    if "=" not in text:
        return parse_mb(text)
    limits = {}
    for part in text.split(","):
        index, sep, mb = part.partition("=")
        if not sep:
            raise ArgumentError(f"expected GPU=MB pairs like 0=4096,1=2048, got {text!r}")
        limits[parse_gpu_index(index)] = parse_mb(mb)
    return limits


def parse_split(text: str) -> int | list[int]:
    """'2' (a count of logical devices) or '2048,2048' (their sizes in MB)."""
    if "," in text:
        return [parse_mb(part) for part in text.split(",")]
    count = parse_count(text)
    if count > MAX_SPLIT_COUNT:
        raise ArgumentError(
            f"{count} logical devices is more than {MAX_SPLIT_COUNT}: list sizes with commas "
            f"(--split {count},{count}) or give one limit with --limit {count}"
        )
    return count


def parse_gpus(text: str) -> list[int]:
    """'0,1', or 'none' to hide every GPU."""
    if text.strip().lower() == "none":
        return []
    return [parse_gpu_index(part) for part in text.split(",")]



def _mapping_or_list(value) -> str:
    if isinstance(value, Mapping):
        return ",".join(f"{i}={mb}" for i, mb in sorted(value.items()))
    return str(value) if isinstance(value, int) else ",".join(map(str, value))


@dataclass(frozen=True)
class SetupOption:
    """One setup option: setup()'s keyword, the %tfmem flag, the parser of its text, what it writes."""

    name: str  # setup()'s keyword and SetupRequest's field
    flag: str  # %tfmem setup's flag
    help: str
    parse: Callable[[str], object] | None = None  # the flag's text -> the value (None: a switch)
    metavar: str | None = None
    env: tuple[str, ...] = ()  # environment variables the option writes
    gpu_only: bool = True  # means nothing without a GPU
    off_flag: str | None = None  # a switch's flag for False (--no-growth)
    off_help: str = ""
    choices: tuple[str, ...] = ()  # the words it takes, where it takes one of a few

    @property
    def switch(self) -> bool:
        return self.parse is None and not self.choices

    def as_flag(self, value) -> str:
        """The option as %tfmem setup would take it."""
        if self.switch:
            return self.flag if value else (self.off_flag or "")
        if self.choices:
            return f"{self.flag} {value}"
        if self.name == "gpus":
            return f"{self.flag} " + (",".join(map(str, value)) or "none")
        return f"{self.flag} {_mapping_or_list(value)}"


# In the order %tfmem setup lists them and a request is written back as a magic.
SETUP_OPTIONS = (
    SetupOption("lab_mb", "--lab", "lab mode: TensorFlow's CPU allocator becomes its BFC allocator with this limit",
                parse_mb, "MB", (LAB_USE_BFC_ENV, LAB_LIMIT_ENV), gpu_only=False),
    SetupOption("gpus", "--gpus", "the GPUs TensorFlow may use", parse_gpus, "0,1|none", gpu_only=False),
    SetupOption("growth", "--growth", "memory growth on every visible GPU (tf.config)", off_flag="--no-growth",
                off_help="preallocate (TensorFlow's default)"),
    SetupOption("force_growth", "--force-growth",
                "TF_FORCE_GPU_ALLOW_GROWTH=true: growth that also works with --limit/--split", env=(FORCE_GROWTH_ENV,)),
    SetupOption("limit_mb", "--limit", "memory limit for every visible GPU, or per GPU (0=4096,1=2048)",
                parse_limit, "MB|GPU=MB,..."),
    SetupOption("split", "--split", "logical devices per GPU: a count (divides the limit) or sizes in MB",
                parse_split, "N|MB,MB,..."),
    SetupOption("allocator", "--allocator", "TF_GPU_ALLOCATOR", env=(GPU_ALLOCATOR_ENV,), choices=ALLOCATORS),
    SetupOption("reserve_mb", "--reserve", "TF_DEVICE_MIN_SYS_MEMORY_IN_MB: memory TensorFlow leaves free per GPU",
                parse_mb_or_zero, "MB", (MIN_SYS_MEMORY_ENV,)),
    SetupOption("cpus", "--cpus", "split the CPU into N logical devices", parse_count, "N", gpu_only=False),
)
OPTION_NAMES = tuple(option.name for option in SETUP_OPTIONS)
# Every variable setup may write: TensorFlow reads each once, when its runtime starts.
SETUP_ENV_VARS = tuple(name for option in SETUP_OPTIONS for name in option.env)


@dataclass(frozen=True)
class SetupRequest:
    """What the user asked for; None means 'leave as it is'.

    lab_mb: lab mode: TensorFlow's CPU allocator becomes its BFC allocator with this limit.
    gpus: the GPU indices TensorFlow may use ([] hides all GPUs).
    growth: tf.config memory growth on every visible GPU.
    force_growth: TF_FORCE_GPU_ALLOW_GROWTH, the route that also works with limits.
    limit_mb: one limit for every visible GPU, or {gpu_index: MB}.
    split: logical devices per visible GPU: a count (dividing the limit) or sizes in MB.
    allocator: 'bfc' or 'cuda_malloc_async' (TF_GPU_ALLOCATOR).
    reserve_mb: TF_DEVICE_MIN_SYS_MEMORY_IN_MB, the reserve TensorFlow keeps back per GPU.
    cpus: split the CPU into this many logical devices.
    """

    lab_mb: int | None = None
    gpus: Sequence[int] | None = None
    growth: bool | None = None
    force_growth: bool | None = None
    limit_mb: int | Mapping[int, int] | None = None
    split: int | Sequence[int] | None = None
    allocator: str | None = None
    reserve_mb: int | None = None
    cpus: int | None = None

    def __post_init__(self):
        # Whole numbers of any integer type as plain ints (frozen: set through object).
        for name in ("lab_mb", "reserve_mb", "cpus", "limit_mb", "split", "gpus"):
            object.__setattr__(self, name, _whole(getattr(self, name)))
        # Values are checked here, where they live; combinations in plan_setup.
        if self.growth is not None and not isinstance(self.growth, bool):
            raise ArgumentError(f"growth must be True or False, got {self.growth!r}.")
        if self.force_growth is not None and not isinstance(self.force_growth, bool):
            raise ArgumentError(f"force_growth must be True or False, got {self.force_growth!r}.")
        if isinstance(self.limit_mb, Mapping):
            for index, mb in self.limit_mb.items():
                _positive(f"limit for GPU {index}", mb)
        elif self.limit_mb is not None:
            _positive("limit_mb", self.limit_mb)
        if isinstance(self.split, int) and not isinstance(self.split, bool):
            if self.split < 1:
                raise ArgumentError(f"split must be a count of at least 1 or a list of sizes in MB, got {self.split}.")
        elif self.split is not None:
            if isinstance(self.split, (str, bytes)) or not isinstance(self.split, Sequence) or not self.split:
                raise ArgumentError(f"split must be a count or a non-empty list of sizes in MB, got {self.split!r}.")
            for mb in self.split:
                _positive("each size in split", mb)
        if self.gpus is not None:
            if isinstance(self.gpus, (str, bytes)) or not isinstance(self.gpus, Sequence):
                raise ArgumentError(f"gpus must be a list of GPU indices, got {self.gpus!r}.")
            for index in self.gpus:
                if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                    raise ArgumentError(f"gpus must list GPU indices (0, 1, ...), got {index!r}.")
            if len(set(self.gpus)) != len(self.gpus):
                raise ArgumentError(f"gpus lists a GPU twice: {list(self.gpus)}.")
        if self.allocator is not None and self.allocator not in ALLOCATORS:
            raise ArgumentError(
                f"unknown allocator {self.allocator!r}: choose 'bfc' or 'cuda_malloc_async'."
            )
        if self.lab_mb is not None:
            _positive("lab_mb", self.lab_mb)
        if self.reserve_mb is not None:
            _positive("reserve_mb", self.reserve_mb, allow_zero=True)
        if self.cpus is not None:
            if isinstance(self.cpus, bool) or not isinstance(self.cpus, int) or self.cpus < 1:
                raise ArgumentError(f"cpus must be a count of at least 1, got {self.cpus!r}.")

    def is_empty(self) -> bool:
        return all(getattr(self, name) is None for name in self.__dataclass_fields__)

    def gpu_options(self) -> list[str]:
        """The options given that only mean something on a GPU (gpus=[], hiding every GPU, is
        meaningful anywhere)."""
        given = [o.name for o in SETUP_OPTIONS if o.gpu_only and getattr(self, o.name) is not None]
        return given + (["gpus"] if self.gpus else [])

    def as_magic(self) -> str:
        """The same request as a %tfmem line, for messages that say what to run."""
        parts = ["%tfmem setup"]
        for option in SETUP_OPTIONS:
            value = getattr(self, option.name)
            if value is not None and option.as_flag(value):
                parts.append(option.as_flag(value))
        return " ".join(parts)


assert tuple(f.name for f in fields(SetupRequest)) == OPTION_NAMES, "SetupRequest holds one field per option"
