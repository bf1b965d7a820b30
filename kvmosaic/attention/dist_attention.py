"""DistAttention: attention for sequences whose KV blocks live on several instances.

``RemoteKVAttention`` wraps an instance's attention backend (a float cache, or a quantized one:
int8, int4, Oaken). The model runner asks it which
scheduled sequences hold borrowed blocks (``spanning``) and, for a step with any, it binds a
``DistAttentionStep``: the backend the model calls for that step. Per layer the step
- rotates q/k and writes K/V of tokens in local blocks with the usual kernel, and keeps the rotated
  K/V of tokens whose slots are on a creditor;
- sends each creditor, in one call, the queries of its debtor's sequences plus those new K/V rows;
  the creditor writes them into its blocks and returns partial attention (out, row max, sum-exp);
- meanwhile computes the local partial over the local blocks, then merges exactly.
  When the lent blocks' K/V is smaller than the queries plus the partials would be (a prefill chunk
  over a short borrowed tail, see ``pull_kv``), the creditor sends those rows back instead and the
  debtor computes that partial itself: fewer bytes, and the creditor's own steps are not held up.
Local sequences of the same batch stay on the fast kernels; their rows are untouched here.
The pool is reached through ``PoolRows`` (pool_rows.py): float rows go in and come out, so with a quantized cache
the creditor quantizes the rows it is sent into its records and dequantizes the lent blocks it
attends over, and only float queries, rows and partials cross between instances.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvmosaic.attention.backend import AttentionBackend, DecodePasses, LayerStack
from kvmosaic.attention.merge import PartialAttention, merge_on, partial_attention
from kvmosaic.attention.metadata import AttentionMetadata
from kvmosaic.attention.pool_rows import PoolRows
from kvmosaic.attention.rotary import RotaryEmbedding
from kvmosaic.outputs import ScheduledRequest


class BlockDirectory(Protocol):
    """rBlock id -> (owner instance, physical block); and the calls that reach other instances."""

    def locate(self, block_id: int) -> tuple[int, int]: ...

    def remote_attention(self, owner: int, layer: int, items: list[dict], scale: float): ...

    def wait(self, futures: dict[int, object]) -> dict[int, list[tuple]]: ...


@dataclass(slots=True)
class DistAttentionStats:
    steps: int = 0  # steps with at least one spanning sequence
    layer_calls: int = 0  # remote micro-attention calls (one per creditor per layer)
    seconds: float = 0.0  # wall time in the distributed part of attention (local partials included)
    wait_seconds: float = 0.0  # of which: blocked on creditors after the local partials were done
    merge_seconds: float = 0.0  # of which: merging the partials
    kv_pulls: int = 0  # sequence-layers whose lent K/V came back to be attended here (pull_kv)


@dataclass(slots=True)
class _SeqPlan:
    rows: torch.Tensor  # batch rows of this sequence's tokens
    q_pos: torch.Tensor
    local_blocks: torch.Tensor  # physical ids of local blocks in its context
    local_k_pos: torch.Tensor
    remote: dict[int, tuple[list[int], torch.Tensor]] = field(default_factory=dict)  # owner -> (blocks, k_pos)
    writes: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)  # owner -> (rows, slots)


def _key_positions(logical: list[int], block_size: int) -> torch.Tensor:
    if not logical:
        return torch.empty(0, dtype=torch.long)
    base = torch.tensor(logical, dtype=torch.long)[:, None] * block_size
    return (base + torch.arange(block_size)[None, :]).flatten()


def pull_kv(num_queries: int, num_keys: int, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether a creditor should return its lent K/V rows rather than attend over them: when those
    rows (K and V, ``num_keys`` x Hk x D each) are fewer floats than the queries sent plus the partials
    returned (out, row max and sum of exponentials: N x Hq x (2D + 2))."""
    return 2 * num_keys * num_kv_heads * head_dim < num_queries * num_heads * (2 * head_dim + 2)


class DistAttention:
    def __init__(self, directory: BlockDirectory, block_size: int, num_local_blocks: int, pull: bool = True) -> None:
        self.directory = directory
        self.pull = pull  # False: creditors always attend themselves (no pull_kv)
        self.block_size = block_size
        self.num_local_blocks = num_local_blocks
        self.stats = DistAttentionStats()

    def _has_remote(self, s: ScheduledRequest) -> bool:
        context = s.start_pos + s.num_tokens
        return any(b >= self.num_local_blocks for b in s.block_table[: -(-context // self.block_size)])

    def spanning(self, batch: list[ScheduledRequest]) -> frozenset[str]:
        return frozenset(s.request_id for s in batch if self._has_remote(s))

    def bind(self, batch: list[ScheduledRequest], meta: AttentionMetadata, local: AttentionBackend,
             rows: PoolRows, merge: Callable[[list[PartialAttention]], torch.Tensor]) -> DistAttentionStep:
        self.stats.steps += 1
        plans: list[_SeqPlan] = []
        remote_rows: list[int] = []
        row = 0
        for s in batch:
            if self._has_remote(s):
                plans.append(self._plan(s, row, remote_rows))
            row += s.num_tokens
        return DistAttentionStep(self, local, rows, merge, plans, row, remote_rows, meta.slot_mapping)

    def _plan(self, s: ScheduledRequest, row0: int, remote_rows: list[int]) -> _SeqPlan:
        bs = self.block_size
        context = s.start_pos + s.num_tokens
        local_ids, local_logical = [], []
        remote: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        for index, block in enumerate(s.block_table[: -(-context // bs)]):
            if block < self.num_local_blocks:
                local_ids.append(block)
                local_logical.append(index)
            else:
                owner, physical = self.directory.locate(block)
                remote[owner][0].append(physical)
                remote[owner][1].append(index)
        writes: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        for j, pos in enumerate(range(s.start_pos, context)):
            block = s.block_table[pos // bs]
            if block >= self.num_local_blocks:
                owner, physical = self.directory.locate(block)
                writes[owner][0].append(row0 + j)
                writes[owner][1].append(physical * bs + pos % bs)
                remote_rows.append(row0 + j)
        return _SeqPlan(
            rows=torch.arange(row0, row0 + s.num_tokens), q_pos=torch.arange(s.start_pos, context),
            local_blocks=torch.tensor(local_ids, dtype=torch.long), local_k_pos=_key_positions(local_logical, bs),
            remote={o: (ids, _key_positions(logical, bs)) for o, (ids, logical) in remote.items()},
            writes=dict(writes),
        )


class RemoteKVAttention(AttentionBackend):
    """An instance's attention backend: its local float backend, plus DistAttention for the steps in
    which some sequence holds borrowed blocks; also answers other instances' micro-attention calls."""

    def __init__(self, local: AttentionBackend, dist: DistAttention) -> None:
        super().__init__(local.model, local.kv_cache)
        rows = local.lendable_rows()
        if rows is None:
            raise ValueError(f"the distributed KV cache cannot lend blocks of {type(local).__name__}")
        self.local = local
        self.rows: PoolRows = rows  # the pool as float rows: creditor calls and the decode lane go through it
        self.merge = merge_on(rows.float_ops)  # quantized pools merge on the float kernels too
        self.dist = dist

    def write(self, layer: int, qkv: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata) -> torch.Tensor:
        return self.local.write(layer, qkv, rotary, meta)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.local.attend(layer, q, meta)

    def layer_stack(self) -> LayerStack | None:
        return self.local.layer_stack()

    def decode_passes(self) -> DecodePasses | None:
        """The local kernel's passes: the runner runs them only for steps no sequence of which spans."""
        return self.local.decode_passes()

    def spanning(self, batch: list[ScheduledRequest]) -> frozenset[str]:
        return self.dist.spanning(batch)

    def bind(self, batch: list[ScheduledRequest], meta: AttentionMetadata) -> AttentionBackend:
        if not self.dist.spanning(batch):
            return self.local
        return self.dist.bind(batch, meta, self.local, self.rows, self.merge)

    @property
    def folded_outliers(self) -> int:
        """The pool's Oaken outliers folded for want of room, by its own steps and the creditor calls."""
        return self.local.folded_outliers

    def serve_micro_attention(self, layer: int, items: list[dict], scale: float) -> list[tuple]:
        """Creditor side: a debtor's queries over the blocks it borrowed from us, for one layer."""
        return creditor_micro_attention(self.rows, layer, items, scale)


class DistAttentionStep(AttentionBackend):
    """The attention backend of one step with spanning sequences; every call names its layer."""

    def __init__(self, owner: DistAttention, local: AttentionBackend, rows: PoolRows,
                 merge: Callable[[list[PartialAttention]], torch.Tensor], plans: list[_SeqPlan], num_rows: int,
                 remote_rows: list[int], slot_mapping: torch.Tensor) -> None:
        super().__init__(local.model, local.kv_cache)
        self.owner = owner
        self.local = local
        self.rows = rows
        self.merge = merge
        self.plans = plans
        self._calls: list[tuple[int, _SeqPlan, dict, torch.Tensor | None, bool]] | None = None
        remote = torch.zeros(num_rows, dtype=torch.bool)
        remote[remote_rows] = True
        self.remote_rows = remote.nonzero().flatten()
        self.local_rows = (~remote).nonzero().flatten()
        self.row_in_remote = torch.full((num_rows,), -1, dtype=torch.long)
        self.row_in_remote[self.remote_rows] = torch.arange(len(self.remote_rows))
        self.local_slots = slot_mapping[self.local_rows]
        self.k_new: torch.Tensor | None = None
        self.v_new: torch.Tensor | None = None

    def write(self, layer: int, qkv: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata) -> torch.Tensor:
        q = torch.empty(qkv.shape[0], self.num_heads, self.head_dim, dtype=qkv.dtype)
        if len(self.local_rows):
            rows = self.local_rows
            q.index_copy_(0, rows, self.rows.rotate_and_write(layer, qkv[rows], rotary, meta.positions[rows],
                                                              self.local_slots))
        if len(self.remote_rows):  # rotated here, written by the creditors that hold their slots
            rows = self.remote_rows
            q_remote, self.k_new, self.v_new = self.rows.rotate(qkv[rows], rotary, meta.positions[rows])
            q.index_copy_(0, rows, q_remote.to(q.dtype))
        return q

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = self.local.attend(layer, q, meta)  # local sequences' rows; the spanning ones are filled below
        started = time.perf_counter()
        owner = self.owner
        futures = {creditor: owner.directory.remote_attention(creditor, layer, items, self.scale)
                   for creditor, items in self._remote_items(q).items()}
        owner.stats.layer_calls += len(futures)
        partials: list[list[PartialAttention]] = []
        for plan in self.plans:  # the local blocks' part, as a creditor computes the lent blocks' part
            partials.append([self.rows.partial(layer, q[plan.rows], plan.q_pos, plan.local_blocks, plan.local_k_pos,
                                               self.scale)])
        waited = time.perf_counter()
        results = owner.directory.wait(futures)
        merging = time.perf_counter()
        owner.stats.wait_seconds += merging - waited
        for creditor, answers in results.items():
            for index, answer in zip(self._plans_on(creditor), answers, strict=True):
                partials[index].append(self._partial(self.plans[index], creditor, answer, q))
        for plan, parts in zip(self.plans, partials, strict=True):
            out.index_copy_(0, plan.rows, self.merge(parts).to(out.dtype))
        done = time.perf_counter()
        owner.stats.merge_seconds += done - merging
        owner.stats.seconds += done - started
        return out

    def _partial(self, plan: _SeqPlan, creditor: int, answer: tuple, q: torch.Tensor) -> PartialAttention:
        """A creditor's answer for one sequence: its partial, or its lent K/V rows to attend over here."""
        kind, *tensors = answer
        if kind == "partial":
            return PartialAttention(*tensors)
        self.owner.stats.kv_pulls += 1
        k, v = tensors
        return partial_attention(q[plan.rows], k, v, plan.q_pos, plan.remote[creditor][1], self.scale)

    def _plans_on(self, creditor: int) -> list[int]:
        return [i for i, plan in enumerate(self.plans) if creditor in plan.remote or creditor in plan.writes]

    def _call_plan(self) -> list[tuple[int, _SeqPlan, dict, torch.Tensor | None, bool]]:
        """Per creditor and spanning sequence, what its call carries in every layer of this step (all
        but the layer's queries and new K/V rows), worked out once a step."""
        if self._calls is None:
            self._calls = []
            for plan in self.plans:
                for creditor in sorted(set(plan.remote) | set(plan.writes)):
                    blocks, k_pos = plan.remote.get(creditor, ([], torch.empty(0, dtype=torch.long)))
                    rows, slots = plan.writes.get(creditor, ([], []))
                    index = self.row_in_remote[torch.tensor(rows, dtype=torch.long)] if rows else None
                    pull = self.owner.pull and pull_kv(len(plan.rows), len(k_pos), self.num_heads,
                                                       self.num_kv_heads, self.head_dim)
                    # keys the last query sees: for a decode row, the prefix of the blocks' slots to attend
                    visible = int(torch.searchsorted(k_pos, plan.q_pos[-1:], right=True)) if len(k_pos) else 0
                    fixed = {"q_pos": plan.q_pos, "blocks": blocks, "k_pos": k_pos, "slots": slots, "visible": visible}
                    self._calls.append((creditor, plan, fixed, index, pull))
        return self._calls

    def _remote_items(self, q: torch.Tensor) -> dict[int, list[dict]]:
        items: dict[int, list[dict]] = defaultdict(list)
        for creditor, plan, fixed, index, pull in self._call_plan():
            items[creditor].append({
                **fixed, "q": None if pull else q[plan.rows], "dtype": q.dtype,
                "k_new": self.k_new[index] if index is not None else None,
                "v_new": self.v_new[index] if index is not None else None,
            })
        return items


def creditor_micro_attention(rows: PoolRows, layer: int, items: list[dict], scale: float) -> list[tuple]:
    """Creditor side of one layer: write the debtor's new K/V into the lent blocks, then per sequence
    ("partial", out, row max, sum-exp) over them, or ("kv", k, v) when the debtor sent no queries."""
    answers = []
    for item in items:
        if item["slots"]:
            rows.write(layer, item["k_new"], item["v_new"], torch.tensor(item["slots"], dtype=torch.long))
        blocks = torch.tensor(item["blocks"], dtype=torch.long)
        if item["q"] is None:
            answers.append(("kv", *rows.gather(layer, blocks, item["dtype"])))
        else:
            partial = rows.partial(layer, item["q"], item["q_pos"], blocks, item["k_pos"], scale)
            answers.append(("partial", *partial.as_tuple()))
    return answers
