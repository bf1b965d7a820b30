"""English prose that every Python installation carries, so evaluation works offline and in CI.

* Evaluation: ``pydoc_data.topics`` -- the help topics of the Python language reference
  (about 465,000 characters of reference prose, rendered from the docs' reST sources), topics
  in sorted order.
* Calibration (Oaken thresholds): the docstrings of a fixed set of standard-library modules and
  of their public classes and functions. It is different text from the language reference: the
  evaluation never sees the calibration text.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from pathlib import Path

EVAL_SOURCE = "stdlib:pydoc_data.topics"
CALIBRATION_SOURCE = "stdlib:module-docstrings"
CALIBRATION_MODULES = (
    "argparse", "calendar", "collections", "concurrent.futures", "configparser", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "fractions", "ftplib", "functools", "gettext", "heapq",
    "http.client", "ipaddress", "json", "locale", "logging", "mailbox", "optparse", "pathlib", "pickle", "queue",
    "random", "sched", "shutil", "smtplib", "statistics", "string", "subprocess", "tarfile", "textwrap",
    "threading", "typing", "unittest", "urllib.parse", "zipfile",
)
MIN_DOC_CHARS = 200  # skip one-line docstrings: too short to be prose


def eval_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def calibration_text() -> str:
    parts: list[str] = []
    for name in CALIBRATION_MODULES:
        module = importlib.import_module(name)
        if module.__doc__:
            parts.append(inspect.cleandoc(module.__doc__))
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            with warnings.catch_warnings():  # deprecated aliases (typing.re) warn when their doc is read
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = inspect.getdoc(obj)
            if doc and len(doc) >= MIN_DOC_CHARS:
                parts.append(doc)
    return "\n\n".join(dict.fromkeys(parts))


def read_text(source: str | None, default: str) -> tuple[str, str]:
    """(text, its name): a file path, or one of the built-in corpora (the default when None)."""
    source = source or default
    if source == EVAL_SOURCE:
        return eval_text(), source
    if source == CALIBRATION_SOURCE:
        return calibration_text(), source
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {source}")
    return path.read_text(encoding="utf-8", errors="replace"), str(path)
