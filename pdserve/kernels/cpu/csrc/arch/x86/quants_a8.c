/*
 * The x86 kernels of quants_a8.c's int8-activation matmuls (its header says what they compute,
 * and why the AVX2 ones exist): x's quantization with AVX-512; the AVX2 kernels (vpmaddubsw, two
 * Q4_1 blocks a step: pair_q4_1_a8); and, on CPUs with AVX512-VNNI (AMD Zen 4/5, Intel Ice Lake
 * on), the 512-bit vpdpbusd kernels, which take both kinds instead: Q4_1 four blocks a step, Q8_0
 * two. Each public function is the native twin of quants_a8.c's NAME_generic (quants.h); where a
 * build has none, the twin runs (arch_fallback.h), and a section's code compiles to nothing.
 *
 * Why VNNI: vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and adds each four products into
 * an int32 lane in one instruction, with no int16 stage to saturate. A Q4_1 weight is an
 * unsigned nibble (0-15) and x's int8 is signed: exactly its operands. Four blocks' 64 nibble
 * bytes are one load; their low nibbles (each block's elements 0-15) meet x's first halves,
 * the high ones its second halves, and the two vpdpbusd land every block's dot in its own four
 * int32 lanes (block i of the four in lanes 4i-4i+3), which one conversion and one fma scale by
 * that block's dw d. Per four blocks and row of x: two vpdpbusd, a conversion, a permute of the
 * scales and an fma, where the AVX2 kernel takes that for two.
 *
 * x's int8 is given in "quad order" (quad_order): per four blocks, their first halves, then
 * their second halves; a row's last, partial quad padded with zeros, so that whatever the nibble
 * bytes read there are, they add nothing. Scales come 16 blocks at a time (d, and x's d and s,
 * padded with zeros to a multiple of 16 blocks); the minima's part m s is added per 16 blocks.
 *
 * Q8_0 (the LM head, and every matrix of --quantization int8-a8) runs two blocks a step: their
 * signed weights become unsigned by flipping the top bit (w + 128), and x's part of that,
 * -128 times the sum of each four of x's int8, is where the int32 lanes start (q8_0_x
 * keeps it beside x), so vpdpbusd leaves the exact signed dot. A row's 16 scales are one
 * gather (they sit at the start of each 34-byte block).
 *
 * Every (weight row, row of x) pair sums in the same order whatever the tile it is computed in,
 * so a request's logits do not depend on what it is batched with.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "isa.h"
#include "prefetch.h"
#include "avx2.h"
#include "bf16.h"
#include "blocks.h"
#include "quants.h"
#include <omp.h>

#if PD_HAS_AVX512
/* x [M, K] (bf16 or fp32) per block of 32: q [M, K] int8, d and s [M, stride] fp32 (zero past
 * the row's blocks, so that loads of 8 or 16 blocks' scales stay in bounds), as quants_a8.c's
 * header says.
 * With AVX-512 a block is two vectors, with the same operations in the same order as the plain
 * loop (IEEE division and product, rounding to nearest even), so both give the same bits. */
void pd_quant_a8_quantize(const void *x, int x_is_bf16, int64_t M, int64_t K, int8_t *q, float *d, float *s,
                          int64_t stride) {
    const int64_t blocks = K / QK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t first = r * K + b * QK;
            __m512 lo, hi;
            if (x_is_bf16) {
                lo = bf16x16_to_fp32((const uint16_t *)x + first);
                hi = bf16x16_to_fp32((const uint16_t *)x + first + 16);
            } else {
                lo = _mm512_loadu_ps((const float *)x + first);
                hi = _mm512_loadu_ps((const float *)x + first + 16);
            }
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
            const __m512 inv = _mm512_set1_ps(inverse);
            const __m512i q_lo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m512i q_hi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm_storeu_si128((__m128i *)(q + first), _mm512_cvtepi32_epi8(q_lo));
            _mm_storeu_si128((__m128i *)(q + first + 16), _mm512_cvtepi32_epi8(q_hi));
            const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
            d[r * stride + b] = scale;
            s[r * stride + b] = scale * (float)sum;
        }
}
#endif

#if PD_HAS_AVX2 && !PD_HAS_AVX512_VNNI /* with VNNI, the kernels below take both kinds */
/* Rows of x one pass over a weight row serves (each holds an accumulator and its scales), and
 * weight rows one pass serves at M == 1 (four independent chains hide the fma latency). */
#define A8_ROWS_PER_TILE 4
#define A8_COLS_PER_TILE 4

/* x's int8 [M, K] in the order pair_q4_1_a8 reads two Q4_1 blocks in: for blocks 2p and 2p + 1,
 * their first halves (elements 0-15 of each), then their second halves (16-31). A row's last
 * block, when its count is odd, stays as it is. */
static void pair_order(int8_t *q, int64_t M, int64_t K) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t p = 0; p + 2 * QK <= K; p += 2 * QK) {
            int8_t *pair = q + r * K + p, middle[16];
            memcpy(middle, pair + 16, 16);      /* block 2p's second half */
            memcpy(pair + 16, pair + 32, 16);   /* block 2p + 1's first half */
            memcpy(pair + 32, middle, 16);
        }
}

/* A Q4_1 block's 32 nibbles as bytes 0-15 in element order: the low nibbles are elements 0-15,
 * the high ones 16-31 (GGUF's order), so one and over both halves lines them up with x. */
static inline __m256i q4_1_bytes(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}

/* The exact integer dot of 32 unsigned weights (0-15) with 32 int8 x, as 8 fp32 partial sums. */
static inline __m256 dot_u8(__m256i w, const int8_t *xq) {
    const __m256i pairs = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)xq));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* The same for 32 signed weights (Q8_0): vpmaddubsw takes |w| and x with w's sign (pairs stay
 * within int16: 2 * 128 * 127). */
static inline __m256 dot_s8(__m256i w, const int8_t *xq) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* The quantized x the kernels read: q [M, K], d and s [M, stride]. */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    int64_t stride, K;
} QuantizedX;

/* Q8_0 block b of one weight row against one row of x (xq: its int8, xd: its scales), into acc:
 * acc += dw d * (q . xq). */
static inline __attribute__((always_inline)) __m256 block_q8_0_a8(const uint8_t *w_row, int64_t b, const int8_t *xq,
                                                                  const float *xd, __m256 acc) {
    const uint8_t *block = w_row + b * Q8_0_BYTES;
    const __m256 scale = _mm256_set1_ps(fp16_to_fp32(*(const uint16_t *)block) * xd[b]);
    return _mm256_fmadd_ps(dot_s8(_mm256_loadu_si256((const __m256i *)(block + 2)), xq + b * QK), scale, acc);
}

/* Q4_1 blocks b and b + 1 (b even) of one weight row against x's pair of blocks there (in pair
 * order, see pair_order), into acc: lanes 0-3 take block b's products with dw d from lane `lane`
 * of dd, lanes 4-7 block b + 1's with lane `lane` + 1. Two blocks' 32 nibble bytes are one load:
 * their low nibbles meet x's first halves, the high ones its second halves, and the two
 * vpmaddubsw results add in int16 (at most 2 * 2 * 15 * 127) before one vpmaddwd, one
 * conversion and one fma: half the instructions of a block at a time. */
static inline __attribute__((always_inline)) __m256 pair_q4_1_a8(const uint8_t *w_row, int64_t b, __m256 dd,
                                                                 int lane, const int8_t *xq, __m256 acc) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(w_row + b * 16)), low = _mm256_set1_epi8(15);
    const __m256i first = _mm256_and_si256(raw, low), second = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    const int8_t *x = xq + b * QK;
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, _mm256_loadu_si256((const __m256i *)x)),
                                           _mm256_maddubs_epi16(second, _mm256_loadu_si256((const __m256i *)(x + 32))));
    const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    const __m256i lanes = _mm256_set_epi32(lane + 1, lane + 1, lane + 1, lane + 1, lane, lane, lane, lane);
    return _mm256_fmadd_ps(dots, _mm256_permutevar8x32_ps(dd, lanes), acc);
}

/* A Q4_1 row's last block when the row has an odd count (x in natural order there), lane `lane`
 * of dd: a block at a time. */
static inline __attribute__((always_inline)) __m256 last_q4_1_a8(const uint8_t *w_row, int64_t b, __m256 dd,
                                                                 int lane, const int8_t *xq, __m256 acc) {
    const __m256 scale = _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(lane));
    return _mm256_fmadd_ps(dot_u8(q4_1_bytes(w_row + b * 16), xq + b * QK), scale, acc);
}

/* At Q4_1 block b (a multiple of 8): each row's products of scales dw * d for the window of 8
 * blocks into dd, and the window's minima (m s) into each row's accumulator. Returns the window's
 * first block (group_start_avx2 moves it back at the row's end). */
static inline __attribute__((always_inline)) int64_t q4_1_group(const uint8_t *w_row, int64_t blocks, int64_t b,
                                                                QuantizedX x, int rows, __m256 *dd, __m256 *acc) {
    __m256 dw;
    const int64_t base = group_start_avx2(w_row, x.K, blocks, b, x.s, x.stride, rows, &dw, acc);
    for (int r = 0; r < rows; r++) dd[r] = _mm256_mul_ps(dw, _mm256_loadu_ps(x.d + r * x.stride + base));
    return base;
}

/* The cache lines of the 8 blocks from b of the row `ahead` rows on (tiles of 4 rows: two tiles
 * on), fetched while this tile computes; with one weight row a tile, the bytes ROW_PREFETCH_BYTES
 * on. Two tiles ahead: SmolLM2's 120 layer matrices at one row of x took 1.33-1.37x a pure read
 * of their bytes, against 1.37-1.49x one tile ahead (three and eight tiles: no better). */
static inline __attribute__((always_inline)) void prefetch_group(int kind, const uint8_t *w_row, int64_t row_bytes,
                                                                 int64_t K, int64_t blocks, int64_t b, int ahead) {
    const uint8_t *next = ahead ? w_row + ahead * row_bytes : w_row + ROW_PREFETCH_BYTES;
    if (kind == 0) { /* 128 bytes of nibbles; the scales and minima every 32 blocks */
        _mm_prefetch((const char *)(next + b * 16), WEIGHT_HINT);
        _mm_prefetch((const char *)(next + b * 16 + 64), WEIGHT_HINT);
        if (b % 32 == 0) {
            _mm_prefetch((const char *)(next + K / 2 + b * 2), WEIGHT_HINT);
            _mm_prefetch((const char *)(next + K / 2 + (blocks + b) * 2), WEIGHT_HINT);
        }
    } else { /* 272 bytes */
        for (int line = 0; line < 5; line++)
            _mm_prefetch((const char *)(next + b * Q8_0_BYTES + line * 64), WEIGHT_HINT);
    }
}

/*
 * `cols` weight rows (from w, row_bytes apart) against `rows` rows of x, cols * rows <= 4 (both
 * constants once inlined): dot[c * rows + r]. Each pair sums in one chain of fmas, in order (Q4_1:
 * two blocks a step, its minima added at the start of each window of 8; Q8_0: a block a step): the
 * same operations in the same order whatever the tile, so a row's logits do not depend on its
 * batch. Whole windows run unrolled with their scales' lanes as constants (a lane index moved
 * from a general register per block cost more than the block's arithmetic); the rest of the row
 * runs a step at a time.
 */
static inline __attribute__((always_inline)) void tile_a8(int kind, const uint8_t *w, int64_t row_bytes,
                                                          int64_t blocks, QuantizedX x, int cols, int rows,
                                                          float *dot) {
    __m256 acc[4], dd[4];
    for (int i = 0; i < cols * rows; i++) acc[i] = dd[i] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++) {
            const uint8_t *w_row = w + c * row_bytes;
            prefetch_group(kind, w_row, row_bytes, x.K, blocks, b, cols > 1 ? 2 * cols : 0); /* two tiles on */
            if (kind == 0) q4_1_group(w_row, blocks, b, x, rows, dd + c * rows, acc + c * rows);
        }
        if (kind == 0) {
#pragma GCC unroll 4
            for (int k = 0; k < 8; k += 2)
#pragma GCC unroll 4
                for (int c = 0; c < cols; c++)
#pragma GCC unroll 4
                    for (int r = 0; r < rows; r++)
                        acc[c * rows + r] = pair_q4_1_a8(w + c * row_bytes, b + k, dd[c * rows + r], k,
                                                         x.q + r * x.K, acc[c * rows + r]);
        } else {
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
#pragma GCC unroll 4
                for (int c = 0; c < cols; c++)
#pragma GCC unroll 4
                    for (int r = 0; r < rows; r++)
                        acc[c * rows + r] = block_q8_0_a8(w + c * row_bytes, b + k, x.q + r * x.K,
                                                          x.d + r * x.stride, acc[c * rows + r]);
        }
    }
    if (b < blocks) { /* the last blocks, fewer than 8: Q4_1's window is moved back (q4_1_group) */
        int64_t base = b;
        for (int c = 0; c < cols; c++)
            if (kind == 0) base = q4_1_group(w + c * row_bytes, blocks, b, x, rows, dd + c * rows, acc + c * rows);
        for (; b < blocks; b += kind == 0 && b + 1 < blocks ? 2 : 1)
            for (int c = 0; c < cols; c++)
                for (int r = 0; r < rows; r++) {
                    __m256 *sum = acc + c * rows + r;
                    const uint8_t *w_row = w + c * row_bytes;
                    if (kind != 0)
                        *sum = block_q8_0_a8(w_row, b, x.q + r * x.K, x.d + r * x.stride, *sum);
                    else if (b + 1 < blocks)
                        *sum = pair_q4_1_a8(w_row, b, dd[c * rows + r], (int)(b - base), x.q + r * x.K, *sum);
                    else
                        *sum = last_q4_1_a8(w_row, b, dd[c * rows + r], (int)(b - base), x.q + r * x.K, *sum);
                }
    }
    for (int i = 0; i < cols * rows; i++) dot[i] = hsum_avx2(acc[i]);
}

#define A8_TILE_CASE(KIND, COLS, ROWS) \
    case ROWS:                         \
        tile_a8(KIND, w, row_bytes, blocks, x, COLS, ROWS, dot); \
        break;
/* tile_a8 with (kind, cols, rows) as constants, so its loops unroll into registers: a tile of
 * A8_COLS_PER_TILE Q4_1 weight rows at one row of x, else one weight row at 1-A8_ROWS_PER_TILE
 * (Q8_0 at one row too: the LM head, bound by memory, was no faster in tiles of 4). */
static void tile_a8_dispatch(int kind, const uint8_t *w, int64_t row_bytes, int64_t blocks, QuantizedX x, int cols,
                             int rows, float *dot) {
    if (cols == A8_COLS_PER_TILE) {
        tile_a8(0, w, row_bytes, blocks, x, A8_COLS_PER_TILE, 1, dot);
    } else if (kind == 0) {
        switch (rows) { A8_TILE_CASE(0, 1, 1) A8_TILE_CASE(0, 1, 2) A8_TILE_CASE(0, 1, 3) A8_TILE_CASE(0, 1, 4) }
    } else {
        switch (rows) { A8_TILE_CASE(1, 1, 1) A8_TILE_CASE(1, 1, 2) A8_TILE_CASE(1, 1, 3) A8_TILE_CASE(1, 1, 4) }
    }
}

static void matmul_a8(int kind, QuantizedX x, int64_t M, const uint8_t *w, int64_t N, void *y, int y_is_bf16,
                      int threads) {
    const int64_t blocks = x.K / QK, row_bytes = blocks * block_bytes(kind);
    if (M == 1 && kind == 0) { /* tiles of A8_COLS_PER_TILE weight rows: independent chains hide the fma latency */
        const int64_t tiles = (N + A8_COLS_PER_TILE - 1) / A8_COLS_PER_TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n0 = tile * A8_COLS_PER_TILE;
            float dot[A8_COLS_PER_TILE];
            if (n0 + A8_COLS_PER_TILE <= N)
                tile_a8_dispatch(kind, w + n0 * row_bytes, row_bytes, blocks, x, A8_COLS_PER_TILE, 1, dot);
            else /* the last, partial tile: a row at a time, summed alike */
                for (int64_t n = n0; n < N; n++)
                    tile_a8_dispatch(kind, w + n * row_bytes, row_bytes, blocks, x, 1, 1, dot + (n - n0));
            for (int64_t n = n0; n < N && n < n0 + A8_COLS_PER_TILE; n++) put_f32(y, y_is_bf16, n, dot[n - n0]);
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        float dot[A8_ROWS_PER_TILE];
        for (int64_t m0 = 0; m0 < M; m0 += A8_ROWS_PER_TILE) {
            const int rows = (int)(M - m0 < A8_ROWS_PER_TILE ? M - m0 : A8_ROWS_PER_TILE);
            QuantizedX tile = x;
            tile.q += m0 * x.K;
            tile.d += m0 * x.stride;
            tile.s += m0 * x.stride;
            tile_a8_dispatch(kind, w + n * row_bytes, row_bytes, blocks, tile, 1, rows, dot);
            for (int r = 0; r < rows; r++) put_f32(y, y_is_bf16, (m0 + r) * N + n, dot[r]);
        }
    }
}

/* The int8-activation matmul with AVX2 (no VNNI): Q4_1's x put in pair order, then tiles. */
int pd_quant_a8_gemm(int kind, int8_t *q, const float *d, const float *s, int64_t stride, int64_t M, int64_t K,
                     const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    if (kind == 0) pair_order(q, M, K);
    const QuantizedX quantized = {q, d, s, stride, K};
    matmul_a8(kind, quantized, M, w, N, y, y_is_bf16, threads);
    return 0;
}
#endif

#if PD_HAS_AVX512_VNNI
/* Weight rows a tile serves at one row of x (independent chains hide the latency), and rows of x
 * a tile serves otherwise (each holds an accumulator and a scale vector: 16 of 32 registers). */
#define VNNI_COLS_PER_TILE 4
#define VNNI_ROWS_PER_TILE 8

/* x as the kernels read it: int8 q [M, q_stride] (Q4_1: quad order; Q8_0: natural order, padded,
 * with each int32 lane's starting sum in start [M, q_stride / 4]), its scales d and scaled sums s
 * [M, stride]. */
typedef struct {
    const int8_t *q;
    const int32_t *start;
    const float *d, *s;
    int64_t q_stride, stride, K;
} VnniX;

/* x's int8 [M, K] (natural order) into quad order [M, quad_stride] (see the header). */
static void quad_order(const int8_t *q, int64_t M, int64_t K, int8_t *out, int64_t quad_stride) {
    const int64_t blocks = K / QK;
    memset(out, 0, (size_t)(M * quad_stride));
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            int8_t *quad = out + r * quad_stride + (b / 4) * 4 * QK;
            const int8_t *block = q + r * K + b * QK;
            memcpy(quad + (b % 4) * 16, block, 16);
            memcpy(quad + 64 + (b % 4) * 16, block + 16, 16);
        }
}

/* The nibble bytes of `count` (1-4) blocks from qs, zero-extended to 64: plain loads (a masked
 * one, streamed from memory, was several times slower on a Zen 5), never past the blocks. */
static inline __m512i quad_bytes(const uint8_t *qs, int64_t count) {
    if (count >= 4) return _mm512_loadu_si512(qs);
    const __m256i first = count >= 2 ? _mm256_loadu_si256((const __m256i *)qs)
                                     : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    const __m256i second = count == 3 ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(qs + 32)))
                                      : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_zextsi256_si512(first), second, 1);
}

/* Lanes 4i-4i+3 read lane 4k + i of the 16 blocks' scales: quad k's four blocks. */
static inline __m512i quad_lanes(int k) {
    return _mm512_add_epi32(_mm512_set1_epi32(4 * k),
                            _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
}

/* `cols` weight rows (row_bytes apart) against `rows` rows of quad-ordered x: dot[c * rows + r]. */
static inline __attribute__((always_inline)) void tile_vnni(const uint8_t *w, int64_t row_bytes, VnniX x, int cols,
                                                            int rows, float *dot) {
    const int64_t K = x.K, blocks = K / QK;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[VNNI_ROWS_PER_TILE], dd[VNNI_ROWS_PER_TILE]; /* cols * rows <= VNNI_ROWS_PER_TILE */
    for (int i = 0; i < cols * rows; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < blocks; g += 16) {
        const int64_t in_group = blocks - g < 16 ? blocks - g : 16;
        const __mmask16 group_mask = (__mmask16)((1u << in_group) - 1);
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++) {
            const uint8_t *w_row = w + c * row_bytes;
            const uint16_t *d_all = (const uint16_t *)(w_row + K / 2), *m_all = d_all + blocks;
            /* the rows eight tiles on (one row a tile: 4 KB on), while this tile computes: the
             * 120 layer matrices at one row of x, streamed, took 3.2-3.5 ms two tiles ahead,
             * 2.5-2.6 eight ahead (2.6-2.75 four, 2.5-2.65 sixteen; one Zen 5 core) */
            const uint8_t *next = cols > 1 ? w_row + 8 * cols * row_bytes : w_row + ROW_PREFETCH_BYTES;
            for (int line = 0; line < 4; line++) _mm_prefetch((const char *)(next + g * 16 + line * 64), WEIGHT_HINT);
            if (g % 32 == 0) {
                _mm_prefetch((const char *)(next + K / 2 + g * 2), WEIGHT_HINT);
                _mm_prefetch((const char *)(next + K / 2 + (blocks + g) * 2), WEIGHT_HINT);
            }
            const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(group_mask, d_all + g));
            const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(group_mask, m_all + g));
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                dd[c * rows + r] = _mm512_mul_ps(dw, _mm512_loadu_ps(x.d + r * x.stride + g));
                acc[c * rows + r] = _mm512_fmadd_ps(m, _mm512_loadu_ps(x.s + r * x.stride + g), acc[c * rows + r]);
            }
        }
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            if (4 * k >= in_group) break;
            const __m512i lanes = quad_lanes(k);
#pragma GCC unroll 4
            for (int c = 0; c < cols; c++) {
                const __m512i raw = quad_bytes(w + c * row_bytes + (g + 4 * k) * 16, in_group - 4 * k);
                const __m512i first = _mm512_and_si512(raw, low);
                const __m512i second = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
#pragma GCC unroll 8
                for (int r = 0; r < rows; r++) {
                    const int8_t *xq = x.q + r * x.q_stride + (g + 4 * k) * QK;
                    __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), first, _mm512_loadu_si512(xq));
                    dots = _mm512_dpbusd_epi32(dots, second, _mm512_loadu_si512(xq + 64));
                    const __m512 scale = _mm512_permutexvar_ps(lanes, dd[c * rows + r]);
                    acc[c * rows + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scale, acc[c * rows + r]);
                }
            }
        }
    }
    for (int i = 0; i < cols * rows; i++) dot[i] = _mm512_reduce_add_ps(acc[i]);
}

/* x's int8 [M, K] for the Q8_0 kernel: rows padded with zeros to `padded` (a multiple of 64), and
 * beside them where each int32 lane of vpdpbusd starts: -128 times the sum of its four bytes of x
 * ([M, padded / 4]), which takes back the 128 added to every weight. */
static void q8_0_x(const int8_t *q, int64_t M, int64_t K, int8_t *out, int32_t *start, int64_t padded) {
    memset(out, 0, (size_t)(M * padded));
    memset(start, 0, (size_t)(M * padded / 4) * sizeof(int32_t));
    for (int64_t r = 0; r < M; r++) {
        memcpy(out + r * padded, q + r * K, (size_t)K);
        for (int64_t j = 0; j < K / 4; j++) {
            const int8_t *four = q + r * K + 4 * j;
            start[r * padded / 4 + j] = -128 * (four[0] + four[1] + four[2] + four[3]);
        }
    }
}

/* The scales of `count` (1-16) Q8_0 blocks from `row`, as fp32: a gather of the dword at each
 * block's start (its fp16 d and two weights), cut to 16 bits. */
static inline __m512 q8_0_scales(const uint8_t *row, int64_t count) {
    const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(Q8_0_BYTES));
    const __mmask16 live = (__mmask16)((1u << count) - 1);
    const __m512i dwords = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, row, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dwords));
}

/* Two Q8_0 blocks' 64 weights from `block` (the second only when `both`), each plus 128. */
static inline __m512i q8_0_pair(const uint8_t *block, int both) {
    const __m256i first = _mm256_loadu_si256((const __m256i *)(block + 2));
    const __m256i second = both ? _mm256_loadu_si256((const __m256i *)(block + Q8_0_BYTES + 2)) : _mm256_setzero_si256();
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1), _mm512_set1_epi8((char)0x80));
}

/* `cols` Q8_0 weight rows against `rows` rows of padded x: dot[c * rows + r]. */
static inline __attribute__((always_inline)) void tile_q8_0_vnni(const uint8_t *w, int64_t row_bytes, VnniX x,
                                                                 int cols, int rows, float *dot) {
    const int64_t blocks = x.K / QK;
    __m512 acc[VNNI_ROWS_PER_TILE], dd[VNNI_ROWS_PER_TILE]; /* cols * rows <= VNNI_ROWS_PER_TILE */
    for (int i = 0; i < cols * rows; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < blocks; g += 16) {
        const int64_t in_group = blocks - g < 16 ? blocks - g : 16;
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++) {
            const uint8_t *group = w + c * row_bytes + g * Q8_0_BYTES;
            const uint8_t *next = cols > 1 ? group + 8 * cols * row_bytes : group + ROW_PREFETCH_BYTES;
            for (int line = 0; line < 9; line++) _mm_prefetch((const char *)(next + line * 64), WEIGHT_HINT);
            const __m512 dw = q8_0_scales(group, in_group);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) dd[c * rows + r] = _mm512_mul_ps(dw, _mm512_loadu_ps(x.d + r * x.stride + g));
        }
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            if (2 * k >= in_group) break;
            const __m512i lanes = _mm512_set_epi32(2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1,
                                                   2 * k + 1, 2 * k + 1, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k,
                                                   2 * k, 2 * k);
#pragma GCC unroll 4
            for (int c = 0; c < cols; c++) {
                const __m512i pair = q8_0_pair(w + c * row_bytes + (g + 2 * k) * Q8_0_BYTES, 2 * k + 1 < in_group);
#pragma GCC unroll 8
                for (int r = 0; r < rows; r++) {
                    const int64_t at = r * x.q_stride + (g + 2 * k) * QK;
                    const __m512i dots = _mm512_dpbusd_epi32(_mm512_loadu_si512(x.start + at / 4), pair,
                                                             _mm512_loadu_si512(x.q + at));
                    const __m512 scale = _mm512_permutexvar_ps(lanes, dd[c * rows + r]);
                    acc[c * rows + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scale, acc[c * rows + r]);
                }
            }
        }
    }
    for (int i = 0; i < cols * rows; i++) dot[i] = _mm512_reduce_add_ps(acc[i]);
}

/* A tile of `cols` weight rows (VNNI_COLS_PER_TILE, at one row of x) or of one weight row against
 * `rows` rows of x (1-VNNI_ROWS_PER_TILE), with the kind, cols and rows as constants, so that the
 * tile's loops unroll into registers. */
static inline __attribute__((always_inline)) void tile_dispatch(int kind, const uint8_t *w, int64_t row_bytes, VnniX x,
                                                                int cols, int rows, float *dot) {
#define VNNI_TILE(COLS, ROWS)                                      \
    do {                                                           \
        if (kind == 0)                                             \
            tile_vnni(w, row_bytes, x, COLS, ROWS, dot);           \
        else                                                       \
            tile_q8_0_vnni(w, row_bytes, x, COLS, ROWS, dot);      \
        return;                                                    \
    } while (0)
    if (cols == VNNI_COLS_PER_TILE) VNNI_TILE(VNNI_COLS_PER_TILE, 1);
    switch (rows) {
        case 1: VNNI_TILE(1, 1);
        case 2: VNNI_TILE(1, 2);
        case 3: VNNI_TILE(1, 3);
        case 4: VNNI_TILE(1, 4);
        case 5: VNNI_TILE(1, 5);
        case 6: VNNI_TILE(1, 6);
        case 7: VNNI_TILE(1, 7);
        default: VNNI_TILE(1, 8);
    }
#undef VNNI_TILE
}

/* y[M, N] over weight rows w of `kind` (0: Q4_1 rows, 1: Q8_0 blocks) and x as the kind's kernel
 * reads it (see VnniX; quad_order and q8_0_x make it). */
static void vnni_matmul(int kind, const int8_t *q, const int32_t *start, int64_t q_stride, const float *d,
                        const float *s, int64_t stride, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                        int y_is_bf16, int threads) {
    const int64_t row_bytes = K / QK * block_bytes(kind);
    const VnniX x = {q, start, d, s, q_stride, stride, K};
    if (M == 1) { /* tiles of VNNI_COLS_PER_TILE weight rows: independent chains hide the latency */
        const int64_t tiles = (N + VNNI_COLS_PER_TILE - 1) / VNNI_COLS_PER_TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n0 = tile * VNNI_COLS_PER_TILE;
            float dot[VNNI_COLS_PER_TILE];
            if (n0 + VNNI_COLS_PER_TILE <= N)
                tile_dispatch(kind, w + n0 * row_bytes, row_bytes, x, VNNI_COLS_PER_TILE, 1, dot);
            else /* the last, partial tile: a row at a time, summed alike */
                for (int64_t n = n0; n < N; n++) tile_dispatch(kind, w + n * row_bytes, row_bytes, x, 1, 1, dot + (n - n0));
            for (int64_t n = n0; n < N && n < n0 + VNNI_COLS_PER_TILE; n++) put_f32(y, y_is_bf16, n, dot[n - n0]);
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += VNNI_ROWS_PER_TILE) {
            const int rows = (int)(M - m0 < VNNI_ROWS_PER_TILE ? M - m0 : VNNI_ROWS_PER_TILE);
            VnniX tile = x;
            tile.q += m0 * q_stride;
            tile.start = start ? start + m0 * q_stride / 4 : NULL;
            tile.d += m0 * stride;
            tile.s += m0 * stride;
            float dot[VNNI_ROWS_PER_TILE];
            tile_dispatch(kind, w + n * row_bytes, row_bytes, tile, 1, rows, dot);
            for (int r = 0; r < rows; r++) put_f32(y, y_is_bf16, (m0 + r) * N + n, dot[r]);
        }
}

/* The int8-activation matmul with AVX512-VNNI, over x quantized into q (natural order), d and s:
 * Q4_1 reads x in quad order, Q8_0 padded, with its lanes' starting sums. Returns 0, or -1 when
 * a buffer could not be allocated. */
int pd_quant_a8_gemm(int kind, int8_t *q, const float *d, const float *s, int64_t stride, int64_t M, int64_t K,
                     const uint8_t *w, int64_t N, void *y, int y_is_bf16, int threads) {
    const int64_t blocks = K / QK;
    if (kind == 0) {
        const int64_t quad_stride = (blocks + 3) / 4 * 4 * QK;
        int8_t *quads = (int8_t *)malloc((size_t)(M * quad_stride));
        if (quads == NULL) return -1;
        quad_order(q, M, K, quads, quad_stride);
        vnni_matmul(0, quads, NULL, quad_stride, d, s, stride, M, K, w, N, y, y_is_bf16, threads);
        free(quads);
        return 0;
    }
    const int64_t padded = (blocks + 1) / 2 * 2 * QK;
    int8_t *xq = (int8_t *)malloc((size_t)(M * padded));
    int32_t *start = (int32_t *)malloc((size_t)(M * padded / 4) * sizeof(int32_t));
    if (xq == NULL || start == NULL) {
        free(xq);
        free(start);
        return -1;
    }
    q8_0_x(q, M, K, xq, start, padded);
    vnni_matmul(1, xq, start, padded, d, s, stride, M, K, w, N, y, y_is_bf16, threads);
    free(xq);
    free(start);
    return 0;
}
#endif
