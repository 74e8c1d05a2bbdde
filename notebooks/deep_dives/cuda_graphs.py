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
# # Deep dive · CUDA graphs, and decode rows that share a prefix
#
# **What it adds.** Notebook 04's runner runs every step eagerly: a few hundred kernel launches a
# step, which on a GPU cost the host more than the kernels cost the GPU. Here steps are captured in
# CUDA graphs (decode steps per batch size; prefill and mixed steps padded to one of a few token
# counts), and decode rows that begin with one cached prompt read it once (notebook 03's cascade).
# At the end, `GPUModelRunner` (a subclass of notebook 04's runner) puts them together with the
# other GPU fast paths: the small-layer kernels, the GPU sampler, the paged prefill kernel.
#
# **It follows notebook 04**; nothing later in the core path needs it: without it, every step runs
# eagerly, to the same tokens. On a CPU there are no graphs: the host-side parts run here, and the
# committed H200 figures show the time they save.

# %%
import json
from pathlib import Path

import numpy as np
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIGURES = Path("../../build/figures").resolve()
FIGURES.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## Decode rows that share a prefix
# A chat server puts one system prompt before every request, so the prefix cache gives many decode
# rows the same leading blocks. Notebook 03's decode kernel can read those blocks once for all of
# them (`prefix_blocks`, `prefix_lens`), if the host finds them: `shared_prefix` looks for the first
# block most rows begin with, then the columns of their block tables where all of them agree. Below
# a few rows or a few hundred tokens, reading the prefix once saves less than its extra launches
# cost, so it gives up.

# %% tags=["export"] module="minivllm.engine.cascade"
import numpy as np

# below these, reading a prefix once saves less than a launch
CASCADE_MIN_ROWS, CASCADE_MIN_TOKENS = (16, 256)


def shared_prefix(
    tables: np.ndarray, context_lens: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """The leading blocks that the most decode rows share (a system prompt in the prefix cache), if
    at least CASCADE_MIN_ROWS rows share CASCADE_MIN_TOKENS tokens: 03's `prefix_blocks` and
    `prefix_lens`, else Nones."""
    if len(tables) < CASCADE_MIN_ROWS:
        return None, None
    firsts, counts = np.unique(tables[:, 0], return_counts=True)
    # blocks before the new token's: full, shareable
    full = (context_lens.astype(np.int64) - 1) // block_size
    # those that begin with the commonest block
    rows = (tables[:, 0] == firsts[counts.argmax()]) & (full > 0)
    if rows.sum() < CASCADE_MIN_ROWS:
        return None, None
    shared = tables[rows, : full[rows].min()]  # (sharers, blocks all of them have filled)
    same = (shared == shared[0]).all(0)  # columns where they all agree
    num_blocks = int(same.argmin()) if not same.all() else len(same)
    if num_blocks * block_size < CASCADE_MIN_TOKENS:
        return None, None
    return shared[0, :num_blocks].copy(), np.where(rows, num_blocks * block_size, 0).astype(
        np.int32
    )


# %% [markdown]
# Twenty rows of 300 tokens; 17 begin with the same 16 blocks (a 260-token system prompt: its last 4
# tokens are in a block of their own, not shared), 3 with blocks of their own.

# %%
from minivllm.engine.cascade import CASCADE_MIN_ROWS, shared_prefix

rng = np.random.default_rng(0)
# 20 rows of 20 distinct blocks
tables = rng.permutation(1000)[:400].reshape(20, 20).astype(np.int32)
tables[:17, :16] = tables[0, :16]  # the system prompt's blocks
prefix_blocks, prefix_lens = shared_prefix(tables, np.full(20, 300, dtype=np.int32), block_size=16)
assert prefix_blocks is not None and prefix_lens is not None
print(f"{len(prefix_blocks)} shared blocks; each row's tokens in them: {prefix_lens.tolist()}")
assert (
    prefix_blocks.tolist() == tables[0, :16].tolist()
    and prefix_lens.tolist() == [256] * 17 + [0] * 3
)
# 14 < CASCADE_MIN_ROWS rows
assert shared_prefix(tables[3:], np.full(17, 300, dtype=np.int32), 16) == (None, None)

# %% [markdown]
# ## The attention context on a GPU
# Notebook 04's `PagedContext` is simple: a prefill over a cached prefix reads every key back out
# of the cache into one tensor, and a mixed step is a prefill whose decode rows have one new token
# each. `FastPagedContext` extends it. A prefill runs the tuned kernel (deep dive prefill_tuning);
# over a cached prefix it reads the blocks inside the kernel (deep dive paged_prefill), over a list
# of (sequence, query tile) pairs, costliest first (`query_tiles`); a mixed step sends its decode
# rows (05 puts them first) to the decode kernel and only the others' tiles to the prefill kernel,
# which would give each one-token query a tile of 64
# rows; and decode rows that share a prefix read it once (`prefix_blocks`, `prefix_lens`).

# %% tags=["export"] module="minivllm.attention.fast_paged"
from dataclasses import dataclass

import numpy as np
import torch

from minivllm import kernels  # kernels.flash_attn_varlen_func: the deep dive paged_prefill's
from minivllm.attention.layer import Attention
from minivllm.attention.paged import PagedContext
from minivllm.kernels.cascade import flash_attn_with_kvcache
from minivllm.kernels.paged_attn import store_kvcache
from minivllm.kernels.prefill_tuned import flash_attn_varlen_tuned


def query_tiles(
    cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, first_seq: int, block_m: int
) -> np.ndarray:  # (num_tiles, 2) int32
    """The paged prefill kernel's work list for sequences first_seq..: (sequence, query tile),
    costliest first."""
    q_lens, k_lens = np.diff(cu_seqlens_q)[first_seq:], np.diff(cu_seqlens_k)[first_seq:]
    counts = -(-q_lens // block_m)  # tiles per sequence
    seqs = np.repeat(np.arange(first_seq, first_seq + len(q_lens)), counts)
    tiles = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)  # in its seq
    q_len = np.repeat(q_lens, counts)
    keys = np.repeat(k_lens, counts) - q_len + np.minimum((tiles + 1) * block_m, q_len)
    order = np.argsort(-keys, kind="stable")  # the tiles whose last row sees the most keys first
    return np.stack([seqs[order], tiles[order]], axis=1).astype(np.int32)


def num_decode_rows(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray) -> int:
    """A prefill step's leading rows that decode: one new token after cached ones."""
    q_lens, k_lens = np.diff(cu_seqlens_q), np.diff(cu_seqlens_k)
    decodes = (q_lens == 1) & (k_lens > 1)
    return len(decodes) if decodes.all() else int(decodes.argmin())


@dataclass(slots=True)
class FastPagedContext(PagedContext):
    """Notebook 04's context with the GPU's kernels: paged prefill, decode rows of a mixed step
    apart, and a shared prefix read once."""

    num_decode_seqs: int = 0  # a mixed step: its first rows decode one token each
    tiles: torch.Tensor | None = None  # a paged prefill's (sequence, query tile) list
    prefix_blocks: torch.Tensor | None = None  # (n,) int32: leading blocks decode rows share
    prefix_lens: torch.Tensor | None = None  # (num decode rows,) int32: a row's tokens in them

    def attend(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if not self.use_triton:  # PyTorch's reference ops: notebook 04's way
            return PagedContext.attend(self, layer, q, k, v)
        store_kvcache(k, v, layer.k_cache, layer.v_cache, self.slot_mapping)
        if not self.is_prefill:
            return self.cascade_decode(layer, q)
        if self.block_tables is None:  # nothing cached: the new k, v (deep dive prefill_tuning)
            cu_q, max_q = self.cu_seqlens_q, self.max_seqlen_q
            assert cu_q is not None  # a prefill step has it
            return flash_attn_varlen_tuned(q, k, v, cu_q, cu_q, max_q, max_q, layer.scale, True)
        out = torch.empty_like(q)
        if self.num_decode_seqs:  # a mixed step's decode rows through the decode kernel
            self.cascade_decode(layer, q[: self.num_decode_seqs], out[: self.num_decode_seqs])
        return self.paged_prefill(layer, q, out)  # the other rows' tiles (none: nothing to do)

    def cascade_decode(self, layer: Attention, q: torch.Tensor, out: torch.Tensor | None = None):
        """The first q.shape[0] rows, one new token each, over their whole caches (a shared
        prefix read once)."""
        lens, tables = self.context_lens, self.block_tables
        assert lens is not None and tables is not None  # a decode row has both
        o = flash_attn_with_kvcache(
            q[:, None],
            layer.k_cache,
            layer.v_cache,
            lens,
            tables[: q.shape[0]],
            layer.scale,
            out=None if out is None else out[:, None],
            prefix_blocks=self.prefix_blocks,
            prefix_lens=self.prefix_lens,
        )
        return o[:, 0]

    def paged_prefill(self, layer: Attention, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """New tokens over their cached ones and each other, read through the block tables."""
        cu_q, cu_k, tables = self.cu_seqlens_q, self.cu_seqlens_k, self.block_tables
        assert cu_q is not None and cu_k is not None and tables is not None
        return kernels.flash_attn_varlen_func(
            q,
            layer.k_cache,
            layer.v_cache,
            cu_q,
            cu_k,
            self.max_seqlen_q,
            self.max_seqlen_k,
            layer.scale,
            causal=True,
            block_table=tables,
            out=out,
            tiles=self.tiles,
        )


# %% [markdown]
# ## CUDA graphs for decode
# A decode step of Qwen3-0.6B launches a few hundred small kernels, each cheaper to run than to
# launch from Python. A CUDA graph records the launches once and replays them in one call, at the
# price of fixed shapes and addresses. So we capture a graph per batch size (1, 2, 4, 8, then every
# 16 up to `max_num_seqs`; the decode kernel's splits depend on it only) over shared static inputs,
# the smaller sharing the largest's memory; a step copies its inputs in, pads the batch to the next
# captured size (padding rows: slot −1, an empty cache, no writes or reads), and replays. Sizes of
# 16 rows and more are captured twice: with the cascade for a prefix the rows share, and without,
# for steps that have none to share.

# %% tags=["export"] module="minivllm.engine.cuda_graphs"
from collections.abc import Callable
from typing import Any

import torch

from minivllm.attention.fast_paged import FastPagedContext
from minivllm.config import Config
from minivllm.engine.cascade import CASCADE_MIN_ROWS

Device = torch.device | str


class StepGraphs:
    """Forward passes captured once per size (tokens in the step), over static inputs that each
    replay fills."""

    def __init__(
        self,
        sizes: list[int],
        max_rows: int,
        max_blocks: int,
        hidden: int,
        dtype: torch.dtype,
        device: Device,
    ):
        self.sizes, n = sizes, sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        # both zeroed by one launch a step
        self.lens = torch.zeros(2, max_rows, dtype=torch.int32, device=device)
        # decode rows' (0: not one), their shared prefix's (03)
        self.context_lens, self.prefix_lens = self.lens
        # a shared prefix (03)
        self.prefix_blocks = torch.zeros(max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (size, cascade): the graph
        self.pool: Any = None  # the graphs' memory, one pool for all
        self.num_replays = 0

    def fill(self, context: FastPagedContext) -> None:
        """Copy the step's attention inputs into the static ones: block tables, and the decode rows'
        cache lengths and shared prefix (the rows past them: an empty cache, no decode output)."""
        assert context.block_tables is not None  # a captured step reads the paged cache
        self.block_tables[: context.block_tables.shape[0], : context.block_tables.shape[1]] = (
            context.block_tables
        )
        self.lens.zero_()
        if context.context_lens is not None:
            self.context_lens[: context.context_lens.shape[0]] = context.context_lens
        if context.prefix_lens is not None and context.prefix_blocks is not None:
            self.prefix_lens[: context.prefix_lens.shape[0]] = context.prefix_lens
            self.prefix_blocks[: context.prefix_blocks.shape[0]] = context.prefix_blocks

    def capture(
        self, model: torch.nn.Module, context_of: Callable[[int], FastPagedContext], cascade: bool
    ) -> None:
        """A graph per size, keyed (size, cascade): with `cascade`, the sizes with room for
        CASCADE_MIN_ROWS decode rows read a shared prefix once (03; rows that share none run it with
        lengths 0, at the price of its launches), and the others are captured without it."""
        for size in reversed(self.sizes):  # the largest first: the others fit in its memory pool
            context = context_of(size)
            # its decode rows (a prefill step's: empty caches)
            assert context.context_lens is not None
            rows = context.context_lens.shape[0]
            key = (size, cascade and rows >= CASCADE_MIN_ROWS)
            if key in self.graphs:
                continue  # too few rows for the cascade: captured without it already
            if key[1]:
                context.prefix_blocks, context.prefix_lens = (
                    self.prefix_blocks,
                    self.prefix_lens[:rows],
                )
            # warm-up: compile
            self.hidden[:size] = model(self.input_ids[:size], self.positions[:size], context)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self.hidden[:size] = model(self.input_ids[:size], self.positions[:size], context)
            self.pool = self.pool or graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize(self.hidden.device)

    def reset(self) -> None:
        """Destroy the graphs now, even if something still holds this object: their memory goes
        back, and an NCCL group whose all-reduces they captured can shut down (it waits for
        them)."""
        for graph in self.graphs.values():
            graph.reset()

    def fits(self, size: int, context: FastPagedContext, num_tokens: int) -> bool:
        """Whether the graph of `size` tokens can run this step."""
        return size >= num_tokens

    def key_for(self, context: FastPagedContext, num_tokens: int) -> tuple[int, bool] | None:
        """The graph that runs this step, (size, cascade), or None: none can. The smallest size that
        fits; there, the cascade graph if the step has a shared prefix, else the other (a size has
        one of them, or both: capture)."""
        size = next((s for s in self.sizes if self.fits(s, context, num_tokens)), None)
        if size is None:
            return None
        order = (True, False) if context.prefix_lens is not None else (False, True)
        return next(((size, cascade) for cascade in order if (size, cascade) in self.graphs), None)

    def replay(
        self,
        key: tuple[int, bool],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: FastPagedContext,
    ) -> torch.Tensor:
        """Run the step in the graph `key_for` chose."""
        n = input_ids.shape[0]
        self.input_ids[:n], self.positions[:n] = input_ids, positions
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:n] = context.slot_mapping
        self.fill(context)
        self.graphs[key].replay()
        self.num_replays += 1
        return self.hidden[:n]  # (num_tokens, hidden_size)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + [
        b for b in range(16, max_num_seqs + 1, 16)
    ]
    return sizes or [max_num_seqs]


class DecodeGraphs(StepGraphs):
    """One captured decode step per batch size."""

    def __init__(self, model: torch.nn.Module, config: Config, dtype: torch.dtype, device: Device):
        sizes, max_blocks = (
            graph_batch_sizes(config.max_num_seqs),
            -(-config.max_model_len // config.block_size),
        )
        super().__init__(sizes, sizes[-1], max_blocks, config.hf_config.hidden_size, dtype, device)
        # a step with a shared prefix, and one without, each as fast as it can be
        for cascade in (False, True):
            self.capture(model, self.context, cascade)

    def context(self, size: int) -> FastPagedContext:
        """The captured decode step of `size` rows: one token each, over the static inputs."""
        context = FastPagedContext(False, self.slot_mapping[:size], self.block_tables[:size])
        context.context_lens = self.context_lens[:size]
        return context


# %% [markdown]
# What decode graphs save: `python -m minivllm.benchmarks.decode_step` times `runner.run(seqs,
# is_prefill=False)` for the 0.6B preset, preparation and sampling included, with and without CUDA
# graphs (on a CPU, an H200 run's).

# %%
import json

from minivllm.benchmarks.decode_step import plot_decode_step, run_decode_step_benchmark

saved = Path("../figures/decode_step.json")  # an H200 run's, on a CPU
step_data = (
    run_decode_step_benchmark(batch_sizes=(1, 8, 64))
    if DEVICE == "cuda"
    else json.loads(saved.read_text())
)
plot_decode_step(step_data).savefig(FIGURES / "cuda_graphs_decode_step.png", dpi=120)
rows = {(r["impl"], r["batch"]): r["ms"] for r in step_data["rows"]}
for batch in sorted({b for _, b in rows}):
    graph, eager = rows["minivllm", batch], rows["minivllm-eager", batch]
    print(
        f"batch {batch:>3}: graph {graph:5.2f} ms, eager {eager:5.2f} ms: the graph "
        f"{eager / graph:4.1f}× faster"
    )
print(f"KV cache on {step_data['device']}: {step_data['kv_cache_tokens'] / 1e6:.2f} M tokens")
assert rows["minivllm", 1] < rows["minivllm-eager", 1]

# %% [markdown]
# Sizes are captured for 1, 2, 4, 8, then every 16 rows: a step of 5 rows pads to 8.

# %%
from minivllm.engine.cuda_graphs import graph_batch_sizes

assert (
    graph_batch_sizes(256)[:5] == [1, 2, 4, 8, 16]
    and next(b for b in graph_batch_sizes(256) if b >= 5) == 8
)

# %% [markdown]
# ### CUDA graphs for prefill and mixed steps
# A prefill or mixed step runs eagerly unless it too is captured, and eagerly its few hundred
# launches cost the host more than the GPU's time (an H200, a chat step of ~255 decode rows and 170
# to 650 prompt tokens: 18 to 28 ms of wall time for 10.4 to 11.2 ms of kernels). Capturing it needs
# every launch fixed: the shapes, and the grids. So we capture a step of `T` tokens for a few `T`
# (16 to 4,096), padding each step to the next, with fixed grids that read what to do:
#
# * the decode kernel runs over `min(T, max_num_seqs)` rows; a row that is not a decode row has an
#   empty cache, and the kernel writes nothing for it (its output row may be a prompt token's);
# * the prefill kernel runs one program per entry of a tile list long enough for `T` tokens, and the
#   list is padded with −1 (notebook 03): the step's tiles say which sequences and query rows there
#   are.
#
# A step with more tiles than the list holds (many short prompts), more tokens, or nothing cached
# runs eagerly.


# %% tags=["export"] module="minivllm.engine.mixed_graphs"
import torch

from minivllm.attention.fast_paged import FastPagedContext
from minivllm.config import Config
from minivllm.engine.cuda_graphs import StepGraphs

MIXED_GRAPH_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def tile_room(num_tokens: int, block_m: int) -> int:
    """Entries in a graph's tile list for steps of num_tokens: every whole tile, and 64 partial
    ones."""
    return num_tokens // block_m + 64


class MixedGraphs(StepGraphs):
    """One captured prefill or mixed step per token count: its decode rows first, then prompt
    tokens."""

    def __init__(
        self,
        model: torch.nn.Module,
        sizes: list[int],
        max_num_seqs: int,
        max_blocks: int,
        block_m: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__(sizes, max_num_seqs, max_blocks, hidden_size, dtype, device)
        self.max_num_seqs, self.block_m = max_num_seqs, block_m

        def int32(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        self.cu_seqlens_q, self.cu_seqlens_k = int32(max_num_seqs + 1), int32(max_num_seqs + 1)
        self.tiles = int32(self.num_tiles(sizes[-1]), 2) - 1
        # steps without a shared prefix too: one capture per size
        self.capture(model, self.context, cascade=True)

    def num_tiles(self, size: int) -> int:
        return tile_room(size, self.block_m)

    def context(self, size: int) -> FastPagedContext:
        rows = min(size, self.max_num_seqs)
        return FastPagedContext(
            True,
            self.slot_mapping[:size],
            self.block_tables,
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            context_lens=self.context_lens[:rows],
            num_decode_seqs=rows,
            tiles=self.tiles[: self.num_tiles(size)],
        )

    def fits(self, size: int, context: FastPagedContext, num_tokens: int) -> bool:
        """Room for the step's tokens and tiles; never without a paged cache (the contiguous
        kernel's) or tiles."""
        if context.block_tables is None or context.tiles is None:
            return False
        return size >= num_tokens and self.num_tiles(size) >= context.tiles.shape[0]

    def fill(self, context: FastPagedContext) -> None:
        super().fill(context)
        assert context.tiles is not None  # key_for has checked
        # a prefill step has both
        assert context.cu_seqlens_q is not None and context.cu_seqlens_k is not None
        self.cu_seqlens_q[: context.cu_seqlens_q.shape[0]] = context.cu_seqlens_q
        self.cu_seqlens_k[: context.cu_seqlens_k.shape[0]] = context.cu_seqlens_k
        self.tiles.fill_(-1)
        self.tiles[: context.tiles.shape[0]] = context.tiles


def capture_mixed_graphs(
    model: torch.nn.Module, config: Config, block_m: int, dtype: torch.dtype, device: torch.device
) -> MixedGraphs | None:
    """The runner's fast path: the graphs of every size up to max_num_batched_tokens (None: no size
    fits)."""
    assert config.max_model_len is not None  # Config resolved it
    sizes = [t for t in MIXED_GRAPH_SIZES if t <= config.max_num_batched_tokens]
    if not sizes:
        return None
    max_blocks = -(-config.max_model_len // config.block_size)
    hidden = config.hf_config.hidden_size
    return MixedGraphs(
        model, sizes, config.max_num_seqs, max_blocks, block_m, hidden, dtype, device
    )


# %% [markdown]
# The tile list of a mixed step: two decode rows, then a chunk of 128 prompt tokens after 1,000
# cached ones and a new prompt of 40. Tiles of 64 query rows; the decode rows have none.

# %%
from minivllm.attention.fast_paged import query_tiles

cu_q, cu_k = (
    np.array([0, 1, 2, 130, 170]),
    np.array([0, 300, 341, 1469, 1509]),
)  # new tokens; cached + new
mixed_tiles = query_tiles(cu_q, cu_k, first_seq=2, block_m=64)
print("(sequence, query tile), the tiles that see the most keys first:", mixed_tiles.tolist())
assert mixed_tiles.tolist() == [[2, 1], [2, 0], [3, 0]]  # 1,128 keys, 1,064, then 40


# %% [markdown]
# What the mixed-step graphs save, per kind of step, on an
# H200 (`python -m minivllm.benchmarks.step_kinds`; on a CPU, the committed run): each workload with
# and without these graphs, the seconds spent in prefill, mixed and decode steps.

# %%
from minivllm.benchmarks.step_kinds import describe_kinds, plot_step_kinds

kinds_data = json.loads(Path("../figures/step_kinds_chat.json").read_text())  # an H200 run's
plot_step_kinds(kinds_data).savefig(FIGURES / "cuda_graphs_step_kinds.png", dpi=120)
for row in kinds_data["rows"]:
    print(describe_kinds(row))

# %% [markdown]
# ## Warm-up: nothing compiles or captures while serving
# A server's first requests should not wait for work that start-up can do. Graphs are captured at
# start-up, and capturing a size runs every model kernel at that size; Triton compiles a kernel for
# each new specialization (deep dive gpu_sampler). What no graph holds is left: steps larger than
# the largest graph run eagerly (so do all steps with `enforce_eager`), a mixed step's decode rows
# come in any number and the decode kernel's splits follow that number (with them the combining
# kernel's constants), and the sampler has its variants. `warm_up_runner` runs each once, before the
# graphs are captured: a prefix hit's step, eager decode steps of padding rows (slot −1: nothing is
# written), the decode kernels at every batch size with and without a shared prefix, the tuned
# prefill kernel over whole prompts (no step compiles it: notebook 02's context profiles the
# memory with 01's kernel), the sampler's variants on the logits. `tests/test_warm_up.py` runs a
# varied workload after `LLM()` in a fresh process (every sampling path, prefix hits, steps past
# the largest graph) and counts Triton's compiles and CUDA graph captures with hooks: none on an
# H200 (`../figures/warm_up_h200.txt`). What it costs is the "compile" phase of `python -m
# minivllm`'s start-up split.

# %% tags=["export"] module="minivllm.engine.warm_up"
import numpy as np
import torch

from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.sampler_warm_up import warm_up_sampler
from minivllm.engine.step_inputs import StepInputs
from minivllm.kernels.cascade import flash_attn_with_kvcache
from minivllm.kernels.prefill_tuned import flash_attn_varlen_tuned


def prefix_hit_step(block_size: int) -> StepInputs:
    """2 new tokens after block_size - 2 cached ones in block 0: a prefix hit's shape."""
    positions = np.arange(block_size - 2, block_size)
    step = StepInputs(
        True, np.zeros(2, np.int64), positions, positions.copy(), np.zeros((1, 1), np.int32)
    )
    step.cu_seqlens_q, step.cu_seqlens_k = (
        np.array([0, 2], np.int32),
        np.array([0, block_size], np.int32),
    )
    return step


def padding_decode_step(rows: int) -> StepInputs:
    """A decode step of padding rows: slot -1 (nothing written), each reading one cached token of
    block 0."""
    zeros = np.zeros(rows, np.int64)
    block_tables, context_lens = np.zeros((rows, 1), np.int32), np.ones(rows, np.int32)
    return StepInputs(
        False,
        zeros,
        zeros.copy(),
        np.full(rows, -1, np.int64),
        block_tables,
        context_lens=context_lens,
    )


def warm_up_decode_attention(runner: ModelRunner) -> None:
    """The decode kernels at every batch size up to max_num_seqs, with and without a shared prefix
    (03)."""
    layer, device = runner.attention_layers[0], runner.device
    kv = layer.k_cache, layer.v_cache
    for rows in range(1, runner.config.max_num_seqs + 1):
        q = torch.zeros(rows, 1, layer.num_heads, layer.head_dim, dtype=runner.dtype, device=device)
        lens = torch.ones(rows, dtype=torch.int32, device=device)
        tables = torch.zeros(rows, 1, dtype=torch.int32, device=device)
        for prefix_blocks, prefix_lens in ((None, None), (tables[0], lens)):
            flash_attn_with_kvcache(
                q, *kv, lens, tables, prefix_blocks=prefix_blocks, prefix_lens=prefix_lens
            )


def warm_up_prefill_attention(runner: ModelRunner) -> None:
    """The tuned prefill kernel (deep dive prefill_tuning) over a whole prompt of one query tile,
    and of several."""
    layer, device, dtype = runner.attention_layers[0], runner.device, runner.dtype
    for n in (2, 200):
        q = torch.zeros(n, layer.num_heads, layer.head_dim, dtype=dtype, device=device)
        kv = torch.zeros(n, layer.num_kv_heads, layer.head_dim, dtype=dtype, device=device)
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        flash_attn_varlen_tuned(q, kv, kv, cu, cu, n, n, layer.scale, True)


@torch.inference_mode()
def warm_up_runner(runner: ModelRunner) -> None:
    """The runner's start-up on a GPU, before its graphs: every Triton kernel variant a step can
    launch, compiled."""
    # (1, vocab): the paged prefill, the small layers
    logits = runner.execute(prefix_hit_step(runner.block_size))
    # eager decode steps: one token's kernels (gemv), a batch's
    for rows in (1, runner.config.max_num_seqs):
        runner.execute(padding_decode_step(rows))
    warm_up_decode_attention(runner)
    warm_up_prefill_attention(runner)
    warm_up_sampler(runner.sampler, logits.expand(runner.config.max_num_seqs, -1).contiguous())


# %% [markdown]
# A padding decode step of three rows, as the runner receives it (the GPU runner below warms up
# with such steps).

# %%
from minivllm.engine.warm_up import padding_decode_step

padding = padding_decode_step(3)
print("slots", padding.slot_mapping.tolist(), "context lengths", padding.context_lens.tolist())

# %% [markdown]
# ## The GPU runner: every fast path, from outside
# Two subclasses of notebook 04's runner (through deep dive sampling_options' `OptionsRunner`, so
# every sampling option stays), one method changed per fast path. `FastAttentionRunner`:
# `device_inputs` builds a `FastPagedContext` (a paged step's tiles, its decode rows, the prefix
# they share). `GPUModelRunner`, on top: `load` swaps the small layers' Triton kernels into the
# model (deep dive triton_layers), `make_sampler` gives the GPU sampler (deep dive gpu_sampler),
# `start` warms up and captures the graphs after the cache is sized, and `forward` replays a graph
# when one fits the step. Nothing in notebook 04 names any of them;
# `minivllm.LLM` (deep dive fast_engine) picks `GPUModelRunner` on a GPU.

# %% tags=["export"] module="minivllm.engine.gpu_runner"
import atexit
import time
from dataclasses import fields
from typing import Any

import numpy as np
import torch

from minivllm.attention.fast_paged import FastPagedContext, num_decode_rows, query_tiles
from minivllm.attention.paged import PagedContext
from minivllm.engine.cascade import shared_prefix
from minivllm.engine.cuda_graphs import DecodeGraphs
from minivllm.engine.mixed_graphs import MixedGraphs, capture_mixed_graphs
from minivllm.engine.sampling_options import OptionsRunner
from minivllm.engine.step_inputs import StepInputs, to_device
from minivllm.engine.warm_up import warm_up_runner
from minivllm.kernels.flash_attn import launch_config
from minivllm.layers.gpu_sampler import GPUSampler
from minivllm.layers.sampler import Sampler
from minivllm.layers.small_layer_kernels import use_small_layer_kernels
from minivllm.models.qwen3 import Qwen3ForCausalLM


class FastAttentionRunner(OptionsRunner):
    """Notebook 04's runner (sampling options included) with `FastPagedContext`: paged prefill, a
    mixed step's decode rows apart, a shared prefix read once (on a CPU too, in Triton's
    interpreter, as tests run it)."""

    block_m = 64  # the prefill kernel's query tile, launch_config's

    def start(self) -> None:
        super().start()
        self.block_m = launch_config(self.attention_layers[0].head_dim, self.device)["BLOCK_M"]

    def put(self, a: np.ndarray) -> torch.Tensor:
        return to_device(a, self.device)  # notebook 04's

    def device_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, Any]:
        input_ids, positions, plain = super().device_inputs(step)
        context = FastPagedContext(*(getattr(plain, f.name) for f in fields(PagedContext)))
        if step.block_tables is not None and self.use_triton:
            self.add_paged_inputs(step, context)
        return input_ids, positions, context

    def add_paged_inputs(self, step: StepInputs, context: FastPagedContext) -> None:
        """A paged step's decode rows, the other rows' tiles, and the prefix the decode rows
        share."""
        assert step.block_tables is not None
        lens = step.context_lens
        if step.is_prefill:
            cu_q, cu_k = step.cu_seqlens_q, step.cu_seqlens_k
            assert cu_q is not None and cu_k is not None  # a prefill step has both
            n = context.num_decode_seqs = num_decode_rows(cu_q, cu_k)
            context.tiles = self.put(query_tiles(cu_q, cu_k, n, self.block_m))
            lens = np.diff(cu_k)[:n].astype(np.int32)
            context.context_lens = self.put(lens) if n else None
        assert lens is not None
        tables = step.block_tables[: len(lens)]
        prefix_blocks, prefix_lens = shared_prefix(tables, lens, self.block_size)
        if prefix_blocks is not None and prefix_lens is not None:
            context.prefix_blocks, context.prefix_lens = (
                self.put(prefix_blocks),
                self.put(prefix_lens),
            )


class GPUModelRunner(FastAttentionRunner):
    """The runner on a GPU: Triton small layers, the GPU sampler, warm-up and CUDA graphs, over the
    fast attention context."""

    graphs: DecodeGraphs | None = None  # decode steps' graphs
    mixed_graphs: MixedGraphs | None = None  # prefill and mixed steps' graphs

    def load(self) -> Qwen3ForCausalLM:
        model = super().load()
        use_small_layer_kernels(model)
        return model

    def make_sampler(self) -> Sampler:
        return GPUSampler()

    def start(self) -> None:
        super().start()  # the model, the sampler, the KV cache
        start = time.perf_counter()
        warm_up_runner(self)  # every Triton kernel variant a step can launch, compiled now
        compiled = time.perf_counter()
        config, model = self.config, self.model
        assert model is not None  # loaded by start()
        if not config.enforce_eager:
            self.graphs = DecodeGraphs(model, config, self.dtype, self.device)
            self.mixed_graphs = capture_mixed_graphs(
                model, config, self.block_m, self.dtype, self.device
            )
        captured = time.perf_counter()
        self.startup_seconds |= {"compile": compiled - start, "CUDA graphs": captured - compiled}
        if self.rank == 0:
            atexit.register(self.close)

    def close(self) -> None:
        super().close()
        atexit.unregister(self.close)

    def free_gpu_memory(self) -> None:
        for graphs in filter(None, (self.graphs, self.mixed_graphs)):
            graphs.reset()
        self.graphs = self.mixed_graphs = None
        super().free_gpu_memory()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Any):
        graphs = self.mixed_graphs if context.is_prefill else self.graphs
        key = None if graphs is None else graphs.key_for(context, input_ids.shape[0])
        if graphs is not None and key is not None:
            return graphs.replay(key, input_ids, positions, context)
        return super().forward(input_ids, positions, context)


# %% [markdown]
# ## Check yourself
# 1. A mixed step has 3 decode rows and a prompt chunk of 100 tokens (tiles of 64 query rows). Which
#    captured `T` replays it, how many programs per group of query heads (deep dive prefill_tuning's
#    `heads_per_program`) does its prefill kernel run, and how many of them have a tile to compute?
#    Answer `(T, programs, real)`.

# %%
from minivllm.engine.mixed_graphs import MIXED_GRAPH_SIZES, tile_room
from minivllm.testing import check_answer

answer1 = None  # your answer: replace None with an expression
mixed_size = next(t for t in MIXED_GRAPH_SIZES if t >= 3 + 100)
chunk_cu_q = np.array([0, 1, 2, 3, 103])  # three decodes, then a 100-token chunk
chunk_cu_k = np.array([0, 9, 18, 27, 147])
chunk_tiles = query_tiles(chunk_cu_q, chunk_cu_k, 3, block_m=64)
expected1 = (mixed_size, tile_room(mixed_size, 64), len(chunk_tiles))
check_answer(answer1, expected1, "1. a mixed step's graph")

# %% [markdown]
# Worked answer. The 103 tokens pad to `T` = 128, whose tile list has room for 128 // 64 + 64 = 66
# tiles; the chunk has ⌈100 / 64⌉ = 2, so 64 of the 66 programs per group of heads read −1 and
# return: the price of a grid fixed at capture.

# %%
check_answer((128, 128 // 64 + 64, -(-100 // 64)), expected1, "1. a mixed step's graph")
