/* Decode attention (query_len 1) read in place from the paged KV cache; kernels/reference.py is the
 * spec. Memory-bound: every K and V row of a sequence's context is read exactly once, by the one
 * task that owns that (sequence, KV heads) pair, for all the query heads sharing those KV heads.
 *
 * A task per sequence covering all its KV heads streams whole cache rows, faster than a task per
 * (sequence, KV head) reading part of each row; the latter is kept for batches too small to keep
 * every thread busy. The next block is prefetched while one is read: blocks sit at random
 * addresses, so the hardware prefetcher restarts at each (bench/kernels.py --cpu times both). */
#include <stdlib.h>

#include "common.h"

/* Prefetches `bytes` of a cache row, a line at a time, into L2: into L1 (prefetcht0), the lines in
 * flight are capped by L1's miss buffers, while into L2 the reads come near a plain in-order read's
 * speed. */
static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) PS_PREFETCH_L2(row + c);
}

/* The task's `len` elements of a cache row as fp32: the row itself (fp32 cache), or widened once
 * into `buffer` (bf16 cache), so the group query heads sharing a KV head reuse one conversion:
 * widening inside the dot loops, once per query head, made bf16 caches slower than fp32 ones. */
static inline __attribute__((always_inline)) const float *row_fp32(const char *row, int64_t len,
                                                                   float *restrict buffer,
                                                                   const int kv_bf16) {
    if (!kv_bf16) return (const float *)row;
    const uint16_t *row16 = (const uint16_t *)row;
#pragma omp simd
    for (int64_t c = 0; c < len; c++) buffer[c] = ps_bf16_to_float(row16[c]);
    return buffer;
}

/* Softmax of each of `num_q` score rows of `len`, in place: capped first (soft_cap > 0), max
 * subtracted, normalised before use as in the spec. */
static inline __attribute__((always_inline)) void softmax_rows(float *scores, int64_t num_q,
                                                               int64_t len, float soft_cap) {
    for (int64_t j = 0; j < num_q; j++) {
        float *s = scores + j * len;
        if (soft_cap > 0.0f) {
            float inv_cap = 1.0f / soft_cap;
#pragma omp simd
            for (int64_t t = 0; t < len; t++) s[t] = soft_cap * ps_tanhf(s[t] * inv_cap);
        }
        float max = s[0];
#pragma omp simd reduction(max : max)
        for (int64_t t = 1; t < len; t++) max = s[t] > max ? s[t] : max;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            s[t] = ps_expf(s[t] - max);
            sum += s[t];
        }
        float inv_sum = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) s[t] *= inv_sum;
    }
}

/* One sequence's decode query against its context positions first..seq_len-1 (first > 0 under a
 * sliding window: older blocks are never touched), for `kv_heads` adjacent KV heads.
 * q, out: [kv_heads * group, head_dim] fp32; k, v: the first KV head's row 0 of cache block 0,
 * rows `row_stride` elements apart, fp32 or (kv_bf16) bf16: a bf16 cache halves the bytes this
 * memory-bound loop reads, and each row is widened once (fp32 arithmetic throughout, row32:
 * [kv_heads * head_dim] scratch); table: the sequence's block table; scores: [kv_heads * group,
 * seq_len - first] scratch;
 * soft_cap > 0 caps the scores (Gemma 2). Inlined with head_dim and kv_bf16 constants for the
 * common sizes (see attend_any). */
static inline __attribute__((always_inline)) void attend(
    float *restrict out, const float *restrict q, const void *k, const void *v, const int32_t *table,
    int64_t first, int64_t seq_len, int64_t block_size, int64_t row_stride, int64_t kv_heads,
    int64_t group, int64_t head_dim, float scale, float soft_cap, float *restrict scores,
    float *restrict row32, const int kv_bf16) {
    int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    int64_t num_q = kv_heads * group, len = seq_len - first;
    int64_t elem = kv_bf16 ? 2 : 4, row_len = kv_heads * head_dim, row_bytes = row_len * elem;
    int64_t row_step = row_stride * elem;  /* bytes from one cache row to the next */

    /* Pass 1: scores = q . k * scale over the context. */
    for (int64_t b = first / block_size; b < num_blocks; b++) {
        int64_t begin = b * block_size > first ? b * block_size : first;
        int64_t end = (b + 1) * block_size < seq_len ? (b + 1) * block_size : seq_len;
        const char *row = (const char *)k + ((int64_t)table[b] * block_size + begin - b * block_size) * row_step;
        const char *next = b + 1 < num_blocks ? (const char *)k + (int64_t)table[b + 1] * block_size * row_step : NULL;
        for (int64_t i = 0; i < end - begin; i++, row += row_step) {
            if (next) prefetch_row(next + i * row_step, row_bytes);
            const float *k32 = row_fp32(row, row_len, row32, kv_bf16);
            for (int64_t h = 0, j = 0; h < kv_heads; h++) {
                const float *kh = k32 + h * head_dim;
                for (int64_t g = 0; g < group; g++, j++) {
                    const float *qj = q + j * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; d++) dot += qj[d] * kh[d];
                    scores[j * len + begin - first + i] = dot * scale;
                }
            }
        }
    }

    softmax_rows(scores, num_q, len, soft_cap);

    /* Pass 2: out = sum_t p_t v_t, each V row read once for all query heads. */
    memset(out, 0, (size_t)(num_q * head_dim) * sizeof *out);
    for (int64_t b = first / block_size; b < num_blocks; b++) {
        int64_t begin = b * block_size > first ? b * block_size : first;
        int64_t end = (b + 1) * block_size < seq_len ? (b + 1) * block_size : seq_len;
        const char *row = (const char *)v + ((int64_t)table[b] * block_size + begin - b * block_size) * row_step;
        const char *next = b + 1 < num_blocks ? (const char *)v + (int64_t)table[b + 1] * block_size * row_step : NULL;
        for (int64_t i = 0; i < end - begin; i++, row += row_step) {
            if (next) prefetch_row(next + i * row_step, row_bytes);
            const float *v32 = row_fp32(row, row_len, row32, kv_bf16);
            for (int64_t h = 0, j = 0; h < kv_heads; h++) {
                const float *vh = v32 + h * head_dim;
                for (int64_t g = 0; g < group; g++, j++) {
                    float p = scores[j * len + begin - first + i];
                    float *o = out + j * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) o[d] += p * vh[d];
                }
            }
        }
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define PS_TILED 1

/* The tiled form of attend(), in AVX-512 or AVX2, for head dims in whole vectors (attend_any).
 * The loop above spends most of its time on a horizontal sum per (position, query head) and on
 * output rows kept in memory. Here a KV head's row segment is loaded (widened) once per
 * position for up to three query heads; q . k is summed for eight positions at a time in
 * registers (AVX2: two sets of four) and reduced by one transpose; p . v accumulates in registers
 * over a tile of positions (AVX2: four vectors of the head at a time). Sums are fp32 as in the
 * spec, in another order (float rounding apart).
 *
 * A step's KV cache (every layer) is far larger than the caches, and its blocks sit at scattered
 * addresses, so this waits on memory unless told what comes next. Positions go by in tiles of
 * PS_TILE, each tile's rows read for every KV head while they are in L1, and the rows
 * PS_AHEAD_BYTES on are prefetched meanwhile, a few per KV head so that the requests spread over
 * the tile's work. This beat walking the KV heads outermost, each over its part of every row, at
 * every batch and context size (bench/kernels.py --cpu). */
#define PS_GROUP_CHUNK 3
#define PS_TILE 8 /* scores_tile's positions */
/* How far ahead rows are prefetched, in bytes of the task's rows: ~16 rows of three bf16 KV heads
 * of 64, 64 rows of one (the best of the distances tried, for either). */
#define PS_AHEAD_BYTES 8192

#if defined(__AVX512F__)
#define PS_LANES 16

/* Chunk c (16 values) of a row segment as fp32. */
static inline __attribute__((always_inline)) __m512 load16(const char *row, int c, const int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)row + c)), 16));
    return _mm512_loadu_ps((const float *)row + 16 * c);
}

/* The sums of eight vectors' lanes, in order. */
static inline __attribute__((always_inline)) __m256 sum8(const __m512 *a) {
    __m512 c[4], d[2];
    for (int i = 0; i < 4; i++)  /* 128-bit lanes folded: [a(2i) | a(2i+1)], 8 partials each */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) {  /* one 128-bit lane per vector, 4 partials each */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
        d[i] = _mm512_add_ps(d[i], _mm512_permute_ps(d[i], 0x4E));
        d[i] = _mm512_add_ps(d[i], _mm512_permute_ps(d[i], 0xB1));
    }
    const __m512i first_lanes = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 28, 24, 20, 16, 12, 8, 4, 0);
    return _mm512_castps512_ps256(_mm512_permutex2var_ps(d[0], first_lanes, d[1]));
}

/* scores[g * len + t0 ..] = scale * q_g . k_t for positions t0 .. t0 + 7 (those below len). */
static inline __attribute__((always_inline)) void scores_tile(
    float *scores, int64_t len, int64_t t0, const float *q, const char *k, const int64_t *offsets,
    float scale, const int nv, const int groups, const int bf16) {
    __m512 acc[PS_GROUP_CHUNK][8];
    const char *rows[8];
    for (int t = 0; t < 8; t++)  /* past the end: the last position again, its sums dropped */
        rows[t] = k + offsets[t0 + t < len ? t0 + t : len - 1];
    for (int g = 0; g < groups; g++)
        for (int t = 0; t < 8; t++) acc[g][t] = _mm512_setzero_ps();
    for (int c = 0; c < nv; c++) {
        for (int t = 0; t < 8; t++) {
            __m512 kc = load16(rows[t], c, bf16);
            for (int g = 0; g < groups; g++)
                acc[g][t] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (g * nv + c) * 16), kc, acc[g][t]);
        }
    }
    int64_t n = len - t0 < 8 ? len - t0 : 8;
    for (int g = 0; g < groups; g++) {
        __m256 s = _mm256_mul_ps(sum8(acc[g]), _mm256_set1_ps(scale));
        _mm256_mask_storeu_ps(scores + g * len + t0, (__mmask8)((1u << n) - 1), s);
    }
}

/* out_g += sum_t p_gt v_t over positions t0 .. t1 - 1, for `groups` query heads sharing one KV
 * head: the sums stay in registers across the span, in out between spans. prefetch_bytes > 0:
 * the rows `ahead` positions on are prefetched as it goes (the span is the whole context). */
static inline __attribute__((always_inline)) void weighted_span(
    float *out, const float *p, int64_t len, int64_t t0, int64_t t1, const char *v,
    const int64_t *offsets, const int nv, const int groups, const int bf16, int64_t ahead,
    int64_t prefetch_bytes) {
    __m512 acc[PS_GROUP_CHUNK][8];
    for (int g = 0; g < groups; g++)
        for (int c = 0; c < nv; c++) acc[g][c] = _mm512_loadu_ps(out + (g * nv + c) * 16);
    for (int64_t t = t0; t < t1; t++) {
        const char *row = v + offsets[t];
        if (prefetch_bytes && t + ahead < len) prefetch_row(v + offsets[t + ahead], prefetch_bytes);
        for (int c = 0; c < nv; c++) {
            __m512 vc = load16(row, c, bf16);
            for (int g = 0; g < groups; g++)
                acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * len + t]), vc, acc[g][c]);
        }
    }
    for (int g = 0; g < groups; g++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(out + (g * nv + c) * 16, acc[g][c]);
}

#else /* AVX2: 16 registers of 8 lanes */
#define PS_LANES 8
#define PS_HEAD_CHUNK 4 /* vectors of a head weighted_span holds per query head at once */

/* Chunk c (8 values) of a row segment as fp32. */
static inline __attribute__((always_inline)) __m256 load8(const char *row, int c, const int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)row + c)), 16));
    return _mm256_loadu_ps((const float *)row + 8 * c);
}

/* The sums of four vectors' lanes, in order. */
static inline __attribute__((always_inline)) __m128 sum4(const __m256 *a) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* scores[g * len + t0 ..] = scale * q_g . k_t for positions t0 .. t0 + 3 (those below len): four
 * positions, as three query heads' sums of four take 12 of the 16 registers. */
static inline __attribute__((always_inline)) void scores4(
    float *scores, int64_t len, int64_t t0, const float *q, const char *k, const int64_t *offsets,
    float scale, const int nv, const int groups, const int bf16) {
    __m256 acc[PS_GROUP_CHUNK][4];
    const char *rows[4];
    for (int t = 0; t < 4; t++)  /* past the end: the last position again, its sums dropped */
        rows[t] = k + offsets[t0 + t < len ? t0 + t : len - 1];
    for (int g = 0; g < groups; g++)
        for (int t = 0; t < 4; t++) acc[g][t] = _mm256_setzero_ps();
    for (int c = 0; c < nv; c++) {
        for (int t = 0; t < 4; t++) {
            __m256 kc = load8(rows[t], c, bf16);
            for (int g = 0; g < groups; g++)
                acc[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (g * nv + c) * 8), kc, acc[g][t]);
        }
    }
    int n = len - t0 < 4 ? (int)(len - t0) : 4;
    __m128i mask = _mm_cmpgt_epi32(_mm_set1_epi32(n), _mm_setr_epi32(0, 1, 2, 3));
    for (int g = 0; g < groups; g++)
        _mm_maskstore_ps(scores + g * len + t0, mask, _mm_mul_ps(sum4(acc[g]), _mm_set1_ps(scale)));
}

/* The same for positions t0 .. t0 + 7. */
static inline __attribute__((always_inline)) void scores_tile(
    float *scores, int64_t len, int64_t t0, const float *q, const char *k, const int64_t *offsets,
    float scale, const int nv, const int groups, const int bf16) {
    scores4(scores, len, t0, q, k, offsets, scale, nv, groups, bf16);
    if (t0 + 4 < len) scores4(scores, len, t0 + 4, q, k, offsets, scale, nv, groups, bf16);
}

/* out_g += sum_t p_gt v_t over positions t0 .. t1 - 1, for `groups` query heads sharing one KV
 * head, PS_HEAD_CHUNK vectors of the head at a time over PS_SUBSPAN positions (whose rows stay in
 * L1 for the head's next chunk; the sums in registers across them, in out between). Prefetch as
 * weighted_span's AVX-512 form, by the first chunk's pass. */
#define PS_SUBSPAN 32
static inline __attribute__((always_inline)) void weighted_span(
    float *out, const float *p, int64_t len, int64_t t0, int64_t t1, const char *v,
    const int64_t *offsets, const int nv, const int groups, const int bf16, int64_t ahead,
    int64_t prefetch_bytes) {
    for (int64_t s0 = t0; s0 < t1; s0 += PS_SUBSPAN) {
        int64_t s1 = s0 + PS_SUBSPAN < t1 ? s0 + PS_SUBSPAN : t1;
        for (int c0 = 0; c0 < nv; c0 += PS_HEAD_CHUNK) {
            const int nc = nv - c0 < PS_HEAD_CHUNK ? nv - c0 : PS_HEAD_CHUNK;
            __m256 acc[PS_GROUP_CHUNK][PS_HEAD_CHUNK];
            for (int g = 0; g < groups; g++)
                for (int c = 0; c < nc; c++)
                    acc[g][c] = _mm256_loadu_ps(out + (g * nv + c0 + c) * 8);
            for (int64_t t = s0; t < s1; t++) {
                const char *row = v + offsets[t];
                if (c0 == 0 && prefetch_bytes && t + ahead < len)
                    prefetch_row(v + offsets[t + ahead], prefetch_bytes);
                for (int c = 0; c < nc; c++) {
                    __m256 vc = load8(row, c0 + c, bf16);
                    for (int g = 0; g < groups; g++)
                        acc[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * len + t]), vc, acc[g][c]);
                }
            }
            for (int g = 0; g < groups; g++)
                for (int c = 0; c < nc; c++)
                    _mm256_storeu_ps(out + (g * nv + c0 + c) * 8, acc[g][c]);
        }
    }
}
#endif

/* Prefetches the task's part of the cache rows of positions t0 .. t1 - 1 (those below len). */
static inline void prefetch_rows(const char *base, const int64_t *offsets, int64_t t0, int64_t t1,
                                 int64_t len, int64_t bytes) {
    for (int64_t t = t0; t < t1 && t < len; t++) prefetch_row(base + offsets[t], bytes);
}

static inline __attribute__((always_inline)) void attend_tiled(
    float *restrict out, const float *restrict q, const void *k, const void *v, const int32_t *table,
    int64_t first, int64_t seq_len, int64_t block_size, int64_t row_stride, int64_t kv_heads,
    int64_t group, float scale, float soft_cap, float *restrict scores, int64_t *restrict offsets,
    const int nv, const int bf16) {
    int64_t len = seq_len - first, elem = bf16 ? 2 : 4, head_bytes = PS_LANES * nv * elem;
    int64_t task_bytes = kv_heads * head_bytes;
    for (int64_t t = 0; t < len; t++) {  /* byte offset of each position's cache row */
        int64_t pos = first + t;
        offsets[t] = ((int64_t)table[pos / block_size] * block_size + pos % block_size) * row_stride * elem;
    }
    int64_t ahead_rows = PS_AHEAD_BYTES / task_bytes;
    if (ahead_rows < PS_TILE) ahead_rows = PS_TILE;
    prefetch_rows(k, offsets, 0, ahead_rows, len, task_bytes);
    for (int64_t t0 = 0; t0 < len; t0 += PS_TILE) {
        int64_t ahead = t0 + ahead_rows;
        if (ahead + PS_TILE > len)  /* the last K tiles: V's first rows next */
            prefetch_rows(v, offsets, t0 == 0 ? 0 : ahead - len, ahead + PS_TILE - len, len,
                          task_bytes);
        for (int64_t h = 0; h < kv_heads; h++) {
            const char *kh = (const char *)k + h * head_bytes;
            prefetch_rows(k, offsets, ahead + h * PS_TILE / kv_heads,
                          ahead + (h + 1) * PS_TILE / kv_heads, len, task_bytes);
            for (int64_t g0 = 0; g0 < group; g0 += PS_GROUP_CHUNK) {
                int64_t j = h * group + g0, n = group - g0 < PS_GROUP_CHUNK ? group - g0 : PS_GROUP_CHUNK;
                float *sj = scores + j * len;
                const float *qj = q + j * PS_LANES * nv;
                if (n == 3) scores_tile(sj, len, t0, qj, kh, offsets, scale, nv, 3, bf16);
                else if (n == 2) scores_tile(sj, len, t0, qj, kh, offsets, scale, nv, 2, bf16);
                else scores_tile(sj, len, t0, qj, kh, offsets, scale, nv, 1, bf16);
            }
        }
    }
    softmax_rows(scores, kv_heads * group, len, soft_cap);
    memset(out, 0, (size_t)(kv_heads * group * PS_LANES * nv) * sizeof *out);
    /* One KV head: its rows are read once whatever the order, so one span, and weighted_span
     * prefetches as it goes (span_prefetch bytes a row); else tiles, prefetched here. */
    int single = kv_heads == 1;
    int64_t span = single ? len : PS_TILE, span_prefetch = single ? task_bytes : 0;
    for (int64_t t0 = 0; t0 < len; t0 += span) {
        int64_t t1 = t0 + span < len ? t0 + span : len, ahead = t0 + ahead_rows;
        for (int64_t h = 0; h < kv_heads; h++) {
            const char *vh = (const char *)v + h * head_bytes;
            if (!single)
                prefetch_rows(v, offsets, ahead + h * PS_TILE / kv_heads,
                              ahead + (h + 1) * PS_TILE / kv_heads, len, task_bytes);
            for (int64_t g0 = 0; g0 < group; g0 += PS_GROUP_CHUNK) {
                int64_t j = h * group + g0, n = group - g0 < PS_GROUP_CHUNK ? group - g0 : PS_GROUP_CHUNK;
                float *o = out + j * PS_LANES * nv;
                const float *p = scores + j * len;
                int64_t pf = g0 == 0 ? span_prefetch : 0;  /* the first query heads' pass fetches */
                if (n == 3) weighted_span(o, p, len, t0, t1, vh, offsets, nv, 3, bf16, ahead_rows, pf);
                else if (n == 2) weighted_span(o, p, len, t0, t1, vh, offsets, nv, 2, bf16, ahead_rows, pf);
                else weighted_span(o, p, len, t0, t1, vh, offsets, nv, 1, bf16, ahead_rows, pf);
            }
        }
    }
}
#endif

/* A constant head_dim lets the compiler unroll the head_dim loops completely, which pays on
 * contexts that fit in cache, where arithmetic rather than memory sets the pace. */
#define PS_ATTEND(dim, bf16)                                                                \
    attend(out, q, k, v, table, first, seq_len, block_size, row_stride, kv_heads, group, dim, \
           scale, soft_cap, scores, row32, bf16)

static void attend_any(float *out, const float *q, const void *k, const void *v,
                       const int32_t *table, int64_t first, int64_t seq_len, int64_t block_size,
                       int64_t row_stride, int64_t kv_heads, int64_t group, int64_t head_dim,
                       float scale, float soft_cap, float *scores, float *row32, int64_t *offsets,
                       int kv_bf16) {
#if defined(PS_TILED)
#define PS_ATTEND_TILED(nv, bf16)                                                               \
    attend_tiled(out, q, k, v, table, first, seq_len, block_size, row_stride, kv_heads, group, \
                 scale, soft_cap, scores, offsets, nv, bf16)
#define PS_NV_CASE(nv)                                                                          \
    case nv:                                                                                    \
        if (kv_bf16) PS_ATTEND_TILED(nv, 1); else PS_ATTEND_TILED(nv, 0);                       \
        return;
    /* Head dims in whole vectors (AVX-512: 16-128, a tiny model's 32, Phi-2's 80, Phi-3's 96;
     * AVX2: the same but 112), nv a constant in each for the compiler to unroll: faster than the
     * loop above for GQA and MHA heads alike. */
    if (head_dim % PS_LANES == 0) {
        switch (head_dim / PS_LANES) {
#if PS_LANES == 16
            PS_NV_CASE(1) PS_NV_CASE(2) PS_NV_CASE(3) PS_NV_CASE(4)
            PS_NV_CASE(5) PS_NV_CASE(6) PS_NV_CASE(7) PS_NV_CASE(8)
#else
            PS_NV_CASE(2) PS_NV_CASE(4) PS_NV_CASE(6) PS_NV_CASE(8)
            PS_NV_CASE(10) PS_NV_CASE(12) PS_NV_CASE(16)
#endif
            default: break;
        }
    }
#undef PS_NV_CASE
#else
    (void)offsets;
#endif
    if (kv_bf16) {
        if (head_dim == 64) PS_ATTEND(64, 1);
        else if (head_dim == 128) PS_ATTEND(128, 1);
        else PS_ATTEND(head_dim, 1);
    } else {
        if (head_dim == 64) PS_ATTEND(64, 0);
        else if (head_dim == 128) PS_ATTEND(128, 0);
        else PS_ATTEND(head_dim, 0);
    }
}

/* The first context position a decode query at seq_len - 1 attends to (0 without a window). */
static inline int64_t first_position(int64_t seq_len, int64_t sliding_window) {
    return sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
}

/* Checks every index the kernel will follow (block table entries outside the window are not
 * followed, and may be anything), so bad metadata is an error code and never a stray read.
 * Returns the longest span of positions a decode attends to through *max_len and the number of
 * decodes. */
static int validate(const int32_t *block_tables, int64_t table_width, const int32_t *seq_lens,
                    const int32_t *query_start_loc, int64_t num_seqs, int64_t num_tokens,
                    int64_t num_blocks, int64_t block_size, int64_t sliding_window,
                    int64_t *max_len, int64_t *decodes) {
    *max_len = *decodes = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t start = query_start_loc[s], end = query_start_loc[s + 1];
        if (start < 0 || end < start || end > num_tokens) return PS_BAD_QUERY_START_LOC;
        if (end - start != 1) continue;
        int64_t len = seq_lens[s], first = first_position(len, sliding_window);
        int status = ps_check_context(block_tables + s * table_width, table_width, len, 1, first,
                                      block_size, num_blocks);
        if (status != PS_OK) return status;
        if (len - first > *max_len) *max_len = len - first;
        ++*decodes;
    }
    return PS_OK;
}

/* out, query: [num_tokens, num_heads, head_dim] (query rows `query_row_stride` elements apart, as
 * a view of a fused QKV projection), both fp32 or (PS_BF16_DATA) both bf16; kv_cache: [2,
 * num_blocks, block_size, num_kv_heads, head_dim], fp32 or (PS_BF16_KV) bf16; block_tables:
 * [num_seqs, table_width]; seq_lens: [num_seqs]; query_start_loc: [num_seqs + 1];
 * sliding_window: 0 for none, else a query at position i sees keys i - sliding_window + 1 .. i;
 * logits_soft_cap: 0 for none. Writes the output rows of sequences with query_len 1 only. A bf16
 * query is widened, and the fp32 result rounded once, per task. */
int pagedserve_paged_decode_attention(void *out, const void *query, int64_t query_row_stride,
                                      const void *kv_cache, int64_t num_blocks, int64_t block_size,
                                      const int32_t *block_tables, int64_t table_width,
                                      const int32_t *seq_lens, const int32_t *query_start_loc,
                                      int64_t num_seqs, int64_t num_tokens, int64_t num_heads,
                                      int64_t num_kv_heads, int64_t head_dim, float scale,
                                      int64_t sliding_window, float logits_soft_cap, int dtypes,
                                      int num_threads) {
    int64_t max_len, decodes;
    int status = validate(block_tables, table_width, seq_lens, query_start_loc, num_seqs,
                          num_tokens, num_blocks, block_size, sliding_window, &max_len, &decodes);
    if (status != PS_OK || decodes == 0) return status;

    /* Whole sequences per task, unless too few of them would leave threads idle or unbalanced. */
    int64_t splits = num_threads > 1 && decodes < 4 * (int64_t)num_threads ? num_kv_heads : 1;
    int64_t kv_heads = num_kv_heads / splits, group = num_heads / num_kv_heads;
    int64_t row_stride = num_kv_heads * head_dim, task_rows = kv_heads * group * head_dim;
    int data_bf16 = dtypes & PS_BF16_DATA, kv_bf16 = dtypes & PS_BF16_KV;
    int64_t data_elem = data_bf16 ? 2 : 4, kv_elem = kv_bf16 ? 2 : 4;
    const char *v_cache = (const char *)kv_cache + num_blocks * block_size * row_stride * kv_elem;
    int64_t items = num_seqs * splits;
    int failed = 0;

#pragma omp parallel num_threads(ps_threads(decodes * splits, 1, num_threads))
    {
        /* scores, a widened cache row, then (bf16 data) the task's query and output in fp32,
         * then the context's row offsets (int64, the AVX-512 form's). */
        int64_t scratch = kv_heads * group * max_len + kv_heads * head_dim + 2 * task_rows;
        scratch += scratch & 1;  /* the offsets 8-byte aligned */
        float *scores = malloc((size_t)scratch * sizeof *scores + (size_t)max_len * sizeof(int64_t));
        float *row32 = scores + kv_heads * group * max_len, *q32 = row32 + kv_heads * head_dim;
        float *out32 = q32 + task_rows;
        int64_t *offsets = (int64_t *)(scores + scratch);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        /* Dynamic: contexts are ragged. */
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < items; item++) {
            int64_t s = item / splits, h = item % splits * kv_heads;
            int64_t token = query_start_loc[s];
            if (!scores || query_start_loc[s + 1] - token != 1) continue;
            const char *q = (const char *)query
                            + (token * query_row_stride + h * group * head_dim) * data_elem;
            char *o = (char *)out + (token * num_heads + h * group) * head_dim * data_elem;
            if (data_bf16) {
#pragma omp simd
                for (int64_t d = 0; d < task_rows; d++) q32[d] = ps_load(q, d, 1);
            }
            attend_any(data_bf16 ? out32 : (float *)o, data_bf16 ? q32 : (const float *)q,
                       (const char *)kv_cache + h * head_dim * kv_elem,
                       v_cache + h * head_dim * kv_elem,
                       block_tables + s * table_width, first_position(seq_lens[s], sliding_window),
                       seq_lens[s], block_size, row_stride, kv_heads, group, head_dim, scale,
                       logits_soft_cap, scores, row32, offsets, kv_bf16);
            if (data_bf16) {
#pragma omp simd
                for (int64_t d = 0; d < task_rows; d++) ps_store(o, d, out32[d], 1);
            }
        }
        free(scores);
    }
    return failed ? PS_OUT_OF_MEMORY : PS_OK;
}
