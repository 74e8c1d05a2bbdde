"""Async scheduling (notebook 06): the engine schedules and launches step N+1 before it reads step N's tokens, which
step N+1's inputs carry as placeholders (-1 - row) until the runner swaps them for the sampled ids on the device.

On the CPU (nothing runs ahead there, but every line of the path runs), the tiny checkpoint in float32: greedy tokens
equal transformers' under both policies in every regime of the scheduler's parity tests; sampled, stopped, penalised,
n > 1 and log-probability requests give exactly the synchronous engine's outputs; the order of the runner's calls
shows that step N+1 is launched before step N's output is read; blocks completed while a token was a placeholder are
cached under their true hash; an abort between two calls leaves nothing behind.
"""

import random

import pytest
import torch

from minivllm import LLM, SamplingParams

rng = random.Random(0)
SHARED = rng.choices(range(3, 2048), k=40)  # a common prefix: prefix-cache hits
PROMPTS = [
    (SHARED if i % 2 else []) + rng.choices(range(3, 2048), k=rng.randint(1, 60)) for i in range(10)
]
MAX_TOKENS = [rng.randint(1, 24) for _ in PROMPTS]
REGIMES = {
    "plain": {},
    "preemption": dict(num_kvcache_blocks=14),
    "tiny budget": dict(max_num_batched_tokens=7),
    "no prefix cache": dict(enable_prefix_caching=False),
}


def make_llm(tiny, async_scheduling: bool, **config) -> LLM:
    return LLM(
        str(tiny), async_scheduling=async_scheduling, max_num_seqs=6, max_model_len=256, **config
    )


def completions(llm: LLM, prompts, params) -> tuple[list[tuple], list[float]]:
    """Each completion's tokens, finish reason, text and the ranks and ids of its (prompt) log-probabilities; and the
    log-probability values, which may differ in the last bits: a row's logits depend a little on its batch's shape."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert (
        not llm.engine.has_unfinished_requests()
        and llm.engine.core.scheduler.block_manager.num_used_blocks == 0
    )
    exact, values = [], []
    for o in outs:
        for c in o.outputs:
            rows = [
                row for row in [*(c.logprobs or []), *(o.prompt_logprobs or [])] if row is not None
            ]
            exact.append(
                (
                    c.token_ids,
                    c.finish_reason,
                    c.text,
                    [[(t, lp.rank) for t, lp in r.items()] for r in rows],
                )
            )
            values += [lp.logprob for r in rows for lp in r.values()] + [
                c.cumulative_logprob or 0.0
            ]
    return exact, values


@pytest.mark.parametrize("policy", ["prefill-first", "unified"])
@pytest.mark.parametrize("regime", REGIMES)
def test_greedy_tokens_equal_transformers(tiny, hf_greedy, policy, regime):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    with make_llm(tiny, True, scheduling_policy=policy, **REGIMES[regime]) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [
            hf_greedy(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)
        ]
        assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0
        assert (llm.engine.core.scheduler.num_preemptions > 0) == (regime == "preemption")


@pytest.mark.parametrize("policy", ["prefill-first", "unified"])
def test_every_kind_of_request_gives_the_synchronous_outputs(tiny, hf_greedy, policy):
    """Seeded sampling, early stops (the step launched ahead computes a row for a request that has already stopped),
    penalties (no step is launched ahead of theirs), n > 1, log-probabilities and prompt log-probabilities."""
    stop_at = [
        hf_greedy(p, 6)[3] for p in PROMPTS[:4]
    ]  # greedy requests that stop at their 4th token
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[t]) for t in stop_at]
    params += [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True),
        SamplingParams(
            temperature=1.0, top_k=20, seed=3, n=3, max_tokens=9, logprobs=2, ignore_eos=True
        ),
        SamplingParams(
            temperature=0.7, seed=1, max_tokens=10, presence_penalty=0.5, repetition_penalty=1.2
        ),
        SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1, logprobs=0, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=4, ignore_eos=False),
        SamplingParams(
            temperature=0.9, seed=11, max_tokens=14, frequency_penalty=0.3, ignore_eos=True
        ),
    ]
    prompts = PROMPTS[: len(params)]
    results = {}
    for async_scheduling in (False, True):
        with make_llm(
            tiny, async_scheduling, scheduling_policy=policy, num_kvcache_blocks=24
        ) as llm:
            results[async_scheduling] = completions(llm, prompts, params)
    (exact, values), (sync_exact, sync_values) = results[True], results[False]
    assert (
        exact == sync_exact and values == pytest.approx(sync_values, abs=1e-4) and len(values) > 60
    )
    assert [(r[1], r[0][-1]) for r in exact[:4]] == [
        ("stop", t) for t in stop_at
    ]  # by the 4th token
    assert all(len(r[0]) <= 4 for r in exact[:4])


class CallLog:
    """Wraps runner.launch: logs ("launch", k) when step k is queued and ("output", k) when its output is read."""

    def __init__(self, runner):
        self.events: list[tuple[str, int]] = []
        self.launch = runner.launch
        runner.launch = self

    def __call__(self, seqs, is_prefill):
        k = sum(kind == "launch" for kind, _ in self.events)
        self.events.append(("launch", k))
        output = self.launch(seqs, is_prefill)

        def logged():
            self.events.append(("output", k))
            return output()

        return logged


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_next_step_is_launched_before_this_ones_output_is_read(tiny, async_scheduling):
    with make_llm(tiny, async_scheduling) as llm:
        log = CallLog(llm.engine.core.runner)
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        llm.generate(PROMPTS[:3], greedy, use_tqdm=False)
        steps = sum(kind == "launch" for kind, _ in log.events)
        if (
            async_scheduling
        ):  # launch 0, launch 1, output 0, launch 2, output 1, ..., output of the last step
            expected = [("launch", 0)] + [
                e for k in range(steps - 1) for e in (("launch", k + 1), ("output", k))
            ]
            expected.append(("output", steps - 1))
        else:
            expected = [e for k in range(steps) for e in (("launch", k), ("output", k))]
        assert log.events == expected and steps >= 6
        log.events.clear()  # a penalised request: each step's tokens are read before the next step is scheduled
        llm.generate(
            PROMPTS[:2],
            SamplingParams(temperature=0, max_tokens=4, presence_penalty=1.0),
            use_tqdm=False,
        )
        assert log.events == [
            e for k in range(len(log.events) // 2) for e in (("launch", k), ("output", k))
        ]


def test_blocks_completed_by_a_placeholder_are_cached_under_their_true_hash(tiny, hf_greedy):
    """A 30-token prompt and 20 generated tokens: blocks 1 and 2 are completed by generated tokens, cached by the
    step that computes them while the token is still a placeholder. A request that starts with those 48 tokens must
    hit all three blocks, as under the synchronous engine."""
    prompt = list(range(100, 130))
    reply = hf_greedy(prompt, 20)
    hits = {}
    for async_scheduling in (False, True):
        with make_llm(tiny, async_scheduling) as llm:
            out = llm.generate(
                [prompt],
                SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                use_tqdm=False,
            )
            assert out[0].outputs[0].token_ids == reply
            llm.engine.add_request(prompt + reply[:18] + [5, 6, 7], SamplingParams(max_tokens=1))
            outputs, stats = llm.engine.step()
            assert stats.kind == "prefill" and len(outputs) == 1
            hits[async_scheduling] = 51 - stats.num_tokens
    assert hits == {False: 48, True: 48}


def test_a_step_launched_for_requests_that_then_stop_is_dropped(tiny, hf_greedy):
    """The last request stops on a token read after the next step was launched for it: generate returns, and the
    engine is idle (no step left to read), as the synchronous engine is."""
    prompt = PROMPTS[0]
    stop = hf_greedy(prompt, 6)[3]
    with make_llm(tiny, True) as llm:
        out = llm.generate(
            prompt,
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]),
            use_tqdm=False,
        )
        assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].token_ids[-1] == stop
        assert not llm.engine.has_unfinished_requests() and llm.engine.core.launched is None
        assert (
            llm.engine.step()[1].kind == "idle"
            and llm.engine.core.scheduler.block_manager.num_used_blocks == 0
        )


def test_an_abort_between_steps_leaves_nothing_behind(tiny, hf_greedy):
    with make_llm(tiny, True) as llm:
        engine = llm.engine
        greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        engine.add_request(PROMPTS[0], greedy, "kept")
        engine.add_request(PROMPTS[1], greedy, "dropped")
        for _ in range(3):
            engine.step()
        assert engine.core.launched is not None  # a step is on its way with both requests
        engine.abort_request("dropped")
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()[0]
        assert [(o.request_id, o.outputs[0].token_ids) for o in outputs] == [
            ("kept", hf_greedy(PROMPTS[0], 10))
        ]
        assert not engine.core.requests and engine.core.scheduler.block_manager.num_used_blocks == 0
        assert engine.step()[1].kind == "idle"


def test_async_scheduling_is_off_on_a_cpu_and_refused_with_tensor_parallelism(tiny):
    from minivllm.config import Config

    assert Config(tiny).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        Config(tiny, async_scheduling=True, tensor_parallel_size=2, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_launching_a_step_never_waits_for_the_gpu(tiny):
    """Launching a step (prefill, mixed or decode) only queues work: a host-device copy or read that
    waits for the GPU there would leave it idle while the host prepares the next step (a blocking
    `.to("cuda")` of an index array did, every step)."""
    with make_llm(tiny, True, device="cuda") as llm:
        runner = llm.engine.core.runner
        launch = runner.launch

        def strict_launch(seqs, is_prefill):
            torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
            try:
                return launch(seqs, is_prefill)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        runner.launch = strict_launch
        params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
