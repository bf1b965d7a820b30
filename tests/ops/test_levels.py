"""ISA levels of the C++ kernels: which are built, which this CPU runs, and forcing one."""

import pytest

from kvmosaic.ops import Kernels, available_levels
from kvmosaic.ops.levels import BY_NAME, ISA_ENV, LEVELS, levels_to_build, resolve_level, runnable_levels


def test_levels_run_best_first_and_always_end_portable():
    runnable = runnable_levels()
    assert runnable[-1].name == "portable"
    order = [level.name for level in LEVELS]
    assert [level.name for level in runnable] == [name for name in order if BY_NAME[name] in runnable]
    # a level's needs include those of every lower level of its family; AVX2+VNNI ranks below the
    # AVX-512 levels without sharing their needs (a CPU with both, e.g. Zen 5, lists all of them)
    for better, worse in zip(runnable, runnable[1:]):
        assert worse.needs <= better.needs or (better.name.startswith("avx512") and worse.name == "avx2_vnni")
    assert all(BY_NAME["avx2"].needs <= level.needs for level in runnable if level.name != "portable")


def test_install_builds_every_level_the_cpu_runs():
    built = [level.name for level in levels_to_build()]
    assert built == [level.name for level in runnable_levels()] and built[-1] == "portable"
    assert ("avx2" in built) == BY_NAME["avx2"].runs_here()


def test_forcing_a_level_checks_the_name_and_the_cpu(monkeypatch):
    with pytest.raises(ValueError, match="unknown kernel level"):
        resolve_level("sse9")
    assert resolve_level("portable").name == "portable"
    monkeypatch.setenv(ISA_ENV, "portable")
    assert resolve_level(None).name == "portable"
    missing = [level for level in LEVELS if not level.runs_here()]
    for level in missing:
        with pytest.raises(ValueError, match="cannot run"):
            resolve_level(level.name)


@pytest.mark.skipif(not available_levels(), reason="C++ kernels not built (python -m kvmosaic.ops.build)")
def test_every_available_level_loads_its_own_build(monkeypatch):
    assert available_levels()[0] == Kernels.load().level
    for name in available_levels():
        kernels = Kernels.load(name)
        assert kernels.level == name and kernels.ops.__name__.endswith(name)
    monkeypatch.setenv(ISA_ENV, available_levels()[-1])
    assert Kernels.load().level == available_levels()[-1]
    monkeypatch.setenv("KVMOSAIC_DISABLE_OPS", "1")
    assert Kernels.load() == Kernels.reference()
