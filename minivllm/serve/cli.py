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
import os
import signal
from typing import Any

from minivllm.async_llm import AsyncLLM
from minivllm.checkpoint import checkpoint_for
from minivllm.engine_args import add_engine_args, engine_kwargs
from minivllm.models.hub import load_error_line
from minivllm.serve.routes import Server

# Seconds an idle kept-alive connection stays open. uvicorn's default, 5, is httpx's keep-alive
# expiry too: a request sent on a connection as its 5 s ran out met the server closing it, and got
# no reply. Clients must be the ones that close.
KEEP_ALIVE_S = 30


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


def make_server(argv: list[str] | None = None) -> tuple[AsyncLLM, Server, dict[str, Any]]:
    """What the command line asks for, started: the engine (its core running; close it), the
    routes over it, and uvicorn's arguments. A model that cannot be loaded exits with code 2."""
    parser, engine_fields = server_parser()
    args = parser.parse_args(argv)
    given = args.model_tag or args.model
    model = given or str(checkpoint_for(args.preset))
    kwargs = engine_kwargs(args, engine_fields)
    try:
        llm = AsyncLLM(model, **kwargs)
    except (ValueError, OSError) as e:  # no such id or folder, gated, offline, .bin weights, ...
        line = load_error_line(e, model, kwargs.get("tokenizer"))
        parser.exit(2, f"{parser.prog}: error: {line}\n")
    name = args.served_model_name or given or args.preset
    server = Server(llm, name, args.api_key, args.max_queued_requests)
    options = dict(host=args.host, port=args.port, timeout_keep_alive=args.timeout_keep_alive)
    return llm, server, options


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    llm, server, options = make_server(argv)
    # uvicorn shuts down, then re-raises it: as Ctrl-C
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        uvicorn.run(server.app, **options)
    except KeyboardInterrupt:
        pass
    finally:
        llm.close()  # stops the engine core's process
