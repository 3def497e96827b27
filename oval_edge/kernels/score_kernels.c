/* Page scoring of OVAL decode ([R-page-score]), called through ctypes by oval_edge/kernels/cpu.py.
 *
 * Why C: in eager torch, scoring one layer's pages is ~15 separate passes (gather, bf16 -> fp32 copies, a matmul
 * with three rows, r broadcast multiply-adds, a log-sum-exp). Here each page's record is read once, straight from
 * the pool, and everything else stays in registers or L1. The arithmetic is the same (fp32 accumulation); only the
 * summation order differs.
 *
 * Two bodies compute the same scores: one in plain C (any CPU, any shape within the limits) and one in AVX2 + FMA
 * intrinsics for the shapes serving uses (head dim and page size multiples of 16, rank <= 16). Why the second: the
 * compiler vectorises each of the (r + 1) * G dot products of a page on its own and ends each with a horizontal
 * sum, and it cannot vectorise the int4 record's nibble reads at all; at 32k tokens that made the int4 record (a
 * third of the bytes) score 2.6x slower than bf16 (13.1 vs 5.1 ms a step, 28 layers, measured). The intrinsics widen
 * a record row at a time (bf16, int8, two int4 nibbles a byte) and reduce four dot products with three horizontal
 * adds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "kernel_math.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_RANK 256     /* oval basis rank */
#define MAX_PAGE 256     /* tokens per page */
#define MIN_PAGES_PER_THREAD 32 /* a thread forks for no fewer pages to score: a fork costs about as much as 32 */

/* Record element formats (page_record.py): the pool's dtype, or quantized. FMT is a constant after inlining. */
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_INT8 2
#define FMT_INT4 3 /* basis rows: 5-bit levels stored as q + 16, a row's dim / 2 bytes of low nibbles (two a byte,
                    * the even element in the low nibble) then dim / 8 bytes of fifth bits (bit i % 8 of byte i / 8
                    * is element i's). Coordinates: a record's r * P / 2 bytes of nibbles, rank-major, then P / 8
                    * bytes of fifth bits for each of its first FIFTH_RANKS(r) ranks; every row's level is its
                    * nibble - 8, and a row with fifth bits adds 16 * bit - 8 (page_record.py) */
#define INT5_ROW_BYTES(dim) ((dim) / 2 + (dim) / 8)
#define FIFTH_RANKS(rank) (3 * (rank) / 4) /* record_layout.coord_fifth_ranks */
#define INT4_COORD_BYTES(rank, page) ((rank) * (page) / 2 + FIFTH_RANKS(rank) * (page) / 8)

/* Element i of a float or int8 record tensor, before its scale (int8 gives the integer level). The int4 record's
 * packed rows are read by load_int5 and load_int4_coord. */
static inline __attribute__((always_inline)) float load_record(const void *base, int64_t i, int fmt) {
    if (fmt == FMT_F32) return ((const float *)base)[i];
    if (fmt == FMT_BF16) return widen_bf16(((const uint16_t *)base)[i]);
    return (float)((const int8_t *)base)[i];
}

/* Element j of packed nibbles (two a byte, the even element in the low nibble) and bit j of a bit plane (bit j % 8
 * of byte j / 8): the int4 record's two packings (page_record.py). */
static inline __attribute__((always_inline)) int nibble_at(const uint8_t *bytes, int64_t j) {
    return (j & 1) ? bytes[j >> 1] >> 4 : bytes[j >> 1] & 15;
}
static inline __attribute__((always_inline)) int bit_at(const uint8_t *plane, int64_t j) {
    return (plane[j >> 3] >> (j & 7)) & 1;
}

/* Token p of rank i's coordinate row of the int4 record `record` (its index in the layer's [Hkv * pages] records):
 * its level. */
static inline __attribute__((always_inline)) float load_int4_coord(const void *coords, int64_t record, int64_t i,
                                                                   int64_t p, int64_t rank, int64_t page) {
    const uint8_t *bytes = (const uint8_t *)coords + record * INT4_COORD_BYTES(rank, page);
    const int64_t j = i * page + p;
    if (i >= FIFTH_RANKS(rank)) return (float)(nibble_at(bytes, j) - 8);
    return (float)(nibble_at(bytes, j) + 16 * bit_at(bytes + rank * page / 2, j) - 16);
}

/* Element d of basis row `row` (the row's index in the layer's basis tensor) of an int4 record: its 5-bit level. */
static inline __attribute__((always_inline)) float load_int5(const void *basis, int64_t row, int64_t d, int64_t dim) {
    const uint8_t *bytes = (const uint8_t *)basis + row * INT5_ROW_BYTES(dim);
    return (float)(nibble_at(bytes, d) + 16 * bit_at(bytes + dim / 2, d) - 16);
}

/* A page's score from its log-sum-exp parts: total = sum of 2^(logit - peak), logits in log2 units -> natural log.
 * Both bodies end here. */
static inline float page_score(float total, float peak) { return (log2f(total) + peak) * LN_2; }

#if defined(__ARM_NEON)
#include "score_neon.h"
#endif

/* Checks shared by both bodies: 1 for shapes above the limits, 2 for a page index outside the pool, else 0. */
static int check_scores(const int64_t *page_table, const int64_t *counts, const uint16_t *scales, int64_t batch,
                        int64_t group, int64_t dim, int64_t rank, int64_t page_size, int64_t num_pages,
                        int64_t pages_total, int fmt) {
    if (dim > MAX_DIM || group > MAX_GROUP || rank > MAX_RANK || page_size > MAX_PAGE) return 1;
    if (fmt >= FMT_INT8 && !scales) return 1;
    if (fmt == FMT_INT4 && (dim % 8 || page_size % 8)) return 1;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t n = 0; n < row_count(counts, b, num_pages); n++)
            if (page_table[b * num_pages + n] < 0 || page_table[b * num_pages + n] >= pages_total) return 2;
    return 0;
}

/* x [dim] -> H x in place, H = page_record.rotation(dim): per block of the dim's binary decomposition (largest
 * first), the Sylvester-Hadamard butterflies, then 1/sqrt(block). The int4 record stores its basis rows as b H. */
static void hadamard_rotate(float *x, int64_t dim) {
    int64_t start = 0;
    for (int bit = 30; bit >= 0; bit--) {
        const int64_t size = (int64_t)1 << bit;
        if (!(dim & size)) continue;
        float *v = x + start;
        for (int64_t h = 1; h < size; h *= 2)
            for (int64_t i = 0; i < size; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    float a = v[j], b = v[j + h];
                    v[j] = a + b;
                    v[j + h] = a - b;
                }
        const float norm = 1.0f / sqrtf((float)size);
        for (int64_t j = 0; j < size; j++) v[j] *= norm;
        start += size;
    }
}

/* Page scores (scoring.oval_scores): for each row b, KV head h and listed page n,
 *   out[b, h, n] = ln( sum over the group's heads g and the page's tokens p of exp(scale * (mu . q_g + R[p] . (B^T q_g))) )
 * q [B, Hkv, G, D] fp32 (qb: the queries the basis rows are dotted with: q, or H q for the int4 record); one layer's records (page_record.py), head-major: mean [Hkv, pages_total, D], basis B^T
 * [Hkv, pages_total, r, D] (int4: [.., r, INT5_ROW_BYTES(D)] bytes), coords R^T [Hkv, pages_total, r, P] (int4:
 * [.., INT4_COORD_BYTES(r, P)] bytes), scales [Hkv, pages_total, 1 + r] fp16 bits (int formats; NULL for float
 * ones): the mean's scale (value = scale * level),
 * then per rank i the product of basis row i's and coordinate row i's. The scales fold into the projections, so
 * the inner loops are those of the float record.
 * page_table [B, Np] physical pages; out [B, Hkv, Np] fp32.
 * counts [B] (or NULL: all Np): how many leading pages of each row to score. Why: the static decode step pads every
 * page table to the longest allowed sequence; pages past a row's count are not read and get UNSCORED (callers mask
 * them: they are not candidates), so the work follows the row's length while the shapes stay fixed.
 * threads: the OpenMP team's size to split the pages over (1 without OpenMP; short tables stay on one thread). */
static inline __attribute__((always_inline)) void oval_scores_plain(
    const float *restrict q, const float *restrict qb, const void *restrict mean, const void *restrict basis, const void *restrict coords,
    const uint16_t *restrict scales, const int64_t *restrict page_table, const int64_t *restrict counts, int64_t batch,
    int64_t kv_heads, int64_t group, int64_t dim, int64_t rank, int64_t page_size, int64_t num_pages,
    int64_t pages_total, float scale, float *restrict out, int64_t threads, int fmt) {
    const int mean_fmt = fmt >= FMT_INT8 ? FMT_INT8 : fmt; /* the int4 record keeps an int8 mean */
    const int64_t items = batch * kv_heads * num_pages;
    /* Pages are independent and cost the same: one flat loop over (b, h, n), split evenly over the team. */
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && items >= MIN_PAGES_PER_THREAD * 2)
#endif
    for (int64_t item = 0; item < items; item++) {
        const int64_t n = item % num_pages, bh = item / num_pages, b = bh / kv_heads, h = bh % kv_heads;
        if (n >= row_count(counts, b, num_pages)) {
            out[item] = UNSCORED;
            continue;
        }
        float row[MAX_DIM > MAX_PAGE ? MAX_DIM : MAX_PAGE];
        float projected[MAX_GROUP * MAX_RANK]; /* [G, r]: the group's queries in the page's basis, log2 units */
        float offset[MAX_GROUP];               /* [G]: mu . q_g, log2 units */
        float logits[MAX_GROUP * MAX_PAGE];    /* [G, P] */
        const float *qh = q + bh * group * dim, *qbh = qb + bh * group * dim;
        int64_t record = h * pages_total + page_table[b * num_pages + n];
        int64_t u = record * rank * dim, c = record * rank * page_size;
        float sc_values[1 + MAX_RANK];
        const float *sc = NULL;
        if (fmt >= FMT_INT8) {
            for (int64_t i = 0; i <= rank; i++) sc_values[i] = widen_fp16(scales[record * (1 + rank) + i]);
            sc = sc_values;
        }
        float unit = scale * LOG2_E;
#ifdef SCORE_NEON_READY
        if (neon_takes(dim, rank, page_size)) { /* a constant test in the common shapes' instantiations */
            out[item] = score_page_neon(qh, qbh, mean, basis, coords, sc, record, unit, group, dim, rank, page_size,
                                        fmt);
            continue;
        }
#endif
        for (int64_t d = 0; d < dim; d++) row[d] = load_record(mean, record * dim + d, mean_fmt);
        for (int64_t g = 0; g < group; g++) offset[g] = unit * (sc ? sc[0] : 1.0f) * dot(qh + g * dim, row, dim);
        for (int64_t i = 0; i < rank; i++) {
            for (int64_t d = 0; d < dim; d++)
                row[d] = fmt == FMT_INT4 ? load_int5(basis, record * rank + i, d, dim)
                                         : load_record(basis, u + i * dim + d, fmt);
            float folded = sc ? unit * sc[1 + i] : unit;
            for (int64_t g = 0; g < group; g++) projected[g * rank + i] = folded * dot(qbh + g * dim, row, dim);
        }
        float peak = -3.0e38f;
        for (int64_t i = 0; i < rank; i++) { /* logits [G, P] = offset [G] + projected [G, r] x R^T [r, P] */
            for (int64_t p = 0; p < page_size; p++)
                row[p] = fmt == FMT_INT4 ? load_int4_coord(coords, record, i, p, rank, page_size)
                                         : load_record(coords, c + i * page_size + p, fmt);
            for (int64_t g = 0; g < group; g++) {
                float z = projected[g * rank + i], *lg = logits + g * page_size;
                if (i == 0) {
                    for (int64_t p = 0; p < page_size; p++) lg[p] = offset[g] + z * row[p];
                } else {
                    for (int64_t p = 0; p < page_size; p++) lg[p] += z * row[p];
                }
            }
        }
        for (int64_t j = 0; j < group * page_size; j++) peak = logits[j] > peak ? logits[j] : peak;
#ifdef SCORE_NEON_READY
        out[item] = page_score(neon_exp2_shifted(logits, group * page_size, peak), peak); /* no scalar tail */
#else
        float total = 0.0f;
        for (int64_t j = 0; j < group * page_size; j++) total += exp2_nonpositive(logits[j] - peak);
        out[item] = page_score(total, peak);
#endif
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include "score_avx2.h"
#endif

/* Public entry points, one per record format (the signatures cpu.py declares). The common head dims and page sizes
 * get their own instantiation of the plain body (constant trip counts unroll the short inner loops), but only its
 * single-threaded calls keep them: an OpenMP region is outlined into a function that reads its variables from
 * memory (score_avx2.h's range functions are the way around it; the plain body, for CPUs without AVX2, has not
 * been given them). Returns 1 for shapes above the fixed limits, 2 for a page index outside the pool, 3 without
 * memory. */
#define SCORE_WITH(DIM, PAGE)                                                                                 \
    oval_scores_plain(q, qb, mean, basis, coords, scales, page_table, counts, batch, kv_heads, group, DIM,    \
                      rank, PAGE, num_pages, pages_total, scale, out, threads, fmt)
static inline __attribute__((always_inline)) int oval_scores(
    const float *q, const void *mean, const void *basis, const void *coords, const uint16_t *scales,
    const int64_t *page_table, const int64_t *counts, int64_t batch, int64_t kv_heads, int64_t group, int64_t dim,
    int64_t rank, int64_t page_size, int64_t num_pages, int64_t pages_total, float scale, float *out,
    int64_t threads, int fmt) {
    int problem = check_scores(page_table, counts, scales, batch, group, dim, rank, page_size, num_pages,
                               pages_total, fmt);
    if (problem) return problem;
    if (threads < 1) threads = 1;
    const float *qb = q;
    float *rotated = NULL;
    if (fmt == FMT_INT4) { /* the basis rows are stored as b H: dot them with H q */
        const int64_t rows = batch * kv_heads * group;
        rotated = (float *)malloc((size_t)(rows * dim) * sizeof(float));
        if (!rotated) return 3;
        memcpy(rotated, q, (size_t)(rows * dim) * sizeof(float));
        for (int64_t r = 0; r < rows; r++) hadamard_rotate(rotated + r * dim, dim);
        qb = rotated;
    }
#ifdef SCORE_AVX2_READY
    if (avx2_takes(dim, rank, page_size))
        problem = oval_scores_avx2(q, qb, mean, basis, coords, scales, page_table, counts, batch, kv_heads, group,
                                   dim, rank, page_size, num_pages, pages_total, scale, out, threads, fmt);
    else
#endif
    if (dim == 64 && page_size == 16) SCORE_WITH(64, 16);
    else if (dim == 64 && page_size == 32) SCORE_WITH(64, 32);
    else if (dim == 64 && page_size == 64) SCORE_WITH(64, 64);
    else if (dim == 128 && page_size == 16) SCORE_WITH(128, 16);
    else if (dim == 128 && page_size == 32) SCORE_WITH(128, 32);
    else if (dim == 128 && page_size == 64) SCORE_WITH(128, 64);
    else SCORE_WITH(dim, page_size);
    free(rotated);
    return problem;
}

#define SCORE_ARGS                                                                                            \
    const float *q, const void *mean, const void *basis, const void *coords, const uint16_t *scales,         \
        const int64_t *page_table, const int64_t *counts, int64_t batch, int64_t kv_heads, int64_t group,     \
        int64_t dim, int64_t rank, int64_t page_size, int64_t num_pages, int64_t pages_total, float scale,    \
        float *out, int64_t threads
#define SCORE_CALL(FMT)                                                                                       \
    return oval_scores(q, mean, basis, coords, scales, page_table, counts, batch, kv_heads, group, dim, rank, \
                       page_size, num_pages, pages_total, scale, out, threads, FMT);
int oval_scores_f32(SCORE_ARGS) { SCORE_CALL(FMT_F32) }
int oval_scores_bf16(SCORE_ARGS) { SCORE_CALL(FMT_BF16) }
int oval_scores_int8(SCORE_ARGS) { SCORE_CALL(FMT_INT8) }
int oval_scores_int4(SCORE_ARGS) { SCORE_CALL(FMT_INT4) }

/* Which body scores (for the startup report and the tests): 2 when the AVX2 body and the AVX-512 int4 one
 * (score_int4_avx512.h) were built in, 1 for the AVX2 body alone, else 0. */
/* 1 when the plain body scores its pages with the Advanced SIMD page (score_neon.h: Arm), else 0. */
int oval_scores_neon(void) {
#if defined(SCORE_NEON_READY)
    return 1;
#else
    return 0;
#endif
}

int oval_scores_vectorised(void) {
#if defined(SCORE_INT4_WIDE_READY)
    return 2;
#elif defined(SCORE_AVX2_READY)
    return 1;
#else
    return 0;
#endif
}
