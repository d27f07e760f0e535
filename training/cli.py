"""Command-line flags generated from a config dataclass, with each field's docstring as
its `--help` text, so training settings are declared (and documented) once."""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import textwrap
from collections.abc import Callable
from dataclasses import MISSING, asdict, fields
from pathlib import Path
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


def write_training_log(out: Path, cfg: Any, target: Path, metrics: dict[str, Any], log: list[Any]) -> None:
    """`training_log.json`: the config, the target distilled from, final metrics and the
    evaluation curve (what the model cards are generated from)."""
    doc = {"config": asdict(cfg), "target": str(target), "metrics": metrics, "log": log}
    (out / "training_log.json").write_text(json.dumps(doc, indent=2) + "\n")


def distill_main(
    description: str,
    module: str,
    default_out: str,
    config_cls: type[T],
    train: Callable[[T, Path, Path], dict[str, Any]],
    write_card: Callable[[Path, str], Path],
) -> None:
    """The command line of a drafter distillation script: --target, --out and the config's
    flags; trains, prints the metrics and writes the model card with the command used."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("models/demo-target"), help="HF target directory")
    ap.add_argument("--out", type=Path, default=Path(default_out), help="output directory")
    add_dataclass_args(ap, config_cls)
    args = ap.parse_args()
    metrics = train(dataclass_from_args(config_cls, args), args.target, args.out)
    print(json.dumps(metrics, indent=2))
    print(f"model card: {write_card(args.out, f'python -m {module} ' + ' '.join(sys.argv[1:]))}")
