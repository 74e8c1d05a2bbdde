"""Tensor parallelism (notebook 04): TP 2 gives what TP 1 gives, each engine owns its process groups, and no
failure hangs: a dead worker, a Ctrl-C, a script without a main guard. On CPUs over gloo; on two GPUs over NCCL."""

import multiprocessing
import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from test_model_runner import run_steps

from minivllm import LLM, SamplingParams
from minivllm.checkpoint import write_checkpoint
from minivllm.config import Config
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.production import GPUTPRunner, make_runner
from minivllm.engine.workers import TPModelRunner, sigint_held
from minivllm.models.loader import load_model
from minivllm.testing import prompt_logits

TWO_GPUS = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=TWO_GPUS)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(1, 40)), [3] * 17, [5, 6, 7]]
os.environ.setdefault(
    "NCCL_NVLS_ENABLE", "0"
)  # NVLink multicast off, in this process and those it spawns


def small_llm(tiny, tp: int, device: str = "cpu") -> LLM:
    return LLM(
        str(tiny),
        tensor_parallel_size=tp,
        device=device,
        num_kvcache_blocks=256,
        max_num_seqs=8,
        max_model_len=4096,
        dtype=torch.float32 if device == "cpu" else torch.bfloat16,
    )


def greedy_tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def no_children_left(timeout: float = 120) -> bool:
    """Whether every child process has exited within `timeout` seconds: a hang check (they exit in seconds, or are
    killed after close()'s 10 s; a busy machine may take longer)."""
    deadline = time.monotonic() + timeout
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not multiprocessing.active_children()


@pytest.fixture(scope="module")
def expected(tiny):
    with small_llm(tiny, 1) as llm:
        return greedy_tokens(llm)


# --- TP 2 = TP 1 ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tensor_parallel_2_equals_1(tiny):
    prompts = [list(range(1, 40)), [3] * 17]
    config = dict(dtype=torch.float32, num_kvcache_blocks=128, max_num_seqs=16, device="cpu")
    single_runner = ModelRunner(Config(tiny, **config))
    try:
        _, single, _ = run_steps(single_runner, prompts, 8)
    finally:
        single_runner.close()
    tp = TPModelRunner(Config(tiny, tensor_parallel_size=2, **config))
    try:
        assert len(tp.workers.processes) == 1 and tp.workers.processes[0].is_alive()
        _, double, _ = run_steps(tp, prompts, 8)
    finally:
        tp.close()
    for a, b in zip(single, double):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not tp.workers.processes[0].is_alive()  # close() ended the worker


# --- each engine owns its groups ---------------------------------------------------------------------------


def test_an_engine_made_beside_a_tensor_parallel_one_is_whole(tiny, expected):
    """Ranks used to come from torch.distributed's global group: a TP 1 engine made while a TP 2 one was alive
    was built with half of each weight (and hung)."""
    with small_llm(tiny, 2) as tp2, small_llm(tiny, 1) as tp1:
        qkv = tp1.engine.core.runner.model.model.layers[0].self_attn.qkv_proj.weight
        assert (
            qkv.shape[0] == (4 + 2 * 2) * 32
        )  # all 4 query and 2 KV heads of 32 dims: nothing split
        assert greedy_tokens(tp1) == greedy_tokens(tp2) == expected
    assert no_children_left()


def test_two_tensor_parallel_engines_at_once(tiny, expected):
    """A second TP 2 engine used to fail with AttributeError and leave an orphan worker."""
    with small_llm(tiny, 2) as first, small_llm(tiny, 2) as second:
        assert greedy_tokens(second) == greedy_tokens(first) == expected
    assert no_children_left()


# --- no failure hangs --------------------------------------------------------------------------------------


def test_a_plain_runner_refuses_tensor_parallelism_without_its_ranks(tiny):
    """ModelRunner is one rank: asked for two without the groups of a rank, it says what to use instead of
    quietly running the whole model as one rank."""
    with pytest.raises(ValueError, match="minivllm.LLM"):
        ModelRunner(
            Config(
                tiny,
                dtype=torch.float32,
                num_kvcache_blocks=16,
                tensor_parallel_size=2,
                device="cpu",
            )
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("when", ["between steps", "during a step"])
def test_a_dead_worker_fails_fast_with_its_cause(tiny, device, when):
    with small_llm(tiny, 2, device) as llm:
        greedy_tokens(llm)
        runner = llm.engine.core.runner
        worker = runner.workers.processes[0]

        def kill_worker() -> None:
            os.kill(worker.pid, signal.SIGKILL)
            worker.join()

        if when == "between steps":
            kill_worker()
        else:  # on the third step of a generate, after rank 0 told the worker what to run, before rank 0 runs it
            execute, calls = runner.execute, []

            def execute_after_a_kill(step):
                calls.append(step)
                if len(calls) == 3:
                    kill_worker()
                return execute(step)

            runner.execute = execute_after_a_kill
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="worker rank 1"):
            llm.generate(
                [[9] * 10],
                SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                use_tqdm=False,
            )
        # A hang check: rank 0 used to wait in the step's collective for STEP_TIMEOUT (600 s) or for ever; a busy
        # machine sees the dead worker in seconds, and 120 s leaves it a wide margin.
        assert time.monotonic() - start < 120
        with pytest.raises(RuntimeError, match="Create a new LLM"):
            greedy_tokens(llm)  # refused at once, with the reason
    assert no_children_left()


def test_sigint_held_passes_ctrl_c_on_when_its_block_ends():
    """Held in the block, then given to the handler that was there; a second one at once; an ignored one stays
    ignored. (os.kill to this process runs the handler before it returns; this handler records, never raises.)"""
    calls: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
            assert calls == [] and signal.getsignal(signal.SIGINT).pending  # held
        assert calls == [signal.SIGINT]
        with sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            assert calls == [signal.SIGINT] * 2  # the second one at once
        assert calls == [signal.SIGINT] * 3
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's Ctrl-C
        with sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
        assert calls == [signal.SIGINT] * 3 and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


# A Python started from a terminal turns Ctrl-C into KeyboardInterrupt. One started as a background job of a
# non-interactive shell (`cmd &`, as CI runners and nohup do) ignores it, and every process it starts inherits that:
# a script that tests Ctrl-C first takes it as a terminal's Python would.
AS_IN_A_TERMINAL = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"

CTRL_C = (
    AS_IN_A_TERMINAL
    + """
import sys, time
from minivllm import LLM, SamplingParams


def report(state):
    print(state, flush=True)


def wait_for_ctrl_c(held=lambda: False):
    while not held():  # the test sends Ctrl-C when it reads the state reported before this
        time.sleep(0.01)


if __name__ == "__main__":
    moment = sys.argv[2]
    llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", num_kvcache_blocks=256, max_num_seqs=8)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    runner, engine = llm.engine.core.runner, llm.engine
    if moment == "in a step":  # rank 0 waits inside the generate's second step (every rank has begun it)
        execute, calls = runner.execute, []

        def execute_held(inputs):
            calls.append(inputs)
            if len(calls) == 2:
                report("in a step")
                wait_for_ctrl_c(held=lambda: signal.getsignal(signal.SIGINT).pending)
            logits = execute(inputs)
            if len(calls) == 2:
                report("step ended")
            return logits

        runner.execute = execute_held
    elif moment == "between steps":  # after a generate's second step, before its third
        step, steps = engine.step, []

        def step_then_wait(*args):
            out = step(*args)
            steps.append(out)
            if len(steps) == 2:
                report("between steps")
                wait_for_ctrl_c()
            return out

        engine.step = step_then_wait
    try:
        if moment == "idle":
            report("idle")
            wait_for_ctrl_c()
        else:
            llm.generate([[9] * 10], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
        report("not interrupted")
    except KeyboardInterrupt:
        report("interrupted")
    engine.__dict__.pop("step", None)
    runner.__dict__.pop("execute", None)
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    report("same tokens" if after == before else f"different tokens: {before} then {after}")
    llm.close()
"""
)


class ScriptLines:
    """A script's stdout, line by line as it comes, read on a thread (the only reader of that pipe), so that a silent
    script cannot block the test."""

    def __init__(self, proc: subprocess.Popen):
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self.read, args=(proc.stdout,), daemon=True)
        self.reader.start()

    def read(self, stdout) -> None:
        for line in stdout:
            self.queue.put(line.rstrip("\n"))
        self.queue.put(None)  # the script closed its stdout (it ended)

    def next(self, timeout: float) -> str | None:
        """The next line, or None if the script ended first."""
        return self.queue.get(timeout=timeout)

    def rest(self, timeout: float) -> list[str]:
        """The lines after those taken, once the script has closed its stdout."""
        self.reader.join(timeout)
        return [line for line in self.queue.queue if line is not None]


@pytest.mark.parametrize("moment", ["idle", "in a step", "between steps"])
def test_ctrl_c_takes_effect_and_leaves_the_tensor_parallel_engine_usable(tiny, tmp_path, moment):
    """Ctrl-C (to the whole process group, as a terminal sends it) at an idle engine raises at once; in a step it
    waits for the step's end; between the steps of a generate it raises there. Each time the engine gives the same
    tokens afterwards (it used to leave rank 0 and the worker out of step: the next generate hung for 300 s).
    Synchronised on the states the script reports, not on time: the timeouts below only catch a hang (each state
    comes within seconds; a busy machine may take a minute)."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C)
    command = [sys.executable, str(script), str(tiny), moment]
    with open(tmp_path / "stderr.txt", "w+") as stderr:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True
        )
        lines = ScriptLines(proc)
        try:
            if reached := lines.next(timeout=300) == moment:
                os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=300)
        finally:
            proc.kill()
        seen = [moment, *lines.rest(timeout=60)]
        stderr.seek(0)
        errors = stderr.read()[-2000:]
    assert reached, f"the script ended before it reached the moment: {errors}"
    ended = ["step ended"] if moment == "in a step" else []
    assert seen == [moment, *ended, "interrupted", "same tokens"], (seen, errors)
    assert proc.returncode == 0, errors


NO_MAIN_GUARD = """
import sys
from minivllm import LLM

llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", num_kvcache_blocks=16)
"""


def test_a_script_without_main_guard_fails_fast_and_says_why(tiny, tmp_path):
    """Its spawned worker dies re-importing the script; rank 0 used to wait out the 300 s rendezvous."""
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(NO_MAIN_GUARD))
    # a hang check: the worker dies importing the script in seconds; a busy machine may take a minute, and rank 0 used
    # to wait out START_TIMEOUT (300 s)
    done = subprocess.run(
        [sys.executable, str(script), str(tiny)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode != 0
    assert "before it started" in done.stderr and 'if __name__ == "__main__":' in done.stderr


def test_a_failing_start_leaves_no_worker(tiny):
    """tensor_parallel_size=4 cannot split the tiny model's 2 KV heads: every rank fails, none is left behind."""
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        TPModelRunner(
            Config(
                tiny,
                dtype=torch.float32,
                num_kvcache_blocks=16,
                tensor_parallel_size=4,
                device="cpu",
            )
        )
    assert no_children_left()


ENGINE = (
    AS_IN_A_TERMINAL
    + """
import os, sys, time, torch
from minivllm.config import Config
from minivllm.engine.production import make_runner

if __name__ == "__main__":
    device = sys.argv[2]
    runner = make_runner(Config(sys.argv[1], dtype=torch.float32 if device == "cpu" else torch.bfloat16,
                                num_kvcache_blocks=64, max_num_seqs=16, tensor_parallel_size=2, device=device))
    print(runner.workers.processes[0].pid, flush=True)
    {ending}
"""
)
ENDINGS = {
    "close": "start = time.perf_counter(); runner.close(); print(f'close() took {time.perf_counter() - start:.2f} s', file=sys.stderr)",
    "normal exit": "pass",
    "exception": "raise RuntimeError('boom')",
    "Ctrl-C": "os.kill(os.getpid(), signal.SIGINT); time.sleep(60)",
    "rank 0 killed": "os.kill(os.getpid(), signal.SIGKILL)",
    "worker killed": "w = runner.workers.processes[0]; os.kill(w.pid, signal.SIGKILL); w.join()",
}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


# each start costs a minute there: the cases NCCL changes
ON_TWO_GPUS = ("close", "exception", "Ctrl-C", "worker killed")
CASES = [(ending, "cpu") for ending in ENDINGS] + [
    pytest.param(ending, "cuda", marks=TWO_GPUS) for ending in ON_TWO_GPUS
]


@pytest.mark.slow
@pytest.mark.parametrize(("ending", "device"), CASES)
def test_the_engine_and_its_workers_end_in_seconds(tiny, tmp_path, ending, device):
    """However rank 0 ends, it ends (with CUDA graphs on GPUs, where close() used to hang) and so does its worker."""
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(ENGINE).format(ending=ENDINGS[ending]))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tiny), device],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker_pid = int(proc.stdout.readline())
    start = time.monotonic()
    _, stderr = proc.communicate(timeout=240)
    print(
        f"{ending} on {device}: rank 0 ended {time.monotonic() - start:.1f} s after start-up",
        stderr[-300:],
    )
    deadline = (
        time.monotonic() + 120
    )  # a hang check: the worker notices in a second; a busy machine may take more
    while alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(worker_pid), f"worker {worker_pid} outlived its engine ({ending})"
    assert (proc.returncode == 0) == (ending in ("close", "normal exit", "worker killed")), stderr


# --- on two GPUs: bf16 agreement ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3-0.6b", "qwen3-0.6b", seed=0)


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs two GPUs"
)
def test_gpu_tensor_parallel_2_agrees_with_1_in_bf16(qwen3_06b):
    """Teacher forcing on the 0.6B preset: TP 2 (CUDA graphs, NCCL) differs from TP 1 by bf16 rounding only,
    no more than TP 1 differs from float32; and close() ends the worker."""
    prompts = [random.Random(n).choices(range(10000), k=n) for n in (7, 100, 513)]
    config = dict(
        dtype=torch.bfloat16, gpu_memory_utilization=0.3, max_num_seqs=16, max_model_len=1024
    )
    single_runner = make_runner(Config(qwen3_06b, **config))  # the GPU runner
    try:
        seqs, single, _ = run_steps(single_runner, prompts, num_decode_steps=16)
    finally:
        single_runner.close()
    tokens = [seq.completion_token_ids for seq in seqs]
    tp = make_runner(Config(qwen3_06b, tensor_parallel_size=2, **config))
    assert isinstance(tp, GPUTPRunner)
    graphs = (
        tp.graphs
    )  # still held when close() runs: it must end all the same (NCCL waits for graphs it is in)
    try:
        _, double, _ = run_steps(tp, prompts, num_decode_steps=16, force=tokens)
    finally:
        start = time.perf_counter()
        tp.close()
        print(f"TP 2 close(): {time.perf_counter() - start:.2f} s")
    assert (
        graphs is not None and graphs.num_replays == 16
    )  # every decode step went through a CUDA graph
    assert not tp.workers.processes[0].is_alive()
    reference = load_model(qwen3_06b, dtype=torch.float32, device="cuda")
    fp32 = [
        prompt_logits(reference, seq.token_ids)
        .float()
        .cpu()[seq.num_prompt_tokens - 1 : len(seq) - 1]
        for seq in seqs
    ]
    single, double, fp32 = torch.cat(single), torch.cat(double), torch.cat(fp32)
    tp_error, bf16_error = (double - single).abs().max().item(), (single - fp32).abs().max().item()
    top2 = fp32.topk(2, dim=-1).values
    decisive = top2[:, 0] - top2[:, 1] > 0.1
    agree = (double.argmax(-1) == single.argmax(-1)).float().mean().item()
    print(
        f"TP 2 vs 1: max |Δ| {tp_error:.4f}, top-1 agreement {agree:.1%}; TP 1 bf16 vs fp32: max |Δ| {bf16_error:.4f}"
    )
    assert tp_error <= 2 * bf16_error
    assert (double.argmax(-1) == fp32.argmax(-1))[decisive].all()
