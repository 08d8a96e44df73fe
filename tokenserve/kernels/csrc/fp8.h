/*
 * The 8-bit float KV cache's elements (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2) to and
 * from float32, VW lanes at a time (vecw.h).
 *
 * E4M3 (OCP's "FN" variant, torch.float8_e4m3fn): sign, 4 exponent bits biased by 7, 3
 * mantissa bits; largest finite 448, no infinities. E5M2 (torch.float8_e5m2): 5 exponent bits
 * biased by 15, 2 mantissa bits; largest finite 57344. Both narrow as torch converts them
 * (round to nearest even, subnormals kept) except that values past the largest finite one
 * saturate to it: torch gives e4m3 that already, e5m2 an infinity (the cache never holds
 * one). A NaN stays a NaN (0x7F); widening reads the NaN (and E5M2's infinity) codes as the
 * finite values their bits spell: keys and values that are not numbers are lost anyway.
 * Narrowing is integer arithmetic on the float32 bits; widening goes through float16 on x86
 * (AVX-512, or AVX2 with F16C), integer arithmetic elsewhere.
 */
#ifndef TOKENSERVE_FP8_H
#define TOKENSERVE_FP8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vecw.h"

#if VW == 16 || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#define FP8_X86 1
#else
#define FP8_X86 0
#endif

typedef uint32_t vwu __attribute__((vector_size(4 * VW)));

/* A format's mantissa bits, exponent bias, and smallest normal and largest finite values. */
#define FP8_MANTISSA(e5m2) ((e5m2) ? 2 : 3)
#define FP8_BIAS(e5m2) ((e5m2) ? 15 : 7)
#define FP8_MIN_NORMAL(e5m2) ((e5m2) ? 0x1p-14f : 0x1p-6f)
#define FP8_MAX(e5m2) ((e5m2) ? 57344.0f : 448.0f)
#define FP8_MAX_CODE(e5m2) ((e5m2) ? 0x7B : 0x7E)
#define FP8_NAN 0x7F

/* Widened values come as the element's value / FP8_UNIT: an E4M3's bits are a float16's
 * shifted (exponent bias 7 against 15, 2^8 apart), an E5M2's a float16's exactly, and the
 * float unit converts float16 (subnormals included) for free; the caller folds FP8_UNIT
 * into its scales. */
#define FP8_UNIT(e5m2) ((e5m2) ? 1.0f : 256.0f)

/* VW 32-bit lanes' low bytes stored at p. */
static inline __attribute__((always_inline)) void fp8_bytes_out(uint8_t *p, vwu lanes) {
#if VW == 16
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8((__m512i)lanes));
#elif FP8_X86
    /* Each 128-bit half's four low bytes gathered to its first dword, then the halves joined. */
    const __m256i low = _mm256_shuffle_epi8(
        (__m256i)lanes, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                         -1, -1, -1, -1));
    const __m128i joined = _mm_unpacklo_epi32(_mm256_castsi256_si128(low),
                                              _mm256_extracti128_si256(low, 1));
    _mm_storel_epi64((__m128i *)p, joined);
#else
    const uint8_t bytes __attribute__((vector_size(VW))) =
        __builtin_convertvector(lanes, __typeof__(bytes));
    memcpy(p, &bytes, sizeof bytes);
#endif
}

/* CHUNK (paged_attention.c) elements at p widened into k[0] (and, FP8_PAIRED, k[1]: the
 * next VW). On x86 through float16 bits: sign-extended to 16 bits, an E4M3's (s eeee mmm)
 * shifted by 7 puts its exponent and mantissa in place and the sign at bit 15, with a copy
 * of the sign in bit 14 (the float16 exponent's top bit, 0 for every E4M3) to clear; an
 * E5M2's shifted by 8 is the float16. On AVX-512 32 elements at once, converted half by
 * half. Elsewhere integer arithmetic: the magnitude's bits shifted into a float32's place
 * and the exponent rebiased give a normal value exactly; a subnormal (exponent 0) comes out
 * as min_normal * (1 + m / 2^mantissa) and loses the implicit one by subtracting
 * min_normal, with no float32 subnormal on the way; then divided by FP8_UNIT as on x86. */
#if VW == 16
#define FP8_PAIRED 1
static inline __attribute__((always_inline)) void fp8_widen_chunk(const uint8_t *p,
                                                                  const int e5m2, vwf k[2]) {
    const __m512i words = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i half = e5m2 ? _mm512_slli_epi16(words, 8)
                              : _mm512_and_si512(_mm512_slli_epi16(words, 7),
                                                 _mm512_set1_epi16((short)0xBF80));
    k[0] = (vwf)_mm512_cvtph_ps(_mm512_castsi512_si256(half));
    k[1] = (vwf)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
}
#elif FP8_X86
#define FP8_PAIRED 0
static inline __attribute__((always_inline)) void fp8_widen_chunk(const uint8_t *p,
                                                                  const int e5m2, vwf k[2]) {
    const __m128i words = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i half = e5m2 ? _mm_slli_epi16(words, 8)
                              : _mm_and_si128(_mm_slli_epi16(words, 7),
                                              _mm_set1_epi16((short)0xBF80));
    k[0] = (vwf)_mm256_cvtph_ps(half);
}
#else
#define FP8_PAIRED 0
static inline __attribute__((always_inline)) void fp8_widen_chunk(const uint8_t *p,
                                                                  const int e5m2, vwf k[2]) {
    uint8_t bytes __attribute__((vector_size(VW)));
    memcpy(&bytes, p, sizeof bytes);
    const vwu x = __builtin_convertvector(bytes, vwu); /* one byte at a time, but portable */
    const int shift = 23 - FP8_MANTISSA(e5m2);
    const vwu magnitude = (x & 0x7Fu) << shift;
    const vwu normal = magnitude + ((uint32_t)(127 - FP8_BIAS(e5m2)) << 23);
    const vwf subnormal = (vwf)(normal + (1u << 23)) - splatw(FP8_MIN_NORMAL(e5m2));
    const vwi is_subnormal = (vwi)((magnitude >> 23) == 0);
    const vwu value = (vwu)selectw(is_subnormal, subnormal, (vwf)normal);
    k[0] = (vwf)(value | ((x & 0x80u) << 24)) * splatw(1.0f / FP8_UNIT(e5m2));
}
#endif

/* VW float32 as elements at p, rounded to nearest even and saturated. A normal result
 * rounds the float's mantissa bits as integers (a carry into the exponent is the next
 * binade, as it should be); a subnormal one is the value in units of the smallest
 * subnormal, rounded by adding 2^23 (the float unit's own round to nearest even). */
static inline __attribute__((always_inline)) void fp8_narrow(uint8_t *p, vwf f, const int e5m2) {
    const int shift = 23 - FP8_MANTISSA(e5m2);
    const vwu bits = (vwu)f;
    const vwu sign = (bits >> 24) & 0x80u;
    const vwu magnitude = bits & 0x7FFFFFFFu;
    const vwf absolute = (vwf)magnitude;
    const vwu odd = (magnitude >> shift) & 1u;
    const uint32_t rebias = (uint32_t)(127 - FP8_BIAS(e5m2)) << 23;
    const vwu normal = (magnitude + ((1u << (shift - 1)) - 1u) + odd - rebias) >> shift;
    const float units = e5m2 ? 0x1p16f : 0x1p9f; /* subnormal steps per unit */
    const vwu subnormal = (vwu)(absolute * splatw(units) + splatw(0x1p23f)) - 0x4B000000u;
    vwu code = (vwu)selectw((vwi)(absolute < splatw(FP8_MIN_NORMAL(e5m2))), (vwf)subnormal,
                            (vwf)normal);
    code = (vwu)selectw((vwi)(absolute >= splatw(FP8_MAX(e5m2))),
                        (vwf)(vwu)((vwu){0} + (uint32_t)FP8_MAX_CODE(e5m2)), (vwf)code);
    code = (vwu)selectw((vwi)(magnitude > 0x7F800000u), (vwf)((vwu){0} + (uint32_t)FP8_NAN),
                        (vwf)code);
    fp8_bytes_out(p, code | sign);
}

/* One element as float32 (the generic paths). */
static inline float fp8_load(const uint8_t *p, int64_t i, int e5m2) {
    const uint8_t x = p[i];
    const int mantissa = FP8_MANTISSA(e5m2);
    const int exponent = (x & 0x7F) >> mantissa, m = x & ((1 << mantissa) - 1);
    const float magnitude = exponent ? ldexpf(1.0f + (float)m / (float)(1 << mantissa),
                                              exponent - FP8_BIAS(e5m2))
                                     : ldexpf((float)m / (float)(1 << mantissa),
                                              1 - FP8_BIAS(e5m2));
    return x & 0x80 ? -magnitude : magnitude;
}

/* n float32 at src as elements at dst (fp8_narrow; a last part of fewer than VW through a
 * zero-padded vector). */
static inline void fp8_narrow_run(uint8_t *dst, const float *src, int64_t n, int e5m2) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        if (e5m2)
            fp8_narrow(dst + i, loadw(src + i), 1);
        else
            fp8_narrow(dst + i, loadw(src + i), 0);
    }
    if (i < n) {
        float tail[VW] = {0};
        uint8_t bytes[VW];
        memcpy(tail, src + i, sizeof(float) * (size_t)(n - i));
        if (e5m2)
            fp8_narrow(bytes, loadw(tail), 1);
        else
            fp8_narrow(bytes, loadw(tail), 0);
        memcpy(dst + i, bytes, (size_t)(n - i));
    }
}

#endif
