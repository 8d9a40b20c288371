/* Every entry point of the native CPU kernels, and the structs of the one-call decoder layer:
 * declared once, here. The kernel sources include it (so the compiler checks each definition
 * against its declaration), and so does torch_ops.cpp, which looks every function up by name in
 * the ISA variant loaded (strata::bind) and fills the structs from the ops' tensor arguments:
 * nothing restates a signature or a layout by hand. */
#ifndef STRATA_KERNELS_H
#define STRATA_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What a layer's projections are packed as (strata_layer.wtype). */
enum { STRATA_W_F32 = 0, STRATA_W_INT8 = 1, STRATA_W_BF16 = 2 };

/* One layer's weights, fixed while they are. The projections (*_p) are strata_gemm_pack_f32
 * panels, strata_gemm_s8_pack blobs or strata_gemm_bf16_pack panels, as ``wtype`` says;
 * ``dot_rows`` is the bf16 GEMM's (strata_gemm_bf16_f32). Norm weights and biases float32. */
typedef struct {
    const float *ln1_w;
    const void *qkv_p;
    const float *qkv_b, *qn_w, *kn_w;
    const void *o_p;
    const float *o_b, *ln2_w;
    const void *gu_p;
    const float *gu_b;
    const void *down_p;
    const float *down_b;
    int64_t hidden, heads, kv_heads, head_dim, inter, wtype, dot_rows;
    double ln1_eps, qk_eps, ln2_eps, scale;
} strata_layer;

/* One forward's batch: T token rows, their RoPE rows and cache slots; the non-decode
 * sequences for the prefill kernel (p_*) and the decode tokens (d_*, d_rows NULL when every row
 * is a decode, in order); one scratch buffer of strata_layer_scratch floats; ``kv_bf16`` 1 when
 * the KV cache is bfloat16 (else float32). */
typedef struct {
    const float *cos_, *sin_;
    const int64_t *slots, *p_tables, *p_ctx, *p_qstart, *p_qlen, *d_tables, *d_ctx, *d_rows;
    float *scratch;
    int64_t T, block_size, p_n, p_max_blocks, d_n, d_max_blocks, nthreads, kv_bf16;
} strata_batch;

/* isa.c: the code paths this library was compiled with ("portable", "avx2", ...) */
const char *strata_kernel_isa(void);

/* decode_attention.c. ``sinks``: NULL, or H attention-sink logits (GPT-OSS): head h's joins
 * every softmax's denominator as a key of value zero (the weights then sum to less than 1). */
void strata_decode_attn_f32(const float *q, const float *k, const float *v,
                            const int64_t *tables, const int64_t *ctx, int64_t max_blocks,
                            int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                            float scale, const float *sinks, float *out, int64_t nthreads);
int64_t strata_decode_attn_bf16kv(const float *q, const uint16_t *k, const uint16_t *v,
                                  const int64_t *tables, const int64_t *ctx, int64_t max_blocks,
                                  int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                                  float scale, const float *sinks, float *out, int64_t nthreads);

/* gemm.c */
int64_t strata_gemm_panel_width(void);
void strata_gemm_pack_f32(const float *w, int64_t N, int64_t K, float *p);
void strata_gemm_f32(const float *x, int64_t M, int64_t K, const float *p, int64_t N,
                     const float *bias, float *y, int64_t nthreads);
/* ``sinks``: NULL or H sink logits, as for strata_decode_attn_f32 */
int64_t strata_prefill_attn_f32(const float *q, int64_t q_ts, const float *k_cache,
                                const float *v_cache, const int64_t *tables, const int64_t *ctx,
                                const int64_t *qstart, const int64_t *qlen, int64_t S,
                                int64_t max_blocks, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                                float scale, const float *sinks, float *out, int64_t o_ts,
                                int64_t nthreads);
int64_t strata_prefill_attn_bf16kv(const float *q, int64_t q_ts, const uint16_t *k_cache,
                                   const uint16_t *v_cache, const int64_t *tables,
                                   const int64_t *ctx, const int64_t *qstart, const int64_t *qlen,
                                   int64_t S, int64_t max_blocks, int64_t H, int64_t KVH,
                                   int64_t D, int64_t BS, float scale, const float *sinks,
                                   float *out, int64_t o_ts, int64_t nthreads);

/* gemm_int8.c */
int64_t strata_gemm_s8_packed_bytes(int64_t N, int64_t K);
void strata_gemm_s8_pack(const int8_t *w, const float *sw, int64_t N, int64_t K, void *p);
int64_t strata_gemm_s8_f32(const float *x, int64_t M, int64_t K, const void *p, int64_t N,
                           const float *bias, float *y, int64_t nthreads);

/* gemm_bf16.c */
int64_t strata_gemm_bf16_packed_numel(int64_t N, int64_t K);
void strata_gemm_bf16_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *p);
int64_t strata_gemm_bf16_f32(const float *x, int64_t M, int64_t K, const uint16_t *p, int64_t N,
                             const float *bias, float *y, int64_t dot_rows, int64_t nthreads);

/* fused.c */
void strata_rms_norm_f32(const float *x, const float *res, float *h_out, const float *w,
                         float eps, int64_t T, int64_t D, float *y, int64_t nthreads);
void strata_qk_norm_rope_f32(float *qkv, int64_t T, int64_t ld, int64_t heads, int64_t nq,
                             int64_t D, const float *wq, const float *wk, float eps,
                             const float *cos_, const float *sin_, int64_t nthreads);

/* layer.c */
int64_t strata_layer_scratch(const strata_layer *L, int64_t T, int64_t d_n);
int64_t strata_decoder_layer_f32(const strata_layer *L, const strata_batch *B, float *h,
                                 void *k_cache, void *v_cache);

#ifdef __cplusplus
}
#endif

#endif
