"""The report's figures: training curves, visual tokens and stop reasons as PNG files."""

from __future__ import annotations

from pathlib import Path

from pipelines.report.collect import ReportData

# Training curves worth plotting first when present (others follow alphabetically).
CURVE_ORDER = ("reward/mean", "reward/accuracy", "reward/tool", "accuracy", "val/accuracy",
               "tool_calls/mean", "turns/mean", "response_length/mean", "strategy/kept_groups",
               "strategy/dropped_zero_variance", "entropy", "grad_norm", "loss")


def _curve_names(data: ReportData) -> list[str]:
    names = {n for per in data.curves.values() for n in per}
    ordered = [n for key in CURVE_ORDER for n in sorted(names) if n.split("/", 1)[1] == key]
    return ordered + sorted(names - set(ordered))


def _save(fig, path: Path) -> Path:
    """``fig`` as a PNG at ``path``, whole or not at all (a full disk left an empty file)."""
    import io

    from pipelines.fsutil import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return atomic_write_bytes(path, buf.getvalue())


def make_plots(data: ReportData, out_dir: Path, max_curves: int = 16) -> dict[str, Path]:
    """Training curves, visual tokens and stop reasons as PNG files; returns name -> path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}
    names = _curve_names(data)[:max_curves]
    if names:
        cols = min(4, len(names))
        rows = (len(names) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names):
            for run, per in sorted(data.curves.items()):
                if name in per:
                    steps, values = zip(*sorted(per[name]))
                    ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3,
                            label=run)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(names):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        made["training_curves"] = _save(fig, out_dir / "training_curves.png")
        plt.close(fig)
    if data.eval_stats:
        labels = [f"{s['run']}\n{s['model']}\n{s['benchmark']}" for s in data.eval_stats]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(labels)), 4))
        ax1.bar(range(len(labels)), [s["visual_tokens_mean"] for s in data.eval_stats])
        ax1.set_title("visual tokens per sample (mean)", fontsize=10)
        reasons = sorted({r for s in data.eval_stats for r in s["stop_reasons"]})
        bottom = [0.0] * len(labels)
        for reason in reasons:
            vals = [s["stop_reasons"].get(reason, 0) / s["n"] for s in data.eval_stats]
            ax2.bar(range(len(labels)), vals, bottom=bottom, label=reason)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax2.set_title("stop reasons (fraction of samples)", fontsize=10)
        ax2.legend(fontsize=7)
        for ax in (ax1, ax2):
            ax.set_xticks(range(len(labels)), labels, fontsize=6)
        fig.tight_layout()
        made["eval_stats"] = _save(fig, out_dir / "eval_stats.png")
        plt.close(fig)
    return made
