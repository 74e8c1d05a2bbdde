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
# # Deep dive · The engine core in its own process
#
# **What this adds.** `AsyncLLM`, the engine behind the OpenAI server (`python -m minivllm.serve`),
# runs the engine core (schedule → forward → sample, notebook 06's loop) in a process of its own, as
# vLLM v1 does. The server's process keeps the text: it tokenizes prompts, detokenizes tokens, looks
# for stop strings and builds the replies. The two talk over a socket, one small message per step.
#
# **Where it sits.** It follows notebook 06 (the engine loop and `LLM.generate`). Nothing in the
# core path needs it: the offline `LLM` runs its engine in its own process, as before. This deep
# dive exports `minivllm.engine.core`; `minivllm/async_llm.py` (hand-written, with the server) is
# its other end.
#
# **What you will see.** Why one process is not enough (measured on this machine), what crosses the
# socket, the core's loop, the same tokens as `LLM.generate` through the process, a killed core
# reported at once, and the server's throughput with the core on a thread and in a process, measured
# on an H200.

# %%
import asyncio
import os
import pickle
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pipe
from pathlib import Path

from minivllm import LLM, SamplingParams
from minivllm.checkpoint import write_checkpoint

FIGURES_IN_REPO = Path("../figures").resolve()
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../../build/checkpoints")).resolve()
path = CHECKPOINTS / "tiny-text"
# notebook 02 wrote it; training it again takes half a minute
if not (path / "model.safetensors").is_file():
    write_checkpoint(path, "tiny-text", seed=0)
config = dict(max_model_len=512)

# %% [markdown]
# ## One process, one GIL, two jobs
# A server does two kinds of work. The engine's: schedule, launch the GPU step, read the sampled
# tokens, a busy loop. The server's: parse HTTP and JSON, tokenize prompts, turn every new token
# into text, look for stop strings, write server-sent events. Both are Python, and in one process
# Python runs one thread at a time (the GIL). While the server's threads build replies, the engine
# cannot launch its next step, and the GPU waits.
#
# How much text work is there per step? The cell below times notebook 06's `OutputProcessor`
# building a running reply for a batch of 256 requests, one new token each, as a step's outputs
# need, on this machine.

# %%
llm = LLM(str(path), **config)
engine, processor = llm.engine, llm.engine.output_processor
reply_ids = engine.tokenizer.encode(
    " and the garden was full of roses, light and quiet birds in the morning"
)[:16]
params = SamplingParams(max_tokens=16)
requests = [
    engine.input_processor.make_request("Once upon a time", params, str(i), "p") for i in range(256)
]
start = time.perf_counter()
for token_id in reply_ids:  # each step: one token more for every request, and its output built
    for request in requests:
        request.seqs[0].append_token(token_id)
        processor.output(request, False)
per_step_ms = (time.perf_counter() - start) / len(reply_ids) * 1e3
print(f"text for 256 requests: {per_step_ms:.1f} ms of Python per step, on this machine")

# %% [markdown]
# A decode step of Qwen3-0.6B for 256 requests takes about 7 ms on an H200
# (`../figures/throughput.json`: TPOT p50 6.4 ms). Compare it with the figure above: in one process
# the GIL would add those milliseconds to every step, on top of HTTP and JSON. In two processes, the
# engine's step and the server's text run at the same time.

# %% [markdown]
# ## What crosses the socket
# The API process tokenizes a prompt once and sends the core its token ids and `SamplingParams`
# (stop strings left out: the core knows no text). After every step the core answers with a `Delta`
# per completion that got tokens: the new token ids, a finish reason when the core finished it (an
# EOS or stop id, or `max_tokens`), and the log-probability rows if asked. That is all it sends.

# %%
# %% tags=["export"] module="minivllm.engine.core"
import dataclasses
import signal
import time
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.output_processor import OutputProcessor
from minivllm.layers.sampler import TokenLogprobs
from minivllm.outputs import Logprob, RequestOutput


class Delta(NamedTuple):  # what one completion got in one step: all that crosses the socket for it
    request_id: str
    completion: int  # which of the request's n completions
    token_ids: list[int]  # its new tokens
    finish_reason: str | None  # set once the core finished it ("stop": an EOS or stop id; "length")
    logprobs: list[TokenLogprobs] | None  # one row per new token, if asked
    # (first position, rows), once the prompt is scored
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None


def rows(logprobs: list[dict[int, Logprob]]) -> list[TokenLogprobs]:
    return [{token: (lp.logprob, lp.rank) for token, lp in row.items()} for row in logprobs]


# %% [markdown]
# ## The core: an engine that speaks token ids
# `EngineCore` is notebook 06's `LLMEngine` with its `OutputProcessor` given no tokenizer: no text
# is made in the core. `handle` applies one message from the API process: add a request, abort some,
# or finish one completion that a stop string ended (the API process found it in the text). `step`
# runs one engine step and collects the deltas from the batch that ran (`scheduler.running`), never
# from the whole queue: with thousands of requests waiting, a walk over all of them every step would
# cost more than the step. `run` is the busy loop: take every message waiting, step if there is
# work, send what the step gave; idle, wait for a message, saying "alive" once a second so the API
# process can tell a quiet core from a hung one.


# %%
# %% tags=["export"] module="minivllm.engine.core"
class EngineCore:
    """An `LLMEngine` that takes token ids and gives token ids: no tokenizer, no text, no stop
    strings (the API process does those). `handle` takes one message from the API process; `step`
    runs one step and says what each completion got."""

    def __init__(self, model: str, **kwargs):
        self.engine = LLMEngine(model, **kwargs)
        self.engine.output_processor = OutputProcessor(None)  # no detokenizing here
        # request id -> tokens sent per completion, while it runs here
        self.sent: dict[str, list[int]] = {}
        self.prompt_sent: dict[str, int] = {}  # request id -> prompt logprob rows sent

    def handle(self, message: tuple) -> list[tuple]:
        """Apply one message: ("add", id, token ids, params), ("abort", ids) or ("finish", id,
        index): a stop string ended that completion. What to answer (a request the engine refused
        fails)."""
        kind, *args = message
        if kind == "add":
            request_id, token_ids, params = args
            try:
                self.engine.add_request(token_ids, dataclasses.replace(params, stop=[]), request_id)
            except ValueError as e:
                return [("failed", [request_id], str(e))]
            self.sent[request_id], self.prompt_sent[request_id] = [0] * params.n, 0
        elif kind == "abort":
            self.engine.abort_request(args[0])
            for request_id in args[0]:
                self.forget(request_id)
        elif kind == "finish":
            self.finish(*args)
        return []

    def finish(self, request_id: str, index: int) -> None:
        """Completion `index` hit a stop string (its request's others run on)."""
        if (request := self.engine.live.get(request_id)) is not None:
            self.engine.scheduler.finish(request.seqs[index], "stop")

    def forget(self, request_id: str) -> None:
        self.sent.pop(request_id, None)
        self.prompt_sent.pop(request_id, None)

    def step(self) -> list[Delta]:
        """One step; a Delta for each completion that got tokens or finished."""
        finished, _ = self.engine.step()
        deltas = [d for out in finished for d in self.finished_deltas(out)]
        # only those can have new tokens: O(batch), not O(queue)
        for seq in self.engine.scheduler.running:
            request = self.engine.requests[seq.seq_id]
            i, sent = request.seqs.index(seq), self.sent[request.request_id]
            if seq.num_completion_tokens > sent[i]:
                logprobs = request.logprobs.get(i)
                new = rows(logprobs[sent[i] :]) if logprobs is not None else None
                token_ids = seq.completion_token_ids[sent[i] :]
                deltas.append(
                    Delta(request.request_id, i, token_ids, None, new, self.prompt(request))
                )
                sent[i] = seq.num_completion_tokens
        return deltas

    def finished_deltas(self, out: RequestOutput) -> list[Delta]:
        sent, deltas = self.sent[out.request_id], []
        for c in out.outputs:
            logprobs = rows(c.logprobs[sent[c.index] :]) if c.logprobs is not None else None
            prompt = None
            if out.prompt_logprobs is not None and not self.prompt_sent[out.request_id]:
                # row 0 is None
                prompt = (1, rows(out.prompt_logprobs[1:]))  # type: ignore[arg-type]
                self.prompt_sent[out.request_id] = 1
            token_ids = c.token_ids[sent[c.index] :]
            deltas.append(
                Delta(out.request_id, c.index, token_ids, c.finish_reason, logprobs, prompt)
            )
        self.forget(out.request_id)
        return deltas

    def prompt(self, request) -> tuple[int, list[TokenLogprobs]] | None:
        """The prompt's log-probability rows, once, when the prompt is scored."""
        wanted = request.seqs[0].sampling_params.prompt_logprobs is not None
        if (
            not wanted
            or self.prompt_sent[request.request_id]
            or len(request.prompt_logprobs) < len(request.prompt_token_ids)
        ):
            return None
        self.prompt_sent[request.request_id] = 1
        return 1, rows(request.prompt_logprobs[1:])

    def lost(self) -> list[str]:
        """After a failed step: the requests the engine aborted."""
        lost = [request_id for request_id in self.sent if not self.engine.in_use(request_id)]
        for request_id in lost:
            self.forget(request_id)
        return lost

    def stats(self) -> dict[str, float]:
        scheduler = self.engine.scheduler
        bm = scheduler.block_manager
        return {
            "num_requests_running": len(scheduler.running),
            "num_requests_waiting": len(scheduler.waiting),
            "kv_cache_usage": bm.num_used_blocks / bm.num_blocks,
        }

    def run(self, conn: Connection, heartbeat: float = 1.0) -> None:
        """The busy loop: take every message waiting, step if there is work, send what the step
        gave. Idle, wait for a message (saying "alive" every `heartbeat` seconds). Ends on
        ("shutdown",) or when the API process is gone (its end of the socket closed)."""
        last = time.monotonic()
        while True:
            busy = self.engine.has_unfinished_requests()
            while conn.poll(0 if busy else heartbeat):
                message = conn.recv()
                if message[0] == "shutdown":
                    return
                for answer in self.handle(message):
                    conn.send(answer)
                busy = self.engine.has_unfinished_requests()
            if busy:
                try:
                    deltas = self.step()
                except (
                    Exception
                ) as e:  # the engine aborted that step's requests: their callers get the error
                    conn.send(("failed", self.lost(), f"the step failed ({e})"))
                    continue
                # plain tuples pickle 5x faster
                conn.send(("step", [tuple(d) for d in deltas], self.stats()))
                last = time.monotonic()
            elif time.monotonic() - last >= heartbeat:
                conn.send(("alive", self.stats()))
                last = time.monotonic()


# %% [markdown]
# The process's entry point loads the engine and says "ready" (or sends the exception that stopped
# it, so the server prints the same one-line error as before). Ctrl-C belongs to the API process: it
# stops the core by message; if the API process dies, the core's end of the socket closes and the
# core exits too, so no process is left behind.


# %%
# %% tags=["export"] module="minivllm.engine.core"
def run_core(conn: Connection, model: str, kwargs: dict[str, Any]) -> None:
    """The engine core process: load the engine, say ("ready", config, number of KV blocks) or
    ("error", exception), then serve messages until shutdown. Ctrl-C is the API process's to handle:
    it stops the core."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        core = EngineCore(model, **kwargs)
    except BaseException as e:
        conn.send(("error", e))
        return
    conn.send(("ready", core.engine.config, core.engine.scheduler.block_manager.num_blocks))
    serve_core(conn, core)


def serve_core(conn: Connection, core: EngineCore) -> None:
    """Run the core until shutdown or until the API process is gone (its end of the socket
    closed)."""
    try:
        core.run(conn)
    except (EOFError, OSError):
        pass
    finally:
        core.engine.close()
        conn.close()


# %% [markdown]
# ## The core alone: the same tokens as `LLM.generate`
# Before any process: drive an `EngineCore` by hand, one message in, deltas out, and rebuild each
# completion from its deltas.

# %%
from minivllm.engine.core import EngineCore

core = EngineCore(str(path), **config)
prompt_ids = engine.tokenizer.encode("The Earth is about")
core.handle(("add", "a", prompt_ids, SamplingParams(temperature=0, max_tokens=12)))
tokens: list[int] = []
while core.engine.has_unfinished_requests():
    for delta in core.step():
        tokens += delta.token_ids
        if delta.finish_reason:
            print("finished:", delta.finish_reason)
expected = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[
    0
].outputs[0]
print(engine.tokenizer.decode(tokens))
assert tokens == expected.token_ids

# %% [markdown]
# What does a message cost? A step of 256 requests, one token each, pickled and sent through a pipe
# to another thread (as `multiprocessing.connection` does between the processes):

# %%
from minivllm.engine.core import Delta

step_message = (
    "step",
    [tuple(Delta(str(i), 0, [1234], None, None, None)) for i in range(256)],
    core.stats(),
)
a, b = Pipe()
received = []
reader = threading.Thread(target=lambda: received.extend(b.recv() for _ in range(200)))
reader.start()
start = time.perf_counter()
for _ in range(200):
    a.send(step_message)
reader.join()
per_message_us = (time.perf_counter() - start) / 200 * 1e6
print(
    f"{len(pickle.dumps(step_message)):,} bytes a step; {per_message_us:.0f} µs to send and "
    f"receive, on this machine"
)

# %% [markdown]
# Compare it with a decode step's ~7 ms on an H200: a small share (on a quiet machine, tens of
# microseconds; a busy one prints more), so the standard library's pickled pipe is enough, and it
# needs nothing installed (vLLM uses ZeroMQ and msgpack). The core sends plain tuples: pickling a
# `NamedTuple` names its class in every row, ~5x slower.
#
# ## The API process: `AsyncLLM`
# `minivllm/async_llm.py` is the other end. `generate` tokenizes and checks the request on an
# executor thread (no lock held: a long prompt stalls nobody), sends it, and yields `RequestOutput`s
# as deltas arrive. Its output thread appends each delta's tokens to its own copy of the request and
# runs notebook 06's `OutputProcessor`: text, stop strings (then it tells the core to finish that
# completion), log-probabilities. Below: the core in its own process, and the same greedy tokens as
# `LLM.generate`.

# %%
from minivllm.async_llm import AsyncLLM, EngineDeadError

served = AsyncLLM(str(path), **config)
print(f"this process {os.getpid()}, the engine core's {served.process.pid}")


def run(coroutine):  # on a thread of its own: Jupyter's event loop already runs on this one
    return ThreadPoolExecutor(1).submit(asyncio.run, coroutine).result()


async def reply(prompt: str, params: SamplingParams) -> str:
    outputs = [out async for out in served.generate(prompt, params)]
    return outputs[-1].outputs[0].text


greedy = SamplingParams(temperature=0, max_tokens=24, stop=["."])
text = run(reply("Once upon a time", greedy))
print(repr(text))
assert text == llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0].text

# %% [markdown]
# A core that dies must not leave callers waiting. Freeze it (SIGSTOP: the request below cannot run
# to its end first), send a request, and kill the core (SIGKILL, as the out-of-memory killer would)
# while its caller waits: the caller gets `EngineDeadError` at once, and `is_healthy()`, which the
# server's `/health` reports, says so.


# %%
async def doomed() -> str:
    os.kill(served.process.pid, signal.SIGSTOP)
    caller = asyncio.ensure_future(
        reply("A long story:", SamplingParams(max_tokens=400, ignore_eos=True))
    )
    while not served.streams:  # the request is in
        await asyncio.sleep(0.001)
    os.kill(served.process.pid, signal.SIGKILL)
    try:
        await caller
    except EngineDeadError as e:
        return str(e)
    return "finished"


print(run(doomed()))
print("healthy:", served.is_healthy())
assert not served.is_healthy()
served.close()
llm.close()

# %% [markdown]
# ## How fast, on an H200
# `python -m minivllm.benchmarks.serving` sends the same requests over HTTP at several rates, with
# the engine core on a thread of the server's process (before) and in a process of its own (after),
# beside the same requests offline.

# %%
import json

serving = FIGURES_IN_REPO / "serving.json"
rows = json.loads(serving.read_text())["rows"] if serving.is_file() else []
for row in rows:
    where = row.get("engine_core", "offline" if row["impl"].endswith("offline") else "thread")
    print(
        f"{where:>8} {float(row['request_rate']):>5g} req/s: {row['tok_per_s']:>8,.0f} output "
        f"tok/s, "
        f"TPOT p50 {row['tpot_p50_ms']:.1f} ms"
    )
