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
# **Where it sits.** It follows notebook 06 (the engine core, the engine and `LLM.generate`).
# Nothing in the core path needs it: the offline `LLM` runs its core in its own process, as before.
# This deep dive exports `minivllm.engine.core_process`, notebook 06's `EngineCore` served over a
# socket; `minivllm/async_llm.py` (hand-written, with the server) is its other end.
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
        request.completions[0].token_ids.append(token_id)
        processor.output(request)
per_step_ms = (time.perf_counter() - start) / len(reply_ids) * 1e3
print(f"text for 256 requests: {per_step_ms:.1f} ms of Python per step, on this machine")

# %% [markdown]
# A decode step of Qwen3-0.6B for 256 requests takes about 7 ms on an H200
# (`../figures/throughput.json`: TPOT p50 6.4 ms). Compare it with the figure above: in one process
# the GIL would add those milliseconds to every step, on top of HTTP and JSON. In two processes, the
# engine's step and the server's text run at the same time.

# %% [markdown]
# ## What crosses the socket
# The API process tokenizes a prompt once and sends the core its token ids and one
# `SamplingParams` per completion: ("add", request id, token ids, params). After every step the core
# answers ("step", deltas, stats): notebook 06's `Delta` per completion that got something (new
# token ids, a finish reason when the core finished it, log-probability rows if asked) and its
# queue's size. The API process sends ("abort", ids) for callers that left and ("finish", id,
# index) for a completion a stop string ended. That is all.
#
# ## The core's loop
# `serve_core` runs the engine core (deep dive `vllm_api`'s `ApiCore`, notebook 06's with stop
# strings and stats) as a busy loop: take every message waiting, step if
# there is work, send what the step gave; idle, wait for a message, saying "alive" once a second so
# the API process can tell a quiet core from a hung one. A step that fails aborts its requests
# (06): the loop names them in a ("failed", ids, why) message and goes on with the others.


# %%
# %% tags=["export"] module="minivllm.engine.core_process"
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

from minivllm.engine.api_core import ApiCore
from minivllm.engine.production import ProductionConfig, make_core


def handle(core: ApiCore, message: tuple) -> None:
    """Apply one message: ("add", id, token ids, params per completion), ("abort", ids) or
    ("finish", id, index)."""
    kind, *args = message
    if kind == "add":
        core.add_request(*args)
    elif kind == "abort":
        core.abort_requests(args[0])
    elif kind == "finish":
        core.finish(*args)


def run_loop(core: ApiCore, conn: Connection, heartbeat: float = 1.0) -> None:
    """The busy loop, until ("shutdown",). Idle, it says ("alive", stats) every `heartbeat` s."""
    last = time.monotonic()
    while True:
        busy = core.has_unfinished_requests()
        while conn.poll(0 if busy else heartbeat):
            message = conn.recv()
            if message[0] == "shutdown":
                return
            handle(core, message)
            busy = core.has_unfinished_requests()
        if busy:
            before = set(core.requests)
            try:
                deltas, _ = core.step()
            except Exception as e:  # the core aborted the step's requests: their callers hear why
                lost = sorted(before - set(core.requests))
                conn.send(("failed", lost, f"the step failed ({e})"))
                continue
            conn.send(("step", [tuple(d) for d in deltas], core.stats()))  # tuples pickle 5x faster
            last = time.monotonic()
        elif time.monotonic() - last >= heartbeat:
            conn.send(("alive", core.stats()))
            last = time.monotonic()


# %% [markdown]
# The process's entry point loads the core and says "ready" (or sends the exception that stopped
# it, so the server prints the same one-line error as before). Ctrl-C belongs to the API process: it
# stops the core by message; if the API process dies, the core's end of the socket closes and the
# core exits too, so no process is left behind.


# %%
# %% tags=["export"] module="minivllm.engine.core_process"
def run_core(conn: Connection, model: str, kwargs: dict[str, Any]) -> None:
    """The engine core process: load the core, say ("ready", config, number of KV blocks) or
    ("error", exception), then serve messages until shutdown. Ctrl-C is the API process's to handle:
    it stops the core."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        config = ProductionConfig(model, **kwargs)
        core = make_core(config)  # the production core (deep dive fast_engine)
    except BaseException as e:
        conn.send(("error", e))
        return
    conn.send(("ready", config, core.scheduler.block_manager.num_blocks))
    serve_core(conn, core)


def serve_core(conn: Connection, core: ApiCore) -> None:
    """Run the core until shutdown or until the API process is gone (its end of the socket
    closed)."""
    try:
        run_loop(core, conn)
    except (EOFError, OSError):
        pass
    finally:
        core.close()
        conn.close()


# %% [markdown]
# ## The core alone: the same tokens as `LLM.generate`
# Before any process: drive a core by hand, messages in, deltas out, and rebuild the completion
# from its deltas.

# %%
from minivllm.config import Config
from minivllm.engine.api_core import ApiCore
from minivllm.engine.core_process import handle

core = ApiCore(Config(str(path), **config))
prompt_ids = engine.tokenizer.encode("The Earth is about")
greedy = SamplingParams(temperature=0, max_tokens=12)
handle(core, ("add", "a", prompt_ids, [greedy]))
tokens: list[int] = []
while core.has_unfinished_requests():
    deltas, _ = core.step()
    for delta in deltas:
        tokens += delta.token_ids
        if delta.finish_reason:
            print("finished:", delta.finish_reason)
expected = llm.generate([prompt_ids], greedy, use_tqdm=False)[0].outputs[0]
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
# `minivllm/async_llm.py` is the other end: notebook 06's input processor and output processor
# around this socket instead of an `EngineCore`. `generate` tokenizes and checks the request on an
# executor thread (no lock held: a long prompt stalls nobody), sends it, and yields `RequestOutput`s
# as deltas arrive. Its output thread hands each step's deltas to the `OutputProcessor`: text, stop
# strings (then it tells the core to finish that completion), log-probabilities. Below: the core
# in its own process, and the same greedy tokens as `LLM.generate`.

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
    rate, tpot = float(row["request_rate"]), row["tpot_p50_ms"]
    speed = f"{row['tok_per_s']:>8,.0f} output tok/s"
    timing = f"TPOT p50 {tpot:.1f} ms"
    print(f"{where:>8} {rate:>5g} req/s: {speed}, {timing}")
