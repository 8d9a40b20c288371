/* Decode attention over the paged KV cache, built and loaded by cpu_kernels.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

/* e^x for x <= 0 (arguments below -87 give ~0): 2^(x log2 e) as 2^f * 2^i, f in [0, 1) by
 * a degree-6 polynomial (relative error ~2e-7, like expf's last bit or two). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, fi);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, fi);
}

/* How far ahead (tokens) the K and V passes prefetch, into L2 (_MM_HINT_T1), not L1: a 16-token
 * stretch of rows is 16 KB for 4 KV heads of 64, half of L1, so fetching one stretch ahead into
 * L1 evicted rows before their use. Two stretches ahead into L2 (1 MB), a decode step's
 * attention over 8 layers read K/V from memory 1.2-1.4x faster (docs/benchmarks/engine.md,
 * "Decode attention prefetched into L2"). */
#define PREFETCH_AHEAD 32

/* Tokens of V summed per load and store of an output chunk (see the V pass below). */
#define TV 4

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
                        int64_t KVH, int64_t D, int64_t BS, float scale, float *out) {
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
            const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
            __m512 vs = _mm512_setzero_ps();
            for (int64_t t = 0; t < n; t += 16) {
                const __mmask16 km = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
                const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mx));
                vs = _mm512_mask_add_ps(vs, km, vs, e);
                _mm512_storeu_ps(sg + t, e);
            }
            const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vs));
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

/* out[b, h, :] = softmax(q[b, h] . K[b]^T * scale) V[b] for one decode token per sequence.
 * q, out: [B, H, D] contiguous; k, v: one layer of the cache, [NB, BS, KVH, D] contiguous;
 * tables: [B, max_blocks] int64; ctx: [B] int64. Query head h reads KV head h / (H / KVH),
 * as transformers' repeat_kv does. Two passes per (sequence, KV head): scores of the whole
 * group, then the weighted sum of V. Scores in float32 like SDPA's CPU kernel. */
static inline __attribute__((always_inline)) void attn(
        const float *q, const float *k, const float *v, const int64_t *tables,
        const int64_t *ctx, int64_t max_blocks, int64_t B, int64_t H, int64_t KVH,
        const int64_t D, int64_t BS, float scale, float *out) {
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
            float m = -INFINITY;
            for (int64_t t = 0; t < n; t++) m = sh[t] > m ? sh[t] : m;
            float sum = 0.f;
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

/* One call for rows [0, B): AVX-512 when the CPU has it and D is a multiple of 16; otherwise
 * the portable body, compiled separately for the common head sizes (constant D: unrolled). */
static void attn_rows(const float *q, const float *k, const float *v,
                      const int64_t *tables, const int64_t *ctx, int64_t max_blocks,
                      int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                      float scale, float *out) {
#ifdef __AVX512F__
    if (D % 16 == 0) {
        attn_avx512(q, k, v, tables, ctx, max_blocks, B, H, KVH, D, BS, scale, out);
        return;
    }
#endif
    if (D == 64) attn(q, k, v, tables, ctx, max_blocks, B, H, KVH, 64, BS, scale, out);
    else if (D == 128) attn(q, k, v, tables, ctx, max_blocks, B, H, KVH, 128, BS, scale, out);
    else attn(q, k, v, tables, ctx, max_blocks, B, H, KVH, D, BS, scale, out);
}

/* Sequences are shared out over ``nthreads`` OpenMP threads. The library links libgomp.so.1,
 * which resolves to the copy torch already loaded, so this is torch's own thread team (no
 * second pool competing for the cores with torch's spinning workers). */
void strata_decode_attn_f32(const float *q, const float *k, const float *v,
                            const int64_t *tables, const int64_t *ctx, int64_t max_blocks,
                            int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                            float scale, float *out, int64_t nthreads) {
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1 && B > 1)
    for (int64_t b = 0; b < B; b++)
        attn_rows(q + b * H * D, k, v, tables + b * max_blocks, ctx + b, max_blocks, 1, H, KVH,
                  D, BS, scale, out + b * H * D);
}
