"""scripts/render_docs.py: the docs' tables rendered from results records, and the repository's docs in
sync with its committed results."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import render_docs  # noqa: E402


def peers_row(workload, dtype, ours, peer, name="llamacpp"):
    return {"workload": workload, "metric": "decode tok/s", "dtype": dtype, "engines": {"kvmosaic": ours, name: peer},
            "best_peer": name, "ratio": ours / peer}


def record(bench, rows, date, **extra):
    return {"schema": 1, "bench": bench, "provenance": "measured", "date": date,
            "host": {"kind": "test-host", "cpu_model": "Test CPU", "isa_summary": "AVX2+FMA"},
            "git": {"commit": "0123456789abcdef", "dirty": False}, "command": f"python benchmarks/{bench}.py",
            "rows": rows, **extra}


@pytest.fixture
def repo(tmp_path):
    results = tmp_path / "benchmarks" / "results" / "test-host"
    results.mkdir(parents=True)
    (results / "peers-old.json").write_text(json.dumps(record(
        "peers", [peers_row("A", "float32", 10.0, 8.0), peers_row("A", "q4_1", 30.0, 10.0)], "2026-01-01T00:00:00Z")))
    (results / "peers.json").write_text(json.dumps(record(
        "peers", [peers_row("A", "float32", 12.0, 8.0)], "2026-02-01T00:00:00Z")))
    (results / "team_barrier.json").write_text(json.dumps(record(
        "team_barrier", [{"workload": "single stream", "steps": 1, "barrier": "own", "median": 101.0, "ratio": 1.01}],
        "2026-02-02T00:00:00Z")))
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# t\n\n<!-- results:peers-summary -->\nstale\n<!-- /results -->\ntail\n")
    (tmp_path / "docs" / "kernels.md").write_text("x\n<!-- results:team-barrier -->\n<!-- /results -->\n")
    return tmp_path


def test_render_fills_the_blocks_and_check_then_passes(repo, capsys):
    assert render_docs.main(["--root", str(repo), "--check"]) == 1
    assert "README.md" in capsys.readouterr().out
    assert render_docs.main(["--root", str(repo)]) == 0
    readme = (repo / "README.md").read_text()
    # float32 from the newer record (12 / 8), q4_1 only in the older one (30 / 10)
    assert "| test-host | A: decode, 1 x 128 + 128 | 1.50x (llama.cpp) | - | - | 3.00x (llama.cpp) |" in readme
    assert "stale" not in readme and readme.endswith("<!-- /results -->\ntail\n")
    assert "`benchmarks/results/test-host/peers.json`" in readme
    assert "`benchmarks/results/test-host/peers-old.json`" in readme
    kernels = (repo / "docs" / "kernels.md").read_text()
    assert "| single stream | 1 | own | 101.0 | 1.010x |" in kernels
    assert "`python benchmarks/team_barrier.py`" in kernels
    assert render_docs.main(["--root", str(repo), "--check"]) == 0


def test_check_writes_nothing(repo):
    before = (repo / "README.md").read_text()
    render_docs.main(["--root", str(repo), "--check"])
    assert (repo / "README.md").read_text() == before


def test_a_changed_result_makes_the_docs_stale(repo):
    render_docs.main(["--root", str(repo)])
    path = repo / "benchmarks" / "results" / "test-host" / "team_barrier.json"
    data = json.loads(path.read_text())
    data["rows"][0]["median"] = 99.0
    path.write_text(json.dumps(data))
    assert render_docs.main(["--root", str(repo), "--check"]) == 1


def test_transcribed_records_are_marked(repo):
    path = repo / "benchmarks" / "results" / "test-host" / "team_barrier.json"
    data = json.loads(path.read_text())
    data.update(provenance="transcribed from the benchmark log of commit abc1234", date=None,
                logged={"commit": "abc1234", "date": "2025-12-31T00:00:00Z"})
    path.write_text(json.dumps(data))
    render_docs.main(["--root", str(repo)])
    kernels = (repo / "docs" / "kernels.md").read_text()
    assert "transcribed from the benchmark log of commit abc1234; date 2025-12-31*" in kernels


@pytest.mark.parametrize("doc, message", [
    ("<!-- results:no-such-table -->\n<!-- /results -->\n", "unknown results table"),
    ("<!-- results:team-barrier -->\nnever closed\n", "has no '<!-- /results -->'"),
])
def test_bad_documents_are_errors(repo, capsys, doc, message):
    (repo / "docs" / "bad.md").write_text(doc)
    assert render_docs.main(["--root", str(repo)]) == 2
    assert message in capsys.readouterr().err


def test_bad_results_file_is_an_error(repo, capsys):
    (repo / "benchmarks" / "results" / "test-host" / "broken.json").write_text("{not json")
    assert render_docs.main(["--root", str(repo), "--check"]) == 2
    assert "broken.json: not valid JSON" in capsys.readouterr().err


def test_repository_docs_are_in_sync_with_committed_results(capsys):
    assert render_docs.main(["--check"]) == 0, capsys.readouterr().out


# speed-ups, rates and sub-millisecond latencies: what a benchmark measures, never a setting
MEASURED = re.compile(r"\b\d+(?:\.\d+)?x\b|\d[\d.,]*\s*(?:tok/s|GB/s|GFLOP/s|TFLOP/s|req/s)|\d+\.\d+\s*(?:ms|us)\b")


def test_docs_state_measured_numbers_only_in_rendered_tables():
    found = []
    for path in render_docs.documents(ROOT):
        text = re.sub(r"<!-- results:.*?<!-- /results -->", "", path.read_text(), flags=re.S)
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        found += [f"{path.name}: {m.group()}" for m in MEASURED.finditer(text)]
    assert not found, "put measured numbers in a results record and a rendered table: " + ", ".join(found)


def test_committed_records_say_where_their_numbers_come_from():
    records = render_docs.load_records(ROOT)
    assert records, "benchmarks/results/ holds no records"
    for r in records:
        data = r.data
        assert data["host"]["kind"] == r.kind, f"{r.path}: host kind differs from its directory"
        assert isinstance(data["rows"], list) and data["rows"], f"{r.path}: no rows"
        provenance = data.get("provenance", "")
        assert provenance == "measured" or provenance.startswith("transcribed from "), r.path
        if provenance == "measured":
            assert data["date"] and data["git"]["commit"] and data["command"], r.path
        else:  # no run date in the old log: the commit that logged the figures stands in for it
            assert data["date"] is None and data["logged"]["commit"] and data["logged"]["date"], r.path


def test_quant_kl_table_leaves_llamacpp_empty_when_it_did_not_run(repo):
    divergence = {"num_tokens": 2044, "mean_kl": 0.0049, "p99_kl": 0.031, "top1": 0.9606}
    rows = [{"label": "q8_0", "held": "Q8_0 x211", "int8": divergence, "activation_kl": 0.0035, "llamacpp": None,
             "weights_only": {**divergence, "mean_kl": 0.0014, "top1": 0.9803}}]
    (repo / "benchmarks" / "results" / "test-host" / "quant_kl.json").write_text(json.dumps(record(
        "quant_kl", rows, "2026-02-03T00:00:00Z")))
    (repo / "docs" / "weights.md").write_text("<!-- results:quant-kl -->\n<!-- /results -->\n")
    assert render_docs.main(["--root", str(repo)]) == 0
    text = (repo / "docs" / "weights.md").read_text()
    assert "| q8_0 | Q8_0 x211 | 0.00490 | 0.00140 | +0.00350 | - | 0.0310 | - | 96.06% | 98.03% | - |" in text


def test_real_size_table_gives_ratios_and_roofline_shares(repo):
    rows = [peers_row("A", "q4_k_m", 30.0, 24.0),
            {"workload": "S", "metric": "start-up s", "dtype": "q4_k_m", "engines": {"kvmosaic": 2.0, "llamacpp": 1.0},
             "best_peer": None, "ratio": None}]
    shares = [{"workload": "A", "dtype": "q4_k_m", "engine": "kvmosaic", "share": 0.8},
              {"workload": "A", "dtype": "q4_k_m", "engine": "llamacpp", "share": 0.64}]
    (repo / "benchmarks" / "results" / "test-host" / "peers-llama-3_2-1b.json").write_text(json.dumps(record(
        "peers-llama-3_2-1b", rows, "2026-02-03T00:00:00Z", config={"model": "llama-3.2-1b"}, roofline_shares=shares)))
    (repo / "docs" / "real.md").write_text("<!-- results:peers-real-size -->\n<!-- /results -->\n")
    assert render_docs.main(["--root", str(repo)]) == 0
    text = (repo / "docs" / "real.md").read_text()
    assert "| test-host | llama-3.2-1b | A | decode tok/s | q4_k_m | 30.0 | 24.0 | - | 1.25x | 80% / 64% |" in text
    # start-up: lower is better, so the ratio is llama.cpp's time over kvmosaic's
    assert "| test-host | llama-3.2-1b | S | start-up s | q4_k_m | 2.00 | 1.00 | - | 0.50x |  |" in text
