"""The run picture: loss and eval loss, learning rate, throughput and memory, drawn from ``metrics.jsonl``.

``draw(RUN_DIR)`` writes ``RUN_DIR/report.png``. For a sweep directory (jobs in sub-directories, each with
its own ``metrics.jsonl``) every panel holds one curve per job, so the jobs compare side by side.
"""

from __future__ import annotations

import json
import os

PANELS = [  # (title, [(metric, style)], y label)
    ("loss", [("train/loss", "-"), ("eval/loss", "o--")], "loss"),
    ("learning rate", [("lr", "-")], "lr"),
    ("throughput", [("tokens_per_s", "-")], "tokens/s (global)"),
    ("memory", [("memory/max_allocated_gib", "-"), ("memory/max_reserved_gib", ":"), ("memory/rss_gib", "-")],
     "GiB (rank 0)"),
]


def read_metrics(path: str) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)], sorted by step. A step logged twice (a resumed run re-does the steps after
    its checkpoint) keeps its last value."""
    by_metric: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if "step" not in rec:  # e.g. the error record of a failed run
                continue
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    by_metric.setdefault(k, {})[rec["step"]] = float(v)
    return {k: sorted(v.items()) for k, v in by_metric.items()}


def find_runs(path: str) -> dict[str, str]:
    """label -> metrics.jsonl: the run itself, or each job of a sweep directory (searched two levels deep)."""
    own = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(own):
        return {os.path.basename(os.path.normpath(path)): own}
    runs = {}
    for root, dirs, files in sorted(os.walk(path)):
        depth = os.path.relpath(root, path).count(os.sep)
        if "metrics.jsonl" in files and root != path:
            runs[os.path.relpath(root, path)] = os.path.join(root, "metrics.jsonl")
            dirs[:] = []
        elif depth >= 1:
            dirs[:] = []
    return runs


def draw(path: str, out: str | None = None) -> str:
    """Draw the report of a run or a sweep directory; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    runs = find_runs(path)
    if not runs:
        raise FileNotFoundError(f"no metrics.jsonl in {path} or in its job directories")
    data = {label: read_metrics(p) for label, p in runs.items()}
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, series, ylabel) in zip(axes.flat, PANELS):
        for i, (label, metrics) in enumerate(data.items()):
            for name, style in series:
                points = metrics.get(name)
                if not points:
                    continue
                steps, values = zip(*points)
                tag = name if len(data) == 1 else f"{label}: {name}"
                ax.plot(steps, values, style, color=colors[i % len(colors)] if len(data) > 1 else None,
                        label=tag, markersize=4, alpha=0.9)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7 if len(data) > 1 else 8)
        else:
            ax.text(0.5, 0.5, "not reported", ha="center", va="center", transform=ax.transAxes, color="gray")
    name = os.path.basename(os.path.normpath(path))
    fig.suptitle(f"shardyard: {name}" + (f" ({len(data)} jobs)" if len(data) > 1 else ""))
    fig.tight_layout()
    out = out or os.path.join(path, "report.png")
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return out
