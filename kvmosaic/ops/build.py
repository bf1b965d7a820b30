"""Compile the C++ kernels: `python -m kvmosaic.ops.build [--levels a,b | best | all] [-v]` (idempotent).

One ninja file builds both extensions for every level asked for (default: every level this CPU runs;
``best``: only the best one), each translation unit once per level, with the level's flags; the
objects go to ``_build/<level>/`` and each extension to ``_build/<level>/<extension>_<level>.so``.
Dependency files make a rebuild recompile only what a changed source or header reaches. ``-v``
shows the compiler commands.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvmosaic.ops import sources as layout
from kvmosaic.ops.levels import BY_NAME, Level, levels_to_build, runnable_levels

PACKAGE = Path(layout.__file__).parent.parent  # kvmosaic/: object paths are relative to it
BINDINGS = {layout.NAME: "kvmosaic_ops.cpp", layout.QUANT_NAME: "kvquant_ops.cpp"}  # in csrc/bind/


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def ninja_binary() -> str | None:
    try:
        import ninja  # the pip package: a dependency

        path = Path(ninja.BIN_DIR) / "ninja"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which("ninja")


def torch_flags() -> tuple[list[str], list[str]]:
    """The include and link flags of an extension of this PyTorch, as torch.utils.cpp_extension.load uses."""
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [*include_paths(), sysconfig.get_path("include", scheme="posix_prefix")]
    cflags = [f"-isystem {shlex.quote(path)}" for path in includes]
    ldflags = [f"-L{shlex.quote(path)}" for path in library_paths()]
    return cflags, [*ldflags, "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def _path(path: Path | str) -> str:
    """A path as ninja reads it in a build statement."""
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _object(level: Level, source: Path) -> str:
    return _path(f"{level.name}/{source.relative_to(PACKAGE).with_suffix('.o')}")


def _library(extension: str, level: Level) -> str:
    return f"{level.name}/{layout.module_name(extension, level)}.so"


def _target(level: Level) -> str:
    return f"kernels_{level.name}"


def ninja_file(levels: list[Level], cxx: str) -> str:
    """build.ninja for both extensions at these levels: one compile per source and level (a source in
    both extensions, the decode lane's, is compiled once), one link per extension and level."""
    include_flags, link_flags = torch_flags()
    cflags = [*(f"-I{shlex.quote(str(d))}" for d in layout.INCLUDE_DIRS), *include_flags, "-fPIC", "-std=c++20",
              *layout.CFLAGS]
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {shlex.quote(cxx)}",
        f"cflags = {' '.join(cflags)}",
        f"ldflags = -shared -fopenmp {' '.join(link_flags)}",
        "",
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $cflags $level_flags $defines -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = $level $source",
        "",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
        "  description = $level link $out",
        "",
    ]
    for level in levels:
        level_flags = " ".join(level.cflags)
        compiled: set[Path] = set()
        for extension, sources in layout.extension_sources().items():
            for source in sources:
                if source in compiled:
                    continue
                compiled.add(source)
                defines = ""
                if source.name == BINDINGS[extension] and source.parent.name == "bind":
                    module = layout.module_name(extension, level)
                    defines = f"-DTORCH_EXTENSION_NAME={module} -DTORCH_API_INCLUDE_EXTENSION_H"
                lines += [f"build {_object(level, source)}: cxx {_path(source)}",
                          f"  level = {level.name}",
                          f"  source = {source.relative_to(PACKAGE)}",
                          f"  level_flags = {level_flags}",
                          f"  defines = {defines}"]
            objects = " ".join(_object(level, source) for source in sources)
            lines += [f"build {_library(extension, level)}: link {objects}", f"  level = {level.name}"]
        libraries = " ".join(_library(extension, level) for extension in BINDINGS)
        lines += [f"build {_target(level)}: phony {libraries}", ""]
    return "\n".join(lines) + "\n"


@contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One build at a time in a build directory (processes that load a level on first use may race)."""
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run_ninja(ninja: str, directory: Path, targets: list[str], verbose: bool) -> None:
    env = {**os.environ, "NINJA_STATUS": "kvmosaic kernels [%f/%t] "}
    command = [ninja, "-C", str(directory), "-k", "0", *(["-v"] if verbose else [])]
    if os.environ.get("MAX_JOBS"):
        command += ["-j", os.environ["MAX_JOBS"]]
    subprocess.run([*command, *targets], env=env, check=False)


def _up_to_date(ninja: str, directory: Path, target: str) -> bool:
    dry = subprocess.run([ninja, "-C", str(directory), "-n", target], capture_output=True, text=True, check=False)
    return dry.returncode == 0 and "no work to do" in dry.stdout


def build(levels: list[Level] | None = None, verbose: bool = False) -> bool:
    """Builds these levels (default: every level this CPU runs); True when every one is built. A failed
    compile prints its errors; the levels that did build stay usable."""
    levels = levels or levels_to_build()
    cxx, ninja = compiler(), ninja_binary()
    if cxx is None or ninja is None:
        missing = "C++ compiler (set CXX, or install g++)" if cxx is None else "ninja (pip install ninja)"
        print(f"kvmosaic: C++ kernels not built: no {missing}; the PyTorch reference path still runs",
              file=sys.stderr)
        return False
    directory = layout.BUILD_DIR
    directory.mkdir(parents=True, exist_ok=True)
    names = ", ".join(level.name for level in levels)
    with _build_lock(directory):
        (directory / "build.ninja").write_text(ninja_file(levels, cxx))
        print(f"kvmosaic: building the C++ kernels for {names} in {directory}", flush=True)
        _run_ninja(ninja, directory, [_target(level) for level in levels], verbose)
        built = [level for level in levels if _up_to_date(ninja, directory, _target(level))]
        # the loader refuses a library older than any header; ninja relinks only what a change reaches
        for level in built:
            for extension in BINDINGS:
                (directory / _library(extension, level)).touch()
    failed = [level.name for level in levels if level not in built]
    if failed:
        print(f"kvmosaic: C++ kernels not built for {', '.join(failed)} (errors above)", file=sys.stderr)
    if built:
        print(f"kvmosaic: C++ kernels built for {', '.join(level.name for level in built)}")
    return not failed


def parse_levels(spec: str | None) -> list[Level]:
    """``best``, ``all`` or comma-separated level names; None (no --levels): ``all``, every level this CPU runs."""
    if spec is None or spec == "all":
        return levels_to_build()
    if spec == "best":
        return runnable_levels()[:1]
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in BY_NAME]
    if unknown or not names:
        bad = ", ".join(unknown) if unknown else repr(spec)
        raise ValueError(f"unknown kernel level {bad}; choose from best, all, {', '.join(BY_NAME)}")
    return [BY_NAME[name] for name in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", help=f"best, all (default), or comma-separated from {', '.join(BY_NAME)}")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    try:
        levels = parse_levels(args.levels)
    except ValueError as exc:
        parser.error(str(exc))
    return 0 if build(levels, args.verbose) else 1


if __name__ == "__main__":
    sys.exit(main())
