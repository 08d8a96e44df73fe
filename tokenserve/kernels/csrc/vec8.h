/*
 * Eight-lane float vectors with GCC's vector extensions: AVX2 registers under
 * -march=native on x86-64, pairs of narrower registers elsewhere. Shared by the kernels.
 */
#ifndef TOKENSERVE_VEC8_H
#define TOKENSERVE_VEC8_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* acc + a * b in one rounding where the CPU has fused multiply-add (the kernels are
 * compiled as ISO C, so a plain a * b + c stays two roundings). */
#if defined(__FMA__)
#include <immintrin.h>
static inline v8f fma8(v8f a, v8f b, v8f acc) {
    __m256 a_, b_, acc_;
    memcpy(&a_, &a, sizeof a_);
    memcpy(&b_, &b, sizeof b_);
    memcpy(&acc_, &acc, sizeof acc_);
    acc_ = _mm256_fmadd_ps(a_, b_, acc_);
    memcpy(&acc, &acc_, sizeof acc);
    return acc;
}
#else
static inline v8f fma8(v8f a, v8f b, v8f acc) { return acc + a * b; }
#endif

/* The lane sums of eight vectors, as one vector: out[i] = sum of a[i]'s lanes. A tree of
 * shuffles and adds, 14 + 7 instructions for all eight instead of ~8 each. */
static inline v8f hsum8x8(const v8f a[8]) {
    const v8i even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const v8i lo_pairs = {0, 1, 8, 9, 4, 5, 12, 13}, hi_pairs = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i lo_half = {0, 1, 2, 3, 8, 9, 10, 11}, hi_half = {4, 5, 6, 7, 12, 13, 14, 15};
    v8f x[4], y[2];
    for (int i = 0; i < 4; ++i)
        x[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) +
               __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
    for (int i = 0; i < 2; ++i)
        y[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo_pairs) +
               __builtin_shuffle(x[2 * i], x[2 * i + 1], hi_pairs);
    return __builtin_shuffle(y[0], y[1], lo_half) + __builtin_shuffle(y[0], y[1], hi_half);
}

/* a as an 8 x 8 matrix (a[i] its row i), transposed in place: 24 shuffles (unpack,
 * shuffle, permute on AVX2). */
static inline void transpose8x8(v8f a[8]) {
    const v8i lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
    const v8i lo_pairs = {0, 1, 8, 9, 4, 5, 12, 13}, hi_pairs = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i lo_half = {0, 1, 2, 3, 8, 9, 10, 11}, hi_half = {4, 5, 6, 7, 12, 13, 14, 15};
    v8f t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo);
        t[2 * i + 1] = __builtin_shuffle(a[2 * i], a[2 * i + 1], hi);
    }
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) {
            u[4 * i + 2 * j] = __builtin_shuffle(t[4 * i + j], t[4 * i + j + 2], lo_pairs);
            u[4 * i + 2 * j + 1] = __builtin_shuffle(t[4 * i + j], t[4 * i + j + 2], hi_pairs);
        }
    for (int i = 0; i < 4; ++i) {
        a[i] = __builtin_shuffle(u[i], u[i + 4], lo_half);
        a[i + 4] = __builtin_shuffle(u[i], u[i + 4], hi_half);
    }
}

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Per lane: mask ? a : b (mask lanes are all ones or all zeros, as comparisons give). */
static inline v8f select8(v8i mask, v8f a, v8f b) {
    v8i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    const v8i r = (mask & ai) | (~mask & bi);
    v8f out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* e^x to ~1 ulp: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n put
 * into the exponent bits. x is clamped to [-87, 88]: below, the result is ~0 (not a
 * denormal); above, it is ~1.65e38 (not inf). */
static inline v8f exp8(v8f x) {
    x = select8(x < splat8(-87.0f), splat8(-87.0f), x);
    x = select8(x > splat8(88.0f), splat8(88.0f), x);
    const v8f scaled = x * splat8(1.44269504088896341f);
    const v8i n = __builtin_convertvector(
        scaled + select8(scaled < splat8(0.0f), splat8(-0.5f), splat8(0.5f)), v8i);
    const v8f nf = __builtin_convertvector(n, v8f);
    v8f r = x - nf * splat8(0.693359375f);
    r = r - nf * splat8(-2.12194440e-4f);
    v8f p = splat8(1.9875691500e-4f);
    p = p * r + splat8(1.3981999507e-3f);
    p = p * r + splat8(8.3334519073e-3f);
    p = p * r + splat8(4.1665795894e-2f);
    p = p * r + splat8(1.6666665459e-1f);
    p = p * r + splat8(5.0000001201e-1f);
    p = p * r * r + r + splat8(1.0f);
    const v8i bits = (n + 127) << 23;
    v8f two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#endif
