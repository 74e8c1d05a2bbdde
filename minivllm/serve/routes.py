"""The FastAPI app over one `AsyncLLM`: the endpoints, and errors in OpenAI's shape. A generating
request is checked (`protocol`), its prompt tokenized off the event loop (a chat's messages made
into one prompt first, as `LLM.chat` makes it), run on the engine, and its outputs shaped into a
reply or a stream (`replies`)."""

import asyncio
import time
import uuid
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

import minivllm
from minivllm.api_llm import chat_prompt
from minivllm.async_llm import AsyncLLM, EngineDeadError
from minivllm.sampling_params import SamplingParams
from minivllm.serve.middleware import Limits, Metrics, RequireKey
from minivllm.serve.protocol import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    SamplingRequest,
    check_request,
    engine_refusal,
    error,
    max_tokens_for,
    prompt_of,
    sampling_params,
)
from minivllm.serve.replies import chat_choice, completion_choice, events, wait_output, whole_reply

# a reply's id prefix and its "object", whole and streamed, per kind of request
OBJECTS = {
    "cmpl": ("text_completion", "text_completion"),
    "chatcmpl": ("chat.completion", "chat.completion.chunk"),
}


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
        handler(HTTPException, self.http_error)  # type: ignore[arg-type]
        handler(EngineDeadError, self.engine_dead)  # type: ignore[arg-type]
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
        """200 while the engine can run requests; 503 once its core has died (a load balancer
        takes it out)."""
        if self.llm.is_healthy():
            return JSONResponse({})
        return error("the engine has died: restart the server", status=503)

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

    async def token_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """The prompt as token ids, as the engine would make them (tokenizing in a thread: a long
        prompt takes time)."""
        try:
            return await asyncio.to_thread(self.llm.input_processor.tokenize, prompt, param)
        except ValueError as e:  # text for a model with no tokenizer
            raise BadRequest(str(e), param) from e

    async def completions(self, request: CompletionRequest, raw: Request):
        check_request(request, self.model_name)
        token_ids = await self.token_ids(prompt_of(request.prompt), "prompt")
        max_model_len = self.llm.config.max_model_len
        max_tokens = max_tokens_for(
            request.max_tokens, "max_tokens", len(token_ids), max_model_len, 16
        )
        params = sampling_params(request, max_tokens, request.logprobs)
        return await self.respond(token_ids, params, request, raw, "cmpl")

    async def chat_completions(self, request: ChatRequest, raw: Request):
        check_request(request, self.model_name)
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
        max_model_len = self.llm.config.max_model_len
        max_tokens = max_tokens_for(given, param, len(token_ids), max_model_len, None)
        top = (request.top_logprobs or 0) if request.logprobs else None
        params = sampling_params(request, max_tokens, top)
        return await self.respond(token_ids, params, request, raw, "chatcmpl")

    async def respond(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request: SamplingRequest,
        raw: Request,
        kind: str,
    ) -> Any:
        """Run the request; the whole reply, or a stream of server-sent events. Bad input: 400
        before any event. A client that leaves aborts its request, streaming or not."""
        request_id = f"{kind}-{uuid.uuid4().hex}"
        outputs = self.llm.generate(token_ids, params, request_id)
        try:  # add_request's checks run as `outputs` starts: a ValueError is still a 400
            out = await wait_output(outputs, raw, last=not request.stream)
        except ValueError as e:
            raise engine_refusal(e, "prompt" if kind == "cmpl" else "messages") from e
        if out is None:  # the client left; nobody will read this: nginx's "client closed request"
            return error("the client disconnected", status=499)
        whole, chunk = OBJECTS[kind]
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        choice = completion_choice if kind == "cmpl" else chat_choice
        if not request.stream:
            self.metrics.finished(out)
            return await whole_reply({**head, "object": whole}, out, choice, params.logprobs)
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        stream = events(
            {**head, "object": chunk},
            out,
            outputs,
            partial(choice, top=params.logprobs),
            include_usage,
            self.metrics.finished,
        )
        return StreamingResponse(stream, media_type="text/event-stream")
