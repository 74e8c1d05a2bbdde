"""Run a function on N CPU ranks over gloo, the way tensor-parallel workers run, and collect what each returns."""

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.engine.model_runner import free_port


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.save(fn(*args), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable, world_size: int, *args) -> list:
    """fn(*args) on each of `world_size` spawned processes with torch.distributed set up; their results by rank."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world_size, free_port(), fn, args, out), nprocs=world_size, join=True)
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(world_size)]
