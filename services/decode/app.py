"""`strata serve decode`: a decode instance (it also prefills short prompts itself)."""

from __future__ import annotations

from services.decode.service import DecodeService
from shared.worker.app import run_worker


def main(argv: list[str]) -> None:
    run_worker("decode", argv, DecodeService)
