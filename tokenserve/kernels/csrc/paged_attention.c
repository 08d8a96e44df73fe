/*
 * Decode attention over a paged KV cache, for the CPU backend.
 *
 * One query token per row attends to the row's whole context, read in place from the
 * cache blocks its block table names: nothing is gathered or padded. Work items are
 * (row, kv head) pairs, spread over the OpenMP threads of the process (the same libgomp
 * runtime torch uses, so one thread pool serves both). The query heads that share a kv
 * head (grouped-query attention) are done together, so each key and value is read once
 * from memory.
 *
 * Two passes per item: scores q.k for the whole context (eight keys at a time, eight
 * independent accumulators), a softmax, then the probability-weighted sum of values
 * (the output row held in registers). Head sizes 64 and 128 get code specialised at
 * compile time; other sizes take a plain loop.
 *
 * The cache holds float32 or bfloat16 (--kv-cache-dtype bfloat16: half the bytes to
 * stream; a bfloat16 is the top half of a float32, so reading one back is a shift, and
 * writing one rounds to nearest even, as torch's conversion does).
 *
 * Layouts (contiguous; out, query, key and value float32):
 *   out, query     [num_tokens, num_heads, head_dim], heads contiguous, rows strided
 *   key/value      [num_blocks, num_kv_heads, block_size, head_dim]: within a block, each
 *                  kv head's keys (values) are contiguous, so a work item streams whole
 *                  runs of block_size * head_dim (faster than heads interleaved per
 *                  token: benchmarks/paged_decode.py)
 *   block_tables   [num_rows, block_table_stride] int64; row r uses the first
 *                  ceil(seq_lens[r] / block_size) entries
 *   seq_lens       [num_rows] int64, each >= 1
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"

/* Cache elements i..i+7 (or i) as float32; `bf16` is a constant after inlining. */
static inline v8f kv_load8(const void *cache, int64_t i, int bf16) {
    if (!bf16) return load8((const float *)cache + i);
    uint16_t half[8];
    memcpy(half, (const uint16_t *)cache + i, sizeof half);
    v8i bits;
    for (int l = 0; l < 8; ++l) bits[l] = (int32_t)((uint32_t)half[l] << 16);
    v8f out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline float kv_load1(const void *cache, int64_t i, int bf16) {
    if (!bf16) return ((const float *)cache)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)cache)[i] << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* float32 → bfloat16, rounding to nearest even (a NaN stays a quiet NaN). */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline __attribute__((always_inline)) void attend_item(
    float *o, const float *q, const void *key_cache, const void *value_cache,
    const int64_t *table, int64_t seq_len, int64_t group, const int64_t head_dim,
    int64_t block_stride, int64_t block_size, int64_t kv_offset,
    float scale, float *scores, int bf16) {
    const int64_t chunks = head_dim / 8;
    const int64_t element = bf16 ? 2 : 4;
    /* Pass 1: scaled scores, per query head of the group, per context position. */
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const int64_t block = table[start / block_size] * block_stride + kv_offset;
        const int64_t count = seq_len - start < block_size ? seq_len - start : block_size;
        if (start + block_size < seq_len) {
            /* The next block's keys, and its values for pass 2, start coming from memory
             * while this block is computed: a block table is a pointer chase the hardware
             * prefetcher cannot follow. */
            const int64_t next = table[start / block_size + 1] * block_stride + kv_offset;
            const int64_t next_count =
                seq_len - start - block_size < block_size ? seq_len - start - block_size
                                                          : block_size;
            /* The kv head's run in the next block: next_count tokens, contiguous. */
            const int64_t bytes = next_count * head_dim * element;
            for (int64_t b = 0; b < bytes; b += 64) {
                __builtin_prefetch((const char *)key_cache + next * element + b, 0, 3);
                __builtin_prefetch((const char *)value_cache + next * element + b, 0, 2);
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            const float *qg = q + g * head_dim;
            float *s = scores + g * seq_len + start;
            int64_t i = 0;
            for (; i + 8 <= count; i += 8) {
                v8f acc[8] = {0};
                for (int64_t c = 0; c < chunks; ++c) {
                    const v8f qv = load8(qg + 8 * c);
                    for (int t = 0; t < 8; ++t)
                        acc[t] = fma8(qv,
                                      kv_load8(key_cache, block + (i + t) * head_dim + 8 * c,
                                               bf16),
                                      acc[t]);
                }
                store8(s + i, hsum8x8(acc) * splat8(scale));
            }
            for (; i < count; ++i) {
                v8f acc = {0};
                for (int64_t c = 0; c < chunks; ++c)
                    acc = fma8(load8(qg + 8 * c),
                               kv_load8(key_cache, block + i * head_dim + 8 * c, bf16), acc);
                s[i] = hsum8(acc) * scale;
            }
        }
    }
    /* Softmax per query head, then pass 2: the probability-weighted sum of values. */
    for (int64_t g = 0; g < group; ++g) {
        float *s = scores + g * seq_len;
        /* The maximum and the sum eight lanes at a time, each reduced once at the end:
         * cheaper than a scalar maximum and a horizontal sum per eight scores. */
        float max = s[0];
        int64_t t = 0;
        if (seq_len >= 8) {
            v8f top = load8(s);
            for (t = 8; t + 8 <= seq_len; t += 8) {
                const v8f x = load8(s + t);
                top = select8(x > top, x, top);
            }
            for (int l = 0; l < 8; ++l) max = top[l] > max ? top[l] : max;
        }
        for (; t < seq_len; ++t) max = s[t] > max ? s[t] : max;
        v8f sums = splat8(0.0f);
        for (t = 0; t + 8 <= seq_len; t += 8) {
            const v8f e = exp8(load8(s + t) - splat8(max));
            store8(s + t, e);
            sums += e;
        }
        float sum = hsum8(sums);
        for (; t < seq_len; ++t) {
            s[t] = expf(s[t] - max);
            sum += s[t];
        }
        v8f acc[32] = {0}; /* head_dim <= 256 */
        for (int64_t start = 0; start < seq_len; start += block_size) {
            const int64_t block = table[start / block_size] * block_stride + kv_offset;
            const int64_t count = seq_len - start < block_size ? seq_len - start : block_size;
            for (int64_t i = 0; i < count; ++i) {
                const v8f p = splat8(s[start + i]);
                const int64_t v = block + i * head_dim;
                for (int64_t c = 0; c < chunks; ++c)
                    acc[c] = fma8(p, kv_load8(value_cache, v + 8 * c, bf16), acc[c]);
            }
        }
        const v8f inv = splat8(1.0f / sum);
        for (int64_t c = 0; c < chunks; ++c) store8(o + g * head_dim + 8 * c, acc[c] * inv);
    }
}

static void attend_item_generic(float *o, const float *q, const void *key_cache,
                                const void *value_cache, const int64_t *table, int64_t seq_len,
                                int64_t group, int64_t head_dim,
                                int64_t block_stride, int64_t block_size, int64_t kv_offset,
                                float scale, float *scores, int bf16) {
    for (int64_t t = 0; t < seq_len; ++t) {
        const int64_t k = table[t / block_size] * block_stride + (t % block_size) * head_dim +
                          kv_offset;
        for (int64_t g = 0; g < group; ++g) {
            float dot = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d)
                dot += q[g * head_dim + d] * kv_load1(key_cache, k + d, bf16);
            scores[g * seq_len + t] = dot * scale;
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        float *s = scores + g * seq_len;
        float *og = o + g * head_dim;
        float max = s[0];
        for (int64_t t = 1; t < seq_len; ++t) max = s[t] > max ? s[t] : max;
        float sum = 0.0f;
        for (int64_t t = 0; t < seq_len; ++t) {
            s[t] = expf(s[t] - max);
            sum += s[t];
        }
        for (int64_t d = 0; d < head_dim; ++d) og[d] = 0.0f;
        for (int64_t t = 0; t < seq_len; ++t) {
            const int64_t v = table[t / block_size] * block_stride +
                              (t % block_size) * head_dim + kv_offset;
            for (int64_t d = 0; d < head_dim; ++d)
                og[d] += s[t] * kv_load1(value_cache, v + d, bf16);
        }
        for (int64_t d = 0; d < head_dim; ++d) og[d] /= sum;
    }
}

/* Work item (row, kv_head) of a decode step: the group of query heads sharing kv_head, for
 * decode row `row` (its query at q, its output at o), over the row's seq_len positions;
 * `scores` holds group * seq_len floats. */
static void decode_item(float *o, const float *q, const void *key_cache,
                        const void *value_cache, const int64_t *table, int64_t seq_len,
                        int64_t kv_head, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, float *scores,
                        int64_t kv_bf16) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t block_stride = num_kv_heads * block_size * head_dim;
    const int64_t kv_offset = kv_head * block_size * head_dim;
    o += kv_head * group * head_dim;
    q += kv_head * group * head_dim;
    /* Head size and element type constants in each call, for the compiler. */
#define ATTEND(dim, bf16)                                                                     \
    attend_item(o, q, key_cache, value_cache, table, seq_len, group, dim, block_stride,        \
                block_size, kv_offset, scale, scores, bf16)
    if (head_dim == 64 && kv_bf16)
        ATTEND(64, 1);
    else if (head_dim == 64)
        ATTEND(64, 0);
    else if (head_dim == 128 && kv_bf16)
        ATTEND(128, 1);
    else if (head_dim == 128)
        ATTEND(128, 0);
    else
        attend_item_generic(o, q, key_cache, value_cache, table, seq_len, group, head_dim,
                            block_stride, block_size, kv_offset, scale, scores, kv_bf16 != 0);
#undef ATTEND
}

/* Returns 0, or -1 if a scratch buffer could not be allocated. Decode row r reads its
 * query at query + rows[r] * query_stride and writes out + rows[r] * out_stride (rows index
 * the step's flat token dimension; query may be a view into a fused QKV tensor). The
 * caches hold bfloat16 if kv_bf16, else float32. */
int ts_paged_decode(float *out, int64_t out_stride, const float *query, int64_t query_stride,
                    const int64_t *rows, const void *key_cache, const void *value_cache,
                    const int64_t *block_tables, int64_t block_table_stride,
                    const int64_t *seq_lens, int64_t num_rows, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                    int64_t kv_bf16) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_items = num_rows * num_kv_heads;
    int64_t max_seq_len = 0;
    for (int64_t r = 0; r < num_rows; ++r)
        max_seq_len = seq_lens[r] > max_seq_len ? seq_lens[r] : max_seq_len;
    int failed = 0;
#pragma omp parallel
    {
        /* Each thread's scores, for the longest context: allocated once, not per item. */
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * max_seq_len));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            const int64_t row = item / num_kv_heads;
            if (scores != NULL)
                decode_item(out + rows[row] * out_stride, query + rows[row] * query_stride,
                            key_cache, value_cache, block_tables + row * block_table_stride,
                            seq_lens[row], item % num_kv_heads, num_heads, num_kv_heads,
                            head_dim, block_size, scale, scores, kv_bf16);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* One token's keys and values (num_kv_heads * head_dim contiguous float32 values at key and
 * value) into cache slot `slot`, i.e. offset slot % block_size of block slot / block_size,
 * one head_dim run per kv head; rounded to bfloat16 if kv_bf16. */
static inline void write_kv_token(void *key_cache, void *value_cache, const float *key,
                                  const float *value, int64_t slot, int64_t num_kv_heads,
                                  int64_t block_size, int64_t head_dim, int64_t kv_bf16) {
    const int64_t head_stride = block_size * head_dim;
    const int64_t base =
        slot / block_size * num_kv_heads * head_stride + slot % block_size * head_dim;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
        const float *k = key + h * head_dim;
        const float *v = value + h * head_dim;
        const int64_t at = base + h * head_stride;
        if (kv_bf16) {
            for (int64_t d = 0; d < head_dim; ++d) {
                ((uint16_t *)key_cache)[at + d] = to_bf16(k[d]);
                ((uint16_t *)value_cache)[at + d] = to_bf16(v[d]);
            }
        } else {
            memcpy((float *)key_cache + at, k, sizeof(float) * (size_t)head_dim);
            memcpy((float *)value_cache + at, v, sizeof(float) * (size_t)head_dim);
        }
    }
}

/* Writes the step's new keys and values into their cache slots: token t's K/V heads at
 * key + t * src_stride, value + t * src_stride (views into a fused QKV tensor) go to slot
 * slots[t] (write_kv_token). */
void ts_write_kv(void *key_cache, void *value_cache, const float *key, const float *value,
                 int64_t src_stride, const int64_t *slots, int64_t num_tokens,
                 int64_t num_kv_heads, int64_t block_size, int64_t head_dim, int64_t kv_bf16) {
#pragma omp parallel for schedule(static) if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; ++t)
        write_kv_token(key_cache, value_cache, key + t * src_stride, value + t * src_stride,
                       slots[t], num_kv_heads, block_size, head_dim, kv_bf16);
}
