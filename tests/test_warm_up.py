"""After `LLM()` the engine compiles nothing and captures nothing while it serves: start-up did it all (GPU)."""

import multiprocessing
import random
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

import pytest
import torch

from minivllm import LLM, SamplingParams


@contextmanager
def counting_compiles_and_captures() -> Iterator[tuple[list[str], list[int]]]:
    """Yields (compiles, captures): each Triton kernel compiled (its name and specialization) and each CUDA graph
    capture begun while inside. A compile is counted on a miss of Triton's in-memory cache, even if its disk cache
    then has the binary: that miss is what a request would wait for."""
    import triton

    compiles: list[str] = []
    captures: list[int] = []
    hook = triton.knobs.runtime.jit_post_compile_hook
    capture_begin = torch.cuda.CUDAGraph.capture_begin

    def counted_capture(graph, *args, **kwargs):
        captures.append(1)
        return capture_begin(graph, *args, **kwargs)

    def counted_compile(fn, compile: dict, **kwargs) -> None:
        constants = {k: v for k, v in compile.get("constants", {}).items() if v is not None}
        compiles.append(f"{fn.name} {compile.get('signature')} {constants}")

    triton.knobs.runtime.jit_post_compile_hook = counted_compile
    torch.cuda.CUDAGraph.capture_begin = counted_capture  # type: ignore[method-assign]
    try:
        yield compiles, captures
    finally:
        triton.knobs.runtime.jit_post_compile_hook = hook
        torch.cuda.CUDAGraph.capture_begin = capture_begin  # type: ignore[method-assign]


def varied_params(rng: random.Random, vocab: int) -> SamplingParams:
    """One request's sampling: every path the sampler has (greedy, temperature, top-p, top-k below and above the
    gathered kernel's 512, min-p, penalties, logprobs, prompt logprobs, seeds, n) in random mixtures."""
    kind = rng.choice(["greedy", "temperature", "top-p", "top-k", "large top-k", "min-p", "all"])
    params: dict = dict(
        max_tokens=rng.choice([1, 2, 5, 17, 40]), seed=rng.choice([None, rng.randrange(2**32)])
    )
    params["temperature"] = 0.0 if kind == "greedy" else rng.choice([0.5, 1.0, 1.3])
    if kind in ("top-p", "all"):
        params["top_p"] = rng.choice([0.5, 0.9, 0.95])
    if kind in ("top-k", "all"):
        params["top_k"] = rng.choice([1, 2, 3, 5, 20, 50, 100, 200, 300, 512])
    if kind == "large top-k":
        params["top_k"] = rng.choice([513, 1000, vocab - 1, vocab, 10 * vocab])
    if kind in ("min-p", "all"):
        params["min_p"] = rng.choice([0.05, 0.2])
    if rng.random() < 0.2:
        params.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    if rng.random() < 0.15:
        params["logprobs"] = rng.choice([0, 1, 5, 20])
    if rng.random() < 0.05:
        params["prompt_logprobs"] = rng.choice([0, 3])
    if rng.random() < 0.05:
        params["n"] = rng.choice([2, 4])
    return SamplingParams(**params)


def varied_prompts(
    rng: random.Random, vocab: int, count: int, system: list[int]
) -> list[list[int]]:
    """Prompt lengths from 1 token to past the largest captured step (eager steps), some behind a shared system
    prompt (prefix hits, cascade decode steps)."""
    lengths = [rng.choice([1, 2, 7, 16, 33, 100, 250, 1000, 3000]) for _ in range(count)]
    prompts = [rng.choices(range(3, vocab), k=n) for n in lengths]
    return [system + p if rng.random() < 0.4 else p for p in prompts]


def compiles_and_captures_after_start_up(model: str, enforce_eager: bool) -> tuple[list[str], int]:
    """In this process: LLM(model), then a varied workload, counting what it compiles and captures."""
    sizes = dict(
        max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=4096
    )  # steps past the largest graph
    with LLM(model, dtype=torch.bfloat16, enforce_eager=enforce_eager, **sizes) as llm:
        vocab = llm.engine.config.hf_config.vocab_size
        rng = random.Random(0)
        system = rng.choices(range(3, vocab), k=300)
        with counting_compiles_and_captures() as (compiles, captures):
            for count in (
                1,
                1,
                2,
                3,
                5,
                17,
                40,
                64,
                100,
                200,
            ):  # batches from one request to more than the seats
                prompts = varied_prompts(rng, vocab, count, system)
                params = [varied_params(rng, vocab) for _ in prompts]
                outputs = llm.generate(prompts, params, use_tqdm=False)
                assert all(c.token_ids for out in outputs for c in out.outputs)
            for params in (
                SamplingParams(temperature=0, max_tokens=64),
                SamplingParams(top_k=50, top_p=0.95),
            ):
                for rows in (
                    1,
                    16,
                    33,
                    64,
                ):  # one shape of sampling on many batch sizes, cascade and not
                    prompts = [system + [rows, i] for i in range(rows)] if rows > 1 else [[5] * 9]
                    llm.generate(prompts, params, use_tqdm=False)
    return compiles, len(captures)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset, enforce_eager", [("tiny", False), ("tiny", True), ("qwen3-0.6b", False)]
)
def test_serving_after_start_up_compiles_and_captures_nothing(
    preset, enforce_eager, tiny, tmp_path
):
    """In a fresh process, so that no kernel another test compiled counts as warm."""
    from minivllm.checkpoint import write_checkpoint

    model = tiny if preset == "tiny" else write_checkpoint(tmp_path / preset, preset, seed=0)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        compiles, captures = pool.submit(
            compiles_and_captures_after_start_up, str(model), enforce_eager
        ).result()
    assert not captures, f"{captures} CUDA graph captures while serving"
    assert not compiles, f"{len(compiles)} Triton compiles while serving:\n" + "\n".join(compiles)
