"""``torch.ops.strata.rms_norm`` (`shared.model.torch_ops`, a torch.library custom op over the
native RMSNorm): bound to each ISA variant this CPU runs, equal to the torch path, passing
torch's own op checks (schema, fake tensors, AOT dispatch), refusing bad input by name."""

from __future__ import annotations

import pytest
import torch

from shared.model import cpu_kernels, torch_ops

pytestmark = pytest.mark.usefixtures("kernel_isa")  # every test once per ISA variant


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape", [(1, 64), (7, 3, 100), (33, 2048)])
def test_the_op_runs_the_loaded_variant_and_matches_torch(kernel_isa, shape):
    assert torch_ops.load() == kernel_isa == cpu_kernels.loaded_isa()
    torch.manual_seed(shape[-1])
    x, w = torch.randn(shape), torch.randn(shape[-1])
    got = torch.ops.strata.rms_norm(x, w, 1e-6, 2)
    torch.testing.assert_close(got, _reference(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    # the same bits as the ctypes path the engine calls (one kernel behind both)
    assert torch.equal(got, cpu_kernels.rms_norm(x, w, 1e-6)[1])


def test_torch_op_checks(kernel_isa):
    torch_ops.load()
    x, w = torch.randn(4, 48), torch.randn(48)
    torch.library.opcheck(torch.ops.strata.rms_norm.default, (x, w, 1e-5))


def test_bad_input_is_refused_by_name(kernel_isa):
    torch_ops.load()
    with pytest.raises(RuntimeError, match="strata::rms_norm takes float32"):
        torch.ops.strata.rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="weight size 7 for rows of 8"):
        torch.ops.strata.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)


def test_the_op_source_is_package_data():
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(torch_ops.__file__).parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["shared.model"]
    assert torch_ops.SOURCE.exists()
    assert any(fnmatch.fnmatch(torch_ops.SOURCE.name, p) for p in patterns)
