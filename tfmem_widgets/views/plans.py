"""A step's plan drawn: its peak against the limit, and its largest owners by layer."""

from __future__ import annotations

from ..units import MiB, format_bytes


def plot_step_plan(plan, ax=None, limit_bytes: int | None = None, top: int = 8):
    """The step's peak against the limit (resident, batch, step, and the worst take), and the step's
    largest owners by layer; `plan` is a StepPlan."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.4))
    limit = plan.limit_bytes if limit_bytes is None else limit_bytes
    left = 0.0
    for label, size, color in (("resident", plan.resident_bytes, "#7f7f7f"), ("batch", plan.batch_bytes, "#2ca02c"),
                               ("step", plan.step_bytes, "#1f77b4")):
        ax.barh(1, size / MiB, left=left, color=color, label=f"{label} {format_bytes(size)}")
        left += size / MiB
    extra = (plan.worst_take_bytes - plan.step_bytes) / MiB
    if extra > 0:
        ax.barh(1, extra, left=left, color="none", edgecolor="#1f77b4", hatch="//", label="up to the worst take")
    left = 0.0
    for k, (key, size) in enumerate(plan.layers.items()[:top]):
        ax.barh(0, size / MiB, left=left, color=f"C{k % 10}", edgecolor="white", label=f"{key} {format_bytes(size)}")
        left += size / MiB
    if limit:
        ax.axvline(limit / MiB, color="#6a1b9a", linestyle=":", label=f"limit {format_bytes(limit)}")
    ax.set_yticks([0, 1])
    ax.set_yticklabels(["step by layer", "peak"])
    ax.set_xlabel("MiB")
    ax.set_title(f"train step at batch {plan.batch_size:,}" + (" (estimate)" if plan.estimate else ""))
    ax.legend(loc="lower right", fontsize=7)
    return ax
