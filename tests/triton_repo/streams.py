"""Streaming gRPC clients for the serving tests: each request on its own stream,
concurrently, collecting the streamed text and the FINAL response's outputs."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

pytest.importorskip("tritonclient.grpc", reason="needs the Triton client: pip install tritonclient[grpc,http]")
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from triton_repo.client import make_inputs, stream_completion

MODEL = "specpipe"
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\n\ndef list_files(path):"]


LATE_RESPONSE_GRACE_S = 0.3
"""How long a stream stays open after its FINAL response, to catch a second one."""


def stream_grpc(url: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send each request on its own gRPC stream (concurrently) through the demo client's
    `stream_completion`; per request the streamed text, the final response's finish reason
    and statistics, and the number of FINAL flags seen (a second one arriving within
    LATE_RESPONSE_GRACE_S is counted), or the error."""
    results: list[dict[str, Any]] = [{} for _ in requests]

    def one(i: int) -> None:
        responses: queue.Queue[Any] = queue.Queue()
        with grpcclient.InferenceServerClient(url) as client:
            client.start_stream(callback=lambda result, error: responses.put((result, error)))
            try:
                done = stream_completion(
                    client, responses, make_inputs(**requests[i], stream=True), MODEL, timeout_s=120
                )
            except InferenceServerException as e:
                results[i] = {"error": e}
                return
            finally:
                time.sleep(LATE_RESPONSE_GRACE_S)
                client.stop_stream()
        late_finals = sum(
            r is not None and r.get_response().parameters["triton_final_response"].bool_param
            for r, _ in list(responses.queue)
        )
        results[i] = {
            "text": done.text,
            "finals": 1 + late_finals,
            "finish_reason": done.finish_reason,
            "output_log_probs": done.output_log_probs,
            "cum_log_prob": done.cum_log_prob,
            "responses": done.responses,
            **done.stats,
        }

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results
