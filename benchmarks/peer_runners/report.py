"""The peer benchmark's table and float32 greedy-token check, from the runners' JSON results."""

from __future__ import annotations

from peer_runners.common import WORKLOADS

BUSY = 0.1  # other processes' CPU share above which a result is marked with *
CHECK_TOKENS = 8  # float32 engines must agree on this many leading greedy tokens


def succeeded(res: dict | None) -> bool:
    return res is not None and "error" not in res and "unsupported" not in res


def _find(results: list[dict], engine: str, dtype: str, workload: str) -> dict | None:
    return next((r for r in results if (r["engine"], r["dtype"], r["workload"]) == (engine, dtype, workload)), None)


def _cell(res: dict | None, key: str, skipped: str | None) -> str:
    if skipped:
        return "skipped"
    if res is None:
        return "-"
    if "unsupported" in res:
        return "n/a"
    if "error" in res:
        return "timeout" if res["error"].startswith("timeout") else "failed"
    mark = "*" if res.get("other_cpu_share", 0) > BUSY else ""
    return (f"{res[key]:.2f}" if key == "seconds" else f"{res[key]:.1f}") + mark


def table(results: list[dict], engines: list, dtypes: list[str], workloads: list[str],
          skipped: dict[str, str]) -> list[str]:
    """One markdown table: a row per (workload, metric, dtype), a column per engine (.key, .label)."""
    head = ["workload", "metric", "dtype", *(e.label for e in engines), "kvmosaic / best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(engines) + 1)]
    metrics = [(w, WORKLOADS[w].metric, "tokens_per_s") for w in workloads]
    if "B" in workloads:
        metrics.insert(workloads.index("B") + 1, ("B", "wall s", "seconds"))
    for workload, metric, key in metrics:
        for dtype in dtypes:
            cells = [_cell(_find(results, e.key, dtype, workload), key, skipped.get(e.key)) for e in engines]
            lines.append("| " + " | ".join([workload, metric, dtype, *cells, _ratio(results, dtype, workload, key)])
                         + " |")
    return lines


def _ratio(results: list[dict], dtype: str, workload: str, key: str) -> str:
    """kvmosaic's speed over the best peer's (> 1: kvmosaic is faster)."""
    ours = _find(results, "kvmosaic", dtype, workload)
    peers = [r for r in results if r["engine"] != "kvmosaic" and (r["dtype"], r["workload"]) == (dtype, workload)
             and succeeded(r)]
    if not succeeded(ours) or not peers:
        return "-"
    if key == "seconds":
        return f"{min(p[key] for p in peers) / ours[key]:.2f}x"
    return f"{ours[key] / max(p[key] for p in peers):.2f}x"


def token_check(results: list[dict], workloads: list[str]) -> tuple[bool | None, list[str]]:
    """float32: every engine's first greedy tokens of the first prompt must equal kvmosaic's.

    Returns (all agree on the first CHECK_TOKENS, or None when nothing was compared; a line per workload).
    """
    ok, lines = None, []
    for workload in workloads:
        ref = _find(results, "kvmosaic", "float32", workload)
        if not succeeded(ref):
            continue
        notes = []
        for res in results:
            if (res["dtype"], res["workload"]) != ("float32", workload) or res["engine"] == "kvmosaic":
                continue
            if not succeeded(res):
                continue
            same = _common_prefix(ref["first_tokens"], res["first_tokens"])
            ok = (ok is not False) and same >= min(CHECK_TOKENS, len(ref["first_tokens"]))
            notes.append(f"{res['engine']} {same}/{len(ref['first_tokens'])}")
        lines.append(f"  {workload}: " + (", ".join(notes) or "no peer ran"))
    return ok, lines


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def summary_rows(results: list[dict], startup: list[dict]) -> list[dict]:
    """The results record's rows: one per (workload, dtype), each engine's rate (None where it failed or
    does not run the dtype), the fastest peer and kvmosaic's speed over it; then kvmosaic's start-up."""
    rows = []
    keys = sorted({(r["workload"], r["dtype"]) for r in results}, key=lambda k: (k[0], k[1]))
    for workload, dtype in keys:
        found = [r for r in results if (r["workload"], r["dtype"]) == (workload, dtype)]
        rates = {r["engine"]: (r["tokens_per_s"] if succeeded(r) else None) for r in found}
        peers = {e: v for e, v in rates.items() if e != "kvmosaic" and v is not None}
        best = max(peers, key=peers.get) if peers else None
        ours = rates.get("kvmosaic")
        rows.append({"workload": workload, "metric": WORKLOADS[workload].metric, "dtype": dtype, "engines": rates,
                     "best_peer": best, "ratio": round(ours / peers[best], 4) if best and ours else None})
    for dtype in sorted({res["dtype"] for res in startup}):  # one row per dtype, every engine that started
        times = {res.get("engine", "kvmosaic"): (res.get("seconds") if succeeded(res) else None)
                 for res in startup if res["dtype"] == dtype}
        rows.append({"workload": "S", "metric": "start-up s", "dtype": dtype, "engines": times, "best_peer": None,
                     "ratio": None})
    return rows
