"""The deployment shape `strata up` picks from the machine when the user does not say.

A pure decision (`choose_shape`) from the usable cores, the accelerators and the explicit flags:

- few cores (fewer than `PD_MIN_CORES`) and no accelerator per model process: **colocated** --
  no prefill instance, decode prefills itself and gets every model core as torch threads
  (two model processes on two cores only fight over them); kvstore and MinIO stay (the pool
  still serves prefixes across restarts and instances);
- enough cores, or one accelerator per model process: **disaggregated** -- one prefill instance,
  prefill and decode each on their own cores;
- model processes are pinned (``STRATA_CPU_AFFINITY``, applied by `strata serve` at start-up)
  to their own slice of the model cores; service processes (gateway, tokenizer, scheduler,
  kvstore, vision) get the spare cores when there are any, and always 1 OMP/torch thread;
- explicit ``--prefill N`` and ``--torch-threads N`` always win.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from shared.config import RuntimeSettings

PD_MIN_CORES = 8
"""Usable cores from which prefill and decode get separate processes on CPU."""
AFFINITY_ENV = "STRATA_CPU_AFFINITY"
"""Cores a service process pins itself to at start-up (``"0-3,6"``; unset = no pinning)."""
SERVICE_THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RAYON_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Env of non-model services: one compute thread, so they never steal the engine's cores."""


@dataclass(frozen=True)
class Shape:
    """What to start: instance counts, threads and cores per model process, and why."""

    prefill: int
    decode: int
    torch_threads: int  # per model process (prefill and decode)
    colocated: bool  # decode prefills (no prefill instance)
    model_cpus: dict[str, list[int]] = field(default_factory=dict)  # "<role>-<i>" -> cores
    service_cpus: list[int] = field(default_factory=list)  # [] = services share every core
    line: str = ""  # the one start-up line that says which shape and how to change it


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity mask), sorted."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def choose_shape(
    cores: list[int],
    accelerators: int = 0,
    *,
    prefill: int | None = None,
    decode: int = 1,
    torch_threads: int | None = None,
) -> Shape:
    """The shape for ``cores`` (usable core ids) and ``accelerators`` (devices the model
    processes run on; 0 = CPU); ``prefill`` / ``torch_threads`` None = choose."""
    n = len(cores)
    if not cores:
        raise ValueError("no usable cores")
    auto = prefill is None
    if prefill is None:
        enough = n >= PD_MIN_CORES or (accelerators and accelerators >= decode + 1)
        prefill = 1 if enough else 0
    names = [f"prefill-{i}" for i in range(prefill)] + [f"decode-{i}" for i in range(decode)]
    # Spare cores for the services only where the model processes still get >= 2 each.
    spare = max(1, n // 8) if n >= 4 and n - max(1, n // 8) >= 2 * len(names) else 0
    service_cpus = cores[n - spare :] if spare else []
    model_cores = cores[: n - spare]
    per = len(model_cores) // len(names)
    threads = torch_threads or (1 if accelerators else max(1, per))
    model_cpus: dict[str, list[int]] = {}
    if per >= 1 and (accelerators or threads <= per):  # else (oversubscribed): no pinning
        for i, name in enumerate(names):  # contiguous slices; leftovers go to decode-0
            model_cpus[name] = model_cores[i * per : (i + 1) * per]
        model_cpus["decode-0"] += model_cores[len(names) * per :]
    colocated = prefill == 0
    where = f"{n} core{'s' if n != 1 else ''}" + (
        f", {accelerators} accelerators" if accelerators else ""
    )
    if colocated:
        line = (
            f"shape: colocated prefill+decode on {where} ({decode} decode x {threads} torch "
            f"threads); pass --prefill 1 to disaggregate"
        )
    else:
        line = (
            f"shape: disaggregated, {prefill} prefill + {decode} decode on {where} "
            f"({threads} torch threads each"
            + (f", {len(service_cpus)} cores kept for services" if service_cpus else "")
            + ")"
            + ("; pass --prefill 0 to colocate" if auto else "")
        )
    return Shape(prefill, decode, threads, colocated, model_cpus, service_cpus, line)


def format_cpus(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    for c in sorted(set(cpus)):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        elif out and "-" not in out[-1] and int(out[-1]) == c - 1:
            out[-1] = f"{out[-1]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def parse_cpus(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``; ValueError naming `AFFINITY_ENV` on bad input."""
    cpus: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            a, b = int(lo), int(hi or lo)
            if a < 0 or b < a:
                raise ValueError
            cpus.update(range(a, b + 1))
    except ValueError:
        raise ValueError(f"{AFFINITY_ENV}={text!r}: expected core ids like '0-3,6'") from None
    if not cpus:
        raise ValueError(f"{AFFINITY_ENV}={text!r}: no cores")
    return sorted(cpus)


def apply_affinity(environ: dict[str, str] | None = None) -> list[int] | None:
    """Pin this process to ``STRATA_CPU_AFFINITY``'s cores (those it may use); returns them, or
    None when unset. Call before torch starts its thread pool (its threads inherit the mask)."""
    text = RuntimeSettings.from_env(environ).cpu_affinity.strip()
    if not text:
        return None
    want = set(parse_cpus(text)) & set(usable_cores())
    if not want:
        raise ValueError(f"{AFFINITY_ENV}={text!r}: none of these cores is usable here")
    os.sched_setaffinity(0, want)
    return sorted(want)
