"""Expert placement for expert parallelism, and its load balancer (EPLB).

A `Placement` says which logical expert each physical expert slot holds: ``ranks`` ranks with
``slots`` slots each, slot ``p`` on rank ``p // slots``. With more slots than experts the extra
slots hold replicas, and the tokens routed to an expert are split evenly over its replicas.

`rebalance` is pure and deterministic (every rank computes the same placement from the same
counts), greedy in two steps like DeepSeek's EPLB: give each spare slot to the expert with the
highest load per replica, then pack the replicas, heaviest first, onto the rank with the least
load that still has a free slot (and no replica of the same expert when another rank can take
it). `imbalance` is what it minimises: the most loaded rank's load over the mean rank's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """``phys[p]``: the logical expert physical slot ``p`` holds."""

    phys: tuple[int, ...]
    ranks: int

    def __post_init__(self):
        if self.ranks < 1 or len(self.phys) % self.ranks:
            raise ValueError(f"{len(self.phys)} slots do not split over {self.ranks} ranks")

    @property
    def slots(self) -> int:
        """Slots per rank."""
        return len(self.phys) // self.ranks

    @property
    def num_experts(self) -> int:
        return max(self.phys) + 1

    def on_rank(self, rank: int) -> tuple[int, ...]:
        """The logical experts rank ``rank`` holds, slot by slot."""
        return self.phys[rank * self.slots : (rank + 1) * self.slots]

    def replicas(self, expert: int) -> list[int]:
        """Physical slots holding ``expert`` (ascending)."""
        return [p for p, e in enumerate(self.phys) if e == expert]


def initial(num_experts: int, ranks: int, spare: int = 0) -> Placement:
    """Contiguous blocks: rank r holds experts ``r*E/N .. (r+1)*E/N - 1``; its ``spare`` extra
    slots replicate the next rank's first experts (uniform load: any choice is as good)."""
    if num_experts % ranks:
        raise ValueError(f"{ranks} ranks do not divide {num_experts} experts")
    per = num_experts // ranks
    phys: list[int] = []
    for r in range(ranks):
        phys += range(r * per, (r + 1) * per)
        phys += [((r + 1) * per + j) % num_experts for j in range(spare)]
    return Placement(tuple(phys), ranks)


def rank_loads(load: Sequence[float], placement: Placement) -> list[float]:
    """Each rank's expected load: an expert's load split evenly over its replicas."""
    reps = [0] * len(load)
    for e in placement.phys:
        reps[e] += 1
    out = [0.0] * placement.ranks
    for p, e in enumerate(placement.phys):
        out[p // placement.slots] += load[e] / reps[e]
    return out


def imbalance(per_rank: Sequence[float]) -> float:
    """max / mean of per-rank loads (1.0 is perfectly balanced; 1.0 for no load at all)."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean > 0 else 1.0


def rebalance(load: Sequence[float], ranks: int, slots: int) -> Placement:
    """A placement of ``len(load)`` experts on ``ranks`` x ``slots`` slots that minimises the
    max/mean rank load (greedy); every expert keeps at least one replica."""
    n_exp = len(load)
    if ranks * slots < n_exp:
        raise ValueError(f"{ranks} x {slots} slots cannot hold {n_exp} experts")
    reps = [1] * n_exp
    for _ in range(ranks * slots - n_exp):
        hot = max(range(n_exp), key=lambda e: (load[e] / reps[e], -e))
        reps[hot] += 1
    items = sorted(
        ((load[e] / reps[e], e) for e in range(n_exp) for _ in range(reps[e])),
        key=lambda t: (-t[0], t[1]),
    )
    held: list[list[int]] = [[] for _ in range(ranks)]
    total = [0.0] * ranks
    for w, e in items:
        free = [q for q in range(ranks) if len(held[q]) < slots]
        fresh = [q for q in free if e not in held[q]] or free
        q = min(fresh, key=lambda q: (total[q], q))
        held[q].append(e)
        total[q] += w
    return Placement(tuple(e for h in held for e in sorted(h)), ranks)
