"""The native kernels' ISA variants (`build_kernels`): each kernel runs on every variant this CPU
can execute (counted per variant, by the library's own report of its code paths) and matches
torch; the dispatch and ``STRATA_CPU_ISA``'s bad values; the fallback counter's reasons."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import REGISTRY

from services import cli
from shared.config import ConfigError
from shared.model import build_kernels, cpu_kernels
from shared.model.build_kernels import _BF16, _V3, _V4, _VNNI
from tests.model import test_native_layer as native_layer
from tests.model.paged_driver import PagedDriver


def _counted(op: str, variant: str) -> int:
    return cpu_kernels.calls[variant, op]


def test_each_kernel_runs_on_the_variant(kernel_isa, monkeypatch):
    """gemm, int8_gemm, rms_norm, qk_norm_rope, decode and prefill attention, the one-call
    layer: each called once under ``kernel_isa``, counted for it, and equal to the torch result
    (int8: to its rounding; bit for bit in tests/model/test_int8_gemm.py)."""
    torch.manual_seed(0)
    ops = ("gemm", "int8_gemm", "rms_norm", "qk_norm_rope", "decode_attention", "decoder_layer")
    before = {op: _counted(op, kernel_isa) for op in ops}
    w, x = torch.randn(40, 70), torch.randn(5, 70)
    got = cpu_kernels.linear(x, cpu_kernels.pack_linear(w), None)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    scale = w.abs().amax(1) / 127
    w8 = torch.round(w / scale[:, None]).to(torch.int8)
    got = cpu_kernels.linear_int8(x, cpu_kernels.pack_int8(w8, scale), None)
    want = F.linear(x, w8.float() * scale[:, None])
    assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()

    weight = torch.randn(64)
    _, y = cpu_kernels.rms_norm(x[:, :64].contiguous(), weight, 1e-6)
    want = weight * x[:, :64] * torch.rsqrt(x[:, :64].pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)

    qkv = torch.randn(3, 4, 32)
    cos, sin = torch.ones(3, 32), torch.zeros(3, 32)  # the identity rotation: norm alone
    want = qkv * torch.rsqrt(qkv.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert cpu_kernels.qk_norm_rope(qkv, 4, 2, torch.ones(32), torch.ones(32), 1e-6, cos, sin)
    torch.testing.assert_close(qkv, want, rtol=1e-5, atol=1e-5)

    kc, vc = torch.randn(4, 16, 2, 32), torch.randn(4, 16, 2, 32)
    q = torch.randn(1, 4, 32)
    out = cpu_kernels.decode_attention(q, kc, vc, torch.tensor([[2, 0]]), torch.tensor([20]), 0.2)
    k = torch.cat([kc[2], kc[0]])[:20].repeat_interleave(2, 1).transpose(0, 1)
    v = torch.cat([vc[2], vc[0]])[:20].repeat_interleave(2, 1).transpose(0, 1)
    want = F.scaled_dot_product_attention(q[0][:, None], k, v, scale=0.2)[:, 0]
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)

    model = native_layer._model()
    monkeypatch.setattr(native_layer.llama, "NATIVE_LAYER", True)
    drv = PagedDriver(model, block_size=16)
    h = drv.step([(drv.new_seq(), [1, 2, 3])])[0]
    monkeypatch.setattr(native_layer.llama, "NATIVE_LAYER", False)
    drv = PagedDriver(model, block_size=16)
    torch.testing.assert_close(h, drv.step([(drv.new_seq(), [1, 2, 3])])[0])

    after = {op: _counted(op, kernel_isa) for op in before}
    assert after["gemm"] - before["gemm"] >= 1
    assert after["int8_gemm"] - before["int8_gemm"] == 1
    assert after["rms_norm"] - before["rms_norm"] >= 1
    assert after["qk_norm_rope"] - before["qk_norm_rope"] >= 1
    assert after["decode_attention"] - before["decode_attention"] == 1
    assert after["decoder_layer"] - before["decoder_layer"] == model.config.num_layers


def test_variants_are_separate_libraries_keyed_by_flags():
    paths = {build_kernels.library_path(v.name) for v in build_kernels.variants()}
    assert len(paths) == len(build_kernels.variants())
    for v in build_kernels.variants():
        assert build_kernels.library_path(v.name).name.startswith(f"strata_kernels_{v.name}_")
    assert build_kernels.NAMES == (  # the fixture's
        "portable",
        "avx2",
        "avx512",
        "avx512vnni",
        "avx512bf16",
    )


def test_build_step_builds_every_variant(capsys):
    assert build_kernels.main([]) == 0
    err = capsys.readouterr().err
    for v in build_kernels.variants():
        assert f"[kernels] {v.name}: strata_kernels_{v.name}_" in err
        assert build_kernels.library_path(v.name).exists()


@pytest.mark.skipif(not build_kernels.is_x86(), reason="the ISA variants are x86-64 builds")
def test_auto_picks_the_widest_variant_the_cpu_runs():
    assert build_kernels.choose("auto", frozenset()) == "portable"
    assert build_kernels.choose("auto", frozenset(_V3)) == "avx2"
    assert build_kernels.choose("auto", frozenset(_V4)) == "avx512"
    assert build_kernels.choose("auto", frozenset(_V4) - {"avx512bw"}) == "avx2"
    assert build_kernels.choose("auto", frozenset(_VNNI)) == "avx512vnni"
    assert build_kernels.choose("auto", frozenset(_VNNI) - {"avx512_vnni"}) == "avx512"
    assert build_kernels.choose("auto", frozenset(_BF16)) == "avx512bf16"
    assert build_kernels.choose("auto", frozenset(_BF16) - {"avx512_vnni"}) == "avx512"
    assert build_kernels.choose("portable", frozenset(_V4)) == "portable"
    auto = build_kernels.choose("auto")
    assert auto == build_kernels.runnable()[-1]
    assert cpu_kernels.use(None) == auto
    for v in build_kernels.NAMES:
        assert REGISTRY.get_sample_value("strata_kernel_isa", {"variant": v}) == (v == auto)


def test_a_forced_variant_the_cpu_lacks_is_one_line(monkeypatch, capsys):
    with pytest.raises(ConfigError) as e:
        build_kernels.choose("avx512", frozenset(_V3))
    msg = str(e.value)
    assert msg.startswith("STRATA_CPU_ISA=avx512: this CPU lacks avx512f avx512bw")
    assert "\n" not in msg and "runs portable, avx2" in msg
    # through `strata serve`: one line, no traceback, before the service is imported
    monkeypatch.setattr(build_kernels, "cpu_flags", lambda: frozenset(_V3))
    monkeypatch.setenv("STRATA_CPU_ISA", "avx512")
    assert cli.serve("decode", []) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("STRATA_FATAL decode: STRATA_CPU_ISA=avx512: this CPU lacks avx512f")
    # and in-process: the kernels refuse to load rather than run code the CPU cannot execute
    with pytest.raises(ConfigError, match="lacks avx512f"):
        cpu_kernels.use(None)
    monkeypatch.delenv("STRATA_CPU_ISA")
    try:
        cpu_kernels.use(None)  # auto again, for the patched flags
        assert cpu_kernels.loaded_isa() == "avx2"
    finally:
        monkeypatch.undo()
        cpu_kernels.use(None)  # this CPU's own choice for the tests after this one


def test_an_unknown_variant_lists_the_valid_ones(monkeypatch, capsys):
    monkeypatch.setenv("STRATA_CPU_ISA", "avx9")
    assert cli.serve("prefill", []) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "STRATA_CPU_ISA" in err and "'avx9'" in err
    assert all(f"'{v}'" in err for v in ("auto", *build_kernels.NAMES))
    valid = "use one of auto, portable, avx2, avx512, avx512vnni, avx512bf16$"
    with pytest.raises(ConfigError, match=valid):
        build_kernels.choose("avx9")


def _fallbacks(op: str, reason: str) -> float:
    labels = {"op": op, "reason": reason}
    return REGISTRY.get_sample_value("strata_kernel_fallback_total", labels) or 0.0


def _counts(op: str, reason: str, call) -> float:
    before = _fallbacks(op, reason)
    call()
    return _fallbacks(op, reason) - before


def test_each_fallback_is_counted_with_its_reason(monkeypatch, tmp_path):
    x = torch.randn(3, 64)
    w = torch.ones(64)
    bf = x.bfloat16()
    assert _counts("rms_norm", "dtype", lambda: cpu_kernels.rms_norm(bf, w.bfloat16(), 1e-6)) == 1
    strided = torch.randn(4, 16, 4, 32)[:, :, :2]
    q, tables, ctx = torch.randn(1, 4, 32), torch.tensor([[0]]), torch.tensor([3])
    attn = lambda: cpu_kernels.decode_attention(q, strided, strided, tables, ctx, 0.1)  # noqa: E731
    assert _counts("decode_attention", "layout", attn) == 1
    qkv = torch.randn(2, 4, 31)  # odd head size: no rotate-half
    cs = torch.ones(2, 31)
    rope = lambda: cpu_kernels.qk_norm_rope(qkv, 4, 2, None, None, 0.0, cs, cs)  # noqa: E731
    assert _counts("qk_norm_rope", "shape", rope) == 1
    gelu = native_layer._model(act="gelu_pytorch_tanh")  # layer.c gates with SiLU only
    drv = PagedDriver(gelu, block_size=16)
    step = lambda: drv.step([(drv.new_seq(), [1, 2])])  # noqa: E731
    assert _counts("decoder_layer", "unsupported", step) == 1
    from shared.model import layers
    from shared.model.layers import project

    half = torch.nn.Linear(64, 8).half()  # no native float16 GEMM
    assert _counts("gemm", "dtype", lambda: project(half, x.half())) == 1
    linear = torch.nn.Linear(64, 8).bfloat16()  # the native bf16 GEMM, unless it is off
    assert _counts("bf16_gemm", "dtype", lambda: project(linear, bf)) == 0
    monkeypatch.setattr(layers, "NATIVE_CPU_GEMM", False)  # STRATA_CPU_GEMM=onednn
    bf_off = torch.nn.Linear(64, 8).bfloat16()
    assert _counts("bf16_gemm", "disabled", lambda: project(bf_off, bf)) == 1
    monkeypatch.setattr(layers, "NATIVE_CPU_GEMM", True)
    wrapped = torch.nn.Sequential(torch.nn.Linear(64, 8))  # as a quantised projection: no kernel
    assert _counts("gemm", "unsupported", lambda: project(wrapped, x)) == 1
    # off by the switch, and a compiler that fails: every kernel call is counted as such
    try:
        monkeypatch.setenv("STRATA_CPU_KERNELS", "0")
        cpu_kernels.use(None)
        assert _counts("rms_norm", "disabled", lambda: cpu_kernels.rms_norm(x, w, 1e-6)) == 1
        monkeypatch.delenv("STRATA_CPU_KERNELS")
        monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
        monkeypatch.setenv("CC", "false")
        cpu_kernels.use(None)
        assert not cpu_kernels.available()
        assert _counts("rms_norm", "unavailable", lambda: cpu_kernels.rms_norm(x, w, 1e-6)) == 1
    finally:
        monkeypatch.undo()
        cpu_kernels.use(None)
    assert cpu_kernels.available()


def test_without_a_cpp_compiler_the_kernels_are_unavailable(tmp_path):
    """The torch ops the kernels are called through are built with the system C++ compiler at
    first use (or set-up): where that fails, in a fresh process with an empty cache, the
    kernels are unavailable, each call counted so, and nothing else breaks."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from prometheus_client import REGISTRY\n"
        "from shared.model import cpu_kernels as k\n"
        "assert k.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6) is None\n"
        "n = REGISTRY.get_sample_value('strata_kernel_fallback_total',"
        " {'op': 'rms_norm', 'reason': 'unavailable'})\n"
        "print(k.available(), k.off_reason(), n)\n"
    )
    env = {
        **os.environ,
        "STRATA_CACHE": str(tmp_path),
        "CXX": "false",
        "STRATA_CPU_ISA": "portable",
    }
    root = Path(__file__).parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "unavailable", "1.0"]
    assert "no torch ops for the portable variant" in done.stderr
    assert build_kernels.library_path("portable").name in {f.name for f in tmp_path.rglob("*.so")}


def test_auto_takes_the_next_variant_when_the_compiler_refuses_one(monkeypatch, tmp_path, capsys):
    """A compiler without the widest variant's target (an old gcc: ``-march=x86-64-v4`` before
    gcc 11, ``-mavx512bf16`` before gcc 10): the build step says so and goes on, and ``auto``
    loads the next narrower variant."""
    order = build_kernels.runnable()
    if len(order) < 2:
        pytest.skip(f"this CPU runs only {order}: no narrower variant to take")
    by_name = {v.name: v for v in build_kernels.variants()}
    widest, narrower = by_name[order[-1]], by_name[order[-2]]
    flag = next(f for f in widest.flags if f not in narrower.flags)  # the flag it alone needs
    cc = tmp_path / "cc"
    cc.write_text(
        f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "{flag}" ] && '
        f'{{ echo "cc: error: bad value for {flag}" >&2; exit 1; }}; done\nexec cc "$@"\n'
    )
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    try:
        assert build_kernels.main([widest.name, order[-2]]) == 0
        err = capsys.readouterr().err
        assert f"[kernels] {widest.name}: not built" in err and flag in err
        assert cpu_kernels.use(None) == order[-2]
        assert REGISTRY.get_sample_value("strata_kernel_isa", {"variant": order[-2]}) == 1
        assert build_kernels.main([widest.name]) == 1  # nothing this CPU runs was built
    finally:
        monkeypatch.undo()
        cpu_kernels.use(None)
    assert cpu_kernels.loaded_isa() == order[-1]
