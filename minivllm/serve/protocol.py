"""What a client may send and the errors it gets back: OpenAI's request bodies as pydantic models,
their checks (before the engine sees a request), the body's SamplingParams, and OpenAI's error
shape. No HTTP here beyond the error's JSONResponse, and no engine."""

import dataclasses
import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from minivllm.sampling_params import SamplingParams

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


def engine_refusal(e: ValueError, prompt_param: str) -> BadRequest:
    """The engine's own checks ("prompt is empty", "stop_token_ids: token id ... is outside") as a
    400: the sampling field its message begins with, else the prompt's field."""
    named = str(e).split(":")[0]
    param = named if named in SAMPLING_FIELDS else prompt_param
    return BadRequest(str(e) if str(e).startswith(param) else f"{param}: {e}", param)


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


def check_request(request: SamplingRequest, model_name: str) -> None:
    """What every request must pass before its prompt is looked at: text, the model served here,
    no field we do not implement, n within MAX_N."""
    check_text(request)
    if request.model != model_name:
        message = f"model {request.model!r} is not served here; this server serves {model_name!r}"
        raise BadRequest(message, "model")
    check_unsupported(request)
    if request.n > MAX_N:
        raise BadRequest(f"n must be at most {MAX_N} (this server's limit), got {request.n}", "n")


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


def max_tokens_for(
    given: int | None, param: str, prompt_len: int, max_model_len: int, default: int | None
) -> int:
    """The request's max_tokens: >= 1, and within what max_model_len leaves after the prompt
    (vLLM's rule). Not given: `default`, or None for all that is left. A prompt with no room
    left is the engine's 400."""
    room = max_model_len - prompt_len
    if given is None:
        return max(1, room) if default is None else default
    if given < 1:
        raise BadRequest(f"{param} must be >= 1, got {given}", param)
    if 0 < prompt_len and 0 < room < given:
        message = (
            f"{param} is {given}, but the prompt has {prompt_len} tokens and max_model_len is "
            f"{max_model_len}: at most {room} tokens can follow it"
        )
        raise BadRequest(message, param)
    return given
