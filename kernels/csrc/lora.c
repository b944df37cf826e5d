/* The batched multi-LoRA delta (punica's shrink / expand) on CPU: each row of a step adds its own
 * adapter's low-rank update, out[t] += (A[s] . x[t]) . Bt[s], s = token_slots[t] (-1: none).
 * Spec: kernels/reference.py's lora_delta_reference; wrapper: kernels/lora.py.
 *
 * One call serves a whole step whatever mix of adapters it holds. Rows are first grouped by slot
 * (a counting sort of their indices), so an adapter's A and Bt are read from cache for all of its
 * rows. Shrink, h[i] = A[s, :r] . x[row i], runs in parallel over (row, block of ranks): a block
 * reads the x row once for PS_LORA_RANK_BLOCK rows of A. Expand runs in parallel over (N chunk,
 * row), chunk-major, so a thread's slice of Bt stays in L1 across a slot's rows, and a lone decode
 * row still splits N over the threads; each output element sums its r terms in a register and
 * touches out once (one rounding for bf16). Rows of A or Bt past ranks[s] are never read. */
#include <stdlib.h>

#include "common.h"
#include "lora.h"

#define PS_LORA_RANK_BLOCK 4
#define PS_LORA_CHUNK 512 /* Bt columns per expand item: 16 ranks of fp32 fit L1 */
/* Output columns summed in registers at once: eight vector registers, independent FMAs enough to
 * hide their latency, half the register file. */
#if defined(__AVX512F__)
#define PS_LORA_TILE 128
#else
#define PS_LORA_TILE 64
#endif

size_t ps_lora_scratch_bytes(int64_t tokens, int64_t slots, int64_t max_rank) {
    return (size_t)(slots + 1 + tokens) * sizeof(int64_t) + (size_t)(tokens * max_rank) * sizeof(float);
}

/* h[c] = A row c . x for the `count` rows of A from `a` (k elements apart): four at once where
 * there are four, so x is loaded once for them. */
static inline __attribute__((always_inline)) void shrink_block(float *h, const void *x, const void *a,
                                                               int64_t k, int64_t count,
                                                               const int data_bf16, const int weight_bf16) {
    if (count == PS_LORA_RANK_BLOCK) {
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t i = 0; i < k; i++) {
            float v = ps_load(x, i, data_bf16);
            s0 = PS_FMA(v, ps_load(a, i, weight_bf16), s0);
            s1 = PS_FMA(v, ps_load(a, k + i, weight_bf16), s1);
            s2 = PS_FMA(v, ps_load(a, 2 * k + i, weight_bf16), s2);
            s3 = PS_FMA(v, ps_load(a, 3 * k + i, weight_bf16), s3);
        }
        h[0] = s0, h[1] = s1, h[2] = s2, h[3] = s3;
        return;
    }
    for (int64_t c = 0; c < count; c++) {
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < k; i++)
            s = PS_FMA(ps_load(x, i, data_bf16), ps_load(a, c * k + i, weight_bf16), s);
        h[c] = s;
    }
}

/* out[j] += sum_r h[r] * bt[r, j] for the w <= PS_LORA_TILE columns from j: the sums stay in
 * registers over the rank loop (w a literal, PS_LORA_TILE, for all but a chunk's last tile), and
 * out is read and written once. */
static inline __attribute__((always_inline)) void expand_tile(void *out, const float *h, const void *bt,
                                                              int64_t n, int64_t rank, int64_t j,
                                                              int64_t w, const int data_bf16,
                                                              const int weight_bf16) {
    float acc[PS_LORA_TILE];
#pragma omp simd
    for (int64_t c = 0; c < w; c++) acc[c] = 0.0f;
    for (int64_t r = 0; r < rank; r++) {
        float hr = h[r];
#pragma omp simd
        for (int64_t c = 0; c < w; c++) acc[c] = PS_FMA(hr, ps_load(bt, r * n + j + c, weight_bf16), acc[c]);
    }
#pragma omp simd
    for (int64_t c = 0; c < w; c++) ps_store(out, j + c, ps_load(out, j + c, data_bf16) + acc[c], data_bf16);
}

static inline __attribute__((always_inline)) void expand_chunk(void *out, const float *h, const void *bt,
                                                               int64_t n, int64_t rank, int64_t j0,
                                                               int64_t j1, const int data_bf16,
                                                               const int weight_bf16) {
    int64_t j = j0;
    for (; j + PS_LORA_TILE <= j1; j += PS_LORA_TILE)
        expand_tile(out, h, bt, n, rank, j, PS_LORA_TILE, data_bf16, weight_bf16);
    if (j < j1) expand_tile(out, h, bt, n, rank, j, j1 - j, data_bf16, weight_bf16);
}

/* Every (data, weight) combination, each with literal flags (see PS_ROW_DISPATCH in norm_act.c). */
#define PS_LORA_DISPATCH(fn, ...)                                                           \
    do {                                                                                    \
        if (dtypes & PS_BF16_DATA) {                                                        \
            if (dtypes & PS_BF16_WEIGHT) fn(__VA_ARGS__, 1, 1);                             \
            else fn(__VA_ARGS__, 1, 0);                                                     \
        } else if (dtypes & PS_BF16_WEIGHT) fn(__VA_ARGS__, 0, 1);                          \
        else fn(__VA_ARGS__, 0, 0);                                                         \
    } while (0)

int ps_lora_delta(void *out, int64_t out_stride, const void *x, int64_t x_stride,
                  const int32_t *token_slots, const void *lora_a, const void *lora_b_t,
                  const int32_t *ranks, int64_t tokens, int64_t k, int64_t n, int64_t slots,
                  int64_t max_rank, int dtypes, void *scratch, int num_threads) {
    for (int64_t s = 0; s < slots; s++)
        if (ranks[s] < 0 || ranks[s] > max_rank) return PS_BAD_LORA;
    for (int64_t t = 0; t < tokens; t++)
        if (token_slots[t] < -1 || token_slots[t] >= slots) return PS_BAD_LORA;
    if (tokens <= 0 || n <= 0 || slots <= 0 || max_rank <= 0) return PS_OK;

    void *owned = NULL;
    if (!scratch && !(scratch = owned = malloc(ps_lora_scratch_bytes(tokens, slots, max_rank))))
        return PS_OUT_OF_MEMORY;
    int64_t *start = scratch, *order = start + slots + 1;  /* slot s's rows: order[start[s]:start[s + 1]] */
    float *h = (float *)(order + tokens);                  /* [m, max_rank], by sorted position */

    memset(start, 0, (size_t)(slots + 1) * sizeof *start);
    int64_t macs = 0;  /* sum of the adapted rows' ranks: the work both steps scale with */
    for (int64_t t = 0; t < tokens; t++) {
        if (token_slots[t] < 0) continue;
        start[token_slots[t] + 1]++;
        macs += ranks[token_slots[t]];
    }
    for (int64_t s = 0; s < slots; s++) start[s + 1] += start[s];
    int64_t m = start[slots];
    for (int64_t t = 0; t < tokens; t++)  /* start[s] walks to slot s's end ... */
        if (token_slots[t] >= 0) order[start[token_slots[t]]++] = t;
    for (int64_t s = slots; s > 0; s--) start[s] = start[s - 1];  /* ... and back to its start */
    start[0] = 0;
    if (m == 0) {
        free(owned);
        return PS_OK;
    }

    int64_t data_elem = dtypes & PS_BF16_DATA ? 2 : 4, weight_elem = dtypes & PS_BF16_WEIGHT ? 2 : 4;
    int64_t blocks = (max_rank + PS_LORA_RANK_BLOCK - 1) / PS_LORA_RANK_BLOCK;
#pragma omp parallel for collapse(2) schedule(static) num_threads(ps_threads(macs * k, PS_GRAIN, num_threads))
    for (int64_t i = 0; i < m; i++) {
        for (int64_t b = 0; b < blocks; b++) {
            int64_t t = order[i], s = token_slots[t], r0 = b * PS_LORA_RANK_BLOCK;
            int64_t count = ranks[s] - r0 < PS_LORA_RANK_BLOCK ? ranks[s] - r0 : PS_LORA_RANK_BLOCK;
            if (count <= 0) continue;
            const char *a = (const char *)lora_a + (s * max_rank + r0) * k * weight_elem;
            PS_LORA_DISPATCH(shrink_block, h + i * max_rank + r0,
                             (const char *)x + t * x_stride * data_elem, a, k, count);
        }
    }

    /* Enough chunks per row for every thread to have one, none wider than PS_LORA_CHUNK. */
    int threads = ps_threads(macs * n, PS_GRAIN, num_threads);
    int64_t per_row = (threads + m - 1) / m;
    int64_t width = ((n + per_row - 1) / per_row + 15) / 16 * 16;
    width = width < PS_LORA_CHUNK ? width : PS_LORA_CHUNK;
    int64_t chunks = (n + width - 1) / width;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t c = 0; c < chunks; c++) {
        for (int64_t i = 0; i < m; i++) {
            int64_t t = order[i], s = token_slots[t], j0 = c * width;
            int64_t j1 = j0 + width < n ? j0 + width : n;
            if (ranks[s] == 0) continue;  /* no update: the row stays as it is */
            const char *bt = (const char *)lora_b_t + s * max_rank * n * weight_elem;
            PS_LORA_DISPATCH(expand_chunk, (char *)out + t * out_stride * data_elem,
                             h + i * max_rank, bt, n, ranks[s], j0, j1);
        }
    }
    free(owned);
    return PS_OK;
}

/* The entry point: ps_lora_delta with scratch of its own. */
int pagedserve_lora_delta(void *out, int64_t out_stride, const void *x, int64_t x_stride,
                          const int32_t *token_slots, const void *lora_a, const void *lora_b_t,
                          const int32_t *ranks, int64_t tokens, int64_t k, int64_t n, int64_t slots,
                          int64_t max_rank, int dtypes, int num_threads) {
    return ps_lora_delta(out, out_stride, x, x_stride, token_slots, lora_a, lora_b_t, ranks, tokens,
                         k, n, slots, max_rank, dtypes, NULL, num_threads);
}
