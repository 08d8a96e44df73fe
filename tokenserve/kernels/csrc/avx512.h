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
 * fused multiply-add), with a relative error below 3e-6 (a degree-4 fit of 2^f on [0, 1),
 * evaluated in float32): the probabilities are rounded to bf16 (relative error up to 2^-9)
 * before they multiply the values, and the row sums' error stays a thousandth of that.
 * f = t - floor(t) in one instruction (vreduceps), 2^f by the polynomial, times 2^floor(t)
 * (vscalefps takes the floor of t itself). No clamps: callers keep t small for the lanes
 * kept (the prompt kernel: at most LAZY_MAX · log2 e) and vscalefps flushes very negative
 * ones to 0; the lanes not kept are 0 whatever they held. */
static inline __m512 exp_shifted(__mmask16 keep, __m512 s, __m512 scale_l2, __m512 top_l2) {
    const __m512 t = _mm512_fmsub_ps(s, scale_l2, top_l2);
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(1.3534133322536945e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.201148986816406e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4144276976585388e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.930038332939148e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026226043701f));
    return _mm512_maskz_scalef_ps(keep, p, t); /* 0 where masked */
}

/* A 16 x 16 transpose of 32-bit elements in registers (r[i] lane j becomes r[j] lane i):
 * interleaving neighbouring rows' 32-bit and then 64-bit elements within 128-bit lanes
 * (vpunpck*), then swapping 128-bit lanes between rows 4 and then 8 apart (vshufi32x4).
 * Both that and four rounds of vpermt2d take 64 shuffles, but on an AMD EPYC (Zen 4) these
 * issue about twice as fast: ~31-39 ns per transpose of 16 loaded and stored rows against
 * ~76-84 ns. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* Rows 4 apart: 128-bit lanes 0 and 2 of each (0x88), then 1 and 3 (0xdd). */
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    /* Then rows 8 apart. */
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* Prefetch `count` floats from p into L1, for reading or (write) for writing. */
static inline void prefetch_span(const float *p, int64_t count, int write) {
    for (int64_t i = 0; i < count; i += 16)
        if (write) _m_prefetchw((void *)(p + i));
        else _mm_prefetch((const char *)(p + i), _MM_HINT_T0);
}

#endif
