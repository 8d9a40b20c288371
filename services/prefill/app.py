"""`strata serve prefill`: a prefill instance."""

from __future__ import annotations

from services.prefill.service import PrefillService
from shared.worker.app import run_worker


def main(argv: list[str]) -> None:
    run_worker("prefill", argv, PrefillService)
