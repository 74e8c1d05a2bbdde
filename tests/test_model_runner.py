"""The model runner (notebook 04): every paged path gives the logits of a from-scratch forward; TP; shutdown."""

import os
import random
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from minivllm.checkpoint import write_checkpoint
from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.model_runner import ModelRunner, graph_batch_sizes
from minivllm.engine.sequence import Sequence
from minivllm.models.loader import load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def reference(tiny):
    return load_model(tiny, dtype=torch.float32, device=DEVICE)


@pytest.fixture(scope="module")
def runner(tiny):
    runner = ModelRunner(Config(tiny, dtype=torch.float32, num_kvcache_blocks=128, max_num_seqs=16))
    yield runner
    runner.close()


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
        full = reference.prompt_logits(seq.token_ids).float().cpu()  # (len, vocab): every position at once
        expected = full[seq.num_prompt_tokens - 1 : len(seq) - 1]  # the positions that predicted each new token
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


@pytest.mark.parametrize("use_triton", [False, True])
def test_prefix_cache_hit_gives_the_logits_of_no_caching(runner, reference, use_triton):
    runner.use_triton = use_triton or DEVICE == "cuda"
    try:
        system = random.Random(1).choices(range(2048), k=48)  # three full blocks
        bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
        run_steps(runner, [system + [1, 2]], 0, bm=bm)  # fills the cache; its blocks stay cached when freed
        seqs, hit, cached = run_steps(runner, [system + [9, 8, 7, 6, 5]], 4, bm=bm)
        assert cached == [48]
        _, plain, _ = run_steps(runner, [system + [9, 8, 7, 6, 5]], 4, bm=BlockManager(128, 16, enable_prefix_caching=False))
        torch.testing.assert_close(hit[0], plain[0], rtol=1e-4, atol=1e-4)
        assert_matches_from_scratch(reference, seqs, hit)
    finally:
        runner.use_triton = DEVICE == "cuda"


@pytest.mark.parametrize("use_triton", [False, True])
def test_chunked_prefill_gives_the_logits_of_one_step(runner, reference, use_triton):
    """A prompt prefilled over several steps, chunks ending inside and on block boundaries, with and without a
    prefix hit: each chunk reads the ones before through the block table; the last one's logits are exact."""
    runner.use_triton = use_triton or DEVICE == "cuda"
    try:
        prompt = random.Random(2).choices(range(2048), k=90)
        expected = reference.prompt_logits(prompt)[-1].float().cpu()
        for hit, ends in ((False, [1, 2, 50, 90]), (False, [16, 32, 89, 90]), (True, [33, 90]), (True, [48, 89, 90])):
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
    finally:
        runner.use_triton = DEVICE == "cuda"


def test_run_samples_greedy_tokens(runner, reference):
    from minivllm.sampling_params import SamplingParams

    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
    seq = Sequence([5, 6, 7, 8], SamplingParams(temperature=0), block_size=runner.block_size)
    admit(bm, seq)
    token = runner.run([seq], is_prefill=True)[0]
    assert token == int(reference.prompt_logits(seq.token_ids)[-1].argmax())
    bm.deallocate(seq)


def test_graph_batch_sizes():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(1) == [1]


def test_config_names_the_bad_field(tiny):
    for bad, field in [(dict(block_size=24), "block_size"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
                       (dict(max_num_seqs=0), "max_num_seqs"), (dict(tensor_parallel_size=0), "tensor_parallel_size")]:
        with pytest.raises(ValueError, match=field):
            Config(tiny, **bad)
    with pytest.raises(FileNotFoundError):
        Config("/no/such/checkpoint")


# --- tensor parallelism over gloo, and clean shutdown ---------------------------------------------------------

@pytest.mark.slow
def test_tensor_parallel_2_equals_1(tiny, runner):
    prompts = [list(range(1, 40)), [3] * 17]
    _, single, _ = run_steps(runner, prompts, 8)
    tp = ModelRunner(Config(tiny, dtype=torch.float32, num_kvcache_blocks=128, max_num_seqs=16,
                            tensor_parallel_size=2, device="cpu"))
    try:
        assert len(tp.workers) == 1 and tp.workers[0].is_alive()
        _, double, _ = run_steps(tp, prompts, 8)
    finally:
        tp.close()
    for a, b in zip(single, double):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not tp.workers[0].is_alive()  # close() ended the worker


def test_a_failing_start_leaves_no_worker(tiny):
    """tensor_parallel_size=4 cannot split the tiny model's 2 KV heads: every rank fails, none is left behind."""
    import multiprocessing

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ModelRunner(Config(tiny, dtype=torch.float32, num_kvcache_blocks=16, tensor_parallel_size=4, device="cpu"))
    deadline = time.time() + 30
    while multiprocessing.active_children() and time.time() < deadline:
        time.sleep(0.2)
    assert not multiprocessing.active_children()


SCRIPT = """
import os, sys, time, torch
from minivllm.config import Config
from minivllm.engine.model_runner import ModelRunner
runner = ModelRunner(Config(sys.argv[1], dtype=torch.float32, num_kvcache_blocks=16, tensor_parallel_size=2,
                            device="cpu"))
print(runner.workers[0].pid, flush=True)
{ending}
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["pass", "raise RuntimeError('boom')", "raise KeyboardInterrupt",
                                    "os.kill(os.getpid(), 9)"])
def test_workers_exit_with_the_engine(tiny, ending):
    """Normal exit, an exception, Ctrl-C, and even kill -9 of rank 0: the worker is gone within seconds."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SCRIPT).format(ending=ending), str(tiny)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker_pid = int(proc.stdout.readline())
    proc.wait(timeout=120)
    deadline = time.time() + 20
    while alive(worker_pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive(worker_pid), f"worker {worker_pid} outlived its engine ({ending})"
    if ending != "pass":
        assert proc.returncode != 0
    proc.stdout.close()
    proc.stderr.close()


# --- on a GPU: the Triton paths and CUDA graphs ----------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_fp32_paged_steps_equal_prompt_logits(tiny, reference):
    runner = ModelRunner(Config(tiny, dtype=torch.float32, num_kvcache_blocks=256, max_num_seqs=16))
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
    runner = ModelRunner(Config(tiny, dtype=torch.bfloat16, num_kvcache_blocks=512, max_num_seqs=48))
    try:
        prompts = [random.Random(i).choices(range(2048), k=5 + 7 * i) for i in range(batch)]
        seqs, graph, _ = run_steps(runner, prompts, num_decode_steps=10, seed=1)
        graphs, runner.graphs = runner.graphs, None
        tokens = [seq.completion_token_ids for seq in seqs]  # teacher forcing: the same tokens both ways
        _, eager, _ = run_steps(runner, prompts, num_decode_steps=10, seed=1, force=tokens)
        runner.graphs = graphs
    finally:
        runner.close()
    for g, e in zip(graph, eager):  # a padded batch may change the decode split count: equal up to bf16 rounding
        torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-2)
        assert (g.argmax(-1) == e.argmax(-1)).float().mean() > 0.9


@pytest.mark.gpu
def test_close_gives_the_kv_cache_back_to_the_gpu(tiny):
    """A second engine in the same process gets (about) the cache the first one had."""
    first = ModelRunner(Config(tiny, dtype=torch.bfloat16, gpu_memory_utilization=0.5, max_num_seqs=16))
    blocks = first.num_kvcache_blocks
    first.close()
    second = ModelRunner(Config(tiny, dtype=torch.bfloat16, gpu_memory_utilization=0.5, max_num_seqs=16))
    try:
        assert second.num_kvcache_blocks >= 0.95 * blocks
    finally:
        second.close()


# --- on two GPUs: tensor parallelism over NCCL -----------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3-0.6b", "qwen3-0.6b", seed=0)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs two GPUs")
def test_gpu_tensor_parallel_2_agrees_with_1_in_bf16(qwen3_06b):
    """Teacher forcing on the 0.6B preset: TP 2 (CUDA graphs, NCCL) differs from TP 1 by bf16 rounding only,
    no more than TP 1 differs from float32; and close() ends the worker and the process group."""
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    prompts = [random.Random(n).choices(range(10000), k=n) for n in (7, 100, 513)]
    config = dict(dtype=torch.bfloat16, gpu_memory_utilization=0.3, max_num_seqs=16, max_model_len=1024)
    single_runner = ModelRunner(Config(qwen3_06b, **config))
    try:
        seqs, single, _ = run_steps(single_runner, prompts, num_decode_steps=16)
    finally:
        single_runner.close()
    tokens = [seq.completion_token_ids for seq in seqs]
    tp = ModelRunner(Config(qwen3_06b, tensor_parallel_size=2, **config))
    replays = []
    try:
        assert tp.graphs is not None
        replay = tp.graphs.replay
        tp.graphs.replay = lambda *args: replays.append(1) or replay(*args)
        _, double, _ = run_steps(tp, prompts, num_decode_steps=16, force=tokens)
    finally:
        tp.close()
    assert len(replays) == 16  # every decode step went through a CUDA graph
    assert not tp.workers[0].is_alive() and not dist.is_initialized()
    reference = load_model(qwen3_06b, dtype=torch.float32, device="cuda")
    fp32 = [reference.prompt_logits(seq.token_ids).float().cpu()[seq.num_prompt_tokens - 1 : len(seq) - 1]
            for seq in seqs]
    single, double, fp32 = torch.cat(single), torch.cat(double), torch.cat(fp32)
    tp_error, bf16_error = (double - single).abs().max().item(), (single - fp32).abs().max().item()
    top2 = fp32.topk(2, dim=-1).values
    decisive = top2[:, 0] - top2[:, 1] > 0.1
    agree = (double.argmax(-1) == single.argmax(-1)).float().mean().item()
    print(f"TP 2 vs 1: max |Δ| {tp_error:.4f}, top-1 agreement {agree:.1%}; TP 1 bf16 vs fp32: max |Δ| {bf16_error:.4f}")
    assert tp_error <= 2 * bf16_error
    assert (double.argmax(-1) == fp32.argmax(-1))[decisive].all()
