"""The production engine (deep dive fast_engine). On a CPU, the GPU runner's Python path (the small layers'
kernels switched in, the GPU sampler, warm-up, the fast attention context: paged prefill, a mixed step's
decode rows apart; async placeholders), its kernels in Triton's interpreter, gives notebook 06's core's
tokens; and `minivllm.LLM` is that composition."""

import torch

import minivllm
from minivllm.config import Config
from minivllm.engine.core import EngineCore
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.production import GPURunner, ProductionCore
from minivllm.production import ProductionLLM
from minivllm.sampling_params import SamplingParams

SMALL = dict(
    dtype=torch.float32,
    num_kvcache_blocks=32,
    max_num_seqs=2,
    max_num_batched_tokens=24,  # chunks: mixed steps
    max_model_len=128,
    enforce_eager=True,  # CUDA graphs need a GPU
    device="cpu",
)


class GPURunnerCore(ProductionCore):
    """The production core with the GPU's runner, on a CPU: Triton's interpreter runs its kernels."""

    def make_runner(self) -> ModelRunner:
        runner = GPURunner(self.config)
        runner.use_triton = True
        return runner


def completions(core: EngineCore) -> dict[str, list[int]]:
    greedy = [SamplingParams(temperature=0, max_tokens=6)]
    system = list(range(1, 33))  # two full blocks: the second request finds them cached
    core.add_request("a", system + [40, 41, 42], greedy)
    tokens: dict[str, list[int]] = {}
    for step in range(40):
        if step == 3:
            core.add_request("b", system + [50, 51], greedy)
        if step > 3 and not core.has_unfinished_requests():
            break
        for delta in core.step()[0]:
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    core.close()
    return tokens


def test_the_gpu_runner_gives_the_cores_tokens(tiny):
    plain = completions(EngineCore(Config(tiny, **SMALL)))
    fast_core = GPURunnerCore(Config(tiny, async_scheduling=True, **SMALL))
    runner = fast_core.runner
    assert isinstance(runner, GPURunner) and runner.startup_seconds.keys() >= {"compile"}
    assert completions(fast_core) == plain and sorted(plain) == ["a", "b"]
    assert all(len(tokens) == 6 for tokens in plain.values())


def test_minivllm_llm_is_the_production_composition(tiny):
    assert minivllm.LLM is ProductionLLM
    with minivllm.LLM(str(tiny), **{k: v for k, v in SMALL.items() if k != "enforce_eager"}) as llm:
        assert isinstance(llm.engine.core, ProductionCore)
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
