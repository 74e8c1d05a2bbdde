"""`python -m minivllm`: generate with a Hub model, a checkpoint folder or a preset; print the
outputs and throughput.

    python -m minivllm                          # the presets that suit this machine, a few prompts
    python -m minivllm --preset tiny-text "Many hands make" "What do bees make?"
    python -m minivllm --model Qwen/Qwen3-0.6B --temperature 0.7 --top-p 0.9 --max-tokens 64 --tp 2
    python -m minivllm --model path/to/Qwen3-0.6B "Dear Maria,"  # a checkpoint folder

--model takes a Hub id as vLLM does: its snapshot in the Hub cache (HF_HUB_CACHE, or
--download-dir), downloaded the first time; HF_HUB_OFFLINE=1 uses the cache alone. A folder of the
id's name, if there is one, wins over the Hub. With no --model, a preset's checkpoint is written
once to ~/.cache/minivllm/checkpoints/ (or $MINIVLLM_CHECKPOINTS). The default is tiny-text: the
tiny model trained on the text its tokenizer was made from (half a minute on a CPU, the first time),
so that it continues a line of that text in words, where random weights write gibberish. On a GPU
the qwen3-0.6b preset runs after it, for speed: random weights in Qwen3-0.6B's shapes, whose ids
mostly have no text in the presets' 2,048-token tokenizer, so its token ids are printed too. Every
argument of LLM(...) is a flag (the "engine" flags below, as `python -m minivllm.serve` has them),
but seed: --seed seeds the requests.
"""

import time

STARTED = time.perf_counter()  # before the imports: the start-up split below counts them

import argparse  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import torch  # noqa: E402

from minivllm.checkpoint import checkpoint_for  # noqa: E402
from minivllm.engine_args import add_engine_args, engine_kwargs  # noqa: E402

if TYPE_CHECKING:
    from minivllm import LLM
    from minivllm.outputs import RequestOutput

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "In autumn the leaves",
    "Dear Maria,",
    "def fibonacci(n",
]
# minivllm.checkpoint.maker's (not imported here: it loads transformers)
PRESETS = [
    "tiny",
    "tiny-text",
    "qwen3-0.6b",
    "tiny-llama",
    "llama-3.2-1b",
    "tiny-qwen2",
    "qwen2.5-0.5b",
]


def positive_int(text: str) -> int:
    """argparse type: an int >= 1; argparse turns the error into a usage error naming the flag."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def make_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser, and the engine fields it has flags for (all of LLM's, as serve's; --seed is the
    requests')."""
    parser = argparse.ArgumentParser(
        prog="python -m minivllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("prompts", nargs="*", help="prompts (default: a few examples)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="a Hub id (ORG/NAME) or a HuggingFace checkpoint folder")
    source.add_argument(
        "--preset", choices=PRESETS, help="a preset (default: tiny-text, then qwen3-0.6b on a GPU)"
    )
    parser.add_argument(
        "--temperature", type=finite_float, default=0.0, help="0 is greedy (default)"
    )
    parser.add_argument("--top-p", type=finite_float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=finite_float, default=0.0)
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--ignore-eos", action="store_true")
    engine_fields = add_engine_args(
        parser,
        skip={"seed"},
        tensor_parallel_size=dict(aliases=["--tp"], type=positive_int),
        max_model_len=dict(type=positive_int),  # not given: Config's, the context length
    )
    return parser, engine_fields


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked: a bad value exits with a one-line usage error (exit code 2), before any
    work."""
    from minivllm.sampling_params import SamplingParams

    parser, engine_fields = make_parser()
    args = parser.parse_args(argv)
    args.engine_kwargs = engine_kwargs(args, engine_fields)
    try:
        args.sampling_params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        parser.error(str(e))
    args.parser = parser
    return args


def default_presets() -> list[str]:
    """tiny-text, whose text reads as text; on a GPU also qwen3-0.6b, for the speed of the real
    shapes."""
    return ["tiny-text", "qwen3-0.6b"] if torch.cuda.is_available() else ["tiny-text"]


def print_outputs(outputs: "list[RequestOutput]", num_known_ids: int, seconds: float) -> None:
    """Each completion's text (and its first token ids if some have no text), then the
    throughput."""
    for out in outputs:
        completion = out.outputs[0]
        print(f"\n--- {out.prompt!r} ({len(out.prompt_token_ids)} tokens)")
        print(
            f"{completion.text!r}  [{len(completion.token_ids)} tokens, "
            f"{completion.finish_reason}, "
            f"TTFT {(out.metrics.time_to_first_token or 0.0) * 1e3:.0f} ms]"
        )
        if num_known_ids and (no_text := sum(t >= num_known_ids for t in completion.token_ids)):
            print(
                f"token ids {completion.token_ids[:12]}... ({no_text} have no text in this "
                f"tokenizer)"
            )
    num_tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    print(
        f"\n{len(outputs)} requests, {num_tokens} output tokens in {seconds:.2f} s: "
        f"{num_tokens / seconds:,.0f} tokens/s on "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}"
    )


def startup_split(llm: "LLM", marks: list[float], first: bool) -> str:
    """Where the time to the first outputs went: imports (or, for a later engine, what ran since the
    last one), LLM() split into the runner's phases and the rest (tokenizer, config, scheduler),
    then the generate call. marks: when this engine's turn began, LLM() was called, it returned,
    generate returned."""
    began, called, built, done = marks
    phases = llm.engine.core.runner.startup_seconds
    runner = ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items())
    since = "imports" if first else "since the last engine"
    rest = built - called - sum(phases.values())
    head = f"start-up: {since} {called - began:.2f} s, LLM() {built - called:.2f} s"
    tail = f"generate {done - built:.2f} s: the outputs after {done - began:.1f} s"
    return f"{head} ({runner}, tokenizer and the rest {rest:.2f}), {tail}"


def generate(args: argparse.Namespace, model: Path | str, began: float, first: bool) -> None:
    from minivllm import LLM
    from minivllm.models.hub import load_error_line

    marks = [began, time.perf_counter()]
    # a model that cannot be had or loaded (no such id or folder, gated, offline and not cached,
    # .bin weights,
    try:
        # an architecture we lack) is one line naming it, exit code 2: no traceback, no usage (the
        # flags were fine)
        llm = LLM(str(model), **args.engine_kwargs)
    except (
        ValueError,
        OSError,
    ) as e:  # OSError: FileNotFoundError, PermissionError (gated), the Hub's HTTP errors
        line = load_error_line(e, str(model), args.engine_kwargs.get("tokenizer"))
        args.parser.exit(2, f"{args.parser.prog}: error: {line}\n")
    with llm:
        marks.append(time.perf_counter())
        try:  # what the engine refuses (a prompt too long) is a usage error too
            outputs = llm.generate(args.prompts or DEFAULT_PROMPTS, args.sampling_params)
        except ValueError as e:
            args.parser.error(str(e).splitlines()[0] if str(e) else type(e).__name__)
        marks.append(time.perf_counter())
        tokenizer, split = llm.get_tokenizer(), startup_split(llm, marks, first)
    print_outputs(outputs, len(tokenizer) if tokenizer is not None else 0, marks[3] - marks[2])
    print(split)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model:
        generate(args, args.model, STARTED, first=True)
        return
    began = STARTED
    for i, preset in enumerate([args.preset] if args.preset else default_presets()):
        print(f"\n=== the {preset} preset")
        generate(args, checkpoint_for(preset), began, first=i == 0)
        began = time.perf_counter()


if __name__ == "__main__":
    main()
