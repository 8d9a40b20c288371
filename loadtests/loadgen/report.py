"""Write one run's results: ``results.json``, ``report.md`` and PNG plots (matplotlib, Agg).

Plots: TTFT CDF, TBT CDF and, for a concurrency sweep, output tokens/s vs concurrency.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtests.loadgen.stats import RequestResult, Summary, cdf


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.1f}"


def summary_table(rows: list[Summary]) -> list[str]:
    """Markdown table, one line per summary (a sweep level or the whole run)."""
    out = [
        "| concurrency | requests | ok | errors | out tok/s | req/s | TTFT p50 / p99 ms "
        "| TBT p50 / p99 ms | e2e p50 / p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in rows:
        errs = ", ".join(f"{k}: {v}" for k, v in s.errors_by_status.items()) or "0"
        out.append(
            f"| {s.concurrency or '-'} | {s.requests} | {s.ok} | {errs} "
            f"| {s.output_tokens_per_s:.1f} | {s.request_throughput:.2f} "
            f"| {_ms(s.ttft.p50)} / {_ms(s.ttft.p99)} | {_ms(s.tbt.p50)} / {_ms(s.tbt.p99)} "
            f"| {_ms(s.e2e.p50)} / {_ms(s.e2e.p99)} |"
        )
    return out


def plot_cdf(series: dict[str, list[float]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in series.items():
        if values:
            xs, ys = cdf([v * 1e3 for v in values])
            ax.step(xs, ys, where="post", label=label)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_throughput(levels: list[Summary], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [s.concurrency for s in levels]
    ax.plot(xs, [s.output_tokens_per_s for s in levels], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput vs concurrency")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(
    out_dir: str | Path,
    config: dict[str, Any],
    overall: Summary,
    results: list[RequestResult],
    sweep: list[Summary] | None = None,
) -> Path:
    """Write results.json, report.md and plots under ``out_dir``; returns the report path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweep = sweep or []
    (out / "results.json").write_text(
        json.dumps(
            {
                "config": config,
                "summary": overall.to_dict(),
                "sweep": [s.to_dict() for s in sweep],
                "requests": [asdict(r) for r in results],
            },
            indent=1,
            default=str,
        )
    )
    ok = [r for r in results if r.ok]
    if sweep:
        by_level = {
            f"c={s.concurrency}": [r for r in ok if r.concurrency == s.concurrency] for s in sweep
        }
    else:
        by_level = {"all": ok}
    plot_cdf(
        {k: [r.ttft for r in v if r.ttft is not None] for k, v in by_level.items()},
        "TTFT CDF",
        out / "ttft_cdf.png",
    )
    plot_cdf(
        {k: [g for r in v for g in r.itl] for k, v in by_level.items()},
        "TBT (inter-token) CDF",
        out / "tbt_cdf.png",
    )
    lines = [
        "# Strata load test",
        "",
        "```",
        json.dumps(config, indent=1, default=str),
        "```",
        "",
        "## Summary",
        "",
        *summary_table([*sweep, overall] if sweep else [overall]),
        "",
        f"Prompt tokens {overall.prompt_tokens}, completion tokens {overall.completion_tokens}, "
        f"cached prompt tokens {overall.cached_tokens}, wall {overall.duration_s:.2f} s.",
        "",
        "![TTFT CDF](ttft_cdf.png)",
        "![TBT CDF](tbt_cdf.png)",
    ]
    if sweep:
        plot_throughput(sweep, out / "throughput.png")
        lines.append("![throughput vs concurrency](throughput.png)")
    errors = [r for r in results if not r.ok][:10]
    if errors:
        lines += ["", "## First errors", ""]
        lines += [f"- #{r.index} status {r.status}: {r.error}" for r in errors]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
