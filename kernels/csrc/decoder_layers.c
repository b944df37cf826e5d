/* A step through a whole stack of Llama-style decoder layers in one call: for each layer,
 * the same kernels with the same arguments, in the same order, as the model's Python forward
 * (replicas/models/llama.py) makes them one call at a time, so the results are bit for bit that
 * forward's; kernels/decoder_layers.py says when a model and a step qualify.
 *
 * Why: at batch 1 the model's Python between kernels (module calls, argument checks, result
 * tensors) cost a large share of the default model's decode step, beside nine or so kernel calls
 * a layer that each do little work (bench/decode_stack.py). Steps with prefills
 * take it too: under streaming load most steps are a prefill chunk beside the decodes, and on a
 * small model the layer loop made those steps the engine's slowest.
 *
 * Per layer, with hidden [T, H] and residual [T, H] carried in place (T tokens of the step's
 * sequences: one each for decodes, a chunk each for prefills):
 *   residual += hidden; hidden = rms_norm(residual) * input_norm      (layer 0: residual = hidden,
 *                                                                      then the plain norm)
 *   qkv = hidden . Wqkv^T (+ b)            the projection's packed GEMM (csrc/gemm*.c)
 *   rotate q, k in qkv; store k, v          csrc/rotary_kv.c
 *   attn = decode attention of q            csrc/paged_attention.c: the decodes' rows
 *          then prefill attention of q      csrc/prefill_attention.c: the prefills' rows
 *   hidden = attn . Wo^T (+ b)
 *   residual += hidden; hidden = rms_norm(residual) * post_norm
 *   gate_up = hidden . Wgu^T (+ b); act = silu(gate) * up; hidden = act . Wdown^T (+ b)
 * The caller applies the final norm.
 *
 * With LoRA adapters (`lora` not NULL), each projection's output gets its rows' adapter deltas
 * right after its GEMM, part by part (q, k, v of the fused qkv; gate, up), by csrc/lora.c: the
 * same kernel, in the same order, as the layer loop's Linear.forward then adds them. */
#include <string.h>

#include "common.h"
#include "lora.h"

/* One projection's fields in a layer's row of `layers` (int64 each): its kernel, the weight's
 * packing (quantized: q and so; dense: the packed panels in DP_W), the bias or 0, and the kernel's
 * dtypes bits (and, quantized, bits and group size). */
enum { DP_KIND, DP_W, DP_SO, DP_BIAS, DP_DTYPES, DP_BITS, DP_GROUP, DP_FIELDS };
enum { KIND_QUANT, KIND_FP32, KIND_BF16 };  /* csrc/gemm_q.c, csrc/gemm.c, csrc/gemm_bf16.c */
enum { PROJ_QKV, PROJ_O, PROJ_GATE_UP, PROJ_DOWN, PROJ_COUNT };
/* A layer's row: its two norm weights, then its projections. */
enum { DL_INPUT_NORM, DL_POST_NORM, DL_PROJ, DL_FIELDS = DL_PROJ + PROJ_COUNT * DP_FIELDS };
/* The step's shape (`step`, int64 each). */
enum {
    DS_LAYERS, DS_TOKENS, DS_SEQS, DS_TABLE_WIDTH, DS_HIDDEN, DS_HEADS, DS_KV_HEADS, DS_HEAD_DIM,
    DS_ROTARY_HALF, DS_CS_STRIDE, DS_INTER, DS_NUM_BLOCKS, DS_BLOCK_SIZE, DS_NORM_DTYPES,
    DS_DATA_DTYPES, DS_FIELDS
};

/* `lora`: a header, then per layer and projection LORA_PARTS parts of LP_FIELDS each (a part whose
 * a is 0 is absent). The header: the step's token_slots (int32 [T], -1: no adapter), the slots,
 * the slot rank, the weights' dtype bits. A part: its A [slots, rank, k], B^T [slots, rank, n],
 * ranks int32 [slots], its n and its first output column. */
enum { LH_TOKEN_SLOTS, LH_SLOTS, LH_RANK, LH_DTYPES, LH_FIELDS };
enum { LP_A, LP_B_T, LP_RANKS, LP_N, LP_OFFSET, LP_FIELDS };
enum { LORA_PARTS = 3, LORA_LAYER_FIELDS = PROJ_COUNT * LORA_PARTS * LP_FIELDS };

static int add_lora(const int64_t *lora, int64_t l, int proj, void *out, int64_t out_n, const void *x,
                    int64_t rows, int64_t k, int data_dtypes, int num_threads) {
    if (!lora) return PS_OK;
    const int64_t *part = lora + LH_FIELDS + l * LORA_LAYER_FIELDS + proj * LORA_PARTS * LP_FIELDS;
    int64_t elem = data_dtypes & PS_BF16_DATA ? 2 : 4;
    int dtypes = (data_dtypes & PS_BF16_DATA) | (int)lora[LH_DTYPES];
    for (int p = 0; p < LORA_PARTS; p++, part += LP_FIELDS) {
        if (!part[LP_A]) continue;
        int status = ps_lora_delta((char *)out + part[LP_OFFSET] * elem, out_n, x, k,
                                   (const int32_t *)(intptr_t)lora[LH_TOKEN_SLOTS],
                                   (const void *)(intptr_t)part[LP_A],
                                   (const void *)(intptr_t)part[LP_B_T],
                                   (const int32_t *)(intptr_t)part[LP_RANKS], rows, k, part[LP_N],
                                   lora[LH_SLOTS], lora[LH_RANK], dtypes, NULL, num_threads);
        if (status != PS_OK) return status;
    }
    return PS_OK;
}

static int project(const int64_t *layer, int proj, void *out, const void *x, int64_t rows, int64_t n,
                   int64_t k, int num_threads) {
    const int64_t *p = layer + DL_PROJ + proj * DP_FIELDS;
    const void *w = (const void *)(intptr_t)p[DP_W], *bias = (const void *)(intptr_t)p[DP_BIAS];
    switch (p[DP_KIND]) {
    case KIND_QUANT:
        return pagedserve_quant_linear(out, x, k, NULL, w, (const void *)(intptr_t)p[DP_SO], bias,
                                       (int)p[DP_DTYPES], (int)p[DP_BITS], p[DP_GROUP], rows, n, k,
                                       num_threads);
    case KIND_FP32:
        return pagedserve_linear(out, x, k, w, bias, rows, n, k, num_threads);
    case KIND_BF16:
        return pagedserve_linear_bf16(out, x, k, w, bias, (int)p[DP_DTYPES], rows, n, k, num_threads);
    }
    return PS_UNSUPPORTED;
}

#define PS_TRY(call)                          \
    do {                                      \
        int status_ = (call);                 \
        if (status_ != PS_OK) return status_; \
    } while (0)

/* hidden, residual: [T, H] in the data dtype (fp32, or bf16 where DS_DATA_DTYPES has
 * PS_BF16_DATA); scratch: T * (qkv width + heads * head_dim + 3 * inter) elements of it;
 * layers: [layers, DL_FIELDS]; kv_caches: [layers] pointers to [2, num_blocks, block_size,
 * kv_heads, head_dim] caches (PS_BF16_KV: bf16); cos, sin: the step's rotary rows (cs_stride
 * apart); slots: int64 [T]; block_tables, seq_lens, query_start_loc as the attention kernels';
 * a step with prefills (T > sequences) needs a head_dim the prefill kernel takes (a multiple of
 * 16); residual's contents are not read; lora: the adapters' table (above), or NULL. Returns
 * the first kernel status that is not PS_OK. */
int pagedserve_decoder_layers(void *hidden, void *residual, void *scratch, const int64_t *layers,
                              const int64_t *kv_caches, const int64_t *step, const void *cos,
                              const void *sin, const int64_t *slots, const int32_t *block_tables,
                              const int32_t *seq_lens, const int32_t *query_start_loc,
                              const int64_t *lora, float eps, float scale, int num_threads) {
    int64_t tokens = step[DS_TOKENS], h = step[DS_HIDDEN], heads = step[DS_HEADS];
    int64_t kv_heads = step[DS_KV_HEADS], head_dim = step[DS_HEAD_DIM], inter = step[DS_INTER];
    int64_t q_size = heads * head_dim, qkv_n = (heads + 2 * kv_heads) * head_dim;
    int64_t num_blocks = step[DS_NUM_BLOCKS], block_size = step[DS_BLOCK_SIZE];
    int norm_dtypes = (int)step[DS_NORM_DTYPES], data_dtypes = (int)step[DS_DATA_DTYPES];
    int64_t elem = data_dtypes & PS_BF16_DATA ? 2 : 4;
    char *qkv = scratch, *attn = qkv + tokens * qkv_n * elem, *gate_up = attn + tokens * q_size * elem;
    char *act = gate_up + tokens * 2 * inter * elem;
    if (tokens == 0) return PS_OK;
    int prefills = 0;
    for (int64_t s = 0; s < step[DS_SEQS] && !prefills; s++)
        prefills = query_start_loc[s + 1] - query_start_loc[s] > 1;
    for (int64_t l = 0; l < step[DS_LAYERS]; l++) {
        const int64_t *layer = layers + l * DL_FIELDS;
        const void *input_norm = (const void *)(intptr_t)layer[DL_INPUT_NORM];
        const void *post_norm = (const void *)(intptr_t)layer[DL_POST_NORM];
        void *kv_cache = (void *)(intptr_t)kv_caches[l];
        if (l == 0) {
            memcpy(residual, hidden, (size_t)(tokens * h * elem));
            PS_TRY(pagedserve_rms_norm(hidden, residual, input_norm, tokens, h, eps, norm_dtypes,
                                       num_threads));
        } else {
            PS_TRY(pagedserve_fused_add_rms_norm(hidden, residual, input_norm, tokens, h, eps,
                                                 norm_dtypes, num_threads));
        }
        PS_TRY(project(layer, PROJ_QKV, qkv, hidden, tokens, qkv_n, h, num_threads));
        PS_TRY(add_lora(lora, l, PROJ_QKV, qkv, qkv_n, hidden, tokens, h, data_dtypes, num_threads));
        PS_TRY(pagedserve_rotary_store_kv(qkv, qkv_n, cos, sin, step[DS_CS_STRIDE], slots, kv_cache,
                                          num_blocks * block_size, tokens, heads, kv_heads, head_dim,
                                          step[DS_ROTARY_HALF], data_dtypes, num_threads));
        PS_TRY(pagedserve_paged_decode_attention(attn, qkv, qkv_n, kv_cache, num_blocks, block_size,
                                                 block_tables, step[DS_TABLE_WIDTH], seq_lens,
                                                 query_start_loc, step[DS_SEQS], tokens, heads,
                                                 kv_heads, head_dim, scale, 0, 0.0f, data_dtypes,
                                                 num_threads));
        if (prefills)  /* their rows, which the decode kernel left */
            PS_TRY(pagedserve_paged_prefill_attention(attn, qkv, qkv_n, kv_cache, num_blocks,
                                                      block_size, block_tables,
                                                      step[DS_TABLE_WIDTH], seq_lens,
                                                      query_start_loc, step[DS_SEQS], tokens, heads,
                                                      kv_heads, head_dim, scale, 0, 0.0f,
                                                      data_dtypes, num_threads));
        PS_TRY(project(layer, PROJ_O, hidden, attn, tokens, h, q_size, num_threads));
        PS_TRY(add_lora(lora, l, PROJ_O, hidden, h, attn, tokens, q_size, data_dtypes, num_threads));
        PS_TRY(pagedserve_fused_add_rms_norm(hidden, residual, post_norm, tokens, h, eps, norm_dtypes,
                                             num_threads));
        PS_TRY(project(layer, PROJ_GATE_UP, gate_up, hidden, tokens, 2 * inter, h, num_threads));
        PS_TRY(add_lora(lora, l, PROJ_GATE_UP, gate_up, 2 * inter, hidden, tokens, h, data_dtypes,
                        num_threads));
        PS_TRY(pagedserve_silu_and_mul(act, gate_up, tokens, inter, data_dtypes & PS_BF16_DATA,
                                       num_threads));
        PS_TRY(project(layer, PROJ_DOWN, hidden, act, tokens, h, inter, num_threads));
        PS_TRY(add_lora(lora, l, PROJ_DOWN, hidden, h, act, tokens, inter, data_dtypes, num_threads));
    }
    return PS_OK;
}
