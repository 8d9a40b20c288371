"""Async load generator for the Strata gateway (see `docs/LOADTESTS.md`).

Pure parts (`workload`, `trace`, `stats`, `report`) hold no sockets; `client` streams requests
over HTTP; `cli` wires them (``python -m loadtests.loadgen --help``).
"""
