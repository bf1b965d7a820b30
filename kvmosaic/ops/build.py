"""Compile the C++ kernels: `python -m kvmosaic.ops.build` (idempotent)."""

from __future__ import annotations

import shutil
import sys

from kvmosaic.ops import BUILD_DIR, CFLAGS, EXTENSIONS


def build(verbose: bool = False) -> bool:
    from torch.utils.cpp_extension import load

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    for name, sources in EXTENSIONS:
        try:
            load(name=name, sources=[str(source) for source in sources], extra_cflags=CFLAGS,
                 extra_ldflags=["-fopenmp"], build_directory=str(BUILD_DIR), verbose=verbose)
        except Exception as exc:  # a missing compiler must not break installation: the PyTorch path still works
            print(f"kvmosaic: C++ kernels {name} not built ({exc}); using the PyTorch reference path",
                  file=sys.stderr)
            return False
    for junk in BUILD_DIR.glob("*.o"):
        junk.unlink()
    shutil.rmtree(BUILD_DIR / ".ninja_deps", ignore_errors=True)
    print(f"kvmosaic: C++ kernels built in {BUILD_DIR}")
    return True


if __name__ == "__main__":
    sys.exit(0 if build(verbose="-v" in sys.argv) else 1)
