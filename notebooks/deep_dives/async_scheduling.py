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
# # Deep dive · Async scheduling: the host plans step N+1 while the GPU runs step N
#
# **What this adds.** Notebook 06's core runs a step, waits for its tokens, then schedules the next:
# between two steps the GPU waits for the host (scheduling, preparing inputs, postprocessing). With
# async scheduling the core launches step N+1 before it reads step N's tokens, so that host work
# hides behind the GPU's. vLLM turns it on the same way (`async_scheduling`).
#
# **It follows notebook 06**; nothing in the core path needs it: notebook 06's core runs one step at
# a time to the same tokens. It exports `minivllm.engine.async_core`: a runner and a core, each a
# subclass of the core's.
#
# **What you will see.** The placeholder trick that lets a step start before its inputs are on the
# host, the core that uses it, and the same tokens as notebook 06's core on this CPU.

# %%
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
# ## Placeholders: a token that is still on the GPU
# To launch step N+1, the host needs each sequence's next input token: the one step N is still
# sampling. The scheduler's `advance` (notebook 05) appends a **placeholder** instead,
# `placeholder(row)` (notebook 04: a negative id, `-1 - row`), and counts the step's tokens as
# computed. On the device, the runner swaps each placeholder for row `row` of the ids the last step
# sampled, without waiting. When step N's tokens reach the host, `resolve` writes the real ids in.
# The copy to the host is started without waiting too (`non_blocking`, into pinned memory), with a
# CUDA event to wait on when the tokens are needed.

# %% tags=["export"] module="minivllm.engine.async_core"
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from minivllm.engine.api_core import ApiCore
from minivllm.engine.core import Delta
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.sampling_options import OptionsRunner
from minivllm.engine.sequence import Sequence
from minivllm.engine.step_inputs import StepInputs, placeholder_row
from minivllm.outputs import StepStats


class AsyncRunner(OptionsRunner):
    """Notebook 04's runner (sampling options included) for async scheduling: placeholder ids
    stand for the last step's sampled tokens, and a step's tokens come to the host without the
    host waiting."""

    last_token_ids: torch.Tensor | None = None  # (num_seqs,): the latest step's, on the device

    def device_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, Any]:
        input_ids, positions, context = super().device_inputs(step)
        if step.input_ids.min() < 0:  # placeholders: the last step's tokens, still on the device
            assert self.last_token_ids is not None
            last = self.last_token_ids[placeholder_row(input_ids)]
            input_ids = torch.where(input_ids < 0, last, input_ids)
        return input_ids, positions, context

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        self.last_token_ids = super().sample(seqs, logits)
        return self.last_token_ids

    def to_host(self, token_ids: torch.Tensor) -> Callable[[], list[int]]:
        host = token_ids.to("cpu", non_blocking=True)  # queued after the step: the host goes on
        if not token_ids.is_cuda:
            return host.tolist
        ready = torch.cuda.Event()
        ready.record()

        def wait() -> list[int]:
            ready.synchronize()
            return host.tolist()

        return wait


# %% [markdown]
# The core keeps one launched step. `step()` takes it (or launches one), `advance`s it (placeholders
# in), launches the next step if there is one, and only then waits for the first's tokens and
# `resolve`s them. A step with penalties waits: they read every token of the rows, placeholders
# would be wrong. A step whose rows all finished or were aborted meanwhile is dropped unread.


# %% tags=["export"] module="minivllm.engine.async_core"
class AsyncEngineCore(ApiCore):
    """Notebook 06's core with async scheduling (`config.async_scheduling`): step N+1 is launched
    before step N's tokens are read."""

    launched: Any = None  # the step queued ahead (notebook 06's Launched), if any

    def make_runner(self) -> ModelRunner:
        return AsyncRunner(self.config)

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or self.launched is not None

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        super().abort_requests(request_ids)
        self.drop_finished_launch()

    def abort_all(self) -> None:
        super().abort_all()
        self.launched = None

    def drop_finished_launch(self) -> None:
        if self.launched and all(seq.is_finished for seq in self.launched.seqs):
            self.launched = None  # launched ahead for rows that all stopped: nothing to read

    def step(self) -> tuple[list[Delta], StepStats]:
        if not self.has_unfinished_requests():
            return [], StepStats("idle")
        step, self.launched = self.launched or self.launch(), None
        try:
            start = time.perf_counter()
            rows = self.scheduler.advance(step.seqs)  # placeholders for the tokens on their way
            advanced = time.perf_counter()
            penalized = any(seq.sampling_params.penalized for seq in step.seqs)
            if self.config.async_scheduling and not penalized and not self.scheduler.is_finished():
                self.launched = self.launch()
            waiting = time.perf_counter()
            out = step.output()
            ran = time.perf_counter()
            self.scheduler.resolve(step.seqs, rows, out.token_ids)
            self.drop_finished_launch()
        except BaseException as e:
            self.abort_step(e, step.seqs + (self.launched.seqs if self.launched else []))
            self.launched = None
            raise
        deltas = self.postprocess(step.seqs, set(rows), out)
        step.stats.run_seconds += ran - waiting
        step.stats.postprocess_seconds = advanced - start + time.perf_counter() - ran
        return deltas, step.stats


# %% [markdown]
# ## The same tokens as notebook 06's core
# Two cores on the tiny checkpoint, fed the same requests (greedy and seeded sampling, a chunked
# prompt, preemption in a small cache): the async one must give every completion the same tokens.
# On this CPU nothing overlaps (the "GPU" is the host), but the placeholders and the order of
# `advance`, launch and `resolve` are exercised as on a GPU.

# %%
from minivllm.config import Config
from minivllm.engine.core import EngineCore
from minivllm.sampling_params import SamplingParams


def completions(core: EngineCore) -> dict[tuple[str, int], list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(seed=3, max_tokens=24)]
    for i, n in enumerate((5, 70, 33, 140, 9, 48)):
        prompt = list(range(1, n + 1))
        core.add_request(f"r{i}", prompt, [params[i % 2]])
    tokens: dict[tuple[str, int], list[int]] = {}
    while core.has_unfinished_requests():
        for delta in core.step()[0]:
            tokens.setdefault((delta.request_id, delta.completion), []).extend(delta.token_ids)
    core.close()
    return tokens


small = dict(num_kvcache_blocks=20, max_num_seqs=4, max_num_batched_tokens=64, device="cpu")
config = Config(path, dtype=torch.float32, async_scheduling=True, **small)
plain, ahead = completions(EngineCore(config)), completions(AsyncEngineCore(config))
print(
    f"{len(ahead)} completions, {sum(map(len, ahead.values()))} tokens; the same: {plain == ahead}"
)
assert plain == ahead and all(len(t) == 24 for t in ahead.values())

# %% [markdown]
# On an H200, `python -m minivllm.benchmarks.gpu_idle` measures what the GPU waits between steps
# with and without it (`notebooks/figures/gpu_idle.json`).
