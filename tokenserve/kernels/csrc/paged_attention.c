/*
 * Decode attention over a paged KV cache, for the CPU backend.
 *
 * One query token per row attends to the row's whole context, read in place from the
 * cache blocks its block table names: nothing is gathered or padded. Work items are
 * (row, kv head) pairs, spread over the OpenMP threads of the process (the same libgomp
 * runtime torch uses, so one thread pool serves both), each thread claiming its next item
 * one ahead and prefetching from it while it computes the current one, as much as suits
 * the CPU (decode_items). The query heads that share a kv head (grouped-query
 * attention) are done together, so each key and value is read once from memory.
 *
 * Two passes per item, each reading every key (value) once for all the query heads of the
 * group: scores q.k for the whole context (KEYS keys by up to SCORE_HEADS heads of
 * accumulators at a time), a softmax per head, then the probability-weighted sum of values
 * (the heads' output rows held in registers). An 8-bit float element costs more to widen
 * than its multiply-adds on AVX2, where a pass holds one head's KEYS accumulators: there
 * each key and value is widened once for all the heads of the group instead (one key at a
 * time, and the values in slices narrow enough for all the heads' outputs, ONE_WIDENING).
 * The vectors are the widest of the build's level (vecw.h: 16 float32 lanes on AVX-512, 8
 * on AVX2). Head sizes 64 and 128 get code specialised at compile time, other multiples of
 * the vector step take the same code with the size a variable (in slices above
 * SLICE_VECTORS vectors), the rest a plain loop.
 *
 * The cache holds float32 or bfloat16 (--kv-cache-dtype bfloat16: half the bytes to
 * stream; a bfloat16 is the top half of a float32, so reading two back is a shift and a
 * mask (vecw.h's even and odd lanes: the queries are laid out to match), and writing one
 * rounds to nearest even, as torch's conversion does), or 8-bit floats (--kv-cache-dtype
 * fp8, fp8_e4m3, fp8_e5m2: a quarter of float32's bytes; fp8.h widens and narrows them). The
 * arithmetic is float32 in every case except on the dot-product path below.
 *
 * On a level with AVX512_BF16 (avx512_bf16, amx) a bfloat16 cache of head size a multiple
 * of 16 in blocks of an even size takes the dot-product path instead, with the numerics of
 * the prompt kernel's bf16 path (prompt_attention.c) and PyTorch's bf16 flash kernel:
 * queries rounded to bfloat16, scores q.k summed in float32 by vdpbf16ps (pairs of bf16
 * products into float32 lanes, 32 cache elements an instruction with no widening; a head
 * size 16 past a multiple of 32 ends in an instruction over 16 elements and 16 zeros), then
 * scaled; the softmax in float32; the probabilities rounded to bfloat16 for the product
 * with the values, whose rows are taken two tokens at a time and interleaved (unpack) so
 * that one vdpbf16ps weighs both; the output summed in float32. A decode row and the same
 * position computed in a prompt chunk then round alike, and each key and value costs one
 * instruction per query head instead of a widening and two multiply-adds.
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
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fp8.h"
#include "vecw.h"

/* Query heads scored per pass over a block's keys: each holds KEYS accumulators, and a
 * 16-register AVX2 file holds one head's. */
#define KEYS 8
/* Pass 1 reads the context in runs of up to RUN tokens of one block, prefetching the
 * keys and values AHEAD tokens on (a float32 cache; AHEAD_BF16 for a bfloat16 one, its
 * keys into L2 rather than L1): a steady stream, where whole blocks at once (128 tokens in
 * an engine) measured ~10% slower (docs/PERFORMANCE_CPU.md). */
#define RUN 16
#define AHEAD 64
#define AHEAD_BF16 32
/* What an item prefetches of its own tokens as it goes (attend_item): nothing (the thread
 * streamed them in during the item before); a float32 cache's keys AHEAD tokens on into
 * L1, a bfloat16 one's AHEAD_BF16 on into L2 (OWN_FAR) or AHEAD_NEAR_BF16 on into L1
 * (OWN_NEAR); the values with the keys, into L2. */
#define OWN_NONE 0
#define OWN_FAR 1
#define OWN_NEAR 2
#define AHEAD_NEAR_BF16 16
/* The next item's first LEAD tokens, which an item prefetches into L2 before its second
 * pass under the OWN_TOKENS_AHEAD plan (decode_items). */
#define LEAD 32
/* On AVX2 builds the STREAM_NEXT_ITEM plan's lines of the next item (NextStream): how many
 * each tile of KEYS keys and one head issues in pass 1, and each value row of a pass in
 * pass 2. */
#define SCORE_LINES 10
#define VALUE_LINES 2
/* ONE_WIDENING(kv): an 8-bit float cache on AVX2 (see the top). */
#define ONE_WIDENING(kv) (VW == 8 && KV_FP8(kv))
#define SCORE_HEADS_MAX 3
#define SCORE_HEADS(kv) (VW == 16 || ONE_WIDENING(kv) ? SCORE_HEADS_MAX : 1)
/* What the cache holds and how it is multiplied: float32; bfloat16 widened to float32
 * (bf16_pairs) for float32 multiply-adds; bfloat16 into vdpbf16ps (PAGED_DP builds only);
 * 8-bit floats, E4M3 or E5M2, widened to float32 (fp8.h) for float32 multiply-adds. */
#define KV_F32 0
#define KV_BF16 1
#define KV_BF16_DP 2
#define KV_FP8_E4M3 3
#define KV_FP8_E5M2 4
#define KV_FP8(kv) ((kv) == KV_FP8_E4M3 || (kv) == KV_FP8_E5M2)
/* Whether a 32-bit lane holds two elements (bfloat16), read as even and odd lanes. */
#define KV_PAIRS(kv) ((kv) == KV_BF16 || (kv) == KV_BF16_DP)
#define KV_ELEMENT(kv) (KV_FP8(kv) ? 1 : KV_PAIRS(kv) ? 2 : 4) /* bytes */
#if defined(__AVX512BF16__)
#define PAGED_DP 1
#else
#define PAGED_DP 0
#endif
/* Vectors of float32 a step over the cache gives: two for bfloat16 (an even and an odd
 * vector) and, on AVX-512, for 8-bit floats (the first and second VW elements: one widening
 * of 32 bytes to float16 serves both); else one. CHUNK: cache elements a step. */
#define KV_PARTS(kv) (KV_PAIRS(kv) || (KV_FP8(kv) && FP8_PAIRED) ? 2 : 1)
#define CHUNK(kv) (KV_PARTS(kv) * VW)

static inline float kv_load1(const void *cache, int64_t i, int kv) {
    if (KV_FP8(kv)) return fp8_load((const uint8_t *)cache, i, kv == KV_FP8_E5M2);
    return kv ? bf16_load((const uint16_t *)cache, i) : ((const float *)cache)[i];
}

/* Chunk c of cache row `row` as float32 into k[0] (and k[1]: the odd elements of bf16);
 * 8-bit floats come divided by KV_UNIT(kv) (fp8.h), which attend_item folds into its scales. */
#define KV_UNIT(kv) (KV_FP8(kv) ? FP8_UNIT((kv) == KV_FP8_E5M2) : 1.0f)
static inline __attribute__((always_inline)) void kv_chunk(const void *cache, int64_t row,
                                                          int64_t c, int kv, vwf k[2]) {
    if (KV_PAIRS(kv))
        bf16_pairs((const uint16_t *)cache + row + c * 2 * VW, &k[0], &k[1]);
    else if (KV_FP8(kv))
        fp8_widen_chunk((const uint8_t *)cache + row + c * CHUNK(kv), kv == KV_FP8_E5M2, k);
    else
        k[0] = loadw((const float *)cache + row + c * VW);
}

/* The work item a thread does after this one, whose keys and values it prefetches while
 * computing this one (decode_items): the block table, context length and kv head offset it
 * reads with. */
typedef struct {
    const int64_t *table;
    int64_t seq_len, kv_offset;
} NextItem;

/* The next item's keys, then its values, streamed into L2 from its first token a few cache
 * lines at a time (stream_lines), as the current item goes: on AVX2 builds the
 * STREAM_NEXT_ITEM plan's prefetches, spread over all of the item's work (SCORE_LINES a
 * tile of keys and head, VALUE_LINES a value row and pass). prefetch_next instead issues a
 * run's share of lines at once, every 16 tokens of the first passes only: bursts that wait
 * on a core's few L1 miss buffers while the arithmetic between them leaves memory idle (on
 * an AMD EPYC Zen 3 the kernel's time was that of reading its bytes plus that of its
 * arithmetic, as if nothing overlapped; docs/PERFORMANCE_CPU.md, "Streaming the next item
 * line by line"). */
typedef struct {
    const NextItem *next;
    const char *keys, *values; /* the caches */
    int64_t head_dim, block_stride, block_size, element;
    const char *at; /* the next line */
    int64_t left;   /* lines left of the run at `at` */
    int64_t token;  /* the first token after that run */
    int part;       /* 0: keys, 1: values, 2: all issued */
} NextStream;

/* The stream's next run of lines: the rest of the block that holds `token`, in the keys or
 * (after the last key) the values. */
static inline void stream_run(NextStream *st) {
    if (st->token >= st->next->seq_len) {
        if (++st->part == 2) return;
        st->token = 0;
    }
    const int64_t offset = st->token % st->block_size;
    int64_t count = st->block_size - offset;
    count = st->next->seq_len - st->token < count ? st->next->seq_len - st->token : count;
    const int64_t row = st->next->table[st->token / st->block_size] * st->block_stride +
                        st->next->kv_offset + offset * st->head_dim;
    st->at = (st->part ? st->values : st->keys) + row * st->element;
    st->left = (count * st->head_dim * st->element + 63) / 64;
    st->token += count;
}

/* `lines` more of the stream's lines into L2 (nothing without a stream). */
static inline __attribute__((always_inline)) void stream_lines(NextStream *st, int64_t lines) {
    if (st == NULL) return;
    for (; lines > 0 && st->part < 2; --lines) {
        if (st->left == 0) {
            stream_run(st);
            if (st->part == 2) return;
        }
        __builtin_prefetch(st->at, 0, 2);
        st->at += 64;
        --st->left;
    }
}

/* Scaled scores of `heads` query heads (qs: scaled, in kv_chunk's element order, head_dim
 * apart) against `count` keys from `keys` (head_dim apart); head h's go to s + h * stride.
 * Each key is converted once for all the heads. Issues the stream's lines as it goes. */
static inline __attribute__((always_inline)) void score_keys(
    float *s, int64_t stride, const float *qs, const void *key_cache, int64_t keys,
    int64_t count, const int64_t head_dim, const int heads, int kv, NextStream *stream) {
    const int64_t chunks = head_dim / CHUNK(kv);
    const int parts = KV_PARTS(kv);
    int64_t i = 0;
    for (; !ONE_WIDENING(kv) && i + KEYS <= count; i += KEYS) {
        stream_lines(stream, heads * SCORE_LINES);
        vwf acc[SCORE_HEADS_MAX][KEYS];
        for (int h = 0; h < heads; ++h)
            for (int t = 0; t < KEYS; ++t) acc[h][t] = splatw(0.0f);
#pragma GCC unroll 16
        for (int64_t c = 0; c < chunks; ++c)
            for (int t = 0; t < KEYS; ++t) {
                vwf k[2];
                kv_chunk(key_cache, keys + (i + t) * head_dim, c, kv, k);
                for (int h = 0; h < heads; ++h)
                    for (int p = 0; p < parts; ++p)
                        acc[h][t] = fmaw(loadw(qs + h * head_dim + (c * parts + p) * VW), k[p],
                                         acc[h][t]);
            }
        for (int h = 0; h < heads; ++h) {
            v8f folded[KEYS];
            for (int t = 0; t < KEYS; ++t) folded[t] = fold8(acc[h][t]);
            store8(s + h * stride + i, hsum8x8(folded));
        }
    }
    for (; i < count; ++i) {
        stream_lines(stream, (heads * SCORE_LINES + KEYS - 1) / KEYS);
        vwf acc[SCORE_HEADS_MAX];
        for (int h = 0; h < heads; ++h) acc[h] = splatw(0.0f);
#pragma GCC unroll 16
        for (int64_t c = 0; c < chunks; ++c) {
            vwf k[2];
            kv_chunk(key_cache, keys + i * head_dim, c, kv, k);
            for (int h = 0; h < heads; ++h)
                for (int p = 0; p < parts; ++p)
                    acc[h] = fmaw(loadw(qs + h * head_dim + (c * parts + p) * VW), k[p], acc[h]);
        }
        for (int h = 0; h < heads; ++h) s[h * stride + i] = hsum8(fold8(acc[h]));
    }
}

/* Scores e^(s - max) in place; returns their sum, and the maximum in *top. */
static inline float softmax_unnormalised(float *s, int64_t n, float *top_out) {
    /* The maximum and the sum eight lanes at a time, each reduced once at the end. */
    float max = s[0];
    int64_t t = 0;
    if (n >= 8) {
        v8f top = load8(s);
        for (t = 8; t + 8 <= n; t += 8) {
            const v8f x = load8(s + t);
            top = select8(x > top, x, top);
        }
        for (int l = 0; l < 8; ++l) max = top[l] > max ? top[l] : max;
    }
    for (; t < n; ++t) max = s[t] > max ? s[t] : max;
    vwf sums = splatw(0.0f);
    for (t = 0; t + VW <= n; t += VW) {
        const vwf e = expw(loadw(s + t) - splatw(max));
        storew(s + t, e);
        sums += e;
    }
    float sum = hsum8(fold8(sums));
    for (; t < n; ++t) {
        s[t] = expf(s[t] - max);
        sum += s[t];
    }
    *top_out = max;
    return sum;
}

/* The part of the next item's keys or values (cache) that corresponds to tokens
 * [from, to) of the current one's n (its m tokens spread over the current item's), into L2. */
static inline __attribute__((always_inline)) void prefetch_next(
    const void *cache, const NextItem *next, int64_t from, int64_t to, int64_t n,
    int64_t head_dim, int64_t block_stride, int64_t block_size, const int64_t element) {
    const int64_t m = next->seq_len;
    const int64_t until = to >= n ? m : to * m / n;
    for (int64_t at = from * m / n; at < until;) {
        const int64_t at_offset = at % block_size;
        const int64_t row = next->table[at / block_size] * block_stride + next->kv_offset +
                            at_offset * head_dim;
        int64_t count = block_size - at_offset;
        count = until - at < count ? until - at : count;
        for (int64_t b = 0; b < count * head_dim * element; b += 64)
            __builtin_prefetch((const char *)cache + row * element + b, 0, 2);
        at += count;
    }
}

/* The next item's keys and values of its first LEAD tokens, into L2. */
static inline __attribute__((always_inline)) void prefetch_lead(
    const void *key_cache, const void *value_cache, const NextItem *next, int64_t head_dim,
    int64_t block_stride, int64_t block_size, const int64_t element) {
    const int64_t until = next->seq_len < LEAD ? next->seq_len : LEAD;
    for (int64_t at = 0; at < until; at += block_size) {
        const int64_t count = until - at < block_size ? until - at : block_size;
        const int64_t row = next->table[at / block_size] * block_stride + next->kv_offset;
        for (int64_t b = 0; b < count * head_dim * element; b += 64) {
            __builtin_prefetch((const char *)key_cache + row * element + b, 0, 2);
            __builtin_prefetch((const char *)value_cache + row * element + b, 0, 2);
        }
    }
}

/* The most vectors of output one value pass keeps in registers, over all its heads, and
 * per head (a wider head is done in slices of SLICE_VECTORS * VW elements). */
#define VALUE_VECTORS (VW == 16 ? 24 : 8)
#define SLICE_VECTORS 8

/* o[h][0 .. width) = sum over the context of p[h * stride + t] * value t [0 .. width),
 * times inv[h], for `heads` query heads, values read from element `first` of each row:
 * each value is converted once for all the heads (a float32 one on AVX2 held in a register
 * for them all, in_register: else GCC loads it again for each head's multiply-add). Issues
 * the stream's lines as it goes. */
static inline __attribute__((always_inline)) void weigh_values(
    float *o, const float *p, int64_t stride, const float *inv, const void *value_cache,
    const int64_t *table, int64_t seq_len, const int64_t head_dim, const int64_t first,
    const int64_t width, int64_t block_stride, int64_t block_size, int64_t kv_offset,
    const int heads, int kv, const NextItem *next, NextStream *stream) {
    const int64_t chunks = width / CHUNK(kv);
    const int parts = KV_PARTS(kv);
    vwf acc[4][SLICE_VECTORS]; /* heads <= 4 */
    for (int h = 0; h < heads; ++h)
        for (int64_t c = 0; c < chunks * parts; ++c) acc[h][c] = splatw(0.0f);
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const int64_t block = table[start / block_size] * block_stride + kv_offset + first;
        const int64_t count = seq_len - start < block_size ? seq_len - start : block_size;
        for (int64_t i = 0; i < count; ++i) {
            const int64_t row = block + i * head_dim;
            if (next && i % 16 == 0)
                prefetch_next(value_cache, next, start + i,
                              start + (i + 16 < count ? i + 16 : count), seq_len, head_dim,
                              block_stride, block_size, KV_ELEMENT(kv));
            stream_lines(stream, VALUE_LINES);
#pragma GCC unroll 16
            for (int64_t c = 0; c < chunks; ++c) {
                vwf v[2];
                kv_chunk(value_cache, row, c, kv, v);
                if (kv == KV_F32 && heads > 1) in_register(v[0]);
                for (int h = 0; h < heads; ++h) {
                    const vwf weight = splatw(p[h * stride + start + i]);
                    for (int q = 0; q < parts; ++q)
                        acc[h][c * parts + q] = fmaw(weight, v[q], acc[h][c * parts + q]);
                }
            }
        }
    }
    for (int h = 0; h < heads; ++h)
        for (int64_t c = 0; c < chunks; ++c) {
            if (!KV_PAIRS(kv)) { /* in the row's order already */
                for (int part = 0; part < parts; ++part)
                    storew(o + h * head_dim + first + (c * parts + part) * VW,
                           acc[h][c * parts + part] * splatw(inv[h]));
                continue;
            }
            /* Back from even and odd lanes to the row's order. */
            vwf lo, hi;
            interleave(acc[h][2 * c], acc[h][2 * c + 1], &lo, &hi);
            storew(o + h * head_dim + first + c * 2 * VW, lo * splatw(inv[h]));
            storew(o + h * head_dim + first + c * 2 * VW + VW, hi * splatw(inv[h]));
        }
}

#if PAGED_DP
/* Chunk c of a dot-product row: 32 bf16 elements from p + 32 c, or with `half` (the last
 * chunk of a row of a size 16 past a multiple of 32) 16 elements and 16 zeros: nothing is
 * read past the row, and the zeros add nothing to a product. */
static inline __attribute__((always_inline)) __m512i dp_chunk(const uint16_t *p, int64_t c,
                                                              int half) {
    return half ? _mm512_maskz_loadu_epi16((__mmask32)0xffff, p + c * 32)
                : _mm512_loadu_si512(p + c * 32);
}

/* The scores of KEYS keys (or 1) from `key` (head_dim apart) by `heads` query heads (qb,
 * head_dim apart) into acc, over chunks from..until (half: one chunk of 16, dp_chunk). */
static inline __attribute__((always_inline)) void score_chunks_dp(
    __m512 acc[SCORE_HEADS_MAX][KEYS], const uint16_t *qb, const uint16_t *key, int n,
    int64_t from, int64_t until, const int64_t head_dim, const int heads, int half) {
#pragma GCC unroll 8
    for (int64_t c = from; c < until; ++c)
        for (int t = 0; t < n; ++t) {
            const __m512bh k = (__m512bh)dp_chunk(key + t * head_dim, c, half);
            for (int h = 0; h < heads; ++h)
                acc[h][t] = _mm512_dpbf16_ps(acc[h][t],
                                             (__m512bh)dp_chunk(qb + h * head_dim, c, half), k);
        }
}

/* Scores of `heads` query heads (qb: bfloat16, head_dim apart) against `count` keys from
 * `keys` (head_dim apart), scaled; head h's go to s + h * stride. One vdpbf16ps per 32
 * elements of a key and head (the last 16 of a head size 16 past a multiple of 32: one
 * with zeros beside them). */
static inline __attribute__((always_inline)) void score_keys_dp(
    float *s, int64_t stride, const uint16_t *qb, const uint16_t *key_cache, int64_t keys,
    int64_t count, const int64_t head_dim, const int heads, float scale) {
    const int64_t full = head_dim / 32;
    const int half = head_dim % 32 != 0;
    int64_t i = 0;
    for (; i + KEYS <= count; i += KEYS) {
        __m512 acc[SCORE_HEADS_MAX][KEYS];
        for (int h = 0; h < heads; ++h)
            for (int t = 0; t < KEYS; ++t) acc[h][t] = _mm512_setzero_ps();
        const uint16_t *key = key_cache + keys + i * head_dim;
        score_chunks_dp(acc, qb, key, KEYS, 0, full, head_dim, heads, 0);
        if (half) score_chunks_dp(acc, qb, key, KEYS, full, full + 1, head_dim, heads, 1);
        for (int h = 0; h < heads; ++h) {
            v8f folded[KEYS];
            for (int t = 0; t < KEYS; ++t) folded[t] = fold8((vwf)acc[h][t]);
            store8(s + h * stride + i, hsum8x8(folded) * splat8(scale));
        }
    }
    for (; i < count; ++i) {
        __m512 acc[SCORE_HEADS_MAX][KEYS];
        for (int h = 0; h < heads; ++h) acc[h][0] = _mm512_setzero_ps();
        const uint16_t *key = key_cache + keys + i * head_dim;
        score_chunks_dp(acc, qb, key, 1, 0, full, head_dim, heads, 0);
        if (half) score_chunks_dp(acc, qb, key, 1, full, full + 1, head_dim, heads, 1);
        for (int h = 0; h < heads; ++h)
            s[h * stride + i] = hsum8(fold8((vwf)acc[h][0])) * scale;
    }
}

/* n float32 at s rounded to bfloat16, in place: s's first n / 2 (rounded up) 32-bit words
 * become pairs (s[2j], s[2j + 1]), the second of an odd n's last pair 0. */
static inline void bf16_pairs_in_place(float *s, int64_t n) {
    uint32_t *pairs = (uint32_t *)s;
    for (int64_t t = 0; t < n; t += 32) {
        /* Each 32 values are read before their 16 pairs are written, at or before them. */
        const __mmask16 lo = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        const __mmask16 hi = n - t >= 32 ? 0xffff
                             : n - t <= 16 ? 0
                                           : (__mmask16)((1u << (n - t - 16)) - 1);
        const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, s + t + 16),
                                              _mm512_maskz_loadu_ps(lo, s + t));
        const int64_t words = (n - t + 1) / 2 < 16 ? (n - t + 1) / 2 : 16;
        _mm512_mask_storeu_epi32(pairs + t / 2, (__mmask16)((1u << words) - 1), (__m512i)b);
    }
}

/* Lane l of unpacklo (unpackhi) of two rows' 32 bf16 holds their element LO_DIM(l)
 * (LO_DIM(l) + 4): four elements of each 128-bit lane's eight. These put a 32-element
 * slice's sums back in order: elements 0-15 and 16-31 from the lo and hi sums. */
#define UNPACK_ORDER_0 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23
#define UNPACK_ORDER_1 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31

/* Two value rows a, b (b: zeros past the context) weighed by `heads` pairs of
 * probabilities w[h] into acc[h][2c], acc[h][2c + 1] for the slice's chunks from..until
 * (half: one chunk of 16, dp_chunk). */
static inline __attribute__((always_inline)) void weigh_pair_dp(
    __m512 acc[4][SLICE_VECTORS], const uint16_t *a, const uint16_t *b,
    const __m512bh *w, int64_t from, int64_t until, const int heads, int half) {
#pragma GCC unroll 8
    for (int64_t c = from; c < until; ++c) {
        const __m512i x = dp_chunk(a, c, half);
        const __m512i y = b ? dp_chunk(b, c, half) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
        for (int h = 0; h < heads; ++h) {
            acc[h][2 * c] = _mm512_dpbf16_ps(acc[h][2 * c], lo, w[h]);
            acc[h][2 * c + 1] = _mm512_dpbf16_ps(acc[h][2 * c + 1], hi, w[h]);
        }
    }
}

/* weigh_pair_dp over a slice's whole chunks, then its half chunk if it has one. */
static inline __attribute__((always_inline)) void weigh_pair_slice_dp(
    __m512 acc[4][SLICE_VECTORS], const uint16_t *a, const uint16_t *b,
    const __m512bh *w, int64_t full, int half, const int heads) {
    weigh_pair_dp(acc, a, b, w, 0, full, heads, 0);
    if (half) weigh_pair_dp(acc, a, b, w, full, full + 1, heads, 1);
}

/* weigh_values on the dot-product path: pp holds each head's probabilities as bf16 pairs
 * (bf16_pairs_in_place), head h's at pp + h * stride; block_size is even, so a pair of
 * positions never straddles two blocks. */
static inline __attribute__((always_inline)) void weigh_values_dp(
    float *o, const uint32_t *pp, int64_t stride, const float *inv,
    const uint16_t *value_cache, const int64_t *table, int64_t seq_len,
    const int64_t head_dim, const int64_t first, const int64_t width, int64_t block_stride,
    int64_t block_size, int64_t kv_offset, const int heads, const NextItem *next) {
    /* 2 * chunks <= SLICE_VECTORS; a width 16 past a multiple of 32 ends in a half chunk */
    const int64_t full = width / 32, chunks = (width + 31) / 32;
    const int half = width % 32 != 0;
    __m512 acc[4][SLICE_VECTORS]; /* heads <= 4 */
    for (int h = 0; h < heads; ++h)
        for (int64_t c = 0; c < 2 * chunks; ++c) acc[h][c] = _mm512_setzero_ps();
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const uint16_t *block =
            value_cache + table[start / block_size] * block_stride + kv_offset + first;
        const int64_t count = seq_len - start < block_size ? seq_len - start : block_size;
        int64_t i = 0;
        for (; i + 2 <= count; i += 2) {
            if (next && i % 16 == 0)
                prefetch_next(value_cache, next, start + i,
                              start + (i + 16 < count ? i + 16 : count), seq_len, head_dim,
                              block_stride, block_size, 2);
            __m512bh w[4];
            for (int h = 0; h < heads; ++h)
                w[h] = (__m512bh)_mm512_set1_epi32((int)pp[h * stride + (start + i) / 2]);
            weigh_pair_slice_dp(acc, block + i * head_dim, block + (i + 1) * head_dim, w, full,
                                half, heads);
        }
        if (i < count) { /* the context's last position, paired with a zero */
            if (next && i % 16 == 0)
                prefetch_next(value_cache, next, start + i, start + count, seq_len, head_dim,
                              block_stride, block_size, 2);
            __m512bh w[4];
            for (int h = 0; h < heads; ++h)
                w[h] = (__m512bh)_mm512_set1_epi32((int)pp[h * stride + (start + i) / 2]);
            weigh_pair_slice_dp(acc, block + i * head_dim, NULL, w, full, half, heads);
        }
    }
    const __m512i order0 = (__m512i)(vwi){UNPACK_ORDER_0};
    const __m512i order1 = (__m512i)(vwi){UNPACK_ORDER_1};
    for (int h = 0; h < heads; ++h) {
        const __m512 scale = _mm512_set1_ps(inv[h]);
        for (int64_t c = 0; c < chunks; ++c) {
            float *out = o + h * head_dim + first + c * 32;
            const __m512 lo = acc[h][2 * c], hi = acc[h][2 * c + 1];
            _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_permutex2var_ps(lo, order0, hi), scale));
            if (c == full) continue; /* a half chunk: its 16 elements are all in order0's */
            _mm512_storeu_ps(out + 16,
                             _mm512_mul_ps(_mm512_permutex2var_ps(lo, order1, hi), scale));
        }
    }
}
#endif

/* The keys, and the values for pass 2, `ahead` tokens past a run of `count` tokens from
 * `start` (all of those up to there at the first run) start coming from memory while the
 * run is computed: a block table is a pointer chase the hardware prefetcher cannot
 * follow. A float32 cache's keys go to L1, AHEAD tokens on; a bfloat16 cache's to L2,
 * AHEAD_BF16 tokens on (on an AMD EPYC 1-13% faster than the float32 cache's choice at the
 * engine's block size, 14-25% at 16, where a float32 cache lost 5-8% with it:
 * docs/PERFORMANCE_CPU.md), or with `near` to L1, AHEAD_NEAR_BF16 tokens on (OWN_NEAR).
 * The values go to L2. `element` is a constant where this is inlined, and so are the
 * hints. */
static inline __attribute__((always_inline)) void prefetch_ahead(
    const void *key_cache, const void *value_cache, const int64_t *table, int64_t start,
    int64_t count, int64_t seq_len, int64_t head_dim, int64_t block_stride,
    int64_t block_size, int64_t kv_offset, const int64_t element, int near) {
    const int64_t ahead = element == 4 ? AHEAD : near ? AHEAD_NEAR_BF16 : AHEAD_BF16;
    const int64_t until = start + ahead + count;
    for (int64_t at = start ? start + ahead : 0; at < until && at < seq_len;) {
        const int64_t at_offset = at % block_size;
        const int64_t row = table[at / block_size] * block_stride + kv_offset +
                            at_offset * head_dim;
        int64_t n = block_size - at_offset;
        n = until - at < n ? until - at : n;
        n = seq_len - at < n ? seq_len - at : n;
        for (int64_t b = 0; b < n * head_dim * element; b += 64) {
            if (element < 4 && !near)
                __builtin_prefetch((const char *)key_cache + row * element + b, 0, 2);
            else
                __builtin_prefetch((const char *)key_cache + row * element + b, 0, 3);
            __builtin_prefetch((const char *)value_cache + row * element + b, 0, 2);
        }
        at += n;
    }
}

/* The group of query heads sharing one kv head, for one decode row: scores for the whole
 * context (SCORE_HEADS(kv) heads per pass over each block's keys), a softmax per head, then
 * the probability-weighted sum of values (as many heads per pass as fit in registers). The
 * caller guarantees head_dim % CHUNK(bf16) == 0 and head_dim <= 256. own: what the item
 * prefetches of its own tokens (OWN_NONE, OWN_FAR, OWN_NEAR); next: the item whose keys
 * and values stream into L2 meanwhile (on AVX2 builds line by line, NextStream; else
 * spread over this one's tokens by prefetch_next), and lead: the item whose first tokens
 * do so before the second pass (either may be NULL). With lse, each head's log-sum-exp of
 * its scaled scores goes to lse[g] (merge_attention). */
static inline __attribute__((always_inline)) void attend_item(
    float *o, const float *q, const void *key_cache, const void *value_cache,
    const int64_t *table, int64_t seq_len, int64_t group, const int64_t head_dim,
    int64_t block_stride, int64_t block_size, int64_t kv_offset,
    float scale, float *scores, int kv, int own, const NextItem *next,
    const NextItem *lead, float *lse) {
    const int64_t element = KV_ELEMENT(kv);
    const int dp = kv == KV_BF16_DP;
    /* The queries scaled (and by KV_UNIT: exactly, a power of two), and for bf16
     * de-interleaved per chunk as kv_chunk reads keys; on the dot-product path rounded to
     * bf16 instead (the scores are scaled). */
    const float unit = KV_UNIT(kv);
    float qs[dp ? 1 : group * head_dim] __attribute__((aligned(64)));
    uint16_t qb[dp ? group * head_dim : 1] __attribute__((aligned(64)));
    (void)qb; /* read on the dot-product path only (PAGED_DP builds) */
    if (dp)
        for (int64_t g = 0; g < group * head_dim; ++g) qb[g] = bf16_round(q[g]);
    else
        for (int64_t g = 0; g < group * head_dim; g += CHUNK(kv))
            for (int64_t j = 0; j < CHUNK(kv); ++j)
                qs[g + (KV_PAIRS(kv) ? (j & 1) * VW + j / 2 : j)] = q[g + j] * scale * unit;
    NextStream stream_state, *stream = NULL;
    if (next && VW == 8 && !dp) {
        stream_state = (NextStream){next, (const char *)key_cache, (const char *)value_cache,
                                    head_dim, block_stride, block_size, element, NULL, 0, 0,
                                    0};
        stream = &stream_state;
        next = NULL; /* streamed line by line instead */
    }
    /* Pass 1: scaled scores, per query head of the group, per context position, in runs
     * of at most RUN tokens of one block. */
    for (int64_t start = 0; start < seq_len;) {
        const int64_t offset = start % block_size;
        const int64_t block = table[start / block_size] * block_stride + kv_offset +
                              offset * head_dim;
        int64_t count = block_size - offset < RUN ? block_size - offset : RUN;
        count = seq_len - start < count ? seq_len - start : count;
        if (own != OWN_NONE)
            prefetch_ahead(key_cache, value_cache, table, start, count, seq_len, head_dim,
                           block_stride, block_size, kv_offset, element, own == OWN_NEAR);
        if (next)
            prefetch_next(key_cache, next, start, start + count, seq_len, head_dim,
                          block_stride, block_size, element);
        for (int64_t g = 0; g < group; g += SCORE_HEADS(kv)) {
            float *s = scores + g * seq_len + start;
            const float *qg = qs + g * head_dim;
#if PAGED_DP
#define SCORE(n)                                                                              \
    (dp ? score_keys_dp(s, seq_len, qb + g * head_dim, key_cache, block, count, head_dim, n,   \
                        scale)                                                                \
        : score_keys(s, seq_len, qg, key_cache, block, count, head_dim, n, kv, stream))
#else
#define SCORE(n) score_keys(s, seq_len, qg, key_cache, block, count, head_dim, n, kv, stream)
#endif
            /* A constant head count in each call, so the accumulators stay in registers. */
            switch (group - g < SCORE_HEADS(kv) ? group - g : SCORE_HEADS(kv)) {
            case 3: SCORE(3); break;
            case 2: SCORE(2); break;
            default: SCORE(1);
            }
#undef SCORE
        }
        start += count;
    }
    float inv[group];
    for (int64_t g = 0; g < group; ++g) {
        float top;
        const float sum = softmax_unnormalised(scores + g * seq_len, seq_len, &top);
        inv[g] = unit / sum;
        if (lse != NULL) lse[g] = top + logf(sum);
#if PAGED_DP
        if (dp) bf16_pairs_in_place(scores + g * seq_len, seq_len);
#endif
    }
    if (lead)
        prefetch_lead(key_cache, value_cache, lead, head_dim, block_stride, block_size, element);
    /* Pass 2: per slice of the head, as many heads per pass over the values as their
     * outputs fit in registers. On AVX2 a float32 cache's group of two or three heads takes
     * slices of 4 vectors, all its heads a pass: 12 sums, 3 weights and the value fill the 16
     * registers, and each value is read once for the group, where slices of 8 vectors hold
     * one head's sums and read each value once per head (from L2, where those reads, not the
     * multiply-adds, bound a pass; docs/PERFORMANCE_CPU.md, "Streaming the next item line by
     * line"). */
    if (VW == 8 && kv == KV_F32 && (group == 2 || group == 3) && head_dim % (4 * VW) == 0) {
        for (int64_t first = 0; first < head_dim; first += 4 * VW)
            if (group == 3)
                weigh_values(o, scores, seq_len, inv, value_cache, table, seq_len, head_dim,
                             first, 4 * VW, block_stride, block_size, kv_offset, 3, kv, next,
                             stream);
            else
                weigh_values(o, scores, seq_len, inv, value_cache, table, seq_len, head_dim,
                             first, 4 * VW, block_stride, block_size, kv_offset, 2, kv, next,
                             stream);
        stream_lines(stream, INT64_MAX); /* what is left of the next item */
        return;
    }
    int64_t width = head_dim < SLICE_VECTORS * VW ? head_dim : SLICE_VECTORS * VW;
    if (ONE_WIDENING(kv)) { /* slices in which all the group's heads (up to 4) fit */
        const int64_t vectors = VALUE_VECTORS / (group < 4 ? group : 4);
        if (vectors * VW < width) width = vectors * VW;
    }
    int64_t most = VALUE_VECTORS / (width / VW);
    most = most < 1 ? 1 : most > 4 ? 4 : most;
    for (int64_t first = 0; first < head_dim; first += width)
        for (int64_t g = 0; g < group;) {
            const int64_t heads = group - g < most ? group - g : most;
            const int64_t slice = head_dim - first < width ? head_dim - first : width;
            /* The next item's values stream in during the first pass over these. */
            const NextItem *values_next = first == 0 && g == 0 ? next : NULL;
#define WEIGH_F32(n)                                                                          \
    weigh_values(o + g * head_dim, scores + g * seq_len, seq_len, inv + g, value_cache, table, \
                 seq_len, head_dim, first, slice, block_stride, block_size, kv_offset, n, kv,    \
                 values_next, stream)
#if PAGED_DP
#define WEIGH(n)                                                                              \
    (dp ? weigh_values_dp(o + g * head_dim, (const uint32_t *)(scores + g * seq_len), seq_len, \
                          inv + g, value_cache, table, seq_len, head_dim, first, slice,         \
                          block_stride, block_size, kv_offset, n, values_next)                  \
        : WEIGH_F32(n))
#else
#define WEIGH(n) WEIGH_F32(n)
#endif
            if (heads == 4)
                WEIGH(4);
            else if (heads == 3)
                WEIGH(3);
            else if (heads == 2)
                WEIGH(2);
            else
                WEIGH(1);
            g += heads;
        }
#undef WEIGH
#undef WEIGH_F32
    stream_lines(stream, INT64_MAX);
}

static void attend_item_generic(float *o, const float *q, const void *key_cache,
                                const void *value_cache, const int64_t *table, int64_t seq_len,
                                int64_t group, int64_t head_dim,
                                int64_t block_stride, int64_t block_size, int64_t kv_offset,
                                float scale, float *scores, int kv) {
    for (int64_t t = 0; t < seq_len; ++t) {
        const int64_t k = table[t / block_size] * block_stride + (t % block_size) * head_dim +
                          kv_offset;
        for (int64_t g = 0; g < group; ++g) {
            float dot = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d)
                dot += q[g * head_dim + d] * kv_load1(key_cache, k + d, kv);
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
                og[d] += s[t] * kv_load1(value_cache, v + d, kv);
        }
        for (int64_t d = 0; d < head_dim; ++d) og[d] /= sum;
    }
}

/* Whether decode rows over a bfloat16 cache of these shapes read with bf16 numerics
 * (KV_BF16_DP) take the dot-product path. */
int ts_paged_decode_dot_products(int64_t head_dim, int64_t block_size) {
    return PAGED_DP && head_dim % 16 == 0 && head_dim <= 256 && block_size % 2 == 0;
}

/* The parameters of an item once its kv head is placed (attend_item's, less the cache
 * mode), and the arguments that pass them on. */
#define ITEM_PARAMS                                                                           \
    float *o, const float *q, const void *key_cache, const void *value_cache,                 \
        const int64_t *table, int64_t seq_len, int64_t group, int64_t head_dim,               \
        int64_t block_stride, int64_t block_size, int64_t kv_offset, float scale,             \
        float *scores, int own, const NextItem *next, const NextItem *lead, float *lse
#define ITEM_ARGS                                                                             \
    o, q, key_cache, value_cache, table, seq_len, group, head_dim, block_stride, block_size,  \
        kv_offset, scale, scores, own, next, lead, lse

/* An item of cache mode kv (a constant where this is inlined) by head size: 64 and 128
 * specialised at compile time, other multiples of the vector chunk up to 256 with the size
 * a variable, the rest the plain loop (lse left alone there). */
static inline __attribute__((always_inline)) void attend_dims(ITEM_PARAMS, const int kv) {
#define ATTEND_ITEM(dim)                                                                      \
    attend_item(o, q, key_cache, value_cache, table, seq_len, group, dim, block_stride,        \
                block_size, kv_offset, scale, scores, kv, own, next, lead, lse)
    if (head_dim == 64)
        ATTEND_ITEM(64);
    else if (head_dim == 128)
        ATTEND_ITEM(128);
    else if (kv == KV_BF16_DP || (head_dim % CHUNK(kv) == 0 && head_dim <= 256))
        ATTEND_ITEM(head_dim); /* the same code with the size a variable */
    else
        attend_item_generic(o, q, key_cache, value_cache, table, seq_len, group, head_dim,
                            block_stride, block_size, kv_offset, scale, scores, kv);
#undef ATTEND_ITEM
}

/* Each cache mode's items in a function of their own, not inlined into decode_item_then:
 * with every mode's code in that one function, the fused decode layer's library (which
 * includes this file) took ~3 % longer over a decode step of 64 rows than the same source
 * without the 8-bit float modes, the bf16 path's own code unchanged; in functions of their
 * own, as long (docs/PERFORMANCE_CPU.md, "One function per cache mode"). */
#define ATTEND_MODE(name, kv)                                                                 \
    static __attribute__((noinline)) void name(ITEM_PARAMS) { attend_dims(ITEM_ARGS, kv); }
ATTEND_MODE(attend_f32, KV_F32)
ATTEND_MODE(attend_bf16, KV_BF16)
ATTEND_MODE(attend_fp8_e4m3, KV_FP8_E4M3)
ATTEND_MODE(attend_fp8_e5m2, KV_FP8_E5M2)
#if PAGED_DP
ATTEND_MODE(attend_bf16_dp, KV_BF16_DP)
#endif
#undef ATTEND_MODE

/* Work item (row, kv_head) of a decode step: the group of query heads sharing kv_head, for
 * decode row `row` (its query at q, its output at o), over the row's seq_len positions;
 * `scores` holds group * seq_len floats. kv_mode is the cache's mode: KV_F32, KV_BF16,
 * KV_BF16_DP (bf16 numerics: the dot-product path where the build and shapes allow it,
 * else as KV_BF16), KV_FP8_E4M3 or KV_FP8_E5M2. own, next and lead: what it prefetches
 * (attend_item). With lse (the row's num_heads floats), each head's log-sum-exp goes there
 * too; not on the generic path (head_dim not a multiple of the vector chunk, or above 256:
 * lse is left alone). */
static void decode_item_then(float *o, const float *q, const void *key_cache,
                             const void *value_cache, const int64_t *table, int64_t seq_len,
                             int64_t kv_head, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, float scale, float *scores,
                             int64_t kv_mode, int own, const NextItem *next,
                             const NextItem *lead, float *lse) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t block_stride = num_kv_heads * block_size * head_dim;
    const int64_t kv_offset = kv_head * block_size * head_dim;
    o += kv_head * group * head_dim;
    q += kv_head * group * head_dim;
    if (lse != NULL) lse += kv_head * group;
#if PAGED_DP
    if (kv_mode == KV_BF16_DP && ts_paged_decode_dot_products(head_dim, block_size)) {
        attend_bf16_dp(ITEM_ARGS);
        return;
    }
#endif
    switch (kv_mode) {
    case KV_F32: attend_f32(ITEM_ARGS); break;
    case KV_FP8_E4M3: attend_fp8_e4m3(ITEM_ARGS); break;
    case KV_FP8_E5M2: attend_fp8_e5m2(ITEM_ARGS); break;
    default: attend_bf16(ITEM_ARGS); /* KV_BF16, and KV_BF16_DP off the dot-product path */
    }
}
#undef ITEM_PARAMS
#undef ITEM_ARGS

/* One item on its own: its keys and values fetched as it goes. */
static inline void decode_item(float *o, const float *q, const void *key_cache,
                        const void *value_cache, const int64_t *table, int64_t seq_len,
                        int64_t kv_head, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, float *scores,
                        int64_t kv_mode) {
    decode_item_then(o, q, key_cache, value_cache, table, seq_len, kv_head, num_heads,
                     num_kv_heads, head_dim, block_size, scale, scores, kv_mode, OWN_FAR, NULL,
                     NULL, NULL);
}

/* How the threads of a decode step keep memory busy while they compute (decode_items; the
 * choice is per CPU, kernels/paged_attention.py): a block table is a pointer chase the
 * hardware prefetcher cannot follow, and an item that only reads waits on memory in its
 * first pass and leaves memory idle in the rest.
 *   STREAM_NEXT_ITEM  each thread claims its next item one ahead and streams that item's
 *                     keys into L2 during the current one's first pass, its values during
 *                     the second (on AVX2 builds its keys then values a few lines at a time
 *                     through both passes, NextStream); only a thread's first item
 *                     prefetches its own tokens (OWN_FAR). On an AMD EPYC (Zen 4) 1.45-1.6x
 *                     faster than each item prefetching its own tokens into L2 (OWN_FAR for
 *                     every item).
 *   OWN_TOKENS_AHEAD  each item prefetches its own tokens a short way ahead (OWN_NEAR), and
 *                     the next item's first LEAD tokens before its second pass. On an Intel
 *                     Xeon with AMX the kernel alone is 1.08-1.17x faster than streaming
 *                     the next item (the engine's decode step 0-2 %): there, it seems, the
 *                     next item's prefetches, each holding one of a core's few L1 miss
 *                     buffers for a whole trip to memory, hold up the current item's loads
 *                     from L2. Not measured on the EPYC.
 * docs/PERFORMANCE_CPU.md has the figures. Prefetches change no arithmetic: both give the
 * same bits. */
#define STREAM_NEXT_ITEM 0
#define OWN_TOKENS_AHEAD 1

/* The first halves of a decode step's items when each row's context is split in two
 * (decode_items): positions [0, at) of every row (at a multiple of the block size, below
 * every row's context), row r's output to out + r * out_stride and its heads' log-sum-exps
 * to lse + r * num_heads. The second halves, [at, context), go where the items' outputs
 * go, their log-sum-exps as with skip = at; merge_attention joins the two. Few items on
 * many threads: one row's three kv heads on two threads leave one thread idle for a third
 * of the attention, six halves do not. */
typedef struct {
    int64_t at;
    float *out;
    int64_t out_stride;
    float *lse;
} DecodeSplit;

/* Where item `item` of decode_items attends: its row, kv head and positions [from, from +
 * len); first_half for an item of a split's first halves. */
typedef struct {
    int64_t row, head, from, len;
    int first_half;
} ItemSpan;

static inline ItemSpan item_span(int64_t item, int64_t num_rows, int64_t num_kv_heads,
                                 const int64_t *seq_lens, int64_t skip, int64_t skip_rows,
                                 const DecodeSplit *split) {
    ItemSpan span = {0};
    const int64_t per_half = num_rows * num_kv_heads;
    span.first_half = split != NULL && item < per_half;
    if (split != NULL && !span.first_half) item -= per_half;
    span.row = item / num_kv_heads;
    span.head = item % num_kv_heads;
    if (span.first_half) {
        span.len = split->at;
        return span;
    }
    span.from = split != NULL ? split->at : span.row < skip_rows ? skip : 0;
    span.len = seq_lens[span.row] - span.from;
    return span;
}

/* A decode step's work items, (row, kv head) for each of num_rows rows, called by every
 * thread of a parallel region, *claimed 0 before it: the items as a dynamic schedule hands
 * them out, but each thread claims its next one ahead, to prefetch from it as `prefetch`
 * (STREAM_NEXT_ITEM or OWN_TOKENS_AHEAD) says. Row r reads its query at query + i *
 * query_stride and writes out + i * out_stride, i = rows[r] (r where rows is NULL). No
 * barrier at the end. With scores NULL (the thread's allocation failed) items are claimed,
 * not done. With skip > 0 (a multiple of block_size, below the contexts of rows 0 ..
 * skip_rows - 1) each of those rows attends to its context past the first `skip` positions
 * only, and writes its heads' log-sum-exps to lse + r * num_heads: the rest of the context
 * after a shared prefix (prompt_attention.c, "Decode rows over a shared prefix"). With
 * `split` (skip then 0) every item is two, its context's halves (DecodeSplit), the second
 * halves' log-sum-exps to lse as with skip. */
static void decode_items(int64_t *claimed, float *out, int64_t out_stride, const float *query,
                         int64_t query_stride, const int64_t *rows, const void *key_cache,
                         const void *value_cache, const int64_t *block_tables,
                         int64_t block_table_stride, const int64_t *seq_lens, int64_t num_rows,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, float *scores, int64_t kv_mode,
                         int64_t prefetch, int64_t skip, int64_t skip_rows, float *lse,
                         const DecodeSplit *split) {
    const int64_t num_items = num_rows * num_kv_heads * (split != NULL ? 2 : 1);
    const int stream = prefetch == STREAM_NEXT_ITEM;
    int64_t item, next;
#pragma omp atomic capture
    item = (*claimed)++;
#pragma omp atomic capture
    next = (*claimed)++;
    for (int first = 1; item < num_items; first = 0) {
        const ItemSpan span = item_span(item, num_rows, num_kv_heads, seq_lens, skip,
                                        skip_rows, split);
        NextItem ahead = {0};
        if (next < num_items) {
            const ItemSpan then = item_span(next, num_rows, num_kv_heads, seq_lens, skip,
                                            skip_rows, split);
            ahead = (NextItem){block_tables + then.row * block_table_stride +
                                   then.from / block_size,
                               then.len, then.head * block_size * head_dim};
        }
        const NextItem *then = next < num_items ? &ahead : NULL;
        const int own = !stream ? OWN_NEAR : first ? OWN_FAR : OWN_NONE;
        const int64_t at = rows ? rows[span.row] : span.row;
        float *o = span.first_half ? split->out + span.row * split->out_stride
                                   : out + at * out_stride;
        float *item_lse = span.first_half ? split->lse + span.row * num_heads
                          : span.from > 0  ? lse + span.row * num_heads
                                           : NULL;
        if (scores != NULL)
            decode_item_then(o, query + at * query_stride, key_cache, value_cache,
                             block_tables + span.row * block_table_stride +
                                 span.from / block_size,
                             span.len, span.head, num_heads, num_kv_heads, head_dim,
                             block_size, scale, scores, kv_mode, own, stream ? then : NULL,
                             stream ? NULL : then, item_lse);
        item = next;
        if (item < num_items) {
#pragma omp atomic capture
            next = (*claimed)++;
        }
    }
}

/* Row r's two halves into its output: o (the rest of its context's, normalized, at out +
 * rows[r] * out_stride, replaced) and p (the first positions', a shared prefix's or a
 * split's first half, at prefix_out + r * prefix_stride), weighed by their heads'
 * log-sum-exps (suffix_lse, prefix_lse: num_heads per row); rows NULL: row r's own. Shared
 * out over the threads of the enclosing region (an orphaned `omp for`, ending in a
 * barrier). */
static void merge_attention(float *out, int64_t out_stride, const int64_t *rows,
                            const float *prefix_out, int64_t prefix_stride,
                            const float *prefix_lse, const float *suffix_lse, int64_t num_rows,
                            int64_t num_heads, int64_t head_dim) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < num_rows; ++r) {
        float *o = out + (rows ? rows[r] : r) * out_stride;
        const float *p = prefix_out + r * prefix_stride;
        for (int64_t n = 0; n < num_heads; ++n) {
            const float a = prefix_lse[r * num_heads + n], b = suffix_lse[r * num_heads + n];
            const float top = a > b ? a : b;
            const float wa = expf(a - top), wb = expf(b - top), inv = 1.0f / (wa + wb);
            const float ka = wa * inv, kb = wb * inv;
            for (int64_t d = n * head_dim; d < (n + 1) * head_dim; ++d)
                o[d] = ka * p[d] + kb * o[d];
        }
    }
}

/* Whether an item over a cache of this mode keeps its heads' log-sum-exps: attend_item does
 * (head sizes it takes, attend_dims), the plain loop does not. KV_BF16_DP as the float32
 * code's bf16 would take it, which the dot-product path's head sizes also fit. */
static int decode_item_keeps_lse(int64_t kv_mode, int64_t head_dim) {
    const int kv = kv_mode == KV_BF16_DP ? KV_BF16 : (int)kv_mode;
    return head_dim == 64 || head_dim == 128 || (head_dim % CHUNK(kv) == 0 && head_dim <= 256);
}

/* Where decode_items splits the rows' contexts in two (DecodeSplit), or 0: only for items
 * too few to share out evenly over the threads (fewer than eight a thread, not a multiple of
 * their number) that keep their log-sum-exps, at half the shortest context in whole
 * blocks. */
static int64_t decode_split_at(int64_t num_rows, int64_t num_kv_heads, const int64_t *seq_lens,
                               int64_t block_size, int64_t threads, int64_t kv_mode,
                               int64_t head_dim) {
    const int64_t items = num_rows * num_kv_heads;
    if (threads < 2 || items == 0 || items % threads == 0 || items >= 8 * threads ||
        !decode_item_keeps_lse(kv_mode, head_dim))
        return 0;
    int64_t shortest = seq_lens[0];
    for (int64_t r = 1; r < num_rows; ++r)
        shortest = seq_lens[r] < shortest ? seq_lens[r] : shortest;
    return shortest / 2 / block_size * block_size;
}

/* *split at `at` (0: none) for num_rows rows, its buffers in one allocation starting at
 * split->out (free() that): the first halves' outputs (width floats a row) and both halves'
 * log-sum-exps, the second halves' at *second_lse (left alone without a split). Returns 0,
 * or -1 if the buffers could not be allocated. */
static int decode_split_init(DecodeSplit *split, int64_t at, int64_t num_rows,
                             int64_t num_heads, int64_t width, float **second_lse) {
    *split = (DecodeSplit){at, NULL, width, NULL};
    if (at == 0) return 0;
    float *buffer = (float *)malloc(sizeof(float) * (size_t)(num_rows * (width + 2 * num_heads)));
    if (buffer == NULL) return -1;
    split->out = buffer;
    split->lse = buffer + num_rows * width;
    *second_lse = split->lse + num_rows * num_heads;
    return 0;
}

/* Returns 0, or -1 if a scratch buffer could not be allocated. Decode row r reads its
 * query at query + rows[r] * query_stride and writes out + rows[r] * out_stride (rows index
 * the step's flat token dimension; query may be a view into a fused QKV tensor). kv_mode:
 * the caches' mode (decode_item_then); prefetch: STREAM_NEXT_ITEM or OWN_TOKENS_AHEAD.
 * split_decode 1: where decode_split_at says, each row's context in two halves merged by
 * their log-sum-exps (the threads kept busy; a row's sums then depend on the other rows of
 * the step); 0: whole contexts. */
int ts_paged_decode(float *out, int64_t out_stride, const float *query, int64_t query_stride,
                    const int64_t *rows, const void *key_cache, const void *value_cache,
                    const int64_t *block_tables, int64_t block_table_stride,
                    const int64_t *seq_lens, int64_t num_rows, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                    int64_t kv_mode, int64_t prefetch, int64_t split_decode) {
    const int64_t group = num_heads / num_kv_heads, width = num_heads * head_dim;
    int64_t max_seq_len = 0;
    for (int64_t r = 0; r < num_rows; ++r)
        max_seq_len = seq_lens[r] > max_seq_len ? seq_lens[r] : max_seq_len;
    DecodeSplit split;
    float *suffix_lse = NULL;
    if (decode_split_init(&split,
                          split_decode ? decode_split_at(num_rows, num_kv_heads, seq_lens,
                                                         block_size, omp_get_max_threads(),
                                                         kv_mode, head_dim)
                                       : 0,
                          num_rows, num_heads, width, &suffix_lse))
        return -1;
    int failed = 0;
    int64_t claimed = 0; /* items handed out: each thread claims its next one ahead */
#pragma omp parallel
    {
        /* Each thread's scores, for the longest context: allocated once, not per item. */
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * max_seq_len));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        decode_items(&claimed, out, out_stride, query, query_stride, rows, key_cache,
                     value_cache, block_tables, block_table_stride, seq_lens, num_rows,
                     num_heads, num_kv_heads, head_dim, block_size, scale, scores, kv_mode,
                     prefetch, 0, 0, suffix_lse, split.at > 0 ? &split : NULL);
        if (split.at > 0) {
#pragma omp barrier
            merge_attention(out, out_stride, rows, split.out, width, split.lse, suffix_lse,
                            num_rows, num_heads, head_dim);
        }
        free(scores);
    }
    free(split.out);
    return failed ? -1 : 0;
}

/* One token's keys and values (num_kv_heads * head_dim contiguous float32 values at key and
 * value) into cache slot `slot`, i.e. offset slot % block_size of block slot / block_size,
 * one head_dim run per kv head; rounded to the cache's elements as kv_mode says (bfloat16:
 * bf16_round; 8-bit floats: fp8_narrow). */
static inline void write_kv_token(void *key_cache, void *value_cache, const float *key,
                                  const float *value, int64_t slot, int64_t num_kv_heads,
                                  int64_t block_size, int64_t head_dim, int64_t kv_mode) {
    const int64_t head_stride = block_size * head_dim;
    const int64_t base =
        slot / block_size * num_kv_heads * head_stride + slot % block_size * head_dim;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
        const float *k = key + h * head_dim;
        const float *v = value + h * head_dim;
        const int64_t at = base + h * head_stride;
        if (KV_FP8(kv_mode)) {
            fp8_narrow_run((uint8_t *)key_cache + at, k, head_dim, kv_mode == KV_FP8_E5M2);
            fp8_narrow_run((uint8_t *)value_cache + at, v, head_dim, kv_mode == KV_FP8_E5M2);
        } else if (kv_mode) {
            for (int64_t d = 0; d < head_dim; ++d) {
                ((uint16_t *)key_cache)[at + d] = bf16_round(k[d]);
                ((uint16_t *)value_cache)[at + d] = bf16_round(v[d]);
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
                 int64_t num_kv_heads, int64_t block_size, int64_t head_dim, int64_t kv_mode) {
#pragma omp parallel for schedule(static) if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; ++t)
        write_kv_token(key_cache, value_cache, key + t * src_stride, value + t * src_stride,
                       slots[t], num_kv_heads, block_size, head_dim, kv_mode);
}
