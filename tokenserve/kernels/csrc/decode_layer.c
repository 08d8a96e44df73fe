/*
 * One Llama decoder layer of a step with few rows, in one call.
 *
 * A step of a few requests has little work per operator. Called one by one from Python,
 * each of a layer's ten operators pays for the call, its checks and a fork and join of the
 * OpenMP threads, a sizeable share of such a step (docs/benchmarks/cpu-hot-path.md). Here
 * the whole layer runs in one parallel region: the operators are the very functions of
 * layer_ops.c, paged_attention.c, prompt_attention.c and quant_linear.c (included below, so
 * the arithmetic and its order are the same and the results identical to calling them one
 * by one), separated by the barriers of their `omp for` loops.
 *
 * The layer: x = rms_norm(hidden (+ residual)); qkv = x · Wqkvᵀ (+ bias); rotary on q and
 * k; k and v into their cache slots; attention (the decode rows' paged decode items and the
 * prompt chunks' items, prompt_attention.c's, claimed by the threads in turn); o = attn · Woᵀ;
 * x = rms_norm(o + residual); gate_up = x · Wguᵀ; out = silu_and_mul(gate_up) · Wdownᵀ.
 * The four projections are in GGUF blocks (quant_linear.c's layouts), each product on the
 * few-row or the many-row kernel as linear() would pick, or for a bfloat16 model on the amx
 * level on the AMX kernel (quant_amx.h, bf16 numerics). A row is one token of the step: a
 * decode row (its index among them in decode_rows) or a row of a prompt chunk.
 */
#define _GNU_SOURCE /* syscall(), for the AMX permission (amx.h, via quant_linear.c) */
#include "layer_ops.c"
#include "prompt_attention.c" /* and paged_attention.c, which it includes */
#include "quant_linear.c"

/* A projection: [out, in] in Q4_1 (q4_1 = 1) or Q8_0 blocks, and an optional bias [out].
 * Products of more than few_rows rows take the many-row (panel) kernel, as linear() sends
 * them (out a multiple of PANEL there); with amx = 1 those take the AMX kernel instead
 * (out a multiple of AMX_PANEL; the amx level only). With dp = 1 (the avx512_bf16 level
 * only) every product takes the vdpbf16ps kernel: up to few_rows rows its dot-product form,
 * more its panel form. Products of at most i8 rows (x86-64 levels) take the kernel of x
 * rounded to 8 bits instead of all of those. */
typedef struct {
    const uint8_t *qs;
    const float *scales;
    const float *bias;
    int64_t out, in, q4_1, few_rows, amx, dp;
    /* Products of at most i8 rows: x rounded to 8 bits (quant_i8.h), the weight read from
     * i8_weight, its copy in that kernel's layout (i8_repack). */
    int64_t i8;
    const uint8_t *i8_weight;
} ts_projection;

/* What a layer holds. */
typedef struct {
    ts_projection qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* RMSNorm weights [hidden] */
    void *key_cache, *value_cache;       /* [blocks, kv_heads, block_size, head_dim] */
} ts_layer;

/* What every layer of the step shares: shapes, the rows' positions and cache slots, the
 * decode rows (their indices among the step's rows, block tables and context lengths) and
 * the prompt chunks (prompt_attention.c's chunk table and block tables), the rotary
 * tables, and scratch buffers. */
typedef struct {
    int64_t num_rows, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t block_size, kv_mode, block_table_stride, max_seq_len; /* kv_mode: decode_item_then's */
    float eps, scale;
    const int64_t *positions, *slots;         /* [num_rows] */
    const int64_t *block_tables, *seq_lens;   /* the decode rows' */
    const float *cos, *sin;                   /* [max_position, head_dim] */
    float *normed;  /* [rows, hidden] */
    float *qkv;     /* [rows, (heads + 2 kv_heads) * head_dim] */
    float *attn;    /* [rows, heads * head_dim] */
    float *o;       /* [rows, hidden] */
    float *gate_up; /* [rows, 2 intermediate] */
    float *act;     /* [rows, intermediate] */
    const int64_t *decode_rows;               /* [num_decode_rows] row indices */
    int64_t num_decode_rows;
    const int64_t *chunks, *chunk_tables;     /* [num_chunks, 3], [num_chunks, stride] */
    int64_t num_chunks, chunk_table_stride, prompt_kv; /* prompt_kv: ts_prompt_attention's */
    int64_t decode_prefetch; /* decode_items' prefetch */
    /* Positions the contexts of the first prefix_rows decode rows share (whole blocks; 0:
     * none), and with them the shared-prefix path's buffers (prompt_attention.c): the prefix
     * half's output [prefix_rows, heads * head_dim], and both halves' log-sum-exps
     * [prefix_rows, heads]. */
    int64_t prefix_len, prefix_rows;
    float *prefix_out, *prefix_lse, *suffix_lse;
    /* 1: where decode_split_at says, each decode row's context in two halves (DecodeSplit);
     * 0: never (a row's attention then does not depend on what else the step holds). */
    int64_t split_decode;
} ts_decode_step;

static void add_bias(float *y, int64_t M, const ts_projection *w) {
    if (w->bias == NULL) return;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < w->out; ++n) y[m * w->out + n] += w->bias[n];
}

/* `panel` and `sums` (M * PANEL floats) are the calling thread's, for the many-row kernel;
 * `xp` (x packed, shared) and `a` (the thread's expanded panel) the AMX kernel's and the
 * vdpbf16ps kernel's panel form's; `xr` the rounded x of the 8-bit kernel: up to
 * I8_SHARED_ROUND_ROWS rows the thread's, which every thread rounds for itself (a few rows:
 * cheaper than a barrier), above it shared, the threads rounding its rows together. */
static void project(float *y, const float *x, int64_t M, const ts_projection *w, float *panel,
                    float *sums, uint16_t *xp, uint16_t *a, uint8_t *xr) {
#if QUANT_I8
    if (M <= w->i8) {
        if (M > I8_SHARED_ROUND_ROWS)
            i8_round_rows_shared(xr, x, M, w->in, (int)w->q4_1);
        else
            i8_round_rows(xr, x, M, w->in, (int)w->q4_1);
        i8_columns(y, xr, M, w->in, w->out, w->i8_weight, (int)w->q4_1);
        add_bias(y, M, w);
        return;
    }
#else
    (void)xr;
#endif
#if QUANT_AMX
    if (w->amx && M > w->few_rows) {
        /* In rounds of amx_round_rows, as ts_quant_linear_amx takes them: a round's
         * packed rows stay in L2 while every panel streams them. */
        const int64_t round = amx_round_rows(w->in);
        for (int64_t m0 = 0; m0 < M; m0 += round) {
            const int64_t rows = M - m0 < round ? M - m0 : round;
            amx_pack_rows(xp, x + m0 * w->in, 0, rows, w->in);
            amx_columns(y + m0 * w->out, 0, xp, rows, w->in, w->out, w->qs, w->scales,
                        (int)w->q4_1, a);
        }
    } else
#elif QUANT_DP
    if (w->dp) {
        dp_pack_rows(xp, x, M, w->in, (int)w->q4_1);
        if (M > w->few_rows)
            dp_panels(y, xp, M, w->in, w->out, w->qs, w->scales, (int)w->q4_1, (uint32_t *)a);
        else
            dp_columns(y, xp, M, w->in, w->out, w->qs, w->scales, (int)w->q4_1);
    } else
#else
    (void)xp, (void)a;
#endif
    if (M > w->few_rows)
        gemm_columns(y, x, M, w->in, w->out, w->qs, w->scales, (int)w->q4_1, panel, sums);
    else
        linear_columns(y, x, M, w->in, w->out, w->qs, w->scales, (int)w->q4_1);
    add_bias(y, M, w);
}

/* out [rows, hidden] = the layer applied to hidden [rows, hidden]. `residual` [rows, hidden]
 * is the residual stream before this layer's input is added; add_input = 0 for the first
 * layer, whose input is the stream itself (pass residual = hidden). Like the operators one
 * by one, residual ends as the stream before `out` is added. Returns 0, 1 for shapes the
 * kernels refuse, -1 if a scratch buffer could not be allocated. */
int ts_decode_layer(const ts_layer *layer, const ts_decode_step *step, float *hidden,
                    float *residual, int64_t add_input, float *out) {
    const int64_t M = step->num_rows, H = step->hidden, D = step->head_dim;
    const int64_t q_size = step->num_heads * D, kv_size = step->num_kv_heads * D;
    const int64_t qkv_width = q_size + 2 * kv_size;
    const int64_t group = step->num_heads / step->num_kv_heads;
    const ts_projection *projections[] = {&layer->qkv, &layer->o, &layer->gate_up,
                                          &layer->down};
    int64_t amx = 0, dp = 0, dp_panels = 0, widest = 0, i8 = 0;
    for (int i = 0; i < 4; ++i) {
        if (projections[i]->in % BLOCK || (M > projections[i]->few_rows &&
                                           projections[i]->out % PANEL))
            return 1;
        widest = projections[i]->in > widest ? projections[i]->in : widest;
        if (M <= projections[i]->i8) {
            if (!QUANT_I8 || projections[i]->i8_weight == NULL) return 1;
            i8 = 1;
            continue; /* neither the AMX nor the vdpbf16ps kernel's scratch */
        }
        amx |= projections[i]->amx;
        dp |= projections[i]->dp;
        dp_panels |= projections[i]->dp && M > projections[i]->few_rows;
    }
#if QUANT_AMX
    if (amx && !amx_permitted()) return 1;
#else
    if (amx) return 1;
#endif
    if (dp && !QUANT_DP) return 1;
    if (layer->qkv.out != qkv_width || layer->o.out != H ||
        layer->gate_up.out != 2 * step->intermediate || layer->down.out != H)
        return 1;
    /* The prompt chunks' attention items, for every thread to claim from. */
    PromptPlan plan = {0};
    if (step->num_chunks > 0 &&
        prompt_plan(&plan, step->chunks, step->num_chunks, step->chunk_tables,
                    step->chunk_table_stride, step->block_size, step->num_heads,
                    step->num_kv_heads, D, step->prompt_kv))
        return -1;
    /* The AMX or vdpbf16ps kernel's x, packed once per product for all threads. */
    uint16_t *xp = amx || dp ? (uint16_t *)aligned_alloc(
                                   64, (size_t)((M + 15) / 16 * 16 * widest * 2))
                             : NULL;
    if ((amx || dp) && xp == NULL) {
        free(plan.items);
        return -1;
    }
#if QUANT_I8
    /* The 8-bit kernel's rounded x for M rows of the widest input: shared above
     * I8_SHARED_ROUND_ROWS rows (allocated here), else each thread's own (below). */
    const size_t xr_bytes = (size_t)((M * i8_row_bytes(widest) + 63) / 64 * 64);
    uint8_t *xr_shared = i8 && M > I8_SHARED_ROUND_ROWS
                             ? (uint8_t *)aligned_alloc(64, xr_bytes)
                             : NULL;
    if (i8 && M > I8_SHARED_ROUND_ROWS && xr_shared == NULL) {
        free(plan.items);
        free(xp);
        return -1;
    }
#else
    uint8_t *const xr_shared = NULL;
#endif
    const int64_t decode_len = step->max_seq_len > 0 ? step->max_seq_len : 1;
    /* Whether gate_up's sums are bf16 values (the AMX or vdpbf16ps kernel's, no bias added
     * after): SwiGLU then reads silu from the table (silu_and_mul_row_bf16_valued). */
    const ts_projection *gate_up = &layer->gate_up;
    const int bf16_gates = gate_up->bias == NULL && M > gate_up->i8 &&
                           (gate_up->dp || (gate_up->amx && M > gate_up->few_rows));
    (void)bf16_gates;
    int failed = 0;
    int64_t claimed = 0; /* decode_items' */
    /* The shared prefix of the first prefix_rows decode rows (prompt_attention.c): the
     * positions their decode items skip, and the rows per prefix item. */
    const int64_t prefix = step->prefix_len > 0 && step->prefix_rows > 0 &&
                                   step->prefix_rows <= step->num_decode_rows &&
                                   ts_decode_prefix_available(step->kv_mode, step->num_heads,
                                                              step->num_kv_heads, D,
                                                              step->block_size)
                               ? step->prefix_len
                               : 0;
    const int64_t prefix_rows = prefix ? step->prefix_rows : 0;
    const int64_t item_rows = prefix ? prefix_item_rows(prefix_rows, group, step->num_kv_heads,
                                                        omp_get_max_threads())
                                     : 0;
    /* Few decode items on the threads: each row's context in two halves, the first halves'
     * outputs and both halves' log-sum-exps here. */
    DecodeSplit split;
    float *suffix_lse = step->suffix_lse;
    if (decode_split_init(&split,
                          prefix || !step->split_decode
                              ? 0
                              : decode_split_at(step->num_decode_rows, step->num_kv_heads,
                                                step->seq_lens, step->block_size,
                                                omp_get_max_threads(), step->kv_mode, D),
                          step->num_decode_rows, step->num_heads, q_size, &suffix_lse)) {
        free(plan.items);
        free(xp);
        free(xr_shared);
        return -1;
    }
#pragma omp parallel
    {
        _Alignas(64) float panel[PANEL_K * PANEL];
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * decode_len));
#if PREFIX_AMX
        /* The thread's AMX scratch is one buffer, kept (amx_scratch): first asked for the
         * larger of both needs, so that the prompt items' request below hands back the same. */
        AmxScratch *prefix_scratch = NULL;
        if (prefix) {
            const int64_t need = item_rows * group, prompt = plan.amx ? plan.max_queries : 0;
            prefix_scratch = amx_scratch(((need > prompt ? need : prompt) + 15) / 16 * 16, D);
            if (prefix_scratch == NULL) {
#pragma omp atomic write
                failed = 1;
            }
        }
#endif
        void *attn_scratch = plan.num_items ? prompt_scratch(&plan) : NULL;
        float *sums = (float *)malloc(sizeof(float) * (size_t)(M * PANEL));
#if QUANT_DP
        const int64_t a_rows = dp_panels ? DP_PANEL_COLS : 0;
#else
        const int64_t a_rows = amx ? 32 : 0; /* amx_columns: two panels of 16 weight rows */
#endif
        uint16_t *a = a_rows ? (uint16_t *)aligned_alloc(64, (size_t)(a_rows * widest * 2)) : NULL;
#if QUANT_I8
        uint8_t *own = i8 && xr_shared == NULL ? (uint8_t *)aligned_alloc(64, xr_bytes) : NULL;
        uint8_t *xr = xr_shared != NULL ? xr_shared : own;
#else
        uint8_t *own = NULL, *xr = NULL;
#endif
        if (scores == NULL || sums == NULL || (a_rows && a == NULL) || (i8 && xr == NULL) ||
            (plan.num_items && attn_scratch == NULL)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r)
            rms_norm_row(step->normed + r * H, add_input ? hidden + r * H : residual + r * H,
                         add_input ? residual + r * H : NULL, layer->input_norm, H, step->eps);
        project(step->qkv, step->normed, M, &layer->qkv, panel, sums, xp, a, xr);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r) {
            float *q = step->qkv + r * qkv_width;
            rotary_token(q, q + q_size, step->positions[r], step->cos, step->sin,
                         step->num_heads, step->num_kv_heads, D);
            write_kv_token(layer->key_cache, layer->value_cache, q + q_size,
                           q + q_size + kv_size, step->slots[r], step->num_kv_heads,
                           step->block_size, D, step->kv_mode);
        }
#if PREFIX_AMX
        if (prefix)
            prefix_items(step->prefix_out, q_size, step->prefix_lse, step->qkv, qkv_width,
                         step->decode_rows, prefix_rows, item_rows,
                         layer->key_cache, layer->value_cache, step->block_tables, prefix,
                         step->num_heads, step->num_kv_heads, D, step->block_size,
                         step->scale, step->kv_mode, prefix_scratch);
#endif
        decode_items(&claimed, step->attn, q_size, step->qkv, qkv_width, step->decode_rows,
                     layer->key_cache, layer->value_cache, step->block_tables,
                     step->block_table_stride, step->seq_lens, step->num_decode_rows,
                     step->num_heads, step->num_kv_heads, D, step->block_size, step->scale,
                     scores, step->kv_mode, step->decode_prefetch, prefix, prefix_rows,
                     suffix_lse, split.at > 0 ? &split : NULL);
        if (plan.num_items)
            prompt_items(&plan, attn_scratch, step->attn, q_size, step->qkv, qkv_width,
                         layer->key_cache, layer->value_cache, step->chunks,
                         step->chunk_tables, step->chunk_table_stride, step->num_heads,
                         step->num_kv_heads, D, step->block_size, step->scale,
                         step->prompt_kv);
#pragma omp barrier
        if (prefix)
            merge_attention(step->attn, q_size, step->decode_rows, step->prefix_out, q_size,
                            step->prefix_lse, step->suffix_lse, prefix_rows, step->num_heads,
                            D);
        if (split.at > 0)
            merge_attention(step->attn, q_size, step->decode_rows, split.out, q_size, split.lse,
                            suffix_lse, step->num_decode_rows, step->num_heads, D);
        project(step->o, step->attn, M, &layer->o, panel, sums, xp, a, xr);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r)
            rms_norm_row(step->normed + r * H, step->o + r * H, residual + r * H,
                         layer->post_norm, H, step->eps);
        project(step->gate_up, step->normed, M, &layer->gate_up, panel, sums, xp, a, xr);
#if TS_SILU_TABLE
        if (bf16_gates) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; ++r)
                silu_and_mul_row_bf16_valued(step->act + r * step->intermediate,
                                             step->gate_up + r * 2 * step->intermediate,
                                             step->intermediate);
        } else
#endif
        {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; ++r)
                silu_and_mul_row(step->act + r * step->intermediate,
                                 step->gate_up + r * 2 * step->intermediate, step->intermediate);
        }
        project(out, step->act, M, &layer->down, panel, sums, xp, a, xr);
        free(scores);
        free(sums);
        free(a);
        free(own);
        if (attn_scratch != NULL) prompt_scratch_free(&plan, attn_scratch);
    }
    free(xp);
    free(xr_shared);
    free(plan.items);
    free(split.out);
    return failed ? -1 : 0;
}

/* The step's layers in turn, in one call instead of one per layer (each layer as
 * ts_decode_layer). Layer 0 reads `hidden`, the residual stream itself; the layers' outputs
 * then take turns between `out` and `spare`, each layer reading the one before's. *last: 0
 * where the last layer's output is in `out`, 1 where it is in `spare`. Returns the first
 * failing layer's status (see ts_decode_layer), 0 when all ran. */
int ts_decode_layers(const ts_layer *const *layers, int64_t num_layers,
                     const ts_decode_step *step, float *hidden, float *residual, float *out,
                     float *spare, int64_t *last) {
    float *input = hidden, *output = out;
    for (int64_t i = 0; i < num_layers; ++i) {
        const int status = ts_decode_layer(layers[i], step, input, residual, i > 0, output);
        if (status != 0) return status;
        float *next = i == 0 ? spare : input; /* hidden is the stream: never written */
        input = output;
        output = next;
    }
    *last = input == spare;
    return 0;
}
