/*
 * bfloat16 <-> float32 one value at a time, as torch converts them: a bfloat16 is the top
 * half of a float32's bits, so widening is a shift; narrowing rounds to nearest even, and a
 * NaN stays a quiet NaN. (The kernels' vector forms are in layer_ops.c and vecw.h.)
 */
#ifndef TS_BF16_H
#define TS_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p, int64_t i) {
    const uint32_t bits = (uint32_t)p[i] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint16_t bf16_round(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#endif
