"""``dsa-tune show --plot``: tuned over default time per stored record, one bar each, grouped by kernel."""
from __future__ import annotations

from pathlib import Path


def plot_records(rows: list[dict], path: str | Path) -> Path:
    """Draw ``rows`` (``dsa-tune show``'s: kernel, phase, shape, tuned/default, timing, code) into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: (r["kernel"], r["phase"], r["shape"]))
    labels = [f"{r['kernel']} {r['phase']} {r['shape']}"[:80] for r in rows]
    speedups = [r["tuned/default"] if r["tuned/default"] == r["tuned/default"] else 0.0 for r in rows]
    colors = ["tab:green" if r["code"] == "fresh" else "tab:gray" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.26 * len(rows) + 1.6))
    ax.barh(range(len(rows)), speedups, color=colors)
    ax.axvline(1.0, color="black", linewidth=0.5)
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("default time / tuned time (green: fresh record, gray: made by other code)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
