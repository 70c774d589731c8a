"""The training loop and its stop rules: batches in a seeded order, one `train_step` per update, logging
windows, periodic validation (and a last one when the run stops) and best.pt, checkpoints and exact
resume (a Ctrl-C or SIGTERM saves the update it lands in first: interruption.py), DistributedDataParallel.

The update itself is train_step.py; the learning rate for the budget spent, schedule.py; the weight
average, weight_average.py; the run directory and data preparation, run_dir.py; what a checkpoint
keeps of the run and how a resume takes it back, run_state.py; what a validation decides (best.pt,
patience), run_validations.py; the checkpoint format, checkpoint.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from seq2seq.checkpoint import LAST, Checkpoint, Progress, save_numbered
from seq2seq.config import Config
from seq2seq.data.batching import epoch_batches, make_batch, over_the_budget
from seq2seq.errors import UserInputError
from seq2seq.progress import progress_bar
from seq2seq.training.distributed import setup_distributed
from seq2seq.training.host_memory import HEAP_TRIM_EVERY, allocator_hint, release_free_heap
from seq2seq.training.interruption import StopRequests
from seq2seq.training.precision import choose_precision
from seq2seq.training.run_dir import RunDir, check_resumable, fine_tuning_start, prepare_run
from seq2seq.training.run_log import LogWindow, MetricsLog, PeakRss, log_to_file, memory_figures
from seq2seq.training.run_state import RANK_SEED_STRIDE, RunState
from seq2seq.training.run_validations import RunValidations
from seq2seq.training.schedule import budget_spent, learning_rate, warmup_outlasting_the_run
from seq2seq.training.train_step import (
    SkippedUpdates,
    StepResult,
    autocast,
    compile_for_training,
    train_step,
)
from seq2seq.training.validation import ValidationResult, validate

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
        except BaseException as failure:  # released as a `with` would be, told why (RunDir.held tidies up)
            self._held.__exit__(type(failure), failure, failure.__traceback__)
            raise

    def _prepare(self, resumed: Checkpoint | None, resumed_path: Path | None, start: Checkpoint | None) -> None:
        config, tc = self.config, self.config.train
        torch.manual_seed(tc.seed)
        tokenizer, data = prepare_run(
            config,
            self.run_dir,
            self.dist,
            self._held,
            progress=self.show_progress,
            tokenizer=(resumed or start).tokenizer if resumed or start else None,
            trained_on=resumed.train_data if resumed else "",
            segmented_as=resumed.segmentations if resumed else None,
            resumed=resumed is not None,
        )
        self.fine_tuning = start is not None
        self.state = RunState.build(config, tokenizer, data, self.device, start=start)
        if self.dist.enabled:  # same initial weights everywhere (DDP also broadcasts them); own dropout streams
            torch.manual_seed(tc.seed + RANK_SEED_STRIDE * self.dist.rank)
        working = self.state.working
        trained = self.model if working is None else working.model
        layerdrop = bool(config.model.encoder_layerdrop or config.model.decoder_layerdrop)  # skipped: no grads
        self.ddp = DistributedDataParallel(trained, find_unused_parameters=layerdrop) if self.dist.enabled else None
        wrapped = self.ddp or trained
        self.forward = compile_for_training(wrapped) if tc.compile else wrapped
        self.budget_spent = 0.0  # share of the run's budget spent (schedule.budget_spent), for the progress bar
        self.last_step: StepResult | None = None
        self.skipped = SkippedUpdates(self.device)
        self.rss_peaks = PeakRss()
        self.metrics = MetricsLog(self.run_dir.metrics, tensorboard=self.dist.is_main)
        # Ctrl-C and SIGTERM (interruption.py); rank 0's, shared after each update and validation, stops them all
        self.stops = StopRequests(again_stops_at_once=not self.dist.enabled, announce=self.dist.is_main)
        self.stop_signal = 0  # the signal that stops the run after this update, the same on every rank (0: none)
        self._interrupted_save: Path | None = None  # saved at an interruption: the next save replaces it
        self.validations = RunValidations(
            self.state,
            dist=self.dist,
            stops=self.stops,
            metrics=self.metrics,
            checkpoints=self.run_dir.checkpoints,
            evaluate=self.evaluate_valid,
        )
        if resumed is not None:
            self._restore(resumed, resumed_path)

    @property
    def progress(self) -> Progress:
        return self.state.progress

    @property
    def model(self) -> torch.nn.Module:
        """The fp32 master weights."""
        return self.state.model

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
                stop_reason = self._train_epoch(bar, window, per_update)
            bar.close()
            if self.dist.is_main and tc.average_last and not self.stop_signal:
                self.validations.average_last_saves()
        # Leave together, once rank 0 has written the last checkpoint: a gloo rank that tore its group
        # down meanwhile sometimes aborted at exit in two-rank CPU runs (rarely with this barrier).
        dist.barrier()
        if self.stop_signal:
            if self.dist.is_main:
                saved = self._interrupted_save or self.run_dir.latest_checkpoint()
                log.warning("interrupted at step %d; saved %s", progress.step, saved)
            self.stops.deliver(self.stop_signal)
        log.info("stopped after %d step%s: %s", progress.step, "" if progress.step == 1 else "s", stop_reason)
        return TrainResult(dataclasses.replace(progress), self.run_dir.checkpoints / LAST, stop_reason)

    def _train_epoch(self, bar: tqdm, window: LogWindow, per_update: int) -> str:
        """The updates of the current epoch from progress.next_batch on, until it ends or a stop rule is
        met: why the run stops ("" to go on with the next epoch)."""
        tc, progress = self.config.train, self.progress
        self._late_dropout(progress.epoch)
        corpus = self.state.data.train_for_epoch(progress.epoch)  # subword sampling: this epoch's pieces
        rows = self.state.data.rows_for_epoch(progress.epoch, seed=tc.seed)  # the corpora's weights
        batches = epoch_batches(corpus, max_tokens=tc.max_tokens, seed=tc.seed, epoch=progress.epoch, rows=rows)
        if len(batches) < per_update:
            raise UserInputError(f"data.train: {len(batches)} batches per epoch; one update needs {per_update}")
        stop_reason = ""
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
        return stop_reason

    def _late_dropout(self, epoch: int) -> None:
        """model.dropout from train.dropout_from_epoch on, none before, in the weights that run the passes
        (the bf16 working copy's too). Set at each epoch's start, so a resumed run sets it as it was."""
        start = self.config.train.dropout_from_epoch
        if start == 1:
            return
        rate = self.config.model.dropout if epoch >= start else 0.0
        working = self.state.working
        for model in (self.model, working.model) if working else (self.model,):
            model.set_dropout(rate)
        if epoch == start:
            log.info("epoch %d: model.dropout %g on (train.dropout_from_epoch)", epoch, rate)

    def _announce(self, per_update: int) -> None:
        tc = self.config.train
        log.info("model: %.2fM parameters; training on %s", _parameter_count(self.model) / 1e6, self.device)
        log.info("precision: %s (%s)", tc.precision, self.precision_reason)
        hint = allocator_hint() if self.device.type == "cpu" and self.dist.is_main else None
        if hint:
            log.info(hint)
        log.info(
            "effective batch: up to %d tokens x %d ranks x %d accumulation steps = %d tokens per update",
            tc.max_tokens,
            self.dist.world_size,
            tc.accum_steps,
            tc.max_tokens * per_update,
        )
        if self.dist.is_main:  # every rank's stderr shows warnings (cli.boundary): said once, by rank 0
            for warning in (over_the_budget(self.state.data.train, tc.max_tokens), warmup_outlasting_the_run(tc)):
                if warning:
                    log.warning(warning)

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
            self.state.optimizer,
            self.state.scaler,
            mine,
            update_tokens=update_tokens,
            lr=lr,
            config=tc,
            forward=self.forward,
            ddp=self.ddp,
            working=self.state.working,
        )
        self.skipped.record(step.skipped)
        if self.state.ema is not None:
            self.state.ema.update(progress.step)
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

    def _log_train(self, bar: tqdm, loss: float, tokens_per_second: float) -> None:
        self.skipped.count_into(self.progress)
        if not self.dist.is_main:
            return
        lr = self.state.optimizer.param_groups[0]["lr"]
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
            self.state.tokenizer,
            self.state.data,
            train=self.config.train,
            decode=self.config.decode,
            autocast=self.autocast(),
            between_batches=between_batches,
        )

    def _validate(self) -> None:
        """run_validations.py; a validation rank 0's stop request dropped stops every rank here."""
        self.stop_signal = self.stop_signal or self.validations.validate()

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

    def _save(self, *, interrupted: bool = False) -> None:
        self.skipped.count_into(self.progress)
        rng_states = self._rng_states()
        if self.dist.is_main:
            checkpoint = dataclasses.replace(self.state.checkpoint(rng_states), interrupted=interrupted)
            path = save_numbered(
                self.run_dir.checkpoints,
                checkpoint,
                keep_last=self.config.train.keep_last,
                replaces=self._interrupted_save,
            )
            self._interrupted_save = path if interrupted else None

    def _restore(self, checkpoint: Checkpoint, path: Path) -> None:
        self.state.restore(checkpoint, rank=self.dist.rank, world_size=self.dist.world_size)
        self._interrupted_save = path if checkpoint.interrupted else None
        if self.dist.is_main:
            self.metrics.truncate_after(self.progress.step)
        log.info("resumed from %s at step %d", path, self.progress.step)
        for change in self._resume_changes:
            log.info(change)
        if checkpoint.config.train.best_metric != self.config.train.best_metric:
            self.validations.rescore_best()


def _parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
