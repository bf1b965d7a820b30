"""Kernel sources compile without the PyTorch headers: only the binding files (ops/csrc/bind/) include
them, so a kernel translation unit costs its own code, not the ~16 s of torch/extension.h. Checked with
the preprocessor's dependency listing and no torch include path: a kernel file that still reaches a
PyTorch header fails to preprocess ("torch/extension.h: No such file")."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "kvmosaic" / "ops" / "csrc"
NATIVE = ROOT / "kvmosaic" / "distributed" / "native"
TORCH_HEADERS = ("torch/", "ATen/", "c10/")

def kernel_sources() -> list[str]:
    """Every .cpp of ops/csrc but the binding files, and the decode lane's native sources."""
    sources = [p for p in CSRC.rglob("*.cpp") if "bind" not in p.relative_to(CSRC).parts]
    return sorted(str(p.relative_to(ROOT)) for p in (*sources, *NATIVE.glob("*.cpp")))


def test_the_sources_are_found():
    sources = kernel_sources()
    assert "kvmosaic/ops/csrc/linear/gemm.cpp" in sources
    assert not any("/bind/" in source for source in sources)
    assert "kvmosaic/distributed/native/lane_server.cpp" in sources


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this host")
@pytest.mark.parametrize("source", kernel_sources())
def test_kernel_source_preprocesses_without_the_pytorch_headers(source):
    listing = subprocess.run(["g++", "-std=c++20", "-M", "-I", str(CSRC), "-I", str(NATIVE), str(ROOT / source)],
                             capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr[-2000:]
    headers = listing.stdout.replace("\\\n", " ").split()
    reached = [h for h in headers if any(mark in h for mark in TORCH_HEADERS)]
    assert not reached, f"{source} includes PyTorch headers: {reached[:5]}"
