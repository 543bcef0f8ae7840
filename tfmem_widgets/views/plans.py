"""A step's plan drawn: its program's buffers over the program, or its peak against the limit by owner."""

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


def plot_program(planned, ax=None, limit_bytes: int | None = None):
    """The step's program drawn from its plan's Timeline (plans/timeline.py), as XProf's memory viewer draws a
    program: the live buffers stacked over the program by Keras layer and phase, on top of what a run holds
    throughout (the model's variables, the batch, the step's outputs), the temporary allocation's whole size
    (taken at the run's start), the peak of the live buffers and the limit marked. Returns the axes."""
    import matplotlib.pyplot as plt

    line = planned.timeline
    side = None
    if ax is None and planned.fit is not None:  # the fit's shares beside the program, on the same scale
        _, (ax, side) = plt.subplots(1, 2, figsize=(11, 5.6), gridspec_kw={"width_ratios": [5, 1]}, sharey=True)
        plot_fit(planned, side, limit_bytes)
    elif ax is None:
        _, ax = plt.subplots(figsize=(9, 4.2))
    outputs = planned.step_bytes - (line.allocation_bytes if line is not None else 0)
    base = [("the model's variables (resident)", planned.resident_bytes, "#9e9e9e"),
            ("the batch", planned.batch_bytes, "#bdbdbd"), ("the step's outputs", max(0, outputs), "#e0e0e0")]
    under = sum(n for _, n, _ in base)
    right = line.events if line is not None else 1
    bottom = 0
    for label, n, colour in base:
        if n > 0:
            ax.fill_between([0, right], bottom / MiB, (bottom + n) / MiB, color=colour, step="post",
                            label=f"{label}: {format_bytes(n)}")
            bottom += n
    if line is not None:
        xs = list(line.moments)
        level = [under] * len(xs)
        for key, values in line.series:
            top = [a + b for a, b in zip(level, values)]
            ax.fill_between(xs, [v / MiB for v in level], [v / MiB for v in top], step="post", label=key,
                            linewidth=0)
            level = top
        whole = under + line.allocation_bytes
        ax.axhline(whole / MiB, color="#555", linestyle="--", linewidth=1,
                   label=f"taken for the run: the temporaries' one allocation, {format_bytes(line.allocation_bytes)}")
        peak = under + line.peak_bytes
        ax.plot([line.peak_moment], [peak / MiB], "v", color="black", markersize=8,
                label=f"peak of the live buffers: {format_bytes(peak)}")
        ax.set_xlim(0, right)
        ax.set_xlabel("the program, in XLA's order (the heap simulator's events)")
    limit = limit_bytes if limit_bytes is not None else planned.limit_bytes
    highest = under + (line.allocation_bytes if line is not None else 0)
    if limit and limit <= 2 * highest:
        ax.axhline(limit / MiB, color="#6a1b9a", linestyle=":", label=f"limit {format_bytes(limit)}")
    elif limit:  # far above: drawn, the program would be a sliver at the bottom
        ax.plot([], [], " ", label=f"limit {format_bytes(limit)}, above this picture")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(f"The train step at batch {planned.batch_size:,}, by its plan: "
                 f"{format_bytes(planned.peak_bytes)} at its peak")
    if side is None:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:  # (the fit's bar stands to the right: the legend goes under the program)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.13), ncol=2)
    return ax


def plot_fit(planned, ax, limit_bytes: int | None = None):
    """The fit's peak by share (plans/fit.py), one stacked bar: what was in use when planned (or the model's
    variables, where nothing was placed), the data, the pipeline's buffers on the device, the step's copy of
    the batch, the step; the peak as placed (or modelled), and the limit where it is near."""
    fit = planned.fit
    first = ("in use when planned", fit.in_use_bytes) if fit.peak_bytes is not None else (
        "the model's variables", planned.resident_bytes)
    shares = [first, ("the data", sum(fit.data) + (0 if fit.peak_bytes is not None else sum(fit.data_held))),
              ("the input pipeline", sum(fit.pipeline)), ("the step's copy of the batch", sum(fit.batch_copy)),
              ("the step", planned.step_bytes)]
    bottom = 0
    for k, (label, n) in enumerate(shares):
        if n:
            ax.bar(0, n / MiB, bottom=bottom / MiB, width=0.6, color=f"C{k + 5}", label=f"{label}: {format_bytes(n)}")
            bottom += n
    peak = planned.fit_peak_bytes
    beyond = fit.handed_out_beyond(planned)
    if beyond > 0:  # what the allocator hands out beyond the bytes asked: whole chunks, the 256-byte steps
        ax.bar(0, beyond / MiB, bottom=bottom / MiB, width=0.6, color="none", edgecolor="#555", hatch="//",
               label=f"handed out beyond the bytes (whole chunks): {format_bytes(beyond)}")
    how = "placed" if fit.peak_bytes is not None else "modelled"
    ax.plot([0], [peak / MiB], "v", color="black", markersize=8, label=f"the fit's peak, {how}: {format_bytes(peak)}")
    limit = limit_bytes if limit_bytes is not None else planned.limit_bytes
    if limit and limit <= 2 * peak:
        ax.axhline(limit / MiB, color="#6a1b9a", linestyle=":")
    ax.set_xticks([])
    ax.set_title("the whole fit", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.02))
    return ax



def plot_replicas(planned, ax=None, limit_bytes: int | None = None):
    """A ReplicaPlan (plans/replicas.py) drawn: one stacked bar per replica of its shares (variables, data,
    pipeline, batches, the larger of its step and its all-reduce), or, where the replicas share one allocator,
    one bar of them all; the limit of the busiest replica's device (or of the shared pool) drawn."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    names = ("variables", "the data", "the input pipeline", "batches", "step or all-reduce")
    bars = [list(planned.replicas)] if planned.shared_pool else [[r] for r in planned.replicas]
    for x, replicas in enumerate(bars):
        bottom = 0
        for replica in replicas:
            batches = (0 if replica.batch_in_pipeline else replica.batch_bytes + replica.ahead_bytes) + replica.first_extra_bytes
            shares = (replica.resident_bytes, replica.data_bytes, replica.pipeline_bytes, batches,
                      max(replica.step_bytes, replica.reduce_bytes))
            for j, (name, size) in enumerate(zip(names, shares)):
                if size:
                    ax.bar(x, size / MiB, bottom=bottom / MiB, width=0.6, color=f"C{j}", edgecolor="white", label=name)
                    bottom += size
    limit = planned.limit_bytes if limit_bytes is None else limit_bytes
    if limit:
        ax.axhline(limit / MiB, color="#6a1b9a", linestyle=":", label=f"limit {format_bytes(limit)}")
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels(["one pool: " + " + ".join(r.device for r in planned.replicas)] if planned.shared_pool
                       else [f"{r.device} ({r.rows:,} rows)" for r in planned.replicas])
    ax.set_ylabel("MiB")
    ax.set_title(f"{planned.strategy}, global batch {planned.global_batch:,}: each replica's peak (estimate)",
                 fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # (each share named once)
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper right")
    return ax
