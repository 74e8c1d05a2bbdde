"""What every benchmark shares: GPU timing, and the JSON + PNG files of DESIGN.md's schema."""

import json
import shlex
import sys
from pathlib import Path

import torch

FIGURES = Path(__file__).resolve().parents[2] / "notebooks" / "figures"


def gpu_ms(fn, warmup: int = 5, rep: int = 30) -> float:
    """Median time of fn() in ms, measured with CUDA events (triton.testing.do_bench)."""
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn, rep: int = 30) -> float:
    """Median time of fn() in ms, replayed from a CUDA graph: the kernels' time without Python's launch overhead
    (which an engine's decode step, itself a graph, does not pay either)."""
    import triton

    fn()  # compile outside the capture
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def result(module: str, rows: list[dict], **extra) -> dict:
    """The schema of DESIGN.md: device, the command that made it, versions, then rows."""
    import triton

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "command": " ".join(["python -m", module, *map(shlex.quote, sys.argv[1:])]),
        "torch": torch.__version__,
        "triton": triton.__version__,
        **extra,
        "rows": rows,
    }


def save(name: str, data: dict, fig, out: Path = FIGURES) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    fig.savefig(out / f"{name}.png", dpi=130, bbox_inches="tight")
    print(f"wrote {out / name}.json and {out / name}.png")
