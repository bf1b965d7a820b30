"""The Ray runtime the distributed engines run on: joined or started once, and a wait for a
cluster-wide condition (used by tests and tools)."""

from __future__ import annotations

import logging
import time

import ray


def ensure_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Join ``address`` (a Ray cluster) or start a local runtime, unless Ray is already up.
    Returns whether this call initialised Ray (then the caller shuts it down)."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    return True


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
