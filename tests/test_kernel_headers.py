"""Kernel sources compile without the PyTorch headers: only the binding files (ops/csrc/bind/) include
them, so a kernel translation unit costs its own code, not the ~16 s of torch/extension.h. Checked with
the preprocessor's dependency listing and no torch include path: a kernel file that still reaches a
PyTorch header fails to preprocess ("torch/extension.h: No such file")."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "kvmosaic" / "ops" / "csrc"
NATIVE = ROOT / "kvmosaic" / "distributed" / "native"
TORCH_HEADERS = ("torch/", "ATen/", "c10/")

# Kernel files whose conversion is still under way (the decode team, the quantized-KV kernels and the
# decode lane's transport). strict: a listed file that passes fails the test, to be taken off the list.
NOT_YET = {
    "kvmosaic/ops/csrc/team/decode_passes.cpp",
    "kvmosaic/ops/csrc/team/decode_team.cpp",
    "kvmosaic/ops/csrc/team/decoder_step.cpp",
    "kvmosaic/ops/csrc/kvquant/kvquant_decode.cpp",
    "kvmosaic/ops/csrc/kvquant/kvquant_decode_fast.cpp",
    "kvmosaic/ops/csrc/kvquant/kvquant_encode.cpp",
    "kvmosaic/distributed/native/float_lane_pool.cpp",
    "kvmosaic/distributed/native/kvquant_lane.cpp",
    "kvmosaic/distributed/native/lane_client.cpp",
    "kvmosaic/distributed/native/lane_server.cpp",
    "kvmosaic/distributed/native/lane_transport.cpp",
}


def kernel_sources() -> list[str]:
    """Every .cpp of ops/csrc but the binding files, and the decode lane's native sources."""
    sources = [p for p in CSRC.rglob("*.cpp") if "bind" not in p.relative_to(CSRC).parts]
    return sorted(str(p.relative_to(ROOT)) for p in (*sources, *NATIVE.glob("*.cpp")))


def _param(source: str):
    if source in NOT_YET:
        return pytest.param(source, marks=pytest.mark.xfail(strict=True, reason="not converted yet"))
    return source


def test_the_sources_are_found_and_the_not_yet_list_names_real_files():
    sources = kernel_sources()
    assert "kvmosaic/ops/csrc/linear/gemm.cpp" in sources
    assert not any("/bind/" in source for source in sources)
    assert set(sources) >= NOT_YET, sorted(NOT_YET - set(sources))


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this host")
@pytest.mark.parametrize("source", [_param(source) for source in kernel_sources()])
def test_kernel_source_preprocesses_without_the_pytorch_headers(source):
    listing = subprocess.run(["g++", "-std=c++20", "-M", "-I", str(CSRC), "-I", str(NATIVE), str(ROOT / source)],
                             capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr[-2000:]
    headers = listing.stdout.replace("\\\n", " ").split()
    reached = [h for h in headers if any(mark in h for mark in TORCH_HEADERS)]
    assert not reached, f"{source} includes PyTorch headers: {reached[:5]}"
