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
 * chunk of 3 heads per kv head), a chunk cut into only as many tiles as keep
 * ITEMS_PER_THREAD items per thread: each item lays out every key tile its rows see, so
 * fewer, longer items lay out less (W1's 256-token prompts: each key tile once, not once
 * per 32 rows).
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
 * Elsewhere (a float32 cache, a level without native bf16, more than 96 heads per group)
 * each query row is one call of the decode kernel (paged_attention.c's decode_item) over
 * its causal prefix: float32 arithmetic, correct, and slower than the bf16 path.
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

static int64_t rows_per_item(int64_t group) { return group >= MAX_QUERIES ? 1 : MAX_QUERIES / group; }

/* Whether ts_prompt_attention takes the bf16 path for these shapes. */
int ts_prompt_attention_native(int64_t kv_bf16, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim) {
    const int64_t group = num_heads / num_kv_heads;
    return PROMPT_BF16 && kv_bf16 && group <= MAX_QUERIES && head_dim <= MAX_DIM &&
           head_dim % 2 == 0;
}

/* Rows first_row .. first_row + rows of a chunk; work: the keys its last row sees. */
typedef struct {
    int64_t chunk, first_row, rows, work;
} PromptItem;

static int by_work_descending(const void *a, const void *b) {
    const int64_t wa = ((const PromptItem *)a)->work, wb = ((const PromptItem *)b)->work;
    return (wa < wb) - (wa > wb);
}

#if PROMPT_BF16
/* The cache row of context position `pos` (bf16), or a row of zeros past the context. */
static const uint16_t zero_row[MAX_DIM] __attribute__((aligned(64)));

/* The cache rows of context positions k0 .. k0 + n (bf16): rows past the context are a row
 * of zeros. One division per call, not per row (block_size is not a constant). */
static inline void tile_rows(const uint16_t **rows, int n, const uint16_t *cache,
                             const int64_t *table, int64_t k0, int64_t seq_len,
                             int64_t block_stride, int64_t block_size, int64_t kv_offset,
                             int64_t head_dim) {
    int64_t block = k0 / block_size, offset = k0 - block * block_size;
    for (int j = 0; j < n; ++j) {
        if (k0 + j >= seq_len) {
            rows[j] = zero_row;
            continue;
        }
        rows[j] = cache + table[block] * block_stride + kv_offset + offset * head_dim;
        if (++offset == block_size) {
            offset = 0;
            ++block;
        }
    }
}

/* Scores of keys rows[0 .. NK) against NQ query vectors (qp: [pairs][MAX_QV] vectors of
 * bf16 pairs): s[j * MAX_QV + v] = sum over pairs of q·k (unscaled). */
static inline __attribute__((always_inline)) void score_tile(
    __m512 *s, const __m512i *qp, const uint16_t *const *rows, const int64_t pairs,
    const int NQ) {
    for (int j0 = 0; j0 < KT; j0 += 4) {
        __m512 acc[4][MAX_QV];
        for (int j = 0; j < 4; ++j)
            for (int v = 0; v < NQ; ++v) acc[j][v] = _mm512_setzero_ps();
        const uint32_t *r[4];
        for (int j = 0; j < 4; ++j) r[j] = (const uint32_t *)rows[j0 + j];
        for (int64_t d = 0; d < pairs; ++d) {
            __m512i q[MAX_QV];
            for (int v = 0; v < NQ; ++v) q[v] = qp[d * MAX_QV + v];
            for (int j = 0; j < 4; ++j) {
                const __m512bh k = (__m512bh)_mm512_set1_epi32((int)r[j][d]);
                for (int v = 0; v < NQ; ++v)
                    acc[j][v] = _mm512_dpbf16_ps(acc[j][v], (__m512bh)q[v], k);
            }
        }
        for (int j = 0; j < 4; ++j)
            for (int v = 0; v < NQ; ++v) s[(j0 + j) * MAX_QV + v] = acc[j][v];
    }
}

/* o[d][v] = o[d][v] * alpha[v] + sum over the tile's key pairs of p · value, for dims
 * first .. first + ND and query vectors v0 .. v0 + NQ (vp: [KT / 2][head_dim] pairs). */
static inline __attribute__((always_inline)) void weigh_tile(
    __m512 *o, const __m512 *alpha, const __m512i *pp, const uint32_t *vp, int64_t head_dim,
    int64_t first, int v0, const int ND, const int NQ) {
    __m512 acc[8][3];
    for (int d = 0; d < ND; ++d)
        for (int v = 0; v < NQ; ++v)
            acc[d][v] = _mm512_mul_ps(o[(first + d) * MAX_QV + v0 + v], alpha[v0 + v]);
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

static inline void weigh_dims(__m512 *o, const __m512 *alpha, const __m512i *pp,
                              const uint32_t *vp, int64_t head_dim, int v0, const int NQ) {
    int64_t d = 0;
    for (; d + 8 <= head_dim; d += 8) weigh_tile(o, alpha, pp, vp, head_dim, d, v0, 8, NQ);
    switch (head_dim - d) { /* head_dim is even */
    case 6: weigh_tile(o, alpha, pp, vp, head_dim, d, v0, 6, NQ); break;
    case 4: weigh_tile(o, alpha, pp, vp, head_dim, d, v0, 4, NQ); break;
    case 2: weigh_tile(o, alpha, pp, vp, head_dim, d, v0, 2, NQ); break;
    default: break;
    }
}

/* Values of `keys` keys (rows, an even count) as pairs of keys:
 * vp[k][d] = (v[2k][d], v[2k + 1][d]). */
static inline void pack_values(uint32_t *vp, const uint16_t *const *rows, int64_t head_dim,
                               int keys) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int k = 0; k < keys / 2; ++k) {
        const uint16_t *a = rows[2 * k], *b = rows[2 * k + 1];
        uint32_t *out = vp + k * head_dim;
        int64_t d = 0;
        for (; d + 32 <= head_dim; d += 32) {
            const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
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
    const uint16_t *rows[KT];
} Bf16Scratch;

/* One item on the bf16 path: `count` rows of a chunk from chunk row `first_row`, the query
 * heads of kv head h. */
static void prompt_item_bf16(float *out, int64_t out_stride, const float *query,
                             int64_t query_stride, const uint16_t *key_cache,
                             const uint16_t *value_cache, const int64_t *table, int64_t start,
                             int64_t q_len, int64_t seq_len, int64_t first_row, int64_t count,
                             int64_t h, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, float scale,
                             Bf16Scratch *w) {
    const int64_t group = num_heads / num_kv_heads, pairs = head_dim / 2;
    const int64_t queries = count * group, context = seq_len - q_len;
    const int nq = (int)((queries + 15) / 16);
    const int64_t block_stride = num_kv_heads * block_size * head_dim;
    const int64_t kv_offset = h * block_size * head_dim;
    /* Queries as bf16 pairs, lane m = (row m / group, head m % group); padding lanes zero
     * and with the last row's causal limit. */
    uint32_t *qp = (uint32_t *)w->qp;
    int32_t *limit = (int32_t *)w->limit;
    for (int64_t m = 0; m < nq * 16; ++m) {
        const int64_t row = m < queries ? m / group : count - 1;
        limit[m] = (int32_t)(context + first_row + row);
        const float *q = query + (start + first_row + row) * query_stride +
                         (h * group + m % group) * head_dim;
        for (int64_t d = 0; d < pairs; ++d)
            qp[d * MAX_QUERIES + m] =
                m < queries ? (uint32_t)bf16_round(q[2 * d]) | (uint32_t)bf16_round(q[2 * d + 1]) << 16
                            : 0;
    }
    for (int v = 0; v < nq; ++v) {
        w->max[v] = _mm512_set1_ps(-INFINITY);
        w->sum[v] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < head_dim * MAX_QV; ++i) w->o[i] = _mm512_setzero_ps();
    const __m512 scales = _mm512_set1_ps(scale);
    const __m512i pair_order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                                25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                                18, 2, 17, 1, 16, 0);
    const int64_t last = context + first_row + count - 1; /* the last key any row sees */
    for (int64_t k0 = 0; k0 <= last; k0 += KT) {
        tile_rows(w->rows, KT, key_cache, table, k0, seq_len, block_stride, block_size,
                  kv_offset, head_dim);
        switch (nq) {
        case 1: score_tile(w->s, w->qp, w->rows, pairs, 1); break;
        case 2: score_tile(w->s, w->qp, w->rows, pairs, 2); break;
        case 3: score_tile(w->s, w->qp, w->rows, pairs, 3); break;
        case 4: score_tile(w->s, w->qp, w->rows, pairs, 4); break;
        case 5: score_tile(w->s, w->qp, w->rows, pairs, 5); break;
        default: score_tile(w->s, w->qp, w->rows, pairs, 6); break;
        }
        tile_rows(w->rows, KT, value_cache, table, k0, seq_len, block_stride, block_size,
                  kv_offset, head_dim);
        pack_values(w->vp, w->rows, head_dim, KT);
        const int masked = k0 + KT - 1 > context + first_row;
        for (int v = 0; v < nq; ++v) {
            /* Scaled, masked scores; the tile's maximum per lane. */
            __mmask16 keep[KT];
            __m512 top = w->max[v];
            for (int j = 0; j < KT; ++j) {
                __m512 x = _mm512_mul_ps(w->s[j * MAX_QV + v], scales);
                keep[j] = masked ? _mm512_cmple_epi32_mask(_mm512_set1_epi32((int)(k0 + j)),
                                                          w->limit[v])
                                 : (__mmask16)0xffff;
                x = _mm512_mask_blend_ps(keep[j], _mm512_set1_ps(-INFINITY), x);
                w->s[j * MAX_QV + v] = x;
                top = _mm512_max_ps(top, x);
            }
            /* Every lane sees key 0, so top is finite from the first tile on. */
            w->alpha[v] = (__m512)expw((vwf)_mm512_sub_ps(w->max[v], top));
            w->max[v] = top;
            __m512 sum = _mm512_mul_ps(w->sum[v], w->alpha[v]);
            __m512 p[KT];
            for (int j = 0; j < KT; ++j) {
                p[j] = _mm512_maskz_mov_ps(
                    keep[j], (__m512)expw((vwf)_mm512_sub_ps(w->s[j * MAX_QV + v], top)));
                sum = _mm512_add_ps(sum, p[j]);
            }
            w->sum[v] = sum;
            for (int k = 0; k < KT / 2; ++k)
                w->pp[k * MAX_QV + v] = _mm512_permutexvar_epi16(
                    pair_order, (__m512i)_mm512_cvtne2ps_pbh(p[2 * k + 1], p[2 * k]));
        }
        for (int v0 = 0; v0 < nq; v0 += 3)
            switch (nq - v0 < 3 ? nq - v0 : 3) {
            case 1: weigh_dims(w->o, w->alpha, w->pp, w->vp, head_dim, v0, 1); break;
            case 2: weigh_dims(w->o, w->alpha, w->pp, w->vp, head_dim, v0, 2); break;
            default: weigh_dims(w->o, w->alpha, w->pp, w->vp, head_dim, v0, 3); break;
            }
    }
    const float *o = (const float *)w->o, *sum = (const float *)w->sum;
    for (int64_t m = 0; m < queries; ++m) {
        float *row = out + (start + first_row + m / group) * out_stride +
                     (h * group + m % group) * head_dim;
        const float inv = 1.0f / sum[m];
        for (int64_t d = 0; d < head_dim; ++d) row[d] = o[d * MAX_QUERIES + m] * inv;
    }
}
#endif

#if PROMPT_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "prompt_amx.h"
#define PROMPT_AMX 1
#else
#define PROMPT_AMX 0
#endif

#define ITEMS_PER_THREAD 4
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

/* The path ts_prompt_attention takes for these shapes: 2 AMX tiles, 1 vdpbf16ps, 0 the
 * float32 one (per query row). */
int ts_prompt_attention_path(int64_t kv_bf16, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim) {
    if (!ts_prompt_attention_native(kv_bf16, num_heads, num_kv_heads, head_dim)) return 0;
#if PROMPT_AMX
    if (head_dim % 32 == 0 && amx_permitted()) return 2;
#endif
    return 1;
}

/* Returns 0, -1 if scratch memory could not be allocated. */
int ts_prompt_attention(float *out, int64_t out_stride, const float *query,
                        int64_t query_stride, const void *key_cache, const void *value_cache,
                        const int64_t *chunks, const int64_t *block_tables,
                        int64_t block_table_stride, int64_t num_chunks, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        float scale, int64_t kv_bf16) {
    const int64_t group = num_heads / num_kv_heads;
    const int native = ts_prompt_attention_native(kv_bf16, num_heads, num_kv_heads, head_dim);
    int amx = 0;
#if PROMPT_AMX
    amx = ts_prompt_attention_path(kv_bf16, num_heads, num_kv_heads, head_dim) == 2;
#endif
    /* AMX items take as many of a chunk's rows as keep ITEMS_PER_THREAD items per thread
     * (each item packs every key tile its rows see: fewer, longer items pack less). */
    const int64_t pairs = num_chunks * num_kv_heads;
    const int64_t pieces = (ITEMS_PER_THREAD * omp_get_max_threads() + pairs - 1) / pairs;
    int64_t num_items = 0, max_seq_len = 0, max_rows = 1;
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t q_len = chunks[3 * c + 1] - chunks[3 * c];
        const int64_t tile = item_rows(amx, group, q_len, pieces);
        num_items += (q_len + tile - 1) / tile;
        max_seq_len = chunks[3 * c + 2] > max_seq_len ? chunks[3 * c + 2] : max_seq_len;
        max_rows = tile > max_rows ? tile : max_rows;
    }
    PromptItem *items = (PromptItem *)malloc(sizeof(PromptItem) * (size_t)(num_items + 1));
    if (items == NULL) return -1;
    int64_t n = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t q_len = chunks[3 * c + 1] - chunks[3 * c];
        const int64_t tile = item_rows(amx, group, q_len, pieces);
        for (int64_t r = 0; r < q_len; r += tile) {
            const int64_t rows = q_len - r < tile ? q_len - r : tile;
            /* work: rows times the keys the last of them sees */
            items[n++] = (PromptItem){c, r, rows, rows * (chunks[3 * c + 2] - q_len + r + rows)};
        }
    }
    /* The items with the most keys first, so the dynamic schedule ends evenly. */
    qsort(items, (size_t)n, sizeof *items, by_work_descending);
    int failed = 0;
#pragma omp parallel
    {
        void *scratch = NULL;
#if PROMPT_AMX
        if (amx) scratch = amx_scratch((max_rows * group + 15) / 16 * 16, head_dim);
        else
#endif
#if PROMPT_BF16
        if (native) scratch = aligned_alloc(64, sizeof(Bf16Scratch));
#endif
        if (!native) scratch = malloc(sizeof(float) * (size_t)(group * max_seq_len));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n * num_kv_heads; ++i) {
            const PromptItem *item = items + i / num_kv_heads;
            const int64_t h = i % num_kv_heads, c = item->chunk;
            const int64_t start = chunks[3 * c], q_len = chunks[3 * c + 1] - start;
            const int64_t seq_len = chunks[3 * c + 2];
            const int64_t *table = block_tables + c * block_table_stride;
            if (scratch == NULL) continue;
#if PROMPT_AMX
            if (amx) {
                prompt_item_amx(out, out_stride, query, query_stride, key_cache, value_cache,
                                table, start, q_len, seq_len, item->first_row, item->rows, h,
                                num_heads, num_kv_heads, head_dim, block_size, scale,
                                (AmxScratch *)scratch);
                continue;
            }
#endif
#if PROMPT_BF16
            if (native) {
                prompt_item_bf16(out, out_stride, query, query_stride, key_cache, value_cache,
                                 table, start, q_len, seq_len, item->first_row, item->rows, h,
                                 num_heads, num_kv_heads, head_dim, block_size, scale,
                                 (Bf16Scratch *)scratch);
                continue;
            }
#endif
            for (int64_t r = item->first_row; r < item->first_row + item->rows; ++r) {
                const int64_t row = start + r;
                decode_item(out + row * out_stride, query + row * query_stride, key_cache,
                            value_cache, table, seq_len - q_len + r + 1, h, num_heads,
                            num_kv_heads, head_dim, block_size, scale, (float *)scratch,
                            kv_bf16);
            }
        }
        if (!amx) free(scratch); /* the AMX scratch is the thread's, kept */
    }
    free(items);
    return failed ? -1 : 0;
}
