"""`AsyncLLM` under a hostile client: hundreds of callers at once from several threads, callers that leave early,
request ids reused, a step that fails, an engine thread that dies. Nothing here decides by timing: the races are
forced with hooks, and the timeouts only guard against a hang. CPU, tiny preset, float32, greedy."""

import asyncio
import contextlib
import threading
import time

import pytest
import torch

from minivllm import SamplingParams
from minivllm.async_llm import AsyncLLM

CONFIG = dict(dtype=torch.float32, device="cpu", num_kvcache_blocks=256, max_model_len=512, max_num_seqs=32)
HANG = 120  # seconds: only a guard against a hang, never what a test decides by


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny):
    llm = AsyncLLM(str(tiny), **CONFIG)
    yield llm
    llm.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG))


async def collect(llm: AsyncLLM, prompt: str, max_tokens: int, request_id: str | None = None) -> list:
    return [out async for out in llm.generate(prompt, greedy(max_tokens), request_id)]


def wait_until_idle(llm: AsyncLLM) -> None:
    """Until the engine has nothing left to run (aborts are freed within a step); a hang guard, not a decision."""
    deadline = time.monotonic() + HANG
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)


def healthy(llm: AsyncLLM) -> bool:
    return llm.thread.is_alive() and getattr(llm, "is_healthy", lambda: True)()


class Tripwire:
    """A stream stand-in whose `unread` (read by `send` as it goes through the streams) runs `action` on another
    thread, to completion, the first time it is read: other callers coming and going mid-iteration."""

    def __init__(self, action):
        self.action, self.fired, self.num_tokens = action, False, 0

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


def test_send_survives_callers_coming_and_going_while_it_iterates(llm):
    """The engine's thread iterated `streams` while event loops removed entries and executor threads added them:
    "dictionary changed size during iteration" killed it. Forced here: the streams change mid-iteration."""
    others = {f"other-{i}": Tripwire(lambda: None) for i in range(3)}

    def come_and_go() -> None:  # as another caller's generate adds its stream, and a third one's finally drops its
        llm.streams["newcomer"] = Tripwire(lambda: None)
        llm.streams["another"] = Tripwire(lambda: None)
        del llm.streams["other-1"]

    llm.streams.update({"tripwire": Tripwire(come_and_go), **others})
    try:
        llm.send([])  # what the engine's thread runs after every step
        assert llm.streams["tripwire"].fired
    finally:
        for request_id in ["tripwire", "newcomer", "another", *others]:
            llm.streams.pop(request_id, None)
    assert healthy(llm)
    assert len(run(collect(llm, "Still alive?", 3))) >= 1  # and the engine still serves


def test_progress_is_asked_with_a_set(llm):
    """`progress` tests each request's id against the ids it is given: a list made that O(n*m) per step."""
    progress, kinds = llm.engine.progress, []
    llm.engine.progress = lambda ids: kinds.append(type(ids)) or progress(ids)
    try:
        outs = run(collect(llm, "Once upon a time", 5))
    finally:
        del llm.engine.progress
    assert outs[-1].finished and kinds and all(issubclass(kind, (set, frozenset)) for kind in kinds)


def test_hundreds_of_callers_from_several_threads_some_leaving_early(llm):
    """300 callers on 4 event loops (so the streams are added and dropped from many threads while the engine
    steps): a third read one output and leave, a few are cancelled at once; all end cleanly, the engine lives on,
    and every KV block comes back."""
    bm = llm.engine.scheduler.block_manager
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
        await asyncio.gather(*(cancelled(n) if i % 25 == 0 else caller(n, i) for i, n in enumerate(names)))

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
    assert healthy(llm)
    wait_until_idle(llm)
    assert not llm.streams and not llm.engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks


def test_a_request_id_in_use_by_an_unread_caller_is_refused(llm):
    """The first caller's request has finished in the engine, but its caller has not read the last output: the
    id is still its own. Reusing it used to let that caller's cleanup delete the newcomer's stream."""
    send, done = llm.send, threading.Event()

    def send_and_note(finished: list) -> None:
        send(finished)
        if any(out.request_id == "dup" for out in finished):
            done.set()

    async def scenario() -> tuple:
        first = llm.generate("Once upon a time", greedy(4), request_id="dup")
        head = await anext(first)
        await asyncio.get_running_loop().run_in_executor(None, done.wait, HANG)  # finished, not read
        with pytest.raises(ValueError, match="dup"):
            await anext(llm.generate("Hello", greedy(4), request_id="dup"))
        rest = [out async for out in first]  # the first caller still gets its reply
        again = await collect(llm, "Hello", 4, request_id="dup")  # and once it is read, the id is free again
        return head, rest, again

    llm.send = send_and_note
    try:
        head, rest, again = run(scenario())
    finally:
        del llm.send
    assert not head.finished and rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 4
    assert again[-1].finished and again[-1].request_id == "dup"
    assert not llm.streams


def test_a_caller_cancelled_while_its_request_is_added_leaves_nothing_behind(llm):
    """A client that disconnects while `generate` waits for its request to be added: the request is added anyway
    (on an executor thread), then must be aborted and its stream dropped, not left to block the id forever."""
    add_request, entered, go = llm.engine.add_request, threading.Event(), threading.Event()

    def slow_add_request(*args):
        entered.set()
        go.wait(HANG)
        return add_request(*args)

    async def scenario() -> None:
        task = asyncio.ensure_future(collect(llm, "Bye", 50, request_id="gone"))
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, HANG)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()  # the add goes on, on its thread (asyncio.run waits for it as it shuts the executor down)

    aborted = llm.num_aborted
    llm.engine.add_request = slow_add_request
    try:
        run(scenario())
    finally:
        go.set()
        del llm.engine.add_request
    wait_until_idle(llm)
    assert llm.num_aborted == aborted + 1 and "gone" not in llm.streams
    assert not llm.engine.has_unfinished_requests()
    assert run(collect(llm, "Hello", 2, request_id="gone"))[-1].finished  # the id is free


def test_a_failed_step_fails_only_its_requests_and_the_engine_goes_on(llm):
    """A step that raises aborts its requests: their callers get the error; the engine lives on."""
    step, calls = llm.engine.step, []

    def failing_step(request_ids=None):
        if not calls:
            calls.append(1)
            llm.engine.abort_all()  # as a failed step does with the requests it ran
            raise RuntimeError("injected step failure")
        return step(request_ids)

    progress, kinds = llm.engine.progress, []
    llm.engine.progress = lambda ids: kinds.append(type(ids)) or progress(ids)
    llm.engine.step = failing_step
    try:
        with pytest.raises(RuntimeError, match="injected step failure"):
            run(collect(llm, "Doomed", 4))
    finally:
        del llm.engine.step, llm.engine.progress
    assert kinds and all(issubclass(kind, (set, frozenset)) for kind in kinds)
    assert healthy(llm) and not llm.streams
    assert run(collect(llm, "Fine again", 4))[-1].finished


def test_a_dead_engine_thread_fails_every_caller_at_once(tiny):
    """Anything unexpected that kills the engine's thread must not leave callers hanging: each waiting caller gets
    the error, new requests are refused, and `is_healthy()` says so (for /health)."""
    llm = AsyncLLM(str(tiny), **CONFIG)
    all_waiting = threading.Event()
    try:

        def broken_send(finished: list) -> None:  # after the first step, once all five callers wait
            all_waiting.wait(HANG)
            raise RuntimeError("dictionary changed size during iteration")  # what the race raised

        async def caller(i: int) -> BaseException | None:
            try:
                await collect(llm, f"Caller {i}", 8)
            except Exception as e:  # noqa: BLE001 - the test looks at it
                return e
            return None

        async def scenario() -> list:
            waiting = [asyncio.ensure_future(caller(i)) for i in range(5)]
            while len(llm.streams) < 5:  # a hang guard bounds it: all five registered before the engine dies
                await asyncio.sleep(0.001)
            all_waiting.set()
            return await asyncio.gather(*waiting)

        llm.send = broken_send
        errors = run(scenario())
        assert len(errors) == 5 and all(isinstance(e, RuntimeError) for e in errors), errors
        assert all("died" in str(e) for e in errors), errors
        assert not llm.is_healthy()
        with pytest.raises(RuntimeError, match="died"):
            run(collect(llm, "Too late", 2))
    finally:
        llm.stopped = True
        llm.wakeup.set()
        llm.thread.join(HANG)
        llm.engine.close()
