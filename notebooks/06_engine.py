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
# # 06 · The engine: vLLM's offline API, end to end
#
# **What this notebook builds.** The layer a user touches: `LLM(model=...).generate(prompts,
# sampling_params)`, with vLLM's names and outputs. Under it, vLLM v1's split: an `EngineCore`
# (05's scheduler and 04's runner, token ids in and out) and, around it, `LLMEngine`: an input
# processor (prompt → checked request) and an output processor (tokens → text and outputs).
#
# **What you will see.** Qwen3 end to end (the real Qwen3-0.6B on a GPU), greedy output equal to
# transformers', KV blocks over a run, the course's final figures. The rest of vLLM's API (stop
# strings, log-probabilities, penalties, chat) is the deep dive `vllm_api`; splitting the model
# over GPUs is `tensor_parallel`.

# %%
import json
import os
import random
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from transformers.utils.logging import disable_progress_bar

disable_progress_bar()  # transformers' saving and loading draw no progress bars in the outputs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../build/checkpoints")).resolve()
random.seed(0)

# %% [markdown]
# ## The engine core: schedule → run → postprocess
# `EngineCore` is the scheduler of 05 and the runner of 04, and nothing else: token ids in, token
# ids out, no tokenizer. `add_request` takes a request's prompt ids and one `SamplingParams` per
# completion (`n` of them), `abort_requests` drops requests, and `step()` runs one step: it
# **schedules** a batch, **runs** it (the runner's `launch`, then its tokens) and **postprocesses**
# (the scheduler appends the tokens and frees what finished). It says what the step gave each
# completion, a `Delta`, and the step's `StepStats`.
#
# Two details. With prefix caching, a request's later completions wait until the first has
# computed the prompt: they then find it in the cache. And when the model fails (a device error,
# Ctrl-C), the step's requests are aborted and their blocks dropped from the prefix cache (their KV
# may be half written); the next `step()` serves the others.

# %% tags=["export"] module="minivllm.engine.core"
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from minivllm.config import Config
from minivllm.engine.model_runner import ModelRunner, PromptLogprobs, StepOutput
from minivllm.engine.scheduler import Scheduler, UnifiedScheduler
from minivllm.engine.sequence import Sequence
from minivllm.layers.sampler import TokenLogprobs
from minivllm.outputs import StepStats
from minivllm.sampling_params import SamplingParams


class Delta(NamedTuple):
    """What one completion got in one step: all a front end hears of it."""

    request_id: str
    completion: int  # which of the request's n completions
    token_ids: list[int]  # its new tokens
    finish_reason: str | None  # once the core finished it: "stop" (an EOS or stop id), "length"
    # if the runner computed them (deep dive sampling_options): a row per new token; the prompt's
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(slots=True)
class CoreRequest:
    request_id: str
    seqs: list[Sequence]  # one per completion
    num_started: int = 0  # with prefix caching, seqs[1:] wait for seqs[0]'s prompt


@dataclass(slots=True)
class Launched:  # a step queued on the GPU
    seqs: list[Sequence]
    output: Callable[[], StepOutput]  # waits for the step's tokens
    stats: StepStats


class EngineCore:
    """The scheduler and the model runner: token ids in, what each step gave each completion out."""

    def __init__(self, config: Config):
        self.config = config
        self.runner = self.make_runner()
        policy = UnifiedScheduler if config.scheduling_policy == "unified" else Scheduler
        self.scheduler = policy(config, self.runner.num_kvcache_blocks)
        self.requests: dict[str, CoreRequest] = {}  # request_id -> request, until it ends
        self.owners: dict[int, CoreRequest] = {}  # seq_id -> its request

    def make_runner(self) -> ModelRunner:
        return ModelRunner(self.config)

    def add_request(self, request_id: str, token_ids: list[int], params: list[SamplingParams]):
        """Queue a checked request (the front end checks): one completion per SamplingParams."""
        seqs = [Sequence(token_ids, p, self.config.block_size) for p in params]
        request = CoreRequest(request_id, seqs)
        self.requests[request_id] = request
        self.owners |= {seq.seq_id: request for seq in seqs}
        self.start(request, 1 if self.config.enable_prefix_caching else len(seqs))

    def start(self, request: CoreRequest, num_seqs: int) -> None:
        for seq in request.seqs[request.num_started : num_seqs]:
            self.scheduler.add(seq)
        request.num_started = max(request.num_started, num_seqs)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Drop these requests, wherever they are, and free their KV blocks."""
        for request in [self.requests.pop(i) for i in request_ids if i in self.requests]:
            for seq in request.seqs:
                self.scheduler.abort(seq)
                del self.owners[seq.seq_id]

    def forget_if_done(self, request: CoreRequest) -> None:
        """Forget a request once every completion has started and finished."""
        started = request.num_started == len(request.seqs)
        if started and all(seq.is_finished for seq in request.seqs):
            del self.requests[request.request_id]
            for seq in request.seqs:
                self.owners.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    def step(self) -> tuple[list[Delta], StepStats]:
        """Schedule a step, run it, postprocess it: what it gave each completion, and its stats."""
        if not self.has_unfinished_requests():
            return [], StepStats("idle")
        step = self.launch()
        try:
            start = time.perf_counter()
            out = step.output()  # the step's tokens
            ran = time.perf_counter()
            rows = self.scheduler.advance(step.seqs)  # the rows that sampled a token
            self.scheduler.resolve(step.seqs, rows, out.token_ids)
        except BaseException as e:
            self.abort_step(e, step.seqs)
            raise
        deltas = self.postprocess(step.seqs, set(rows), out)
        step.stats.run_seconds += ran - start
        step.stats.postprocess_seconds = time.perf_counter() - ran
        return deltas, step.stats

    def launch(self) -> Launched:
        """Schedule a step and queue it on the GPU; if that fails, its requests are aborted."""
        seqs = None
        try:
            start = time.perf_counter()
            seqs, is_prefill = self.scheduler.schedule()
            scheduled = time.perf_counter()
            output = self.runner.launch(seqs, is_prefill)
        except BaseException as e:
            self.abort_step(e, seqs)
            raise
        decoding = [seq.num_completion_tokens > 0 and seq.num_scheduled_tokens == 1 for seq in seqs]
        kind = "mixed" if is_prefill and any(decoding) else "prefill" if is_prefill else "decode"
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        seconds = scheduled - start, time.perf_counter() - scheduled
        return Launched(seqs, output, StepStats(kind, len(seqs), num_tokens, *seconds))

    def postprocess(self, seqs: list[Sequence], rows: set[int], out: StepOutput) -> list[Delta]:
        """A Delta for each completion the step gave a token, scored a prompt for, or finished."""
        deltas, finished = [], {}
        for row, seq in enumerate(seqs):
            if (request := self.owners.get(seq.seq_id)) is None:
                continue  # aborted while its step ran
            if seq.num_completion_tokens > 0 and request.num_started < len(request.seqs):
                self.start(request, len(request.seqs))  # seqs[0]'s prompt is cached now
            new = [out.token_ids[row]] if row in rows else []
            token_logprobs = out.logprobs[row]
            logprobs = None if token_logprobs is None else [token_logprobs]
            reason = seq.finish_reason if seq.is_finished else None
            if new or reason or out.prompt_logprobs[row]:
                index = request.seqs.index(seq)
                prompt = out.prompt_logprobs[row]
                deltas.append(Delta(request.request_id, index, new, reason, logprobs, prompt))
            if seq.is_finished:
                finished[request.request_id] = request
        for request in finished.values():  # after the loop: its other rows may follow this one
            self.forget_if_done(request)
        return deltas

    def abort_step(self, error: BaseException, seqs: list[Sequence] | None) -> None:
        """Abort a failed step's requests (all, if its batch was not known yet), named on the
        error."""
        if seqs is None:
            ids = list(self.requests)
            self.abort_all()
        else:
            ids = [self.owners[seq.seq_id].request_id for seq in seqs if seq.seq_id in self.owners]
            self.abort_requests(ids)
        ids = list(dict.fromkeys(ids))
        error.add_note(f"minivllm: the step failed; these requests were aborted: {ids}")

    def abort_all(self) -> None:
        """Drop every request; the scheduler resets its block manager."""
        self.scheduler.abort_all()
        self.requests.clear()
        self.owners.clear()

    def close(self) -> None:
        self.runner.close()


# %% [markdown]
# ## The engine: an input processor, an output processor and the core
# `LLMEngine` is what `LLM` (below) and a user's own loop drive, with vLLM's names: `add_request`
# tokenizes and checks a request (the **input processor**, below) and hands the core its token ids;
# `step()` runs a core step and turns its deltas into text and `RequestOutput`s (the **output
# processor**, below). It returns the requests that finished; given `request_ids`, only those, and
# it keeps the others' outputs for a later call. Each part is made by a method (`make_core`,
# `make_input_processor`, ...), so a deep dive swaps one in a subclass: `vllm_api` adds the rest of
# vLLM's API, `fast_engine` the fast core, and `engine_core` runs the core in a process of its own.

# %% tags=["export"] module="minivllm.engine.llm_engine"
import time
from collections.abc import Collection, Iterable
from itertools import count
from pathlib import Path

from minivllm.config import Config
from minivllm.engine.core import Delta, EngineCore
from minivllm.engine.input_processor import InputProcessor, Prompt, load_tokenizer
from minivllm.engine.output_processor import OutputProcessor
from minivllm.outputs import RequestOutput, StepStats
from minivllm.sampling_params import SamplingParams


class LLMEngine:
    """Requests in, steps, outputs out."""

    def __init__(self, model: str | Path, **kwargs):
        self.config = self.make_config(model, **kwargs)
        self.tokenizer = load_tokenizer(self.config.tokenizer)
        self.core = self.make_core()
        self.input_processor = self.make_input_processor()
        self.output_processor = self.make_output_processor()
        self.finished: list[RequestOutput] = []  # not returned yet (a step given request_ids)
        self.counter = count()  # request ids

    def make_config(self, model: str | Path, **kwargs) -> Config:
        return Config(model, **kwargs)

    def make_core(self) -> EngineCore:
        return EngineCore(self.config)

    def make_input_processor(self) -> InputProcessor:
        num_blocks = self.core.scheduler.block_manager.num_blocks
        return InputProcessor(self.config, self.tokenizer, num_blocks)

    def make_output_processor(self) -> OutputProcessor:
        return OutputProcessor(self.tokenizer)

    def add_requests(self, prompts: list[Prompt], params: list[SamplingParams | None]) -> list[str]:
        """Queue these requests; their ids. If one is bad: ValueError, and none is queued."""
        return self.queue(prompts, params, [str(next(self.counter)) for _ in prompts])

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> str:
        return self.add_requests([prompt], [params])[0]

    def queue(self, prompts: list, params: list, request_ids: list[str]) -> list[str]:
        """Check every request, then queue them all."""
        several = len(prompts) > 1  # errors name the prompt
        names = [f"prompts[{i}]" for i in range(len(prompts))] if several else ["prompt"]
        make = self.input_processor.make_request
        requests = [make(*args) for args in zip(prompts, params, request_ids, names, strict=True)]
        for request in requests:
            self.output_processor.add(request)
            self.core.add_request(request.request_id, request.prompt_token_ids, request.params)
        return request_ids

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Drop these requests, unfinished or finished but not returned yet; free their blocks."""
        ids = set(request_ids)
        self.core.abort_requests(ids)
        self.output_processor.abort(ids)
        self.finished = [out for out in self.finished if out.request_id not in ids]

    def step(
        self, request_ids: Collection[str] | None = None
    ) -> tuple[list[RequestOutput], StepStats]:
        """One core step: the outputs of the requests that finished (only those in request_ids when
        given: the others are kept for a later step) and the step's stats."""
        try:
            deltas, stats = self.core.step()
        except BaseException:  # the core aborted the step's requests: forget them here too
            self.output_processor.abort(
                set(self.output_processor.requests) - set(self.core.requests)
            )
            raise
        if deltas:
            self.process(deltas, stats)
        wanted = set(request_ids) if request_ids is not None else None
        mine = [out for out in self.finished if wanted is None or out.request_id in wanted]
        self.finished = [out for out in self.finished if out not in mine]
        return mine, stats

    def process(self, deltas: list[Delta], stats: StepStats) -> None:
        """Text and outputs from a step's deltas (its time counts as postprocess)."""
        start = time.perf_counter()
        requests = self.output_processor.process(deltas, start)
        self.finished += [self.output_processor.output(r) for r in requests if r.finished]
        stats.postprocess_seconds += time.perf_counter() - start

    def has_unfinished_requests(self) -> bool:
        """Whether step() has more to give: requests to run, kept outputs."""
        return bool(self.finished) or self.core.has_unfinished_requests()

    def close(self) -> None:
        self.core.close()


# %% [markdown]
# ## `LLM.generate`: the loop, for a user
# `LLM(model, ...)` takes notebook 02's `Config` fields as keyword arguments. `generate` accepts a
# str, token ids (a list of ints, a 1-D integer array or tensor) or a list of those, with one
# `SamplingParams` for all or one per prompt; it steps the engine until its requests finish and
# returns their outputs in the prompts' order. Interrupted (Ctrl-C, an error), it aborts them.

# %% tags=["export"] module="minivllm.llm"
from collections.abc import Sequence as SequenceOf
from typing import Self, TypeGuard

from tqdm.auto import tqdm

from minivllm.engine.input_processor import Prompt
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams, scalar


def is_one_prompt(prompts) -> TypeGuard[Prompt]:
    """A str, an array or tensor, or a list of token ids (not a list of prompts)."""
    if isinstance(prompts, str) or hasattr(prompts, "ndim"):
        return True
    is_list = isinstance(prompts, list | tuple) and len(prompts) > 0
    return is_list and isinstance(scalar(prompts[0]), int | float)


def pair_up(prompts, sampling_params) -> tuple[list[Prompt], list[SamplingParams | None]]:
    """The prompts as a list, and a SamplingParams (or None) for each."""
    prompts = [prompts] if is_one_prompt(prompts) else prompts
    if not isinstance(prompts, list | tuple):
        kind = type(prompts).__name__
        raise ValueError(f"prompts must be a str, token ids, or a list of them; got {kind}")
    if not isinstance(sampling_params, list | tuple):
        sampling_params = [sampling_params] * len(prompts)
    if len(sampling_params) != len(prompts):
        n, m = len(sampling_params), len(prompts)
        raise ValueError(f"sampling_params has {n} entries for {m} prompts")
    return list(prompts), list(sampling_params)


class LLM:
    """vLLM's offline entry point. Keyword arguments are `Config`'s fields, with its defaults
    (notebook 02)."""

    def __init__(self, model: str, **kwargs):
        self.engine = self.make_engine(model, **kwargs)

    def make_engine(self, model: str, **kwargs) -> LLMEngine:
        return LLMEngine(model, **kwargs)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in order."""
        ids = self.engine.add_requests(*pair_up(prompts, sampling_params))
        try:
            outputs = self.run(ids, use_tqdm)
        except BaseException:  # Ctrl-C or an error: drop what is left of them
            self.engine.abort_request(ids)
            raise
        order = {request_id: i for i, request_id in enumerate(ids)}
        return sorted(outputs, key=lambda out: order[out.request_id])

    def run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until these requests have finished; their outputs."""
        outputs: list[RequestOutput] = []
        rates: dict[str, float] = {}  # tokens per second of the latest step of each kind
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        with bar:
            while len(outputs) < len(request_ids):
                finished, stats = self.engine.step(request_ids)
                assert stats.kind != "idle" or finished, "requests outstanding, but no step to run"
                if stats.kind != "idle":
                    rates[stats.kind] = stats.num_tokens / max(stats.seconds, 1e-9)
                speeds = [f"{kind} {rate:,.0f} tok/s" for kind, rate in rates.items()]
                bar.set_postfix_str(", ".join(speeds))
                outputs += finished
                bar.update(len(finished))
        return outputs

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# %% [markdown]
# ## vLLM's offline API: what goes in, what comes out
# **Outputs** are vLLM's `RequestOutput`: the prompt and, per completion, its text, token ids and
# `finish_reason` ("stop": an EOS or stop token; "length": `max_tokens` or the context); and two
# timings a server is judged by: **time to first token** (TTFT) and **time per output token**
# (TPOT). The log-probability fields stay `None` here: the deep dive `vllm_api` fills them.

# %% tags=["export"] module="minivllm.outputs"
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float  # under the raw distribution: the log-softmax of the model's logits
    rank: int  # 1 is the most likely token
    decoded_token: str


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", or None while running
    # per token: its own and the most likely tokens' (if asked), and their sum
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # time.perf_counter() seconds
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_tokens: int) -> float | None:
        if self.finished_time is None or self.first_token_time is None or num_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_tokens - 1)


@dataclass(slots=True)
class StepStats:
    """What one engine step did, and its phases' wall times in seconds (time.perf_counter())."""

    # "prefill", "decode", "mixed" (prompt and decode rows in one forward), or "idle" (no step ran)
    kind: str
    num_seqs: int = 0  # sequences in the batch
    num_tokens: int = 0  # tokens computed: prompt tokens, plus one per sequence that decodes
    schedule_seconds: float = 0.0  # Scheduler.schedule
    run_seconds: float = 0.0  # the runner's launch, and waiting for its tokens
    postprocess_seconds: float = 0.0  # Scheduler.advance and resolve, the engine's outputs

    @property
    def seconds(self) -> float:
        return self.schedule_seconds + self.run_seconds + self.postprocess_seconds


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False)
    # per prompt token (None for the first), if asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


# %% [markdown]
# A front end keeps each request as a `Request`: the prompt, and one `Completion` per sample with
# the tokens the core has reported. The core keeps its own `Sequence`s; the two share only request
# ids and token ids.

# %% tags=["export"] module="minivllm.engine.request"
from dataclasses import dataclass, field

from minivllm.outputs import Logprob, RequestMetrics
from minivllm.sampling_params import SamplingParams


@dataclass(slots=True)
class Completion:
    """A front end's view of one of a request's n completions: its tokens so far."""

    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length" once finished
    # what the deep dive vllm_api keeps: where a stop string ended the text, a row of
    # log-probabilities per token, the text read so far
    text_end: int | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    running: tuple[str, int, int] = ("", 0, 0)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Request:
    """A request as its front end keeps it: its prompt, and each completion as the core says."""

    request_id: str
    prompt: str | None  # the text, when the prompt was text
    prompt_token_ids: list[int]
    params: list[SamplingParams]  # one per completion (SamplingParams.n): the core's too
    completions: list[Completion]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=lambda: [None])

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.completions)


# %% [markdown]
# ### Requests in: the input processor
# **Bad input never gets in.** `make_request` tokenizes a prompt and checks it before it touches any
# state, with a `ValueError` naming the field and the allowed range; the scheduler only `assert`s.
# Each request keeps its own copy of its `SamplingParams`, with the model's end-of-sequence ids (the
# tokenizer's and `generation_config.json`'s) among its stop tokens unless it says `ignore_eos`.
# `n` completions get a `SamplingParams` each, seeded `seed + i`. What this engine does not do
# (stop strings, penalties, log-probabilities: the deep dives) is refused by name, never ignored.

# %% tags=["export"] module="minivllm.engine.input_processor"
import dataclasses
import json
import time
from pathlib import Path

import transformers
from transformers import GenerationConfig, PreTrainedTokenizerBase

from minivllm.config import Config
from minivllm.engine.request import Completion, Request
from minivllm.outputs import RequestMetrics
from minivllm.sampling_params import SamplingParams, as_token_ids

# text, or token ids: a list or tuple of ints, or a 1-D integer NumPy array / PyTorch tensor
Prompt = str | list[int]
# SamplingParams fields left to the deep dives sampling_options (the runner) and vllm_api (text)
OPTIONS = "presence_penalty frequency_penalty repetition_penalty min_tokens logprobs".split()
OPTIONS += ["prompt_logprobs", "stop", "include_stop_str_in_output"]


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer, or None when the folder has none (token-id prompts still work).
    transformers may build an empty tokenizer from a folder without tokenizer files: one that knows
    only special tokens is none."""
    config = Path(path) / "tokenizer_config.json"
    named = json.loads(config.read_text()) if config.is_file() else {}
    auto = "auto_map" in named  # a tokenizer of the checkpoint's own code
    name = "AutoTokenizer" if auto else named.get("tokenizer_class") or "AutoTokenizer"
    # the class named, imported alone: AutoTokenizer imports transformers' model registry (seconds)
    tokenizer_class = getattr(transformers, name, None) or transformers.AutoTokenizer
    try:
        tokenizer = tokenizer_class.from_pretrained(path)
    except (OSError, ValueError):
        return None
    return tokenizer if set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens) else None


def eos_token_ids(path: str | Path, tokenizer: PreTrainedTokenizerBase | None, hf_config):
    """Every end-of-sequence id: the tokenizer's first, then generation_config.json's, then
    config.json's."""
    ids = [tokenizer.eos_token_id] if tokenizer and tokenizer.eos_token_id is not None else []
    try:
        extra = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        extra = getattr(hf_config, "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra] if extra is not None else []
    return list(dict.fromkeys(ids))


class InputProcessor:
    """Prompts in, checked `Request`s out; it changes nothing (the engine queues what it
    returns)."""

    def __init__(self, config: Config, tokenizer: PreTrainedTokenizerBase | None, num_blocks: int):
        self.config, self.tokenizer, self.num_blocks = config, tokenizer, num_blocks
        self.eos_token_ids = eos_token_ids(config.model, tokenizer, config.hf_config)

    def tokenize(self, prompt: Prompt, name: str = "prompt") -> list[int]:
        if not isinstance(prompt, str):
            return as_token_ids(prompt, name)
        if self.tokenizer is None:
            model = self.config.model
            raise ValueError(f"{name} is text, but {model} has no tokenizer: pass token ids")
        return self.tokenizer.encode(prompt)

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if this request cannot run."""
        config, vocab_size = self.config, self.config.hf_config.vocab_size
        num_slots = self.num_blocks * config.block_size
        if not token_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        if len(token_ids) >= config.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; it must be shorter than max_model_len="
                f"{config.max_model_len} (prompt + at least one generated token)"
            )
        if len(token_ids) + 1 > num_slots:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the whole KV cache holds {num_slots} "
                f"({self.num_blocks} blocks of {config.block_size}): it can never run"
            )
        if bad := [t for t in token_ids if not 0 <= t < vocab_size]:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if bad := [t for t in params.stop_token_ids if not 0 <= t < vocab_size]:  # the sampler
            raise ValueError(  # indexes by them
                f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )

    def check_options(self, params: SamplingParams) -> None:
        """Refuse what this engine leaves to the deep dives (`minivllm.LLM` does it all)."""
        default = SamplingParams()
        if asked := [name for name in OPTIONS if getattr(params, name) != getattr(default, name)]:
            raise ValueError(
                f"{asked[0]} is not in notebook 06's engine: minivllm.LLM has it (deep dive "
                f"vllm_api)"
            )

    def request_params(self, params: SamplingParams | None) -> SamplingParams:
        """The request's own copy of params, with every EOS id (`replace` runs the checks again:
        fields may change)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # a copy, checked again: its fields may have changed
        self.check_options(params)
        eos = [] if params.ignore_eos else self.eos_token_ids
        stop_token_ids = list(dict.fromkeys([*params.stop_token_ids, *eos]))
        return dataclasses.replace(params, stop_token_ids=stop_token_ids)

    def completion_params(self, params: SamplingParams) -> list[SamplingParams]:
        """One SamplingParams per completion (vLLM's rule): completion i seeded seed + i."""
        seeds = [None if params.seed is None else params.seed + i for i in range(params.n)]
        return [dataclasses.replace(params, n=1, seed=seed) for seed in seeds]

    def make_request(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str, name: str
    ) -> Request:
        """Tokenize and check one request."""
        params = self.request_params(params)
        token_ids = self.tokenize(prompt, name)
        self.check_request(token_ids, params)
        samples = self.completion_params(params)
        completions = [Completion(p) for p in samples]
        text = prompt if isinstance(prompt, str) else None
        metrics = RequestMetrics(time.perf_counter())
        return Request(request_id, text, token_ids, samples, completions, metrics)


# %% [markdown]
# ### Outputs out: the output processor
# It keeps each request as the front end sees it and turns the core's deltas into what a user
# reads: each completion's tokens, its finish reason, its text (the tokenizer's `decode`), and the
# request's timings; it gathers a request's n completions into one `RequestOutput`.

# %% tags=["export"] module="minivllm.engine.output_processor"
from collections.abc import Iterable
from typing import cast

from transformers import PreTrainedTokenizerBase

from minivllm.engine.core import Delta
from minivllm.engine.request import Completion, Request
from minivllm.outputs import CompletionOutput, RequestOutput


class OutputProcessor:
    """The core's deltas in, what a user reads out: text, finish reasons, `RequestOutput`s."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        self.tokenizer = tokenizer
        self.requests: dict[str, Request] = {}  # request_id -> request, until it finishes

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def detokenize(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return cast(str, self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def process(self, deltas: Iterable[Delta], now: float) -> list[Request]:
        """A step's deltas: the requests they touched (a finished one is forgotten here)."""
        touched: dict[str, Request] = {}
        for delta in deltas:
            if (request := self.requests.get(delta.request_id)) is None:
                continue  # aborted
            touched[request.request_id] = request
            self.update(request, request.completions[delta.completion], delta, now)
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
        return list(touched.values())

    def update(self, request: Request, completion: Completion, delta: Delta, now: float) -> None:
        """One delta: the completion's new tokens, and its finish reason once it has one."""
        if delta.token_ids and request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        completion.token_ids += delta.token_ids
        completion.finish_reason = delta.finish_reason

    def output(self, request: Request) -> RequestOutput:
        """The request's output so far (finished, if every completion is)."""
        completions = [self.completion(i, c) for i, c in enumerate(request.completions)]
        prompt, ids, metrics = request.prompt, request.prompt_token_ids, request.metrics
        return RequestOutput(
            request.request_id, prompt, ids, completions, request.finished, metrics
        )

    def completion(self, index: int, completion: Completion) -> CompletionOutput:
        token_ids = list(completion.token_ids)
        text = self.detokenize(token_ids)
        return CompletionOutput(index, text, token_ids, completion.finish_reason)


# %% [markdown]
# ## Qwen3 end to end
# On a GPU, the real Qwen3-0.6B by Hub id (notebook 02) if the Hub cache holds it or a network can
# fetch it (1.5 GB); else `tiny-text`, notebook 02's tiny model trained on text (random weights
# write gibberish). Greedy text with each request's timings, then `n=3` samples of one prompt
# (completion i seeded `seed + i`).

# %%
from minivllm.checkpoint import write_checkpoint
from minivllm.checks.model_parity import greedy_agreement
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams

prompts = ["What is the capital of France?", "Dear Maria,", "In autumn the leaves"]
path = CHECKPOINTS / "tiny-text"
# notebook 02 wrote it; it is trained once, then kept
if not (path / "model.safetensors").is_file():
    write_checkpoint(path, "tiny-text", seed=0)
real = None
if DEVICE == "cuda":
    try:
        real = LLM("Qwen/Qwen3-0.6B", max_model_len=4096)
    except (OSError, ValueError) as e:  # not in the cache and no network, say
        print(f"tiny-text instead of the real Qwen3-0.6B: {e}")
llm = real or LLM(str(path), max_model_len=1024, max_num_seqs=32, num_kvcache_blocks=256)
texts = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
for out in texts:
    done, metrics = out.outputs[0], out.metrics
    ttft = metrics.time_to_first_token * 1e3
    tpot = metrics.time_per_output_token(len(done.token_ids)) * 1e3
    timings = f"TTFT {ttft:.1f} ms, TPOT {tpot:.2f} ms"
    print(f"{out.prompt!r} -> {done.text!r} ({done.finish_reason}; {timings})")
three = llm.generate(prompts[2], SamplingParams(n=3, seed=0, max_tokens=16), use_tqdm=False)
for c in three[0].outputs:
    print(f"sample {c.index}: {c.text!r}")
# seeds 0, 1, 2: three draws, the same three on every run
assert len({tuple(c.token_ids) for c in three[0].outputs}) == 3
# bfloat16 (notebook 02): transformers' top token given our tokens before it, where rounding cannot
# flip it
if real:
    agreement = greedy_agreement(real.engine.config.model, texts)
    print(f"real Qwen3-0.6B against transformers, teacher forced: {agreement}")
    assert agreement["agreement_clear_cut"] == 1.0

# %% [markdown]
# ### The same tokens as transformers
# Greedy decoding must reproduce transformers' `generate` token for token: prompts of mixed lengths,
# some sharing a cached prefix, in float32 on a CPU (the real model, in bfloat16 on a GPU: above).

# %%
from transformers import AutoModelForCausalLM

# float32, on the CPU even beside a GPU
tiny_path = write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0)
cpu_llm = LLM(str(tiny_path), device="cpu", num_kvcache_blocks=256, max_num_seqs=32)
hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
shared = random.choices(range(2048), k=40)
prompts = [random.choices(range(2048), k=n) for n in (1, 5, 17, 64)]
prompts += [shared + [1, 2], shared + [3]]
greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# the same, for transformers
hf_greedy = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
ours = [out.outputs[0].token_ids for out in cpu_llm.generate(prompts, greedy, use_tqdm=False)]
for prompt, tokens in zip(prompts, ours):
    expected = hf.generate(torch.tensor([prompt]), **hf_greedy)[0, len(prompt) :].tolist()
    assert tokens == expected, (prompt[:5], tokens, expected)
print(f"{len(prompts)} prompts, greedy: identical to transformers' generate")

# %% [markdown]
# ### Bad input is refused, and changes nothing
# An empty prompt, a token id outside the vocabulary, a prompt of `max_model_len` tokens, one bad
# prompt among good ones, an option this engine leaves to a deep dive: each raises a `ValueError`
# naming the field; the call adds no request, and the engine serves on.

# %%
vocab, max_len = cpu_llm.engine.config.hf_config.vocab_size, cpu_llm.engine.config.max_model_len
bad_prompts = [[[]], [[1, 2, vocab]], [[1] * max_len]]
bad_prompts.append([[1, 2, 3], [], [4, 5]])  # one bad prompt among good ones
bad_calls = [(bad, greedy) for bad in bad_prompts] + [([[1, 2]], SamplingParams(stop="."))]
for bad, params in bad_calls:
    try:
        cpu_llm.generate(bad, params, use_tqdm=False)
        raise AssertionError(f"{str(bad)[:30]} was accepted")
    except ValueError as e:
        print(f"{str(bad)[:20]:>20}: {e}")
assert not cpu_llm.engine.has_unfinished_requests()
assert cpu_llm.engine.core.scheduler.block_manager.num_used_blocks == 0
# the engine still serves
after = cpu_llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids
theirs = hf.generate(torch.tensor([[1, 2, 3]]), **hf_greedy)[0, 3:]
assert after == theirs.tolist()

# %% [markdown]
# ## KV blocks over a whole run
# Notebook 03 simulated block occupancy; here is the real engine's, step by step, on 24 requests (a
# third behind a shared system prompt) and 64 KV blocks: blocks in use, free ones holding a cached
# prefix, empty ones; then the steps' `StepStats` added up ("mixed" steps compute waiting prompts
# beside decodes: notebook 05).

# %%
engine = LLM(str(tiny_path), device="cpu", num_kvcache_blocks=64, max_num_seqs=16).engine
scheduler = engine.core.scheduler
bm = scheduler.block_manager
system_prompt = random.choices(range(2048), k=64)
for i in range(24):
    prompt = (system_prompt if i % 3 == 0 else []) + random.choices(
        range(2048), k=random.randint(16, 64)
    )
    engine.add_request(
        prompt, SamplingParams(temperature=0.8, max_tokens=random.randint(8, 40), ignore_eos=True)
    )
occupancy, steps = [], []
while engine.has_unfinished_requests():
    steps.append(engine.step()[1])
    occupancy.append(
        (
            bm.num_used_blocks,
            bm.num_cached_free_blocks,
            bm.num_free_blocks - bm.num_cached_free_blocks,
        )
    )
used, cached, empty = map(list, zip(*occupancy))
fig, ax = plt.subplots(figsize=(8, 3.5), layout="tight")
labels = ["used by running requests", "free, prefix cached", "free"]
ax.stackplot(range(len(used)), used, cached, empty, labels=labels, colors=["C0", "C2", "0.85"])
ax.vlines(
    [i for i, stats in enumerate(steps) if stats.kind != "decode"],
    0,
    bm.num_blocks,
    "C3",
    lw=0.4,
    alpha=0.5,
)
ax.set(
    xlabel="engine step (red lines: steps that compute prompt tokens)",
    ylabel=f"KV blocks (of {bm.num_blocks})",
)
ax.set_title(f"KV block occupancy over a run: 24 requests, {scheduler.num_preemptions} preemptions")
ax.legend(loc="upper right", fontsize=8)
fig.savefig(FIGURES / "06_kv_occupancy.png", dpi=120)
print(f"{len(used)} steps, peak {max(used)} blocks used, {scheduler.num_preemptions} preemptions")
assert bm.num_used_blocks == 0 and max(used) > 0.8 * bm.num_blocks - 1
phases = ("schedule", "run", "postprocess")
for kind in ("prefill", "mixed", "decode"):
    of_kind = [stats for stats in steps if stats.kind == kind]
    seconds = {phase: sum(getattr(s, f"{phase}_seconds") for s in of_kind) for phase in phases}
    times = ", ".join(f"{phase} {t:.3f} s" for phase, t in seconds.items())
    num_tokens = sum(s.num_tokens for s in of_kind)
    print(f"{len(of_kind):4d} {kind} steps: {num_tokens:5,} tokens; {times}")
assert all(
    s.num_seqs > 0 and (s.num_tokens == s.num_seqs if s.kind == "decode" else s.kind != "idle")
    for s in steps
)

# %% [markdown]
# ## The course's final figures
# **FlashAttention (prefill) vs PagedAttention (decode)**, from `python -m
# minivllm.benchmarks.prefill` and `.decode`: prefill is compute-bound (TFLOP/s), decode
# memory-bound (TB/s). **Throughput and latency** per workload and policy, from `python -m
# minivllm.benchmarks.throughput`: nano-vllm's benchmark (256 requests of 100–1024 tokens in and
# out), a chat burst (512 requests sharing a 1,500-token system prompt, also without prefix
# caching), 32 long prompts (10–12k tokens) and a single stream. On a GPU the cell measures again;
# without one it reads the H200 runs in `figures/`.

# %%
from minivllm.benchmarks.decode import plot_decode, run_decode_benchmark
from minivllm.benchmarks.prefill import plot_prefill, run_prefill_benchmark
from minivllm.benchmarks.throughput import describe, plot_throughput, run_throughput_benchmark

figures = Path("figures")
throughput = json.loads((figures / "throughput.json").read_text())
if DEVICE == "cuda":
    llm.close()  # its KV cache holds most of the GPU: give it to the benchmarks
    prefill, decode = run_prefill_benchmark(), run_decode_benchmark()
    now = run_throughput_benchmark(["nano-vllm"], policies=("unified",))
    throughput["rows"].insert(0, {**now["rows"][0], "impl": f"minivllm, now ({now['device']})"})
else:  # the committed H200 runs
    prefill, decode = (
        json.loads((figures / f"{name}.json").read_text()) for name in ("prefill", "decode")
    )
plot_prefill(prefill).savefig(FIGURES / "06_prefill.png", dpi=120)
plot_decode(decode).savefig(FIGURES / "06_decode.png", dpi=120)
plot_throughput(throughput).savefig(FIGURES / "06_throughput.png", dpi=120)
for row in throughput["rows"]:
    print(describe(row))
# an earlier run, same workload
baseline = json.loads((figures / "throughput_vs_transformers.json").read_text())
print(
    "nano-vllm's workload, earlier run:",
    ", ".join(f"{r['impl']} {r['tok_per_s']:,.0f}" for r in baseline["rows"]),
)

# %% [markdown]
# ## Check yourself
# Replace `None` in each `answer = None` with your answer and run the cell; the worked answer
# follows (CPU engine).
#
# **1.** One request, a 10-token prompt with `max_tokens=5`, runs alone in the engine. Which kind of
# step ends its time to first token, and over how many steps is its time per output token averaged?
# Answer `(kind, steps)`.

# %%
from minivllm.testing import check_answer

answer = None  # your answer: replace None with an expression
engine.add_request(
    list(range(10, 20)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
)
kinds, done = [], []  # each step's kind, and when it ended
while not done:
    done, stats = engine.step()
    kinds.append((stats.kind, time.perf_counter()))
timed = done[0].metrics  # arrival, first-token and finish times
# the step that set it
first = next(i for i, (_, end) in enumerate(kinds) if timed.first_token_time <= end)
check_answer(answer, (kinds[first][0], len(kinds) - 1 - first), "1. timings")

# %% [markdown]
# Worked answer: the prefill samples the first token, so TTFT is waiting plus that prefill (the
# queue and the prompt's length set it); each of the other 5 − 1 tokens is one decode step, whose
# time the batch it shares sets.

# %%
expected = (kinds[first][0], len(kinds) - 1 - first)
check_answer(("prefill", 5 - 1), expected, "1. timings")
print(
    f"TTFT {timed.time_to_first_token * 1e3:.1f} ms, TPOT "
    f"{timed.time_per_output_token(5) * 1e3:.1f} ms"
)

# %% [markdown]
# **2.** The green blocks of the occupancy figure are free but keep a cached prefix, among them the
# 64-token system prompt's. A request arrives: the system prompt and 10 tokens. How many does its
# prefill find in the cache?

# %%
answer = None  # your answer: replace None with an expression
greens = bm.num_cached_free_blocks
late = engine.add_request(system_prompt + list(range(10, 20)), greedy)
_, prefill = engine.step()
hits = len(system_prompt) + 10 - prefill.num_tokens  # the prompt less what the prefill computed
check_answer(answer, hits, "2. green blocks")

# %% [markdown]
# Worked answer: 64, the system prompt's 4 full blocks. They turn blue (reference counts 0 → 1); 10
# tokens computed.

# %%
check_answer(64 // 16 * 16, hits, "2. green blocks")
assert bm.num_cached_free_blocks == greens - 4
engine.abort_request([late])
