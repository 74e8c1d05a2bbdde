"""`python -m minivllm.serve`: an OpenAI-compatible HTTP server over `AsyncLLM`, as `vllm serve` is.

    python -m minivllm.serve Qwen/Qwen3-0.6B --port 8000  # a Hub id (or --model ID), as vllm serve
    python -m minivllm.serve --model path/to/Qwen3-0.6B    # a checkpoint folder; or --preset tiny
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "Qwen/Qwen3-0.6B", "prompt": "Once upon a time", "max_tokens": 16}'

The model is served under the name it was given by (the id, the folder or the preset), or
--served-model-name. An id's snapshot comes from the Hub cache (HF_HUB_CACHE, or --download-dir),
downloaded the first time; HF_HUB_OFFLINE=1 uses the cache alone; a folder of the id's name wins. A
model that cannot be had or loaded is one line, exit code 2. Every argument of `LLM(...)` is a flag,
as in `vllm serve` (the "engine" flags below, one per field of Config): `--max-num-seqs 64
--no-enable-prefix-caching --dtype float32`. With --api-key KEY (or MINIVLLM_API_KEY), every request
but /health and /version must send `Authorization: Bearer KEY` (OpenAI's clients send their api_key
so).

Endpoints: `/v1/completions` and `/v1/chat/completions` (streaming with `"stream": true`, as
server-sent events ending in `data: [DONE]`), `/v1/models`, `/health`, `/version`. A bad request
gets status 400 and OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, with
the offending field in `param` and in the message: checked here, before the engine sees the request
(strict int64 integers, token ids in the vocabulary, float32-safe top_p and repetition_penalty,
max_tokens within max_model_len, one prompt per request, OpenAI fields not implemented here).
`"stream_options": {"include_usage": true}` ends a stream with a chunk holding the usage and no
choices.

Operations, as vLLM's: `/metrics` answers in Prometheus' text format with vLLM's names
(vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc, the histograms
vllm:time_to_first_token_seconds and vllm:time_per_output_token_seconds, the counters
vllm:prompt_tokens_total, vllm:generation_tokens_total and vllm:request_success_total). With
--max-queued-requests N, a request that finds N in flight gets 503 and `Retry-After: 1`. A client
that disconnects aborts its request, streaming or not: its KV blocks are freed at once. At most n =
128 completions per request (400 beyond), and a body of 10 MiB (413 beyond: from its Content-Length
before it is read, or as it is read). A stream ends with its last token and `data: [DONE]`, or with
an event in OpenAI's error shape saying why it stopped (the engine core died, or the reply could not
be made). A large reply (many completions, log-probabilities) is encoded to JSON on a worker thread:
the event loop serves the others meanwhile. --timeout-keep-alive (default 30 s) is how long an idle
connection stays open: well above clients' own expiry (httpx's and OpenAI's client's: 5 s), so that
the client closes it, never the server as a request goes out on it.
"""

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import HTTPException as FastAPIHTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import minivllm
from minivllm.async_llm import AsyncLLM, EngineDeadError
from minivllm.checkpoint import checkpoint_for
from minivllm.engine_args import add_engine_args, engine_kwargs
from minivllm.llm import chat_prompt
from minivllm.models.hub import load_error_line
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# An integer field: a JSON integer (not true, 5.0 or "5": strict) that fits the engine's int64
# tensors.
Int64 = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]
# OpenAI fields we do not implement, with the values that mean "off" (those we accept, as clients
# send defaults).
UNSUPPORTED = {
    "logit_bias": (None, {}),
    "echo": (None, False),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
}
MAX_N = 128  # completions per request: each is a sequence in the batch, with its own KV blocks
# a request body beyond this is refused (413) before it is read whole
MAX_REQUEST_BYTES = 10 * 2**20
# the routes --max-queued-requests limits
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
# Seconds an idle kept-alive connection stays open. uvicorn's default, 5, is httpx's keep-alive
# expiry too: a request sent on a connection as its 5 s ran out met the server closing it, and got
# no reply. Clients must be the ones that close.
KEEP_ALIVE_S = 30
LARGE_REPLY = 4096  # tokens and top log-probabilities: a reply beyond is encoded off the event loop
# vLLM's histogram buckets, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
# The engine's load, read from AsyncLLM.stats() at each scrape: (metric, key, its help).
GAUGES = (
    (
        "vllm:num_requests_running",
        "num_requests_running",
        "Sequences running on the engine (one per completion).",
    ),
    (
        "vllm:num_requests_waiting",
        "num_requests_waiting",
        "Sequences waiting for the engine (one per completion).",
    ),
    (
        "vllm:kv_cache_usage_perc",
        "kv_cache_usage",
        "KV-cache usage: the fraction of blocks in use (1 is full).",
    ),
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False  # a last chunk, before [DONE], with the usage and no choices


class SamplingRequest(BaseModel):
    """The sampling fields both endpoints share, with OpenAI's names and defaults."""

    # OpenAI clients send fields we do not use (user, ...)
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: Int64 | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int64 = -1  # vLLM's extensions of the API
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: Int64 = 0
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    seed: Int64 | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    # Refused unless "off" (see UNSUPPORTED): named here so that they are not silently dropped with
    # the unknown ones.
    logit_bias: Any = None
    echo: Any = None
    suffix: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    best_of: Any = None


class CompletionRequest(SamplingRequest):
    # a string or a list of token ids, checked by `prompt_of` (pydantic's union would coerce or
    # blur)
    prompt: Any
    logprobs: Int64 | None = (
        None  # per token: its log-probability and this many most likely tokens'
    )


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None  # None: until the reply stops or fills max_model_len
    max_completion_tokens: Int64 | None = None  # the chat API's newer name for max_tokens
    logprobs: bool = False  # per token: its log-probability ...
    top_logprobs: Int64 | None = None  # ... and this many most likely tokens'


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, param: str | None, status: int) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"message": message, "type": kind, "param": param, "code": None}


def error(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": error_body(message, param, status)}, status_code=status)


SAMPLING_FIELDS = {field.name for field in dataclasses.fields(SamplingParams)} - {
    "max_tokens",
    "logprobs",
}


def sampling_params(
    request: SamplingRequest, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """The request's SamplingParams; BadRequest naming the field when SamplingParams refuses a
    value."""
    # the request's fields that SamplingParams has too
    fields = request.model_dump(include=SAMPLING_FIELDS)
    try:
        params = SamplingParams(
            **fields, max_tokens=16 if max_tokens is None else max_tokens, logprobs=logprobs
        )
    except (
        ValueError
    ) as e:  # SamplingParams names the field first: "temperature must be >= 0, got -1"
        raise BadRequest(str(e), str(e).split()[0]) from e
    return params


def check_text(request: BaseModel) -> None:
    """BadRequest naming the field if a string in it is not Unicode text: JSON's "\\ud800", a lone
    surrogate, parses to a str that the tokenizer and UTF-8 cannot take."""

    def walk(value: Any) -> bool:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return False
            return True
        if isinstance(value, BaseModel):
            value = dict(value)
        if isinstance(value, dict):
            return all(walk(k) and walk(v) for k, v in value.items())
        if isinstance(value, list | tuple):
            return all(map(walk, value))
        return True

    for name, value in request:
        if not walk(value):
            raise BadRequest(
                f"{name} is not valid Unicode text (a lone surrogate such as \\ud800)", name
            )


def check_unsupported(request: SamplingRequest) -> None:
    """BadRequest naming an OpenAI field we do not implement, unless it holds the value that turns
    it off."""
    for name, off in UNSUPPORTED.items():
        value = getattr(request, name)
        if not any(value == o and type(value) is type(o) for o in off):
            raise BadRequest(f"{name} is not supported by this server", name)
    if request.best_of is not None and (
        type(request.best_of) is not int or request.best_of != request.n
    ):
        raise BadRequest(
            f"best_of is not supported by this server (only best_of = n = {request.n})", "best_of"
        )
    if request.stream_options is not None and not request.stream:
        raise BadRequest("stream_options is only allowed with stream set to true", "stream_options")


def prompt_of(prompt: Any) -> str | list[int]:
    """The completion request's prompt: a string or a list of token ids; BadRequest naming `prompt`
    otherwise."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise BadRequest(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt"
        )
    # OpenAI's batch: ["a", "b"] or [[1, 2], [3]]
    if prompt and all(isinstance(p, str | list) for p in prompt):
        raise BadRequest(
            "prompt: a list of prompts is not supported; send one prompt per request", "prompt"
        )
    for i, token in enumerate(prompt):
        if type(token) is not int:  # JSON's true, 5.0 and "5" are not token ids
            raise BadRequest(
                f"prompt[{i}] must be an integer token id, got {json.dumps(token)}", "prompt"
            )
        if not -(2**63) <= token < 2**63:
            raise BadRequest(f"prompt[{i}] = {token} does not fit int64", "prompt")
    return prompt


class RequireKey:
    """ASGI middleware: every request but OPEN_ROUTES must send `Authorization: Bearer KEY`, else a
    401 before anything else reads it (vLLM's --api-key). compare_digest takes as long for a near
    miss as for a far one."""

    OPEN_ROUTES = ("/health", "/version")

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN_ROUTES:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = "a valid API key is needed: send the header `Authorization: Bearer KEY`"
                return await error(message, status=401)(scope, receive, send)
        await self.app(scope, receive, send)


class Metrics(Collector):
    """The server's Prometheus metrics, with vLLM's names, in a registry of its own (several servers
    can share a process). The engine's load is read at each scrape; the rest is counted as each
    request finishes."""

    def __init__(self, llm: AsyncLLM, model_name: str):
        self.llm, self.model_name = llm, model_name
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.ttft = self.histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.tpot = self.histogram(
            "vllm:time_per_output_token_seconds", "Time per token after the first.", TPOT_BUCKETS
        )
        self.prompt_tokens = self.counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests."
        )
        self.generation_tokens = self.counter(
            "vllm:generation_tokens", "Tokens generated by finished requests."
        )
        self.success = self.counter("vllm:request_success", "Requests that ran to their end.")

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["model_name"], registry=self.registry, buckets=buckets).labels(
            self.model_name
        )

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.llm.stats()
        for name, key, doc in GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], stats[key])
            yield gauge

    def finished(self, out: RequestOutput) -> None:
        """Count a request that ran to its end (not one whose client left)."""
        num_tokens = [len(c.token_ids) for c in out.outputs]
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(num_tokens))
        self.success.inc()
        if (ttft := out.metrics.time_to_first_token) is not None:
            self.ttft.observe(ttft)
        # n completions step together
        if (tpot := out.metrics.time_per_output_token(max(num_tokens))) is not None:
            self.tpot.observe(tpot)


class Limits:
    """ASGI middleware: a request body over MAX_REQUEST_BYTES gets a 413, from its Content-Length
    before anything is read, or while it is read if it has none; with `max_in_flight`, a request to
    generate while that many are in flight (from their arrival until their reply or stream ends)
    gets a 503 and Retry-After: retry, or elsewhere."""

    def __init__(self, app: ASGIApp, max_in_flight: int | None):
        self.app, self.max_in_flight = app, max_in_flight
        self.num_in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if int(dict(scope["headers"]).get(b"content-length", 0)) > MAX_REQUEST_BYTES:
            return await error(too_large(), status=413)(scope, receive, send)
        if scope["path"] not in GENERATE_PATHS:
            return await self.app(scope, capped(receive), send)
        if self.max_in_flight is not None and self.num_in_flight >= self.max_in_flight:
            message = (
                f"the server is busy: {self.num_in_flight} requests in flight, its limit; "
                f"retry later"
            )
            response = error(message, status=503)
            response.headers["Retry-After"] = "1"
            return await response(scope, receive, send)
        self.num_in_flight += 1
        try:
            await self.app(scope, capped(receive), send)
        finally:
            self.num_in_flight -= 1


def too_large() -> str:
    return f"the request body is larger than this server's limit of {MAX_REQUEST_BYTES} bytes"


def capped(receive: Receive) -> Receive:
    """receive, raising a 413 (FastAPI's route answers it) once the body read exceeds
    MAX_REQUEST_BYTES."""
    received = 0

    async def receive_capped() -> Message:
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > MAX_REQUEST_BYTES:
            raise FastAPIHTTPException(413, too_large())
        return message

    return receive_capped


async def disconnected(raw: Request) -> None:
    """Return once the client has gone: its body has been read, so all the ASGI server can send is
    http.disconnect."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def wait_output(
    outputs: AsyncGenerator[RequestOutput, None], raw: Request, last: bool
) -> RequestOutput | None:
    """The request's last output if `last`, else its next one (a stream's first, before its events);
    None if its client disconnects first, queued or running: the request is aborted then (closing
    `outputs` frees its blocks), not run on to its end for nobody, as vLLM does."""

    async def wait() -> RequestOutput:
        while not (out := await anext(outputs)).finished and last:
            pass
        return out

    waiting, gone = asyncio.create_task(wait()), asyncio.create_task(disconnected(raw))
    try:
        await asyncio.wait([waiting, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        # done with it; or the client left (or this handler was cancelled): abort
        if last or not waiting.done():
            waiting.cancel()
            await asyncio.wait([waiting])
            await outputs.aclose()
    return None if waiting.cancelled() else waiting.result()


class Server:
    """The routes over one AsyncLLM, serving under the name `model_name`; with `api_key`, only to
    who sends it; with `max_queued_requests`, a 503 to a request that finds that many in flight."""

    def __init__(
        self,
        llm: AsyncLLM,
        model_name: str,
        api_key: str | None = None,
        max_queued_requests: int | None = None,
    ):
        self.llm, self.model_name = llm, model_name
        self.metrics = Metrics(llm, model_name)
        self.app = FastAPI(title="minivllm")
        self.app.add_middleware(Limits, max_in_flight=max_queued_requests)
        if api_key:  # added last: it runs first
            self.app.add_middleware(RequireKey, key=api_key)
        handler = self.app.add_exception_handler
        handler(RequestValidationError, self.invalid)  # type: ignore[arg-type]
        handler(BadRequest, self.bad_request)  # type: ignore[arg-type]
        self.app.add_exception_handler(HTTPException, self.http_error)  # type: ignore[arg-type]
        self.app.add_exception_handler(EngineDeadError, self.engine_dead)  # type: ignore[arg-type]
        self.app.get("/health")(self.health)
        self.app.get("/version")(self.version)
        self.app.get("/metrics")(self.scrape)
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.chat_completions)

    async def invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        # its loc: ("body", field, ...); a union type adds the variant tried, e.g. "str"
        first = exc.errors()[0]
        if first["type"] == "json_invalid":  # loc: ("body", the offset)
            detail = first.get("ctx", {}).get("error", first["msg"])
            return error(
                f"the request body is not valid JSON: {detail} (at character {first['loc'][-1]})"
            )
        if tuple(first["loc"]) == ("body",):  # no body, or not a JSON object
            return error("the request body must be a JSON object")
        loc = first["loc"]
        param = str(loc[1] if len(loc) > 1 else loc[0])
        return error(f"{param}: {first['msg']}", param)

    async def bad_request(self, request: Request, exc: BadRequest) -> JSONResponse:
        return error(str(exc), exc.param)

    async def http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        """FastAPI's own errors in OpenAI's shape: a body it cannot parse (not UTF-8, say), an
        unknown route."""
        if exc.status_code == 400:
            return error("the request body is not valid JSON in UTF-8")
        return error(str(exc.detail), status=exc.status_code)

    async def engine_dead(self, request: Request, exc: EngineDeadError) -> JSONResponse:
        # every request fails at once, none waits: restart the server
        return error(str(exc), status=503)

    async def health(self) -> JSONResponse:
        """200 while the engine can run requests; 503 once its thread has died (a load balancer
        takes it out)."""
        return (
            JSONResponse({})
            if self.llm.is_healthy()
            else error("the engine has died: restart the server", status=503)
        )

    async def version(self) -> dict:
        return {"version": minivllm.__version__}

    async def scrape(self) -> Response:
        """Prometheus' text format: the engine core's load as of its last message, and the counts
        here."""
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "owned_by": "minivllm"}],
        }

    def check_model(self, request: SamplingRequest) -> None:
        if request.model != self.model_name:
            raise BadRequest(
                f"model {request.model!r} is not served here; this server serves "
                f"{self.model_name!r}",
                "model",
            )

    def check_request(self, request: SamplingRequest) -> None:
        """What every request must pass before its prompt is looked at."""
        check_text(request)
        self.check_model(request)
        check_unsupported(request)
        if request.n > MAX_N:
            raise BadRequest(
                f"n must be at most {MAX_N} (this server's limit), got {request.n}", "n"
            )

    async def token_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """The prompt as token ids, as the engine would make them (tokenizing in a thread: a long
        prompt takes time)."""
        try:
            return await asyncio.to_thread(self.llm.input_processor.tokenize, prompt, param)
        except ValueError as e:  # text for a model with no tokenizer
            raise BadRequest(str(e), param) from e

    def max_tokens(
        self, given: int | None, param: str, prompt_len: int, default: int | None
    ) -> int:
        """The request's max_tokens: >= 1, and within what max_model_len leaves after the prompt
        (vLLM's rule). Not given: `default`, or None for all that is left. A prompt with no room
        left is the engine's 400."""
        room = self.llm.config.max_model_len - prompt_len
        if given is None:
            return max(1, room) if default is None else default
        if given < 1:
            raise BadRequest(f"{param} must be >= 1, got {given}", param)
        if 0 < prompt_len and 0 < room < given:
            message = (
                f"{param} is {given}, but the prompt has {prompt_len} tokens and max_model_len is "
                f"{self.llm.config.max_model_len}: at most {room} tokens can follow it"
            )
            raise BadRequest(message, param)
        return given

    async def completions(self, request: CompletionRequest, raw: Request):
        self.check_request(request)
        token_ids = await self.token_ids(prompt_of(request.prompt), "prompt")
        max_tokens = self.max_tokens(request.max_tokens, "max_tokens", len(token_ids), 16)
        params = sampling_params(request, max_tokens, request.logprobs)
        return await self.respond(token_ids, params, request, raw, "cmpl", completion_choice)

    async def chat_completions(self, request: ChatRequest, raw: Request):
        self.check_request(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
        conversation = [message.model_dump() for message in request.messages]
        try:
            prompt = chat_prompt(self.llm.tokenizer, conversation, self.model_name)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from e
        token_ids = await self.token_ids(prompt, "messages")
        given, param = request.max_completion_tokens, "max_completion_tokens"  # the newer name wins
        if given is None:
            given, param = request.max_tokens, "max_tokens"
        max_tokens = self.max_tokens(given, param, len(token_ids), None)
        params = sampling_params(
            request, max_tokens, (request.top_logprobs or 0) if request.logprobs else None
        )
        return await self.respond(token_ids, params, request, raw, "chatcmpl", chat_choice)

    async def respond(
        self,
        prompt,
        params: SamplingParams,
        request: SamplingRequest,
        raw: Request,
        kind: str,
        choice,
    ):
        """Run the request; the whole reply, or a stream of server-sent events. Bad input: 400
        before any event. A client that leaves aborts its request, streaming or not."""
        request_id = f"{kind}-{uuid.uuid4().hex}"
        outputs = self.llm.generate(prompt, params, request_id)
        try:  # add_request's checks run as `outputs` starts: a ValueError is still a 400
            out = await wait_output(outputs, raw, last=not request.stream)
        except (
            ValueError
        ) as e:  # the engine's checks: "prompt is empty", "stop_token_ids: token id ... is outside"
            # a sampling field the message begins with, else the prompt's
            named = str(e).split(":")[0]
            param = (
                named if named in SAMPLING_FIELDS else "prompt" if kind == "cmpl" else "messages"
            )
            raise BadRequest(str(e) if str(e).startswith(param) else f"{param}: {e}", param) from e
        if out is None:  # the client left; nobody will read this: nginx's "client closed request"
            return error("the client disconnected", status=499)
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if not request.stream:
            self.metrics.finished(out)
            head["object"] = "text_completion" if kind == "cmpl" else "chat.completion"
            encode = partial(encode_reply, head, out, partial(choice, top=params.logprobs))
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            if num_tokens * (1 + (params.logprobs or 0)) > LARGE_REPLY:  # megabytes, maybe
                return json_reply(await asyncio.to_thread(encode))  # the loop serves on meanwhile
            return json_reply(encode())
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        events = self.events(
            head, kind, out, outputs, partial(choice, top=params.logprobs), include_usage
        )
        return StreamingResponse(events, media_type="text/event-stream")

    async def events(
        self,
        head: dict,
        kind: str,
        first: RequestOutput,
        outputs: AsyncGenerator[RequestOutput, None],
        choice,
        include_usage: bool = False,
    ) -> AsyncIterator[str]:
        """After each output, one event per completion that changed, with what it added since its
        last event (text, and log-probabilities if asked); with include_usage (OpenAI's
        stream_options), one more with no choices and the usage (the others then carry "usage":
        null); then `data: [DONE]`. If the request fails midway (the engine core died, a failed step
        aborted it, or an event could not be made), an event with OpenAI's error shape saying why,
        and no [DONE]: never a connection cut short. If the client goes away, Starlette stops
        iterating: closing `outputs` aborts the request and frees its blocks."""
        object_name = "text_completion" if kind == "cmpl" else "chat.completion.chunk"
        sent: list[tuple[str, int, str | None]] = [("", 0, None)] * len(
            first.outputs
        )  # text, tokens, finish
        extra = {"usage": None} if include_usage else {}
        try:
            last: RequestOutput = first
            out: RequestOutput | None = first
            while out is not None:
                last = out
                for c in out.outputs:
                    text, num_tokens, reason = sent[c.index]
                    if (c.text, len(c.token_ids), c.finish_reason) == (text, num_tokens, reason):
                        continue
                    # a decode that changed its mind
                    delta = c.text[len(text) :] if c.text.startswith(text) else c.text
                    sent[c.index] = (c.text, len(c.token_ids), c.finish_reason)
                    event = {
                        **head,
                        "object": object_name,
                        "choices": [choice(c, delta, num_tokens)],
                        **extra,
                    }
                    yield f"data: {json.dumps(event)}\n\n"
                out = await anext(outputs, None)
            self.metrics.finished(last)
            if include_usage:
                tail = {**head, "object": object_name, "choices": [], "usage": usage(last)}
                yield f"data: {json.dumps(tail)}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as e:  # not the client leaving (CancelledError, GeneratorExit): say why
            yield f"data: {json.dumps({'error': error_body(failure(e), None, 500)})}\n\n"
        finally:
            await outputs.aclose()


def failure(e: Exception) -> str:
    """Why a stream stopped, for its client: the engine's errors say it (the core died, a step
    failed: its RuntimeErrors); anything else is a fault here, logged, and named by its type."""
    if type(e) is RuntimeError or isinstance(e, EngineDeadError):
        return str(e)
    logger.error("minivllm: a stream failed", exc_info=e)
    return f"the server failed to make the stream: {type(e).__name__}: {e}"


def encode_reply(head: dict, out: RequestOutput, choice) -> bytes:
    """A whole (not streamed) reply as JSON: its choices, built here, and the usage."""
    choices = [choice(c, None, 0) for c in out.outputs]
    return json.dumps({**head, "choices": choices, "usage": usage(out)}).encode()


def json_reply(body: bytes) -> Response:
    return Response(body, media_type="application/json")


def top_entries(c: CompletionOutput, start: int, top: int) -> list[tuple[Logprob, list[Logprob]]]:
    """From token `start` on: each token's Logprob, and the `top` most likely tokens' (its own among
    them or not)."""
    rows = zip(c.token_ids[start:], (c.logprobs or [])[start:])
    return [(row[token], sorted(row.values(), key=lambda lp: lp.rank)[:top]) for token, row in rows]


def completion_choice(c: CompletionOutput, delta: str | None, start: int, top: int | None) -> dict:
    """A choice of /v1/completions: the text (or what it added), and OpenAI's legacy logprobs if
    asked."""
    logprobs = None
    if top is not None:
        entries = top_entries(c, start, top)
        tops = [{t.decoded_token: t.logprob for t in row} for _, row in entries]
        logprobs = {
            "tokens": [lp.decoded_token for lp, _ in entries],
            "token_logprobs": [lp.logprob for lp, _ in entries],
            "top_logprobs": tops,
        }
    text = c.text if delta is None else delta
    return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}


def chat_logprob(lp: Logprob) -> dict:
    return {
        "token": lp.decoded_token,
        "logprob": lp.logprob,
        "bytes": list(lp.decoded_token.encode()),
    }


def chat_choice(c: CompletionOutput, delta: str | None, start: int, top: int | None) -> dict:
    """A choice of /v1/chat/completions: the message (or, streaming, its delta), and logprobs if
    asked."""
    logprobs = None
    if top is not None:
        entries = top_entries(c, start, top)
        logprobs = {
            "content": [
                chat_logprob(lp) | {"top_logprobs": list(map(chat_logprob, tops))}
                for lp, tops in entries
            ]
        }
    key, content = ("message", c.text) if delta is None else ("delta", delta)
    message = {"role": "assistant", "content": content}
    return {"index": c.index, key: message, "logprobs": logprobs, "finish_reason": c.finish_reason}


def usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


@contextmanager
def serve_in_thread(
    llm: AsyncLLM,
    model_name: str,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    timeout_keep_alive: int = KEEP_ALIVE_S,
) -> Iterator[str]:
    """The server over `llm` on a free port of 127.0.0.1, in a thread of this process (tests,
    benchmarks, the notebook), until the block ends; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server(llm, model_name, api_key, max_queued_requests)
    config = uvicorn.Config(server.app, log_level="warning", timeout_keep_alive=timeout_keep_alive)
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not http.started and time.monotonic() < deadline:
        time.sleep(0.05)
    if not http.started:
        raise RuntimeError("the server did not start within 60 s")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        http.should_exit = True
        thread.join(timeout=30)


def server_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser, and the engine fields it has flags for: all of LLM's (Config's fields)."""
    parser = argparse.ArgumentParser(
        prog="python -m minivllm.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="a Hub id (ORG/NAME) or a checkpoint folder"
    )
    source.add_argument("--model", help="the same, as a flag")
    source.add_argument("--preset", help="a random-weight preset, e.g. tiny or qwen3-0.6b")
    parser.add_argument(
        "--served-model-name", help="the name clients ask for (default: MODEL, --model or --preset)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-queued-requests", type=int, help="503 to a request finding this many in flight"
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=KEEP_ALIVE_S,
        metavar="SECONDS",
        help="how long an idle connection stays open (default: %(default)s; uvicorn's: 5). Keep "
        "it well above clients' keep-alive expiry (httpx's, OpenAI's client's: 5 s): at equal "
        "times, a request sent on a reused connection as the server closed it got no reply",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MINIVLLM_API_KEY"),
        help="the key every request but /health and /version must send, as `Authorization: Bearer "
        "KEY` "
        "(default: $MINIVLLM_API_KEY; none: no key is asked for)",
    )
    return parser, add_engine_args(parser)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser, engine_fields = server_parser()
    args = parser.parse_args(argv)
    given = args.model_tag or args.model
    model = given or str(checkpoint_for(args.preset))
    kwargs = engine_kwargs(args, engine_fields)
    try:
        llm = AsyncLLM(model, **kwargs)
    except (
        ValueError,
        OSError,
    ) as e:  # no such id or folder, gated, offline and not cached, .bin weights, ...
        parser.exit(
            2, f"{parser.prog}: error: {load_error_line(e, model, kwargs.get('tokenizer'))}\n"
        )
    name = args.served_model_name or given or args.preset
    server = Server(llm, name, args.api_key, args.max_queued_requests)
    # uvicorn shuts down, then re-raises it: as Ctrl-C
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        keep_alive = args.timeout_keep_alive
        uvicorn.run(server.app, host=args.host, port=args.port, timeout_keep_alive=keep_alive)
    except KeyboardInterrupt:
        pass
    finally:
        llm.close()  # stops the engine core's process


if __name__ == "__main__":
    main()
