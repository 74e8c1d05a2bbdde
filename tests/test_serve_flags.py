"""The server's command line: every field of Config is a flag of `python -m minivllm.serve` (and of
`python -m minivllm`), typed by its annotation, given to the engine only when set; /version answers the package's
version. In this process, on the tiny checkpoint on a CPU."""

import dataclasses
from typing import Any, Literal, get_args

import pytest
import torch

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

import minivllm  # noqa: E402
from minivllm import __main__ as cli  # noqa: E402
from minivllm import serve  # noqa: E402
from minivllm.async_llm import AsyncLLM  # noqa: E402
from minivllm.config import Config  # noqa: E402
from minivllm.engine_args import engine_kwargs, flag_kwargs  # noqa: E402

ENGINE_FIELDS = [field for field in dataclasses.fields(Config) if field.init and field.name != "model"]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def given(argv: list[str]) -> dict[str, Any]:
    """What serve's command line `MODEL ARGV` gives the engine, each value with its type."""
    parser, names = serve.server_parser()
    return {name: (value, type(value)) for name, value in engine_kwargs(parser.parse_args(["m", *argv]), names).items()}


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
        (["--max-num-seqs", "3", "--block-size", "32"], {"max_num_seqs": (3, int), "block_size": (32, int)}),
        (["--num-kvcache-blocks", "64"], {"num_kvcache_blocks": (64, int)}),  # int | None
        (["--gpu-memory-utilization", "0.5"], {"gpu_memory_utilization": (0.5, float)}),
        (["--dtype", "float32", "--revision", "v1"], {"dtype": ("float32", str), "revision": ("v1", str)}),
        (
            ["--no-enable-prefix-caching", "--enforce-eager"],
            {"enable_prefix_caching": (False, bool), "enforce_eager": (True, bool)},
        ),
        (["--async-scheduling"], {"async_scheduling": (True, bool)}),  # bool = None
        (["--tensor-parallel-size", "2", "--seed", "7"], {"tensor_parallel_size": (2, int), "seed": (7, int)}),
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
    assert flag_kwargs(Literal["unified", "prefill-first"]) == {"choices": ("unified", "prefill-first"), "type": str}
    assert flag_kwargs(int | None) == {"type": int} and flag_kwargs(float) == {"type": float}
    with pytest.raises(TypeError, match="no command-line type"):
        flag_kwargs(bytes | None)


def test_the_cli_has_the_same_engine_flags_and_keeps_its_own():
    """python -m minivllm: --tp is --tensor-parallel-size, max_model_len defaults to 4096, --seed is the requests'."""
    args = cli.parse_args(["--tp", "2", "--max-num-seqs", "3", "--no-enable-prefix-caching", "--seed", "5"])
    assert args.engine_kwargs == dict(
        tensor_parallel_size=2, max_num_seqs=3, enable_prefix_caching=False, max_model_len=4096
    )
    assert args.sampling_params.seed == 5
    parser, names = cli.make_parser()
    assert names == [field.name for field in ENGINE_FIELDS if field.name != "seed"]


@pytest.fixture
def started(monkeypatch):
    """serve.main(argv) in this process, up to the point where uvicorn would run: returns its AsyncLLM and app."""
    built: dict[str, Any] = {}

    def async_llm(model: str, **kwargs) -> AsyncLLM:
        built["llm"] = llm = AsyncLLM(model, **kwargs)
        return llm

    monkeypatch.setattr(serve, "AsyncLLM", async_llm)
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port: built.update(app=app))

    def start(argv: list[str]) -> tuple[AsyncLLM, Any]:
        serve.main(argv)
        return built["llm"], built["app"]

    return start


def test_the_servers_flags_reach_its_engine(started, tiny):
    flags = ["--max-num-seqs", "3", "--block-size", "32", "--no-enable-prefix-caching", "--dtype", "float32"]
    llm, _ = started([str(tiny), *flags, "--max-model-len", "512", "--device", "cpu", "--num-kvcache-blocks", "64"])
    config = llm.engine.config
    assert (config.max_num_seqs, config.block_size, config.enable_prefix_caching) == (3, 32, False)
    assert (config.max_model_len, config.num_kvcache_blocks, llm.engine.runner.dtype) == (512, 64, torch.float32)
    defaults = Config.__dataclass_fields__
    assert config.max_num_batched_tokens == defaults["max_num_batched_tokens"].default  # not given: Config's


def test_version_is_the_packages(server):
    assert httpx.get(f"{server[0]}/version", timeout=60).json() == {"version": minivllm.__version__}
