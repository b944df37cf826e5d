/* Prefill attention (query_len > 1) read in place from the paged KV cache; kernels/reference.py is
 * the spec: causal, query i of a sequence of seq_len positions sits at position
 * seq_len - query_len + i, GQA. Unlike decode it is compute-bound: torch's CPU SDPA, which the
 * torch path calls a sequence at a time after gathering its blocks, runs at a small fraction of
 * the GEMMs' rate, so on long prompts it took longer than all of the model's projections.
 *
 * Flash-attention order. A task owns a (sequence, KV head, tile of query positions); its rows are
 * the tile's positions times the query heads sharing that KV head, so every K and V row it reads
 * serves them all. Keys go by in chunks of 64 positions, widened to fp32 once per task (K
 * transposed, so one vector holds 16 of a row's scores); scores and p.v are small matrix products
 * whose accumulators stay in registers; the softmax runs online (a running max and sum per row).
 * Arithmetic is fp32 throughout, as in the spec, in another order (float rounding apart). Chunks
 * of 64 keys rather than 16 because the per-row softmax work is per chunk (bench/kernels.py --cpu
 * times this against SDPA). On AVX512-BF16, bf16 queries over a bf16 cache take
 * attend_tile_bf16, whose scores come from the bf16 values without widening. */
#include <math.h>
#include <stdlib.h>

#include "common.h"

#define PS_KEY_CHUNK 64  /* key positions per step, a multiple of 16 */
#define PS_TILE_ROWS 96  /* rows (positions x group) per task: K/V widening amortised, tasks many */
#if defined(__AVX512F__)
#define PS_MR 8  /* rows per register block: 8 accumulators of 16 floats in 32 zmm registers */
#else
#define PS_MR 4  /* 8 ymm accumulators of 16 ymm registers */
#endif

/* c[i][0..15] (+)= sum_k a[i][k] b[k][0..15] for PS_MR rows (rows `lda`/`ldc` apart, b's `ldb`). */
static inline __attribute__((always_inline)) void mm16(float *restrict c, int64_t ldc,
                                                       const float *restrict a, int64_t lda,
                                                       const float *restrict b, int64_t ldb,
                                                       int64_t depth, const int accumulate) {
    float acc[PS_MR][16];
    for (int i = 0; i < PS_MR; i++)
#pragma omp simd
        for (int j = 0; j < 16; j++) acc[i][j] = accumulate ? c[i * ldc + j] : 0.0f;
    for (int64_t k = 0; k < depth; k++) {
        const float *bk = b + k * ldb;
        for (int i = 0; i < PS_MR; i++) {
            float ai = a[i * lda + k];
#pragma omp simd
            for (int j = 0; j < 16; j++) acc[i][j] = PS_FMA(ai, bk[j], acc[i][j]);
        }
    }
    for (int i = 0; i < PS_MR; i++)
#pragma omp simd
        for (int j = 0; j < 16; j++) c[i * ldc + j] = acc[i][j];
}

/* A task's scratch: queries (scaled), outputs, one chunk's scores, running max and sum per row,
 * and the chunk's K (transposed) and V, all fp32; for the bf16 tile, the queries and the chunk's
 * K in bf16, K packed for vdpbf16ps. */
typedef struct {
    float *q, *o, *s, *max, *sum, *kt, *v;
    uint16_t *q16, *k16;
} Scratch;

static float *scratch_alloc(Scratch *w, int64_t head_dim, int64_t rows) {
    int64_t chunk = PS_KEY_CHUNK;
    int64_t floats = 2 * rows * head_dim + rows * chunk + 2 * rows + 2 * chunk * head_dim;
    int64_t halves = rows * head_dim + chunk * head_dim;
    float *base = malloc((size_t)floats * sizeof(float) + (size_t)halves * sizeof(uint16_t));
    if (!base) return NULL;
    w->q = base;
    w->o = w->q + rows * head_dim;
    w->s = w->o + rows * head_dim;
    w->max = w->s + rows * chunk;
    w->sum = w->max + rows;
    w->kt = w->sum + rows;
    w->v = w->kt + chunk * head_dim;
    w->q16 = (uint16_t *)(base + floats);
    w->k16 = w->q16 + rows * head_dim;
    return base;
}

/* The online softmax over one chunk's scores (w->s, `width` columns of which the first n are
 * keys p0 ..): each row's scores become probabilities against its running max, its sum and output
 * rescaled to that max. Row r is position `start` + r / group; padding rows see every key. */
static inline __attribute__((always_inline)) void chunk_softmax(
    Scratch *w, int64_t rows, int64_t padded, int64_t group, int64_t start, int64_t p0, int64_t n,
    int64_t width, int64_t head_dim) {
    for (int64_t r = 0; r < padded; r++) {
        float *s = w->s + r * PS_KEY_CHUNK;
        /* Keys this row sees in the chunk: up to its own position. */
        int64_t position = r < rows ? start + r / group : p0 + n - 1;
        int64_t seen = position - p0 + 1 < n ? position - p0 + 1 : n;
        if (seen <= 0) {  /* the whole chunk is in this row's future */
            memset(s, 0, (size_t)width * sizeof *s);
            continue;
        }
        float max = w->max[r];
#pragma omp simd reduction(max : max)
        for (int64_t j = 0; j < width; j++) {
            float x = ps_select(j >= seen, s[j], -INFINITY);
            max = x > max ? x : max;
        }
        float alpha = ps_expf(w->max[r] - max), sum = 0.0f;  /* -inf at first: 0 */
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < width; j++) {
            float p = ps_select(j >= seen, ps_expf(s[j] - max), 0.0f);
            s[j] = p;
            sum += p;
        }
        w->max[r] = max;
        w->sum[r] = w->sum[r] * alpha + sum;
        if (alpha != 1.0f) {
            float *o = w->o + r * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) o[d] *= alpha;
        }
    }
}

/* Rows [positions first .. first + count) x `group` query heads of one sequence against its keys
 * 0 .. (context + first + count - 1), where context = seq_len - query_len. q: the first query
 * head's row of the sequence's first token, tokens `q_stride` elements apart; out likewise,
 * `o_stride` apart; k, v: the KV head's row 0 of cache block 0, rows `row_stride` apart. */
static inline __attribute__((always_inline)) void attend_tile(
    char *out, int64_t o_stride, const char *q, int64_t q_stride, const char *k, const char *v,
    const int32_t *table, int64_t context, int64_t first, int64_t count, int64_t block_size,
    int64_t row_stride, int64_t group, int64_t head_dim, float scale, Scratch *w,
    const int data_bf16, const int kv_bf16) {
    int64_t rows = count * group, padded = (rows + PS_MR - 1) / PS_MR * PS_MR;
    int64_t data_elem = data_bf16 ? 2 : 4, kv_elem = kv_bf16 ? 2 : 4;
    for (int64_t r = 0; r < padded; r++) {
        float *qr = w->q + r * head_dim;
        const char *src = q + ((first + r / group) * q_stride + r % group * head_dim) * data_elem;
        if (r < rows) {
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) qr[d] = ps_load(src, d, data_bf16) * scale;
        } else {
            memset(qr, 0, (size_t)head_dim * sizeof *qr);  /* padding rows: computed, never stored */
        }
        memset(w->o + r * head_dim, 0, (size_t)head_dim * sizeof(float));
        w->max[r] = -INFINITY;
        w->sum[r] = 0.0f;
    }
    int64_t end = context + first + count;  /* keys before `end` */
    for (int64_t p0 = 0; p0 < end; p0 += PS_KEY_CHUNK) {
        int64_t n = end - p0 < PS_KEY_CHUNK ? end - p0 : PS_KEY_CHUNK;
        for (int64_t j = 0; j < PS_KEY_CHUNK; j++) {
            float *vj = w->v + j * head_dim;
            if (j >= n) {  /* past the last key: zeros, their probabilities zero */
                memset(vj, 0, (size_t)head_dim * sizeof *vj);
                for (int64_t d = 0; d < head_dim; d++) w->kt[d * PS_KEY_CHUNK + j] = 0.0f;
                continue;
            }
            int64_t pos = p0 + j;
            int64_t offset = ((int64_t)table[pos / block_size] * block_size + pos % block_size)
                             * row_stride * kv_elem;
            const char *kr = k + offset, *vr = v + offset;
            for (int64_t d = 0; d < head_dim; d++) w->kt[d * PS_KEY_CHUNK + j] = ps_load(kr, d, kv_bf16);
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) vj[d] = ps_load(vr, d, kv_bf16);
        }
        int64_t width = (n + 15) / 16 * 16;  /* score columns worth computing */
        for (int64_t r0 = 0; r0 < padded; r0 += PS_MR)
            for (int64_t c = 0; c < width; c += 16)
                mm16(w->s + r0 * PS_KEY_CHUNK + c, PS_KEY_CHUNK, w->q + r0 * head_dim, head_dim,
                     w->kt + c, PS_KEY_CHUNK, head_dim, 0);
        chunk_softmax(w, rows, padded, group, context + first, p0, n, width, head_dim);
        for (int64_t r0 = 0; r0 < padded; r0 += PS_MR)
            for (int64_t d0 = 0; d0 < head_dim; d0 += 16)
                mm16(w->o + r0 * head_dim + d0, head_dim, w->s + r0 * PS_KEY_CHUNK, PS_KEY_CHUNK,
                     w->v + d0, head_dim, n, 1);
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *o = w->o + r * head_dim;
        char *dst = out + ((first + r / group) * o_stride + r % group * head_dim) * data_elem;
        float inv = 1.0f / w->sum[r];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) ps_store(dst, d, o[d] * inv, data_bf16);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

/* c[i][0..31] = scale * sum over pairs p of a[i][2p..2p+1] . b[p][0..31] for PS_MR rows: a's
 * rows are bf16, `lda` elements apart; b holds, for each pair p (`ldb` elements apart), 32 columns
 * of two bf16 each, as vdpbf16ps takes them. The sums are fp32. */
static inline __attribute__((always_inline)) void scores_bf16(float *restrict c, int64_t ldc,
                                                              const uint16_t *restrict a, int64_t lda,
                                                              const uint16_t *restrict b, int64_t ldb,
                                                              int64_t pairs, float scale) {
    __m512 acc[PS_MR][2];
#pragma GCC unroll 8
    for (int i = 0; i < PS_MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * ldb);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * ldb + 32);
#pragma GCC unroll 8
        for (int i = 0; i < PS_MR; i++) {
            int32_t pair;
            memcpy(&pair, a + i * lda + 2 * p, sizeof pair);
            __m512bh ai = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
        }
    }
    __m512 scales = _mm512_set1_ps(scale);
#pragma GCC unroll 8
    for (int i = 0; i < PS_MR; i++) {
        _mm512_storeu_ps(c + i * ldc, _mm512_mul_ps(acc[i][0], scales));
        _mm512_storeu_ps(c + i * ldc + 16, _mm512_mul_ps(acc[i][1], scales));
    }
}

/* attend_tile for bf16 queries over a bf16 cache: the scores by vdpbf16ps straight from the bf16
 * values (their products are exact in fp32, as in the spec; only the order of the fp32 sums
 * differs), p.v as in attend_tile, faster than widening the keys. p.v stays fp32: bf16 was no
 * faster on short prompts, and rounding the probabilities to bf16 left the spec's tolerance. */
static inline __attribute__((always_inline)) void attend_tile_bf16(
    char *out, int64_t o_stride, const char *q, int64_t q_stride, const char *k, const char *v,
    const int32_t *table, int64_t context, int64_t first, int64_t count, int64_t block_size,
    int64_t row_stride, int64_t group, int64_t head_dim, float scale, Scratch *w) {
    const int64_t chunk = PS_KEY_CHUNK, dim_pairs = head_dim / 2;
    int64_t rows = count * group, padded = (rows + PS_MR - 1) / PS_MR * PS_MR;
    for (int64_t r = 0; r < padded; r++) {
        uint16_t *qr = w->q16 + r * head_dim;
        if (r < rows)
            memcpy(qr, (const uint16_t *)q + (first + r / group) * q_stride + r % group * head_dim,
                   (size_t)head_dim * sizeof *qr);
        else
            memset(qr, 0, (size_t)head_dim * sizeof *qr);  /* padding rows: computed, never stored */
        memset(w->o + r * head_dim, 0, (size_t)head_dim * sizeof(float));
        w->max[r] = -INFINITY;
        w->sum[r] = 0.0f;
    }
    uint16_t *k16 = w->k16;  /* [dim pair][key][2]: a key's pair of dims in each 32-bit lane */
    int64_t end = context + first + count;
    for (int64_t p0 = 0; p0 < end; p0 += chunk) {
        int64_t n = end - p0 < chunk ? end - p0 : chunk;
        int64_t width = (n + 15) / 16 * 16;
        for (int64_t j = 0; j < chunk; j++) {
            if (j >= n) {  /* past the last key: zeros, their probabilities zero */
                for (int64_t d = 0; d < dim_pairs; d++) memset(k16 + 2 * (d * chunk + j), 0, 4);
                memset(w->v + j * head_dim, 0, (size_t)head_dim * sizeof(float));
                continue;
            }
            int64_t pos = p0 + j;
            int64_t offset = ((int64_t)table[pos / block_size] * block_size + pos % block_size)
                             * row_stride;
            const uint16_t *kr = (const uint16_t *)k + offset;
            const uint16_t *vr = (const uint16_t *)v + offset;
            for (int64_t d = 0; d < dim_pairs; d++) memcpy(k16 + 2 * (d * chunk + j), kr + 2 * d, 4);
            float *vj = w->v + j * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) vj[d] = ps_bf16_to_float(vr[d]);
        }
        for (int64_t r0 = 0; r0 < padded; r0 += PS_MR)
            for (int64_t c = 0; c < width; c += 32)
                scores_bf16(w->s + r0 * chunk + c, chunk, w->q16 + r0 * head_dim, head_dim,
                            k16 + 2 * c, 2 * chunk, dim_pairs, scale);
        chunk_softmax(w, rows, padded, group, context + first, p0, n, width, head_dim);
        for (int64_t r0 = 0; r0 < padded; r0 += PS_MR)
            for (int64_t d0 = 0; d0 < head_dim; d0 += 16)
                mm16(w->o + r0 * head_dim + d0, head_dim, w->s + r0 * chunk, chunk,
                     w->v + d0, head_dim, n, 1);
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *o = w->o + r * head_dim;
        uint16_t *dst = (uint16_t *)out + (first + r / group) * o_stride + r % group * head_dim;
        float inv = 1.0f / w->sum[r];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) dst[d] = ps_float_to_bf16(o[d] * inv);
    }
}
#define PS_HAVE_BF16_TILE 1
#endif

/* Constant head dims unroll the head_dim loops; the dtypes fold away. */
#define PS_TILE(dim, data_bf16, kv_bf16)                                                          \
    attend_tile(out, o_stride, q, q_stride, k, v, table, context, first, count, block_size,    \
                row_stride, group, dim, scale, w, data_bf16, kv_bf16)
#define PS_TILE_DTYPES(dim)                                                                    \
    do {                                                                                       \
        if (data_bf16 && kv_bf16) PS_TILE(dim, 1, 1);                                          \
        else if (data_bf16) PS_TILE(dim, 1, 0);                                                \
        else if (kv_bf16) PS_TILE(dim, 0, 1);                                                  \
        else PS_TILE(dim, 0, 0);                                                               \
    } while (0)

static void attend_tile_any(char *out, int64_t o_stride, const char *q, int64_t q_stride,
                            const char *k, const char *v, const int32_t *table, int64_t context,
                            int64_t first, int64_t count, int64_t block_size, int64_t row_stride,
                            int64_t group, int64_t head_dim, float scale, Scratch *w,
                            int data_bf16, int kv_bf16) {
#if defined(PS_HAVE_BF16_TILE)
    if (data_bf16 && kv_bf16) {
#define PS_TILE_BF16(dim)                                                                      \
    attend_tile_bf16(out, o_stride, q, q_stride, k, v, table, context, first, count, block_size, \
                     row_stride, group, dim, scale, w)
        if (head_dim == 64) PS_TILE_BF16(64);
        else if (head_dim == 128) PS_TILE_BF16(128);
        else PS_TILE_BF16(head_dim);
        return;
    }
#endif
    if (head_dim == 64) PS_TILE_DTYPES(64);
    else if (head_dim == 128) PS_TILE_DTYPES(128);
    else PS_TILE_DTYPES(head_dim);
}

/* Checks every index the kernel will follow, so bad metadata is an error code and never a stray
 * read; counts the tasks (a sequence's KV heads times its query tiles). */
static int validate(const int32_t *block_tables, int64_t table_width, const int32_t *seq_lens,
                    const int32_t *query_start_loc, int64_t num_seqs, int64_t num_tokens,
                    int64_t num_blocks, int64_t block_size, int64_t tile, int64_t *tiles) {
    *tiles = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t start = query_start_loc[s], end = query_start_loc[s + 1];
        if (start < 0 || end < start || end > num_tokens) return PS_BAD_QUERY_START_LOC;
        int64_t q_len = end - start, len = seq_lens[s];
        if (q_len <= 1) continue;
        int status = ps_check_context(block_tables + s * table_width, table_width, len, q_len, 0,
                                      block_size, num_blocks);
        if (status != PS_OK) return status;
        *tiles += (q_len + tile - 1) / tile;
    }
    return PS_OK;
}

/* The arguments of pagedserve_paged_decode_attention; writes the output rows of sequences with
 * query_len > 1 only. sliding_window and logits_soft_cap must be 0, and head_dim a multiple of 16
 * (else PS_UNSUPPORTED: the torch path takes those). */
int pagedserve_paged_prefill_attention(void *out, const void *query, int64_t query_row_stride,
                                       const void *kv_cache, int64_t num_blocks, int64_t block_size,
                                       const int32_t *block_tables, int64_t table_width,
                                       const int32_t *seq_lens, const int32_t *query_start_loc,
                                       int64_t num_seqs, int64_t num_tokens, int64_t num_heads,
                                       int64_t num_kv_heads, int64_t head_dim, float scale,
                                       int64_t sliding_window, float logits_soft_cap, int dtypes,
                                       int num_threads) {
    if (sliding_window != 0 || logits_soft_cap != 0.0f || head_dim % 16 || head_dim <= 0
        || num_kv_heads <= 0 || num_heads % num_kv_heads)
        return PS_UNSUPPORTED;
    int64_t group = num_heads / num_kv_heads;
    /* Query positions per task; one at least, however many query heads share a KV head. */
    int64_t tile = group < PS_TILE_ROWS ? PS_TILE_ROWS / group : 1;
    int64_t scratch_rows = (tile * group + PS_MR - 1) / PS_MR * PS_MR;
    int64_t tiles;
    int status = validate(block_tables, table_width, seq_lens, query_start_loc, num_seqs,
                          num_tokens, num_blocks, block_size, tile, &tiles);
    if (status != PS_OK || tiles == 0) return status;

    int data_bf16 = dtypes & PS_BF16_DATA, kv_bf16 = dtypes & PS_BF16_KV;
    int64_t data_elem = data_bf16 ? 2 : 4, kv_elem = kv_bf16 ? 2 : 4;
    int64_t row_stride = num_kv_heads * head_dim;
    const char *v_cache = (const char *)kv_cache + num_blocks * block_size * row_stride * kv_elem;
    /* Tasks as (sequence, first position), the last tiles (the most keys) first: dynamic
     * scheduling then balances the threads. */
    int64_t *tasks = malloc((size_t)tiles * 2 * sizeof *tasks);
    if (!tasks) return PS_OUT_OF_MEMORY;
    int64_t n = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len <= 1) continue;
        for (int64_t first = (q_len - 1) / tile * tile; first >= 0; first -= tile) {
            tasks[2 * n] = s;
            tasks[2 * n + 1] = first;
            n++;
        }
    }
    int failed = 0;
    int64_t items = tiles * num_kv_heads;
#pragma omp parallel num_threads(ps_threads(items, 1, num_threads))
    {
        Scratch w;
        float *base = scratch_alloc(&w, head_dim, scratch_rows);
        if (!base) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < items; item++) {
            if (!base) continue;
            int64_t t = item / num_kv_heads, h = item % num_kv_heads;
            int64_t s = tasks[2 * t], first = tasks[2 * t + 1];
            int64_t token = query_start_loc[s], q_len = query_start_loc[s + 1] - token;
            int64_t count = q_len - first < tile ? q_len - first : tile;
            const char *q = (const char *)query
                            + (token * query_row_stride + h * group * head_dim) * data_elem;
            char *o = (char *)out + (token * num_heads + h * group) * head_dim * data_elem;
            attend_tile_any(o, num_heads * head_dim, q, query_row_stride,
                            (const char *)kv_cache + h * head_dim * kv_elem,
                            v_cache + h * head_dim * kv_elem, block_tables + s * table_width,
                            seq_lens[s] - q_len, first, count, block_size, row_stride, group,
                            head_dim, scale, &w, data_bf16, kv_bf16);
        }
        free(base);
    }
    free(tasks);
    return failed ? PS_OUT_OF_MEMORY : PS_OK;
}
