"""`AsyncLLM` under a hostile client: hundreds of callers at once from several threads, callers that leave early,
request ids reused, a step that fails, an engine core that dies or hangs. Nothing here decides by timing: the races
are forced with hooks (the core on a thread of this process, `multiprocessing=False`, where a hook must reach inside
it), and the timeouts only guard against a hang. CPU, tiny preset, float32, greedy."""

import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import threading
import time

import pytest
import torch

from minivllm import SamplingParams
from minivllm.async_llm import AsyncLLM, EngineDeadError
from minivllm.config import Config
from minivllm.engine.api_core import ApiCore
from minivllm.engine.core import Delta
from minivllm.engine.core_process import handle
from minivllm.testing import WatchedDict

CONFIG = dict(
    dtype=torch.float32, device="cpu", num_kvcache_blocks=256, max_model_len=512, max_num_seqs=32
)
HANG = 120  # seconds: only a guard against a hang, never what a test decides by


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """What the input processor gives the core: one SamplingParams per completion, seeded seed + i
    (the rule `tests/test_n_and_logprobs.py` checks through the engine)."""
    seeds = [None if params.seed is None else params.seed + i for i in range(params.n)]
    return [dataclasses.replace(params, n=1, seed=seed) for seed in seeds]


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


def test_a_step_never_walks_the_queue(tiny):
    """Per step, the core looks at the batch it ran, not at every queued request: with hundreds waiting, a walk
    over them each step cost O(queue) per step (O(queue²) in all). The core's table of requests is watched while
    it steps, and only then (adding a request may look at it)."""
    core, walks, stepping = ApiCore(Config(str(tiny), **CONFIG)), [], False
    core.requests = WatchedDict(core.requests, walks, lambda: stepping)
    finished = set()
    try:
        for i in range(200):
            core.add_request(f"r{i}", [5 + i % 7, 11, 13 + i], sample_params(greedy(2)))
        while core.has_unfinished_requests():
            stepping = True
            deltas, _ = core.step()
            stepping = False
            finished |= {d.request_id for d in deltas if d.finish_reason is not None}
    finally:
        core.close()
    assert len(finished) == 200 and not walks


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
    id is still its own. Reusing it used to let that caller's cleanup delete the newcomer's stream. (Finished: a
    request added after its first output and as long as all of it has run to its end meanwhile, and the engine's
    outputs reach this event loop in the order it made them.)"""

    async def scenario() -> tuple:
        first = llm.generate("Once upon a time", greedy(4), request_id="dup")
        head = await anext(first)
        assert (await collect(llm, "Meanwhile", 4))[-1].finished  # "dup" finished, not read
        with pytest.raises(ValueError, match="dup"):
            await anext(llm.generate("Hello", greedy(4), request_id="dup"))
        rest = [out async for out in first]  # the first caller still gets its reply
        again = await collect(
            llm, "Hello", 4, request_id="dup"
        )  # and once it is read, the id is free again
        return head, rest, again

    head, rest, again = run(scenario())
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


# --- n > 1: one completion ended in the core, another by a stop string ---
# tiny-text, whose text holds the stop strings; seeded samples

ABOVE = [" above"]
STOP_ID_THEN_STRING = SamplingParams(n=2, seed=0, max_tokens=16, stop_token_ids=[998], stop=ABOVE)
STOP_STRINGS = [SamplingParams(n=2, seed=seed, max_tokens=16, stop=ABOVE) for seed in range(4)]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def text_offline(tiny_text):
    """The oracle: offline `LLM.generate` on tiny-text, the same settings."""
    from minivllm import LLM

    with LLM(str(tiny_text), **CONFIG) as llm:
        yield llm


@pytest.fixture(scope="module", params=["thread", "process"])
def text_llm(tiny_text, request):
    """`AsyncLLM` on tiny-text: its core on a thread of this process, then in a process."""
    llm = AsyncLLM(str(tiny_text), multiprocessing=request.param == "process", **CONFIG)
    yield llm
    llm.close()


def completions(out) -> list[tuple]:
    return [(c.text, c.token_ids, c.finish_reason) for c in out.outputs]


def ends(out) -> list[tuple[int, str | None]]:
    return [(len(c.token_ids), c.finish_reason) for c in out.outputs]


async def last_output(llm: AsyncLLM, params: SamplingParams, request_id: str | None = None):
    return [out async for out in llm.generate(PROMPT, params, request_id)][-1]


@pytest.mark.slow  # the tiny_text fixture trains for half a minute
def test_a_completion_ended_in_the_core_sends_its_last_delta_at_that_step(tiny_text, text_offline):
    """Completion 0 ends on the stop id at its 3rd token, completion 1 runs on to its 16th: the
    core sends completion 0's last delta, finish reason and all, at the step that ends it. It
    used to keep it until the whole request ended, so the API process thought it still ran."""
    params = dataclasses.replace(STOP_ID_THEN_STRING, stop=[])
    core = ApiCore(Config(str(tiny_text), **CONFIG))
    try:
        prompt_ids = text_offline.get_tokenizer().encode(PROMPT)
        handle(core, ("add", "r", prompt_ids, sample_params(params)))
        steps = []
        while core.has_unfinished_requests():
            steps.append(core.step()[0])
    finally:
        core.close()
    want = text_offline.generate([prompt_ids], params, use_tqdm=False)[0]
    assert ends(want) == [(3, "stop"), (16, "length")]
    last_step = {}  # completion -> the step of its last delta
    for c in want.outputs:
        mine = [(k, d) for k, step in enumerate(steps) for d in step if d.completion == c.index]
        assert [t for _, d in mine for t in d.token_ids] == c.token_ids
        reasons = [d.finish_reason for _, d in mine]
        assert reasons == [None] * (len(mine) - 1) + [c.finish_reason]  # the last delta ends it
        last_step[c.index] = mine[-1][0]
    assert last_step[0] < last_step[1] == len(steps) - 1, last_step


@pytest.mark.slow  # the tiny_text fixture trains for half a minute
def test_n_with_a_stop_id_and_a_stop_string_ends_as_offline(text_llm, text_offline):
    """n=2: completion 0 ends in the core (stop id 998, 3rd token), completion 1 later on a stop
    string (9th). The API process used to tell the core to finish completion 1 when the core had
    finished completion 0 already: the request stayed live in the core, its caller waited
    forever. Then seeds with a stop string alone: every reply equals offline `generate`'s, and
    the core holds nothing afterwards."""
    want = text_offline.generate(PROMPT, STOP_ID_THEN_STRING, use_tqdm=False)[0]
    assert ends(want) == [(3, "stop"), (9, "stop")]
    first, second = want.outputs
    assert first.token_ids[-1] == 998 and 998 not in second.token_ids  # the id, then the string
    for params in [STOP_ID_THEN_STRING, *STOP_STRINGS]:
        want = text_offline.generate(PROMPT, params, use_tqdm=False)[0]
        got = run(last_output(text_llm, params))
        assert got.finished and completions(got) == completions(want), params
    assert wait_until_idle(text_llm)["kv_cache_usage"] == 0 and not text_llm.streams


@pytest.mark.slow  # the tiny_text fixture trains for half a minute
def test_a_finish_for_a_completion_the_core_ended_first_ends_the_request(tiny_text, text_offline):
    """The race itself, forced: completion 1 hits its stop string (9th token), and the API
    process's ("finish", id, 1) reaches the core only once the core has ended completion 0 by
    length (16th token). The core must end completion 1 through the engine's own path: the
    request ends there, its caller gets the whole reply, and the core keeps nothing. (It used to
    end the sequence behind the engine's back: the request stayed live.)"""
    params = STOP_STRINGS[0]
    want = text_offline.generate(PROMPT, params, use_tqdm=False)[0]
    assert ends(want) == [(16, "length"), (9, "stop")]
    llm = AsyncLLM(str(tiny_text), multiprocessing=False, **CONFIG)
    core, send = llm.core, llm.send
    core_step, ahead, sent = core.step, threading.Event(), threading.Event()

    def step_then_wait():  # after the step that ends completion 0, wait for the "finish"
        deltas = core_step()
        request = core.requests.get("race")
        if request is not None and request.seqs[0].is_finished and not ahead.is_set():
            ahead.set()
            sent.wait(HANG)
        return deltas

    def send_late(message: tuple) -> None:  # the "finish" waits until the core is ahead
        if message[0] == "finish":
            ahead.wait(HANG)
        send(message)
        if message[0] == "finish":
            sent.set()

    core.step, llm.send = step_then_wait, send_late
    try:
        got = run(last_output(llm, params, "race"))
        assert ahead.is_set() and sent.is_set()
        assert completions(got) == completions(want)
        assert wait_until_idle(llm)["kv_cache_usage"] == 0
        assert not core.requests and not core.owners
    finally:
        llm.close()


@pytest.mark.slow  # the tiny_text fixture trains for half a minute
def test_a_finish_for_what_the_core_ended_or_dropped_changes_nothing(tiny_text, text_offline):
    """A "finish" may cross a delta on its way: for a completion the core has ended (here by its
    stop id), or a request it has finished or aborted, it is harmless; the request runs on to the
    same reply as offline."""
    params = dataclasses.replace(STOP_ID_THEN_STRING, stop=[])
    core = ApiCore(Config(str(tiny_text), **CONFIG))
    try:
        prompt_ids = text_offline.get_tokenizer().encode(PROMPT)
        handle(core, ("finish", "nobody", 0))  # never seen, or forgotten
        handle(core, ("add", "r", prompt_ids, sample_params(params)))
        request, deltas = core.requests["r"], []
        while not request.seqs[0].is_finished:
            deltas += core.step()[0]
        handle(core, ("finish", "r", 0))
        assert request.seqs[0].finish_reason == "stop"
        while core.has_unfinished_requests():
            deltas += core.step()[0]
        handle(core, ("finish", "r", 1))
        assert not core.requests
        handle(core, ("add", "gone", prompt_ids, sample_params(params)))
        handle(core, ("abort", ["gone"]))
        handle(core, ("finish", "gone", 0))
        assert not core.has_unfinished_requests() and not core.requests
    finally:
        core.close()
    want = text_offline.generate([prompt_ids], params, use_tqdm=False)[0].outputs
    for c in want:
        assert [t for d in deltas if d.completion == c.index for t in d.token_ids] == c.token_ids
