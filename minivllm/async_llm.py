"""Online serving's engine: requests arrive while it runs, and each one streams its outputs as it goes.

`AsyncLLM` runs `LLMEngine.step()` in a loop on its own thread; `generate` (a coroutine, on the caller's asyncio
loop) adds a request and yields its `RequestOutput` after every step that gave it a token (cumulative, as vLLM's
default: `outputs[0].text` is the whole reply so far), the last one with `finished=True`. A caller that falls behind
gets the newest output only (as vLLM's output collector merges them), and the engine builds none for it until it has
taken the last: a slow client costs the engine nothing and the reply is the same. A caller that stops iterating (a
client that disconnects) aborts its request: its KV blocks are freed at once.

Threads: the streams (request id -> the caller's `Stream`) are touched by the engine's thread, by the callers' event
loops and by the executor threads that add requests, so every access holds `streams_lock`, and the engine's thread
iterates over a snapshot. Lock order: `engine.lock` may be held while taking `streams_lock`, never the other way
round (so a caller leaving never waits for a step to count its abort). A request id belongs to its caller until that
caller has read its last output or left: `generate` refuses (ValueError) an id still in use.

Health: if the engine's thread dies of an unexpected exception, every waiting caller gets `EngineDeadError` at once,
later `generate` calls raise it before queueing anything, and `is_healthy()` turns False (a server's `/health` can
answer 503 then); `error` holds the exception that killed it.
"""

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from minivllm.engine.input_processor import Prompt
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's thread has died: no request can run on this `AsyncLLM` any more."""


@dataclass
class Stream:
    """One request's way back to its caller: outputs (or the step's exception) put from the engine's thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_tokens: int = 0  # tokens already sent
    unread: bool = False  # an output waits in the queue: the engine need not build the next one yet
    request_id: str | None = None  # set once registered (under streams_lock)
    abandoned: bool = False  # its caller left while the request was being added (under streams_lock)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queue item on the caller's loop; RuntimeError if that loop is closed (the caller is gone)."""
        self.unread = True
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def get(self) -> RequestOutput | BaseException:
        """The newest item queued (outputs are cumulative: an older one says nothing the newest does not)."""
        item = await self.queue.get()
        while not self.queue.empty() and not isinstance(item, BaseException):
            item = self.queue.get_nowait()
        self.unread = False
        return item


class AsyncLLM:
    """`LLMEngine` (keyword arguments: `Config`'s fields) stepping on a background thread, for many callers.

    `is_healthy()` says whether the engine's thread still runs (False once it died, or after `close()`)."""

    def __init__(self, model: str, **kwargs):
        self.engine = LLMEngine(model, **kwargs)
        self.streams: dict[str, Stream] = {}  # request_id -> stream, while its caller listens (hold streams_lock)
        self.streams_lock = threading.Lock()  # taken after engine.lock, never before it
        self.num_aborted = 0  # requests whose caller left before they finished
        self.error: BaseException | None = None  # what killed the engine's thread, if it died
        self.counter = itertools.count()  # request ids handed out when the caller gives none
        self.wakeup = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self.loop, name="minivllm-engine", daemon=True)
        self.thread.start()

    def is_healthy(self) -> bool:
        """Whether the engine's thread is alive and can run requests (for a server's /health: 503 when not)."""
        return self.error is None and not self.stopped and self.thread.is_alive()

    def stats(self) -> dict[str, float]:
        """The engine's load now (a server's /metrics): sequences running and waiting (one per completion of n, as
        vLLM v1 counts n's children), and the fraction of KV blocks in use."""
        with self.engine.lock:
            scheduler, bm = self.engine.scheduler, self.engine.scheduler.block_manager
            return {
                "num_requests_running": len(scheduler.running),
                "num_requests_waiting": len(scheduler.waiting),
                "kv_cache_usage": bm.num_used_blocks / bm.num_blocks,
            }

    def dead_error(self) -> EngineDeadError:
        error = EngineDeadError(f"the engine's thread died: {self.error!r}")
        error.__cause__ = self.error
        return error

    async def generate(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as it runs. ValueError (before anything is queued) if the request is bad or its
        request_id is still in use by another caller; EngineDeadError if the engine's thread has died."""
        stream = Stream(asyncio.get_running_loop())

        def add() -> str:
            with self.engine.lock:  # registered before any step can give it a token
                with self.streams_lock:
                    if self.error is not None:
                        raise self.dead_error()
                    if request_id is not None and request_id in self.streams:
                        raise ValueError(f"request_id {request_id!r} is already in use by another caller")
                    id_ = request_id
                    while id_ is None or id_ in self.streams:
                        id_ = str(next(self.counter))
                id_ = self.engine.add_request(prompt, sampling_params, id_)
                with self.streams_lock:
                    if self.error is None and not stream.abandoned:
                        self.streams[id_] = stream
                        stream.request_id = id_
                        return id_
                    dead = self.error is not None
                    self.num_aborted += not dead
                self.engine.abort_request(id_)  # nobody will read it
                if dead:
                    raise self.dead_error()
                return id_

        try:
            request_id = await stream.loop.run_in_executor(None, add)  # the lock may wait for a step: not on the loop
        except asyncio.CancelledError:  # the caller left while its request was being added: add drops it, or
            with self.streams_lock:  # it was registered already and we do
                stream.abandoned, added = True, stream.request_id
            if added is not None:
                self.leave(added, stream)
            raise
        self.wakeup.set()
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
        """Forget this caller's stream (only its own: the id may be someone else's by now), counting it in
        num_aborted if aborted. Whether it was there."""
        with self.streams_lock:
            if self.streams.get(request_id) is not stream:
                return False
            del self.streams[request_id]
            self.num_aborted += aborted
            return True

    def leave(self, request_id: str, stream: Stream) -> None:
        """A caller left before its last output: forget its stream and abort its request."""
        if self.remove(request_id, stream, aborted=True):  # counted before abort_request waits for the engine's lock
            self.engine.abort_request(request_id)

    def loop(self) -> None:
        """The engine's thread: step while there is work, then sleep until a request arrives. If anything
        unexpected kills it, every caller hears of it at once (`die`)."""
        try:
            while not self.stopped:
                if not self.engine.has_unfinished_requests():
                    self.wakeup.wait(timeout=0.5)
                    self.wakeup.clear()
                    continue
                try:
                    finished, _ = self.engine.step()
                except Exception as error:  # the engine aborted that step's requests: tell their callers
                    self.fail_lost_requests(error)
                    continue
                self.send(finished)
        except BaseException as error:
            logger.exception("minivllm: the engine's thread died")
            self.die(error)

    def snapshot(self) -> list[tuple[str, Stream]]:
        with self.streams_lock:
            return list(self.streams.items())

    def deliver(self, items: list[tuple[str, Stream, RequestOutput | BaseException]]) -> None:
        """Put each item on its stream; a stream whose loop has closed (its caller is gone) is dropped and its
        request aborted."""
        gone = []
        for request_id, stream, item in items:
            try:
                stream.put(item)
            except RuntimeError:  # "Event loop is closed"
                gone.append((request_id, stream))
        for request_id, stream in gone:
            self.leave(request_id, stream)

    def send(self, finished: list[RequestOutput]) -> None:
        """After a step: each finished request's last output, and the progress of those that got new tokens and
        whose caller has taken the last one."""
        streams = dict(self.snapshot())  # callers come and go meanwhile: a copy to iterate over
        ready = {request_id for request_id, stream in streams.items() if not stream.unread}
        items: list[tuple[str, Stream, RequestOutput | BaseException]] = []
        for out in finished + self.engine.progress(ready):
            stream = streams.get(out.request_id)
            num_tokens = sum(len(c.token_ids) for c in out.outputs)  # of all n completions
            if stream is not None and (out.finished or num_tokens > stream.num_tokens):
                stream.num_tokens = num_tokens
                items.append((out.request_id, stream, out))
        self.deliver(items)

    def fail_lost_requests(self, error: Exception) -> None:
        """After a failed step: an error for each caller whose request the engine aborted."""
        streams = self.snapshot()
        with self.engine.lock:  # the requests still queued, or finished and kept back, were not lost
            running = {out.request_id for out in self.engine.progress({request_id for request_id, _ in streams})}
            running |= {out.request_id for out in self.engine.finished}
        message = f"was aborted: the step failed ({error})"
        self.deliver([(i, s, RuntimeError(f"request {i} {message}")) for i, s in streams if i not in running])

    def die(self, error: BaseException) -> None:
        """The engine's thread is dying: no new request is taken, and every waiting caller gets the error now."""
        with self.streams_lock:
            self.error = error
            streams = list(self.streams.items())
        for _, stream in streams:
            try:
                stream.put(self.dead_error())
            except RuntimeError:  # its loop has closed: nobody is waiting
                pass

    def close(self) -> None:
        self.stopped = True
        self.wakeup.set()
        self.thread.join()
        self.engine.close()
