/*
 * What quant_linear.c's bf16 kernels share (quant_amx.h on AMX tiles, quant_dp.h by
 * vdpbf16ps): x rounded to bf16 as torch rounds, one 32-weight block of a weight row
 * expanded to bf16 as the model's dense bf16 weight holds it, and the float32 sums rounded
 * to bf16 as oneDNN's bf16 GEMM hands its sums on.
 */
#ifndef TOKENSERVE_QUANT_BF16_H
#define TOKENSERVE_QUANT_BF16_H

#include <immintrin.h>
#include <stdint.h>

/* 16 float32 rounded to bf16 to nearest even as torch rounds (a NaN to 0x7fc0), left in
 * float32 lanes: each the float32 of the bf16 value. In integer arithmetic: vcvtneps2bf16
 * reads denormal inputs as zero, and activations may be denormal. */
static inline __m512 bf16_round_ps(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
        _mm512_set1_epi32((int)0xffff0000u));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(r);
}

/* 16 float32 → their bf16 bits, rounded as bf16_round_ps rounds. */
static inline __m256i bf16_round16(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(bf16_round_ps(v)), 16));
}

/* Block b (32 weights) of one weight row (quant_linear.c's layouts: qs and scales from the
 * row's start) → 32 bf16 in the block's order. The expansion is tile()'s: d * q (+ m) as two
 * roundings (mul then add: this file is ISO C, nothing is contracted), then to bf16. Q4_1
 * expands the block's 16 possible values (q = 0..15) once and looks its 32 weights up
 * (vpermw): the same arithmetic on the same values, in fewer instructions. vcvtne(2)ps2bf16
 * rounds to nearest even like torch; its zeroing of denormals never applies here: d and m
 * are float16 (multiples of 2^-24) and q an integer, so a nonzero weight is at least 2^-48
 * in magnitude. */
static inline __attribute__((always_inline)) __m512i bf16_expand_block(
    const uint8_t *qs, const float *scales, int64_t b, int q4_1) {
    if (q4_1) {
        const __m128i low4 = _mm_set1_epi8(0x0f);
        const __m512 values =
            _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(qs + b * 16));
        const __m512 table = _mm512_add_ps(_mm512_mul_ps(values, _mm512_set1_ps(scales[2 * b])),
                                           _mm512_set1_ps(scales[2 * b + 1]));
        const __m512i lookup = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(table));
        /* Weights 0-15 are the bytes' low nibbles, 16-31 their high ones. */
        const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                                           _mm_and_si128(bytes, low4));
        return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), lookup);
    }
    const int8_t *q = (const int8_t *)qs + b * 32;
    const __m512 d = _mm512_set1_ps(scales[b]);
    const __m512 w0 =
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), d);
    const __m512 w1 = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), d);
    return (__m512i)_mm512_cvtne2ps_pbh(w1, w0);
}

#endif
