"""Train a preset's random weights on the text that ships with the package, so that greedy output
reads as text.

250 AdamW steps on random 32-token windows of minivllm/data/tokenizer_corpus.txt (~4k tokens, seen
~60 times): the tiny model learns the corpus nearly by heart, and a prompt from it continues the way
the corpus does. `write_checkpoint(out, "tiny-text")` calls `train`. Deterministic: the windows come
from a seeded generator and training runs on one CPU thread, so the same seed writes the same bytes
(on the same kind of CPU).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources

import torch

# the terminal bar: tqdm.auto would draw a widget in notebooks, disable=None or not
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase, Qwen3ForCausalLM

STEPS = 250
BATCH_SIZE = 32
CONTEXT = 32  # tokens per window; short windows mean many short contexts, like a prompt's
LR = 4e-3
WARMUP_STEPS = 20


def corpus_ids(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """The corpus the tokenizer was trained on, as token ids."""
    text = (
        resources.files("minivllm")
        .joinpath("data/tokenizer_corpus.txt")
        .read_text(encoding="utf-8")
    )
    return torch.tensor(tokenizer.encode(text))  # (num_tokens,)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run on one CPU thread: no thread-count-dependent reductions, and no contention on a small
    machine."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def windows(token_ids: torch.Tensor, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """`steps` batches of random windows of the corpus, from a generator of their own (the global
    RNG is left alone)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(token_ids) - CONTEXT + 1, (BATCH_SIZE,), generator=generator)
        # (BATCH_SIZE, CONTEXT)
        yield torch.stack([token_ids[start : start + CONTEXT] for start in starts.tolist()])


def learning_rate(step: int, steps: int) -> float:
    """A linear warm-up, a plateau, then a linear decay to 0 over the last fifth of the steps."""
    return LR * min(1.0, (step + 1) / WARMUP_STEPS, 5 * (1 - step / steps))


def train(
    model: Qwen3ForCausalLM, token_ids: torch.Tensor, seed: int = 0, steps: int = STEPS
) -> list[float]:
    """Train `model` in place on windows of `token_ids` (next-token loss); returns the loss of every
    step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    model.train()
    with one_thread():
        # about half a minute: a bar in a terminal (disable=None: none in a notebook's or a log's
        # output)
        batches = tqdm(
            windows(token_ids, steps, seed),
            total=steps,
            desc="training on the corpus",
            disable=None,
        )
        for step, batch in enumerate(batches):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, steps)
            # transformers shifts the labels by one
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            batches.set_postfix(loss=f"{losses[-1]:.2f}", refresh=False)
    model.eval()
    return losses


@torch.no_grad()
def corpus_loss(model: Qwen3ForCausalLM, token_ids: torch.Tensor) -> float:
    """Mean next-token loss over the corpus, cut into windows of CONTEXT tokens."""
    num_windows = len(token_ids) // CONTEXT
    batch = token_ids[: num_windows * CONTEXT].view(num_windows, CONTEXT)
    return model(input_ids=batch, labels=batch).loss.item()
