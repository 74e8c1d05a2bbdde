"""What every benchmark shares: GPU timing, and the JSON + PNG files of DESIGN.md's schema."""

import json
import platform
import shlex
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

OUT = Path("figures")  # every benchmark's default --out: under the current directory, never inside the package


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


def percentiles(name: str, values: list[float]) -> dict:
    """p50 and p99 in milliseconds, e.g. {"ttft_p50_ms": ..., "ttft_p99_ms": ...}."""
    import numpy as np

    p50, p99 = np.percentile(np.array(values) * 1e3, [50, 99]) if values else (float("nan"),) * 2
    return {f"{name}_p50_ms": float(p50), f"{name}_p99_ms": float(p99)}


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def result(module: str, rows: list[dict], device: str | None = None, **extra) -> dict:
    """The schema of DESIGN.md: device (default: the GPU, else "cpu"), the command that made it, versions, rows."""
    import torch

    if device is None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "device": device,
        "command": " ".join(["python -m", module, *map(shlex.quote, sys.argv[1:])]),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        **extra,
        "rows": rows,
    }


def cpu_name() -> str:
    """The host CPU's model name, for benchmarks that run on it."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def save(name: str, data: dict, fig=None, out: Path = OUT) -> None:
    """Write out/NAME.json, and out/NAME.png when there is a figure; `out` is created if missing."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    written = [out / f"{name}.json"]
    if fig is not None:
        fig.savefig(out / f"{name}.png", dpi=130, bbox_inches="tight")
        written.append(out / f"{name}.png")
    print("wrote " + " and ".join(map(str, written)))
