# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Deep dive · The production engine: the core plus every layer, composed
#
# **What this adds.** The core path built a simple engine; the deep dives each built one production
# layer as a subclass or a part: the small layers' Triton kernels, the GPU sampler, paged prefill,
# the cascade, CUDA graphs and warm-up (`GPUModelRunner`), tensor parallelism (`TPModelRunner`),
# async scheduling (`AsyncEngineCore`). Here they are put together, once, into what
# `from minivllm import LLM` gives: the same `LLM` API, the right runner for the machine.
#
# **It follows notebook 06** and the deep dives before it; nothing in the core path needs it. It
# exports `minivllm.engine.production` (the runner and core classes, `make_core`) and
# `minivllm.production` (`ProductionLLM`, which `from minivllm import LLM` gives).
#
# **What you will see.** Which runner each machine gets, and the production engine giving the core
# engine's tokens on this CPU.

# %%
import gc
import os
from pathlib import Path

import torch
from transformers.utils.logging import disable_progress_bar

from minivllm.checkpoint import write_checkpoint

disable_progress_bar()  # transformers' saving draws no progress bars in the outputs

CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../../build/checkpoints")).resolve()
path = CHECKPOINTS / "tiny"
if not (path / "model.safetensors").is_file():
    write_checkpoint(path, "tiny", seed=0)

# %% [markdown]
# ## Runners by multiple inheritance
# Each layer changes a few methods and calls `super()` for the rest, so layers stack: a class that
# lists two of them runs both, in the order its bases are listed (Python's method resolution
# order). On one GPU: async scheduling's placeholders and host copies over the GPU fast paths; on
# several, rank 0's `TPModelRunner` over the GPU fast paths, its workers `RankRunner`s over them
# too; on a CPU, the plain runner with async scheduling's placeholders (tensor parallelism over
# gloo when asked). Every one loads through `ZooRunner`, last among its bases: notebook 02's loader
# with the deep dive model_zoo's table, so that Llama and Qwen2 load too.

# %% tags=["export"] module="minivllm.engine.production"
import atexit
import gc
from pathlib import Path
from typing import Any

from minivllm.config import Config
from minivllm.engine.api_core import ApiCore
from minivllm.engine.api_engine import ApiEngine
from minivllm.engine.async_core import AsyncEngineCore, AsyncRunner
from minivllm.engine.core import EngineCore
from minivllm.engine.gpu_runner import GPUModelRunner
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.workers import RankRunner, TPModelRunner
from minivllm.layers.linear import tensor_parallel
from minivllm.models.checked_loader import read_config_fast
from minivllm.models.loader import load_model
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.models.zoo import ZOO


class ZooRunner(ModelRunner):
    """Listed last among a runner's bases: notebook 02's loader given the deep dive model_zoo's
    table (Llama, Qwen2 beside Qwen3); the layers above it wrap what it loads."""

    def load(self) -> Qwen3ForCausalLM:
        config = self.config
        with tensor_parallel(self.tp):  # the layers keep this engine's group
            return load_model(config.model, config.dtype, self.device, config.hf_config, ZOO)


class GPURunner(AsyncRunner, GPUModelRunner, ZooRunner):
    """One GPU: async scheduling's inputs and host copies over every GPU fast path."""


class GPURankRunner(RankRunner, GPUModelRunner, ZooRunner):
    """A tensor-parallel worker on a GPU."""


class GPUTPRunner(TPModelRunner, GPUModelRunner, ZooRunner):
    """Rank 0 of a tensor-parallel engine on GPUs; its workers run GPURankRunner."""

    worker_class = GPURankRunner


class CPURunner(AsyncRunner, ZooRunner):
    """A CPU: async scheduling's placeholders over the plain runner."""


class CPURankRunner(RankRunner, ZooRunner):
    """A tensor-parallel worker on a CPU (gloo)."""


class CPUTPRunner(TPModelRunner, ZooRunner):
    """Rank 0 of a tensor-parallel engine on CPUs; its workers run CPURankRunner."""

    worker_class = CPURankRunner


def make_runner(config: Config) -> ModelRunner:
    """The runner for this machine and config."""
    gpu = config.device == "cuda"
    if config.tensor_parallel_size > 1:
        return GPUTPRunner(config) if gpu else CPUTPRunner(config)
    return GPURunner(config) if gpu else CPURunner(config)


class ProductionCore(AsyncEngineCore):
    """Notebook 06's core with async scheduling and this machine's runner."""

    def make_runner(self) -> ModelRunner:
        return make_runner(self.config)


def make_core(config: Config) -> ApiCore:
    return ProductionCore(config)


class ProductionConfig(Config):
    """Notebook 02's Config, config.json read without importing the architecture's class (deep dive
    checkpoints: seconds at start-up)."""

    __slots__ = ()

    def read_hf_config(self) -> Any:
        return read_config_fast(Path(self.model), ZOO)  # Llama and Qwen2 too (deep dive model_zoo)


# %% [markdown]
# ## The engine: its config read fast, its objects frozen for the collector
# The engine's layers. Its `Config` reads config.json without transformers' architecture classes
# (`read_config_fast`, deep dive checkpoints), whose import costs seconds of a first start-up.
# Python's cyclic garbage collector walks every tracked object in a
# full collection: after start-up that is the model's modules, the tokenizer, the KV cache's
# bookkeeping, hundreds of thousands of objects that live as long as the engine. A full collection
# mid-run then stalls a step for tens of milliseconds. `gc.freeze()` after start-up moves them out
# of the collector's sight; `close()` gives them back.


# %% tags=["export"] module="minivllm.engine.production"
class ProductionEngine(ApiEngine):
    """Notebook 06's engine over the production core, its start-up objects frozen for the GC."""

    def __init__(self, model: str, **kwargs):
        super().__init__(model, **kwargs)
        gc.collect()
        gc.freeze()  # start-up's objects live as long as the engine: full collections skip them
        atexit.register(gc.unfreeze)  # (and the interpreter's last collection frees them)

    def make_config(self, model: str | Path, **kwargs) -> Config:
        return ProductionConfig(model, **kwargs)

    def make_core(self) -> EngineCore:
        return make_core(self.config)

    def close(self) -> None:
        gc.unfreeze()  # what this engine held goes back to the collector
        super().close()


# %% tags=["export"] module="minivllm.production"
from minivllm.api_llm import ApiLLM
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.production import ProductionEngine


class ProductionLLM(ApiLLM):
    """vLLM's offline entry point with every production layer: `from minivllm import LLM`."""

    def make_engine(self, model: str, **kwargs) -> LLMEngine:
        return ProductionEngine(model, **kwargs)


# %% [markdown]
# ## On this CPU: the runner it picks, the core's tokens
# The production `LLM` on a CPU runs `CPURunner` (an `AsyncRunner`) under `ProductionCore`; asked
# for async scheduling (on by default only on one GPU), it launches ahead. Greedy and seeded outputs
# must equal notebook 06's engine's.

# %%
import minivllm
from minivllm.engine.async_core import AsyncRunner
from minivllm.engine.production import ProductionCore
from minivllm.llm import LLM as CoreLLM
from minivllm.production import ProductionLLM
from minivllm.sampling_params import SamplingParams

assert minivllm.LLM is ProductionLLM
config = dict(device="cpu", dtype=torch.float32, num_kvcache_blocks=64, max_num_seqs=8)
prompts = [list(range(1, n)) for n in (7, 40, 90)]
params = [SamplingParams(temperature=0, max_tokens=16), SamplingParams(seed=1, max_tokens=16)]


def tokens(llm: CoreLLM, sampling: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sampling, use_tqdm=False)]


with CoreLLM(str(path), **config) as core_llm:
    expected = [tokens(core_llm, p) for p in params]
with ProductionLLM(str(path), async_scheduling=True, **config) as llm:
    core = llm.engine.core
    assert isinstance(core, ProductionCore) and isinstance(core.runner, AsyncRunner)
    got = [tokens(llm, p) for p in params]
    print(
        f"{type(core).__name__} over {type(core.runner).__name__}; frozen: {gc.get_freeze_count()}"
    )
assert got == expected

# %% [markdown]
# ## On a GPU: every compile in start-up
# The GPU runner warms up before it captures its graphs (deep dive cuda_graphs). With Triton's
# compile hook set: the compiles of a small engine's start-up, then of a varied batch after it
# (none).

# %%
import triton

from minivllm.checkpoint import checkpoint_for

if torch.cuda.is_available():
    compiled: list[str] = []
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    with ProductionLLM(str(checkpoint_for("tiny")), max_num_seqs=32, max_model_len=1024) as small:
        print(f"start-up: {len(compiled)} compiles")
        compiled.clear()
        batch, params = [[7] * n for n in range(1, 30)], SamplingParams(top_k=20, max_tokens=8)
        small.generate(batch, params, use_tqdm=False)
        print(f"29 requests after it: {len(compiled)} compiles")
    triton.knobs.runtime.jit_post_compile_hook = None


# %% [markdown]
# ## How far from the hardware's limit?
# Notebook 06 plotted `LLM`'s throughput on nano-vllm's workload (256 requests of 100–1,024 tokens
# in and out) from an H200 run. Every decode step reads all the weights once, and each running
# request's whole KV cache: add it up over the workload and divide by the copy bandwidth notebook 03
# measured. The benchmark does this for every workload (the % labels of 06's figure; it counts
# FLOPs too, and a prefix all requests share once a step).

# %%
import json

from minivllm.benchmarks.workloads import workload
from minivllm.checkpoint.maker import preset_config
from minivllm.models.qwen3 import Qwen3ForCausalLM

figures = Path("../figures")  # the committed H200 runs
throughput = json.loads((figures / "throughput.json").read_text())
decode = json.loads((figures / "decode.json").read_text())

qwen = preset_config("qwen3-0.6b")
with torch.device("meta"):  # shapes only: count the parameters without allocating them
    num_params = sum(p.numel() for p in Qwen3ForCausalLM(qwen).parameters())
# K and V, bf16
kv_bytes_per_token = 2 * qwen.num_hidden_layers * qwen.num_key_value_heads * qwen.head_dim * 2
prompts, output_lens = workload(256)
kv_reads = kv_bytes_per_token * sum(
    len(p) + t for p, n in zip(prompts, output_lens) for t in range(1, n)
)
weight_reads = num_params * 2 * (max(output_lens) - 1)  # bf16 weights, once per decode step
roofline = sum(output_lens) / ((kv_reads + weight_reads) / (decode["copy_tbps"] * 1e12))
key = ("nano-vllm", "unified", "minivllm")
rows = {(r["workload"], r["policy"], r["impl"]): r for r in throughput["rows"]}
ours = rows[key]
print(
    f"KV reads {kv_reads / 1e12:.1f} TB + weights {weight_reads / 1e12:.1f} TB at "
    f"{decode['copy_tbps']:.2f} TB/s"
)
print(f"at most {roofline:,.0f} tok/s; minivllm reaches {ours['tok_per_s'] / roofline:.0%} of it")
# at this batch size the KV cache, not the weights, is what decode reads
assert kv_reads > 10 * weight_reads
# the benchmark's roofline (FLOPs too) agrees
assert abs(roofline / ours["roofline_tok_per_s"] - 1) < 0.05
