"""What tests and notebooks share, never the engine's hot path: the teacher-forced logits of one
prompt (the oracle every KV-cache path is compared with), a builder of random paged KV caches,
edited copies of a checkpoint folder and a Hub cache laid out on disk (no network needed)."""

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from minivllm.attention.prefill import PrefillContext
from minivllm.kernels.paged_attn import store_kvcache
from minivllm.models.qwen3 import Qwen3ForCausalLM


class WatchedDict(dict):
    """A dict that appends to `walks` each walk over it (iteration, values(), items()) while
    `watching()` holds: a test that a path looks its entries up by key, never scanning all of
    them."""

    def __init__(
        self, entries: dict, walks: list[str], watching: Callable[[], bool] = lambda: True
    ):
        super().__init__(entries)
        self.walks, self.watching = walks, watching

    def walk(self, how: str) -> None:
        if self.watching():
            self.walks.append(how)

    def __iter__(self):
        self.walk("iter")
        return super().__iter__()

    def values(self):
        self.walk("values")
        return super().values()

    def items(self):
        self.walk("items")
        return super().items()


def check_prompt(model: Qwen3ForCausalLM, token_ids: list[int]) -> None:
    vocab_size, max_len = model.config.vocab_size, model.config.max_position_embeddings
    if not token_ids:
        raise ValueError("token_ids is empty: a prompt needs at least one token")
    if len(token_ids) > max_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens; max_position_embeddings is {max_len}"
        )
    if bad := [t for t in token_ids if not 0 <= t < vocab_size]:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


@torch.inference_mode()
def prompt_logits(model: Qwen3ForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Run one prompt through the model, no KV cache: the logits at every position, (len,
    vocab_size)."""
    check_prompt(model, token_ids)
    device = model.lm_head.weight.device
    input_ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(len(token_ids), device=device)
    context = PrefillContext.from_lens([len(token_ids)], device)
    return model.compute_logits(model(input_ids, positions, context))


def edited_copy(
    source: Path,
    path: Path,
    config_edit: Callable[[dict], object] | None = None,
    tensors_edit: Callable[[dict[str, torch.Tensor]], object] | None = None,
) -> Path:
    """A copy of the checkpoint folder `source` at `path`; `config_edit` changes config.json's dict
    in place, `tensors_edit` model.safetensors' tensors (a broken or an older checkpoint, for a
    test)."""
    shutil.copytree(source, path)
    if config_edit:
        config = json.loads((path / "config.json").read_text())
        config_edit(config)
        (path / "config.json").write_text(json.dumps(config))
    if tensors_edit:
        tensors = load_file(path / "model.safetensors")
        tensors_edit(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def lay_out_hub_cache(
    source: Path, cache: Path, repo_id: str, commit: str = "0" * 40, ref: str = "main"
) -> Path:
    """Put the folder `source` in the Hub cache `cache` as `repo_id` at `commit`, as
    `snapshot_download` leaves a download (`models--ORG--NAME/refs/REF` names the commit,
    `snapshots/COMMIT/` holds the files); its snapshot."""
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def scatter_into_cache(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """Random K/V per sequence, written to shuffled blocks of a paged cache; also returned
    contiguous: k_cache, v_cache, block_table, k, v (total_tokens, num_kv_heads, head_dim),
    cu_seqlens_k."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.zeros(
        num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    ks, vs = [], []
    for i, n in enumerate(seq_lens):
        blocks = [free.pop() for _ in range(blocks_per_seq[i])]
        block_table[i, : len(blocks)] = torch.tensor(blocks)
        k, v = (
            torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype)
            for _ in range(2)
        )
        slots = torch.tensor(
            [blocks[t // block_size] * block_size + t % block_size for t in range(n)], device=device
        )
        store_kvcache(k, v, k_cache, v_cache, slots)
        ks.append(k)
        vs.append(v)
    cu_k = torch.tensor(
        [0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    return k_cache, v_cache, block_table, torch.cat(ks), torch.cat(vs), cu_k


@contextmanager
def exercise(part: str) -> Iterator[None]:
    """Wrap an exercise's check cell: a part still left as `raise NotImplementedError` fails the
    check with what to write, instead of a stub's traceback. Everything else (a wrong answer's
    AssertionError) passes through."""
    try:
        yield
    except NotImplementedError:
        raise AssertionError(
            f"{part} is not written yet: replace `raise NotImplementedError` in its cell"
        ) from None


def check_answer(answer: object, expected: object, question: str) -> None:
    """A "check yourself" cell: compare the learner's `answer` with the value computed from the
    objects. None means not answered yet (the cell says so and the notebook goes on: the worked
    answer is one cell below)."""
    if answer is None:
        print(f"{question}: not answered yet (set `answer` above; the worked answer is below)")
        return
    assert answer == expected, (
        f"{question}: your answer is {answer!r}, the objects say {expected!r}"
    )
    print(f"{question}: {answer!r}, right")
