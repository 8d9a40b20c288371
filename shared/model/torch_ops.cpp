// The native RMSNorm as a torch custom op, `torch.ops.strata.rms_norm` (torch_ops.py builds and
// loads this file): the first kernel registered with torch.library instead of called through
// ctypes, so torch's dispatcher, schema checks and fake tensors see it. The kernel itself is
// the one in fused.c of the ISA variant cpu_kernels loaded; torch_ops.py hands its address to
// strata_ops_bind, so this library is built once per torch, not once per variant.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>

using rms_norm_fn = void (*)(const float *, const float *, float *, const float *, float,
                             int64_t, int64_t, float *, int64_t);
static rms_norm_fn g_rms_norm = nullptr;

extern "C" void strata_ops_bind(void *rms_norm) { g_rms_norm = (rms_norm_fn)rms_norm; }

static at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps,
                           int64_t nthreads) {
    TORCH_CHECK(g_rms_norm, "strata::rms_norm: no kernel bound (torch_ops.load)");
    TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
                "strata::rms_norm takes float32");
    TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "strata::rms_norm: not contiguous");
    const int64_t d = x.dim() ? x.size(-1) : 0;
    TORCH_CHECK(weight.numel() == d, "strata::rms_norm: weight size ", weight.numel(),
                " for rows of ", d);
    at::Tensor y = at::empty_like(x);
    g_rms_norm(x.data_ptr<float>(), nullptr, nullptr, weight.data_ptr<float>(), (float)eps,
               d ? x.numel() / d : 0, d, y.data_ptr<float>(), nthreads);
    return y;
}

TORCH_LIBRARY(strata, m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps, int nthreads=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(strata, CPU, m) { m.impl("rms_norm", &rms_norm); }
