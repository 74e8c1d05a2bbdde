"""Sampling options (deep dive sampling_options): vLLM's penalties against a per-token reference, min_tokens'
banned stop tokens, and the options runner's sampling on top of notebook 04's; its log-probabilities and prompt
log-probabilities against a from-scratch forward (through `minivllm.LLM`: tests/test_n_and_logprobs.py)."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.config import Config
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.sampling_options import OptionsRunner, banned_tokens, penalty_arrays
from minivllm.engine.sequence import Sequence
from minivllm.layers.sampling_options import apply_penalties, logprobs_of
from minivllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def runner(tiny):
    return OptionsRunner(Config(tiny, num_kvcache_blocks=8, dtype=torch.float32))


def random_logits(seed: int, vocab: int, scale: float, rows: int = 1) -> torch.Tensor:
    return scale * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def sequence(prompt: list[int], params: SamplingParams, output: list[int] = ()) -> Sequence:
    """What sampling reads of a sequence: its parameters and tokens (a prompt may be empty here)."""
    row = SimpleNamespace(sampling_params=params, num_completion_tokens=len(output))
    row.prompt_token_ids, row.completion_token_ids = list(prompt), list(output)
    return row  # type: ignore[return-value]


def reference_penalized(
    logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]
) -> list:
    """vLLM's penalties for one row, token by token in plain Python."""
    penalized = []
    for token, x in enumerate(logits):
        if token in prompt or token in output:
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        n = output.count(token)
        penalized.append(x - params.frequency_penalty * n - params.presence_penalty * (n > 0))
    return penalized


token_lists = st.lists(st.integers(0, 59), max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.integers(2, 60),
    scale=st.floats(0.1, 4.0),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    repetition=st.floats(0.1, 3),
    prompt=token_lists,
    output=token_lists,
)
def test_penalties_match_a_per_token_reference(
    seed, vocab, scale, presence, frequency, repetition, prompt, output
):
    prompt, output = [t % vocab for t in prompt], [t % vocab for t in output]
    params = SamplingParams(
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition
    )
    plain = sequence([1, 2], SamplingParams(), [0])  # a row without penalties: untouched
    logits = random_logits(seed, vocab, scale, rows=2)
    arrays = penalty_arrays([sequence(prompt, params, output), plain])
    got = apply_penalties(logits, *map(torch.from_numpy, arrays))
    expected = torch.tensor(reference_penalized(logits[0].tolist(), params, prompt, output))
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], logits[1])


def test_without_options_the_runner_samples_what_the_core_runner_samples(runner):
    """No penalty, no ban: the core sampler gets the caller's logits (same seeded draws, any dtype)."""
    logits = random_logits(3, 50, 2.0, rows=4).bfloat16()
    seqs = [
        Sequence([1, 2], SamplingParams(seed=s, temperature=t))
        for s, t in enumerate((1, 0.5, 0, 2))
    ]
    assert banned_tokens(seqs) is None
    assert torch.equal(runner.sample(seqs, logits), ModelRunner.sample(runner, seqs, logits))


def test_penalized_frequencies_match_the_penalized_softmax(runner):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3)
    prompt, output = [0], [1, 1, 3]
    n = 20_000
    torch.manual_seed(0)
    seq = sequence(prompt, params, output)
    tokens = runner.sample([seq] * n, logits.expand(n, -1))
    freq = torch.bincount(tokens, minlength=5) / n
    expected = torch.softmax(
        torch.tensor(reference_penalized(logits[0].tolist(), params, prompt, output)), dim=-1
    )
    torch.testing.assert_close(freq, expected, atol=0.012, rtol=0)


def test_min_tokens_bans_stop_tokens_until_then_for_greedy_and_random_rows(runner):
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])  # token 1 is the likeliest
    greedy = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    said = [runner.sample([sequence([2], greedy, [0] * step)], logits).item() for step in range(4)]
    assert said == [3, 3, 1, 1]
    random_rows = [sequence([2], SamplingParams(min_tokens=2, stop_token_ids=[1, 3]), [0])] * 2000
    torch.manual_seed(0)
    assert set(runner.sample(random_rows, logits.expand(2000, -1)).tolist()) == {0, 2}
    before = logits.clone()
    runner.sample([sequence([2], greedy)], logits)
    assert torch.equal(logits, before)  # the caller's logits are untouched


def test_logprobs_of_gives_the_chosen_token_its_rank_then_the_top_k():
    logits = torch.tensor([[4.0, 3.1, 2.6, 2.2], [0.0, 1.0, 2.0, 3.0]])
    rows = logprobs_of(logits, torch.tensor([2, 3]), [2, 0])
    expected = torch.log_softmax(logits, dim=-1)
    assert list(rows[0]) == [2, 0, 1] and rows[0][2][1] == 3 and rows[0][1][1] == 2
    assert list(rows[1]) == [3] and rows[1][3][1] == 1  # k = 0: the chosen token alone
    torch.testing.assert_close(rows[0][2][0], expected[0, 2].item())
