"""Command-line flags generated from a frozen config dataclass, so each flag is written once.

A field made with `flag(default, help, ...)` becomes `--field-name`; its type (int, float, str),
choices, `repeat` (a repeatable flag collected into a tuple), `store_true`, `boolean` (a
`--name/--no-name` pair) and `env` (an
environment variable read when the flag is absent) come from the field's metadata.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, field, fields
from typing import Any, TypeVar

T = TypeVar("T")


def flag(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    for f in fields(cls):
        meta = f.metadata
        name = "--" + f.name.replace("_", "-")
        help_text = meta["help"] + (f" (env {meta['env']})" if "env" in meta else "")
        kw: dict[str, Any] = {"help": help_text, "dest": f.name}
        if meta.get("store_true"):
            parser.add_argument(name, action="store_true", **kw)
            continue
        if meta.get("boolean"):  # --name / --no-name
            kw["help"] += f" (default: {'on' if f.default else 'off'})"
            parser.add_argument(
                name, action=argparse.BooleanOptionalAction, default=f.default, **kw
            )
            continue
        if meta.get("repeat"):
            parser.add_argument(
                name, action="append", default=[], metavar=meta.get("metavar", "URL"), **kw
            )
            continue
        default = f.default if f.default is not MISSING else None
        kind = str(f.type)
        if kind.startswith("int"):
            kw["type"] = int
        elif kind.startswith("float"):
            kw["type"] = float
        if "choices" in meta:
            kw["choices"] = meta["choices"]
        if default is not None:
            kw["help"] += f" (default: {default})"
        parser.add_argument(name, default=default, **kw)


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    values = {}
    for f in fields(cls):
        value = getattr(args, f.name)
        if f.metadata.get("repeat"):
            value = tuple(value)
        elif value is None and "env" in f.metadata:
            value = os.environ.get(f.metadata["env"]) or None
        values[f.name] = value
    return cls(**values)


def parse_dataclass(
    cls: type[T], argv: list[str] | None, *, prog: str, description: str | None, epilog: str
) -> T:
    """`argv` as a `cls` (its flags from its fields); a `ValueError` of the config's own checks
    is argparse's error: the reason on stderr, exit 2."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_dataclass_arguments(parser, cls)
    args = parser.parse_args(argv)
    try:
        return dataclass_from_args(cls, args)
    except ValueError as e:
        parser.error(str(e))
