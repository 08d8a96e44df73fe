/*
 * The avx512_bf16 level of quant_linear.c (a CPU with AVX512_BF16 and no AMX): y = x · Wᵀ on
 * GGUF blocks with a bfloat16 model's numerics, those of quant_amx.h (each weight expanded
 * as gguf dequantizes it, then rounded to bf16; x rounded to bf16; float32 sums, each
 * rounded to bf16 at the end), by vdpbf16ps: a bf16 model's small decode steps then compute
 * what its dense bf16 products on oneDNN compute, up to the order of the float32 sums,
 * instead of multiplying by float32 weights, and with fewer instructions per weight than
 * the float32 kernels.
 *
 * x is rounded to bf16 once per call, [M][K] in its own order. Each output column (weight
 * row) is one item: its blocks are streamed once, each block expanded to 32 bf16 in one
 * vector (bf16_expand_block; for more than DP_ROWS rows of x into a buffer that each
 * DP_ROWS-row tile reads) and multiplied into each row by one
 * vdpbf16ps (16 float32 lanes, each the sum of a pair of products), the lanes summed and
 * the sum rounded to bf16 at the row's end. A row's result depends neither on M nor on the
 * other rows.
 */
#ifndef TOKENSERVE_QUANT_DP_H
#define TOKENSERVE_QUANT_DP_H

#include "quant_bf16.h"

#define DP_ROWS 6 /* rows of x per pass over a weight row: DP_ROWS accumulators */

/* x [M, K] float32 → xp [M, K] bf16, shared out over the threads of the enclosing region
 * (an orphaned `omp for`, ending in a barrier). */
static void dp_pack_rows(uint16_t *xp, const float *x, int64_t M, int64_t K) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; k += 16)
            _mm256_storeu_si256((__m256i *)(xp + m * K + k),
                                bf16_round16(_mm512_loadu_ps(x + m * K + k)));
}

/* `rows` (1..DP_ROWS) rows of xp times one weight row (its blocks at qs and scales, or
 * already expanded to bf16 at `expanded`), into y[r * N] (y: the column's first row). */
static inline __attribute__((always_inline)) void dp_tile(
    float *y, int64_t N, const uint16_t *xp, int64_t K, const uint8_t *qs,
    const float *scales, const uint16_t *expanded, int q4_1, int rows) {
    __m512 acc[DP_ROWS];
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / BLOCK; ++b) {
        const __m512bh w = (__m512bh)(expanded ? _mm512_loadu_si512(expanded + b * BLOCK)
                                               : bf16_expand_block(qs, scales, b, q4_1));
        for (int r = 0; r < rows; ++r)
            acc[r] = _mm512_dpbf16_ps(
                acc[r], (__m512bh)_mm512_loadu_si512(xp + r * K + b * BLOCK), w);
    }
    for (int r = 0; r < rows; ++r)
        y[r * N] = _mm_cvtss_f32(_mm512_castps512_ps128(
            bf16_round_ps(_mm512_set1_ps(_mm512_reduce_add_ps(acc[r])))));
}

/* Output column n for all M rows of xp, DP_ROWS at a time; the weight row PREFETCH_ROWS
 * ahead fetched into L2 meanwhile, as linear_column() does. Up to DP_ROWS rows expand the
 * blocks as they go; more expand the row once into `expanded` (K bf16, the calling
 * thread's), which every tile then reads instead of expanding the blocks again (the default
 * model's products of 16 rows on an AMD EPYC: 25.5 → 22.3 ms). */
static inline __attribute__((always_inline)) void dp_column(
    float *y, const uint16_t *xp, int64_t M, int64_t K, int64_t N, const uint8_t *qs,
    const float *scales, int64_t n, uint16_t *expanded, int q4_1) {
    const int64_t row_bytes = q4_1 ? K / 2 : K;
    const int64_t row_scales = q4_1 ? K / BLOCK * 2 : K / BLOCK;
    const uint8_t *next_qs = qs + (n + PREFETCH_ROWS) * row_bytes;
    for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(next_qs + i, 0, 2);
    __builtin_prefetch(scales + (n + PREFETCH_ROWS) * row_scales, 0, 2);
    qs += n * row_bytes;
    scales += n * row_scales;
    if (M <= DP_ROWS) {
        DISPATCH_ROWS(dp_tile, (int)M, DP_ROWS, y + n, N, xp, K, qs, scales, NULL, q4_1)
        return;
    }
    for (int64_t b = 0; b < K / BLOCK; ++b)
        _mm512_storeu_si512(expanded + b * BLOCK, bf16_expand_block(qs, scales, b, q4_1));
    for (int64_t m = 0; m < M; m += DP_ROWS) {
        const int rows = M - m < DP_ROWS ? (int)(M - m) : DP_ROWS;
        DISPATCH_ROWS(dp_tile, rows, DP_ROWS, y + m * N + n, N, xp + m * K, K, qs, scales,
                      expanded, q4_1)
    }
}

/* The columns of y = x · Wᵀ (x packed by dp_pack_rows) shared out over the threads of the
 * enclosing region (an orphaned `omp for`, ending in a barrier); the format a constant in
 * each branch, as in linear_columns(). */
static void dp_columns(float *y, const uint16_t *xp, int64_t M, int64_t K, int64_t N,
                       const uint8_t *qs, const float *scales, int q4_1) {
    uint16_t expanded[M > DP_ROWS ? K : 1] __attribute__((aligned(64)));
    if (q4_1) {
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) dp_column(y, xp, M, K, N, qs, scales, n, expanded, 1);
    } else {
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) dp_column(y, xp, M, K, N, qs, scales, n, expanded, 0);
    }
}

#endif
