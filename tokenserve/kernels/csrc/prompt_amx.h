/*
 * The AMX level of prompt_attention.c: the same item (rows of one chunk, the query heads of
 * one kv head) with both products on AMX tiles (tdpbf16ps: 16 x 16 float32 sums of bf16
 * pairs) and the same numerics as the vdpbf16ps path and PyTorch's bf16 flash kernel:
 * queries and probabilities rounded to bf16, scores, softmax and output in float32.
 *
 * Per key tile of AKT = 64 keys and block of 16 queries, back to back while S and P are in
 * L1: scores S = Q Kᵀ: A = the queries row-major [16 rows x 32 dims] (bf16), B = the
 * tile's keys laid out as pairs of dims ([dims / 2][AKT keys]: the VNNI layout), C = S
 * [16 queries x 16 keys], four of them; the softmax along each query's row of S
 * (softmax_row: a lazily moving maximum, lane-wise sums, 2^t exponentials); output
 * O += P V: A = P [16 queries x 32 keys] row-major (bf16), two of them, B = values as
 * pairs of keys ([AKT / 2][head_dim]: pack_values), C = O [16 queries x 16 dims], loaded
 * and stored once per key tile, rescaled in memory when a row's maximum moves. All eight
 * tiles are configured 16 rows x 64 bytes; the configuration is loaded per item (oneDNN,
 * on the same threads, loads its own). An item is up to AMX_MAX_QUERIES queries: each key
 * tile is laid out once and used by all of its row blocks; the per-query state (bf16
 * queries, O, sums, maxima) lives in a per-thread scratch kept across calls. The queries
 * are rounded with vcvtneps2bf16 (nearest even; it reads a float32 denormal as 0, far
 * below any score's precision), their rows prefetched ROWS_AHEAD rows early (a
 * new page each: the hardware prefetch restarts there), and the output likewise.
 * Needs head_dim % 32 == 0 (whole A tiles); other sizes take the vdpbf16ps path.
 */
#ifndef TOKENSERVE_PROMPT_AMX_H
#define TOKENSERVE_PROMPT_AMX_H

#include "amx.h"

#define AKT 64          /* keys per AMX key tile: four S tiles, two P tiles */
#define ROWS_AHEAD 16         /* query and output rows prefetched ahead */

/* kp[d][j] = pair d of key j (rows[j]: bf16, or 8-bit floats as kv says, kv_row_bf16), for
 * AKT keys and `pairs` (a multiple of 16) pairs: 16 x 16 transposes in registers (avx512.h). */
static inline void pack_keys(uint32_t *kp, const void *const *rows, int64_t pairs, int kv) {
    for (int j0 = 0; j0 < AKT; j0 += 16)
        for (int64_t d0 = 0; d0 < pairs; d0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i)
                r[i] = kv_row_bf16(rows[j0 + i], 2 * d0, kv);
            transpose16(r);
            for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kp + (d0 + i) * AKT + j0, r[i]);
        }
}

#define AMX_MAX_QUERIES 768 /* queries per item: a 256-row chunk of 3 heads per kv head */

/* One thread's scratch, kept for the thread's life and grown as a call needs: the key
 * tile's packed keys and values, one row block's scores and probabilities, and per query
 * (`queries` of them, head_dim each) the bf16 queries, the output sums, softmax state. */
typedef struct {
    uint32_t kp[MAX_DIM / 2 * AKT]; /* [head_dim / 2][AKT] key pairs */
    uint32_t vp[AKT / 2 * MAX_DIM]; /* [AKT / 2][head_dim] value pairs */
    float s[16 * AKT];              /* one row block's [16][AKT] scores */
    uint16_t p[16 * AKT];           /* its [16][AKT] bf16 probabilities */
    const void *rows[AKT];
    int64_t capacity, queries;      /* queries · head_dim, and queries, they hold */
    uint16_t *q;                    /* [queries][head_dim] bf16 */
    float *o;                       /* [queries][head_dim] */
    __m512 *sum;                    /* per query, lane-wise partial sums */
    float *max;                     /* the running maximum (scaled scores) */
    float *bar;                     /* the unscaled score that moves it (softmax_row) */
    float *max_l2;                  /* max · log2 e */
    int32_t *limit;
} AmxScratch;

/* This thread's scratch for items of up to `queries` queries of head_dim; NULL if memory
 * ran out. Kept, not freed: a fresh allocation each call would fault its pages in again. */
static AmxScratch *amx_scratch(int64_t queries, int64_t head_dim) {
    static _Thread_local AmxScratch *kept = NULL;
    const int64_t need = queries * head_dim;
    /* Both bounds: a later call may have fewer dims but more queries. */
    if (kept != NULL && kept->capacity >= need && kept->queries >= queries) return kept;
    free(kept);
    const size_t header = (sizeof(AmxScratch) + 63) / 64 * 64;
    const size_t q = ((size_t)need * 2 + 63) / 64 * 64, o = (size_t)need * 4;
    const size_t per_query = 64 + 4 * 4; /* sum, max, bar, max_l2, limit */
    char *base = aligned_alloc(64, header + q + o + (size_t)queries * per_query + 64);
    kept = (AmxScratch *)base;
    if (base == NULL) return NULL;
    kept->capacity = need;
    kept->queries = queries;
    kept->q = (uint16_t *)(base + header);
    kept->o = (float *)(base + header + q);
    kept->sum = (__m512 *)(base + header + q + o);
    kept->max = (float *)(kept->sum + queries);
    kept->bar = kept->max + queries;
    kept->max_l2 = kept->bar + queries;
    kept->limit = (int32_t *)(kept->max_l2 + queries);
    return kept;
}

/* The online softmax of one query row's AKT scores (s, unscaled) into bf16 probabilities
 * (p). The running maximum moves lazily: only when a score passes it by more than
 * LAZY_MAX, the one horizontal maximum per row and key tile (and the rescale of the row's
 * output and sum) is skipped otherwise. Exact all the same: every probability and the sum
 * are relative to the same stale maximum, so the final division cancels it, and they stay
 * below e^LAZY_MAX (bf16 and float32 keep their relative precision). The test is on the
 * unscaled scores, against the row's bar ((max + LAZY_MAX) / scale, kept with max and
 * max · log2 e): per row and key tile, one comparison and no scalar arithmetic. `masked`
 * is a constant at each call: without masks the compiler drops them and their branches. */
static inline __attribute__((always_inline)) void softmax_row(
    AmxScratch *w, int64_t m, const float *s, uint16_t *p, float scale, __m512 scales_l2,
    int masked, __m512i pos0, int64_t head_dim) {
    __m512 x[AKT / 16];
    __mmask16 keep[AKT / 16];
    const __m512i limit = _mm512_set1_epi32(w->limit[m]);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < AKT / 16; ++t) {
        x[t] = _mm512_loadu_ps(s + 16 * t); /* unscaled: scale > 0 keeps the order */
        keep[t] = masked ? _mm512_cmple_epi32_mask(
                               _mm512_add_epi32(pos0, _mm512_set1_epi32(16 * t)), limit)
                         : (__mmask16)0xffff;
        top = masked ? _mm512_mask_max_ps(top, keep[t], top, x[t])
                     : (t == 0 ? x[t] : _mm512_max_ps(top, x[t]));
    }
    /* -inf stays -inf: the first tile always sets the maximum (key 0 is everyone's). */
    if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(w->bar[m]), _CMP_GT_OQ)) {
        const float old = w->max[m];
        const float now = _mm512_reduce_max_ps(top) * scale;
        w->max[m] = now;
        w->bar[m] = (now + LAZY_MAX) / scale;
        w->max_l2[m] = now * 1.44269504088896341f;
        /* On the first key tile the sum is 0 and the output not yet written (the product
         * with the values starts it from zero tiles). */
        if (old != -INFINITY) {
            const __m512 alpha = _mm512_set1_ps(expf(old - now));
            w->sum[m] = _mm512_mul_ps(w->sum[m], alpha);
            float *o = w->o + m * head_dim;
            for (int64_t d = 0; d < head_dim; d += 16)
                _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), alpha));
        }
    }
    /* The rounding of max · log2 e is common to the row: the final division cancels it. */
    const __m512 now_v = _mm512_set1_ps(w->max_l2[m]);
    __m512 sum = w->sum[m];
    for (int t = 0; t < AKT / 16; t += 2) {
        /* 16 keys all past the row (on the diagonal tile): no exponentials. */
        const __m512 p0 = keep[t] ? exp_shifted(keep[t], x[t], scales_l2, now_v)
                                  : _mm512_setzero_ps();
        const __m512 p1 = keep[t + 1] ? exp_shifted(keep[t + 1], x[t + 1], scales_l2, now_v)
                                      : _mm512_setzero_ps();
        _mm512_storeu_si512(p + 16 * t, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    }
    w->sum[m] = sum;
}

/* The item's rows of queries and output, and what each sees, for amx_attend: query row i
 * (0..count-1) at query + (rows ? rows[i] : i) * query_stride, its output at out + i *
 * out_stride (both at kv head h's heads), attending to context positions 0..limit0 + i *
 * limit_step; with lse, its heads' log-sum-exps at lse + i * num_heads (the heads of h). */
typedef struct {
    float *out;
    int64_t out_stride;
    const float *query;
    int64_t query_stride;
    const int64_t *rows;
    int64_t count, limit0, limit_step;
    float *lse;
} AmxRows;

/* Query row i of an item's rows (AmxRows), at kv head h's heads (span floats). */
static inline const float *amx_query_row(const AmxRows *r, int64_t i, int64_t h, int64_t span) {
    return r->query + (r->rows ? r->rows[i] : i) * r->query_stride + h * span;
}

/* Queries per AmxRows run in the scratch: its count · group, padded to whole 16-row blocks. */
static inline int64_t amx_padded(const AmxRows *rows, int64_t group) {
    return (rows->count * group + 15) / 16 * 16;
}

/* A run's queries of kv head h, rounded to bf16, into the scratch from query `base` on
 * (base a multiple of 16), and their softmax state: limits, maxima, sums. */
static inline void amx_load_rows(const AmxRows *rows, int64_t base, int64_t h, int64_t group,
                                 int64_t head_dim, AmxScratch *w) {
    const int64_t count = rows->count, queries = count * group;
    const int64_t padded = amx_padded(rows, group);
    /* A row's queries of this kv head are contiguous (group · head_dim floats); rows are
     * strided, a new page each, where the hardware's prefetch restarts: fetched ROWS_AHEAD
     * rows early. */
    const int64_t span = group * head_dim;
    uint16_t *q0 = w->q + base * head_dim;
    for (int64_t i = 0; i < ROWS_AHEAD && i < count; ++i)
        prefetch_span(amx_query_row(rows, i, h, span), span, 0);
    for (int64_t i = 0; i < count; ++i) {
        if (i + ROWS_AHEAD < count)
            prefetch_span(amx_query_row(rows, i + ROWS_AHEAD, h, span), span, 0);
        const float *q = amx_query_row(rows, i, h, span);
        for (int64_t e = 0; e < span; e += 16)
            _mm256_storeu_si256((__m256i *)(q0 + i * span + e),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(q + e)));
    }
    memset(q0 + queries * head_dim, 0, sizeof(uint16_t) * (size_t)((padded - queries) * head_dim));
    for (int64_t m = base, row = 0, g = 0; m < base + padded; ++m) {
        w->limit[m] = (int32_t)(rows->limit0 + rows->limit_step *
                                                   (m - base < queries ? row : count - 1));
        w->max[m] = w->bar[m] = w->max_l2[m] = -INFINITY;
        w->sum[m] = _mm512_setzero_ps();
        if (++g == group) {
            g = 0;
            ++row;
        }
    }
}

/* Tiles 0-3: S (16 queries x 16 keys each); 4: Q (16 queries x 32 dims) or P (16 queries x
 * 32 keys); 5: K (16 dim pairs x 16 keys) or P; 6: V (16 key pairs x 16 dims); 7: O (16
 * queries x 16 dims). */
static inline void amx_attend_config(void) {
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    amx_load_config(&config);
}

/* What a key tile's pass needs besides the scratch: kv head h's cache, its strides and
 * what it holds (KV_BF16, KV_FP8_E4M3, KV_FP8_E5M2). */
typedef struct {
    const void *key_cache, *value_cache;
    int64_t block_stride, block_size, kv_offset, head_dim;
    float scale;
    int kv;
} AmxKeys;

/* Key tile k0 (AKT keys of `table`, positions past `end` read as zeros) laid out, then the
 * scratch's queries first .. last - 1 (whole 16-row blocks) through it: scores, softmax,
 * output; `masked`: whether any of their rows ends within the tile. */
static inline __attribute__((always_inline)) void amx_key_tile(
    const AmxKeys *keys, const int64_t *table, int64_t k0, int64_t end, int64_t first,
    int64_t last, int masked, AmxScratch *w) {
    const int64_t head_dim = keys->head_dim;
    const __m512 scales_l2 = _mm512_set1_ps(keys->scale * 1.44269504088896341f);
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* The tile's keys as pairs of dims, [pairs][AKT]; values as pairs of keys. */
    const int64_t element = KV_ELEMENT(keys->kv);
    tile_rows(w->rows, AKT, keys->key_cache, table, k0, end, keys->block_stride,
              keys->block_size, keys->kv_offset, head_dim, element);
    pack_keys(w->kp, w->rows, head_dim / 2, keys->kv);
    tile_rows(w->rows, AKT, keys->value_cache, table, k0, end, keys->block_stride,
              keys->block_size, keys->kv_offset, head_dim, element);
    pack_values(w->vp, w->rows, head_dim, AKT, keys->kv);
    const __m512i pos0 = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)k0));
    /* Per block of 16 queries: scores, softmax, output, while they are in L1. */
    for (int64_t r = first; r < last; r += 16) {
        if (w->limit[r + 15] < k0) continue; /* every key past the block's rows */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t d = 0; d < head_dim; d += 32) {
            _tile_loadd(4, w->q + r * head_dim + d, head_dim * 2);
            _tile_loadd(5, w->kp + d / 2 * AKT, AKT * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(5, w->kp + d / 2 * AKT + 16, AKT * 4);
            _tile_dpbf16ps(1, 4, 5);
            _tile_loadd(5, w->kp + d / 2 * AKT + 32, AKT * 4);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(5, w->kp + d / 2 * AKT + 48, AKT * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, w->s, AKT * 4);
        _tile_stored(1, w->s + 16, AKT * 4);
        _tile_stored(2, w->s + 32, AKT * 4);
        _tile_stored(3, w->s + 48, AKT * 4);
        /* Two copies of the row loop: where no key of the tile is masked the compiler
         * drops the masks and their branches. */
        if (masked)
            for (int i = 0; i < 16; ++i)
                softmax_row(w, r + i, w->s + i * AKT, w->p + i * AKT, keys->scale, scales_l2,
                            1, pos0, head_dim);
        else
            for (int i = 0; i < 16; ++i)
                softmax_row(w, r + i, w->s + i * AKT, w->p + i * AKT, keys->scale, scales_l2,
                            0, pos0, head_dim);
        _tile_loadd(4, w->p, AKT * 2);
        _tile_loadd(5, w->p + 32, AKT * 2);
        for (int64_t d = 0; d < head_dim; d += 16) {
            if (k0 == 0) _tile_zero(7); /* every row's first key tile */
            else _tile_loadd(7, w->o + r * head_dim + d, head_dim * 4);
            _tile_loadd(6, w->vp + d, head_dim * 4);
            _tile_dpbf16ps(7, 4, 6);
            _tile_loadd(6, w->vp + 16 * head_dim + d, head_dim * 4);
            _tile_dpbf16ps(7, 5, 6);
            _tile_stored(7, w->o + r * head_dim + d, head_dim * 4);
        }
    }
}

/* The run's outputs (and log-sum-exps) from the scratch's queries from `base` on. */
static inline void amx_write_rows(const AmxRows *rows, int64_t base, int64_t h,
                                  int64_t num_heads, int64_t group, int64_t head_dim,
                                  const AmxScratch *w) {
    const int64_t count = rows->count, span = group * head_dim;
    float *out0 = rows->out + h * span;
    const int64_t out_stride = rows->out_stride;
    for (int64_t i = 0; i < ROWS_AHEAD && i < count; ++i) prefetch_span(out0 + i * out_stride, span, 1);
    for (int64_t i = 0; i < count; ++i) {
        if (i + ROWS_AHEAD < count) prefetch_span(out0 + (i + ROWS_AHEAD) * out_stride, span, 1);
        for (int64_t g = 0; g < group; ++g) {
            const int64_t m = base + i * group + g;
            const float sum = _mm512_reduce_add_ps(w->sum[m]);
            const __m512 inv = _mm512_set1_ps(1.0f / sum);
            float *row = out0 + i * out_stride + g * head_dim;
            for (int64_t d = 0; d < head_dim; d += 16)
                _mm512_storeu_ps(row + d, _mm512_mul_ps(_mm512_loadu_ps(w->o + m * head_dim + d), inv));
            /* The probabilities are e^(s - max), s the scaled scores. */
            if (rows->lse != NULL)
                rows->lse[i * num_heads + h * group + g] = w->max[m] + logf(sum);
        }
    }
}

/* kv head h's cache as amx_key_tile reads it. */
static inline AmxKeys amx_keys(const void *key_cache, const void *value_cache, int64_t h,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               float scale, int kv) {
    return (AmxKeys){key_cache, value_cache, num_kv_heads * block_size * head_dim, block_size,
                     h * block_size * head_dim, head_dim, scale, kv};
}

/* The attention of an item's rows (AmxRows) to kv head h's keys and values (see the top of
 * this file). */
static inline __attribute__((always_inline)) void amx_attend(
    const AmxRows *rows, const void *key_cache, const void *value_cache,
    const int64_t *table, int64_t h, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int kv, AmxScratch *w) {
    const int64_t group = num_heads / num_kv_heads;
    const AmxKeys keys = amx_keys(key_cache, value_cache, h, num_kv_heads, head_dim, block_size,
                                  scale, kv);
    amx_load_rows(rows, 0, h, group, head_dim, w);
    amx_attend_config();
    /* Positions past the last row's limit are never read (tile_rows: rows of zeros). */
    const int64_t last = rows->limit0 + rows->limit_step * (rows->count - 1);
    for (int64_t k0 = 0; k0 <= last; k0 += AKT)
        amx_key_tile(&keys, table, k0, last + 1, 0, amx_padded(rows, group),
                     k0 + AKT - 1 > rows->limit0, w);
    _tile_release();
    amx_write_rows(rows, 0, h, num_heads, group, head_dim, w);
}

/* The attention of several runs (runs[s], each over its own block table tables[s]) whose
 * contexts start with the same `shared` positions (the same blocks, within every run's
 * first limit): the key tiles wholly within them are laid out once for all the runs'
 * queries, each later tile once per run for its own queries. Each row sees the same key
 * tiles in the same order as amx_attend would show it alone, so the results are its bit for
 * bit. */
static inline __attribute__((always_inline)) void amx_attend_runs(
    const AmxRows *runs, const int64_t *const *tables, int64_t num_runs, int64_t shared,
    const void *key_cache, const void *value_cache, int64_t h, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int kv,
    AmxScratch *w) {
    const int64_t group = num_heads / num_kv_heads;
    const AmxKeys keys = amx_keys(key_cache, value_cache, h, num_kv_heads, head_dim, block_size,
                                  scale, kv);
    int64_t total = 0;
    for (int64_t s = 0; s < num_runs; ++s) {
        amx_load_rows(runs + s, total, h, group, head_dim, w);
        total += amx_padded(runs + s, group);
    }
    amx_attend_config();
    const int64_t common = shared / AKT * AKT; /* tiles with no key past `shared` */
    for (int64_t k0 = 0; k0 < common; k0 += AKT)
        amx_key_tile(&keys, tables[0], k0, common, 0, total, 0, w);
    for (int64_t s = 0, base = 0; s < num_runs; ++s) {
        const AmxRows *run = runs + s;
        const int64_t last = run->limit0 + run->limit_step * (run->count - 1);
        const int64_t end = base + amx_padded(run, group);
        for (int64_t k0 = common; k0 <= last; k0 += AKT)
            amx_key_tile(&keys, tables[s], k0, last + 1, base, end, k0 + AKT - 1 > run->limit0,
                         w);
        base = end;
    }
    _tile_release();
    for (int64_t s = 0, base = 0; s < num_runs; ++s) {
        amx_write_rows(runs + s, base, h, num_heads, group, head_dim, w);
        base += amx_padded(runs + s, group);
    }
}

/* Rows first_row .. first_row + count - 1 of a chunk (rows start.. of the step, the last
 * q_len of seq_len positions, causal) as an item's run. */
static inline AmxRows amx_chunk_rows(float *out, int64_t out_stride, const float *query,
                                     int64_t query_stride, int64_t start, int64_t q_len,
                                     int64_t seq_len, int64_t first_row, int64_t count) {
    return (AmxRows){out + (start + first_row) * out_stride, out_stride,
                     query + (start + first_row) * query_stride, query_stride, NULL, count,
                     seq_len - q_len + first_row, 1, NULL};
}

/* Those rows (amx_chunk_rows), kv head h. */
static void prompt_item_amx(float *out, int64_t out_stride, const float *query,
                            int64_t query_stride, const void *key_cache,
                            const void *value_cache, const int64_t *table, int64_t start,
                            int64_t q_len, int64_t seq_len, int64_t first_row, int64_t count,
                            int64_t h, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, int kv,
                            AmxScratch *w) {
    const AmxRows rows = amx_chunk_rows(out, out_stride, query, query_stride, start, q_len,
                                        seq_len, first_row, count);
    amx_attend(&rows, key_cache, value_cache, table, h, num_heads, num_kv_heads, head_dim,
               block_size, scale, kv, w);
}

#endif
