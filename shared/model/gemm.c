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
 * extensions: a vector is 16 floats where the compiler targets AVX-512, 8 otherwise. */
#include <stdint.h>
#include <string.h>

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
 * float32. Work items (panel, block of MB rows) are shared out over ``nthreads`` OpenMP
 * threads in contiguous runs of panels (each thread streams its part of the weight); the
 * library links torch's libgomp, so this is torch's own team. */
void strata_gemm_f32(const float *x, int64_t M, int64_t K, const float *p, int64_t N,
                     const float *bias, float *y, int64_t nthreads) {
    const int64_t panels = (N + NW - 1) / NW, blocks = (M + MB - 1) / MB;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)
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
