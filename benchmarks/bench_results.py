"""One results record per benchmark run: the output flag every benchmark script takes and the one
function that writes its JSON.

A record says where and how its numbers were measured: the host (CPU model, core count, ISA flags,
a short host-kind slug such as ``amd-zen5-avx512``), the kernel level kvmosaic ran, the UTC date,
the git commit (and whether the tree had uncommitted changes), the exact command line and the
kvmosaic version, then the benchmark's rows. Records land in ``benchmarks/results/<host-kind>/
<bench>.json`` unless ``--out`` names another file; ``scripts/render_docs.py`` renders the docs'
tables from the committed ones.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCHEMA = 1

# x86 extensions that decide which kernels run; the record keeps these rather than every /proc flag
ISA_FLAG_PREFIXES = ("sse", "ssse3", "avx", "fma", "f16c", "bmi", "amx", "vnni", "vpclmul", "gfni")

# AMD family 0x19 holds Zen 3 and Zen 4; these model ranges are Zen 4 (the rest of the family is Zen 3)
_ZEN4_MODELS = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))


class ResultsError(ValueError):
    """A record that cannot be written as asked (bad rows, bad bench name)."""


def add_output_arg(parser: argparse.ArgumentParser, bench: str) -> None:
    """The one output flag of every benchmark: ``--out PATH``."""
    parser.add_argument("--out", type=Path, default=None, metavar="PATH",
                        help=f"results JSON (default: benchmarks/results/<host-kind>/{bench}.json)")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def host_kind(vendor: str, family: int | None, model: int | None, flags: frozenset[str] | set[str],
              machine: str = "x86_64") -> str:
    """A short stable slug for the kind of CPU: ``amd-zen5-avx512``, ``amd-zen3-avx2``, ``intel-amx``,
    ``intel-avx512``; off x86 the machine name (``aarch64``)."""
    if "avx512f" in flags:
        width = "avx512"
    elif "avx2" in flags:
        width = "avx2"
    elif machine.lower() in ("x86_64", "amd64"):
        width = "x86-64"
    else:
        return machine.lower() or "unknown"
    if vendor == "AuthenticAMD":
        return f"amd-{_zen(family, model)}-{width}"
    if vendor == "GenuineIntel":
        return "intel-amx" if "amx_tile" in flags else f"intel-{width}"
    return f"x86-{width}"


def _zen(family: int | None, model: int | None) -> str:
    if family == 0x1A:
        return "zen5"
    if family == 0x19:
        return "zen4" if model is not None and any(model in r for r in _ZEN4_MODELS) else "zen3"
    if family == 0x17:
        return "zen2" if model is not None and model >= 0x30 else "zen1"
    return f"family{family}" if family is not None else "unknown"


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


@functools.cache
def host_info() -> dict:
    """The host fields of a record (the kernel level is asked for separately: it loads the kernels)."""
    info = _cpuinfo()
    flags = frozenset(info.get("flags", "").split())
    machine = platform.machine()
    model_name = info.get("model name") or _lscpu_model() or platform.processor() or machine
    return {
        "kind": host_kind(info.get("vendor_id", ""), _int(info.get("cpu family")), _int(info.get("model")), flags,
                          machine),
        "cpu_model": model_name,
        "vendor": info.get("vendor_id") or None,
        "cpu_family": _int(info.get("cpu family")),
        "cpu_model_number": _int(info.get("model")),
        "cores": os.cpu_count(),
        "machine": machine,
        "isa_flags": sorted(f for f in flags if f.startswith(ISA_FLAG_PREFIXES)),
        "isa_summary": _isa_summary(),
    }


def _lscpu_model() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return None


def _isa_summary() -> str | None:
    try:
        from kvmosaic.ops.cpu import isa_summary
    except ImportError:
        return None
    return isa_summary()


def kernel_level() -> str | None:
    """The kernel level kvmosaic loads on this host (None when no kernels are built)."""
    try:
        from kvmosaic.ops import Kernels

        return Kernels.load().level
    except Exception:  # noqa: BLE001 - a record is still worth writing without its kernel level
        return None


def git_state(root: Path = ROOT) -> dict:
    """The checkout's commit and whether it has uncommitted changes (None outside a git checkout)."""
    def run(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = run("rev-parse", "HEAD")
    status = run("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip() if commit else None, "dirty": bool(status.strip()) if status is not None else None}


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed from the repository root: ``python benchmarks/x.py --flag ...``."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        script = Path(argv[0])
        try:
            argv[0] = str(script.resolve().relative_to(ROOT))
        except ValueError:
            argv[0] = script.name
    return shlex.join(["python", *argv])


def kvmosaic_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("kvmosaic")
    except Exception:  # noqa: BLE001 - not installed: fall back to the package attribute
        try:
            import kvmosaic

            return kvmosaic.__version__
        except ImportError:
            return None


def default_path(bench: str, kind: str | None = None) -> Path:
    return RESULTS / (kind or host_info()["kind"]) / f"{bench}.json"


def build_record(bench: str, rows: list[dict], *, config: dict | None = None, extra: dict | None = None,
                 isa_level: str | None = None, argv: list[str] | None = None) -> dict:
    """The record of one run: host, kernel level, date, commit, command, version, config and rows."""
    if not bench or not bench.replace("_", "").replace("-", "").isalnum():
        raise ResultsError(f"bench name {bench!r} must be letters, digits, '-' or '_'")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ResultsError(f"rows of {bench} must be a list of dicts, got {type(rows).__name__}")
    record = {
        "schema": SCHEMA,
        "bench": bench,
        "provenance": "measured",
        "host": host_info(),
        "isa_level": isa_level if isa_level is not None else kernel_level(),
        "date": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "git": git_state(),
        "command": command_line(argv),
        "kvmosaic_version": kvmosaic_version(),
        "config": _jsonable(config or {}),
        "rows": rows,
    }
    for key, value in (extra or {}).items():
        if key in record:
            raise ResultsError(f"extra field {key!r} would overwrite the record's own field")
        record[key] = value
    return record


def _jsonable(config: dict) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in config.items()}


def write_record(bench: str, rows: list[dict], *, out: Path | str | None = None, config: dict | None = None,
                 extra: dict | None = None, isa_level: str | None = None, argv: list[str] | None = None) -> Path:
    """Write one run's record to ``out`` (default ``benchmarks/results/<host-kind>/<bench>.json``) and
    return the path. ``config`` is the run's settings (e.g. ``vars(args)``), ``extra`` any further
    top-level fields (raw series, skipped peers)."""
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if k != "out"}
    record = build_record(bench, rows, config=config, extra=extra, isa_level=isa_level, argv=argv)
    path = Path(out) if out is not None else default_path(bench, record["host"]["kind"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return path
