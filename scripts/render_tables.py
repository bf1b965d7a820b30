"""The tables scripts/render_docs.py renders: each a function from the results records to markdown lines.

A table is either generic (``rows_table``: the rows of one benchmark's records, a column per field) or
a view across records (the peers summary: kvmosaic over its best peer per workload, dtype and host
kind, from the latest record that measured it). Every table ends with the files it read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Record:
    path: str  # relative to the repository root
    kind: str  # host kind: the results directory's name
    data: dict

    @property
    def when(self) -> str:
        """Sort key and label: the measurement's date, else the date the figures entered the log."""
        return self.data.get("date") or (self.data.get("logged") or {}).get("date") or ""

    @property
    def order(self) -> tuple[str, int, str]:
        """Oldest first; figures logged by one commit keep the log's order (later lines were measured later)."""
        return self.when, (self.data.get("logged") or {}).get("log_line") or 0, self.path

    @property
    def transcribed(self) -> bool:
        return not str(self.data.get("provenance", "measured")).startswith("measured")


def get(row: dict, key: str):
    value = row
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def fmt(value, spec: str = "{}") -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return spec.format(value)
    return str(value)


def day(record: Record) -> str:
    return (record.when[:10] or "undated") + ("*" if record.transcribed else "")


def host_label(record: Record) -> str:
    host = record.data.get("host") or {}
    parts = [p for p in (host.get("cpu_model"), host.get("isa_summary")) if p]
    return ", ".join(parts) or "not recorded"


def sources(records: list[Record]) -> list[str]:
    """One line per record the table read: file, provenance, date, host and command."""
    lines = [""]
    for r in sorted(records, key=lambda r: (r.kind, r.order)):
        command = r.data.get("command")
        tree = (r.data.get("git") or {}).get("commit")
        bits = [f"`{r.path}`", r.data.get("provenance", "measured"), f"date {day(r)}", f"host: {host_label(r)}"]
        if tree:
            bits.append(f"commit {tree[:7]}")
        if command:
            bits.append(f"`{command}`")
        lines.append("- " + "; ".join(bits))
    if any(r.transcribed for r in records):
        lines.append("")
        lines.append("\\* transcribed record: the date its figures entered the benchmark log (the log kept no run "
                     "dates).")
    return lines


def select(records: list[Record], bench: str, kinds: tuple[str, ...] | None = None) -> list[Record]:
    chosen = [r for r in records if r.data.get("bench") == bench and (kinds is None or r.kind in kinds)]
    return sorted(chosen, key=lambda r: (r.kind, r.order))


Column = tuple[str, str, str]  # header, field (dotted), format


def pair(label: str, key: str, spec: str, stats: tuple[str, str] = ("p50", "p99")) -> list[Column]:
    return [(f"{label} {stat} ms", f"{key}.{stat}", spec) for stat in stats]


def rows_table(bench: str, columns: list[Column], kinds: tuple[str, ...] | None = None,
               where: Callable[[dict], bool] | None = None) -> Callable[[list[Record]], list[str]]:
    """A table of every row of ``bench``'s records (a host-kind column when there are several kinds)."""
    def render(records: list[Record]) -> list[str]:
        chosen = select(records, bench, kinds)
        if not chosen:
            return ["_No results recorded yet._"]
        several = len({r.kind for r in chosen}) > 1
        head = (["host kind"] if several else []) + [c[0] for c in columns]
        align = (["---"] if several else []) + ["---" if spec == "{}" else "---:" for _, _, spec in columns]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
        for r in chosen:
            for row in r.data["rows"]:
                if where is not None and not where(row):
                    continue
                cells = ([r.kind] if several else []) + [fmt(get(row, key), spec) for _, key, spec in columns]
                lines.append("| " + " | ".join(cells) + " |")
        return lines + sources(chosen)
    return render


# ---- peers -----------------------------------------------------------------------------------------
DTYPES = ("float32", "bfloat16", "q8_0", "q4_1")
WORKLOADS = {"A": "A: decode, 1 x 128 + 128", "B": "B: 64 x 128 + 128", "C": "C: prefill, 16 x 512"}
PEER_NAMES = {"vllm": "vLLM", "llamacpp": "llama.cpp", "hf": "HF", "ct2": "CTranslate2"}


def latest_peer_rows(records: list[Record]) -> dict[tuple[str, str, str], tuple[dict, Record]]:
    """(host kind, workload, dtype) -> the row of the latest peers record that measured it."""
    found: dict[tuple[str, str, str], tuple[dict, Record]] = {}
    for r in select(records, "peers"):  # oldest first, so later records replace earlier ones
        for row in r.data["rows"]:
            found[r.kind, row["workload"], row["dtype"]] = (row, r)
    return found


def peers_summary(records: list[Record]) -> list[str]:
    """kvmosaic / best peer per workload and dtype, a row per host kind and workload."""
    found = latest_peer_rows(records)
    kinds = sorted({k for k, _, _ in found})
    if not kinds:
        return ["_No results recorded yet._"]
    lines = ["| host kind | workload | " + " | ".join(DTYPES) + " | date | host |",
             "|---|---|" + "---:|" * len(DTYPES) + "---|---|"]
    used: list[Record] = []
    for kind in kinds:
        for workload, label in WORKLOADS.items():
            cells, recs = [], []
            for dtype in DTYPES:
                row, rec = found.get((kind, workload, dtype), (None, None))
                if row is None or row.get("ratio") is None:
                    cells.append("-")
                    continue
                peer = PEER_NAMES.get(row.get("best_peer"), row.get("best_peer"))
                cells.append(f"{row['ratio']:.2f}x ({peer})")
                recs.append(rec)
            if not recs:
                continue
            used += [r for i, r in enumerate(recs) if r not in used and r not in recs[:i]]
            dates = sorted({day(r) for r in recs})
            when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
            lines.append(f"| {kind} | {label} | " + " | ".join(cells) + f" | {when} | {host_label(recs[-1])} |")
    return lines + sources(used)


def peers_latest(records: list[Record]) -> list[str]:
    """Every engine's figure behind the summary, and kvmosaic's start-up."""
    found = latest_peer_rows(records)
    if not found:
        return ["_No results recorded yet._"]
    engines = ["kvmosaic", "vllm", "llamacpp"]
    lines = ["| host kind | workload | metric | dtype | kvmosaic | vLLM | llama.cpp | kvmosaic / best peer |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    order = {w: i for i, w in enumerate("ABCLS")}
    used: list[Record] = []
    for (kind, workload, dtype), (row, rec) in sorted(
            found.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 9), DTYPES.index(kv[0][2])
                                           if kv[0][2] in DTYPES else 9)):
        spec = "{:.2f}" if workload == "S" else "{:.1f}"
        cells = [fmt(row["engines"].get(e), spec) for e in engines]
        lines.append(f"| {kind} | {workload} | {row['metric']} | {dtype} | " + " | ".join(cells)
                     + f" | {fmt(row.get('ratio'), '{:.2f}x')} |")
        if rec not in used:
            used.append(rec)
    return lines + sources(used)


def peers_real_size(records: list[Record]) -> list[str]:
    """The real-size shapes (peers.py --model <shape>): each engine per workload and weight format,
    kvmosaic over llama.cpp, and each A / L run's share of the DRAM read roofline."""
    found = _real_size_records(records)
    if not found:
        return ["_No results recorded yet._"]
    lines = ["| host kind | model | workload | metric | weights | kvmosaic | llama.cpp | vLLM | kvmosaic / llama.cpp "
             "| roofline share: kvmosaic / llama.cpp |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    order = {w: i for i, w in enumerate("ABCLS")}
    for rec in found:
        shares = {(s["workload"], s["dtype"], s["engine"]): s["share"] for s in rec.data.get("roofline_shares", [])}
        model = rec.data["config"]["model"]
        kv = rec.data["config"].get("kv_cache_dtype", "auto")
        kv_note = "" if kv == "auto" else f" (kvmosaic KV {kv})"
        for row in sorted(rec.data["rows"], key=lambda r: (order.get(r["workload"], 9), r["dtype"])):
            eng = row["engines"]
            ours, theirs = eng.get("kvmosaic"), eng.get("llamacpp")
            spec = "{:.2f}" if row["workload"] == "S" else "{:.1f}"
            ratio = (theirs / ours if row["workload"] == "S" else ours / theirs) if ours and theirs else None
            share = [shares.get((row["workload"], row["dtype"], e)) for e in ("kvmosaic", "llamacpp")]
            share_cell = " / ".join(fmt(v, "{:.0%}") for v in share) if any(v is not None for v in share) else ""
            lines.append(f"| {rec.kind} | {model} | {row['workload']} | {row['metric']} | {row['dtype']}{kv_note} | "
                         f"{fmt(ours, spec)} | {fmt(theirs, spec)} | {fmt(eng.get('vllm'), spec)} | "
                         f"{fmt(ratio, '{:.2f}x')} | {share_cell} |")
    return lines + sources(found)



def _gb(value: float | None) -> float | None:
    return None if value is None else value / 1e9


def _real_size_records(records: list[Record]) -> list[Record]:
    return [r for r in records if r.data["bench"].startswith("peers-") and (r.data.get("config") or {}).get("model")]


def peers_real_size_memory(records: list[Record]) -> list[str]:
    """Each engine's highest peak RSS over a real-size record's runs of one weight format, against the
    weights' bytes plus its KV pool (the issue's allowance: 15% over those)."""
    found = _real_size_records(records)
    if not found:
        return ["_No results recorded yet._"]
    lines = ["| host kind | model | weights | engine | peak RSS GB | in workload | weights GB | KV pool GB "
             "| RSS / (weights + KV pool) |", "|---|---|---|---|---:|---|---:|---:|---:|"]
    for rec in found:
        peaks: dict[tuple[str, str], dict] = {}
        for res in [*rec.data.get("results", []), *rec.data.get("startup", [])]:
            if not res.get("peak_rss_bytes"):
                continue
            key = (res["dtype"], res["engine"])
            if key not in peaks or res["peak_rss_bytes"] > peaks[key]["peak_rss_bytes"]:
                peaks[key] = res
        for (dtype, engine), res in sorted(peaks.items()):
            weights, kv = res.get("weights_bytes"), res.get("kv_pool_bytes")
            budget = weights + kv if weights is not None and kv is not None else None
            share = res["peak_rss_bytes"] / budget if budget else None
            lines.append(f"| {rec.kind} | {rec.data['config']['model']} | {dtype} | {engine} | "
                         f"{fmt(_gb(res['peak_rss_bytes']), '{:.2f}')} | {res['workload']} | "
                         f"{fmt(_gb(weights), '{:.2f}')} | {fmt(_gb(kv), '{:.2f}')} | {fmt(share, '{:.2f}')} |")
    return lines + sources(found)

_DECODE_PROFILE = rows_table("qlinear-gguf", [("file", "file", "{}"), ("threads", "threads", "{}"),
                                               ("product kind", "kind", "{}"), ("N", "n", "{}"), ("K", "k", "{}"),
                                               ("per token", "per_token", "{}"),
                                               ("cold GB/s", "cold_gb_s", "{:.1f}"), ("hot GB/s", "hot_gb_s", "{:.1f}"),
                                               ("DRAM probe GB/s", "dram_gb_s", "{:.1f}"),
                                               ("ms per token (cold)", "ms_per_token", "{:.2f}")])


def decode_profile(records: list[Record]) -> list[str]:
    """The decode profile of each profiled file, its rows named by the file they read."""
    for r in select(records, "qlinear-gguf"):
        name = r.data["config"]["gguf"].rsplit("/", 1)[-1].removesuffix(".gguf")
        for row in r.data["rows"]:
            row.setdefault("file", name)
    return _DECODE_PROFILE(records)


TABLES: dict[str, Callable[[list[Record]], list[str]]] = {
    "peers-summary": peers_summary,
    "trees": rows_table("trees", [("case", "case", "{}"), ("old tok/s", "old_median", "{:.1f}"),
                                  ("new tok/s", "new_median", "{:.1f}"), ("new / old", "new_over_old", "{:.3f}")]),
    "install-time": rows_table("install_time", [("step", "step", "{}"), ("kernel level", "level", "{}"),
                                                ("seconds", "seconds", "{:.0f}"), ("cold caches", "cold", "{}")]),
    "peers-latest": peers_latest,
    "peers-real-size": peers_real_size,
    "peers-real-size-memory": peers_real_size_memory,
    "decode-profile": decode_profile,
    "level-agreement": rows_table("level_agreement", [("dtype", "dtype", "{}"), ("level", "level", "{}"),
                                                      ("against", "against", "{}"),
                                                      ("identical texts", "identical", "{}"),
                                                      ("of", "prompts", "{}"),
                                                      ("first differing token", "first_difference", "{}"),
                                                      ("max logprob gap before it", "max_logprob_gap", "{:.3f}")]),
    "throughput": rows_table("throughput", [("engine", "engine", "{}"), ("dtype", "dtype", "{}"),
                                            ("seconds", "seconds", "{:.2f}"), ("req/s", "requests_per_s", "{:.2f}"),
                                            ("output tok/s", "output_tokens_per_s", "{:.1f}")]),
    "linear": rows_table("linear", [("dtype", "dtype", "{}"), ("layer", "layer", "{}"), ("N", "n", "{}"),
                                    ("K", "k", "{}"), ("rows", "rows", "{}"),
                                    ("packed GFLOP/s", "packed_gflops", "{:.0f}"),
                                    ("packed / best of oneDNN, F.linear", "packed_over_best_other", "{:.2f}x")]),
    "team-barrier": rows_table("team_barrier", [("workload", "workload", "{}"), ("scheduler steps", "steps", "{}"),
                                                ("barrier", "barrier", "{}"), ("median tok/s", "median", "{:.1f}"),
                                                ("median ratio to OpenMP's", "ratio", "{:.3f}x")]),
    "multistep": rows_table("multistep", [("workload", "workload", "{}"), ("num_scheduler_steps", "steps", "{}"),
                                          ("median tok/s", "median", "{:.1f}"), ("best tok/s", "best", "{:.1f}"),
                                          ("median ratio to 1 pass", "ratio", "{:.3f}x")]),
    "structured": rows_table("structured", [("schema", "schema", "{}"), ("mode", "mode", "{}"),
                                            ("output tokens", "tokens", "{}"), ("engine steps", "steps", "{}"),
                                            ("tok/s", "tokens_per_s", "{:.1f}"),
                                            ("vs unconstrained", "vs_unconstrained", "{:.2f}x"),
                                            ("grammar share", "grammar_share", "{:.1%}")]),
    "speculative": rows_table("speculative", [("workload", "workload", "{}"), ("config", "config", "{}"),
                                              ("tok/s", "tokens_per_s", "{:.1f}"), ("speed-up", "speedup", "{:.2f}x"),
                                              ("acceptance", "acceptance", "{:.2f}"),
                                              ("tokens per verification", "mean_accepted_length", "{:.2f}")]),
    "ppl-oracle": rows_table("ppl_oracle", [("weights", "label", "{}"), ("GGUF matrices", "tensor_types", "{}"),
                                            ("kvmosaic loads as", "weight_format", "{}"),
                                            ("kvmosaic holds", "held", "{}"),
                                            ("kvmosaic PPL", "kvmosaic", "{:.4f}"),
                                            ("llama.cpp PPL", "llamacpp", "{:.4f}"),
                                            ("difference", "difference", "{:+.2%}")]),
    "quant-kl": rows_table("quant_kl", [("weights", "label", "{}"), ("kvmosaic holds", "held", "{}"),
                                        ("KL int8 act.", "int8.mean_kl", "{:.5f}"),
                                        ("KL float act.", "weights_only.mean_kl", "{:.5f}"),
                                        ("int8 adds", "activation_kl", "{:+.5f}"),
                                        ("llama.cpp KL", "llamacpp.mean_kl", "{:.5f}"),
                                        ("p99 KL int8 act.", "int8.p99_kl", "{:.4f}"),
                                        ("llama.cpp p99 KL", "llamacpp.p99_kl", "{:.4f}"),
                                        ("top-1 int8 act.", "int8.top1", "{:.2%}"),
                                        ("top-1 float act.", "weights_only.top1", "{:.2%}"),
                                        ("llama.cpp top-1", "llamacpp.top1", "{:.2%}")]),
    "disagg": rows_table("disagg", [("mode", "mode", "{}"), ("class", "class", "{}"),
                                    *pair("TTFT", "ttft_ms", "{:,.0f}"), *pair("TPOT", "tpot_ms", "{:.0f}"),
                                    *pair("ITL", "itl_ms", "{:,.0f}", ("p99", "max")),
                                    ("goodput req/s", "goodput_rps", "{:.2f}")]),
    "distkv-stream": rows_table("distkv_stream", [
        ("mode", "mode", "{}"), ("instances", "instances", "{}"), ("blocks each", "blocks_per_instance", "{}"),
        ("output tok/s", "output_tok_s", "{:.1f}"), ("long served", "completed_long", "{}"),
        ("rejected", "rejected", "{}"), ("longest context", "longest_context", "{:,}"), ("loans", "loans", "{}"),
        ("K/V pulls", "kv_pulls", "{:,}"), ("TPOT p99 alone ms", "short_alone.tpot_p99_ms", "{:.1f}"),
        ("TPOT p99 on a creditor ms", "short_on_creditor.tpot_p99_ms", "{:.1f}"),
        ("creditor p99 ratio", "creditor_tpot_p99_ratio", "{:.2f}x"),
        ("remote decode row ms", "lane_vs_local.lane_round_trip_ms", "{:.4f}"),
        ("same row locally ms", "lane_vs_local.local_kernel_ms", "{:.4f}"),
        ("remote / local", "lane_vs_local.ratio", "{:.2f}x")]),
    "kv-quality": rows_table("kv_quality", [("kv_cache_dtype", "mode", "{}"), ("perplexity", "perplexity", "{:.4f}"),
                                            ("cost %", "cost_pct", "{:+.2f}"),
                                            ("+- s.e. pts", "cost_stderr_pts", "{:.2f}"),
                                            ("KL nats/token", "mean_kl", "{:.5f}"), ("top-1 same", "top1", "{:.4f}"),
                                            ("bits/value", "bits_per_value", "{:.2f}")]),
    "kv-capacity": rows_table("kv_capacity", [("kv_cache_dtype", "mode", "{}"),
                                              ("bits/value", "bits_per_value", "{:.2f}"),
                                              ("blocks", "num_blocks", "{}"), ("max batch", "max_batch", "{}"),
                                              ("decode tok/s at max batch", "tok_s", "{:.1f}"),
                                              ("equal batch", "equal_batch", "{}"),
                                              ("decode tok/s at equal batch", "equal_tok_s", "{:.1f}"),
                                              ("preemptions", "preemptions", "{}")]),
    "serving": rows_table("serving", [("rate req/s", "request_rate", "{}"), ("requests", "completed", "{}"),
                                      ("errors", "errors", "{}"), ("req/s", "request_throughput", "{:.2f}"),
                                      ("out tok/s", "output_throughput", "{:.1f}"),
                                      *pair("TTFT", "ttft_ms", "{:.0f}"), *pair("TPOT", "tpot_ms", "{:.0f}"),
                                      *pair("E2E", "e2e_ms", "{:,.0f}")]),
    "serving-soak": rows_table("serving_soak", [
        ("requests", "completed", "{:,}"), ("errors", "errors", "{}"),
        ("KV blocks max", "soak.kv_blocks_used_max", "{:.0f}"),
        ("KV blocks after drain", "soak.kv_blocks_used_after_drain", "{:.0f}"),
        ("RSS after warm-up MiB", "soak.rss_after_warmup_mib", "{:.0f}"),
        ("RSS after drain MiB", "soak.rss_after_drain_mib", "{:.0f}"),
        ("growth after warm-up", "soak.rss_growth_after_warmup_pct", "{:+.1f}%"),
        ("MiB/min", "soak.rss_slope_mib_per_min", "{:.1f}"),
        *pair("TTFT", "ttft_ms", "{:.0f}", ("mean", "p99")), *pair("E2E", "e2e_ms", "{:.0f}", ("mean", "p99"))]),
}
