"""Few-row linears on a GPU: cuBLAS (`F.linear`) against `plugins.gpu_linear.rows_linear` at
a grid of (BLOCK_N, BLOCK_K, SPLIT) configurations, per product shape of the demo models and
row count, each timed as 20 calls replayed in one CUDA graph (no launch costs: how the
engine's captured forwards run them). What `plugins/gpu_linear.py`'s `CONFIGS` were chosen
from, and where cuBLAS's fp32 choice for a few rows is far off.

    python -m benchmarks.gpu_linear_bench                 # needs CUDA
    python -m benchmarks.gpu_linear_bench --render benchmarks/results/gpu_linear_h200_s22.json

Writes `<out>.json` (rows: n, k, m, "cublas" and one key per configuration, microseconds a
call; the command line) and `<out>.md` (per shape and row count: cuBLAS, the best
configuration, `CONFIGS`' best).
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from plugins.gpu_linear import CONFIGS, _replay_us, rows_linear

SHAPES = ((384, 384), (128, 384), (1024, 384), (384, 1024), (8192, 384), (768, 256), (8192, 256))
"""(N, K) of the demo target's q / k, v / gate, up / down / LM head and the draft LM's MLP and head."""
GRID = tuple((bn, bk, split) for bn in (16, 32, 64) for bk in (64, 128) for split in (1, 2, 4))


def name(config: tuple[int, int, int]) -> str:
    return "BN{} BK{} split{}".format(*config)


def measure(rows: tuple[int, ...]) -> list[dict[str, Any]]:
    out = []
    torch.manual_seed(0)
    for n, k in tqdm(SHAPES, desc="shapes"):
        w = torch.randn(n, k, device="cuda")
        for m in rows:
            x = torch.randn(m, k, device="cuda")
            exact = x.double() @ w.double().T
            row: dict[str, Any] = {"n": n, "k": k, "m": m, "cublas": _replay_us(functools.partial(F.linear, x, w))}
            for config in GRID:
                if config[0] > n or config[1] * config[2] > 2 * k:
                    continue
                y = rows_linear(x, w, None, config)
                if not torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-3):
                    raise AssertionError(f"rows_linear at {config} is off for {m} x {k} x {n}")
                row[name(config)] = _replay_us(functools.partial(rows_linear, x, w, None, config))
            out.append(row)
    return out


def render(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Few-row linears: cuBLAS vs the split-K Triton matmul (us a call, CUDA-graph replays)",
        "",
        f"`{command}`",
        "",
        "| N x K | rows | cuBLAS | best of the grid | CONFIGS' best | chosen (saves >= 25%) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        timed = {key: t for key, t in r.items() if key.startswith("BN")}
        best = min(timed, key=timed.__getitem__)
        ours = min((name(c) for c in CONFIGS if name(c) in timed), key=timed.__getitem__)
        chosen = "Triton" if timed[ours] < 0.75 * r["cublas"] else "cuBLAS"
        lines.append(
            f"| {r['n']} x {r['k']} | {r['m']} | {r['cublas']:.1f} | {timed[best]:.1f} ({best}) "
            f"| {timed[ours]:.1f} ({ours}) | {chosen} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rows", default="1,8,16", help="row counts, comma-separated (at most 16)")
    parser.add_argument("--out", default="benchmarks/results/gpu_linear", help="output stem (.json, .md)")
    parser.add_argument("--render", metavar="JSON", help="re-write the markdown of a saved run, measuring nothing")
    args = parser.parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(render(saved["rows"], saved["command"]))
        return
    if not torch.cuda.is_available():
        sys.exit(
            "gpu_linear_bench times CUDA kernels: run it on a machine with an NVIDIA GPU and a CUDA build of torch"
        )
    command = "python -m benchmarks.gpu_linear_bench " + shlex.join(argv if argv is not None else sys.argv[1:])
    rows = measure(tuple(int(m) for m in args.rows.split(",")))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(args.out + ".json").write_text(json.dumps({"command": command, "meta": meta, "rows": rows}, indent=1))
    Path(args.out + ".md").write_text(render(rows, command))
    print(render(rows, command))


if __name__ == "__main__":
    main()
