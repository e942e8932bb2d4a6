"""Run a test body on P local gloo ranks (torch.multiprocessing) and fail the test if any rank fails."""
from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autosp.harness.launch import rendezvous_store

_TIMEOUT_S = 600


def _entry(rank: int, world_size: int, port: int, body: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    timeout = datetime.timedelta(seconds=_TIMEOUT_S)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout),
                            rank=rank, world_size=world_size)
    try:
        body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, body: Callable, *args) -> None:
    """`body(rank, world_size, *args)` on every rank; body must be a module-level (picklable) function."""
    store = rendezvous_store(_TIMEOUT_S)  # held by this process until the ranks have joined and ended
    mp.start_processes(_entry, args=(world_size, store.port, body, args), nprocs=world_size, join=True,
                       start_method="spawn")
