"""SamplingParams validation and the Sequence helpers the scheduler and block manager rely on (notebook 03)."""

import math

import pytest

from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams


def test_sampling_params_defaults_match_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1.0, 1.0, -1, 0.0, 16)
    assert (p.ignore_eos, p.seed, p.stop_token_ids) == (False, None, [])


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.01),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -1.0),
        ("top_p", math.nan),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("min_p", math.nan),
    ],
)
def test_sampling_params_rejects_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 1),
        ("temperature", 0.0),
        ("top_p", 1.0),
        ("top_p", 1e-6),
        ("top_k", -1),
        ("top_k", 1),
        ("min_p", 0.0),
        ("min_p", 1.0),
    ],
)
def test_sampling_params_accepts_range_ends(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_sampling_params_copies_stop_token_ids():
    stops = [7, 8]
    p = SamplingParams(stop_token_ids=stops)
    stops.append(9)
    assert p.stop_token_ids == [7, 8]


def test_sequence_copies_its_tokens_and_tracks_prompt_and_completion():
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=0, max_tokens=4)
    seq = Sequence(prompt, params, block_size=2)
    prompt.append(4)
    seq.append_token(10)
    seq.append_token(11)
    assert seq.token_ids == [1, 2, 3, 10, 11] and len(seq) == seq.num_tokens == 5
    assert seq.prompt_token_ids == [1, 2, 3] and seq.num_prompt_tokens == 3
    assert seq.completion_token_ids == [10, 11] and seq.num_completion_tokens == 2
    assert seq.last_token == 11 and seq.sampling_params is params
    assert seq.status == SequenceStatus.WAITING and not seq.is_finished and seq.block_table == []
    seq.status = SequenceStatus.FINISHED
    assert seq.is_finished


@pytest.mark.parametrize(
    "num_tokens, block_size, num_blocks, last",
    [(1, 4, 1, 1), (4, 4, 1, 4), (5, 4, 2, 1), (8, 4, 2, 4), (9, 1, 9, 1), (300, 256, 2, 44)],
)
def test_sequence_block_helpers(num_tokens, block_size, num_blocks, last):
    seq = Sequence(list(range(num_tokens)), block_size=block_size)
    assert (seq.num_blocks, seq.last_block_num_tokens) == (num_blocks, last)
    assert sum((seq.block(i) for i in range(num_blocks)), []) == seq.token_ids
    assert len(seq.block(num_blocks - 1)) == last
    with pytest.raises(AssertionError):
        seq.block(num_blocks)


def test_sequence_ids_are_unique_and_increasing():
    a, b = Sequence([1]), Sequence([1])
    assert b.seq_id > a.seq_id


def test_a_broken_sequence_is_an_assertion():
    """The engine refuses bad requests before it makes a Sequence; inside, these are invariants."""
    with pytest.raises(AssertionError, match="empty prompts"):
        Sequence([])
    with pytest.raises(AssertionError, match="block_size"):
        Sequence([1], block_size=0)
