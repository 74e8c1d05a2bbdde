"""Misuse of the engine (issue 18): no silent wrong answers, no hangs. Concurrent generate calls, checkpoints without
a tokenizer, atomic validation of every field of every request, numeric edges of the sampling parameters, the
LLMEngine step/add_request API, and the command line's bad values."""

import math
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.outputs import StepStats

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(str(tiny), num_kvcache_blocks=64, max_num_seqs=8, max_model_len=256) as llm:
        yield llm


def greedy_tokens(llm: LLM, prompt: list[int], max_tokens: int = 8) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def assert_idle(llm: LLM) -> None:
    """Nothing queued, nothing leaked: no request entry, no held KV block, no output kept back."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine.output_processor.requests and not engine.core.requests
    assert engine.core.scheduler.block_manager.num_used_blocks == 0
    outputs, stats = engine.step()
    assert outputs == [] and stats.kind == "idle" and stats.num_tokens == 0


# --- 1. concurrent generate calls ----------------------------------------------------------------------------------


def test_concurrent_generate_calls_are_serialised(llm):
    batches = [[[i + 1, i + 2, i + 3], list(range(10 + i, 30 + i))] for i in range(3)]
    alone = [
        [o.outputs[0].token_ids for o in llm.generate(b, GREEDY, use_tqdm=False)] for b in batches
    ]
    start, results, errors = threading.Barrier(len(batches)), [None] * len(batches), []

    def worker(i: int) -> None:
        start.wait()
        try:
            results[i] = [
                o.outputs[0].token_ids for o in llm.generate(batches[i], GREEDY, use_tqdm=False)
            ]
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a generate call hangs"
    assert not errors, errors
    assert results == alone
    assert_idle(llm)


# --- 2. a checkpoint without a tokenizer ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dropped", [("tokenizer.json", "tokenizer_config.json"), ("tokenizer.json",)]
)
def test_a_checkpoint_without_tokenizer_files_refuses_text(tiny, tmp_path, llm, dropped):
    folder = tmp_path / "no_tokenizer"
    shutil.copytree(tiny, folder)
    for name in dropped:
        (folder / name).unlink()
    with LLM(str(folder), num_kvcache_blocks=16, max_num_seqs=2, max_model_len=64) as bare:
        assert bare.get_tokenizer() is None
        with pytest.raises(ValueError, match="has no tokenizer: pass token ids"):
            bare.generate("Hello there", GREEDY, use_tqdm=False)
        assert_idle(bare)
        out = bare.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_tokens(llm, [5, 6, 7]) and out.text == ""


# --- 3. validation covers every field, and a call is atomic --------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 1.5),
        ("max_tokens", 2.0),
        ("max_tokens", "3"),
        ("max_tokens", None),
        ("max_tokens", True),
        ("max_tokens", np.float64(2)),
        ("seed", 1.5),
        ("seed", "7"),
        ("seed", True),
        ("top_k", 2.0),
        ("top_k", None),
        ("top_k", True),
        ("top_k", 2**63),  # top_k travels to the sampler as int64
        ("stop_token_ids", [[1]]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [None]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 5),
        ("stop_token_ids", "ab"),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", (i for i in [1])),
        ("temperature", None),
        ("temperature", "0.5"),
        ("temperature", True),
        ("temperature", math.inf),
        ("temperature", -math.inf),
        ("temperature", 1j),
        ("top_p", None),
        ("top_p", math.inf),
        ("top_p", "1"),
        ("min_p", None),
        ("min_p", math.inf),
        ("min_p", -math.inf),
        ("ignore_eos", "yes"),
        ("ignore_eos", None),
    ],
)
def test_sampling_params_reject_wrong_types(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_accept_numpy_and_torch_scalars():
    p = SamplingParams(
        max_tokens=np.int64(3),
        seed=torch.tensor(5),
        top_k=np.int32(4),
        temperature=np.float32(0.5),
        top_p=torch.tensor(0.75),
        min_p=np.float64(0.125),
        stop_token_ids=(np.int64(1), torch.tensor(2)),
        ignore_eos=np.bool_(True),
    )
    assert (p.max_tokens, p.seed, p.top_k, p.temperature, p.top_p, p.min_p) == (
        3,
        5,
        4,
        0.5,
        0.75,
        0.125,
    )
    assert p.stop_token_ids == [1, 2] and p.ignore_eos is True
    assert all(type(v) is int for v in (p.max_tokens, p.seed, p.top_k, *p.stop_token_ids))
    assert all(type(v) is float for v in (p.temperature, p.top_p, p.min_p))


@pytest.mark.parametrize(
    "prompt",
    [
        np.array([5, 6, 7]),
        torch.tensor([5, 6, 7]),
        np.array([5, 6, 7], dtype=np.int32),
        (5, 6, 7),
        [np.int64(5), 6, torch.tensor(7)],
        torch.tensor([5, 6, 7], dtype=torch.int32),
    ],
)
def test_integer_arrays_and_scalars_are_prompts(llm, prompt):
    out = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt_token_ids == [5, 6, 7]
    assert all(type(t) is int for t in out[0].prompt_token_ids)
    assert out[0].outputs[0].token_ids == greedy_tokens(llm, [5, 6, 7])
    both = llm.generate([prompt, [5, 6, 7]], GREEDY, use_tqdm=False)
    assert both[0].outputs[0].token_ids == both[1].outputs[0].token_ids


@pytest.mark.parametrize(
    "prompts",
    [
        [[1.0, 2.0]],
        [[1, None]],
        [[1, [2]]],
        [[True, 2]],
        [[1, 2], [3.5]],
        np.array([1.0, 2.0]),
        np.array([[1, 2]]),
        torch.tensor([[1, 2]]),
        torch.tensor([1.0, 2.0]),
        np.array([True, False]),
        (t for t in [1, 2]),
        [(t for t in [1, 2])],
        None,
        [None],
        5,
        [[1, 2], 3],
        [[1, 2], b"ab"],
    ],
)
def test_bad_prompts_raise_and_change_nothing(llm, prompts):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_a_bad_request_anywhere_in_a_call_queues_nothing(llm):
    changed = SamplingParams(max_tokens=4)
    changed.stop_token_ids = [[1]]  # changed after it was checked: the engine checks again
    zero = SamplingParams()
    zero.max_tokens = 0
    for bad in (changed, zero):
        with pytest.raises(ValueError, match="stop_token_ids|max_tokens"):
            llm.generate([[1, 2], [3, 4], [5, 6]], [GREEDY, GREEDY, bad], use_tqdm=False)
        assert_idle(llm)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(
            [[1, 2], [3, 4]], [GREEDY, SamplingParams(stop_token_ids=[[1]])], use_tqdm=False
        )
    assert_idle(llm)
    assert llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_a_request_keeps_its_own_copy_of_the_parameters(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.engine.add_request([5, 6, 7], params, "copy")
    params.max_tokens = 1  # the queued request must not see this
    outputs = drain(llm)
    assert [o.request_id for o in outputs] == ["copy"] and len(outputs[0].outputs[0].token_ids) == 8


# --- 4. numeric edges ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", math.nan),
        ("top_p", math.inf),
        ("min_p", math.nan),
        ("min_p", math.inf),
        ("temperature", np.float32("nan")),
        ("top_p", torch.tensor(math.nan)),
    ],
)
def test_non_finite_sampling_params_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_p", 1e-300),  # 0 in float32: no token would be kept
        ("top_p", 1e-39),  # a float32 subnormal
        ("repetition_penalty", 1e-300),  # 0 in float32: x / 0 and 0 * inf are NaN probabilities
        ("repetition_penalty", 1e-7),
        ("repetition_penalty", 1e300),
    ],
)
def test_sampling_values_that_float32_cannot_hold_are_refused(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: value})


def test_the_float32_floors_themselves_sample_valid_tokens(llm):
    edges = [dict(top_p=2**-126), dict(repetition_penalty=1e-6), dict(repetition_penalty=1e6)]
    params = [SamplingParams(seed=3, max_tokens=4, ignore_eos=True, **edge) for edge in edges]
    outputs = llm.generate([[1, 2, 3, 1, 2]] * len(params), params, use_tqdm=False)
    vocab_size = llm.engine.config.hf_config.vocab_size
    assert all(
        len(o.outputs[0].token_ids) == 4 and 0 <= min(o.outputs[0].token_ids) for o in outputs
    )
    assert all(max(o.outputs[0].token_ids) < vocab_size for o in outputs)


@pytest.mark.parametrize(
    "temperature", [9.99e-6, 1e-6, 1.1754944e-38, float(np.float32(1e-45)), 5e-324, 0.0]
)
def test_temperatures_below_1e_5_are_greedy(llm, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=3)
    assert params.temperature == 0.0
    out = llm.generate([[5, 6, 7], list(range(40, 60))], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [
        greedy_tokens(llm, [5, 6, 7]),
        greedy_tokens(llm, list(range(40, 60))),
    ]


@pytest.mark.parametrize("temperature", [1e-5, 1e-4, 1e30, float(np.finfo(np.float32).max), 1e300])
def test_extreme_temperatures_sample_valid_tokens(llm, temperature):
    params = SamplingParams(
        temperature=temperature, max_tokens=8, ignore_eos=True, seed=3, top_p=0.9, min_p=1e-30
    )
    assert params.temperature == temperature
    tokens = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    vocab = llm.engine.config.hf_config.vocab_size
    assert len(tokens) == 8 and all(0 <= t < vocab for t in tokens)
    if temperature <= 1e-4:  # the logits' gaps over so small a temperature: the draw is the argmax
        assert tokens == greedy_tokens(llm, [5, 6, 7])


# --- 5. the LLMEngine API ------------------------------------------------------------------------------------------


def drain(llm: LLM) -> list:
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()[0]
    return outputs


def test_a_step_with_nothing_queued_returns_no_outputs(llm):
    for _ in range(2):
        outputs, stats = llm.engine.step()
        assert outputs == [] and stats == StepStats("idle")


def test_duplicate_request_ids_are_refused(llm):
    engine = llm.engine
    assert engine.add_request([1, 2], GREEDY, "a") == "a"
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([3, 4], GREEDY, "a")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([3, 4], GREEDY, 7)
    outputs = drain(llm)
    assert [o.request_id for o in outputs] == ["a"]
    assert (
        engine.add_request([1, 2], GREEDY, "a") == "a"
    )  # a finished request's id may be used again
    assert [o.request_id for o in drain(llm)] == ["a"]
    assert_idle(llm)


def test_requests_added_earlier_survive_a_generate(llm):
    engine = llm.engine
    expected = {"x": greedy_tokens(llm, [5, 6, 7], 16), "y": greedy_tokens(llm, [9, 9], 2)}
    engine.add_request(
        [5, 6, 7], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), "x"
    )
    engine.add_request([9, 9], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), "y")
    engine.add_request([0], GREEDY, "0")  # an id generate's own numbering would also use
    out = llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in out] == [[1, 2, 3], [4, 5]]
    assert [o.outputs[0].token_ids for o in out] == [
        greedy_tokens(llm, [1, 2, 3]),
        greedy_tokens(llm, [4, 5]),
    ]
    rest = {o.request_id: o.outputs[0].token_ids for o in drain(llm)}
    assert rest == {**expected, "0": greedy_tokens(llm, [0])}
    assert_idle(llm)


@pytest.mark.parametrize("policy", ["prefill-first", "unified"])
def test_a_failed_step_aborts_its_requests_and_the_engine_goes_on(tiny, hf_greedy, policy):
    """A step fails: exactly its requests are aborted. Prefill-first runs a and b's prefill alone, so the request
    that was decoding survives; the unified policy puts its next token in the same (failed) step."""
    long_a, long_b = (
        list(range(100, 140)),
        list(range(200, 250)),
    )  # full blocks never seen before: cacheable
    expected = {p[0]: hf_greedy(p, 16) for p in ([1, 2, 3], long_a, long_b)}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(
        str(tiny),
        num_kvcache_blocks=64,
        max_num_seqs=8,
        max_model_len=256,
        scheduling_policy=policy,
    ) as llm:
        engine, runner = llm.engine, llm.engine.core.runner
        engine.add_request([1, 2, 3], params, "survivor")
        engine.step()  # its prefill
        engine.add_request(long_a, params, "a")
        engine.add_request(long_b, params, "b")
        original = runner.launch

        def failing_step(seqs, is_prefill):
            raise RuntimeError("the device fell over")

        runner.launch = failing_step
        try:
            with pytest.raises(RuntimeError, match="fell over"):
                engine.step()  # the prefill of a and b (unified: and the survivor's next token)
        finally:
            runner.launch = original
        outputs = drain(llm)  # later steps run
        survivors = {"survivor": expected[1]} if policy == "prefill-first" else {}
        assert {o.request_id: o.outputs[0].token_ids for o in outputs} == survivors
        assert_idle(llm)
        # the failed prefill's blocks were never written: a new request must not hit them in the prefix cache
        again = llm.generate([long_a, long_b], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [expected[100], expected[200]]
        assert_idle(llm)


def test_a_failed_decode_step_aborts_its_requests(llm, hf_greedy):
    engine, runner = llm.engine, llm.engine.core.runner
    prompt = list(
        range(300, 331)
    )  # 31 tokens: the first decode fills the second block, which is then cached
    expected = hf_greedy(prompt, 8)
    engine.add_request(prompt, GREEDY, "d")
    engine.step()  # prefill
    original, calls = runner.launch, []

    def failing_step(seqs, is_prefill):
        calls.append(is_prefill)
        raise KeyboardInterrupt

    runner.launch = failing_step
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    finally:
        runner.launch = original
    assert calls == [False]
    assert_idle(llm)
    assert greedy_tokens(llm, prompt + [expected[0]], 7) == expected[1:]


class Interrupter:
    """Ctrl-C at a chosen moment of what the engine runs: `at` = k raises KeyboardInterrupt at the k-th moment (just
    before or just after a call to one of the engine's, scheduler's, runner's or processors' methods); 0 never."""

    def __init__(self, engine):
        self.at = self.moments = 0
        self.patched = []
        methods = {
            engine: ["add_requests", "step"],
            engine.core: ["add_request", "start", "step", "launch", "postprocess", "finish"],
            engine.input_processor: ["make_request", "check_request"],
            engine.core.scheduler: ["add", "schedule", "advance", "resolve", "finish"],
            engine.core.runner: ["launch"],
            engine.output_processor: ["process", "output"],
        }
        for owner, names in methods.items():
            for name in names:
                setattr(owner, name, self.wrap(getattr(owner, name)))
                self.patched.append((owner, name))

    def restore(self) -> None:
        for owner, name in self.patched:
            delattr(owner, name)  # the class's method again

    def moment(self) -> None:
        self.moments += 1
        if self.moments == self.at:
            raise KeyboardInterrupt

    def wrap(self, method):
        def wrapped(*args, **kwargs):
            self.moment()
            result = method(*args, **kwargs)
            self.moment()
            return result

        return wrapped


def test_an_interrupt_at_any_moment_of_generate_leaves_no_request_behind(llm, hf_greedy):
    """Ctrl-C anywhere in generate, even as add_requests queues or returns: every request it added is gone, with its
    KV blocks and kept outputs, and the engine serves on. One call per moment of a whole call, interrupted there; the
    model's logits are random meanwhile (the bookkeeping is under test, and a forward of the model takes long)."""
    prompts = [
        list(range(10, 30)),
        "Hello",
        list(range(10, 26)) + [3],
    ]  # the third hits the first's cached block
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    params = [
        greedy,
        SamplingParams(max_tokens=3, n=2, seed=0),
        SamplingParams(max_tokens=4, stop_token_ids=[7]),
    ]
    runner, vocab_size = llm.engine.core.runner, llm.engine.config.hf_config.vocab_size
    runner.step_logits = lambda seqs, is_prefill: torch.randn(len(seqs), vocab_size)
    interrupter, config, counts = Interrupter(llm.engine), llm.engine.config, []
    try:
        for config.async_scheduling in (
            False,
            True,
        ):  # with async scheduling, a step is launched ahead too
            interrupter.at, interrupter.moments = 0, 0
            llm.generate(prompts, params, use_tqdm=False)
            counts.append(interrupter.moments)
            for k in range(1, counts[-1] + 1):
                interrupter.at, interrupter.moments = k, 0
                with pytest.raises(KeyboardInterrupt):
                    llm.generate(prompts, params, use_tqdm=False)
                assert_idle(llm)
    finally:
        interrupter.restore()
        del runner.step_logits
        config.async_scheduling = False
    assert min(counts) > 100, counts
    fresh = list(
        range(400, 420)
    )  # not the prompts above: random logits wrote no KV to their cached blocks
    assert greedy_tokens(llm, fresh) == hf_greedy(fresh, 8)


# --- 6. the command line -------------------------------------------------------------------------------------------


def run_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MINIVLLM_CHECKPOINTS=str(tmp_path))
    return subprocess.run(
        [sys.executable, "-m", "minivllm", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.parametrize(
    "args, field",
    [
        (["--max-tokens", "0"], "max-tokens"),
        (["--max-tokens", "-2"], "max-tokens"),
        (["--max-tokens", "1.5"], "max-tokens"),
        (["--model", "/no/such/folder"], "model"),
        (["--temperature", "nan"], "temperature"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "2"], "top_p"),
        (["--top-p", "inf"], "top"),
        (["--min-p", "nan"], "min"),
        (["--top-k", "0"], "top_k"),
        (["--tp", "0"], "tp"),
        (["--max-model-len", "0"], "max-model-len"),
    ],
)
def test_cli_bad_values_are_usage_errors(tmp_path, args, field):
    proc = (
        run_cli(tmp_path, "--preset", "tiny", *args)
        if "--model" not in args
        else run_cli(tmp_path, *args)
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and field in proc.stderr.splitlines()[-1]
    assert proc.stderr.splitlines()[-1].startswith("python -m minivllm: error:"), proc.stderr
    assert not list(tmp_path.iterdir())  # refused before any checkpoint is written


def test_cli_a_prompt_the_engine_refuses_is_a_usage_error(tmp_path):
    proc = run_cli(
        tmp_path, "--preset", "tiny", "--max-model-len", "4", "a prompt far longer than four tokens"
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "max_model_len" in proc.stderr.splitlines()[-1]
