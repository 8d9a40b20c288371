"""Reading Prometheus ``/metrics`` pages of the services, for the benchmarks and the soak: one
parser (`prometheus_client`'s) and one HTTP client for all of them."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def metrics_url(cluster, name: str) -> str:
    """The ``/metrics`` URL of service ``name`` of a `services.launcher.Cluster`."""
    return f"http://127.0.0.1:{cluster.specs[name].env['STRATA_METRICS_PORT']}/metrics"


def scrape(
    url: str,
    names: Mapping[str, str],
    key: Callable[[str, Sample], str] | None = None,
) -> dict[str, float]:
    """The samples of a ``/metrics`` page whose names are keys of ``names``, summed over their
    labels under the name each maps to, or under ``key(mapped name, sample)`` when given (e.g.
    a histogram's buckets by their ``le``); {} when the page cannot be read."""
    try:
        text = httpx.get(url, timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = names.get(sample.name)
            if name:
                k = key(name, sample) if key else name
                out[k] = out.get(k, 0.0) + sample.value
    return out


def sample_total(url: str, selector: str) -> float:
    """The sum of the page's sample lines that start with ``selector``: a series name, or a
    name with its first labels as exposed (``'strata_kvstore_blocks{tier="write_behind"}'``)."""
    text = httpx.get(url, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(selector) and not line.startswith("#")
    )
