/* y = x @ (w8 * sw).T (+ bias) with int8 weights and int8 activations (W8A8), float32 in and
 * out; built and loaded by cpu_kernels.py beside the float32 GEMM (gemm.c), which it mirrors.
 *
 * Weights: int8 with one scale per output channel (shared/model/int8.py's quantisation),
 * packed once by strata_gemm_s8_pack into panels of NW8 outputs: for each group g of 4 k, the
 * 4 bytes w[n, 4g..4g+3] of every output n of the panel side by side (zero past K and N); after
 * the panels, per output, comp[n] = 128 * sum_k w[n, k] (int32) and sw[n] (float).
 *
 * Activations: each row of x is quantised at call time to int8 by its own symmetric scale,
 * sx = max|x| / 127, q = round-half-even(x * (127 / max|x|)), a zero row to 0; so a row's result
 * does not depend on the other rows of the batch.
 *
 * Sums in int32 (exact for K <= 65536), so every code path computes the same integers; then
 * y = (float)acc * (sx * sw[n]) (+ bias[n]), each product rounded on its own (no FMA) in every
 * path: the result is bit-identical across ISA variants and to the torch reference of
 * tests/model/test_int8_gemm.py.
 *
 * AVX-512 VNNI path (the avx512vnni variant only): vpdpbusd adds four products of unsigned by
 * signed bytes into each int32 lane, so a row is fed as q + 128 (u8) and comp (128 x the column
 * sum) is taken off at the end. A tile of MR8 = 6 rows by one panel of 64 outputs keeps its sums
 * in 24 zmm registers; each group of 4 k costs 4 panel loads and 6 broadcasts for 24 vpdpbusd
 * (1536 multiply-adds), 4x the float32 FMA's per instruction, over a weight a quarter of
 * float32's bytes. No K blocking: at decode sizes a panel (64 x K bytes) stays in L2 while the
 * row tiles pass it.
 *
 * AVX-512BW (avx512) and AVX2 (avx2) paths: vpmaddubsw multiplies u8 by s8 into int16 pair sums
 * and vpmaddwd adds the pairs into int32: |q| by w carrying q's sign, exact since |q|, |w| <= 127
 * (a pair sums to at most 32258, below int16's saturation). Four instructions per vector of
 * products where VNNI needs one: about the float32 FMA's rate, over a quarter of the bytes.
 * Panels of 32 (6-row tiles) and 16 outputs (4-row tiles).
 *
 * Portable path (the portable variant): GCC vectors of int32, each lane a column's 4 bytes of a
 * group, split by shifts and multiplied by each row's q; correct everywhere, and slower than the
 * float32 GEMM wherever compute rather than the weight's bytes bounds it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define NOFMA __attribute__((optimize("fp-contract=off")))
#define MB8 96 /* rows of x per work item */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define Q8_VNNI 1
#define NW8 64 /* outputs per panel: 4 vectors of 16 int32 sums */
#define MR8 6  /* rows per tile */
#define FLIP 0x80 /* rows stored as q + 128 for vpdpbusd's unsigned operand */
#elif defined(__AVX512BW__)
#include <immintrin.h>
#define Q8_BW 1
#define NW8 32 /* outputs per panel: 2 vectors of 16 int32 sums */
#define MR8 6
#define FLIP 0
#elif defined(__AVX2__)
#include <immintrin.h>
#define Q8_AVX2 1
#define NW8 16 /* outputs per panel: 2 vectors of 8 int32 sums */
#define MR8 4
#define FLIP 0
#else
#if defined(__AVX512F__)
#define VI 16
#else
#define VI 8
#endif
typedef int32_t vi32 __attribute__((vector_size(VI * sizeof(int32_t))));
typedef uint32_t vu32 __attribute__((vector_size(VI * sizeof(int32_t))));
#define NV8 2 /* vectors of outputs per panel */
#define NW8 (NV8 * VI)
#define MR8 4
#define FLIP 0
#endif

static inline int64_t groups(int64_t K) { return (K + 3) / 4; }

static inline size_t align64(size_t n) { return (n + 63) / 64 * 64; }

/* bytes of strata_gemm_s8_pack's output for an [N, K] weight */
int64_t strata_gemm_s8_packed_bytes(int64_t N, int64_t K) {
    const int64_t np = (N + NW8 - 1) / NW8 * NW8;
    return (int64_t)(align64((size_t)(np * groups(K) * 4)) + 2 * sizeof(int32_t) * (size_t)np);
}

/* w: [N, K] int8 (|w| <= 127: -128 would break the AVX2 / AVX-512BW paths' sign trick),
 * sw: [N] float32; p: strata_gemm_s8_packed_bytes bytes (any alignment; 64 bytes is fastest). */
void strata_gemm_s8_pack(const int8_t *w, const float *sw, int64_t N, int64_t K, void *p) {
    const int64_t panels = (N + NW8 - 1) / NW8, G = groups(K), np = panels * NW8;
    int8_t *d = (int8_t *)p;
    int32_t *comp = (int32_t *)(d + align64((size_t)(np * G * 4)));
    float *scale = (float *)(comp + np);
    for (int64_t q = 0; q < panels; q++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < NW8; j++)
                for (int64_t t = 0; t < 4; t++) {
                    const int64_t n = q * NW8 + j, k = 4 * g + t;
                    d[((q * G + g) * NW8 + j) * 4 + t] = n < N && k < K ? w[n * K + k] : 0;
                }
    for (int64_t n = 0; n < np; n++) {
        int32_t s = 0;
        for (int64_t k = 0; n < N && k < K; k++) s += w[n * K + k];
        comp[n] = 128 * s;
        scale[n] = n < N ? sw[n] : 0.f;
    }
}

#if defined(__AVX512F__)
#define QW 16
#else
#define QW 8
#endif
typedef float vqf __attribute__((vector_size(QW * sizeof(float))));
typedef int32_t vqi __attribute__((vector_size(QW * sizeof(int32_t))));
typedef int8_t vqb __attribute__((vector_size(QW)));

static inline vqf vqload(const float *p) {
    vqf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vqf vqsel(vqi m, vqf a, vqf b) { /* a where m, else b */
    return (vqf)(((vqi)a & m) | ((vqi)b & ~m));
}

/* round-half-even(v * inv) clamped to +-127, as bytes XOR FLIP */
static inline NOFMA vqb quantise(vqf v, float inv) {
    v = v * inv;
    v = (v + 12582912.f) - 12582912.f; /* round half to even for |v| < 2^22 */
    v = vqsel(v > 127.f, (vqf){0} + 127.f, v);
    v = vqsel(v < -127.f, (vqf){0} - 127.f, v);
    return __builtin_convertvector(__builtin_convertvector(v, vqi), vqb) ^ (int8_t)FLIP;
}

/* One row of x quantised into q (4 * groups(K) bytes, zero past K, each XOR FLIP); returns its
 * scale. No FMA: x * inv is rounded before the rounding to an integer, as in torch. Vectors of
 * QW floats, the tail through a zero-padded one. */
static NOFMA float quantise_row(const float *x, int64_t K, uint8_t *q) {
    const vqi abs_mask = (vqi){0} + 0x7fffffff;
    vqf m[4] = {{0}, {0}, {0}, {0}}; /* four chains: a select's latency each */
    int64_t k = 0;
    for (; k + 4 * QW <= K; k += 4 * QW)
        for (int u = 0; u < 4; u++) {
            const vqf a = (vqf)((vqi)vqload(x + k + u * QW) & abs_mask);
            m[u] = vqsel(a > m[u], a, m[u]);
        }
    for (; k + QW <= K; k += QW) {
        const vqf a = (vqf)((vqi)vqload(x + k) & abs_mask);
        m[0] = vqsel(a > m[0], a, m[0]);
    }
    float amax = 0.f;
    for (int u = 0; u < 4; u++)
        for (int i = 0; i < QW; i++) amax = m[u][i] > amax ? m[u][i] : amax;
    for (int64_t j = k; j < K; j++) {
        const float a = x[j] < 0.f ? -x[j] : x[j];
        amax = a > amax ? a : amax;
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const int64_t padded = 4 * groups(K);
    for (k = 0; k < padded; k += QW) {
        vqf v = {0};
        if (k + QW <= K)
            v = vqload(x + k);
        else if (k < K) /* the tail, zero-padded */
            memcpy(&v, x + k, sizeof(float) * (size_t)(K - k));
        const vqb b = quantise(v, inv);
        if (k + QW <= padded)
            memcpy(q + k, &b, sizeof b);
        else
            memcpy(q + k, &b, (size_t)(padded - k));
    }
    return amax / 127.f;
}

#if defined(Q8_VNNI)
/* Rows [0, m) of a tile: x (u8, ldx bytes a row) by one panel p over G groups, into y (ldy
 * floats a row) for the panel's first ``cols`` outputs. NOFMA: GCC contracts the intrinsics'
 * multiply and add as well. */
static inline NOFMA __attribute__((always_inline)) void tile(const int m, const uint8_t *x,
                                                             int64_t ldx, int64_t G,
                                                             const int8_t *p, const float *sx,
                                                             const int32_t *comp, const float *sw,
                                                             const float *bias, float *y,
                                                             int64_t ldy, int64_t cols) {
    __m512i acc[MR8][4];
    for (int i = 0; i < m; i++)
        for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_si512();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *pg = p + g * NW8 * 4;
        const __m512i b0 = _mm512_loadu_si512(pg), b1 = _mm512_loadu_si512(pg + 64);
        const __m512i b2 = _mm512_loadu_si512(pg + 128), b3 = _mm512_loadu_si512(pg + 192);
        for (int i = 0; i < m; i++) {
            int32_t four;
            memcpy(&four, x + i * ldx + 4 * g, sizeof four);
            const __m512i a = _mm512_set1_epi32(four);
            acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], a, b0);
            acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], a, b1);
            acc[i][2] = _mm512_dpbusd_epi32(acc[i][2], a, b2);
            acc[i][3] = _mm512_dpbusd_epi32(acc[i][3], a, b3);
        }
    }
    for (int v = 0; v < 4 && 16 * v < cols; v++) {
        const int left = cols - 16 * v;
        const __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512i c = _mm512_loadu_si512(comp + 16 * v);
        const __m512 s = _mm512_loadu_ps(sw + 16 * v);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + 16 * v) : _mm512_setzero_ps();
        for (int i = 0; i < m; i++) {
            const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][v], c));
            __m512 r = _mm512_mul_ps(f, _mm512_mul_ps(_mm512_set1_ps(sx[i]), s));
            if (bias) r = _mm512_add_ps(r, b);
            _mm512_mask_storeu_ps(y + i * ldy + 16 * v, keep, r);
        }
    }
}
#else
/* (float)acc * (sx * sw) (+ bias) into y for the first ``cols`` outputs; no FMA. */
static NOFMA void epilogue(int m, const int32_t *acc, const float *sx, const float *sw,
                           const float *bias, float *y, int64_t ldy, int64_t cols) {
    for (int i = 0; i < m; i++)
        for (int64_t j = 0; j < cols; j++) {
            float r = (float)acc[i * NW8 + j] * (sx[i] * sw[j]);
            if (bias) r = r + bias[j];
            y[i * ldy + j] = r;
        }
}
#endif

#if defined(Q8_BW)
static inline __attribute__((always_inline)) void tile(const int m, const uint8_t *x, int64_t ldx,
                                                       int64_t G, const int8_t *p,
                                                       const float *sx, const int32_t *comp,
                                                       const float *sw, const float *bias,
                                                       float *y, int64_t ldy, int64_t cols) {
    (void)comp; /* signed rows (FLIP 0): nothing to take off */
    __m512i acc[MR8][2];
    for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
    for (int64_t g = 0; g < G; g++) {
        const __m512i b0 = _mm512_loadu_si512(p + g * NW8 * 4);
        const __m512i b1 = _mm512_loadu_si512(p + g * NW8 * 4 + 64);
        for (int i = 0; i < m; i++) {
            int32_t four;
            memcpy(&four, x + i * ldx + 4 * g, sizeof four);
            /* as the AVX2 path below; AVX-512 has no vpsignb: w negated where q < 0 */
            const __m512i a = _mm512_set1_epi32(four), ax = _mm512_abs_epi8(a);
            const __mmask64 neg = _mm512_movepi8_mask(a);
            const __m512i p0 = _mm512_maddubs_epi16(ax, _mm512_mask_sub_epi8(b0, neg, zero, b0));
            const __m512i p1 = _mm512_maddubs_epi16(ax, _mm512_mask_sub_epi8(b1, neg, zero, b1));
            acc[i][0] = _mm512_add_epi32(acc[i][0], _mm512_madd_epi16(p0, ones));
            acc[i][1] = _mm512_add_epi32(acc[i][1], _mm512_madd_epi16(p1, ones));
        }
    }
    int32_t out[MR8 * NW8];
    for (int i = 0; i < m; i++) memcpy(out + i * NW8, acc[i], sizeof acc[i]);
    epilogue(m, out, sx, sw, bias, y, ldy, cols);
}
#elif defined(Q8_AVX2)
static inline __attribute__((always_inline)) void tile(const int m, const uint8_t *x, int64_t ldx,
                                                       int64_t G, const int8_t *p,
                                                       const float *sx, const int32_t *comp,
                                                       const float *sw, const float *bias,
                                                       float *y, int64_t ldy, int64_t cols) {
    (void)comp; /* signed rows (FLIP 0): nothing to take off */
    __m256i acc[MR8][2];
    for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < G; g++) {
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(p + g * NW8 * 4));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(p + g * NW8 * 4 + 32));
        for (int i = 0; i < m; i++) {
            int32_t four;
            memcpy(&four, x + i * ldx + 4 * g, sizeof four);
            /* vpmaddubsw takes u8 x s8: |q| by w with q's sign; |q|, |w| <= 127, so a pair
             * sums to at most 32258 and never saturates int16 */
            const __m256i a = _mm256_set1_epi32(four), ax = _mm256_sign_epi8(a, a);
            const __m256i p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(b0, a));
            const __m256i p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(b1, a));
            acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(p0, ones));
            acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(p1, ones));
        }
    }
    int32_t out[MR8 * NW8];
    for (int i = 0; i < m; i++) memcpy(out + i * NW8, acc[i], sizeof acc[i]);
    epilogue(m, out, sx, sw, bias, y, ldy, cols);
}
#elif !defined(Q8_VNNI)
static inline __attribute__((always_inline)) void tile(const int m, const uint8_t *x, int64_t ldx,
                                                       int64_t G, const int8_t *p,
                                                       const float *sx, const int32_t *comp,
                                                       const float *sw, const float *bias,
                                                       float *y, int64_t ldy, int64_t cols) {
    (void)comp; /* rows are stored signed here (FLIP 0): nothing to take off */
    vi32 acc[MR8][NV8];
    for (int i = 0; i < m; i++)
        for (int v = 0; v < NV8; v++) acc[i][v] = (vi32){0};
    for (int64_t g = 0; g < G; g++) {
        vu32 b[NV8];
        memcpy(b, p + g * NW8 * 4, sizeof b);
        for (int t = 0; t < 4; t++) {
            vi32 bt[NV8]; /* byte t of each lane, sign-extended */
            for (int v = 0; v < NV8; v++) bt[v] = (vi32)(b[v] << (24 - 8 * t)) >> 24;
            for (int i = 0; i < m; i++) {
                const int32_t a = (int8_t)x[i * ldx + 4 * g + t];
                for (int v = 0; v < NV8; v++) acc[i][v] += a * bt[v];
            }
        }
    }
    int32_t out[MR8 * NW8];
    for (int i = 0; i < m; i++) memcpy(out + i * NW8, acc[i], sizeof acc[i]);
    epilogue(m, out, sx, sw, bias, y, ldy, cols);
}
#endif

static NOFMA void tile_any(int m, const uint8_t *x, int64_t ldx, int64_t G, const int8_t *p,
                           const float *sx, const int32_t *comp, const float *sw,
                           const float *bias, float *y, int64_t ldy, int64_t cols) {
    switch (m) {
#if MR8 > 4
    case 6: tile(6, x, ldx, G, p, sx, comp, sw, bias, y, ldy, cols); break;
    case 5: tile(5, x, ldx, G, p, sx, comp, sw, bias, y, ldy, cols); break;
#endif
    case 4: tile(4, x, ldx, G, p, sx, comp, sw, bias, y, ldy, cols); break;
    case 3: tile(3, x, ldx, G, p, sx, comp, sw, bias, y, ldy, cols); break;
    case 2: tile(2, x, ldx, G, p, sx, comp, sw, bias, y, ldy, cols); break;
    default: tile(1, x, ldx, G, p, sx, comp, sw, bias, y, ldy, cols); break;
    }
}

/* x: [M, K] float32, p: strata_gemm_s8_pack of an [N, K] weight, bias: [N] or NULL, y: [M, N];
 * contiguous. The rows are quantised, then work items (panel, block of MB8 rows) handed out
 * over ``nthreads`` OpenMP threads in runs, as strata_gemm_f32 does. Returns 0, or -1 (nothing
 * done) when K is past the int32 sums' range or the rows' buffer cannot be allocated. */
int64_t strata_gemm_s8_f32(const float *x, int64_t M, int64_t K, const void *p, int64_t N,
                           const float *bias, float *y, int64_t nthreads) {
    if (K > 65536) return -1;
    if (M < 1 || N < 1) return 0;
    const int64_t G = groups(K), ldq = 4 * G, panels = (N + NW8 - 1) / NW8, np = panels * NW8;
    const int64_t blocks = (M + MB8 - 1) / MB8;
    const int8_t *d = (const int8_t *)p;
    const int32_t *comp = (const int32_t *)(d + align64((size_t)(np * G * 4)));
    const float *sw = (const float *)(comp + np);
    uint8_t *q = (uint8_t *)malloc((size_t)(M * ldq) + sizeof(float) * (size_t)M);
    if (!q) return -1;
    float *sx = (float *)(q + M * ldq); /* unaligned is fine: read one float at a time */
    int64_t run = panels * blocks / (8 * (nthreads > 1 ? nthreads : 1));
    if (run < 1) run = 1;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) {
            const float s = quantise_row(x + i * K, K, q + i * ldq);
            memcpy(sx + i, &s, sizeof s);
        }
        #pragma omp for collapse(2) schedule(dynamic, run)
        for (int64_t qp = 0; qp < panels; qp++) {
            for (int64_t ib = 0; ib < blocks; ib++) {
                const int64_t n0 = qp * NW8, i1 = (ib + 1) * MB8 < M ? (ib + 1) * MB8 : M;
                const int64_t cols = N - n0 < NW8 ? N - n0 : NW8;
                const int8_t *pq = d + qp * G * NW8 * 4;
                for (int64_t i0 = ib * MB8; i0 < i1; i0 += MR8) {
                    float s[MR8];
                    const int m = i1 - i0 < MR8 ? (int)(i1 - i0) : MR8;
                    memcpy(s, sx + i0, sizeof(float) * (size_t)m);
                    tile_any(m, q + i0 * ldq, ldq, G, pq, s, comp + n0, sw + n0,
                             bias ? bias + n0 : 0, y + i0 * N + n0, N, cols);
                }
            }
        }
    }
    free(q);
    return 0;
}
