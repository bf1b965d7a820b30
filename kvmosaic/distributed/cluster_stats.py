"""The cluster's stats: every live instance's own summed, plus the gManager's ledger counters."""

from __future__ import annotations


def cluster_stats(per_instance: dict[int, dict], ledger: dict) -> dict:
    """Summed instance stats (``per_instance``: live instances only) and ledger counters (a gManager snapshot)."""
    total: dict = {}
    for stats in per_instance.values():
        for key, value in stats.items():
            total[key] = total.get(key, 0) + value
    counters = ledger["counters"]
    blocks = total.get("dist_table_blocks", 0)
    total.update({
        "dist_instances_alive": sum(ledger["alive"].values()),
        "dist_outstanding_debt_blocks": ledger["total_debt"],
        "dist_loans_total": counters["loans"],
        "dist_repayments_total": counters["repayments"],
        "dist_swaps_total": counters["swaps"],
        "dist_swapped_blocks_total": counters["swapped_blocks"],
        "dist_written_off_blocks_total": counters["written_off_blocks"],
        "dist_remote_fraction": total.get("dist_borrowed_blocks", 0) / blocks if blocks else 0.0,
    })
    queries = total.get("prefix_cache_queries", 0)
    total["prefix_cache_hit_rate"] = total.get("prefix_cache_hits", 0) / queries if queries else 0.0
    return total
