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
# # Exercise 01 · `GeluAndMul`, the gated activation of Gemma
#
# Notebook 01 built `SiluAndMul` for Qwen3 and Llama: one projection produces `[gate | up]`, and the
# activation returns `silu(gate) * up`. Gemma's MLP is the same shape with a different non-linearity:
# `gelu(gate) * up`, with GELU's tanh approximation (transformers calls it `gelu_pytorch_tanh`).
#
# **Your task.** Write `GeluAndMul.forward`. It receives `x` of shape `(num_tokens, 2 * d)` and returns
# `(num_tokens, d)`. Use `gelu_tanh` from notebook 01 or PyTorch's `F.gelu(..., approximate="tanh")`.
# Run the check cell: it compares your layer with transformers' Gemma MLP on the same weights.

# %%
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.activation import gelu_tanh
from minivllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GeluAndMul(nn.Module):
    """gelu_tanh(gate) * up, where the input holds [gate | up] along its last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, 2 * intermediate_size)
        # BEGIN SOLUTION
        gate, up = x.chunk(2, dim=-1)
        return gelu_tanh(gate) * up  # (num_tokens, intermediate_size)
        # END SOLUTION


# %% [markdown]
# ## Check
# A Gemma MLP from transformers and ours, built from notebook 01's packed layers plus your activation,
# on the same random weights.

# %%
from transformers import GemmaConfig
from transformers.models.gemma.modeling_gemma import GemmaMLP

config = GemmaConfig(hidden_size=64, intermediate_size=96, hidden_activation="gelu_pytorch_tanh")
torch.manual_seed(0)
ref = GemmaMLP(config)
for p in ref.parameters():
    nn.init.normal_(p, std=0.1)

gate_up = MergedColumnParallelLinear(64, [96, 96])
gate_up.weight.weight_loader(gate_up.weight, ref.gate_proj.weight.data, 0)
gate_up.weight.weight_loader(gate_up.weight, ref.up_proj.weight.data, 1)
down = RowParallelLinear(96, 64)
down.weight.weight_loader(down.weight, ref.down_proj.weight.data)

x = torch.randn(10, 64)
with torch.no_grad():
    ours = down(GeluAndMul()(gate_up(x)))
    torch.testing.assert_close(ours, ref(x))
    torch.testing.assert_close(GeluAndMul()(torch.cat([x, x], -1)), F.gelu(x, approximate="tanh") * x)
print("GeluAndMul matches transformers' Gemma MLP")
