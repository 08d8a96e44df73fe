/*
 * The avx512_bf16 level of quant_linear.c (a CPU with AVX512_BF16 and no AMX): y = x · Wᵀ on
 * GGUF blocks with a bfloat16 model's numerics, those of quant_amx.h (each weight expanded
 * as gguf dequantizes it, then rounded to bf16; x rounded to bf16; float32 sums, each
 * rounded to bf16 at the end), by vdpbf16ps: a bf16 model's small decode steps then compute
 * what its dense bf16 products on oneDNN compute, up to the order of the float32 sums,
 * instead of multiplying by float32 weights, and with fewer instructions per weight than
 * the float32 kernels.
 *
 * x is rounded to bf16 once per call, [M][K], each 32-value block in the order its weights
 * expand in (dp_expand_block: Q4_1 in DP_Q4_1_ORDER, the order that takes the fewest
 * instructions, Q8_0 in its own). Each output column (weight row) is one item: its blocks
 * are streamed once, each block expanded to 32 bf16 in one vector (for more than DP_ROWS
 * rows of x into a buffer that each DP_ROWS-row tile reads) and multiplied into each row by
 * one vdpbf16ps (16 float32 lanes, each the sum of a pair of products), even and odd blocks
 * into two accumulators, so that a row's consecutive vdpbf16ps do not wait on each other's
 * result; the two are added, their lanes summed and the sum rounded to bf16 at the row's
 * end. A row's result depends neither on M nor on the other rows.
 *
 * On an AMD EPYC (Zen 4, 2.6 GHz nominal) the loop's time is about a cycle per 512-bit
 * operation: five per Q4_1 block to expand it, one per row to multiply. Expanded in the
 * natural order (bf16_expand_block: eight) and with one accumulator per row (a single row
 * then waits on vdpbf16ps's latency), the default model's projections ran 3.6-3.8x as fast
 * as oneDNN's bf16 product at 1 row and 2.4-2.8x at 4; now 4.6-4.8x and 3.2-3.5x
 * (`python benchmarks/quantized_linear.py --dtype bfloat16`, three runs of each build).
 */
#ifndef TOKENSERVE_QUANT_DP_H
#define TOKENSERVE_QUANT_DP_H

#include "avx512.h"
#include "quant_bf16.h"

#define DP_ROWS 8 /* rows of x per pass over a weight row: 2 DP_ROWS accumulators */
#define DP_PANEL_VECS 3 /* the panel kernel's column vectors: 16 weight rows each */
#define DP_PANEL_COLS (16 * DP_PANEL_VECS) /* weight rows per panel */
#define DP_PANEL_ROWS 8 /* rows of x per pass over a panel: DP_PANEL_ROWS x 3 accumulators */

/* Q4_1 block b of one weight row → its 32 weights as bf16, in the order DP_Q4_1_ORDER names
 * (the vector's position p holds weight DP_Q4_1_ORDER[p]), with bf16_expand_block's
 * arithmetic: the block's 16 possible values are expanded once, into both halves of the
 * lookup (vpermw reads an index's low 5 bits, so bit 4 picks a copy of the same value), and
 * its weights looked up. The indices need one instruction: the block's 16 bytes broadcast to
 * the four 128-bit lanes, whose 16-bit words (bytes 2j and 2j + 1) lane l shifts right by
 * 4 l, so that word j's low 4 bits are byte 2j's low nibble in lane 0, its high one in lane
 * 1, byte 2j + 1's low one in lane 2 and its high one in lane 3; bit 4, the next nibble's,
 * only picks the copy. bf16_expand_block's natural order needs two more, among them a
 * widening across lanes; x is laid out in this order instead, once per call
 * (dp_pack_rows). */
static const uint16_t DP_Q4_1_ORDER[BLOCK] = {
    0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
    1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

static inline __attribute__((always_inline)) __m512i dp_expand_q4_1(
    const uint8_t *qs, const float *scales, int64_t b) {
    const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i shifts = _mm512_set_epi64(0x000c000c000c000c, 0x000c000c000c000c,
                                            0x0008000800080008, 0x0008000800080008,
                                            0x0004000400040004, 0x0004000400040004, 0, 0);
    const __m512 table = _mm512_add_ps(_mm512_mul_ps(values, _mm512_set1_ps(scales[2 * b])),
                                       _mm512_set1_ps(scales[2 * b + 1]));
    const __m512i lookup = (__m512i)_mm512_cvtne2ps_pbh(table, table);
    const __m512i words =
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(qs + b * BLOCK / 2)));
    return _mm512_permutexvar_epi16(_mm512_srlv_epi16(words, shifts), lookup);
}

/* Block b of one weight row as dp_tile multiplies it: Q4_1 in DP_Q4_1_ORDER, Q8_0 in the
 * block's own order. */
static inline __attribute__((always_inline)) __m512i dp_expand_block(
    const uint8_t *qs, const float *scales, int64_t b, int q4_1) {
    return q4_1 ? dp_expand_q4_1(qs, scales, b) : bf16_expand_block(qs, scales, b, 0);
}

/* x [M, K] float32 → xp [M, K] bf16, each 32-value block in the order its weights expand
 * in (dp_expand_block), shared out over the threads of the enclosing region (an orphaned
 * `omp for`, ending in a barrier). */
static void dp_pack_rows(uint16_t *xp, const float *x, int64_t M, int64_t K, int q4_1) {
    const __m512i order = _mm512_loadu_si512(DP_Q4_1_ORDER);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; k += BLOCK) {
            __m512i block = _mm512_inserti64x4(
                _mm512_castsi256_si512(bf16_round16(_mm512_loadu_ps(x + m * K + k))),
                bf16_round16(_mm512_loadu_ps(x + m * K + k + 16)), 1);
            if (q4_1) block = _mm512_permutexvar_epi16(order, block);
            _mm512_storeu_si512(xp + m * K + k, block);
        }
}

/* `rows` (1..DP_ROWS) rows of xp times one weight row (its blocks at qs and scales, or
 * already expanded by dp_expand_block at `expanded`), into y[r * N] (y: the column's first
 * row). */
static inline __attribute__((always_inline)) void dp_tile(
    float *y, int64_t N, const uint16_t *xp, int64_t K, const uint8_t *qs,
    const float *scales, const uint16_t *expanded, int q4_1, int rows) {
    __m512 acc[DP_ROWS];
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    __m512 odd[DP_ROWS];
    for (int r = 0; r < rows; ++r) odd[r] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < K / BLOCK; b += 2) {
        const __m512bh w = (__m512bh)(expanded ? _mm512_loadu_si512(expanded + b * BLOCK)
                                               : dp_expand_block(qs, scales, b, q4_1));
        const __m512bh w1 = (__m512bh)(expanded ? _mm512_loadu_si512(expanded + (b + 1) * BLOCK)
                                               : dp_expand_block(qs, scales, b + 1, q4_1));
        for (int r = 0; r < rows; ++r) {
            acc[r] = _mm512_dpbf16_ps(
                acc[r], (__m512bh)_mm512_loadu_si512(xp + r * K + b * BLOCK), w);
            odd[r] = _mm512_dpbf16_ps(
                odd[r], (__m512bh)_mm512_loadu_si512(xp + r * K + (b + 1) * BLOCK), w1);
        }
    }
    if (b < K / BLOCK) {
        const __m512bh w = (__m512bh)(expanded ? _mm512_loadu_si512(expanded + b * BLOCK)
                                               : dp_expand_block(qs, scales, b, q4_1));
        for (int r = 0; r < rows; ++r)
            acc[r] = _mm512_dpbf16_ps(
                acc[r], (__m512bh)_mm512_loadu_si512(xp + r * K + b * BLOCK), w);
    }
    for (int r = 0; r < rows; ++r)
        y[r * N] = _mm_cvtss_f32(_mm512_castps512_ps128(bf16_round_ps(
            _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_add_ps(acc[r], odd[r]))))));
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
        _mm512_storeu_si512(expanded + b * BLOCK, dp_expand_block(qs, scales, b, q4_1));
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

/* The panel kernel (ts_*_gemm_dp): the dot-product form above sums each output across a
 * vector's lanes at its end, some ten operations per output beside K / 32 vdpbf16ps, and
 * loads x once per vdpbf16ps; with many rows those dominate (the default model's
 * projections at 64 rows took 1.5x oneDNN's time). Here each lane is an output column
 * instead: a panel of DP_PANEL_COLS weight rows is expanded once per call into pairs of k,
 * [K / 2][DP_PANEL_COLS] (dp_expand_block, then a 16 x 16 transpose per block of 16 rows),
 * and a register tile of DP_PANEL_ROWS rows x DP_PANEL_VECS vectors of 16 columns
 * accumulates, per pair of k, one vdpbf16ps of each panel vector with the row's pair
 * broadcast (an outer product, as in a GEMM micro-kernel): no sums across lanes, and one
 * load of x per DP_PANEL_VECS vdpbf16ps. Each output is one float32 sum over the pairs of k
 * in order (x in dp_pack_rows' layout, the weights in the same order), rounded to bf16 at
 * the end: the same numerics as the dot-product form but another order of the float32 sums,
 * so a row's result depends neither on M nor on the other rows here either, but may differ
 * in the last bit of bf16 from the dot-product form's. */

/* Weight rows 0..16 vecs - 1 (their blocks at qs and scales) expanded into panel
 * [K / 2][16 vecs]: entry (s, j) holds weights 2s and 2s + 1 of row j in dp_expand_block's
 * order, the layout the panel tile multiplies. `next_qs` and `next_scales`, the next
 * panel's, are fetched into L2 block by block meanwhile (past the weight's end harmless:
 * prefetches do not fault). */
static inline __attribute__((always_inline)) void dp_expand_panel(
    uint32_t *panel, const uint8_t *qs, const float *scales, int64_t K, int vecs, int q4_1) {
    const int64_t row_bytes = q4_1 ? K / 2 : K, blocks = K / BLOCK;
    const int64_t row_scales = q4_1 ? blocks * 2 : blocks, width = 16 * vecs;
    const int64_t block_bytes = q4_1 ? BLOCK / 2 : BLOCK, scale_floats = q4_1 ? 2 : 1;
    const uint8_t *next_qs = qs + width * row_bytes;
    const float *next_scales = scales + width * row_scales;
    for (int64_t b = 0; b < blocks; ++b) {
        if ((b * block_bytes) % 64 == 0)
            for (int64_t j = 0; j < width; ++j)
                __builtin_prefetch(next_qs + j * row_bytes + b * block_bytes, 0, 2);
        if ((b * scale_floats * 4) % 64 == 0)
            for (int64_t j = 0; j < width; ++j)
                __builtin_prefetch(next_scales + j * row_scales + b * scale_floats, 0, 2);
        for (int v = 0; v < vecs; ++v) {
            __m512i r[16];
            for (int j = 0; j < 16; ++j) {
                const int64_t row = v * 16 + j;
                r[j] = dp_expand_block(qs + row * row_bytes, scales + row * row_scales, b, q4_1);
            }
            transpose16(r); /* r[s]: pair s of the block, for each of the 16 rows */
            for (int s = 0; s < 16; ++s)
                _mm512_store_si512(panel + (b * 16 + s) * width + v * 16, r[s]);
        }
    }
}

/* `rows` (1..DP_PANEL_ROWS) rows of xp times a panel of 16 vecs columns, into y (y: the
 * tile's first row and column). */
static inline __attribute__((always_inline)) void dp_panel_tile(
    float *y, int64_t N, const uint16_t *xp, int64_t K, const uint32_t *panel, int vecs,
    int rows) {
    const uint32_t *x = (const uint32_t *)xp; /* pairs of k */
    const int64_t pairs = K / 2, width = 16 * vecs;
    __m512 acc[DP_PANEL_ROWS][DP_PANEL_VECS];
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < vecs; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t s = 0; s < pairs; ++s) {
        __m512bh w[DP_PANEL_VECS];
        for (int v = 0; v < vecs; ++v)
            w[v] = (__m512bh)_mm512_load_si512(panel + s * width + v * 16);
        for (int r = 0; r < rows; ++r) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)x[r * pairs + s]);
            for (int v = 0; v < vecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[v], pair);
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < vecs; ++v)
            _mm512_storeu_ps(y + r * N + v * 16, bf16_round_ps(acc[r][v]));
}

/* All M rows of xp times one expanded panel, DP_PANEL_ROWS at a time. */
static inline __attribute__((always_inline)) void dp_panel_rows(
    float *y, const uint16_t *xp, int64_t M, int64_t K, int64_t N, const uint32_t *panel,
    int vecs) {
    for (int64_t m = 0; m < M; m += DP_PANEL_ROWS) {
        const int rows = M - m < DP_PANEL_ROWS ? (int)(M - m) : DP_PANEL_ROWS;
        DISPATCH_ROWS(dp_panel_tile, rows, DP_PANEL_ROWS, y + m * N, N, xp + m * K, K, panel,
                      vecs)
    }
}

/* Panel p (y's columns p * DP_PANEL_COLS.., fewer in the last panel where N is not a
 * multiple) expanded into `panel` (the calling thread's: DP_PANEL_COLS * K bf16) and
 * multiplied into every row. */
static inline __attribute__((always_inline)) void dp_panel(
    float *y, const uint16_t *xp, int64_t M, int64_t K, int64_t N, const uint8_t *qs,
    const float *scales, int64_t p, uint32_t *panel, int q4_1) {
    const int64_t n = p * DP_PANEL_COLS;
    const int64_t row_bytes = q4_1 ? K / 2 : K;
    const int64_t row_scales = q4_1 ? K / BLOCK * 2 : K / BLOCK;
    const int vecs = N - n < DP_PANEL_COLS ? (int)((N - n) / 16) : DP_PANEL_VECS;
    qs += n * row_bytes;
    scales += n * row_scales;
    switch (vecs) {
    case 1:
        dp_expand_panel(panel, qs, scales, K, 1, q4_1);
        dp_panel_rows(y + n, xp, M, K, N, panel, 1);
        break;
    case 2:
        dp_expand_panel(panel, qs, scales, K, 2, q4_1);
        dp_panel_rows(y + n, xp, M, K, N, panel, 2);
        break;
    default:
        dp_expand_panel(panel, qs, scales, K, DP_PANEL_VECS, q4_1);
        dp_panel_rows(y + n, xp, M, K, N, panel, DP_PANEL_VECS);
        break;
    }
}

/* The panels of y = x · Wᵀ (x packed by dp_pack_rows; N a multiple of 16) shared out over
 * the threads of the enclosing region (an orphaned `omp for`, ending in a barrier), the
 * format a constant in each branch. `panel` (DP_PANEL_COLS * K bf16, 64-byte aligned) is
 * the calling thread's; NULL (its allocation failed, which the caller reports) skips. */
static void dp_panels(float *y, const uint16_t *xp, int64_t M, int64_t K, int64_t N,
                      const uint8_t *qs, const float *scales, int q4_1, uint32_t *panel) {
    const int64_t panels = (N + DP_PANEL_COLS - 1) / DP_PANEL_COLS;
    if (q4_1) {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p)
            if (panel != NULL) dp_panel(y, xp, M, K, N, qs, scales, p, panel, 1);
    } else {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p)
            if (panel != NULL) dp_panel(y, xp, M, K, N, qs, scales, p, panel, 0);
    }
}

#endif
