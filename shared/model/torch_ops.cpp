// The native CPU kernels as torch custom ops, `torch.ops.strata.*` (torch_ops.py builds and
// loads this file): torch's dispatcher, schema checks and fake tensors see every kernel the
// model's forward calls, and no caller passes a raw pointer or mirrors a C struct.
//
// The kernels themselves stay in the C library of the ISA variant cpu_kernels loaded:
// `strata::bind` opens that library and looks every entry point of kernels.h up by name, so this
// file is built once per torch version, not once per variant, and the ops follow STRATA_CPU_ISA.
// Each op checks its tensors' dtypes, shapes and layouts with TORCH_CHECK before handing their
// addresses to the bound function; the decoder layer op fills kernels.h's strata_layer and
// strata_batch from its arguments. The kernels use torch's thread count (at::get_num_threads).
// bf16 tensors (weights, a bf16 KV cache) are handed over as their uint16_t bit patterns.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "kernels.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// The bound variant's entry points, each named and typed as kernels.h declares it.
#define STRATA_KERNELS(X)                                                                         \
    X(strata_kernel_isa)                                                                          \
    X(strata_decode_attn_f32)                                                                     \
    X(strata_decode_attn_bf16kv)                                                                  \
    X(strata_gemm_panel_width)                                                                    \
    X(strata_gemm_pack_f32)                                                                       \
    X(strata_gemm_f32)                                                                            \
    X(strata_prefill_attn_f32)                                                                    \
    X(strata_prefill_attn_bf16kv)                                                                 \
    X(strata_gemm_s8_packed_bytes)                                                                \
    X(strata_gemm_s8_pack)                                                                        \
    X(strata_gemm_s8_f32)                                                                         \
    X(strata_gemm_bf16_packed_numel)                                                              \
    X(strata_gemm_bf16_pack)                                                                      \
    X(strata_gemm_bf16_f32)                                                                       \
    X(strata_rms_norm_f32)                                                                        \
    X(strata_qk_norm_rope_f32)                                                                    \
    X(strata_layer_scratch)                                                                       \
    X(strata_decoder_layer_f32)

struct Kernels {
#define STRATA_FIELD(f) decltype(&::f) f = nullptr;
    STRATA_KERNELS(STRATA_FIELD)
#undef STRATA_FIELD
};
Kernels k;  // all null until strata::bind

const Kernels &kern(const char *op) {
    TORCH_CHECK(k.strata_kernel_isa, op, ": no kernels bound (cpu_kernels loads them)");
    return k;
}

// Open the variant library at `path` (kept open: weights packed for it may outlive a rebind,
// and cpu_kernels refuses those by generation) and bind every entry point; its ISA report.
std::string bind(std::string path) {
    void *lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(lib, "strata::bind: ", dlerror());
    Kernels n;
#define STRATA_BIND(f)                                                                            \
    n.f = reinterpret_cast<decltype(&::f)>(dlsym(lib, #f));                                       \
    TORCH_CHECK(n.f, "strata::bind: ", path, " has no ", #f);
    STRATA_KERNELS(STRATA_BIND)
#undef STRATA_BIND
    k = n;
    return k.strata_kernel_isa();
}

int64_t nthreads() { return at::get_num_threads(); }

// float32, on the CPU, contiguous
void check_f32(const Tensor &t, const char *op, const char *name) {
    TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " is not on the CPU");
    TORCH_CHECK(t.scalar_type() == at::kFloat, op, " takes float32 (", name, " is ",
                t.scalar_type(), ")");
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " is not contiguous");
}

// int64, on the CPU, contiguous, `dim` dimensions
void check_index(const Tensor &t, int64_t dim, const char *op, const char *name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(), op,
                ": ", name, " must be a contiguous int64 CPU tensor");
    TORCH_CHECK(t.dim() == dim, op, ": ", name, " has ", t.dim(), " dimensions, not ", dim);
}

// a float32 vector of n elements (or nothing), as a pointer
const float *vec(const OptTensor &t, int64_t n, const char *op, const char *name) {
    if (!t) return nullptr;
    check_f32(*t, op, name);
    TORCH_CHECK(t->numel() == n, op, ": ", name, " has ", t->numel(), " elements, not ", n);
    return t->data_ptr<float>();
}

// an [n_blocks, block_size, kv_heads, head_dim] cache layer: float32 or bfloat16 (the kernels
// widen a bf16 cache as they read it and round what they write to it), on the CPU, contiguous
void check_cache(const Tensor &c, int64_t kvh, int64_t d, const char *op, const char *name) {
    TORCH_CHECK(c.device().is_cpu() && c.is_contiguous(), op, ": ", name,
                " must be a contiguous CPU tensor");
    TORCH_CHECK(c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16, op,
                " takes a float32 or bfloat16 cache (", name, " is ", c.scalar_type(), ")");
    TORCH_CHECK(c.dim() == 4 && c.size(2) == kvh && c.size(3) == d, op, ": ", name, " of shape ",
                c.sizes(), " for ", kvh, " KV heads of ", d);
}

int64_t panel_width() { return kern("strata::gemm_panel_width").strata_gemm_panel_width(); }

int64_t int8_packed_bytes(int64_t n, int64_t kk) {
    TORCH_CHECK(n >= 0 && kk >= 0, "strata::int8_packed_bytes: negative size");
    return kern("strata::int8_packed_bytes").strata_gemm_s8_packed_bytes(n, kk);
}

int64_t bf16_packed_numel(int64_t n, int64_t kk) {
    TORCH_CHECK(n >= 0 && kk >= 0, "strata::bf16_packed_numel: negative size");
    return kern("strata::bf16_packed_numel").strata_gemm_bf16_packed_numel(n, kk);
}

// what a packed weight holds: float32 panels, an int8 blob (uint8) or bf16 pair panels; the
// dtype of its tensor says which
enum class Packing { F32, INT8, BF16 };

at::ScalarType packed_dtype(Packing kind) {
    return kind == Packing::INT8 ? at::kByte : kind == Packing::BF16 ? at::kBFloat16 : at::kFloat;
}

Packing packing_of(const Tensor &p) {
    return p.scalar_type() == at::kByte       ? Packing::INT8
           : p.scalar_type() == at::kBFloat16 ? Packing::BF16
                                              : Packing::F32;
}

// elements of a packed [n, kk] weight
int64_t packed_numel(Packing kind, int64_t n, int64_t kk) {
    if (kind == Packing::INT8) return int8_packed_bytes(n, kk);
    if (kind == Packing::BF16) return bf16_packed_numel(n, kk);
    const int64_t w = panel_width();
    return (n + w - 1) / w * w * kk;
}

// a packed weight for an [n, kk] product, of the kind `kind`
void check_packed(const Tensor &p, Packing kind, int64_t n, int64_t kk, const char *op,
                  const char *name) {
    TORCH_CHECK(p.device().is_cpu() && p.is_contiguous(), op, ": ", name,
                " must be a contiguous CPU tensor");
    const char *what = kind == Packing::INT8   ? "int8 (uint8)"
                       : kind == Packing::BF16 ? "bfloat16"
                                               : "float32";
    TORCH_CHECK(p.scalar_type() == packed_dtype(kind), op, ": ", name, " is ", p.scalar_type(),
                ", not a packed ", what, " weight");
    TORCH_CHECK(p.numel() == packed_numel(kind, n, kk), op, ": ", name, " has ", p.numel(),
                " elements, not those of a packed [", n, ", ", kk, "] weight");
}

Tensor rms_norm(const Tensor &x, const Tensor &weight, double eps) {
    const auto &kk = kern("strata::rms_norm");
    check_f32(x, "strata::rms_norm", "x");
    check_f32(weight, "strata::rms_norm", "weight");
    const int64_t d = x.dim() ? x.size(-1) : 0;
    TORCH_CHECK(weight.numel() == d, "strata::rms_norm: weight size ", weight.numel(),
                " for rows of ", d);
    Tensor y = at::empty_like(x);
    kk.strata_rms_norm_f32(x.data_ptr<float>(), nullptr, nullptr, weight.data_ptr<float>(),
                           (float)eps, d ? x.numel() / d : 0, d, y.data_ptr<float>(), nthreads());
    return y;
}

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor &x, const Tensor &residual,
                                        const Tensor &weight, double eps) {
    const char *op = "strata::add_rms_norm";
    const auto &kk = kern(op);
    check_f32(x, op, "x");
    check_f32(residual, op, "residual");
    check_f32(weight, op, "weight");
    TORCH_CHECK(residual.sizes() == x.sizes(), op, ": residual of shape ", residual.sizes(),
                " for x of ", x.sizes());
    const int64_t d = x.dim() ? x.size(-1) : 0;
    TORCH_CHECK(weight.numel() == d, op, ": weight size ", weight.numel(), " for rows of ", d);
    Tensor h = at::empty_like(x), y = at::empty_like(x);
    kk.strata_rms_norm_f32(x.data_ptr<float>(), residual.data_ptr<float>(), h.data_ptr<float>(),
                           weight.data_ptr<float>(), (float)eps, d ? x.numel() / d : 0, d,
                           y.data_ptr<float>(), nthreads());
    return {h, y};
}

void qk_norm_rope_(const Tensor &qkv, int64_t heads, int64_t num_q, const OptTensor &q_weight,
                   const OptTensor &k_weight, double eps, const Tensor &cos, const Tensor &sin) {
    const char *op = "strata::qk_norm_rope_";
    const auto &kk = kern(op);
    check_f32(qkv, op, "qkv");
    TORCH_CHECK(qkv.dim() == 3, op, ": qkv of shape ", qkv.sizes(), ", not [T, heads, D]");
    const int64_t t = qkv.size(0), d = qkv.size(2);
    TORCH_CHECK(d % 2 == 0, op, ": rotate-half RoPE takes an even head size, not ", d);
    TORCH_CHECK(0 <= num_q && num_q <= heads && heads <= qkv.size(1), op, ": ", num_q, " of ",
                heads, " heads normed and rotated out of ", qkv.size(1));
    TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), op,
                ": q_weight and k_weight come together");
    check_f32(cos, op, "cos");
    check_f32(sin, op, "sin");
    const bool rows = cos.dim() == 2 && cos.size(0) == t && cos.size(1) == d;
    TORCH_CHECK(rows && sin.sizes() == cos.sizes(), op, ": cos/sin of shape ", cos.sizes(),
                " for ", t, " rows of head size ", d);
    kk.strata_qk_norm_rope_f32(qkv.data_ptr<float>(), t, qkv.stride(0), heads, num_q, d,
                               vec(q_weight, d, op, "q_weight"), vec(k_weight, d, op, "k_weight"),
                               (float)eps, cos.data_ptr<float>(), sin.data_ptr<float>(),
                               nthreads());
}

Tensor decode_attention(const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                        const Tensor &block_tables, const Tensor &context_lens, double scale,
                        const OptTensor &sinks) {
    const char *op = "strata::decode_attention";
    const auto &kk = kern(op);
    check_f32(q, op, "q");
    TORCH_CHECK(q.dim() == 3, op, ": q of shape ", q.sizes(), ", not [B, H, D]");
    const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
    TORCH_CHECK(k_cache.dim() == 4, op, ": k_cache of shape ", k_cache.sizes());
    const int64_t kvh = k_cache.size(2);
    check_cache(k_cache, kvh, d, op, "k_cache");
    check_cache(v_cache, kvh, d, op, "v_cache");
    TORCH_CHECK(v_cache.sizes() == k_cache.sizes() &&
                    v_cache.scalar_type() == k_cache.scalar_type(),
                op, ": v_cache and k_cache differ in shape or dtype");
    TORCH_CHECK(kvh > 0 && h % kvh == 0, op, ": ", h, " heads over ", kvh, " KV heads");
    check_index(block_tables, 2, op, "block_tables");
    check_index(context_lens, 1, op, "context_lens");
    TORCH_CHECK(block_tables.size(0) == b && context_lens.size(0) == b, op,
                ": tables/lengths for ", block_tables.size(0), "/", context_lens.size(0),
                " sequences, not ", b);
    const float *sk = vec(sinks, h, op, "sinks");  // one logit per query head, or none
    Tensor out = at::empty_like(q);
    const int64_t *tab = block_tables.data_ptr<int64_t>(), *ctx = context_lens.data_ptr<int64_t>();
    if (k_cache.scalar_type() == at::kFloat) {
        kk.strata_decode_attn_f32(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                                  v_cache.data_ptr<float>(), tab, ctx, block_tables.size(1), b, h,
                                  kvh, d, k_cache.size(1), (float)scale, sk,
                                  out.data_ptr<float>(), nthreads());
        return out;
    }
    const int64_t rc = kk.strata_decode_attn_bf16kv(
        q.data_ptr<float>(), static_cast<const uint16_t *>(k_cache.data_ptr()),
        static_cast<const uint16_t *>(v_cache.data_ptr()), tab, ctx, block_tables.size(1), b, h,
        kvh, d, k_cache.size(1), (float)scale, sk, out.data_ptr<float>(), nthreads());
    TORCH_CHECK_WITH(OutOfMemoryError, rc == 0, op, ": no memory for the bf16 cache's copy");
    return out;
}

void prefill_attention_(const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                        const Tensor &tables, const Tensor &ctx, const Tensor &qstart,
                        const Tensor &qlen, double scale, const Tensor &out,
                        const OptTensor &sinks) {
    const char *op = "strata::prefill_attention_";
    const auto &kk = kern(op);
    for (const auto *t : {&q, &out}) {
        TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, op,
                    " takes float32 CPU q and out");
        TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2), op,
                    ": q and out must be [T, H, D] with contiguous heads");
    }
    TORCH_CHECK(out.sizes() == q.sizes(), op, ": out of shape ", out.sizes(), " for q of ",
                q.sizes());
    const int64_t h = q.size(1), d = q.size(2);
    TORCH_CHECK(k_cache.dim() == 4, op, ": k_cache of shape ", k_cache.sizes());
    const int64_t kvh = k_cache.size(2);
    check_cache(k_cache, kvh, d, op, "k_cache");
    check_cache(v_cache, kvh, d, op, "v_cache");
    TORCH_CHECK(v_cache.sizes() == k_cache.sizes() &&
                    v_cache.scalar_type() == k_cache.scalar_type(),
                op, ": v_cache and k_cache differ in shape or dtype");
    check_index(tables, 2, op, "tables");
    const int64_t s = tables.size(0);
    for (const auto *t : {&ctx, &qstart, &qlen}) {
        check_index(*t, 1, op, "ctx/qstart/qlen");
        TORCH_CHECK(t->size(0) == s, op, ": ctx/qstart/qlen for ", t->size(0), " sequences, not ",
                    s);
    }
    const float *sk = vec(sinks, h, op, "sinks");  // one logit per query head, or none
    const int64_t *tab = tables.data_ptr<int64_t>(), *cx = ctx.data_ptr<int64_t>();
    const int64_t *qs = qstart.data_ptr<int64_t>(), *ql = qlen.data_ptr<int64_t>();
    const int64_t rc =
        k_cache.scalar_type() == at::kFloat
            ? kk.strata_prefill_attn_f32(q.data_ptr<float>(), q.stride(0),
                                         k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                                         tab, cx, qs, ql, s, tables.size(1), h, kvh, d,
                                         k_cache.size(1), (float)scale, sk,
                                         out.data_ptr<float>(), out.stride(0), nthreads())
            : kk.strata_prefill_attn_bf16kv(
                  q.data_ptr<float>(), q.stride(0),
                  static_cast<const uint16_t *>(k_cache.data_ptr()),
                  static_cast<const uint16_t *>(v_cache.data_ptr()), tab, cx, qs, ql, s,
                  tables.size(1), h, kvh, d, k_cache.size(1), (float)scale, sk,
                  out.data_ptr<float>(), out.stride(0), nthreads());
    TORCH_CHECK(rc == 0, op, ": refused (nothing written): head size ", d, " or ", h, "/", kvh,
                " heads it does not take, or a sequence with more new tokens than context");
}

Tensor pack_linear(const Tensor &w) {
    const char *op = "strata::pack_linear";
    const auto &kk = kern(op);
    check_f32(w, op, "w");
    TORCH_CHECK(w.dim() == 2, op, ": w of shape ", w.sizes(), ", not [N, K]");
    Tensor p = at::empty({packed_numel(Packing::F32, w.size(0), w.size(1))}, w.options());
    kk.strata_gemm_pack_f32(w.data_ptr<float>(), w.size(0), w.size(1), p.data_ptr<float>());
    return p;
}

// the rows of x [M, K] and the bias of a product by a packed [n, K] weight
void check_product(const Tensor &x, const Tensor &packed, Packing kind, int64_t n,
                   const OptTensor &bias, const char *op) {
    check_f32(x, op, "x");
    TORCH_CHECK(x.dim() == 2, op, ": x of shape ", x.sizes(), ", not [M, K]");
    check_packed(packed, kind, n, x.size(1), op, "packed");
    vec(bias, n, op, "bias");
}

Tensor linear(const Tensor &x, const Tensor &packed, int64_t n, const OptTensor &bias) {
    const char *op = "strata::linear";
    const auto &kk = kern(op);
    check_product(x, packed, Packing::F32, n, bias, op);
    Tensor y = at::empty({x.size(0), n}, x.options());
    kk.strata_gemm_f32(x.data_ptr<float>(), x.size(0), x.size(1), packed.data_ptr<float>(), n,
                       bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), nthreads());
    return y;
}

Tensor pack_int8(const Tensor &w, const Tensor &scale) {
    const char *op = "strata::pack_int8";
    const auto &kk = kern(op);
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kChar && w.is_contiguous() &&
                    w.dim() == 2,
                op, ": w must be a contiguous [N, K] int8 CPU tensor");
    const int64_t n = w.size(0), kdim = w.size(1);
    vec(scale, n, op, "scale");
    Tensor p = at::empty({int8_packed_bytes(n, kdim)}, w.options().dtype(at::kByte));
    kk.strata_gemm_s8_pack(w.data_ptr<int8_t>(), scale.data_ptr<float>(), n, kdim,
                           p.data_ptr<uint8_t>());
    return p;
}

Tensor linear_int8(const Tensor &x, const Tensor &packed, int64_t n, const OptTensor &bias) {
    const char *op = "strata::linear_int8";
    const auto &kk = kern(op);
    check_product(x, packed, Packing::INT8, n, bias, op);
    TORCH_CHECK(x.size(1) <= 65536, op, ": ", x.size(1), " inputs, past the exact int32 sums");
    Tensor y = at::empty({x.size(0), n}, x.options());
    const int64_t rc = kk.strata_gemm_s8_f32(x.data_ptr<float>(), x.size(0), x.size(1),
                                             packed.data_ptr(), n,
                                             bias ? bias->data_ptr<float>() : nullptr,
                                             y.data_ptr<float>(), nthreads());
    TORCH_CHECK_WITH(OutOfMemoryError, rc == 0, op, ": no memory for the quantised rows");
    return y;
}

Tensor pack_bf16(const Tensor &w) {
    const char *op = "strata::pack_bf16";
    const auto &kk = kern(op);
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
                    w.dim() == 2,
                op, ": w must be a contiguous [N, K] bfloat16 CPU tensor");
    const int64_t n = w.size(0), kdim = w.size(1);
    Tensor p = at::empty({bf16_packed_numel(n, kdim)}, w.options());
    kk.strata_gemm_bf16_pack(reinterpret_cast<const uint16_t *>(w.data_ptr()), n, kdim,
                             reinterpret_cast<uint16_t *>(p.data_ptr()));
    return p;
}

Tensor linear_bf16(const Tensor &x, const Tensor &packed, int64_t n, const OptTensor &bias,
                   int64_t dot_rows) {
    const char *op = "strata::linear_bf16";
    const auto &kk = kern(op);
    check_product(x, packed, Packing::BF16, n, bias, op);
    Tensor y = at::empty({x.size(0), n}, x.options());
    const int64_t rc = kk.strata_gemm_bf16_f32(
        x.data_ptr<float>(), x.size(0), x.size(1),
        reinterpret_cast<const uint16_t *>(packed.data_ptr()), n,
        bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), dot_rows, nthreads());
    TORCH_CHECK_WITH(OutOfMemoryError, rc == 0, op, ": no memory for the bf16 rows");
    return y;
}

// strata_layer with only its shapes set: what strata_layer_scratch reads
strata_layer layer_shape(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t inter) {
    strata_layer l{};
    l.hidden = hidden, l.heads = heads, l.kv_heads = kv_heads, l.head_dim = head_dim;
    l.inter = inter;
    return l;
}

int64_t layer_scratch(int64_t tokens, int64_t decodes, int64_t hidden, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t inter) {
    const strata_layer l = layer_shape(hidden, heads, kv_heads, head_dim, inter);
    return kern("strata::layer_scratch").strata_layer_scratch(&l, tokens, decodes);
}

const int64_t *index_or_null(const OptTensor &t, int64_t dim, int64_t rows, const char *op,
                             const char *name) {
    if (!t) return nullptr;
    check_index(*t, dim, op, name);
    TORCH_CHECK(t->size(0) == rows, op, ": ", name, " has ", t->size(0), " rows, not ", rows);
    return t->data_ptr<int64_t>();
}

void decoder_layer_(const Tensor &h, const Tensor &k_cache, const Tensor &v_cache,
                    const Tensor &scratch, const Tensor &ln1_w, double ln1_eps,
                    const Tensor &qkv_p, const OptTensor &qkv_b, const OptTensor &qn_w,
                    const OptTensor &kn_w, double qk_eps, const Tensor &o_p, const OptTensor &o_b,
                    const Tensor &ln2_w, double ln2_eps, const Tensor &gu_p,
                    const OptTensor &gu_b, const Tensor &down_p, const OptTensor &down_b,
                    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                    double scale, int64_t dot_rows, const Tensor &cos, const Tensor &sin,
                    const Tensor &slots,
                    const OptTensor &p_tables, const OptTensor &p_ctx, const OptTensor &p_qstart,
                    const OptTensor &p_qlen, const OptTensor &d_tables, const OptTensor &d_ctx,
                    const OptTensor &d_rows) {
    const char *op = "strata::decoder_layer_";
    const auto &kk = kern(op);
    check_f32(h, op, "h");
    TORCH_CHECK(h.dim() == 2, op, ": h of shape ", h.sizes(), ", not [T, hidden]");
    const int64_t t = h.size(0), hidden = h.size(1), att = heads * head_dim;
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && inter > 0,
                op, ": ", heads, " heads over ", kv_heads, " KV heads of ", head_dim,
                ", intermediate size ", inter);
    check_cache(k_cache, kv_heads, head_dim, op, "k_cache");
    check_cache(v_cache, kv_heads, head_dim, op, "v_cache");
    TORCH_CHECK(v_cache.sizes() == k_cache.sizes() &&
                    v_cache.scalar_type() == k_cache.scalar_type(),
                op, ": v_cache and k_cache differ in shape or dtype");

    strata_layer l = layer_shape(hidden, heads, kv_heads, head_dim, inter);
    const Packing kind = packing_of(qkv_p);
    const int64_t ld = att + 2 * kv_heads * head_dim;
    check_packed(qkv_p, kind, ld, hidden, op, "qkv_p");
    check_packed(o_p, kind, hidden, att, op, "o_p");
    check_packed(gu_p, kind, 2 * inter, hidden, op, "gu_p");
    check_packed(down_p, kind, hidden, inter, op, "down_p");
    TORCH_CHECK(qn_w.has_value() == kn_w.has_value(), op, ": qn_w and kn_w come together");
    l.ln1_w = vec(ln1_w, hidden, op, "ln1_w"), l.ln2_w = vec(ln2_w, hidden, op, "ln2_w");
    l.qkv_p = qkv_p.data_ptr(), l.qkv_b = vec(qkv_b, ld, op, "qkv_b");
    l.qn_w = vec(qn_w, head_dim, op, "qn_w"), l.kn_w = vec(kn_w, head_dim, op, "kn_w");
    l.o_p = o_p.data_ptr(), l.o_b = vec(o_b, hidden, op, "o_b");
    l.gu_p = gu_p.data_ptr(), l.gu_b = vec(gu_b, 2 * inter, op, "gu_b");
    l.down_p = down_p.data_ptr(), l.down_b = vec(down_b, hidden, op, "down_b");
    l.wtype = kind == Packing::INT8   ? STRATA_W_INT8
              : kind == Packing::BF16 ? STRATA_W_BF16
                                      : STRATA_W_F32;
    l.dot_rows = dot_rows;
    l.ln1_eps = ln1_eps, l.qk_eps = qk_eps, l.ln2_eps = ln2_eps, l.scale = scale;

    strata_batch b{};
    b.T = t, b.block_size = k_cache.size(1), b.nthreads = nthreads();
    b.kv_bf16 = k_cache.scalar_type() == at::kBFloat16;
    b.cos_ = vec(cos, t * head_dim, op, "cos"), b.sin_ = vec(sin, t * head_dim, op, "sin");
    b.slots = index_or_null(slots, 1, t, op, "slots");
    TORCH_CHECK(p_tables.has_value() == p_ctx.has_value() &&
                    p_ctx.has_value() == p_qstart.has_value() &&
                    p_qstart.has_value() == p_qlen.has_value(),
                op, ": p_tables, p_ctx, p_qstart and p_qlen come together");
    if (p_tables) {
        const int64_t w = panel_width();
        TORCH_CHECK(head_dim >= w && head_dim % w == 0, op, ": the prefill kernel takes head ",
                    "sizes of whole panels of ", w, ", not ", head_dim);
        b.p_n = p_tables->dim() ? p_tables->size(0) : 0;
        b.p_tables = index_or_null(p_tables, 2, b.p_n, op, "p_tables");
        b.p_max_blocks = p_tables->size(1);
        b.p_ctx = index_or_null(p_ctx, 1, b.p_n, op, "p_ctx");
        b.p_qstart = index_or_null(p_qstart, 1, b.p_n, op, "p_qstart");
        b.p_qlen = index_or_null(p_qlen, 1, b.p_n, op, "p_qlen");
    }
    TORCH_CHECK(d_tables.has_value() == d_ctx.has_value(), op,
                ": d_tables and d_ctx come together");
    TORCH_CHECK(d_tables || !d_rows, op, ": d_rows without decodes");
    if (d_tables) {
        b.d_n = d_ctx->dim() ? d_ctx->size(0) : 0;
        b.d_tables = index_or_null(d_tables, 2, b.d_n, op, "d_tables");
        b.d_max_blocks = d_tables->size(1);
        b.d_ctx = index_or_null(d_ctx, 1, b.d_n, op, "d_ctx");
        b.d_rows = index_or_null(d_rows, 1, b.d_n, op, "d_rows");
        TORCH_CHECK(d_rows || b.d_n == t, op, ": ", b.d_n, " decodes of ", t,
                    " rows without d_rows");
    }
    check_f32(scratch, op, "scratch");
    const int64_t need = kk.strata_layer_scratch(&l, t, b.d_n);
    TORCH_CHECK(scratch.numel() >= need, op, ": scratch of ", scratch.numel(), " floats, not ",
                need);
    b.scratch = scratch.data_ptr<float>();

    const int64_t rc = kk.strata_decoder_layer_f32(&l, &b, h.data_ptr<float>(),
                                                   k_cache.data_ptr(), v_cache.data_ptr());
    TORCH_CHECK_WITH(OutOfMemoryError, rc != -2, op,
                     ": no memory for the int8 / bf16 GEMM's rows or the bf16 cache's copy");
    TORCH_CHECK(rc == 0, op, ": the prefill kernel refused the batch (a sequence with more new ",
                "tokens than context)");
}

}  // namespace

TORCH_LIBRARY(strata, m) {
    // the kernels' own queries: no tensors, so one kernel for every dispatch key
    m.def("bind(str path) -> str", &bind);
    m.def("gemm_panel_width() -> int", &panel_width);
    m.def("int8_packed_bytes(int n, int k) -> int", &int8_packed_bytes);
    m.def("bf16_packed_numel(int n, int k) -> int", &bf16_packed_numel);
    m.def("layer_scratch(int tokens, int decodes, int hidden, int heads, int kv_heads, "
          "int head_dim, int inter) -> int",
          &layer_scratch);
    // the kernels
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
    m.def("qk_norm_rope_(Tensor(a!) qkv, int heads, int num_q, Tensor? q_weight, "
          "Tensor? k_weight, float eps, Tensor cos, Tensor sin) -> ()");
    m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
          "Tensor context_lens, float scale, Tensor? sinks=None) -> Tensor");
    m.def("prefill_attention_(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
          "Tensor ctx, Tensor qstart, Tensor qlen, float scale, Tensor(a!) out, "
          "Tensor? sinks=None) -> ()");
    m.def("pack_linear(Tensor w) -> Tensor");
    m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
    m.def("pack_int8(Tensor w, Tensor scale) -> Tensor");
    m.def("linear_int8(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
    m.def("pack_bf16(Tensor w) -> Tensor");
    m.def("linear_bf16(Tensor x, Tensor packed, int n, Tensor? bias, int dot_rows) -> Tensor");
    m.def("decoder_layer_(Tensor(a!) h, Tensor(b!) k_cache, Tensor(c!) v_cache, "
          "Tensor(d!) scratch, Tensor ln1_w, float ln1_eps, Tensor qkv_p, Tensor? qkv_b, "
          "Tensor? qn_w, Tensor? kn_w, float qk_eps, Tensor o_p, Tensor? o_b, Tensor ln2_w, "
          "float ln2_eps, Tensor gu_p, Tensor? gu_b, Tensor down_p, Tensor? down_b, int heads, "
          "int kv_heads, int head_dim, int inter, float scale, int dot_rows, Tensor cos, "
          "Tensor sin, Tensor slots, Tensor? p_tables, Tensor? p_ctx, Tensor? p_qstart, "
          "Tensor? p_qlen, Tensor? d_tables, Tensor? d_ctx, Tensor? d_rows) -> ()");
}

TORCH_LIBRARY_IMPL(strata, CPU, m) {
    m.impl("rms_norm", &rms_norm);
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("qk_norm_rope_", &qk_norm_rope_);
    m.impl("decode_attention", &decode_attention);
    m.impl("prefill_attention_", &prefill_attention_);
    m.impl("pack_linear", &pack_linear);
    m.impl("linear", &linear);
    m.impl("pack_int8", &pack_int8);
    m.impl("linear_int8", &linear_int8);
    m.impl("pack_bf16", &pack_bf16);
    m.impl("linear_bf16", &linear_bf16);
    m.impl("decoder_layer_", &decoder_layer_);
}

// Inference kernels, no gradient: past the autograd keys untouched, so their outputs never
// require grad (a weight that does, an nn.Parameter, gives no autograd graph or warning).
TORCH_LIBRARY_IMPL(strata, Autograd, m) {
    for (const char *op : {"rms_norm", "add_rms_norm", "qk_norm_rope_", "decode_attention",
                           "prefill_attention_", "pack_linear", "linear", "pack_int8",
                           "linear_int8", "pack_bf16", "linear_bf16", "decoder_layer_"})
        m.impl(op, torch::CppFunction::makeFallthrough());
}
