/* y = x @ w.T (+ bias) in float32 on a weight packed once into column panels; built and loaded
 * by cpu_kernels.py beside the decode-attention kernel.
 *
 * The weight [N, K] is repacked into panels of NW = 2 vectors of outputs: panel q holds, for
 * every k, the NW weights w[q*NW + j, k] side by side (zero past N). A tile of MR = 6 rows of x
 * by one panel keeps its 6 x NW sums in 12 vector registers; each k costs two vector loads of
 * the panel and six broadcasts of x for twelve FMAs. The panel (NW x KC floats) stays in L1
 * while every row tile of x passes it, so the weight is read from memory once per call for any
 * number of rows up to MB, and once per MB rows beyond.
 *
 * On the benchmark model's shapes on an AVX2 EPYC (2 threads) this ran decode-sized products
 * (1-32 rows) 1.4-2.1x faster than oneDNN's blocked GEMM, whose small-row blocking left the
 * FMA units idle while the weight streamed in, and prefill-sized ones (128-1024 rows) within
 * 0.9-1.2x of it (docs/benchmarks/engine.md). It replaces oneDNN's packed copy on CPU float32,
 * so the weight costs the same memory as before.
 *
 * Each output is summed over k in order (one FMA chain per output, K-blocks added in order),
 * like a naive dot product; within float32 rounding of a BLAS. Written with GCC vector
 * extensions: a vector is 16 floats where the compiler targets AVX-512, 8 otherwise.
 *
 * The prefill attention kernel at the end of the file runs both of its products on this tile. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__)
#define VW 16
#define SPLAT(s) {s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}
#else
#define VW 8
#define SPLAT(s) {s, s, s, s, s, s, s, s}
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

#define NW (2 * VW) /* outputs per panel */
#define MR 6        /* rows of x per tile */
#define KC 384      /* k per block: a panel block of NW x KC floats stays in L1 */
#define MB 96       /* rows of x per work item: its K-block stays in L2 */

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v); /* unaligned */
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

int64_t strata_gemm_panel_width(void) { return NW; }

/* p: ceil(N / NW) * K * NW floats. */
void strata_gemm_pack_f32(const float *w, int64_t N, int64_t K, float *p) {
    const int64_t panels = (N + NW - 1) / NW;
    for (int64_t q = 0; q < panels; q++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NW; j++) {
                const int64_t n = q * NW + j;
                p[(q * K + k) * NW + j] = n < N ? w[n * K + k] : 0.f;
            }
}

/* c[i, 0:NW] (+)= sum over kc of x[i, k] * panel[k, 0:NW] for i < m; ``first`` starts from
 * zero (else from c), ``bias`` (NW values or NULL) is added at the end. */
static inline __attribute__((always_inline)) void tile(const int m, const float *x, int64_t ldx,
                                                       int64_t kc, const float *p, float *c,
                                                       int64_t ldc, int first, const float *bias) {
    vf acc[MR][2];
    for (int i = 0; i < m; i++) {
        acc[i][0] = first ? (vf){0} : load(c + i * ldc);
        acc[i][1] = first ? (vf){0} : load(c + i * ldc + VW);
    }
    for (int64_t k = 0; k < kc; k++) {
        const vf b0 = load(p + k * NW), b1 = load(p + k * NW + VW);
        for (int i = 0; i < m; i++) {
            const float s = x[i * ldx + k];
            const vf a = SPLAT(s);
            acc[i][0] += a * b0;
            acc[i][1] += a * b1;
        }
    }
    if (bias) {
        const vf c0 = load(bias), c1 = load(bias + VW);
        for (int i = 0; i < m; i++) {
            acc[i][0] += c0;
            acc[i][1] += c1;
        }
    }
    for (int i = 0; i < m; i++) {
        store(c + i * ldc, acc[i][0]);
        store(c + i * ldc + VW, acc[i][1]);
    }
}

static void tile_any(int m, const float *x, int64_t ldx, int64_t kc, const float *p, float *c,
                     int64_t ldc, int first, const float *bias) {
    switch (m) {
    case 6: tile(6, x, ldx, kc, p, c, ldc, first, bias); break;
    case 5: tile(5, x, ldx, kc, p, c, ldc, first, bias); break;
    case 4: tile(4, x, ldx, kc, p, c, ldc, first, bias); break;
    case 3: tile(3, x, ldx, kc, p, c, ldc, first, bias); break;
    case 2: tile(2, x, ldx, kc, p, c, ldc, first, bias); break;
    default: tile(1, x, ldx, kc, p, c, ldc, first, bias); break;
    }
}

/* x: [M, K], p: strata_gemm_pack_f32 of w [N, K], bias: [N] or NULL, y: [M, N]; contiguous
 * float32. Work items (panel, block of MB rows) are handed out over ``nthreads`` OpenMP
 * threads in runs of about 1/8 of a thread's share (each run streams adjacent panels of the
 * weight). Handed out, not split up front: when the OS takes a core from one thread (a service
 * process waking up on a small box), the others go on with the remaining runs instead of
 * waiting at the end for its fixed half (on the 2-core box the default cluster ran ~10% faster
 * than with a static split; docs/benchmarks/engine.md). The library links torch's libgomp, so
 * this is torch's own team. Which thread computes an output does not change its sum. */
void strata_gemm_f32(const float *x, int64_t M, int64_t K, const float *p, int64_t N,
                     const float *bias, float *y, int64_t nthreads) {
    const int64_t panels = (N + NW - 1) / NW, blocks = (M + MB - 1) / MB;
    int64_t run = panels * blocks / (8 * (nthreads > 1 ? nthreads : 1));
    if (run < 1) run = 1;
    #pragma omp parallel for collapse(2) schedule(dynamic, run) num_threads(nthreads) if (nthreads > 1)
    for (int64_t q = 0; q < panels; q++) {
        for (int64_t ib = 0; ib < blocks; ib++) {
            const int64_t n0 = q * NW, i1 = (ib + 1) * MB < M ? (ib + 1) * MB : M;
            const float *pq = p + q * K * NW;
            const int full = n0 + NW <= N;
            float pad_bias[NW], out[MR * NW];
            const float *bq = bias ? bias + n0 : 0;
            if (bias && !full) {
                for (int64_t j = 0; j < NW; j++) pad_bias[j] = n0 + j < N ? bias[n0 + j] : 0.f;
                bq = pad_bias;
            }
            if (full) {
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t kc = K - k0 < KC ? K - k0 : KC;
                    const int last = k0 + kc == K;
                    for (int64_t i0 = ib * MB; i0 < i1; i0 += MR)
                        tile_any(i1 - i0 < MR ? (int)(i1 - i0) : MR, x + i0 * K + k0, K, kc,
                                 pq + k0 * NW, y + i0 * N + n0, N, k0 == 0, last ? bq : 0);
                }
            } else { /* the last panel, narrower than NW: whole K into a scratch tile */
                for (int64_t i0 = ib * MB; i0 < i1; i0 += MR) {
                    const int m = i1 - i0 < MR ? (int)(i1 - i0) : MR;
                    tile_any(m, x + i0 * K, K, K, pq, out, NW, 1, bq);
                    for (int i = 0; i < m; i++)
                        memcpy(y + (i0 + i) * N + n0, out + i * NW, sizeof(float) * (N - n0));
                }
            }
        }
    }
}

/* ----- Prefill attention on the same tile: causal attention of prompt chunks over the paged
 * KV cache (fresh prefill, chunked prefill, prefix-cache hits). torch's CPU SDPA ran it at
 * ~45 GFLOP/s for a 272-token prompt and ~107 for 2048, and a chunk over a cached prefix first
 * gathered its context and built a mask. Here a work item is (sequence, QB query tokens, KV
 * head): its R = QB x G query rows (the whole GQA group) walk the context in blocks of NW keys
 * read in place through the block table. Per block the keys are packed as one panel (K^T,
 * [D][NW]) and the values as D / NW panels ([NW keys][NW outputs]), so both products are the
 * GEMM tile above: scores S = Q K^T, then, after an online softmax over each row (running max
 * and sum, as SDPA's flash kernel), O = O * alpha + P V. Keys past a row's position get
 * probability 0. Sums in float32; the order differs from SDPA's, so results agree to float32
 * rounding, not bit for bit. */
#include <math.h>
#include <stdlib.h>

#include "bf16.h"
#include "exp2_poly.h"

#define QB 64      /* query tokens per work item */
#define KP 4       /* key panels per block */
#define KB (KP * NW) /* keys per block */

/* e^x for x <= 0 (below -87 gives ~0): 2^i * 2^f, i the nearest integer, f in [-1/2, 1/2];
 * the polynomial and its error: exp2_poly.h. */
typedef int32_t vi __attribute__((vector_size(VW * sizeof(float))));

#define VEXP_FMA(a, b, c) ((a) * (b) + (c))
#define VEXP_SET1(c) ((vf){0} + (c))

static inline vf vexp(vf x) {
    const vf lo = (vf){0} - 87.f;
    const vi keep = x >= lo;
    x = (vf)(((vi)x & keep) | ((vi)lo & ~keep));
    const vf t = x * STRATA_LOG2E;
    /* nearest for t <= 0: t - 1/2 converted toward zero (t in [0, 1/2) gives 0 as well) */
    const vi ti = __builtin_convertvector(t - 0.5f, vi);
    const vf f = t - __builtin_convertvector(ti, vf);
    const vf p = STRATA_EXP2_POLY(f, VEXP_FMA, VEXP_SET1);
    const vi e = (ti + 127) << 23;
    vf s;
    memcpy(&s, &e, sizeof s);
    return p * s;
}

/* Query tokens [i0, i1) of a sequence with ``qn`` new tokens and context ``n`` (query i sits
 * at position n - qn + i), KV head ``g``; ``ws`` scratch of item_floats() floats. With
 * ``sinks``, each row's online softmax starts from its head's sink logit as the running max
 * and a sum of 1 (the sink's own term; its value is zero, so the output starts at zero). */
static void attn_item(const float *q, int64_t q_ts, const void *kc, const void *vc, int kv16,
                      const int64_t *tab, int64_t n, int64_t qn, int64_t i0, int64_t i1,
                      int64_t g, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale,
                      const float *sinks, float *out, int64_t o_ts, float *ws) {
    const int64_t G = H / KVH, R = (i1 - i0) * G, NP = D / NW;
    const int64_t tok = KVH * D, blk = BS * tok, first = n - qn;
    float *qs = ws, *o = qs + R * D, *s = o + R * D, *kt = s + R * KB, *vp = kt + D * KB;
    float *mx = vp + D * KB, *sum = mx + R;
    for (int64_t r = 0; r < R; r++) {
        const float *src = q + (i0 + r / G) * q_ts + (g * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) qs[r * D + d] = src[d] * scale;
        mx[r] = sinks ? sinks[g * G + r % G] : -INFINITY;
        sum[r] = sinks ? 1.f : 0.f;
    }
    memset(o, 0, sizeof(float) * (size_t)(R * D));
    const int64_t last = first + i1 - 1; /* the furthest query position */
    for (int64_t k0 = 0; k0 <= last; k0 += KB) {
        const int64_t m = last + 1 - k0 < KB ? last + 1 - k0 : KB;
        /* K^T as KP panels [D][NW]; V as NP panels [KB keys][NW outputs]; zero past m */
        for (int64_t j = 0; j < KB; j++) {
            float *ktj = kt + (j / NW) * D * NW + j % NW;
            if (j < m && kv16) { /* a bf16 cache: widened as it is packed (exact) */
                const int64_t t = k0 + j, off = tab[t / BS] * blk + (t % BS) * tok + g * D;
                const uint16_t *kr = (const uint16_t *)kc + off, *vr = (const uint16_t *)vc + off;
                for (int64_t d = 0; d < D; d++) ktj[d * NW] = strata_bf16_to_f32(kr[d]);
                for (int64_t c = 0; c < NP; c++)
                    for (int64_t u = 0; u < NW; u++)
                        vp[(c * KB + j) * NW + u] = strata_bf16_to_f32(vr[c * NW + u]);
            } else if (j < m) {
                const int64_t t = k0 + j, off = tab[t / BS] * blk + (t % BS) * tok + g * D;
                const float *kr = (const float *)kc + off, *vr = (const float *)vc + off;
                for (int64_t d = 0; d < D; d++) ktj[d * NW] = kr[d];
                for (int64_t c = 0; c < NP; c++)
                    memcpy(vp + (c * KB + j) * NW, vr + c * NW, sizeof(float) * NW);
            } else {
                for (int64_t d = 0; d < D; d++) ktj[d * NW] = 0.f;
                for (int64_t c = 0; c < NP; c++)
                    memset(vp + (c * KB + j) * NW, 0, sizeof(float) * NW);
            }
        }
        const int kp = (int)((m + NW - 1) / NW); /* panels holding keys (the rest are masked) */
        for (int64_t r0 = 0; r0 < R; r0 += MR) /* S = Q K^T */
            for (int p = 0; p < kp; p++)
                tile_any(R - r0 < MR ? (int)(R - r0) : MR, qs + r0 * D, D, D, kt + p * D * NW,
                         s + r0 * KB + p * NW, KB, 1, 0);
        for (int64_t r = 0; r < R; r++) { /* online softmax; S becomes P */
            const int64_t pos = first + i0 + r / G;
            const int64_t lim = pos - k0 + 1 < m ? pos - k0 + 1 : m; /* visible keys here */
            float *sr = s + r * KB;
            if (lim <= 0) {
                memset(sr, 0, sizeof(float) * KB);
                continue;
            }
            vf v[KB / VW];
            for (int u = 0; u < KB / VW; u++) v[u] = load(sr + u * VW);
            if (lim < KB) /* the diagonal block: keys past the row's position are masked */
                for (int u = 0; u < KB / VW; u++)
                    for (int i = 0; i < VW; i++)
                        if (u * VW + i >= lim) v[u][i] = -INFINITY;
            vf vm = v[0];
            for (int u = 1; u < KB / VW; u++) {
                const vi gt = vm > v[u];
                vm = (vf)(((vi)vm & gt) | ((vi)v[u] & ~gt));
            }
            float bm = mx[r];
            for (int i = 0; i < VW; i++) bm = vm[i] > bm ? vm[i] : bm;
            /* 0 on the first block (mx = -inf), unless a sink started it */
            const float alpha = expf(mx[r] - bm);
            mx[r] = bm;
            vf acc = {0};
            for (int u = 0; u < KB / VW; u++) {
                vf e = vexp(v[u] - bm);
                if (lim < KB) /* exp(-inf) is ~1e-38 here, not 0 */
                    for (int i = 0; i < VW; i++)
                        if (u * VW + i >= lim) e[i] = 0.f;
                store(sr + u * VW, e);
                acc += e;
            }
            float ps = 0.f;
            for (int i = 0; i < VW; i++) ps += acc[i];
            sum[r] = sum[r] * alpha + ps;
            if (alpha != 1.f) {
                float *orow = o + r * D;
                for (int64_t d = 0; d < D; d += VW) store(orow + d, load(orow + d) * alpha);
            }
        }
        for (int64_t c = 0; c < NP; c++) /* O += P V */
            for (int64_t r0 = 0; r0 < R; r0 += MR)
                tile_any(R - r0 < MR ? (int)(R - r0) : MR, s + r0 * KB, KB, m, vp + c * KB * NW,
                         o + r0 * D + c * NW, D, 0, 0);
    }
    for (int64_t r = 0; r < R; r++) {
        float *dst = out + (i0 + r / G) * o_ts + (g * G + r % G) * D;
        const float inv = 1.f / sum[r];
        for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
    }
}

/* The body of both entry points below: ``kv16`` says the caches are bf16 (uint16_t). */
static int64_t prefill_attn(const float *q, int64_t q_ts, const void *k_cache,
                            const void *v_cache, int kv16, const int64_t *tables,
                            const int64_t *ctx, const int64_t *qstart, const int64_t *qlen,
                            int64_t S, int64_t max_blocks, int64_t H, int64_t KVH, int64_t D,
                            int64_t BS, float scale, const float *sinks, float *out, int64_t o_ts,
                            int64_t nthreads) {
    if (D < NW || D % NW || KVH < 1 || H % KVH) return -1;
    int64_t items = 0;
    for (int64_t s = 0; s < S; s++) {
        if (qlen[s] < 1 || qlen[s] > ctx[s]) return -1;
        items += (qlen[s] + QB - 1) / QB * KVH;
    }
    /* item -> (sequence, query block, KV head); each sequence's longest (last) blocks first */
    int64_t *work = (int64_t *)malloc(sizeof(int64_t) * 3 * (size_t)(items ? items : 1));
    int64_t w = 0;
    for (int64_t s = 0; s < S; s++)
        for (int64_t b = (qlen[s] + QB - 1) / QB - 1; b >= 0; b--)
            for (int64_t g = 0; g < KVH; g++) {
                work[3 * w] = s;
                work[3 * w + 1] = b;
                work[3 * w + 2] = g;
                w++;
            }
    const int64_t R = QB * (H / KVH);
    const size_t per = (size_t)(2 * R * D + R * KB + 2 * D * KB + 2 * R);
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1 && items > 1)
    {
        float *ws = (float *)malloc(sizeof(float) * per);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t s = work[3 * it], b = work[3 * it + 1], g = work[3 * it + 2];
            const int64_t i0 = b * QB, i1 = i0 + QB < qlen[s] ? i0 + QB : qlen[s];
            attn_item(q + qstart[s] * q_ts, q_ts, k_cache, v_cache, kv16, tables + s * max_blocks,
                      ctx[s], qlen[s], i0, i1, g, H, KVH, D, BS, scale, sinks,
                      out + qstart[s] * o_ts, o_ts, ws);
        }
        free(ws);
    }
    free(work);
    return 0;
}

/* q: rows of the sequences' new tokens, row i of sequence s at q + (qstart[s] + i) * q_ts, heads
 * D apart; k_cache, v_cache: one layer [NB, BS, KVH, D] holding every sequence's context
 * including its new tokens; tables [S, max_blocks], ctx [S] (context length with the new
 * tokens), qlen [S] (new tokens); out like q with token stride o_ts. Returns 0, or -1 (nothing
 * done) for a shape it does not handle (D not a multiple of the panel width). */
int64_t strata_prefill_attn_f32(const float *q, int64_t q_ts, const float *k_cache,
                                const float *v_cache, const int64_t *tables, const int64_t *ctx,
                                const int64_t *qstart, const int64_t *qlen, int64_t S,
                                int64_t max_blocks, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                                float scale, const float *sinks, float *out, int64_t o_ts,
                                int64_t nthreads) {
    return prefill_attn(q, q_ts, k_cache, v_cache, 0, tables, ctx, qstart, qlen, S, max_blocks, H,
                        KVH, D, BS, scale, sinks, out, o_ts, nthreads);
}

/* strata_prefill_attn_f32 over a bfloat16 cache (the one-call layer of a bf16 model): each
 * key and value is widened (exactly) as the blocks are packed, so the output is bit-identical to
 * strata_prefill_attn_f32 over the widened cache. */
int64_t strata_prefill_attn_bf16kv(const float *q, int64_t q_ts, const uint16_t *k_cache,
                                   const uint16_t *v_cache, const int64_t *tables,
                                   const int64_t *ctx, const int64_t *qstart, const int64_t *qlen,
                                   int64_t S, int64_t max_blocks, int64_t H, int64_t KVH,
                                   int64_t D, int64_t BS, float scale, const float *sinks,
                                   float *out, int64_t o_ts, int64_t nthreads) {
    return prefill_attn(q, q_ts, k_cache, v_cache, 1, tables, ctx, qstart, qlen, S, max_blocks, H,
                        KVH, D, BS, scale, sinks, out, o_ts, nthreads);
}
