/*
 * The CPU kernels' entry points: every symbol the Python bindings load (their ctypes declarations
 * are the _declare functions of pdserve/kernels/cpu/), and what decoder_layer.c calls to run a
 * whole decoder layer out of them, linked into one library (pdserve/kernels/cpu/build.py). Every
 * one starts with pd_; each function's contract is documented at its definition (for a kernel
 * with an x86 version, at its portable twin NAME_generic: arch_fallback.h). What the .c files of
 * a family call across files is declared in quants.h, repack.h and attention.h.
 */
#ifndef PDSERVE_KERNELS_H
#define PDSERVE_KERNELS_H
#include <stdint.h>

/* quants.c (arch/x86/quants.c): row-major GGUF blocks against fp32 or bf16 activations */
int pd_quant_matmul(int kind, const void *x, int x_is_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                    void *y, int y_is_bf16, int threads);
void pd_quant_dequant(int kind, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, void *out,
                      int out_is_bf16, int threads);

/* quants_a8.c (arch/x86/quants_a8.c): the same against activations quantized to int8 */
int pd_quant_matmul_a8(int kind, const void *x, int x_is_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                       void *y, int y_is_bf16, int threads);

/* quants_k.c: whether the kinds held as GGUF stores them run a vector kernel here */
int pd_quant_k_route(void);

/* repack_a8.c, repack_bf16.c: whether blocks repacked 16 rows at a time run a vector kernel here */
int pd_repack_a8_route(void);
int pd_repack_bf16_route(void);

/* causal_attention.c (arch/x86/causal_attention.c) */
int pd_causal_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                             const uint16_t *v, int64_t v_stride, int64_t Lq, int64_t L, int64_t Hq, int64_t Hkv,
                             int64_t D, float scale, int64_t window, uint16_t *out, int64_t out_stride, int threads);

/* layer_ops.c */
void pd_rms_norm(const void *x, const void *delta, void *sum_out, const void *weight, void *out, int64_t rows,
                 int64_t dim, float eps, int is_bf16, int weight_f32);
void pd_rope_and_cache(void *qkv, int is_bf16, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       const void *cos, const void *sin_signed, void *cache, int cache_is_bf16,
                       const int64_t *slots, int64_t block_size, int64_t block_stride, int64_t half_stride);
void pd_silu_mul(const void *gate_up, void *act, int64_t rows, int64_t inter, int is_bf16);
void pd_gelu_tanh_mul(const void *gate_up, void *act, int64_t rows, int64_t inter, int is_bf16);

/* paged_attention.c (arch/x86/paged_attention.c) */
void pd_paged_decode_attention(const void *q, int q_is_bf16, const void *kv, int kv_is_bf16, int64_t num_seqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               int64_t block_stride, const int32_t *block_tables, int64_t max_blocks,
                               const int32_t *seq_lens, int64_t window, float scale, void *out, float *scratch,
                               int64_t max_len, int threads);
int pd_paged_attention_vector_lanes(void);

/* decoder_layer.c */
typedef struct PdDecoderLayer PdDecoderLayer;
int pd_decoder_layers(const PdDecoderLayer *layers, int64_t count, int64_t layer_stride, int is_bf16,
                      const void *hidden_in, void *hidden_out, int64_t rows, const void *cos, const void *sin_signed,
                      void *cache, int cache_is_bf16, int64_t block_size, int64_t block_stride, int64_t half_stride,
                      const int64_t *slots, const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                      int threads);
#endif
