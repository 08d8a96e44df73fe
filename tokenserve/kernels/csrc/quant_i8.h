/*
 * Few-row products of GGUF blocks with x rounded to 8 bits (AVX512-VNNI, or AVX2).
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
 * The weights are read from a copy laid out for this kernel once at load (i8_repack), in
 * panels of 16 output rows: per panel, per 32-weight block, the 16 rows' weights as 8 rows
 * of 64 bytes in which byte 4n + i of row k is output row n's weight 4k + i, so that one
 * vpdpbusd of row k against x's four values 4k..4k+3 (broadcast) adds a block's four
 * products to each of the 16 outputs' lanes, and then the 16 rows' scales (float16, as in
 * the file). Each lane is one output: no sums across lanes, one scaling per block for 16
 * outputs, and the bytes of the file's blocks, not more:
 *   Q4_1, I8_Q4_1_BYTES (320) a panel's block: 4 × 64 bytes of nibbles, byte 64r + 4n + i
 *     holding row n's weight 4r + i (low nibble) and 16 + 4r + i (high nibble): the file's
 *     byte 4r + i of row n's block, so rows 0-3 come from the low nibbles and rows 4-7 from
 *     the high ones; then 16 d and 16 m.
 *   Q8_0, I8_Q8_0_BYTES (544): 8 × 64 bytes, byte 64k + 4n + i = row n's weight 4k + i offset
 *     by 128 (w ^ 0x80: vpdpbusd multiplies unsigned bytes by signed ones); then 16 d.
 * A last panel of fewer than 16 rows is padded with zero weights and scales.
 *
 * Rows of x are first rounded into a buffer (i8_row_bytes(K) a row): K bytes of q in order,
 * then per block dx (float), then per block Q4_1: sx = dx · Σq (block b adds d·dx·Σ(q_w·q)
 * + m·sx to an output); Q8_0: c = -128 · Σq (int32), where the block's sums start so that
 * the weights' offset comes back out. This form is built where the level has AVX512-VNNI
 * (avx512_bf16 and amx).
 *
 * Below VNNI (the avx2 and avx512 levels) the same layout and the same rounded x go through
 * AVX2's vpmaddubsw, which multiplies unsigned bytes by signed ones and adds each pair into
 * a saturating int16, then vpmaddwd, which adds the pairs' pairs into int32 (as llama.cpp
 * does on AVX2): the same integers, so the same result up to the order of the float32 sums.
 * A 64-byte row of a block is two halves of 8 outputs each (256-bit registers). Q4_1's
 * products are at most 15 · 127, a pair 3,810, and a block's eight pairs of one lane 30,480,
 * so they are added as int16 before one vpmaddwd; Q8_0's weights (w ^ 0x80 undone) give
 * pairs of up to 2 · 128 · 127 = 32,512, so each goes to int32 on its own, as |w| times x
 * with w's sign (vpsignb), and c is not needed.
 */
#ifndef TOKENSERVE_QUANT_I8_H
#define TOKENSERVE_QUANT_I8_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define I8_VNNI 1
#define I8_ROWS 8 /* rows of x a pass over a panel carries (its 8 weight rows in registers) */
#else
#define I8_VNNI 0
#define I8_ROWS 4 /* (16 registers of 256 bits: 8 weight rows, the rows' sums, temporaries) */
#endif
#define I8_PANEL 16 /* output rows a panel */
#define I8_Q4_1_BYTES 320
#define I8_Q8_0_BYTES 544
#define I8_PREFETCH_PANELS 2 /* panels ahead whose bytes i8_panel prefetches */
#define I8_CHUNK_ROWS 64 /* rows of x a sweep over the panels takes (64 · K bytes, in L2) */
/* Above this many rows the threads round x together (in the fused layer into one buffer). */
#define I8_SHARED_ROUND_ROWS 16

static inline int64_t i8_block_bytes(int q4_1) { return q4_1 ? I8_Q4_1_BYTES : I8_Q8_0_BYTES; }
static inline int64_t i8_panels(int64_t N) { return (N + I8_PANEL - 1) / I8_PANEL; }
/* Bytes of a weight of N output rows and K inputs in the kernel's layout. */
static inline int64_t i8_weight_bytes(int64_t N, int64_t K, int q4_1) {
    return i8_panels(N) * (K / BLOCK) * i8_block_bytes(q4_1);
}
/* Bytes of one row of the rounded x. */
static inline int64_t i8_row_bytes(int64_t K) { return K + K / BLOCK * 8; }

/* The file's blocks (quant_linear.c's layouts: Q4_1 qs [N, K / 2] and dm [N, K / 32, 2],
 * Q8_0 qs [N, K] and d [N, K / 32]) into the kernel's at out (i8_weight_bytes). */
static void i8_repack(uint8_t *out, const uint8_t *qs, const float *scales, int64_t N,
                      int64_t K, int q4_1) {
    const int64_t blocks = K / BLOCK, block_bytes = i8_block_bytes(q4_1);
    const int64_t row_bytes = q4_1 ? K / 2 : K, weight_bytes = q4_1 ? 16 : 32;
    const int64_t scale_count = q4_1 ? 2 : 1, panels = i8_panels(N);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t *dst = out + (p * blocks + b) * block_bytes;
            float d[I8_PANEL], m[I8_PANEL];
            memset(dst, q4_1 ? 0 : 0x80, (size_t)(weight_bytes * I8_PANEL));
            for (int64_t n = 0; n < I8_PANEL; ++n) {
                const int64_t row = p * I8_PANEL + n;
                d[n] = m[n] = 0.0f;
                if (row >= N) continue;
                const uint8_t *src = qs + row * row_bytes + b * weight_bytes;
                for (int64_t j = 0; j < weight_bytes; ++j)
                    dst[64 * (j / 4) + 4 * n + j % 4] = q4_1 ? src[j] : (uint8_t)(src[j] ^ 0x80);
                d[n] = scales[(row * blocks + b) * scale_count];
                if (q4_1) m[n] = scales[(row * blocks + b) * scale_count + 1];
            }
            const int64_t at = weight_bytes * I8_PANEL;
            for (int h = 0; h < 2; ++h) {
                _mm_storeu_si128((__m128i *)(dst + at + 16 * h),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(d + 8 * h),
                                                 _MM_FROUND_TO_NEAREST_INT));
                if (q4_1)
                    _mm_storeu_si128((__m128i *)(dst + at + 32 + 16 * h),
                                     _mm256_cvtps_ph(_mm256_loadu_ps(m + 8 * h),
                                                     _MM_FROUND_TO_NEAREST_INT));
            }
        }
}

/* Panel p's blocks in the weight; the panel I8_PREFETCH_PANELS ahead starts coming from
 * memory. */
static inline __attribute__((always_inline)) const uint8_t *i8_panel_start(
    const uint8_t *weight, int64_t p, int64_t N, int64_t panel_bytes) {
    const uint8_t *w = weight + p * panel_bytes;
    if (p + I8_PREFETCH_PANELS < i8_panels(N))
        for (int64_t i = 0; i < panel_bytes; i += 64)
            __builtin_prefetch(w + I8_PREFETCH_PANELS * panel_bytes + i, 0, 2);
    return w;
}

#if I8_VNNI

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

/* y[r * N + 16p ...] for the R rows of rounded x at xr (row_bytes apart) and panel p of the
 * weight (its blocks at w): each block's 8 weight rows are expanded once into registers and
 * taken by every row of x. `store` masks a last panel's columns past N. */
static inline __attribute__((always_inline)) void i8_panel_rows(
    float *y, int64_t N, const uint8_t *xr, int64_t row_bytes, int64_t K, const uint8_t *w,
    __mmask16 store, int q4_1, const int R) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int64_t blocks = K / BLOCK, block_bytes = i8_block_bytes(q4_1);
    __m512 acc[I8_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = w + b * block_bytes;
        __m512i k[8];
        __m512 d, m = _mm512_setzero_ps();
        if (q4_1) {
            for (int j = 0; j < 4; ++j) {
                const __m512i v = _mm512_loadu_si512(block + 64 * j);
                k[j] = _mm512_and_si512(v, low4);
                k[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 256)));
            m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 288)));
        } else {
            for (int j = 0; j < 8; ++j) k[j] = _mm512_loadu_si512(block + 64 * j);
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 512)));
        }
        for (int r = 0; r < R; ++r) {
            const uint8_t *q = xr + r * row_bytes;
            const float *dx = (const float *)(q + K);
            const int32_t *x4 = (const int32_t *)(q + b * BLOCK);
            __m512i sums = q4_1 ? _mm512_setzero_si512()
                                : _mm512_set1_epi32(((const int32_t *)dx)[blocks + b]);
            for (int j = 0; j < 8; ++j)
                sums = _mm512_dpbusd_epi32(sums, k[j], _mm512_set1_epi32(x4[j]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums),
                                     _mm512_mul_ps(d, _mm512_set1_ps(dx[b])), acc[r]);
            if (q4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx[blocks + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N, store, acc[r]);
}

/* Panel p of y for all M rows, I8_ROWS at a time. */
static inline __attribute__((always_inline)) void i8_panel(
    float *y, const uint8_t *xr, int64_t M, int64_t K, int64_t N, const uint8_t *weight,
    int64_t p, int q4_1) {
    const int64_t row_bytes = i8_row_bytes(K);
    const uint8_t *w = i8_panel_start(weight, p, N, K / BLOCK * i8_block_bytes(q4_1));
    const int64_t left = N - p * I8_PANEL;
    const __mmask16 store = left >= I8_PANEL ? (__mmask16)0xFFFF
                                             : (__mmask16)((1u << left) - 1);
    for (int64_t m = 0; m < M; m += I8_ROWS) {
        const int rows = M - m < I8_ROWS ? (int)(M - m) : I8_ROWS;
        if (q4_1) {
            DISPATCH_ROWS(i8_panel_rows, rows, I8_ROWS, y + m * N + p * I8_PANEL, N,
                          xr + m * row_bytes, row_bytes, K, w, store, 1)
        } else {
            DISPATCH_ROWS(i8_panel_rows, rows, I8_ROWS, y + m * N + p * I8_PANEL, N,
                          xr + m * row_bytes, row_bytes, K, w, store, 0)
        }
    }
}

#else /* AVX2: vpmaddubsw and vpmaddwd */

/* Block b (32 floats at x) rounded as above, with AVX2. */
static inline __attribute__((always_inline)) void i8_round_block(const float *x, __m128i *lo,
                                                                 __m128i *hi, float *dx,
                                                                 int32_t *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    /* The packs work within 128-bit lanes: 4-value groups come out as 0 2 4 6 | 1 3 5 7. */
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    *lo = _mm256_castsi256_si128(packed);
    *hi = _mm256_extracti128_si256(packed, 1);
    *dx = d;
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *sum = _mm_cvtsi128_si32(s4);
}

/* Half h (outputs 8h..8h+7) of panel p's columns of y, for the R rows of rounded x at xr
 * (row_bytes apart): each block's 8 weight rows of that half are expanded once into
 * registers and taken by every row of x. `columns` (1-8) of the half lie within N. */
static inline __attribute__((always_inline)) void i8_panel_rows(
    float *y, int64_t N, const uint8_t *xr, int64_t row_bytes, int64_t K, const uint8_t *w,
    int h, int columns, int q4_1, const int R) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const int64_t blocks = K / BLOCK, block_bytes = i8_block_bytes(q4_1);
    __m256 acc[I8_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = w + b * block_bytes + 32 * h;
        __m256i k[8], a[8];
        __m256 d, m = _mm256_setzero_ps();
        if (q4_1) {
            for (int j = 0; j < 4; ++j) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(block + 64 * j));
                k[j] = _mm256_and_si256(v, low4);
                k[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            }
            d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block - 16 * h + 256)));
            m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block - 16 * h + 288)));
        } else {
            for (int j = 0; j < 8; ++j) {  /* the signed weights, and their magnitudes */
                k[j] = _mm256_xor_si256(
                    _mm256_loadu_si256((const __m256i *)(block + 64 * j)), flip);
                a[j] = _mm256_abs_epi8(k[j]);
            }
            d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block - 16 * h + 512)));
        }
        for (int r = 0; r < R; ++r) {
            const uint8_t *q = xr + r * row_bytes;
            const float *dx = (const float *)(q + K);
            const int32_t *x4 = (const int32_t *)(q + b * BLOCK);
            __m256i sums;
            if (q4_1) {
                __m256i pairs = _mm256_maddubs_epi16(k[0], _mm256_set1_epi32(x4[0]));
                for (int j = 1; j < 8; ++j)
                    pairs = _mm256_add_epi16(
                        pairs, _mm256_maddubs_epi16(k[j], _mm256_set1_epi32(x4[j])));
                sums = _mm256_madd_epi16(pairs, ones);
            } else {
                sums = _mm256_setzero_si256();
                for (int j = 0; j < 8; ++j) {
                    const __m256i x = _mm256_set1_epi32(x4[j]);
                    sums = _mm256_add_epi32(
                        sums, _mm256_madd_epi16(_mm256_maddubs_epi16(a[j],
                                                                     _mm256_sign_epi8(x, k[j])),
                                                ones));
                }
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                     _mm256_mul_ps(d, _mm256_set1_ps(dx[b])), acc[r]);
            if (q4_1) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(dx[blocks + b]), acc[r]);
        }
    }
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(columns),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < R; ++r) {
        if (columns == 8)
            _mm256_storeu_ps(y + r * N, acc[r]);
        else
            _mm256_maskstore_ps(y + r * N, mask, acc[r]);
    }
}

/* Panel p of y for all M rows, I8_ROWS at a time, a half of 8 columns at a time. */
static inline __attribute__((always_inline)) void i8_panel(
    float *y, const uint8_t *xr, int64_t M, int64_t K, int64_t N, const uint8_t *weight,
    int64_t p, int q4_1) {
    const int64_t row_bytes = i8_row_bytes(K);
    const uint8_t *w = i8_panel_start(weight, p, N, K / BLOCK * i8_block_bytes(q4_1));
    const int64_t left = N - p * I8_PANEL;
    for (int h = 0; h < 2; ++h) {
        const int64_t columns = left - 8 * h > 8 ? 8 : left - 8 * h;
        if (columns <= 0) break;
        for (int64_t m = 0; m < M; m += I8_ROWS) {
            const int rows = M - m < I8_ROWS ? (int)(M - m) : I8_ROWS;
            float *out = y + m * N + p * I8_PANEL + 8 * h;
            if (q4_1) {
                DISPATCH_ROWS(i8_panel_rows, rows, I8_ROWS, out, N, xr + m * row_bytes,
                              row_bytes, K, w, h, (int)columns, 1)
            } else {
                DISPATCH_ROWS(i8_panel_rows, rows, I8_ROWS, out, N, xr + m * row_bytes,
                              row_bytes, K, w, h, (int)columns, 0)
            }
        }
    }
}
#endif

/* Row m of x [M, K] rounded into xr (i8_row_bytes(K) a row). */
static inline void i8_round_row(uint8_t *xr, const float *x, int64_t m, int64_t K, int q4_1) {
    const int64_t blocks = K / BLOCK;
    uint8_t *q = xr + m * i8_row_bytes(K);
    float *dx = (float *)(q + K);
    for (int64_t b = 0; b < blocks; ++b) {
        __m128i lo, hi;
        int32_t sum;
        i8_round_block(x + m * K + b * BLOCK, &lo, &hi, &dx[b], &sum);
        _mm_storeu_si128((__m128i *)(q + b * BLOCK), lo);
        _mm_storeu_si128((__m128i *)(q + b * BLOCK + 16), hi);
        if (q4_1)
            dx[blocks + b] = dx[b] * (float)sum;
        else
            ((int32_t *)dx)[blocks + b] = -128 * sum;
    }
}

/* The M rows of x [M, K] rounded into xr, by the calling thread alone. */
static void i8_round_rows(uint8_t *xr, const float *x, int64_t M, int64_t K, int q4_1) {
    for (int64_t m = 0; m < M; ++m) i8_round_row(xr, x, m, K, q4_1);
}

/* The same shared out over the enclosing parallel region's threads (an orphaned `omp for`,
 * ending in a barrier): for prompt-sized products, whose rounding is worth one. */
static void i8_round_rows_shared(uint8_t *xr, const float *x, int64_t M, int64_t K, int q4_1) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) i8_round_row(xr, x, m, K, q4_1);
}

/* The panels of y shared out over the enclosing parallel region's threads (an orphaned
 * `omp for`, ending in a barrier); xr holds the M rounded rows, weight the i8_repack
 * layout. */
static void i8_columns(float *y, const uint8_t *xr, int64_t M, int64_t K, int64_t N,
                       const uint8_t *weight, int q4_1) {
    const int64_t panels = i8_panels(N), row_bytes = i8_row_bytes(K);
    /* Rows I8_CHUNK_ROWS at a time, each chunk over all panels: a panel's pass reads every
     * row of its chunk, which then stays in L2 for the next panel. */
    for (int64_t m = 0; m < M; m += I8_CHUNK_ROWS) {
        const int64_t rows = M - m < I8_CHUNK_ROWS ? M - m : I8_CHUNK_ROWS;
        float *out = y + m * N;
        const uint8_t *in = xr + m * row_bytes;
        if (q4_1) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; ++p) i8_panel(out, in, rows, K, N, weight, p, 1);
        } else {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; ++p) i8_panel(out, in, rows, K, N, weight, p, 0);
        }
    }
}

/* y = x · Wᵀ with x rounded to 8 bits, W in the i8_repack layout; 2 if the buffer for the
 * rounded rows could not be had. */
static int quant_linear_i8(float *y, const float *x, int64_t M, int64_t K, int64_t N,
                           const uint8_t *weight, int q4_1) {
    if (K % BLOCK != 0) return 1;
    uint8_t *xr = (uint8_t *)aligned_alloc(64, (size_t)((M * i8_row_bytes(K) + 63) / 64 * 64));
    if (xr == NULL) return 2;
    /* A few rows (a decode step's logits) here, without the barrier of rounding them
     * together; more by the threads together, as in the fused layer. */
    if (M <= I8_SHARED_ROUND_ROWS) i8_round_rows(xr, x, M, K, q4_1);
#pragma omp parallel
    {
        if (M > I8_SHARED_ROUND_ROWS) i8_round_rows_shared(xr, x, M, K, q4_1);
        i8_columns(y, xr, M, K, N, weight, q4_1);
    }
    free(xr);
    return 0;
}

#endif
