"""TensorFlow's device-setup rules, in one place.

``plan_setup(request, state)`` checks a request against the rules TensorFlow enforces
(python/eager/context.py) and the ones it does not enforce but silently gets wrong, and
returns the steps to take, or raises SetupError (StateError once the runtime has started)
with one line: what is wrong and what to do. It reads nothing and changes nothing itself, so both ``%tfmem setup`` and the setup
panel ask it, and tests can hand it any machine's state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import SetupError, StateError
from ..units import MiB, format_bytes
from .devices import PhysicalGpu
from .lab import lab_setting
from .nvml import GpuMemory
from .options import (
    DEFAULT_LAB_MB,
    FORCE_GROWTH_ENV,
    GPU_ALLOCATOR_ENV,
    LAB_LIMIT_ENV,
    LAB_USE_BFC_ENV,
    MIN_SYS_MEMORY_ENV,
    SetupRequest,
)
from .system_reserve import system_reserve

# Dividing a GPU "by count" must leave room for the CUDA context, which TensorFlow's default limit
# does not see (it reads free memory after creating it): 1 GiB, more than the context took on the cards tried.
CUDA_CONTEXT_ALLOWANCE = 1 << 30


@dataclass(frozen=True)
class DeviceState:
    """What the process has now, gathered without starting TensorFlow's runtime."""

    gpus: tuple[PhysicalGpu, ...]
    gpu_memory: Mapping[int, GpuMemory | None]  # TensorFlow GPU index -> the driver's reading
    nvml_note: str | None  # why NVML could not be read, if it could not
    cpu_logical: int
    host_total_bytes: int
    env: Mapping[str, str]  # the setup variables as TensorFlow read them (or will read them)
    runtime_started: bool
    env_notes: tuple[str, ...] = ()  # setup variables changed in the environment since TensorFlow read them


@dataclass(frozen=True)
class Step:
    """One change: what it does, the code a reader would write, and its data."""

    kind: str  # 'env', 'visible', 'growth', 'logical', 'cpus'
    target: object  # env name, GPU index, or None
    value: object
    code: str


@dataclass(frozen=True)
class SetupPlan:
    request: SetupRequest
    steps: tuple[Step, ...]
    notes: tuple[str, ...] = field(default=())
    lab_mb: int | None = None  # lab mode's limit once applied (None: not in lab mode)

    def code(self) -> str:
        """The equivalent plain TensorFlow code, in the order it must run."""
        env = [s.code for s in self.steps if s.kind == "env"]
        config = [s.code for s in self.steps if s.kind != "env"]
        lines = []
        if env:
            lines += ["import os"] + env
        if config:
            lines += ["import tensorflow as tf"]
            if any(s.kind in ("visible", "growth", "logical") for s in self.steps):
                lines += ['gpus = tf.config.list_physical_devices("GPU")']
            if any(s.kind == "cpus" for s in self.steps):
                lines += ['cpus = tf.config.list_physical_devices("CPU")']
            lines += config
        return "\n".join(lines)


def _restart_fix(request: SetupRequest) -> str:
    return (
        f"restart the kernel and run `{request.as_magic()}` (or tfmem_widgets.setup(...)) "
        "before any TensorFlow work"
    )


def _env_step(name: str, value: str, why: str) -> Step:
    return Step("env", name, value, f'os.environ["{name}"] = "{value}"  # {why}')


def _logical_code(index: int, sizes: Sequence[int]) -> str:
    configs = ", ".join(f"tf.config.LogicalDeviceConfiguration(memory_limit={mb})" for mb in sizes)
    return f"tf.config.set_logical_device_configuration(gpus[{index}], [{configs}])"


def _split_total_mb(index: int, request: SetupRequest, state: DeviceState) -> int:
    """The MB that --split N divides on GPU `index`: the limit if given, else an estimate."""
    limit = request.limit_mb
    if isinstance(limit, Mapping) and index in limit:
        return limit[index]
    if isinstance(limit, int):
        return limit
    memory = state.gpu_memory.get(index)
    if memory is None:
        raise SetupError(
            f"--split {request.split} without --limit divides GPU {index}'s free memory, which "
            f"needs NVML ({state.nvml_note or 'no reading for this GPU'}): give --limit MB "
            "(the total to divide) or the sizes (--split 2048,2048)."
        )
    gpu = state.gpus[index]
    reserve, _ = system_reserve(
        memory.free_bytes, gpu.compute_capability[0] if gpu.compute_capability else None, state.env
    )
    available = memory.free_bytes - (reserve or 0) - CUDA_CONTEXT_ALLOWANCE
    if available < request.split * MiB:
        raise SetupError(
            f"GPU {index} has {format_bytes(memory.free_bytes)} free: too little to split into "
            f"{request.split} logical devices; give smaller sizes with --split MB,MB."
        )
    return available // MiB


def plan_setup(request: SetupRequest, state: DeviceState) -> SetupPlan:
    """Check `request` against TensorFlow's rules on `state`; return the steps or raise.

    The phases, in order: what a bare request means; the GPUs named exist; the configuration each
    visible GPU would end with; TensorFlow's growth rules on it; the sizes against the card and
    the host; the steps (only what changes); too late once the runtime has started.
    """
    notes: list[str] = []
    request = _bare_request(request, state, notes)
    visible = _gpus_named_exist(request, state)
    targets = _targets(request, state, visible)
    _check_growth(request, state, visible, targets)
    _check_sizes(request, state, targets, notes)
    steps = _steps(request, state, visible, targets, notes)
    if state.runtime_started and steps:
        raise StateError(_too_late(steps[0], request, state))
    lab_now = lab_setting(state.env)
    lab_mb = request.lab_mb
    if lab_mb is None and lab_now.enabled:
        lab_mb = lab_now.limit_mb
    return SetupPlan(request=request, steps=tuple(steps), notes=tuple(notes), lab_mb=lab_mb)


@dataclass(frozen=True)
class _Targets:
    """What each visible GPU would end with: logical sizes, growth, and which were asked to change."""

    logical: dict[int, tuple[int, ...] | None]
    growth: dict[int, bool]
    requested_logical: set[int]


def _bare_request(request: SetupRequest, state: DeviceState, notes: list[str]) -> SetupRequest:
    """Without options and without a GPU: lab mode (the user's exported limit stands)."""
    gpu_count = len(state.gpus)
    lab_now = lab_setting(state.env)
    if request.is_empty() and gpu_count == 0:
        if lab_now.crashes:
            raise SetupError(f"{lab_now.problems[0]}; or run %tfmem setup --lab {DEFAULT_LAB_MB} to replace it.")
        if lab_now.enabled:
            # The user's own setting stands: they exported it, and did not ask to change it.
            notes.append(f"{lab_now.describe()}, as set in the environment (kept; --lab N replaces it)")
            notes.extend(lab_now.problems)
            if lab_now.limit_mb is not None:
                request = SetupRequest(lab_mb=lab_now.limit_mb)
        else:
            request = SetupRequest(lab_mb=DEFAULT_LAB_MB)
            notes.append(f"no GPU is visible to TensorFlow: lab mode with a {DEFAULT_LAB_MB} MB limit")
    notes.extend(state.env_notes)
    return request


def _gpus_named_exist(request: SetupRequest, state: DeviceState) -> list[int]:
    """Every GPU the request names exists; returns the GPUs in use after it."""
    gpu_count = len(state.gpus)
    if gpu_count == 0 and request.gpu_options():
        raise SetupError(
            f"no GPU is visible to TensorFlow here, so {', '.join(request.gpu_options())} cannot apply; "
            "for TensorFlow's allocator on the CPU use lab mode (%tfmem setup --lab 256)."
        )
    existing = ", ".join(str(g.index) for g in state.gpus) or "none"
    for index in list(request.gpus or []) + (
        list(request.limit_mb) if isinstance(request.limit_mb, Mapping) else []
    ):
        if not (isinstance(index, int) and 0 <= index < gpu_count):
            raise SetupError(
                f"there is no GPU {index}: TensorFlow lists GPUs {existing} "
                "(tf.config.list_physical_devices('GPU'))."
            )

    visible = [g.index for g in state.gpus if g.visible] if request.gpus is None else sorted(request.gpus)
    if isinstance(request.limit_mb, Mapping):
        hidden = sorted(set(request.limit_mb) - set(visible))
        if hidden:
            raise SetupError(
                f"GPU {hidden[0]} gets a limit but is not among the GPUs in use ({visible}): "
                "add it to --gpus or drop its limit."
            )
    if request.split is not None and not isinstance(request.split, int) and request.limit_mb is not None:
        raise SetupError(
            "give either sizes with --split (each is a logical device's limit) or --limit with a "
            "count (--limit 8192 --split 2), not both."
        )
    if request.growth is False and request.force_growth:
        raise SetupError("--no-growth and --force-growth contradict each other: choose one.")

    return visible


def _targets(request: SetupRequest, state: DeviceState, visible: list[int]) -> _Targets:
    target_logical: dict[int, tuple[int, ...] | None] = {}
    target_growth: dict[int, bool] = {}
    requested_logical: set[int] = set()
    for index in visible:
        gpu = state.gpus[index]
        sizes = gpu.logical_limits_mb
        limit = request.limit_mb
        if isinstance(limit, Mapping):
            limit = limit.get(index)
        if request.split is not None and not isinstance(request.split, int):
            sizes = tuple(request.split)
        elif isinstance(request.split, int):
            total = _split_total_mb(index, request, state)
            sizes = (total // request.split,) * request.split
        elif limit is not None:
            sizes = (limit,)
        if sizes != gpu.logical_limits_mb:
            requested_logical.add(index)
        target_logical[index] = sizes
        target_growth[index] = gpu.growth if request.growth is None else request.growth

    return _Targets(target_logical, target_growth, requested_logical)


def _check_growth(request: SetupRequest, state: DeviceState, visible: list[int], targets: _Targets) -> None:
    """TensorFlow's growth rules: not with logical devices through tf.config; the same on every GPU."""
    target_logical, target_growth, requested_logical = targets.logical, targets.growth, targets.requested_logical
    with_logical = [i for i in visible if target_logical[i]]
    with_growth = [i for i in visible if target_growth[i]]
    # TF_FORCE_GPU_ALLOW_GROWTH=true gives growth whatever tf.config dropped.
    forced = request.force_growth is True or (
        request.force_growth is None and state.env.get(FORCE_GROWTH_ENV, "") == "true"
    )
    if with_growth and with_logical and not (forced and request.growth is not True):
        g, lg = with_growth[0], with_logical[0]
        why = (
            "TensorFlow refuses memory growth on a GPU that has logical devices, and logical "
            "devices set after growth silently drop it (each preallocates its whole limit)"
        )
        if request.growth:
            if any(state.gpus[i].logical_limits_mb for i in with_logical) and lg not in requested_logical:
                raise SetupError(
                    f"GPU {lg} already has logical devices (set earlier in this process): {why}; "
                    "use --force-growth (TF_FORCE_GPU_ALLOW_GROWTH=true) to have growth with them."
                )
            raise SetupError(
                f"--growth cannot be combined with --limit or --split through tf.config: {why}; "
                "use --force-growth instead of --growth to have both."
            )
        raise SetupError(
            f"memory growth is on for GPU {g} (set earlier in this process) and logical devices on "
            f"GPU {lg} would silently drop it: {why}; add --no-growth to replace it, or "
            "--force-growth to keep growth with the limit."
        )
    if not with_logical and len({target_growth[i] for i in visible}) > 1:
        raise SetupError(
            "memory growth cannot differ between GPUs (TensorFlow: 'Memory growth cannot differ "
            "between GPU devices'): pass --growth or --no-growth to set it on all of them."
        )



def _check_sizes(request: SetupRequest, state: DeviceState, targets: _Targets, notes: list[str]) -> None:
    """Logical sizes within the card (NVML), the lab limit within the host."""
    target_logical, requested_logical = targets.logical, targets.requested_logical
    for index in sorted(requested_logical):
        sizes = target_logical[index]
        memory = state.gpu_memory.get(index)
        if sizes and memory is not None and sum(sizes) * MiB > memory.total_bytes:
            raise SetupError(
                f"GPU {index} has {format_bytes(memory.total_bytes)} in all (NVML), less than the "
                f"{sum(sizes)} MB asked for; choose at most {memory.total_bytes // MiB} MB in total."
            )
        if sizes and memory is None:
            notes.append(
                f"GPU {index}'s limit not checked against its size: {state.nvml_note or 'no NVML reading'}"
            )

    kept = lab_setting(state.env)
    if (request.lab_mb is not None and kept.enabled and kept.limit_mb == request.lab_mb
            and request.lab_mb * MiB > state.host_total_bytes):
        # The user's own exported setting, kept by a bare setup: said, not refused (they did not ask).
        notes.append(f"lab mode's limit of {request.lab_mb} MB, as exported, is more than this machine's "
                     f"{format_bytes(state.host_total_bytes)} of memory: an OOM in lab mode would come from "
                     "the machine, not the limit; --lab N sets a smaller one")
    elif request.lab_mb is not None and request.lab_mb * MiB > state.host_total_bytes:
        raise SetupError(
            f"lab mode's limit of {request.lab_mb} MB is more than this machine's "
            f"{format_bytes(state.host_total_bytes)} of memory; choose a smaller --lab."
        )



def _steps(request: SetupRequest, state: DeviceState, visible: list[int], targets: _Targets,
           notes: list[str]) -> list[Step]:
    """Only what changes, in the order it must run."""
    target_logical, target_growth, requested_logical = targets.logical, targets.growth, targets.requested_logical
    lab_now = lab_setting(state.env)
    steps: list[Step] = []
    env = state.env

    def env_change(name: str, value: str, why: str):
        if env.get(name) != value:
            steps.append(_env_step(name, value, why))

    lab_in_effect = (lab_now.enabled and lab_now.limit_mb == request.lab_mb
                     and (state.runtime_started or not lab_now.problems))
    if request.lab_mb is not None and not lab_in_effect:
        # Once the runtime has started, what counts is what TensorFlow read, not how it was
        # spelled (TF_CPU_ALLOCATOR_USE_BFC=1 is lab mode as much as "true").
        env_change(LAB_USE_BFC_ENV, "true", "lab mode: the CPU allocator becomes TensorFlow's BFC allocator")
        env_change(LAB_LIMIT_ENV, str(request.lab_mb), "and its limit in MB")
    elif request.lab_mb is None and not state.runtime_started:
        notes.extend(p for p in lab_now.problems if p not in notes)  # an exported setting read otherwise
    if request.allocator is not None:
        env_change(GPU_ALLOCATOR_ENV, request.allocator, "GPU allocator, read when the GPUs are created")
    if request.force_growth is not None:
        env_change(FORCE_GROWTH_ENV, "true" if request.force_growth else "false",
                   "growth for every GPU, logical devices included")
    if request.reserve_mb is not None:
        env_change(MIN_SYS_MEMORY_ENV, str(request.reserve_mb), "memory TensorFlow leaves free per GPU")
    current_visible = [g.index for g in state.gpus if g.visible]
    if request.gpus is not None and visible != current_visible:
        listed = ", ".join(f"gpus[{i}]" for i in visible)
        steps.append(Step("visible", None, tuple(visible),
                          f'tf.config.set_visible_devices([{listed}], "GPU")'))
    for index in visible:
        if target_growth[index] != state.gpus[index].growth:
            steps.append(Step("growth", index, target_growth[index],
                              f"tf.config.experimental.set_memory_growth(gpus[{index}], {target_growth[index]})"))
    for index in sorted(requested_logical):
        steps.append(Step("logical", index, target_logical[index], _logical_code(index, target_logical[index])))
    if request.cpus is not None and request.cpus != state.cpu_logical:
        steps.append(Step("cpus", None, request.cpus,
                          f"tf.config.set_logical_device_configuration(cpus[0], "
                          f"[tf.config.LogicalDeviceConfiguration()] * {request.cpus})"))

    return steps


def _too_late(step: Step, request: SetupRequest, state: DeviceState) -> str:
    """One line for a change asked after the runtime started: why, and the way out."""
    started = "TensorFlow's runtime has already started in this process (at its first op)"
    fix = _restart_fix(request)
    env = state.env
    if step.kind == "env" and step.target in (LAB_USE_BFC_ENV, LAB_LIMIT_ENV):
        now = lab_setting(env).describe()
        return f"{started}, so lab mode can no longer change (it is {now}, asked {request.lab_mb} MB): {fix}."
    if step.kind == "growth" or step.target == FORCE_GROWTH_ENV:
        return (
            f"{started}, so memory growth can no longer change: {fix}, or start Jupyter with "
            f"{FORCE_GROWTH_ENV}=true in its environment."
        )
    what = {
        "visible": "the visible GPUs",
        "logical": "logical devices and memory limits",
        "cpus": "the logical CPU devices",
        "env": f"{step.target}",
    }[step.kind]
    return f"{started}, so {what} can no longer change: {fix}."
