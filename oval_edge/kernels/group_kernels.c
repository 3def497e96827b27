/* Two-level page scoring (oval_edge/sparse/grouped.py) in one call: coarse group bounds, the choice of groups, and
 * the fine records of the chosen groups' pages. Called through ctypes by oval_edge/kernels/cpu.py.
 *
 * Why C: in torch the coarse level is ~60 small ops a layer (gathers, einsums, a box bound, two log-sum-exps, a
 * top-k, the fine table's index arithmetic, a scatter); on two cores that cost more than the flat scan it replaces
 * (18.8 vs 15.8 ms a decode step at 32k, measured). Here a layer is one call: the coarse records are read in place
 * and each group's bound is a few dot products, the selection and the fine table are integer loops, and the fine
 * scoring is score_kernels.c's own entry point over the compacted table.
 *
 * Same result as grouped.grouped_scores (the torch reference): scores [B, Hkv, Np] with -inf on every page that is
 * not scored finely. Only the summation order differs, and on exact ties between two groups' masses the lower group
 * is kept (torch.topk does not promise an order).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <float.h>
#include <math.h>
#include "kernel_math.h"
#if defined(__ARM_NEON)
#include "kernel_neon.h"
#endif

#define MAX_RANK 256          /* as score_kernels.c */
#define MAX_HEADS 64          /* KV heads a coarse mass sums over */
#define MIN_GROUPS_PER_THREAD 16 /* coarse items a thread forks for: each is (r + 1) G dot products of D */

/* score_kernels.c's entry points, one per fine record format (FMT_F32 .. FMT_INT4 there), all of this type. */
typedef int fine_scorer(const float *q, const void *mean, const void *basis, const void *coords, const uint16_t *scales,
                        const int64_t *page_table, const int64_t *counts, int64_t batch, int64_t kv_heads,
                        int64_t group, int64_t dim, int64_t rank, int64_t page_size, int64_t num_pages,
                        int64_t pages_total, float scale, float *out, int64_t threads);
fine_scorer oval_scores_f32, oval_scores_bf16, oval_scores_int8, oval_scores_int4;

/* n values of a coarse record tensor from element `first`, widened to fp32 (bf16: the pool's dtype on a CPU). Two
 * loops rather than a per-element test, so each vectorises. */
static inline void widen_group(float *restrict dst, const void *base, int64_t first, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + first;
        for (int64_t i = 0; i < n; i++) dst[i] = widen_bf16(src[i]);
    } else {
        memcpy(dst, (const float *)base + first, (size_t)n * sizeof(float));
    }
}

/* Row element formats of the coarse record: its mean in the pool's float dtype, its basis rows in int8 codes. */
#define ROW_F32 0
#define ROW_BF16 1
#define ROW_INT8 2

#if defined(__AVX2__) && defined(__FMA__)
/* Elements first..first+7 of a coarse record tensor in format fmt, widened to fp32 in registers. */
static inline __attribute__((always_inline)) __m256 widen8_row(const void *base, int64_t first, int fmt) {
    if (fmt == ROW_F32) return _mm256_loadu_ps((const float *)base + first);
    if (fmt == ROW_BF16) {
        __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + first));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + first))));
}
#endif

/* out[g] = row . q_g for the G queries q [G, dim], row = elements first..first+dim-1 of base in format fmt. With
 * AVX2 + FMA and dim a multiple of 8 the row is widened in registers and each vector of it is dotted with four
 * queries (three horizontal adds end four dot products); else it is widened into a buffer and dotted one query at a
 * time. */
static inline __attribute__((always_inline)) void dot_queries(float *restrict out, const void *base, int64_t first,
                                                              const float *restrict q, int64_t group, int64_t dim,
                                                              int fmt) {
#if defined(__AVX2__) && defined(__FMA__)
    if (dim % 8 == 0) {
        for (int64_t g = 0; g < group; g += 4) {
            const int64_t n = group - g < 4 ? group - g : 4;
            const float *q0 = q + g * dim, *q1 = n > 1 ? q0 + dim : q0, *q2 = n > 2 ? q0 + 2 * dim : q0,
                        *q3 = n > 3 ? q0 + 3 * dim : q0;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            for (int64_t d = 0; d < dim; d += 8) {
                const __m256 r = widen8_row(base, first + d, fmt);
                a0 = _mm256_fmadd_ps(r, _mm256_loadu_ps(q0 + d), a0);
                a1 = _mm256_fmadd_ps(r, _mm256_loadu_ps(q1 + d), a1);
                a2 = _mm256_fmadd_ps(r, _mm256_loadu_ps(q2 + d), a2);
                a3 = _mm256_fmadd_ps(r, _mm256_loadu_ps(q3 + d), a3);
            }
            __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            float four[4];
            _mm_storeu_ps(four, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
            for (int64_t i = 0; i < n; i++) out[g + i] = four[i];
        }
        return;
    }
#elif defined(__ARM_NEON)
    if (dim % 8 == 0) { /* the row widened once, each vector of it dotted with four queries */
        float row[MAX_DIM];
        neon_widen(row, base, first, dim, fmt); /* ROW_* numbers the formats as NEON_* does */
        neon_dot_queries(out, row, q, group, dim);
        return;
    }
#endif
    float row[MAX_DIM];
    for (int64_t d = 0; d < dim; d++)
        row[d] = fmt == ROW_F32    ? ((const float *)base)[first + d]
                 : fmt == ROW_BF16 ? widen_bf16(((const uint16_t *)base)[first + d])
                                   : (float)((const int8_t *)base)[first + d];
    for (int64_t g = 0; g < group; g++) out[g] = dot(q + g * dim, row, dim);
}

#if defined(__AVX512F__) && defined(__AVX512VL__)
#include "group_avx512.h"
#endif

/* Prefetch the coarse basis codes of every KV head of slot (they sit together: [pages, Hkv, r, D]). Why: groups are
 * group_pages pages apart in the pool, so the hardware prefetcher, which follows a stream within a 4 KiB page,
 * misses the start of each record; unprefetched, the coarse level ran at half its in-cache speed (measured). */
static inline void prefetch_group(const void *basis, int64_t slot, int64_t kv_heads, int64_t rank, int64_t dim,
                                  int64_t slots_total) {
    if (slot < 0 || slot >= slots_total) return;
    const int64_t bytes = kv_heads * rank * dim; /* int8 codes */
    const char *start = (const char *)basis + slot * bytes;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(start + off, 0, 3);
}

/* A group's mass bound over the row's KV heads, in log2 units (grouped.coarse_scores, then log-sum-exp over the
 * heads): per head h and query g, mu . q + sum_i max(p_i lo_i, p_i hi_i) with p = B^T q, q in log2 units.
 * slot: the coarse record's slot (group_slot of the group's last page; >= 0). */
static inline __attribute__((always_inline)) float group_mass(
    const float *qs, const void *mean, const void *basis, const float *scales, const void *bounds, int bf16,
    int64_t slot, int64_t kv_heads, int64_t group, int64_t dim, int64_t rank) {
    float bound[MAX_HEADS * MAX_GROUP]; /* bound [Hkv, G]; the caller refused larger shapes */
    for (int64_t h = 0; h < kv_heads; h++) {
        const int64_t record = slot * kv_heads + h; /* [slots, Hkv, ...] */
        const float *qh = qs + h * group * dim;
        float *bh = bound + h * group, box[2 * MAX_RANK]; /* box [2, r]: the coordinates' min, then max */
        widen_group(box, bounds, record * 2 * rank, 2 * rank, bf16);
        float p[MAX_GROUP];
        dot_queries(bh, mean, record * dim, qh, group, dim, bf16 ? ROW_BF16 : ROW_F32);
#ifdef GROUP_BOUND8_READY
        if (rank == 8 && dim % 16 == 0) {
            const int8_t *rows = (const int8_t *)basis + record * rank * dim;
            for (int64_t g = 0; g < group; g += 3)
                switch (group - g) { /* one instantiation per chunk size */
                case 1: box_bound8(bh, qh, rows, scales + record * rank, box, g, 1, dim); break;
                case 2: box_bound8(bh, qh, rows, scales + record * rank, box, g, 2, dim); break;
                default: box_bound8(bh, qh, rows, scales + record * rank, box, g, 3, dim);
                }
            continue;
        }
#endif
        for (int64_t i = 0; i < rank; i++) {
            dot_queries(p, basis, (record * rank + i) * dim, qh, group, dim, ROW_INT8);
            const float unit = scales[record * rank + i]; /* the row's scale folds into its projections */
            const float lo = box[i] * unit, hi = box[rank + i] * unit;
            for (int64_t g = 0; g < group; g++) bh[g] += p[g] * lo > p[g] * hi ? p[g] * lo : p[g] * hi;
        }
    }
    /* log2 of the sum of 2^bound: one log2f a group (a log-add per term costs ~20 ns each, a third of the call) */
    const int64_t n = kv_heads * group;
    float peak = bound[0], total = 0.0f;
    for (int64_t i = 1; i < n; i++) peak = bound[i] > peak ? bound[i] : peak;
#if defined(__ARM_NEON)
    total = neon_exp2_shifted(bound, n, peak); /* no scalar tail; bound is not read again */
#else
    for (int64_t i = 0; i < n; i++) total += exp2_nonpositive(bound[i] - peak);
#endif
    return peak + log2f(total);
}

/* The `keep` largest of mass[0..n) (keep <= n) -> picked (group indices, ascending: the fine table then walks the
 * pool forwards). Ties keep the lower group. */
static void top_groups_of(const float *mass, int64_t n, int64_t keep, int64_t *picked, float *best) {
    int64_t count = 0;
    for (int64_t j = 0; j < n; j++) {
        float v = mass[j];
        if (count == keep && !(v > best[count - 1])) continue;
        int64_t at = count < keep ? count++ : keep - 1;
        while (at > 0 && v > best[at - 1]) {
            best[at] = best[at - 1];
            picked[at] = picked[at - 1];
            at--;
        }
        best[at] = v;
        picked[at] = j;
    }
    for (int64_t i = 1; i < count; i++) /* insertion sort by index: keep is small */
        for (int64_t k = i; k > 0 && picked[k] < picked[k - 1]; k--) {
            int64_t t = picked[k];
            picked[k] = picked[k - 1];
            picked[k - 1] = t;
        }
}

/* Two-level scores of q [B, Hkv, G, D] fp32 over page_table [B, Np] (physical pages; sealed [B]: pages with
 * records, in logical order) -> out [B, Hkv, Np] fp32.
 * Coarse records of one layer, [slots_total, Hkv, ...] (group_record.py): mean [D] and bounds [2, r] in fp32 or
 * bf16 (group_bf16), basis B^T [r, D] int8 codes with scales [r] fp32; group j's sits in slot group_slot[last],
 * last = page_table[b, j * group_pages + group_pages - 1] (group_slot [pages_total] int64, kv/group_slots.py); a
 * group whose slot is -1 has no record and ranks above every other (FLT_MAX: always kept).
 * Fine records of the layer and their format fine_fmt (0 fp32, 1 bf16, 2 int8, 3 int4): score_kernels.c's layout.
 * Per row: the complete groups (sealed / group_pages of them) are ranked by their mass bound summed over the KV
 * heads; the top_groups best, and the sealed pages of the unfinished group, are scored with their fine records;
 * every other page gets -inf. Returns 1 for shapes it does not take (the caller falls back to torch), 2 for a page
 * index outside the pool or a slot outside -1..slots_total-1, 3 without memory, or the fine scorer's code. */
int oval_grouped_scores(const float *q, const void *group_mean, const void *group_basis, const void *group_bounds,
                        const float *group_scales, int64_t group_bf16, const int64_t *group_slot,
                        int64_t slots_total, const void *mean, const void *basis,
                        const void *coords, const uint16_t *scales, int64_t fine_fmt, const int64_t *page_table,
                        const int64_t *sealed, int64_t batch, int64_t kv_heads, int64_t group, int64_t dim,
                        int64_t rank, int64_t page_size, int64_t num_pages, int64_t pages_total, int64_t group_pages,
                        int64_t top_groups, float scale, float *out, int64_t threads) {
    static fine_scorer *const fine_scorers[4] = {oval_scores_f32, oval_scores_bf16, oval_scores_int8,
                                                oval_scores_int4};
    if (dim > MAX_DIM || group > MAX_GROUP || rank > MAX_RANK || kv_heads > MAX_HEADS || fine_fmt < 0 ||
        fine_fmt > 3 || group_pages < 1 || top_groups < 1 || num_pages / group_pages <= top_groups)
        return 1;
    if (threads < 1) threads = 1;
    const int64_t ngroups = num_pages / group_pages, width = (top_groups + 1) * group_pages;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t complete = (sealed[b] < 0 ? 0 : sealed[b]) / group_pages;
        for (int64_t j = 0; j < (complete < ngroups ? complete : ngroups); j++) {
            const int64_t last = page_table[b * num_pages + j * group_pages + group_pages - 1];
            if (last < 0 || last >= pages_total || group_slot[last] < -1 || group_slot[last] >= slots_total) return 2;
        }
    }
    /* scratch: queries in log2 units [B, Hkv, G, D]; masses [B, Ng]; the fine table, its logical pages and
     * counts [B, F], [B, F], [B]; fine scores [B, Hkv, F]; the selection's working arrays [top_groups] x 2 */
    const int64_t qn = batch * kv_heads * group * dim;
    float *qs = malloc((size_t)qn * sizeof(float));
    float *mass = malloc((size_t)(batch * ngroups) * sizeof(float));
    int64_t *table = malloc((size_t)(batch * width) * sizeof(int64_t));
    int64_t *logical = malloc((size_t)(batch * width) * sizeof(int64_t));
    int64_t *counts = malloc((size_t)batch * sizeof(int64_t));
    float *fine = malloc((size_t)(batch * kv_heads * width) * sizeof(float));
    int64_t *picked = malloc((size_t)top_groups * sizeof(int64_t));
    float *best = malloc((size_t)top_groups * sizeof(float));
    int code = 3;
    if (!qs || !mass || !table || !logical || !counts || !fine || !picked || !best) goto done;
    const float unit = scale * LOG2_E;
    for (int64_t i = 0; i < qn; i++) qs[i] = q[i] * unit;

    /* 1. every complete group's mass bound: flat (b, j) items, split over the team when there are enough */
    const int64_t items = batch * ngroups;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && items >= 2 * MIN_GROUPS_PER_THREAD)
#endif
    for (int64_t item = 0; item < items; item++) {
        const int64_t b = item / ngroups, j = item % ngroups;
        const int64_t complete = (sealed[b] < 0 ? 0 : sealed[b]) / group_pages;
        if (j >= complete) continue; /* not complete: never ranked */
        const int64_t slot = group_slot[page_table[b * num_pages + j * group_pages + group_pages - 1]];
        if (j + 1 < ngroups && j + 1 < complete) /* the next group's record (validated), while this one is scored */
            prefetch_group(group_basis, group_slot[page_table[b * num_pages + (j + 2) * group_pages - 1]], kv_heads,
                           rank, dim, slots_total);
        mass[item] = slot < 0 ? FLT_MAX /* no record: always kept */
                              : group_mass(qs + b * kv_heads * group * dim, group_mean, group_basis, group_scales,
                                           group_bounds, (int)group_bf16, slot, kv_heads, group, dim, rank);
    }

    /* 2. per row: the best groups' pages, then the unfinished group's sealed ones, compacted to the front */
    for (int64_t b = 0; b < batch; b++) {
        const int64_t done_pages = sealed[b] < 0 ? 0 : (sealed[b] > num_pages ? num_pages : sealed[b]);
        int64_t complete = done_pages / group_pages;
        if (complete > ngroups) complete = ngroups;
        const int64_t keep = complete < top_groups ? complete : top_groups;
        top_groups_of(mass + b * ngroups, complete, keep, picked, best);
        int64_t n = 0, *lg = logical + b * width;
        for (int64_t i = 0; i < keep; i++)
            for (int64_t o = 0; o < group_pages; o++) lg[n++] = picked[i] * group_pages + o;
        for (int64_t page = complete * group_pages; page < done_pages && page < (complete + 1) * group_pages; page++)
            lg[n++] = page;
        counts[b] = n;
        for (int64_t i = 0; i < width; i++) /* unused tail: any valid page, never read (counts) */
            table[b * width + i] = page_table[b * num_pages + (i < n ? lg[i] : 0)];
    }

    /* 3. the fine records of those pages, then out: -inf except where a page was scored */
    code = fine_scorers[fine_fmt](q, mean, basis, coords, scales, table, counts, batch, kv_heads, group, dim, rank,
                                  page_size, width, pages_total, scale, fine, threads);
    if (code) goto done;
    const uint32_t minus_inf_bits = 0xff800000u; /* -inf as bits: this file is built with finite math */
    float minus_inf;
    memcpy(&minus_inf, &minus_inf_bits, sizeof minus_inf);
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < kv_heads; h++) {
            float *o = out + (b * kv_heads + h) * num_pages;
            const float *f = fine + (b * kv_heads + h) * width;
            for (int64_t i = 0; i < num_pages; i++) o[i] = minus_inf;
            for (int64_t i = 0; i < counts[b]; i++) o[logical[b * width + i]] = f[i];
        }
done:
    free(qs);
    free(mass);
    free(table);
    free(logical);
    free(counts);
    free(fine);
    free(picked);
    free(best);
    return code;
}
