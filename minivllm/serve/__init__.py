"""The OpenAI-compatible server over `AsyncLLM` (`python -m minivllm.serve`; `cli.py`'s docstring
says what it serves and how), in rooms by job:

    protocol.py    request bodies as pydantic models, their checks, their SamplingParams; errors
    middleware.py  the API key, the limits on size and on requests in flight, the metrics
    routes.py      the FastAPI app over one AsyncLLM: its endpoints (`Server`)
    replies.py     outputs into OpenAI's replies: whole (JSON off the loop if large) or streamed
    cli.py         the command line: its flags, the engine and the routes started, `main`
    testing.py     the server in a thread (tests, benchmarks): never imported by the rest
"""

from minivllm.serve.cli import KEEP_ALIVE_S, main, make_server, server_parser
from minivllm.serve.middleware import MAX_REQUEST_BYTES
from minivllm.serve.protocol import MAX_N
from minivllm.serve.routes import Server

__all__ = [
    "KEEP_ALIVE_S",
    "MAX_N",
    "MAX_REQUEST_BYTES",
    "Server",
    "main",
    "make_server",
    "server_parser",
]
