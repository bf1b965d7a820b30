"""What one more token costs in a decode step, measured: a decayed least-squares line through the
engine's timed decode and verification steps, ``seconds = T_weights + tokens * T_token``.

Adaptive k weighs a proposal's expected tokens against ``r = T_token / T_weights``. That ratio is
not a constant of the engine: a float32 target reading 540 MB of weights per step hardly notices
eight more rows, a Q4_1 one reading 80 MB through int8 dot products pays ~20% of a step per row. So
the speculator fits it from the steps it sees and keeps the configured ``token_cost`` only until the
steps spread over enough token counts. A draft model's passes are timed apart (``DraftCost``): they
are no part of the target's step, and each one costs a share of it.

Both are kept per class of batch sizes (``BatchCosts``: 1, 2-3, 4-7, ... sequences). One line
does not fit all: a float32 step of the default model costs 13.8 ms for 1-4 rows and then ~1.07 ms
more per row (24.2 ms for 16, 74.2 ms for 64), and a Q8_0 draft pass 4.2 ms for one row but 13.2 ms
for 16. Fitted on single-stream steps and applied at batch 16, the line priced a row at half its
cost and the draft pass at a third, and the self-draft ran batch 16 at 0.63x.

Both take a timing at most ``SPIKE`` times what they already predict: a step that first touches a
huge page of the KV pool, or meets a garbage collection, says nothing about the next ones. One
uncapped 0.2 s draft pass once raised the draft's cost past what a new sequence's prior acceptance
could beat, and a cost that stops drafting is never measured again.
"""

from __future__ import annotations

import dataclasses

DECAY = 0.97  # weight of an observation one step older: the fit follows a few dozen recent steps
MIN_SPREAD = 0.5  # variance of the token counts (tokens^2) below which the slope is not trusted
SPIKE = 3.0  # a timing counts for at most this many times the current prediction


@dataclasses.dataclass(slots=True)
class StepCost:
    weight: float = 0.0
    tokens: float = 0.0
    tokens_sq: float = 0.0
    seconds: float = 0.0
    tokens_seconds: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One decode / verification step (no prefill rows) of ``num_tokens`` rows took ``seconds``."""
        line = self.line()
        if line is not None and line[0] > 0.0:
            seconds = min(seconds, SPIKE * (line[0] + num_tokens * max(0.0, line[1])))
        self.weight = self.weight * DECAY + 1.0
        self.tokens = self.tokens * DECAY + num_tokens
        self.tokens_sq = self.tokens_sq * DECAY + num_tokens * num_tokens
        self.seconds = self.seconds * DECAY + seconds
        self.tokens_seconds = self.tokens_seconds * DECAY + num_tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """(T_weights, T_token) of the fitted line, or None while the steps seen do not determine it."""
        if self.weight <= 0.0:
            return None
        mean_x, mean_y = self.tokens / self.weight, self.seconds / self.weight
        spread = self.tokens_sq / self.weight - mean_x * mean_x
        if spread < MIN_SPREAD:
            return None
        slope = (self.tokens_seconds / self.weight - mean_x * mean_y) / spread
        return mean_y - slope * mean_x, slope

    def weights_seconds(self, prior: float) -> float | None:
        """T_weights: the fitted line's, else (undetermined) the mean step's over ``1 + tokens * prior``
        (r = ``prior``: steps that all verified 8 proposals for 64 sequences are not 576 rows of weight
        time, and taken for it they made a draft pass look free); None before any step."""
        line = self.line()
        if line is not None and line[0] > 0.0:
            return line[0]
        if self.weight <= 0.0:
            return None
        return self.seconds / (self.weight + self.tokens * prior)

    def token_cost(self, prior: float) -> float:
        """``T_token / T_weights`` in [0, 1], or ``prior`` while the line is undetermined or not a cost."""
        line = self.line()
        if line is None or line[0] <= 0.0:
            return prior
        return min(1.0, max(0.0, line[1] / line[0]))


@dataclasses.dataclass(slots=True)
class DraftCost:
    """Seconds per drafting pass of a draft model (a pass runs every drafting sequence's next row),
    decayed like the step fit."""

    passes: float = 0.0
    seconds: float = 0.0

    def observe(self, passes: int, seconds: float) -> None:
        known = self.pass_seconds()
        if known is not None:
            seconds = min(seconds, SPIKE * known * passes)
        self.passes = self.passes * DECAY + passes
        self.seconds = self.seconds * DECAY + seconds

    def pass_seconds(self) -> float | None:
        return self.seconds / self.passes if self.passes > 0.0 else None


def batch_class(batch_size: int) -> int:
    """Batch sizes whose steps are fitted together: 1, 2-3, 4-7, 8-15, ..."""
    return max(1, batch_size).bit_length()


def _nearest(seen: dict, batch_size: int):
    """The class of ``batch_size`` if seen, else the nearest larger class seen, else the nearest smaller
    one (None: none seen). A larger batch's costs are the cautious guess: a batch of 16 that shrinks as
    its requests finish passes through 8-15, 4-7, ... and, priced at the priors there, drafted 6 deep."""
    wanted = batch_class(batch_size)
    if wanted in seen:
        return seen[wanted]
    larger = [c for c in seen if c > wanted]
    if larger:
        return seen[min(larger)]
    smaller = [c for c in seen if c < wanted]
    return seen[max(smaller)] if smaller else None


@dataclasses.dataclass(slots=True)
class BatchCosts:
    """The step line and the draft-pass cost of each class of batch sizes; a class not yet seen takes
    the nearest one seen (``_nearest``), and with none seen, empty ones whose callers use their priors."""

    steps: dict[int, StepCost] = dataclasses.field(default_factory=dict)
    drafts: dict[int, DraftCost] = dataclasses.field(default_factory=dict)

    def observe_step(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        self.steps.setdefault(batch_class(batch_size), StepCost()).observe(num_tokens, seconds)

    def observe_draft(self, batch_size: int, passes: int, seconds: float) -> None:
        self.drafts.setdefault(batch_class(batch_size), DraftCost()).observe(passes, seconds)

    def step(self, batch_size: int) -> StepCost:
        return _nearest(self.steps, batch_size) or StepCost()

    def draft(self, batch_size: int) -> DraftCost:
        return _nearest(self.drafts, batch_size) or DraftCost()
