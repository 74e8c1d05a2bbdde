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
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None  # (first position, rows), once the prompt is scored


def rows(logprobs: list[dict[int, Logprob]]) -> list[TokenLogprobs]:
    return [{token: (lp.logprob, lp.rank) for token, lp in row.items()} for row in logprobs]


class EngineCore:
    """An `LLMEngine` that takes token ids and gives token ids: no tokenizer, no text, no stop strings (the API
    process does those). `handle` takes one message from the API process; `step` runs one step and says what
    each completion got."""

    def __init__(self, model: str, **kwargs):
        self.engine = LLMEngine(model, **kwargs)
        self.engine.output_processor = OutputProcessor(None)  # no detokenizing here
        self.sent: dict[str, list[int]] = {}  # request id -> tokens sent per completion, while it runs here
        self.prompt_sent: dict[str, int] = {}  # request id -> prompt logprob rows sent

    def handle(self, message: tuple) -> list[tuple]:
        """Apply one message: ("add", id, token ids, params), ("abort", ids) or ("finish", id, index): a stop
        string ended that completion. What to answer (a request the engine refused fails)."""
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
        for request in {id(r): r for r in self.engine.requests.values() if r.request_id == request_id}.values():
            self.engine.scheduler.finish(request.seqs[index], "stop")

    def forget(self, request_id: str) -> None:
        self.sent.pop(request_id, None)
        self.prompt_sent.pop(request_id, None)

    def step(self) -> list[Delta]:
        """One step; a Delta for each completion that got tokens or finished."""
        finished, _ = self.engine.step()
        deltas = [d for out in finished for d in self.finished_deltas(out)]
        for seq in self.engine.scheduler.running:  # only those can have new tokens: O(batch), not O(queue)
            request = self.engine.requests[seq.seq_id]
            i, sent = request.seqs.index(seq), self.sent[request.request_id]
            if seq.num_completion_tokens > sent[i]:
                logprobs = request.logprobs.get(i)
                new = rows(logprobs[sent[i] :]) if logprobs is not None else None
                token_ids = seq.completion_token_ids[sent[i] :]
                deltas.append(Delta(request.request_id, i, token_ids, None, new, self.prompt(request)))
                sent[i] = seq.num_completion_tokens
        return deltas

    def finished_deltas(self, out: RequestOutput) -> list[Delta]:
        sent, deltas = self.sent[out.request_id], []
        for c in out.outputs:
            logprobs = rows(c.logprobs[sent[c.index] :]) if c.logprobs is not None else None
            prompt = None
            if out.prompt_logprobs is not None and not self.prompt_sent[out.request_id]:
                prompt = (1, rows(out.prompt_logprobs[1:]))  # type: ignore[arg-type]  # row 0 is None
                self.prompt_sent[out.request_id] = 1
            token_ids = c.token_ids[sent[c.index] :]
            deltas.append(Delta(out.request_id, c.index, token_ids, c.finish_reason, logprobs, prompt))
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
        live = {r.request_id for r in self.engine.requests.values()} | {o.request_id for o in self.engine.finished}
        lost = [request_id for request_id in self.sent if request_id not in live]
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
        """The busy loop: take every message waiting, step if there is work, send what the step gave. Idle, wait
        for a message (saying "alive" every `heartbeat` seconds). Ends on ("shutdown",) or when the API process is
        gone (its end of the socket closed)."""
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
                except Exception as e:  # the engine aborted that step's requests: their callers get the error
                    conn.send(("failed", self.lost(), f"the step failed ({e})"))
                    continue
                conn.send(("step", deltas, self.stats()))
                last = time.monotonic()
            elif time.monotonic() - last >= heartbeat:
                conn.send(("alive", self.stats()))
                last = time.monotonic()


def run_core(conn: Connection, model: str, kwargs: dict[str, Any]) -> None:
    """The engine core process: load the engine, say ("ready", config, number of KV blocks) or ("error",
    exception), then serve messages until shutdown. Ctrl-C is the API process's to handle: it stops the core."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        core = EngineCore(model, **kwargs)
    except BaseException as e:
        conn.send(("error", e))
        return
    conn.send(("ready", core.engine.config, core.engine.scheduler.block_manager.num_blocks))
    serve_core(conn, core)


def serve_core(conn: Connection, core: EngineCore) -> None:
    """Run the core until shutdown or until the API process is gone (its end of the socket closed)."""
    try:
        core.run(conn)
    except (EOFError, OSError):
        pass
    finally:
        core.engine.close()
        conn.close()
