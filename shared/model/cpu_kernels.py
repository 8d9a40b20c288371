"""Native CPU kernels: decode attention over the paged KV cache, float32 and int8 GEMMs.

Decode attention in torch needs, per sequence and layer, two ``index_select`` copies of its
context blocks and one small SDPA call: ~300 tiny ops per step for 16 sequences x 8 layers, which
measured ~13 ms of a 33 ms step on the benchmark model (docs/benchmarks/model.md). The kernel
in ``decode_attention.c`` (beside this file, shipped as package data) reads K/V straight from
the blocks (no copy) for every sequence and head in one call.

``gemm.c`` multiplies activations by a linear weight packed once into column panels
(:func:`pack_linear`, :func:`linear`): on an AVX2 CPU it ran decode-sized products 1.4-1.8x
faster than oneDNN's blocked GEMM and prefill-sized ones within ~10% of it
(docs/benchmarks/engine.md), and `shared.model.layers.Gemm` uses it for float32 on CPU.

All are plain C, built by ``build_kernels.py`` once per ISA variant (portable, AVX2, AVX-512,
AVX-512 VNNI, AVX-512 BF16: explicit target flags, one library each in ``$STRATA_CACHE/kernels``;
at set-up, else on first use) and called as torch custom ops, ``torch.ops.strata.*``
(`torch_ops`: one C++ library per torch version, bound to the loaded variant's entry points;
the dispatcher releases the GIL). The variant loaded is ``STRATA_CPU_ISA`` (auto: the widest
this CPU runs; ``strata_kernel_isa{variant}``). Where there is no compiler, or ``STRATA_CPU_KERNELS=0``, or the
dtype is not float32, the wrappers here return ``None`` / ``False`` and the caller uses the torch
path (oneDNN for linears); each such call on the CPU counts in
``strata_kernel_fallback_total{op,reason}`` (`fallback`). The wrappers check what the kernels
take and count the calls (`calls`); the ops check it again (a bad call raises, never falls back).

``gemm.c`` also holds causal prefill attention over the paged cache (:func:`prefill_attention`):
both of its products run on the GEMM tile, with an online softmax between them.

``gemm_int8.c`` multiplies by an int8 weight with per-output scales packed once
(:func:`pack_int8`, :func:`linear_int8`), each row of activations quantised to int8 at call time
(W8A8, int32 sums; `shared.model.int8.Int8Gemm` uses it): AVX-512 VNNI in the ``avx512vnni``
variant, ``vpmaddubsw`` in ``avx512`` and ``avx2``, plain C in ``portable``, all bit-identical.

``gemm_bf16.c`` multiplies float32 rows by a bf16 weight packed once (its wrappers are in
`shared.model.bf16`): the weight widened in registers on every variant, ``vdpbf16ps`` on bf16
rows in ``avx512bf16`` (from `bf16.DOT_ROWS` rows). A bf16 model's layers run on it, one call
each, over a bf16 KV cache (``layer.c``; the attention kernels widen it as they read it).

``fused.c`` holds the decoder layer's row-wise ops as one call each (:func:`rms_norm`, with the
residual add; :func:`qk_norm_rope`), which as torch ops were 8-20 small calls apiece.

``layer.c`` strings all of them into one call per decoder layer (:class:`NativeLayer`,
:class:`LayerBatch`, :func:`decoder_layer`), so a forward of a Llama-family model in float32 on
CPU runs one op per layer (``strata::decoder_layer_``) and no Python between its kernels.
"""

from __future__ import annotations

import collections
import logging
import subprocess
import threading
from pathlib import Path
from typing import Protocol

import torch
from prometheus_client import Counter, Gauge

from shared.config import RuntimeSettings
from shared.model import build_kernels, torch_ops

log = logging.getLogger(__name__)

_SOURCES = build_kernels.SOURCES  # package data (pyproject.toml), compiled into one library
_SOURCE = _SOURCES[0]  # the decode-attention kernel
_HEADERS = build_kernels.HEADERS

ISA = Gauge("strata_kernel_isa", "1 for the CPU kernel variant this process loaded", ["variant"])
FALLBACKS = Counter(
    "strata_kernel_fallback_total",
    "Calls that ran torch instead of a native CPU kernel, by kernel and reason",
    ["op", "reason"],
)
_fallback_children: dict[tuple[str, str], Counter] = {}
# calls into each loaded variant's kernels, by (variant the library reports, op): tests read it
calls: collections.Counter[tuple[str, str]] = collections.Counter()

_lock = threading.Lock()
_loaded: bool | None = None  # True: a variant's kernels are bound to the ops; False: unavailable
_width = 0  # the loaded variant's GEMM panel width (strata_gemm_panel_width)
_isa = ""  # the loaded library's own report of its code paths (isa.c)
_off = "unavailable"  # the fallback reason while _loaded is False
_generation = 0  # libraries loaded so far: what is packed for one is wrong for another


def fallback(op: str, reason: str) -> None:
    """Count one call of ``op`` that runs torch instead of its native kernel, and why:
    ``disabled`` (a STRATA_CPU_* switch), ``unavailable`` (no compiler, build failed),
    ``dtype`` (not float32), ``layout`` (strides the kernel does not take), ``shape`` (a size
    it does not take), ``unsupported`` (a model part it has no code for: MoE, a
    tensor-parallel projection). Returns None (the callers' "no kernel")."""
    child = _fallback_children.get((op, reason))
    if child is None:  # per call on a bf16 model's every layer: labels() once per pair
        child = _fallback_children[op, reason] = FALLBACKS.labels(op, reason)
    child.inc()


def _load(variant: str | None) -> None:
    """Load ``variant`` (None: ``STRATA_CPU_ISA``), building it first when the cache lacks it;
    for ``auto`` the next narrower variant when the compiler refuses one; then bind the torch
    ops to it (`torch_ops.bind`, building the op library first when needed). A variant this CPU
    cannot run raises `ConfigError`; a failed build leaves the kernels unavailable (torch paths,
    counted)."""
    global _loaded, _isa, _off, _generation, _width
    on = RuntimeSettings.from_env().cpu_kernels
    names = build_kernels.candidates(variant) if on else []  # ConfigError: nothing changed
    _loaded, _isa, _off = False, "", "disabled" if not on else "unavailable"
    for v in build_kernels.NAMES:
        ISA.labels(v).set(0)
    for name in names:
        try:
            path = build_kernels.build(name)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("CPU kernels: the %s variant unavailable (%s)", name, e)
            continue
        try:
            isa = torch_ops.bind(path)
        except (OSError, subprocess.SubprocessError) as e:  # no C++ compiler, a bad library
            log.warning("CPU kernels: no torch ops for the %s variant (%s)", name, e)
            continue
        _loaded, _isa, _generation = True, isa, _generation + 1
        _width = torch.ops.strata.gemm_panel_width()
        ISA.labels(name).set(1)
        log.info("CPU kernels: the %s variant (%s)", name, Path(path).name)
        return
    if names:
        log.warning("CPU kernels unavailable; using the torch path")


def use(variant: str | None) -> str:
    """Load ``variant`` (None: ``STRATA_CPU_ISA``) in place of the current one and return the
    variant its code reports. Packed weights and layers made under another variant must be
    made again (the GEMM panel width differs). For tests and tools."""
    with _lock:
        _load(variant)
    return _isa


def generation() -> int:
    """Which load of the kernels is current: weights packed under another are stale."""
    return _generation


def loaded_isa() -> str:
    """The variant of the loaded kernels ("" when none)."""
    return _isa if available() else ""


def _cpu_flags() -> str:
    """The /proc/cpuinfo flags, space separated."""
    return " ".join(sorted(build_kernels.cpu_flags()))


# CPU flags of a native matrix unit for each half type; without one torch emulates it (measured
# 3-4x slower than float32 on an AVX2-only EPYC, docs/benchmarks/peer.md).
_NATIVE_HALF = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def native_half(dtype: str, flags: str | None = None) -> bool:
    """Whether this CPU (or ``flags``, a /proc/cpuinfo flags line) has native matrix products
    for ``dtype`` ("bfloat16" / "float16"); True for any other dtype."""
    if dtype not in _NATIVE_HALF:
        return True
    have = set((_cpu_flags() if flags is None else flags).split())
    return any(f in have for f in _NATIVE_HALF[dtype])


def available() -> bool:
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _load(None)
    return _loaded is not False


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``[B, H, D]`` attention of one query token per sequence over its cached context, or
    ``None`` when the native kernel does not apply (not CPU float32, or no compiler).
    ``sinks``: ``[H]`` attention-sink logits (GPT-OSS), each in its head's softmax denominator
    as a key whose value is zero."""
    why = _why(q, k_cache, v_cache, sinks, layout=False)
    if not why and not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        why = "layout"
    if not why and not available():
        why = _off
    if why:
        return _fallback("decode_attention", why)
    tables = block_tables.to(torch.int64).contiguous()
    ctx = context_lens.to(torch.int64).contiguous()
    out = torch.ops.strata.decode_attention(
        q.contiguous(), k_cache, v_cache, tables, ctx, scale, _sinks(sinks)
    )
    calls[_isa, "decode_attention"] += 1
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    ctx: torch.Tensor,
    qstart: torch.Tensor,
    qlen: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> bool:
    """Causal attention of the new tokens of several sequences over their cached context (the
    new K/V already written), into ``out``: ``q`` and ``out`` ``[T, H, D]`` (any token stride,
    heads contiguous), sequence ``s``'s ``qlen[s]`` rows from ``qstart[s]``, its context
    ``ctx[s]`` tokens (new ones last) in the blocks of ``tables[s]``; int64 index tensors.
    False (nothing done) when the kernel does not apply (not CPU float32, a head layout or size
    it does not take, or no compiler). A sequence with more new tokens than context is no
    batch at all: the op refuses it (RuntimeError, nothing written). ``sinks``: as for
    `decode_attention`."""
    t, h, d = q.shape
    why = _why(q, k_cache, v_cache, out, sinks, layout=False)
    if not why and q.shape != out.shape:
        why = "shape"
    if not why and (q.stride()[1:] != (d, 1) or out.stride()[1:] != (d, 1)):
        why = "layout"
    if not why and not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        why = "layout"
    if not why and not available():
        why = _off
    if not why and (d < _width or d % _width or k_cache.shape[2] < 1 or h % k_cache.shape[2]):
        why = "shape"  # strata_prefill_attn_f32 takes head sizes of whole panels, whole groups
    if why:
        _fallback("prefill_attention", why)
        return False
    torch.ops.strata.prefill_attention_(
        q, k_cache, v_cache, tables, ctx, qstart, qlen, scale, out, _sinks(sinks)
    )
    calls[_isa, "prefill_attention"] += 1
    return True


def _sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The sink logits as the ops take them: float32, contiguous, outside autograd."""
    return None if sinks is None else sinks.detach().contiguous()


class PackedLinear:
    """A ``[N, K]`` float32 weight repacked for ``gemm.c`` (column panels of the kernel's width,
    zero past ``N``); ``data`` keeps the packed floats alive; ``gen`` the `generation` it was
    packed for."""

    __slots__ = ("data", "n", "k", "gen")

    def __init__(self, data: torch.Tensor, n: int, k: int):
        self.data, self.n, self.k, self.gen = data, n, k, _generation


def native_gemm_chosen(choice: str | None = None) -> bool:
    """Whether float32 linears run on the native kernel: ``STRATA_CPU_GEMM`` (or ``choice``),
    ``auto`` and ``native`` meaning yes. It was measured against oneDNN on an AVX2 EPYC (1.3-1.6x
    at decode batch sizes) and an AVX-512 one (2.1x at 1 row, 1.0-1.1x from 16 rows up), never
    slower beyond the spread (docs/benchmarks/engine.md); ``onednn`` keeps oneDNN's kernel."""
    choice = RuntimeSettings.from_env().cpu_gemm if choice is None else choice
    return choice != "onednn"


def pack_linear(w: torch.Tensor) -> PackedLinear | None:
    """``w`` packed for :func:`linear`, or ``None`` when the kernel does not apply (not a CPU
    float32 matrix, or no compiler / ``STRATA_CPU_KERNELS=0``). Callers ask
    :func:`native_gemm_chosen` first."""
    if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
        return None
    if not available():
        return None
    n, k = w.shape
    return PackedLinear(torch.ops.strata.pack_linear(w.detach().contiguous()), n, k)


def linear(x: torch.Tensor, w: PackedLinear, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + bias`` for float32 CPU ``x`` of shape ``[..., K]``."""
    if w.gen != _generation:
        raise RuntimeError("weight packed for other kernels than the loaded ones")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k).contiguous()
    if bias is not None:
        bias = bias.contiguous()
    out = torch.ops.strata.linear(x2, w.data, w.n, bias)
    calls[_isa, "gemm"] += 1
    return out.view(*lead, w.n)


class PackedInt8:
    """A ``[N, K]`` int8 weight and its ``[N]`` float32 scales packed for ``gemm_int8.c``
    (panels of the kernel's width, then per output its column sum and scale); ``data`` keeps
    the bytes alive; ``gen`` the `generation` it was packed for."""

    __slots__ = ("data", "n", "k", "gen")

    def __init__(self, data: torch.Tensor, n: int, k: int):
        self.data, self.n, self.k, self.gen = data, n, k, _generation


INT8_MAX_K = 65536  # gemm_int8.c's int32 sums are exact up to this many products per output


def pack_int8(w: torch.Tensor, scale: torch.Tensor) -> PackedInt8 | None:
    """``w`` (int8 ``[N, K]``, ``|w| <= 127``) with its per-output ``scale`` (float32 ``[N]``)
    packed for :func:`linear_int8`, or ``None`` when the kernel does not apply (not on the CPU,
    another dtype or shape, ``K`` past `INT8_MAX_K`, or no compiler / ``STRATA_CPU_KERNELS=0``)."""
    if w.device.type != "cpu" or w.dtype != torch.int8 or w.dim() != 2:
        return None
    n, k = w.shape
    if scale.dtype != torch.float32 or scale.shape != (n,) or scale.device != w.device:
        return None
    if k > INT8_MAX_K or not available():
        return None
    data = torch.ops.strata.pack_int8(w.detach().contiguous(), scale.detach().contiguous())
    return PackedInt8(data, n, k)


def linear_int8(x: torch.Tensor, w: PackedInt8, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (w8 * scale[:, None]).T + bias`` for float32 CPU ``x`` of shape ``[..., K]``, each
    row of ``x`` quantised to int8 by its own symmetric scale (``gemm_int8.c``: W8A8, int32
    sums)."""
    if w.gen != _generation:
        raise RuntimeError("weight packed for other kernels than the loaded ones")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k).contiguous()
    if bias is not None:
        bias = bias.contiguous()
    out = torch.ops.strata.linear_int8(x2, w.data, w.n, bias)  # OutOfMemoryError: no rows
    calls[_isa, "int8_gemm"] += 1
    return out.view(*lead, w.n)


def _plain(*ts: torch.Tensor | None) -> bool:
    """All given tensors CPU float32 and contiguous (None entries ignored)."""
    return not _why(*ts)


def _why(*ts: torch.Tensor | None, layout: bool = True) -> str:
    """Why the given tensors (None entries ignored) do not fit a float32 CPU kernel: "device"
    (not on the CPU: no native kernel there, nothing counted), "dtype", "layout" (not
    contiguous, checked when ``layout``), or "" when they fit."""
    real = [t for t in ts if t is not None]
    if any(t.device.type != "cpu" for t in real):
        return "device"
    if any(t.dtype != torch.float32 for t in real):
        return "dtype"
    if layout and not all(t.is_contiguous() for t in real):
        return "layout"
    return ""


def _fallback(op: str, why: str) -> None:
    """`fallback` for a reason from `_why`, a CPU one only (None)."""
    if why != "device":
        fallback(op, why)


def off_reason() -> str:
    """Why the kernels are not loaded ("disabled" or "unavailable"); "" when they are."""
    return "" if available() else _off


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(h, weight * rmsnorm(h))`` over the last dim, with ``h = x + residual`` (a new
    tensor) or ``h = x``; ``None`` when the kernel does not apply (not CPU float32 contiguous).
    A bf16 ``weight`` over float32 rows (a bf16 model's final norm after the one-call layers)
    is widened: what torch computes for them too."""
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
        weight = weight.float()
    why = _why(x, weight, residual)
    if not why and residual is not None and residual.shape != x.shape:
        why = "shape"
    if not why and not available():
        why = _off
    if why:
        return _fallback("rms_norm", why)
    if residual is None:
        h, y = x, torch.ops.strata.rms_norm(x, weight, eps)
    else:
        h, y = torch.ops.strata.add_rms_norm(x, residual, weight, eps)
    calls[_isa, "rms_norm"] += 1
    return h, y


def qk_norm_rope(
    qkv: torch.Tensor,
    heads: int,
    num_q: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> bool:
    """In place on ``qkv [T, H_all, D]``: per-head RMSNorm of its first ``heads`` heads
    (``q_weight`` for the first ``num_q``, ``k_weight`` after; none when ``q_weight`` is None),
    then rotate-half RoPE by ``cos``/``sin [T, D]``. False (nothing done) when the kernel does
    not apply."""
    t, _, d = qkv.shape
    why = _why(qkv, q_weight, k_weight, cos, sin)
    if not why and (d % 2 or cos.shape != (t, d) or sin.shape != (t, d)):
        why = "shape"
    if not why and not available():
        why = _off
    if why:
        _fallback("qk_norm_rope", why)
        return False
    torch.ops.strata.qk_norm_rope_(qkv, heads, num_q, q_weight, k_weight, eps, cos, sin)
    calls[_isa, "qk_norm_rope"] += 1
    return True


_layer_arg_names: list[str] = []  # strata::decoder_layer_'s, in order (the op's schema)


def _in_schema_order(args: dict[str, object]) -> tuple[object, ...]:
    """The values of ``args``, named as arguments of ``torch.ops.strata.decoder_layer_``, in the
    order of its schema (a run of consecutive arguments there): positional arguments cost the
    call less than keywords, and the order comes from the schema, not from here."""
    global _layer_arg_names
    if not _layer_arg_names:
        schema = torch.ops.strata.decoder_layer_.default._schema
        _layer_arg_names = [a.name for a in schema.arguments]
    names = _layer_arg_names
    first = names.index(next(iter(args)))
    run = names[first : first + len(args)]
    if sorted(run) != sorted(args):
        raise ValueError(f"not a run of strata::decoder_layer_'s arguments: {sorted(args)}")
    return tuple(args[n] for n in run)


class NativeLayer:
    """One decoder layer for :func:`decoder_layer`: ``args``, its weights and sizes as the
    arguments of ``torch.ops.strata.decoder_layer_`` they are, by schema name (the op fills
    kernels.h's ``strata_layer`` from them, checking each: nothing here restates its layout; the
    projections' dtype, float32 panels, int8 bytes or bf16 pairs, says which GEMM); ``shape`` its
    (hidden, heads, kv_heads, head_dim, inter); ``key`` what its owner built it from."""

    __slots__ = ("args", "ordered", "shape", "key")

    def __init__(self, args: dict[str, object], shape: tuple[int, int, int, int, int]):
        self.args, self.shape, self.key = args, shape, None
        self.ordered = _in_schema_order(args)

    @property
    def head_dim(self) -> int:
        return self.shape[3]


class PackedWeight(Protocol):
    """What `native_layer` reads of a packed projection: `PackedLinear`, `PackedInt8` or
    `shared.model.bf16.PackedBF16`."""

    data: torch.Tensor
    n: int
    k: int
    gen: int


Projection = tuple[PackedWeight, torch.Tensor | None]


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A bf16 model's norm weight or bias widened for the kernels (exact); others as they are."""
    return t.float() if t is not None and t.dtype == torch.bfloat16 else t


def native_layer(
    ln1: tuple[torch.Tensor, float],
    qkv: Projection,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    o: Projection,
    ln2: tuple[torch.Tensor, float],
    gate_up: Projection,
    down: Projection,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scale: float,
) -> NativeLayer | None:
    """The layer for :func:`decoder_layer` from its norms' ``(weight, eps)`` and its packed
    projections' ``(weight, bias)`` (q/k/v and gate/up fused, SiLU gating; all four float32
    `PackedLinear`, all four int8 `PackedInt8` or all four bf16 ``PackedBF16``, whose norms and
    biases may be bf16: they are widened to float32 here); ``None`` when a shape or tensor does
    not fit the kernels."""
    ln1, ln2 = (_f32(ln1[0]), ln1[1]), (_f32(ln2[0]), ln2[1])
    if qk_norm:
        qk_norm = (_f32(qk_norm[0]), _f32(qk_norm[1]), qk_norm[2])
    qkv, o, gate_up, down = ((p, _f32(b)) for p, b in (qkv, o, gate_up, down))
    hidden = ln1[0].numel()
    att = heads * head_dim
    inter = gate_up[0].n // 2
    shapes = (
        qkv[0].k == hidden and qkv[0].n == att + 2 * kv_heads * head_dim,
        o[0].k == att and o[0].n == hidden,
        gate_up[0].k == hidden and gate_up[0].n == 2 * inter,
        down[0].k == inter and down[0].n == hidden,
        ln2[0].numel() == hidden and heads % kv_heads == 0,
    )
    norms = [ln1[0], ln2[0], *(qk_norm[:2] if qk_norm else ())]
    biases = [b for _, b in (qkv, o, gate_up, down) if b is not None]
    kinds = {type(p) for p, _ in (qkv, o, gate_up, down)}
    if not all(shapes) or not _plain(*norms, *biases) or len(kinds) != 1 or not available():
        return None
    if any(p.gen != _generation for p, _ in (qkv, o, gate_up, down)):
        raise RuntimeError("weights packed for other kernels than the loaded ones")
    if qk_norm and not (qk_norm[0].numel() == qk_norm[1].numel() == head_dim):
        return None
    if any(b.numel() != p.n for p, b in (qkv, o, gate_up, down) if b is not None):
        return None
    return NativeLayer(
        {
            "ln1_w": ln1[0], "ln1_eps": ln1[1],
            "qkv_p": qkv[0].data, "qkv_b": qkv[1],
            "qn_w": qk_norm[0] if qk_norm else None, "kn_w": qk_norm[1] if qk_norm else None,
            "qk_eps": qk_norm[2] if qk_norm else 0.0,
            "o_p": o[0].data, "o_b": o[1],
            "ln2_w": ln2[0], "ln2_eps": ln2[1],
            "gu_p": gate_up[0].data, "gu_b": gate_up[1],
            "down_p": down[0].data, "down_b": down[1],
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "inter": inter,
            "scale": scale, "dot_rows": getattr(qkv[0], "dot_rows", 0),  # a PackedBF16's
        },
        (hidden, heads, kv_heads, head_dim, inter),
    )  # fmt: skip


class LayerBatch:
    """One forward's batch for :func:`decoder_layer`: ``args``, the arguments of
    ``torch.ops.strata.decoder_layer_`` it fills kernels.h's ``strata_batch`` from, by schema
    name, and the ``scratch`` every layer of the forward shares."""

    __slots__ = ("args", "ordered", "scratch")

    def __init__(self, args: dict[str, torch.Tensor | None], scratch: torch.Tensor):
        self.args, self.scratch = args, scratch
        self.ordered = _in_schema_order(args)


def layer_batch(
    layers: list[NativeLayer],
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
) -> LayerBatch | None:
    """The batch of ``cos``/``sin`` ``[T, head_dim]`` and int64 ``slots [T]``; ``prefill`` the
    non-decode sequences as (block tables, context lengths, first rows, new-token counts),
    ``decode`` the decode tokens as (block tables, context lengths, rows or None for all rows
    in order), all int64. ``None`` when a tensor or the prefill kernel's head size does not
    fit. Every layer of ``layers`` (one forward's) shares it, and its scratch."""
    t = slots.numel()
    d = layers[0].head_dim
    if any(x.head_dim != d for x in layers):
        return None
    if not _plain(cos, sin) or cos.shape != (t, d) or sin.shape != (t, d):
        return None
    if prefill is not None and (d < _width or d % _width):
        return None  # strata_prefill_attn_f32 takes head sizes of whole panels
    i64 = torch.int64

    def index(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(i64).contiguous()

    p = tuple(index(x) for x in prefill) if prefill is not None else (None,) * 4
    dec = tuple(index(x) for x in decode) if decode is not None else (None,) * 3
    d_n = 0 if dec[1] is None else dec[1].numel()
    sizes = {x.shape for x in layers}
    floats = max(torch.ops.strata.layer_scratch(t, d_n, *shape) for shape in sizes)
    args = {"cos": cos, "sin": sin, "slots": index(slots)}
    args |= dict(zip(("p_tables", "p_ctx", "p_qstart", "p_qlen"), p, strict=True))
    args |= dict(zip(("d_tables", "d_ctx", "d_rows"), dec, strict=True))
    return LayerBatch(args, layer_scratch(floats))


_scratch = threading.local()


def layer_scratch(floats: int) -> torch.Tensor:
    """``floats`` of the calling thread's layer scratch: one buffer per thread (the one that
    runs forwards), grown to the largest batch it ran and reused by every later forward. A fresh
    buffer per forward is, above glibc's mmap threshold (55 MB at a 2048-token step of the
    benchmark model), a fresh mapping whose pages the kernel faults in and zeroes on every
    forward: 5% of an 8 x 256-token prefill (docs/benchmarks/engine.md). A forward holds it
    only while it runs, and one thread runs one forward at a time."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < floats:
        _scratch.buf = None  # the old buffer goes before the larger one is allocated
        buf = _scratch.buf = torch.empty(floats, dtype=torch.float32)
    return buf[:floats]


# calls of decoder_layer in this process: tests read it to tell the one-call layer ran
layer_calls = 0


def decoder_layer(
    layer: NativeLayer, batch: LayerBatch, h: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:  # fmt: skip
    """One decoder layer over ``h [T, hidden]`` in place (CPU float32, contiguous), writing the
    batch's new K/V into this layer's ``k_cache``/``v_cache [blocks, block_size, KVH, D]``
    (float32, or bf16: rounded as written, widened as read) (``torch.ops.strata.decoder_layer_``:
    RuntimeError for arguments it does not take, torch.OutOfMemoryError when an int8 or bf16
    GEMM had no memory for its rows or a bf16 cache's decode attention none for its copy)."""
    global layer_calls
    torch.ops.strata.decoder_layer_(
        h, k_cache, v_cache, batch.scratch, *layer.ordered, *batch.ordered
    )
    layer_calls += 1
    calls[_isa, "decoder_layer"] += 1
