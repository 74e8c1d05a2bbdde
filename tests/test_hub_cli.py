"""Hub ids on the command line: `python -m minivllm --model ORG/NAME` and `python -m minivllm.serve ORG/NAME` (vLLM's
positional model) run the id's snapshot from the Hub cache, as a folder would; a folder of the id's name wins; a model
that cannot be had or loaded (unknown id, missing revision, an architecture we lack) is one line naming it, exit code
2, no traceback. Subprocesses on an offline Hub cache laid out on disk (conftest's `hub_cache`): no network, CPU on a
machine without a GPU, greedy. Timeouts only catch hangs: nothing here measures time."""

import ast
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from huggingface_hub.errors import GatedRepoError, HfHubHTTPError  # noqa: E402

import minivllm  # noqa: E402
from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.__main__ import main as cli_main  # noqa: E402
from minivllm.checkpoint import write_checkpoint  # noqa: E402
from minivllm.models import hub  # noqa: E402
from minivllm.serve import main as serve_main  # noqa: E402
from minivllm.testing import edited_copy, lay_out_hub_cache  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ID = "minivllm/tiny"
PROMPTS = ["Once upon a time", "The capital of France is"]
CLI_FLAGS = [
    "--max-tokens",
    "12",
    "--ignore-eos",
    "--max-model-len",
    "512",
]  # greedy: --temperature 0 is the default
STARTUP_S = 120  # a hang check: a start takes seconds


def hub_env(cache: Path) -> dict[str, str]:
    """This environment (TRITON_INTERPRET=1 on a CPU, as conftest sets it) with the Hub cache `cache`, offline, and
    this checkout first on the path (the subprocesses may run in another folder)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", PYTHONPATH=path)


def run(
    module: str, *args: str, env: dict[str, str], cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=cwd,
    )


def completions(stdout: str) -> list[str]:
    """The completion texts `python -m minivllm` printed: the line after each `--- 'prompt' (N tokens)` starts with the
    text's repr, then `  [N tokens, reason, TTFT ...]` (a time, left out)."""
    lines = stdout.splitlines()
    texts = [
        lines[i + 1].rsplit("  [", 1)[0] for i, line in enumerate(lines) if line.startswith("--- ")
    ]
    return [ast.literal_eval(text) for text in texts]


def offline_texts(folder: Path) -> list[str]:
    """What the CLI's settings give in this process, on the checkpoint folder `folder`."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(folder), max_model_len=512) as llm:
        return [out.outputs[0].text for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a refused start prints: exit code 2, nothing else on stderr, no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


# --- python -m minivllm --------------------------------------------------------------------------------------------


def test_cli_runs_a_hub_id_as_its_snapshot_folder(hub_cache, tiny):
    env = hub_env(hub_cache)
    by_id = run("minivllm", "--model", ID, *CLI_FLAGS, *PROMPTS, env=env)
    assert by_id.returncode == 0, by_id.stderr
    snapshot = next((hub_cache / "models--minivllm--tiny" / "snapshots").iterdir())
    by_folder = run("minivllm", "--model", str(snapshot), *CLI_FLAGS, *PROMPTS, env=env)
    assert by_folder.returncode == 0, by_folder.stderr
    assert completions(by_id.stdout) == completions(by_folder.stdout) == offline_texts(tiny)


def test_cli_takes_the_hub_cache_from_download_dir_and_the_tokenizer_by_id(
    hub_cache, tiny, tmp_path
):
    env = hub_env(
        tmp_path / "empty-cache"
    )  # HF_HUB_CACHE holds nothing: --download-dir is where the id is
    flags = ["--download-dir", str(hub_cache), "--revision", "main", "--tokenizer", ID]
    proc = run("minivllm", "--model", ID, *flags, *CLI_FLAGS, *PROMPTS, env=env)
    assert proc.returncode == 0, proc.stderr
    assert completions(proc.stdout) == offline_texts(tiny)


def test_a_folder_named_like_the_id_wins_over_the_hub_cache(hub_cache, tiny, tmp_path):
    other = write_checkpoint(
        tmp_path / "minivllm" / "tiny", "tiny", seed=1
    )  # ./minivllm/tiny in the cwd below
    expected = offline_texts(other)
    assert expected != offline_texts(tiny)  # the two checkpoints are told apart by their outputs
    proc = run(
        "minivllm", "--model", ID, *CLI_FLAGS, *PROMPTS, env=hub_env(hub_cache), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert completions(proc.stdout) == expected


# --- what cannot start: the CLI and the server alike ---------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_cache(tiny, tmp_path_factory) -> Path:
    """A Hub cache holding the tiny checkpoint twice, spoilt: as `minivllm/mixtral`, its config.json naming an
    architecture we lack; as `minivllm/bin-only`, its weights in a PyTorch .bin file, not safetensors."""
    cache, work = tmp_path_factory.mktemp("hub-bad"), tmp_path_factory.mktemp("bad")
    mixtral = edited_copy(
        tiny, work / "mixtral", lambda c: c.update(architectures=["MixtralForCausalLM"])
    )
    lay_out_hub_cache(mixtral, cache, "minivllm/mixtral")
    bin_only = edited_copy(tiny, work / "bin-only")
    (bin_only / "model.safetensors").rename(
        bin_only / "pytorch_model.bin"
    )  # its bytes do not matter: not read
    lay_out_hub_cache(bin_only, cache, "minivllm/bin-only")
    return cache


PROGRAMS = {
    "cli": ("minivllm", ["--model"]),
    "serve": ("minivllm.serve", []),
}  # the server's model is positional


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize(
    "model, flags, named",
    [
        (
            "minivllm/not-there",
            [],
            ["--model minivllm/not-there:", "not in the Hub cache", "HF_HUB_OFFLINE"],
        ),
        (ID, ["--revision", "v9"], [f"--model {ID}:", "revision v9"]),
        (
            ID,
            ["--tokenizer", "minivllm/no-tokenizer"],
            ["--tokenizer minivllm/no-tokenizer:", "not in the Hub cache"],
        ),
        (
            "minivllm/mixtral",
            [],
            [
                "--model minivllm/mixtral:",
                "MixtralForCausalLM",
                "not supported",
                "Qwen3ForCausalLM",
            ],
        ),
        ("minivllm/bin-only", [], ["--model minivllm/bin-only has no *.safetensors", ".bin"]),
    ],
)
def test_a_model_that_cannot_start_is_one_line_naming_it(
    hub_cache, bad_cache, program, model, flags, named
):
    module, model_flag = PROGRAMS[program]
    cache = hub_cache if model.startswith(ID) else bad_cache
    line = one_line(
        run(module, *model_flag, model, *flags, "--max-model-len", "512", env=hub_env(cache))
    )
    assert line.startswith(f"python -m {module}: error: "), line
    for part in named:
        assert part in line, line


def hub_error(kind: type[OSError], message: str) -> OSError:
    error = kind.__new__(
        kind
    )  # its __init__ wants the HTTP response: only the type and the message matter here
    OSError.__init__(error, message)
    return error


@pytest.mark.parametrize("main", [cli_main, serve_main], ids=["cli", "serve"])
@pytest.mark.parametrize(
    "error, named",
    [
        (
            GatedRepoError,
            ["--model meta/gated is gated", "hf auth login"],
        ),  # a PermissionError from resolve_model
        (
            HfHubHTTPError,
            ["--model meta/gated: 500 Server Error"],
        ),  # the Hub's other errors, OSErrors as they come
    ],
)
def test_a_gated_repo_or_a_hub_error_is_one_line_naming_the_id(
    monkeypatch, capsys, main, error, named
):
    """What a real Hub answers (no network here): snapshot_download raising the error huggingface_hub raises."""

    def snapshot_download(*args, **kwargs):
        raise hub_error(
            error, "500 Server Error: Internal Server Error for url https://huggingface.co/api/..."
        )

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    with pytest.raises(SystemExit) as exit:
        main([*(["--model"] if main is cli_main else []), "meta/gated", "--max-model-len", "512"])
    assert exit.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    for part in named:
        assert part in lines[0], lines


# --- python -m minivllm.serve --------------------------------------------------------------------------------------


@contextmanager
def running_server(args: list[str], env: dict[str, str], log: Path) -> Iterator[str]:
    """`python -m minivllm.serve ARGS` on a free port of 127.0.0.1 (port 0: the system picks one, and uvicorn logs
    which), until the block ends; yields its base URL once /health answers."""
    command = [
        sys.executable,
        "-m",
        "minivllm.serve",
        *args,
        "--port",
        "0",
        "--max-model-len",
        "512",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url, deadline = None, time.monotonic() + STARTUP_S
        while time.monotonic() < deadline and proc.poll() is None:
            if url is None and (
                found := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log.read_text())
            ):
                url = found[1]
            if url is not None:
                try:
                    if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        else:
            raise AssertionError(
                f"the server did not answer /health (exit code {proc.poll()}): {log.read_text()}"
            )
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("how", ["positional", "--model"])
def test_the_server_serves_a_hub_id_under_that_name(hub_cache, tiny, tmp_path, how):
    args = [ID] if how == "positional" else ["--model", ID]
    ids = [5, 77, 300, 9, 1000]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    with LLM(str(tiny), max_model_len=512) as llm:
        expected = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    tokens = [
        row[token].decoded_token for token, row in zip(expected.token_ids, expected.logprobs or [])
    ]
    with running_server(args, hub_env(hub_cache), tmp_path / "server.log") as url:
        models = httpx.get(f"{url}/v1/models", timeout=60).json()
        assert [m["id"] for m in models["data"]] == [ID]
        body = dict(model=ID, prompt=ids, max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
    choice = reply["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (expected.text, "length"), reply
    assert choice["logprobs"]["tokens"] == tokens and len(tokens) == 8, reply
    assert reply["usage"]["completion_tokens"] == 8 and reply["model"] == ID


def test_the_server_still_serves_a_preset(tmp_path):
    env = dict(
        hub_env(tmp_path / "empty-cache"), MINIVLLM_CHECKPOINTS=str(tmp_path / "checkpoints")
    )
    with running_server(["--preset", "tiny"], env, tmp_path / "server.log") as url:
        models = httpx.get(f"{url}/v1/models", timeout=60).json()
        reply = httpx.post(
            f"{url}/v1/completions",
            json=dict(model="tiny", prompt=[5, 6], max_tokens=2),
            timeout=300,
        )
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2, reply.text


def test_the_server_takes_engine_flags_and_an_api_key(hub_cache, tmp_path):
    """vLLM's command line: engine flags generated from Config (that they reach the engine: test_serve_flags.py) and
    --api-key, which closes /v1/ to a client without the key but leaves /health (running_server's) and /version."""
    flags = [
        "--max-num-seqs",
        "3",
        "--block-size",
        "32",
        "--no-enable-prefix-caching",
        "--api-key",
        "sk-e2e",
    ]
    with running_server([ID, *flags], hub_env(hub_cache), tmp_path / "server.log") as url:
        version = httpx.get(f"{url}/version", timeout=60)
        refused = httpx.get(f"{url}/v1/models", timeout=60)
        body = dict(model=ID, prompt=[5, 6], max_tokens=2)
        reply = httpx.post(
            f"{url}/v1/completions",
            json=body,
            headers={"Authorization": "Bearer sk-e2e"},
            timeout=300,
        )
    assert version.json() == {"version": minivllm.__version__}
    assert (
        refused.status_code == 401 and refused.json()["error"]["type"] == "invalid_request_error"
    ), refused.text
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2, reply.text
