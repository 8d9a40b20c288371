"""Logging set-up: one line per record, prefixed with role and instance; request ids travel in
the ``rid`` extra so a request can be followed across services (grep its id)."""

from __future__ import annotations

import logging
import sys


def setup_logging(role: str, instance: str, level: str = "INFO") -> None:
    fmt = f"%(asctime)s %(levelname)s [{role}:{instance}] %(name)s: %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("nats", "httpx", "urllib3", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
