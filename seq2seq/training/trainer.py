"""The training loop and its stop rules: batches in a seeded order, one `train_step` per update, logging
windows, periodic validation (and a last one when the run stops) and best.pt, checkpoints and exact
resume (a Ctrl-C or SIGTERM saves the update it lands in first: interruption.py), DistributedDataParallel.

The update itself is train_step.py; the learning rate for the budget spent, schedule.py; the weight
average, weight_average.py; the run directory and data preparation, run_dir.py; the checkpoint
format, checkpoint.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from seq2seq.checkpoint import (
    BEST,
    LAST,
    Checkpoint,
    Progress,
    RngStates,
    save_numbered,
)
from seq2seq.config import Config
from seq2seq.data.batching import epoch_batches, make_batch
from seq2seq.errors import UserInputError
from seq2seq.model.transformer import build_model
from seq2seq.progress import progress_bar
from seq2seq.training.distributed import setup_distributed
from seq2seq.training.host_memory import HEAP_TRIM_EVERY, release_free_heap
from seq2seq.training.interruption import StopRequested, StopRequests
from seq2seq.training.precision import choose_precision
from seq2seq.training.run_dir import RunDir, check_resumable, fine_tuning_start, prepare_run
from seq2seq.training.run_log import LogWindow, MetricsLog, PeakRss, log_to_file, memory_figures
from seq2seq.training.schedule import budget_spent, learning_rate
from seq2seq.training.train_step import (
    MAX_SKIPPED_IN_A_ROW,
    SkippedUpdates,
    StepResult,
    TrainingDiverged,
    autocast,
    build_optimizer,
    build_scaler,
    compile_for_training,
    train_step,
)
from seq2seq.training.validation import (
    ValidationResult,
    average_last_saves,
    metric_score,
    record_best,
    report_validation,
    score_of_saved,
    validate,
)
from seq2seq.training.weight_average import ExponentialAverage
from seq2seq.training.working_copy import working_copy_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    progress: Progress
    last_checkpoint: Path
    stop_reason: str


class Trainer:
    def __init__(self, config: Config, run_dir: Path, *, resume: bool = False, show_progress: bool = True) -> None:
        self.config, self.run_dir = config, RunDir(Path(run_dir))
        tc = config.train
        self.dist = setup_distributed(tc.device)
        self.show_progress = show_progress and self.dist.is_main
        if tc.threads:
            torch.set_num_threads(tc.threads)
        self.device = self.dist.device()
        if tc.precision == "fp16" and self.device.type != "cuda":
            raise UserInputError("train.precision: fp16 needs a CUDA GPU (loss scaling); use auto, bf16 or fp32 on CPU")
        self.run_dir.check(resume=resume)
        resumed = None
        if resume:  # the checkpoint and the config are checked before the run directory is touched
            resumed_path = self.run_dir.latest_checkpoint()
            resumed = Checkpoint.load(resumed_path)
        # auto becomes what this hardware runs natively, once per run: the run's config (run directory,
        # checkpoints) records the precision used, and a resumed run keeps it. Rank 0 decides, so a
        # borderline CPU probe cannot split the ranks.
        choice = choose_precision(
            tc.precision, self.device, recorded=resumed.config.train.precision if resumed else None
        )
        self.precision_reason = choice.reason
        tc = dataclasses.replace(tc, precision=self.dist.broadcast(choice.precision))
        self.config = config = dataclasses.replace(config, train=tc)
        self._resume_changes = (
            check_resumable(resumed.config, config, self.run_dir, data_recorded=bool(resumed.train_data))
            if resumed
            else []
        )
        # fine-tuning: a new run starts from another's weights and tokenizer (a resumed one from its own)
        start = fine_tuning_start(config) if tc.init_from and not resumed else None
        self._held = contextlib.ExitStack()  # RUN_DIR/train.log and the run directory's lock, until run() ends
        if self.dist.is_main:
            self._held.enter_context(log_to_file(self.run_dir.log))
        try:
            self._prepare(resumed, resumed_path if resumed else None, start)
        except BaseException:
            self._held.close()
            raise

    def _prepare(self, resumed: Checkpoint | None, resumed_path: Path | None, start: Checkpoint | None) -> None:
        config, tc = self.config, self.config.train
        torch.manual_seed(tc.seed)
        self.tokenizer, self.data = prepare_run(
            config,
            self.run_dir,
            self.dist,
            self._held,
            progress=self.show_progress,
            tokenizer=(resumed or start).tokenizer if resumed or start else None,
            trained_on=resumed.train_data if resumed else "",
            segmented_as=resumed.segmentations if resumed else None,
        )
        self.train_data = self.data.text_digest  # checkpoints record it; prepare_run compared a resumed run's
        self.model = build_model(config.model, self.tokenizer).to(self.device)
        self.fine_tuning = start is not None
        if start is not None:
            self.model.load_state_dict(start.model)
            log.info(
                "fine-tuning %s (step %d of its run): its weights and tokenizer; the optimizer, schedule and step "
                "count start afresh",
                tc.init_from,
                start.progress.step,
            )
        if self.dist.enabled:  # same initial weights everywhere (DDP also broadcasts them); own dropout streams
            torch.manual_seed(tc.seed + 7919 * self.dist.rank)
        layerdrop = bool(config.model.encoder_layerdrop or config.model.decoder_layerdrop)  # skipped: no grads
        # bf16 trains a working copy (working_copy.py); the model keeps the fp32 master weights
        self.working = working_copy_for(self.model, tc.precision)
        trained = self.model if self.working is None else self.working.model
        self.ddp = DistributedDataParallel(trained, find_unused_parameters=layerdrop) if self.dist.enabled else None
        wrapped = self.ddp or trained
        self.forward = compile_for_training(wrapped) if tc.compile else wrapped
        self.optimizer = build_optimizer(self.model, tc)
        self.scaler = build_scaler(self.device, tc.precision)
        self.ema = ExponentialAverage(self.model, tc.ema_decay) if tc.ema_decay else None
        self.progress = Progress()
        self.budget_spent = 0.0  # share of the run's budget spent (schedule.budget_spent), for the progress bar
        self.last_step: StepResult | None = None
        self.skipped = SkippedUpdates(self.device)
        self.rss_peaks = PeakRss()
        self.metrics = MetricsLog(self.run_dir.metrics, tensorboard=self.dist.is_main)
        # Ctrl-C and SIGTERM (interruption.py); rank 0's, shared after each update and validation, stops them all
        self.stops = StopRequests(again_stops_at_once=not self.dist.enabled, announce=self.dist.is_main)
        self.stop_signal = 0  # the signal that stops the run after this update, the same on every rank (0: none)
        self._interrupted_save: Path | None = None  # saved at an interruption: the next save replaces it
        if resumed is not None:
            self._restore(resumed, resumed_path)

    def autocast(self):
        return autocast(self.device, self.config.train.precision)

    def run(self) -> TrainResult:
        with self._held:
            return self._run()

    def _run(self) -> TrainResult:
        tc, progress, dist = self.config.train, self.progress, self.dist
        per_update = tc.accum_steps * dist.world_size  # batches consumed by one optimizer update
        self._announce(per_update)
        steps_alone = not (tc.max_time or tc.max_epochs)  # else the bar counts steps and shows the budget spent
        bar = progress_bar(
            total=tc.max_steps if steps_alone else None,
            initial=progress.step,
            desc="train",
            unit="step",
            enabled=self.show_progress,
        )
        window = LogWindow(self.device)
        if self.fine_tuning and progress.step == 0:
            # the model it starts from, on this run's validation split: the curves start at its BLEU, and
            # best.pt is never a model worse there than the one the run was given
            self._validate()
        if progress.validation_due:  # the validation a stop request cut short, before the run was saved
            self._validate()
        stop_reason = self._stop_reason()  # a resumed run may have finished already
        with self.stops:  # Ctrl-C or SIGTERM: this update ends and is saved first (interruption.py)
            while not stop_reason:
                self._late_dropout(progress.epoch)
                corpus = self.data.train_for_epoch(progress.epoch)  # subword sampling: this epoch's segmentation
                rows = self.data.rows_for_epoch(progress.epoch, seed=tc.seed)  # the corpora's weights
                batches = epoch_batches(corpus, max_tokens=tc.max_tokens, seed=tc.seed, epoch=progress.epoch, rows=rows)
                if len(batches) < per_update:
                    raise UserInputError(f"data.train: {len(batches)} batches per epoch; one update needs {per_update}")
                while progress.next_batch + per_update <= len(batches) and not stop_reason:
                    group = batches[progress.next_batch : progress.next_batch + per_update]
                    progress.next_batch += per_update
                    per_epoch = len(batches) - len(batches) % per_update
                    step, tokens = self._update(corpus, group, batches_per_epoch=per_epoch)
                    window.add(step, tokens)
                    bar.update(1)
                    stop_reason = self._after_update(bar, window)
                if progress.next_batch + per_update > len(batches):
                    progress.epoch, progress.next_batch = progress.epoch + 1, 0
                    if tc.max_epochs and progress.epoch > tc.max_epochs and not stop_reason:
                        stop_reason = f"max_epochs ({tc.max_epochs})"
                        if progress.step % tc.valid_every:
                            self._validate()
                        self._save()
            bar.close()
            if self.dist.is_main and tc.average_last and not self.stop_signal:
                self._average_last_saves()
        # Leave together, once rank 0 has written the last checkpoint: a gloo rank that tore its group
        # down meanwhile sometimes aborted at exit in two-rank CPU runs (rarely with this barrier).
        dist.barrier()
        if self.stop_signal:
            if self.dist.is_main:
                saved = self._interrupted_save or self.run_dir.latest_checkpoint()
                log.warning("interrupted at step %d; saved %s", progress.step, saved)
            self.stops.deliver(self.stop_signal)
        log.info("stopped after %d steps: %s", progress.step, stop_reason)
        return TrainResult(dataclasses.replace(progress), self.run_dir.checkpoints / LAST, stop_reason)

    def _late_dropout(self, epoch: int) -> None:
        """model.dropout from train.dropout_from_epoch on, none before, in the weights that run the passes
        (the bf16 working copy's too). Set at each epoch's start, so a resumed run sets it as it was."""
        start = self.config.train.dropout_from_epoch
        if start == 1:
            return
        rate = self.config.model.dropout if epoch >= start else 0.0
        for model in (self.model, self.working.model) if self.working else (self.model,):
            model.set_dropout(rate)
        if epoch == start:
            log.info("epoch %d: model.dropout %g on (train.dropout_from_epoch)", epoch, rate)

    def _announce(self, per_update: int) -> None:
        tc = self.config.train
        log.info("model: %.2fM parameters; training on %s", _parameter_count(self.model) / 1e6, self.device)
        log.info("precision: %s (%s)", tc.precision, self.precision_reason)
        log.info(
            "effective batch: up to %d tokens x %d ranks x %d accumulation steps = %d tokens per update",
            tc.max_tokens,
            self.dist.world_size,
            tc.accum_steps,
            tc.max_tokens * per_update,
        )

    def _update(self, corpus, group: list, *, batches_per_epoch: int) -> tuple[StepResult, int]:
        """One optimizer update on this rank's share of `group` (the batches of every rank): its
        result and this rank's target tokens."""
        tc, progress, dist = self.config.train, self.progress, self.dist
        update_tokens = int(sum(corpus.tgt.lengths(indices).sum() + len(indices) for indices in group))  # + EOS
        started = time.perf_counter()
        mine = [
            make_batch(corpus, indices)
            for indices in group[dist.rank * tc.accum_steps : (dist.rank + 1) * tc.accum_steps]
        ]
        progress.step += 1
        spent = budget_spent(progress, tc, batches_per_epoch=batches_per_epoch)
        if progress.step == tc.warmup_steps:
            progress.decay_start = spent
        lr = learning_rate(
            progress.step, tc, d_model=self.config.model.d_model, spent=spent, decay_start=progress.decay_start
        )
        self.budget_spent = spent
        step = train_step(
            self.model,
            self.optimizer,
            self.scaler,
            mine,
            update_tokens=update_tokens,
            lr=lr,
            config=tc,
            forward=self.forward,
            ddp=self.ddp,
            working=self.working,
        )
        self.skipped.record(step.skipped)
        if self.ema is not None:
            self.ema.update(progress.step)
        self.last_step = step
        # ranks read their own clocks; rank 0's is the run's, from the first update on, so that
        # every rank computes the same budget share (learning rate) and stops at the same step
        # (and rank 0's stop request, so that every rank stops after this update if rank 0 was asked to)
        progress.train_seconds, stop = dist.rank_zero_numbers(
            progress.train_seconds + time.perf_counter() - started, self.stops.received or 0
        )
        self.stop_signal = self.stop_signal or int(stop)
        return step, sum(batch.num_tokens for batch in mine)

    def _after_update(self, bar: tqdm, window: LogWindow) -> str:
        """Log, validate, trim the heap and save as the step asks; why the run stops now ("" to go on)."""
        tc, progress = self.config.train, self.progress
        if progress.step % tc.log_every == 0:
            loss, tokens_per_second = window.flush(self.dist)
            self._log_train(bar, loss, tokens_per_second)
        if progress.step % tc.valid_every == 0:
            self._validate()
        if self.device.type == "cpu" and progress.step % HEAP_TRIM_EVERY == 0:
            release_free_heap()  # see host_memory.py: keeps RSS near what is in use
        stop_reason = self._stop_reason()
        if stop_reason and progress.step % tc.valid_every:
            self._validate()  # the final weights (at the floor of a budgeted schedule) may be the best
        if progress.step % tc.save_every == 0 or stop_reason:
            self._save()
        elif self.stop_signal:  # off the save grid: a checkpoint to resume from, which the next save replaces
            self._save(interrupted=True)
        return stop_reason or self._interruption()

    def _account_skipped_updates(self) -> None:
        """Bring the device-side skip counters into the progress; stop if training has diverged."""
        skipped, longest_run = self.skipped.collect()
        self.progress.skipped_steps += skipped
        if skipped:
            log.warning("%d updates skipped for non-finite gradients (up to step %d)", skipped, self.progress.step)
        if longest_run >= MAX_SKIPPED_IN_A_ROW:
            raise TrainingDiverged(
                f"training diverged: {longest_run} updates in a row had non-finite gradients "
                f"(up to step {self.progress.step}); lower train.lr, raise train.warmup_steps or use fp32/bf16"
            )

    def _log_train(self, bar: tqdm, loss: float, tokens_per_second: float) -> None:
        self._account_skipped_updates()
        if not self.dist.is_main:
            return
        lr = self.optimizer.param_groups[0]["lr"]
        bar.set_postfix(
            epoch=self.progress.epoch,
            loss=f"{loss:.3f}",
            lr=f"{lr:.2e}",
            tok_s=f"{tokens_per_second:,.0f}",
            budget=f"{self.budget_spent:.0%}",
        )
        self.metrics.write(
            "train",
            step=self.progress.step,
            epoch=self.progress.epoch,
            loss=loss,
            lr=lr,
            grad_norm=float(self.last_step.grad_norm),
            tokens_per_second=tokens_per_second,
            skipped_steps=self.progress.skipped_steps,
            budget_spent=self.budget_spent,
            **memory_figures(self.device, self.rss_peaks),
        )

    def evaluate_valid(self, between_batches: Callable[[], None] = lambda: None) -> ValidationResult:
        return validate(
            self.model,
            self.tokenizer,
            self.data,
            train=self.config.train,
            decode=self.config.decode,
            autocast=self.autocast(),
            between_batches=between_batches,
        )

    def _validate(self) -> None:
        """Rank 0 validates (the trained weights, and their average when train.ema_decay keeps one);
        the outcome (best score, patience count) is shared so all ranks stop together. Ctrl-C or SIGTERM
        drops a validation between its batches: the run is saved with it due (progress.validation_due),
        and the resumed run makes it first, as the uninterrupted run made it here."""
        progress = self.progress
        if self.dist.is_main:
            try:
                result = self.evaluate_valid(self.stops.check)
                averaged = None
                if self.ema is not None:
                    with self.ema.swapped_in():
                        averaged = self.evaluate_valid(self.stops.check)
            except StopRequested:
                progress.validation_due = True
                log.warning("the validation of step %d is left for the resumed run", progress.step)
            else:
                progress.validation_due = False
                self._record_validation(result, averaged)
        progress.best_bleu, progress.best_score, progress.stale_validations, stop = self.dist.broadcast(
            (progress.best_bleu, progress.best_score, progress.stale_validations, self.stops.received or 0)
        )
        self.stop_signal = self.stop_signal or stop  # a validation rank 0 dropped: every rank stops here

    def _record_validation(self, result: ValidationResult, averaged: ValidationResult | None) -> None:
        """Best score, patience count, log lines, metrics and best.pt for a validation's results: the
        better of the trained weights and their average by train.best_metric."""
        progress, metric = self.progress, self.config.train.best_metric
        better_averaged = averaged is not None and metric_score(averaged, metric) > metric_score(result, metric)
        chosen = averaged if better_averaged else result
        improved = record_best(progress, chosen, metric)
        progress.stale_validations = 0 if improved else progress.stale_validations + 1
        samples = list(zip(self.data.valid_text.src, self.data.valid_text.tgt, chosen.hypotheses))[:2]
        report_validation(self.metrics, progress.step, result, averaged, samples)
        if improved:
            # best.pt is for translation, not resuming: rank 0's own RNG state is enough (no collective)
            best = self._checkpoint([torch.get_rng_state()])
            if chosen is averaged:
                best = dataclasses.replace(best, model=self.ema.model_state(self.model), weights="ema")
            best.save(self.run_dir.checkpoints / BEST)

    def _average_last_saves(self) -> None:
        """Rank 0 alone (no collective here): validation.average_last_saves."""
        average_last_saves(
            self.run_dir.checkpoints,
            self.config.train.average_last,
            self.model,
            self.evaluate_valid,
            self.progress,
            self.metrics,
            self.config.train.best_metric,
        )

    def _stop_reason(self) -> str:
        """Why the run stops now ("" to go on): the same on every rank, whose clocks are rank 0's."""
        tc, progress = self.config.train, self.progress
        if progress.step >= tc.max_steps:
            return f"max_steps ({tc.max_steps})"
        if tc.max_time and progress.train_seconds >= tc.max_time:
            return f"max_time ({tc.max_time:g}s)"
        if tc.patience and progress.stale_validations >= tc.patience:
            return f"no {tc.best_metric} improvement in {tc.patience} validations (patience)"
        return ""

    def _interruption(self) -> str:
        """Why the run stops when Ctrl-C or SIGTERM asked it to ("" if neither did); a stop rule met by the
        same update comes first, so that the run ends as its budget says and is saved as such."""
        return f"interrupted ({signal.Signals(self.stop_signal).name})" if self.stop_signal else ""

    def _rng_states(self) -> list[torch.Tensor]:
        """Every rank's dropout RNG state (a collective: all ranks call it together)."""
        return self.dist.gather(torch.get_rng_state())

    def _checkpoint(self, rng_states: list[torch.Tensor]) -> Checkpoint:
        return Checkpoint(
            config=self.config,
            tokenizer=self.tokenizer,
            model=self.model.state_dict(),
            optimizer=self.optimizer.state_dict(),
            scaler=self.scaler.state_dict(),
            progress=dataclasses.replace(self.progress),
            rng=RngStates(rng_states, torch.cuda.get_rng_state_all()),
            ema=self.ema.state_dict() if self.ema is not None else {},
            train_data=self.train_data,
            segmentations=list(self.data.segmentations),
        )

    def _save(self, *, interrupted: bool = False) -> None:
        self._account_skipped_updates()
        rng_states = self._rng_states()
        if self.dist.is_main:
            checkpoint = dataclasses.replace(self._checkpoint(rng_states), interrupted=interrupted)
            path = save_numbered(
                self.run_dir.checkpoints,
                checkpoint,
                keep_last=self.config.train.keep_last,
                replaces=self._interrupted_save,
            )
            self._interrupted_save = path if interrupted else None

    def _restore(self, checkpoint: Checkpoint, path: Path) -> None:
        self.model.load_state_dict(checkpoint.model)
        if self.working is not None:
            self.working.refresh()
        self.optimizer.load_state_dict(checkpoint.optimizer)
        self.scaler.load_state_dict(checkpoint.scaler)
        self.progress = checkpoint.progress  # its clock is rank 0's, the same for every rank
        self._interrupted_save = path if checkpoint.interrupted else None
        if self.ema is not None and checkpoint.ema:
            self.ema.load_state_dict(checkpoint.ema)
        elif self.ema is not None:
            log.info("train.ema_decay is new to this run: the weight average starts from the resumed weights")
        rng_states = checkpoint.rng.torch
        if len(rng_states) == self.dist.world_size:
            torch.set_rng_state(rng_states[self.dist.rank])
        else:  # resumed with another number of ranks: dropout streams cannot continue exactly
            log.warning(
                "resuming %d ranks from a %d-rank run: dropout is reseeded", self.dist.world_size, len(rng_states)
            )
            torch.manual_seed(self.config.train.seed + 7919 * self.dist.rank + self.progress.step)
        if torch.cuda.is_available() and checkpoint.rng.cuda:
            torch.cuda.set_rng_state_all(checkpoint.rng.cuda)
        if self.dist.is_main:
            self.metrics.truncate_after(self.progress.step)
        log.info("resumed from %s at step %d", path, self.progress.step)
        for change in self._resume_changes:
            log.info(change)
        if checkpoint.config.train.best_metric != self.config.train.best_metric:
            self._rescore_best()

    def _rescore_best(self) -> None:
        """best.pt's score by a train.best_metric the run kept it by no longer (changed on resume): it is
        validated again, so that only a better model replaces it and patience counts from here."""
        metric, path, score = self.config.train.best_metric, self.run_dir.checkpoints / BEST, -math.inf
        if self.dist.is_main and path.is_file():
            score = score_of_saved(path, self.model, self.evaluate_valid, metric)
            log.info("train.best_metric is now %s: best.pt validated again, %s %.4g", metric, metric, abs(score))
        self.progress.best_score, self.progress.stale_validations = self.dist.broadcast(score), 0


def _parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
