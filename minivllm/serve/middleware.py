"""What stands around the routes: the API key (401), the limits on a request's size (413) and on
the requests in flight (503), both as ASGI middleware, and the Prometheus metrics with vLLM's
names."""

import secrets
from collections.abc import Iterator

from fastapi.exceptions import HTTPException as FastAPIHTTPException
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minivllm.async_llm import AsyncLLM
from minivllm.outputs import RequestOutput
from minivllm.serve.protocol import error

# a request body beyond this is refused (413) before it is read whole
MAX_REQUEST_BYTES = 10 * 2**20
# the routes --max-queued-requests limits
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
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
