/* y = x @ w.T (+ bias) with bfloat16 weights and float32 activations and outputs; built and
 * loaded by cpu_kernels.py beside the float32 GEMM (gemm.c), which it mirrors.
 *
 * The weight [N, K] (bf16 bit patterns) is packed once into panels of NWB = 2 vectors of outputs,
 * as gemm.c's, but by pairs of k: for each pair g, the 32-bit word of output n holds w[n, 2g] in
 * its low half and w[n, 2g + 1] in its high half (zero past K and N). Half the bytes of the
 * float32 panels, and one layout for both paths:
 *
 * - Widen (every variant; where there is no dot path, or below ``dot_rows``): a pair word
 *   shifted left 16 is the float32 of w[n, 2g], masked to its high half that of w[n, 2g + 1],
 *   exactly. Then gemm.c's tile: one FMA per k and output, k in order, K-blocks added in order,
 *   the bias last; so the result is bit-identical to strata_gemm_f32 on the weight widened to
 *   float32 (same variant), and a row's result does not depend on the batch. About float32's
 *   speed where compute bounds it, up to 1.4x where the weight's bytes do (1-2 rows). GCC
 *   vector extensions: 16 floats a vector on AVX-512, 8 elsewhere.
 * - Dot (the avx512bf16 variant only, from ``dot_rows`` rows up): each row of x is rounded to
 *   bf16 once per call (vcvtneps2bf16, round to nearest even), and vdpbf16ps adds the two
 *   products of a pair into each float32 lane: 32 multiply-adds per instruction where the FMA
 *   does 16, on two panels at a time (24 sums in registers). The activations' rounding (relative
 *   2^-9) is the price: results are within bf16 rounding of the widen path's, not bit-identical.
 *
 * The caller picks ``dot_rows`` (shared/model/bf16.py's DOT_ROWS, measured: 1, as the dot path
 * was the faster from one row up on an AVX-512 BF16 EPYC); 0 keeps the widen path. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__)
#define BW 16
#define BSPLAT(s) {s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}
#else
#define BW 8
#define BSPLAT(s) {s, s, s, s, s, s, s, s}
#endif
typedef float vbf __attribute__((vector_size(BW * sizeof(float))));
typedef uint32_t vbu __attribute__((vector_size(BW * sizeof(float))));

#define NWB (2 * BW) /* outputs per panel (gemm.c's NW) */
#define MRB 6        /* rows of x per tile */
#define KCB 384      /* k per block (gemm.c's KC): an even number, whole pairs */
#define MBB 96       /* rows of x per work item */

static inline int64_t pairs(int64_t K) { return (K + 1) / 2; }

/* bf16 elements of strata_gemm_bf16_pack's output for an [N, K] weight */
int64_t strata_gemm_bf16_packed_numel(int64_t N, int64_t K) {
    return (N + NWB - 1) / NWB * NWB * 2 * pairs(K);
}

/* w: [N, K] bf16 bit patterns; p: strata_gemm_bf16_packed_numel elements. */
void strata_gemm_bf16_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *p) {
    const int64_t panels = (N + NWB - 1) / NWB, G = pairs(K);
    for (int64_t q = 0; q < panels; q++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < NWB; j++)
                for (int64_t t = 0; t < 2; t++) {
                    const int64_t n = q * NWB + j, k = 2 * g + t;
                    p[((q * G + g) * NWB + j) * 2 + t] = n < N && k < K ? w[n * K + k] : 0;
                }
}

static inline vbu loadu(const uint32_t *p) {
    vbu v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vbf loadf(const float *p) {
    vbf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storef(float *p, vbf v) { memcpy(p, &v, sizeof v); }

/* c[i, 0:NWB] (+)= sum over k < kc of x[i, k] * w[k] for i < m, the panel block p (pairs);
 * ``first`` starts from zero (else from c), ``bias`` (NWB values or NULL) is added at the end.
 * kc may be odd (the last block of an odd K): its last pair's high half is zero and x[kc] is
 * not read. */
static inline __attribute__((always_inline)) void tile(const int m, const float *x, int64_t ldx,
                                                       int64_t kc, const uint32_t *p, float *c,
                                                       int64_t ldc, int first, const float *bias) {
    const vbu hi_mask = (vbu){0} + 0xFFFF0000u;
    vbf acc[MRB][2];
    for (int i = 0; i < m; i++) {
        acc[i][0] = first ? (vbf){0} : loadf(c + i * ldc);
        acc[i][1] = first ? (vbf){0} : loadf(c + i * ldc + BW);
    }
    const int64_t whole = kc / 2;
    for (int64_t g = 0; g < whole; g++) {
        const vbu b0 = loadu(p + g * NWB), b1 = loadu(p + g * NWB + BW);
        const vbf l0 = (vbf)(b0 << 16), l1 = (vbf)(b1 << 16);
        const vbf h0 = (vbf)(b0 & hi_mask), h1 = (vbf)(b1 & hi_mask);
        for (int i = 0; i < m; i++) { /* k = 2g, then 2g + 1: gemm.c's order */
            const float s0 = x[i * ldx + 2 * g], s1 = x[i * ldx + 2 * g + 1];
            const vbf a0 = BSPLAT(s0), a1 = BSPLAT(s1);
            acc[i][0] += a0 * l0;
            acc[i][1] += a0 * l1;
            acc[i][0] += a1 * h0;
            acc[i][1] += a1 * h1;
        }
    }
    if (kc % 2) {
        const vbu b0 = loadu(p + whole * NWB), b1 = loadu(p + whole * NWB + BW);
        const vbf l0 = (vbf)(b0 << 16), l1 = (vbf)(b1 << 16);
        for (int i = 0; i < m; i++) {
            const float s0 = x[i * ldx + 2 * whole];
            const vbf a0 = BSPLAT(s0);
            acc[i][0] += a0 * l0;
            acc[i][1] += a0 * l1;
        }
    }
    if (bias) {
        const vbf c0 = loadf(bias), c1 = loadf(bias + BW);
        for (int i = 0; i < m; i++) {
            acc[i][0] += c0;
            acc[i][1] += c1;
        }
    }
    for (int i = 0; i < m; i++) {
        storef(c + i * ldc, acc[i][0]);
        storef(c + i * ldc + BW, acc[i][1]);
    }
}

static void tile_any(int m, const float *x, int64_t ldx, int64_t kc, const uint32_t *p, float *c,
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

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DOT 1

/* The dot path's tile: x as bf16 pairs (ldx words a row, pair g of the block at x[g]), kc k
 * (whole pairs: the rows are zero-padded to an even K, so an odd K's last pair is whole too), by
 * ``np`` adjacent panels (1 or 2; the second ``pstride`` words after the first): 24 sums in
 * registers for two, so each broadcast row pair feeds four vdpbf16ps. */
static inline __attribute__((always_inline)) void dtile(const int m, const int np,
                                                        const uint32_t *x, int64_t ldx,
                                                        int64_t kc, const uint32_t *p,
                                                        int64_t pstride, float *c, int64_t ldc,
                                                        int first, const float *bias) {
    __m512 acc[MRB][4];
    const int nv = 2 * np;
    for (int i = 0; i < m; i++)
        for (int v = 0; v < nv; v++)
            acc[i][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc + 16 * v);
    const int64_t G = pairs(kc);
    for (int64_t g = 0; g < G; g++) {
        __m512bh b[4];
        for (int v = 0; v < nv; v++)
            b[v] = (__m512bh)_mm512_loadu_si512(p + (v / 2) * pstride + g * NWB + 16 * (v % 2));
        for (int i = 0; i < m; i++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[i * ldx + g]);
            for (int v = 0; v < nv; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, b[v]);
        }
    }
    for (int v = 0; v < nv; v++) {
        const __m512 cb = bias ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
        for (int i = 0; i < m; i++) {
            if (bias) acc[i][v] = _mm512_add_ps(acc[i][v], cb);
            _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
        }
    }
}

static void dtile_any(int m, int np, const uint32_t *x, int64_t ldx, int64_t kc,
                      const uint32_t *p, int64_t pstride, float *c, int64_t ldc, int first,
                      const float *bias) {
#define DT(M)                                                                                     \
    (np == 2 ? dtile(M, 2, x, ldx, kc, p, pstride, c, ldc, first, bias)                           \
             : dtile(M, 1, x, ldx, kc, p, pstride, c, ldc, first, bias))
    switch (m) {
    case 6: DT(6); break;
    case 5: DT(5); break;
    case 4: DT(4); break;
    case 3: DT(3); break;
    case 2: DT(2); break;
    default: DT(1); break;
    }
#undef DT
}

/* One row of K floats as bf16 (round to nearest even), zero-padded to 2 * pairs(K). */
static void round_row(const float *x, int64_t K, uint16_t *out) {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k));
        _mm256_storeu_si256((__m256i *)(out + k), b);
    }
    if (k < K) {
        const __mmask16 keep = (__mmask16)((1u << (K - k)) - 1);
        const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, x + k));
        _mm256_mask_storeu_epi16(out + k, keep, b);
    }
    if (K % 2) out[K] = 0;
}
#endif

/* One run of a tile over rows [r0, r0 + m) and k [k0, k0 + kc) of ``np`` panel blocks from pk
 * (``pstride`` words apart; np 2 on the dot path only). */
static inline void run_tile(int m, int np, const float *x, const uint32_t *xb, int64_t ldb,
                            int64_t r0, int64_t K, int64_t k0, int64_t kc, const uint32_t *pk,
                            int64_t pstride, float *c, int64_t ldc, int first, const float *bias,
                            int dot) {
#ifdef HAVE_DOT
    if (dot) {
        dtile_any(m, np, xb + r0 * ldb + k0 / 2, ldb, kc, pk, pstride, c, ldc, first, bias);
        return;
    }
#endif
    (void)xb, (void)ldb, (void)dot, (void)np, (void)pstride;
    tile_any(m, x + r0 * K + k0, K, kc, pk, c, ldc, first, bias);
}

/* One work item: rows [i0, i1) by ``np`` adjacent panels from pq (outputs n0..), as
 * strata_gemm_f32's items; G pairs of k a row. */
static void item(const float *x, const uint32_t *xb, int64_t i0, int64_t i1, int64_t K,
                 int64_t G, const uint32_t *pq, int np, int64_t n0, int64_t N, const float *bias,
                 float *y, int dot) {
    if (n0 + np * NWB > N && np > 1) { /* the last pair holds the narrow panel: one by one */
        for (int j = 0; j < np; j++)
            item(x, xb, i0, i1, K, G, pq + j * G * NWB, 1, n0 + j * NWB, N, bias, y, dot);
        return;
    }
    float pad_bias[NWB], out[MRB * NWB];
    const float *bq = bias ? bias + n0 : 0;
    if (n0 + NWB <= N) {
        for (int64_t k0 = 0; k0 < K; k0 += KCB) {
            const int64_t kc = K - k0 < KCB ? K - k0 : KCB;
            const float *bk = k0 + kc == K ? bq : 0;
            for (int64_t r0 = i0; r0 < i1; r0 += MRB)
                run_tile(i1 - r0 < MRB ? (int)(i1 - r0) : MRB, np, x, xb, G, r0, K, k0, kc,
                         pq + (k0 / 2) * NWB, G * NWB, y + r0 * N + n0, N, k0 == 0, bk, dot);
        }
        return;
    }
    if (bias) { /* the last panel, narrower than NWB: whole K into a scratch tile */
        for (int64_t j = 0; j < NWB; j++) pad_bias[j] = n0 + j < N ? bias[n0 + j] : 0.f;
        bq = pad_bias;
    }
    for (int64_t r0 = i0; r0 < i1; r0 += MRB) {
        const int m = i1 - r0 < MRB ? (int)(i1 - r0) : MRB;
        run_tile(m, 1, x, xb, G, r0, K, 0, K, pq, G * NWB, out, NWB, 1, bq, dot);
        for (int i = 0; i < m; i++)
            memcpy(y + (r0 + i) * N + n0, out + i * NWB, sizeof(float) * (size_t)(N - n0));
    }
}

/* x: [M, K] float32, p: strata_gemm_bf16_pack of w [N, K], bias: [N] float32 or NULL, y:
 * [M, N] float32; contiguous. The dot path from ``dot_rows`` rows up where it is compiled in
 * (dot_rows 0: never), two panels a work item. Work items (panels, block of MBB rows) are handed
 * out over ``nthreads`` OpenMP threads in runs, as strata_gemm_f32 does. Returns 0, or -1
 * (nothing done) when the rounded rows' buffer cannot be allocated. */
int64_t strata_gemm_bf16_f32(const float *x, int64_t M, int64_t K, const uint16_t *p, int64_t N,
                             const float *bias, float *y, int64_t dot_rows, int64_t nthreads) {
    if (M < 1 || N < 1) return 0;
    const int64_t panels = (N + NWB - 1) / NWB, blocks = (M + MBB - 1) / MBB, G = pairs(K);
    const uint32_t *pw = (const uint32_t *)p;
    uint32_t *xb = 0;
#ifdef HAVE_DOT
    const int dot = dot_rows > 0 && M >= dot_rows;
    if (dot && !(xb = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(M * G)))) return -1;
#else
    const int dot = 0;
    (void)dot_rows;
#endif
    const int np = dot ? 2 : 1; /* panels per work item */
    const int64_t groups = (panels + np - 1) / np;
    int64_t run = groups * blocks / (8 * (nthreads > 1 ? nthreads : 1));
    if (run < 1) run = 1;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
#ifdef HAVE_DOT
        if (dot) {
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < M; i++) round_row(x + i * K, K, (uint16_t *)(xb + i * G));
        }
#endif
        #pragma omp for collapse(2) schedule(dynamic, run)
        for (int64_t qq = 0; qq < groups; qq++)
            for (int64_t ib = 0; ib < blocks; ib++) {
                const int64_t q = qq * np, i1 = (ib + 1) * MBB < M ? (ib + 1) * MBB : M;
                const int n = q + np <= panels ? np : 1;
                item(x, xb, ib * MBB, i1, K, G, pw + q * G * NWB, n, q * NWB, N, bias, y, dot);
            }
    }
    free(xb);
    return 0;
}
