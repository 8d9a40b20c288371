"""One OpenMP team per model process: the engine thread's.

torch (and Strata's native kernels, which share torch's libgomp) runs a parallel op as an OpenMP
team led by the calling thread; each thread that ever leads one keeps its own pool of worker
threads until it exits. libgomp counts every such thread, and once a process holds more than it
has cores, it stops spinning between parallel regions: a team's workers sleep on a futex at the
end of every region and are woken for the next (``do_spin`` in libgomp's ``wait.h``, the
"throttled" spin count). A decode step runs a hundred or more regions, so a second team anywhere
in the process -- the thread that loaded the model, or the event loop copying a KV block --
costs the engine a sleep and a wake-up per region. On a 2-core box this was 15% of the in-process
engine's throughput, and in the cluster its team's second thread slept ~1,500 times a second
(docs/benchmarks/peer.md, "One OpenMP team per process").

So a model process keeps one team:

- `in_fresh_thread` runs the model load and the warm-up forward on a thread that exits after
  (libgomp frees its pool and forgets its workers then);
- `serial_torch_here` makes the event loop and its executor threads run torch ops on themselves
  alone, never leading a team (they only copy and convert KV blocks and image embeddings).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
_OMP_LIBS = ("libgomp", "libiomp", "libomp")


@functools.cache
def _omp_set_num_threads():
    """``omp_set_num_threads`` of the OpenMP runtime torch loaded (found once in this process's
    mappings), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {
                line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line
            }
    except OSError:
        return None
    for p in sorted(paths):
        if os.path.basename(p).startswith(_OMP_LIBS):
            try:
                fn = ctypes.CDLL(p).omp_set_num_threads
            except (OSError, AttributeError):
                continue
            fn.argtypes = (ctypes.c_int,)
            fn.restype = None
            return fn
    return None


def serial_torch_here() -> bool:
    """Make the calling thread run torch's CPU ops on itself alone: it never leads an OpenMP
    team. Other threads keep their own thread counts (an OpenMP setting is per thread). Returns
    False where no OpenMP runtime is loaded (nothing to do)."""
    torch.get_num_threads()  # torch's per-thread init first: it would reset the count later
    set_num_threads = _omp_set_num_threads()
    if set_num_threads is None:
        return False
    set_num_threads(1)
    return True


def in_fresh_thread(fn: Callable[[], T], name: str = "strata-load") -> T:
    """``fn()`` on a new thread that exits when it returns, so any OpenMP team it led exits too;
    returns its result or raises its exception. Blocks the caller (use ``asyncio.to_thread``
    around it from a loop)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
