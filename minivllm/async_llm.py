"""Online serving's engine: requests arrive while it runs, and each one streams its outputs as it
goes.

`AsyncLLM` splits the work as vLLM v1 does. The engine core (schedule -> forward -> sample, a busy
loop: `minivllm.engine.core`) runs in a process of its own, so the server's threads and its GIL
never slow a step. This process tokenizes and checks each request, sends the core its token ids, and
turns what comes back (each step's new token ids, finish reasons, log-probabilities) into text, stop
strings and `RequestOutput`s. The two talk over a socket (`multiprocessing.connection`: pickled
tuples, one message per step). `multiprocessing=False` runs the same core on a thread of this
process instead (vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING=0`).

`generate` (a coroutine, on the caller's asyncio loop) adds a request and yields its `RequestOutput`
after every step that gave it a token (cumulative, as vLLM's default: `outputs[0].text` is the whole
reply so far), the last one with `finished=True`. A caller that falls behind gets the newest output
only, and none is built for it until it has taken the last: a slow client costs nothing and the
reply is the same. A caller that stops iterating (a client that disconnects) aborts its request: the
core frees its KV blocks at its next message.

Threads: the streams (request id -> the caller's `Stream` and the request's text state) are touched
by the output thread, by the callers' event loops and by the executor threads that add requests:
every access holds `lock`. A request id belongs to its caller until that caller has read its last
output or left: `generate` refuses (ValueError) an id still in use. Messages to the core are queued
and written by the input thread, in order: no caller, and no lock, waits on a core that has stopped
reading.

Health: if the core dies (its process exits, or its thread raises) or hangs (no message for
`timeout` seconds: it sends one after every step and every second when idle), every waiting caller
gets `EngineDeadError` at once, later `generate` calls raise it, and `is_healthy()` turns False (a
server's `/health` answers 503 then); a hung core process is killed. `close()` stops the core: no
process outlives it, and a core whose API process dies exits by itself.
"""

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing import Pipe, get_context
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess as Process
from typing import Any

from minivllm.engine.api_processors import ApiInputProcessor, ApiOutputProcessor
from minivllm.engine.core import Delta, EngineCore
from minivllm.engine.core_process import run_core, serve_core
from minivllm.engine.input_processor import Prompt, load_tokenizer
from minivllm.engine.production import ProductionConfig, make_core
from minivllm.engine.request import Request
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


EXITED = (
    "the engine core's process exited while loading the model (see its output above); if it "
    "re-ran your script, "
    'create the AsyncLLM under `if __name__ == "__main__":` (the core process is spawned: it '
    "imports your main module)"
)


# The stats of a core that runs nothing.
IDLE = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0}


class EngineDeadError(RuntimeError):
    """The engine core has died: no request can run on this `AsyncLLM` any more."""


@dataclass
class Stream:
    """One request's way back to its caller: outputs (or an exception) put from the output
    thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unread: bool = False  # an output waits in the queue: none need be built until it is taken
    request: Request | None = None  # set once registered (under lock): its tokens and text so far
    abandoned: bool = False  # its caller left while the request was being added (under lock)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queue item on the caller's loop; RuntimeError if that loop is closed (the caller is
        gone)."""
        self.unread = True
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def get(self) -> RequestOutput | BaseException:
        """The newest item queued (outputs are cumulative: an older one says nothing the newest does
        not)."""
        item = await self.queue.get()
        while not self.queue.empty() and not isinstance(item, BaseException):
            item = self.queue.get_nowait()
        self.unread = False
        return item


class AsyncLLM:
    """The engine core in its own process (keyword arguments: `Config`'s fields), for many callers.

    `is_healthy()` says whether the core still runs; `stats()` its queue and KV-cache use, as of its
    last message."""

    def __init__(
        self, model: str, multiprocessing: bool = True, timeout: float = 60.0, **kwargs: Any
    ):
        self.timeout = timeout
        self.core: EngineCore | None = None  # the core, when it runs on a thread of this process
        self.process: Process | threading.Thread
        # ids resolved (downloaded) and settings checked here: errors come before any process
        if multiprocessing:
            config = ProductionConfig(model, **kwargs)
            # the core loads the folders found here
            hub = ("revision", "tokenizer_revision", "download_dir")
            kwargs = {k: v for k, v in kwargs.items() if k not in hub} | {
                "tokenizer": str(config.tokenizer)
            }
            self.conn, self.process = start_core_process(str(config.model), kwargs)
            _, self.config, num_blocks = self.receive_first()
        else:
            self.config = ProductionConfig(model, **kwargs)
            self.core = make_core(self.config)
            self.conn, core_end = Pipe()
            self.process = threading.Thread(
                target=serve_core, args=(core_end, self.core), name="minivllm-core"
            )
            self.process.start()
            num_blocks = self.core.scheduler.block_manager.num_blocks
        self.tokenizer = load_tokenizer(self.config.tokenizer)
        self.input_processor = ApiInputProcessor(self.config, self.tokenizer, num_blocks)
        self.output_processor = ApiOutputProcessor(self.tokenizer)
        # request_id -> stream, while its caller listens (hold lock)
        self.streams: dict[str, Stream] = {}
        self.lock = threading.Lock()
        self.outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()  # to the core, in order
        self.num_aborted = 0  # requests whose caller left before they finished
        self.error: BaseException | None = None  # what killed the core, if it died
        self.core_stats = dict(IDLE)
        self.counter = itertools.count()  # request ids handed out when the caller gives none
        self.stopped = False
        self.thread = threading.Thread(
            target=self.receive_loop, name="minivllm-output", daemon=True
        )
        self.thread.start()
        self.writer = threading.Thread(target=self.write_loop, name="minivllm-input", daemon=True)
        self.writer.start()

    def receive_first(self) -> tuple:
        """The core's first message: ("ready", config, number of KV blocks), or the error that
        stopped it loading."""
        try:
            answer = self.conn.recv()
        except EOFError:
            self.join_core()
            raise EngineDeadError(EXITED) from None
        if answer[0] == "error":
            self.join_core()
            raise answer[1]
        return answer

    def is_healthy(self) -> bool:
        """Whether the core is alive and can run requests (for a server's /health: 503 when not)."""
        return self.error is None and not self.stopped and self.process.is_alive()

    def stats(self) -> dict[str, float]:
        """num_requests_running, num_requests_waiting, kv_cache_usage (0..1), as of the core's last
        message; all 0 once the core has died or stopped (nothing runs on it any more)."""
        return dict(self.core_stats) if self.is_healthy() else dict(IDLE)

    def dead_error(self) -> EngineDeadError:
        error = EngineDeadError(f"the engine core died: {self.error!r}")
        error.__cause__ = self.error
        return error

    def send(self, message: tuple) -> None:
        """Queue one message to the core (the input thread writes it): it never blocks, so no lock
        is held while a core that stops reading fills the socket. EngineDeadError if the core has
        died or exited."""
        if self.error is not None:
            raise self.dead_error()
        if not self.process.is_alive():  # before the output thread has seen the socket close
            raise EngineDeadError("the engine core died: its process exited")
        self.outbox.put(message)

    def write_loop(self) -> None:
        """The input thread: the queued messages, in order, to the core. A write blocks while the
        core reads nothing; the output thread, which holds no lock while it waits, reports a hung
        core and kills it, and then the write fails. Ends at None or when the socket closes."""
        while (message := self.outbox.get()) is not None:
            try:
                self.conn.send(message)
            except OSError:  # the core is gone: the output thread reports it
                return

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as it runs. ValueError (before anything is queued) if the request
        is bad or its request_id is still in use by another caller; EngineDeadError if the engine
        core has died."""
        stream = Stream(asyncio.get_running_loop())

        def add() -> str:  # tokenizing and checking hold no lock: a long prompt stalls nobody
            params = self.input_processor.request_params(sampling_params)
            with self.lock:
                if self.error is not None:
                    raise self.dead_error()
                if request_id is not None and request_id in self.streams:
                    raise ValueError(
                        f"request_id {request_id!r} is already in use by another caller"
                    )
                id_ = request_id
                while id_ is None or id_ in self.streams:
                    id_ = str(next(self.counter))
                self.streams[id_] = stream  # held: nobody else takes the id while we tokenize
            try:
                request = self.input_processor.make_request(prompt, params, id_, "prompt")
            except BaseException:
                self.remove(id_, stream)
                raise
            with self.lock:
                if stream.abandoned or self.error is not None:
                    self.remove_locked(id_, stream, aborted=self.error is None)
                    if self.error is not None:
                        raise self.dead_error()
                    return id_
                stream.request = request
                self.output_processor.add(request)  # before the core can answer for it
                try:
                    # under lock: before any abort
                    self.send(("add", id_, request.prompt_token_ids, request.params))
                except EngineDeadError:
                    self.remove_locked(id_, stream, aborted=False)  # forgets the request too
                    raise
            return id_

        try:
            request_id = await stream.loop.run_in_executor(None, add)
        except asyncio.CancelledError:  # the caller left while its request was being added
            with self.lock:
                stream.abandoned = True
                added = (
                    stream.request is not None
                    and self.streams.get(stream.request.request_id) is stream
                )
            if added:
                assert stream.request is not None
                self.leave(stream.request.request_id, stream)
            raise
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if finished:
                self.remove(request_id, stream)
            else:  # the caller left early (a client disconnected): free its blocks now
                self.leave(request_id, stream)

    def remove(self, request_id: str, stream: Stream, aborted: bool = False) -> bool:
        """Forget this caller's stream (only its own: the id may be someone else's by now), counting
        it in num_aborted if aborted. Whether it was there."""
        with self.lock:
            return self.remove_locked(request_id, stream, aborted)

    def remove_locked(self, request_id: str, stream: Stream, aborted: bool) -> bool:
        if self.streams.get(request_id) is not stream:
            return False
        del self.streams[request_id]
        kept = self.output_processor.requests.get(request_id)
        if kept is not None and kept is stream.request:  # its caller left: no text is needed
            self.output_processor.abort([request_id])
        self.num_aborted += aborted
        return True

    def leave(self, request_id: str, stream: Stream) -> None:
        """A caller left before its last output: forget its stream and abort its request in the
        core."""
        with self.lock:
            if self.remove_locked(request_id, stream, aborted=True) and self.error is None:
                with suppress(EngineDeadError):  # a dead core has nothing left to abort
                    # under lock: after its "add", before a reuse of the id
                    self.send(("abort", [request_id]))

    def receive_loop(self) -> None:
        """The output thread: each message from the core, turned into outputs for the callers. If
        the core dies, hangs or sends what we cannot read, every caller hears of it at once
        (`die`)."""
        try:
            while not self.stopped:
                if not self.conn.poll(self.timeout):
                    raise EngineDeadError(
                        f"the engine core sent nothing for {self.timeout:g} s: hung"
                    )
                kind, *body = self.conn.recv()
                if kind == "step":
                    self.apply(body[0])
                if kind in ("step", "alive"):
                    self.core_stats = body[-1]
                elif kind == "failed":
                    self.fail(*body)
        except BaseException as error:
            if not self.stopped:
                if not isinstance(error, EOFError | OSError | EngineDeadError):
                    logger.exception("minivllm: the output thread died")
                self.die(
                    error
                    if not isinstance(error, EOFError | OSError)
                    else EngineDeadError("its process exited")
                )

    def apply(self, deltas: list[tuple]) -> None:
        """One step's deltas: text, stop strings, and an output for each caller that wants one."""
        now = time.perf_counter()
        requests = self.output_processor.process(map(Delta._make, deltas), now)
        for (
            request_id,
            index,
        ) in (
            self.output_processor.pop_stopped()
        ):  # the core ends that completion (its request, if last)
            with suppress(EngineDeadError):
                self.send(("finish", request_id, index))
        with self.lock:
            streams = [(r, s) for r in requests if (s := self.streams.get(r.request_id))]
        items: list[tuple[str, Stream, RequestOutput | BaseException]] = []
        for request, stream in streams:
            if stream.request is not request:
                continue  # its caller left, and the id is another's now
            if request.finished or not stream.unread:
                items.append((request.request_id, stream, self.output_processor.output(request)))
        self.deliver(items)

    def deliver(self, items: list[tuple[str, Stream, RequestOutput | BaseException]]) -> None:
        """Put each item on its stream; a stream whose loop has closed (its caller is gone) is
        dropped and its request aborted."""
        for request_id, stream, item in items:
            try:
                stream.put(item)
            except RuntimeError:  # "Event loop is closed"
                self.leave(request_id, stream)

    def fail(self, request_ids: list[str], message: str) -> None:
        """The core refused or lost these requests (a failed step aborts its batch): their callers
        get the error."""
        with self.lock:
            streams = [(i, s) for i in request_ids if (s := self.streams.get(i)) is not None]
        self.deliver(
            [(i, s, RuntimeError(f"request {i} was aborted: {message}")) for i, s in streams]
        )

    def die(self, error: BaseException) -> None:
        """The core is dead or hung: no new request is taken, and every waiting caller gets the
        error now."""
        with self.lock:
            self.error = error
            streams = list(self.streams.values())
        for stream in streams:
            try:
                stream.put(self.dead_error())
            except RuntimeError:  # its loop has closed: nobody is waiting
                pass
        if isinstance(self.process, Process) and self.process.is_alive():
            self.process.kill()  # hung: its GPU memory goes back

    def join_core(self) -> None:
        """Wait for the core to end (a process: then terminate it, then kill it)."""
        self.process.join(30)
        if isinstance(self.process, Process):
            for stop in (self.process.terminate, self.process.kill):
                if self.process.is_alive():
                    stop()
                    self.process.join(5)

    def close(self) -> None:
        """Stop the core (and its process) and the output thread."""
        if self.stopped:
            return
        self.stopped = True
        if self.error is None:  # a dead core is gone already
            self.outbox.put(("shutdown",))
        self.outbox.put(None)
        self.join_core()
        self.conn.close()
        self.thread.join(timeout=5)
        self.writer.join(timeout=5)


def start_core_process(model: str, kwargs: dict[str, Any]) -> tuple[Connection, Process]:
    context = get_context("spawn")  # CUDA cannot be forked
    conn, core_end = context.Pipe()
    process = context.Process(
        target=run_core, args=(core_end, model, kwargs), name="minivllm-core", daemon=True
    )
    process.start()
    core_end.close()  # ours closed: when the core exits, recv raises EOFError
    return conn, process
