/* Exact decode attention over pool rows ([R-exact-attention]), called through ctypes by oval_edge/kernels/cpu.py.
 *
 * Why C: a decode attention in eager torch first copies every selected K/V row into a new fp32 buffer. Here each
 * slot's row is read once, straight from the pool, in its storage type (fp32, bf16 widened by a 16-bit shift, or
 * int8 codes times the row's scale), and the logits and sums stay in L1. The arithmetic is the same (fp32
 * accumulation, one softmax); only the summation order differs. It returns 0, or a nonzero code for arguments it
 * refuses (the caller then raises or falls back); indices are checked before any memory is read, so it never
 * touches memory outside what the shapes describe.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernel_math.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* K/V row storage of attend_slots: fp32, bf16, or int8 codes times the row's fp32 scale (kv_dtype='int8'). */
#define KV_F32 0
#define KV_BF16 1
#define KV_INT8 2

/* A (row, KV head) pair's slots are split over the team in pieces of at least this many (a dense layer's pairs
 * at batch 1 are fewer than the threads; the sparse layers' 224 slots stay whole). */
#define MIN_SLOTS_PER_PIECE 2048

static inline __attribute__((always_inline)) int64_t kv_size(int kv) { return kv == KV_F32 ? 4 : kv == KV_BF16 ? 2 : 1; }

/* row[0..dim) = K or V row r, widened to fp32 (int8: code * scales[r]); kv is a constant after inlining. */
static inline __attribute__((always_inline)) void load_kv_row(float *restrict row, const void *rows,
                                                             const float *scales, int64_t r, int64_t dim, int kv) {
    if (kv == KV_INT8) {
        const int8_t *codes = (const int8_t *)rows + r * dim;
        float s = scales[r];
        for (int64_t d = 0; d < dim; d++) row[d] = (float)codes[d] * s;
    } else if (kv == KV_BF16) {
        for (int64_t d = 0; d < dim; d++) row[d] = widen_bf16(((const uint16_t *)rows)[r * dim + d]);
    } else {
        for (int64_t d = 0; d < dim; d++) row[d] = ((const float *)rows)[r * dim + d];
    }
}

/* Software prefetch of the K/V rows the attention reads PREFETCH_SLOTS slots ahead. Why: a KV head's rows in the
 * pool come in page-sized runs (page_size * dim elements) separated by the other heads' runs, and hardware
 * prefetchers stop at each 4 KB memory page, so without it every run starts with a stall on DRAM (measured at 8k:
 * two dense layers 2.1 -> 1.25 ms per step). */
#define PREFETCH_SLOTS 64
#define CACHE_LINE 64

static inline __attribute__((always_inline)) void prefetch_row(const void *rows, int64_t row, int64_t dim, int kv) {
    const char *p = (const char *)rows + row * dim * kv_size(kv);
    for (int64_t off = 0; off < dim * kv_size(kv); off += CACHE_LINE) __builtin_prefetch(p + off, 0, 3);
}

#if defined(__AVX2__) && defined(__FMA__)
#include "attend_avx2.h"
#elif defined(__ARM_NEON)
#include "kernel_neon.h" /* a slot's K row dotted with the group's queries four at a time */
#define ATTEND_NEON_READY 1
#endif

/* One piece of a pair: slots [first, last) of (b, h). Leaves in part the unnormalised sums relative to its own
 * peaks: part = [peak [G] | total [G] | acc [G, D]] (peak -3e38 and zeros when no slot of the piece is valid).
 * weights: the pair's [G, T] logits row block (stride slots); each piece writes only its own columns. */
static inline __attribute__((always_inline)) void attend_piece(
    const float *restrict qh, const void *k_rows, const void *v_rows, const int64_t *restrict idx,
    const uint8_t *restrict ok, int64_t first, int64_t last, int64_t group, int64_t dim, int64_t slots, float scale,
    float *restrict weights, float *restrict part, const float *k_scales, const float *v_scales, int kv) {
    float row[MAX_DIM];
    float acc[MAX_GROUP * MAX_DIM];
    float peak[MAX_GROUP], total[MAX_GROUP];
    float logit[MAX_GROUP]; /* [G]: one slot's logits */
    for (int64_t g = 0; g < group; g++) peak[g] = -3.0e38f;
    /* The queries times scale * log2 e: [G, D]. */
    float qs[MAX_GROUP * MAX_DIM];
    for (int64_t j = 0; j < group * dim; j++) qs[j] = scale * LOG2_E * qh[j];
    int64_t seen = 0;
    /* Logits in log2 units. Unread slots get -3e38: weight ~1e-38, and their values are never read. */
#ifdef KEYS_BLOCKED_READY
    if (attend_avx2_takes(dim)) /* a constant test for dims 64 and 128 */
        seen = key_logits_blocked(weights, peak, qs, k_rows, k_scales, idx, ok, first, last, group, dim, slots, kv);
    else
#endif
    for (int64_t t = first; t < last; t++) {
        if (!ok[t]) {
            for (int64_t g = 0; g < group; g++) weights[g * slots + t] = -3.0e38f;
            continue;
        }
        if (t + PREFETCH_SLOTS < last) prefetch_row(k_rows, idx[t + PREFETCH_SLOTS], dim, kv);
#ifdef ATTEND_AVX2_READY
        if (attend_avx2_takes(dim)) { /* a constant test for dims 64 and 128 */
            key_logits_avx2(logit, qs, k_rows, k_scales, idx[t], group, dim, kv);
        } else
#endif
        {
            load_kv_row(row, k_rows, k_scales, idx[t], dim, kv);
#ifdef ATTEND_NEON_READY
            if (dim % 4 == 0) /* a constant test for dims 64 and 128 */
                neon_dot_queries(logit, row, qs, group, dim);
            else
#endif
            for (int64_t g = 0; g < group; g++) logit[g] = dot(qs + g * dim, row, dim);
        }
        for (int64_t g = 0; g < group; g++) {
            weights[g * slots + t] = logit[g];
            peak[g] = logit[g] > peak[g] ? logit[g] : peak[g];
        }
        seen++;
    }
    for (int64_t g = 0; g < group; g++) part[g] = peak[g];
    memset(part + group, 0, (size_t)(group * (dim + 1)) * sizeof(float)); /* total and acc */
    if (seen == 0) return;
    for (int64_t g = 0; g < group; g++) { /* one vectorised pass: logits -> unnormalised weights */
        float *w = weights + g * slots, sum = 0.0f;
#ifdef ATTEND_NEON_READY
        total[g] = neon_exp2_shifted(w + first, last - first, peak[g]);
        continue;
#endif
        for (int64_t t = first; t < last; t++) {
            w[t] = exp2_nonpositive(w[t] - peak[g]);
            sum += w[t];
        }
        total[g] = sum;
    }
    for (int64_t j = 0; j < group * dim; j++) acc[j] = 0.0f;
#ifdef ATTEND_AVX2_READY
    if (attend_avx2_takes(dim))
        accumulate_values_avx2(acc, weights, v_rows, v_scales, idx, ok, first, last, group, dim, slots, kv);
    else
#endif
    for (int64_t t = first; t < last; t++) {
        if (!ok[t]) continue;
        if (t + PREFETCH_SLOTS < last) prefetch_row(v_rows, idx[t + PREFETCH_SLOTS], dim, kv);
        load_kv_row(row, v_rows, v_scales, idx[t], dim, kv);
        for (int64_t g = 0; g < group; g++) {
            float w = weights[g * slots + t], *a = acc + g * dim;
            for (int64_t d = 0; d < dim; d++) a[d] += w * row[d];
        }
    }
    for (int64_t g = 0; g < group; g++) part[group + g] = total[g];
    memcpy(part + 2 * group, acc, (size_t)(group * dim) * sizeof(float));
}

/* One call's inputs, shared by the threads that attend its pieces. */
struct attend_job {
    const float *q;
    const void *k_rows, *v_rows;
    const int64_t *flat, *limits;
    const uint8_t *valid;
    const float *k_scales, *v_scales;
    float *scratch, *parts;
    int64_t kv_heads, group, dim, slots, pieces, part_size;
    float scale;
};

/* Pieces first..last-1 (item = pair * pieces + piece). Its own function per storage type and common head dim
 * (below): an OpenMP region is outlined into a function that reads its variables from memory, so constants passed
 * into the region do not specialise anything; passed into this function they do. */
static inline __attribute__((always_inline)) void attend_range(const struct attend_job *job, int64_t first,
                                                               int64_t last, int64_t dim, int kv) {
    const int64_t group = job->group, slots = job->slots, pieces = job->pieces;
    for (int64_t item = first; item < last; item++) {
        const int64_t bh = item / pieces, piece = item % pieces, b = bh / job->kv_heads;
        const int64_t used = row_count(job->limits, b, slots); /* slots [0, used) are visited */
        attend_piece(job->q + bh * group * dim, job->k_rows, job->v_rows, job->flat + bh * slots,
                     job->valid + bh * slots, used * piece / pieces, used * (piece + 1) / pieces, group, dim, slots,
                     job->scale, job->scratch + bh * group * slots, job->parts + item * job->part_size,
                     job->k_scales, job->v_scales, kv);
    }
}

typedef void (*attend_range_fn)(const struct attend_job *, int64_t, int64_t);
#define ATTEND_RANGE(KV, DIM, NAME)                                                                           \
    static void NAME(const struct attend_job *job, int64_t first, int64_t last) {                             \
        attend_range(job, first, last, DIM, KV);                                                              \
    }
#define ATTEND_RANGES(KV, TAG)                                                                                \
    ATTEND_RANGE(KV, 64, attend_##TAG##_64)                                                                   \
    ATTEND_RANGE(KV, 128, attend_##TAG##_128)                                                                 \
    ATTEND_RANGE(KV, job->dim, attend_##TAG)                                                                  \
    static attend_range_fn pick_##TAG(int64_t dim) {                                                          \
        return dim == 64 ? attend_##TAG##_64 : dim == 128 ? attend_##TAG##_128 : attend_##TAG;               \
    }
ATTEND_RANGES(KV_F32, f32)
ATTEND_RANGES(KV_BF16, bf16)
ATTEND_RANGES(KV_INT8, int8)

/* Exact attention of one new token per row over the slots a selection names (attention.attend_selection):
 *   out[b, h*G + g] = sum_t softmax_t(scale * q_g . k_t) v_t  over the valid slots t of (b, h)
 * q [B, Hkv, G, D] fp32; k_rows, v_rows [rows_total, D] (one layer of the pool); flat [B, Hkv, T] row indices;
 * valid [B, Hkv, T] (bytes, 0 or 1); scratch: B * Hkv * G * T floats; out [B, Hkv, G, D] fp32.
 * threads: the OpenMP team's size (1 without OpenMP). The work is split into pieces of (b, h, slot range): whole
 * pairs when there are enough of them, else each pair's slots in equal parts, merged by their log-sum-exp (a dense
 * layer at batch 1 has 3 pairs for 2 threads: whole pairs left one thread idle a third of the time).
 * K and V rows are read in place: nothing is gathered. A (b, h) with no valid slot gets zeros.
 * limits [B] (or NULL: all T): slots at or past limits[b] count as invalid and are not visited (the static step's
 * dense layers list every slot of the padded page table; a row's length bounds what it reads).
 * Returns 1 for shapes above the fixed limits, 2 for a slot index outside the layer, 3 without memory. */
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
    const int64_t pairs = batch * kv_heads;
    if (threads < 1) threads = 1;
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++) longest = row_count(limits, b, slots) > longest ? row_count(limits, b, slots) : longest;
    int64_t pieces = 1; /* per pair: enough that every thread gets an equal share, none below the minimum */
    if (pairs % threads != 0) {
        int64_t want = threads;
        while (want > 1 && longest / want < MIN_SLOTS_PER_PIECE) want--;
        pieces = want;
    }
    const int64_t part_size = group * (dim + 2), items = pairs * pieces;
    float *parts = (float *)malloc((size_t)(items * part_size) * sizeof(float));
    if (!parts) return 3;
    const struct attend_job job = {q, k_rows, v_rows, flat, limits, valid, k_scales, v_scales, scratch, parts,
                                   kv_heads, group, dim, slots, pieces, part_size, scale};
    attend_range_fn range = kv == KV_F32 ? pick_f32(dim) : kv == KV_BF16 ? pick_bf16(dim) : pick_int8(dim);
#ifdef _OPENMP
    if (threads > 1 && items > 1) {
#pragma omp parallel num_threads(threads)
        { /* equal shares of the items, one per thread (whole items: pieces are sized so they divide evenly) */
            const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
            range(&job, items * me / team, items * (me + 1) / team);
        }
    } else
#endif
        range(&job, 0, items);
    for (int64_t bh = 0; bh < pairs; bh++) { /* merge each pair's pieces: rescale to the common peak, normalise */
        const float *part0 = parts + bh * pieces * part_size;
        float *oh = out + bh * group * dim;
        for (int64_t g = 0; g < group; g++) {
            float peak = -3.0e38f, total = 0.0f;
            for (int64_t p = 0; p < pieces; p++) peak = part0[p * part_size + g] > peak ? part0[p * part_size + g] : peak;
            float *o = oh + g * dim;
            memset(o, 0, (size_t)dim * sizeof(float));
            for (int64_t p = 0; p < pieces; p++) {
                const float *part = part0 + p * part_size;
                if (part[group + g] == 0.0f) continue; /* no valid slot in this piece */
                float factor = exp2_nonpositive(part[g] - peak);
                total += factor * part[group + g];
                for (int64_t d = 0; d < dim; d++) o[d] += factor * part[2 * group + g * dim + d];
            }
            if (total > 0.0f)
                for (int64_t d = 0; d < dim; d++) o[d] /= total;
        }
    }
    free(parts);
    return 0;
}

/* Public entry points: one per pool storage type (the signatures cpu.py declares). k_scales, v_scales: the rows'
 * fp32 scales [rows_total] for int8 (NULL otherwise). */
#define ATTEND_ARGS                                                                                           \
    const float *q, const void *k_rows, const void *v_rows, int64_t rows_total, const int64_t *flat,          \
        const uint8_t *valid, const int64_t *limits, int64_t batch, int64_t kv_heads, int64_t group,           \
        int64_t dim, int64_t slots, float scale, float *weights, float *out, const float *k_scales,             \
        const float *v_scales, int64_t threads
#define ATTEND_CALL(KV)                                                                                       \
    return attend_slots(q, k_rows, v_rows, rows_total, flat, valid, limits, batch, kv_heads, group, dim, slots, \
                        scale, weights, out, k_scales, v_scales, threads, KV);
int attend_slots_f32(ATTEND_ARGS) { ATTEND_CALL(KV_F32) }
int attend_slots_bf16(ATTEND_ARGS) { ATTEND_CALL(KV_BF16) }
int attend_slots_int8(ATTEND_ARGS) { ATTEND_CALL(KV_INT8) }
