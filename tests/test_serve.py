"""The OpenAI-compatible server (`python -m minivllm.serve`), driven by the real `openai` client on 127.0.0.1: the
same replies as offline `generate`, streamed or not, for one client or 64 at once; a client that leaves frees its
request's KV blocks; bad requests get a 400 naming the field. CPU, tiny preset, float32, greedy."""

import asyncio
import contextlib
import json
import os
import signal
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.async_llm import AsyncLLM  # noqa: E402
from minivllm.serve.testing import WatchedLLM, serve_in_thread  # noqa: E402

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def offline(tiny, serve_config):
    with LLM(str(tiny), **serve_config) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_health_and_models(server, client):
    assert httpx.get(f"{server[0]}/health", timeout=60).status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_offline_generate(client, offline, stream):
    expected = offline.generate(PROMPTS, greedy(12), use_tqdm=False)
    for prompt, out in zip(PROMPTS, expected):
        kw = dict(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body=dict(ignore_eos=True),
        )
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks)
            assert (
                chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 2
            )  # token by token
        else:
            reply = client.completions.create(**kw)
            text = reply.choices[0].text
            assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens == len(
                out.prompt_token_ids
            )
        assert text == out.outputs[0].text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["stop string", "penalties"])
def test_stop_strings_and_penalties_as_offline(client, offline, stream, kind):
    plain = offline.generate(["Once upon a time"], greedy(20), use_tqdm=False)[0].outputs[0].text
    fields = (
        dict(stop=[plain[8:11]])
        if kind == "stop string"
        else dict(frequency_penalty=0.5, presence_penalty=0.2)
    )
    extra = (
        dict(ignore_eos=True)
        if kind == "stop string"
        else dict(ignore_eos=True, repetition_penalty=1.3, min_tokens=2)
    )
    params = SamplingParams(temperature=0, max_tokens=20, **fields, **extra)
    expected = offline.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    assert expected.text != plain and expected.finish_reason == (
        "stop" if kind == "stop string" else "length"
    )
    kw = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0,
        extra_body=extra,
        **fields,
    )
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text, reason = (
            "".join(c.choices[0].text for c in chunks),
            chunks[-1].choices[0].finish_reason,
        )
    else:
        choice = client.completions.create(**kw).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert (text, reason) == (expected.text, expected.finish_reason)


def test_a_prompt_of_token_ids_gives_the_same_tokens(client, offline):
    ids = [5, 77, 300, 9, 1000]
    reply = client.completions.create(
        model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_body=dict(ignore_eos=True)
    )
    assert (
        reply.choices[0].text
        == offline.generate([ids], greedy(8), use_tqdm=False)[0].outputs[0].text
    )


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_equal_offline_chat(client, offline, stream):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    expected = offline.chat(messages, greedy(10), use_tqdm=False)[0].outputs[0].text
    kw = dict(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body=dict(ignore_eos=True),
    )
    if stream:
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(stream=True, **kw)
        )
    else:
        reply = client.chat.completions.create(**kw)
        assert (
            reply.choices[0].message.role == "assistant"
            and reply.choices[0].finish_reason == "length"
        )
        text = reply.choices[0].message.content
    assert text == expected


@pytest.mark.parametrize("stream", [False, True])
def test_n_seeded_samples_are_reproducible_and_equal_offline(client, offline, stream):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    expected = [
        c.text for c in offline.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs
    ]
    assert len(set(expected)) > 1  # four samples, not one four times
    kw = dict(
        model="tiny",
        prompt="Once upon a time",
        n=4,
        seed=7,
        max_tokens=8,
        extra_body=dict(ignore_eos=True),
    )
    for _ in range(2):  # the same again
        texts = [""] * 4
        if stream:
            for chunk in client.completions.create(stream=True, **kw):
                texts[chunk.choices[0].index] += chunk.choices[0].text
        else:
            texts = [
                c.text
                for c in sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
            ]
        assert texts == expected


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_equal_offline(client, offline, stream):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    (completion,) = offline.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs
    want = [row[t].logprob for row, t in zip(completion.logprobs, completion.token_ids)]
    kw = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        extra_body=dict(ignore_eos=True),
    )
    if stream:
        chunks = [
            c.choices[0].logprobs for c in client.completions.create(stream=True, logprobs=3, **kw)
        ]
        got = [lp for c in chunks if c is not None for lp in c.token_logprobs]
        tops = [top for c in chunks if c is not None for top in c.top_logprobs]
    else:
        logprobs = client.completions.create(logprobs=3, **kw).choices[0].logprobs
        got, tops = logprobs.token_logprobs, logprobs.top_logprobs
    assert got == pytest.approx(want, abs=1e-5) and all(len(top) == 3 for top in tops)
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = dict(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        extra_body=dict(ignore_eos=True),
    )
    content = (
        client.chat.completions.create(logprobs=True, top_logprobs=2, **chat)
        .choices[0]
        .logprobs.content
    )
    (expected,) = offline.chat(messages, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2),
                               use_tqdm=False)[0].outputs  # fmt: skip
    assert [c.logprob for c in content] == pytest.approx(
        [r[t].logprob for r, t in zip(expected.logprobs, expected.token_ids)], abs=1e-5
    )
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob for c in content)


def test_64_concurrent_streams_all_complete_correctly(server, offline):
    prompts = [f"Request number {i} says" for i in range(64)]
    expected = [out.outputs[0].text for out in offline.generate(prompts, greedy(6), use_tqdm=False)]

    async def one(client, prompt: str) -> str:
        kw = dict(
            model="tiny",
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            extra_body=dict(ignore_eos=True),
        )
        return "".join(
            [c.choices[0].text async for c in await client.completions.create(stream=True, **kw)]
        )

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{server[0]}/v1", api_key="none", max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_at_once()) == expected


def test_a_caller_that_falls_behind_gets_the_newest_output_only(server, offline):
    """AsyncLLM builds no output for a caller that has not taken the last one, and hands it the newest: a slow
    client gets one output for many steps, and the same reply. The caller reads nothing while a second request,
    added after its first output and as long as all of it, runs to its end: the engine has finished the first by
    then, and the outputs of both reach this event loop in the order the engine made them."""
    llm = server[1]
    expected = offline.generate(["Once upon a time"], greedy(40), use_tqdm=False)[0].outputs[0]

    async def slow() -> list:
        outputs = llm.generate("Once upon a time", greedy(40), request_id="slow")
        first = await anext(outputs)
        meanwhile = [out async for out in llm.generate("Meanwhile", greedy(40))]
        assert meanwhile[-1].finished
        return [first] + [out async for out in outputs]

    # Which outputs are built, for whom: work that no reply shows (the one seam left here).
    output, built = llm.output_processor.output, []

    def output_and_note(request):
        built.append((request.request_id, request.finished))
        return output(request)

    llm.output_processor.output = output_and_note
    try:
        first, *rest = asyncio.run(slow())
    finally:
        del llm.output_processor.output
    assert len(rest) == 1 and rest[0].finished and not first.finished
    assert (
        sum(1 for i, finished in built if i == "slow" and not finished)
        <= 3
        < len(expected.token_ids)
    )
    assert (rest[0].outputs[0].token_ids, rest[0].outputs[0].text) == (
        expected.token_ids,
        expected.text,
    )


def test_a_client_that_leaves_mid_stream_frees_its_request(server):
    """The server sees the client go (the ASGI server tells it) and aborts the request. The engine core, stopped
    (SIGSTOP) from the first token until then, cannot run the request on to its end meanwhile."""
    url, llm = server
    body = dict(
        model="tiny",
        prompt="A long story:",
        max_tokens=400,
        temperature=0,
        ignore_eos=True,
        stream=True,
    )
    aborted = llm.num_aborted
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        events = response.iter_lines()
        assert next(line for line in events if line.startswith("data:"))  # it has started
        os.kill(llm.process.pid, signal.SIGSTOP)  # no step runs until the abort
    try:
        deadline = time.monotonic() + 120  # a hang check: the server notices in milliseconds
        while llm.num_aborted == aborted and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(llm.process.pid, signal.SIGCONT)
    assert llm.num_aborted == aborted + 1  # aborted, not run to its 400th token
    idle = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0}
    deadline = time.monotonic() + 120
    while (
        llm.stats() != idle and time.monotonic() < deadline
    ):  # the core says so after its next message
        time.sleep(0.05)
    assert llm.stats() == idle and llm.is_healthy()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(model="gpt-4"), "model"),
        (dict(prompt=""), "prompt"),
        (dict(prompt=[10**9]), "prompt"),
        (dict(prompt=None), "prompt"),
        (dict(n=0), "n"),
        (dict(logprobs=21), "logprobs"),
        (dict(presence_penalty=5), "presence_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(min_tokens=9), "min_tokens"),
    ],
)
def test_a_bad_request_gets_a_400_naming_the_field(server, change, field):
    body = {**dict(model="tiny", prompt="Hello", max_tokens=4), **change}
    response = httpx.post(f"{server[0]}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (
        error["param"] == field
        and field in error["message"]
        and error["type"] == "invalid_request_error"
    )


def test_a_stream_that_fails_midway_ends_with_an_error_event(server):
    """A stream ends with its last token and [DONE], or with an event saying why it stopped: an
    exception midway (here the engine's stream raising after its first output, an engine handed to
    the server that fails so) must not cut the connection mid-stream, leaving the client with a
    broken read and no reason."""
    body = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    body |= dict(ignore_eos=True, stream=True)
    with serve_in_thread(WatchedLLM(server[1], fail_after=1), "tiny") as url:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    first, error = json.loads(events[0]), json.loads(events[-1])["error"]
    assert len(events) == 2 and first["choices"]  # a token, then the error
    assert "ValueError: injected failure" in error["message"] and error["type"] == "server_error"


def test_300_concurrent_streams_each_get_every_token_and_done(server):
    """300 streams at once (the engine runs 32 at a time: most wait in its queue): each ends with
    its last token, the usage chunk and [DONE], and its events carry each of its max_tokens tokens
    (logprobs=0 names the tokens each event adds)."""
    max_tokens = 8

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int, str]:
        body = dict(model="tiny", prompt=f"Stream {i} says", max_tokens=max_tokens, logprobs=0)
        body |= dict(ignore_eos=True, stream=True, stream_options=dict(include_usage=True))
        tokens, usage, last = 0, -1, ""
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = line
                if line.startswith("data: {"):
                    event = json.loads(line.removeprefix("data: "))
                    tokens += sum(len(c["logprobs"]["tokens"]) for c in event["choices"])
                    usage = (event.get("usage") or {}).get("completion_tokens", usage)
        return tokens, usage, last

    async def all_at_once() -> list[tuple[int, int, str]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        new = lambda: httpx.AsyncClient(base_url=server[0], timeout=300, limits=limits)
        # 30 streams a client: the work of httpx's pool grows as the square of its connections
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(new()) for _ in range(10)]
            return await asyncio.gather(*(one(clients[i % 10], i) for i in range(300)))

    results = asyncio.run(all_at_once())
    assert results == [(max_tokens, max_tokens, "data: [DONE]")] * 300


# tiny-text, whose text holds the stop strings below
STOP_ID_THEN_STRING = dict(n=2, seed=0, max_tokens=16, stop_token_ids=[998], stop=[" above"])
MIN_TOKENS_THEN_STRING = dict(temperature=0, max_tokens=60, min_tokens=25, stop=[" the"])
TEXT_CASES = {
    "n=2, a stop id then a stop string": STOP_ID_THEN_STRING,
    "min_tokens, then a stop string": MIN_TOKENS_THEN_STRING,
}


@pytest.fixture(scope="module")
def text_server(tiny_text, serve_config):
    """The server over tiny-text, and offline `LLM` on it; yields (base_url, the offline LLM)."""
    llm = AsyncLLM(str(tiny_text), **serve_config)
    with LLM(str(tiny_text), **serve_config) as offline, serve_in_thread(llm, "tiny-text") as url:
        yield url, offline
    llm.close()


def reply(url: str, body: dict) -> tuple[list[str], list[str | None]]:
    """A /v1/completions reply's texts and finish reasons, by index; a stream must end with
    `data: [DONE]`."""
    if not body["stream"]:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        return [c["text"] for c in choices], [c["finish_reason"] for c in choices]
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [line.removeprefix("data: ") for line in lines]
    assert events[-1] == "[DONE]", events[-1]
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    texts, reasons = [""] * body.get("n", 1), [None] * body.get("n", 1)
    for c in chunks:
        texts[c["index"]] += c["text"]
        reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    return texts, reasons


@pytest.mark.slow  # the tiny_text fixture trains for half a minute
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_stop_strings_with_n_and_min_tokens_reply_as_offline(text_server, case, stream):
    """n=2 where completion 0 ends on a stop id (3rd token) before completion 1's stop string
    (9th): the request used to stay live in the engine core, and the client waited forever.
    min_tokens=25 with stop=" the": greedy text holds " the" at its 2nd token, which used to stop
    it; a stop string counts only after min_tokens tokens, in the text after theirs. Both reply
    (a stream ends with [DONE]) as offline `generate` does."""
    url, offline = text_server
    fields = TEXT_CASES[case]
    want = offline.generate("Once upon a time", SamplingParams(**fields), use_tqdm=False)[0].outputs
    assert all(c.finish_reason == "stop" for c in want)
    assert len(want[-1].token_ids) >= fields.get("min_tokens", 0)
    got = reply(url, dict(model="tiny-text", prompt="Once upon a time", stream=stream, **fields))
    assert got == ([c.text for c in want], [c.finish_reason for c in want])
