"""The engine and vLLM's offline API (notebook 06): parity with transformers, stopping, validation, recovery, CLI."""

import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from minivllm import LLM, SamplingParams
from minivllm.testing import WatchedDict

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(str(tiny), num_kvcache_blocks=256, max_num_seqs=16, max_model_len=512) as llm:
        yield llm


def test_generate_equals_transformers_greedy_for_mixed_prompts(llm, hf_greedy, tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    shared = list(range(100, 150))
    prompts = [
        "Once upon a time",
        [7],
        list(range(3, 40)),
        shared + [1],
        shared + [2, 3],
        "A paged KV cache is",
    ]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == [p if isinstance(p, str) else None for p in prompts]
    for prompt, out in zip(prompts, outputs):
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(ids, 24)
        assert out.outputs[0].finish_reason == "length" and out.finished
        assert out.outputs[0].text == tokenizer.decode(
            out.outputs[0].token_ids, skip_special_tokens=True
        )
        assert out.metrics.time_to_first_token > 0 and out.metrics.time_per_output_token(24) > 0


def test_single_prompt_forms(llm):
    by_text = llm.generate("Hello", GREEDY, use_tqdm=False)
    by_ids = llm.generate(by_text[0].prompt_token_ids, GREEDY, use_tqdm=False)
    assert len(by_text) == len(by_ids) == 1
    assert by_text[0].outputs[0].token_ids == by_ids[0].outputs[0].token_ids


def test_stop_token_ids_and_eos(llm, tiny, tmp_path):
    tokens = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = tokens[5]
    first = tokens.index(stop)
    out = llm.generate(
        [[5, 6, 7]],
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop"

    # an end-of-sequence id from generation_config.json stops a request, unless ignore_eos
    eos_folder = tmp_path / "eos"
    shutil.copytree(tiny, eos_folder)
    generation_config = json.loads((eos_folder / "generation_config.json").read_text())
    generation_config["eos_token_id"] = [generation_config["eos_token_id"][0], stop]
    (eos_folder / "generation_config.json").write_text(json.dumps(generation_config))
    with LLM(str(eos_folder), num_kvcache_blocks=64, max_num_seqs=4, max_model_len=256) as eos_llm:
        stopped = eos_llm.generate(
            [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
        )
        ignored = eos_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert (
        stopped[0].outputs[0].token_ids == tokens[: first + 1]
        and stopped[0].outputs[0].finish_reason == "stop"
    )
    assert ignored[0].outputs[0].token_ids == tokens


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_the_text_there_and_frees_the_blocks(llm, include):
    full = llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 3 :][:3]  # three characters a third of the way in
    end = full.text.find(stop) + (len(stop) if include else 0)
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=stop, include_stop_str_in_output=include
    )
    out = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:end] and out.finish_reason == "stop"
    assert (
        out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 24
    )  # it stopped early
    bm = llm.engine.core.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_running_reply_never_shows_text_it_takes_back(llm):
    """A running reply's output (finished=False, what a stream sends) holds back what may begin a stop string: every
    partial text is a prefix of the final one."""
    full = llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2 :][:4]
    request_id = llm.engine.add_request(
        "Once upon a time", dataclasses.replace(GREEDY, stop=[stop, "zz"])
    )
    partial, final = [], None
    while final is None:
        finished, _ = llm.engine.step()
        if (request := llm.engine.output_processor.requests.get(request_id)) is not None:
            partial.append(llm.engine.output_processor.output(request).outputs[0].text)
        final = next(
            (out.outputs[0].text for out in finished if out.request_id == request_id), None
        )
    assert final == full[: full.find(stop)] and len(partial) >= 2
    assert all(final.startswith(text) for text in partial)


def test_running_text_is_decoded_incrementally_and_equals_the_whole_decode(llm):
    """What a stream shows while a reply runs (running_text, from its newest tokens) is always a prefix of the whole
    reply's decode, and all of it once that decode is whole; random tokens, multi-byte characters included."""
    engine, outputs, rng = llm.engine, llm.engine.output_processor, random.Random(0)
    for trial in range(20):
        request = engine.input_processor.make_request([1, 2, 3], GREEDY, f"r{trial}", "prompt")
        completion = request.completions[0]
        for _ in range(60):
            completion.token_ids.append(rng.randrange(2048))
            text = outputs.running_text(completion)
            whole = outputs.detokenize(completion.token_ids)
            assert whole.startswith(text)
            assert text == whole or whole.endswith("\ufffd")


def test_min_tokens_holds_back_stop_tokens(llm):
    tokens = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = tokens[
        0
    ]  # the first token greedy picks: with min_tokens=4 it may not be drawn before the 5th
    out = llm.generate(
        [[5, 6, 7]],
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], min_tokens=4),
        use_tqdm=False,
    )[0].outputs[0]
    assert (
        len(out.token_ids) > 4 and stop not in out.token_ids[:4] and out.token_ids[0] != tokens[0]
    )


@pytest.mark.slow  # the tiny_text fixture trains for half a minute
def test_min_tokens_holds_back_stop_strings(tiny_text, serve_config):
    """Greedy tiny-text holds " the" at its 2nd token. With min_tokens=25, as in vLLM, a stop
    string counts only once 25 tokens are out, and only in the text after theirs: one inside the
    first 25 tokens' text does not stop the reply (it used to: 2 tokens, finish "stop")."""
    params = SamplingParams(temperature=0, max_tokens=60, min_tokens=25, stop=[" the"])
    with LLM(str(tiny_text), **serve_config) as text_llm:
        (out,) = text_llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs
        tokenizer = text_llm.get_tokenizer()
    head, full = tokenizer.decode(out.token_ids[:25]), tokenizer.decode(out.token_ids)
    assert len(out.token_ids) >= 25 and " the" in head and full.startswith(head)
    end = full.find(" the", len(head))
    assert end >= 0 and out.finish_reason == "stop" and out.text == full[:end]
    before_last = tokenizer.decode(out.token_ids[:-1])
    assert before_last.find(" the", len(head)) < 0  # it stopped at the first one after the head


def test_max_tokens_and_max_model_len_finish_with_length(llm):
    out = llm.generate(
        [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].finish_reason == "length"
    long = llm.generate(
        [[1] * 500], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
    )
    assert (
        len(long[0].outputs[0].token_ids) == 12 and long[0].outputs[0].finish_reason == "length"
    )  # 512 in all


@pytest.mark.parametrize(
    "prompts, params, field",
    [
        ([[]], GREEDY, "prompt is empty"),
        ([[1, 2, 10**6]], GREEDY, "token id 1000000 is outside the vocabulary"),
        ([[1] * 512], GREEDY, "max_model_len"),
        ([[1, 2], [1, -3], [4]], GREEDY, "token id -3"),
        ([[1, 2]], [GREEDY, GREEDY], "sampling_params has 2 entries"),
        ([[1, 2]], "greedy", "sampling_params must be SamplingParams"),
        (
            [[1, 2]],
            SamplingParams(min_tokens=1, stop_token_ids=[5000]),
            "stop_token_ids: token id 5000 is outside",
        ),
    ],
)
def test_bad_requests_raise_and_change_nothing(llm, prompts, params, field):
    free = llm.engine.core.scheduler.block_manager.num_free_blocks
    with pytest.raises(ValueError, match=field):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.scheduler.block_manager.num_free_blocks == free
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=17), "min_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[3]), "stop"),
        (dict(stop=123), "stop must be a str or a list of str"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
        (dict(n=0), "^n must"),
        (dict(n=2.0), "^n must"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=True), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "messages, index",
    [
        ([{"role": "user"}], 0),
        ([{"role": "user", "content": "Hi"}, {"content": "Hello"}], 1),
        ([{"role": "user", "content": "Hi"}, "Hello"], 1),
    ],
)
def test_chat_names_the_message_that_is_not_a_role_and_content(llm, messages, index):
    with pytest.raises(
        ValueError, match=rf'messages\[{index}\] must be a dict with "role" and "content"'
    ):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_cache_too_small_for_the_prompt(tiny):
    with LLM(str(tiny), num_kvcache_blocks=2, max_num_seqs=4, max_model_len=256) as small:
        with pytest.raises(ValueError, match="KV cache holds 32"):
            small.generate([[1] * 40], GREEDY, use_tqdm=False)
        assert (
            small.generate([[1] * 20], SamplingParams(max_tokens=4), use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )


def test_missing_model_folder():
    with pytest.raises(FileNotFoundError):
        LLM("/no/such/folder")


def test_two_threads_calling_generate_take_turns(llm, hf_greedy):
    """One engine, two threads calling generate at once: each gets exactly what it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[5, 6, 7], [8, 9]]
    alone = [hf_greedy(p, 24) for p in prompts]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: llm.generate(prompts, GREEDY, use_tqdm=False), range(2)))
    assert all([out.outputs[0].token_ids for out in result] == alone for result in results)
    assert (
        not llm.engine.has_unfinished_requests()
        and not llm.engine.output_processor.requests
        and not llm.engine.core.requests
    )


def test_an_interrupted_generate_leaves_the_engine_usable(llm, hf_greedy):
    runner = llm.engine.core.runner
    original, calls = runner.launch, []

    def failing_step(seqs, is_prefill):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return original(seqs, is_prefill)

    runner.launch = failing_step
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([list(range(10, 30)), [3, 4]], GREEDY, use_tqdm=False)
    finally:
        runner.launch = original
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0
    out = llm.generate([[3, 4]], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy([3, 4], 24)


def test_each_step_returns_its_stats(llm):
    engine = llm.engine
    uncached = list(range(700, 720))
    engine.add_request(uncached, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), "s")
    steps, outputs = [], []
    while engine.has_unfinished_requests():
        finished, stats = engine.step()
        outputs += finished
        steps.append(stats)
    assert [(s.kind, s.num_seqs, s.num_tokens) for s in steps] == [
        ("prefill", 1, 20),
        ("decode", 1, 1),
        ("decode", 1, 1),
    ]
    assert all(
        s.schedule_seconds >= 0 and s.run_seconds > 0 and s.postprocess_seconds >= 0 for s in steps
    )
    assert all(
        s.seconds == s.schedule_seconds + s.run_seconds + s.postprocess_seconds for s in steps
    )
    assert [o.request_id for o in outputs] == ["s"] and len(outputs[0].outputs[0].token_ids) == 3
    assert engine.step()[1].kind == "idle"


def test_abort_drops_every_request_and_the_engine_goes_on(llm, hf_greedy):
    engine = llm.engine
    for i, prompt in enumerate([list(range(10, 50)), [3, 4, 5], list(range(60, 100))]):
        engine.add_request(prompt, GREEDY, f"abort-{i}")
    engine.step()  # one prefill: all three now hold blocks
    assert engine.core.scheduler.block_manager.num_used_blocks > 0
    llm.abort()
    assert not engine.has_unfinished_requests() and not engine.output_processor.requests
    bm = engine.core.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_free_blocks == 0
    out = llm.generate(
        [list(range(10, 50))], GREEDY, use_tqdm=False
    )  # the same prompt, from scratch
    assert out[0].outputs[0].token_ids == hf_greedy(list(range(10, 50)), 24)


def test_cli_runs_the_tiny_preset(tmp_path):
    env = dict(os.environ, MINIVLLM_CHECKPOINTS=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "minivllm", "--preset", "tiny", "--max-tokens", "8", "Hello there"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "'Hello there'" in proc.stdout
        and "output tokens in" in proc.stdout
        and "tokens/s" in proc.stdout
    )
    split = next(line for line in proc.stdout.splitlines() if line.startswith("start-up: imports"))
    gpu_phases = ("compile", "CUDA graphs") if torch.cuda.is_available() else ()  # a GPU runner's
    phases = ("LLM()", "load", "KV cache", *gpu_phases, "tokenizer and the rest", "generate")
    for phase in phases:  # the start-up split names every phase, each with its seconds
        assert f"{phase} " in split, split
    seconds = [float(x) for x in re.findall(r"(\d+\.\d+)", split)]
    assert len(seconds) == 2 + len(phases) and all(x >= 0 for x in seconds), split


def test_tokenizer_loads_the_class_its_config_names_without_auto_tokenizer(tiny):
    """AutoTokenizer imports transformers' model registry (seconds of start-up): the named class is imported alone."""
    code = (
        "import sys; from minivllm.engine.input_processor import load_tokenizer; "
        f"t = load_tokenizer({str(tiny)!r}); "
        "print(type(t).__name__, 'transformers.models.auto.tokenization_auto' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["TokenizersBackend", "False"]


def test_adding_aborting_and_stepping_never_walk_the_other_requests(llm):
    """Each add, abort and step looks up its own requests by id: a walk over every queued request
    made each of N adds O(N) (a flood of N requests O(N²) on the host)."""
    engine, core, walks = llm.engine, llm.engine.core, []
    front = engine.output_processor
    front.requests = WatchedDict(front.requests, walks)
    core.requests, core.owners = WatchedDict(core.requests, walks), WatchedDict(core.owners, walks)
    try:
        ids = [engine.add_request(f"Request {i}", SamplingParams(max_tokens=3)) for i in range(300)]
        engine.add_request("Named", SamplingParams(max_tokens=3), request_id="named")
        engine.step()
        engine.abort_request(ids[:100])
        while engine.has_unfinished_requests():
            engine.step()
        assert walks == []
    finally:
        front.requests = dict(front.requests)
        core.requests, core.owners = dict(core.requests), dict(core.owners)
    assert not front.requests and not core.requests and not core.owners
