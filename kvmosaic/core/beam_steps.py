"""The scheduler's side of beam search: after a step, each beam-search request's live beams
(sequences) hand their best next tokens to its ``BeamGroup``; beams chosen more than once fork
(sharing every KV block copy-on-write, so only the partial last block is ever copied), beams
not chosen are dropped, and a finished search leaves its hypotheses for the engine to report."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from kvmosaic.core.beam_search import BeamConfig, BeamGroup, BeamHypothesis
from kvmosaic.outputs import ModelOutput
from kvmosaic.request import Request


class BeamSteps:
    def __init__(self, eos_token_ids: frozenset[int], fork: Callable[[Request, str, int], Request],
                 drop: Callable[[Request], None]) -> None:
        """``fork(parent, child id, token)``: a new live sequence continuing ``parent`` with ``token``;
        ``drop(sequence)``: end a beam that was not chosen."""
        self.eos_token_ids = eos_token_ids
        self._fork = fork
        self._drop = drop
        self.groups: dict[str, BeamGroup] = {}
        self._results: list[tuple[str, list[BeamHypothesis]]] = []
        self._ids = itertools.count(1)

    def advance(self, computed: list[Request], model_output: ModelOutput) -> None:
        """Step every group whose live beams were all computed this step. Beams of a group only partly
        computed (some were preempted) give their token back: they run again with the others."""
        by_group: dict[str, list[Request]] = {}
        for request in computed:
            by_group.setdefault(request.group_id, []).append(request)
        for group_id, beams in by_group.items():
            group = self.groups.get(group_id) or self._start(group_id, beams[0])
            if {b.request_id for b in beams} != set(group.beams):
                for beam in beams:
                    beam.num_computed_tokens -= 1
                continue
            self._step(group_id, group, {b.request_id: b for b in beams}, model_output)

    def group_members(self, group_ids: Iterable[str]) -> list[str]:
        """The live beams of these requests' beam searches (the first beam's id is the request's)."""
        members: list[str] = []
        for group_id in group_ids:
            group = self.groups.get(group_id)
            if group is not None:
                members += [beam for beam in group.beams if beam not in members]
        return members

    def forget(self, group_id: str) -> None:
        self.groups.pop(group_id, None)

    def take_results(self) -> list[tuple[str, list[BeamHypothesis]]]:
        """(request id, its best ``n`` hypotheses) of every search finished since the last call."""
        results, self._results = self._results, []
        return results

    def _start(self, group_id: str, first: Request) -> BeamGroup:
        params = first.sampling_params
        config = BeamConfig(params.best_of, params.length_penalty, params.early_stopping,
                            frozenset() if params.ignore_eos else self.eos_token_ids, params.max_tokens)
        group = self.groups[group_id] = BeamGroup(config, first.request_id)
        return group

    def _step(self, group_id: str, group: BeamGroup, beams: dict[str, Request], model_output: ModelOutput) -> None:
        tops = {beam_id: model_output.sampled[beam_id].top_logprobs or {} for beam_id in beams}
        chosen = group.step(tops, {beam_id: beams[beam_id].output_token_ids for beam_id in beams})
        if group.done:
            for beam in beams.values():
                self._drop(beam)
            self.groups.pop(group_id, None)
            self._results.append((group_id, group.results(beams[next(iter(beams))].sampling_params.n)))
            return
        # Forks first: a child copies its parent's tokens before the parent takes its own next one.
        continued: set[str] = set()
        names: list[str] = []
        appended: list[tuple[Request, int]] = []
        for nxt in chosen:
            parent = beams[nxt.parent]
            if nxt.parent in continued:
                names.append(self._fork(parent, f"{group_id}#b{next(self._ids)}", nxt.token_id).request_id)
            else:
                continued.add(nxt.parent)
                names.append(nxt.parent)
                appended.append((parent, nxt.token_id))
        for parent, token in appended:
            parent.append_output_token(token)
        for beam_id, beam in beams.items():
            if beam_id not in continued:
                self._drop(beam)
        group.rename(names)
