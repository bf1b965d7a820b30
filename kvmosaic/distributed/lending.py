"""What an instance does to its own engine's KV books for the distributed cache: lend free blocks
to another instance and take them back, point block tables at blocks brought home, and run again the
requests whose borrowed blocks died with their creditor. Each verb holds the engine's KV lock (the
one held around its scheduling), so it never interleaves with a step's bookkeeping."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmosaic.engine.engine import Engine


class EngineLending:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def lend(self, num_blocks: int) -> list[int] | None:
        """Free local blocks reserved for another instance, or None when there are not enough."""
        with self.engine.kv_lock:
            return self.engine.kv_manager.lend_blocks(num_blocks)

    def reclaim(self, block_ids: list[int]) -> None:
        """Blocks back in the local free pool (repaid, or lent to an instance that died)."""
        with self.engine.kv_lock:
            self.engine.kv_manager.reclaim_blocks(block_ids)

    def replace(self, mapping: dict[int, int]) -> None:
        """Block-table entries ``old -> new`` everywhere (blocks brought home from another instance)."""
        with self.engine.kv_lock:
            self.engine.kv_manager.replace_blocks(mapping)

    def requests_holding(self, block_ids: set[int]) -> set[str]:
        with self.engine.kv_lock:
            return self.engine.kv_manager.requests_holding(block_ids)

    def num_table_blocks(self) -> int:
        """Blocks in all block tables (the distributed stats' denominator; not part of Engine.stats(),
        which the server reads every loop iteration)."""
        with self.engine.kv_lock:
            return self.engine.kv_manager.num_table_blocks()

    def recompute_lost(self, request_ids: set[str]) -> dict[str, str]:
        """Sequences whose KV was lost run again from their first token; a request that no longer
        fits the reachable pool is aborted. Returns {request id: why} for those."""
        engine, errors = self.engine, {}
        with engine.kv_lock:
            engine.scheduler.recompute(request_ids)
            reachable = engine.kv_manager.num_reachable_blocks * engine.kv_manager.block_size
            for request_id in request_ids:
                request = engine.scheduler.get_request(request_id)
                if request is not None and request.num_tokens > reachable:
                    errors[request.group_id] = (
                        f"the KV blocks of request {request.group_id} were lost with a failed instance and it "
                        f"no longer fits the {reachable} KV slots still reachable")
                    engine.abort(request.group_id, emit_output=True)
        return errors
