"""Rank processes for the tests' torch.distributed groups, forked from one warm server.

`torch.multiprocessing.spawn` starts every rank as a fresh interpreter that imports torch and the
engine again: about 2 CPU-s a rank, two ranks a test, some twenty tests. `spawn_ranks` starts
them with the ``forkserver`` method instead: one server process per test session imports
`PRELOAD` once, and each rank is forked from it. The ranks are still separate processes in a
real gloo group over TCP; only their interpreter start-up is shared.

A forked rank inherits the server's environment (the session's at its start), not the calling
test's: a test that sets variables for its ranks passes them as arguments instead.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

import torch.multiprocessing as mp

PRELOAD = [
    "torch",
    "torch.distributed",
    "shared.engine.engine",
    "shared.engine.model_runner",
    "shared.model.loader",
    "shared.model.parallel",
]
"""What the fork server imports once (the ranks import anything else themselves)."""


def spawn_ranks(fn: Callable, args: tuple, nprocs: int = 2) -> None:
    """``fn(rank, *args)`` in each of ``nprocs`` processes, forked from the session's server;
    returns when all exited, raising (as `torch.multiprocessing.spawn` does) if one failed."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: first call
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
