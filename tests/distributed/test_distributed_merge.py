"""DistAttention math, the debt ledger and the KV manager's borrowing hook: no Ray, no model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmosaic.attention.merge import PartialAttention, merge_partials, partial_attention, reference_attention
from kvmosaic.core.kv_cache_manager import KVCacheManager
from kvmosaic.distributed.ledger import DebtLedger, SwapPlan
from kvmosaic.request import Request, RequestStatus
from kvmosaic.sampling_params import SamplingParams


@pytest.mark.parametrize("use_flash", [True, False])
@pytest.mark.parametrize("holders", [2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_merge_equals_monolithic_attention(holders: int, seed: int, use_flash: bool) -> None:
    gen = torch.Generator().manual_seed(seed * 10 + holders)
    hq, hk, dim = 9, 3, 16
    context = int(torch.randint(holders, 70, (1,), generator=gen))
    num_queries = int(torch.randint(1, context + 1, (1,), generator=gen))
    if use_flash:
        num_queries = max(num_queries, min(context, 8))  # the flash path takes chunks of 8+ rows
    q = torch.randn(num_queries, hq, dim, generator=gen)
    k = torch.randn(context, hk, dim, generator=gen)
    v = torch.randn(context, hk, dim, generator=gen)
    q_pos = torch.arange(context - num_queries, context)
    k_pos = torch.arange(context)
    owner = torch.randint(0, holders, (context,), generator=gen)  # a random split, holders may be empty
    scale = dim**-0.5
    partials = [partial_attention(q, k[owner == h], v[owner == h], q_pos, k_pos[owner == h], scale, use_flash)
                for h in range(holders)]
    merged = merge_partials(partials)
    expected = reference_attention(q, k, v, q_pos, k_pos, scale)
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1), v.repeat_interleave(3, 1).transpose(0, 1),
        attn_mask=k_pos[None, :] <= q_pos[:, None], scale=scale).transpose(0, 1)
    torch.testing.assert_close(merged, sdpa, atol=1e-5, rtol=1e-5)


def test_partial_with_no_visible_key_is_neutral() -> None:
    q = torch.randn(2, 4, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    part = partial_attention(q, k, v, torch.tensor([0, 1]), torch.tensor([5, 6, 7]), 0.3)
    assert torch.isinf(part.row_max).all() and (part.sum_exp == 0).all() and (part.out == 0).all()
    empty = partial_attention(q, k[:0], v[:0], torch.tensor([0, 1]), torch.tensor([], dtype=torch.long), 0.3)
    real = partial_attention(q, k, v, torch.tensor([9, 9]), torch.tensor([5, 6, 7]), 0.3)
    torch.testing.assert_close(merge_partials([part, empty, real]), real.out)


# ------------------------------------------------------------------ ledger (hypothesis)
_ops = st.lists(st.tuples(st.sampled_from(["borrow", "repay", "beat", "die", "swap"]),
                          st.integers(0, 3), st.integers(0, 3), st.integers(1, 6)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(num=st.integers(2, 4), ops=_ops)
def test_ledger_invariants(num: int, ops) -> None:
    ledger = DebtLedger()
    for i in range(num):
        ledger.register(i, 10, node="a" if i < 2 else "b")
    truth: dict[tuple[int, int], int] = {}
    for op, a, b, n in ops:
        a, b = a % num, b % num
        alive = set(ledger.alive_ids())
        if op == "borrow" and a != b and a in alive:
            candidates = ledger.candidates(a, n)
            assert a not in candidates and all(c in alive for c in candidates)
            assert all(ledger.instances[c].free_blocks >= n for c in candidates)
            costs = [(ledger.cost(a, c), -ledger.instances[c].free_blocks) for c in candidates]
            assert costs == sorted(costs)
            if candidates:
                ledger.record_loan(a, candidates[0], n)
                truth[(a, candidates[0])] = truth.get((a, candidates[0]), 0) + n
        elif op == "repay" and truth.get((a, b)):
            paid = min(n, truth[(a, b)])
            ledger.record_repayment(a, b, paid)
            truth[(a, b)] -= paid
        elif op == "beat" and a in alive:
            ledger.heartbeat(a, n, now=0.0)
        elif op == "die":
            ledger.declare_dead(a)
            truth = {pair: v for pair, v in truth.items() if a not in pair}
        elif op == "swap":
            for plan in ledger.find_cycles():
                ledger.record_swap(plan)
                for i, d in enumerate(plan.cycle):
                    truth[(d, plan.cycle[(i + 1) % len(plan.cycle)])] -= plan.num_blocks
        truth = {pair: v for pair, v in truth.items() if v}
        assert ledger.loans() == truth  # repaid debts vanish
        lent = {(d, c): v for c, row in ledger.lent.items() for d, v in row.items()}
        assert lent == ledger.loans()  # lent equals borrowed per pair
        assert all(v > 0 for v in lent.values())
        assert all(info.free_blocks >= 0 for info in ledger.instances.values())
        assert all(a in alive or not ledger.instances[a].alive for a in ledger.instances)
    for dead in ledger.dead_ids():
        assert all(dead not in pair for pair in ledger.loans())


def test_ledger_cycles_and_swaps() -> None:
    ledger = DebtLedger()
    for i in range(4):
        ledger.register(i, 16)
    ledger.record_loan(0, 1, 3)
    ledger.record_loan(1, 2, 5)
    ledger.record_loan(2, 0, 4)
    ledger.record_loan(3, 0, 2)
    plans = ledger.find_cycles()
    assert plans == [SwapPlan([0, 1, 2], 3)]
    ledger.record_swap(plans[0])
    assert ledger.loans() == {(1, 2): 2, (2, 0): 1, (3, 0): 2}
    assert ledger.find_cycles() == []
    assert ledger.find_cycles(min_blocks=5) == []
    ledger.record_loan(0, 3, 2)
    assert ledger.find_cycles(min_blocks=3) == []
    assert ledger.find_cycles(min_blocks=2) == [SwapPlan([0, 3], 2)]
    ledger.expire(now=100.0, timeout=1.0)  # nobody beat since t=0: all dead, every debt written off
    assert ledger.loans() == {} and ledger.counters.dead_instances == 4


# --------------------------------------------------------------- the KV manager hook
class FakeBorrower:
    """An rManager that lends from an imaginary creditor: rBlock ids from 100 up; records what comes back."""

    def __init__(self, lendable: int, num_local_blocks: int) -> None:
        self.num_local_blocks = num_local_blocks
        self.lendable = lendable
        self.next_id = 100
        self.released: list[int] = []

    @property
    def num_lendable_blocks(self) -> int:
        return self.lendable

    def borrow(self, request: Request, num_blocks: int) -> list[int] | None:
        if num_blocks > self.lendable:
            return None
        self.lendable -= num_blocks
        ids = list(range(self.next_id, self.next_id + num_blocks))
        self.next_id += num_blocks
        return ids

    def release(self, block_ids: list[int]) -> None:
        self.released.extend(block_ids)
        self.lendable += len(block_ids)


def _request(rid: str, n: int) -> Request:
    request = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))
    request.status = RequestStatus.RUNNING
    return request


def test_kv_manager_borrows_when_local_pool_is_full() -> None:
    from kvmosaic.distributed.rmanager import BorrowingAllocator

    local_only = KVCacheManager(num_blocks=4, block_size=4)
    request = _request("a", 20)
    assert local_only.allocate_slots(request, 20) is None  # no borrower: all or nothing
    assert local_only.num_free_blocks == 4
    borrower = FakeBorrower(lendable=3, num_local_blocks=4)
    manager = KVCacheManager(num_blocks=4, block_size=4, allocator=BorrowingAllocator(borrower))
    assert manager.num_reachable_blocks == 7
    table = manager.allocate_slots(request, 20)
    assert table == [0, 1, 2, 3, 100]
    assert manager.swap_out(request) is None  # borrowed blocks are recomputed, not swapped
    request.num_computed_tokens = 20
    assert manager.allocate_slots(request, 8) == [0, 1, 2, 3, 100, 101, 102]
    request.num_computed_tokens = 28
    assert manager.allocate_slots(request, 4) is None  # the lender is dry
    manager.free(request)
    assert sorted(borrower.released) == [100, 101, 102] and manager.num_free_blocks == 4


def test_serve_parses_cluster_flags() -> None:
    from kvmosaic.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--instances", "3", "--ray-address", "auto", "--no-borrowing"])
    assert (args.instances, args.ray_address, args.enable_borrowing) == (3, "auto", False)
    assert build_parser().parse_args(["serve"]).instances == 1


def test_gmanager_declares_silent_instances_dead_and_writes_off_their_debts() -> None:
    import time

    from kvmosaic.config import DistributedConfig
    from kvmosaic.distributed.gmanager import GManager

    gm = GManager(DistributedConfig(heartbeat_interval=0.1, missed_heartbeats=5))  # dead after 0.5 s of silence
    for i in range(3):
        gm.register(i, 8)
    gm.record_loan(0, 1, 3)
    gm.record_loan(2, 0, 2)
    assert gm.candidates(0, 4) == [2, 1]  # 2 still has 8 free, 1 has 5
    for _ in range(40):
        time.sleep(0.02)
        gm.heartbeat(0, 4)
        dead = gm.heartbeat(2, 6)
    assert dead == [1]  # the silent one; the survivors learn it from their heartbeats
    snapshot = gm.snapshot()
    assert snapshot["loans"] == {"2->0": 2} and snapshot["counters"]["written_off_blocks"] == 3
    assert gm.candidates(0, 1) == [2]
    gm.record_repayment(2, 0, 2)
    assert gm.snapshot()["total_debt"] == 0


def test_only_backends_that_say_what_they_lend_can_lend(level_kernels) -> None:
    """A backend lends what its ``lendable_rows()`` returns (float and quantized pools); one that
    returns None cannot back an instance of the distributed cache."""
    from quant_pools import quantized_rows

    from kvmosaic.attention.backend import AttentionBackend
    from kvmosaic.attention.dist_attention import RemoteKVAttention
    from kvmosaic.attention.kv_cache import KVCache
    from kvmosaic.attention.paged import FloatPoolRows, KernelAttention
    from kvmosaic.attention.quantized import QuantizedPoolRows
    from kvmosaic.config import CacheConfig

    rows, cache = quantized_rows(level_kernels, "int8", torch.float32, 64)
    assert type(rows) is QuantizedPoolRows and rows.local.kv_cache is cache

    class Unlendable(AttentionBackend):
        def write(self, layer, qkv, rotary, meta):
            raise NotImplementedError

        def attend(self, layer, q, meta):
            raise NotImplementedError

    float_cache = KVCache(rows.local.model, CacheConfig(num_blocks=4, block_size=16, swap_space=0), torch.float32)
    kernel = KernelAttention(rows.local.model, float_cache, level_kernels.ops)
    assert type(kernel.lendable_rows()) is FloatPoolRows and kernel.lendable_rows().float_ops is level_kernels.ops
    with pytest.raises(ValueError, match="cannot lend blocks of Unlendable"):
        RemoteKVAttention(Unlendable(rows.local.model, float_cache), dist=None)


def test_requests_go_to_the_least_committed_pool() -> None:
    from kvmosaic.distributed.cluster import least_committed

    capacity = {0: 32, 1: 32, 2: 16}
    assert least_committed([0, 1, 2], {}, {}, capacity, 4) == 0  # all empty: the lowest id
    route, blocks = {"long": 0}, {"long": 40}  # longer than instance 0's pool: it borrows
    assert least_committed([0, 1, 2], route, blocks, capacity, 4) == 1
    route.update({"a": 1, "b": 1}), blocks.update({"a": 4, "b": 4})
    # 1 would hold 12/32, 2 (half the pool) 4/16: equal shares, the fewer requests win
    assert least_committed([0, 1, 2], route, blocks, capacity, 4) == 2
    assert least_committed([0, 1], route, blocks, capacity, 30) == 1  # 38/32 < 70/32
    assert least_committed([0], route, blocks, capacity, 4) == 0  # the only live one


def test_creditors_return_kv_rows_when_they_are_smaller_than_queries_and_partials() -> None:
    from kvmosaic.attention.dist_attention import pull_kv

    hq, hk, d = 9, 3, 64  # the default model: GQA 9/3
    # a decode query: 9 * 130 floats against 384 a key, so only under 4 keys (less than a block) come back
    assert pull_kv(1, 3, hq, hk, d) and not pull_kv(1, 4, hq, hk, d) and not pull_kv(1, 16, hq, hk, d)
    # a prefill chunk of 64 queries: 64 * 9 * 130 floats of queries and partials against
    # 2 * keys * 3 * 64 of K/V rows, equal at 195 keys
    assert pull_kv(64, 194, hq, hk, d) and not pull_kv(64, 195, hq, hk, d)


def _check_decode_partials(rows, gen: torch.Generator, hq: int, head_dim: int, dtype: torch.dtype,
                           tol: float) -> torch.Tensor:
    """A holder's decode-row partial (``rows.partial``, on a kernel) against gathering its lent blocks'
    rows and attending in PyTorch, with the query inside the last lent block (a prefix of its slots
    visible), past all of them, and before the first (nothing visible); returns the last query."""
    from kvmosaic.attention.dist_attention import _key_positions
    from kvmosaic.attention.pool_rows import gathered_partial

    bs = 16
    lent = torch.tensor([7, 2, 10])  # physical blocks holding logical blocks 1, 4 and 5 of a sequence
    k_pos = _key_positions([1, 4, 5], bs)
    for q_at in (5 * bs + 6, 9 * bs, bs - 1):
        q = torch.randn(1, hq, head_dim, generator=gen).to(dtype)
        q_pos = torch.tensor([q_at])
        got = rows.partial(1, q, q_pos, lent, k_pos, head_dim**-0.5)
        want = gathered_partial(rows, 1, q, q_pos, lent, k_pos, head_dim**-0.5)
        assert got.out.dtype == torch.float32 and got.out.shape == (1, hq, head_dim)
        torch.testing.assert_close(got.out, want.out, atol=tol, rtol=tol)
        # a kernel's reference may sit below the row max (it is raised lazily): the pair's
        # log-sum-exp, what a merge uses, is the same
        torch.testing.assert_close(got.row_max + got.sum_exp.log(), want.row_max + want.sum_exp.log(),
                                   atol=tol, rtol=tol)
        assert (got.row_max <= want.row_max + tol).all()
    return q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_creditor_decode_partial_on_the_kernel_equals_pytorchs(level_kernels, dtype, head_dim) -> None:
    """A creditor's partial for a decode row runs the decode attention kernel over its lent blocks in
    place: the same output and log-sum-exp as gathering the rows and attending in PyTorch, with
    the query inside the last lent block (a prefix of its slots visible), past all of them, and
    before the first (nothing visible)."""
    from types import SimpleNamespace

    from kvmosaic.attention.paged import FloatPoolRows

    gen = torch.Generator().manual_seed(head_dim)
    bs, hq, hk, blocks = 16, 9, 3, 12
    caches = [(torch.randn(blocks, bs, hk, head_dim, generator=gen).to(dtype),
               torch.randn(blocks, bs, hk, head_dim, generator=gen).to(dtype)) for _ in range(2)]
    rows = FloatPoolRows(SimpleNamespace(layers=caches, ops=level_kernels.ops))
    q = _check_decode_partials(rows, gen, hq, head_dim, dtype, 1e-5 if dtype == torch.float32 else 2e-2)
    with pytest.raises(RuntimeError, match="block id out of range"):
        level_kernels.ops.paged_decode_attention_partial(q, *caches[0], torch.tensor([[3, 99]]),
                                                         torch.tensor([20]), 0.125)


@pytest.mark.parametrize("mode", ["int8", "int4", "oaken", "oaken-rot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_quantized_creditor_partial_runs_the_quantized_kernel_in_place(level_kernels, mode, dtype, head_dim) -> None:
    """An int8 / int4 / Oaken creditor's partial for a decode row reads its lent records in place with
    the quantized decode kernel: the output and log-sum-exp of dequantizing the blocks and attending
    in PyTorch, for a query inside, past and before the lent blocks; and the kernel's partial over a
    whole sequence is its plain output."""
    from quant_pools import HQ, quantized_rows

    from kvmosaic.attention.quantized import kernel_decode_args

    rows, _ = quantized_rows(level_kernels, mode, dtype, head_dim)
    gen = torch.Generator().manual_seed(3)
    q = _check_decode_partials(rows, gen, HQ, head_dim, dtype, 1e-4 if dtype == torch.float32 else 3e-2)
    layer, qops = rows.local.layers[1], level_kernels.quant
    table, lens = torch.tensor([[3, 8, 1]]), torch.tensor([40])
    args = kernel_decode_args(layer, head_dim**-0.5)
    out, _, _ = qops.quant_decode_attention_partial(q, layer.k_pool, layer.v_pool, table, lens, *args)
    plain = qops.quant_decode_attention(q, layer.k_pool, layer.v_pool, table, lens, *args)
    assert torch.equal(out.to(dtype), plain)


def test_the_merge_kernel_combines_partials_as_merge_partials_does(level_kernels) -> None:
    """ops.merge_attention_partials (the debtor's merge of its own and its creditors' partials) against
    merge_partials: one to three holders, a holder that saw no keys, a row no holder saw, a strided input."""
    from kvmosaic.attention.merge import merge_on

    gen = torch.Generator().manual_seed(5)
    n, hq, d = 3, 9, 64
    for holders in (1, 2, 3):
        parts = [PartialAttention(torch.randn(n, hq, d, generator=gen), torch.randn(n, hq, generator=gen) * 4,
                                  torch.rand(n, hq, generator=gen) * 30 + 1) for _ in range(holders)]
        parts[0].row_max[1] = float("-inf")  # the first holder saw none of row 1's keys
        parts[0].sum_exp[1] = 0.0
        parts[0].out[1] = 0.0
        if holders == 1:
            parts[0].row_max[2], parts[0].sum_exp[2], parts[0].out[2] = float("-inf"), 0.0, 0.0
        parts[-1] = PartialAttention(parts[-1].out.transpose(0, 1).contiguous().transpose(0, 1), parts[-1].row_max,
                                     parts[-1].sum_exp)
        got = merge_on(level_kernels.ops)(parts)
        want = merge_partials(parts)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert merge_on(None) is merge_partials
    with pytest.raises(RuntimeError, match="different shapes"):
        level_kernels.ops.merge_attention_partials([parts[0].out, parts[1].out[:2]], [p.row_max for p in parts[:2]],
                                                   [p.sum_exp for p in parts[:2]])


def test_a_quantized_pools_partials_merge_on_the_float_kernel(level_kernels) -> None:
    """An instance with an int8 pool merges its decode rows' partials with ops.merge_attention_partials
    (its float kernels), as a float instance does, not with the PyTorch reference."""
    from quant_pools import quantized_rows

    from kvmosaic.attention.dist_attention import RemoteKVAttention

    rows, _ = quantized_rows(level_kernels, "int8", torch.float32, 64)
    attention = RemoteKVAttention(rows.local, dist=None)
    assert attention.rows.float_ops is level_kernels.ops and attention.merge is not merge_partials
    gen = torch.Generator().manual_seed(9)
    parts = [PartialAttention(torch.randn(1, 9, 64, generator=gen), torch.randn(1, 9, generator=gen),
                              torch.rand(1, 9, generator=gen) + 1) for _ in range(2)]
    torch.testing.assert_close(attention.merge(parts), merge_partials(parts), atol=1e-6, rtol=1e-5)


def test_an_instance_backend_hands_on_its_local_kernel_calls() -> None:
    """RemoteKVAttention gives the runner its local backend's layer stack and greedy decode passes (the
    runner runs them only for steps that span no other instance), so an instance's local steps run
    on the kernels as a lone engine's do."""
    from kvmosaic import LLM
    from kvmosaic.attention.dist_attention import RemoteKVAttention

    local = LLM(kv_cache_memory="16MiB").engine.executor.worker.runner.attention
    attention = RemoteKVAttention(local, dist=None)
    assert local.decode_passes() is not None and local.layer_stack() is not None
    assert attention.decode_passes() == local.decode_passes()
    assert attention.layer_stack() == local.layer_stack()
