"""Compile the C++ kernels for every ISA level this machine needs: `python -m kvmosaic.ops.build` (idempotent).

`--levels avx2,portable` builds only those; `-v` shows the compiler commands.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from kvmosaic.ops import BUILD_DIR, CFLAGS, INCLUDE_DIRS, extension_sources, level_dir, levels_to_build, module_name
from kvmosaic.ops.levels import BY_NAME, Level


def build_level(level: Level, verbose: bool = False) -> bool:
    from torch.utils.cpp_extension import load

    out = level_dir(level)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lock").unlink(missing_ok=True)  # left by an interrupted build, it would make this one wait forever
    for extension, sources in extension_sources().items():
        try:
            load(name=module_name(extension, level), sources=[str(source) for source in sources],
                 extra_cflags=[*CFLAGS, *level.cflags], extra_ldflags=["-fopenmp"], build_directory=str(out),
                 extra_include_paths=[str(d) for d in INCLUDE_DIRS],
                 verbose=verbose)
        except Exception as exc:  # a missing compiler must not break installation: the PyTorch path still works
            print(f"kvmosaic: C++ kernels {extension} ({level.name}) not built ({exc})", file=sys.stderr)
            return False
    # ninja relinks only what a changed source or header reaches; the load-time staleness check
    # compares with every header, so mark the libraries current once ninja says they are
    for library in out.glob("*.so"):
        library.touch()
    print(f"kvmosaic: C++ kernels ({level.name}) built in {out}")
    return True


def build(levels: list[Level] | None = None, verbose: bool = False) -> bool:
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    for stale in BUILD_DIR.glob("*.so"):  # single-level builds of older versions
        stale.unlink()
    shutil.rmtree(BUILD_DIR / ".ninja_deps", ignore_errors=True)
    results = [build_level(level, verbose) for level in (levels or levels_to_build())]
    if not any(results):
        print("kvmosaic: no C++ kernels built; using the PyTorch reference path", file=sys.stderr)
    return all(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--levels", help=f"comma-separated, from {', '.join(BY_NAME)} (default: this host's)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    levels = [BY_NAME[name] for name in args.levels.split(",")] if args.levels else None
    return 0 if build(levels, args.verbose) else 1


if __name__ == "__main__":
    sys.exit(main())
