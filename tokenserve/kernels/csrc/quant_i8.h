/*
 * Few-row products of GGUF blocks with x rounded to 8 bits (AVX512-VNNI).
 *
 * quant_linear.c's few-row kernels expand every weight to float32 (or bf16) before multiplying it,
 * and at one to a few rows that expansion, not the weights' bytes, sets their time. Here x
 * is rounded per 32-weight block to 8-bit integers and a scale, as llama.cpp's Q8_1 and
 * Q8_0 and vLLM's GGUF kernels on GPUs do, and vpdpbusd multiplies a block's 4-bit or 8-bit
 * weights into it as integers: sums of four products a lane, exact in 32 bits, then one
 * conversion and one scaling a block. In real arithmetic the result is W · x̂, the file's
 * dequantized weights times x rounded to its blocks' 8-bit grid (x̂ = dx · q, dx = max |x| /
 * 127 over the block, q = x / dx rounded to nearest even).
 *
 * Rows of x are first rounded into a buffer laid out per group of weights, in the order the
 * weights come out of their blocks:
 *   Q4_1, groups of 4 blocks (128 weights, the 64 bytes of their nibbles): 64 bytes of q,
 *     byte 16j + i = block j's weight i (the low nibbles), then 64 bytes with its weights
 *     16 + i (the high nibbles); 16 floats dx (lane l: block l / 4's); 16 floats sx / 4
 *     (sx = dx · Σq, block l / 4's). Per weight row, block b adds d·dx·Σ(q_w·q) + m·sx.
 *   Q8_0, groups of 2 blocks (64 weights): 64 bytes of q in order; 16 floats dx (lane l:
 *     block l / 8's); 16 int32 c_l = -128 · (q_4l + ... + q_4l+3). vpdpbusd multiplies
 *     unsigned bytes by signed ones, so the weights go in offset by 128 (w ^ 0x80) and the
 *     sums start from c, which takes the offset back out.
 * Blocks past K in the last group have q = 0 and zero scales. Built where the level has
 * AVX512-VNNI (avx512_bf16 and amx).
 */
#ifndef TOKENSERVE_QUANT_I8_H
#define TOKENSERVE_QUANT_I8_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define I8_ROWS 4 /* rows of x a pass over the weights carries */
#define I8_PREFETCH_ROWS 8 /* weight rows ahead that i8_column prefetches */

/* Bytes of one group of the rounded x, and the weights a group spans. */
static inline int64_t i8_group_bytes(int q4_1) { return q4_1 ? 256 : 192; }
static inline int64_t i8_group_weights(int q4_1) { return q4_1 ? 128 : 64; }
static inline int64_t i8_groups(int64_t K, int q4_1) {
    const int64_t span = i8_group_weights(q4_1);
    return (K + span - 1) / span;
}
/* Bytes of one row of the rounded x. */
static inline int64_t i8_row_bytes(int64_t K, int q4_1) {
    return i8_groups(K, q4_1) * i8_group_bytes(q4_1);
}

/* The larger of the two layouts' row bytes (a buffer for rows of either kind). */
static inline int64_t i8_row_bytes_max(int64_t K) {
    const int64_t q4_1 = i8_row_bytes(K, 1), q8_0 = i8_row_bytes(K, 0);
    return q4_1 > q8_0 ? q4_1 : q8_0;
}

/* Block b (32 floats at x) rounded: its 32 values into q (lanes 0-15 then 16-31), and dx,
 * Σq returned through the pointers. */
static inline __attribute__((always_inline)) void i8_round_block(const float *x, __m128i *lo,
                                                                 __m128i *hi, float *dx,
                                                                 int32_t *sum) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
    *lo = _mm512_cvtsepi32_epi8(qa);
    *hi = _mm512_cvtsepi32_epi8(qb);
    *dx = d;
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

/* The M rows of x [M, K] rounded into xr (i8_row_bytes(K, q4_1) a row). */
static void i8_round_rows(uint8_t *xr, const float *x, int64_t M, int64_t K, int q4_1) {
    const int64_t blocks = K / BLOCK, row_bytes = i8_row_bytes(K, q4_1);
    const int64_t group_bytes = i8_group_bytes(q4_1);
    const int per_group = q4_1 ? 4 : 2, lanes = 16 / per_group;
    const int64_t groups = i8_groups(K, q4_1);
    for (int64_t m = 0; m < M; ++m) {
        uint8_t *row = xr + m * row_bytes;
        memset(row + (row_bytes - group_bytes), 0, (size_t)group_bytes); /* the last group */
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t *g = row + (b / per_group) * group_bytes;
            const int j = (int)(b % per_group);
            float *dx = (float *)(g + (q4_1 ? 128 : 64));
            __m128i lo, hi;
            float d;
            int32_t sum;
            i8_round_block(x + m * K + b * BLOCK, &lo, &hi, &d, &sum);
            for (int l = 0; l < lanes; ++l) dx[j * lanes + l] = d;
            if (q4_1) {
                _mm_storeu_si128((__m128i *)(g + 16 * j), lo);
                _mm_storeu_si128((__m128i *)(g + 64 + 16 * j), hi);
                float *sx = dx + 16;
                const float quarter = d * (float)sum * 0.25f;
                for (int l = 0; l < 4; ++l) sx[j * 4 + l] = quarter;
            } else {
                _mm_storeu_si128((__m128i *)(g + 32 * j), lo);
                _mm_storeu_si128((__m128i *)(g + 32 * j + 16), hi);
            }
        }
        if (!q4_1) /* the offsets' corrections, once the groups' q are in place */
            for (int64_t g = 0; g < groups; ++g) {
                uint8_t *group = row + g * group_bytes;
                const __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                      _mm512_set1_epi8((char)0x80),
                                                      _mm512_loadu_si512(group));
                _mm512_storeu_si512(group + 128, _mm512_sub_epi32(_mm512_setzero_si512(), c));
            }
    }
}

/* y[r * N] for the R rows of rounded x at xr (row_bytes apart) and weight row n: Q4_1. */
static inline __attribute__((always_inline)) void i8_q4_1_tile(
    float *y, int64_t N, const uint8_t *xr, int64_t row_bytes, int64_t K, const uint8_t *qs,
    const float *dm, const int R) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i d_index = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    const __m512i m_index = _mm512_add_epi32(d_index, _mm512_set1_epi32(1));
    const int64_t groups = i8_groups(K, 1), tail_blocks = (K / BLOCK) % 4;
    __m512 acc[I8_ROWS], accm[I8_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i v;
        __m512 s;
        if (g < groups - 1 || tail_blocks == 0) {
            v = _mm512_loadu_si512(qs + g * 64);
            s = _mm512_castps256_ps512(_mm256_loadu_ps(dm + g * 8));
        } else { /* the last group's blocks past K: no bytes, zero scales */
            v = _mm512_maskz_loadu_epi8((__mmask64)((1ULL << (16 * tail_blocks)) - 1),
                                        qs + g * 64);
            s = _mm512_maskz_loadu_ps((__mmask16)((1u << (2 * tail_blocks)) - 1), dm + g * 8);
        }
        const __m512i lo = _mm512_and_si512(v, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        const __m512 d = _mm512_permutexvar_ps(d_index, s), m = _mm512_permutexvar_ps(m_index, s);
        for (int r = 0; r < R; ++r) {
            const uint8_t *group = xr + r * row_bytes + g * 256;
            __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                               _mm512_loadu_si512(group));
            sums = _mm512_dpbusd_epi32(sums, hi, _mm512_loadu_si512(group + 64));
            const __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps((const float *)(group + 128)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
            accm[r] = _mm512_fmadd_ps(m, _mm512_loadu_ps((const float *)(group + 192)), accm[r]);
        }
    }
    for (int r = 0; r < R; ++r) y[r * N] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], accm[r]));
}

/* The same for Q8_0. */
static inline __attribute__((always_inline)) void i8_q8_0_tile(
    float *y, int64_t N, const uint8_t *xr, int64_t row_bytes, int64_t K, const int8_t *qs,
    const float *d_row, const int R) {
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    const __m512i d_index = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const int64_t groups = i8_groups(K, 0), tail = (K / BLOCK) % 2;
    __m512 acc[I8_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i w;
        __m512 s;
        if (g < groups - 1 || tail == 0) {
            w = _mm512_loadu_si512(qs + g * 64);
            s = _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(d_row + 2 * g))));
        } else {
            w = _mm512_maskz_loadu_epi8((__mmask64)0xFFFFFFFFULL, qs + g * 64);
            s = _mm512_maskz_loadu_ps((__mmask16)1, d_row + 2 * g);
        }
        w = _mm512_xor_si512(w, offset);
        const __m512 d = _mm512_permutexvar_ps(d_index, s);
        for (int r = 0; r < R; ++r) {
            const uint8_t *group = xr + r * row_bytes + g * 192;
            const __m512i sums = _mm512_dpbusd_epi32(_mm512_loadu_si512(group + 128), w,
                                                     _mm512_loadu_si512(group));
            const __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps((const float *)(group + 64)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) y[r * N] = _mm512_reduce_add_ps(acc[r]);
}

/* Output column n for all M rows, I8_ROWS at a time. */
static inline __attribute__((always_inline)) void i8_column(
    float *y, const uint8_t *xr, int64_t M, int64_t K, int64_t N, const uint8_t *qs,
    const float *scales, int64_t n, int q4_1) {
    const int64_t row_bytes = i8_row_bytes(K, q4_1);
    const int64_t w_bytes = q4_1 ? K / 2 : K, w_scales = q4_1 ? K / BLOCK * 2 : K / BLOCK;
    /* The weight row I8_PREFETCH_ROWS ahead, blocks and scales, as linear_column does (8
     * rows: 1- and 2-row steps 4 % faster than at its 4, no faster at 16). */
    const uint8_t *next_qs = qs + (n + I8_PREFETCH_ROWS) * w_bytes;
    const float *next_scales = scales + (n + I8_PREFETCH_ROWS) * w_scales;
    for (int64_t i = 0; i < w_bytes; i += 64) __builtin_prefetch(next_qs + i, 0, 2);
    for (int64_t i = 0; i < w_scales; i += 16) __builtin_prefetch(next_scales + i, 0, 2);
    for (int64_t m = 0; m < M; m += I8_ROWS) {
        const int rows = M - m < I8_ROWS ? (int)(M - m) : I8_ROWS;
        if (q4_1) {
            DISPATCH_ROWS(i8_q4_1_tile, rows, I8_ROWS, y + m * N + n, N, xr + m * row_bytes,
                          row_bytes, K, qs + n * w_bytes, scales + n * w_scales)
        } else {
            DISPATCH_ROWS(i8_q8_0_tile, rows, I8_ROWS, y + m * N + n, N, xr + m * row_bytes,
                          row_bytes, K, (const int8_t *)qs + n * w_bytes, scales + n * w_scales)
        }
    }
}

/* The columns of y shared out over the enclosing parallel region's threads (an orphaned
 * `omp for`, ending in a barrier); xr holds the M rounded rows. */
static void i8_columns(float *y, const uint8_t *xr, int64_t M, int64_t K, int64_t N,
                       const uint8_t *qs, const float *scales, int q4_1) {
    if (q4_1) {
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) i8_column(y, xr, M, K, N, qs, scales, n, 1);
    } else {
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) i8_column(y, xr, M, K, N, qs, scales, n, 0);
    }
}

/* y = x · Wᵀ with x rounded to 8 bits; 2 if the buffer for the rounded rows could not be
 * had. */
static int quant_linear_i8(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                           const uint8_t *qs, const float *scales, int q4_1) {
    if (K % BLOCK != 0) return 1;
    const int64_t row_bytes = i8_row_bytes(K, q4_1);
    uint8_t *xr = (uint8_t *)aligned_alloc(64, (size_t)(M * row_bytes));
    if (xr == NULL) return 2;
    i8_round_rows(xr, x, M, K, q4_1);
#pragma omp parallel
    i8_columns(y, xr, M, K, N, qs, scales, q4_1);
    free(xr);
    return 0;
}

#endif
