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
# sampling_params)`, with vLLM's names, arguments and outputs. Under it, vLLM v1's split: an
# `EngineCore` (the scheduler and the runner: `schedule → run → postprocess`, token ids in and out)
# and, around it, `LLMEngine`: an input processor (prompt → checked request) and an output
# processor (tokens → text, stop strings, log-probabilities). It builds on the model (02), the KV
# cache (03), the runner (04) and the scheduler (05).
#
# **What you will see.** The real Qwen3-0.6B (on a GPU), greedy output equal to transformers'
# `generate`, KV blocks over a run, the course's final figures. Splitting the model over GPUs is the
# deep dive `tensor_parallel`, after it.

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
# ids out, no tokenizer (vLLM v1 splits its engine the same way). `add_request` takes a request's
# prompt ids and one `SamplingParams` per completion, `abort_requests` drops requests, `finish`
# ends a completion a front end stopped (a stop string), and `step()` runs one step and says what
# it gave each completion: a `Delta` (new token ids, a finish reason once finished, log-probability
# rows if asked), and the step's `StepStats` (`"idle"` with nothing queued). A step has three
# phases: **schedule** (the scheduler picks the batch), **run** (the runner queues the forward and
# sampler on the GPU, `launch`, then waits for the tokens) and **postprocess** (the scheduler
# appends the tokens and frees what finished; the deltas are made).
#
# **When the model fails** (a device error, Ctrl-C), the step's requests are aborted, their blocks
# freed and dropped from the prefix cache (their KV may be half written); the next `step()` serves
# the others. This core runs one step at a time on notebook 04's eager runner; the deep dives make
# it fast from outside: `async_scheduling` launches step N+1 before it reads step N's tokens (a
# subclass), `tensor_parallel` and `cuda_graphs` bring their runners (`make_runner`), and
# `engine_core` runs the core in a process of its own.

# %% tags=["export"] module="minivllm.engine.core"
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from minivllm.config import Config
from minivllm.engine.model_runner import ModelRunner, StepOutput
from minivllm.engine.scheduler import Scheduler, UnifiedScheduler
from minivllm.engine.sequence import Sequence
from minivllm.layers.sampler import TokenLogprobs
from minivllm.outputs import StepStats
from minivllm.sampling_params import SamplingParams


class Delta(NamedTuple):  # what one completion got in one step: all a front end hears of it
    request_id: str
    completion: int  # which of the request's n completions
    token_ids: list[int]  # its new tokens
    finish_reason: str | None  # set once the core finished it ("stop": an EOS or stop id)
    logprobs: list[TokenLogprobs] | None  # one row per new token, if asked
    # (first position, rows): the prompt positions this step scored, if asked
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None


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
                continue  # aborted, or stopped by its front end, while its step ran
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

    def stats(self) -> dict[str, float]:
        bm = self.scheduler.block_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.num_used_blocks / bm.num_blocks,
        }

    def close(self) -> None:
        self.runner.close()


# %% [markdown]
# ## The engine: an input processor, an output processor and the core
# `LLMEngine` is what `LLM` (below) and a user's own loop drive, with vLLM's names: `add_request`
# tokenizes and checks a request (the **input processor**, below) and hands the core its token ids;
# `step()` runs a core step and turns its deltas into text, stop strings and `RequestOutput`s (the
# **output processor**, below); it returns the requests that finished and the step's stats. A stop
# string is found here, where the text is: the engine tells the core to `finish` that completion.
# The server's `AsyncLLM` (deep dive `engine_core`) is the same two processors around the same core,
# run in a process of its own.

# %% tags=["export"] module="minivllm.engine.llm_engine"
import threading
import time
from collections.abc import Collection, Iterable
from pathlib import Path

from minivllm.config import Config
from minivllm.engine.core import Delta, EngineCore
from minivllm.engine.input_processor import InputProcessor, Prompt, load_tokenizer
from minivllm.engine.output_processor import OutputProcessor
from minivllm.outputs import RequestOutput, StepStats
from minivllm.sampling_params import SamplingParams


class LLMEngine:
    """Requests in, steps, outputs out. Thread-safe: one lock serialises every call that changes the
    engine."""

    def __init__(self, model: str | Path, **kwargs):
        self.config = self.make_config(model, **kwargs)
        self.tokenizer = load_tokenizer(self.config.tokenizer)
        self.core = self.make_core()
        num_blocks = self.core.scheduler.block_manager.num_blocks
        self.input_processor = InputProcessor(self.config, self.tokenizer, num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.finished: list[RequestOutput] = []  # not returned yet (a step given request_ids)
        self.lock = threading.RLock()  # reentrant: LLM.generate holds it while it steps

    def make_config(self, model: str | Path, **kwargs) -> Config:
        return Config(model, **kwargs)

    def make_core(self) -> EngineCore:
        return EngineCore(self.config)

    def add_requests(
        self,
        prompts: list[Prompt],
        sampling_params: list[SamplingParams | None],
        request_ids: list[str | None] | None = None,
    ) -> list[str]:
        """Check every request, then queue them all: if one is bad, ValueError and none is queued.
        Their ids."""
        with self.lock:
            ids = self.input_processor.request_ids(
                request_ids or [None] * len(prompts), self.in_use
            )
            names = (
                [f"prompts[{i}]" for i in range(len(prompts))] if len(prompts) > 1 else ["prompt"]
            )
            make = self.input_processor.make_request
            requests = [
                make(*args) for args in zip(prompts, sampling_params, ids, names, strict=True)
            ]
            for request in requests:
                self.output_processor.add(request)
                self.core.add_request(request.request_id, request.prompt_token_ids, request.params)
            return ids

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
        """Drop these requests, unfinished or finished but not returned yet; free their blocks."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        with self.lock:
            self.core.abort_requests(ids)
            self.output_processor.abort(ids)
            self.finished = [out for out in self.finished if out.request_id not in ids]

    def step(
        self, request_ids: Collection[str] | None = None
    ) -> tuple[list[RequestOutput], StepStats]:
        """One core step: the outputs of the requests that finished (only those in request_ids when
        given: the others are kept for a later step) and the step's stats."""
        with self.lock:
            try:
                deltas, stats = self.core.step()
            except BaseException:  # the core aborted the step's requests: forget them here too
                lost = set(self.output_processor.requests) - set(self.core.requests)
                self.output_processor.abort(lost)
                raise
            if deltas:
                self.process(deltas, stats)
            if request_ids is None:
                mine, self.finished = self.finished, []
            else:
                mine = [out for out in self.finished if out.request_id in request_ids]
                self.finished = [out for out in self.finished if out.request_id not in request_ids]
            return mine, stats

    def process(self, deltas: list[Delta], stats: StepStats) -> None:
        """Text, stop strings and outputs from a step's deltas (its time counts as postprocess)."""
        start = time.perf_counter()
        requests, stopped = self.output_processor.process(deltas, start)
        for request_id, index in stopped:  # a stop string: the core frees that completion
            self.core.finish(request_id, index)
        self.finished += [self.output_processor.output(r) for r in requests if r.finished]
        stats.postprocess_seconds += time.perf_counter() - start

    def has_unfinished_requests(self) -> bool:
        """Whether step() has more to give: requests to run, a step to finish, kept outputs."""
        return bool(self.finished) or self.core.has_unfinished_requests()

    def abort_all(self) -> None:
        """Drop every request and kept output; the scheduler resets its block manager."""
        with self.lock:
            self.core.abort_all()
            self.output_processor.abort(set(self.output_processor.requests))
            self.finished.clear()

    def close(self) -> None:
        self.core.close()


# %% [markdown]
# ## `LLM.generate`: the loop, for a user
# `LLM(model, ...)` takes notebook 02's `Config` fields as keyword arguments. `generate` accepts a
# str, token ids (a list of ints, a 1-D integer array or tensor) or a list of those, with one
# `SamplingParams` for all or one per prompt, and returns the outputs in the prompts' order; `chat`
# does the same for conversations, through the chat template. It holds the engine's lock for its
# whole run and returns only its own requests: those queued with `engine.add_request` share its
# batches, their outputs kept for `engine.step()`; interrupted (Ctrl-C, an error), it aborts every
# request it added. A server streams instead: `AsyncLLM` runs this engine in a process of its own
# and makes the text in the server's (deep dive `engine_core`), and `python -m minivllm.serve` puts
# OpenAI's HTTP API in front.

# %% tags=["export"] module="minivllm.llm"
from collections.abc import Sequence as SequenceOf
from typing import Self, TypeGuard, cast

from tqdm.auto import tqdm

from minivllm.engine.input_processor import Prompt
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams, scalar


def is_one_prompt(prompts) -> TypeGuard[Prompt]:
    """A str, an array or tensor, or a list of token ids (not a list of prompts)."""
    if isinstance(prompts, str) or hasattr(prompts, "ndim"):
        return True
    return (
        isinstance(prompts, list | tuple)
        and len(prompts) > 0
        and isinstance(scalar(prompts[0]), int | float)
    )


def chat_prompt(tokenizer, conversation, model, template_kwargs: dict | None = None) -> str:
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{model} has no chat template: pass prompts to generate instead")
    if bad := [
        i
        for i, m in enumerate(conversation)
        if not isinstance(m, dict) or not {"role", "content"} <= m.keys()
    ]:
        raise ValueError(
            f'messages[{bad[0]}] must be a dict with "role" and "content", got '
            f"{conversation[bad[0]]!r}"
        )
    kwargs = template_kwargs or {}  # the template's own switches: Qwen3's enable_thinking, say
    return tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True, **kwargs
    )


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
        """One output per prompt, in order. Only this call's requests are returned (see the
        notebook's contract)."""
        prompts = [prompts] if is_one_prompt(prompts) else prompts
        if not isinstance(prompts, list | tuple):
            raise ValueError(
                f"prompts must be a str, token ids, or a list of them; got {type(prompts).__name__}"
            )
        params = (
            sampling_params
            if isinstance(sampling_params, list | tuple)
            else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
            )
        with self.engine.lock:
            before = self.engine.request_ids()
            # casts: a list of prompts and their SamplingParams (or None) now; add_requests checks
            # each
            try:
                ids = self.engine.add_requests(
                    cast(list[Prompt], list(prompts)), cast(list, list(params))
                )
                outputs = self.run(ids, use_tqdm)
            except (
                BaseException
            ):  # Ctrl-C or an error, even half-way through add_requests: abort all it added
                self.engine.abort_request(self.engine.request_ids() - before)
                raise
        order = {request_id: i for i, request_id in enumerate(ids)}
        return sorted(outputs, key=lambda out: order[out.request_id])

    def run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until these requests have finished; their outputs."""
        outputs: list[RequestOutput] = []
        wanted = set(request_ids)
        with tqdm(
            total=len(wanted), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        ) as bar:
            rates: dict[str, float] = {}  # tokens per second of the latest step of each kind
            while len(outputs) < len(wanted):
                finished, stats = self.engine.step(wanted)
                assert stats.kind != "idle" or finished, "requests outstanding, but no step to run"
                if stats.kind != "idle":
                    rates[stats.kind] = stats.num_tokens / max(stats.seconds, 1e-9)
                speeds = [f"{kind} {rate:,.0f} tok/s" for kind, rate in sorted(rates.items())]
                bar.set_postfix_str(", ".join(speeds))
                outputs += finished
                bar.update(len(finished))
        return outputs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params=None,
        use_tqdm=True,
        chat_template_kwargs=None,
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

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# %% [markdown]
# ## vLLM's offline API: what goes in, what comes out
# Three modules: what a request gives back (`outputs`), how a prompt gets in (`input_processor`),
# how tokens come out as text (`output_processor`). **Outputs** are vLLM's `RequestOutput`: the
# prompt and, per completion, its text, token ids, `finish_reason` ("stop": an EOS or stop token;
# "length": `max_tokens` or the context) and log-probabilities if asked; and two timings a server is
# judged by: **time to first token** (TTFT) and **time per output token** (TPOT).

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
    logprobs: list[dict[int, Logprob]] | None = (
        None  # per token: its own and the most likely tokens' (if asked)
    )
    cumulative_logprob: float | None = (
        None  # the sum of its tokens' log-probabilities (if logprobs were asked)
    )


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
    run_seconds: float = (
        0.0  # ModelRunner.launch (inputs, forward, sampler, log-probabilities), waiting for tokens
    )
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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = (
        None  # per prompt token (None for the first), if asked
    )


# %% [markdown]
# A front end (the engine, or the server's `AsyncLLM`) keeps each request as a `Request`: the
# prompt, and one `Completion` per sample with the tokens the core has reported and its text so far.
# The core keeps its own `Sequence`s; the two share only request ids and token ids.

# %% tags=["export"] module="minivllm.engine.request"
from dataclasses import dataclass, field

from minivllm.outputs import Logprob, RequestMetrics
from minivllm.sampling_params import SamplingParams


@dataclass(slots=True)
class Completion:
    """A front end's view of one of a request's n completions: its tokens and its text so far."""

    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length" once finished
    text_end: int | None = None  # where its text ends, if a stop string ended it
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # one per token, if asked
    running: tuple[str, int, int] = ("", 0, 0)  # see OutputProcessor.running_text

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
# state, with a `ValueError` naming the field and the allowed range; each request keeps its own copy
# of its `SamplingParams`, and `add_requests` checks a whole list before adding any. The scheduler
# only `assert`s. **Stop tokens**: a model's EOS ids (the tokenizer's and
# `generation_config.json`'s) join each request's stop tokens unless it says `ignore_eos`. **n
# completions**: `n` makes a `SamplingParams` per completion (seeded `seed + i`); the core runs a
# sequence for each, and they share the first one's cached prompt.

# %% tags=["export"] module="minivllm.engine.input_processor"
import dataclasses
import json
import time
from collections.abc import Callable
from itertools import count
from pathlib import Path

import transformers
from transformers import GenerationConfig, PreTrainedTokenizerBase

from minivllm.config import Config
from minivllm.engine.request import Completion, Request
from minivllm.outputs import RequestMetrics
from minivllm.sampling_params import SamplingParams, as_token_ids

# text, or token ids: a list or tuple of ints, or a 1-D integer NumPy array / PyTorch tensor
Prompt = str | list[int]


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer, or None when the folder has none (token-id prompts still work).
    transformers may build an empty tokenizer from a folder without tokenizer files: one that knows
    only special tokens is none."""
    named = (
        json.loads(p.read_text()) if (p := Path(path) / "tokenizer_config.json").is_file() else {}
    )
    name = (
        "AutoTokenizer" if "auto_map" in named else named.get("tokenizer_class") or "AutoTokenizer"
    )
    # the class named, imported alone: AutoTokenizer imports transformers' model registry (seconds)
    try:
        tokenizer = (
            getattr(transformers, name, None) or transformers.AutoTokenizer
        ).from_pretrained(path)
    except (OSError, ValueError):
        return None
    return tokenizer if set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens) else None


def eos_token_ids(
    path: str | Path, tokenizer: PreTrainedTokenizerBase | None, hf_config
) -> list[int]:
    """Every end-of-sequence id: the tokenizer's first, then generation_config.json's, then
    config.json's."""
    ids = (
        [tokenizer.eos_token_id]
        if tokenizer is not None and tokenizer.eos_token_id is not None
        else []
    )
    try:
        extra = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        extra = getattr(hf_config, "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra] if extra is not None else []
    return list(dict.fromkeys(ids))


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per completion (vLLM's rule): seed + i, prompt logprobs asked of
    completion 0 only."""
    seeds = [None if params.seed is None else params.seed + i for i in range(params.n)]
    prompt_logprobs = [params.prompt_logprobs] + [None] * (params.n - 1)
    return [
        dataclasses.replace(params, n=1, seed=s, prompt_logprobs=p)
        for s, p in zip(seeds, prompt_logprobs)
    ]


class InputProcessor:
    """Prompts in, checked `Request`s out; it changes nothing (the engine queues what it
    returns)."""

    def __init__(self, config: Config, tokenizer: PreTrainedTokenizerBase | None, num_blocks: int):
        self.config, self.tokenizer, self.num_blocks = config, tokenizer, num_blocks
        self.eos_token_ids = eos_token_ids(config.model, tokenizer, config.hf_config)
        self.counter = count()  # request ids the engine hands out

    def tokenize(self, prompt: Prompt, name: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{name} is text, but {self.config.model} has no tokenizer: pass token ids"
                )
            return self.tokenizer.encode(prompt)
        return as_token_ids(prompt, name)

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
        # the sampler indexes by them
        if bad := [t for t in params.stop_token_ids if not 0 <= t < vocab_size]:
            raise ValueError(
                f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"stop strings need a tokenizer, and {config.model} has none: use stop_token_ids"
            )

    def request_params(self, params: SamplingParams | None) -> SamplingParams:
        """The request's own copy of params, with every EOS id (`replace` runs the checks again:
        fields may change)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)
        eos = [] if params.ignore_eos else self.eos_token_ids
        return dataclasses.replace(
            params, stop_token_ids=list(dict.fromkeys([*params.stop_token_ids, *eos]))
        )

    def request_ids(
        self, request_ids: list[str | None], in_use: Callable[[str], bool]
    ) -> list[str]:
        """The given ids, checked to be strings neither in use (by live requests) nor repeated; None
        gets the next unused number."""
        ids: dict[str, None] = {}  # in order
        for request_id in request_ids:
            if request_id is None:
                request_id = next(
                    i for i in map(str, self.counter) if not in_use(i) and i not in ids
                )
            elif not isinstance(request_id, str):
                raise ValueError(
                    f"request_id must be a str, got {request_id!r} ({type(request_id).__name__})"
                )
            elif in_use(request_id) or request_id in ids:
                raise ValueError(
                    f"request_id {request_id!r} is already in use by an unfinished request"
                )
            ids[request_id] = None
        return list(ids)

    def make_request(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str, name: str
    ) -> Request:
        """Tokenize and check one request."""
        params = self.request_params(params)
        token_ids = self.tokenize(prompt, name)
        self.check_request(token_ids, params)
        samples = sample_params(params)
        completions = [Completion(p) for p in samples]
        text = prompt if isinstance(prompt, str) else None
        metrics = RequestMetrics(time.perf_counter())
        return Request(request_id, text, token_ids, samples, completions, metrics)


# %% [markdown]
# ### Outputs out: the output processor
# It keeps each request as the front end sees it (`Request`, one `Completion` per sample) and turns
# the core's deltas into what a user reads. Stop *strings* are found here, not in the scheduler (it
# sees only token ids): after each step it detokenizes the replies that have one, after their first
# `min_tokens` tokens, and a reply holding one ends with reason `"stop"` (the core is told).
# While a reply runs, `running_text` detokenizes its newest tokens only and holds back what could
# begin a stop string. It also keeps each token's log-probabilities, and gathers a request's n
# completions into one `RequestOutput`.

# %% tags=["export"] module="minivllm.engine.output_processor"
from collections.abc import Iterable
from typing import cast

from transformers import PreTrainedTokenizerBase

from minivllm.engine.core import Delta
from minivllm.engine.request import Completion, Request
from minivllm.layers.sampler import TokenLogprobs
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput


class OutputProcessor:
    """The core's deltas in, what a user reads out: text, stop strings, log-probabilities,
    `RequestOutput`s."""

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

    def process(
        self, deltas: Iterable[Delta], now: float
    ) -> tuple[list[Request], list[tuple[str, int]]]:
        """A step's deltas: the requests they touched (a finished one is forgotten here), and the
        completions a stop string ended, (request_id, index), which the core must finish."""
        touched: dict[str, Request] = {}
        stopped = []
        for delta in deltas:
            if (request := self.requests.get(delta.request_id)) is None:
                continue  # aborted
            touched[request.request_id] = request
            completion = request.completions[delta.completion]
            self.record_prompt_logprobs(request, delta.prompt_logprobs)
            if self.append(request, completion, delta, now):
                stopped.append((request.request_id, delta.completion))
            if delta.finish_reason is not None and not completion.is_finished:
                completion.finish_reason = delta.finish_reason
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
        return list(touched.values()), stopped

    def append(self, request: Request, completion: Completion, delta: Delta, now: float) -> bool:
        """Append a delta's tokens (those before a stop string: the core's later ones are dropped);
        whether a stop string ended the completion."""
        for k, token_id in enumerate(delta.token_ids):
            if completion.is_finished:
                return False
            completion.token_ids.append(token_id)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if delta.logprobs is not None:
                completion.logprobs.append(self.logprobs(delta.logprobs[k]))
            if completion.params.stop and self.find_stop(completion):
                completion.finish_reason = "stop"
                return True
        return False

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
        """The request's output so far (finished, if every completion is)."""
        first = request.params[0]
        prompt_logprobs = None if first.prompt_logprobs is None else list(request.prompt_logprobs)
        completions = [self.completion(i, c) for i, c in enumerate(request.completions)]
        prompt, ids, metrics = request.prompt, request.prompt_token_ids, request.metrics
        finished = request.finished
        return RequestOutput(
            request.request_id, prompt, ids, completions, finished, metrics, prompt_logprobs
        )

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


# %% [markdown]
# ## Qwen3 end to end
# On a GPU, the real Qwen3-0.6B by Hub id (notebook 02) if the Hub cache holds it or a network can
# fetch it (1.5 GB); else `tiny-text`, notebook 02's tiny model trained on text (random weights
# write gibberish). Greedy text, a stop string, a chat (Qwen3 thinks first unless
# `enable_thinking=False`), `n=3` samples (completion i seeded `seed + i`).

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
    ttft, tpot = (
        metrics.time_to_first_token * 1e3,
        metrics.time_per_output_token(len(done.token_ids)) * 1e3,
    )
    print(
        f"{out.prompt!r} -> {done.text!r} ({done.finish_reason}; TTFT {ttft:.1f} ms, TPOT "
        f"{tpot:.2f} ms)"
    )
stopped = llm.generate(
    prompts[0], SamplingParams(temperature=0, max_tokens=24, stop="."), use_tqdm=False
)[0].outputs[0]
print(f"with stop='.': {stopped.text!r}, finish_reason={stopped.finish_reason}")
first = texts[0].outputs[0].text  # a stop string ends the text before it, with reason "stop"
assert (stopped.text, stopped.finish_reason) == (
    first.split(".")[0],
    "stop" if "." in first else "length",
)
chat, greedy_40 = (
    [{"role": "user", "content": prompts[0]}],
    SamplingParams(temperature=0, max_tokens=40),
)
# the chat template's switch: Qwen3 writes <think>...</think> first, or not
for thinking in (True, False):
    reply = llm.chat(
        chat, greedy_40, use_tqdm=False, chat_template_kwargs={"enable_thinking": thinking}
    )[0]
    print(f"chat, enable_thinking={thinking}: {reply.outputs[0].text!r}")
three = llm.generate(
    prompts[2], SamplingParams(n=3, seed=0, max_tokens=16, logprobs=2), use_tqdm=False
)[0].outputs
# each token's row: {token id: Logprob(logprob, rank, decoded_token)}, its own first
for c in three:
    print(
        f"sample {c.index}: {c.text!r}, log-probability {c.cumulative_logprob:.1f}; first token: "
        f"{c.logprobs[0]}"
    )
# seeds 0, 1, 2: three draws, the same three on every run
assert len({tuple(c.token_ids) for c in three}) == 3
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
# Async scheduling is on: on a CPU nothing runs ahead, but all its code runs.

# %%
from transformers import AutoModelForCausalLM

# float32, on the CPU even beside a GPU
tiny_path = write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0)
cpu_llm = LLM(
    str(tiny_path), device="cpu", num_kvcache_blocks=256, max_num_seqs=32, async_scheduling=True
)
hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
shared = random.choices(range(2048), k=40)
prompts = [random.choices(range(2048), k=n) for n in (1, 5, 17, 64)] + [
    shared + [1, 2],
    shared + [3],
]
greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# the same, for transformers
hf_greedy = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
ours = [out.outputs[0].token_ids for out in cpu_llm.generate(prompts, greedy, use_tqdm=False)]
for prompt, tokens in zip(prompts, ours):
    expected = hf.generate(torch.tensor([prompt]), **hf_greedy)[0, len(prompt) :].tolist()
    assert tokens == expected, (prompt[:5], tokens, expected)
print(f"{len(prompts)} prompts, greedy: identical to transformers' generate")
scored = cpu_llm.generate(
    prompts[3], SamplingParams(temperature=0, prompt_logprobs=0), use_tqdm=False
)[0]
with torch.no_grad():  # transformers' log-probability of each prompt token after the first
    logits = hf(torch.tensor([prompts[3]])).logits[0, :-1]
    want = torch.log_softmax(logits, -1)[range(63), prompts[3][1:]]
rows = zip(scored.prompt_logprobs[1:], prompts[3][1:])
got = torch.tensor([row[t].logprob for row, t in rows])
torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

# %% [markdown]
# ### Bad input is refused, and changes nothing
# An empty prompt, a token id outside the vocabulary, a prompt of `max_model_len` tokens, one bad
# prompt among good ones: each raises a `ValueError` naming the field; the call adds no request, and
# the engine serves on.

# %%
vocab, max_len = cpu_llm.engine.config.hf_config.vocab_size, cpu_llm.engine.config.max_model_len
bad_prompts = [[[]], [[1, 2, vocab]], [[1] * max_len]]
bad_prompts.append([[1, 2, 3], [], [4, 5]])  # one bad prompt among good ones
for bad in bad_prompts:
    try:
        cpu_llm.generate(bad, greedy, use_tqdm=False)
        raise AssertionError(f"{str(bad)[:30]} was accepted")
    except ValueError as e:
        print(f"{str(bad)[:20]:>20}: {e}")
assert (
    not cpu_llm.engine.has_unfinished_requests()
    and cpu_llm.engine.core.scheduler.block_manager.num_used_blocks == 0
)
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
from minivllm.benchmarks.workloads import workload

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
# How far is that from the hardware's limit? Every decode step reads all the weights once, and each
# running request's whole KV cache: add it up over the workload and divide by the copy bandwidth
# notebook 03 measured. The benchmark does this for every workload (the % labels above; it counts
# FLOPs too, and a prefix all requests share once a step).

# %%
from minivllm.checkpoint.maker import preset_config
from minivllm.models.qwen3 import Qwen3ForCausalLM

qwen = preset_config("qwen3-0.6b")
with torch.device("meta"):  # shapes only: count the parameters without allocating them
    num_params = sum(p.numel() for p in Qwen3ForCausalLM(qwen).parameters())
# K and V, bf16
kv_bytes_per_token = 2 * qwen.num_hidden_layers * qwen.num_key_value_heads * qwen.head_dim * 2
prompts, output_lens = workload(256)
kv_reads = kv_bytes_per_token * sum(
    len(p) + t for p, n in zip(prompts, output_lens) for t in range(1, n)
)
weight_reads = num_params * 2 * (max(output_lens) - 1)  # bf16 weights, once per decode step
roofline = sum(output_lens) / ((kv_reads + weight_reads) / (decode["copy_tbps"] * 1e12))
key = ("nano-vllm", "unified", "minivllm")
rows = {(r["workload"], r["policy"], r["impl"]): r for r in throughput["rows"]}
ours = rows[key]
print(
    f"KV reads {kv_reads / 1e12:.1f} TB + weights {weight_reads / 1e12:.1f} TB at "
    f"{decode['copy_tbps']:.2f} TB/s"
)
print(f"at most {roofline:,.0f} tok/s; minivllm reaches {ours['tok_per_s'] / roofline:.0%} of it")
# at this batch size the KV cache, not the weights, is what decode reads
assert kv_reads > 10 * weight_reads
# the benchmark's roofline (FLOPs too) agrees
assert abs(roofline / ours["roofline_tok_per_s"] - 1) < 0.05

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
    list(range(10, 20)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), "timed"
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
engine.add_request(system_prompt + list(range(10, 20)), greedy, "late")
_, prefill = engine.step()
hits = len(system_prompt) + 10 - prefill.num_tokens  # the prompt less what the prefill computed
check_answer(answer, hits, "2. green blocks")

# %% [markdown]
# Worked answer: 64, the system prompt's 4 full blocks. They turn blue (reference counts 0 → 1); 10
# tokens computed.

# %%
check_answer(64 // 16 * 16, hits, "2. green blocks")
assert bm.num_cached_free_blocks == greens - 4
engine.abort_request("late")
