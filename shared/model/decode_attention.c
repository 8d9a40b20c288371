/* Decode attention over the paged KV cache, built and loaded by cpu_kernels.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "exp2_poly.h"
#include "kernels.h"

/* How far ahead (tokens) the K and V passes prefetch, into L2 (_MM_HINT_T1), not L1: a 16-token
 * stretch of rows is 16 KB for 4 KV heads of 64, half of L1, so fetching one stretch ahead into
 * L1 evicted rows before their use. Two stretches ahead into L2 (1 MB), a decode step's
 * attention over 8 layers read K/V from memory 1.2-1.4x faster (docs/benchmarks/engine.md,
 * "Decode attention prefetched into L2"). */
#define PREFETCH_AHEAD 32

/* Tokens of V summed per load and store of an output chunk (see the V pass below). */
#define TV 4

#ifdef __AVX512F__
#include <immintrin.h>
/* lane i of the result = sum of the 16 lanes of v[i] */
static inline __m512 sum16x16(const __m512 *v) {
    __m512 s2[8], s4[4], u[2];
    for (int i = 0; i < 8; i++)
        s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                              _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(s2[2 * i]), b = _mm512_castps_pd(s2[2 * i + 1]);
        s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                         _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
}

/* e^x for x <= 0 (arguments below -87 give ~0); the polynomial and its error: exp2_poly.h. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(STRATA_LOG2E));
    const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, fi);
    return _mm512_scalef_ps(STRATA_EXP2_POLY(f, _mm512_fmadd_ps, _mm512_set1_ps), fi);
}

/* The AVX-512 path (D a multiple of 16), per sequence. Both passes walk the context token by
 * token, each token's row (every KV head) front to back, so memory is read in the order it
 * lies within a block and the hardware prefetcher follows it; the software prefetch only
 * crosses the block table's jumps.
 *
 * - Scores: for each token, the dot product of every query head with its KV head's row as one
 *   vector of 16 partial sums, kept in a small L1 buffer; every 16 tokens a transpose-add per
 *   head folds the 16 vectors into 16 scores (no per-token horizontal sum). This replaced a
 *   head-major walk (16 tokens' rows at one head's offset at a time) that read K at about a
 *   third of the box's bandwidth: 1.2-1.4x faster for the decode step's attention
 *   (docs/benchmarks/engine.md, "Decode attention, token-major").
 * - A vectorised softmax per head.
 * - The weighted V sum into the output rows (L1-resident), TV tokens per load and store of an
 *   output chunk: the same FMAs in the same order as one token at a time.
 *
 * Both passes sum in the same order as before, so the output is bit-identical to it. */
static void attn_avx512(const float *q, const float *k, const float *v, const int64_t *tables,
                        const int64_t *ctx, int64_t max_blocks, int64_t B, int64_t H,
                        int64_t KVH, int64_t D, int64_t BS, float scale, const float *sinks,
                        float *out) {
    const int64_t G = H / KVH, C = D / 16;
    const int64_t tok_stride = KVH * D, blk_stride = BS * tok_stride;
    const int64_t dv = v - k; /* a token's V row is at the same offset as its K row */
    int64_t cap = 0;
    for (int64_t b = 0; b < B; b++) if (ctx[b] > cap) cap = ctx[b];
    const int64_t pitch = cap + 16;  /* s[h * pitch + t] */
    float *s = (float *)aligned_alloc(64, sizeof(float) * (size_t)(H * pitch));
    float *part = (float *)aligned_alloc(64, sizeof(float) * (size_t)(H * 16 * 16));
    const float **rows = (const float **)malloc(sizeof(float *) * (size_t)pitch);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = ctx[b];
        const int64_t *tab = tables + b * max_blocks;
        const float *qb = q + b * H * D;
        float *ob = out + b * H * D;
        for (int64_t t = 0, blk = 0; t < n; blk++) {
            const float *base = k + tab[blk] * blk_stride;
            for (int64_t i = 0; i < BS && t < n; i++, t++) rows[t] = base + i * tok_stride;
        }
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
            const int64_t m = n - t0 < 16 ? n - t0 : 16;
            for (int64_t j = 0; j < m; j++) {
                const int64_t t = t0 + j;
                if (t + PREFETCH_AHEAD < n)
                    for (int64_t l = 0; l < tok_stride; l += 16)
                        _mm_prefetch((const char *)(rows[t + PREFETCH_AHEAD] + l), _MM_HINT_T1);
                for (int64_t h = 0; h < H; h++) {
                    const float *qq = qb + h * D, *kk = rows[t] + (h / G) * D;
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qq), _mm512_loadu_ps(kk));
                    for (int64_t c = 1; c < C; c++)
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qq + 16 * c),
                                            _mm512_loadu_ps(kk + 16 * c), a);
                    _mm512_store_ps(part + (h * 16 + j) * 16, a);
                }
            }
            for (int64_t j = m; j < 16; j++)
                for (int64_t h = 0; h < H; h++)
                    _mm512_store_ps(part + (h * 16 + j) * 16, _mm512_setzero_ps());
            for (int64_t h = 0; h < H; h++) {
                __m512 acc[16];
                for (int j = 0; j < 16; j++) acc[j] = _mm512_load_ps(part + (h * 16 + j) * 16);
                _mm512_storeu_ps(s + h * pitch + t0, _mm512_mul_ps(sum16x16(acc), vscale));
            }
        }
        for (int64_t h = 0; h < H; h++) {  /* softmax over s[h][0..n); lanes past n masked */
            float *sg = s + h * pitch;
            __m512 vm = _mm512_set1_ps(-INFINITY);
            for (int64_t t = 0; t < n; t += 16) {
                const __mmask16 km = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
                vm = _mm512_mask_max_ps(vm, km, vm, _mm512_loadu_ps(sg + t));
            }
            float top = _mm512_reduce_max_ps(vm);
            if (sinks && sinks[h] > top) top = sinks[h];
            const __m512 mx = _mm512_set1_ps(top);
            __m512 vs = _mm512_setzero_ps();
            for (int64_t t = 0; t < n; t += 16) {
                const __mmask16 km = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
                const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mx));
                vs = _mm512_mask_add_ps(vs, km, vs, e);
                _mm512_storeu_ps(sg + t, e);
            }
            float tot = _mm512_reduce_add_ps(vs);
            if (sinks) tot += expf(sinks[h] - top); /* the sink's key: value zero */
            const __m512 inv = _mm512_set1_ps(1.f / tot);
            for (int64_t t = 0; t < n; t += 16)
                _mm512_storeu_ps(sg + t, _mm512_mul_ps(_mm512_loadu_ps(sg + t), inv));
        }
        for (int64_t i = 0; i < H * D; i++) ob[i] = 0.f;
        for (int64_t t = 0; t < n; t += TV) {
            const int64_t m = n - t < TV ? n - t : TV;
            for (int64_t j = t + PREFETCH_AHEAD; j < t + PREFETCH_AHEAD + m && j < n; j++)
                for (int64_t l = 0; l < tok_stride; l += 16)
                    _mm_prefetch((const char *)(rows[j] + dv + l), _MM_HINT_T1);
            for (int64_t h = 0; h < H; h++) {
                const int64_t off = dv + (h / G) * D;
                const float *sh = s + h * pitch + t;
                float *o = ob + h * D;
                if (m == TV) {
                    __m512 p[TV];
                    const float *vr[TV];
                    for (int j = 0; j < TV; j++) {
                        p[j] = _mm512_set1_ps(sh[j]);
                        vr[j] = rows[t + j] + off;
                    }
                    for (int64_t c = 0; c < C; c++) {
                        __m512 a = _mm512_loadu_ps(o + 16 * c);
                        for (int j = 0; j < TV; j++)
                            a = _mm512_fmadd_ps(p[j], _mm512_loadu_ps(vr[j] + 16 * c), a);
                        _mm512_storeu_ps(o + 16 * c, a);
                    }
                } else {
                    for (int64_t j = 0; j < m; j++) {
                        const __m512 p = _mm512_set1_ps(sh[j]);
                        const float *vv = rows[t + j] + off;
                        for (int64_t c = 0; c < C; c++)
                            _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(
                                p, _mm512_loadu_ps(vv + 16 * c), _mm512_loadu_ps(o + 16 * c)));
                    }
                }
            }
        }
    }
    free(rows);
    free(part);
    free(s);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
/* lane i of the result = sum of the 8 lanes of v[i] */
static inline __m256 sum8x8(const __m256 *v) {
    __m256 s2[4], s4[2];
    for (int i = 0; i < 4; i++)
        s2[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                              _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        __m256d a = _mm256_castps_pd(s2[2 * i]), b = _mm256_castps_pd(s2[2 * i + 1]);
        s4[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                              _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(s4[0], s4[1], 0x20),
                         _mm256_permute2f128_ps(s4[0], s4[1], 0x31));
}

/* e^x for x <= 0, as exp16 of the AVX-512 path: 2^f by the same polynomial (exp2_poly.h),
 * times 2^i built in the exponent bits (x >= -87 keeps i >= -126, a normal float). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(STRATA_LOG2E));
    const __m256 fi = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, fi);
    const __m256 p = STRATA_EXP2_POLY(f, _mm256_fmadd_ps, _mm256_set1_ps);
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* lanes i < rem all ones (rem >= 8: every lane) */
static inline __m256 lanes_below(int64_t rem) {
    const __m256 idx = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    return _mm256_cmp_ps(idx, _mm256_set1_ps((float)(rem < 8 ? rem : 8)), _CMP_LT_OQ);
}

/* The AVX2 path (D a multiple of 8): the AVX-512 path's walk on 8-lane vectors. Scores token
 * by token, each token's row (every KV head) front to back, 8 partial sums per (token, query
 * head) folded every 8 tokens by sum8x8; a vectorised softmax; the weighted V sum TV tokens
 * per load and store of an output chunk. The portable loop it replaces on AVX2 CPUs walked
 * the same order but summed each score across the lanes per token (docs/benchmarks/engine.md,
 * "Decode attention on AVX2"). */
static inline __attribute__((always_inline)) void attn_avx2(
        const float *q, const float *k, const float *v, const int64_t *tables,
        const int64_t *ctx, int64_t max_blocks, int64_t B, int64_t H, int64_t KVH,
        const int64_t D, int64_t BS, float scale, const float *sinks, float *out) {
    const int64_t G = H / KVH, C = D / 8;
    const int64_t tok_stride = KVH * D, blk_stride = BS * tok_stride;
    const int64_t dv = v - k; /* a token's V row is at the same offset as its K row */
    int64_t cap = 0;
    for (int64_t b = 0; b < B; b++) if (ctx[b] > cap) cap = ctx[b];
    const int64_t pitch = cap + 8;  /* s[h * pitch + t] */
    float *s = (float *)aligned_alloc(32, sizeof(float) * (size_t)(H * pitch));
    float *part = (float *)aligned_alloc(32, sizeof(float) * (size_t)(H * 8 * 8));
    const float **rows = (const float **)malloc(sizeof(float *) * (size_t)pitch);
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = ctx[b];
        const int64_t *tab = tables + b * max_blocks;
        const float *qb = q + b * H * D;
        float *ob = out + b * H * D;
        for (int64_t t = 0, blk = 0; t < n; blk++) {
            const float *base = k + tab[blk] * blk_stride;
            for (int64_t i = 0; i < BS && t < n; i++, t++) rows[t] = base + i * tok_stride;
        }
        for (int64_t t0 = 0; t0 < n; t0 += 8) {
            const int64_t m = n - t0 < 8 ? n - t0 : 8;
            for (int64_t j = 0; j < m; j++) {
                const int64_t t = t0 + j;
                if (t + PREFETCH_AHEAD < n)
                    for (int64_t l = 0; l < tok_stride; l += 16)
                        _mm_prefetch((const char *)(rows[t + PREFETCH_AHEAD] + l), _MM_HINT_T1);
                for (int64_t h = 0; h < H; h++) {
                    const float *qq = qb + h * D, *kk = rows[t] + (h / G) * D;
                    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qq), _mm256_loadu_ps(kk));
                    for (int64_t c = 1; c < C; c++)
                        a = _mm256_fmadd_ps(_mm256_loadu_ps(qq + 8 * c),
                                            _mm256_loadu_ps(kk + 8 * c), a);
                    _mm256_store_ps(part + (h * 8 + j) * 8, a);
                }
            }
            for (int64_t j = m; j < 8; j++)
                for (int64_t h = 0; h < H; h++)
                    _mm256_store_ps(part + (h * 8 + j) * 8, _mm256_setzero_ps());
            for (int64_t h = 0; h < H; h++) {
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_load_ps(part + (h * 8 + j) * 8);
                _mm256_storeu_ps(s + h * pitch + t0, _mm256_mul_ps(sum8x8(acc), vscale));
            }
        }
        for (int64_t h = 0; h < H; h++) {  /* softmax over s[h][0..n); lanes past n masked */
            float *sg = s + h * pitch;
            const __m256 ninf = _mm256_set1_ps(-INFINITY);
            __m256 vm = ninf;
            for (int64_t t = 0; t < n; t += 8)
                vm = _mm256_max_ps(vm, _mm256_blendv_ps(ninf, _mm256_loadu_ps(sg + t),
                                                        lanes_below(n - t)));
            float top = hmax8(vm);
            if (sinks && sinks[h] > top) top = sinks[h];
            const __m256 mx = _mm256_set1_ps(top);
            __m256 vs = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t += 8) {
                const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mx)),
                                               lanes_below(n - t));
                vs = _mm256_add_ps(vs, e);
                _mm256_storeu_ps(sg + t, e);
            }
            float tot = hsum8(vs);
            if (sinks) tot += expf(sinks[h] - top); /* the sink's key: value zero */
            const __m256 inv = _mm256_set1_ps(1.f / tot);
            for (int64_t t = 0; t < n; t += 8)
                _mm256_storeu_ps(sg + t, _mm256_mul_ps(_mm256_loadu_ps(sg + t), inv));
        }
        for (int64_t i = 0; i < H * D; i++) ob[i] = 0.f;
        for (int64_t t = 0; t < n; t += TV) {
            const int64_t m = n - t < TV ? n - t : TV;
            for (int64_t j = t + PREFETCH_AHEAD; j < t + PREFETCH_AHEAD + m && j < n; j++)
                for (int64_t l = 0; l < tok_stride; l += 16)
                    _mm_prefetch((const char *)(rows[j] + dv + l), _MM_HINT_T1);
            for (int64_t h = 0; h < H; h++) {
                const int64_t off = dv + (h / G) * D;
                const float *sh = s + h * pitch + t;
                float *o = ob + h * D;
                if (m == TV) {
                    __m256 p[TV];
                    const float *vr[TV];
                    for (int j = 0; j < TV; j++) {
                        p[j] = _mm256_set1_ps(sh[j]);
                        vr[j] = rows[t + j] + off;
                    }
                    for (int64_t c = 0; c < C; c++) {
                        __m256 a = _mm256_loadu_ps(o + 8 * c);
                        for (int j = 0; j < TV; j++)
                            a = _mm256_fmadd_ps(p[j], _mm256_loadu_ps(vr[j] + 8 * c), a);
                        _mm256_storeu_ps(o + 8 * c, a);
                    }
                } else {
                    for (int64_t j = 0; j < m; j++) {
                        const __m256 p = _mm256_set1_ps(sh[j]);
                        const float *vv = rows[t + j] + off;
                        for (int64_t c = 0; c < C; c++)
                            _mm256_storeu_ps(o + 8 * c, _mm256_fmadd_ps(
                                p, _mm256_loadu_ps(vv + 8 * c), _mm256_loadu_ps(o + 8 * c)));
                    }
                }
            }
        }
    }
    free(rows);
    free(part);
    free(s);
}
#endif

/* out[b, h, :] = softmax(q[b, h] . K[b]^T * scale) V[b] for one decode token per sequence.
 * q, out: [B, H, D] contiguous; k, v: one layer of the cache, [NB, BS, KVH, D] contiguous;
 * tables: [B, max_blocks] int64; ctx: [B] int64. Query head h reads KV head h / (H / KVH),
 * as transformers' repeat_kv does. Two passes per (sequence, KV head): scores of the whole
 * group, then the weighted sum of V. Scores in float32 like SDPA's CPU kernel. */
static inline __attribute__((always_inline)) void attn(
        const float *q, const float *k, const float *v, const int64_t *tables,
        const int64_t *ctx, int64_t max_blocks, int64_t B, int64_t H, int64_t KVH,
        const int64_t D, int64_t BS, float scale, const float *sinks, float *out) {
    const int64_t G = H / KVH;
    const int64_t tok_stride = KVH * D;
    const int64_t blk_stride = BS * tok_stride;
    int64_t cap = 0;
    for (int64_t b = 0; b < B; b++) if (ctx[b] > cap) cap = ctx[b];
    float *s = (float *)malloc(sizeof(float) * (size_t)(H * cap));  /* s[h * n + t] */
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = ctx[b];
        const int64_t *tab = tables + b * max_blocks;
        const float *qb = q + b * H * D;
        float *ob = out + b * H * D;
        /* scores: walk the context once, token by token (each token's K is KVH*D contiguous) */
        for (int64_t t = 0; t < n; t++) {
            const float *kt = k + tab[t / BS] * blk_stride + (t % BS) * tok_stride;
            for (int64_t h = 0; h < H; h++) {
                const float *qq = qb + h * D, *kk = kt + (h / G) * D;
                float acc = 0.f;
                #pragma omp simd reduction(+:acc)
                for (int64_t d = 0; d < D; d++) acc += qq[d] * kk[d];
                s[h * n + t] = acc * scale;
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float *sh = s + h * n;
            float m = sinks ? sinks[h] : -INFINITY;
            for (int64_t t = 0; t < n; t++) m = sh[t] > m ? sh[t] : m;
            float sum = sinks ? expf(sinks[h] - m) : 0.f; /* the sink's key: value zero */
            for (int64_t t = 0; t < n; t++) { sh[t] = expf(sh[t] - m); sum += sh[t]; }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < n; t++) sh[t] *= inv;
        }
        for (int64_t i = 0; i < H * D; i++) ob[i] = 0.f;
        for (int64_t t = 0; t < n; t++) {
            const float *vt = v + tab[t / BS] * blk_stride + (t % BS) * tok_stride;
            for (int64_t h = 0; h < H; h++) {
                const float p = s[h * n + t];
                const float *vv = vt + (h / G) * D;
                float *restrict o = ob + h * D;
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] += p * vv[d];
            }
        }
    }
    free(s);
}

/* One call for rows [0, B): AVX-512 when the CPU has it and D is a multiple of 16, else AVX2
 * with FMA when D is a multiple of 8; otherwise the portable body. The AVX2 and portable
 * bodies are compiled separately for the common head sizes (constant D: unrolled). */
static void attn_rows(const float *q, const float *k, const float *v,
                      const int64_t *tables, const int64_t *ctx, int64_t max_blocks,
                      int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                      float scale, const float *sinks, float *out) {
#ifdef __AVX512F__
    if (D % 16 == 0) {
        attn_avx512(q, k, v, tables, ctx, max_blocks, B, H, KVH, D, BS, scale, sinks, out);
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        /* constant D for the common head sizes: 1.1-1.2x at 128 (probe, in cache) */
        if (D == 64)
            attn_avx2(q, k, v, tables, ctx, max_blocks, B, H, KVH, 64, BS, scale, sinks, out);
        else if (D == 128)
            attn_avx2(q, k, v, tables, ctx, max_blocks, B, H, KVH, 128, BS, scale, sinks, out);
        else attn_avx2(q, k, v, tables, ctx, max_blocks, B, H, KVH, D, BS, scale, sinks, out);
        return;
    }
#endif
    if (D == 64) attn(q, k, v, tables, ctx, max_blocks, B, H, KVH, 64, BS, scale, sinks, out);
    else if (D == 128)
        attn(q, k, v, tables, ctx, max_blocks, B, H, KVH, 128, BS, scale, sinks, out);
    else attn(q, k, v, tables, ctx, max_blocks, B, H, KVH, D, BS, scale, sinks, out);
}

/* Sequences are shared out over ``nthreads`` OpenMP threads. The library links libgomp.so.1,
 * which resolves to the copy torch already loaded, so this is torch's own thread team (no
 * second pool competing for the cores with torch's spinning workers). */
void strata_decode_attn_f32(const float *q, const float *k, const float *v,
                            const int64_t *tables, const int64_t *ctx, int64_t max_blocks,
                            int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                            float scale, const float *sinks, float *out, int64_t nthreads) {
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1 && B > 1)
    for (int64_t b = 0; b < B; b++)
        attn_rows(q + b * H * D, k, v, tables + b * max_blocks, ctx + b, max_blocks, 1, H, KVH,
                  D, BS, scale, sinks, out + b * H * D);
}

/* strata_decode_attn_f32 over a bfloat16 cache (the one-call layer of a bf16 model): each
 * sequence's context is widened, K then V, into a float32 copy of its own (exact), laid out as
 * blocks in order, and the float32 code above runs on it: the output is bit-identical to
 * strata_decode_attn_f32 over the widened cache. The copy is per thread, 2 x (longest context)
 * x KVH x D floats, taken for the call; a sequence's context is read from memory once, at half
 * float32's bytes, and its copy, in L2 for contexts of a few hundred tokens, twice. Returns 0,
 * or -1 (nothing written) when a copy cannot be allocated. */
int64_t strata_decode_attn_bf16kv(const float *q, const uint16_t *k, const uint16_t *v,
                                  const int64_t *tables, const int64_t *ctx, int64_t max_blocks,
                                  int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                                  float scale, const float *sinks, float *out,
                                  int64_t nthreads) {
    int64_t cap = 1;
    for (int64_t b = 0; b < B; b++) cap = ctx[b] > cap ? ctx[b] : cap;
    const int64_t nblk = (cap + BS - 1) / BS, tok = KVH * D, blk = BS * tok;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1 && B > 1)
    {
        float *kw = (float *)malloc(sizeof(float) * (size_t)(2 * nblk * blk));
        int64_t *ident = (int64_t *)malloc(sizeof(int64_t) * (size_t)nblk);
        if (!kw || !ident) {
            #pragma omp atomic write
            failed = 1;
        } else
            for (int64_t i = 0; i < nblk; i++) ident[i] = i;
        #pragma omp barrier
        if (!failed) {
            float *vw = kw + nblk * blk;
            #pragma omp for schedule(dynamic, 1)
            for (int64_t b = 0; b < B; b++) {
                const int64_t n = ctx[b], *tab = tables + b * max_blocks;
                for (int64_t t = 0; t < n; t++) {
                    const int64_t off = tab[t / BS] * blk + (t % BS) * tok;
                    const uint16_t *kr = k + off, *vr = v + off;
                    float *kd = kw + t * tok, *vd = vw + t * tok;
                    for (int64_t e = 0; e < tok; e++) kd[e] = strata_bf16_to_f32(kr[e]);
                    for (int64_t e = 0; e < tok; e++) vd[e] = strata_bf16_to_f32(vr[e]);
                }
                attn_rows(q + b * H * D, kw, vw, ident, ctx + b, nblk, 1, H, KVH, D, BS, scale,
                          sinks, out + b * H * D);
            }
        }
        free(ident);
        free(kw);
    }
    return failed ? -1 : 0;
}
