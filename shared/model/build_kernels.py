"""The native CPU kernels built once per ISA variant, and the variant this CPU runs.

Each variant is the same C sources (``cpu_kernels._SOURCES``' files, package data) compiled with
explicit target flags into its own shared library in ``$STRATA_CACHE/kernels``, named by the
variant and a hash of the sources, the compiler and the flags; so a cache folder copied to
another machine holds nothing built for the wrong CPU, and every variant can be built (and, where
the CPU runs it, tested) on any x86-64 box. ``scripts/setup.sh`` builds them all
(``python -m shared.model.build_kernels``); a missing one is built on first use.

Which variant a process loads: ``STRATA_CPU_ISA`` (``auto``, the default: the widest this CPU
runs, judged from the ``flags`` line of /proc/cpuinfo). Forcing one this CPU cannot run is a
`ConfigError` naming the missing CPU flags. The sources have an AVX-512 BF16 path (the bf16
GEMM's ``vdpbf16ps`` path, ``gemm_bf16.c``), an AVX-512 VNNI path (the int8 GEMM,
``gemm_int8.c``), AVX-512 and AVX2 + FMA paths and a portable one (``#ifdef``). The
``avx512vnni`` variant needs AVX-512 VNNI beside x86-64-v4 (Cascade Lake, Ice Lake, Zen 4 and
later); ``avx512bf16`` needs AVX-512 BF16 as well (Cooper Lake, Sapphire Rapids and later, whose
AMX it does not use; Zen 4 and later) and holds the VNNI path too. The bf16 GEMM's other path
(bf16 weights widened to float32 in registers) is in every variant.

Imports no torch: `strata serve` checks the setting with it before the service starts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from shared.config import ConfigError, RuntimeSettings

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(f)
    for f in (
        "decode_attention.c",
        "gemm.c",
        "gemm_int8.c",
        "gemm_bf16.c",
        "fused.c",
        "layer.c",
        "isa.c",
    )
)
# included by SOURCES (kernels.h: every entry point, and by torch_ops.cpp too)
HEADERS = tuple(Path(__file__).with_name(f) for f in ("bf16.h", "exp2_poly.h", "kernels.h"))
COMMON_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC")

_V3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")  # x86-64-v3 (abm: LZCNT)
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")  # x86-64-v4
_VNNI = (*_V4, "avx512_vnni")  # Cascade Lake, Ice Lake, Zen 4 and later
_BF16 = (*_VNNI, "avx512_bf16")  # Cooper Lake, Sapphire Rapids (AMX), Zen 4 and later


@dataclasses.dataclass(frozen=True)
class Variant:
    """One build of the kernels."""

    name: str
    flags: tuple[str, ...]
    """Compiler target flags."""
    needs: tuple[str, ...]
    """/proc/cpuinfo flags the code compiled with ``flags`` may execute."""


_X86 = (
    Variant("portable", ("-march=x86-64", "-mtune=generic"), ()),
    Variant("avx2", ("-march=x86-64-v3", "-mtune=generic"), _V3),
    Variant("avx512", ("-march=x86-64-v4", "-mtune=generic"), _V4),
    Variant("avx512vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"), _VNNI),
    Variant(
        "avx512bf16",
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mtune=generic"),
        _BF16,
    ),
)
NAMES = tuple(v.name for v in _X86)
"""Every variant name (the values of ``STRATA_CPU_ISA`` beside ``auto``), narrowest first."""


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def variants() -> tuple[Variant, ...]:
    """The variants of this machine's architecture, narrowest first (elsewhere than x86-64 one
    generic ``portable`` build)."""
    return _X86 if is_x86() else (Variant("portable", (), ()),)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def missing(name: str, flags: frozenset[str] | None = None) -> list[str]:
    """The CPU features variant ``name`` needs that this CPU (or ``flags``) lacks; ``[]`` when
    it runs here."""
    by_name = {v.name: v for v in variants()}
    if name not in by_name:
        return [f"an x86-64 CPU (this is {platform.machine()})"]
    have = cpu_flags() if flags is None else flags
    return [f for f in by_name[name].needs if f not in have]


def runnable(flags: frozenset[str] | None = None) -> list[str]:
    """The variants this CPU (or ``flags``) runs, narrowest first."""
    return [v.name for v in variants() if not missing(v.name, flags)]


def choose(setting: str | None = None, flags: frozenset[str] | None = None) -> str:
    """The variant for ``STRATA_CPU_ISA`` (or ``setting``): ``auto`` the widest this CPU runs.
    `ConfigError` (one line) for a variant this CPU cannot run or an unknown name."""
    setting = RuntimeSettings.from_env().cpu_isa if setting is None else setting
    if setting == "auto":
        return runnable(flags)[-1]
    if setting not in NAMES:
        raise ConfigError(
            f"STRATA_CPU_ISA={setting!r} is not a kernel variant; use one of auto, "
            + ", ".join(NAMES)
        )
    lacks = missing(setting, flags)
    if lacks:
        raise ConfigError(
            f"STRATA_CPU_ISA={setting}: this CPU lacks {' '.join(lacks)}; it runs "
            f"{', '.join(runnable(flags))} (or set STRATA_CPU_ISA=auto)"
        )
    return setting


def candidates(setting: str | None = None, flags: frozenset[str] | None = None) -> list[str]:
    """The variants to load for ``STRATA_CPU_ISA`` (or ``setting``), in order: for ``auto``
    every one this CPU runs, widest first (a compiler that refuses one flag set leaves the
    next); else `choose`'s one."""
    setting = RuntimeSettings.from_env().cpu_isa if setting is None else setting
    if setting == "auto":
        return runnable(flags)[::-1]
    return [choose(setting, flags)]


def _variant(name: str) -> Variant:
    for v in variants():
        if v.name == name:
            return v
    raise ValueError(f"no kernel variant {name!r} on {platform.machine()}")


def library_path(name: str) -> Path:
    """Where variant ``name``'s library is (or will be) in the cache: named by the variant and a
    hash of the sources, the compiler and the flags."""
    v = _variant(name)
    cc = os.environ.get("CC", "cc")
    texts = [f.read_text() for f in (*SOURCES, *HEADERS)]
    key = "\0".join([*texts, cc, *COMMON_FLAGS, *v.flags, platform.machine()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache = Path(RuntimeSettings.from_env().cache_dir) / "kernels"
    return cache / f"strata_kernels_{name}_{digest}.so"


def build(name: str) -> Path:
    """Variant ``name``'s library, compiled first when the cache lacks it. Raises `OSError` or
    `subprocess.SubprocessError` when the sources or the compiler fail (the compiler's
    message in the error)."""
    v = _variant(name)
    out = library_path(name)
    if out.exists():
        return out
    cc = os.environ.get("CC", "cc")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        for f in (*SOURCES, *HEADERS):
            (Path(tmp) / f.name).write_text(f.read_text())
        srcs = [str(Path(tmp) / f.name) for f in SOURCES]
        so = Path(tmp) / "k.so"
        done = subprocess.run(
            [cc, *COMMON_FLAGS, *v.flags, *srcs, "-o", str(so), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise subprocess.SubprocessError(f"{cc} failed for the {name} variant: {tail}")
        os.replace(so, out)  # atomic: concurrent builders race harmlessly
    return out


def main(argv: list[str] | None = None) -> int:
    """Build every variant of this architecture (or those named); one line each. Exit 1 when
    none this CPU runs was built: a variant the compiler refuses is skipped, not fatal."""
    names = argv or [v.name for v in variants()]
    built = []
    for name in names:
        try:
            path = build(name)
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            print(f"[kernels] {name}: not built ({e})", file=sys.stderr)
            continue
        built.append(name)
        lacks = missing(name)
        runs = "runs on this CPU" if not lacks else f"not on this CPU (lacks {' '.join(lacks)})"
        print(f"[kernels] {name}: {path.name} ({runs})", file=sys.stderr)
    return 0 if set(built) & set(runnable()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
