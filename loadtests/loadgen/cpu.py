"""Where a box's CPU went during a benchmark phase: every process's user + system time from
``/proc``, before and after, summed by what the process is (a Strata role from its
``services.cli serve <role>`` command line, nats-server, MinIO, the benchmark's own client
processes, anything else). On a box with fewer cores than processes this says which services
share the cores the engine leaves, and how much the load generator itself takes."""

from __future__ import annotations

import os
from dataclasses import dataclass

_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcCPU:
    label: str
    seconds: float  # user + system, all threads
    threads: dict[int, float]  # by thread id: a model process's engine thread is the busiest


def label_of(argv: list[str], pid: int, parent: int, me: int) -> str:
    """What a process is, from its command line and its parent's pid; ``me``: the
    benchmark's own pid."""
    if pid == me:
        return "bench client (main)"
    if len(argv) == 1 and " " in argv[0]:  # a title set in place (a forked model process)
        argv = argv[0].split()
    names = [os.path.basename(a) for a in argv]
    if "services.cli" in argv and "serve" in argv:
        i = argv.index("serve")
        return argv[i + 1] if i + 1 < len(argv) else "strata"
    if names and names[0].startswith("nats-server"):
        return "nats-server"
    if names and names[0] == "minio":
        return "minio"
    if parent == me and any("multiprocessing" in a for a in argv):
        return "bench client (worker)"
    return "other"


def _stat(path: str) -> tuple[int, float]:
    """(parent pid, user + system CPU seconds) from a ``/proc/.../stat`` file."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK  # ppid; utime, stime


def snapshot() -> dict[int, ProcCPU]:
    """Every readable process now: pid -> what it is and the CPU seconds it has used."""
    me, out = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            parent, total = _stat(f"/proc/{pid}/stat")
            threads = {
                int(t): _stat(f"/proc/{pid}/task/{t}/stat")[1]
                for t in os.listdir(f"/proc/{pid}/task")
            }
        except (OSError, ValueError, IndexError):
            continue  # gone, or a kernel thread without a command line
        if argv:
            out[pid] = ProcCPU(label_of(argv, pid, parent, me), total, threads)
    return out


def cores_by_label(before: dict[int, ProcCPU], after: dict[int, ProcCPU], seconds: float) -> dict:
    """Cores each kind of process used on average between two snapshots ({label: cores}, most
    first), and for each the busiest single thread's share (``<label> busiest thread``) where
    the process has more than one thread's worth of interest (the model processes)."""
    used: dict[str, float] = {}
    busiest: dict[str, float] = {}
    for pid, now in after.items():
        was = before.get(pid)
        d = now.seconds - (was.seconds if was else 0.0)
        old = was.threads if was else {}
        t = max((s - old.get(tid, 0.0) for tid, s in now.threads.items()), default=0.0)
        used[now.label] = used.get(now.label, 0.0) + d
        busiest[now.label] = max(busiest.get(now.label, 0.0), t)
    out = {k: round(v / seconds, 2) for k, v in sorted(used.items(), key=lambda kv: -kv[1])}
    for k in ("decode", "prefill", "worker"):
        if k in busiest:
            out[f"{k} busiest thread"] = round(busiest[k] / seconds, 2)
    return out
