"""What every benchmark writes next to its numbers: the machine it ran on, and the JSON +
markdown pair under benchmarks/results/."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime import native_policy


@dataclass
class Cell:
    """What a row of the method-against-AR benchmarks (`step_profile`, `no_draft`, `churn`)
    was measured at."""

    method: str
    engine: str
    """The engine it ran on: each method is compared with AR on its own engine."""
    batch: int
    temperature: float


def by_count(counts: dict[str, int]) -> str:
    """`counts` as "key n, key n", the largest first ("-" where there are none): how the
    policy's full solves by cause read in a report (`SpeculationPolicy.solves`)."""
    ordered = sorted(counts.items(), key=lambda kv: -kv[1])  # (stable: ties as they came)
    return ", ".join(f"{key} {n}" for key, n in ordered) or "-"


def machine() -> dict[str, object]:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    info: dict[str, object] = {
        "cpu": cpu,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "policy": "compiled" if native_policy.active() else "python",  # (`runtime/native_policy.py`)
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def command(module: str, argv: list[str] | None) -> str:
    """The command line that reproduces a benchmark run: `python -m <module>` and its
    arguments (`argv`, or the process's own when None), for its report's meta."""
    return f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)


def named_dirs(values: list[str] | None, defaults: tuple[str, ...], flag: str) -> dict[str, Path]:
    """Repeatable `--flag NAME=DIR` values (`defaults` when None) -> {NAME: DIR}; a malformed
    one exits naming the flag."""
    out = {}
    for text in values if values is not None else list(defaults):
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: {flag} {text!r}: expected NAME=DIR")
        out[name] = Path(path)
    return out


def write_report(
    out: Path,
    meta: dict[str, Any],
    rows: list[dict[str, Any]],
    markdown: str,
    summary: dict[str, Any] | None = None,
    echo: bool = True,
) -> None:
    """`<out>.json` (`summary` keys at the top level, as vLLM's benchmark JSON has them, then
    meta + rows) and `<out>.md`; prints the markdown unless `echo` is False (a report
    rewritten after every cell of a sweep prints only its last)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {**(summary or {}), "meta": meta, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown)
    if echo:
        print(markdown)


def subplots(ncols: int, size: tuple[float, float]) -> tuple[Any, Any]:
    """A headless (Agg) matplotlib figure with `ncols` axes; matplotlib is imported only by
    the reports that draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=size)


def save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch intra-op threads = n inside (0: leave torch's default), restored after, since a
    benchmark's main() may run in-process (tests)."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
