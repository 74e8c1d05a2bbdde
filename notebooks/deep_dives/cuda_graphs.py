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
# # Deep dive · CUDA graphs for prefill and mixed steps
#
# **What it adds.** Notebook 04 captures decode steps in CUDA graphs; prefill and mixed steps (notebook 05's, decode
# rows and prompt chunks together) run eagerly. Here they are captured too, each step padded to one of a few token
# counts, with the attention kernels' grids fixed and their work read from a tile list. The runner composes them by
# name (`fast_path("mixed-step CUDA graphs")`), on a GPU only.
#
# **It follows notebook 04**; nothing later in the core path needs it: without it, those steps run eagerly, to the
# same tokens. On a CPU there are no graphs: the host-side parts run here, and the committed H200 figures show the
# time they save.

# %%
import json
from pathlib import Path

import numpy as np
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# %% [markdown]
# ### CUDA graphs for prefill and mixed steps
# A prefill or mixed step runs eagerly unless it too is captured, and eagerly its few hundred launches cost the
# host more than the GPU's time (an H200, a chat step of ~255 decode rows and 170 to 650 prompt tokens: 18 to 28 ms
# of wall time for 10.4 to 11.2 ms of kernels). Capturing it needs every launch fixed: the shapes, and the grids.
# So we capture a step of `T` tokens for a few `T` (16 to 4,096), padding each step to the next, with fixed grids
# that read what to do:
#
# * the decode kernel runs over `min(T, max_num_seqs)` rows; a row that is not a decode row has an empty cache,
#   and the kernel writes nothing for it (its output row may be a prompt token's);
# * the prefill kernel runs one program per entry of a tile list long enough for `T` tokens, and the list is
#   padded with −1 (notebook 03): the step's tiles say which sequences and query rows there are.
#
# A step with more tiles than the list holds (many short prompts), more tokens, or nothing cached runs eagerly.


# %% tags=["export"] module="minivllm.engine.mixed_graphs"
import torch

from minivllm.attention.paged import PagedContext
from minivllm.config import Config
from minivllm.engine.cuda_graphs import StepGraphs

MIXED_GRAPH_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def tile_room(num_tokens: int, block_m: int) -> int:
    """Entries in a graph's tile list for steps of num_tokens: every whole tile, and 64 partial ones."""
    return num_tokens // block_m + 64


class MixedGraphs(StepGraphs):
    """One captured prefill or mixed step per token count: its decode rows first, then prompt tokens."""

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
        self.capture(model, self.context, cascade=True)  # steps without a shared prefix too: one capture per size

    def num_tiles(self, size: int) -> int:
        return tile_room(size, self.block_m)

    def context(self, size: int) -> PagedContext:
        rows = min(size, self.max_num_seqs)
        return PagedContext(
            True,
            self.slot_mapping[:size],
            self.block_tables,
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            context_lens=self.context_lens[:rows],
            num_decode_seqs=rows,
            tiles=self.tiles[: self.num_tiles(size)],
        )

    def fits(self, size: int, context: PagedContext, num_tokens: int) -> bool:
        """Room for the step's tokens and tiles; never without a paged cache (the contiguous kernel's) or tiles."""
        if context.block_tables is None or context.tiles is None:
            return False
        return size >= num_tokens and self.num_tiles(size) >= context.tiles.shape[0]

    def fill(self, context: PagedContext) -> None:
        super().fill(context)
        assert context.tiles is not None  # key_for has checked
        assert context.cu_seqlens_q is not None and context.cu_seqlens_k is not None  # a prefill step has both
        self.cu_seqlens_q[: context.cu_seqlens_q.shape[0]] = context.cu_seqlens_q
        self.cu_seqlens_k[: context.cu_seqlens_k.shape[0]] = context.cu_seqlens_k
        self.tiles.fill_(-1)
        self.tiles[: context.tiles.shape[0]] = context.tiles


def capture_mixed_graphs(
    model: torch.nn.Module, config: Config, block_m: int, dtype: torch.dtype, device: torch.device
) -> MixedGraphs | None:
    """The runner's fast path: the graphs of every size up to max_num_batched_tokens (None: no size fits)."""
    assert config.max_model_len is not None  # Config resolved it
    sizes = [t for t in MIXED_GRAPH_SIZES if t <= config.max_num_batched_tokens]
    if not sizes:
        return None
    max_blocks = -(-config.max_model_len // config.block_size)
    hidden = config.hf_config.hidden_size
    return MixedGraphs(model, sizes, config.max_num_seqs, max_blocks, block_m, hidden, dtype, device)


# %% [markdown]
# The tile list of a mixed step: two decode rows, then a chunk of 128 prompt tokens after 1,000 cached ones and a
# new prompt of 40. Tiles of 64 query rows; the decode rows have none.

# %%
from minivllm.engine.step_inputs import query_tiles

cu_q, cu_k = np.array([0, 1, 2, 130, 170]), np.array([0, 300, 341, 1469, 1509])  # new tokens; cached + new
mixed_tiles = query_tiles(cu_q, cu_k, first_seq=2, block_m=64)
print("(sequence, query tile), the tiles that see the most keys first:", mixed_tiles.tolist())
assert mixed_tiles.tolist() == [[2, 1], [2, 0], [3, 0]]  # 1,128 keys, 1,064, then 40


# %% [markdown]
# The runner finds the capture by name. What it saves, per kind of step, on an H200
# (`python -m minivllm.benchmarks.step_kinds`; on a CPU, the committed run): each workload with and without these
# graphs, the seconds spent in prefill, mixed and decode steps.

# %%
from minivllm.benchmarks.step_kinds import describe_kinds, plot_step_kinds
from minivllm.engine.fast_paths import fast_path
from minivllm.engine.mixed_graphs import capture_mixed_graphs

assert fast_path("mixed-step CUDA graphs") is capture_mixed_graphs
kinds_data = json.loads(Path("../figures/step_kinds_chat.json").read_text())  # an H200 run's
FIGURES = Path("../../build/figures").resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
plot_step_kinds(kinds_data).savefig(FIGURES / "cuda_graphs_step_kinds.png", dpi=120)
for row in kinds_data["rows"]:
    print(describe_kinds(row))

# %% [markdown]
# ## Check yourself
# 1. A mixed step has 3 decode rows and a prompt chunk of 100 tokens (tiles of 64 query rows). Which captured
#    `T` replays it, how many programs per group of query heads (notebook 01's `heads_per_program`) does its
#    prefill kernel run, and how many of them have a tile to compute? Answer `(T, programs, real)`.

# %%
from minivllm.engine.mixed_graphs import MIXED_GRAPH_SIZES, tile_room
from minivllm.testing import check_answer

answer1 = None  # your answer: replace None with an expression
mixed_size = next(t for t in MIXED_GRAPH_SIZES if t >= 3 + 100)
chunk_tiles = query_tiles(np.array([0, 1, 2, 3, 103]), np.array([0, 9, 18, 27, 147]), 3, block_m=64)
expected1 = (mixed_size, tile_room(mixed_size, 64), len(chunk_tiles))
check_answer(answer1, expected1, "1. a mixed step's graph")

# %% [markdown]
# Worked answer. The 103 tokens pad to `T` = 128, whose tile list has room for 128 // 64 + 64 = 66 tiles; the chunk
# has ⌈100 / 64⌉ = 2, so 64 of the 66 programs per group of heads read −1 and return: the price of a grid fixed at
# capture.

# %%
check_answer((128, 128 // 64 + 64, -(-100 // 64)), expected1, "1. a mixed step's graph")
