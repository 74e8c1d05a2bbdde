"""The server's command line and its access: every field of Config is a flag of `python -m minivllm.serve` (and of
`python -m minivllm`), typed by its annotation, given to the engine only when set; --api-key (or MINIVLLM_API_KEY)
closes every route but /health and /version to who does not send `Authorization: Bearer KEY`; /version answers the
package's version. In this process, on the tiny checkpoint on a CPU."""

import dataclasses
import json
import shutil
from typing import Any, Literal, get_args

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from starlette.testclient import TestClient  # noqa: E402

import minivllm  # noqa: E402
from minivllm import __main__ as cli  # noqa: E402
from minivllm import serve  # noqa: E402
from minivllm.async_llm import AsyncLLM  # noqa: E402
from minivllm.config import Config  # noqa: E402
from minivllm.engine_args import engine_kwargs, flag_kwargs  # noqa: E402
from minivllm.serve.testing import serve_in_thread  # noqa: E402

ENGINE_FIELDS = [
    field for field in dataclasses.fields(Config) if field.init and field.name != "model"
]
KEY = "sk-minivllm-test"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def given(argv: list[str]) -> dict[str, Any]:
    """What serve's command line `MODEL ARGV` gives the engine, each value with its type."""
    parser, names = serve.server_parser()
    return {
        name: (value, type(value))
        for name, value in engine_kwargs(parser.parse_args(["m", *argv]), names).items()
    }


@pytest.mark.parametrize("field", ENGINE_FIELDS, ids=lambda field: field.name)
def test_every_config_field_is_a_flag_of_the_server(field):
    """A new field of Config without a flag fails here. "1" parses as any int, float or str field."""
    if bool in (get_args(field.type) or (field.type,)):
        assert given([flag(field.name)]) == {field.name: (True, bool)}
        assert given([flag("no_" + field.name)]) == {field.name: (False, bool)}
    else:
        assert list(given([flag(field.name), "1"])) == [field.name]


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], {}),  # nothing given: Config's defaults hold
        (
            ["--max-num-seqs", "3", "--block-size", "32"],
            {"max_num_seqs": (3, int), "block_size": (32, int)},
        ),
        (["--num-kvcache-blocks", "64"], {"num_kvcache_blocks": (64, int)}),  # int | None
        (["--gpu-memory-utilization", "0.5"], {"gpu_memory_utilization": (0.5, float)}),
        (
            ["--dtype", "float32", "--revision", "v1"],
            {"dtype": ("float32", str), "revision": ("v1", str)},
        ),
        (
            ["--no-enable-prefix-caching", "--enforce-eager"],
            {"enable_prefix_caching": (False, bool), "enforce_eager": (True, bool)},
        ),
        (["--async-scheduling"], {"async_scheduling": (True, bool)}),  # bool = None
        (
            ["--tensor-parallel-size", "2", "--seed", "7"],
            {"tensor_parallel_size": (2, int), "seed": (7, int)},
        ),
    ],
)
def test_flags_parse_to_the_fields_types(argv, expected):
    assert given(argv) == expected


@pytest.mark.parametrize("argv", [["--max-num-seqs", "1.5"], ["--gpu-memory-utilization", "a lot"]])
def test_a_value_of_the_wrong_type_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        given(argv)
    assert exit.value.code == 2 and f"argument {argv[0]}: invalid" in capsys.readouterr().err


def test_the_help_documents_each_flag_with_its_comment_in_config():
    help = serve.server_parser()[0].format_help()
    assert "tokens per KV block; default: 16" in help and "--no-enable-prefix-caching" in help


def test_flag_types_follow_annotations():
    assert flag_kwargs(Literal["unified", "prefill-first"]) == {
        "choices": ("unified", "prefill-first"),
        "type": str,
    }
    assert flag_kwargs(int | None) == {"type": int} and flag_kwargs(float) == {"type": float}
    with pytest.raises(TypeError, match="no command-line type"):
        flag_kwargs(bytes | None)


def test_the_cli_has_the_same_engine_flags_and_keeps_its_own():
    """python -m minivllm: --tp is --tensor-parallel-size, --seed is the requests';
    max_model_len, not given, is left to Config (the model's context length), as LLM(...) is."""
    args = cli.parse_args(
        ["--tp", "2", "--max-num-seqs", "3", "--no-enable-prefix-caching", "--seed", "5"]
    )
    expected = dict(tensor_parallel_size=2, max_num_seqs=3, enable_prefix_caching=False)
    assert args.engine_kwargs == expected
    assert args.sampling_params.seed == 5
    parser, names = cli.make_parser()
    assert names == [field.name for field in ENGINE_FIELDS if field.name != "seed"]


@pytest.fixture
def started():
    """serve's command line ARGV started as `python -m minivllm.serve ARGV` starts it, up to uvicorn
    (`serve.make_server`, what `serve.main` runs): its AsyncLLM, its app, uvicorn's arguments. The
    engines started are closed after the test."""
    engines: list[AsyncLLM] = []

    def start(argv: list[str]) -> tuple[AsyncLLM, Any, dict[str, Any]]:
        llm, server, options = serve.make_server(argv)
        engines.append(llm)
        return llm, server.app, options

    yield start
    for llm in engines:
        llm.close()


@pytest.fixture(scope="module")
def context_2048(tiny, tmp_path_factory):
    """The tiny checkpoint with a context of 2,048 tokens (max_position_embeddings), less than the
    CLI's old default max_model_len of 4,096."""
    folder = tmp_path_factory.mktemp("ckpt") / "tiny-2048"
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    return folder


def test_the_cli_takes_the_models_context_length(context_2048, capsys):
    """No --max-model-len: the model's context length, as LLM(...) takes it (the CLI's own
    default, 4096, refused a model whose context is 2,048)."""
    flags = ["--device", "cpu", "--num-kvcache-blocks", "64", "--max-tokens", "2"]
    cli.main(["--model", str(context_2048), *flags, "Hello"])
    assert "1 requests, 2 output tokens" in capsys.readouterr().out


def test_the_server_takes_the_models_context_length(started, context_2048):
    llm, _, _ = started([str(context_2048), "--device", "cpu", "--num-kvcache-blocks", "64"])
    assert llm.config.max_model_len == 2048


def test_the_keep_alive_outlasts_the_clients(started, tiny):
    """uvicorn closes a connection idle for --timeout-keep-alive seconds. At its default (5 s),
    httpx's keep-alive expiry too, a client could send a request on a connection the server was
    closing: no reply (BrokenPipeError, ReadError). The default must be well above clients' expiry;
    the flag sets it."""
    flags = [str(tiny), "--max-model-len", "512", "--device", "cpu", "--num-kvcache-blocks", "64"]
    default = started(flags)[2]["timeout_keep_alive"]
    assert default >= 4 * httpx.Limits().keepalive_expiry  # httpx's: 5 s
    assert started([*flags, "--timeout-keep-alive", "12"])[2]["timeout_keep_alive"] == 12


def test_the_servers_flags_reach_its_engine(started, tiny):
    flags = [
        "--max-num-seqs",
        "3",
        "--block-size",
        "32",
        "--no-enable-prefix-caching",
        "--dtype",
        "float32",
    ]
    llm, _, _ = started(
        [
            str(tiny),
            *flags,
            "--max-model-len",
            "512",
            "--device",
            "cpu",
            "--num-kvcache-blocks",
            "64",
        ]
    )
    config = llm.config  # the engine core's, sent from its process once it started
    assert (config.max_num_seqs, config.block_size, config.enable_prefix_caching) == (3, 32, False)
    assert (config.max_model_len, config.num_kvcache_blocks, config.dtype) == (512, 64, "float32")
    defaults = Config.__dataclass_fields__
    assert (
        config.max_num_batched_tokens == defaults["max_num_batched_tokens"].default
    )  # not given: Config's


@pytest.mark.parametrize("how", ["--api-key", "MINIVLLM_API_KEY", "neither"])
def test_the_server_takes_its_key_from_the_flag_or_the_environment(started, tiny, monkeypatch, how):
    monkeypatch.delenv("MINIVLLM_API_KEY", raising=False)
    if how == "MINIVLLM_API_KEY":
        monkeypatch.setenv("MINIVLLM_API_KEY", KEY)
    flags = ["--api-key", KEY] if how == "--api-key" else []
    _, app, _ = started(
        [
            str(tiny),
            *flags,
            "--max-model-len",
            "512",
            "--device",
            "cpu",
            "--num-kvcache-blocks",
            "64",
        ]
    )
    client = TestClient(app)
    assert client.get("/v1/models").status_code == (200 if how == "neither" else 401)
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/version").json() == {"version": minivllm.__version__}


@pytest.fixture(scope="module")
def locked(server):
    """A second server over the `server` fixture's engine, asking for the key KEY."""
    with serve_in_thread(server[1], "tiny", api_key=KEY) as url:
        yield url


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_without_the_key_every_v1_route_is_a_401_in_openais_shape(locked, headers):
    for method, route in [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
    ]:
        reply = httpx.request(
            method, f"{locked}{route}", headers=headers, json={"model": "tiny"}, timeout=60
        )
        assert reply.status_code == 401, reply.text
        error = reply.json()["error"]
        assert (
            set(error) == {"message", "type", "param", "code"}
            and "Authorization: Bearer" in error["message"]
        )


def test_with_the_key_the_openai_client_is_served(locked):
    client = openai.OpenAI(base_url=f"{locked}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    reply = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    stream = client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == reply.choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{locked}/v1", api_key="wrong", max_retries=0).models.list()


def test_health_and_version_stay_open(locked, server):
    for url in (locked, server[0]):
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        assert httpx.get(f"{url}/version", timeout=60).json() == {"version": minivllm.__version__}
