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
# # Deep dive · Settings: the engine's `Config` and a request's `SamplingParams`, value by value
#
# **What this adds.** Notebook 02 writes both dataclasses with vLLM's names and defaults and checks
# every value before anything is built. Here they run: what `Config` resolves, the message each bad
# value gets, why a tiny temperature is stored as 0, and how NumPy and PyTorch numbers become plain
# Python ones.
#
# **Where it sits.** It follows notebook 02 and uses only what it exports. The core path needs none
# of it: the checks run in notebook 02's classes whether or not anyone reads them here.

# %%
import os
from pathlib import Path

import numpy as np
import torch
from transformers.utils.logging import disable_progress_bar

from minivllm.checkpoint import write_checkpoint
from minivllm.config import Config
from minivllm.sampling_params import SamplingParams

disable_progress_bar()  # transformers' saving draws no progress bars in the outputs
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../../build/checkpoints")).resolve()
tiny_path = write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0)


def refusal(make, **kwargs) -> str:
    """The ValueError's message for make(**kwargs); AssertionError if it is accepted."""
    try:
        make(**kwargs)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{make.__name__} accepted {kwargs}")


# %% [markdown]
# ## What `Config` resolves
# Every `None` is replaced once, here: `max_model_len` by the model's `max_position_embeddings`,
# `device` by what the machine has, `tokenizer` by the model's folder (a Hub id becomes the folder
# of its snapshot). The runner, the scheduler and the engine read the resolved values only.

# %%
config = Config(tiny_path)
print(config)
assert config.max_model_len == config.hf_config.max_position_embeddings
assert config.tokenizer == config.model and config.device in ("cpu", "cuda")

# %% [markdown]
# ## Every bad value, named
# Each check says the field, what is allowed and what it got, before anything is built: a
# `block_size` of 24 would fail much later, deep in a kernel, as a wrong answer or none.

# %%
bad_configs = [
    dict(block_size=24),
    dict(max_num_seqs=0),
    dict(max_model_len=10**6),
    dict(gpu_memory_utilization=1.5),
    dict(scheduling_policy="fcfs"),
]
for bad in bad_configs:
    message = refusal(Config, model=tiny_path, **bad)
    assert message.startswith(next(iter(bad))), message
    print(message)

# %% [markdown]
# `SamplingParams` does the same for a request. A bad value must be refused here: in the sampler a
# NaN temperature makes garbage tokens and no error, and a `top_p` of 1e-300 is 0 in float32, the
# sampler's precision, where it would keep no token at all.

# %%
bad_params = [
    dict(max_tokens=2.0),
    dict(max_tokens=True),  # a bool is an int to Python, not to us
    dict(temperature=float("nan")),
    dict(top_p=1e-300),
    dict(top_k=0),
    dict(min_tokens=20),  # more than max_tokens
    dict(stop=[""]),
]
for bad in bad_params:
    message = refusal(SamplingParams, **bad)
    assert message.startswith(next(iter(bad))), message
    print(message)

# %% [markdown]
# ## A tiny temperature is greedy
# Sampling divides the logits by the temperature. Below 1e-5 (vLLM's `_SAMPLING_EPS`) that
# overflows float32, and the softmax of infinities is NaN; so such a temperature is stored as 0,
# which the sampler treats as greedy:

# %%
logits = torch.tensor([10.0, 9.0])
print(logits / 1e-45, torch.softmax(logits / 1e-45, -1), SamplingParams(temperature=1e-6))
assert torch.softmax(logits / 1e-45, -1).isnan().all()
assert SamplingParams(temperature=1e-6).temperature == 0.0

# %% [markdown]
# ## NumPy and PyTorch numbers
# A value read from an array is a NumPy or PyTorch scalar, not a Python number. Each is stored as
# the plain `int`, `float` or `list` it holds, so nothing later meets a 0-d tensor:

# %%
params = SamplingParams(
    temperature=np.float32(0.5),
    max_tokens=torch.tensor(8),
    seed=np.int64(3),
    stop_token_ids=np.array([1, 2]),
)
stored = [params.temperature, params.max_tokens, params.seed, params.stop_token_ids]
print([type(v).__name__ for v in stored], stored)
assert [type(v) for v in stored] == [float, int, int, list]

# %% [markdown]
# ## Check yourself
# How many of these temperatures does `SamplingParams` store as 0 (greedy)?

# %%
from minivllm.testing import check_answer

temperatures = [0.7, 1e-4, 1e-5, 9e-6, 1e-7, 0]
answer = None  # your answer: replace None with an expression
greedy = sum(SamplingParams(temperature=t).temperature == 0 for t in temperatures)
check_answer(answer, greedy, "temperatures stored as 0")

# %% [markdown]
# Worked answer: those below 1e-5, and 0 itself: 9e-6, 1e-7 and 0. 1e-5 is kept as it is.

# %%
check_answer(3, greedy, "temperatures stored as 0")
