"""The picture beside a bench file: every row's fraction of its floor (ours eager and graph, the baseline), or in
the interpreter the seconds each check took (times there say nothing of speed)."""
from __future__ import annotations

from pathlib import Path

from .harness import Measurement


def plot_bench(rows: list[Measurement], path: Path, *, interpreter: bool) -> Path:
    """Write a horizontal bar chart of ``rows`` to ``path`` (PNG) and return it; failed checks are marked red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.kernel} {r.phase} {r.shape}"[:70] for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.6))
    y = range(len(rows))
    if interpreter:
        ax.barh(list(y), [r.median_us / 1e6 for r in rows], color=["tab:blue" if r.check == "ok" else "tab:red"
                                                                  for r in rows])
        ax.set_xlabel("seconds a call in the Triton interpreter (a check, not a speed)")
    else:
        series = {
            "ours (eager)": [r.floor_fraction for r in rows],
            "ours (CUDA graph)": [r.graph_floor_fraction for r in rows],
            "baseline (eager)": [r.floor_us / r.baseline_us for r in rows],
        }
        height = 0.27
        for i, (name, values) in enumerate(series.items()):
            ax.barh([v + (i - 1) * height for v in y], [v if v == v else 0.0 for v in values], height=height,
                    label=name)
        ax.set_xlabel("fraction of the floor (bytes / copy rate or FLOPs / matmul rate, measured in the same run)")
        ax.axvline(1.0, color="black", linewidth=0.5)
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(list(y), labels, fontsize=7)
    for tick, r in zip(ax.get_yticklabels(), rows):
        if r.check != "ok":
            tick.set_color("tab:red")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
