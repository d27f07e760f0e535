"""Stream completions from a running server over gRPC, printing text as it arrives.

    python -m triton_repo.client --url localhost:8001 --prompt "def fib(n):" [--prompt ...] [--max-tokens 64]

Prompts are sent one after another on one bidirectional stream (`start_stream` /
`async_stream_infer`, the way Triton's TensorRT-LLM examples stream); every response
of a streaming request carries the text added since the previous one, the last also the
finish reason and token counts.
"""

from __future__ import annotations

import argparse
import queue
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

STATS = ("num_input_tokens", "num_output_tokens", "num_draft_tokens", "num_accepted_tokens", "num_forwards")
"""The statistics a final response carries (`serving_model.STATS_OUTPUTS`), as clients read them
(the OpenAI front too)."""


def _tensor(name: str, values: list[object], dtype: str, np_dtype: type | None, batched: bool) -> grpcclient.InferInput:
    array: np.ndarray = np.array(values, dtype=np_dtype if np_dtype is not None else object)
    if batched:  # a model with max_batch_size > 0 (the TensorRT-LLM ensemble) wants [1, ...]
        array = array[None]
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def make_inputs(
    prompt: str,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stream: bool = True,
    end_id: int | None = None,
    stop_words: list[str] | None = None,
    ignore_eos: bool | None = None,
    method: str | None = None,
    beam_width: int | None = None,
    beam_length: int | None = None,
    branching: tuple[int, ...] | None = None,
    min_tokens: int | None = None,
    seed_name: str = "random_seed",
    batched: bool = False,
    exclude_input_in_output: bool | None = None,
    return_log_probs: bool | None = None,
    min_length: int | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    bad_words: list[str] | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> list[grpcclient.InferInput]:
    """Request tensors for the specpipe model, or a TensorRT-LLM ensemble (same names; there
    `batched=True`, `seed_name="seed"` in current releases, and `min_tokens` for a fixed
    length); None leaves an input out (the model's default). `extra` adds any other input
    as it is (name -> array; the Triton dtype follows the numpy dtype)."""
    inputs = [
        _tensor("text_input", [prompt.encode()], "BYTES", None, batched),
        _tensor("stream", [stream], "BOOL", np.bool_, batched),
    ]
    optional: list[tuple[str, object, str, type | None]] = [
        ("max_tokens", max_tokens, "INT32", np.int32),
        ("temperature", temperature, "FP32", np.float32),
        ("top_k", top_k, "INT32", np.int32),
        ("top_p", top_p, "FP32", np.float32),
        (seed_name, seed, "UINT64", np.uint64),
        ("end_id", end_id, "INT32", np.int32),
        ("ignore_eos", ignore_eos, "BOOL", np.bool_),
        ("method", None if method is None else method.encode(), "BYTES", None),
        ("redrafter_beam_width", beam_width, "INT32", np.int32),  # not the ensemble's beam_width (beam search)
        ("redrafter_beam_length", beam_length, "INT32", np.int32),
        ("min_tokens", min_tokens, "INT32", np.int32),  # the ensemble's way to a fixed length
        ("min_length", min_length, "INT32", np.int32),  # older ensembles' name, genai-perf's
        ("exclude_input_in_output", exclude_input_in_output, "BOOL", np.bool_),
        ("return_log_probs", return_log_probs, "BOOL", np.bool_),
        ("repetition_penalty", repetition_penalty, "FP32", np.float32),
        ("presence_penalty", presence_penalty, "FP32", np.float32),
        ("frequency_penalty", frequency_penalty, "FP32", np.float32),
    ]
    inputs += [_tensor(n, [v], dtype, np_dtype, batched) for n, v, dtype, np_dtype in optional if v is not None]
    if branching:
        inputs.append(_tensor("rsd_branching", list(branching), "INT32", np.int32, batched))
    if stop_words:
        inputs.append(_tensor("stop_words", [w.encode() for w in stop_words], "BYTES", None, batched))
    if bad_words:
        inputs.append(_tensor("bad_words", [w.encode() for w in bad_words], "BYTES", None, batched))
    for name, array in (extra or {}).items():
        array = array[None] if batched else array
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


@dataclass
class Completion:
    text: str
    finish_reason: str
    stats: dict[str, int]
    """The STATS outputs the final response carried."""
    output_log_probs: list[float] = field(default_factory=list)
    """With return_log_probs: every response's `output_log_probs`, concatenated."""
    cum_log_prob: float | None = None
    """With return_log_probs: the last response's `cum_log_probs`."""
    responses: int = 0
    """Responses received, the final one included."""


def stream_completion(
    client: grpcclient.InferenceServerClient,
    responses: queue.Queue[tuple[grpcclient.InferResult | None, InferenceServerException | None]],
    inputs: list[grpcclient.InferInput],
    model: str = "specpipe",
    on_text: Callable[[str], None] = lambda _: None,
    timeout_s: float = 300.0,
) -> Completion:
    """Send one request on the client's open stream (whose callback fills `responses`) and
    collect its responses until the final one, calling `on_text` with every text piece."""
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    pieces: list[str] = []
    finish_reason, stats = "", {}
    log_probs: list[float] = []
    cum_log_prob: float | None = None
    received = 0
    while True:
        result, error = responses.get(timeout=timeout_s)
        if error is not None:
            raise error
        assert result is not None
        received += 1
        text = result.as_numpy("text_output")
        if text is not None:
            piece = b"".join(text.reshape(-1)).decode("utf-8")
            pieces.append(piece)
            on_text(piece)
        reason = result.as_numpy("finish_reason")
        if reason is not None:
            finish_reason = reason.reshape(-1)[0].decode()
        stats.update({name: int(v.reshape(-1)[0]) for name in STATS if (v := result.as_numpy(name)) is not None})
        if (lp := result.as_numpy("output_log_probs")) is not None:
            log_probs += [float(x) for x in lp.reshape(-1)]
        if (cum := result.as_numpy("cum_log_probs")) is not None:
            cum_log_prob = float(cum.reshape(-1)[0])
        if result.get_response().parameters["triton_final_response"].bool_param:
            return Completion("".join(pieces), finish_reason, stats, log_probs, cum_log_prob, received)


def _print_piece(piece: str) -> None:
    print(piece, end="", flush=True)


def run_prompts(
    url: str, prompts: list[str], request: Callable[[str], list[grpcclient.InferInput]], model: str = "specpipe"
) -> list[Completion]:
    """Stream each prompt's completion to stdout in turn, with its stats after it;
    `request(prompt)` builds the inputs (`make_inputs` with stream=True)."""
    completions = []
    responses: queue.Queue[tuple[grpcclient.InferResult | None, InferenceServerException | None]] = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.is_server_live()  # a connection error here reads better than the stream's later one
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            for prompt in prompts:
                print(f"--- prompt: {prompt!r}\n{prompt}", end="", flush=True)
                done = stream_completion(client, responses, request(prompt), model, on_text=_print_piece)
                stats = done.stats
                line = f"\n# {stats.get('num_output_tokens', '?')} tokens, {done.finish_reason}"
                if stats.get("num_draft_tokens"):
                    line += f"; drafted {stats['num_draft_tokens']}, accepted {stats.get('num_accepted_tokens', 0)}"
                print(line, flush=True)
                completions.append(done)
        finally:
            client.stop_stream()
    return completions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m triton_repo.client", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default="localhost:8001", help="gRPC endpoint (default: %(default)s)")
    ap.add_argument("--model", default="specpipe", help="model name (default: %(default)s)")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several, sent in turn")
    ap.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    ap.add_argument("--temperature", type=float, help="0 = greedy (default: the model's, greedy)")
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--method", help="decoding method, e.g. ar or redrafter (default: the engine's)")
    args = ap.parse_args(argv)

    def request(prompt: str) -> list[grpcclient.InferInput]:
        return make_inputs(
            prompt, args.max_tokens, args.temperature, args.top_k, args.top_p, args.seed, method=args.method
        )

    try:
        run_prompts(args.url, args.prompt, request, args.model)
    except InferenceServerException as e:
        print(f"\nerror: {e.message()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
