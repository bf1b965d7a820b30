"""Turns sampled tokens into user-facing outputs: detokenization, stop strings,
log-probabilities, best_of selection and per-request timing."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvmosaic.core.beam_search import BeamHypothesis
from kvmosaic.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvmosaic.outputs import CompletionOutput, ModelOutput, RequestMetrics, RequestOutput, SampledToken
from kvmosaic.request import Request
from kvmosaic.sample.stop import StopMatcher, StopStrings
from kvmosaic.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_matcher: StopMatcher | None = None  # None: the request has no stop strings


@dataclass(slots=True)
class GroupState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    sequences: dict[str, SequenceState] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled as the prompt's chunks run
    stop_strings: StopStrings | None = None  # failure tables built once for all of the group's sequences

    @property
    def finished(self) -> bool:
        total = self.params.best_of or 1
        done = [s for s in self.sequences.values() if s.finish_reason is not None]
        return len(done) == total or any(s.finish_reason == "abort" for s in done)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, GroupState] = {}
        self.seq_to_group: dict[str, str] = {}

    def add_group(self, request: Request, prompt: str | None) -> None:
        params = request.sampling_params
        group = GroupState(request.group_id, prompt, request.prompt_token_ids, params,
                           RequestMetrics(arrival_time=request.arrival_time),
                           stop_strings=StopStrings(params.stop) if params.stop else None)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(request.prompt_token_ids)
        self.groups[group.request_id] = group
        self._add_sequence(group, request.request_id, 0)

    def _add_sequence(self, group: GroupState, seq_id: str, index: int) -> SequenceState:
        detok = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids, group.params.skip_special_tokens)
        state = SequenceState(index, detok, logprobs=[] if group.params.logprobs is not None else None,
                              stop_matcher=group.stop_strings.matcher() if group.stop_strings else None)
        group.sequences[seq_id] = state
        self.seq_to_group[seq_id] = group.request_id
        return state

    def sequence_ids(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return list(group.sequences) if group else []

    def group_of(self, seq_id: str) -> str | None:
        return self.seq_to_group.get(seq_id)

    def process(self, updated: list[Request], model_output: ModelOutput
                ) -> tuple[list[RequestOutput], list[str], dict[str, str]]:
        """Returns the outputs of touched groups, the sequence ids a stop string finished, and
        {request id: error} for groups whose output could not be made (they are left out)."""
        now = time.monotonic()
        touched: dict[str, GroupState] = {}
        stopped: list[str] = []
        failed: dict[str, str] = {}
        self._add_prompt_logprobs(model_output)
        for req in updated:
            if req.group_id in failed:
                continue
            group = self.groups[req.group_id]
            try:
                seq = group.sequences.get(req.request_id) or self._add_sequence(group, req.request_id,
                                                                                req.sample_index)
                if group.metrics.first_token_time is None:
                    group.metrics.first_token_time = now
                    group.metrics.num_cached_tokens = req.num_cached_tokens
                if self._append(seq, req, model_output, group.params):
                    stopped.append(req.request_id)
            except Exception as exc:  # noqa: BLE001  (detokenizing one request must not stop the others)
                logger.exception("request %s: output processing failed", req.group_id)
                failed[req.group_id] = f"the output of request {req.group_id} could not be processed: {exc!r}"
                touched.pop(req.group_id, None)
                continue
            touched[group.request_id] = group
        return [self._make_output(g, now) for g in touched.values()], stopped, failed

    def _append(self, seq: SequenceState, req: Request, model_output: ModelOutput, params: SamplingParams) -> bool:
        """Take the tokens the sequence gained this step (several after accepted proposals), one at a
        time, so a stop string ends it at the token that completes the stop."""
        new_tokens = req.output_token_ids[len(seq.token_ids):]
        sampled = model_output.new_tokens(req.request_id)
        for i, token in enumerate(new_tokens):
            seq.token_ids.append(token)
            if i < len(sampled) and sampled[i].logprob is not None:
                self._add_logprob(seq, token, sampled[i])
            delta = seq.detokenizer.add_tokens([token])
            seq.text += delta
            if i == len(new_tokens) - 1 and req.status.finished:
                break
            hit = seq.stop_matcher.feed(delta) if seq.stop_matcher is not None else None
            if hit is not None:
                pos, stop = hit
                seq.text = seq.text[: pos + len(stop)] if params.include_stop_str_in_output else seq.text[:pos]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        if req.status.finished:  # by the scheduler: EOS, a stop token, max_tokens, or never fitting the cache
            seq.finish_reason, seq.stop_reason = req.status.finish_reason, req.stop_reason
        return False

    def _add_prompt_logprobs(self, model_output: ModelOutput) -> None:
        for seq_id, (start, entries) in model_output.prompt_logprobs.items():
            group = self.groups.get(self.seq_to_group.get(seq_id, ""))
            if group is not None and group.prompt_logprobs is not None:
                group.prompt_logprobs[start:start + len(entries)] = entries

    @staticmethod
    def _add_logprob(seq: SequenceState, token: int, sampled: SampledToken) -> None:
        seq.cumulative_logprob += sampled.logprob
        if seq.logprobs is not None:
            top = dict(sampled.top_logprobs or {})
            top[token] = sampled.logprob
            seq.logprobs.append(top)

    def finish_beams(self, results: list[tuple[str, list[BeamHypothesis]]]) -> list[RequestOutput]:
        """The final outputs of finished beam searches: their best hypotheses, best first."""
        outputs = []
        now = time.monotonic()
        for request_id, hypotheses in results:
            group = self.groups.get(request_id)
            if group is None:
                continue
            skip = group.params.skip_special_tokens
            group.metrics.finished_time = now
            group.metrics.first_token_time = group.metrics.first_token_time or now
            completions = [CompletionOutput(
                index=i, text=self.tokenizer.decode(h.token_ids, skip_special_tokens=skip), token_ids=list(h.token_ids),
                cumulative_logprob=h.cumulative_logprob, logprobs=None,
                finish_reason="stop" if h.ended_by_eos else "length", score=h.score)
                for i, h in enumerate(hypotheses)]
            self._forget(group)
            outputs.append(RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, True,
                                         group.metrics))
        return outputs

    def finish_aborted(self, request_id: str, message: str | None = None) -> RequestOutput | None:
        """End a group with finish reason "abort" (``message``, when given, as the stop reason)."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for seq in group.sequences.values():
            if seq.finish_reason is None:
                seq.finish_reason, seq.stop_reason = "abort", message
        return self._make_output(group, time.monotonic())

    def finish_failed(self, request_id: str, message: str) -> RequestOutput:
        """The final output of a group that failed (finish reason "abort", the error as stop reason)."""
        out = self.finish_aborted(request_id, message)
        if out is None:
            raise KeyError(f"unknown request {request_id!r}")
        return out

    def _make_output(self, group: GroupState, now: float) -> RequestOutput:
        finished = group.finished
        if finished:
            group.metrics.finished_time = now
            self._forget(group)
        seqs = sorted(group.sequences.values(), key=lambda s: s.index)
        params = group.params
        if (params.best_of or 1) > params.n:
            if not finished:
                seqs = []  # best_of picks only once every candidate is done
            else:
                seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: params.n]
        outputs = [self._completion(i, s, params, finished) for i, s in enumerate(seqs)]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished, group.metrics,
                             prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None)

    @staticmethod
    def _completion(index: int, seq: SequenceState, params: SamplingParams, finished: bool) -> CompletionOutput:
        text = seq.text
        if seq.finish_reason is None and seq.stop_matcher is not None:
            held = seq.stop_matcher.held_back
            text = text[: len(text) - held] if held else text
        return CompletionOutput(
            index=index if (params.best_of or 1) > params.n else seq.index,
            text=text,
            token_ids=list(seq.token_ids),
            cumulative_logprob=seq.cumulative_logprob if params.tracks_logprobs else None,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _forget(self, group: GroupState) -> None:
        self.groups.pop(group.request_id, None)
        for seq_id in group.sequences:
            self.seq_to_group.pop(seq_id, None)

