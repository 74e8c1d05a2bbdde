"""From the engine's `RequestOutput`s to what the client reads: waiting for a request's output
while watching for its client to leave, OpenAI's choices (text or chat message, with log-
probabilities) and usage, a whole reply as JSON (a large one encoded on a worker thread, off the
event loop), and a stream as server-sent events ending in `data: [DONE]` or in an error event."""

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from functools import partial

from fastapi import Request
from fastapi.responses import Response

from minivllm.async_llm import EngineDeadError
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.serve.protocol import error_body

logger = logging.getLogger(__name__)

LARGE_REPLY = 4096  # tokens and top log-probabilities: a reply beyond is encoded off the event loop
Sent = tuple[str, int, str | None]  # a completion's text, tokens and finish reason streamed so far


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


def encode_reply(head: dict, out: RequestOutput, choice) -> bytes:
    """A whole (not streamed) reply as JSON: its choices, built here, and the usage."""
    choices = [choice(c, None, 0) for c in out.outputs]
    return json.dumps({**head, "choices": choices, "usage": usage(out)}).encode()


async def whole_reply(head: dict, out: RequestOutput, choice, top: int | None) -> Response:
    """The reply to a request that does not stream. A large one (many completions, log-
    probabilities: megabytes, maybe) is encoded on a worker thread: the loop serves on meanwhile."""
    encode = partial(encode_reply, head, out, partial(choice, top=top))
    num_tokens = sum(len(c.token_ids) for c in out.outputs)
    if num_tokens * (1 + (top or 0)) > LARGE_REPLY:
        body = await asyncio.to_thread(encode)
    else:
        body = encode()
    return Response(body, media_type="application/json")


def failure(e: Exception) -> str:
    """Why a stream stopped, for its client: the engine's errors say it (the core died, a step
    failed: its RuntimeErrors); anything else is a fault here, logged, and named by its type."""
    if type(e) is RuntimeError or isinstance(e, EngineDeadError):
        return str(e)
    logger.error("minivllm: a stream failed", exc_info=e)
    return f"the server failed to make the stream: {type(e).__name__}: {e}"


async def events(
    head: dict,
    first: RequestOutput,
    outputs: AsyncGenerator[RequestOutput, None],
    choice,
    include_usage: bool,
    finished: Callable[[RequestOutput], None],
) -> AsyncIterator[str]:
    """After each output, one event per completion that changed, with what it added since its last
    event (text, and log-probabilities if asked); with include_usage (OpenAI's stream_options), one
    more with no choices and the usage (the others then carry "usage": null); then `data: [DONE]`,
    and `finished(last output)`. If the request fails midway (the engine core died, a failed step
    aborted it, or an event could not be made), an event with OpenAI's error shape saying why, and
    no [DONE]: never a connection cut short. If the client goes away, Starlette stops iterating:
    closing `outputs` aborts the request and frees its blocks."""
    sent: list[Sent] = [("", 0, None)] * len(first.outputs)
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
                event = {**head, "choices": [choice(c, delta, num_tokens)], **extra}
                yield f"data: {json.dumps(event)}\n\n"
            out = await anext(outputs, None)
        finished(last)
        if include_usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(last)})}\n\n"
        yield "data: [DONE]\n\n"
    except Exception as e:  # not the client leaving (CancelledError, GeneratorExit): say why
        yield f"data: {json.dumps({'error': error_body(failure(e), None, 500)})}\n\n"
    finally:
        await outputs.aclose()
