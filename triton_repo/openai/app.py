"""The OpenAI-compatible HTTP API (FastAPI), forwarding every request to Triton over gRPC.

    GET  /v1/models, /v1/models/{id}, /health/ready
    POST /v1/completions, /v1/chat/completions   (stream: server-sent events, `data: [DONE]`)

A request is turned into the served model's Triton inputs (`protocol.py`), streamed from
Triton (`triton_backend.py`), and turned back into OpenAI's response shapes here. A
streamed response starts only once Triton's first response is in, so a refused request gets
its HTTP status (400 / 503) even with `stream: true`. If the HTTP client goes away, the
Triton stream is closed, which cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send
from tokenizers import Tokenizer

from triton_repo.openai.chat import TOKENIZER_CONFIG_FILE, ChatTemplate, no_template
from triton_repo.openai.protocol import APIError, ChatRequest, CompletionRequest, GenerationRequest
from triton_repo.openai.responses import ChatFormat, CompletionFormat, Format, Reply
from triton_repo.openai.triton_backend import Delta, ModelInputs, TritonBackend

T = TypeVar("T")


@dataclass
class ServerState:
    backend: TritonBackend
    default_max_tokens: int = 16
    """max_tokens when a request sets none (OpenAI's completions default)."""
    engine_dir: Path | None = None
    """For the tokenizer and chat template; None: the served model's `engine_dir` parameter,
    if that directory is on this machine."""
    chat_template_file: Path | None = None
    """A Jinja file that replaces the engine's chat template."""
    created: int = field(default_factory=lambda: int(time.time()))
    chat: ChatTemplate | None = None
    tokenizer: Tokenizer | None = None
    _resolved: bool = False

    @property
    def model(self) -> str:
        return self.backend.model

    async def inputs(self) -> ModelInputs:
        inputs = await self.backend.inputs()
        if not self._resolved:
            self._resolve(inputs)
        return inputs

    def _resolve(self, inputs: ModelInputs) -> None:
        """Tokenizer and chat template, from the engine directory once it is known."""
        self._resolved = True
        engine = self.engine_dir or Path(inputs.parameters.get("engine_dir") or "/nonexistent")
        if (engine / "config.json").is_file():  # runtime/engine_dir.py's format, read without importing torch
            tokenizer = engine / json.loads((engine / "config.json").read_text()).get("tokenizer", "tokenizer.json")
            self.tokenizer = Tokenizer.from_file(str(tokenizer))
        self.chat = ChatTemplate.from_tokenizer_config(engine / TOKENIZER_CONFIG_FILE)
        if self.chat_template_file is not None:
            base = self.chat or ChatTemplate.from_source("")
            source = self.chat_template_file.read_text()
            self.chat = ChatTemplate.from_source(source, base.bos_token, base.eos_token)

    def check_model(self, model: str) -> None:
        if model != self.model:
            raise APIError(404, f"The model `{model}` does not exist (this server has {self.model!r})", "model",
                           "model_not_found")  # fmt: skip


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator however the response ends (a client that went away
    included), so the Triton stream under it is always closed at once."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) if the client leaves first."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
    if task.cancelled():
        raise ClientGone
    return task.result()


def sse(doc: dict[str, Any] | str) -> str:
    return f"data: {doc if isinstance(doc, str) else json.dumps(doc)}\n\n"


async def stream_events(reply: Reply, first: Delta, deltas: AsyncIterator[Delta]) -> AsyncIterator[str]:
    """Server-sent events: one chunk per Triton response, then `data: [DONE]`. An error after
    the response has started is sent as an `{"error": ...}` event."""
    try:
        extra = {"usage": None} if reply.body.include_usage else {}
        for choice in reply.fmt.start():
            yield sse(reply.envelope(reply.fmt.chunk_object, [choice], **extra))
        delta = first
        while True:
            for chunk in reply.chunks(delta):
                yield sse(chunk)
            if delta.final:
                break
            delta = await anext(deltas)
    except APIError as e:
        yield sse(e.body())
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]
    yield sse("[DONE]")


async def generate(request: Request, state: ServerState, body: GenerationRequest, prompt: str, fmt: Format) -> Response:
    """Send the request to Triton and answer it, streamed or whole."""
    inputs = await state.inputs()
    fields = {
        "text_input": ("messages" if isinstance(body, ChatRequest) else "prompt", prompt),
        "stream": ("stream", True),
    }
    fields |= body.triton_fields(state.default_max_tokens)
    if fmt.logprobs is not None:
        fields["return_log_probs"] = ("logprobs", True)
    deltas = state.backend.generate(inputs.request(state.model, fields))
    reply = Reply(body, fmt)
    try:
        try:
            first = await until_disconnected(request, anext(deltas))
        except APIError as e:  # Triton refused it: its message names the input
            word = re.match(r"\w+", e.message)
            e.param = e.param or next((p for n, (p, _) in fields.items() if word and word[0] in (n, p)), None)
            raise
        if body.stream:
            return ClosingStreamingResponse(stream_events(reply, first, deltas), media_type="text/event-stream")
        received = [first]
        if not first.final:
            received += await until_disconnected(request, _rest(deltas))
    except BaseException:
        await deltas.aclose()  # type: ignore[attr-defined]
        raise
    return JSONResponse(reply.full(received))


async def _rest(deltas: AsyncIterator[Delta]) -> list[Delta]:
    out = []
    async for delta in deltas:
        out.append(delta)
        if delta.final:
            break
    return out


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def validation_error(e: RequestValidationError) -> APIError:
    """Pydantic's first complaint as OpenAI's 400."""
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param)
    if err.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})")
    return APIError(400, f"{param}: {err['msg']}" if param else str(err["msg"]), param)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await state.backend.close()

    app = FastAPI(title="specpipe OpenAI-compatible API", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(e))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException) -> JSONResponse:
        return error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    def model_card() -> dict[str, Any]:
        return {"id": state.model, "object": "model", "created": state.created, "owned_by": "specpipe"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return model_card()

    @app.get("/health/ready")
    async def ready() -> Response:
        if await state.backend.ready():
            return Response(status_code=200)
        return error_response(APIError(503, f"Triton at {state.backend.url} or model {state.model!r} is not ready"))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        body.check()
        await state.inputs()  # finds the tokenizer
        fmt = CompletionFormat(body.logprobs, state.tokenizer)
        return await generate(request, state, body, body.prompt_text(), fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        state.check_model(body.model)
        body.check()
        await state.inputs()  # finds the chat template and the tokenizer
        if state.chat is None:
            raise no_template(state.model)
        prompt = state.chat.render([{"role": m.role, "content": m.text()} for m in body.messages])
        fmt = ChatFormat(0 if body.logprobs else None, state.tokenizer)
        return await generate(request, state, body, prompt, fmt)

    return app
