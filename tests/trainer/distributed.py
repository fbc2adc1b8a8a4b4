"""Run a function on N real torch.distributed ranks (gloo, one process each).

`run_ranks(fn, world_size, *args)` spawns the ranks, initialises the process group the
way the trainer's workers do (`init_distributed`), calls `fn(rank, *args)` on each and
returns the results in rank order. An exception in any rank fails the call with that
rank's traceback. `fn` must be a module-level function (spawn pickles it by name), and
its arguments and result must pickle.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf_trainer.api.config import Role
from rlhf_trainer.worker import RankInfo, free_port, init_distributed


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="ranks-") as results:
        mp.spawn(
            _rank_main,
            args=(fn, world_size, free_port(), Path(results), args),
            nprocs=world_size,
            join=True,
        )
        return [
            torch.load(Path(results) / f"rank-{rank}.pt", weights_only=False)
            for rank in range(world_size)
        ]


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    results: Path,
    args: tuple[Any, ...],
) -> None:
    # Two ranks share a small machine: one thread each keeps them from fighting.
    torch.set_num_threads(1)
    init_distributed(RankInfo(Role.ACTOR, "test", rank, world_size), "127.0.0.1", port)
    try:
        result = fn(rank, *args)
        torch.save(result, results / f"rank-{rank}.pt")
        # No rank closes its connections while a peer may still be finishing the last
        # collective (one rank died of SIGABRT in gloo once, in CI, without this).
        dist.barrier()
    finally:
        dist.destroy_process_group()
