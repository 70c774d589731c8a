"""PNG plots people would rather see than read: training curves and cross-attention maps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from seq2seq.config import DecodeConfig  # noqa: E402
from seq2seq.data.batching import pad  # noqa: E402
from seq2seq.data.special_tokens import BOS_ID  # noqa: E402
from seq2seq.data.tokenizer import Tokenizer  # noqa: E402
from seq2seq.errors import UserInputError  # noqa: E402
from seq2seq.files import atomic_write  # noqa: E402
from seq2seq.inference.search import search  # noqa: E402
from seq2seq.training.run_log import MetricsLog  # noqa: E402

ATTENTION_PLOT_PIECES = 100  # pieces of each side an attention plot shows at most
ATTENTION_PLOT_LINES = 5  # `translate --attention-plot` draws the first lines only


def plot_training_curves(run_dir: str | Path) -> list[Path]:
    """RUN_DIR/plots/{loss,bleu,lr,memory}.png from RUN_DIR/metrics.jsonl."""
    run_dir = Path(run_dir)
    records = MetricsLog(run_dir / "metrics.jsonl").read()
    if not records:
        raise UserInputError(f"{run_dir}/metrics.jsonl: no metrics to plot (has this run logged a step yet?)")
    train = [r for r in records if r["kind"] == "train"]
    valid = [r for r in records if r["kind"] == "valid"]
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    figures = {
        "loss": [("train loss (label-smoothed)", train, "loss"), ("valid loss (NLL)", valid, "loss")],
        "bleu": [("valid BLEU", valid, "bleu"), ("valid chrF", valid, "chrf")],
        "lr": [("learning rate", train, "lr")],
        "memory": [
            ("RSS now (MiB)", train, "rss_mb"),
            ("RSS, peak since the last log line (MiB)", train, "window_peak_rss_mb"),
            ("peak (MiB)", train, "peak_memory_mb"),
            ("CUDA allocated (MiB)", train, "cuda_allocated_mb"),
            ("CUDA reserved (MiB)", train, "cuda_reserved_mb"),
        ],
    }
    written = []
    for name, series in figures.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, rows, key in series:
            rows = [r for r in rows if key in r]  # runs logged before a figure existed lack it
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
        ax.legend()
        fig.tight_layout()
        _save_png(fig, out / f"{name}.png")
        plt.close(fig)
        written.append(out / f"{name}.png")
    return written


@torch.no_grad()
def plot_attention(
    model, tokenizer: Tokenizer, lines: list[str], out_dir: str | Path, decode: DecodeConfig
) -> list[Path]:
    """One PNG per line: cross-attention (target pieces x source pieces) of the translation `decode`
    finds, averaged over heads, per layer. At most ATTENTION_PLOT_PIECES pieces of each side are drawn:
    the figure grows with them, and a 2,000-piece line once asked for gigabytes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    written = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        src = pad([tokenizer.encode_src([line])[0]]).to(device)
        hyp = search(model, src, dataclasses.replace(decode, nbest=1))[0][0]
        tgt_in = torch.tensor([[BOS_ID, *hyp.tokens]], device=device)
        shown = ATTENTION_PLOT_PIECES
        maps = model.cross_attention(src, tgt_in)[:, 0].mean(1).float().cpu()[:, :shown, :shown]  # (layers, T, S)
        src_labels = tokenizer.src_pieces(line)[:shown]
        tgt_labels = (tokenizer.tgt_pieces(hyp.tokens) + ["</s>"])[:shown]
        layers = maps.size(0)
        fig, axes = plt.subplots(
            1, layers, figsize=(1 + 0.35 * len(src_labels) * layers, 1 + 0.3 * len(tgt_labels)), squeeze=False
        )
        for layer, ax in enumerate(axes[0]):
            ax.imshow(maps[layer].numpy(), cmap="viridis", aspect="auto", vmin=0.0)
            ax.set_xticks(range(len(src_labels)), src_labels, rotation=90, fontsize=7)
            ax.set_yticks(range(len(tgt_labels)), tgt_labels if layer == 0 else [""] * len(tgt_labels), fontsize=7)
            ax.set_title(f"layer {layer + 1}", fontsize=8)
        fig.tight_layout()
        path = out_dir / f"attention_{number}.png"
        _save_png(fig, path)
        plt.close(fig)
        written.append(path)
    return written


def _save_png(fig, path: Path) -> None:
    """Written atomically, as every file seq2seq writes: a killed run never leaves half a PNG."""
    with atomic_write(path) as handle:
        fig.savefig(handle, format="png", dpi=110)
