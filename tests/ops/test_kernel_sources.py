"""What the C++ sources include: the kernels never reach a socket header, and the decode lane's headers
and the quantized-KV entry points never reach a PyTorch one (only the binding files do)."""

import re
from pathlib import Path

import pytest

from kvmosaic.ops.sources import CSRC, NATIVE

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)
NETWORK = ("sys/socket.h", "sys/un.h", "sys/uio.h", "netinet/", "arpa/", "poll.h", "linux/futex.h")
TORCH = ("torch/", "ATen/", "c10/")


def system_includes(source: Path) -> set[str]:
    """The <...> headers source reaches through its "..." includes (resolved in csrc/ and native/)."""
    seen: set[Path] = set()
    found: set[str] = set()
    pending = [source]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for kind, name in INCLUDE.findall(path.read_text()):
            if kind == "<":
                found.add(name)
                continue
            local = [root / name for root in (path.parent, CSRC, NATIVE) if (root / name).exists()]
            assert local, f"{path.name} includes {name}, which is in neither csrc/ nor native/"
            pending.append(local[0])
    return found


def test_the_walk_sees_through_local_includes():
    assert "sys/socket.h" in system_includes(NATIVE / "lane_server.cpp")  # through no header: directly
    assert "atomic" in system_includes(CSRC / "bind" / "lane_bind.h")  # through lane_server.h


@pytest.mark.parametrize("source", sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h")),
                         ids=lambda p: str(p.relative_to(CSRC)))
def test_no_kernel_source_reaches_a_network_header(source):
    assert not [name for name in system_includes(source) if name.startswith(NETWORK)]


@pytest.mark.parametrize("header", ["lane_server.h", "lane_client.h", "lane_pool.h", "lane_auth.h", "hmac_sha256.h"])
def test_the_lane_headers_the_bindings_include_reach_no_pytorch_header(header):
    assert not [name for name in system_includes(NATIVE / header) if name.startswith(TORCH)]


def test_the_quantized_kv_entry_points_and_their_lane_pool_reach_no_pytorch_header():
    for source in (CSRC / "kvquant" / "kvquant.h", NATIVE / "kvquant_lane.cpp", NATIVE / "float_lane_pool.cpp"):
        assert not [name for name in system_includes(source) if name.startswith(TORCH)], source.name
    for source in (CSRC / "kvquant").glob("*.cpp"):
        direct = [name for kind, name in INCLUDE.findall(source.read_text()) if kind == "<"]
        assert not [name for name in direct if name.startswith(TORCH)], source.name
