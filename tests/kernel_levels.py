"""The ISA levels the kernel tests run at: every level built on this host, or only the best one with
KVMOSAIC_TEST_LEVELS=best (``make test-fast``, the edit-test loop; ``make test`` and CI run them all)."""

from __future__ import annotations

import os

from kvmosaic.ops import available_levels


def levels_under_test() -> list[str]:
    levels = available_levels()
    return levels[:1] if os.environ.get("KVMOSAIC_TEST_LEVELS", "") == "best" else levels
