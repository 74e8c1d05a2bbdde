"""pytest set-up for tests/, notebooks/ and solutions/ (nbval)."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton decides interpreter-or-GPU when @triton.jit runs: set it before any kernel module is imported.
    # Notebook kernels started by nbval inherit this environment.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# nbval waits 60 s for a notebook's kernel to start and 5 s for each output message after a cell's reply: ceilings a
# busy machine can miss. These are hang checks, not measurements: give them a margin.
NBVAL_KERNEL_STARTUP_S = 300
NBVAL_OUTPUT_S = 120


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "nbval_kernel_startup_timeout"):
        config.option.nbval_kernel_startup_timeout = max(
            int(config.option.nbval_kernel_startup_timeout), NBVAL_KERNEL_STARTUP_S
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if hasattr(item, "output_timeout"):  # an nbval cell
            item.output_timeout = NBVAL_OUTPUT_S
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset's checkpoint (random weights, seed 0), written once per session. Tests that change a
    checkpoint change a copy."""
    from minivllm.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-text preset: tiny's shapes, trained on the corpus, so that its text reads as text
    (the tests' one full training: half a minute, once per session)."""
    from minivllm.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-text", "tiny-text", seed=0)


@pytest.fixture(scope="session")
def hub_cache(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hub cache laid out on disk, as a download leaves it, holding the tiny checkpoint as the id `minivllm/tiny`:
    point HF_HUB_CACHE (or download_dir) at it, with HF_HUB_OFFLINE=1. No network is needed or used."""
    from minivllm.testing import lay_out_hub_cache

    cache = tmp_path_factory.mktemp("hub")
    lay_out_hub_cache(tiny, cache, "minivllm/tiny")
    return cache


@pytest.fixture(scope="session")
def serve_config() -> dict:
    """The engine settings the server tests run the tiny checkpoint with (offline comparisons use the same)."""
    return dict(
        dtype=torch.float32,
        device="cpu",
        num_kvcache_blocks=256,
        max_model_len=512,
        max_num_seqs=32,
    )


@pytest.fixture(scope="module")
def server(tiny: Path, serve_config: dict):
    """The OpenAI server over the tiny checkpoint on a free port of 127.0.0.1; yields (base_url, its AsyncLLM)."""
    from minivllm.async_llm import AsyncLLM
    from minivllm.serve.testing import serve_in_thread

    llm = AsyncLLM(str(tiny), **serve_config)
    with serve_in_thread(llm, "tiny") as url:
        yield url, llm
    llm.close()


@pytest.fixture(scope="session")
def hf_model(tiny: Path):
    """The oracle: transformers' model of the tiny checkpoint, in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_logprobs(hf_model):
    """transformers' log-probabilities of the next token after each position of token_ids: (len, vocab)."""

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].float(), dim=-1)

    return logprobs


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """transformers' greedy continuation of a prompt on the tiny checkpoint, `max_tokens` token ids."""

    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        out = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        return out[0, len(prompt) :].tolist()

    return greedy
