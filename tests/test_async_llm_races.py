"""`AsyncLLM` under a hostile client: hundreds of callers at once from several threads, callers that leave early,
request ids reused, a step that fails, an engine core that dies or hangs. Nothing here decides by timing: the races
are forced with hooks (the core on a thread of this process, `multiprocessing=False`, where a hook must reach inside
it), and the timeouts only guard against a hang. CPU, tiny preset, float32, greedy."""

import asyncio
import contextlib
import os
import random
import signal
import threading
import time

import pytest
import torch

from minivllm import SamplingParams
from minivllm.async_llm import AsyncLLM, EngineDeadError
from minivllm.engine.core import Delta
from minivllm.testing import WatchedDict

CONFIG = dict(
    dtype=torch.float32, device="cpu", num_kvcache_blocks=256, max_model_len=512, max_num_seqs=32
)
HANG = 120  # seconds: only a guard against a hang, never what a test decides by


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny):
    """The engine core in its own process, as the server runs it."""
    llm = AsyncLLM(str(tiny), **CONFIG)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def local(tiny):
    """The engine core on a thread of this process: hooks can reach its engine."""
    llm = AsyncLLM(str(tiny), multiprocessing=False, **CONFIG)
    yield llm
    llm.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG))


async def collect(
    llm: AsyncLLM, prompt: str, max_tokens: int, request_id: str | None = None
) -> list:
    return [out async for out in llm.generate(prompt, greedy(max_tokens), request_id)]


def wait_until_idle(llm: AsyncLLM) -> dict:
    """Until the core says it holds no request and no KV block (it says so after each step, and each second when
    idle); a hang guard, not a decision. Its last stats."""
    deadline = time.monotonic() + HANG
    idle = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0}
    while llm.stats() != idle and time.monotonic() < deadline:
        time.sleep(0.01)
    return llm.stats()


class Tripwire:
    """A stream stand-in whose `unread` (read by `apply` as it goes through the streams) runs `action` on another
    thread, to completion, the first time it is read: other callers coming and going mid-iteration."""

    def __init__(self, action, request):
        self.action, self.fired, self.request = action, False, request

    @property
    def unread(self) -> bool:
        if not self.fired:
            self.fired = True
            thread = threading.Thread(target=self.action)
            thread.start()
            thread.join(HANG)
        return True  # no output is built for it

    def put(self, item) -> None:
        pass


def test_apply_survives_callers_coming_and_going_while_it_iterates(llm):
    """The thread that delivers outputs iterated `streams` while event loops removed entries and executor threads added them:
    "dictionary changed size during iteration" killed it. Forced here: the streams change mid-iteration."""
    request = lambda i: llm.input_processor.make_request("Hi", greedy(2), i, "prompt")  # noqa: E731
    others = {f"other-{i}": Tripwire(lambda: None, request(f"other-{i}")) for i in range(3)}

    def come_and_go() -> (
        None
    ):  # as another caller's generate adds its stream, and a third one's finally drops its
        with llm.lock:
            llm.streams["newcomer"] = Tripwire(lambda: None, request("newcomer"))
            del llm.streams["other-1"]

    llm.streams.update({"tripwire": Tripwire(come_and_go, request("tripwire")), **others})
    for stream in list(llm.streams.values()):
        llm.output_processor.add(stream.request)
    try:
        deltas = [Delta(i, 0, [], None, None, None) for i in ["tripwire", *others]]
        llm.apply(deltas)  # what runs after each step
        assert llm.streams["tripwire"].fired
    finally:
        for request_id in ["tripwire", "newcomer", *others]:
            llm.streams.pop(request_id, None)
        llm.output_processor.abort(["tripwire", "newcomer", *others])
    assert llm.is_healthy()
    assert len(run(collect(llm, "Still alive?", 3))) >= 1  # and the engine still serves


def test_a_step_never_walks_the_queue(local):
    """Per step, the core looks at the batch it ran, not at every queued request: with hundreds waiting, a walk
    over them each step cost O(queue) per step (O(queue²) in all)."""
    walks, stepping = [], threading.local()
    core, core_step = local.core, local.core.step

    def watched_step():
        stepping.on = True
        try:
            return core_step()
        finally:
            stepping.on = False

    core.requests = WatchedDict(core.requests, walks, lambda: getattr(stepping, "on", False))
    local.core.step = watched_step
    try:

        async def many() -> list:
            return await asyncio.gather(*(collect(local, f"Request {i}", 2) for i in range(200)))

        outs = run(many())
    finally:
        core.requests = dict(core.requests)
        del local.core.step
    assert all(out[-1].finished for out in outs) and not walks


def test_hundreds_of_callers_from_several_threads_some_leaving_early(llm):
    """300 callers on 4 event loops (so the streams are added and dropped from many threads while the engine
    steps): a third read one output and leave, a few are cancelled at once; all end cleanly, the engine lives on,
    and every KV block comes back."""
    results: dict[str, object] = {}

    async def caller(name: str, kind: int) -> None:
        outputs = llm.generate(f"Caller {name} says", greedy(3 + kind % 3), request_id=name)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if kind % 3 == 1:  # leaves after its first output
                    results[name] = "left"
                    return
                if out.finished:
                    results[name] = out
        results.setdefault(name, "no finished output")

    async def cancelled(name: str) -> None:
        task = asyncio.ensure_future(caller(name, 0))
        await asyncio.sleep(0)  # let it start adding its request
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        results[name] = results.get(name, "cancelled")

    async def one_loop(t: int) -> None:
        names = [f"t{t}-{i}" for i in range(75)]
        await asyncio.gather(
            *(cancelled(n) if i % 25 == 0 else caller(n, i) for i, n in enumerate(names))
        )

    errors: list[BaseException] = []

    def thread(t: int) -> None:
        try:
            run(one_loop(t))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=thread, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG + 10)
    assert not errors, errors
    assert len(results) == 300
    for name, result in results.items():
        i = int(name.split("-")[1])
        if i % 25 == 0:
            assert result == "cancelled" or getattr(result, "finished", False), (name, result)
        elif i % 3 == 1:
            assert result == "left", (name, result)
        else:
            assert result.finished and len(result.outputs[0].token_ids) == 3 + i % 3, (name, result)
    assert llm.is_healthy()
    assert wait_until_idle(llm)["kv_cache_usage"] == 0  # every block back
    assert not llm.streams


def test_a_request_id_in_use_by_an_unread_caller_is_refused(llm):
    """The first caller's request has finished in the engine, but its caller has not read the last output: the
    id is still its own. Reusing it used to let that caller's cleanup delete the newcomer's stream."""
    apply, done = llm.apply, threading.Event()

    def apply_and_note(deltas: list) -> None:
        apply(deltas)
        if any(Delta._make(d).request_id == "dup" and Delta._make(d).finish_reason for d in deltas):
            done.set()

    async def scenario() -> tuple:
        first = llm.generate("Once upon a time", greedy(4), request_id="dup")
        head = await anext(first)
        await asyncio.get_running_loop().run_in_executor(
            None, done.wait, HANG
        )  # finished, not read
        with pytest.raises(ValueError, match="dup"):
            await anext(llm.generate("Hello", greedy(4), request_id="dup"))
        rest = [out async for out in first]  # the first caller still gets its reply
        again = await collect(
            llm, "Hello", 4, request_id="dup"
        )  # and once it is read, the id is free again
        return head, rest, again

    llm.apply = apply_and_note
    try:
        head, rest, again = run(scenario())
    finally:
        del llm.apply
    assert not head.finished and rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 4
    assert again[-1].finished and again[-1].request_id == "dup"
    assert not llm.streams


def test_a_caller_cancelled_while_its_request_is_added_leaves_nothing_behind(llm):
    """A client that disconnects while `generate` tokenizes its request (on an executor thread): the request must
    not reach the core, and its stream must go, not block the id forever."""
    make_request, entered, go = (
        llm.input_processor.make_request,
        threading.Event(),
        threading.Event(),
    )

    def slow_make_request(*args):
        entered.set()
        go.wait(HANG)
        return make_request(*args)

    async def scenario() -> None:
        task = asyncio.ensure_future(collect(llm, "Bye", 50, request_id="gone"))
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, HANG)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()  # the add goes on, on its thread (asyncio.run waits for it as it shuts the executor down)

    aborted, sent = llm.num_aborted, []
    send = llm.send
    llm.send = lambda message: sent.append(message[0]) or send(message)
    llm.input_processor.make_request = slow_make_request
    try:
        run(scenario())
    finally:
        go.set()
        del llm.input_processor.make_request, llm.send
    assert llm.num_aborted == aborted + 1 and "gone" not in llm.streams and "add" not in sent
    assert run(collect(llm, "Hello", 2, request_id="gone"))[-1].finished  # the id is free


def test_a_failed_step_fails_only_its_requests_and_the_engine_goes_on(local):
    """A step that raises aborts its requests: their callers get the error; the engine lives on."""
    core = local.core
    step, calls = core.step, []

    def failing_step():
        if not calls:
            calls.append(1)
            core.abort_all()  # as a failed step does with the requests it ran
            raise RuntimeError("injected step failure")
        return step()

    core.step = failing_step
    try:
        with pytest.raises(RuntimeError, match="injected step failure"):
            run(collect(local, "Doomed", 4))
    finally:
        del core.step
    assert local.is_healthy() and not local.streams
    assert run(collect(local, "Fine again", 4))[-1].finished


async def five_callers(llm: AsyncLLM, kill) -> list:
    """Five callers waiting on long requests when `kill()` runs; what each got."""

    async def caller(i: int) -> BaseException | None:
        try:
            await collect(llm, f"Caller {i}", 400)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            return e
        return None

    waiting = [asyncio.ensure_future(caller(i)) for i in range(5)]
    while len(llm.streams) < 5:  # a hang guard bounds it: all five registered before the core dies
        await asyncio.sleep(0.001)
    kill()
    return await asyncio.gather(*waiting)


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_dead_or_hung_core_fails_every_caller_at_once(tiny, how):
    """A core process that is killed (or stops answering: SIGSTOP) must not leave callers hanging: each waiting
    caller gets EngineDeadError, new requests are refused, `is_healthy()` says so (for /health), and a hung core's
    process is killed."""
    llm = AsyncLLM(str(tiny), timeout=2.0, **CONFIG)
    try:
        pid = llm.process.pid
        errors = run(
            five_callers(
                llm, lambda: os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            )
        )
        assert len(errors) == 5 and all(isinstance(e, EngineDeadError) for e in errors), errors
        assert all(("hung" if how == "hung" else "exited") in str(e) for e in errors), errors
        assert not llm.is_healthy()
        with pytest.raises(EngineDeadError):
            run(collect(llm, "Too late", 2))
        llm.process.join(HANG)
        assert not llm.process.is_alive()
    finally:
        llm.close()


def test_a_message_to_a_core_that_has_exited_raises_engine_dead_error(tiny):
    """Until the output thread sees the core's socket close, a new request (or an abort) writes to a closed socket:
    its caller gets EngineDeadError, not BrokenPipeError, nothing is left registered, and close() still works."""
    llm = AsyncLLM(str(tiny), **CONFIG)
    try:
        os.kill(llm.process.pid, signal.SIGKILL)
        llm.process.join(HANG)
        with pytest.raises(EngineDeadError):
            llm.send(("abort", ["nobody"]))
        with pytest.raises(EngineDeadError):
            run(collect(llm, "Too late", 2))
        assert not llm.streams
    finally:
        llm.close()
    assert not llm.is_healthy()


def test_a_core_that_stops_reading_is_reported_while_writes_to_it_block(tiny):
    """A stopped core (SIGSTOP) reads nothing: once the socket's buffer is full, a write to it blocks. The callers
    whose requests are being written, and every other, must still get EngineDeadError after the timeout: no write
    may block while it holds a lock the output thread needs to report the death."""
    llm = AsyncLLM(str(tiny), timeout=2.0, **CONFIG)
    prompts = [
        [random.randrange(3, 2000) for _ in range(500)] for _ in range(300)
    ]  # ~0.5 MB of token ids

    async def callers() -> list:
        async def one(prompt):
            try:
                return [out async for out in llm.generate(prompt, greedy(2))]
            except EngineDeadError as e:
                return e

        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        os.kill(llm.process.pid, signal.SIGSTOP)
        results = run(callers())
        assert all(isinstance(r, EngineDeadError) for r in results), [
            r for r in results if isinstance(r, list)
        ]
        assert not llm.is_healthy()
    finally:
        llm.close()
    assert not llm.process.is_alive()
