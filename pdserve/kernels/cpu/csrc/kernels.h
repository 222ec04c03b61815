/*
 * The exported entry points of the CPU kernels (the .c files beside this one), for a source that calls
 * another's: decoder_layer.c runs a whole decoder layer out of them, linked into one library
 * (pdserve/kernels/cpu/build.py builds a CLibrary from several sources). Each function's
 * contract is documented at its definition.
 */
#ifndef PDSERVE_KERNELS_H
#define PDSERVE_KERNELS_H
#include <stdint.h>

/* quants.c */
int pd_quant_matmul(int kind, const void *x, int x_is_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                    void *y, int y_is_bf16, int threads);

/* quants_a8.c */
int pd_quant_matmul_a8(int kind, const void *x, int x_is_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                       void *y, int y_is_bf16, int threads);

/* arch/x86/quants_a8.c (AVX512-VNNI CPUs only) */
void int8_quad_order(const int8_t *q, int64_t M, int64_t K, int8_t *out, int64_t quad_stride);
void int8_q8_0_x(const int8_t *q, int64_t M, int64_t K, int8_t *out, int32_t *start, int64_t padded);
void a8_vnni_matmul(int kind, const int8_t *q, const int32_t *start, int64_t q_stride, const float *d, const float *s,
                    int64_t stride, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y, int y_is_bf16,
                    int threads);

/* repack_a8.c */
int a8_x16_matmul(int kind, const int8_t *q, const float *d, const float *s, int64_t stride, int64_t M, int64_t K,
                  const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads);
int pd_quant_x16_route(void);

/* repack_bf16.c */
int bf16_x16_matmul(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                    int y_is_bf16, int threads);
int pd_quant_bf16_x16_route(void);

/* causal_attention.c */
int pd_causal_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                             const uint16_t *v, int64_t v_stride, int64_t L, int64_t Hq, int64_t Hkv, int64_t D,
                             float scale, uint16_t *out, int64_t out_stride, int threads);

/* layer_ops.c */
void pd_rms_norm(const void *x, const void *delta, void *sum_out, const void *weight, void *out, int64_t rows,
                 int64_t dim, float eps, int is_bf16);
void pd_rope_and_cache(void *qkv, int is_bf16, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       const void *cos, const void *sin_signed, void *cache, int cache_is_bf16,
                       const int64_t *slots, int64_t block_size, int64_t block_stride, int64_t half_stride);
void pd_silu_mul(const void *gate_up, void *act, int64_t rows, int64_t inter, int is_bf16);

/* paged_attention.c */
void pd_paged_decode_attention(const void *q, int q_is_bf16, const void *kv, int kv_is_bf16, int64_t num_seqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               int64_t block_stride, const int32_t *block_tables, int64_t max_blocks,
                               const int32_t *seq_lens, float scale, void *out, float *scratch, int64_t max_len,
                               int threads);
#endif
