/*
 * silu(g) = g / (1 + e^-g) of every bfloat16 g, in a table indexed by g's 16 bits.
 *
 * A bf16 model's SwiGLU reads its gates in bf16: there are only 65536 of them, so the
 * exponential and the division (most of the operator's arithmetic) are done once per
 * process, here, with the very vector arithmetic of layer_ops.c's float32 kernel (expw is
 * exp8's, lane by lane); the operator then gathers silu(g) and multiplies by up, the same
 * two roundings as computing it in place, so the results are bit for bit the same.
 * Included by layer_ops.c after its vector helpers.
 */
#ifndef TS_SILU_TABLE_H
#define TS_SILU_TABLE_H

#include <stdint.h>

#include "vecw.h"

/* Gathers need AVX2 (every x86 level); elsewhere ("native") the operator computes silu. */
#if defined(__AVX2__)
#include <immintrin.h>
#define TS_SILU_TABLE 1

static float silu_of_bf16[1 << 16];

/* Filled when the library is loaded (4096 vectors: well under a millisecond). */
__attribute__((constructor)) static void fill_silu_of_bf16(void) {
    for (uint32_t first = 0; first < (1u << 16); first += VW) {
        vwi bits;
        for (int lane = 0; lane < VW; ++lane) bits[lane] = (int32_t)((first + lane) << 16);
        const vwf g = (vwf)bits;
        storew(silu_of_bf16 + first, g / (splatw(1.0f) + expw(-g)));
    }
}

/* silu of VW bf16 gates at p, from the table. */
static inline vwf silu_bf16w(const uint16_t *p) {
    vwh h;
    memcpy(&h, p, sizeof h);
    const vwi index = (vwi)__builtin_convertvector(h, vwu);
#if VW == 16
    return (vwf)_mm512_i32gather_ps((__m512i)index, silu_of_bf16, 4);
#else
    return (vwf)_mm256_i32gather_ps(silu_of_bf16, (__m256i)index, 4);
#endif
}

/* The same for eight gates (the rest of a row after the VW-lane blocks). */
static inline v8f silu_bf16_8(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    const v8i index = (v8i)__builtin_convertvector(h, v8u);
    return (v8f)_mm256_i32gather_ps(silu_of_bf16, (__m256i)index, 4);
}

/* silu of VW float32 gates at p that hold bf16 values (their low 16 bits zero: a bf16
 * product's sums kept in float32), from the table: indexed by their top 16 bits. */
static inline vwf silu_bf16_valued_w(const float *p) {
    vwi bits;
    memcpy(&bits, p, sizeof bits);
    const vwi index = (vwi)((vwu)bits >> 16);
#if VW == 16
    return (vwf)_mm512_i32gather_ps((__m512i)index, silu_of_bf16, 4);
#else
    return (vwf)_mm256_i32gather_ps(silu_of_bf16, (__m256i)index, 4);
#endif
}

#endif
#endif
