"""Train to convergence (#85): ``train.rounds`` is a ceiling, ``train.stop`` ends a run when the sites' validation
score stops improving, and the model of the round the selection rule reports is kept.

One rule for every trainer — FedAvg and its family, each cluster of a clustered workflow, the centralized and
each-site-alone references: after round ``r``'s replies (each scores the model it was served at the start of round
``r`` on its validation split), the round's score is the one the experiment's round selection reads
(``train.stop.metric``: the site-mean validation accuracy or Dice, or the pooled validation AUC; computed from the
replies as the run's record summarises them, :func:`val_score`). The run stops after round ``r`` when no round in
``r - patience + 1 .. r`` beat the best before it by more than ``min_delta`` (Keras' ``EarlyStopping`` rule, counted
in rounds); the model trained in round ``r`` is still averaged and scored (the final ``validate`` round). The round
with the highest score (the earliest of equals: the summary's selection rule) is :attr:`Stopper.selected`, its
model :attr:`Stopper.params`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["STILL_IMPROVING", "Stopper", "stop_metric"]

STILL_IMPROVING = "still improving when the rounds ran out"  # a run whose best validation round is its last (#85)


def stop_metric(stop, task: str, selection: str) -> str:
    """The score ``train.stop`` reads: its ``metric``, or for ``auto`` the one the experiment's round selection reads
    (the site-mean validation Dice for segmentation, the pooled validation AUC under ``validation_auc``, else the
    site-mean validation accuracy)."""
    if stop.metric != "auto":
        return stop.metric
    return "val_dice_mean" if task == "segmentation" else "pooled_val_auc" if selection == "validation_auc" \
        else "val_accuracy"


@dataclass
class Stopper:
    """The stop rule's state for one trained model (see the module notes); ``patience`` None: it only keeps the
    selected round's model."""

    metric: str
    patience: int | None = None
    min_delta: float = 0.0
    best: float = -math.inf  # the highest score so far (the selected round's)
    selected: int | None = None
    anchor: float = -math.inf  # the score the patience counts improvements against
    improved: int | None = None  # the last round that beat the anchor by more than min_delta
    params: dict | None = field(default=None, repr=False)  # the selected round's model
    stopped_at: int | None = None
    hist: object = field(default=None, repr=False)  # the selected round's pooled validation score histograms
    last_hist: object = field(default=None, repr=False)  # the last observed round's

    @classmethod
    def from_config(cls, train, state: dict | None = None, metric: str | None = None) -> "Stopper":
        """A stopper for ``train`` (a :class:`~fedmed.core.schema.TrainConfig`; ``metric``: its resolved score,
        :func:`stop_metric`), continuing ``state`` (:meth:`state` of a resumed run's checkpoint)."""
        s = train.stop
        out = cls(metric or (s.metric if s.metric != "auto" else "val_accuracy"), s.patience, float(s.min_delta))
        for k, v in (state or {}).items():
            setattr(out, k, -math.inf if v is None and k in ("best", "anchor") else v)
        return out

    def observe(self, round_: int, score: float, params: dict | None = None, hist=None) -> bool:
        """Round ``round_``'s score of the model ``params`` it served (``hist``: its pooled validation score
        histograms, from which a decision threshold is chosen); True when the run should stop after it."""
        self.last_hist = hist
        if score is not None and math.isfinite(score):
            if score > self.best:
                self.best, self.selected, self.hist = float(score), int(round_), hist
                self.params = None if params is None else {k: np.array(v, copy=True) for k, v in params.items()}
            if self.improved is None or score > self.anchor + self.min_delta:
                self.anchor, self.improved = float(score), int(round_)
        if self.patience is None or self.improved is None:
            return False
        return round_ - self.improved >= self.patience

    def state(self) -> dict:
        """What a checkpoint keeps (the selected model travels as a checkpoint model)."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in
                (("best", self.best), ("selected", self.selected), ("anchor", self.anchor),
                 ("improved", self.improved), ("stopped_at", self.stopped_at))}

    def why(self, last: int) -> str:
        """Why the run ended at round ``last``, in words."""
        if self.stopped_at is not None:
            return (f"stopped after round {self.stopped_at}: no round in the last {self.patience} raised the "
                    f"validation score ({self.metric}) by more than {self.min_delta:g} (best {self.best:.4f} at round "
                    f"{self.selected})")
        tail = f"; {STILL_IMPROVING}" if self.selected == last else ""
        if self.selected is None:
            return "ran every round (no validation score to select on)"
        return f"ran every round to the ceiling (best {self.metric} {self.best:.4f} at round {self.selected}){tail}"

    def record(self, last: int) -> dict:
        """The run record's ``stop`` note."""
        return {"metric": self.metric, "patience": self.patience, "min_delta": self.min_delta,
                "stopped_at": self.stopped_at, "selected_round": self.selected, "last_round": int(last),
                "best": None if not math.isfinite(self.best) else self.best, "why": self.why(last)}
