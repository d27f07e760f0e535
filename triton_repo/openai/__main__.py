"""OpenAI-compatible API for a specpipe engine, in front of Triton Inference Server.

    python -m triton_repo.openai --engine engines/demo-redrafter [--openai-port 9000]   (make serve)
        starts Triton on the engine (HTTP 8000, gRPC 8001, metrics 8002, as `triton_repo.server`,
        whose flags it takes), then serves the OpenAI API on :9000
    python -m triton_repo.openai --triton-url localhost:8001 [--engine DIR] [--model-name specpipe]
        attaches to a running Triton (the engine directory is only read for its tokenizer and
        chat template; by default the one the served model names, if it is on this machine)

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream or not),
GET /health/ready. Requests go to Triton over gRPC streaming, so Triton stays the serving
core: in-flight batching, metrics and tensor parallelism are unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from jinja2 import TemplateError

from triton_repo.openai.app import ServerState, create_app
from triton_repo.openai.chat import ChatTemplate
from triton_repo.openai.triton_backend import TritonBackend

if TYPE_CHECKING:
    from triton_repo.server import TritonServer

# triton_repo.server's exit codes (not imported here: attaching to a Triton needs no torch)
EXIT_STOPPED, EXIT_START_FAILED, EXIT_SERVING_FAILED = 0, 1, 3
SUPERVISE_EVERY_S = 1.0
GRACEFUL_SHUTDOWN_S = 5


def parser(attach: bool) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m triton_repo.openai", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--triton-url", help="gRPC host:port of a running Triton to attach to (default: start one)")
    ap.add_argument("--host", default="0.0.0.0", help="OpenAI API address (default: %(default)s)")
    ap.add_argument("--openai-port", type=int, default=9000, help="OpenAI API port (default: %(default)s)")
    ap.add_argument("--default-max-tokens", type=int, default=16, help="when a request sets none (default: 16)")
    ap.add_argument("--chat-template", type=Path, help="Jinja file replacing the engine's chat template")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    if attach:
        ap.add_argument("--engine", type=Path, help="engine directory, for the tokenizer and chat template")
        ap.add_argument("--model-name", default="specpipe", help="Triton model to serve (default: %(default)s)")
    else:
        from triton_repo.repository import add_serving_args
        from triton_repo.server import EXIT_CODES

        ap.epilog = EXIT_CODES
        add_serving_args(ap)
        ap.add_argument("--http-port", type=int, default=8000, help="Triton HTTP (default: %(default)s; 0: free)")
        ap.add_argument("--grpc-port", type=int, default=8001, help="Triton gRPC (default: %(default)s; 0: free)")
        ap.add_argument("--metrics-port", type=int, default=8002, help="Triton metrics (default: %(default)s; 0: free)")
        ap.add_argument("--run-dir", type=Path, help="Triton's model repository and logs (default: a temporary one)")
    return ap


async def serve(state: ServerState, args: argparse.Namespace, triton: TritonServer | None) -> int:
    """Run uvicorn until a signal (or, with `triton`, until Triton fails its liveness check)."""
    config = uvicorn.Config(
        create_app(state),
        host=args.host,
        port=args.openai_port,
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    failures: list[str] = []

    async def supervise() -> None:
        while triton is not None and not server.should_exit:
            try:
                await asyncio.to_thread(triton.check_alive)
            except RuntimeError as e:
                failures.append(str(e))
                server.should_exit = True
                return
            await asyncio.sleep(SUPERVISE_EVERY_S)

    watcher = asyncio.create_task(supervise())
    try:
        await server.serve()
    except SystemExit:  # uvicorn exits this way when it cannot bind its port
        return EXIT_START_FAILED
    finally:
        watcher.cancel()
    if failures:
        print(f"error: {failures[0]}", file=sys.stderr, flush=True)
        return EXIT_SERVING_FAILED
    return EXIT_STOPPED if server.started else EXIT_START_FAILED


def _state(args: argparse.Namespace, url: str, engine: Path | None) -> ServerState:
    return ServerState(TritonBackend(url, args.model_name), args.default_max_tokens, engine, args.chat_template)


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--triton-url")
    attach = pre.parse_known_args(argv)[0].triton_url is not None
    ap = parser(attach)
    args = ap.parse_args(argv)
    if args.chat_template is not None:  # refuse a template that cannot work now, not at the first chat
        try:
            ChatTemplate.from_source(args.chat_template.read_text())
        except (OSError, TemplateError) as e:
            ap.error(f"--chat-template {args.chat_template}: {e}")
    logging.basicConfig(format="%(levelname)s: %(message)s", level=logging.INFO)
    if attach:
        print(f"OpenAI API on http://{args.host}:{args.openai_port}/v1 -> Triton {args.triton_url}", flush=True)
        return asyncio.run(serve(_state(args, args.triton_url, args.engine), args, None))
    return start_triton_and_serve(args)


def start_triton_and_serve(args: argparse.Namespace) -> int:
    """Start Triton like `triton_repo.server` (same supervision and teardown), then serve."""
    from triton_repo.processes import LAUNCH_ID_ENV
    from triton_repo.repository import serving_config
    from triton_repo.server import TritonServer, _StopOnSignal, check_ports_free

    signals = _StopOnSignal()  # Ctrl-C while Triton starts: tear it down
    code, triton = EXIT_START_FAILED, None
    with tempfile.TemporaryDirectory(prefix="specpipe-openai-") as tmp:
        try:
            check_ports_free({"OpenAI": args.openai_port})
            ports = (args.http_port, args.grpc_port, args.metrics_port)
            triton = TritonServer(serving_config(args), args.run_dir or Path(tmp), *ports)
            print(f"loading {args.engine} into tritonserver (log: {triton.log_file}; "
                  f"processes marked {LAUNCH_ID_ENV}={triton.launch_id}) ...", flush=True)  # fmt: skip
            triton.start()
            triton.wait_ready()
            host = "localhost" if args.host == "0.0.0.0" else args.host
            body = {"model": args.model_name, "prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}
            print(
                f"ready: model {args.model_name!r}\n  OpenAI  http://{host}:{args.openai_port}/v1\n"
                f"  Triton  HTTP {triton.http_url}, gRPC {triton.grpc_url}, metrics {triton.metrics_url}\n"
                f"try:  curl http://{host}:{args.openai_port}/v1/completions -H 'Content-Type: application/json' "
                f"-d '{json.dumps(body)}'\nCtrl-C stops both.",
                flush=True,
            )
            signals.armed = False  # uvicorn handles signals from here on
            code = asyncio.run(serve(_state(args, triton.grpc_url, args.engine), args, triton))
        except KeyboardInterrupt:
            print(f"{signals.received or 'interrupted'}: stopping tritonserver ...", flush=True)
            code = EXIT_STOPPED
        except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
        finally:
            signals.armed = False
            if triton is not None:
                print("stopping tritonserver ...", flush=True)
                triton.stop()
    print("stopped." if code == EXIT_STOPPED else f"exit {code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
