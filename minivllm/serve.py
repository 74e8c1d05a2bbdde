"""`python -m minivllm.serve`: an OpenAI-compatible HTTP server over `AsyncLLM`, as `vllm serve` is.

    python -m minivllm.serve Qwen/Qwen3-0.6B --port 8000       # a Hub id (or --model ID), as `vllm serve ID`
    python -m minivllm.serve --model path/to/Qwen3-0.6B         # a checkpoint folder; or --preset tiny
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "Qwen/Qwen3-0.6B", "prompt": "Once upon a time", "max_tokens": 16}'

The model is served under the name it was given by (the id, the folder or the preset), or --served-model-name. An
id's snapshot comes from the Hub cache (HF_HUB_CACHE, or --download-dir), downloaded the first time; HF_HUB_OFFLINE=1
uses the cache alone; a folder of the id's name wins. A model that cannot be had or loaded is one line, exit code 2.

Endpoints: `/v1/completions` and `/v1/chat/completions` (streaming with `"stream": true`, as server-sent events
ending in `data: [DONE]`), `/v1/models`, `/health`. A bad request gets status 400 and OpenAI's error shape,
`{"error": {"message", "type", "param", "code"}}`, with the offending field in `param` and in the message.
"""

import argparse
import dataclasses
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from minivllm.async_llm import AsyncLLM
from minivllm.checkpoint import checkpoint_for
from minivllm.llm import chat_prompt
from minivllm.models.hub import load_error_line
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams


class SamplingRequest(BaseModel):
    """The sampling fields both endpoints share, with OpenAI's names and defaults."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, ...)
    model: str
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # vLLM's extensions of the API
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None
    n: int = 1
    stream: bool = False
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    logprobs: int | None = None  # per token: its log-probability and this many most likely tokens'


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: until the reply stops or fills max_model_len
    max_completion_tokens: int | None = None  # the chat API's newer name for max_tokens
    logprobs: bool = False  # per token: its log-probability ...
    top_logprobs: int | None = None  # ... and this many most likely tokens'


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    body = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return JSONResponse({"error": body}, status_code=status)


SAMPLING_FIELDS = {field.name for field in dataclasses.fields(SamplingParams)} - {"max_tokens", "logprobs"}


def sampling_params(request: SamplingRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams; BadRequest naming the field when SamplingParams refuses a value."""
    fields = request.model_dump(include=SAMPLING_FIELDS)  # the request's fields that SamplingParams has too
    try:
        return SamplingParams(**fields, max_tokens=16 if max_tokens is None else max_tokens, logprobs=logprobs)
    except ValueError as e:  # SamplingParams names the field first: "temperature must be >= 0, got -1"
        raise BadRequest(str(e), str(e).split()[0]) from e


class Server:
    """The routes over one AsyncLLM, serving under the name `model_name`."""

    def __init__(self, llm: AsyncLLM, model_name: str):
        self.llm, self.model_name = llm, model_name
        self.app = FastAPI(title="minivllm")
        self.app.add_exception_handler(RequestValidationError, self.invalid)  # type: ignore[arg-type]
        self.app.add_exception_handler(BadRequest, self.bad_request)  # type: ignore[arg-type]
        self.app.get("/health")(self.health)
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.chat_completions)

    async def invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]  # its loc: ("body", field, ...); a union type adds the variant tried, e.g. "str"
        param = str(first["loc"][1]) if len(first["loc"]) > 1 else str(first["loc"][0])
        return error(f"{param}: {first['msg']}", param)

    async def bad_request(self, request: Request, exc: BadRequest) -> JSONResponse:
        return error(str(exc), exc.param)

    async def health(self) -> dict:
        return {}

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "minivllm"}]}

    def check_model(self, request: SamplingRequest) -> None:
        if request.model != self.model_name:
            raise BadRequest(
                f"model {request.model!r} is not served here; this server serves {self.model_name!r}", "model"
            )

    async def completions(self, request: CompletionRequest):
        self.check_model(request)
        params = sampling_params(request, request.max_tokens, request.logprobs)
        return await self.respond(request.prompt, params, request.stream, "cmpl", completion_choice)

    async def chat_completions(self, request: ChatRequest):
        self.check_model(request)
        max_tokens = request.max_completion_tokens or request.max_tokens or self.llm.engine.config.max_model_len
        if request.top_logprobs is not None and not request.logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
        params = sampling_params(request, max_tokens, (request.top_logprobs or 0) if request.logprobs else None)
        conversation = [message.model_dump() for message in request.messages]
        try:
            prompt = chat_prompt(self.llm.engine.tokenizer, conversation, self.model_name)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from e
        return await self.respond(prompt, params, request.stream, "chatcmpl", chat_choice)

    async def respond(self, prompt, params: SamplingParams, stream: bool, kind: str, choice):
        """Run the request; the whole reply, or a stream of server-sent events. Bad input: 400 before any event."""
        request_id = f"{kind}-{uuid.uuid4().hex}"
        outputs = self.llm.generate(prompt, params, request_id)
        try:
            first = await anext(outputs)  # add_request's checks run here: a ValueError is still a 400
        except ValueError as e:  # the engine's checks of the prompt: "prompt is empty", "token id ... is outside"
            param = "prompt" if kind == "cmpl" else "messages"
            raise BadRequest(str(e) if str(e).startswith(param) else f"{param}: {e}", param) from e
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if not stream:
            last = first
            try:
                async for out in outputs:
                    last = out
            finally:  # cancelled (the client left): abort the request now, not when the generator is collected
                await outputs.aclose()
            object_name = "text_completion" if kind == "cmpl" else "chat.completion"
            choices = [choice(c, None, 0, params.logprobs) for c in last.outputs]
            return {**head, "object": object_name, "choices": choices, "usage": usage(last)}
        events = self.events(head, kind, first, outputs, partial(choice, top=params.logprobs))
        return StreamingResponse(events, media_type="text/event-stream")

    async def events(
        self, head: dict, kind: str, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None], choice
    ) -> AsyncIterator[str]:
        """After each output, one event per completion that changed, with what it added since its last event (text,
        and log-probabilities if asked); then `data: [DONE]`. If the client goes away, Starlette stops iterating:
        closing `outputs` aborts the request and frees its blocks."""
        object_name = "text_completion" if kind == "cmpl" else "chat.completion.chunk"
        sent: list[tuple[str, int, str | None]] = [("", 0, None)] * len(first.outputs)  # text, tokens, finish
        try:
            out: RequestOutput | None = first
            while out is not None:
                for c in out.outputs:
                    text, num_tokens, reason = sent[c.index]
                    if (c.text, len(c.token_ids), c.finish_reason) == (text, num_tokens, reason):
                        continue
                    delta = c.text[len(text) :] if c.text.startswith(text) else c.text  # a decode that changed its mind
                    sent[c.index] = (c.text, len(c.token_ids), c.finish_reason)
                    event = {**head, "object": object_name, "choices": [choice(c, delta, num_tokens)]}
                    yield f"data: {json.dumps(event)}\n\n"
                out = await anext(outputs, None)
            yield "data: [DONE]\n\n"
        finally:
            await outputs.aclose()


def top_entries(c: CompletionOutput, start: int, top: int) -> list[tuple[Logprob, list[Logprob]]]:
    """From token `start` on: each token's Logprob, and the `top` most likely tokens' (its own among them or not)."""
    rows = zip(c.token_ids[start:], (c.logprobs or [])[start:])
    return [(row[token], sorted(row.values(), key=lambda lp: lp.rank)[:top]) for token, row in rows]


def completion_choice(c: CompletionOutput, delta: str | None, start: int, top: int | None) -> dict:
    """A choice of /v1/completions: the text (or what it added), and OpenAI's legacy logprobs if asked."""
    logprobs = None
    if top is not None:
        entries = top_entries(c, start, top)
        logprobs = {"tokens": [lp.decoded_token for lp, _ in entries],
                    "token_logprobs": [lp.logprob for lp, _ in entries],
                    "top_logprobs": [{t.decoded_token: t.logprob for t in tops} for _, tops in entries]}  # fmt: skip
    text = c.text if delta is None else delta
    return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}


def chat_logprob(lp: Logprob) -> dict:
    return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}


def chat_choice(c: CompletionOutput, delta: str | None, start: int, top: int | None) -> dict:
    """A choice of /v1/chat/completions: the message (or, streaming, its delta), and logprobs if asked."""
    logprobs = None
    if top is not None:
        entries = top_entries(c, start, top)
        logprobs = {
            "content": [chat_logprob(lp) | {"top_logprobs": list(map(chat_logprob, tops))} for lp, tops in entries]
        }
    key, content = ("message", c.text) if delta is None else ("delta", delta)
    return {"index": c.index, key: {"role": "assistant", "content": content}, "logprobs": logprobs,
            "finish_reason": c.finish_reason}  # fmt: skip


def usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@contextmanager
def serve_in_thread(llm: AsyncLLM, model_name: str) -> Iterator[str]:
    """The server over `llm` on a free port of 127.0.0.1, in a thread of this process (tests, benchmarks, the
    notebook), until the block ends; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    http = uvicorn.Server(uvicorn.Config(Server(llm, model_name).app, log_level="warning"))
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


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m minivllm.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("model_tag", nargs="?", metavar="MODEL", help="a Hub id (ORG/NAME) or a checkpoint folder")
    source.add_argument("--model", help="the same, as a flag")
    source.add_argument("--preset", help="a random-weight preset, e.g. tiny or qwen3-0.6b")
    parser.add_argument("--revision", help="the model's Hub branch, tag or commit (default: main)")
    parser.add_argument("--tokenizer", help="a Hub id or folder to take the tokenizer from (default: the model's)")
    parser.add_argument("--download-dir", help="the Hub cache to read and download into (default: HF_HUB_CACHE)")
    parser.add_argument("--served-model-name", help="the name clients ask for (default: MODEL, --model or --preset)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args(argv)
    given = args.model_tag or args.model
    model = given or str(checkpoint_for(args.preset))
    try:
        llm = AsyncLLM(
            model,
            max_model_len=args.max_model_len,
            revision=args.revision,
            tokenizer=args.tokenizer,
            download_dir=args.download_dir,
        )
    except (ValueError, OSError) as e:  # no such id or folder, gated, offline and not cached, .bin weights, ...
        parser.exit(2, f"{parser.prog}: error: {load_error_line(e, model, args.tokenizer)}\n")
    server = Server(llm, args.served_model_name or given or args.preset)
    try:
        uvicorn.run(server.app, host=args.host, port=args.port)
    finally:
        llm.close()


if __name__ == "__main__":
    main()
