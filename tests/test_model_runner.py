"""The model runner (notebook 04): every paged path gives the logits of a from-scratch forward; TP; shutdown."""

import random

import numpy as np
import pytest
import torch

from minivllm.attention import fast_paged
from minivllm.attention.fast_paged import FastPagedContext
from minivllm.config import Config
from minivllm.engine import cascade
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.cascade import shared_prefix
from minivllm.engine.cuda_graphs import StepGraphs, graph_batch_sizes
from minivllm.engine.gpu_runner import FastAttentionRunner, GPUModelRunner
from minivllm.engine.mixed_graphs import MixedGraphs
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.production import make_runner
from minivllm.engine.sequence import Sequence
from minivllm.kernels.cascade import flash_attn_with_kvcache  # the GPU context's decode kernel
from minivllm.models.loader import load_model
from minivllm.testing import prompt_logits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def reference(tiny):
    return load_model(tiny, dtype=torch.float32, device=DEVICE)


@pytest.fixture(scope="module")
def runner(tiny):
    runner = ModelRunner(Config(tiny, dtype=torch.float32, num_kvcache_blocks=128, max_num_seqs=16))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def fast_runner(tiny):
    """The GPU's attention context (deep dive cuda_graphs): on a CPU, its kernels in Triton's
    interpreter; on a GPU, the GPU runner itself, graphs included."""
    config = Config(tiny, dtype=torch.float32, num_kvcache_blocks=128, max_num_seqs=16)
    runner = make_runner(config) if DEVICE == "cuda" else FastAttentionRunner(config)
    runner.use_triton = True
    yield runner
    runner.close()


@pytest.fixture(params=["reference", "triton", "fast"])
def any_runner(request, runner, fast_runner):
    """Notebook 04's runner with PyTorch's reference ops, with its Triton kernels, and the GPU's
    attention context (deep dive cuda_graphs)."""
    if request.param == "fast":
        yield fast_runner
        return
    runner.use_triton = request.param == "triton" or DEVICE == "cuda"
    yield runner
    runner.use_triton = DEVICE == "cuda"


def admit(bm: BlockManager, seq: Sequence) -> None:
    """The scheduler's part for a prompt prefilled in one step: blocks, cache the full ones, schedule the rest."""
    bm.allocate(seq)
    bm.cache_blocks(seq, len(seq))
    seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens


def run_steps(runner, prompts, num_decode_steps, shuffle=True, seed=0, bm=None, force=None):
    """Prefill then greedy decode: the sequences, every step's logits per sequence ((steps, vocab) tensors), and
    how many prompt tokens each found in the prefix cache. `force`: per sequence, the tokens to append instead."""
    bm = bm or BlockManager(runner.num_kvcache_blocks, runner.block_size)
    if shuffle:
        random.Random(seed).shuffle(bm.free_block_ids)
    seqs = [Sequence(p, block_size=runner.block_size) for p in prompts]
    for seq in seqs:
        admit(bm, seq)
    cached = [seq.num_cached_tokens for seq in seqs]
    history = [[] for _ in seqs]
    for step in range(num_decode_steps + 1):
        logits = runner.step_logits(seqs, is_prefill=step == 0)
        for i, (seq, row) in enumerate(zip(seqs, logits)):
            history[i].append(row.float().cpu())
            seq.append_token(force[i][step] if force else int(row.argmax()))
            bm.may_append(seq)
    for seq in seqs:
        bm.deallocate(seq)
    return seqs, [torch.stack(h) for h in history], cached


def assert_matches_from_scratch(reference, seqs, history, tol=1e-4):
    for seq, logits in zip(seqs, history):
        full = (
            prompt_logits(reference, seq.token_ids).float().cpu()
        )  # (len, vocab): every position at once
        expected = full[
            seq.num_prompt_tokens - 1 : len(seq) - 1
        ]  # the positions that predicted each new token
        torch.testing.assert_close(logits, expected, rtol=tol, atol=tol)


def test_prefill_then_many_decode_steps_equal_prompt_logits(runner, reference):
    prompts = [random.Random(n).choices(range(2048), k=n) for n in (1, 15, 16, 17, 31, 100, 250)]
    seqs, history, _ = run_steps(runner, prompts, num_decode_steps=60)
    assert all(len(seq.block_table) == 0 for seq in seqs)
    assert_matches_from_scratch(reference, seqs, history)


def test_block_tables_are_really_shuffled_and_contiguous_order_gives_the_same(runner):
    prompts = [list(range(40)), list(range(5, 70))]
    _, shuffled, _ = run_steps(runner, prompts, 20, shuffle=True)
    _, ordered, _ = run_steps(runner, prompts, 20, shuffle=False)
    for a, b in zip(shuffled, ordered):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_triton_kernels_in_the_runner(runner, reference):
    """The same steps through the Triton kernels (the interpreter on a CPU): store, paged prefill, decode."""
    runner.use_triton = True
    try:
        seqs, history, _ = run_steps(runner, [list(range(3, 20)), [7] * 33], num_decode_steps=3)
    finally:
        runner.use_triton = DEVICE == "cuda"
    assert_matches_from_scratch(reference, seqs, history)


def test_prefix_cache_hit_gives_the_logits_of_no_caching(any_runner, reference):
    runner = any_runner
    system = random.Random(1).choices(range(2048), k=48)  # three full blocks
    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
    run_steps(
        runner, [system + [1, 2]], 0, bm=bm
    )  # fills the cache; its blocks stay cached when freed
    seqs, hit, cached = run_steps(runner, [system + [9, 8, 7, 6, 5]], 4, bm=bm)
    assert cached == [48]
    _, plain, _ = run_steps(
        runner,
        [system + [9, 8, 7, 6, 5]],
        4,
        bm=BlockManager(128, 16, enable_prefix_caching=False),
    )
    torch.testing.assert_close(hit[0], plain[0], rtol=1e-4, atol=1e-4)
    assert_matches_from_scratch(reference, seqs, hit)


def test_chunked_prefill_gives_the_logits_of_one_step(any_runner, reference):
    """A prompt prefilled over several steps, chunks ending inside and on block boundaries, with and without a
    prefix hit: each chunk reads the ones before through the block table; the last one's logits are exact."""
    runner = any_runner
    prompt = random.Random(2).choices(range(2048), k=90)
    expected = prompt_logits(reference, prompt)[-1].float().cpu()
    for hit, ends in (
        (False, [1, 2, 50, 90]),
        (False, [16, 32, 89, 90]),
        (True, [33, 90]),
        (True, [48, 89, 90]),
    ):
        bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
        if hit:
            run_steps(runner, [prompt[:40]], 0, bm=bm)  # caches the prompt's first two blocks
        seq = Sequence(prompt, block_size=runner.block_size)
        bm.allocate(seq)
        assert seq.num_cached_tokens == (32 if hit else 0)
        for end in ends:
            bm.cache_blocks(seq, end)
            seq.num_scheduled_tokens = end - seq.num_cached_tokens
            logits = runner.step_logits([seq], is_prefill=True)[0].float().cpu()
            seq.num_cached_tokens = end  # the step has run
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        bm.deallocate(seq)


def test_mixed_step_gives_every_row_its_logits(any_runner, reference, monkeypatch):
    """One step of two decode rows (first, as the unified scheduler orders them) and a prompt's chunk after its
    cached part. Notebook 04's context runs it as one prefill; the GPU's sends the decode rows through the decode
    kernel and the chunk through the prefill kernel."""
    runner, decode_rows = any_runner, []  # rows of each decode-kernel call

    def spy(q, *args, **kwargs):
        decode_rows.append(q.shape[0])
        return flash_attn_with_kvcache(q, *args, **kwargs)

    monkeypatch.setattr(fast_paged, "flash_attn_with_kvcache", spy)
    rng, bm = random.Random(3), BlockManager(runner.num_kvcache_blocks, runner.block_size)
    decoding = [
        Sequence(rng.choices(range(2048), k=n), block_size=runner.block_size) for n in (20, 37)
    ]
    chunked = Sequence(rng.choices(range(2048), k=50), block_size=runner.block_size)
    for seq in decoding:
        admit(bm, seq)
    bm.allocate(chunked)
    bm.cache_blocks(chunked, 21)
    chunked.num_scheduled_tokens = 21
    runner.step_logits(
        [*decoding, chunked], is_prefill=True
    )  # the prompts, the chunk's first 21 tokens
    for seq in decoding:
        seq.num_cached_tokens = len(seq)
        seq.append_token(rng.randrange(2048))
        bm.may_append(seq)
        seq.num_scheduled_tokens = 1
    chunked.num_cached_tokens = 21
    bm.cache_blocks(chunked, 50)
    chunked.num_scheduled_tokens = 29
    decode_rows.clear()
    step = [*decoding, chunked]
    graphs = runner.mixed_graphs if isinstance(runner, GPUModelRunner) else None
    if isinstance(runner, GPUModelRunner):
        monkeypatch.setattr(runner, "mixed_graphs", None)  # eagerly first: the spy sees each launch
    logits = runner.step_logits(step, is_prefill=True).float().cpu()
    for seq, row in zip(step, logits):
        expected = prompt_logits(reference, seq.token_ids)[-1].float().cpu()
        torch.testing.assert_close(row, expected, rtol=1e-4, atol=1e-4)
    layers = runner.config.hf_config.num_hidden_layers
    assert decode_rows == ([2] * layers if isinstance(runner, FastAttentionRunner) else [])
    if (
        graphs is not None
    ):  # on a GPU: the same step again (the same KV to the same slots), replayed
        monkeypatch.setattr(runner, "mixed_graphs", graphs)
        replays = graphs.num_replays
        torch.testing.assert_close(runner.step_logits(step, is_prefill=True).float().cpu(), logits)
        assert graphs.num_replays == replays + 1


def test_shared_prefix_finds_the_leading_blocks_most_rows_share(monkeypatch):
    monkeypatch.setattr(cascade, "CASCADE_MIN_ROWS", 3)
    monkeypatch.setattr(cascade, "CASCADE_MIN_TOKENS", 32)
    tables = np.array(
        [[5, 6, 7, 8], [5, 6, 7, 9], [1, 2, 3, 4], [5, 6, 7, 3], [5, 6, 2, 0]], dtype=np.int32
    )
    lens = np.array(
        [60, 50, 64, 49, 40], dtype=np.int32
    )  # full blocks of 16 before the new token: 3, 3, 3, 3, 2
    blocks, prefix_lens = shared_prefix(tables, lens, 16)
    assert blocks is not None and prefix_lens is not None
    assert blocks.tolist() == [5, 6] and prefix_lens.tolist() == [
        32,
        32,
        0,
        32,
        32,
    ]  # row 4 fills only 2 blocks
    blocks, prefix_lens = shared_prefix(tables[:4], lens[:4], 16)
    assert blocks is not None and prefix_lens is not None
    assert blocks.tolist() == [5, 6, 7] and prefix_lens.tolist() == [48, 48, 0, 48]
    assert shared_prefix(tables[:3], lens[:3], 16) == (None, None)  # 2 rows share: fewer than 3
    assert shared_prefix(tables, lens, 8) == (
        None,
        None,
    )  # 6 blocks of 8 fill the rows: 2 shared, 16 tokens
    tables[:, 0] = [5, 1, 1, 5, 1]  # the commonest first block starts nothing longer
    assert shared_prefix(tables, lens, 16) == (None, None)


def test_rows_sharing_a_cached_prompt_decode_through_the_shared_prefix(
    fast_runner, reference, monkeypatch
):
    """Decode steps of rows that begin with one cached system prompt: the GPU's context gives the decode kernel
    the shared prefix (03's cascade), and every row's logits are still those of a from-scratch forward."""
    monkeypatch.setattr(cascade, "CASCADE_MIN_ROWS", 3)
    monkeypatch.setattr(cascade, "CASCADE_MIN_TOKENS", 32)
    prefixes = []  # prefix_lens of each decode-kernel call

    def spy(*args, **kwargs):
        prefixes.append(None if kwargs["prefix_lens"] is None else kwargs["prefix_lens"].tolist())
        return flash_attn_with_kvcache(*args, **kwargs)

    monkeypatch.setattr(fast_paged, "flash_attn_with_kvcache", spy)
    if isinstance(fast_runner, GPUModelRunner):
        monkeypatch.setattr(fast_runner, "graphs", None)  # eagerly: the spy sees each launch
    rng = random.Random(4)
    system = rng.choices(range(2048), k=40)  # two full blocks of 16, and 8 tokens
    prompts = [system + rng.choices(range(2048), k=n) for n in (3, 30, 9)]
    prompts.append(rng.choices(range(2048), k=50))
    seqs, history, cached = run_steps(fast_runner, prompts, num_decode_steps=3)
    assert cached == [0, 32, 32, 0]
    layers = fast_runner.config.hf_config.num_hidden_layers
    assert prefixes == [[32, 32, 32, 0]] * (
        3 * layers
    )  # each decode step: rows 0-2 share 32 tokens
    assert_matches_from_scratch(reference, seqs, history)


def test_run_samples_greedy_tokens(runner, reference):
    from minivllm.sampling_params import SamplingParams

    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
    seq = Sequence([5, 6, 7, 8], SamplingParams(temperature=0), block_size=runner.block_size)
    admit(bm, seq)
    token = runner.run([seq], is_prefill=True)[0]
    assert token == int(prompt_logits(reference, seq.token_ids)[-1].argmax())
    bm.deallocate(seq)


def test_graph_batch_sizes():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(1) == [1]


def test_a_step_replays_the_smallest_graph_that_fits_cascade_if_it_has_a_prefix():
    """Graph keys (size, cascade), as decode captures them (both from 16 rows, plain below) and as mixed steps do
    (one per size: plain below 16, cascade from 16). No graph is run: key_for only picks."""
    decode = StepGraphs([4, 8, 16, 32], 32, 4, 8, torch.float32, torch.device("cpu"))
    decode.graphs = {(s, c): None for s in decode.sizes for c in (False, True) if s >= 16 or not c}  # type: ignore
    plain = FastPagedContext(False, torch.zeros(3), torch.zeros(3, 4))
    shared = FastPagedContext(False, torch.zeros(3), torch.zeros(3, 4), prefix_lens=torch.zeros(3))
    assert decode.key_for(plain, 3) == (4, False) and decode.key_for(shared, 3) == (
        4,
        False,
    )  # few rows: plain
    assert decode.key_for(plain, 20) == (32, False) and decode.key_for(shared, 20) == (32, True)
    assert decode.key_for(plain, 33) is None
    mixed = MixedGraphs.__new__(MixedGraphs)  # its key_for alone, without capturing
    StepGraphs.__init__(mixed, [4, 8, 16, 32], 32, 4, 8, torch.float32, torch.device("cpu"))
    mixed.block_m, mixed.graphs = 2, {(s, s >= 16): None for s in mixed.sizes}  # type: ignore[misc]
    tiles = torch.zeros(67, 2)  # one more than size 4's room (4 // 2 + 64): size 8
    prefill = FastPagedContext(True, torch.zeros(3), torch.zeros(3, 4), tiles=tiles[:66])
    assert mixed.key_for(prefill, 3) == (4, False) and mixed.key_for(prefill, 20) == (
        32,
        True,
    )  # no prefix: cascade
    assert mixed.key_for(
        FastPagedContext(True, torch.zeros(3), torch.zeros(3, 4), tiles=tiles), 3
    ) == (8, False)
    assert (
        mixed.key_for(FastPagedContext(True, torch.zeros(3), None, tiles=tiles[:66]), 3) is None
    )  # not paged


def test_config_names_the_bad_field(tiny):
    for bad, field in [
        (dict(block_size=24), "block_size"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_model_len=4097), "max_model_len"),
    ]:
        with pytest.raises(ValueError, match=field):
            Config(tiny, **bad)
    with pytest.raises(FileNotFoundError):
        Config("/no/such/checkpoint")


# --- on a GPU: the Triton paths and CUDA graphs ----------------------------------------------------------------


def gpu_runner(config: Config) -> GPUModelRunner:
    runner = make_runner(config)
    assert isinstance(runner, GPUModelRunner)
    return runner


@pytest.mark.gpu
def test_gpu_fp32_paged_steps_equal_prompt_logits(tiny, reference):
    runner = gpu_runner(Config(tiny, dtype=torch.float32, num_kvcache_blocks=256, max_num_seqs=16))
    try:
        assert runner.graphs is not None
        prompts = [random.Random(n).choices(range(2048), k=n) for n in (1, 16, 17, 100, 300)]
        seqs, history, _ = run_steps(runner, prompts, num_decode_steps=30)
        assert_matches_from_scratch(reference, seqs, history, tol=1e-3)
    finally:
        runner.close()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 16, 40])
def test_cuda_graph_replay_equals_eager(tiny, batch):
    runner = gpu_runner(Config(tiny, dtype=torch.bfloat16, num_kvcache_blocks=512, max_num_seqs=48))
    try:
        prompts = [random.Random(i).choices(range(2048), k=5 + 7 * i) for i in range(batch)]
        seqs, graph, _ = run_steps(runner, prompts, num_decode_steps=10, seed=1)
        graphs, runner.graphs = runner.graphs, None
        tokens = [
            seq.completion_token_ids for seq in seqs
        ]  # teacher forcing: the same tokens both ways
        _, eager, _ = run_steps(runner, prompts, num_decode_steps=10, seed=1, force=tokens)
        runner.graphs = graphs
    finally:
        runner.close()
    for g, e in zip(
        graph, eager
    ):  # a padded batch may change the decode split count: equal up to bf16 rounding
        torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-2)
        assert (g.argmax(-1) == e.argmax(-1)).float().mean() > 0.9


@pytest.mark.gpu
def test_rows_sharing_a_prompt_replay_the_cascade_graph(tiny, reference):
    """20 rows, 17 of which begin with one cached 260-token prompt: each decode step replays the graph of 32 rows
    captured with the shared-prefix kernel; 3 rows alone replay the plain graph of 4; logits stay exact (fp32)."""
    runner = gpu_runner(Config(tiny, dtype=torch.float32, num_kvcache_blocks=512, max_num_seqs=32))
    try:
        assert runner.graphs is not None
        keys = []
        replay = runner.graphs.replay
        runner.graphs.replay = lambda key, *args: keys.append(key) or replay(key, *args)  # type: ignore[method-assign]
        rng = random.Random(5)
        system = rng.choices(range(2048), k=260)  # 16 full blocks and 4 tokens
        prompts = [system + rng.choices(range(2048), k=rng.randint(1, 40)) for _ in range(17)]
        prompts += [rng.choices(range(2048), k=30) for _ in range(3)]
        seqs, history, cached = run_steps(runner, prompts, num_decode_steps=4)
        assert cached[1:17] == [256] * 16
        assert keys == [(32, True)] * 4
        run_steps(runner, prompts[17:], num_decode_steps=2)
        assert keys[4:] == [(4, False)] * 2
    finally:
        runner.close()
    assert_matches_from_scratch(reference, seqs, history, tol=1e-3)


@pytest.mark.gpu
def test_a_runner_with_fewer_seats_than_the_cascade_needs_replays_mixed_graphs(tiny, reference):
    """max_num_seqs 8 < CASCADE_MIN_ROWS: the mixed graphs are captured without the shared-prefix kernel, and a
    prefix hit's prefill replays one."""
    runner = gpu_runner(Config(tiny, dtype=torch.float32, num_kvcache_blocks=128, max_num_seqs=8))
    try:
        assert runner.mixed_graphs is not None and all(
            not cascade for _, cascade in runner.mixed_graphs.graphs
        )
        system = random.Random(6).choices(range(2048), k=48)
        bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
        run_steps(runner, [system + [1, 2]], 0, bm=bm)  # caches the system prompt's 3 blocks
        replays = runner.mixed_graphs.num_replays
        seqs, history, cached = run_steps(runner, [system + [9, 8, 7], system + [5]], 2, bm=bm)
        assert cached == [48, 48] and runner.mixed_graphs.num_replays == replays + 1
    finally:
        runner.close()
    assert_matches_from_scratch(reference, seqs, history, tol=1e-3)


@pytest.mark.gpu
def test_close_gives_the_kv_cache_back_to_the_gpu(tiny):
    """A second engine in the same process gets the cache the first one had, even when memory the first one freed
    is still reserved by PyTorch's allocator (here: its graph pool, released only after it was measured)."""
    config = Config(tiny, dtype=torch.bfloat16, gpu_memory_utilization=0.5, max_num_seqs=16)
    first = gpu_runner(config)
    blocks, graphs = first.num_kvcache_blocks, first.graphs
    first.close()
    del graphs  # freed after close's empty_cache(): the allocator keeps it reserved
    second = gpu_runner(config)
    try:
        print(f"KV blocks: first engine {blocks}, second {second.num_kvcache_blocks}")
        assert abs(second.num_kvcache_blocks - blocks) <= 0.01 * blocks
    finally:
        second.close()


def test_config_json_is_read_once(tiny):
    """Config reads it; the runner passes it down to load_model instead of reading the folder again."""
    from unittest import mock

    from transformers import AutoConfig

    read = mock.patch.object(AutoConfig, "from_pretrained", wraps=AutoConfig.from_pretrained)
    with read as from_pretrained:
        ModelRunner(Config(tiny, dtype=torch.float32, num_kvcache_blocks=16)).close()
    assert from_pretrained.call_count == 1
