"""Online serving's engine: requests arrive while it runs, and each one streams its outputs as it goes.

`AsyncLLM` runs `LLMEngine.step()` in a loop on its own thread; `generate` (a coroutine, on the caller's asyncio
loop) adds a request and yields its `RequestOutput` after every step that gave it a token (cumulative, as vLLM's
default: `outputs[0].text` is the whole reply so far), the last one with `finished=True`. A caller that falls behind
gets the newest output only (as vLLM's output collector merges them), and the engine builds none for it until it has
taken the last: a slow client costs the engine nothing and the reply is the same. A caller that stops iterating (a
client that disconnects) aborts its request: its KV blocks are freed at once.
"""

import asyncio
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from minivllm.engine.input_processor import Prompt
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


@dataclass
class Stream:
    """One request's way back to its caller: outputs (or the step's exception) put from the engine's thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_tokens: int = 0  # tokens already sent
    unread: bool = False  # an output waits in the queue: the engine need not build the next one yet

    def put(self, item: RequestOutput | BaseException) -> None:
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
    """`LLMEngine` (keyword arguments: `Config`'s fields) stepping on a background thread, for many callers."""

    def __init__(self, model: str, **kwargs):
        self.engine = LLMEngine(model, **kwargs)
        self.streams: dict[str, Stream] = {}  # request_id -> stream, while its caller listens
        self.num_aborted = 0  # requests whose caller left before they finished
        self.wakeup = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self.loop, name="minivllm-engine", daemon=True)
        self.thread.start()

    async def generate(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as it runs. ValueError (before anything is queued) if the request is bad."""
        stream = Stream(asyncio.get_running_loop())

        def add() -> str:
            with self.engine.lock:  # registered before any step can give it a token
                request_id_ = self.engine.add_request(prompt, sampling_params, request_id)
                self.streams[request_id_] = stream
                return request_id_

        request_id = await stream.loop.run_in_executor(None, add)  # the lock may wait for a step: not on the loop
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
            del self.streams[request_id]
            if not finished:  # the caller left early (a client disconnected): free its blocks now
                self.num_aborted += 1
                self.engine.abort_request(request_id)

    def loop(self) -> None:
        """The engine's thread: step while there is work, then sleep until a request arrives."""
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

    def send(self, finished: list[RequestOutput]) -> None:
        """After a step: each finished request's last output, and the progress of those that got new tokens and
        whose caller has taken the last one."""
        ready = [request_id for request_id, stream in self.streams.items() if not stream.unread]
        for out in finished + self.engine.progress(ready):
            stream = self.streams.get(out.request_id)
            num_tokens = sum(len(c.token_ids) for c in out.outputs)  # of all n completions
            if stream is not None and (out.finished or num_tokens > stream.num_tokens):
                stream.num_tokens = num_tokens
                stream.put(out)

    def fail_lost_requests(self, error: Exception) -> None:
        running = {out.request_id for out in self.engine.progress(list(self.streams))}
        for request_id, stream in list(self.streams.items()):
            if request_id not in running:
                stream.put(RuntimeError(f"request {request_id} was aborted: the step failed ({error})"))

    def close(self) -> None:
        self.stopped = True
        self.wakeup.set()
        self.thread.join()
        self.engine.close()
