"""The soak part of benchmarks/serving.py: samples of the server's RSS and KV blocks while the load
runs (from /metrics, or psutil with the server's pid), and their growth after warm-up."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import numpy as np


def scrape(base_url: str, server_pid: int | None, headers: dict[str, str]) -> dict[str, float | None]:
    sample: dict[str, float | None] = {"time": time.monotonic(), "rss_bytes": None, "kv_blocks_used": None,
                                       "running": None}
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10, headers=headers).text
    except httpx.HTTPError:
        text = ""
    names = {"process_resident_memory_bytes": "rss_bytes", "kvmosaic_kv_blocks_used": "kv_blocks_used",
             "kvmosaic_num_requests_running": "running"}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            sample[names[name]] = float(value)
    if server_pid is not None:
        import psutil

        sample["rss_bytes"] = float(psutil.Process(server_pid).memory_info().rss)
    return sample


async def sample_until(stop: asyncio.Event, base_url: str, server_pid: int | None, headers: dict[str, str],
                       interval: float, samples: list[dict]) -> None:
    while not stop.is_set():
        samples.append(await asyncio.to_thread(scrape, base_url, server_pid, headers))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


def soak_report(samples: list[dict], after_drain: dict) -> dict:
    start = samples[0]["time"]
    rss = [(s["time"] - start, s["rss_bytes"]) for s in samples if s["rss_bytes"] is not None]
    blocks = [s["kv_blocks_used"] for s in samples if s["kv_blocks_used"] is not None]
    report = {"samples": len(samples), "series": [[round(s["time"] - start, 1), s["rss_bytes"], s["kv_blocks_used"],
                                                   s["running"]] for s in samples],
              "kv_blocks_used_max": max(blocks, default=None),
              "kv_blocks_used_after_drain": after_drain["kv_blocks_used"],
              "running_after_drain": after_drain["running"]}
    if len(rss) >= 4:
        warm = rss[len(rss) // 4 :]  # the first quarter is warm-up (allocator pools, caches)
        slope = np.polyfit([t for t, _ in warm], [v for _, v in warm], 1)[0] * 60 / 2**20
        report.update(rss_first_mib=rss[0][1] / 2**20, rss_after_warmup_mib=warm[0][1] / 2**20,
                      rss_max_mib=max(v for _, v in rss) / 2**20, rss_after_drain_mib=after_drain["rss_bytes"] / 2**20,
                      rss_growth_after_warmup_mib=(after_drain["rss_bytes"] - warm[0][1]) / 2**20,
                      rss_growth_after_warmup_pct=100 * (after_drain["rss_bytes"] / warm[0][1] - 1),
                      rss_slope_mib_per_min=float(slope))
    return report
