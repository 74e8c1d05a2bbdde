"""The server's operating habits, vLLM's (`python -m minivllm.serve`): /metrics in Prometheus' text format, a 503 with
Retry-After beyond --max-queued-requests, a request aborted when its client leaves before its reply, caps on n and on
the body's size, and prompts tokenized once, off the engine's lock. CPU, tiny preset, float32, greedy."""

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

from minivllm.serve import MAX_N, MAX_REQUEST_BYTES  # noqa: E402
from minivllm.serve.testing import WatchedLLM, serve_in_thread  # noqa: E402

LONG = dict(model="tiny", prompt="A long story:", max_tokens=400, temperature=0, ignore_eos=True)


def scrape(url: str) -> dict[str, float]:
    """/metrics parsed: each sample's value by name (histograms' buckets left out; one model, one label)."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    families = parser.text_string_to_metric_families(text)
    return {s.name: s.value for family in families for s in family.samples if "le" not in s.labels}


def wait_until(condition, seconds: float = 60) -> None:
    """Poll until condition() holds: a hang check, not a measurement (the server answers in milliseconds)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


class Gate:
    """The engine core's process stopped (SIGSTOP) until `set()`: no step runs, its messages wait in the socket."""

    def __init__(self, pid: int):
        self.pid, self.opened = pid, False
        os.kill(pid, signal.SIGSTOP)

    def set(self) -> None:
        if not self.opened:
            self.opened = True
            os.kill(self.pid, signal.SIGCONT)


@pytest.fixture
def gate(server) -> Iterator[Gate]:
    """Holds the engine core before its next step until set, or until the test ends."""
    gate = Gate(server[1].process.pid)
    yield gate
    gate.set()


IDLE = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0}


def wait_until_idle(llm) -> None:
    """Until no caller waits and the core, in a message sent after this call, holds no request and no KV block."""
    before = llm.core_stats
    wait_until(lambda: not llm.streams and llm.core_stats is not before and llm.stats() == IDLE)


def address(url: str) -> tuple[str, int]:
    split = urlsplit(url)
    return split.hostname or "", split.port or 80


def post(url: str, body: bytes = b"", framing: str | None = None) -> bytes:
    """A POST of JSON to /v1/completions written by hand, with any framing header (default: the body's
    Content-Length). The server closes the connection after its reply."""
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\nConnection: close\r\n"
    framing = framing or f"Content-Length: {len(body)}"
    return f"{head}Content-Type: application/json\r\n{framing}\r\n\r\n".encode() + body


def raw_http(url: str, message: bytes) -> bytes:
    """Send a request written by hand; the reply, read until the server closes the connection."""
    with socket.create_connection(address(url), timeout=60) as sock:
        try:
            sock.sendall(message)
        except (
            OSError
        ):  # the server answered and closed before it read all: its answer still waits for us
            pass
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except OSError:
            pass
    return reply


def test_metrics_count_what_the_replies_report(server):
    url, _ = server
    before = scrape(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    kw = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=7,
        temperature=0,
        extra_body=dict(ignore_eos=True),
    )
    usages = [client.completions.create(**kw).usage, client.completions.create(n=2, **kw).usage]
    usages.append(
        list(client.completions.create(stream=True, stream_options=dict(include_usage=True), **kw))[
            -1
        ].usage
    )
    messages = [{"role": "user", "content": "Name a colour."}]
    usages.append(
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=5).usage
    )
    after = scrape(url)

    def added(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert added("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert added("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert added("vllm:request_success_total") == len(usages) == 4
    assert added("vllm:time_to_first_token_seconds_count") == len(usages)
    assert (
        added("vllm:time_per_output_token_seconds_count") >= 3
    )  # the chat reply may stop after one token
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert (
        after["vllm:kv_cache_usage_perc"] == 0
    )  # finished requests' blocks are free (cached or not)


def test_a_request_beyond_max_queued_requests_gets_a_503(server, gate):
    """A second server over the same engine (its own metrics registry: no clash), taking one request at a time."""
    llm, small = server[1], dict(LONG, max_tokens=4)
    with serve_in_thread(llm, "tiny", max_queued_requests=1) as url:
        with socket.create_connection(address(url), timeout=60) as sock:
            sock.sendall(post(url, json.dumps(dict(LONG, stream=True)).encode()))
            wait_until(lambda: bool(llm.streams))  # in flight, and no step runs: it stays so
            busy = httpx.post(f"{url}/v1/completions", json=small, timeout=60)
        gate.set()
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "1", busy.text
        error = busy.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "busy" in error["message"]
        replies = [
            busy
        ]  # once the stream has ended (the server sees its client gone), its slot is free
        wait_until(lambda: replies.append(httpx.post(f"{url}/v1/completions", json=small, timeout=60))
                   or replies[-1].status_code != 503)  # fmt: skip
        assert replies[-1].status_code == 200, replies[-1].text
    wait_until_idle(llm)  # the stream's request, aborted: the engine is idle
    assert llm.stats() == IDLE and not llm.streams


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_is_aborted_when_its_client_leaves_before_its_reply(server, gate, stream):
    """No step runs until the server has aborted the request (the gate): without the abort it would wait there, and
    then run to its 400th token for nobody. A stream whose client left after its first event: test_serve.py."""
    url, llm = server
    aborted = llm.num_aborted
    with socket.create_connection(address(url), timeout=60) as sock:
        sock.sendall(post(url, json.dumps(dict(LONG, stream=stream)).encode()))
        wait_until(lambda: bool(llm.streams))  # sent to the engine core
        assert llm.streams
    wait_until(lambda: llm.num_aborted > aborted)
    gate.set()
    assert llm.num_aborted == aborted + 1
    wait_until_idle(llm)
    assert llm.stats() == IDLE  # every KV block free


def test_n_above_the_limit_gets_a_400(server):
    body = dict(model="tiny", prompt="Hello", max_tokens=1, n=MAX_N + 1)
    response = httpx.post(f"{server[0]}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "n" and str(MAX_N) in error["message"]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_over_the_limit_gets_a_413(server, framing):
    """Refused from its Content-Length before a byte of it is read; without one, once it has read past the limit.
    The body is valid JSON with a large field the server ignores: without the cap it would be served."""
    url = server[0]
    pad = b"x" * MAX_REQUEST_BYTES
    body = b'{"model": "tiny", "prompt": "Hello", "max_tokens": 1, "pad": "' + pad + b'"}'
    if framing == "content-length":  # the header alone: the server must not wait for the body
        reply = raw_http(url, post(url, framing=f"Content-Length: {len(body)}"))
    else:
        chunks = b"".join(
            b"%x\r\n%s\r\n" % (len(c), c)
            for c in (body[i : i + 2**16] for i in range(0, len(body), 2**16))
        )
        reply = raw_http(url, post(url, chunks + b"0\r\n\r\n", "Transfer-Encoding: chunked"))
    status, _, rest = reply.partition(b"\r\n")
    assert status.split()[1] == b"413", reply[:300]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert (
        set(error) == {"message", "type", "param", "code"}
        and str(MAX_REQUEST_BYTES) in error["message"]
    )
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200  # and it serves on


def test_a_text_prompt_reaches_the_engine_as_token_ids(server):
    """The server tokenizes in a thread, off the engine's lock, and hands the engine the ids: nothing is tokenized
    twice, nor under the lock. Seen by serving the engine watched (the prompts it is handed)."""
    engine = WatchedLLM(server[1])
    body = dict(model="tiny", prompt="Once upon a time", max_tokens=2)
    with serve_in_thread(engine, "tiny") as url:
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    assert engine.prompts == [engine.tokenizer.encode("Once upon a time")]


def test_a_large_reply_is_encoded_off_the_event_loop(server, monkeypatch):
    """A reply of n=128 with logprobs=20 can be megabytes of JSON: encoded on the event loop, it
    stalled every other request (/health, other streams) meanwhile. Its encoding must run on a
    worker thread, where no event loop runs. Seen by wrapping json.dumps (which the server and
    Starlette both call) to note where each large text is made."""
    dumps, large = json.dumps, []

    def noting_dumps(*args, **kwargs) -> str:
        text = dumps(*args, **kwargs)
        if len(text) > 100_000:
            try:
                asyncio.get_running_loop()
                large.append("on the event loop")
            except RuntimeError:  # no loop runs on this thread
                large.append("off the event loop")
        return text

    monkeypatch.setattr(json, "dumps", noting_dumps)
    body = dict(model="tiny", prompt="Once upon a time", n=MAX_N, logprobs=20, max_tokens=4)
    reply = httpx.post(f"{server[0]}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200 and len(reply.json()["choices"]) == MAX_N
    assert large == ["off the event loop"]
