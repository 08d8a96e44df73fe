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
 * rounded to bf16 on its way to y, as oneDNN's bf16 GEMM hands its sums on (by
 * vcvtneps2bf16: amx_round_sums16). A pass's C tiles are written into y during the next
 * pass's products (AmxPending), and the last before the kernel's barrier.
 *
 * Layout: A = a panel of 16 weight rows expanded once per call into bf16 [16][K] (row
 * major, one 32-weight block per tile row: the blocks' natural order; expanded during the
 * first pass over x's rows), reused for every row of x; B = x packed once per call as pairs of k ([M / 16][K / 2][16 rows][2]: the VNNI
 * layout, rows padded to 16 with zeros); C = [16 weight rows x 16 x rows], transposed on
 * their way to y. All eight tiles are 16 rows x 64 bytes. Up to AMX_C row tiles of x (64
 * rows) one panel at a time (amx_panel: C tiles 0-3, A 4, B 5-7), all row tiles in one
 * pass sharing each A load; up to 32 rows (decode steps of few requests) each expanded
 * block is loaded into the A tile once, from a small buffer instead of the panel's rows.
 * Above 64 rows two panels at a time, two row tiles per pass (amx_panel_pair: C 0-3, A
 * 4-5, B 6-7), so that each B tile, which streams from L2 once x outgrows L1, feeds two
 * products instead of one. Each C element is the same sum in the same order whichever
 * function computes it. x and y are float32 or bf16 (the bf16 values the operators around
 * a bf16 product hand over: half the bytes, no cast between).
 */
#ifndef TOKENSERVE_QUANT_AMX_H
#define TOKENSERVE_QUANT_AMX_H

#include "amx.h"
#include "quant_bf16.h"

#define AMX_PANEL 16 /* weight rows per A tile: N must be a multiple */
#define AMX_C 4      /* C tiles: row tiles of x per pass over a panel */
/* Rows of x per round over all panels (amx_round_rows): as many as keep a round's packed x
 * (rows x K bf16) within AMX_ROUND_BYTES, so that it stays in L2 while every panel streams
 * it: 1024 rows at K = 576, 384 at K = 1536; more rows are taken in rounds, each expanding
 * the weights again. (A loop of the kernel's tile pattern on one thread streaming B from
 * 1.1 MiB ran at ~2.0 TFLOP/s, from 1.6-1.8 MiB at 1.2-1.3: docs/PERFORMANCE_CPU.md.) */
#define AMX_ROUND_BYTES (1152 * 1024)

static inline int64_t amx_round_rows(int64_t K) {
    const int64_t rows = AMX_ROUND_BYTES / (K * 2) / 32 * 32;
    return rows < 64 ? 64 : rows;
}

/* x [M, K] float32 (rounded to bf16) or bf16 (x_bf16) → xp [padded / 16][K / 2][16][2] bf16
 * pairs (rows M..padded-1 zero),
 * shared out over the threads of the enclosing region (an orphaned `omp for`, ending in a
 * barrier) by 32-k blocks of 16 rows: each such item is a 16 x 16 transpose of the rows'
 * pairs in registers, written as 16 whole cache lines. (Scattering each row's pairs 64 bytes
 * apart, rows shared out over the threads, had both threads writing every line of a row
 * tile: with few rows that was as slow as the products.) */
static void amx_pack_rows(uint16_t *xp, const void *x, int x_bf16, int64_t M, int64_t K) {
    const int64_t blocks = K / 32, items = (M + 15) / 16 * blocks;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t t = item / blocks, k = item % blocks * 32;
        __m512i r[16];
        for (int j = 0; j < 16; ++j) {
            const int64_t m = t * 16 + j;
            r[j] = _mm512_setzero_si512();
            if (m < M && x_bf16) {
                r[j] = _mm512_loadu_si512((const uint16_t *)x + m * K + k);
            } else if (m < M) {
                const float *row = (const float *)x + m * K;
                const __m256i lo = bf16_round16(_mm512_loadu_ps(row + k));
                const __m256i hi = bf16_round16(_mm512_loadu_ps(row + k + 16));
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

/* 16 sums of the tiles → their bf16 bits, rounded as bf16_round16 rounds them, in one
 * vcvtneps2bf16 (a fifth of the instructions: rounding a product's sums took ~20 % of its
 * time). The instruction reads denormals as zero, but the tiles never hold one (tdpbf16ps
 * flushes its denormal results to zero), and a NaN becomes the one quiet NaN, as there. */
static inline __m256i amx_round_sums16(__m512 sums) {
    const __m256i r = (__m256i)_mm512_cvtneps_pbh(sums);
    return _mm256_mask_mov_epi16(r, _mm512_cmp_ps_mask(sums, sums, _CMP_UNORD_Q),
                                 _mm256_set1_epi16(0x7fc0));
}

/* One row of y (float32, or bf16 where y_bf16), columns n..n+15: the 16 sums rounded to
 * bf16. */
static inline void amx_store_row(void *y, int y_bf16, int64_t N, int64_t m, int64_t n,
                                 __m512 sums) {
    const __m256i bits = amx_round_sums16(sums);
    if (y_bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + m * N + n), bits);
    else
        _mm512_storeu_si512((float *)y + m * N + n,
                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* A stored C tile c ([16 weight rows][16 x rows]) into y's rows m0.. (rows of them),
 * columns n..n+15: a gather per row (few rows: decode steps). */
static inline void amx_store_c(void *y, int y_bf16, int64_t N, int64_t n, int64_t m0,
                               int64_t rows, const float *c) {
    const __m512i apart = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(16));
    for (int64_t m = 0; m < rows; ++m)
        amx_store_row(y, y_bf16, N, m0 + m, n, _mm512_i32gather_ps(apart, c + m, 4));
}

/* amx_store_c by a 16 x 16 transpose in registers (avx512.h), for whole row tiles. */
static inline void amx_store_c_transposed(void *y, int y_bf16, int64_t N, int64_t n,
                                          int64_t m0, int64_t rows, const float *c) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(c + 16 * i);
    transpose16(r); /* r[m]: x row m0 + m's 16 sums */
    for (int64_t m = 0; m < rows; ++m)
        amx_store_row(y, y_bf16, N, m0 + m, n, _mm512_castsi512_ps(r[m]));
}

/* C tiles of amx_panel(_pair) stored but not yet written into y: each is transposed and
 * written during one k-step of the products after it, so that the AVX-512 work of the
 * transposes runs while the tiles multiply (done after all of a pass's products, the
 * stores of a 576-wide product took ~30 % of its time: the tile unit waited on them). */
/* Tiles of fewer rows of x than this are written by a gather per row, more by a transpose. */
#define AMX_GATHER_ROWS 8

typedef struct {
    _Alignas(64) float c[4][16 * 16];
    int64_t n[4], m0[4], rows[4];
    int count, next;
} AmxPending;

/* Writes the next pending tile, if any, into y. */
static inline void amx_pending_one(AmxPending *p, void *y, int y_bf16, int64_t N) {
    if (p->next < p->count) {
        const int i = p->next++;
        if (p->rows[i] < AMX_GATHER_ROWS)
            amx_store_c(y, y_bf16, N, p->n[i], p->m0[i], p->rows[i], p->c[i]);
        else
            amx_store_c_transposed(y, y_bf16, N, p->n[i], p->m0[i], p->rows[i], p->c[i]);
    }
}

/* Writes every pending tile into y. */
static inline void amx_pending_flush(AmxPending *p, void *y, int y_bf16, int64_t N) {
    while (p->next < p->count) amx_pending_one(p, y, y_bf16, N);
    p->count = p->next = 0;
}

/* C tile `tile` (a constant) stored as pending for y's columns n.., rows m0.. (rows). */
#define AMX_PEND(p, tile, col, row0, nrows)                                                  \
    do {                                                                                    \
        _tile_stored(tile, (p)->c[(p)->count], 64);                                         \
        (p)->n[(p)->count] = (col), (p)->m0[(p)->count] = (row0);                           \
        (p)->rows[(p)->count++] = (nrows);                                                  \
    } while (0)

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
    void *y, int y_bf16, int64_t n, const uint16_t *xp, uint16_t *a, const uint8_t *qs,
    const float *scales, int64_t M, int64_t K, int64_t N, AmxPending *pending, int q4_1) {
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
            amx_pending_one(pending, y, y_bf16, N);
        }
        amx_pending_flush(pending, y, y_bf16, N);
        for (int64_t t = 0; t < count; ++t) {
            const int64_t m0 = (t0 + t) * 16, rows = M - m0 < 16 ? M - m0 : 16;
            switch (t) {
            case 0: AMX_PEND(pending, 0, n, m0, rows); break;
            case 1: AMX_PEND(pending, 1, n, m0, rows); break;
            case 2: AMX_PEND(pending, 2, n, m0, rows); break;
            default: AMX_PEND(pending, 3, n, m0, rows); break;
            }
        }
    }
}

/* Two panels (y's columns n..n+31, the first's weight rows' blocks at qs and scales, the
 * second's right after) times every row of x, two row tiles per pass: C tiles 0-1 the
 * panels against row tile t, 2-3 against t + 1; A tiles 4-5 the panels' expanded blocks,
 * B tiles 6-7 the row tiles, each load feeding two products. The first pass expands both
 * panels into `a` (2 x AMX_PANEL rows, K * 2 bytes apart) as it goes, fetching the next
 * pair's blocks into L2. */
static inline __attribute__((always_inline)) void amx_panel_pair(
    void *y, int y_bf16, int64_t n, const uint16_t *xp, uint16_t *a, const uint8_t *qs,
    const float *scales, int64_t M, int64_t K, int64_t N, AmxPending *pending, int q4_1) {
    const int64_t tiles = (M + 15) / 16, tile_elems = K / 2 * 32;
    const int64_t row_bytes = q4_1 ? K / 2 : K, row_scales = q4_1 ? K / BLOCK * 2 : K / BLOCK;
    const uint8_t *qs1 = qs + AMX_PANEL * row_bytes;
    const float *scales1 = scales + AMX_PANEL * row_scales;
    uint16_t *a1 = a + AMX_PANEL * K;
    for (int64_t t0 = 0; t0 < tiles; t0 += 2) {
        const int two = t0 + 1 < tiles;
        const uint16_t *b = xp + t0 * tile_elems;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
            if (t0 == 0) {
                /* amx_prefetch_next_block fetches the panel after the one it is given. */
                amx_prefetch_next_block(qs1, scales1, K, k / BLOCK, q4_1);
                amx_prefetch_next_block(qs1 + AMX_PANEL * row_bytes,
                                        scales1 + AMX_PANEL * row_scales, K, k / BLOCK, q4_1);
                amx_expand_block(a + k, qs, scales, K, K, k / BLOCK, q4_1);
                amx_expand_block(a1 + k, qs1, scales1, K, K, k / BLOCK, q4_1);
            }
            _tile_loadd(4, a + k, K * 2);
            _tile_loadd(5, a1 + k, K * 2);
            _tile_loadd(6, b + k * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            if (two) {
                _tile_loadd(7, b + tile_elems + k * 16, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
            amx_pending_one(pending, y, y_bf16, N);
        }
        amx_pending_flush(pending, y, y_bf16, N);
        const int64_t m0 = t0 * 16, rows0 = M - m0 < 16 ? M - m0 : 16;
        AMX_PEND(pending, 0, n, m0, rows0);
        AMX_PEND(pending, 1, n + AMX_PANEL, m0, rows0);
        if (two) {
            const int64_t m1 = m0 + 16, rows1 = M - m1 < 16 ? M - m1 : 16;
            AMX_PEND(pending, 2, n, m1, rows1);
            AMX_PEND(pending, 3, n + AMX_PANEL, m1, rows1);
        }
    }
}

/* The panels of y = x · Wᵀ (x packed by amx_pack_rows) shared out over the threads of the
 * enclosing region (an orphaned `omp for`, ending in a barrier): one at a time up to AMX_C
 * row tiles, else in pairs (an odd last panel alone). `a` (2 * AMX_PANEL * K bf16) is the
 * calling thread's; N a multiple of AMX_PANEL, AMX permitted (amx_permitted()); y float32
 * or (y_bf16) bf16. */
static void amx_columns(void *y, int y_bf16, const uint16_t *xp, int64_t M, int64_t K,
                        int64_t N, const uint8_t *qs, const float *scales, int q4_1,
                        uint16_t *a) {
    const int64_t row_bytes = q4_1 ? K / 2 : K;
    const int64_t row_scales = q4_1 ? K / BLOCK * 2 : K / BLOCK;
    const int64_t panels = N / AMX_PANEL, step = (M + 15) / 16 > AMX_C ? 2 : 1;
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    AmxPending pending = {.count = 0, .next = 0};
    int configured = 0;
#pragma omp for schedule(static) nowait
    for (int64_t g = 0; g < (panels + step - 1) / step; ++g) {
        const int64_t p = g * step, n = p * AMX_PANEL;
        if (a == NULL) continue;
        if (!configured) {
            /* Per call: oneDNN loads its own configuration on these threads in between. */
            amx_load_config(&config);
            configured = 1;
        }
        const uint8_t *panel_qs = qs + n * row_bytes;
        const float *panel_scales = scales + n * row_scales;
        /* The format a constant in each branch (OpenMP outlines a parallel body once). */
        if (step == 2 && p + 1 < panels) {
            if (q4_1)
                amx_panel_pair(y, y_bf16, n, xp, a, panel_qs, panel_scales, M, K, N, &pending, 1);
            else
                amx_panel_pair(y, y_bf16, n, xp, a, panel_qs, panel_scales, M, K, N, &pending, 0);
        } else if (q4_1) {
            amx_panel(y, y_bf16, n, xp, a, panel_qs, panel_scales, M, K, N, &pending, 1);
        } else {
            amx_panel(y, y_bf16, n, xp, a, panel_qs, panel_scales, M, K, N, &pending, 0);
        }
    }
    amx_pending_flush(&pending, y, y_bf16, N);
    if (configured) _tile_release();
#pragma omp barrier
}

#endif
