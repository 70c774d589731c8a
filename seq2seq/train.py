"""The training loop: teacher forcing, label-smoothed loss, warmup schedule, clipping, mixed precision,
periodic validation BLEU, atomic checkpoints and exact resume."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from tqdm import tqdm

from seq2seq import checkpoint as ckpt
from seq2seq.config import Config
from seq2seq.data.batching import Batch, epoch_batches, make_batch
from seq2seq.data.prepare import TrainingData, load_or_train_tokenizer, prepare_training_data, read_split
from seq2seq.errors import UserInputError
from seq2seq.evaluate import Scores, score
from seq2seq.run_log import MetricsLog, peak_memory_mb
from seq2seq.schedule import learning_rate
from seq2seq.tokenizer import PAD_ID
from seq2seq.translate import translate_lines

log = logging.getLogger(__name__)

MAX_SKIPPED_IN_A_ROW = 20  # fp16 loss scaling alone can skip a few in a row; this many means divergence


class TrainingDiverged(UserInputError):
    """Too many consecutive updates with non-finite gradients: the settings need changing."""


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint so a resumed run continues exactly."""

    step: int = 0
    epoch: int = 1
    next_batch: int = 0  # index into this epoch's batch order
    best_bleu: float = -1.0
    stale_validations: int = 0
    train_seconds: float = 0.0
    skipped_steps: int = 0  # non-finite gradients (fp16 overflow or NaN loss): never applied


@dataclass(frozen=True)
class TrainResult:
    progress: Progress
    last_checkpoint: Path
    stop_reason: str


def token_loss(logits: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Summed label-smoothed cross entropy over non-pad positions; logits (B, T, V), target (B, T)."""
    return F.cross_entropy(
        logits.float().flatten(0, 1), target.flatten(), ignore_index=PAD_ID, label_smoothing=smoothing, reduction="sum"
    )


class Trainer:
    def __init__(self, config: Config, run_dir: Path, *, resume: bool = False, show_progress: bool = True) -> None:
        self.config, self.run_dir, self.show_progress = config, Path(run_dir), show_progress
        tc = config.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if tc.precision == "fp16" and self.device.type != "cuda":
            raise UserInputError("train.precision: fp16 needs a CUDA GPU (loss scaling); use bf16 or fp32 on CPU")
        self.checkpoints = self.run_dir / "checkpoints"
        _check_run_dir(self.checkpoints, resume)
        torch.manual_seed(tc.seed)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        train_text = read_split(config, "train")
        self.tokenizer = load_or_train_tokenizer(config, self.run_dir / "tokenizer", train_text)
        self.data: TrainingData = prepare_training_data(config, self.tokenizer, train_text)
        self.model = ckpt.build_model(config, self.tokenizer).to(self.device)
        self.forward = torch.compile(self.model) if tc.compile else self.model
        optimizer_class = torch.optim.AdamW if tc.optimizer == "adamw" else torch.optim.Adam
        self.optimizer = optimizer_class(
            self.model.parameters(), lr=0.0, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=tc.precision == "fp16")
        self.progress = Progress()
        self.skipped_in_a_row = 0
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", tensorboard=True)
        if resume:
            self._restore(_latest_checkpoint(self.checkpoints))

    def autocast(self):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.config.train.precision)
        return torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)

    def run(self) -> TrainResult:
        tc, progress = self.config.train, self.progress
        log.info("model: %.2fM parameters; training on %s", _parameter_count(self.model) / 1e6, self.device)
        bar = tqdm(total=tc.max_steps, initial=progress.step, desc="train", unit="step", disable=not self.show_progress)
        window_loss, window_tokens, window_start = torch.zeros((), device=self.device), 0, time.perf_counter()
        stop_reason = ""
        while not stop_reason:
            batches = epoch_batches(self.data.train, max_tokens=tc.max_tokens, seed=tc.seed, epoch=progress.epoch)
            while progress.next_batch < len(batches) and not stop_reason:
                group = batches[progress.next_batch : progress.next_batch + tc.accum_steps]
                progress.next_batch += len(group)
                started = time.perf_counter()
                loss_sum, tokens, applied = self._update([make_batch(self.data.train, indices) for indices in group])
                progress.train_seconds += time.perf_counter() - started
                if applied:  # a skipped (non-finite) step would poison the logged average
                    window_loss += loss_sum
                    window_tokens += tokens
                bar.update(1)
                if progress.step % tc.log_every == 0:
                    elapsed = time.perf_counter() - window_start
                    loss = window_loss.item() / max(window_tokens, 1)
                    self._log_train(bar, loss, window_tokens / elapsed)
                    window_loss.zero_()
                    window_tokens, window_start = 0, time.perf_counter()
                if progress.step % tc.valid_every == 0:
                    self._validate(bar)
                stop_reason = self._stop_reason()
                if progress.step % tc.save_every == 0 or stop_reason:
                    self._save()
            if progress.next_batch >= len(batches):
                progress.epoch, progress.next_batch = progress.epoch + 1, 0
                if tc.max_epochs and progress.epoch > tc.max_epochs and not stop_reason:
                    stop_reason = f"max_epochs ({tc.max_epochs})"
                    self._save()
        bar.close()
        log.info("stopped after %d steps: %s", progress.step, stop_reason)
        return TrainResult(dataclasses.replace(progress), self.checkpoints / "last.pt", stop_reason)

    def _update(self, batches: list[Batch]) -> tuple[torch.Tensor, int, bool]:
        """One optimizer update over `batches` (gradient accumulation), in the canonical AMP order.

        Returns the summed loss, the target tokens and whether the update was applied: an update
        with non-finite gradients (fp16 overflow, NaN loss) is skipped, never applied.
        """
        tc, progress = self.config.train, self.progress
        total_tokens = sum(batch.num_tokens for batch in batches)
        loss_sum = torch.zeros((), device=self.device)
        self.model.train()
        for batch in batches:
            batch = batch.to(self.device)
            with self.autocast():
                logits = self.forward(batch.src, batch.tgt_in)
            loss = token_loss(logits, batch.tgt_out, tc.label_smoothing)
            self.scaler.scale(loss / total_tokens).backward()
            loss_sum += loss.detach()
        progress.step += 1
        lr = learning_rate(progress.step, tc, d_model=self.config.model.d_model)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaler.unscale_(self.optimizer)
        max_norm = tc.clip_norm if tc.clip_norm > 0 else math.inf
        self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if self.scaler.is_enabled():
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skips the step itself when gradients overflowed
            self.scaler.update()
            applied = self.scaler.get_scale() >= scale
        else:
            applied = bool(torch.isfinite(self.grad_norm))
            if applied:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not applied:
            self._count_skipped_step()
        else:
            self.skipped_in_a_row = 0
        return loss_sum, total_tokens, applied

    def _count_skipped_step(self) -> None:
        self.progress.skipped_steps += 1
        self.skipped_in_a_row += 1
        log.warning("step %d: non-finite gradients; update skipped", self.progress.step)
        if self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise TrainingDiverged(
                f"training diverged: {self.skipped_in_a_row} updates in a row had non-finite gradients "
                f"(step {self.progress.step}); lower train.lr, raise train.warmup_steps or use fp32/bf16"
            )

    def _log_train(self, bar: tqdm, loss: float, tokens_per_second: float) -> None:
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = float(self.grad_norm)
        bar.set_postfix(
            epoch=self.progress.epoch, loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:,.0f}"
        )
        self.metrics.write(
            "train",
            step=self.progress.step,
            epoch=self.progress.epoch,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens_per_second=tokens_per_second,
            peak_memory_mb=peak_memory_mb(self.device),
        )

    @torch.no_grad()
    def evaluate_valid(self) -> tuple[float, Scores, list[str]]:
        """Validation NLL per target token, and BLEU/chrF of at most valid_max_sentences translations."""
        tc = self.config.train
        self.model.eval()
        nll, tokens = 0.0, 0
        for indices in epoch_batches(self.data.valid, max_tokens=tc.max_tokens, seed=0, epoch=0):
            batch = make_batch(self.data.valid, indices).to(self.device)
            with self.autocast():
                logits = self.model(batch.src, batch.tgt_in)
            nll += token_loss(logits, batch.tgt_out, 0.0).item()
            tokens += batch.num_tokens
        count = min(tc.valid_max_sentences, len(self.data.valid_text))
        decode = dataclasses.replace(self.config.decode, beam=tc.valid_beam, nbest=1)
        with self.autocast():
            translations = translate_lines(self.model, self.tokenizer, self.data.valid_text.src[:count], decode)
        hypotheses = [t.text for t in translations]
        return nll / max(tokens, 1), score(hypotheses, self.data.valid_text.tgt[:count]), hypotheses

    def _validate(self, bar: tqdm) -> None:
        loss, scores, hypotheses = self.evaluate_valid()
        improved = scores.bleu > self.progress.best_bleu
        if improved:
            self.progress.best_bleu, self.progress.stale_validations = scores.bleu, 0
        else:
            self.progress.stale_validations += 1
        ppl = math.exp(min(loss, 50))
        bar.write(
            f"step {self.progress.step}: valid loss {loss:.3f}, ppl {ppl:.2f}, "
            f"BLEU {scores.bleu:.2f}, chrF {scores.chrf:.2f}"
        )
        samples = zip(self.data.valid_text.src, self.data.valid_text.tgt, hypotheses)
        for src, ref, hyp in list(samples)[:2]:
            bar.write(f"  src: {src}\n  ref: {ref}\n  hyp: {hyp}")
        self.metrics.write("valid", step=self.progress.step, loss=loss, ppl=ppl, bleu=scores.bleu, chrf=scores.chrf)
        if improved:
            ckpt.save_checkpoint(self.checkpoints / "best.pt", self._state())

    def _stop_reason(self) -> str:
        tc, progress = self.config.train, self.progress
        if progress.step >= tc.max_steps:
            return f"max_steps ({tc.max_steps})"
        if tc.max_time and progress.train_seconds >= tc.max_time:
            return f"max_time ({tc.max_time:g}s)"
        if tc.patience and progress.stale_validations >= tc.patience:
            return f"no BLEU improvement in {tc.patience} validations (patience)"
        return ""

    def _state(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "tokenizer": ckpt.tokenizer_to_state(self.tokenizer),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "progress": dataclasses.asdict(self.progress),
            "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all()},
        }

    def _save(self) -> None:
        step = self.progress.step
        path = self.checkpoints / f"step_{step:08d}.pt"
        ckpt.save_checkpoint(path, self._state())
        ckpt.link_latest(path, self.checkpoints / "last.pt")
        for old in sorted(self.checkpoints.glob("step_*.pt"))[: -self.config.train.keep_last]:
            old.unlink()

    def _restore(self, path: Path) -> None:
        state = ckpt.read_checkpoint(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.progress = Progress(**state["progress"])
        torch.set_rng_state(state["rng"]["torch"])
        if torch.cuda.is_available() and state["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.metrics.truncate_after(self.progress.step)
        log.info("resumed from %s at step %d", path, self.progress.step)


def _check_run_dir(checkpoints: Path, resume: bool) -> None:
    existing = checkpoints.exists() and any(checkpoints.glob("step_*.pt"))
    if resume and not existing:
        raise UserInputError(f"--resume: {checkpoints} has no checkpoint to resume from")
    if existing and not resume:
        raise UserInputError(
            f"{checkpoints.parent}: this run directory already has checkpoints; pass --resume to continue it "
            "or --run-dir to start a new run"
        )


def _latest_checkpoint(checkpoints: Path) -> Path:
    return sorted(checkpoints.glob("step_*.pt"))[-1]


def _parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
