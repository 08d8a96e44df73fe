/*
 * Prompt-chunk attention over a paged KV cache: every prompt chunk of a step in one call.
 *
 * A chunk is rows start..end of the step's queries, the last q_len = end - start positions
 * of a context of seq_len tokens that is already in the cache (the step's keys and values
 * are written first, ts_write_kv); row r of the chunk attends to context positions
 * 0 .. seq_len - q_len + r (causal, aligned bottom-right: a chunk that continues a context
 * sees all of it). Work items are (chunk, tile of query rows, kv head), the biggest first,
 * spread over the OpenMP threads with a dynamic schedule; the query heads that share a kv
 * head (grouped-query attention) are one tile, so each key and value is read once for all.
 * On the vector paths a tile is up to 96 queries; on the AMX path up to 768 (a 256-row
 * chunk of 3 heads per kv head), each chunk cut into as many tiles as its share of the
 * step's work (rows x keys) of ITEMS_PER_THREAD items per thread: each item lays out every
 * key tile its rows see, so fewer, longer items lay out less (W1's 256-token prompts: each
 * key tile once, not once per 32 rows). A chunk holding more than one thread's share gives
 * a multiple of the thread count of equal items, so that they end together (one 256-row
 * chunk of 3 kv heads on 2 threads: 6 items, not 9 of which one thread takes 5).
 *
 * The bf16 path (a bfloat16 cache on a level with AVX512_BF16: avx512_bf16, amx) computes
 * as PyTorch's bf16 flash kernel does: queries rounded to bfloat16, scores q·k summed in
 * float32 (vdpbf16ps: pairs of bf16 products into float32 lanes), scaled, an online softmax
 * in float32 (running maximum and sum per query), the probabilities rounded to bfloat16 for
 * the product with the values, the output summed in float32. Its lanes are queries: a
 * tile's queries (up to 96: query rows x group heads) lie in up to six 16-lane vectors,
 * laid out once per item as bf16 pairs, and each key's pair of elements is broadcast from
 * the cache in place, so keys are never copied; the maximum, exponentials and sums of the
 * softmax are then lane-wise. Values are laid out per key tile (KT keys) as pairs of keys,
 * the probabilities likewise, for the second product. Key tiles past a tile's last row are
 * skipped; only tiles that reach past its first row are masked.
 *
 * An 8-bit float cache (E4M3, E5M2) of head size a multiple of 32 takes the same two
 * paths, its keys and values widened to bf16 (exactly: every 8-bit float is a bf16) as
 * each key tile is read (kv_row_bf16): on the AMX path (prompt_amx.h) as its tiles are laid
 * out, on the vdpbf16ps path into the scratch the scores then read (widen_keys); the
 * numerics are the bf16 cache's.
 *
 * A float32 cache takes the float32 path on every level (up to 48 heads per group, head
 * sizes up to 256): the same items and lanes, in float32 with FMAs (see "The float32
 * path" below). Elsewhere (a bf16 or 8-bit float cache on a level without native bf16, an
 * 8-bit float cache of another head size, more than 96 heads per group) each query row is
 * one call of the decode kernel (paged_attention.c's decode_item) over its causal prefix:
 * float32 arithmetic, correct, and slower.
 *
 * Layouts: out, query [tokens, num_heads, head_dim] float32, rows strided, heads
 * contiguous; caches [num_blocks, num_kv_heads, block_size, head_dim]; chunks
 * [num_chunks, 3] int64 (start, end, seq_len); block_tables [num_chunks, stride] int64.
 */
#define _GNU_SOURCE /* syscall(), for the AMX permission (prompt_amx.h) */
#include "paged_attention.c"

#include <omp.h>

#if defined(__AVX512BF16__)
#define PROMPT_BF16 1
#else
#define PROMPT_BF16 0
#endif

#define KT 32         /* keys per tile */
#define MAX_QV 6      /* 16-lane query vectors per item */
#define MAX_QUERIES (MAX_QV * 16)
#define MAX_DIM 256
#define LAZY_MAX 8.0f /* how far a score may pass the running maximum before it moves */

static int64_t rows_per_item(int64_t group) { return group >= MAX_QUERIES ? 1 : MAX_QUERIES / group; }

/* Whether a cache (kv: paged_attention.c's KV_* mode) of these shapes suits the bf16 paths
 * of ts_prompt_attention: a bf16 cache; an 8-bit float one of head size a multiple of 32
 * (kv_row_bf16 widens 32 elements at a time). */
int ts_prompt_attention_native(int64_t kv, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim) {
    const int64_t group = num_heads / num_kv_heads;
    return PROMPT_BF16 && kv != KV_F32 && group <= MAX_QUERIES && head_dim <= MAX_DIM &&
           head_dim % (KV_FP8(kv) ? 32 : 2) == 0;
}

/* The cache mode the bf16 paths read with: an 8-bit float's own, else KV_BF16 (a bf16 cache,
 * whatever numerics the decode kernel reads it with). */
#define BF16_PATHS_KV(kv) (KV_FP8(kv) ? (int)(kv) : KV_BF16)

/* Rows first_row .. first_row + rows of a chunk; work: the keys its last row sees. On the
 * AMX path an item may instead be `chunks` whole consecutive chunks from `chunk` on whose
 * contexts start with the same `shared` positions (prompt_groups). */
typedef struct {
    int64_t chunk, first_row, rows, work, chunks, shared;
} PromptItem;

static int by_work_descending(const void *a, const void *b) {
    const int64_t wa = ((const PromptItem *)a)->work, wb = ((const PromptItem *)b)->work;
    return (wa < wb) - (wa > wb);
}

/* What a cache row past the context reads as: zeros (of any element size). */
static const float zero_row[MAX_DIM] __attribute__((aligned(64)));

/* The cache rows of context positions k0 .. k0 + n (elements of `element` bytes: float32,
 * bf16 or 8-bit floats): rows past the context are a row of zeros. One division per call,
 * not per row (block_size is not a constant). */
static inline void tile_rows(const void **rows, int n, const void *cache,
                             const int64_t *table, int64_t k0, int64_t seq_len,
                             int64_t block_stride, int64_t block_size, int64_t kv_offset,
                             int64_t head_dim, int64_t element) {
    int64_t block = k0 / block_size, offset = k0 - block * block_size;
    for (int j = 0; j < n; ++j) {
        if (k0 + j >= seq_len) {
            rows[j] = zero_row;
            continue;
        }
        rows[j] = (const char *)cache +
                  (table[block] * block_stride + kv_offset + offset * head_dim) * element;
        if (++offset == block_size) {
            offset = 0;
            ++block;
        }
    }
}

/* ---- The float32 path: a float32 cache, on every level ----
 *
 * Lanes are queries, as on the vdpbf16ps path, VW of them to a vector (8 on AVX2, 16 on
 * AVX-512): an item's queries (up to F32_MAX_QUERIES: rows x the group's heads) are laid
 * out once, transposed and multiplied by the scale and log2(e) (qt[d][v] lane i: element
 * d of query VW·v + i), and each key element is broadcast from the cache in place. Per key
 * tile (KT keys): the scores of F32_SCORE_KEYS keys x up to three query vectors at a time,
 * summed over the head's elements in registers; the online softmax lane-wise in powers of
 * two (the running maximum moves lazily, as on the bf16 paths); then o[d][v] += p[k][v] ·
 * v[k][d] for F32_DIMS elements x up to three query vectors at a time, each value element
 * broadcast from the cache in place. The three query (probability) vectors stay in
 * registers through the elements (keys) they multiply (in_register: on AVX2 the twelve sums,
 * three vectors and a broadcast take all 16; 1.13-1.36x faster on an AMD EPYC Zen 3 than
 * their loads folded into each multiply-add, docs/PERFORMANCE_CPU.md, "Operands in
 * registers"). Float32 arithmetic throughout: the results differ from attention in float64
 * by the order of the sums and the exponential's ~1e-7 only. */
#define F32_MAX_QUERIES 48
#define F32_QV ((F32_MAX_QUERIES + VW - 1) / VW) /* query vectors per item */
#define F32_SCORE_KEYS 4
#define F32_DIMS 4

typedef struct {
    float qt[MAX_DIM * F32_QV * VW]; /* [d][v][lane] */
    float s[KT * F32_QV * VW];       /* [key][v][lane]: scores, then probabilities */
    float o[MAX_DIM * F32_QV * VW];  /* [d][v][lane] */
    vwf max[F32_QV], sum[F32_QV], alpha[F32_QV];
    vwi limit[F32_QV];
    const void *keys[KT], *values[KT];
} F32Scratch;

#define F32_AT(array, row, v) ((array) + ((row) * F32_QV + (v)) * VW)

/* Scores of keys[0 .. KT) against query vectors v0 .. v0 + NQ. */
static inline __attribute__((always_inline)) void score_tile_f32(
    float *s, const float *qt, const void *const *keys, int64_t head_dim, int v0,
    const int NQ) {
    for (int j0 = 0; j0 < KT; j0 += F32_SCORE_KEYS) {
        vwf acc[F32_SCORE_KEYS][3];
        const float *k[F32_SCORE_KEYS];
        for (int j = 0; j < F32_SCORE_KEYS; ++j) {
            k[j] = (const float *)keys[j0 + j];
            for (int v = 0; v < NQ; ++v) acc[j][v] = splatw(0.0f);
        }
        for (int64_t d = 0; d < head_dim; ++d) {
            vwf q[3];
            for (int v = 0; v < NQ; ++v) {
                q[v] = loadw(F32_AT(qt, d, v0 + v));
                in_register(q[v]);
            }
            for (int j = 0; j < F32_SCORE_KEYS; ++j) {
                const vwf x = splatw(k[j][d]);
                for (int v = 0; v < NQ; ++v) acc[j][v] = fmaw(q[v], x, acc[j][v]);
            }
        }
        for (int j = 0; j < F32_SCORE_KEYS; ++j)
            for (int v = 0; v < NQ; ++v) storew(F32_AT(s, j0 + j, v0 + v), acc[j][v]);
    }
}

static void score_f32(float *s, const float *qt, const void *const *keys, int64_t head_dim,
                      int nq) {
    for (int v0 = 0; v0 < nq; v0 += 3) {
        switch (nq - v0) {
        case 1: score_tile_f32(s, qt, keys, head_dim, v0, 1); break;
        case 2: score_tile_f32(s, qt, keys, head_dim, v0, 2); break;
        default: score_tile_f32(s, qt, keys, head_dim, v0, 3); break;
        }
    }
}

/* o[d][v] = o[d][v] · alpha[v] (with RESCALE) + sum over the tile's keys of p[k][v] ·
 * value k's element d, for elements first .. first + ND and query vectors v0 .. v0 + NQ. */
static inline __attribute__((always_inline)) void weigh_tile_f32(
    float *o, const vwf *alpha, const float *p, const void *const *values, int64_t first,
    int v0, const int ND, const int NQ, const int RESCALE) {
    vwf acc[F32_DIMS][3];
    for (int d = 0; d < ND; ++d)
        for (int v = 0; v < NQ; ++v) {
            acc[d][v] = loadw(F32_AT(o, first + d, v0 + v));
            if (RESCALE) acc[d][v] *= alpha[v0 + v];
        }
    for (int k = 0; k < KT; ++k) {
        const float *x = (const float *)values[k] + first;
        vwf pk[3];
        for (int v = 0; v < NQ; ++v) {
            pk[v] = loadw(F32_AT(p, k, v0 + v));
            in_register(pk[v]);
        }
        for (int d = 0; d < ND; ++d) {
            const vwf xd = splatw(x[d]);
            for (int v = 0; v < NQ; ++v) acc[d][v] = fmaw(pk[v], xd, acc[d][v]);
        }
    }
    for (int d = 0; d < ND; ++d)
        for (int v = 0; v < NQ; ++v) storew(F32_AT(o, first + d, v0 + v), acc[d][v]);
}

static inline __attribute__((always_inline)) void weigh_dims_f32(
    float *o, const vwf *alpha, const float *p, const void *const *values, int64_t head_dim,
    int v0, const int NQ, const int RESCALE) {
    int64_t d = 0;
    for (; d + F32_DIMS <= head_dim; d += F32_DIMS)
        weigh_tile_f32(o, alpha, p, values, d, v0, F32_DIMS, NQ, RESCALE);
    for (; d < head_dim; ++d) weigh_tile_f32(o, alpha, p, values, d, v0, 1, NQ, RESCALE);
}

static void weigh_f32(float *o, const vwf *alpha, const float *p, const void *const *values,
                      int64_t head_dim, int nq, int rescale) {
    for (int v0 = 0; v0 < nq; v0 += 3) {
        switch ((nq - v0 < 3 ? nq - v0 : 3) * 2 + rescale) {
        case 2: weigh_dims_f32(o, alpha, p, values, head_dim, v0, 1, 0); break;
        case 3: weigh_dims_f32(o, alpha, p, values, head_dim, v0, 1, 1); break;
        case 4: weigh_dims_f32(o, alpha, p, values, head_dim, v0, 2, 0); break;
        case 5: weigh_dims_f32(o, alpha, p, values, head_dim, v0, 2, 1); break;
        case 6: weigh_dims_f32(o, alpha, p, values, head_dim, v0, 3, 0); break;
        default: weigh_dims_f32(o, alpha, p, values, head_dim, v0, 3, 1); break;
        }
    }
}

static inline int any_lane(vwi mask) {
    int32_t lanes[VW];
    memcpy(lanes, &mask, sizeof lanes);
    int any = 0;
    for (int i = 0; i < VW; ++i) any |= lanes[i];
    return any != 0;
}

/* The online softmax of one key tile's scores for query vector v (in log2 units: the
 * queries carry scale · log2(e)), in place: the scores become the probabilities 2^(s -
 * max), relative to the lane's running maximum, which moves lazily as on the bf16 path
 * (softmax_tile; LAZY_MAX here in log2 units). MASKED: a tile reaching past the first row's
 * causal limit. Returns whether a lane moved. */
static inline __attribute__((always_inline)) int softmax_tile_f32_n(F32Scratch *w, int v,
                                                                    int64_t k0,
                                                                    const int MASKED) {
    vwi keep[KT];
    vwf top = splatw(-INFINITY);
    for (int j = 0; j < KT; ++j) {
        const vwf x = loadw(F32_AT(w->s, j, v));
        if (MASKED) {
            keep[j] = (vwi){0} + (int32_t)(k0 + j) <= w->limit[v];
            top = selectw(keep[j] & (x > top), x, top);
        } else {
            top = selectw(x > top, x, top);
        }
    }
    const vwi moved = top > w->max[v] + splatw(LAZY_MAX);
    vwf sum = w->sum[v];
    const int any = any_lane(moved);
    if (any) {
        const vwf now = selectw(moved, top, w->max[v]);
        /* 2^(old - now): ~0 where old is -inf (sum and output still 0), 1 where unmoved */
        w->alpha[v] = exp2w(w->max[v] - now);
        w->max[v] = now;
        sum *= w->alpha[v];
    } else {
        w->alpha[v] = splatw(1.0f);
    }
    for (int j = 0; j < KT; ++j) {
        float *x = F32_AT(w->s, j, v);
        vwf p = exp2w(loadw(x) - w->max[v]);
        if (MASKED) p = selectw(keep[j], p, splatw(0.0f));
        sum += p;
        storew(x, p);
    }
    w->sum[v] = sum;
    return any;
}

static int softmax_tile_f32(F32Scratch *w, int v, int64_t k0, int masked) {
    return masked ? softmax_tile_f32_n(w, v, k0, 1) : softmax_tile_f32_n(w, v, k0, 0);
}

/* One item on the float32 path: `count` rows of a chunk from chunk row `first_row`, the
 * query heads of kv head h (see ts_prompt_attention). */
static void prompt_item_f32(float *out, int64_t out_stride, const float *query,
                            int64_t query_stride, const void *key_cache,
                            const void *value_cache, const int64_t *table, int64_t start,
                            int64_t q_len, int64_t seq_len, int64_t first_row, int64_t count,
                            int64_t h, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale,
                            F32Scratch *w) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t queries = count * group, context = seq_len - q_len;
    const int nq = (int)((queries + VW - 1) / VW);
    const int64_t block_stride = num_kv_heads * block_size * head_dim;
    const int64_t kv_offset = h * block_size * head_dim;
    const float *q0 = query + (start + first_row) * query_stride + h * group * head_dim;
    const float scale_l2 = scale * 1.44269504088896341f; /* scores in log2 units */
    /* Query m: row m / group, head m % group; lanes past the item's queries are zero and
     * take the last row's causal limit. */
    for (int64_t m = 0; m < (int64_t)nq * VW; ++m) {
        const float *q = q0 + (m / group) * query_stride + (m % group) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d)
            F32_AT(w->qt, d, m / VW)[m % VW] = m < queries ? q[d] * scale_l2 : 0.0f;
    }
    for (int v = 0; v < nq; ++v) {
        int32_t limit[VW];
        for (int i = 0; i < VW; ++i) {
            const int64_t m = (int64_t)VW * v + i;
            limit[i] = (int32_t)(context + first_row + (m < queries ? m / group : count - 1));
        }
        memcpy(&w->limit[v], limit, sizeof limit);
        w->max[v] = splatw(-INFINITY);
        w->sum[v] = splatw(0.0f);
        for (int64_t d = 0; d < head_dim; ++d) storew(F32_AT(w->o, d, v), splatw(0.0f));
    }
    const int64_t last = context + first_row + count - 1; /* the last key any row sees */
    for (int64_t k0 = 0; k0 <= last; k0 += KT) {
        tile_rows(w->keys, KT, key_cache, table, k0, seq_len, block_stride, block_size,
                  kv_offset, head_dim, sizeof(float));
        score_f32(w->s, w->qt, w->keys, head_dim, nq);
        tile_rows(w->values, KT, value_cache, table, k0, seq_len, block_stride, block_size,
                  kv_offset, head_dim, sizeof(float));
        const int masked = k0 + KT - 1 > context + first_row;
        int rescale = 0;
        for (int v = 0; v < nq; ++v) rescale |= softmax_tile_f32(w, v, k0, masked);
        weigh_f32(w->o, w->alpha, w->s, w->values, head_dim, nq, rescale);
    }
    for (int v = 0; v < nq; ++v) {
        float inverse[VW];
        const vwf one_over = splatw(1.0f) / w->sum[v];
        memcpy(inverse, &one_over, sizeof inverse);
        for (int i = 0; i < VW && (int64_t)VW * v + i < queries; ++i) {
            const int64_t m = (int64_t)VW * v + i;
            float *o = out + (start + first_row + m / group) * out_stride + (m % group) * head_dim
                       + h * group * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) o[d] = F32_AT(w->o, d, v)[i] * inverse[i];
        }
    }
}

#if PROMPT_BF16
#include "avx512.h"

/* Elements d .. d + 31 of a cache row as bf16: a bf16 row's own; an 8-bit float row's
 * (kv: KV_FP8_E4M3 or KV_FP8_E5M2) widened (fp8.h) and rounded to bf16, exactly: every
 * 8-bit float is a bf16. */
static inline __attribute__((always_inline)) __m512i kv_row_bf16(const void *row, int64_t d,
                                                                 int kv) {
    if (!KV_FP8(kv)) return _mm512_loadu_si512((const uint16_t *)row + d);
    vwf k[2];
    fp8_widen_chunk((const uint8_t *)row + d, kv == KV_FP8_E5M2, k);
    const __m512 unit = _mm512_set1_ps(KV_UNIT(kv));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps((__m512)k[1], unit),
                                        _mm512_mul_ps((__m512)k[0], unit));
}

/* A key tile's rows of 8-bit floats (kv) widened to bf16 rows of head_dim (a multiple of 32)
 * in `keys`, which rows[] then point at. */
static inline void widen_keys(uint16_t *keys, const void **rows, int64_t head_dim, int kv) {
    for (int j = 0; j < KT; ++j) {
        uint16_t *row = keys + j * head_dim;
        for (int64_t d = 0; d < head_dim; d += 32)
            _mm512_storeu_si512(row + d, kv_row_bf16(rows[j], d, kv));
        rows[j] = row;
    }
}

/* Scores of keys rows[0 .. KT) against NQ query vectors (qp: [pairs][MAX_QV] vectors of
 * bf16 pairs): s[j * MAX_QV + v] = sum over pairs of q·k (unscaled). SCORE_KEYS keys at a
 * time: more keep the queries in registers no better (the sums then spill). */
#define SCORE_KEYS 2
static inline __attribute__((always_inline)) void score_tile(
    __m512 *s, const __m512i *qp, const void *const *rows, const int64_t pairs,
    const int NQ) {
    for (int j0 = 0; j0 < KT; j0 += SCORE_KEYS) {
        __m512 acc[SCORE_KEYS][MAX_QV];
        for (int j = 0; j < SCORE_KEYS; ++j)
            for (int v = 0; v < NQ; ++v) acc[j][v] = _mm512_setzero_ps();
        const uint32_t *r[SCORE_KEYS];
        for (int j = 0; j < SCORE_KEYS; ++j) r[j] = (const uint32_t *)rows[j0 + j];
        for (int64_t d = 0; d < pairs; ++d) {
            __m512i q[MAX_QV];
            for (int v = 0; v < NQ; ++v) q[v] = qp[d * MAX_QV + v];
            for (int j = 0; j < SCORE_KEYS; ++j) {
                const __m512bh k = (__m512bh)_mm512_set1_epi32((int)r[j][d]);
                for (int v = 0; v < NQ; ++v)
                    acc[j][v] = _mm512_dpbf16_ps(acc[j][v], (__m512bh)q[v], k);
            }
        }
        for (int j = 0; j < SCORE_KEYS; ++j)
            for (int v = 0; v < NQ; ++v) s[(j0 + j) * MAX_QV + v] = acc[j][v];
    }
}

/* o[d][v] = o[d][v] * alpha[v] + sum over the tile's key pairs of p · value, for dims
 * first .. first + ND and query vectors v0 .. v0 + NQ (vp: [KT / 2][head_dim] pairs). */
static inline __attribute__((always_inline)) void weigh_tile(
    __m512 *o, const __m512 *alpha, const __m512i *pp, const uint32_t *vp, int64_t head_dim,
    int64_t first, int v0, const int ND, const int NQ, const int RESCALE) {
    __m512 acc[8][3];
    for (int d = 0; d < ND; ++d)
        for (int v = 0; v < NQ; ++v)
            acc[d][v] = RESCALE ? _mm512_mul_ps(o[(first + d) * MAX_QV + v0 + v], alpha[v0 + v])
                                : o[(first + d) * MAX_QV + v0 + v];
    for (int k = 0; k < KT / 2; ++k) {
        __m512i p[3];
        for (int v = 0; v < NQ; ++v) p[v] = pp[k * MAX_QV + v0 + v];
        for (int d = 0; d < ND; ++d) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)vp[k * head_dim + first + d]);
            for (int v = 0; v < NQ; ++v) acc[d][v] = _mm512_dpbf16_ps(acc[d][v], (__m512bh)p[v], x);
        }
    }
    for (int d = 0; d < ND; ++d)
        for (int v = 0; v < NQ; ++v) o[(first + d) * MAX_QV + v0 + v] = acc[d][v];
}

static inline __attribute__((always_inline)) void weigh_dims_n(
    __m512 *o, const __m512 *alpha, const __m512i *pp, const uint32_t *vp, int64_t head_dim,
    int v0, const int NQ, const int RESCALE) {
    int64_t d = 0;
    for (; d + 8 <= head_dim; d += 8) weigh_tile(o, alpha, pp, vp, head_dim, d, v0, 8, NQ, RESCALE);
    switch (head_dim - d) { /* head_dim is even */
    case 6: weigh_tile(o, alpha, pp, vp, head_dim, d, v0, 6, NQ, RESCALE); break;
    case 4: weigh_tile(o, alpha, pp, vp, head_dim, d, v0, 4, NQ, RESCALE); break;
    case 2: weigh_tile(o, alpha, pp, vp, head_dim, d, v0, 2, NQ, RESCALE); break;
    default: break;
    }
}

/* The product with the values for query vectors v0 .. v0 + nq (nq <= 3); rescale: the
 * output is first multiplied by alpha (a lane's maximum moved). */
static void weigh_dims(__m512 *o, const __m512 *alpha, const __m512i *pp, const uint32_t *vp,
                       int64_t head_dim, int v0, int nq, int rescale) {
    switch (nq * 2 + rescale) {
    case 2: weigh_dims_n(o, alpha, pp, vp, head_dim, v0, 1, 0); break;
    case 3: weigh_dims_n(o, alpha, pp, vp, head_dim, v0, 1, 1); break;
    case 4: weigh_dims_n(o, alpha, pp, vp, head_dim, v0, 2, 0); break;
    case 5: weigh_dims_n(o, alpha, pp, vp, head_dim, v0, 2, 1); break;
    case 6: weigh_dims_n(o, alpha, pp, vp, head_dim, v0, 3, 0); break;
    default: weigh_dims_n(o, alpha, pp, vp, head_dim, v0, 3, 1); break;
    }
}

/* Values of `keys` keys (rows, an even count) as pairs of keys:
 * vp[k][d] = (v[2k][d], v[2k + 1][d]). */
static inline void pack_values(uint32_t *vp, const void *const *rows, int64_t head_dim,
                               int keys, int kv) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int k = 0; k < keys / 2; ++k) {
        const uint16_t *a = rows[2 * k], *b = rows[2 * k + 1];
        uint32_t *out = vp + k * head_dim;
        int64_t d = 0;
        for (; d + 32 <= head_dim; d += 32) {
            const __m512i x = kv_row_bf16(rows[2 * k], d, kv);
            const __m512i y = kv_row_bf16(rows[2 * k + 1], d, kv);
            _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(x, hi, y));
        }
        for (; d < head_dim; ++d) out[d] = (uint32_t)a[d] | (uint32_t)b[d] << 16;
    }
}

typedef struct {
    __m512i qp[MAX_DIM / 2 * MAX_QV];
    __m512 s[KT * MAX_QV];
    __m512i pp[KT / 2 * MAX_QV];
    __m512 o[MAX_DIM * MAX_QV];
    __m512 max[MAX_QV], sum[MAX_QV], alpha[MAX_QV];
    __m512i limit[MAX_QV];
    uint32_t vp[KT / 2 * MAX_DIM];
    uint16_t keys[KT * MAX_DIM]; /* a key tile widened from 8-bit floats (widen_keys) */
    const void *rows[KT];
} Bf16Scratch;

/* The item's queries as bf16 pairs, qp[d][v] lane i = pair d of query 16v + i (query m:
 * row m / group, head m % group; the row's heads of this kv head are contiguous at
 * q0 + row · query_stride): per 16 queries and 16 pairs, each query's 32 floats rounded
 * to bf16 (vcvtne2ps2bf16: nearest even) and the 16 x 16 block transposed. Lanes past the
 * item's queries are zero. */
static void lay_out_queries(__m512i *qp, const float *q0, int64_t query_stride, int64_t group,
                            int64_t queries, int nq, int64_t head_dim) {
    const int64_t pairs = head_dim / 2;
    for (int v = 0; v < nq; ++v) {
        /* The next 16 queries' lines into L1 (rows are strided: a new page each) */
        for (int64_t m = 16 * (v + 1); m < 16 * (v + 2) && m < queries; ++m)
            prefetch_span(q0 + (m / group) * query_stride + (m % group) * head_dim, head_dim, 0);
        for (int64_t d0 = 0; d0 < pairs; d0 += 16) {
            const int n = pairs - d0 < 16 ? (int)(pairs - d0) : 16;
            const __mmask16 lo = n >= 8 ? 0xffff : (__mmask16)((1u << 2 * n) - 1);
            const __mmask16 hi = n >= 16 ? 0xffff : n > 8 ? (__mmask16)((1u << 2 * (n - 8)) - 1) : 0;
            __m512i r[16];
            for (int i = 0; i < 16; ++i) {
                const int64_t m = 16 * v + i;
                if (m >= queries) {
                    r[i] = _mm512_setzero_si512();
                    continue;
                }
                const float *q = q0 + (m / group) * query_stride + (m % group) * head_dim + 2 * d0;
                r[i] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, q + 16),
                                                    _mm512_maskz_loadu_ps(lo, q));
            }
            transpose16(r);
            for (int i = 0; i < n; ++i) qp[(d0 + i) * MAX_QV + v] = r[i];
        }
    }
}

/* The output: o[d][v] (lane i: query 16v + i) divided by the query's sum and written to
 * its row, per 16 queries and 16 dims one 16 x 16 transpose. */
static void write_out(float *o0, int64_t out_stride, const __m512 *o, const __m512 *sum,
                      int64_t group, int64_t queries, int nq, int64_t head_dim) {
    for (int v = 0; v < nq; ++v) {
        for (int64_t m = 16 * (v + 1); m < 16 * (v + 2) && m < queries; ++m)
            prefetch_span(o0 + (m / group) * out_stride + (m % group) * head_dim, head_dim, 1);
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), sum[v]);
        for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
            const int n = head_dim - d0 < 16 ? (int)(head_dim - d0) : 16;
            __m512i r[16];
            for (int i = 0; i < 16; ++i)
                r[i] = i < n ? (__m512i)_mm512_mul_ps(o[(d0 + i) * MAX_QV + v], inv)
                             : _mm512_setzero_si512();
            transpose16(r);
            const __mmask16 keep = (__mmask16)((1u << n) - 1);
            for (int i = 0; i < 16 && 16 * v + i < queries; ++i) {
                const int64_t m = 16 * v + i;
                _mm512_mask_storeu_ps(o0 + (m / group) * out_stride + (m % group) * head_dim + d0,
                                      keep, (__m512)r[i]);
            }
        }
    }
}

/* The online softmax of one key tile's scores for query vector v (w->s, unscaled) into bf16
 * probabilities as pairs of keys (w->pp). The running maximum moves lazily, lane by lane:
 * only where a score passes it by more than LAZY_MAX (then w->alpha's lane is the rescale
 * of the lane's output and sum, else 1), exact all the same: a lane's probabilities and
 * sum share its maximum, stale or not, which the final division cancels, and they stay
 * below e^LAZY_MAX. Returns whether a lane moved (its output then needs the rescale). */
static inline __attribute__((always_inline)) int softmax_tile(
    Bf16Scratch *w, int v, int64_t k0, int masked, __m512 scales, __m512 scales_l2) {
    __mmask16 keep[KT];
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < KT; ++j) {
        keep[j] = masked ? _mm512_cmple_epi32_mask(_mm512_set1_epi32((int)(k0 + j)), w->limit[v])
                         : (__mmask16)0xffff;
        top = _mm512_mask_max_ps(top, keep[j], top, w->s[j * MAX_QV + v]);
    }
    top = _mm512_mul_ps(top, scales); /* unscaled above: scale > 0 keeps the order */
    /* -inf + LAZY_MAX stays -inf: the first tile moves every lane (key 0 is everyone's). */
    const __mmask16 moved =
        _mm512_cmp_ps_mask(top, _mm512_add_ps(w->max[v], _mm512_set1_ps(LAZY_MAX)), _CMP_GT_OQ);
    __m512 sum = w->sum[v];
    if (moved) {
        const __m512 now = _mm512_mask_mov_ps(w->max[v], moved, top);
        /* e^(old - now): 0 where old is -inf (sum and output still 0), 1 where unmoved */
        w->alpha[v] = (__m512)expw((vwf)_mm512_sub_ps(w->max[v], now));
        w->max[v] = now;
        sum = _mm512_mul_ps(sum, w->alpha[v]);
    } else {
        w->alpha[v] = _mm512_set1_ps(1.0f);
    }
    const __m512 now_l2 = _mm512_mul_ps(w->max[v], _mm512_set1_ps(1.44269504088896341f));
    const __m512i pair_order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                                25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                                18, 2, 17, 1, 16, 0);
    for (int k = 0; k < KT / 2; ++k) {
        const __m512 p0 = exp_shifted(keep[2 * k], w->s[2 * k * MAX_QV + v], scales_l2, now_l2);
        const __m512 p1 =
            exp_shifted(keep[2 * k + 1], w->s[(2 * k + 1) * MAX_QV + v], scales_l2, now_l2);
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        w->pp[k * MAX_QV + v] =
            _mm512_permutexvar_epi16(pair_order, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    w->sum[v] = sum;
    return moved != 0;
}

/* One item on the bf16 path: `count` rows of a chunk from chunk row `first_row`, the query
 * heads of kv head h; kv: KV_BF16, KV_FP8_E4M3 or KV_FP8_E5M2. */
static void prompt_item_bf16(float *out, int64_t out_stride, const float *query,
                             int64_t query_stride, const void *key_cache,
                             const void *value_cache, const int64_t *table, int64_t start,
                             int64_t q_len, int64_t seq_len, int64_t first_row, int64_t count,
                             int64_t h, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, float scale, int kv,
                             Bf16Scratch *w) {
    const int64_t group = num_heads / num_kv_heads, pairs = head_dim / 2;
    const int64_t queries = count * group, context = seq_len - q_len;
    const int nq = (int)((queries + 15) / 16);
    const int64_t block_stride = num_kv_heads * block_size * head_dim;
    const int64_t kv_offset = h * block_size * head_dim;
    lay_out_queries(w->qp, query + (start + first_row) * query_stride + h * group * head_dim,
                    query_stride, group, queries, nq, head_dim);
    /* Lane i of vector v is query 16v + i; padding lanes take the last row's causal limit. */
    for (int v = 0; v < nq; ++v) {
        int32_t limit[16];
        for (int i = 0; i < 16; ++i) {
            const int64_t m = 16 * v + i;
            limit[i] = (int32_t)(context + first_row + (m < queries ? m / group : count - 1));
        }
        w->limit[v] = _mm512_loadu_si512(limit);
        w->max[v] = _mm512_set1_ps(-INFINITY);
        w->sum[v] = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; ++d) w->o[d * MAX_QV + v] = _mm512_setzero_ps();
    }
    const __m512 scales = _mm512_set1_ps(scale);
    const __m512 scales_l2 = _mm512_set1_ps(scale * 1.44269504088896341f);
    const int64_t last = context + first_row + count - 1; /* the last key any row sees */
    const int64_t element = KV_ELEMENT(kv);
    for (int64_t k0 = 0; k0 <= last; k0 += KT) {
        tile_rows(w->rows, KT, key_cache, table, k0, seq_len, block_stride, block_size,
                  kv_offset, head_dim, element);
        if (KV_FP8(kv)) widen_keys(w->keys, w->rows, head_dim, kv);
        switch (nq) {
        case 1: score_tile(w->s, w->qp, w->rows, pairs, 1); break;
        case 2: score_tile(w->s, w->qp, w->rows, pairs, 2); break;
        case 3: score_tile(w->s, w->qp, w->rows, pairs, 3); break;
        case 4: score_tile(w->s, w->qp, w->rows, pairs, 4); break;
        case 5: score_tile(w->s, w->qp, w->rows, pairs, 5); break;
        default: score_tile(w->s, w->qp, w->rows, pairs, 6); break;
        }
        tile_rows(w->rows, KT, value_cache, table, k0, seq_len, block_stride, block_size,
                  kv_offset, head_dim, element);
        pack_values(w->vp, w->rows, head_dim, KT, kv);
        const int masked = k0 + KT - 1 > context + first_row;
        int rescale = 0;
        for (int v = 0; v < nq; ++v) rescale |= softmax_tile(w, v, k0, masked, scales, scales_l2);
        for (int v0 = 0; v0 < nq; v0 += 3) {
            const int n = nq - v0 < 3 ? nq - v0 : 3;
            if (rescale) weigh_dims(w->o, w->alpha, w->pp, w->vp, head_dim, v0, n, 1);
            else weigh_dims(w->o, w->alpha, w->pp, w->vp, head_dim, v0, n, 0);
        }
    }
    write_out(out + (start + first_row) * out_stride + h * group * head_dim, out_stride, w->o,
              w->sum, group, queries, nq, head_dim);
}
#endif

#if PROMPT_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "prompt_amx.h"
#define PROMPT_AMX 1
#else
#define PROMPT_AMX 0
#endif

#define ITEMS_PER_THREAD 2
#if !PROMPT_AMX
#define AMX_MAX_QUERIES MAX_QUERIES
#endif

/* Rows per item of a chunk of q_len rows: fixed on the vector paths; on the AMX path the
 * chunk in `pieces`, whole 16-row blocks, at most AMX_MAX_QUERIES queries. */
static int64_t item_rows(int amx, int64_t group, int64_t q_len, int64_t pieces) {
    if (!amx) return rows_per_item(group);
    const int64_t most = AMX_MAX_QUERIES / group;
    const int64_t rows = ((q_len + pieces - 1) / pieces + 15) / 16 * 16;
    return rows < most ? rows : most;
}

/* A chunk's work: its rows times the keys they see on average (causal). */
static double chunk_work(const int64_t *chunk) {
    const double q_len = (double)(chunk[1] - chunk[0]);
    return q_len * ((double)chunk[2] - q_len / 2);
}

/* How many pieces the AMX path cuts a chunk of q_len rows into, per kv head: its share
 * (`share`, of the step's work) of ITEMS_PER_THREAD items per thread, and at least as many
 * as keep each within `most` rows; for a chunk of more than one thread's share, rounded up
 * to a whole number of items per thread. */
static int64_t chunk_pieces(double share, int64_t q_len, int64_t most, int64_t num_kv_heads,
                            int64_t threads) {
    const double items = ITEMS_PER_THREAD * (double)threads * share / (double)num_kv_heads;
    int64_t pieces = (int64_t)ceil(items);
    if (pieces < (q_len + most - 1) / most) pieces = (q_len + most - 1) / most;
    if (pieces < 1) pieces = 1;
    if (share * (double)threads > 1.0)
        while ((pieces * num_kv_heads) % threads != 0) ++pieces;
    return pieces;
}

/* Rows per item of a chunk ({start, end, seq_len}) in a step of `total_work`. */
static int64_t chunk_item_rows(int amx, int64_t group, const int64_t *chunk, double total_work,
                               int64_t num_kv_heads, int64_t threads) {
    const int64_t q_len = chunk[1] - chunk[0];
    const double share = total_work > 0 ? chunk_work(chunk) / total_work : 1.0;
    return item_rows(amx, group, q_len,
                     chunk_pieces(share, q_len, AMX_MAX_QUERIES / group, num_kv_heads,
                                  threads));
}

/* The path ts_prompt_attention takes for these shapes: 2 AMX tiles, 1 vdpbf16ps, 3 the
 * float32 one (a float32 cache), 0 the decode kernel per query row. */
int ts_prompt_attention_path(int64_t kv, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim) {
    if (!ts_prompt_attention_native(kv, num_heads, num_kv_heads, head_dim))
        return kv == KV_F32 && num_heads / num_kv_heads <= F32_MAX_QUERIES &&
                       head_dim <= MAX_DIM ? 3 : 0;
#if PROMPT_AMX
    if (head_dim % 32 == 0 && amx_permitted()) return 2;
#endif
    return 1;
}

/* A step's prompt chunks cut into work items (prompt_plan), for prompt_items. */
typedef struct {
    PromptItem *items; /* the items with the most keys first, or NULL with none */
    int64_t num_items, max_rows, max_seq_len, group, head_dim;
    int64_t max_queries; /* AMX: queries of the largest item, padded as its scratch holds them */
    int amx, native, f32;
} PromptPlan;

/* Chunks behind a shared prefix, on the AMX path: consecutive chunks of one item each
 * whose block tables start with the same blocks (prefix caching hands every request with
 * a common prefix the same blocks: W3's prompts) are one item per kv head, so that the key
 * tiles of the prefix are laid out once for all of them instead of once per chunk
 * (amx_attend_runs; the results are the chunks' own items' bit for bit). A group needs
 * GROUP_MIN_SHARED shared positions, holds up to GROUP_MAX_QUERIES queries, and the groups
 * are cut small enough to leave ITEMS_PER_THREAD items per thread. */
#define GROUP_MIN_SHARED 256
#define GROUP_MAX_QUERIES 1536
#define GROUP_MAX_CHUNKS 64

/* Positions that chunks a and b ({start, end, seq_len}, tables ta and tb) share: their
 * leading equal blocks, within both contexts before their own rows. */
static int64_t shared_positions(const int64_t *a, const int64_t *ta, const int64_t *b,
                                const int64_t *tb, int64_t block_size) {
    const int64_t ca = a[2] - (a[1] - a[0]), cb = b[2] - (b[1] - b[0]);
    const int64_t most = (ca < cb ? ca : cb) / block_size;
    int64_t n = 0;
    while (n < most && ta[n] == tb[n]) ++n;
    return n * block_size;
}

/* The items (n, in chunk order, one or more per chunk) with runs of whole chunks behind a
 * shared prefix merged into one item each (see GROUP_MIN_SHARED above); returns the new
 * count. */
static int64_t prompt_groups(PromptPlan *plan, PromptItem *items, int64_t n,
                             const int64_t *chunks, const int64_t *block_tables,
                             int64_t block_table_stride, int64_t block_size,
                             int64_t num_kv_heads, int64_t threads) {
    const int64_t group = plan->group;
    /* Items wanted: ITEMS_PER_THREAD per thread over the kv heads. */
    const int64_t wanted = (ITEMS_PER_THREAD * threads + num_kv_heads - 1) / num_kv_heads;
    int64_t whole = 0; /* items that are a whole chunk */
    for (int64_t i = 0; i < n; ++i)
        whole += items[i].first_row == 0 &&
                 items[i].rows == chunks[3 * items[i].chunk + 1] - chunks[3 * items[i].chunk];
    const int64_t per_group = (whole + wanted - 1) / (wanted < 1 ? 1 : wanted);
    int64_t kept = 0;
    for (int64_t i = 0; i < n;) {
        PromptItem first = items[i];
        const int64_t c0 = first.chunk, *a = chunks + 3 * c0;
        const int64_t *ta = block_tables + c0 * block_table_stride;
        int64_t j = i + 1, shared = INT64_MAX;
        int64_t queries = (first.rows * group + 15) / 16 * 16;
        if (first.first_row == 0 && first.rows == a[1] - a[0]) {
            while (j < n && j - i < GROUP_MAX_CHUNKS && j - i < per_group) {
                const PromptItem *next = items + j;
                const int64_t *b = chunks + 3 * next->chunk;
                if (next->chunk != c0 + (j - i) || next->first_row != 0 ||
                    next->rows != b[1] - b[0])
                    break;
                const int64_t more = (next->rows * group + 15) / 16 * 16;
                const int64_t both = shared_positions(
                    a, ta, b, block_tables + next->chunk * block_table_stride, block_size);
                if (both < GROUP_MIN_SHARED || queries + more > GROUP_MAX_QUERIES) break;
                shared = both < shared ? both : shared;
                queries += more;
                first.work += next->work;
                ++j;
            }
        }
        if (j - i > 1) {
            first.chunks = j - i;
            first.shared = shared;
            if (queries > plan->max_queries) plan->max_queries = queries;
        }
        items[kept++] = first;
        i = j;
    }
    return kept;
}

/* The items of the chunks (see ts_prompt_attention); returns 0, -1 if the item list could
 * not be allocated. plan->items is freed by the caller. */
static int prompt_plan(PromptPlan *plan, const int64_t *chunks, int64_t num_chunks,
                       const int64_t *block_tables, int64_t block_table_stride,
                       int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t kv) {
    const int64_t group = num_heads / num_kv_heads;
    const int path = ts_prompt_attention_path(kv, num_heads, num_kv_heads, head_dim);
    *plan = (PromptPlan){NULL, 0, 1, 0, group, head_dim, 0, 0, path == 1 || path == 2,
                         path == 3};
#if PROMPT_AMX
    plan->amx = path == 2;
#endif
    /* AMX items: each chunk's rows in pieces by its share of the work (chunk_pieces). */
    const int64_t threads = omp_get_max_threads();
    double total_work = 0;
    for (int64_t c = 0; c < num_chunks; ++c) total_work += chunk_work(chunks + 3 * c);
    int64_t num_items = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t q_len = chunks[3 * c + 1] - chunks[3 * c];
        const int64_t tile = plan->f32 ? F32_MAX_QUERIES / group
                                       : chunk_item_rows(plan->amx, group, chunks + 3 * c,
                                                         total_work, num_kv_heads, threads);
        num_items += (q_len + tile - 1) / tile;
        if (chunks[3 * c + 2] > plan->max_seq_len) plan->max_seq_len = chunks[3 * c + 2];
        if (tile > plan->max_rows) plan->max_rows = tile;
    }
    if (num_items == 0) return 0;
    PromptItem *items = (PromptItem *)malloc(sizeof(PromptItem) * (size_t)num_items);
    if (items == NULL) return -1;
    int64_t n = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t q_len = chunks[3 * c + 1] - chunks[3 * c];
        const int64_t tile = plan->f32 ? F32_MAX_QUERIES / group
                                       : chunk_item_rows(plan->amx, group, chunks + 3 * c,
                                                         total_work, num_kv_heads, threads);
        for (int64_t r = 0; r < q_len; r += tile) {
            const int64_t rows = q_len - r < tile ? q_len - r : tile;
            /* work: rows times the keys the last of them sees */
            items[n++] = (PromptItem){c, r, rows, rows * (chunks[3 * c + 2] - q_len + r + rows),
                                      1, 0};
        }
    }
    plan->max_queries = (plan->max_rows * group + 15) / 16 * 16;
    if (plan->amx)
        n = prompt_groups(plan, items, n, chunks, block_tables, block_table_stride, block_size,
                          num_kv_heads, threads);
    /* The items with the most keys first, so the dynamic schedule ends evenly. */
    qsort(items, (size_t)n, sizeof *items, by_work_descending);
    plan->items = items;
    plan->num_items = n;
    return 0;
}

/* The calling thread's scratch for a plan's items (NULL if it could not be allocated);
 * prompt_scratch_free gives it back. */
static void *prompt_scratch(const PromptPlan *plan) {
#if PROMPT_AMX
    if (plan->amx) return amx_scratch(plan->max_queries, plan->head_dim);
#endif
#if PROMPT_BF16
    if (plan->native) return aligned_alloc(64, sizeof(Bf16Scratch));
#endif
    if (plan->f32) return aligned_alloc(64, (sizeof(F32Scratch) + 63) / 64 * 64);
    return malloc(sizeof(float) * (size_t)(plan->group * plan->max_seq_len));
}

static void prompt_scratch_free(const PromptPlan *plan, void *scratch) {
    if (!plan->amx) free(scratch); /* the AMX scratch is the thread's, kept */
}

/* A plan's items (every chunk's rows, each kv head), shared out over the threads of the
 * enclosing parallel region (an orphaned `omp for`, dynamic, ending in a barrier); scratch
 * is the calling thread's (prompt_scratch; with NULL its items are claimed, not done). */
static void prompt_items(const PromptPlan *plan, void *scratch, float *out, int64_t out_stride,
                         const float *query, int64_t query_stride, const void *key_cache,
                         const void *value_cache, const int64_t *chunks,
                         const int64_t *block_tables, int64_t block_table_stride,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int64_t kv) {
    const int amx = plan->amx, native = plan->native, cache = BF16_PATHS_KV(kv);
    (void)amx, (void)native, (void)cache;
    const int f32 = plan->f32;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < plan->num_items * num_kv_heads; ++i) {
        const PromptItem *item = plan->items + i / num_kv_heads;
        const int64_t h = i % num_kv_heads, c = item->chunk;
        const int64_t start = chunks[3 * c], q_len = chunks[3 * c + 1] - start;
        const int64_t seq_len = chunks[3 * c + 2];
        const int64_t *table = block_tables + c * block_table_stride;
        if (scratch == NULL) continue;
#if PROMPT_AMX
        if (amx && item->chunks > 1) {
            AmxRows runs[GROUP_MAX_CHUNKS];
            const int64_t *tables[GROUP_MAX_CHUNKS];
            for (int64_t s = 0; s < item->chunks; ++s) {
                const int64_t *chunk = chunks + 3 * (c + s), rows = chunk[1] - chunk[0];
                runs[s] = amx_chunk_rows(out, out_stride, query, query_stride, chunk[0], rows,
                                         chunk[2], 0, rows);
                tables[s] = block_tables + (c + s) * block_table_stride;
            }
            amx_attend_runs(runs, tables, item->chunks, item->shared, key_cache, value_cache,
                            h, num_heads, num_kv_heads, head_dim, block_size, scale,
                            cache, (AmxScratch *)scratch);
            continue;
        }
        if (amx) {
            prompt_item_amx(out, out_stride, query, query_stride, key_cache, value_cache,
                            table, start, q_len, seq_len, item->first_row, item->rows, h,
                            num_heads, num_kv_heads, head_dim, block_size, scale,
                            cache, (AmxScratch *)scratch);
            continue;
        }
#endif
#if PROMPT_BF16
        if (native) {
            prompt_item_bf16(out, out_stride, query, query_stride, key_cache, value_cache,
                             table, start, q_len, seq_len, item->first_row, item->rows, h,
                             num_heads, num_kv_heads, head_dim, block_size, scale,
                             cache, (Bf16Scratch *)scratch);
            continue;
        }
#endif
        if (f32) {
            prompt_item_f32(out, out_stride, query, query_stride, key_cache, value_cache, table,
                            start, q_len, seq_len, item->first_row, item->rows, h, num_heads,
                            num_kv_heads, head_dim, block_size, scale, (F32Scratch *)scratch);
            continue;
        }
        for (int64_t r = item->first_row; r < item->first_row + item->rows; ++r) {
            const int64_t row = start + r;
            decode_item(out + row * out_stride, query + row * query_stride, key_cache,
                        value_cache, table, seq_len - q_len + r + 1, h, num_heads,
                        num_kv_heads, head_dim, block_size, scale, (float *)scratch, kv);
        }
    }
}

/* Decode rows over a shared prefix: when the contexts of a step's first `prefix_rows`
 * decode rows start with the same `prefix` positions (whole blocks shared through the
 * prefix cache, the same block ids in those rows' tables), those rows attend to that prefix
 * together and each to the rest of its context alone, and the two halves are merged by their
 * log-sum-exps (merge_attention); the other rows attend to their whole contexts.
 * The prefix half is the AMX prompt kernel's item (amx_attend) over those rows' queries of
 * a kv head at once: each prefix key tile is laid out once for all of them instead of being
 * read once per row, and the tiles are full (16 queries) where a row's 3 heads fill a
 * sixteenth of one. The rest is the decode kernel's item over the row's own positions
 * (decode_items with skip). Numerics: those of both kernels, each half's probabilities
 * relative to its own maximum, the merge in float32: for a bf16 cache queries and
 * probabilities rounded to bf16 in both halves, float32 sums; for an 8-bit float cache the
 * prefix half as the prompt kernel computes it (bf16 rounding, its values widened exactly)
 * and the rest as the decode kernel does (float32 arithmetic on the widened values). Needs
 * the AMX prompt path for the cache (head_dim a multiple of 32) and, for a bf16 one, the
 * decode kernel's dot-product path (head_dim up to 256: ts_decode_prefix_available). */
#if PROMPT_AMX
#define PREFIX_AMX 1
#else
#define PREFIX_AMX 0
#endif

/* Whether decode rows with these shapes can take the shared-prefix path here. */
int ts_decode_prefix_available(int64_t kv_mode, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size) {
    if (!PREFIX_AMX) return 0;
    if (KV_FP8(kv_mode)) /* the decode item's lse: head_dim a multiple of its chunk, <= 256 */
        return ts_prompt_attention_path(kv_mode, num_heads, num_kv_heads, head_dim) == 2 &&
               head_dim % CHUNK(KV_FP8_E4M3) == 0 && head_dim <= 256;
    return kv_mode == KV_BF16_DP &&
           ts_prompt_attention_path(KV_BF16, num_heads, num_kv_heads, head_dim) == 2 &&
           ts_paged_decode_dot_products(head_dim, block_size);
}

/* Rows per prefix item for `rows` decode rows: each item at most AMX_MAX_QUERIES queries,
 * and at least two items per thread over the kv heads, so that the dynamic schedule ends
 * evenly. */
static int64_t prefix_item_rows(int64_t rows, int64_t group, int64_t num_kv_heads,
                                int64_t threads) {
    int64_t pieces = (rows * group + AMX_MAX_QUERIES - 1) / AMX_MAX_QUERIES;
    const int64_t even = (2 * threads + num_kv_heads - 1) / num_kv_heads;
    if (pieces < even) pieces = even;
    return rows <= pieces ? 1 : (rows + pieces - 1) / pieces;
}

#if PREFIX_AMX
/* The prefix half's items, (kv head, run of rows), shared out over the threads of the
 * enclosing region (an orphaned `omp for`, dynamic, no barrier at the end): row r (0 ..
 * num_rows - 1, its query at query + rows[r] * query_stride) attends to positions 0 ..
 * prefix - 1 of table (the rows' shared blocks), writing its output to out + r * out_stride
 * and its heads' log-sum-exps to lse + r * num_heads. kv_mode: the decode kernel's mode of
 * the caches (KV_BF16_DP or an 8-bit float). w: the thread's AMX scratch for item_rows rows
 * (NULL: items claimed, not done). */
static void prefix_items(float *out, int64_t out_stride, float *lse, const float *query,
                         int64_t query_stride, const int64_t *rows, int64_t num_rows,
                         int64_t item_rows, const void *key_cache, const void *value_cache,
                         const int64_t *table, int64_t prefix, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                         float scale, int64_t kv_mode, AmxScratch *w) {
    const int kv = BF16_PATHS_KV(kv_mode);
    const int64_t runs = (num_rows + item_rows - 1) / item_rows;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < runs * num_kv_heads; ++i) {
        const int64_t r0 = i / num_kv_heads * item_rows, h = i % num_kv_heads;
        const int64_t count = num_rows - r0 < item_rows ? num_rows - r0 : item_rows;
        if (w == NULL) continue;
        const AmxRows run = {out + r0 * out_stride, out_stride, query, query_stride, rows + r0,
                             count, prefix - 1, 0, lse + r0 * num_heads};
        amx_attend(&run, key_cache, value_cache, table, h, num_heads, num_kv_heads, head_dim,
                   block_size, scale, kv, w);
    }
}
#endif

/* ts_paged_decode (paged_attention.c) for rows whose first prefix_rows all start with the
 * same `prefix` positions (the same blocks in their tables, whole blocks, below each of
 * their contexts), on the shared-prefix path where ts_decode_prefix_available says it runs
 * (else on ts_paged_decode's). Returns 0, or -1 if a scratch buffer could not be
 * allocated. */
int ts_paged_decode_prefix(float *out, int64_t out_stride, const float *query,
                           int64_t query_stride, const int64_t *rows, const void *key_cache,
                           const void *value_cache, const int64_t *block_tables,
                           int64_t block_table_stride, const int64_t *seq_lens,
                           int64_t num_rows, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, int64_t kv_mode,
                           int64_t prefetch, int64_t split_decode, int64_t prefix,
                           int64_t prefix_rows) {
    if (prefix <= 0 || prefix_rows <= 0 || prefix_rows > num_rows ||
        !ts_decode_prefix_available(kv_mode, num_heads, num_kv_heads, head_dim, block_size))
        return ts_paged_decode(out, out_stride, query, query_stride, rows, key_cache,
                               value_cache, block_tables, block_table_stride, seq_lens,
                               num_rows, num_heads, num_kv_heads, head_dim, block_size, scale,
                               kv_mode, prefetch, split_decode);
#if PREFIX_AMX
    const int64_t group = num_heads / num_kv_heads, width = num_heads * head_dim;
    int64_t max_seq_len = 0;
    for (int64_t r = 0; r < num_rows; ++r)
        max_seq_len = seq_lens[r] > max_seq_len ? seq_lens[r] : max_seq_len;
    float *prefix_out = (float *)malloc(sizeof(float) * (size_t)(prefix_rows * width));
    float *lse = (float *)malloc(sizeof(float) * (size_t)(2 * prefix_rows * num_heads));
    const int64_t item_rows = prefix_item_rows(prefix_rows, group, num_kv_heads,
                                               omp_get_max_threads());
    int failed = prefix_out == NULL || lse == NULL;
    int64_t claimed = 0;
    if (!failed) {
#pragma omp parallel
        {
            float *scores = (float *)malloc(sizeof(float) * (size_t)(group * max_seq_len));
            AmxScratch *w = amx_scratch((item_rows * group + 15) / 16 * 16, head_dim);
            if (scores == NULL || w == NULL) {
#pragma omp atomic write
                failed = 1;
            }
            prefix_items(prefix_out, width, lse, query, query_stride, rows, prefix_rows,
                         item_rows, key_cache, value_cache, block_tables, prefix, num_heads,
                         num_kv_heads, head_dim, block_size, scale, kv_mode, w);
            decode_items(&claimed, out, out_stride, query, query_stride, rows, key_cache,
                         value_cache, block_tables, block_table_stride, seq_lens, num_rows,
                         num_heads, num_kv_heads, head_dim, block_size, scale, scores, kv_mode,
                         prefetch, prefix, prefix_rows, lse + prefix_rows * num_heads, NULL);
#pragma omp barrier
            merge_attention(out, out_stride, rows, prefix_out, width, lse,
                            lse + prefix_rows * num_heads, prefix_rows, num_heads, head_dim);
            free(scores);
        }
    }
    free(prefix_out);
    free(lse);
    return failed ? -1 : 0;
#else
    return -1; /* not reached: ts_decode_prefix_available is 0 */
#endif
}

/* Returns 0, -1 if scratch memory could not be allocated. */
int ts_prompt_attention(float *out, int64_t out_stride, const float *query,
                        int64_t query_stride, const void *key_cache, const void *value_cache,
                        const int64_t *chunks, const int64_t *block_tables,
                        int64_t block_table_stride, int64_t num_chunks, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        float scale, int64_t kv) {
    PromptPlan plan;
    if (prompt_plan(&plan, chunks, num_chunks, block_tables, block_table_stride, block_size,
                    num_heads, num_kv_heads, head_dim, kv))
        return -1;
    if (plan.num_items == 0) return 0;
    int failed = 0;
#pragma omp parallel
    {
        void *scratch = prompt_scratch(&plan);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        prompt_items(&plan, scratch, out, out_stride, query, query_stride, key_cache,
                     value_cache, chunks, block_tables, block_table_stride, num_heads,
                     num_kv_heads, head_dim, block_size, scale, kv);
        prompt_scratch_free(&plan, scratch);
    }
    free(plan.items);
    return failed ? -1 : 0;
}
