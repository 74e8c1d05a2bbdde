"""The server's validation of hostile requests (`python -m minivllm.serve`): each gets a 400 in OpenAI's error shape
naming the field, and is refused before the engine sees it (the engine's `generate` is never called); the server
keeps serving. Also `stream_options.include_usage`. CPU, tiny preset (2048 tokens), max_model_len 512, greedy."""

import json
import os
import signal

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from minivllm.async_llm import AsyncLLM  # noqa: E402
from minivllm.serve.testing import WatchedLLM, serve_in_thread  # noqa: E402

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(server):
    """conftest's server, served again over its engine watched (`WatchedLLM`: the prompts the
    server hands it are noted); yields (base_url, the watched engine)."""
    engine = WatchedLLM(server[1])
    with serve_in_thread(engine, "tiny") as url:
        yield url, engine


@pytest.fixture
def engine_calls(server):
    """The prompts the server handed to the engine during the test."""
    server[1].prompts.clear()
    return server[1].prompts


def body_for(endpoint: str, **change) -> dict:
    base = dict(model="tiny", max_tokens=4, temperature=0)
    base |= dict(prompt="Hello") if endpoint == "completions" else dict(messages=MESSAGES)
    return {k: v for k, v in (base | change).items() if v is not ...}  # ...: leave the field out


def post(
    server, endpoint: str, body: dict | None = None, content: bytes | None = None
) -> httpx.Response:
    kw = (
        dict(json=body)
        if content is None
        else dict(content=content, headers={"Content-Type": "application/json"})
    )
    return httpx.post(
        f"{server[0]}/v1/{endpoint.replace('chat', 'chat/completions')}", timeout=120, **kw
    )


def assert_400(response: httpx.Response, field: str | None, *words: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (
        set(error) == {"message", "type", "param", "code"}
        and error["type"] == "invalid_request_error"
    )
    assert error["param"] == field and (field is None or field in error["message"]), error
    assert all(w in error["message"] for w in words), error
    return error


def refused(server, engine_calls, endpoint: str, field: str, *words: str, **change) -> None:
    assert_400(post(server, endpoint, body_for(endpoint, **change)), field, *words)
    assert engine_calls == []  # refused before the engine


def served(server, endpoint: str, **change) -> dict:
    response = post(server, endpoint, body_for(endpoint, **change))
    assert response.status_code == 200, response.text
    return response.json()


ENDPOINTS = ["completions", "chat"]


# --- 1. token ids outside the vocabulary or int64 ------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_stop_token_ids_outside_the_vocabulary_are_refused_and_the_engine_lives(server, endpoint):
    """Refused by the engine's own check as the request is added (never in a step), the 400 naming the field."""
    for ids, words in (([5000], ("5000", "vocabulary")), ([7, 2048], ())):
        assert_400(
            post(server, endpoint, body_for(endpoint, stop_token_ids=ids)), "stop_token_ids", *words
        )
    assert served(server, endpoint, stop_token_ids=[2047])[
        "choices"
    ]  # the last id is in; the engine still steps


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(stop_token_ids=[2**63]), "stop_token_ids"),
        (dict(seed=2**63), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(prompt=[5, 2**63]), "prompt"),
        (dict(top_k=2**70), "top_k"),
        (dict(n=2**64), "n"),
        (dict(max_tokens=2**63), "max_tokens"),
    ],
)
def test_integers_that_do_not_fit_int64_are_refused(server, engine_calls, change, field):
    refused(server, engine_calls, "completions", field, **change)


# --- 2. sampling values that would make NaN or empty distributions -------------------------------------------------


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(top_p=1e-300), "top_p"),
        (dict(top_p=1e-39), "top_p"),  # a float32 subnormal
        (dict(repetition_penalty=1e-300), "repetition_penalty"),
        (dict(repetition_penalty=1e-7), "repetition_penalty"),
        (dict(repetition_penalty=1e300), "repetition_penalty"),
        (dict(presence_penalty=1e300), "presence_penalty"),
        (dict(frequency_penalty=-1e300), "frequency_penalty"),
    ],
)
def test_values_that_underflow_or_overflow_float32_are_refused(
    server, engine_calls, endpoint, change, field
):
    refused(server, engine_calls, endpoint, field, **change, temperature=1.0)


@pytest.mark.parametrize(
    "field", ["top_p", "repetition_penalty", "presence_penalty", "temperature"]
)
def test_nan_is_refused(server, engine_calls, field):
    content = json.dumps(body_for("completions")).replace("}", f', "{field}": NaN}}').encode()
    assert_400(post(server, "completions", content=content), field)
    assert engine_calls == []


def test_the_floors_themselves_are_served(server):
    for change in (
        dict(top_p=1.2e-38),
        dict(repetition_penalty=1e-6),
        dict(repetition_penalty=1e6),
    ):
        (choice,) = served(server, "completions", temperature=1.0, seed=3, **change)["choices"]
        assert choice["finish_reason"] in ("length", "stop")


# --- 3. max_tokens: at least 1, and within what the context leaves -------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "change", "field"),
    [
        ("completions", dict(max_tokens=0), "max_tokens"),
        ("chat", dict(max_tokens=0), "max_tokens"),
        ("chat", dict(max_tokens=..., max_completion_tokens=0), "max_completion_tokens"),
        ("chat", dict(max_tokens=-1), "max_tokens"),
        ("completions", dict(max_tokens=600), "max_tokens"),
        ("chat", dict(max_tokens=600), "max_tokens"),
        ("chat", dict(max_tokens=4, max_completion_tokens=600), "max_completion_tokens"),
    ],
)
def test_max_tokens_below_1_or_beyond_the_context_is_refused(
    server, engine_calls, endpoint, change, field
):
    refused(server, engine_calls, endpoint, field, **change)


def test_max_tokens_may_fill_the_context_exactly(server, engine_calls):
    prompt = list(range(1, 501))  # 500 tokens of 512: 12 can follow
    refused(
        server,
        engine_calls,
        "completions",
        "max_tokens",
        "at most 12",
        prompt=prompt,
        max_tokens=13,
    )
    reply = served(server, "completions", prompt=prompt, max_tokens=12, ignore_eos=True)
    assert reply["usage"] == {"prompt_tokens": 500, "completion_tokens": 12, "total_tokens": 512}


# --- 4. prompts: one string or one list of integer token ids -------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        (["12", "34"], ["list of prompts is not supported"]),
        (["Hello"], ["list of prompts is not supported"]),
        ([[1, 2], [3]], ["list of prompts is not supported"]),
        ([True, False], ["prompt[0]", "integer token id", "true"]),
        ([5.0, 6.0], ["prompt[0]", "integer token id"]),
        ([5, "6"], ["prompt[1]", "integer token id"]),
        ([5, None], ["prompt[1]"]),
        ({"text": "Hello"}, ["string or a list of token ids"]),
        (5, ["string or a list of token ids"]),
    ],
)
def test_a_prompt_that_is_not_one_string_or_token_ids_is_refused(
    server, engine_calls, prompt, words
):
    refused(server, engine_calls, "completions", "prompt", *words, prompt=prompt)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(max_tokens=True), "max_tokens"),
        (dict(n=2.0), "n"),
        (dict(seed="7"), "seed"),
        (dict(logprobs=1.0), "logprobs"),
    ],
)
def test_integer_fields_are_not_coerced(server, engine_calls, change, field):
    refused(server, engine_calls, "completions", field, **change)


# --- 5. OpenAI fields this server does not implement ---------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize(
    "change",
    [
        dict(logit_bias={"5": 100}),
        dict(echo=True),
        dict(best_of=3),
        dict(best_of=2, n=1),
        dict(suffix="the end"),
        dict(response_format={"type": "json_object"}),
        dict(tools=[{"type": "function", "function": {"name": "f"}}]),
        dict(tool_choice="auto"),
    ],
)
def test_unsupported_fields_are_refused_by_name(server, engine_calls, endpoint, change):
    field = next(iter(change))
    refused(server, engine_calls, endpoint, field, "not supported", **change)


def test_their_off_values_and_unknown_fields_are_still_served(server):
    off = dict(
        logit_bias={},
        echo=False,
        suffix=None,
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
    )
    for endpoint in ENDPOINTS:
        served(
            server,
            endpoint,
            **off,
            best_of=2,
            n=2,
            user="someone",
            metadata={"a": "b"},
            store=False,
        )


# --- 6. stream_options.include_usage -------------------------------------------------------------------------------


def stream_events(server, endpoint: str, **change) -> list:
    body = body_for(endpoint, stream=True, ignore_eos=True, **change)
    with httpx.stream("POST", f"{server[0]}/v1/{endpoint.replace('chat', 'chat/completions')}", json=body,
                      timeout=120) as response:  # fmt: skip
        assert response.status_code == 200
        lines = [
            line.removeprefix("data: ")
            for line in response.iter_lines()
            if line.startswith("data: ")
        ]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_include_usage_adds_a_last_chunk_with_the_usage(server, endpoint):
    plain = served(server, endpoint, ignore_eos=True, n=2, seed=5, temperature=1.0)
    events = stream_events(
        server, endpoint, n=2, seed=5, temperature=1.0, stream_options={"include_usage": True}
    )
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == plain["usage"]
    assert plain["usage"]["completion_tokens"] == 8 and plain["usage"]["total_tokens"] > 8
    assert chunks and all(c["choices"] and c["usage"] is None for c in chunks)
    for events in (stream_events(server, endpoint), stream_events(server, endpoint, stream_options=None),
                   stream_events(server, endpoint, stream_options={"include_usage": False})):  # fmt: skip
        assert all(e["choices"] and "usage" not in e for e in events)


def test_stream_options_without_stream_is_refused(server, engine_calls):
    refused(
        server,
        engine_calls,
        "completions",
        "stream_options",
        stream_options={"include_usage": True},
    )


# --- 7. bodies that are not JSON, not UTF-8, or not Unicode text ---------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b'{"model": "tiny", "prompt": ',
        b"not json",
        b"",
        b"[1]",
        b'{"model": "tiny", "prompt": "caf\xe9"}',
        b"\xff\xfe{}",
    ],
)
def test_a_body_that_is_not_a_json_object_in_utf8_gets_openais_400(server, engine_calls, content):
    assert "JSON" in assert_400(post(server, "completions", content=content), None)["message"]
    assert engine_calls == []


@pytest.mark.parametrize(
    ("endpoint", "raw", "field"),
    [
        ("completions", '"prompt": "\\ud800"', "prompt"),
        ("completions", '"prompt": "Hello", "stop": ["a\\udfff"]', "stop"),
        ("chat", '"messages": [{"role": "user", "content": "hi \\ud800 there"}]', "messages"),
    ],
)
def test_lone_surrogates_are_refused(server, engine_calls, endpoint, raw, field):
    content = f'{{"model": "tiny", "max_tokens": 4, {raw}}}'.encode()
    assert_400(post(server, endpoint, content=content), field, "surrogate")
    assert engine_calls == []


def test_the_server_still_serves_after_all_that(server):
    assert httpx.get(f"{server[0]}/health", timeout=60).status_code == 200
    assert (
        served(server, "completions", max_tokens=3, ignore_eos=True)["usage"]["completion_tokens"]
        == 3
    )


def test_a_dead_engine_makes_health_503_and_requests_fail_at_once(tiny, serve_config):
    """If the engine core dies, /health says so (503) and a request fails with 503 in OpenAI's shape, no hang."""
    llm = AsyncLLM(str(tiny), **serve_config)
    with serve_in_thread(llm, "tiny") as url:
        assert httpx.get(f"{url}/health").status_code == 200
        os.kill(llm.process.pid, signal.SIGKILL)
        llm.thread.join(120)  # the output thread sees the socket close, fails every caller and ends
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "died" in health.json()["error"]["message"]
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}
        late = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert late.status_code == 503 and late.json()["error"]["type"] == "server_error", late.text
    llm.close()
