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
# # Deep dive · vLLM's API: stop strings, log-probabilities, penalties, chat, request ids
#
# **What this adds.** Notebook 06's engine takes prompts and vLLM's core sampling settings, and
# refuses the rest by name. vLLM's API has more: **stop strings** (found in the text, not the
# tokens), **log-probabilities** of the sampled and the prompt tokens, **penalties** and
# `min_tokens`, **chat** through the model's template, a caller's own **request ids**, and an
# engine that several threads may drive. This deep dive adds them, each a subclass of notebook
# 06's classes; the runner's part (penalties, log-probabilities) is the deep dive
# `sampling_options`'s `OptionsRunner`.
#
# **It follows notebook 06**; nothing in the core path needs it. It exports
# `minivllm.engine.api_core`, `minivllm.engine.api_processors`, `minivllm.engine.api_engine` and
# `minivllm.api_llm`; `from minivllm import LLM` (deep dive `fast_engine`) builds on them, and the
# server's `AsyncLLM` uses its processors.

# %%
import os
import random
from pathlib import Path

import torch
from transformers.utils.logging import disable_progress_bar

from minivllm.checkpoint import write_checkpoint

disable_progress_bar()  # transformers' saving draws no progress bars in the outputs
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../../build/checkpoints")).resolve()
tiny_text = CHECKPOINTS / "tiny-text"  # notebook 02's tiny model trained on text
if not (tiny_text / "model.safetensors").is_file():
    write_checkpoint(tiny_text, "tiny-text", seed=0)
random.seed(0)

# %% [markdown]
# ## The core: the runner's options, and a completion a front end ends
# The core runs the deep dive `sampling_options`' runner, which computes penalties, `min_tokens`
# and log-probabilities. A stop string ends a completion in the front end (the core never sees
# text), so the core needs a way to be told: `finish(request_id, index)` frees that completion
# now, and drops any token a step still in flight gives it. `stats()` is what a server's
# `/metrics` reports.

# %% tags=["export"] module="minivllm.engine.api_core"
from minivllm.engine.core import EngineCore
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.sampling_options import OptionsRunner


class ApiCore(EngineCore):
    """Notebook 06's core with the deep dive sampling_options' runner, completions a front end ends
    (stop strings), and its stats."""

    def make_runner(self) -> ModelRunner:
        return OptionsRunner(self.config)

    def finish(self, request_id: str, index: int) -> None:
        """A front end ended completion `index` (a stop string): free it now. Harmless if the core
        ended it (or its request) first."""
        request = self.requests.get(request_id)
        if request is None:
            return
        seq = request.seqs[index]
        self.scheduler.finish(seq, "stop")
        self.owners.pop(seq.seq_id, None)  # its later tokens, if a step holds it, are dropped
        self.forget_if_done(request)

    def stats(self) -> dict[str, float]:
        bm = self.scheduler.block_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.num_used_blocks / bm.num_blocks,
        }


# %% [markdown]
# ## Requests in: every option, and a caller's own ids
# The input processor lets every option through (the runner and the output processor below do
# them); stop strings need a tokenizer. Request ids: a caller may name its request (a server does,
# to abort it later); a name in use by a live request, or given twice, is refused; unnamed requests
# get the next free number. Prompt log-probabilities are the same for all n completions: only the
# first computes them.
#
# ## Outputs out: stop strings, log-probabilities, text as it comes
# **Stop strings** are found in the text: after each step the output processor detokenizes each
# reply that has one, after its first `min_tokens` tokens (vLLM's rule), and a reply holding one
# ends with reason `"stop"`; its text ends before it (or after, with
# `include_stop_str_in_output`), and the engine tells the core to `finish` it. **Text as it comes**
# (a server streams it): `running_text` detokenizes only the newest tokens, and holds back what
# could be the start of a stop string. **Log-probabilities** arrive as rows of (token id →
# (log-probability, rank)) and leave as vLLM's `Logprob`s, decoded.

# %% tags=["export"] module="minivllm.engine.api_processors"
import dataclasses
from collections.abc import Callable, Iterable
from itertools import count

from transformers import PreTrainedTokenizerBase

from minivllm.config import Config
from minivllm.engine.core import Delta
from minivllm.engine.input_processor import InputProcessor
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.request import Completion, Request
from minivllm.layers.sampler import TokenLogprobs
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams


class ApiInputProcessor(InputProcessor):
    """Notebook 06's input processor with every option, and request ids a caller chooses."""

    def __init__(self, config: Config, tokenizer: PreTrainedTokenizerBase | None, num_blocks: int):
        super().__init__(config, tokenizer, num_blocks)
        self.counter = count()  # the ids of unnamed requests

    def check_options(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"stop strings need a tokenizer, and {self.config.model} has none: use "
                f"stop_token_ids"
            )

    def completion_params(self, params: SamplingParams) -> list[SamplingParams]:
        """Notebook 06's, with prompt log-probabilities asked of completion 0 only."""
        first, *others = super().completion_params(params)
        return [first, *(dataclasses.replace(p, prompt_logprobs=None) for p in others)]

    def request_ids(
        self, request_ids: list[str | None], in_use: Callable[[str], bool]
    ) -> list[str]:
        """The given ids, checked to be strings neither in use (by live requests) nor repeated; None
        gets the next unused number."""
        ids: dict[str, None] = {}  # in order
        for request_id in request_ids:
            if request_id is None:
                free = (i for i in map(str, self.counter) if not in_use(i) and i not in ids)
                request_id = next(free)
            elif not isinstance(request_id, str):
                kind = type(request_id).__name__
                raise ValueError(f"request_id must be a str, got {request_id!r} ({kind})")
            elif in_use(request_id) or request_id in ids:
                raise ValueError(
                    f"request_id {request_id!r} is already in use by an unfinished request"
                )
            ids[request_id] = None
        return list(ids)


class ApiOutputProcessor(OutputProcessor):
    """Notebook 06's output processor with stop strings, log-probabilities and running text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        super().__init__(tokenizer)
        self.stopped: list[tuple[str, int]] = []  # (request_id, index): the core must finish them

    def pop_stopped(self) -> list[tuple[str, int]]:
        """The completions stop strings ended since the last call."""
        stopped, self.stopped = self.stopped, []
        return stopped

    def update(self, request: Request, completion: Completion, delta: Delta, now: float) -> None:
        """Notebook 06's, token by token: the tokens after a stop string are dropped."""
        self.record_prompt_logprobs(request, delta.prompt_logprobs)
        for k, token_id in enumerate(delta.token_ids):
            if completion.is_finished:
                return
            completion.token_ids.append(token_id)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if delta.logprobs is not None:
                completion.logprobs.append(self.logprobs(delta.logprobs[k]))
            if completion.params.stop and self.find_stop(completion):
                completion.finish_reason = "stop"
                self.stopped.append((request.request_id, delta.completion))
        if not completion.is_finished:
            completion.finish_reason = delta.finish_reason

    def record_prompt_logprobs(
        self, request: Request, rows: tuple[int, list[TokenLogprobs]] | None
    ) -> None:
        for position, row in enumerate(rows[1], rows[0]) if rows else ():
            if position == len(request.prompt_logprobs):  # not scored before (a preempted prompt)
                request.prompt_logprobs.append(self.logprobs(row))

    def logprobs(self, row: TokenLogprobs) -> dict[int, Logprob]:
        items = row.items()
        return {token: Logprob(lp, rank, self.detokenize([token])) for token, (lp, rank) in items}

    def find_stop(self, completion: Completion) -> bool:
        """Whether the completion's text, after its first `min_tokens` tokens' text, holds a stop
        string; if so, `text_end` says where its text ends."""
        params, token_ids = completion.params, completion.token_ids
        if len(token_ids) < params.min_tokens:
            return False
        text = self.detokenize(token_ids)
        after = len(self.detokenize(token_ids[: params.min_tokens])) if params.min_tokens else 0
        hits = [(at, stop) for stop in params.stop if (at := text.find(stop, after)) >= 0]
        if hits:
            at, stop = min(hits)  # the first stop string in the text
            completion.text_end = at + len(stop) if params.include_stop_str_in_output else at
        return bool(hits)

    def output(self, request: Request) -> RequestOutput:
        out = super().output(request)
        if request.params[0].prompt_logprobs is not None:
            out.prompt_logprobs = list(request.prompt_logprobs)
        return out

    def completion(self, index: int, completion: Completion) -> CompletionOutput:
        params, token_ids = completion.params, list(completion.token_ids)
        done = completion.is_finished
        text = self.detokenize(token_ids) if done else self.running_text(completion)
        text = text[: completion.text_end]
        if not done and params.stop:  # hold back what may be the start of a stop string
            text = text[: len(text) + 1 - max(map(len, params.stop))]
        reason = completion.finish_reason
        if params.logprobs is None:
            return CompletionOutput(index, text, token_ids, reason)
        logprobs = list(completion.logprobs)
        cumulative = sum(row[token].logprob for row, token in zip(logprobs, token_ids))
        return CompletionOutput(index, text, token_ids, reason, logprobs, cumulative)

    def running_text(self, completion: Completion) -> str:
        """The completion's text so far (detokenizing the whole reply at every step would cost
        O(length²)). `running` = (text, start, read): text ends with tokens[start:read]'s; newer
        tokens are read once whole (no '\ufffd')."""
        text, start, read = completion.running
        if len(completion.token_ids) > read:
            tokens = completion.token_ids[start:]
            known, new = self.detokenize(tokens[: read - start]), self.detokenize(tokens)
            if not new.endswith("\ufffd"):  # a token with no text (a special one, say) is read too
                text, start, read = text + new[len(known) :], read, len(completion.token_ids)
                completion.running = (text, start, read)
        return text


def abortable(request_ids: str | Iterable[str]) -> set[str]:
    """One id or many, as a set."""
    return {request_ids} if isinstance(request_ids, str) else set(request_ids)


# %% [markdown]
# ## The engine: a lock, ids, and stop strings told to the core
# `ApiEngine` is notebook 06's engine with these processors and core. After each step it tells the
# core which completions a stop string ended. One reentrant lock serialises every call that changes
# it, so a user's thread may add or abort requests while `LLM.generate` steps it (`generate` holds
# the lock for its whole run; `engine.step` keeps the other requests' outputs for the caller).

# %% tags=["export"] module="minivllm.engine.api_engine"
import threading
from collections.abc import Collection, Iterable
from pathlib import Path

from minivllm.engine.api_core import ApiCore
from minivllm.engine.api_processors import ApiInputProcessor, ApiOutputProcessor, abortable
from minivllm.engine.core import EngineCore
from minivllm.engine.input_processor import InputProcessor, Prompt
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.output_processor import OutputProcessor
from minivllm.outputs import RequestOutput, StepStats
from minivllm.sampling_params import SamplingParams


class ApiEngine(LLMEngine):
    """Notebook 06's engine with vLLM's whole API. Thread-safe: one lock serialises every call that
    changes the engine."""

    core: ApiCore
    input_processor: ApiInputProcessor
    output_processor: ApiOutputProcessor

    def __init__(self, model: str | Path, **kwargs):
        self.lock = threading.RLock()  # reentrant: LLM.generate holds it while it steps
        super().__init__(model, **kwargs)

    def make_core(self) -> EngineCore:
        return ApiCore(self.config)

    def make_input_processor(self) -> InputProcessor:
        num_blocks = self.core.scheduler.block_manager.num_blocks
        return ApiInputProcessor(self.config, self.tokenizer, num_blocks)

    def make_output_processor(self) -> OutputProcessor:
        return ApiOutputProcessor(self.tokenizer)

    def add_requests(
        self,
        prompts: list[Prompt],
        params: list[SamplingParams | None],
        request_ids: list[str | None] | None = None,
    ) -> list[str]:
        """Notebook 06's, with the callers' ids (None: the next free number)."""
        with self.lock:
            named = request_ids or [None] * len(prompts)
            return self.queue(prompts, params, self.input_processor.request_ids(named, self.in_use))

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        return self.add_requests([prompt], [params], [request_id])[0]

    def request_ids(self) -> set[str]:
        """The ids in use: of unfinished requests, and of finished ones step() has kept back."""
        return set(self.output_processor.requests) | {out.request_id for out in self.finished}

    def in_use(self, request_id: str) -> bool:
        kept = any(out.request_id == request_id for out in self.finished)
        return request_id in self.output_processor.requests or kept

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        with self.lock:
            super().abort_request(abortable(request_ids))

    def step(
        self, request_ids: Collection[str] | None = None
    ) -> tuple[list[RequestOutput], StepStats]:
        """Notebook 06's step; then the core frees the completions stop strings ended."""
        with self.lock:
            outputs, stats = super().step(request_ids)
            for request_id, index in self.output_processor.pop_stopped():
                self.core.finish(request_id, index)
            return outputs, stats

    def abort_all(self) -> None:
        """Drop every request and kept output; the scheduler resets its block manager."""
        with self.lock:
            self.core.abort_all()
            self.output_processor.abort(set(self.output_processor.requests))
            self.finished.clear()


# %% [markdown]
# ## `LLM`: chat, and a generate that shares the engine
# `chat` is `generate` for conversations: each goes through the tokenizer's chat template (its own
# switches, Qwen3's `enable_thinking` say, as `chat_template_kwargs`). `generate` holds the
# engine's lock: requests queued with `engine.add_request` share its batches, and their outputs
# wait for `engine.step()`; interrupted, it aborts every request it added.

# %% tags=["export"] module="minivllm.api_llm"
from collections.abc import Sequence as SequenceOf

from minivllm.engine.api_engine import ApiEngine
from minivllm.engine.input_processor import Prompt
from minivllm.engine.llm_engine import LLMEngine
from minivllm.llm import LLM
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


def chat_prompt(tokenizer, conversation, model, template_kwargs: dict | None = None) -> str:
    """A conversation ([{"role": ..., "content": ...}, ...]) as the model's chat template writes it,
    ready for the assistant's reply."""
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{model} has no chat template: pass prompts to generate instead")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
            raise ValueError(
                f'messages[{i}] must be a dict with "role" and "content", got {message!r}'
            )
    kwargs = template_kwargs or {}  # the template's own switches: Qwen3's enable_thinking, say
    return tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True, **kwargs
    )


class ApiLLM(LLM):
    """Notebook 06's `LLM` over `ApiEngine`: `chat`, `abort`, and a shared engine."""

    engine: ApiEngine

    def make_engine(self, model: str, **kwargs) -> LLMEngine:
        return ApiEngine(model, **kwargs)

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Notebook 06's, holding the engine's lock; only this call's requests come back."""
        with self.engine.lock:
            before = self.engine.request_ids()
            try:
                return super().generate(prompts, sampling_params, use_tqdm)
            except BaseException:  # even half-way through queueing: abort all it added
                self.engine.abort_request(self.engine.request_ids() - before)
                raise

    def chat(
        self, messages, sampling_params=None, use_tqdm=True, chat_template_kwargs=None
    ) -> list[RequestOutput]:
        """`generate` for a conversation ([{"role": ..., "content": ...}, ...]) or a list of
        them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        model, kwargs = self.engine.config.model, chat_template_kwargs
        prompts = [chat_prompt(self.get_tokenizer(), c, model, kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def abort(self) -> None:
        """Drop every unfinished request and free its KV blocks."""
        self.engine.abort_all()


# %% [markdown]
# ## Stop strings, and `min_tokens`
# Greedy text from notebook 02's `tiny-text`, then the same with `stop`: the text ends before the
# first stop string, with reason "stop" (or at it, with `include_stop_str_in_output`). With
# `min_tokens`, stop strings count only in the text after those tokens.

# %%
from minivllm.api_llm import ApiLLM
from minivllm.sampling_params import SamplingParams

llm = ApiLLM(str(tiny_text), max_model_len=1024, num_kvcache_blocks=256, device="cpu")
prompt = "Once upon a time"
greedy = SamplingParams(temperature=0, max_tokens=40)
full = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text
print(f"no stop:      {full!r}")
stop = "the"
tokenizer = llm.get_tokenizer()
for params in (
    SamplingParams(temperature=0, max_tokens=40, stop=stop),
    SamplingParams(temperature=0, max_tokens=40, stop=stop, include_stop_str_in_output=True),
    SamplingParams(temperature=0, max_tokens=40, stop=stop, min_tokens=12),
):
    done = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    options = f"include={params.include_stop_str_in_output}, min_tokens={params.min_tokens}"
    print(f"stop={stop!r} ({options}): {done.text!r} ({done.finish_reason})")
    # the first stop string in the text after the first min_tokens tokens' text
    at = full.find(stop, len(tokenizer.decode(done.token_ids[: params.min_tokens])))
    end = at + len(stop) if params.include_stop_str_in_output else at
    assert at > 0 and (done.text, done.finish_reason) == (full[:end], "stop")

# %% [markdown]
# ## Log-probabilities, n samples, and the prompt's
# `logprobs=k`: each sampled token's log-probability under the model's raw distribution and rank,
# with the k most likely tokens; `prompt_logprobs=k` the same for each prompt token after the
# first. On the tiny model in float32 they equal transformers' log-softmax.

# %%
from transformers import AutoModelForCausalLM

sampled = SamplingParams(n=3, seed=0, max_tokens=8, logprobs=2)
three = llm.generate("In autumn the leaves", sampled, use_tqdm=False)[0].outputs
for c in three:
    print(f"sample {c.index}: {c.text!r}, log-probability {c.cumulative_logprob:.2f}")
# each token's row: {token id: Logprob(logprob, rank, decoded_token)}, its own first
print(f"sample 0's first token: {three[0].logprobs[0]}")
for c in three:  # its own token, and at most the 2 most likely others
    for token, row in zip(c.token_ids, c.logprobs):
        assert token in row and len(row) <= 3

hf = AutoModelForCausalLM.from_pretrained(tiny_text, dtype=torch.float32)
ids = llm.get_tokenizer().encode("The cat sat on the mat, and the dog sat on the rug.")
scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
scored = llm.generate(ids, scoring, use_tqdm=False)[0]
with torch.no_grad():  # transformers' log-probability of each prompt token after the first
    logits = hf(torch.tensor([ids])).logits[0, :-1]
    want = torch.log_softmax(logits, -1)[range(len(ids) - 1), ids[1:]]
rows = zip(scored.prompt_logprobs[1:], ids[1:])
got = torch.tensor([row[t].logprob for row, t in rows])
torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
gap = (got - want).abs().max()
print(f"{len(ids) - 1} prompt log-probabilities equal transformers' (largest gap {gap:.1e})")

# %% [markdown]
# ## Chat, and an engine shared with a user's own loop
# `chat` writes the conversation with the tokenizer's template. Then a request queued by hand
# (`engine.add_request`, with its own id) shares `generate`'s batches: `generate` returns only its
# own outputs; the other waits for `engine.step()`.

# %%
chat = [{"role": "user", "content": "What is the capital of France?"}]
# the template's switch: Qwen3 writes <think>...</think> first, or not
for thinking in (True, False):
    switch = {"enable_thinking": thinking}
    reply = llm.chat(chat, greedy, use_tqdm=False, chat_template_kwargs=switch)[0]
    prompt_end, text = reply.prompt[-40:], reply.outputs[0].text[:40]
    print(f"enable_thinking={thinking}: {prompt_end!r} -> {text!r}")
engine = llm.engine
engine.add_request("A user's own request", SamplingParams(max_tokens=4), request_id="mine")
outputs = llm.generate(["Dear Maria,", "Hello"], SamplingParams(max_tokens=30), use_tqdm=False)
kept, _ = engine.step()
returned, stepped = [o.request_id for o in outputs], [o.request_id for o in kept]
print(f"generate returned {returned}; engine.step() then gave {stepped}")
assert stepped == ["mine"] and "mine" not in returned
engine.add_request("A second one", SamplingParams(max_tokens=4), request_id="live")
try:
    engine.add_request("A third", request_id="live")
    raise AssertionError("a live request's id was given twice")
except ValueError as e:
    print(f"a name in use is refused: {e}")
engine.abort_request("live")
engine.abort_request("mine")
assert not engine.has_unfinished_requests()
