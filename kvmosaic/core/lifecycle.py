"""Where a sequence is and how it ends: the scheduler's queues and the transitions that are not
scheduling policy (finishing, stop checks, the tokens a grammar forces, forks).

``SequenceQueues`` holds every unfinished sequence in one of three queues; ``Lifecycle`` moves
sequences out of them when they end (freeing their blocks, arrivals and speculation state) or
adds the sequences a parent forks into. The scheduler decides who runs; these only keep the books.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvmosaic.core.sequence_rules import check_stop, num_forced_tokens
from kvmosaic.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvmosaic.core.kv_arrivals import KVArrivals
    from kvmosaic.core.kv_cache_manager import KVCacheManager
    from kvmosaic.core.spec_steps import NoSpeculation, SpeculationSteps
    from kvmosaic.outputs import ModelOutput, ScheduledRequest


class SequenceQueues:
    """Every unfinished sequence by id, each in one queue: ``waiting`` (arrival order; preempted
    ones go back to the front), ``running`` (admission order: the last one is the newest) or
    ``swapped`` (its blocks in host memory)."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    def remove(self, request: Request) -> None:
        """Out of the queue its status says it is in (it stays known by id)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)

    def has_seq_room(self, request: Request, max_num_seqs: int) -> bool:
        """Whether max_num_seqs allows the request and the siblings it (or anyone running) will fork into."""
        num_seqs = sum(1 + running.num_forks for running in self.running)
        # A group larger than max_num_seqs may still run alone, or it would never run.
        return not self.running or num_seqs + 1 + request.num_forks <= max_num_seqs

    def run_after(self, parent: Request, children: list[Request]) -> None:
        """Forked sequences run right after their parent (known by id from now on)."""
        for child in children:
            self.requests[child.request_id] = child
        position = self.running.index(parent) + 1
        self.running[position:position] = children


class Lifecycle:
    """Ends and forks sequences: what they hold is freed when they finish, and each finished id is
    reported once (``take_finished_ids``) so the workers drop their per-sequence state."""

    def __init__(self, queues: SequenceQueues, kv_manager: KVCacheManager, arrivals: KVArrivals,
                 spec: SpeculationSteps | NoSpeculation, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.queues = queues
        self.kv_manager = kv_manager
        self.arrivals = arrivals
        self.spec = spec
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._finished_ids: set[str] = set()
        self._finished_by_scheduler: list[Request] = []  # reported by the next update_from_output

    def take_finished_ids(self) -> set[str]:
        finished, self._finished_ids = self._finished_ids, set()
        return finished

    def take_finished_by_scheduler(self) -> list[Request]:
        finished, self._finished_by_scheduler = self._finished_by_scheduler, []
        return finished

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Finish a sequence already out of every queue: free its blocks and whatever else it holds."""
        request.status = status
        self.kv_manager.free(request)
        self.arrivals.discard(request.request_id)
        self.spec.free(request.request_id)
        self.queues.requests.pop(request.request_id, None)
        self._finished_ids.add(request.request_id)

    def finish_unfittable(self, request: Request) -> None:
        """Finish a sequence that can never fit the KV cache (it is already out of every queue)."""
        if request.num_output_tokens:
            self.finish(request, RequestStatus.FINISHED_LENGTH)
        else:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
            request.stop_reason = (
                f"prompt of {request.num_tokens} tokens can never fit: max_model_len={self.max_model_len}, "
                f"KV cache holds {self.kv_manager.num_reachable_blocks * self.kv_manager.block_size} tokens"
            )
        self._finished_by_scheduler.append(request)

    def stop_if_done(self, request: Request, queue: list[Request] | deque[Request]) -> None:
        """Finish the sequence (taking it out of ``queue``) when its last token ends it."""
        stop = check_stop(request, self.eos_token_ids, self.max_model_len)
        if stop is not None:
            queue.remove(request)
            self.finish(request, stop[0])
            request.stop_reason = stop[1]

    def follow_guide(self, request: Request) -> None:
        """Append the tokens the sequence's grammar forces (jump-forward: they are computed in one pass
        next step, not sampled one a step), and finish it once the grammar is complete."""
        if request.is_finished:
            return
        forced = request.guide.forced(request.output_token_ids)
        for token in forced[:num_forced_tokens(request, self.max_model_len)]:
            request.append_output_token(token)
            self.stop_if_done(request, self.queues.running)
            if request.is_finished:
                return
        if request.guide.complete(request.output_token_ids):
            self.queues.running.remove(request)
            self.finish(request, RequestStatus.FINISHED_STOPPED)

    def fork_children(self, parent: Request, scheduled: ScheduledRequest, model_output: ModelOutput) -> list[Request]:
        """The parallel samples (n > 1) of a parent's first step, each with its own first token."""
        if len(scheduled.sample_ids) == 1:
            return []
        children = []
        forks = zip(scheduled.sample_ids[1:], scheduled.sample_seeds[1:])
        for sample_index, (child_id, seed) in enumerate(forks, start=1):
            child = parent.fork(child_id, sample_index, model_output.sampled[child_id].token_id, seed)
            self.kv_manager.fork(parent, child)
            children.append(child)
        self.queues.run_after(parent, children)
        parent.num_forks = 0
        return children

    def fork_beam(self, parent: Request, child_id: str, token_id: int) -> Request:
        child = parent.fork_beam(child_id, token_id)
        self.kv_manager.fork(parent, child)
        self.queues.run_after(parent, [child])
        return child

    def drop_beam(self, beam: Request) -> None:
        self.queues.remove(beam)
        self.finish(beam, RequestStatus.FINISHED_STOPPED)
