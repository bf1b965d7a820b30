"""The benchmarks' shared results helper (benchmarks/bench_results.py): the record's fields, where it is
written, the host-kind slug, and the one output flag."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_results  # noqa: E402

FIELDS = ("schema", "bench", "provenance", "host", "isa_level", "date", "git", "command", "kvmosaic_version", "config",
          "rows")


def test_record_written_where_asked_with_every_field(tmp_path):
    out = tmp_path / "sub" / "probe.json"
    rows = [{"case": "A", "tok_s": 12.5}, {"case": "B", "tok_s": 30.0}]
    path = bench_results.write_record("probe", rows, out=out, config={"rounds": 3, "out": out, "model": Path("m")},
                                      extra={"note": "x"}, isa_level="portable",
                                      argv=["benchmarks/probe.py", "--rounds", "3"])
    assert path == out and out.is_file()
    record = json.loads(out.read_text())
    assert all(key in record for key in FIELDS)
    assert record["bench"] == "probe" and record["rows"] == rows and record["note"] == "x"
    assert record["provenance"] == "measured" and record["isa_level"] == "portable"
    assert record["config"] == {"rounds": 3, "model": "m"}  # the output path is not a setting; paths become text
    assert record["command"] == "python benchmarks/probe.py --rounds 3"
    host = record["host"]
    for key in ("kind", "cpu_model", "cores", "isa_flags", "isa_summary"):
        assert key in host
    assert host["cores"] >= 1 and isinstance(host["isa_flags"], list)
    assert dt.datetime.fromisoformat(record["date"].replace("Z", "+00:00")).tzinfo is not None
    assert set(record["git"]) == {"commit", "dirty"}
    assert record["git"]["commit"] is None or len(record["git"]["commit"]) == 40
    assert record["kvmosaic_version"]


def test_default_path_is_under_the_host_kind(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_results, "RESULTS", tmp_path)
    path = bench_results.write_record("probe", [], isa_level="portable", argv=["x.py"])
    assert path == tmp_path / bench_results.host_info()["kind"] / "probe.json"
    assert json.loads(path.read_text())["rows"] == []


def test_command_outside_the_repo_keeps_only_the_script_name():
    assert bench_results.command_line(["/elsewhere/tool.py", "--a", "b c"]) == "python tool.py --a 'b c'"


@pytest.mark.parametrize("bad", [{"rows": "not a list"}, {"rows": [1, 2]}, {"bench": "../x"}, {"bench": ""},
                                 {"extra": {"rows": []}}])
def test_bad_input_is_a_typed_error(tmp_path, bad):
    kwargs = {"bench": "probe", "rows": [], **bad}
    with pytest.raises(bench_results.ResultsError):
        bench_results.write_record(kwargs.pop("bench"), kwargs.pop("rows"), out=tmp_path / "r.json",
                                   isa_level="portable", **kwargs)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("vendor, family, model, flags, kind", [
    ("AuthenticAMD", 0x1A, 2, {"avx512f", "avx2"}, "amd-zen5-avx512"),
    ("AuthenticAMD", 0x19, 0x11, {"avx512f", "avx2"}, "amd-zen4-avx512"),
    ("AuthenticAMD", 0x19, 0x01, {"avx2", "fma"}, "amd-zen3-avx2"),
    ("GenuineIntel", 6, 143, {"avx512f", "avx2", "amx_tile"}, "intel-amx"),
    ("GenuineIntel", 6, 85, {"avx512f", "avx2"}, "intel-avx512"),
    ("GenuineIntel", 6, 60, {"avx2"}, "intel-avx2"),
])
def test_host_kind_slugs(vendor, family, model, flags, kind):
    assert bench_results.host_kind(vendor, family, model, flags) == kind


def test_host_kind_off_x86_is_the_machine():
    assert bench_results.host_kind("", None, None, set(), machine="aarch64") == "aarch64"


def test_output_flag():
    parser = argparse.ArgumentParser()
    bench_results.add_output_arg(parser, "probe")
    assert parser.parse_args([]).out is None
    assert parser.parse_args(["--out", "a/b.json"]).out == Path("a/b.json")


def test_peers_summary_rows_pick_the_fastest_peer():
    from peer_runners.report import summary_rows

    results = [
        {"engine": "kvmosaic", "dtype": "float32", "workload": "A", "tokens_per_s": 30.0},
        {"engine": "llamacpp", "dtype": "float32", "workload": "A", "tokens_per_s": 20.0},
        {"engine": "vllm", "dtype": "float32", "workload": "A", "tokens_per_s": 24.0},
        {"engine": "hf", "dtype": "float32", "workload": "A", "error": "timeout after 10 s"},
        {"engine": "kvmosaic", "dtype": "q4_1", "workload": "A", "tokens_per_s": 50.0},
    ]
    startup = [{"engine": "kvmosaic", "dtype": "float32", "workload": "S", "seconds": 3.5}]
    rows = summary_rows(results, startup)
    a32, a41, s = rows
    assert a32["engines"] == {"kvmosaic": 30.0, "llamacpp": 20.0, "vllm": 24.0, "hf": None}
    assert (a32["best_peer"], a32["ratio"], a32["metric"]) == ("vllm", 1.25, "decode tok/s")
    assert (a41["best_peer"], a41["ratio"]) == (None, None)  # no peer ran it
    assert s["workload"] == "S" and s["engines"] == {"kvmosaic": 3.5} and s["ratio"] is None
