"""Streaming gRPC clients for the serving tests: each request on its own stream,
concurrently, collecting the streamed text and the FINAL response's outputs."""

from __future__ import annotations

import queue
import threading
from typing import Any

import tritonclient.grpc as grpcclient

from triton_repo.client import make_inputs

MODEL = "specpipe"
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\n\ndef list_files(path):"]


def stream_grpc(url: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send each request on its own gRPC stream (concurrently); per request the streamed
    text, the final response's outputs and the number of FINAL flags seen."""
    results: list[dict[str, Any]] = [{} for _ in requests]

    def one(i: int) -> None:
        client = grpcclient.InferenceServerClient(url)
        events: queue.Queue[Any] = queue.Queue()
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        client.async_stream_infer(MODEL, make_inputs(**requests[i], stream=True), enable_empty_final_response=True)
        text, finals, final = [], 0, {}
        while True:
            result, error = events.get(timeout=120)
            if error is not None:
                results[i] = {"error": error}
                break
            response = result.get_response()
            out = result.as_numpy("text_output")
            if out is not None:
                text.append(b"".join(out).decode())
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
                final = {n: result.as_numpy(n) for n in ("finish_reason", "num_output_tokens", "num_draft_tokens")}
                break
        client.stop_stream()
        client.close()
        if "error" not in results[i]:
            results[i] = {"text": "".join(text), "finals": finals, **final}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results
