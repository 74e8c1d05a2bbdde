"""Sampler (notebook 04): greedy rows, the top-k / top-p / min-p filters, the exponential race and per-request seeds;
the Triton race (Gumbel-max, one pass), nucleus (top-p by rejection, no sort) and top_k_sample (top-k's candidates
from the lanes' maxima, no sort of the row) in Triton's interpreter on a CPU, and through the sampler on a GPU.

Many draws of one distribution are taken in one call, by repeating its row of logits down the batch.
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.engine.sequence import Sequence
from minivllm.engine.step_inputs import sampling_tensors
from minivllm.kernels.sampling import _neg_log2, nucleus, race, race_ids, top_k_sample
from minivllm.layers.gpu_sampler import GPUSampler
from minivllm.layers.sampler import (
    SamplingTensors,
    exponential_noise,
    filter_probs,
    keep_mask,
    noise_seed,
)
from minivllm.sampling_params import SamplingParams

sampler = GPUSampler()  # on a CPU the core Sampler's draw; on a GPU, the Triton kernels
DRAWS = 400  # rows per hypothesis example
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),
]  # the PyTorch sampler; on a GPU, the Triton race


def tensors(
    params: list[SamplingParams], steps: list[int] | None = None, device: str = "cpu"
) -> SamplingTensors:
    return sampling_tensors(params, steps or [0] * len(params), device)


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int] | None = None,
           device: str = "cpu") -> torch.Tensor:  # fmt: skip
    return sampler(logits.to(device), tensors(params, steps, device)).cpu()


def random_logits(seed: int, vocab: int, scale: float, rows: int = 1) -> torch.Tensor:
    return scale * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def draws(logits: torch.Tensor, params: SamplingParams, seed: int) -> torch.Tensor:
    """DRAWS tokens of one row of logits (1, vocab), deterministically."""
    torch.manual_seed(seed)
    return sample(logits.expand(DRAWS, -1), [params] * DRAWS)


logit_rows = dict(
    seed=st.integers(0, 2**32 - 1), vocab=st.integers(2, 60), scale=st.floats(0.1, 4.0)
)


# --- SamplingTensors ---------------------------------------------------------------------------------------


def test_from_params_fields():
    params = [
        SamplingParams(temperature=0),
        SamplingParams(0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3),
        SamplingParams(seed=-1),
        SamplingParams(seed=2**70 + 1),
    ]
    torch.manual_seed(0)
    t = tensors(params, steps=[0, 2, 5, 1])
    assert t.temperatures.dtype == t.top_ps.dtype == t.min_ps.dtype == torch.float32
    assert t.top_ks.dtype == t.keys.dtype == torch.int64
    torch.testing.assert_close(t.temperatures, torch.tensor([0.0, 0.7, 1.0, 1.0]))
    assert t.top_ks.tolist() == [-1, 5, -1, -1]
    torch.testing.assert_close(t.top_ps, torch.tensor([1.0, 0.9, 1.0, 1.0]))
    torch.testing.assert_close(t.min_ps, torch.tensor([0.0, 0.1, 0.0, 0.0]))
    assert t.keys[1:].tolist() == [
        noise_seed(3, 2),
        noise_seed(-1, 5),
        noise_seed(2**70 + 1, 1),
    ]  # any int is a seed
    assert 0 <= t.keys[0] < 2**62 and all(0 <= k < 2**63 for k in t.keys.tolist())
    torch.manual_seed(0)
    assert torch.equal(
        tensors(params, steps=[0, 2, 5, 1]).keys, t.keys
    )  # the fresh key: the default generator's
    assert tensors(params, steps=[0, 2, 5, 1]).keys[0] != t.keys[0]
    assert (
        tensors([SamplingParams(temperature=0, seed=3)] * 2).keys.numel() == 0
    )  # greedy rows draw no noise
    assert t.filtering


def test_filtering_flag_only_for_random_rows_with_a_filter():
    def filtering(*params: SamplingParams) -> bool:
        return tensors(list(params)).filtering

    assert not filtering(SamplingParams(), SamplingParams(temperature=0.6, seed=1))
    assert not filtering(SamplingParams(temperature=0, top_k=3))  # greedy ignores filters
    assert filtering(SamplingParams(), SamplingParams(top_k=3))
    assert filtering(SamplingParams(top_p=0.5)) and filtering(SamplingParams(min_p=0.2))


# --- greedy ------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.integers(2, 300),
    greedy=st.lists(st.booleans(), min_size=1, max_size=12),
    top_k=st.integers(-1, 5),
    top_p=st.floats(0.05, 1.0),
    temperature=st.floats(0.05, 5.0),
)
def test_greedy_rows_are_the_argmax_of_the_raw_logits(
    seed, vocab, greedy, top_k, top_p, temperature
):
    logits = random_logits(seed, vocab, 3.0, rows=len(greedy))
    top_k = -1 if top_k < 1 else top_k
    params = [
        SamplingParams(temperature=0.0 if g else temperature, top_k=top_k, top_p=top_p)
        for g in greedy
    ]
    torch.manual_seed(seed)
    tokens = sample(logits, params)
    rows = torch.tensor(greedy)
    assert torch.equal(tokens[rows], logits.argmax(dim=-1)[rows])


def test_greedy_rows_ignore_the_rest_of_the_batch():
    logits = random_logits(
        0, 1000, 0.01, rows=6
    )  # nearly flat: a random draw would almost never be the argmax
    alone = [sample(logits[i : i + 1], [SamplingParams(temperature=0)]).item() for i in (0, 3)]
    params = [SamplingParams(temperature=0 if i in (0, 3) else 2.0, top_k=1 + i) for i in range(6)]
    mixed = sample(logits, params)
    assert mixed[[0, 3]].tolist() == alone == logits[[0, 3]].argmax(dim=-1).tolist()
    assert (mixed[[1, 2, 4, 5]] != logits[[1, 2, 4, 5]].argmax(dim=-1)).any()


def test_dtypes_and_caller_logits_untouched():
    logits = random_logits(1, 50, 2.0, rows=4)
    before = logits.clone()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        tokens = sample(logits.to(dtype), [SamplingParams(top_k=5, seed=1)] * 4)
        assert tokens.dtype == torch.int64 and tokens.shape == (4,)
    assert torch.equal(logits, before)


# --- filters -----------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(**logit_rows, k=st.integers(1, 10), temperature=st.floats(0.2, 3.0))
def test_top_k_never_returns_a_token_outside_the_top_k(seed, vocab, scale, k, temperature):
    logits = random_logits(seed, vocab, scale)
    tokens = draws(logits, SamplingParams(temperature=temperature, top_k=k), seed)
    kth_largest = logits[0].topk(min(k, vocab)).values[-1]
    assert (logits[0, tokens] >= kth_largest).all()


@settings(max_examples=200, deadline=None)
@given(**logit_rows, top_p=st.floats(0.01, 1.0), temperature=st.floats(0.2, 3.0))
def test_top_p_returns_a_token_of_the_smallest_set_reaching_p(
    seed, vocab, scale, top_p, temperature
):
    logits = random_logits(seed, vocab, scale)
    probs = torch.softmax(logits[0].double() / temperature, dim=-1)
    tokens = draws(logits, SamplingParams(temperature=temperature, top_p=top_p), seed)
    # a token is in that set iff the tokens strictly more likely than it hold less than p
    mass_before = torch.stack([probs[probs > probs[tok]].sum() for tok in tokens.unique()])
    assert (mass_before < top_p + 1e-5).all()


@settings(max_examples=200, deadline=None)
@given(**logit_rows, min_p=st.floats(0.0, 1.0), temperature=st.floats(0.2, 3.0))
def test_min_p_never_returns_a_token_below_min_p_times_the_max(
    seed, vocab, scale, min_p, temperature
):
    logits = random_logits(seed, vocab, scale)
    probs = torch.softmax(logits[0].double() / temperature, dim=-1)
    tokens = draws(logits, SamplingParams(temperature=temperature, min_p=min_p), seed)
    assert (probs[tokens] >= min_p * probs.max() * (1 - 1e-5)).all()


@pytest.mark.parametrize(
    "top_k, top_p, min_p, kept",
    [
        (-1, 1.0, 0.0, 4),
        (-1, 0.8, 0.0, 2),
        (-1, 0.81, 0.0, 3),
        (-1, 0.01, 0.0, 1),
        (3, 1.0, 0.0, 3),
        (1, 1.0, 0.0, 1),
        (-1, 0.82, 0.0, 3),
        (3, 0.82, 0.0, 2),
        (-1, 1.0, 0.3, 3),
        (-1, 1.0, 0.31, 2),
        (-1, 1.0, 1.0, 1),
    ],
)
def test_keep_mask_on_a_hand_example(top_k, top_p, min_p, kept):
    """probs [0.5, 0.3, 0.15, 0.05]: top-p 0.8 is reached by 2 tokens; after top-k 3, 0.5 + 0.3 is 0.84 of the mass."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    mask = keep_mask(probs, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    assert mask[0].tolist() == [True] * kept + [False] * (4 - kept)


def reference_kept(probs: list[float], top_k: int, top_p: float, min_p: float) -> int:
    """How many of the sorted (largest first) probs survive top-k, top-p and min-p, one row in plain Python."""
    kept = probs[:top_k] if top_k > 0 else probs
    total, mass, n = sum(kept), 0.0, 0
    while n < len(kept) and (top_p >= 1 or mass < top_p * total):
        mass, n = mass + kept[n], n + 1
    return sum(p >= min_p * probs[0] for p in kept[:n])


@settings(max_examples=200, deadline=None)
@given(
    **logit_rows,
    rows=st.lists(
        st.tuples(st.integers(-1, 8), st.floats(0.01, 1.0), st.floats(0.0, 1.0)),
        min_size=1,
        max_size=6,
    ),
)
def test_keep_mask_matches_a_per_row_reference(seed, vocab, scale, rows):
    logits = random_logits(seed, vocab, scale, rows=len(rows))
    sorted_probs = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values
    top_ks = torch.tensor([k if k >= 1 else -1 for k, _, _ in rows])
    top_ps, min_ps = torch.tensor([p for _, p, _ in rows]), torch.tensor([m for _, _, m in rows])
    mask = keep_mask(sorted_probs, top_ks, top_ps, min_ps)
    for i in range(len(rows)):
        probs = sorted_probs[i].double().tolist()
        kept = int(mask[i].sum())
        assert mask[i, :kept].all()  # the kept tokens are the most likely ones
        bounds = [
            reference_kept(probs, int(top_ks[i]), float(top_ps[i]) + d, float(min_ps[i]) + e)
            for d in (-1e-5, 1e-5)
            for e in (-1e-5, 1e-5)
        ]
        # float32 sums may round either way at a boundary: the count is that of a threshold within 1e-5 of the given one
        assert min(bounds) <= kept <= max(bounds)


@settings(max_examples=200, deadline=None)
@given(
    **logit_rows,
    rows=st.lists(
        st.tuples(st.integers(1, 12), st.floats(0.01, 1.0), st.floats(0.0, 1.0)),
        min_size=1,
        max_size=6,
    ),
)
def test_filtering_the_top_k_only_equals_filtering_the_sorted_vocabulary(seed, vocab, scale, rows):
    """When every row has a top-k, filter_probs sorts only the k_max most likely tokens (torch.topk): same result."""
    probs = torch.softmax(random_logits(seed, vocab, scale, rows=len(rows)), dim=-1)
    top_ks, top_ps, min_ps = (torch.tensor(column) for column in zip(*rows))
    k_max = max(k for k, _, _ in rows)
    assert torch.equal(
        filter_probs(probs, top_ks, top_ps, min_ps, k_max),
        filter_probs(probs, top_ks, top_ps, min_ps),
    )


def test_top_k_max_only_when_every_random_row_has_a_top_k():
    greedy, k5, k50, top_p = (SamplingParams(**kw) for kw in (dict(temperature=0), dict(top_k=5), dict(top_k=50),
                                                                dict(top_p=0.9)))  # fmt: skip
    assert (
        tensors([k5, k50, greedy]).top_k_max == 50
    )  # a greedy row takes the argmax of the logits: no filter
    assert (
        tensors([k5, top_p]).top_k_max == 0 and tensors([greedy]).top_k_max == 0
    )  # sort the whole vocabulary
    # on a GPU, the nucleus kernel serves a batch only if no random row has a top-k
    assert tensors([k5, top_p]).largest_top_k == 5 and tensors([top_p, greedy]).largest_top_k == 0
    assert (
        tensors([SamplingParams(temperature=0, top_k=5), top_p]).largest_top_k == 0
    )  # a greedy row's: unused


def test_top_p_1_keeps_a_tail_too_small_for_a_float32_sum():
    probs = torch.cat([torch.tensor([1.0]), torch.full((200_000,), 1e-9)])[
        None
    ]  # 1 + 1e-9 == 1 in float32
    mask = keep_mask(probs, torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert mask.all()


# --- the draw ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_match_the_softmax(temperature, device):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 20_000
    torch.manual_seed(0)
    tokens = sample(
        logits.expand(n, -1), [SamplingParams(temperature=temperature)] * n, device=device
    )
    freq = torch.bincount(tokens, minlength=5) / n
    torch.testing.assert_close(
        freq, torch.softmax(logits[0] / temperature, dim=-1), atol=0.012, rtol=0
    )


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_frequencies_match_the_softmax_too(device):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 20_000
    tokens = sample(logits.expand(n, -1), [SamplingParams(seed=s) for s in range(n)], device=device)
    freq = torch.bincount(tokens, minlength=5) / n
    torch.testing.assert_close(freq, torch.softmax(logits[0], dim=-1), atol=0.012, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("filters", "kept"),
    [(dict(top_k=3), 3), (dict(top_k=4, top_p=0.7), 2), (dict(top_p=0.7), 2), (dict(min_p=0.2), 3)],
)
def test_filtered_frequencies_are_the_renormalized_survivors(filters, kept, device):
    """Top-k alone, top-p inside a top-k (both: no full sort), top-p alone and min-p alone (a full sort)."""
    logits = torch.tensor(
        [[2.0, 1.0, 0.5, 0.0, -1.0]]
    )  # probabilities 0.55, 0.20, 0.12, 0.07, 0.03
    n = 20_000
    torch.manual_seed(0)
    tokens = sample(logits.expand(n, -1), [SamplingParams(**filters)] * n, device=device)
    freq = torch.bincount(tokens, minlength=5) / n
    torch.testing.assert_close(
        freq,
        torch.softmax(logits[0].masked_fill(torch.arange(5) >= kept, -torch.inf), dim=-1),
        atol=0.012,
        rtol=0,
    )


# --- seeds -------------------------------------------------------------------------------------------------


def seeded_tokens(
    seed: int, logits_row: torch.Tensor, row: int, batch: int, steps: range
) -> list[int]:
    """The tokens of a request seeded with `seed` at each step, placed at `row` of a batch of random neighbours."""
    out = []
    for step in steps:
        logits = random_logits(1000 + step, logits_row.shape[-1], 1.0, rows=batch)
        logits[row] = logits_row
        params = [
            SamplingParams(seed=seed if i == row else (None if i % 2 else 500 + i))
            for i in range(batch)
        ]
        out.append(
            sample(logits, params, steps=[step if i == row else 3 * i for i in range(batch)])[
                row
            ].item()
        )
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_a_top_k_above_the_vocabulary_keeps_every_token(device):
    """top_k larger than the vocabulary filters nothing: seeded rows draw what they draw with top_k -1 (on a GPU the
    sort path took topk(k) of a row shorter than k and failed the whole step)."""
    logits = random_logits(8, 1000, 1.0, rows=4).to(device)
    for top_k in (1001, 5000):
        with_k = [
            SamplingParams(seed=s, top_k=top_k, temperature=t)
            for s, t in ((0, 1.0), (1, 0.7), (2, 0), (3, 1.5))
        ]
        without = [dataclasses.replace(p, top_k=-1) for p in with_k]
        drawn = sampler(logits, tensors(with_k, device=device))
        assert torch.equal(drawn, sampler(logits, tensors(without, device=device))), (
            f"top_k={top_k}"
        )


def test_same_seed_same_tokens_whatever_the_batch():
    logits_row = random_logits(7, 1000, 0.5)[0]
    torch.manual_seed(0)
    alone = seeded_tokens(42, logits_row, row=0, batch=1, steps=range(20))
    torch.manual_seed(1)
    crowded = seeded_tokens(42, logits_row, row=3, batch=8, steps=range(20))
    torch.manual_seed(2)
    crowded_again = seeded_tokens(42, logits_row, row=1, batch=5, steps=range(20))
    assert alone == crowded == crowded_again
    assert len(set(alone)) > 10  # the token changes with the step


def test_different_seeds_give_different_tokens():
    logits_row = random_logits(7, 1000, 0.5)[0]
    a = seeded_tokens(1, logits_row, row=0, batch=2, steps=range(10))
    b = seeded_tokens(2, logits_row, row=0, batch=2, steps=range(10))
    assert sum(x != y for x, y in zip(a, b)) >= 8


def test_unseeded_rows_do_not_disturb_seeded_ones():
    logits = random_logits(3, 1000, 0.5, rows=6)
    params = [SamplingParams(seed=None if i % 2 else 10 + i) for i in range(6)]
    torch.manual_seed(0)
    first = sample(logits, params, steps=[4] * 6)
    torch.manual_seed(1)
    second = sample(logits, params, steps=[4] * 6)
    assert torch.equal(first[::2], second[::2])
    assert not torch.equal(first[1::2], second[1::2])  # the unseeded rows did draw anew


def test_a_preempted_request_regenerates_its_tokens():
    """Same seed, same prompt: decoded alone, or in two different batches around a preemption."""
    table = 2 * random_logits(
        11, 300, 1.0, rows=300
    )  # toy model: next-token logits from the last token

    def decode(batch: list[Sequence]) -> None:
        tokens = sampler(
            table[[s.last_token for s in batch]],
            tensors([s.sampling_params for s in batch], [s.num_completion_tokens for s in batch]),
        )
        for seq, token in zip(batch, tokens.tolist()):
            seq.append_token(token)

    def request(seed: int | None) -> Sequence:
        return Sequence([5, 6], SamplingParams(temperature=1.2, top_k=50, seed=seed))

    solo, crowded = request(77), request(77)
    for _ in range(10):
        decode([solo])
    for _ in range(5):
        decode([request(None), request(3), crowded])
    for _ in range(5):  # after the preemption: other neighbours, another row
        decode([crowded, request(None)])
    assert crowded.completion_token_ids == solo.completion_token_ids


def test_noise_depends_only_on_seed_and_step():
    ones = torch.ones(4, 100)
    noise = exponential_noise(
        ones, torch.tensor([noise_seed(9, 0), noise_seed(9, 1), noise_seed(9, 0), 5])
    )
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])
    expected = torch.empty(100).exponential_(
        generator=torch.Generator().manual_seed(noise_seed(9, 1))
    )
    assert torch.equal(noise[1], expected)
    assert len({noise_seed(s, step) for s in range(50) for step in range(1000)}) == 50 * 1000


@pytest.mark.gpu
def test_cuda_matches_the_contract():
    logits = random_logits(5, 32_000, 1.0, rows=4).cuda()
    logits[3] = logits[1]  # the same row twice, with the same seed: the same token
    params = [
        SamplingParams(temperature=0),
        SamplingParams(seed=8, top_p=0.9),
        SamplingParams(top_k=5),
        SamplingParams(seed=8, top_p=0.9),
    ]
    tokens = sampler(logits, tensors(params, device="cuda"))
    assert tokens.device.type == "cuda" and tokens[0] == logits[0].argmax()
    assert tokens[1] == tokens[3]
    again = sampler(logits[1:2], tensors(params[1:2], device="cuda"))
    assert again[0] == tokens[1]


# --- the Triton race (notebook 04): on a CPU in Triton's interpreter, a few hundred rows at most --------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_race_at_temperature_0_is_the_argmax_first_on_ties(dtype):
    logits = random_logits(0, 10_000, 1.0, rows=3).to(
        dtype
    )  # 2,500 counters of four columns, five parts a row
    logits[1, 5000] = logits[1, 9000] = logits[1, 200] = (
        100.0  # a tie across parts and lanes: the first wins
    )
    logits[0, 2600] = logits[0, 1000] = (
        100.0  # lane 1 of part 0, lane 0 of part 1: still the first column
    )
    logits[2, 9999] = 100.0  # in the last, partial block
    tokens = race(logits, torch.zeros(3), torch.tensor([1, 2, 3]))
    assert tokens.tolist() == logits.float().argmax(dim=-1).tolist() and tokens.tolist() == [
        1000,
        200,
        9999,
    ]


def test_race_noise_follows_the_token_id_not_the_column():
    logits, keys, temps = (
        random_logits(1, 300, 1.0, rows=32),
        torch.arange(32) * 7919,
        torch.full((32,), 0.8),
    )
    perm = torch.stack(
        [torch.randperm(300, generator=torch.Generator().manual_seed(r)) for r in range(32)]
    )
    assert torch.equal(
        race_ids(logits.gather(1, perm), temps, keys, perm, 300), race(logits, temps, keys)
    )
    assert (
        len(set(race(logits[:1].expand(32, -1), temps, keys).tolist())) > 5
    )  # other keys, other draws


def test_race_among_candidates_is_the_race_over_the_row():
    """The top-k path: race_ids over the 20 most likely tokens = race over the row with the others at -inf."""
    logits, keys, temps = (
        random_logits(2, 1000, 1.0, rows=32),
        torch.arange(32) * 13,
        torch.full((32,), 0.7),
    )
    top = logits.topk(20)
    only_top = torch.full_like(logits, float("-inf")).scatter(1, top.indices, top.values)
    assert torch.equal(
        race_ids(top.values, temps, keys, top.indices, 1000), race(only_top, temps, keys)
    )


def test_race_same_key_same_token_in_any_row():
    logits = random_logits(2, 500, 0.5, rows=1).expand(16, -1)
    keys = torch.tensor([noise_seed(42, 7)] * 8 + [noise_seed(42, 8)] * 8)
    tokens = race(logits, torch.ones(16), keys).tolist()
    assert len(set(tokens[:8])) == 1 and len(set(tokens[8:])) == 1


def test_race_never_draws_a_masked_candidate():
    logits = random_logits(3, 40, 2.0, rows=64)
    masked = torch.rand(64, 40, generator=torch.Generator().manual_seed(3)) < 0.8
    masked[:, 0] = False  # one candidate left at least
    tokens = race(
        logits.masked_fill(masked, float("-inf")), torch.full((64,), 1.5), torch.arange(64)
    )
    assert not masked.gather(1, tokens[:, None]).any()


def test_race_frequencies_match_the_tempered_softmax():
    """512 draws of [0.6, 0.3, 0.1] at T = 0.5: each frequency within 4.5 standard deviations of softmax(x / T)."""
    x = torch.tensor([0.6, 0.3, 0.1]).log() * 0.5  # softmax(x / 0.5) = [0.6, 0.3, 0.1]
    n = 512
    freq = (
        torch.bincount(
            race(x.expand(n, -1), torch.full((n,), 0.5), torch.arange(n) * 31), minlength=3
        )
        / n
    )
    expected = torch.tensor([0.6, 0.3, 0.1])
    assert ((freq - expected).abs() <= 4.5 * (expected * (1 - expected) / n).sqrt()).all(), freq


@pytest.mark.gpu
def test_cuda_greedy_rows_in_a_random_batch_are_the_argmax():
    logits = random_logits(4, 151_936, 2.0, rows=8).cuda()
    logits[0, 7] = logits[0, 70_000] = 50.0  # a tie: the first index, as torch.argmax
    for filters in (dict(), dict(top_k=20), dict(top_p=0.9)):
        params = [
            SamplingParams(temperature=0.0 if r % 2 == 0 else 0.8, **filters) for r in range(8)
        ]
        tokens = sampler(logits, tensors(params, device="cuda"))
        assert torch.equal(tokens[::2], logits[::2].argmax(dim=-1)) and tokens[0] == 7


@pytest.mark.gpu
def test_cuda_race_noise_follows_the_token_id_not_the_column():
    """A row split into parts, a program each: the same draw as from the row's candidates in any order."""
    logits, keys, temps = (
        random_logits(1, 151_936, 1.0, rows=8).cuda(),
        torch.arange(8).cuda(),
        torch.ones(8).cuda(),
    )
    perm = torch.stack(
        [torch.randperm(151_936, generator=torch.Generator().manual_seed(r)) for r in range(8)]
    ).cuda()
    assert torch.equal(
        race_ids(logits.gather(1, perm), temps, keys, perm, 151_936), race(logits, temps, keys)
    )


@triton.jit
def _neg_log2_kernel(U, Q, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Q + offs, _neg_log2(tl.load(U + offs, mask=offs < n, other=0.5), FAST), mask=offs < n)


@pytest.mark.parametrize("device", DEVICES)
def test_the_race_noise_keeps_its_relative_precision_next_to_1(device):
    """q = -log2(u) sets how much a token's score rises; for u near 1 it is tiny, and an absolute error as large as
    it gives a random token +inf. Every float32 u in [1 - 2^-11, 1) (on a GPU: in [0.5, 1)), every one within 2^-14
    of 0.99 (where _neg_log2 switches to the series), and a sample below."""
    top = 2**23 if device == "cuda" else 2**13  # the float32 steps below 1 checked one by one
    steps = torch.arange(top, dtype=torch.int32) + (
        0x3F800000 - top
    )  # bit patterns of the largest floats below 1
    switch = torch.arange(-1024, 1024, dtype=torch.int32) + torch.tensor([0.99]).view(
        torch.int32
    )  # 2^-24 apart
    sample = torch.rand(4096, generator=torch.Generator().manual_seed(0))
    u = torch.cat([steps.view(torch.float32), switch.view(torch.float32), sample]).to(device)
    q = torch.empty_like(u)
    _neg_log2_kernel[(triton.cdiv(len(u), 1024),)](u, q, len(u), FAST=device == "cuda", BLOCK=1024)
    exact = -torch.log2(u.double())
    assert (q > 0).all()
    assert ((q.double() - exact).abs() / exact).max() < 2e-5


# --- nucleus: top-p (and min-p) by drawing, then checking the draw --------------------------------------------


def nucleus_of(
    logits: torch.Tensor, t: float, top_p: float, min_p: float = 0.0, keys=None
) -> torch.Tensor:
    rows = logits.shape[0]
    keys = torch.arange(rows) * 31 if keys is None else keys
    return nucleus(
        logits, torch.full((rows,), t), torch.full((rows,), top_p), torch.full((rows,), min_p), keys
    )


def test_nucleus_without_filters_is_the_race():
    logits, keys = random_logits(5, 300, 2.0, rows=48), torch.arange(48) * 7
    assert torch.equal(
        nucleus_of(logits, 0.8, 1.0, keys=keys), race(logits, torch.full((48,), 0.8), keys)
    )


def test_nucleus_at_temperature_0_is_the_argmax_first_on_ties():
    logits = random_logits(6, 5000, 1.0, rows=3)
    logits[1, 4500] = logits[1, 300] = 50.0
    assert torch.equal(nucleus_of(logits, 0.0, 0.5, min_p=0.3), logits.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [40, 3000])  # one part per row; every try in 2 parts (race_parts)
@pytest.mark.parametrize(
    ("top_p", "min_p", "t"), [(0.5, 0.0, 1.0), (0.9, 0.0, 0.7), (0.8, 0.3, 1.5), (1.0, 0.2, 1.0)]
)
def test_nucleus_never_draws_what_keep_mask_drops(top_p, min_p, t, vocab):
    logits = random_logits(7, vocab, 2.0, rows=64)
    probs = torch.softmax(logits / t, dim=-1)
    kept = (
        filter_probs(
            probs, torch.full((64,), -1), torch.full((64,), top_p), torch.full((64,), min_p)
        )
        > 0
    )
    tokens = nucleus_of(logits, t, top_p, min_p)
    assert kept.gather(1, tokens[:, None]).all()
    assert len(set(tokens.tolist())) > 5  # rows draw apart: not always the argmax


@pytest.mark.parametrize(("top_p", "min_p"), [(0.7, 0.0), (1.0, 0.5)])
def test_nucleus_frequencies_are_the_renormalized_survivors(top_p, min_p):
    """256 draws of [0.5, 0.3, 0.15, 0.05] at top-p 0.7 or at min-p 0.5: the first two renormalized (each within 4.5
    standard deviations); a try that lands on the third or fourth token is drawn again."""
    x = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    n = 256
    freq = torch.bincount(nucleus_of(x.expand(n, -1), 1.0, top_p, min_p), minlength=4) / n
    expected = torch.tensor([0.625, 0.375, 0.0, 0.0])
    assert ((freq - expected).abs() <= 4.5 * (expected * (1 - expected) / n).sqrt()).all(), freq


def test_a_small_batch_tries_once_in_parts_then_alone():
    """Below NUCLEUS_PARTS_MIN_ROWS rows only the first try runs in parts; a rejected row goes on alone, and still
    never returns a token outside the nucleus ([0.5, 0.3, 0.15, 0.05] at top-p 0.7: the first two)."""
    x = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(16, -1)
    assert set(nucleus_of(x, 1.0, 0.7).tolist()) == {0, 1}


def test_a_try_alone_draws_what_the_same_try_in_parts_draws(monkeypatch):
    """Try i draws with counters + i * s in parts or alone: with every try after the first alone
    (NUCLEUS_TRIES_IN_PARTS = 1) a batch gets the tokens of five tries in parts. 64 rows: greedy, min-p, and
    near-uniform rows at top-p 0.05, which reject most draws (many rows go past five tries)."""
    rows = 64
    logits, keys = random_logits(11, 1000, 0.3, rows=rows), torch.arange(rows) * 13
    t, top_p, min_p = torch.ones(rows), torch.full((rows,), 0.05), torch.zeros(rows)
    t[:8], top_p[8:16], min_p[8:16] = 0.0, 1.0, 0.9  # greedy rows; min-p rows
    five = nucleus(logits, t, top_p, min_p, keys)
    monkeypatch.setattr("minivllm.kernels.sampling.NUCLEUS_TRIES_IN_PARTS", 1)
    assert torch.equal(nucleus(logits, t, top_p, min_p, keys), five)
    assert torch.equal(five[:8], logits[:8].argmax(dim=-1))
    probs = torch.softmax(logits[8:] / t[8:, None], dim=-1)
    kept = filter_probs(probs, torch.full((rows - 8,), -1), top_p[8:], min_p[8:]) > 0
    assert kept.gather(1, five[8:, None]).all()
    assert len(set(five[16:].tolist())) > 10  # rows draw apart


def test_nucleus_sums_the_masses_of_every_part():
    """Each try's masses are summed in parts of the row (2 here): the four tokens of the test above, spread over
    both parts of a 3,000-token vocabulary, still give the renormalized survivors at top-p 0.7."""
    x = torch.full((3000,), -30.0)
    cols = torch.tensor(
        [2900, 2100, 10, 1000]
    )  # the kept in the second part: the first's masses alone keep 0.15
    x[cols] = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    n = 256
    drawn = nucleus_of(x.expand(n, -1), 1.0, 0.7)
    freq = torch.stack([(drawn == c).float().mean() for c in cols])
    expected = torch.tensor([0.625, 0.375, 0.0, 0.0])
    assert ((freq - expected).abs() <= 4.5 * (expected * (1 - expected) / n).sqrt()).all(), freq


# --- top_k_sample: the candidates at or above a floor from the lanes' maxima, sorted and raced -------------------


def top_k_of(logits: torch.Tensor, t: float, k: int, top_p: float = 1.0, min_p: float = 0.0, cap: int = 0,
             keys=None) -> torch.Tensor:  # fmt: skip
    rows = logits.shape[0]
    keys = torch.arange(rows) * 31 if keys is None else keys
    settings = (torch.full((rows,), v) for v in (float(t), k, float(top_p), float(min_p)))
    return top_k_sample(logits, *settings, keys, k_max=max(k, 1), cap=cap)


@pytest.mark.parametrize(
    ("k", "top_p", "min_p", "t"), [(5, 1.0, 0.0, 1.0), (8, 0.6, 0.0, 0.7), (3, 1.0, 0.4, 2.0)]
)
def test_top_k_sample_never_draws_what_keep_mask_drops(k, top_p, min_p, t):
    """1,500 columns: two lanes' blocks, the second a partial one (column % 1024)."""
    logits = random_logits(8, 1500, 2.0, rows=48)
    probs = torch.softmax(logits / t, dim=-1)
    kept = (
        filter_probs(
            probs, torch.full((48,), k), torch.full((48,), top_p), torch.full((48,), min_p)
        )
        > 0
    )
    tokens = top_k_of(logits, t, k, top_p, min_p)
    assert kept.gather(1, tokens[:, None]).all()
    assert len(set(tokens.tolist())) > 5  # rows draw apart: not always the argmax


@pytest.mark.parametrize(
    ("k", "top_p", "expected"), [(3, 1.0, [0.5, 0.3, 0.15]), (3, 0.7, [0.5, 0.3, 0.0])]
)
def test_top_k_sample_frequencies_are_the_renormalized_survivors(k, top_p, expected):
    """256 draws of [0.5, 0.3, 0.15, 0.05]: top-k 3 keeps three; top-p 0.7 on what it left (0.95) keeps two."""
    x = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    n = 256
    freq = torch.bincount(top_k_of(x.expand(n, -1), 1.0, k, top_p), minlength=4) / n
    expected = torch.tensor([*expected, 0.0]) / sum(expected)
    assert ((freq - expected).abs() <= 4.5 * (expected * (1 - expected) / n).sqrt()).all(), freq


def test_top_k_sample_at_temperature_0_is_the_argmax_first_on_ties():
    logits = random_logits(6, 3000, 1.0, rows=3)
    logits[1, 2500] = logits[1, 300] = 50.0
    assert torch.equal(
        top_k_of(logits, 0.0, -1), logits.argmax(dim=-1)
    )  # a greedy row without a top-k
    assert torch.equal(top_k_of(logits, 0.0, 7, top_p=0.5), logits.argmax(dim=-1))


@pytest.mark.parametrize(
    "cap", [128, 8]
)  # 128 slots hold the 82 candidates; 8 overflow: the row goes on alone
def test_top_k_keeps_the_lowest_ids_of_the_ties_at_the_kth(cap):
    """Logits 5 and 4 at columns 1,990 and 1,995, 80 ties at 3 (columns 10..49 and 1,010..1,049), the rest lower:
    top-k 3 keeps 1,990, 1,995 and the tie of lowest id, 10, what a sort of the row largest first keeps (rank < k)."""
    x = torch.full((2000,), -5.0)
    x[1990], x[1995], x[10:50], x[1010:1050] = 5.0, 4.0, 3.0, 3.0
    drawn = top_k_of(x.expand(64, -1), 8.0, 3, cap=cap)  # T = 8: all three often
    assert set(drawn.tolist()) == {1990, 1995, 10}


def test_a_row_whose_candidates_overflow_draws_what_enough_slots_draw():
    """Top-k 2 with 4 slots per row: every 4th row has its four largest logits in one lane (columns 1,000 + 1,024 i),
    so its floor (the 2nd largest lane's maximum) leaves 5 or more logits above: it finds its 2nd logit alone. With
    64 slots no row does. The same token ids (the same kept set, order and noise)."""
    logits = random_logits(9, 4096, 0.5, rows=32)
    logits[::4, 1000::1024] += torch.tensor(
        [10.0, 11.0, 12.0, 13.0]
    )  # the largest at the highest column
    many, few = (
        top_k_of(logits, 0.7, 2, min_p=0.3, cap=64),
        top_k_of(logits, 0.7, 2, min_p=0.3, cap=4),
    )
    assert torch.equal(few, many)
    assert (
        logits.gather(1, many[:, None]) >= logits.topk(2).values[:, 1:]
    ).all()  # in each row's top 2


def test_a_row_with_fewer_finite_logits_than_k_draws_among_them():
    """Three finite logits, top-k 10: the floor is -inf, every column a candidate (overflow): the three, as often
    as softmax says."""
    x = torch.full((3000,), float("-inf"))
    cols = torch.tensor([2999, 5, 1500])
    x[cols] = torch.tensor([0.5, 0.3, 0.2]).log()
    n = 64
    drawn = top_k_of(x.expand(n, -1), 1.0, 10)
    freq = torch.stack([(drawn == c).float().mean() for c in cols])
    expected = torch.tensor([0.5, 0.3, 0.2])
    assert set(drawn.tolist()) <= set(cols.tolist())
    assert ((freq - expected).abs() <= 4.5 * (expected * (1 - expected) / n).sqrt()).all(), freq


def test_rows_of_the_other_path_are_skipped_and_change_nothing():
    """A batch mixing top-k rows, random rows without one and greedy rows: top_k_sample draws the first and the
    greedy ones, nucleus (told which) the others, each as in a batch of those rows alone."""
    rows = 24
    logits, keys = random_logits(13, 1500, 2.0, rows=rows), torch.arange(rows) * 17
    t, k, top_p, min_p = (
        torch.ones(rows),
        torch.full((rows,), 6),
        torch.full((rows,), 0.8),
        torch.zeros(rows),
    )
    t[::4], k[::8], k[1::4], k[2::4] = (
        0.0,
        -1,
        -1,
        -1,
    )  # greedy rows, half without a top-k; random rows without
    others = (k <= 0) & (t > 0)
    mixed_k = top_k_sample(logits, t, k, top_p, min_p, keys, k_max=6)
    mixed_p = nucleus(logits, t, top_p, min_p, keys, others)
    ours = ~others
    alone_k = top_k_sample(
        logits[ours], t[ours], k[ours], top_p[ours], min_p[ours], keys[ours], k_max=6
    )
    assert torch.equal(mixed_k[ours], alone_k)
    assert torch.equal(
        mixed_p[others], nucleus(*(v[others] for v in (logits, t, top_p, min_p, keys)))
    )
    assert torch.equal(mixed_k[::4], logits[::4].argmax(dim=-1))


@pytest.mark.gpu
def test_cuda_top_k_sample_on_a_full_vocabulary_batch():
    """256 rows of 151,936 float32 logits, each row its own top-k (1..512), top-p, min-p and temperature (some 0):
    every token is one keep_mask keeps (sorting the whole row), greedy rows the argmax; the sampler takes this path."""
    rows, vocab = 256, 151_936
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(rows, vocab, generator=g)
    k = torch.randint(1, 513, (rows,), generator=g)
    top_p = torch.where(
        torch.rand(rows, generator=g) < 0.5, 1.0, 0.5 + 0.5 * torch.rand(rows, generator=g)
    )
    min_p = torch.where(torch.rand(rows, generator=g) < 0.3, 0.2, 0.0)
    t = torch.where(torch.rand(rows, generator=g) < 0.1, 0.0, 0.5 + torch.rand(rows, generator=g))
    params = [SamplingParams(temperature=float(t[i]), top_k=int(k[i]), top_p=float(top_p[i]), min_p=float(min_p[i]))
              for i in range(rows)]  # fmt: skip
    tokens = sample(logits, params, device="cuda")
    probs = torch.softmax(logits / torch.where(t > 0, t, 1.0)[:, None], dim=-1)
    kept = filter_probs(probs, k, top_p, min_p) > 0
    greedy = t == 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(dim=-1))
    assert kept[~greedy].gather(1, tokens[~greedy, None]).all()
    assert len(set(tokens[~greedy].tolist())) > 100


@pytest.mark.gpu
def test_cuda_top_k_rows_beside_top_p_rows_draw_what_they_draw_alone():
    """A batch mixing seeded top-k (+ top-p) rows, top-p rows and greedy rows: top_k_sample serves the first,
    nucleus the others, each row the token it gets in a batch of its kind alone (its seed's noise, no sort)."""
    kinds = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9), SamplingParams(temperature=0.8, top_p=0.8),
             SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, top_k=600)]  # fmt: skip
    params = [dataclasses.replace(kind, seed=i) for i in range(64) for kind in kinds[:3]]
    logits = random_logits(12, 151_936, 3.0, rows=len(params))
    mixed = sample(logits, params, device="cuda")
    for r in range(3):  # each kind's rows alone
        assert torch.equal(sample(logits[r::3], params[r::3], device="cuda"), mixed[r::3])
    tokens = sample(
        logits[:3], params[:2] + kinds[3:], device="cuda"
    )  # a top-k above 512: the whole row sorted
    assert logits[2, tokens[2]] >= logits[2].topk(600).values[-1]
