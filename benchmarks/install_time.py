"""From a fresh clone to a healthy server: the time `make run` takes (virtualenv, pinned packages, the
default model, the best kernel level this CPU runs, the server answering /health), then the time one
more kernel level takes to build.

    python benchmarks/install_time.py [--extra-level avx2] [--port 8000] [--cold]

It clones this checkout's HEAD into a temporary directory, so only committed work is measured, and
runs the clone's own Makefile. ``--cold`` turns pip's and uv's download caches off for the run.
Needs nothing else on the port and should run alone (it compiles on every core).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_results import ROOT, add_output_arg, write_record


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def time_make_run(clone: Path, port: int, env: dict, timeout: float) -> float:
    """Seconds from `make run` to a 200 from /health; the server is stopped afterwards."""
    if healthy(port):
        raise SystemExit(f"something already answers on port {port}")
    start = time.monotonic()
    log = open(clone / "make-run.log", "w")  # noqa: SIM115  (closed below, after the process)
    proc = subprocess.Popen(["make", "run"], cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        while not healthy(port):
            if proc.poll() is not None:
                raise SystemExit(f"make run exited with {proc.returncode}; see {clone / 'make-run.log'}")
            if time.monotonic() - start > timeout:
                raise SystemExit(f"no healthy server after {timeout:.0f} s")
            time.sleep(0.5)
        return time.monotonic() - start
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def time_extra_level(clone: Path, level: str, env: dict) -> float:
    start = time.monotonic()
    subprocess.run([str(clone / ".venv" / "bin" / "python"), "-m", "kvmosaic.ops.build", "--levels", level],
                   cwd=clone, env=env, check=True, capture_output=True)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extra-level", default="avx2", help="the level built after the server is up")
    parser.add_argument("--port", type=int, default=8000, help="the port `make run` serves on")
    parser.add_argument("--cold", action="store_true", help="no pip / uv download caches")
    parser.add_argument("--timeout", type=float, default=1800)
    add_output_arg(parser, "install_time")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    if args.cold:
        env.update(PIP_NO_CACHE_DIR="1", UV_NO_CACHE="1")
    with tempfile.TemporaryDirectory(prefix="kvmosaic-install-") as tmp:
        clone = Path(tmp) / "kvmosaic"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        run_s = time_make_run(clone, args.port, env, args.timeout)
        best = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c",
                               "from kvmosaic.ops import Kernels; print(Kernels.load().level)"],
                              cwd=clone, env=env, capture_output=True, text=True).stdout.strip()
        extra_s = time_extra_level(clone, args.extra_level, env)
    rows = [{"step": "make run to a healthy server", "level": best, "seconds": round(run_s, 1), "cold": args.cold},
            {"step": "one more kernel level", "level": args.extra_level, "seconds": round(extra_s, 1),
             "cold": args.cold}]
    print("| step | kernel level | seconds |\n|---|---|---:|")
    for row in rows:
        print(f"| {row['step']} | {row['level']} | {row['seconds']:.0f} |")
    write_record("install_time", rows, out=args.out, config=vars(args))


if __name__ == "__main__":
    sys.exit(main())
