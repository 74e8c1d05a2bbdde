"""The server's operating habits, vLLM's (`python -m minivllm.serve`): /metrics in Prometheus' text format. CPU, tiny
preset, float32, greedy."""

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")


def scrape(url: str) -> dict[str, float]:
    """/metrics parsed: each sample's value by name (histograms' buckets left out; one model, one label)."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    families = parser.text_string_to_metric_families(text)
    return {s.name: s.value for family in families for s in family.samples if "le" not in s.labels}


def test_metrics_count_what_the_replies_report(server):
    url, _ = server
    before = scrape(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=7, temperature=0, extra_body=dict(ignore_eos=True))
    usages = [client.completions.create(**kw).usage, client.completions.create(n=2, **kw).usage]
    usages.append(list(client.completions.create(stream=True, stream_options=dict(include_usage=True), **kw))[-1].usage)
    messages = [{"role": "user", "content": "Name a colour."}]
    usages.append(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5).usage)
    after = scrape(url)

    def added(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert added("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert added("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert added("vllm:request_success_total") == len(usages) == 4
    assert added("vllm:time_to_first_token_seconds_count") == len(usages)
    assert added("vllm:time_per_output_token_seconds_count") >= 3  # the chat reply may stop after one token
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0  # finished requests' blocks are free (cached or not)
