/* Fused CPU kernels for OVAL decode (DESIGN §4.3, §4.6), called through ctypes by oval_edge/kernels/cpu.py.
 *
 * Why C: in eager torch, scoring one layer's pages is ~15 separate passes (gather, bf16 -> fp32 copies, a matmul
 * with three rows, r broadcast multiply-adds, a log-sum-exp) and a decode attention first copies every selected
 * K/V row into a new fp32 buffer. Here each page (or slot) is read once, straight from the pool, and everything
 * else stays in registers or L1. The arithmetic is the same (fp32 accumulation); only the summation order differs.
 *
 * Both kernels read the pool in its storage type, fp32 or bf16 (widened by a 16-bit shift): each is written once
 * and instantiated for both by the public wrappers at the end. They are single-threaded. Each returns 0, or a
 * nonzero code for arguments it refuses (the caller then raises or falls back); indices are checked before any
 * memory is read, so they never touch memory outside what the shapes describe.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#define MAX_DIM 256      /* head dim */
#define MAX_GROUP 32     /* query heads per KV head */
#define MAX_RANK 256     /* oval basis rank */
#define MAX_PAGE 256     /* tokens per page */
#define MIN_PAGES_PER_THREAD 32 /* a thread forks for no fewer pages to score: a fork costs about as much as 32 */

static inline float widen_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Element i of a pool tensor stored as bf16 (is_bf16) or fp32; is_bf16 is a constant after inlining. */
static inline __attribute__((always_inline)) float load(const void *base, int64_t i, int is_bf16) {
    return is_bf16 ? widen_bf16(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* K/V row storage of attend_slots: fp32, bf16, or int8 codes times the row's fp32 scale (kv_dtype='int8'). */
#define KV_F32 0
#define KV_BF16 1
#define KV_INT8 2

static inline __attribute__((always_inline)) int64_t kv_size(int kv) { return kv == KV_F32 ? 4 : kv == KV_BF16 ? 2 : 1; }

/* row[0..dim) = K or V row r, widened to fp32 (int8: code * scales[r]); kv is a constant after inlining. */
static inline __attribute__((always_inline)) void load_kv_row(float *restrict row, const void *rows,
                                                             const float *scales, int64_t r, int64_t dim, int kv) {
    if (kv == KV_INT8) {
        const int8_t *codes = (const int8_t *)rows + r * dim;
        float s = scales[r];
        for (int64_t d = 0; d < dim; d++) row[d] = (float)codes[d] * s;
    } else {
        for (int64_t d = 0; d < dim; d++) row[d] = load(rows, r * dim + d, kv == KV_BF16);
    }
}

/* 2^x for x <= 0 without libm, so the compiler vectorises the loops that call it. x = n + f with n = round(x),
 * |f| <= 1/2, 2^f by its Taylor series to degree 6 (relative error < 1.3e-7, about fp32's rounding), 2^n from
 * the exponent bits. x is clamped at -126, so terms below 2^-126 count as 2^-126 (~1e-38): next to the largest
 * term, which is 1, that changes no sum, and unread slots are skipped by the caller, not weighted by this. */
static inline float exp2_nonpositive(float x) {
    float clamped = x < -126.0f ? -126.0f : x;
    float n = floorf(clamped + 0.5f);
    float f = clamped - n;
    float p = 1.5403530e-04f;                    /* ln2^6 / 6! */
    p = p * f + 1.3333558e-03f;                  /* ln2^5 / 5! */
    p = p * f + 9.6181291e-03f;                  /* ln2^4 / 4! */
    p = p * f + 5.5504109e-02f;                  /* ln2^3 / 3! */
    p = p * f + 2.4022651e-01f;                  /* ln2^2 / 2! */
    p = p * f + 6.9314718e-01f;                  /* ln2 */
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Software prefetch of the K/V rows the attention reads PREFETCH_SLOTS slots ahead. Why: a KV head's rows in the
 * pool come in page-sized runs (page_size * dim elements) separated by the other heads' runs, and hardware
 * prefetchers stop at each 4 KB memory page, so without it every run starts with a stall on DRAM (measured at 8k:
 * two dense layers 2.1 -> 1.25 ms per step). Page scoring is compute-bound and gains nothing from it. */
#define PREFETCH_SLOTS 32
#define CACHE_LINE 64

static inline void prefetch_bytes(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += CACHE_LINE) __builtin_prefetch(p + off, 0, 3);
}

static inline __attribute__((always_inline)) void prefetch_row(const void *rows, int64_t row, int64_t dim, int kv) {
    int64_t size = kv_size(kv);
    prefetch_bytes((const char *)rows + row * dim * size, dim * size);
}

/* A row's share of a padded axis: counts[b] clamped to [0, width], or the whole width without counts. */
static inline int64_t row_count(const int64_t *counts, int64_t b, int64_t width) {
    if (!counts) return width;
    int64_t c = counts[b];
    return c < 0 ? 0 : (c > width ? width : c);
}

#define UNSCORED (-3.0e38f) /* the score of a page a row's count leaves out (finite: built with finite math) */

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* Record element formats (page_record.py): the pool's dtype, or quantized. FMT is a constant after inlining. */
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_INT8 2
#define FMT_INT4 3 /* two values a byte, the even element in the low nibble, stored as q + 8 */

/* Element i of a record tensor in format fmt, before its scale (int formats give the integer level). */
static inline __attribute__((always_inline)) float load_record(const void *base, int64_t i, int fmt) {
    if (fmt == FMT_F32) return ((const float *)base)[i];
    if (fmt == FMT_BF16) return widen_bf16(((const uint16_t *)base)[i]);
    if (fmt == FMT_INT8) return (float)((const int8_t *)base)[i];
    uint8_t byte = ((const uint8_t *)base)[i >> 1];
    return (float)((int)((i & 1) ? byte >> 4 : byte & 15) - 8);
}

/* Page scores (scoring.oval_scores): for each row b, KV head h and listed page n,
 *   out[b, h, n] = ln( sum over the group's heads g and the page's tokens p of exp(scale * (mu . q_g + R[p] . (B^T q_g))) )
 * q [B, Hkv, G, D] fp32; one layer's records (page_record.py), head-major: mean [Hkv, pages_total, D], basis B^T
 * [Hkv, pages_total, r, D], coords R^T [Hkv, pages_total, r, P], scales [Hkv, pages_total, 1 + 2r] fp32 (int
 * formats; NULL for float ones): value = scale * level, the mean's scale first, then each basis row's, then each
 * coordinate row's. The scales fold into the projections, so the inner loops are those of the float record.
 * page_table [B, Np] physical pages; out [B, Hkv, Np] fp32.
 * counts [B] (or NULL: all Np): how many leading pages of each row to score. Why: the static decode step pads every
 * page table to the longest allowed sequence; pages past a row's count are not read and get UNSCORED (callers mask
 * them: they are not candidates), so the work follows the row's length while the shapes stay fixed.
 * threads: the OpenMP team's size to split the pages over (1 without OpenMP; short tables stay on one thread).
 * Returns 1 for shapes above the fixed limits, 2 for a page index outside the pool. */
static inline __attribute__((always_inline)) int oval_scores(
    const float *restrict q, const void *restrict mean, const void *restrict basis, const void *restrict coords,
    const float *restrict scales, const int64_t *restrict page_table, const int64_t *restrict counts, int64_t batch,
    int64_t kv_heads, int64_t group, int64_t dim, int64_t rank, int64_t page_size, int64_t num_pages,
    int64_t pages_total, float scale, float *restrict out, int64_t threads, int fmt) {
    if (dim > MAX_DIM || group > MAX_GROUP || rank > MAX_RANK || page_size > MAX_PAGE) return 1;
    if (fmt >= FMT_INT8 && !scales) return 1;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t n = 0; n < row_count(counts, b, num_pages); n++)
            if (page_table[b * num_pages + n] < 0 || page_table[b * num_pages + n] >= pages_total) return 2;
    const float log2e = 1.4426950408889634f, ln2 = 0.6931471805599453f;
    const int mean_fmt = fmt >= FMT_INT8 ? FMT_INT8 : fmt; /* the int4 record keeps an int8 mean */
    const int64_t items = batch * kv_heads * num_pages;
    if (threads < 1) threads = 1;
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
        const float *qh = q + bh * group * dim;
        int64_t record = h * pages_total + page_table[b * num_pages + n];
        int64_t u = record * rank * dim, c = record * rank * page_size;
        const float *sc = fmt >= FMT_INT8 ? scales + record * (1 + 2 * rank) : NULL;
        float unit = scale * log2e;
        for (int64_t d = 0; d < dim; d++) row[d] = load_record(mean, record * dim + d, mean_fmt);
        for (int64_t g = 0; g < group; g++) offset[g] = unit * (sc ? sc[0] : 1.0f) * dot(qh + g * dim, row, dim);
        for (int64_t i = 0; i < rank; i++) {
            for (int64_t d = 0; d < dim; d++) row[d] = load_record(basis, u + i * dim + d, fmt);
            float folded = sc ? unit * sc[1 + i] * sc[1 + rank + i] : unit;
            for (int64_t g = 0; g < group; g++) projected[g * rank + i] = folded * dot(qh + g * dim, row, dim);
        }
        float peak = -3.0e38f;
        for (int64_t i = 0; i < rank; i++) { /* logits [G, P] = offset [G] + projected [G, r] x R^T [r, P] */
            for (int64_t p = 0; p < page_size; p++) row[p] = load_record(coords, c + i * page_size + p, fmt);
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
        float total = 0.0f;
        for (int64_t j = 0; j < group * page_size; j++) total += exp2_nonpositive(logits[j] - peak);
        out[item] = (log2f(total) + peak) * ln2;
    }
    return 0;
}

/* Exact attention of one new token per row over the slots a selection names (attention.attend_selection):
 *   out[b, h*G + g] = sum_t softmax_t(scale * q_g . k_t) v_t  over the valid slots t of (b, h)
 * q [B, Hkv, G, D] fp32; k_rows, v_rows [rows_total, D] (one layer of the pool); flat [B, Hkv, T] row indices;
 * valid [B, Hkv, T] (bytes, 0 or 1); scratch: B * Hkv * G * T floats; out [B, Hkv, G, D] fp32.
 * threads: the OpenMP team's size to split the (b, h) pairs over (1 without OpenMP).
 * K and V rows are read in place: nothing is gathered. A (b, h) with no valid slot gets zeros.
 * limits [B] (or NULL: all T): slots at or past limits[b] count as invalid and are not visited (the static step's
 * dense layers list every slot of the padded page table; a row's length bounds what it reads).
 * Returns 1 for shapes above the fixed limits, 2 for a slot index outside the layer. */
static inline __attribute__((always_inline)) int attend_slots(
    const float *restrict q, const void *restrict k_rows, const void *restrict v_rows, int64_t rows_total,
    const int64_t *restrict flat, const uint8_t *restrict valid, const int64_t *restrict limits, int64_t batch,
    int64_t kv_heads, int64_t group, int64_t dim, int64_t slots, float scale, float *restrict scratch,
    float *restrict out, const float *restrict k_scales, const float *restrict v_scales, int64_t threads, int kv) {
    if (dim > MAX_DIM || group > MAX_GROUP) return 1;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t t = 0, i = (b * kv_heads + h) * slots; t < row_count(limits, b, slots); t++)
                if (valid[i + t] && (flat[i + t] < 0 || flat[i + t] >= rows_total)) return 2;
    const float log2e = 1.4426950408889634f;
    const int64_t pairs = batch * kv_heads;
    if (threads < 1) threads = 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1 && pairs > 1)
#endif
    for (int64_t bh = 0; bh < pairs; bh++) {
        const int64_t b = bh / kv_heads, h = bh % kv_heads;
        float row[MAX_DIM];
        float acc[MAX_GROUP * MAX_DIM];
        float peak[MAX_GROUP], total[MAX_GROUP];
        float *weights = scratch + bh * group * slots; /* [G, T] logits, then weights, of this (b, h) */
        const float *qh = q + (b * kv_heads + h) * group * dim;
        const int64_t *idx = flat + (b * kv_heads + h) * slots;
        const uint8_t *ok = valid + (b * kv_heads + h) * slots;
        float *oh = out + (b * kv_heads + h) * group * dim;
        int64_t used = row_count(limits, b, slots); /* slots [0, used) are visited; weights keep stride slots */
        for (int64_t g = 0; g < group; g++) peak[g] = -3.0e38f;
        int64_t seen = 0;
        /* Logits in log2 units. Unread slots get -3e38: weight ~1e-38, and their values are never read. */
        for (int64_t t = 0; t < used; t++) {
            if (!ok[t]) {
                for (int64_t g = 0; g < group; g++) weights[g * slots + t] = -3.0e38f;
                continue;
            }
            if (t + PREFETCH_SLOTS < used) prefetch_row(k_rows, idx[t + PREFETCH_SLOTS], dim, kv);
            load_kv_row(row, k_rows, k_scales, idx[t], dim, kv);
            for (int64_t g = 0; g < group; g++) {
                float s = scale * log2e * dot(qh + g * dim, row, dim);
                weights[g * slots + t] = s;
                peak[g] = s > peak[g] ? s : peak[g];
            }
            seen++;
        }
        if (seen == 0) {
            memset(oh, 0, (size_t)(group * dim) * sizeof(float));
            continue;
        }
        for (int64_t g = 0; g < group; g++) { /* one vectorised pass: logits -> unnormalised weights */
            float *w = weights + g * slots, sum = 0.0f;
            for (int64_t t = 0; t < used; t++) {
                w[t] = exp2_nonpositive(w[t] - peak[g]);
                sum += w[t];
            }
            total[g] = sum;
        }
        for (int64_t j = 0; j < group * dim; j++) acc[j] = 0.0f;
        for (int64_t t = 0; t < used; t++) {
            if (!ok[t]) continue;
            if (t + PREFETCH_SLOTS < used) prefetch_row(v_rows, idx[t + PREFETCH_SLOTS], dim, kv);
            load_kv_row(row, v_rows, v_scales, idx[t], dim, kv);
            for (int64_t g = 0; g < group; g++) {
                float w = weights[g * slots + t], *a = acc + g * dim;
                for (int64_t d = 0; d < dim; d++) a[d] += w * row[d];
            }
        }
        for (int64_t g = 0; g < group; g++)
            for (int64_t d = 0; d < dim; d++) oh[g * dim + d] = acc[g * dim + d] / total[g];
    }
    return 0;
}

/* Public entry points: one per pool storage type (the signatures native_kernels.py declares). The common head dims
 * and page sizes get their own instantiation: with constant trip counts the compiler unrolls the short inner loops
 * and drops their remainders (measured: scoring at D = 64, P = 32 takes 85 instead of 108 us per layer at 8k). */
#define SCORE_ARGS                                                                                            \
    const float *q, const void *mean, const void *basis, const void *coords, const float *scales,            \
        const int64_t *page_table, const int64_t *counts, int64_t batch, int64_t kv_heads, int64_t group,     \
        int64_t dim, int64_t rank, int64_t page_size, int64_t num_pages, int64_t pages_total, float scale,    \
        float *out, int64_t threads
#define SCORE_WITH(DIM, PAGE, FMT)                                                                            \
    oval_scores(q, mean, basis, coords, scales, page_table, counts, batch, kv_heads, group, DIM, rank, PAGE,  \
                num_pages, pages_total, scale, out, threads, FMT)
#define SCORE_DISPATCH(FMT)                                                                                   \
    if (dim == 64 && page_size == 16) return SCORE_WITH(64, 16, FMT);                                         \
    if (dim == 64 && page_size == 32) return SCORE_WITH(64, 32, FMT);                                         \
    if (dim == 64 && page_size == 64) return SCORE_WITH(64, 64, FMT);                                         \
    if (dim == 128 && page_size == 16) return SCORE_WITH(128, 16, FMT);                                       \
    if (dim == 128 && page_size == 32) return SCORE_WITH(128, 32, FMT);                                       \
    if (dim == 128 && page_size == 64) return SCORE_WITH(128, 64, FMT);                                       \
    return SCORE_WITH(dim, page_size, FMT);
int oval_scores_f32(SCORE_ARGS) { SCORE_DISPATCH(FMT_F32) }
int oval_scores_bf16(SCORE_ARGS) { SCORE_DISPATCH(FMT_BF16) }
int oval_scores_int8(SCORE_ARGS) { SCORE_DISPATCH(FMT_INT8) }
int oval_scores_int4(SCORE_ARGS) { SCORE_DISPATCH(FMT_INT4) }

#define ATTEND_ARGS                                                                                           \
    const float *q, const void *k_rows, const void *v_rows, int64_t rows_total, const int64_t *flat,          \
        const uint8_t *valid, const int64_t *limits, int64_t batch, int64_t kv_heads, int64_t group,           \
        int64_t dim, int64_t slots, float scale, float *weights, float *out, const float *k_scales,             \
        const float *v_scales, int64_t threads
#define ATTEND_WITH(DIM, KV)                                                                                  \
    attend_slots(q, k_rows, v_rows, rows_total, flat, valid, limits, batch, kv_heads, group, DIM, slots, scale, \
                 weights, out, k_scales, v_scales, threads, KV)
#define ATTEND_DISPATCH(KV)                                                                                   \
    if (dim == 64) return ATTEND_WITH(64, KV);                                                                \
    if (dim == 128) return ATTEND_WITH(128, KV);                                                              \
    return ATTEND_WITH(dim, KV);
/* k_scales, v_scales: the rows' fp32 scales [rows_total] for int8 (NULL otherwise). */
int attend_slots_f32(ATTEND_ARGS) { ATTEND_DISPATCH(KV_F32) }
int attend_slots_bf16(ATTEND_ARGS) { ATTEND_DISPATCH(KV_BF16) }
int attend_slots_int8(ATTEND_ARGS) { ATTEND_DISPATCH(KV_INT8) }

