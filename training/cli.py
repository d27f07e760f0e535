"""Command-line flags generated from a config dataclass, with each field's docstring as
its `--help` text, so training settings are declared (and documented) once."""

from __future__ import annotations

import argparse
import ast
import inspect
import textwrap
from dataclasses import MISSING, fields
from typing import Any, TypeVar

T = TypeVar("T")


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal that follows it in the class body."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for node, nxt in zip(body.body, body.body[1:], strict=False):
        is_field = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)
        if is_field and is_doc:
            docs[node.target.id] = nxt.value.value  # type: ignore[attr-defined]
    return docs


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--field-name` flag per field, defaulting to the field's default."""
    docs = field_docs(cls)
    group = parser.add_argument_group(f"{cls.__name__} settings")
    for f in fields(cls):
        if f.default is MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} needs a default to become a flag")
        kind: Any = type(f.default)
        extra: dict[str, Any] = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        help_text = f"{docs.get(f.name, '')} (default: %(default)s)".replace("%", "%%").replace(
            "%%(default)s", "%(default)s"
        )
        group.add_argument(f"--{f.name.replace('_', '-')}", default=f.default, help=help_text, **extra)


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})  # type: ignore[arg-type]
