/*
 * The amx level of quant_linear.c: y = x · Wᵀ on GGUF blocks with a bfloat16 model's
 * numerics, on AMX tiles (tdpbf16ps: 16 x 16 float32 sums of bf16 pairs).
 *
 * Numerics, those of the model's dense bf16 products: each weight is expanded exactly as
 * the float32 kernels expand it (Q4_1 d * q + m, Q8_0 d * q, unfused float32) and then
 * rounded to bf16 to nearest even, as `tensor.to(torch.bfloat16)` rounds the dequantized
 * weight the model loads; x is rounded to bf16 the same way; the sums are float32 on the
 * tiles, over k in a fixed order (32 k per instruction, blocks in order), so a row's result
 * depends neither on M nor on the other rows (each C element is its own sum), and each is
 * rounded to bf16 on its way to y, as oneDNN's bf16 GEMM hands its sums on.
 *
 * Layout: A = a panel of 16 weight rows expanded once per call into bf16 [16][K] (row
 * major, one 32-weight block per tile row: the blocks' natural order; expanded during the
 * first pass over x's rows), reused for every row of x; B = x packed once per call as pairs of k ([M / 16][K / 2][16 rows][2]: the VNNI
 * layout, rows padded to 16 with zeros); C = [16 weight rows x 16 x rows], up to four of
 * them per pass (64 rows of x sharing each A load), transposed on their way to y. All
 * eight tiles are 16 rows x 64 bytes: 0-3 C, 4 A, 5-7 B. Up to 32 rows of x (decode
 * steps of few requests) each expanded block is loaded into the A tile once, from a small
 * buffer instead of the panel's rows (amx_panel; the same sums in the same order).
 */
#ifndef TOKENSERVE_QUANT_AMX_H
#define TOKENSERVE_QUANT_AMX_H

#include "amx.h"
#include "quant_bf16.h"

#define AMX_PANEL 16 /* weight rows per A tile: N must be a multiple */
#define AMX_C 4      /* C tiles: row tiles of x per pass over a panel */

/* x [M, K] float32 → xp [padded / 16][K / 2][16][2] bf16 pairs (rows M..padded-1 zero),
 * shared out over the threads of the enclosing region (an orphaned `omp for`, ending in a
 * barrier) by 32-k blocks of 16 rows: each such item is a 16 x 16 transpose of the rows'
 * pairs in registers, written as 16 whole cache lines. (Scattering each row's pairs 64 bytes
 * apart, rows shared out over the threads, had both threads writing every line of a row
 * tile: with few rows that was as slow as the products.) */
static void amx_pack_rows(uint16_t *xp, const float *x, int64_t M, int64_t K) {
    const int64_t blocks = K / 32, items = (M + 15) / 16 * blocks;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t t = item / blocks, k = item % blocks * 32;
        __m512i r[16];
        for (int j = 0; j < 16; ++j) {
            const int64_t m = t * 16 + j;
            r[j] = _mm512_setzero_si512();
            if (m < M) {
                const __m256i lo = bf16_round16(_mm512_loadu_ps(x + m * K + k));
                const __m256i hi = bf16_round16(_mm512_loadu_ps(x + m * K + k + 16));
                r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            }
        }
        transpose16(r); /* r[p]: pair p of the block, for each of the 16 rows */
        uint32_t *tile = (uint32_t *)xp + t * (K / 2) * 16 + k / 2 * 16;
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + p * 16, r[p]);
    }
}

/* Block b (32 weights) of AMX_PANEL weight rows (quant_linear.c's layouts, from the
 * panel's first row) → a[j * stride ..] bf16 (32 of them), for the panel's rows j
 * (bf16_expand_block). */
static inline __attribute__((always_inline)) void amx_expand_block(
    uint16_t *a, const uint8_t *qs, const float *scales, int64_t stride, int64_t K, int64_t b,
    int q4_1) {
    const int64_t row_bytes = q4_1 ? K / 2 : K, row_scales = q4_1 ? K / BLOCK * 2 : K / BLOCK;
    for (int j = 0; j < AMX_PANEL; ++j)
        _mm512_storeu_si512(a + j * stride,
                            bf16_expand_block(qs + j * row_bytes, scales + j * row_scales, b,
                                              q4_1));
}

/* The next panel's cache lines that hold block b, fetched into L2 while this panel's block b
 * is expanded: spread over the first pass, not all at its start, so that the core does not
 * wait on a burst of outstanding fetches (a sampled profile of few-row decode steps had a
 * third of this kernel's time on the burst's prefetch instructions). A line holds 4 Q4_1
 * or 2 Q8_0 blocks of a row, and 8 or 16 blocks' scales. */
static inline void amx_prefetch_next_block(const uint8_t *qs, const float *scales, int64_t K,
                                           int64_t b, int q4_1) {
    const int64_t blocks = K / BLOCK, row_bytes = q4_1 ? K / 2 : K;
    const int64_t block_bytes = q4_1 ? 16 : BLOCK, scale_floats = q4_1 ? 2 : 1;
    const uint8_t *next_qs = qs + AMX_PANEL * row_bytes;
    const float *next_scales = scales + AMX_PANEL * blocks * scale_floats;
    if ((b * block_bytes) % 64 == 0)
        for (int j = 0; j < AMX_PANEL; ++j)
            __builtin_prefetch(next_qs + j * row_bytes + b * block_bytes, 0, 2);
    if ((b * scale_floats * 4) % 64 == 0)
        for (int j = 0; j < AMX_PANEL; ++j)
            __builtin_prefetch(next_scales + (j * blocks + b) * scale_floats, 0, 2);
}

/* C tile `t` ([16 weight rows][16 x rows]) into y's rows m0.. (rows of them), columns
 * n..n+15, each sum rounded to bf16. */
static inline void amx_store_c(float *y, int64_t N, int64_t m0, int64_t rows, float *c) {
    const __m512i apart = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(16));
    for (int64_t m = 0; m < rows; ++m)
        _mm512_storeu_ps(y + (m0 + m) * N, bf16_round_ps(_mm512_i32gather_ps(apart, c + m, 4)));
}

/* One panel (y's columns n..n+15, its weight rows' blocks at qs and scales) times every
 * row of x (packed in xp), up to AMX_C row tiles per pass. The first pass expands the
 * weights block by block as it goes (the expansion then overlaps the tile products'
 * latency): into `a`, the panel's rows K * 2 bytes apart, where later passes reuse them.
 * With at most two row tiles (M <= 32, a few requests' decode step: one pass, each block
 * loaded into the A tile once or twice) into 16 rows of 64 bytes instead (1 KiB, two such
 * buffers taking turns), from which the tile loads faster: expanding a block and loading
 * the tile that reads it bound such a step's products, and with the strided rows decode
 * steps of 2-4 rows of the default model took 4-6 % longer, of 8-32 rows 1-3 %; from 48
 * rows on no difference (`benchmarks/decode_step_cost.py --other-csrc`,
 * docs/PERFORMANCE_CPU.md). */
static inline __attribute__((always_inline)) void amx_panel(
    float *y, const uint16_t *xp, uint16_t *a, const uint8_t *qs, const float *scales,
    int64_t M, int64_t K, int64_t N, float *c, int q4_1) {
    const int64_t tiles = (M + 15) / 16, tile_elems = K / 2 * 32; /* bf16 per packed x tile */
    const int few = tiles <= 2;
    _Alignas(64) uint16_t block[2][AMX_PANEL * BLOCK];
    for (int64_t t0 = 0; t0 < tiles; t0 += AMX_C) {
        const int64_t count = tiles - t0 < AMX_C ? tiles - t0 : AMX_C;
        const uint16_t *b = xp + t0 * tile_elems;
        _tile_zero(0);
        if (count > 1) _tile_zero(1);
        if (count > 2) _tile_zero(2);
        if (count > 3) _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
            if (few) {
                uint16_t *ab = block[(k / BLOCK) & 1];
                amx_prefetch_next_block(qs, scales, K, k / BLOCK, q4_1);
                amx_expand_block(ab, qs, scales, BLOCK, K, k / BLOCK, q4_1);
                _tile_loadd(4, ab, BLOCK * 2);
            } else {
                if (t0 == 0) {
                    amx_prefetch_next_block(qs, scales, K, k / BLOCK, q4_1);
                    amx_expand_block(a + k, qs, scales, K, K, k / BLOCK, q4_1);
                }
                _tile_loadd(4, a + k, K * 2);
            }
            _tile_loadd(5, b + k * 16, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (count > 1) {
                _tile_loadd(6, b + tile_elems + k * 16, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (count > 2) {
                _tile_loadd(7, b + 2 * tile_elems + k * 16, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (count > 3) {
                _tile_loadd(5, b + 3 * tile_elems + k * 16, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        for (int64_t t = 0; t < count; ++t) {
            switch (t) {
            case 0: _tile_stored(0, c, 64); break;
            case 1: _tile_stored(1, c, 64); break;
            case 2: _tile_stored(2, c, 64); break;
            default: _tile_stored(3, c, 64); break;
            }
            const int64_t m0 = (t0 + t) * 16;
            amx_store_c(y, N, m0, M - m0 < 16 ? M - m0 : 16, c);
        }
    }
}

/* The panels of y = x · Wᵀ (x packed by amx_pack_rows) shared out over the threads of the
 * enclosing region (an orphaned `omp for`, ending in a barrier). `a` (AMX_PANEL * K bf16)
 * is the calling thread's; N a multiple of AMX_PANEL, AMX permitted (amx_permitted()). */
static void amx_columns(float *y, const uint16_t *xp, int64_t M, int64_t K, int64_t N,
                        const uint8_t *qs, const float *scales, int q4_1, uint16_t *a) {
    const int64_t row_bytes = q4_1 ? K / 2 : K;
    const int64_t row_scales = q4_1 ? K / BLOCK * 2 : K / BLOCK;
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _Alignas(64) float c[16 * 16];
    int configured = 0;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < N / AMX_PANEL; ++p) {
        const int64_t n = p * AMX_PANEL;
        if (a == NULL) continue;
        if (!configured) {
            /* Per call: oneDNN loads its own configuration on these threads in between. */
            amx_load_config(&config);
            configured = 1;
        }
        /* The format a constant in each branch (OpenMP outlines a parallel body once). */
        if (q4_1)
            amx_panel(y + n, xp, a, qs + n * row_bytes, scales + n * row_scales, M, K, N, c, 1);
        else
            amx_panel(y + n, xp, a, qs + n * row_bytes, scales + n * row_scales, M, K, N, c, 0);
    }
    if (configured) _tile_release();
}

#endif
