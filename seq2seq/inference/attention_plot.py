"""Cross-attention maps as PNG plots (`seq2seq translate --attention-plot`): where each output piece looked."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from seq2seq.data.batching import pad  # noqa: E402
from seq2seq.data.special_tokens import BOS_ID  # noqa: E402
from seq2seq.data.tokenizer import Tokenizer  # noqa: E402
from seq2seq.decoding import DecodeConfig  # noqa: E402
from seq2seq.files import save_png  # noqa: E402
from seq2seq.inference.search import search  # noqa: E402

ATTENTION_PLOT_PIECES = 100  # pieces of each side an attention plot shows at most


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
        hyp = search(model, src, dataclasses.replace(decode, nbest=1, sample=False))[0][0]
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
        path = plot_file(out_dir, number)
        save_png(fig, path)
        plt.close(fig)
        written.append(path)
    return written


def plot_file(out_dir: Path, number: int) -> Path:
    """The PNG of the input's line `number` (from 1)."""
    return out_dir / f"attention_{number}.png"
