/*
 * The widest float vector of the level a kernel is built for (kernels/cpu_isa.py): 16
 * lanes where the build has AVX-512 (zmm registers), else the 8 lanes of vec8.h. Code
 * written on `vwf` runs 16 lanes wide on an AVX-512 build and 8 on an AVX2 one.
 *
 * A bfloat16 is the top half of a float32, so a 32-bit lane holding two of them (element
 * 2j in its low half, 2j + 1 in its high half) gives both as float32 in one instruction
 * each: shifted left by 16 (the even element) and masked to the high half (the odd one).
 * bf16_pairs() reads 2 * VW bfloat16 that way, de-interleaved into even and odd lanes.
 */
#ifndef TOKENSERVE_VECW_H
#define TOKENSERVE_VECW_H

#include <stdint.h>
#include <string.h>

#include "vec8.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
typedef float vwf __attribute__((vector_size(64)));
typedef int32_t vwi __attribute__((vector_size(64)));

static inline vwf fmaw(vwf a, vwf b, vwf acc) {
    return (vwf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
}

/* The two eight-lane halves added: the first step of a horizontal sum. */
static inline v8f fold8(vwf v) {
    const __m512 x = (__m512)v;
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    return (v8f)_mm256_add_ps(_mm512_castps512_ps256(x), hi);
}

/* The lanes of even and odd interleaved: lo = e0 o0 e1 o1 .. e7 o7, hi = e8 o8 .. e15 o15. */
static inline void interleave(vwf even, vwf odd, vwf *lo, vwf *hi) {
    *lo = __builtin_shuffle(even, odd, (vwi){0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22,
                                             7, 23});
    *hi = __builtin_shuffle(even, odd, (vwi){8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29,
                                             14, 30, 15, 31});
}
#else
#define VW 8
typedef v8f vwf;
typedef v8i vwi;

static inline vwf fmaw(vwf a, vwf b, vwf acc) { return fma8(a, b, acc); }

static inline v8f fold8(vwf v) { return v; }

static inline void interleave(vwf even, vwf odd, vwf *lo, vwf *hi) {
    *lo = __builtin_shuffle(even, odd, (vwi){0, 8, 1, 9, 2, 10, 3, 11});
    *hi = __builtin_shuffle(even, odd, (vwi){4, 12, 5, 13, 6, 14, 7, 15});
}
#endif

/* Keeps v in a register from here on, on an 8-lane build: with 16 vector registers the
 * compiler, when they run short, folds the load of a value that several multiply-adds use
 * into each of them as a memory operand instead, and the loop is then bound by its loads
 * (the float32 prompt-attention tiles: 16 loads per 12 multiply-adds, not 7). AVX-512's
 * 32 registers leave it no cause to. */
#if VW == 8
#define in_register(v) __asm__("" : "+x"(v))
#else
#define in_register(v) ((void)(v))
#endif

static inline vwf loadw(const float *p) {
    vwf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storew(float *p, vwf v) { memcpy(p, &v, sizeof v); }

static inline vwf splatw(float x) {
#if VW == 16
    return (vwf)_mm512_set1_ps(x);
#else
    return splat8(x);
#endif
}

/* Per lane: mask ? a : b (mask lanes all ones or all zeros, as comparisons give). */
static inline vwf selectw(vwi mask, vwf a, vwf b) {
    return (vwf)((mask & (vwi)a) | (~mask & (vwi)b));
}

/* e^x as exp8 (vec8.h) computes it, VW lanes at a time. */
static inline vwf expw(vwf x) {
    x = selectw(x < splatw(-87.0f), splatw(-87.0f), x);
    x = selectw(x > splatw(88.0f), splatw(88.0f), x);
    const vwf scaled = x * splatw(1.44269504088896341f);
    const vwi n = __builtin_convertvector(
        scaled + selectw(scaled < splatw(0.0f), splatw(-0.5f), splatw(0.5f)), vwi);
    const vwf nf = __builtin_convertvector(n, vwf);
    vwf r = x - nf * splatw(0.693359375f);
    r = r - nf * splatw(-2.12194440e-4f);
    vwf p = splatw(1.9875691500e-4f);
    p = p * r + splatw(1.3981999507e-3f);
    p = p * r + splatw(8.3334519073e-3f);
    p = p * r + splatw(4.1665795894e-2f);
    p = p * r + splatw(1.6666665459e-1f);
    p = p * r + splatw(5.0000001201e-1f);
    p = p * r * r + r + splatw(1.0f);
    return p * (vwf)((n + 127) << 23);
}

/* 2^x for x up to 127, flushed to 2^-126 (the smallest normal float) below it: x rounded to
 * the nearest integer n (adding 1.5 · 2^23 leaves n in the low mantissa bits), 2^(x - n)
 * by a degree-6 polynomial fitted here to relative error ~1e-7 on [-0.5, 0.5], times 2^n
 * put in the exponent field. */
static inline vwf exp2w(vwf x) {
    x = selectw(x < splatw(-126.0f), splatw(-126.0f), x);
    const vwf shifted = x + splatw(12582912.0f);
    const vwf f = x - (shifted - splatw(12582912.0f));
    vwf p = splatw(1.534581097e-4f);
    p = p * f + splatw(1.339993090e-3f);
    p = p * f + splatw(9.618489072e-3f);
    p = p * f + splatw(5.550328642e-2f);
    p = p * f + splatw(2.402264625e-1f);
    p = p * f + splatw(6.931471825e-1f);
    p = p * f + splatw(1.0f);
    return p * (vwf)(((vwi)shifted - (vwi)splatw(12582912.0f) + 127) << 23);
}

/* p[0 .. 2 * VW) bfloat16 as float32: even[j] = p[2j], odd[j] = p[2j + 1]. */
static inline void bf16_pairs(const uint16_t *p, vwf *even, vwf *odd) {
    vwi bits;
    memcpy(&bits, p, sizeof bits);
    *even = (vwf)(bits << 16);
    *odd = (vwf)(bits & (int32_t)0xffff0000u);
}

#endif
