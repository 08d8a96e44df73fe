/*
 * y = x · Wᵀ with W kept in GGUF's block-quantized form, for the products of decode.
 *
 * A decode step with few rows is bound by reading the weights: in float32 the projections
 * of a 135M model are ~0.5 GB per step. Q4_1 holds the same weights in ~0.6 bytes each
 * and Q8_0 in ~1.1, so these kernels read the quantized blocks and expand them in
 * registers. The expansion is the same float32 arithmetic as gguf's dequantization
 * (Q4_1: d * q + m, Q8_0: d * q, each a single rounding; this file is compiled as ISO
 * C, so that multiply and add are not fused), so the products use the very weights the
 * float32 path uses; only the sums differ (their order, and fused multiply-adds).
 *
 * Layouts (repacked at load time, rows in PyTorch's [out, in] order):
 *   Q4_1: qs  uint8 [N, K / 2]  per 32-weight block, 16 bytes: byte i holds weight i in
 *                               its low nibble and weight i + 16 in its high nibble
 *         dm  float [N, K / 32, 2]  the block's scale d and minimum m
 *   Q8_0: qs  int8  [N, K]
 *         d   float [N, K / 32]
 *   x float [M, K] and y float [M, N], both contiguous; K a multiple of 32.
 *
 * Two kernels, both split over output columns (rows of W), so that each thread streams its
 * share of the weights once. The few-row one (ts_*_linear_f32) multiplies every 32-weight
 * block into up to four rows of x as it expands it; the many-row one (ts_*_gemm_f32, N a
 * multiple of PANEL) expands a panel of weight rows once into a float32 buffer and runs a
 * GEMM micro-kernel over it for all rows of x. Both return 0, or 1 for shapes they refuse;
 * the many-row one 2 if its scratch buffer could not be allocated.
 *
 * On the amx level a third kernel (ts_*_gemm_amx, quant_amx.h; ts_*_gemm_amx_bf16 reads bf16
 * x and writes bf16 y) multiplies with a bfloat16 model's numerics instead: weights and x
 * rounded to bf16, float32 sums on AMX tiles, each rounded to bf16 at the end (as oneDNN's
 * bf16 GEMM hands its sums on). It returns 3 where AMX is not built or not granted
 * (ts_quant_amx_available says which). On the avx512_bf16 level (AVX512_BF16 without AMX)
 * ts_*_linear_dp (quant_dp.h) has those numerics by vdpbf16ps; it returns 3 on other
 * levels (ts_quant_dp_available). On every x86-64 level ts_linear_i8 (quant_i8.h) rounds
 * x to 8 bits per block and multiplies the blocks into it as integers (VNNI where the
 * level has it, else AVX2); 3 elsewhere (ts_quant_i8_available).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* syscall(), for the AMX permission (amx.h) */
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QUANT_AMX 1
#else
#define QUANT_AMX 0
#endif
/* The vdpbf16ps kernel with the same numerics where AVX512_BF16 comes without AMX. */
#if !QUANT_AMX && defined(__AVX512BF16__)
#define QUANT_DP 1
#else
#define QUANT_DP 0
#endif

#define BLOCK 32
/* The few-row kernel's tile: up to ROWS rows of x times one weight row (see tile()). */
#define ROWS 4
/* How many weight rows ahead the few-row kernel fetches into L2. */
#define PREFETCH_ROWS 4

/* Eight bytes widened to eight int32 lanes. GCC's generic vector conversion does this one
 * byte at a time, so x86 gets the one-instruction form. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline v8i widen_u8(const uint8_t *p) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    v8i out;
    memcpy(&out, &v, sizeof out);
    return out;
}
static inline v8i widen_s8(const int8_t *p) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    v8i out;
    memcpy(&out, &v, sizeof out);
    return out;
}
#else
static inline v8i widen_u8(const uint8_t *p) {
    return (v8i){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
}
static inline v8i widen_s8(const int8_t *p) {
    return (v8i){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
}
#endif
/* (fma8, from vec8.h, only for the sums: the weights are expanded unfused.) */

/* Eight 4-bit values q to Q4_1 weights d * q + m. */
static inline v8f q4_1_expand(v8i q, float d, float m) {
    return __builtin_convertvector(q, v8f) * splat8(d) + splat8(m);
}

/* Weights 8c..8c+7 of a Q4_1 block (c = 0..3). */
static inline v8f q4_1_chunk(const uint8_t *qs, float d, float m, int c) {
    const v8i bytes = widen_u8(qs + (c & 1) * 8);
    return q4_1_expand((c < 2) ? (bytes & 0x0F) : (bytes >> 4), d, m);
}

static inline v8f q8_0_chunk(const int8_t *qs, float d, int c) {
    return __builtin_convertvector(widen_s8(qs + c * 8), v8f) * splat8(d);
}

/* Weights 8c..8c+7 of block b of weight row j (of a tile), in either format. */
static inline v8f weight_chunk(int q4_1, const uint8_t *qs, const float *scales, int64_t K,
                               int j, int64_t b, int c) {
    const int64_t blocks = K / BLOCK;
    if (q4_1) {
        const float *s = scales + (j * blocks + b) * 2;
        return q4_1_chunk(qs + j * (K / 2) + b * 16, s[0], s[1], c);
    }
    return q8_0_chunk((const int8_t *)qs + j * K + b * BLOCK, scales[j * blocks + b], c);
}

/* One tile: `rows` (1..ROWS) rows of x times one weight row. Each 32-weight block is
 * expanded once (its four chunks of 8) and multiplied into every row, the even chunks into
 * one accumulator per row and the odd ones into another: with 4 rows that is 8 independent
 * sums, as many as the FMA units' latency times their throughput asks for, and with the
 * block's scales and bytes they fit the 16 AVX2 registers (a tile needing more had GCC spill
 * accumulators into the sums' dependency chains; docs/benchmarks/cpu-hot-path.md). `rows`
 * and `q4_1` are constants after inlining. */
static inline __attribute__((always_inline)) void tile(
    float *y, int64_t y_stride, const float *x, int64_t K, const uint8_t *qs,
    const float *scales, int q4_1, int rows) {
    v8f even[ROWS], odd[ROWS];
#pragma GCC unroll 4
    for (int i = 0; i < ROWS; ++i) even[i] = odd[i] = splat8(0.0f);
    for (int64_t b = 0; b < K / BLOCK; ++b) {
        v8f w[4];
        if (q4_1) {
            /* Chunks 0 and 2 are the low and high nibbles of bytes 0-7, 1 and 3 of 8-15. */
            const v8i low = widen_u8(qs + b * 16), high = widen_u8(qs + b * 16 + 8);
            const float d = scales[2 * b], m = scales[2 * b + 1];
            w[0] = q4_1_expand(low & 0x0F, d, m);
            w[1] = q4_1_expand(high & 0x0F, d, m);
            w[2] = q4_1_expand(low >> 4, d, m);
            w[3] = q4_1_expand(high >> 4, d, m);
        } else {
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c)
                w[c] = q8_0_chunk((const int8_t *)qs + b * BLOCK, scales[b], c);
        }
        const float *xb = x + b * BLOCK;
#pragma GCC unroll 2
        for (int c = 0; c < 4; c += 2)
#pragma GCC unroll 4
            for (int i = 0; i < rows; ++i) {
                even[i] = fma8(load8(xb + i * K + c * 8), w[c], even[i]);
                odd[i] = fma8(load8(xb + i * K + c * 8 + 8), w[c + 1], odd[i]);
            }
    }
#pragma GCC unroll 4
    for (int i = 0; i < rows; ++i) y[i * y_stride] = hsum8(even[i] + odd[i]);
}

#if defined(__AVX512F__) /* (immintrin.h is included above: AVX-512 builds have AVX2) */
/* Block b's 32 weights: 0-15 into *w0, 16-31 into *w1. */
static inline __attribute__((always_inline)) void block16(const uint8_t *qs,
                                                          const float *scales, int64_t b,
                                                          int q4_1, __m512 *w0, __m512 *w1) {
    if (q4_1) {
        const __m512 values =
            _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512 table = _mm512_add_ps(_mm512_mul_ps(values, _mm512_set1_ps(scales[2 * b])),
                                           _mm512_set1_ps(scales[2 * b + 1]));
        const __m512i bytes =
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + b * 16)));
        *w0 = _mm512_permutexvar_ps(bytes, table);
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    } else {
        const int8_t *q = (const int8_t *)qs + b * BLOCK;
        const __m512 d = _mm512_set1_ps(scales[b]);
        *w0 = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), d);
        *w1 = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))),
            d);
    }
}

/* tile() on an AVX-512 build: the same weights (each d * q (+ m), unfused), 16 lanes at a
 * time, in fewer instructions and with shorter chains of sums. A Q4_1 block's 16 possible
 * weights (q = 0..15) are expanded once into one vector and its 32 weights looked up from
 * it (vpermps reads the low 4 bits of an index: the low nibbles need no mask), weights 0-15
 * and 16-31 each one lookup. Each row keeps four accumulators, weights 0-15 and 16-31 of
 * even and of odd blocks, so that a block's two multiply-adds per row wait on the block
 * before last, not the one before: with 8-lane vectors and two accumulators a row, one
 * row's sums were a chain of two multiply-adds per block, ~8 cycles, longer than the
 * block's expansion. Summed in another order than tile(), so not bit for bit its sums. */
static inline __attribute__((always_inline)) void tile16(
    float *y, int64_t y_stride, const float *x, int64_t K, const uint8_t *qs,
    const float *scales, int q4_1, int rows) {
    __m512 a0[ROWS], a1[ROWS], a2[ROWS], a3[ROWS]; /* even blocks' 0-15, 16-31; odd blocks' */
#pragma GCC unroll 4
    for (int i = 0; i < ROWS; ++i) a0[i] = a1[i] = a2[i] = a3[i] = _mm512_setzero_ps();
    const int64_t blocks = K / BLOCK;
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        __m512 w0, w1, w2, w3;
        block16(qs, scales, b, q4_1, &w0, &w1);
        block16(qs, scales, b + 1, q4_1, &w2, &w3);
        const float *xb = x + b * BLOCK;
#pragma GCC unroll 4
        for (int i = 0; i < rows; ++i) {
            a0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + i * K), w0, a0[i]);
            a1[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + i * K + 16), w1, a1[i]);
            a2[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + i * K + 32), w2, a2[i]);
            a3[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + i * K + 48), w3, a3[i]);
        }
    }
    if (b < blocks) { /* an odd number of blocks: the last one */
        __m512 w0, w1;
        block16(qs, scales, b, q4_1, &w0, &w1);
        const float *xb = x + b * BLOCK;
#pragma GCC unroll 4
        for (int i = 0; i < rows; ++i) {
            a0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + i * K), w0, a0[i]);
            a1[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + i * K + 16), w1, a1[i]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < rows; ++i)
        y[i * y_stride] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(a0[i], a1[i]), _mm512_add_ps(a2[i], a3[i])));
}
#define FEW_ROWS_TILE tile16
#else
#define FEW_ROWS_TILE tile
#endif

/* The tile functions with the row count (1..max, max at most 8) as a constant, so the
 * accumulators stay in registers. */
#define DISPATCH_ROWS(tile, rows, max, ...)                      \
    switch (rows) {                                              \
    case 1: tile(__VA_ARGS__, 1); break;                         \
    case 2: tile(__VA_ARGS__, 2 < (max) ? 2 : (max)); break;     \
    case 3: tile(__VA_ARGS__, 3 < (max) ? 3 : (max)); break;     \
    case 4: tile(__VA_ARGS__, 4 < (max) ? 4 : (max)); break;     \
    case 5: tile(__VA_ARGS__, 5 < (max) ? 5 : (max)); break;     \
    case 6: tile(__VA_ARGS__, 6 < (max) ? 6 : (max)); break;     \
    case 7: tile(__VA_ARGS__, 7 < (max) ? 7 : (max)); break;     \
    default: tile(__VA_ARGS__, max); break;                      \
    }

/* Output column n of y = x · Wᵀ (weight row n) for all M rows of x, in tiles of ROWS. */
static inline __attribute__((always_inline)) void linear_column(
    float *y, const float *x, int64_t M, int64_t K, int64_t N, const uint8_t *qs,
    const float *scales, int64_t n, int q4_1) {
    const int64_t row_bytes = q4_1 ? K / 2 : K;
    const int64_t row_scales = q4_1 ? K / BLOCK * 2 : K / BLOCK;
    /* The weight row PREFETCH_ROWS ahead, fetched into L2 meanwhile: with so little work per
     * byte the hardware prefetcher alone leaves the loads waiting (past the end of the
     * weight this is harmless, prefetches do not fault). */
    const uint8_t *next_qs = qs + (n + PREFETCH_ROWS) * row_bytes;
    const float *next_scales = scales + (n + PREFETCH_ROWS) * row_scales;
    for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(next_qs + i, 0, 2);
    for (int64_t i = 0; i < row_scales; i += 16) __builtin_prefetch(next_scales + i, 0, 2);
    for (int64_t m = 0; m < M; m += ROWS) {
        const int rows = M - m < ROWS ? (int)(M - m) : ROWS;
        DISPATCH_ROWS(FEW_ROWS_TILE, rows, ROWS, y + m * N + n, N, x + m * K, K,
                      qs + n * row_bytes, scales + n * row_scales, q4_1)
    }
}

/* The columns of y = x · Wᵀ shared out over the threads of the enclosing parallel region
 * (an orphaned `omp for`, ending in a barrier). The format is a constant in each branch:
 * OpenMP outlines a parallel body once for both formats, and with q4_1 a variable there the
 * tile runs slower. */
static void linear_columns(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                           const uint8_t *qs, const float *scales, int q4_1) {
    if (q4_1) {
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) linear_column(y, x, M, K, N, qs, scales, n, 1);
    } else {
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) linear_column(y, x, M, K, N, qs, scales, n, 0);
    }
}

/* y = x · Wᵀ, split over weight rows. */
static int quant_linear(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                        const uint8_t *qs, const float *scales, int q4_1) {
    if (K % BLOCK != 0) return 1;
#pragma omp parallel
    linear_columns(y, x, M, K, N, qs, scales, q4_1);
    return 0;
}

/* Many rows: the few-row tiles above expand each weight again for every 4 rows of x, so from
 * ~8 rows on they are bound by the expansion. Here each thread expands a panel of PANEL
 * weight rows once per K slice into a float32 buffer laid out [k][PANEL] (in L1), and a
 * register-blocked micro-kernel multiplies it into all M rows, PANEL_ROWS at a time:
 * 6 x 16 keeps 12 accumulators; per k it loads 2 weight vectors and broadcasts 6 x values.
 * Slices of 256 keep the panel in L1 and are no slower than longer ones. */
#define PANEL 16
#define PANEL_ROWS 6
#define PANEL_K 256 /* the most k of one slice: 16 KiB of expanded weights */

/* Weights k0..k0+kc of PANEL weight rows into panel[k - k0][PANEL]: each block of each row
 * expanded as in tile() into rows[PANEL][BLOCK], then transposed 8 x 8 at a time. (Kept
 * apart, the expansion loop has few live pointers and vectors, so nothing spills.) */
static inline __attribute__((always_inline)) void expand_panel(
    float *panel, const uint8_t *qs, const float *scales, int64_t K, int64_t k0, int64_t kc,
    int q4_1) {
    _Alignas(32) float rows[PANEL][BLOCK];
    for (int64_t b = k0 / BLOCK; b < (k0 + kc) / BLOCK; ++b) {
#pragma GCC unroll 1
        for (int j = 0; j < PANEL; ++j)
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c)
                store8(rows[j] + c * 8, weight_chunk(q4_1, qs, scales, K, j, b, c));
        float *out = panel + (b * BLOCK - k0) * PANEL;
#pragma GCC unroll 1
        for (int c = 0; c < 4; ++c)
#pragma GCC unroll 2
            for (int g = 0; g < PANEL; g += 8) {
                v8f w[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; ++i) w[i] = load8(rows[g + i] + c * 8);
                transpose8x8(w);
#pragma GCC unroll 8
                for (int i = 0; i < 8; ++i) store8(out + (c * 8 + i) * PANEL + g, w[i]);
            }
    }
}

/* `rows` (1..PANEL_ROWS) rows of x times an expanded panel, over kc k; adds into y unless
 * `first`. */
static inline __attribute__((always_inline)) void panel_tile(
    float *y, int64_t y_stride, const float *x, int64_t K, const float *panel, int64_t kc,
    int first, int rows) {
    v8f acc[PANEL_ROWS][PANEL / 8];
#pragma GCC unroll 8
    for (int i = 0; i < rows; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < PANEL / 8; ++j)
            acc[i][j] = first ? splat8(0.0f) : load8(y + i * y_stride + j * 8);
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; ++k) {
        v8f w[PANEL / 8];
#pragma GCC unroll 4
        for (int j = 0; j < PANEL / 8; ++j) w[j] = load8(panel + k * PANEL + j * 8);
#pragma GCC unroll 8
        for (int i = 0; i < rows; ++i) {
            const v8f xv = splat8(x[i * K + k]);
#pragma GCC unroll 4
            for (int j = 0; j < PANEL / 8; ++j) acc[i][j] = fma8(xv, w[j], acc[i][j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < rows; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < PANEL / 8; ++j) store8(y + i * y_stride + j * 8, acc[i][j]);
}

/* The `rows` weight rows after these (the next panel's) fetched into L2 meanwhile: a panel's
 * expansion reads a block of each of its rows in turn, which the hardware prefetcher does not
 * follow (past the end of the weight this is harmless, prefetches do not fault). */
static inline void prefetch_next_panel(const uint8_t *qs, const float *scales, int64_t rows,
                                       int64_t K, int q4_1) {
    const int64_t qs_bytes = rows * (q4_1 ? K / 2 : K);
    const int64_t scale_bytes = rows * (q4_1 ? K / BLOCK * 2 : K / BLOCK) * 4;
    for (int64_t i = 0; i < qs_bytes; i += 64) __builtin_prefetch(qs + qs_bytes + i, 0, 2);
    for (int64_t i = 0; i < scale_bytes; i += 64)
        __builtin_prefetch((const char *)scales + scale_bytes + i, 0, 2);
}

/* One panel of PANEL weight rows times all M rows of x; K in slices of `slice`. The sums
 * build up in sums [M][PANEL] (contiguous, cache-resident) and go to y's PANEL columns at
 * the end: y's rows are N floats apart (for the wide outputs a multiple of 4 KiB, so the
 * rows of a tile share L1 sets), and reading and writing them at every slice was slower
 * (docs/benchmarks/cpu-hot-path.md). */
static inline __attribute__((always_inline)) void gemm_panel(
    float *y, const float *x, int64_t M, int64_t K, int64_t N, const uint8_t *qs,
    const float *scales, int64_t slice, float *panel, float *sums, int q4_1) {
    prefetch_next_panel(qs, scales, PANEL, K, q4_1);
    for (int64_t k0 = 0; k0 < K; k0 += slice) {
        const int64_t kc = K - k0 < slice ? K - k0 : slice;
        expand_panel(panel, qs, scales, K, k0, kc, q4_1);
        for (int64_t m = 0; m < M; m += PANEL_ROWS) {
            const int rows = M - m < PANEL_ROWS ? (int)(M - m) : PANEL_ROWS;
            DISPATCH_ROWS(panel_tile, rows, PANEL_ROWS, sums + m * PANEL, PANEL, x + m * K + k0,
                          K, panel, kc, k0 == 0)
        }
    }
    for (int64_t m = 0; m < M; ++m)
        for (int j = 0; j < PANEL; j += 8) store8(y + m * N + j, load8(sums + m * PANEL + j));
}

/* The panels of y = x · Wᵀ shared out over the threads of the enclosing parallel region (an
 * orphaned `omp for`, ending in a barrier); K in slices of at most PANEL_K. `panel`
 * (PANEL_K * PANEL floats) and `sums` (M * PANEL) are the calling thread's; nothing is done
 * if `sums` is NULL. */
static void gemm_columns(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                         const uint8_t *qs, const float *scales, int q4_1, float *panel,
                         float *sums) {
    const int64_t row_bytes = q4_1 ? K / 2 : K;
    const int64_t row_scales = q4_1 ? K / BLOCK * 2 : K / BLOCK;
    /* Equal slices, whole blocks each. */
    const int64_t slices = (K + PANEL_K - 1) / PANEL_K;
    const int64_t slice = (K / BLOCK + slices - 1) / slices * BLOCK;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N / PANEL; ++t) {
        const int64_t n = t * PANEL;
        if (sums == NULL) continue;
        /* The format a constant in each branch (OpenMP outlines a parallel body once). */
        if (q4_1)
            gemm_panel(y + n, x, M, K, N, qs + n * row_bytes, scales + n * row_scales, slice,
                       panel, sums, 1);
        else
            gemm_panel(y + n, x, M, K, N, qs + n * row_bytes, scales + n * row_scales, slice,
                       panel, sums, 0);
    }
}

/* y = x · Wᵀ, split over panels of PANEL weight rows. */
static int quant_gemm(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                      const uint8_t *qs, const float *scales, int q4_1) {
    if (K % BLOCK != 0 || N % PANEL != 0) return 1;
    int failed = 0;
#pragma omp parallel
    {
        _Alignas(64) float panel[PANEL_K * PANEL];
        float *sums = (float *)malloc(sizeof(float) * (size_t)(M * PANEL));
        if (sums == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        gemm_columns(y, x, M, K, N, qs, scales, q4_1, panel, sums);
        free(sums);
    }
    return failed ? 2 : 0;
}

int ts_q4_1_linear_f32(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                       const uint8_t *qs, const float *dm) {
    return quant_linear(y, x, M, K, N, qs, dm, 1);
}

int ts_q8_0_linear_f32(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                       const int8_t *qs, const float *d) {
    return quant_linear(y, x, M, K, N, (const uint8_t *)qs, d, 0);
}

int ts_q4_1_gemm_f32(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                     const uint8_t *qs, const float *dm) {
    return quant_gemm(y, x, M, K, N, qs, dm, 1);
}

int ts_q8_0_gemm_f32(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                     const int8_t *qs, const float *d) {
    return quant_gemm(y, x, M, K, N, (const uint8_t *)qs, d, 0);
}

#if QUANT_AMX
#include "quant_amx.h"
#endif

#if QUANT_DP
#include "quant_dp.h"
#endif

/* 1 where the vdpbf16ps kernel is built (the avx512_bf16 level). */
int ts_quant_dp_available(void) { return QUANT_DP; }

/* y = x · Wᵀ with bf16 numerics by vdpbf16ps (quant_dp.h): in its dot-product form split over
 * output columns, or (panels) in its panel form split over panels, N a multiple of 16. */
static int quant_linear_dp(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                           const uint8_t *qs, const float *scales, int q4_1, int panels) {
#if QUANT_DP
    if (K % BLOCK != 0 || (panels && N % 16 != 0)) return 1;
    if (M == 0) return 0;
    uint16_t *xp = (uint16_t *)aligned_alloc(64, (size_t)(M * K * 2)); /* K % 32 == 0 */
    if (xp == NULL) return 2;
    int failed = 0;
#pragma omp parallel
    {
        uint32_t *panel =
            panels ? (uint32_t *)aligned_alloc(64, (size_t)(DP_PANEL_COLS * K * 2)) : NULL;
        if (panels && panel == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        dp_pack_rows(xp, x, M, K, q4_1);
        if (panels)
            dp_panels(y, xp, M, K, N, qs, scales, q4_1, panel);
        else
            dp_columns(y, xp, M, K, N, qs, scales, q4_1);
        free(panel);
    }
    free(xp);
    return failed ? 2 : 0;
#else
    (void)y, (void)x, (void)M, (void)K, (void)N, (void)qs, (void)scales, (void)q4_1;
    (void)panels;
    return 3;
#endif
}

int ts_q4_1_linear_dp(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                      const uint8_t *qs, const float *dm) {
    return quant_linear_dp(y, x, M, K, N, qs, dm, 1, 0);
}

int ts_q8_0_linear_dp(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                      const int8_t *qs, const float *d) {
    return quant_linear_dp(y, x, M, K, N, (const uint8_t *)qs, d, 0, 0);
}

int ts_q4_1_gemm_dp(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                    const uint8_t *qs, const float *dm) {
    return quant_linear_dp(y, x, M, K, N, qs, dm, 1, 1);
}

int ts_q8_0_gemm_dp(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                    const int8_t *qs, const float *d) {
    return quant_linear_dp(y, x, M, K, N, (const uint8_t *)qs, d, 0, 1);
}

/* 1 where the AMX kernel runs: built for the amx level and the tiles granted. */
int ts_quant_amx_available(void) {
#if QUANT_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* y = x · Wᵀ with bf16 numerics on AMX tiles, split over panels of AMX_PANEL weight rows;
 * x float32 or (x_bf16) bf16, y likewise. */
static int quant_gemm_amx(void *y, int y_bf16, const void *x, int x_bf16, int64_t M, int64_t K,
                          int64_t N, const uint8_t *qs, const float *scales, int q4_1) {
#if QUANT_AMX
    if (K % BLOCK != 0 || N % AMX_PANEL != 0) return 1;
    if (!amx_permitted()) return 3;
    if (M == 0) return 0;
    const int64_t round = amx_round_rows(K), chunk = M < round ? M : round;
    uint16_t *xp = (uint16_t *)aligned_alloc(64, (size_t)((chunk + 15) / 16 * 16 * K * 2));
    if (xp == NULL) return 2;
    const size_t x_size = x_bf16 ? 2 : 4, y_size = y_bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *a = (uint16_t *)aligned_alloc(64, (size_t)(2 * AMX_PANEL * K * 2));
        if (a == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
            amx_pack_rows(xp, (const char *)x + m0 * K * x_size, x_bf16, rows, K);
            amx_columns((char *)y + m0 * N * y_size, y_bf16, xp, rows, K, N, qs, scales, q4_1,
                        a);
        }
        free(a);
    }
    free(xp);
    return failed ? 2 : 0;
#else
    (void)y, (void)y_bf16, (void)x, (void)x_bf16, (void)M, (void)K, (void)N, (void)qs;
    (void)scales, (void)q4_1;
    return 3;
#endif
}

int ts_q4_1_gemm_amx(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                     const uint8_t *qs, const float *dm) {
    return quant_gemm_amx(y, 0, x, 0, M, K, N, qs, dm, 1);
}

int ts_q8_0_gemm_amx(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                     const int8_t *qs, const float *d) {
    return quant_gemm_amx(y, 0, x, 0, M, K, N, (const uint8_t *)qs, d, 0);
}

/* The AMX kernel on bf16 x, its sums rounded into bf16 y (the values ts_*_gemm_amx would
 * give as float32): what a bf16 model's operators hand each other. */
int ts_q4_1_gemm_amx_bf16(uint16_t *y, const uint16_t *x, int64_t M, int64_t K, int64_t N,
                          const uint8_t *qs, const float *dm) {
    return quant_gemm_amx(y, 1, x, 1, M, K, N, qs, dm, 1);
}

int ts_q8_0_gemm_amx_bf16(uint16_t *y, const uint16_t *x, int64_t M, int64_t K, int64_t N,
                          const int8_t *qs, const float *d) {
    return quant_gemm_amx(y, 1, x, 1, M, K, N, (const uint8_t *)qs, d, 0);
}

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || \
    (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define QUANT_I8 1
#include "quant_i8.h"
#else
#define QUANT_I8 0
#endif

/* x rounded to 8 bits per block (quant_i8.h): returns 3 where the level lacks both
 * AVX512-VNNI and AVX2 (ts_quant_i8_available says which). The weight in i8_repack's
 * layout. */
int ts_quant_i8_available(void) { return QUANT_I8; }

/* Bytes of an [N, K] weight in the 8-bit kernel's layout (0 where the level lacks it). */
int64_t ts_i8_weight_bytes(int64_t N, int64_t K, int64_t q4_1) {
#if QUANT_I8
    return i8_weight_bytes(N, K, (int)q4_1);
#else
    (void)N, (void)K, (void)q4_1;
    return 0;
#endif
}

/* The file's blocks (the layouts above) into the 8-bit kernel's, at out
 * (ts_i8_weight_bytes). */
int ts_i8_repack(uint8_t *out, const uint8_t *qs, const float *scales, int64_t N, int64_t K,
                 int64_t q4_1) {
#if QUANT_I8
    if (K % BLOCK != 0) return 1;
    i8_repack(out, qs, scales, N, K, (int)q4_1);
    return 0;
#else
    (void)out, (void)qs, (void)scales, (void)N, (void)K, (void)q4_1;
    return 3;
#endif
}

/* y = x · Wᵀ, W in the 8-bit kernel's layout (ts_i8_repack) of Q4_1 (q4_1 = 1) or Q8_0
 * blocks. */
int ts_linear_i8(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                 const uint8_t *weight, int64_t q4_1) {
#if QUANT_I8
    return quant_linear_i8(y, x, M, K, N, weight, (int)q4_1);
#else
    (void)y, (void)x, (void)M, (void)K, (void)N, (void)weight, (void)q4_1;
    return 3;
#endif
}
