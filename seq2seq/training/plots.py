"""Training curves as PNG plots (loss, BLEU, learning rate, memory), read from a run's metrics log."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402

from seq2seq.errors import UserInputError  # noqa: E402
from seq2seq.files import check_replaceable_plots, save_png  # noqa: E402
from seq2seq.training.run_log import MetricsLog  # noqa: E402

# each plot's curves: (label, kind of record, key)
FIGURES = {
    "loss": [
        ("train loss (label-smoothed)", "train", "loss"),
        ("valid loss (NLL)", "valid", "loss"),
        ("valid loss, weight average", "valid", "ema_loss"),
    ],
    "bleu": [
        ("valid BLEU", "valid", "bleu"),
        ("valid chrF", "valid", "chrf"),
        ("valid BLEU, weight average", "valid", "ema_bleu"),
        ("valid chrF, weight average", "valid", "ema_chrf"),
    ],
    "lr": [("learning rate", "train", "lr")],
    "memory": [
        ("RSS now (MiB)", "train", "rss_mb"),
        ("RSS, peak since the last log line (MiB)", "train", "window_peak_rss_mb"),
        ("peak (MiB)", "train", "peak_memory_mb"),
        ("CUDA allocated (MiB)", "train", "cuda_allocated_mb"),
        ("CUDA reserved (MiB)", "train", "cuda_reserved_mb"),
    ],
}


def plot_training_curves(run_dir: str | Path) -> list[Path]:
    """RUN_DIR/plots/{loss,bleu,lr,memory}.png from RUN_DIR/metrics.jsonl, replacing the ones an
    earlier call wrote and nothing else."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        found = "not found" if not run_dir.exists() else "not a directory"
        raise UserInputError(f"{run_dir}: {found}; expected a run directory (seq2seq train --run-dir)")
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserInputError(
            f"{run_dir}: no metrics.jsonl; expected a run directory (seq2seq train --run-dir) that has logged a step"
        )
    out = run_dir / "plots"
    check_replaceable_plots([out / f"{name}.png" for name in FIGURES], command="seq2seq plot")
    records = MetricsLog(run_dir / "metrics.jsonl").read()
    if not records:
        raise UserInputError(f"{run_dir}/metrics.jsonl: no metrics to plot (has this run logged a step yet?)")
    out.mkdir(exist_ok=True)
    written = []
    for name, series in FIGURES.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, kind, key in series:
            rows = [r for r in records if r["kind"] == kind and key in r]  # older runs' records lack new keys
            if rows:
                ax.plot(
                    [r["step"] for r in rows],
                    [r[key] for r in rows],
                    marker="." if len(rows) < 50 else None,
                    label=label,
                )
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
        else:  # a run shorter than its first log line: say so rather than draw an empty frame
            ax.text(0.5, 0.5, "nothing logged yet", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        save_png(fig, out / f"{name}.png")
        plt.close(fig)
        written.append(out / f"{name}.png")
    return written
