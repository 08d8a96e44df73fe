/*
 * AVX-512F pieces the bf16 attention and block kernels share (built where the level has
 * AVX-512: avx512, avx512_bf16, amx): 2^t exponentials on 16 lanes, a 16 x 16 transpose
 * of 32-bit elements in registers, and prefetching a span of floats.
 */
#ifndef TOKENSERVE_AVX512_H
#define TOKENSERVE_AVX512_H

#include <immintrin.h>
#include <stdint.h>

/* e^(s · scale - top) as 2^t, t = s · scale_l2 - top_l2 (both scaled by log2 e: one
 * fused multiply-add), with a relative error below 3e-6 (a degree-4 fit of 2^f on
 * [-1/2, 1/2], evaluated in float32): the probabilities are rounded to bf16 (relative error
 * up to 2^-9) before they multiply the values, and the row sums' error stays a thousandth of
 * that. n = round(t), 2^(t - n) by the polynomial, times 2^n (vscalefps). No
 * clamps: callers keep t small for the lanes kept (the prompt kernel: at most LAZY_MAX ·
 * log2 e) and vscalefps flushes very negative ones to 0; the lanes not kept are 0 whatever they held. */
static inline __m512 exp_shifted(__mmask16 keep, __m512 s, __m512 scale_l2, __m512 top_l2) {
    const __m512 t = _mm512_fmsub_ps(s, scale_l2, top_l2);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.5700688443e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5917808388e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024745057e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312182128e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999926157e-1f));
    return _mm512_maskz_scalef_ps(keep, p, n); /* 0 where masked */
}

/* A 16 x 16 transpose of 32-bit elements in registers (r[i] lane j becomes r[j] lane i): four
 * rounds of swapping off-diagonal blocks (8, 4, 2, 1 wide) with vpermt2d, whose index vectors
 * transpose16_order() makes once. */
typedef struct {
    __m512i lo[4], hi[4];
} Transpose16;

static inline Transpose16 transpose16_order(void) {
    Transpose16 order;
    for (int s = 0; s < 4; ++s) {
        const int b = 8 >> s;
        int32_t l[16], u[16];
        for (int c = 0; c < 16; ++c) {
            l[c] = (c & b) ? 16 + c - b : c;
            u[c] = (c & b) ? 16 + c : c + b;
        }
        order.lo[s] = _mm512_loadu_si512(l);
        order.hi[s] = _mm512_loadu_si512(u);
    }
    return order;
}

static inline __attribute__((always_inline)) void transpose16(__m512i r[16],
                                                              const Transpose16 *order) {
    for (int s = 0; s < 4; ++s) {
        const int b = 8 >> s;
        for (int i = 0; i < 16; ++i)
            if (!(i & b)) {
                const __m512i a = r[i], c = r[i + b];
                r[i] = _mm512_permutex2var_epi32(a, order->lo[s], c);
                r[i + b] = _mm512_permutex2var_epi32(a, order->hi[s], c);
            }
    }
}

/* Prefetch `count` floats from p into L1, for reading or (write) for writing. */
static inline void prefetch_span(const float *p, int64_t count, int write) {
    for (int64_t i = 0; i < count; i += 16)
        if (write) _m_prefetchw((void *)(p + i));
        else _mm_prefetch((const char *)(p + i), _MM_HINT_T0);
}

#endif
