/*
 * A whole Llama decoder layer for a batch of decode tokens, as one call: the layer the model's
 * torch code runs op by op (the model's llama.py), over weights held as GGUF blocks.
 *
 * Why: at one sequence a decode step of SmolLM2-135M is 30 layers of a dozen small ops each
 * (norms, four projections, RoPE and the KV write, attention, SiLU, residual adds). Each op was
 * already one C call, but each call still costs its Python around it (the module call, the
 * ctypes marshalling, an output tensor): 9-12 ms of a 34 ms step on the AMD EPYC (Zen 3) here,
 * a third of the step, doing no arithmetic. Here a layer is one call, and so is a run of
 * layers (pd_decoder_layers): a pass marshals its tensors once (cpu_decoder_layer.FusedPass) and
 * calls C once per run between the engine's input polls, all 30 layers where nothing polls. One
 * call a layer still left 2.5-4 ms of Python in a 15-20 ms step; a call for all of them, 1.1-1.4.
 *
 * The ops are the same C functions the per-op path calls (kernels.h), in the same order and
 * with the same roundings to the activations' dtype, so a row's result is the per-op path's bit
 * for bit.
 * Like the per-op path, a row's result does not depend on the rows batched with it.
 *
 *   normed = rms_norm(h)                       input_layernorm
 *   qkv    = normed @ Wqkv^T (+ bias)          self_attn.qkv_proj
 *   [q, k heads each rms_norm'd]               qk-norm (Qwen3, Gemma 3)
 *   RoPE on q, k; k, v into the cache          pd_rope_and_cache (the layer's table)
 *   attn   = paged decode attention(q)         pd_paged_decode_attention (the layer's window)
 *   o      = attn @ Wo^T [then rms_norm'd]     (Gemma 3's post_attention_layernorm)
 *   h'     = h + o                             residual
 *   normed = rms_norm(h')                      post_attention_layernorm (Gemma 3: pre_feedforward)
 *   act    = silu(gate) * up, [gate up] = normed @ Wgate_up^T   (Gemma 3: gelu_tanh)
 *   out    = h' + act @ Wdown^T [rms_norm'd]   (Gemma 3's post_feedforward_layernorm)
 *
 * Gemma 3's norms scale by 1 + w in fp32 and round once (pd_rms_norm's weight_f32); Llama's
 * round the normed value to the dtype first. With none of the bracketed parts it is Llama's
 * layer (Mistral's and Qwen2's: a window, a q/k/v bias).
 *
 * Built at first use with the host compiler and -march=native together with the sources it
 * calls (pdserve/kernels/cpu/build.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "bf16.h"
#include "kernels.h"

/* A projection's weight: its output rows as up to PD_WEIGHT_PARTS ranges of GGUF block rows,
 * each of its own kind (as pd_quant_matmul takes them): a q/k/v whose v llama.cpp kept in Q6_K
 * and its q and k in Q4_K (the "_M" mixes) is two parts, q and k in one. */
#define PD_WEIGHT_PARTS 3
typedef struct {
    const uint8_t *blocks[PD_WEIGHT_PARTS];
    int64_t rows[PD_WEIGHT_PARTS];
    int32_t kinds[PD_WEIGHT_PARTS];
    int32_t parts; /* 1 .. PD_WEIGHT_PARTS */
} PdWeight;

/* One layer's constants, filled once per layer by pdserve/kernels/cpu/decoder_layer.py (whose
 * ctypes Structure mirrors this one field for field). Weights are GGUF block rows (PdWeight);
 * norms and the bias are in the activations' dtype. int8_activations: the projections quantize their x to int8 (pd_quant_matmul_a8,
 * --quantization gguf-a8) instead of keeping it in the dtype (pd_quant_matmul). sliding_window:
 * the layer's attention window W (a token at p sees p - W < k <= p), 0 for full attention; it
 * may differ from layer to layer of a run (Gemma 3's local and global layers). */
struct PdDecoderLayer {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, sliding_window;
    float eps, scale;
    const void *input_norm, *post_norm; /* [hidden] */
    const void *qkv_bias;               /* [(heads + 2 * kv_heads) * head_dim] or NULL */
    PdWeight qkv, o, gate_up, down;
    int32_t int8_activations;
    /* Qwen3's and Gemma 3's parts (NULL and 0 for Llama's layer): */
    const void *q_norm, *k_norm;                            /* [head_dim] qk-norm, or NULL */
    const void *post_attention_norm, *post_feedforward_norm; /* [hidden] (Gemma 3), or NULL */
    int32_t norm_weight_f32; /* every norm's weight fp32, the product rounded once (Gemma 3) */
    int32_t activation;      /* ACTIVATION_SILU or ACTIVATION_GELU_TANH */
    int32_t rope_table;      /* which of the pass's RoPE tables the layer rotates by */
};
enum { ACTIVATION_SILU = 0, ACTIVATION_GELU_TANH = 1 };

/* The layer's RMSNorm (pd_rms_norm's contract), in its family's form. */
static void norm(const PdDecoderLayer *layer, const void *x, const void *delta, void *sum_out, const void *weight,
                 void *out, int64_t rows, int64_t dim, int is_bf16) {
    pd_rms_norm(x, delta, sum_out, weight, out, rows, dim, layer->eps, is_bf16, layer->norm_weight_f32);
}

/* pd_quant_matmul, or pd_quant_matmul_a8 when the layer's activations go to int8. Returns 0, or
 * what the kernel returned otherwise (-1: its buffers could not be allocated). */
static int matmul(const PdDecoderLayer *layer, int kind, const void *x, int is_bf16, int64_t rows, int64_t K,
                  const uint8_t *w, int64_t N, void *y, int threads) {
    if (layer->int8_activations) return pd_quant_matmul_a8(kind, x, is_bf16, rows, K, w, N, y, is_bf16, threads);
    return pd_quant_matmul(kind, x, is_bf16, rows, K, w, N, y, is_bf16, threads);
}

/* y [rows, N] = x [rows, K] @ W^T, W's parts one matmul each: a single part straight into y, more
 * each into `part_out` ([rows, its rows]) and then into its columns of y. */
static int project(const PdDecoderLayer *layer, const PdWeight *weight, const void *x, int is_bf16, int64_t rows,
                   int64_t K, int64_t N, void *y, char *part_out, int threads) {
    if (weight->parts == 1) return matmul(layer, weight->kinds[0], x, is_bf16, rows, K, weight->blocks[0], N, y, threads);
    const size_t es = is_bf16 ? 2 : 4;
    int status = 0;
    int64_t first = 0;
    for (int p = 0; p < weight->parts && status == 0; p++) {
        const int64_t width = weight->rows[p];
        status = matmul(layer, weight->kinds[p], x, is_bf16, rows, K, weight->blocks[p], width, part_out, threads);
        for (int64_t r = 0; r < rows; r++)
            memcpy((char *)y + (r * N + first) * es, part_out + r * width * es, (size_t)width * es);
        first += width;
    }
    return status;
}

/* a[i] = a[i] + b[i], rounded to the dtype (torch's elementwise add). */
static void add_into(void *a, const void *b, int is_bf16, int64_t count) {
    for (int64_t i = 0; i < count; i++) put_f32(a, is_bf16, i, get_f32(a, is_bf16, i) + get_f32(b, is_bf16, i));
}

/* The intermediates of one layer's pass over `rows` tokens, allocated once for a run of layers:
 * normed, qkv, q, attention out, o, gate_up, act, a part's output (in the activations' dtype),
 * and the attention's scores. */
typedef struct {
    char *buffer;
    float *scores;
} LayerScratch;

static int scratch_alloc(LayerScratch *scratch, const PdDecoderLayer *layer, int64_t rows, size_t es,
                         int attn_threads, int64_t max_len) {
    const int64_t H = layer->hidden, D = layer->head_dim, I = layer->intermediate;
    const int64_t qkv_width = (layer->heads + 2 * layer->kv_heads) * D, q_width = layer->heads * D;
    const int64_t widest = qkv_width > 2 * I ? qkv_width : 2 * I; /* of a multi-part weight */
    const int64_t elems = rows * (H + qkv_width + 2 * q_width + H + 2 * I + I + (widest > H ? widest : H));
    scratch->buffer = (char *)malloc((size_t)elems * es);
    scratch->scores = (float *)malloc((size_t)(attn_threads * (max_len + 2 * D) * layer->heads) * sizeof(float));
    if (scratch->buffer == NULL || scratch->scores == NULL) {
        free(scratch->buffer);
        free(scratch->scores);
        return -1;
    }
    return 0;
}

/* One layer, hidden_in -> hidden_out (not aliased), its cache at `cache`: the header's formulas.
 * Returns 0, or -1 when an int8 kernel's buffers could not be allocated. */
static int run_layer(const PdDecoderLayer *layer, const LayerScratch *scratch, int is_bf16, const void *hidden_in,
                     void *hidden_out, int64_t rows, const void *cos, const void *sin_signed, void *cache,
                     int cache_is_bf16, int64_t block_size, int64_t block_stride, int64_t half_stride,
                     const int64_t *slots, const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                     int threads, int attn_threads) {
    const int64_t H = layer->hidden, heads = layer->heads, kv_heads = layer->kv_heads, D = layer->head_dim;
    const int64_t I = layer->intermediate, qkv_width = (heads + 2 * kv_heads) * D, q_width = heads * D;
    const int64_t max_len = max_blocks * block_size;
    const size_t es = is_bf16 ? 2 : 4;
    char *normed = scratch->buffer, *qkv = normed + rows * H * es, *q = qkv + rows * qkv_width * es;
    char *attn = q + rows * q_width * es, *o = attn + rows * q_width * es, *gate_up = o + rows * H * es;
    char *act = gate_up + rows * 2 * I * es, *part_out = act + rows * I * es;

    int status = 0;
    norm(layer, hidden_in, NULL, NULL, layer->input_norm, normed, rows, H, is_bf16);
    status |= project(layer, &layer->qkv, normed, is_bf16, rows, H, qkv_width, qkv, part_out, threads);
    if (status) return status; /* before the cache is written */
    if (layer->qkv_bias != NULL)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t n = 0; n < qkv_width; n++)
                put_f32(qkv, is_bf16, r * qkv_width + n,
                    get_f32(qkv, is_bf16, r * qkv_width + n) + get_f32(layer->qkv_bias, is_bf16, n));
    if (layer->q_norm != NULL) /* each q head, then each k head, in place */
        for (int64_t r = 0; r < rows; r++) {
            char *row = qkv + r * qkv_width * es;
            norm(layer, row, NULL, NULL, layer->q_norm, row, heads, D, is_bf16);
            norm(layer, row + q_width * es, NULL, NULL, layer->k_norm, row + q_width * es, kv_heads, D, is_bf16);
        }
    const size_t table = (size_t)(layer->rope_table * rows * D) * es; /* cos, sin: [tables, rows, D] */
    pd_rope_and_cache(qkv, is_bf16, rows, heads, kv_heads, D, (const char *)cos + table,
                      (const char *)sin_signed + table, cache, cache_is_bf16, slots, block_size, block_stride,
                      half_stride);
    for (int64_t r = 0; r < rows; r++) /* the q heads of each row, contiguous for the attention */
        memcpy(q + r * q_width * es, qkv + r * qkv_width * es, (size_t)q_width * es);
    pd_paged_decode_attention(q, is_bf16, cache, cache_is_bf16, rows, heads, kv_heads, D, block_size, block_stride,
                              block_tables, max_blocks, seq_lens, layer->sliding_window, layer->scale, attn,
                              scratch->scores, max_len, attn_threads);
    status |= project(layer, &layer->o, attn, is_bf16, rows, q_width, H, o, part_out, threads);
    if (layer->post_attention_norm != NULL) norm(layer, o, NULL, NULL, layer->post_attention_norm, o, rows, H, is_bf16);
    /* hidden_out = hidden_in + o, and its norm (one pass: vLLM's fused_add_rms_norm) */
    norm(layer, hidden_in, o, hidden_out, layer->post_norm, normed, rows, H, is_bf16);
    status |= project(layer, &layer->gate_up, normed, is_bf16, rows, H, 2 * I, gate_up, part_out, threads);
    if (layer->activation == ACTIVATION_GELU_TANH)
        pd_gelu_tanh_mul(gate_up, act, rows, I, is_bf16);
    else
        pd_silu_mul(gate_up, act, rows, I, is_bf16);
    status |= project(layer, &layer->down, act, is_bf16, rows, I, H, o, part_out, threads);
    if (layer->post_feedforward_norm != NULL)
        norm(layer, o, NULL, NULL, layer->post_feedforward_norm, o, rows, H, is_bf16);
    add_into(hidden_out, o, is_bf16, rows * H);
    return status;
}

/*
 * hidden_out[rows, hidden] = layers[0 .. count) applied in turn to hidden_in (rows decode tokens,
 * one per sequence; hidden_out may not alias hidden_in). Layer i's cache is `cache` plus i *
 * layer_stride elements (the engine's cache holds every layer of a block together), so a run of
 * layers is one call: the Python and the allocations around a call are paid once for the run,
 * not per layer. The layers must share their shapes (one model's). is_bf16: the activations'
 * dtype (hidden, cos, sin_signed, norms but Gemma's). cos and sin_signed: [tables, rows,
 * head_dim], each layer reading its rope_table's. The cache arguments are pd_rope_and_cache's and
 * pd_paged_decode_attention's for layer 0's view: slots [rows] int64, block_tables [rows,
 * max_blocks] int32, seq_lens [rows] int32 (including the new token).
 * Returns 0, or -1 when a buffer could not be allocated (nothing written to the cache then, unless
 * an int8 kernel's buffers failed after a K/V write: the step fails either way).
 */
int pd_decoder_layers(const PdDecoderLayer *layers, int64_t count, int64_t layer_stride, int is_bf16,
                      const void *hidden_in, void *hidden_out, int64_t rows, const void *cos, const void *sin_signed,
                      void *cache, int cache_is_bf16, int64_t block_size, int64_t block_stride, int64_t half_stride,
                      const int64_t *slots, const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                      int threads) {
    if (count <= 0 || rows <= 0) return 0;
    const int attn_threads = (int)(threads < rows * layers->kv_heads ? threads : rows * layers->kv_heads);
    const size_t es = is_bf16 ? 2 : 4;
    LayerScratch scratch;
    if (scratch_alloc(&scratch, layers, rows, es, attn_threads, max_blocks * block_size)) return -1;
    /* Layers alternate between hidden_out and a spare buffer, so that the last one writes
     * hidden_out. */
    void *spare = count > 1 ? malloc((size_t)(rows * layers->hidden) * es) : NULL;
    int status = count > 1 && spare == NULL ? -1 : 0;
    const void *from = hidden_in;
    for (int64_t i = 0; i < count && status == 0; i++) {
        void *to = (count - 1 - i) % 2 == 0 ? hidden_out : spare;
        status = run_layer(layers + i, &scratch, is_bf16, from, to, rows, cos, sin_signed,
                           (char *)cache + i * layer_stride * (cache_is_bf16 ? 2 : 4), cache_is_bf16, block_size,
                           block_stride, half_stride, slots, block_tables, max_blocks, seq_lens, threads,
                           attn_threads);
        from = to;
    }
    free(spare);
    free(scratch.buffer);
    free(scratch.scores);
    return status;
}
