"""Kernel levels on first use and the build driver, against a scratch build directory: the builder and
the library import are stand-ins, so nothing is compiled here."""

import logging
import os
import types
from pathlib import Path

import pytest

import kvmosaic.ops as ops
from kvmosaic.ops import Kernels, build, sources
from kvmosaic.ops.levels import BY_NAME, ISA_ENV, runnable_levels


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """An empty build directory, a builder that records its calls and writes the libraries it is told
    to (as a build that compiles would), and an import that returns a stand-in module."""
    monkeypatch.setattr(sources, "BUILD_DIR", tmp_path)
    monkeypatch.delenv(ISA_ENV, raising=False)
    monkeypatch.delenv("KVMOSAIC_DISABLE_OPS", raising=False)
    monkeypatch.delenv(ops.BUILD_ON_USE_ENV, raising=False)
    calls: list[list[str]] = []
    state = types.SimpleNamespace(calls=calls, succeed=True)

    def fake_build(levels=None, verbose=False):
        calls.append([level.name for level in levels])
        if state.succeed:
            for level in levels:
                write_libraries(tmp_path, level.name)
        return state.succeed

    monkeypatch.setattr(build, "build", fake_build)
    monkeypatch.setattr(ops, "_import", lambda name, library: types.ModuleType(name))
    ops._load.cache_clear()
    ops._warn_once.cache_clear()
    yield state
    ops._load.cache_clear()
    ops._warn_once.cache_clear()


def write_libraries(directory: Path, level: str) -> None:
    (directory / level).mkdir(parents=True, exist_ok=True)
    for extension in (ops.NAME, ops.QUANT_NAME):
        (directory / level / f"{extension}_{level}.so").write_bytes(b"")


def test_a_named_level_that_is_not_built_is_built_on_first_use(scratch, caplog):
    with caplog.at_level(logging.WARNING, logger="kvmosaic.ops"):
        kernels = Kernels.load("portable")
    assert scratch.calls == [["portable"]]
    assert kernels.level == "portable" and kernels.ops.__name__ == "kvmosaic_ops_portable"
    assert kernels.quant.__name__ == "kvmosaic_kvquant_portable"
    assert "building the C++ kernels for portable" in caplog.text
    Kernels.load("portable")
    assert scratch.calls == [["portable"]]  # built once


def test_the_level_of_the_environment_is_built_on_first_use_too(scratch, monkeypatch):
    monkeypatch.setenv(ISA_ENV, "portable")
    assert Kernels.load().level == "portable"
    assert scratch.calls == [["portable"]]


def test_a_failed_build_names_the_level_and_the_command(scratch):
    scratch.succeed = False
    with pytest.raises(ValueError, match=r"portable kernels .*python -m kvmosaic.ops.build --levels portable"):
        Kernels.load("portable")
    assert scratch.calls == [["portable"]]


def test_a_build_directory_that_cannot_be_written_is_a_clear_error(scratch, monkeypatch):
    def read_only(levels=None, verbose=False):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(build, "build", read_only)
    with pytest.raises(ValueError, match=r"portable kernels are not built and building them failed"):
        Kernels.load("portable")


def test_building_on_use_can_be_turned_off(scratch, monkeypatch):
    monkeypatch.setenv(ops.BUILD_ON_USE_ENV, "0")
    with pytest.raises(ValueError, match=r"portable kernels are not built .*--levels portable"):
        Kernels.load("portable")
    assert scratch.calls == []


def test_a_built_level_loads_without_building(scratch, tmp_path):
    write_libraries(tmp_path, "portable")
    assert Kernels.load("portable").level == "portable"
    assert scratch.calls == []


def test_a_library_older_than_its_sources_is_rebuilt(scratch, tmp_path):
    write_libraries(tmp_path, "portable")
    for library in (tmp_path / "portable").glob("*.so"):
        os.utime(library, (0, 0))
    assert Kernels.load("portable").level == "portable"
    assert scratch.calls == [["portable"]]


@pytest.mark.skipif(len(runnable_levels()) < 2, reason="this CPU runs only the portable level")
def test_the_default_warns_when_the_best_level_is_not_built(scratch, tmp_path, caplog):
    write_libraries(tmp_path, "portable")
    best = runnable_levels()[0].name
    with caplog.at_level(logging.WARNING, logger="kvmosaic.ops"):
        kernels = Kernels.load()
    assert kernels.level == "portable" and scratch.calls == []  # the default never compiles
    assert f"the {best} kernels (the best this CPU runs) are not built" in caplog.text
    assert f"--levels {best}" in caplog.text


def test_the_default_warns_when_nothing_is_built(scratch, caplog):
    with caplog.at_level(logging.WARNING, logger="kvmosaic.ops"):
        assert Kernels.load() == Kernels.reference()
    assert "no C++ kernels are built" in caplog.text and scratch.calls == []


def test_the_default_is_quiet_when_the_best_level_is_built(scratch, tmp_path, caplog):
    write_libraries(tmp_path, runnable_levels()[0].name)
    with caplog.at_level(logging.WARNING, logger="kvmosaic.ops"):
        assert Kernels.load().level == runnable_levels()[0].name
    assert caplog.text == ""


def test_level_specs_of_the_build_command():
    assert build.parse_levels("best") == runnable_levels()[:1]
    assert build.parse_levels("all") == runnable_levels() == build.parse_levels(None)
    assert build.parse_levels("avx2,portable") == [BY_NAME["avx2"], BY_NAME["portable"]]
    with pytest.raises(ValueError, match="unknown kernel level sse9"):
        build.parse_levels("portable,sse9")


def test_the_ninja_file_compiles_each_source_once_per_level_and_names_only_the_bindings(monkeypatch):
    monkeypatch.setattr(build, "torch_flags", lambda: (["-isystem /torch"], ["-L/torch/lib", "-ltorch"]))
    text = build.ninja_file([BY_NAME["avx2"], BY_NAME["portable"]], "c++")
    compiles = [line for line in text.splitlines() if line.startswith("build ") and ": cxx " in line]
    sources = {source for extension in ops.extension_sources().values() for source in extension}
    assert len(compiles) == 2 * len(sources)  # the decode lane's sources serve both extensions, compiled once
    assert "build avx2/ops/csrc/kvquant/kvquant_encode.o: cxx " in text
    assert text.count("-DTORCH_EXTENSION_NAME=") == 4  # the two binding files, at each level
    assert "-DTORCH_EXTENSION_NAME=kvmosaic_kvquant_portable" in text
    assert "build avx2/kvmosaic_ops_avx2.so: link " in text and "build kernels_portable: phony " in text
    assert "-MMD" in text and "deps = gcc" in text
    assert " ".join(BY_NAME["avx2"].cflags) in text


def test_a_missing_compiler_is_a_message_not_a_crash(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sources, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(build, "compiler", lambda: None)
    assert build.main(["--levels", "portable"]) == 1
    assert "C++ kernels not built: no C++ compiler" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
