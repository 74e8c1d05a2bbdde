"""`python -m minivllm.serve` as an operator runs it, its engine core in a process of its own: a killed core makes
`/health` answer 503 and every request fail at once (a stream ends with an error event); a server stopped with
SIGINT or SIGTERM leaves no process behind. Timeouts here only guard against a hang."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")

HANG = 120  # seconds: a guard, never what a test decides by


def children(pid: int) -> list[int]:
    """The processes whose parent is pid (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited


def core_pid(server: subprocess.Popen) -> int:
    """The engine core: the spawned child that is not multiprocessing's resource tracker."""
    for pid in children(server.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no engine core among {children(server.pid)}")


@pytest.fixture
def serve(tiny: Path):
    """A server subprocess over the tiny checkpoint, once /health answers; yields (process, base url, model name)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        sys.executable,
        "-m",
        "minivllm.serve",
        str(tiny),
        "--port",
        str(port),
        "--max-model-len",
        "512",
    ]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + HANG
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    assert server.poll() is None, server.stderr.read().decode()[-2000:] if server.stderr else ""
    yield server, url, str(tiny)
    if server.poll() is None:
        server.kill()
    server.wait(HANG)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_server_leaves_no_process_behind(serve, sig):
    server, url, _ = serve
    core = core_pid(server)
    spawned = children(server.pid)
    server.send_signal(sig)
    assert server.wait(HANG) == 0
    deadline = time.monotonic() + HANG
    while any(alive(pid) for pid in spawned) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert core in spawned and not any(alive(pid) for pid in spawned)


def test_a_killed_core_fails_health_and_every_request(serve):
    server, url, model = serve
    body = dict(model=model, prompt="A long story:", max_tokens=400, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=HANG) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it has started
        os.kill(core_pid(server), signal.SIGKILL)  # as the out-of-memory killer would
        rest = [line for line in lines if line.startswith("data:")]
    last = json.loads(rest[-1].removeprefix("data: "))
    assert (
        "died" in last["error"]["message"] and last["error"]["type"] == "server_error"
    )  # an error, no [DONE]
    assert httpx.get(f"{url}/health", timeout=HANG).status_code == 503
    again = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=HANG)
    assert again.status_code == 503 and "died" in again.json()["error"]["message"]


def gauges(url: str) -> dict[str, float]:
    """/metrics' gauges of the engine's load, by name."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=HANG).text
    families = text_string_to_metric_families(text)
    return {f.name: f.samples[0].value for f in families if f.type == "gauge"}


def test_metrics_of_a_dead_core_say_nothing_runs(serve):
    """The gauges came from the core's last message: once it had died, they said forever that its
    last requests ran."""
    server, url, model = serve
    body = dict(model=model, prompt="A long story:", max_tokens=400, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=HANG) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it runs
        deadline = time.monotonic() + HANG
        while gauges(url)["vllm:num_requests_running"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the core's next message says so
        assert gauges(url)["vllm:num_requests_running"] == 1
        os.kill(core_pid(server), signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data:")]
        assert "died" in rest[-1]  # the server knows
    load = gauges(url)
    assert load["vllm:num_requests_running"] == load["vllm:num_requests_waiting"] == 0, load
    assert load["vllm:kv_cache_usage_perc"] == 0
