"""Beam search for one request, step by step, as transformers' ``generate(num_beams=...)`` does it.

Each step every live beam brings the log-probabilities of its most likely next tokens. The
candidates (beam score + token logprob) are ranked; the best ``width`` that do not end (EOS, or
max_tokens reached) become the next beams; those among the best ``width`` that do end become
finished hypotheses, scored by their summed logprob over their length ** length_penalty. The
search stops when no running beam can beat the worst of ``width`` finished hypotheses (the
``early_stopping`` heuristic), when ``width`` are finished and early_stopping is True, or at
max_tokens. Sums are float32, as in transformers, so the same logprobs rank the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

_NEG = -1.0e9


@dataclass(frozen=True, slots=True)
class BeamHypothesis:
    token_ids: tuple[int, ...]  # the generated tokens, the ending EOS included
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    ended_by_eos: bool


@dataclass(frozen=True, slots=True)
class NextBeam:
    parent: str  # the beam it continues
    token_id: int
    cumulative_logprob: float


@dataclass(frozen=True, slots=True)
class BeamConfig:
    width: int
    length_penalty: float
    early_stopping: bool | str  # True, False or "never"
    eos_token_ids: frozenset[int]
    max_tokens: int

    def __post_init__(self) -> None:
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")

    @property
    def num_candidates(self) -> int:
        """Candidates kept per step: enough that ``width`` survive even if the ending ones are best."""
        return max(2, 1 + len(self.eos_token_ids)) * self.width


class BeamGroup:
    def __init__(self, config: BeamConfig, first_beam: str) -> None:
        self.config = config
        self.running: list[tuple[str, float]] = [(first_beam, 0.0)]  # (beam, cumulative logprob), best first
        self.finished: list[BeamHypothesis] = []  # best first, at most width
        self._improvable = True
        self.done = False

    @property
    def beams(self) -> list[str]:
        return [beam for beam, _ in self.running]

    def step(self, top_logprobs: Mapping[str, Mapping[int, float]], outputs: Mapping[str, Sequence[int]]
             ) -> list[NextBeam]:
        """Advance by one token: each running beam's {token id: logprob} of its best next tokens (at
        least ``num_candidates``) and its tokens so far -> the next running beams, best first (none
        once ``done``)."""
        cfg = self.config
        entries = [(b, token, logprob) for b, (beam, _) in enumerate(self.running)
                   for token, logprob in top_logprobs[beam].items()]
        scores = torch.tensor([self.running[b][1] for b, _, _ in entries], dtype=torch.float32)
        totals = torch.tensor([lp for _, _, lp in entries], dtype=torch.float32) + scores
        ranked = sorted(range(len(entries)), key=lambda i: (-totals[i].item(), entries[i][0], entries[i][1]))
        top = ranked[: cfg.num_candidates]
        generated = len(outputs[self.running[0][0]]) + 1
        ends = [entries[i][1] in cfg.eos_token_ids or generated >= cfg.max_tokens for i in top]
        self._add_finished([(i, end) for i, end in zip(top[: cfg.width], ends)], entries, totals, outputs, generated)
        survivors = sorted(range(len(top)), key=lambda k: (-(totals[top[k]].item() + (_NEG if ends[k] else 0.0)), k))
        next_beams = [NextBeam(self.running[entries[top[k]][0]][0], entries[top[k]][1],
                               totals[top[k]].item() + (_NEG if ends[k] else 0.0)) for k in survivors[: cfg.width]]
        self._improvable = self._improvable and self._may_improve(next_beams[0].cumulative_logprob, generated)
        full = len(self.finished) == cfg.width
        self.done = not self._improvable or (full and cfg.early_stopping is True) or all(ends)
        self.running = [] if self.done else [(b.parent, b.cumulative_logprob) for b in next_beams]
        return [] if self.done else next_beams

    def rename(self, beams: Sequence[str]) -> None:
        """The running beams' sequence ids, in the order ``step`` returned them."""
        self.running = [(new, score) for new, (_, score) in zip(beams, self.running, strict=True)]

    def results(self, n: int) -> list[BeamHypothesis]:
        return self.finished[:n]

    def _add_finished(self, ranked: list[tuple[int, bool]], entries, totals: torch.Tensor,
                      outputs: Mapping[str, Sequence[int]], generated: int) -> None:
        cfg = self.config
        if not self._improvable or (len(self.finished) == cfg.width and cfg.early_stopping is True):
            return
        new = []
        for i, ends in ranked:
            if not ends:
                continue
            b, token, _ = entries[i]
            score = (totals[i] / (generated ** cfg.length_penalty)).item()
            beam = self.running[b][0]
            new.append(BeamHypothesis((*outputs[beam], token), totals[i].item(), score, token in cfg.eos_token_ids))
        merged = self.finished + new  # earlier ones first, so a tie keeps them
        order = sorted(range(len(merged)), key=lambda k: (-merged[k].score, k))
        self.finished = [merged[k] for k in order[: cfg.width]]

    def _may_improve(self, best_running: float, generated: int) -> bool:
        cfg = self.config
        if len(self.finished) < cfg.width:
            return True
        length = cfg.max_tokens if cfg.early_stopping == "never" and cfg.length_penalty > 0.0 else generated
        best_possible = (torch.tensor(best_running, dtype=torch.float32) / (length ** cfg.length_penalty)).item()
        return best_possible > min(h.score for h in self.finished)
