"""Render the docs' benchmark tables from the committed results.

Reads every ``benchmarks/results/<host-kind>/*.json`` record (written by ``benchmarks/bench_results.py``,
or transcribed from an older log and marked so in its ``provenance``) and rewrites each block between

    <!-- results:NAME -->
    ...
    <!-- /results -->

in ``README.md`` and ``docs/*.md`` with table NAME (``TABLES`` below), followed by the files it came
from. ``--check`` rewrites nothing and exits 1 when a document differs from what its results render.

    python scripts/render_docs.py            # rewrite the tables
    python scripts/render_docs.py --check    # CI / tests: are the docs in sync with the results?
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from render_tables import TABLES, Record  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^<!-- results:(?P<name>[a-z0-9_-]+) -->\n(?P<body>.*?)^<!-- /results -->$", re.M | re.S)
OPEN = re.compile(r"^<!-- results:(?P<name>[^ ]*) -->$", re.M)


class RenderError(ValueError):
    """A results file or a document the renderer cannot use (bad JSON, unknown table, unclosed block)."""


def load_records(root: Path) -> list[Record]:
    records = []
    for path in sorted((root / "benchmarks" / "results").glob("*/*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise RenderError(f"{path.relative_to(root)}: not valid JSON ({exc})") from exc
        missing = [k for k in ("bench", "host", "rows") if k not in data]
        if missing:
            raise RenderError(f"{path.relative_to(root)}: not a results record (no {', '.join(missing)})")
        records.append(Record(path.relative_to(root).as_posix(), path.parent.name, data))
    return records


def documents(root: Path) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


def render_text(text: str, records: list[Record], where: str = "document") -> str:
    """``text`` with every results block filled from ``records``."""
    opened = [m.group("name") for m in OPEN.finditer(text)]
    blocks = list(BLOCK.finditer(text))
    if len(opened) != len(blocks):
        raise RenderError(f"{where}: a '<!-- results:NAME -->' line has no '<!-- /results -->' after it")

    def fill(match: re.Match) -> str:
        name = match.group("name")
        if name not in TABLES:
            raise RenderError(f"{where}: unknown results table {name!r}; known: {', '.join(sorted(TABLES))}")
        lines = TABLES[name](records)
        return f"<!-- results:{name} -->\n" + "".join(line + "\n" for line in lines) + "<!-- /results -->"

    return BLOCK.sub(fill, text)


@dataclass
class Outcome:
    path: Path
    stale: bool


def render(root: Path, check: bool) -> list[Outcome]:
    records = load_records(root)
    outcomes = []
    for path in documents(root):
        text = path.read_text()
        new = render_text(text, records, str(path.relative_to(root)))
        outcomes.append(Outcome(path, new != text))
        if new != text and not check:
            path.write_text(new)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a document is out of date; write nothing")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    try:
        outcomes = render(args.root, args.check)
    except RenderError as exc:
        print(f"render_docs: {exc}", file=sys.stderr)
        return 2
    stale = [o.path.relative_to(args.root) for o in outcomes if o.stale]
    if args.check:
        for path in stale:
            print(f"out of date with benchmarks/results: {path} (run python scripts/render_docs.py)")
        return 1 if stale else 0
    for path in stale:
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
