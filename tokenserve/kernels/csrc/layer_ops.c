/*
 * Fused element-wise operators of a decoder layer, for the CPU backend.
 *
 * Each replaces a chain of PyTorch operators that would otherwise read and write the
 * whole activation several times (RMSNorm: pow, mean, rsqrt, two multiplies; rotary:
 * gather, negate, concatenate, four multiplies, two adds; SwiGLU: silu, multiply). Rows
 * (tokens) are spread over the process's OpenMP threads, when there are enough of them:
 * a decode step of a few rows has a few microseconds of work per operator, less than
 * waking the other threads and joining them again costs, so below PARALLEL_MIN values
 * the calling thread does it alone. All tensors are fp32 and contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec8.h"
#include "vecw.h"

/* Values (rows x row width) from which an operator is split over the threads. */
#define PARALLEL_MIN 16384

/* out = x * rsqrt(mean(x^2) + eps) * weight for one row of `hidden` values. If `residual`
 * is not NULL, x is first added into residual and the norm is taken of the sum (the
 * residual stream of the next sub-layer). `out` may be `x`. */
static inline void rms_norm_row(float *out, float *x, float *residual, const float *weight,
                                int64_t hidden, float eps) {
    const float *src = x;
    if (residual != NULL) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) residual[i] += x[i];
        src = residual;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; ++i) sum += src[i] * src[i];
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) out[i] = weight[i] * (src[i] * inv);
}

/* rms_norm_row for each of num_rows rows (residual, if not NULL, [num_rows, hidden] too). */
void ts_rms_norm_f32(float *out, float *x, float *residual, const float *weight,
                     int64_t num_rows, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (num_rows * hidden >= PARALLEL_MIN)
    for (int64_t r = 0; r < num_rows; ++r)
        rms_norm_row(out + r * hidden, x + r * hidden,
                     residual == NULL ? NULL : residual + r * hidden, weight, hidden, eps);
}

/* out = silu(gate_up[:d]) * gate_up[d:] for one row of 2d values. */
static inline void silu_and_mul_row(float *out, const float *gate_up, int64_t d) {
    const float *gate = gate_up, *up = gate_up + d;
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const v8f g = load8(gate + i);
        store8(out + i, g / (splat8(1.0f) + exp8(-g)) * load8(up + i));
    }
    for (; i < d; ++i) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

void ts_silu_and_mul_f32(float *out, const float *gate_up, int64_t num_rows, int64_t d) {
#pragma omp parallel for schedule(static) if (num_rows * d >= PARALLEL_MIN)
    for (int64_t r = 0; r < num_rows; ++r) silu_and_mul_row(out + r * d, gate_up + r * 2 * d, d);
}

/* Rotary embedding in place, "rotate half" (GPT-NeoX) layout, as HF Llama does it:
 * x[i] <- x[i] cos[i] - x[i + h] sin[i],  x[i + h] <- x[i + h] cos[i + h] + x[i] sin[i + h]
 * for i < h = head_dim / 2, with cos/sin rows [max_position, head_dim] picked by the
 * token's position: here for one token's query heads (at query) and key heads (at key),
 * each head head_dim contiguous values. */
static inline void rotary_token(float *query, float *key, int64_t position, const float *cos,
                                const float *sin, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim) {
    const int64_t half = head_dim / 2;
    const float *c = cos + position * head_dim;
    const float *s = sin + position * head_dim;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        float *x = h < num_heads ? query + h * head_dim : key + (h - num_heads) * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * s[i];
            x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
    }
}

/* rotary_token for num_tokens tokens: token t's query heads start at query + t *
 * token_stride, its key heads at key + t * token_stride (both may be views into one fused
 * QKV row). */
void ts_rotary_f32(float *query, float *key, int64_t token_stride, const int64_t *positions,
                   const float *cos, const float *sin, int64_t num_tokens, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim) {
#pragma omp parallel for schedule(static) \
    if (num_tokens * (num_heads + num_kv_heads) * head_dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < num_tokens; ++t)
        rotary_token(query + t * token_stride, key + t * token_stride, positions[t], cos, sin,
                     num_heads, num_kv_heads, head_dim);
}

/* --- bfloat16 hand-offs between a bf16 model's products (model/precision.py) ---------------
 * A product's input is rounded to bf16 and its sums come back in bf16; these variants read
 * or write bf16 directly, so no separate cast pass runs between the operators. The
 * arithmetic is the float32 one above; a bf16 result is that float32 value rounded to
 * nearest even, as torch's cast rounds it (bf16.h). */

/* VW bf16 values as floats, and VW floats rounded into bf16 as bf16_round does each: the
 * widest vectors of the build (vecw.h). */
typedef uint16_t vwh __attribute__((vector_size(VW * 2)));
typedef uint32_t vwu __attribute__((vector_size(VW * 4)));

static inline vwf load_bf16w(const uint16_t *p) {
    vwh h;
    memcpy(&h, p, sizeof h);
    return (vwf)(__builtin_convertvector(h, vwu) << 16);
}

static inline void store_bf16w(uint16_t *p, vwf v) {
    const vwu bits = (vwu)v;
    const vwu nan = (vwu)((bits & 0x7fffffffu) > 0x7f800000u);
    const vwu rounded = (nan & 0x7fc00000u) | (~nan & (bits + 0x7fffu + ((bits >> 16) & 1u)));
    const vwh h = __builtin_convertvector(rounded >> 16, vwh);
    memcpy(p, &h, sizeof h);
}

/* The same eight lanes at a time (the rest of a row after the VW-lane blocks). */
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8f load8_bf16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

static inline void store8_bf16(uint16_t *p, v8f v) {
    const v8u bits = (v8u)v;
    const v8u nan = (v8u)((bits & 0x7fffffffu) > 0x7f800000u);
    const v8u rounded = (nan & 0x7fc00000u) | (~nan & (bits + 0x7fffu + ((bits >> 16) & 1u)));
    const v8h h = __builtin_convertvector(rounded >> 16, v8h);
    memcpy(p, &h, sizeof h);
}

#include "silu_table.h" /* after the bf16 vector helpers it uses */

/* rms_norm_row with x in float32 or bf16 (x_bf16) and the result in float32 or bf16. */
static inline void rms_norm_row_mixed(void *out, int out_bf16, const void *x, int x_bf16,
                                      float *residual, const float *weight, int64_t hidden,
                                      float eps, float *scratch) {
    const float *src;
    if (residual != NULL) {
        if (x_bf16) {
#pragma omp simd
            for (int64_t i = 0; i < hidden; ++i) residual[i] += bf16_load(x, i);
        } else {
            const float *xf = x;
#pragma omp simd
            for (int64_t i = 0; i < hidden; ++i) residual[i] += xf[i];
        }
        src = residual;
    } else if (x_bf16) {
        for (int64_t i = 0; i < hidden; ++i) scratch[i] = bf16_load(x, i);
        src = scratch;
    } else {
        src = x;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; ++i) sum += src[i] * src[i];
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
    if (out_bf16) {
        uint16_t *o = out;
        for (int64_t i = 0; i < hidden; ++i) o[i] = bf16_round(weight[i] * (src[i] * inv));
    } else {
        float *o = out;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) o[i] = weight[i] * (src[i] * inv);
    }
}

/* ts_rms_norm_f32 with x and out each float32 or bf16 (residual and weight float32). */
void ts_rms_norm_mixed(void *out, int out_bf16, const void *x, int x_bf16, float *residual,
                       const float *weight, int64_t num_rows, int64_t hidden, float eps) {
#pragma omp parallel if (num_rows * hidden >= PARALLEL_MIN)
    {
        float scratch_stack[1024];
        float *scratch = hidden <= 1024 ? scratch_stack : malloc(hidden * sizeof(float));
        const size_t x_size = x_bf16 ? 2 : 4, out_size = out_bf16 ? 2 : 4;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; ++r)
            rms_norm_row_mixed((char *)out + r * hidden * out_size, out_bf16,
                               (const char *)x + r * hidden * x_size, x_bf16,
                               residual == NULL ? NULL : residual + r * hidden, weight, hidden,
                               eps, scratch);
        if (scratch != scratch_stack) free(scratch);
    }
}

/* silu_and_mul_row with gate_up in float32 or bf16 and the result in bf16: VW lanes at a
 * time, then eight, then one, as silu_and_mul_row splits a row (expw is exp8's arithmetic),
 * so each value is the float32 kernel's, rounded; bf16 gates take silu from the table of
 * silu_table.h, which holds those very values. */
static inline void silu_and_mul_row_to_bf16(uint16_t *out, const void *gate_up, int in_bf16,
                                            int64_t d) {
    int64_t i = 0;
    if (in_bf16) {
        const uint16_t *gate = gate_up, *up = (const uint16_t *)gate_up + d;
#if TS_SILU_TABLE
        for (; i + VW <= d; i += VW)
            store_bf16w(out + i, silu_bf16w(gate + i) * load_bf16w(up + i));
        for (; i + 8 <= d; i += 8)
            store8_bf16(out + i, silu_bf16_8(gate + i) * load8_bf16(up + i));
#else
        for (; i + VW <= d; i += VW) {
            const vwf g = load_bf16w(gate + i);
            store_bf16w(out + i, g / (splatw(1.0f) + expw(-g)) * load_bf16w(up + i));
        }
        for (; i + 8 <= d; i += 8) {
            const v8f g = load8_bf16(gate + i);
            store8_bf16(out + i, g / (splat8(1.0f) + exp8(-g)) * load8_bf16(up + i));
        }
#endif
        for (; i < d; ++i) {
            const float g = bf16_load(gate, i);
            out[i] = bf16_round(g / (1.0f + expf(-g)) * bf16_load(up, i));
        }
    } else {
        const float *gate = gate_up, *up = (const float *)gate_up + d;
        for (; i + VW <= d; i += VW) {
            const vwf g = loadw(gate + i);
            store_bf16w(out + i, g / (splatw(1.0f) + expw(-g)) * loadw(up + i));
        }
        for (; i + 8 <= d; i += 8) {
            const v8f g = load8(gate + i);
            store8_bf16(out + i, g / (splat8(1.0f) + exp8(-g)) * load8(up + i));
        }
        for (; i < d; ++i) out[i] = bf16_round(gate[i] / (1.0f + expf(-gate[i])) * up[i]);
    }
}

#if TS_SILU_TABLE
/* silu_and_mul_row for float32 gates that hold bf16 values (a bf16 product's sums, as the
 * fused layer keeps them: decode_layer.c): silu from the table where silu_and_mul_row takes
 * its vector arithmetic, whose very values the table holds, and that row's scalar arithmetic
 * for the rest, so the results are silu_and_mul_row's bit for bit. */
static inline void silu_and_mul_row_bf16_valued(float *out, const float *gate_up, int64_t d) {
    const float *gate = gate_up, *up = gate_up + d;
    const int64_t vectors = d / 8 * 8; /* silu_and_mul_row's eight-lane blocks */
    int64_t i = 0;
    for (; i + VW <= vectors; i += VW)
        storew(out + i, silu_bf16_valued_w(gate + i) * loadw(up + i));
    for (; i < vectors; ++i) {
        uint32_t bits;
        memcpy(&bits, gate + i, sizeof bits);
        out[i] = silu_of_bf16[bits >> 16] * up[i];
    }
    for (; i < d; ++i) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}
#endif

void ts_silu_and_mul_to_bf16(uint16_t *out, const void *gate_up, int in_bf16, int64_t num_rows,
                             int64_t d) {
    const size_t in_size = in_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (num_rows * d >= PARALLEL_MIN)
    for (int64_t r = 0; r < num_rows; ++r)
        silu_and_mul_row_to_bf16(out + r * d, (const char *)gate_up + r * 2 * d * in_size,
                                 in_bf16, d);
}

/* A bf16 product's fused q/k/v rows [num_tokens, width] (query heads, key heads, then value
 * heads) into float32 `out` of the same shape, with rotary applied to the query and key
 * heads: the cast and ts_rotary_f32 in one pass over each row, with the same arithmetic. */
void ts_rotary_from_bf16(float *out, const uint16_t *qkv, int64_t width, const int64_t *positions,
                         const float *cos, const float *sin, int64_t num_tokens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
#pragma omp parallel for schedule(static) if (num_tokens * width >= PARALLEL_MIN)
    for (int64_t t = 0; t < num_tokens; ++t) {
        float *row = out + t * width;
        const uint16_t *source = qkv + t * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) row[i] = bf16_load(source, i);
        rotary_token(row, row + num_heads * head_dim, positions[t], cos, sin, num_heads,
                     num_kv_heads, head_dim);
    }
}

/* VW values from element j of x (float32, or bfloat16 widened: exact). */
typedef uint16_t vwh __attribute__((vector_size(VW * 2)));
static inline __attribute__((always_inline)) vwf load_values(const void *x, int64_t j, int bf16) {
    if (!bf16) return loadw((const float *)x + j);
    vwh h;
    memcpy(&h, (const uint16_t *)x + j, sizeof h);
    return (vwf)(__builtin_convertvector(h, vwi) << 16);
}

static inline float load_value(const void *x, int64_t j, int bf16) {
    return bf16 ? bf16_load((const uint16_t *)x, j) : ((const float *)x)[j];
}

/* Row x's argmax over `cols` float32 or bfloat16 values, as torch's max(dim=-1).indices:
 * the first of equal maxima, and the first NaN where the row has one. Each lane keeps the
 * first index of its own strict maximum; the lanes are then merged by value, ties to the
 * lower index. bf16 values compare as the float32 they widen to, so the answer is the same. */
static inline __attribute__((always_inline)) int64_t argmax_row(const void *x, int64_t cols,
                                                               const int bf16) {
    int64_t j = 0, best = 0;
    float best_value = load_value(x, 0, bf16);
    int nan = 0;
    if (cols >= VW) {
        vwf values = load_values(x, 0, bf16);
        vwi indices, at;
        for (int lane = 0; lane < VW; ++lane) indices[lane] = lane;
        at = indices;
        vwi nans = values != values;
        for (j = VW; j + VW <= cols; j += VW) {
            const vwf v = load_values(x, j, bf16);
            at += VW;
            const vwi greater = v > values;
            values = selectw(greater, v, values);
            indices = (greater & at) | (~greater & indices);
            nans |= v != v;
        }
        best_value = values[0], best = indices[0];
        for (int lane = 0; lane < VW; ++lane) {
            nan |= nans[lane] != 0;
            if (values[lane] > best_value || (values[lane] == best_value && indices[lane] < best))
                best_value = values[lane], best = indices[lane];
        }
    } else {
        j = 1;
        nan = best_value != best_value;
    }
    for (; j < cols; ++j) {
        const float value = load_value(x, j, bf16);
        nan |= value != value;
        if (value > best_value) best_value = value, best = j;
    }
    if (nan)
        for (j = 0; j < cols; ++j)
            if (load_value(x, j, bf16) != load_value(x, j, bf16)) return j;
    return best;
}

/* out[r] = argmax_row(x[r]) for each of num_rows rows (greedy sampling's token ids). */
void ts_argmax_rows_f32(int64_t *out, const float *x, int64_t num_rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (num_rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < num_rows; ++r) out[r] = argmax_row(x + r * cols, cols, 0);
}

/* The same of bfloat16 rows (a bf16 LM head's logits). */
void ts_argmax_rows_bf16(int64_t *out, const uint16_t *x, int64_t num_rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (num_rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < num_rows; ++r) out[r] = argmax_row(x + r * cols, cols, 1);
}
