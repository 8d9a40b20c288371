/* Fused row-wise float32 ops of the decoder layer, built and loaded by cpu_kernels.py beside
 * the GEMM and attention kernels.
 *
 * A decode step runs each of these on a few rows per layer; as torch ops each is 8-20 small
 * calls (float(), pow, mean, add, rsqrt, mul, slices, RoPE's halves), whose dispatch cost more
 * than their arithmetic: ~14 ms of a ~35 ms decode step of the benchmark model went to such
 * calls. One call per op here, the rows shared out over torch's OpenMP team when there are many.
 *
 * The arithmetic is transformers': RMSNorm as w * (h * (1 / sqrt(mean(h^2) + eps))) in float32,
 * RoPE as x1*c - x2*s and x2*c + x1*s, each product rounded before the sum (no FMA contraction
 * in these functions, so RoPE is bit-identical to the torch path). Only the order of the sum of
 * squares differs from torch's reduction. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define NOFMA __attribute__((optimize("fp-contract=off")))
#define PAR_MIN 65536 /* elements below which one thread does it all */

typedef float v8 __attribute__((vector_size(8 * sizeof(float))));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 1 / sqrt(mean(h^2) + eps) of one row; the sum in 8 lanes, folded in order. */
static float inv_rms(const float *h, int64_t D, float eps) {
    v8 acc = {0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        const v8 v = load8(h + d);
        acc += v * v;
    }
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += acc[i];
    for (; d < D; d++) s += h[d] * h[d];
    return 1.f / sqrtf(s / (float)D + eps);
}

static NOFMA void scale_row(const float *h, float r, const float *w, int64_t D, float *y) {
    for (int64_t d = 0; d < D; d++) y[d] = w[d] * (h[d] * r);
}

/* y[t] = rmsnorm(h[t]) * w for T rows of D, where h = x, or h = x + res written to h_out
 * (res and h_out both NULL or both set; h_out may be x). */
NOFMA void strata_rms_norm_f32(const float *x, const float *res, float *h_out, const float *w,
                               float eps, int64_t T, int64_t D, float *y, int64_t nthreads) {
    #pragma omp parallel for schedule(dynamic, 8) num_threads(nthreads) if (nthreads > 1 && T * D >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *h = x + t * D;
        if (res) {
            float *ho = h_out + t * D;
            const float *rt = res + t * D;
            for (int64_t d = 0; d < D; d++) ho[d] = h[d] + rt[d];
            h = ho;
        }
        scale_row(h, inv_rms(h, D, eps), w, D, y + t * D);
    }
}

/* In place on the first ``heads`` heads of each of T rows of ``qkv`` (row stride ``ld``
 * floats, heads of D contiguous): RMSNorm per head with ``wq`` for heads < nq and ``wk`` after
 * (skipped when wq is NULL), then rotate-half RoPE with cos/sin rows [T, D] (their halves
 * equal, so the first half is used). */
NOFMA void strata_qk_norm_rope_f32(float *qkv, int64_t T, int64_t ld, int64_t heads, int64_t nq,
                                   int64_t D, const float *wq, const float *wk, float eps,
                                   const float *cos_, const float *sin_, int64_t nthreads) {
    const int64_t half = D / 2;
    #pragma omp parallel for schedule(dynamic, 8) num_threads(nthreads) if (nthreads > 1 && T * heads * D >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * D, *s = sin_ + t * D;
        for (int64_t hd = 0; hd < heads; hd++) {
            float *x = qkv + t * ld + hd * D;
            if (wq) scale_row(x, inv_rms(x, D, eps), hd < nq ? wq : wk, D, x);
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
                x[i] = a - b;
                x[i + half] = e + f;
            }
        }
    }
}
