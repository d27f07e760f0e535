"""The OpenAI server's only way to the engine: Triton's gRPC streaming API (`ModelStreamInfer`).

Each request gets its own stream on one shared channel; Triton keeps doing the serving
(in-flight batching, metrics, tensor parallelism). Closing the stream early cancels the
request in Triton, which ends it in the engine and frees its KV blocks.

Inputs are sent with the dtypes the served model declares (read from its config once), and
only those it declares: a field the model lacks is refused with 400 rather than dropped.

A streamed error carries only a message (ModelStreamInferResponse has no status code; the
`triton_grpc_error` header that adds one crashes this tritonserver build, README "Soak
test"), so the HTTP status is read from it (`status_of`): the engine's "down" / queue-full
refusals are 503, exceptions caught inside the engine ("SomeError: ...") and errors after
output has started are 500, any other refusal before output is a bad input, 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferResult, model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor, triton_to_np_dtype

from triton_repo.client import STATS
from triton_repo.openai.protocol import APIError

UNAVAILABLE = ("engine is down", "max_queue_size", "is not ready", "unknown model", "is not found")
"""Triton / engine messages that mean "not now", not "bad request"."""
ENGINE_EXCEPTION = re.compile(r"^[A-Z][A-Za-z0-9_]*: ")
"""How the engine reports an exception it caught while serving a request (`runtime/faults.py`
`describe`: "ClassName: message"); refusals of bad input start with the input's name instead."""
DRAIN_TIMEOUT_S = 5.0
"""After the final response the stream is half-closed and Triton ends it; wait this long."""
GRPC_OPTIONS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]


def status_of(message: str, output_started: bool) -> int:
    if any(hint in message for hint in UNAVAILABLE):
        return 503
    if output_started or ENGINE_EXCEPTION.match(message):
        return 500
    return 400


def rpc_error(e: grpc.aio.AioRpcError) -> APIError:
    code = e.code()
    status = {
        grpc.StatusCode.UNAVAILABLE: 503,
        grpc.StatusCode.INVALID_ARGUMENT: 400,
        grpc.StatusCode.NOT_FOUND: 503,
        grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    }.get(code, 500)
    return APIError(status, f"Triton: {code.name}: {e.details()}", code="triton_unavailable" if status == 503 else None)


@dataclass
class Delta:
    """One Triton response of a request: new text, the log probability of each token it
    adds, and on the final one the finish reason and token counts."""

    text: str
    num_tokens: int | None
    """Output tokens so far (specpipe sends the running count on every response)."""
    log_probs: list[float] = field(default_factory=list)
    final: bool = False
    finish_reason: str | None = None
    stats: dict[str, int] = field(default_factory=dict)


def _output(result: InferResult, name: str) -> np.ndarray | None:
    value = result.as_numpy(name)
    return None if value is None else value.reshape(-1)


def parse_response(response: service_pb2.ModelInferResponse) -> Delta:
    result = InferResult(response)
    text = _output(result, "text_output")
    count = _output(result, "num_output_tokens")
    log_probs = _output(result, "output_log_probs")
    reason = _output(result, "finish_reason")
    return Delta(
        text=b"".join(text).decode("utf-8") if text is not None else "",
        num_tokens=int(count[0]) if count is not None and count.size else None,
        log_probs=[] if log_probs is None else [float(x) for x in log_probs],
        final=bool(response.parameters["triton_final_response"].bool_param),
        finish_reason=reason[0].decode() if reason is not None and reason.size else None,
        stats={name: int(v[0]) for name in STATS if (v := _output(result, name)) is not None and v.size},
    )


@dataclass(frozen=True)
class ModelInputs:
    """What the served model declares: its inputs' dtypes and shapes, whether it batches."""

    dtypes: dict[str, str]
    """Input name -> Triton dtype ("INT32", "BYTES", ...)."""
    lists: frozenset[str]
    """Inputs of variable length (dims [-1]): lists, not scalars."""
    batched: bool
    parameters: dict[str, str]

    @classmethod
    def of(cls, config: Any) -> ModelInputs:
        dtypes = {i.name: _dtype_name(i.data_type) for i in config.input}
        lists = frozenset(i.name for i in config.input if list(i.dims) == [-1])
        params = {k: v.string_value for k, v in config.parameters.items()}
        return cls(dtypes, lists, config.max_batch_size > 0, params)

    def request(self, model: str, fields: dict[str, tuple[str, Any]]) -> service_pb2.ModelInferRequest:
        """A streaming request for `fields` ({input: (request field, value)}); raises APIError
        (400) for a field the model does not declare or a value its dtype cannot hold."""
        request = service_pb2.ModelInferRequest(model_name=model)
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        for name, (param, value) in fields.items():
            if name not in self.dtypes:
                raise APIError(400, f"{param} is not supported by model {model!r} (it has no {name!r} input)", param)
            array = self._array(name, param, value)
            request.inputs.add(name=name, datatype=self.dtypes[name], shape=array.shape)  # data: raw, in order
            raw = serialize_byte_tensor(array).item() if self.dtypes[name] == "BYTES" else array.tobytes()
            request.raw_input_contents.append(raw)
        return request

    def _array(self, name: str, param: str, value: Any) -> np.ndarray:
        dtype = self.dtypes[name]
        values = list(value) if isinstance(value, list | tuple) else [value]
        if dtype == "BYTES":
            array = np.array([str(v).encode() for v in values], dtype=np.object_)
        else:
            np_dtype = triton_to_np_dtype(dtype)
            if np.issubdtype(np_dtype, np.integer):
                info = np.iinfo(np_dtype)
                bad = [v for v in values if not info.min <= v <= info.max]
                if bad:
                    raise APIError(400, f"{param} must be in [{info.min}, {info.max}] ({dtype}), got {bad[0]}", param)
            array = np.array(values, dtype=np_dtype)
        if name not in self.lists and array.size != 1:
            raise APIError(400, f"{param} must be a single value", param)
        return array[None] if self.batched else array


def _dtype_name(data_type: int) -> str:
    name = model_config_pb2.DataType.Name(data_type).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


class TritonBackend:
    """A gRPC channel to one Triton server and one of its models."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self._channel: grpc.aio.Channel | None = None
        self._inputs: ModelInputs | None = None

    @property
    def stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        if self._channel is None:  # made on first use, inside the server's event loop
            self._channel = grpc.aio.insecure_channel(self.url, options=GRPC_OPTIONS)
        return service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def ready(self) -> bool:
        try:
            live = await self.stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=2)
            model = await self.stub.ModelReady(service_pb2.ModelReadyRequest(name=self.model), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return bool(live.ready and model.ready)

    async def inputs(self) -> ModelInputs:
        """The model's inputs, read once it is there; APIError (503) until then."""
        if self._inputs is None:
            try:
                response = await self.stub.ModelConfig(service_pb2.ModelConfigRequest(name=self.model), timeout=10)
            except grpc.aio.AioRpcError as e:
                raise rpc_error(e) from None
            self._inputs = ModelInputs.of(response.config)
        return self._inputs

    async def generate(self, request: service_pb2.ModelInferRequest) -> AsyncIterator[Delta]:
        """The request's responses as Deltas, up to the final one. Raises APIError for an
        error response or a failed stream. Closing the generator early (the HTTP client went
        away) cancels the stream, and with it the request in Triton."""
        sent = asyncio.Event()

        async def requests() -> AsyncIterator[service_pb2.ModelInferRequest]:
            yield request
            await sent.wait()  # keep the stream open until the final response; then half-close

        call = self.stub.ModelStreamInfer(requests())
        finished = started = False
        try:
            async for response in call:
                if response.error_message:
                    finished = True
                    raise APIError(status_of(response.error_message, started), response.error_message)
                delta = parse_response(response.infer_response)
                started = started or bool(delta.text or delta.num_tokens)
                finished = delta.final
                yield delta
                if finished:
                    break
            if not finished:
                raise APIError(502, "Triton ended the stream before the request's final response")
        except grpc.aio.AioRpcError as e:
            finished = True
            raise rpc_error(e) from None
        finally:
            sent.set()
            if finished:
                with contextlib.suppress(asyncio.TimeoutError, grpc.aio.AioRpcError):
                    await asyncio.wait_for(_drain(call), DRAIN_TIMEOUT_S)
            call.cancel()  # a no-op once Triton has ended the stream


async def _drain(call: Any) -> None:
    async for _ in call:
        pass
