"""Who a request belongs to, for fair queuing: the tenant name and its weight (pure).

A tenant is an API key, known by its name (`KeyPolicy.name`: ``env-<i>`` for the i-th key of
``STRATA_API_KEYS``, the ``name`` of a key-file entry), never by the key itself. With auth off
every request is the ``default`` tenant, except over the NATS API, where the client's
authenticated NATS identity is: ``nats:<client>``. The name and weight go into the `WorkItem`, and the
engines admit waiting requests of one priority class by weighted shares between tenants
(`shared/engine/fair_queue.py`). `Tenants.of` is the one place that decides the identity, so a
caller identified another way (a NATS API identity) needs a change here only.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.gateway.auth import KeyPolicy

DEFAULT_TENANT = "default"  # the same name as `shared.engine.fair_queue.DEFAULT_TENANT`
NATS_PREFIX = "nats:"  # tenants of NATS API clients without an API key: nats:<identity>


class Tenants:
    """Tenant names and weights (1 for a tenant not given one)."""

    def __init__(self, weights: dict[str, float] | None = None):
        self.weights = dict(weights or {})

    @classmethod
    def from_config(cls, specs: Iterable[str], key_names: Iterable[str]) -> Tenants:
        """Parse ``STRATA_TENANT_WEIGHTS`` entries ``name:weight``; a ValueError naming the
        entry when one is malformed, its weight is not a positive number, or no API key has
        that name (``default`` is the tenant of requests when auth is off)."""
        known = set(key_names) | {DEFAULT_TENANT}
        weights: dict[str, float] = {}
        for spec in specs:
            name, sep, value = spec.rpartition(":")
            name = name.strip()
            if not sep or not name:
                raise ValueError(f"{spec!r}: expected 'keyname:weight'")
            try:
                weight = float(value)
            except ValueError:
                raise ValueError(f"{spec!r}: weight {value.strip()!r} is not a number") from None
            if not weight > 0 or weight == float("inf"):
                raise ValueError(f"{spec!r}: weight must be a positive number")
            if name not in known and not name.startswith(NATS_PREFIX):
                names = ", ".join(sorted(known))
                raise ValueError(f"{spec!r}: no API key is named {name!r} (names: {names})")
            weights[name] = weight
        return cls(weights)

    def of(self, policy: KeyPolicy | None, client: str = "") -> tuple[str, float]:
        """(tenant name, weight) of a request made with ``policy`` (None: auth is off) by NATS
        API ``client`` ('' over REST): the key's name, else ``nats:<client>``, else default."""
        if policy is not None:
            name = policy.name
        else:
            name = f"{NATS_PREFIX}{client}" if client else DEFAULT_TENANT
        return name, self.weights.get(name, 1.0)
