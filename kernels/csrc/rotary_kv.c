/* Rotary embedding and the KV-cache store of one attention layer, in one pass over a fused QKV
 * projection's rows: q and k rotated (the half-split form: [x1 | x2] -> [x1 c - x2 s | x2 c + x1 s]
 * over the first 2 * half dims, the rest passed through), q in place, k and v written to their
 * cache slots. In a decode step these were about ten small torch calls per layer, each costing
 * more dispatch than arithmetic.
 * Spec: kernels/rotary.py's reference (apply_rotary, then store_kv). For bf16 data each product
 * and each sum is rounded to bf16 as torch's bf16 ops round them, so the results agree bit for
 * bit; a cache of another dtype gets the rotated values converted as `.to(cache dtype)` does. */
#include "common.h"

static inline __attribute__((always_inline)) void rotate_head(
    void *x, const void *cos, const void *sin, int64_t half, const int data_bf16) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        float x1 = ps_load(x, i, data_bf16), x2 = ps_load(x, half + i, data_bf16);
        float c = ps_load(cos, i, data_bf16), s = ps_load(sin, i, data_bf16);
        float a = x1 * c, b = x2 * s, d = x2 * c, e = x1 * s;
        if (data_bf16) {
            a = ps_round_bf16(a), b = ps_round_bf16(b), d = ps_round_bf16(d), e = ps_round_bf16(e);
        }
        ps_store(x, i, a - b, data_bf16);
        ps_store(x, half + i, d + e, data_bf16);
    }
}

static inline __attribute__((always_inline)) void copy_head(
    void *dst, const void *src, int64_t head_dim, const int data_bf16, const int kv_bf16) {
#pragma omp simd
    for (int64_t i = 0; i < head_dim; i++)
        ps_store(dst, i, ps_load(src, i, data_bf16), kv_bf16);
}

static inline __attribute__((always_inline)) void rotary_store_row(
    char *row, const char *cos, const char *sin, char *key_slot, char *value_slot,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t half,
    const int data_bf16, const int kv_bf16) {
    const int64_t item = data_bf16 ? 2 : 4, kv_item = kv_bf16 ? 2 : 4;
    for (int64_t h = 0; h < num_heads + num_kv_heads; h++)
        rotate_head(row + h * head_dim * item, cos, sin, half, data_bf16);
    const char *key = row + num_heads * head_dim * item;
    const char *value = key + num_kv_heads * head_dim * item;
    for (int64_t h = 0; h < num_kv_heads; h++) {
        copy_head(key_slot + h * head_dim * kv_item, key + h * head_dim * item, head_dim,
                  data_bf16, kv_bf16);
        copy_head(value_slot + h * head_dim * kv_item, value + h * head_dim * item, head_dim,
                  data_bf16, kv_bf16);
    }
}

/* qkv: [num_tokens, qkv_stride] rows of [q heads | k heads | v heads], each head_dim wide; cos,
 * sin: [num_tokens, half] at rows cs_stride apart (one position's table row each); slots: int64
 * [num_tokens], each < num_slots; kv_cache: [2, num_slots, num_kv_heads, head_dim] (the paged
 * cache's blocks flattened). dtypes: PS_BF16_DATA for qkv, cos and sin, PS_BF16_KV for the cache. */
int pagedserve_rotary_store_kv(void *qkv, int64_t qkv_stride, const void *cos, const void *sin,
                               int64_t cs_stride, const int64_t *slots, void *kv_cache,
                               int64_t num_slots, int64_t num_tokens, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t half, int dtypes,
                               int num_threads) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return PS_BAD_SLOT;
    const int data_bf16 = dtypes & PS_BF16_DATA, kv_bf16 = dtypes & PS_BF16_KV;
    const int64_t item = data_bf16 ? 2 : 4, kv_item = kv_bf16 ? 2 : 4;
    const int64_t slot_bytes = num_kv_heads * head_dim * kv_item;
    char *keys = (char *)kv_cache, *values = keys + num_slots * slot_bytes;
    int64_t work = num_tokens * (num_heads + 3 * num_kv_heads) * head_dim;
#pragma omp parallel for num_threads(ps_threads(work, PS_GRAIN, num_threads))
    for (int64_t t = 0; t < num_tokens; t++) {
        char *row = (char *)qkv + t * qkv_stride * item;
        const char *c = (const char *)cos + t * cs_stride * item;
        const char *s = (const char *)sin + t * cs_stride * item;
        char *key_slot = keys + slots[t] * slot_bytes, *value_slot = values + slots[t] * slot_bytes;
        if (data_bf16 && kv_bf16)
            rotary_store_row(row, c, s, key_slot, value_slot, num_heads, num_kv_heads, head_dim, half, 1, 1);
        else if (data_bf16)
            rotary_store_row(row, c, s, key_slot, value_slot, num_heads, num_kv_heads, head_dim, half, 1, 0);
        else if (kv_bf16)
            rotary_store_row(row, c, s, key_slot, value_slot, num_heads, num_kv_heads, head_dim, half, 0, 1);
        else
            rotary_store_row(row, c, s, key_slot, value_slot, num_heads, num_kv_heads, head_dim, half, 0, 0);
    }
    return PS_OK;
}
