"""Run a function on N CPU ranks over gloo, the way tensor-parallel workers run, and collect what each returns."""

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.layers.linear import TPGroup, tensor_parallel


def _worker(rank: int, world_size: int, fn: Callable, args: tuple, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world_size
    )
    try:
        with tensor_parallel(
            TPGroup(rank, world_size, dist.group.WORLD)
        ):  # layers built in fn split over it
            torch.save(fn(*args), Path(out) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears its group down while another's last collective may still be in flight
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable, world_size: int, *args) -> list:
    """fn(*args) on each of `world_size` spawned processes with torch.distributed set up; their results by rank."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world_size, fn, args, out), nprocs=world_size, join=True)
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(world_size)]
