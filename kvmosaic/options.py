"""Options declared once, as fields of a frozen dataclass: each field is an option's name, type and
default, and its metadata (``option(...)``) holds the one help text, the choices and any older flag
spellings. The command line's flags and the Python API's keyword checks are generated from those
fields, so neither can drift from the other.

Command-line flags follow from a field's type: ``bool`` -> ``--x`` / ``--no-x``; ``tuple[T, ...]``
-> a repeatable ``--x``; ``int``, ``float``, ``str`` (or one of them or None) -> ``--x VALUE``;
any other type needs a ``parse`` function from the flag's text to the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

_SCALARS = (int, float, str)
_METAVARS = {int: "N", float: "X"}


def option(default: Any, *, help: str, choices: Iterable[str] | None = None, flags: Iterable[str] = (),
           parse: Callable[[str], Any] | None = None, metavar: str | None = None) -> Any:
    """A dataclass field that is an option: ``flags`` are extra spellings of its command-line flag
    (for a bool, one starting with ``--no-`` turns it off); ``parse`` turns a flag's text into the value."""
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None,
                "flags": tuple(flags), "parse": parse, "metavar": metavar}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True, slots=True)
class OptionSpec:
    """One option as the command line sees it."""

    name: str
    default: Any
    help: str
    kind: str  # "flag" (bool), "list" (repeatable) or "value"
    parse: Callable[[str], Any] | None
    choices: tuple[str, ...] | None
    flags: tuple[str, ...]
    metavar: str | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def option_strings(self) -> list[str]:
        negated = ["--no-" + self.name.replace("_", "-")] if self.kind == "flag" else []
        return [self.flag, *negated, *self.flags]


def option_specs(cls: type) -> list[OptionSpec]:
    """The options of a dataclass declared with ``option``, in declaration order."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with option(...)")
        kind, parse = _kind(hints[f.name])
        parse = f.metadata["parse"] or parse
        if parse is None and kind != "flag":
            raise TypeError(f"{cls.__name__}.{f.name}: type {hints[f.name]} needs option(parse=...)")
        specs.append(OptionSpec(f.name, f.default, f.metadata["help"], kind, parse, f.metadata["choices"],
                                f.metadata["flags"], f.metadata["metavar"]))
    return specs


def _kind(hint: Any) -> tuple[str, Callable[[str], Any] | None]:
    """("flag" | "list" | "value", the parser of one flag's text if the type alone gives one)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = members[0] if len(members) == 1 else None
    if hint is bool:
        return "flag", None
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        return "list", item if item in _SCALARS else None
    return "value", hint if hint in _SCALARS else None


class _Toggle(argparse.Action):
    """A bool option: its ``--no-`` spellings turn it off, the others on."""

    def __init__(self, option_strings, dest, default=None, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))


def add_options(parser: argparse.ArgumentParser, cls: type, title: str, exclude: Iterable[str] = ()) -> None:
    """Add a flag for each option of ``cls`` (not those in ``exclude``) to ``parser``, in a group."""
    group = parser.add_argument_group(title)
    skipped = set(exclude)
    for spec in option_specs(cls):
        if spec.name in skipped:
            continue
        text = spec.help.replace("%", "%%") + _shown_default(spec)
        if spec.kind == "flag":
            group.add_argument(*spec.option_strings, dest=spec.name, action=_Toggle, default=spec.default,
                               help=text)
        elif spec.kind == "list":
            group.add_argument(*spec.option_strings, dest=spec.name, action="append", type=spec.parse,
                               default=list(spec.default), choices=spec.choices, metavar=spec.metavar, help=text)
        else:
            group.add_argument(*spec.option_strings, dest=spec.name, type=spec.parse, default=spec.default,
                               choices=spec.choices, metavar=spec.metavar or _METAVARS.get(spec.parse), help=text)


def _shown_default(spec: OptionSpec) -> str:
    if spec.kind == "flag":
        return f" (default: {'on' if spec.default else 'off'})"
    if spec.default is None or spec.default == ():
        return ""
    return f" (default: {spec.default})".replace("%", "%%")


def from_namespace(cls: type, namespace: argparse.Namespace):
    """``cls`` built from the parsed flags of its options (a repeatable one's list becomes a tuple);
    options the parser did not define keep their defaults."""
    values = {}
    for spec in option_specs(cls):
        if hasattr(namespace, spec.name):
            value = getattr(namespace, spec.name)
            values[spec.name] = tuple(value) if spec.kind == "list" else value
    return cls(**values)


def check_keywords(cls: type, kwargs: Mapping[str, Any], caller: str, others: Iterable[str] = ()) -> None:
    """TypeError naming a keyword that is no option of ``cls``, with the names it may have meant
    (among the options and the caller's ``others`` parameters)."""
    names = [f.name for f in dataclasses.fields(cls)]
    for key in kwargs:
        if key not in names:
            close = difflib.get_close_matches(key, [*names, *others], n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise TypeError(f"{caller} got an unexpected keyword argument {key!r}{hint} "
                            f"(its options are the fields of {cls.__module__}.{cls.__name__})")


def keyword_parameters(cls: type) -> list[inspect.Parameter]:
    """The options of ``cls`` as keyword parameters with their defaults (for a generated signature)."""
    hints = typing.get_type_hints(cls)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
            for f in dataclasses.fields(cls)]
