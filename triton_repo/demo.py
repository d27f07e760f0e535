"""Serve an engine with Triton and stream three completions from it over gRPC.

    python -m triton_repo.demo --engine engines/demo-redrafter [--max-tokens 64] [runtime flags]

Starts tritonserver on free ports in a temporary directory, runs the demo client on
three code prompts one after another, then stops the server.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from triton_repo.client import make_inputs, run_prompts
from triton_repo.repository import add_serving_args, serving_config
from triton_repo.server import TritonServer

PROMPTS = (
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\n\ndef list_python_files(path):",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m triton_repo.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_serving_args(ap)
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (default: %(default)s)")
    args = ap.parse_args(argv)

    def request(prompt: str) -> list[grpcclient.InferInput]:
        return make_inputs(prompt, max_tokens=args.max_tokens)

    with tempfile.TemporaryDirectory(prefix="specpipe-triton-") as tmp:
        try:
            server = TritonServer(serving_config(args), Path(tmp))
            print(f"== starting tritonserver on {args.engine} (log: {server.log_file}) ...", flush=True)
            with server:
                print(f"== ready: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}")
                run_prompts(server.grpc_url, list(PROMPTS), request, args.model_name)
        except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except InferenceServerException as e:
            print(f"\nerror: {e.message()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
