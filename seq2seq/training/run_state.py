"""A training run's state between updates, and the one place that says what a checkpoint keeps of it.

`RunState.build` makes a new run's state; the trainer (trainer.py) changes it with every update;
`checkpoint` saves it and `restore` takes it back in a resumed run. The two sit side by side because
a part saved and not restored (or restored from another field) resumes the run inexactly without
any error: the resume tests compare a resumed run with an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from seq2seq.checkpoint import Checkpoint, Progress, RngStates
from seq2seq.config import Config
from seq2seq.data.prepare import TrainingData
from seq2seq.data.tokenizer import Tokenizer
from seq2seq.model.transformer import build_model
from seq2seq.training.optimizer import build_optimizer
from seq2seq.training.train_step import build_scaler
from seq2seq.training.weight_average import ExponentialAverage
from seq2seq.training.working_copy import WorkingCopy, working_copy_for

log = logging.getLogger(__name__)

# Each rank's dropout stream starts from the run's seed plus this times its rank (and, reseeded at a
# resume with another number of ranks, plus the step), so that ranks never draw the same masks.
RANK_SEED_STRIDE = 7919


@dataclass
class RunState:
    """The run's constants a checkpoint describes itself by (config, tokenizer, the data it trained on)
    and what each update changes: the fp32 master weights (and the bf16 working copy made from them,
    working_copy.py), the optimizer's moments, the loss scaler, the weight average and the progress."""

    config: Config
    tokenizer: Tokenizer
    data: TrainingData
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: ExponentialAverage | None
    working: WorkingCopy | None
    progress: Progress = field(default_factory=Progress)

    @classmethod
    def build(
        cls, config: Config, tokenizer: Tokenizer, data: TrainingData, device: torch.device, *, start: Checkpoint | None
    ) -> RunState:
        """A new run's state on `device`: the model initialised by the global RNG (or, fine-tuning, with
        `start`'s weights), the bf16 working copy where train.precision is bf16, a fresh optimizer, loss
        scaler and weight average."""
        tc = config.train
        model = build_model(config.model, tokenizer).to(device)
        if start is not None:
            model.load_state_dict(start.model)
            log.info(
                "fine-tuning %s (step %d of its run): its weights and tokenizer; the optimizer, schedule and step "
                "count start afresh",
                tc.init_from,
                start.progress.step,
            )
        # first: it makes the master weights views of one flat buffer, before the optimizer holds them
        working = working_copy_for(model, tc.precision)  # bf16 (working_copy.py); `model` keeps fp32
        return cls(
            config=config,
            tokenizer=tokenizer,
            data=data,
            model=model,
            optimizer=build_optimizer(model, tc),
            scaler=build_scaler(device, tc.precision),
            ema=ExponentialAverage(model, tc.ema_decay) if tc.ema_decay else None,
            working=working,
        )

    def checkpoint(self, rng_states: list[Tensor]) -> Checkpoint:
        """A checkpoint of the state now, with every rank's dropout RNG state (`rng_states`, in rank order)."""
        return Checkpoint(
            config=self.config,
            tokenizer=self.tokenizer,
            model=self.model.state_dict(),
            optimizer=self.optimizer.state_dict(),
            scaler=self.scaler.state_dict(),
            progress=dataclasses.replace(self.progress),
            rng=RngStates(rng_states, torch.cuda.get_rng_state_all()),
            ema=self.ema.state_dict() if self.ema is not None else {},
            train_data=self.data.text_digest,
            segmentations=list(self.data.segmentations),
        )

    def best_checkpoint(self, *, averaged: bool) -> Checkpoint:
        """best.pt: for translation, not resuming, so rank 0's own RNG state is enough (no collective);
        the weight average's weights where `averaged` (the average validated better)."""
        best = self.checkpoint([torch.get_rng_state()])
        if averaged:
            best = dataclasses.replace(best, model=self.ema.model_state(self.model), weights="ema")
        return best

    def restore(self, checkpoint: Checkpoint, *, rank: int, world_size: int) -> None:
        """Take back what `checkpoint` saved, as rank `rank` of `world_size`: the run then continues as
        the one that saved it would have (its dropout streams too, with the same number of ranks)."""
        self.model.load_state_dict(checkpoint.model)
        if self.working is not None:
            self.working.refresh()
        self.optimizer.load_state_dict(checkpoint.optimizer)
        self.scaler.load_state_dict(checkpoint.scaler)
        self.progress = checkpoint.progress  # its clock is rank 0's, the same for every rank
        if self.ema is not None and checkpoint.ema:
            self.ema.load_state_dict(checkpoint.ema)
        elif self.ema is not None:
            log.info("train.ema_decay is new to this run: the weight average starts from the resumed weights")
        rng_states = checkpoint.rng.torch
        if len(rng_states) == world_size:
            torch.set_rng_state(rng_states[rank])
        else:  # resumed with another number of ranks: dropout streams cannot continue exactly
            log.warning("resuming %d ranks from a %d-rank run: dropout is reseeded", world_size, len(rng_states))
            torch.manual_seed(self.config.train.seed + RANK_SEED_STRIDE * rank + self.progress.step)
        if torch.cuda.is_available() and checkpoint.rng.cuda:
            torch.cuda.set_rng_state_all(checkpoint.rng.cuda)
