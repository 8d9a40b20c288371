"""``--tp N``: one model instance over N tensor-parallel ranks.

The service process is rank 0: it owns the NATS connection, the instance's identity, its load
reports and the gRPC KV plane, and runs the engine. `TPRanks` starts ranks 1..N-1 as processes
(torch.distributed, gloo on CPU, NCCL on CUDA; rendezvous on 127.0.0.1 at a free port); each
loads the same checkpoint, keeps its shard (`shared.model.parallel.shard_model`) and follows rank
0's batches and KV operations (`ModelRunner.follow`). Every rank runs with its share of the
process's torch threads; on CUDA rank r uses the device after rank 0's r-th.

No half-alive instance: when a rank exits, rank 0 logs one line naming it and exits
(``EXIT_RANK_DIED``), taking the other ranks with it; a follower whose rank 0 is gone exits too.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import threading
import time

import torch
import torch.distributed as dist

from shared.model.parallel import TPGroup

log = logging.getLogger(__name__)

EXIT_RANK_DIED = 3
"""Rank 0's exit code when another rank of its instance died."""


def world_size(cfg) -> int:
    """Ranks of one instance: ``--tp`` or ``--ep`` (both: equal, over the same ranks)."""
    return max(cfg.tp, cfg.ep)


def rank_threads(torch_threads: int, tp: int) -> int:
    """Each rank's share of the process's torch threads (at least 1)."""
    return max(1, torch_threads // tp)


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s torch device: on CUDA the ``rank``-th after rank 0's."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def _init_group(device: str, rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPRanks:
    """Rank 0's side of an instance's tensor-parallel group: the follower processes, the
    process group (``group``) and the watch that stops the instance when a rank dies."""

    def __init__(self, cfg, role: str):
        self.world = world_size(cfg)
        self._stopping = False
        if cfg.device.startswith("cuda"):  # NCCL's object broadcasts use the current device
            torch.cuda.set_device(rank_device(cfg.device, 0))
        port = _free_port()
        ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of this one's threads
        self.procs = [
            ctx.Process(
                target=follower_main,
                args=(cfg, role, r, port, os.getpid()),
                name=f"strata-tp{r}",
                daemon=True,
            )
            for r in range(1, self.world)
        ]
        for p in self.procs:
            p.start()
        # runs before multiprocessing's own exit handler, which would wait for the followers
        # (they ignore SIGTERM): on any exit of rank 0 they go too
        atexit.register(self._at_exit)
        threading.Thread(target=self._watch, name="strata-tp-watch", daemon=True).start()
        _init_group(cfg.device, 0, self.world, port)
        self.group = TPGroup(0, self.world)
        log.info(
            "%s parallel: %d ranks (followers %s)",
            "expert" if cfg.ep > 1 else "tensor",
            self.world,
            [p.pid for p in self.procs],
        )

    def _at_exit(self) -> None:
        self._stopping = True
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: (r, p) for r, p in enumerate(self.procs, start=1)}
        done = multiprocessing.connection.wait(list(by_sentinel))
        if self._stopping:
            return
        rank, p = by_sentinel[done[0]]
        p.join(timeout=1)  # reaped: its exit code
        log.error(
            "tensor parallel rank %d of %d (pid %s) exited with code %s: stopping this instance",
            rank,
            self.world,
            p.pid,
            p.exitcode,
        )
        for q in self.procs:
            if q.is_alive():
                q.kill()
        os._exit(EXIT_RANK_DIED)

    def stop(self) -> None:
        """Release the followers (after the engine stopped) and tear the group down."""
        self._stopping = True
        try:
            with self.group.lock:
                self.group.broadcast(None)
            dist.barrier()  # every rank past its last collective before the group goes
        except Exception as exc:  # noqa: BLE001 - the followers are killed below then
            log.warning("tensor parallel shutdown: %s", exc)
        finally:
            dist.destroy_process_group()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def shard(model, group: TPGroup, cfg) -> None:
    """Cut a loaded model to this rank's part: its heads under ``--tp``, its experts under
    ``--ep`` (both: over the same ranks)."""
    if cfg.tp > 1:
        from shared.model.parallel import shard_model

        shard_model(model, group, experts=cfg.ep > 1)
    if cfg.ep > 1:
        from shared.model.ep import shard_experts

        shard_experts(
            model,
            group,
            cfg.ep_spare,
            replicated_kv=cfg.tp == 1,
            micro_batches=cfg.ep_micro_batches,
        )


def _exit_with_parent(parent: int) -> None:
    """A follower whose rank 0 is gone (killed, crashed) exits: nothing is left running."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="strata-tp-parent", daemon=True).start()


def follower_main(cfg, role: str, rank: int, port: int, parent: int) -> None:
    """Rank ``rank`` (> 0): load, shard, follow rank 0 until it sends ``None``."""
    from shared.engine.port import EnginePort
    from shared.logs import setup_logging
    from shared.model.loader import load_model

    _exit_with_parent(parent)
    # A signal to the instance's process group stops rank 0, which then releases this rank
    # (`TPRanks.stop`); a follower that died of it first would fail rank 0's shutdown.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(f"{role}-tp{rank}", cfg.instance_id, cfg.log_level)
    world = world_size(cfg)
    torch.set_num_threads(rank_threads(cfg.torch_threads, world))
    device = rank_device(cfg.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    _init_group(cfg.device, rank, world, port)
    tp = TPGroup(rank, world)
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
    loaded = load_model(cfg.model, dtype=dtype, device=device)
    shard(loaded.model, tp, cfg)
    try:
        n = EnginePort.follow(loaded)
    except RuntimeError as exc:  # rank 0 is gone (killed): its watch or ours says so
        log.error("tensor parallel rank %d: rank 0 is gone (%s); exiting", rank, exc)
        logging.shutdown()
        os._exit(1)
    dist.barrier()
    dist.destroy_process_group()
    log.info("tensor parallel rank %d stopped after %d batches", rank, n)
    logging.shutdown()
    # Nothing left to clean up: skip the interpreter's teardown, where gloo's threads were
    # seen to abort ("terminate called without an active exception") and hang the exit.
    os._exit(0)
