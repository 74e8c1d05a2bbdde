"""What every benchmark shares: its command line (`--out`), the checkpoint of a preset, GPU timing,
the machine's matmul rate and copy bandwidth, and the files it writes.

Every benchmark writes NAME.json (and NAME.png when it draws a figure) with one schema: `device`
(the GPU, else "cpu" or the CPU's name), `command` (the `python -m` line that made it), `torch` and
`triton` versions, the benchmark's own fields, then `rows` (one dict per measurement, with an `impl`
field where several are compared).
"""

import argparse
import atexit
import functools
import importlib.util
import json
import platform
import shlex
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# every benchmark's default --out: under the current directory, never inside the package
OUT = Path("figures")
# an anchor row when installed; never required
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def arg_parser(doc: str | None, name: str, figure: bool = True) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring as the help, and `--out`, the folder for NAME.json (and
    .png)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    files = f"{name}.json and .png" if figure else f"{name}.json"
    parser.add_argument(
        "--out", type=Path, default=OUT, help=f"folder for {files} (default: ./figures)"
    )
    return parser


def require_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")


@functools.cache
def preset_checkpoint(preset: str, seed: int = 0) -> Path:
    """The preset's random-weight checkpoint, written once per process to a temporary folder removed
    at exit."""
    from minivllm.checkpoint import write_checkpoint

    folder = tempfile.TemporaryDirectory(prefix="minivllm-benchmark-")
    atexit.register(folder.cleanup)  # also keeps the folder alive until then
    return write_checkpoint(Path(folder.name) / preset, preset, seed=seed)


def gpu_ms(fn, warmup: int = 5, rep: int = 30) -> float:
    """Median time of fn() in ms, measured with CUDA events (triton.testing.do_bench)."""
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn, rep: int = 30) -> float:
    """Median time of fn() in ms, replayed from a CUDA graph: the kernels' time without Python's
    launch overhead (which an engine's decode step, itself a graph, does not pay either)."""
    import triton

    fn()  # compile outside the capture
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def percentiles(name: str, values: list[float]) -> dict:
    """p50 and p99 in milliseconds, e.g. {"ttft_p50_ms": ..., "ttft_p99_ms": ...}."""
    import numpy as np

    ms = np.array(values) * 1e3
    p50, p99 = np.percentile(ms, [50, 99]) if values else (float("nan"),) * 2
    return {f"{name}_p50_ms": float(p50), f"{name}_p99_ms": float(p99)}


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def result(module: str, rows: list[dict], device: str | None = None, **extra) -> dict:
    """The schema above: device (default: the GPU, else "cpu"), the command that made it, versions,
    extra, rows."""
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


def copy_tbps() -> float:
    """The GPU's copy bandwidth in TB/s, read + write, of a 2 GiB tensor."""
    import torch

    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (gpu_ms(lambda: y.copy_(x)) * 1e-3) / 1e12


def matmul_tflops(n: int = 8192) -> float:
    """The GPU's bf16 matmul rate in TFLOP/s, of an n × n square."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / (gpu_ms(lambda: a @ a) * 1e-3) / 1e12


def machine_rates() -> tuple[float, float]:
    """The GPU's bf16 matmul TFLOP/s and copy TB/s, measured (on a CPU: nan, nan)."""
    import torch

    if not torch.cuda.is_available():
        return float("nan"), float("nan")
    rates = matmul_tflops(), copy_tbps()
    torch.cuda.empty_cache()  # before the engines size their KV caches
    return rates


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
