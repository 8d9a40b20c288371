"""The Grafana dashboard is generated from `compose/grafana/build_dashboard.py` and queries only
metrics that the services define."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "compose" / "grafana"


def _builder():
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _defined_metrics() -> set[str]:
    names = set()
    pat = re.compile(r'(?:Counter|Gauge|Histogram|latency_histogram)\(\s*"([a-z0-9_:]+)"', re.S)
    for d in ("services", "shared"):
        for f in (ROOT / d).rglob("*.py"):
            names |= set(pat.findall(f.read_text()))
    return names


def test_json_is_up_to_date_and_well_formed():
    text = (GRAFANA / "strata-dashboard.json").read_text()
    assert text == _builder().render(), "run compose/grafana/build_dashboard.py"
    dash = json.loads(text)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["targets"] for p in dash["panels"] if p["type"] != "row")


def test_every_queried_metric_is_exported_by_a_service():
    defined = _defined_metrics()
    assert "strata:time_to_first_token_seconds" in defined  # the scan itself works
    dash = json.loads((GRAFANA / "strata-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = set()
    for e in exprs:
        used |= {m for m in re.findall(r"\b(strata[a-z0-9_:]*)\b", e)}
    assert len(used) >= 25
    base = {re.sub(r"_(bucket|total|sum|count)$", "", m) for m in used}
    # prometheus_client exposes a Counter "x" (or "x_total") as "x_total"
    missing = {m for m in base if m not in defined and m + "_total" not in defined}
    assert not missing, missing
    for want in (
        "time_to_first_token",
        "inter_token_latency",
        "e2e_request",
        "queue_time",
        "num_requests_running",
        "num_requests_waiting",
        "prompt_tokens_cached",
        "degrade_level",
        "kvstore_hits",
        "kvstore_bytes",
        "generation_tokens",
    ):
        assert any(want in m for m in used), want
