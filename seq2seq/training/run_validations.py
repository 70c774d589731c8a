"""What a training run does with its validations: the better of the trained weights and their average
becomes best.pt where it beats it, the patience count, the log and metrics, and one outcome that
every rank shares, so that all of them stop together.

How a model is validated is validation.py; when the run validates, trainer.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

from seq2seq.checkpoint import BEST
from seq2seq.training.distributed import DistributedContext
from seq2seq.training.interruption import StopRequested, StopRequests
from seq2seq.training.run_log import MetricsLog
from seq2seq.training.run_state import RunState
from seq2seq.training.validation import (
    ValidationResult,
    average_last_saves,
    metric_score,
    record_best,
    report_validation,
    score_of_saved,
)

log = logging.getLogger(__name__)

# Validates the run's model now; an exception from the callable it is given, called between batches,
# drops the validation (a stop request).
Evaluate = Callable[[Callable[[], None]], ValidationResult]


class RunValidations:
    def __init__(
        self,
        state: RunState,
        *,
        dist: DistributedContext,
        stops: StopRequests,
        metrics: MetricsLog,
        checkpoints: Path,
        evaluate: Evaluate,
    ) -> None:
        self.state, self.dist, self.stops, self.metrics = state, dist, stops, metrics
        self.checkpoints, self.evaluate = checkpoints, evaluate

    @property
    def metric(self) -> str:
        return self.state.config.train.best_metric

    def validate(self) -> int:
        """Rank 0 validates (the trained weights, and their average when train.ema_decay keeps one);
        the outcome (best score, patience count) is shared so all ranks stop together. Ctrl-C or SIGTERM
        drops a validation between its batches: the run is saved with it due (progress.validation_due),
        and the resumed run makes it first, as the uninterrupted run made it here. Returns the signal
        that stopped rank 0 (0: none), which every rank then stops for."""
        state, progress = self.state, self.state.progress
        if self.dist.is_main:
            try:
                result = self.evaluate(self.stops.check)
                averaged = None
                if state.ema is not None:
                    with state.ema.swapped_in():
                        averaged = self.evaluate(self.stops.check)
            except StopRequested:
                progress.validation_due = True
                log.warning("the validation of step %d is left for the resumed run", progress.step)
            else:
                progress.validation_due = False
                self._record(result, averaged)
        progress.best_bleu, progress.best_score, progress.stale_validations, stop = self.dist.broadcast(
            (progress.best_bleu, progress.best_score, progress.stale_validations, self.stops.received or 0)
        )
        return int(stop)

    def _record(self, result: ValidationResult, averaged: ValidationResult | None) -> None:
        """Best score, patience count, log lines, metrics and best.pt for a validation's results: the
        better of the trained weights and their average by train.best_metric."""
        state, progress = self.state, self.state.progress
        better_averaged = averaged is not None and metric_score(averaged, self.metric) > metric_score(
            result, self.metric
        )
        chosen = averaged if better_averaged else result
        improved = record_best(progress, chosen, self.metric)
        progress.stale_validations = 0 if improved else progress.stale_validations + 1
        samples = list(zip(state.data.valid_text.src, state.data.valid_text.tgt, chosen.hypotheses))[:2]
        report_validation(self.metrics, progress.step, result, averaged, samples)
        if improved:
            state.best_checkpoint(averaged=better_averaged).save(self.checkpoints / BEST)

    def average_last_saves(self) -> None:
        """Rank 0 alone (no collective here): validation.average_last_saves."""
        average_last_saves(
            self.checkpoints,
            self.state.config.train.average_last,
            self.state.model,
            lambda: self.evaluate(lambda: None),
            self.state.progress,
            self.metrics,
            self.metric,
        )

    def rescore_best(self) -> None:
        """best.pt's score by a train.best_metric the run kept it by no longer (changed on resume): it is
        validated again, so that only a better model replaces it and patience counts from here."""
        path, score, progress, metric = self.checkpoints / BEST, -math.inf, self.state.progress, self.metric
        if self.dist.is_main and path.is_file():
            score = score_of_saved(path, self.state.model, lambda: self.evaluate(lambda: None), metric)
            log.info("train.best_metric is now %s: best.pt validated again, %s %.4g", metric, metric, abs(score))
        progress.best_score, progress.stale_validations = self.dist.broadcast(score), 0
