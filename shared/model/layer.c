/* A whole Llama-family decoder layer in one call: built and loaded by cpu_kernels.py with the
 * GEMM, attention and row-wise kernels it strings together.
 *
 * Between the kernels the torch path ran ~30 small ops per layer (views, the fused projections'
 * slices, two index_copy_ KV writes, SiLU and the gate product, the residual adds) and the
 * Python around them: 4.9 ms of an 18.7 ms decode step of the benchmark model (16 sequences x
 * 256 context, docs/benchmarks/engine.md). Here the layer is
 *
 *     x = rmsnorm(h);  qkv = x Wqkv^T (+b);  q/k norm + RoPE in place;  K/V -> their slots;
 *     a = attention(q, cache);  h += a Wo^T (+b);  x = rmsnorm(h);  gu = x Wgu^T (+b);
 *     h += (silu(g) * u) Wdown^T (+b)
 *
 * with the same kernels the torch path calls (strata_gemm_f32, or strata_gemm_s8_f32 for an int8
 * layer, strata_rms_norm_f32, strata_qk_norm_rope_f32, strata_prefill_attn_f32,
 * strata_decode_attn_f32), so every result but SiLU is bit-identical to it; SiLU's e^x is
 * exp2_poly.h's polynomial (relative error <= 3e-7 for |x| <= 5, ~4e-6 at 87) where torch uses
 * Sleef's.
 *
 * A bf16 model's layer (wtype STRATA_W_BF16: strata_gemm_bf16_f32 projections) runs the same
 * float32 arithmetic between its GEMMs: h, the norms, RoPE, attention's scores and sums and SiLU
 * in float32. Its KV cache stays bf16 (kv_bf16): the new K/V rows are rounded to bf16 as they
 * are written (nearest even, as torch's .to(bfloat16)), and the attention kernels widen them
 * back exactly (strata_prefill_attn_bf16kv, strata_decode_attn_bf16kv). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp2_poly.h"
#include "kernels.h" /* the kernels it strings together, strata_layer and strata_batch */

#define PAR_MIN 65536 /* elements below which one thread does a row-wise loop */

int64_t strata_layer_scratch(const strata_layer *L, int64_t T, int64_t d_n) {
    const int64_t qkv = (L->heads + 2 * L->kv_heads) * L->head_dim, att = L->heads * L->head_dim;
    return T * (2 * L->hidden + qkv + att + 3 * L->inter) + 2 * d_n * att;
}

typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t vi8 __attribute__((vector_size(8 * sizeof(int32_t))));

#define V8_FMA(a, b, c) ((a) * (b) + (c))
#define V8_SET1(c) ((v8){0} + (c))

/* e^x for x in [-87, 87]: 2^i * 2^f, i = rint(x log2 e), f in [-1/2, 1/2]. */
static inline v8 exp8(v8 x) {
    const v8 t = x * STRATA_LOG2E;
    const v8 r = (t + 12582912.f) - 12582912.f; /* rint for |t| < 2^22 (1.5 * 2^23 trick) */
    const v8 f = t - r;
    const vi8 e = (__builtin_convertvector(r, vi8) + 127) << 23;
    v8 s;
    memcpy(&s, &e, sizeof s);
    return STRATA_EXP2_POLY(f, V8_FMA, V8_SET1) * s;
}

/* SiLU like torch's, x / (1 + e^-x), with e^-x clamped to e^+-87 (beyond, the quotient is x or
 * ~0 in float32 all the same). */
static inline v8 select8(vi8 m, v8 a, v8 b) { /* a where m, else b */
    return (v8)(((vi8)a & m) | ((vi8)b & ~m));
}

static inline v8 silu8(v8 x) {
    v8 n = -x;
    n = select8(n < -87.f, V8_SET1(-87.f), n);
    n = select8(n > 87.f, V8_SET1(87.f), n);
    return x / (1.f + exp8(n));
}

/* act[t, j] = silu(gu[t, j]) * gu[t, I + j] */
static void silu_mul(const float *gu, int64_t T, int64_t I, float *act, int64_t nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T * I >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *a = act + t * I;
        int64_t j = 0;
        for (; j + 8 <= I; j += 8) {
            v8 gv, uv;
            memcpy(&gv, g + j, sizeof gv);
            memcpy(&uv, u + j, sizeof uv);
            const v8 y = silu8(gv) * uv;
            memcpy(a + j, &y, sizeof y);
        }
        if (j < I) { /* the tail through a zero-padded vector */
            v8 gv = {0}, uv = {0};
            memcpy(&gv, g + j, sizeof(float) * (size_t)(I - j));
            memcpy(&uv, u + j, sizeof(float) * (size_t)(I - j));
            const v8 y = silu8(gv) * uv;
            memcpy(a + j, &y, sizeof(float) * (size_t)(I - j));
        }
    }
}

/* y = x p^T (+ b) on the layer's float32, int8 or bf16 GEMM; nonzero when the int8 or bf16
 * one had no memory for its rows. */
static int64_t proj(const strata_layer *L, const float *x, int64_t M, int64_t K, const void *p,
                    int64_t N, const float *b, float *y, int64_t nt) {
    if (L->wtype == STRATA_W_INT8) return strata_gemm_s8_f32(x, M, K, p, N, b, y, nt);
    if (L->wtype == STRATA_W_BF16)
        return strata_gemm_bf16_f32(x, M, K, (const uint16_t *)p, N, b, y, L->dot_rows, nt);
    strata_gemm_f32(x, M, K, (const float *)p, N, b, y, nt);
    return 0;
}

/* Row t's K and V (tok floats each, at kv and kv + tok) into cache slot s. */
static void write_kv(const strata_batch *B, const float *kv, int64_t tok, int64_t s,
                     void *k_cache, void *v_cache) {
    if (!B->kv_bf16) {
        memcpy((float *)k_cache + s * tok, kv, sizeof(float) * (size_t)tok);
        memcpy((float *)v_cache + s * tok, kv + tok, sizeof(float) * (size_t)tok);
        return;
    }
    uint16_t *kd = (uint16_t *)k_cache + s * tok, *vd = (uint16_t *)v_cache + s * tok;
    for (int64_t e = 0; e < tok; e++) kd[e] = strata_f32_to_bf16(kv[e]);
    for (int64_t e = 0; e < tok; e++) vd[e] = strata_f32_to_bf16(kv[tok + e]);
}

/* h: [T, hidden], updated in place; k_cache, v_cache: this layer's [blocks, block_size,
 * kv_heads, head_dim], float32 or (kv_bf16) bfloat16. Returns 0, or -1 when the prefill kernel
 * refused the head layout (the caller checks that first: then nothing is half done), or -2 when
 * an int8 or bf16 GEMM or the bf16 cache's decode attention had no memory for its copies. */
int64_t strata_decoder_layer_f32(const strata_layer *L, const strata_batch *B, float *h,
                                 void *k_cache, void *v_cache) {
    const int64_t T = B->T, Hd = L->hidden, D = L->head_dim, nh = L->heads, nkv = L->kv_heads;
    const int64_t I = L->inter, nt = B->nthreads, att = nh * D, ld = (nh + 2 * nkv) * D;
    float *x = B->scratch, *qkv = x + T * Hd, *a = qkv + T * ld, *tmp = a + T * att;
    float *gu = tmp + T * Hd, *act = gu + T * 2 * I, *dq = act + T * I, *dout = dq + B->d_n * att;

    strata_rms_norm_f32(h, 0, 0, L->ln1_w, (float)L->ln1_eps, T, Hd, x, nt);
    if (proj(L, x, T, Hd, L->qkv_p, ld, L->qkv_b, qkv, nt)) return -2;
    strata_qk_norm_rope_f32(qkv, T, ld, nh + nkv, nh, D, L->qn_w, L->kn_w, (float)L->qk_eps,
                            B->cos_, B->sin_, nt);
    const int64_t tok = nkv * D;
    for (int64_t t = 0; t < T; t++)
        write_kv(B, qkv + t * ld + att, tok, B->slots[t], k_cache, v_cache);
    if (B->p_n) {
        const int64_t rc =
            B->kv_bf16
                ? strata_prefill_attn_bf16kv(qkv, ld, k_cache, v_cache, B->p_tables, B->p_ctx,
                                             B->p_qstart, B->p_qlen, B->p_n, B->p_max_blocks, nh,
                                             nkv, D, B->block_size, (float)L->scale, NULL, a, att,
                                             nt)
                : strata_prefill_attn_f32(qkv, ld, k_cache, v_cache, B->p_tables, B->p_ctx,
                                          B->p_qstart, B->p_qlen, B->p_n, B->p_max_blocks, nh,
                                          nkv, D, B->block_size, (float)L->scale, NULL, a, att,
                                          nt);
        if (rc) return -1;
    }
    if (B->d_n) {
        for (int64_t i = 0; i < B->d_n; i++) /* q rows, contiguous */
            memcpy(dq + i * att, qkv + (B->d_rows ? B->d_rows[i] : i) * ld,
                   sizeof(float) * (size_t)att);
        float *o = B->d_rows ? dout : a;
        if (!B->kv_bf16)
            strata_decode_attn_f32(dq, k_cache, v_cache, B->d_tables, B->d_ctx, B->d_max_blocks,
                                   B->d_n, nh, nkv, D, B->block_size, (float)L->scale, NULL, o,
                                   nt);
        else if (strata_decode_attn_bf16kv(dq, k_cache, v_cache, B->d_tables, B->d_ctx,
                                           B->d_max_blocks, B->d_n, nh, nkv, D, B->block_size,
                                           (float)L->scale, NULL, o, nt))
            return -2;
        if (B->d_rows)
            for (int64_t i = 0; i < B->d_n; i++)
                memcpy(a + B->d_rows[i] * att, dout + i * att, sizeof(float) * (size_t)att);
    }
    if (proj(L, a, T, att, L->o_p, Hd, L->o_b, tmp, nt)) return -2;
    strata_rms_norm_f32(h, tmp, h, L->ln2_w, (float)L->ln2_eps, T, Hd, x, nt);
    if (proj(L, x, T, Hd, L->gu_p, 2 * I, L->gu_b, gu, nt)) return -2;
    silu_mul(gu, T, I, act, nt);
    if (proj(L, act, T, I, L->down_p, Hd, L->down_b, tmp, nt)) return -2;
    for (int64_t i = 0; i < T * Hd; i++) h[i] += tmp[i];
    return 0;
}
