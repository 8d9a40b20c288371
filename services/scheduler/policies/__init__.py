"""Routing policies behind a tiny registry with lazy imports.

Policy contract: a plain synchronous, deterministic object with

    name: str
    choose(request: RequestView, state: ClusterState) -> RouteDecision

``state`` holds only live, non-excluded instances; ``state.decode`` is never empty (the core
answers "unavailable" before asking). The same objects run in the service and the simulator.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from services.scheduler.types import ClusterState, CostModel, RequestView, RouteDecision


class Policy(Protocol):
    name: str

    def choose(self, request: RequestView, state: ClusterState) -> RouteDecision: ...


_REGISTRY: dict[str, str] = {
    "round_robin": "services.scheduler.policies.basic:RoundRobin",
    "least_loaded": "services.scheduler.policies.basic:LeastLoaded",
    "prefix_aware": "services.scheduler.policies.prefix_aware:PrefixAware",
}

POLICY_NAMES = tuple(_REGISTRY)


def make_policy(name: str, cost: CostModel | None = None, **options: Any) -> Policy:
    """Instantiate the policy registered as ``name`` (unknown names raise ValueError)."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(_REGISTRY)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(cost or CostModel(), **options)
