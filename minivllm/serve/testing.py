"""What tests and benchmarks need of the server, never its own path: the server over an `AsyncLLM`
in a thread of this process, on a free port; an `AsyncLLM` watched from outside (the prompts it is
handed; a stream that fails midway), given to the server as its engine."""

import socket
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing, contextmanager
from typing import Any

from minivllm.async_llm import AsyncLLM
from minivllm.outputs import RequestOutput
from minivllm.serve.cli import KEEP_ALIVE_S
from minivllm.serve.routes import Server


@contextmanager
def serve_in_thread(
    llm: AsyncLLM,
    model_name: str,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    timeout_keep_alive: int = KEEP_ALIVE_S,
) -> Iterator[str]:
    """The server over `llm` on a free port of 127.0.0.1, in a thread of this process, until the
    block ends; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server(llm, model_name, api_key, max_queued_requests)
    config = uvicorn.Config(server.app, log_level="warning", timeout_keep_alive=timeout_keep_alive)
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not http.started and time.monotonic() < deadline:
        time.sleep(0.05)
    if not http.started:
        raise RuntimeError("the server did not start within 60 s")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        http.should_exit = True
        thread.join(timeout=30)


class WatchedLLM:
    """`llm` as a server sees it (every attribute is llm's), noting the prompt of each `generate`
    call in `prompts`; with `fail_after`, each stream raises ValueError("injected failure") after
    that many outputs, as a fault midway would."""

    def __init__(self, llm: AsyncLLM, fail_after: int | None = None):
        self.llm, self.fail_after = llm, fail_after
        self.prompts: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)

    async def generate(self, prompt: Any, *args: Any) -> AsyncGenerator[RequestOutput, None]:
        self.prompts.append(prompt)
        async with aclosing(self.llm.generate(prompt, *args)) as outputs:
            num_outputs = 0
            async for out in outputs:
                if num_outputs == self.fail_after:
                    raise ValueError("injected failure")
                num_outputs += 1
                yield out
