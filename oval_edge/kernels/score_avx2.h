/* The AVX2 + FMA body of page scoring, included by score_kernels.c (which says why it exists) when the compiler
 * targets AVX2 and FMA. Same scores as oval_scores_plain; only the summation order differs.
 *
 * Per (row b, KV head h, page): the page's mean and r basis rows are widened to fp32 one row at a time and dotted
 * with the group's queries four at a time (three horizontal adds reduce four dot products); the r coordinate rows
 * are widened once into L1, then logits [G, P] = offset + projected x R^T run eight tokens a vector, and their
 * log-sum-exp uses an 8-lane 2^x (the same polynomial as exp2_nonpositive).
 * Takes: head dim and page size multiples of 16 (int4 rows are widened 16 values from 8 bytes), rank <= 16,
 * page_size <= 128; anything else takes the plain body. */
#define SCORE_AVX2_READY 1
#define AVX2_MAX_RANK 16
#define AVX2_MAX_PAGE 128

static inline int avx2_takes(int64_t dim, int64_t rank, int64_t page_size) {
    return dim % 16 == 0 && page_size % 16 == 0 && rank >= 1 && rank <= AVX2_MAX_RANK && page_size <= AVX2_MAX_PAGE;
}

/* 16 4-bit codes from 8 bytes (value 2j in byte j's low nibble, 2j + 1 in its high one) -> 16 bytes, element
 * order. */
static inline __attribute__((always_inline)) __m128i nibbles16(const uint8_t *src) {
    const __m128i nibble = _mm_set1_epi8(0x0F), bytes = _mm_loadl_epi64((const __m128i *)src);
    return _mm_unpacklo_epi8(_mm_and_si128(bytes, nibble), _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
}

/* n values (a multiple of 16) of a record tensor from element `first` (even), widened to fp32 levels in dst. */
static inline __attribute__((always_inline)) void widen_row(float *restrict dst, const void *base, int64_t first,
                                                            int64_t n, int fmt) {
    if (fmt == FMT_F32) {
        const float *src = (const float *)base + first;
        for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, _mm256_loadu_ps(src + i));
    } else if (fmt == FMT_BF16) {
        const uint16_t *src = (const uint16_t *)base + first;
        for (int64_t i = 0; i < n; i += 8) {
            __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
        }
    } else if (fmt == FMT_INT8) {
        const int8_t *src = (const int8_t *)base + first;
        for (int64_t i = 0; i < n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)))));
    } else { /* int4: byte j holds value 2j in its low nibble and 2j + 1 in its high one, each stored as q + 8 */
        const uint8_t *src = (const uint8_t *)base + first / 2;
        const __m256i bias = _mm256_set1_epi32(8);
        for (int64_t i = 0; i < n; i += 16) {
            __m128i ordered = nibbles16(src + i / 2);
            __m256i first8 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(ordered), bias);
            __m256i next8 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(ordered, 8)), bias);
            _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(first8));
            _mm256_storeu_ps(dst + i + 8, _mm256_cvtepi32_ps(next8));
        }
    }
}

/* n (a multiple of 16) 5-bit levels of an int4 record widened to fp32: their low nibbles packed two a byte at
 * `nibbles`, their fifth bits at `fifth` (element m's is bit m % 8 of byte m / 8). A basis row has its fifth bits
 * right after its nibbles; a coordinate row's are in the record's bit plane (score_kernels.c). */
static inline __attribute__((always_inline)) void widen_int5(float *restrict dst, const uint8_t *nibbles,
                                                             const uint8_t *fifth, int64_t n) {
    const __m256i bias = _mm256_set1_epi32(16), one = _mm256_set1_epi32(1);
    const __m256i first_bits = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i next_bits = _mm256_add_epi32(first_bits, _mm256_set1_epi32(8));
    for (int64_t i = 0; i < n; i += 16) {
        __m128i ordered = nibbles16(nibbles + i / 2);
        uint16_t bits;
        memcpy(&bits, fifth + i / 8, sizeof bits); /* element i + m's fifth bit is bit m */
        const __m256i high = _mm256_set1_epi32(bits);
        const __m256i high_first = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(high, first_bits), one), 4);
        const __m256i high_next = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(high, next_bits), one), 4);
        __m256i first8 = _mm256_or_si256(_mm256_cvtepu8_epi32(ordered), high_first);
        __m256i next8 = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_srli_si128(ordered, 8)), high_next);
        _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_sub_epi32(first8, bias)));
        _mm256_storeu_ps(dst + i + 8, _mm256_cvtepi32_ps(_mm256_sub_epi32(next8, bias)));
    }
}

/* One int4 record's coordinates (INT4_COORD_BYTES(rank, page) bytes at src, score_kernels.c) widened to fp32
 * levels dst [rank, page]: the rows with fifth bits as 5-bit levels, the rest as 4-bit ones. */
static inline __attribute__((always_inline)) void widen_int4_coords(float *restrict dst, const uint8_t *src,
                                                                    int64_t rank, int64_t page) {
    const int64_t wide = FIFTH_RANKS(rank) * page; /* values in the rows with fifth bits */
    widen_int5(dst, src, src + rank * page / 2, wide);
    widen_row(dst + wide, src, wide, rank * page - wide, FMT_INT4);
}

/* n fp16 scales -> fp32 (F16C where the build targets it). */
static inline __attribute__((always_inline)) void widen_scales(float *restrict dst, const uint16_t *src, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = _cvtsh_ss(src[i]);
#else
    for (; i < n; i++) dst[i] = widen_fp16(src[i]);
#endif
}

/* row . q_g for the G4 padded queries qs [G4, dim] -> out [G4] (a chunk of 3 real queries skips the padded one). */
static inline __attribute__((always_inline)) void dot_group(float *restrict out, const float *restrict row,
                                                            const float *restrict qs, int64_t group, int64_t group4,
                                                            int64_t dim) {
    for (int64_t g = 0; g < group4; g += 4) {
        const float *q = qs + g * dim;
        _mm_store_ps(out + g, group - g == 3 ? dot3(row, q, q + dim, q + 2 * dim, dim)
                                             : dot4(row, q, q + dim, q + 2 * dim, q + 3 * dim, dim));
    }
}

/* exp2_nonpositive on 8 lanes. */
static inline __m256 exp2_nonpositive8(__m256 x) {
    __m256 clamped = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(clamped, _mm256_set1_ps(0.5f)));
    __m256 f = _mm256_sub_ps(clamped, n);
    __m256 p = EXP2_TAYLOR(_mm256_fmadd_ps, _mm256_set1_ps, f);
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* One page's score. qs [G4, dim]: the group's queries times scale * log2 e, zero rows past G up to G4 (a multiple
 * of 4); qbs: the same for the basis rows (H q for the int4 record). record: the page's index in the layer's
 * head-major record tensors. */
static inline __attribute__((always_inline)) float score_page_avx2(
    const float *restrict qs, const float *restrict qbs, const void *mean, const void *basis, const void *coords, const float *sc,
    int64_t record, int64_t group, int64_t group4, int64_t dim, int64_t rank, int64_t page_size, int fmt) {
    const int mean_fmt = fmt >= FMT_INT8 ? FMT_INT8 : fmt; /* the int4 record keeps an int8 mean */
    float row[MAX_DIM] __attribute__((aligned(32)));
    float coord[AVX2_MAX_RANK * AVX2_MAX_PAGE] __attribute__((aligned(32))); /* [r, P] */
    float offset[MAX_GROUP] __attribute__((aligned(16)));                    /* [G4]: mu . q_g */
    float projected[AVX2_MAX_RANK * MAX_GROUP] __attribute__((aligned(16))); /* [r, G4]: B^T q_g */
    widen_row(row, mean, record * dim, dim, mean_fmt);
    dot_group(offset, row, qs, group, group4, dim);
    for (int64_t i = 0; i < rank; i++) {
        if (fmt == FMT_INT4) {
            const uint8_t *packed = (const uint8_t *)basis + (record * rank + i) * INT5_ROW_BYTES(dim);
            widen_int5(row, packed, packed + dim / 2, dim);
        } else {
            widen_row(row, basis, (record * rank + i) * dim, dim, fmt);
        }
        dot_group(projected + i * group4, row, qbs, group, group4, dim);
    }
    if (fmt == FMT_INT4)
        widen_int4_coords(coord, (const uint8_t *)coords + record * INT4_COORD_BYTES(rank, page_size), rank, page_size);
    else
        widen_row(coord, coords, record * rank * page_size, rank * page_size, fmt);
    if (sc) { /* quantized: value = scale * level; rank i's basis and coordinate scales are stored as one product */
        for (int64_t g = 0; g < group; g++) offset[g] *= sc[0];
        for (int64_t i = 0; i < rank; i++)
            for (int64_t g = 0; g < group; g++) projected[i * group4 + g] *= sc[1 + i];
    }
    float logits[MAX_GROUP * AVX2_MAX_PAGE] __attribute__((aligned(32))); /* [G, P] */
    __m256 peak8 = _mm256_set1_ps(-3.0e38f);
    for (int64_t g = 0; g < group; g++) {
        __m256 z[AVX2_MAX_RANK]; /* this query's coordinates in the basis, broadcast once */
        for (int64_t i = 0; i < rank; i++) z[i] = _mm256_set1_ps(projected[i * group4 + g]);
        const __m256 base = _mm256_set1_ps(offset[g]);
        for (int64_t p = 0; p < page_size; p += 8) {
            __m256 acc = base;
            for (int64_t i = 0; i < rank; i++) acc = _mm256_fmadd_ps(z[i], _mm256_load_ps(coord + i * page_size + p), acc);
            _mm256_store_ps(logits + g * page_size + p, acc);
            peak8 = _mm256_max_ps(peak8, acc);
        }
    }
    float peak = hmax8(peak8);
    __m256 shift = _mm256_set1_ps(peak), total8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < group * page_size; j += 8)
        total8 = _mm256_add_ps(total8, exp2_nonpositive8(_mm256_sub_ps(_mm256_load_ps(logits + j), shift)));
    return page_score(hsum8(total8), peak);
}

#if defined(__AVX512F__)
#include "score_int4_avx512.h"
#endif

/* Bytes from element `first` of a record tensor in format fmt, fetched into the cache ahead of use. Why: a page's
 * record lies in four tensors (mean, basis, coordinates, scales), and the pages a two-level table lists come in runs
 * of group_pages scattered over the pool; without it each run began with four stalls on DRAM (perf put the hottest
 * samples on the records' first loads; at 32k two-level scoring took 3.4 ms a step without it, 2.7 ms with it). */
static inline __attribute__((always_inline)) void prefetch_record(const void *base, int64_t first, int64_t count,
                                                                  int fmt) {
    const int64_t bits = fmt == FMT_F32 ? 32 : fmt == FMT_BF16 ? 16 : 8; /* int4 records' bytes come as FMT_INT8 */
    const char *start = (const char *)base + first * bits / 8;
    for (int64_t off = 0; off < count * bits / 8; off += 64) __builtin_prefetch(start + off, 0, 3);
}

#define RECORD_PREFETCH_PAGES 4 /* pages ahead: a page scores in ~150 ns, a DRAM fetch takes ~100 */

/* One call's inputs, shared by the threads that score its pages. */
struct score_job {
    const float *qs, *qbs;            /* [B * Hkv, G4, D]: the scaled, padded queries (qbs: the basis rows') */
    const void *mean, *basis, *coords;
    const uint16_t *scales;           /* fp16 bits */
    const int64_t *page_table, *counts;
    int64_t kv_heads, group, group4, dim, rank, page_size, num_pages, pages_total;
    float *out;
};

/* Pages first..last-1 of the flat (b, h, n) order. Its own function per record format and common shape (below):
 * an OpenMP region is outlined into a function that reads its variables from memory, so constants passed into
 * the region do not unroll anything; passed into this function they do. */
static inline __attribute__((always_inline)) void score_range(const struct score_job *job, int64_t first,
                                                              int64_t last, int64_t dim, int64_t rank,
                                                              int64_t page_size, int fmt) {
    const int64_t num_pages = job->num_pages, kv_heads = job->kv_heads, group4 = job->group4;
    int64_t n = first % num_pages, bh = first / num_pages; /* then counted up: no division per page */
    int64_t b = bh / kv_heads, h = bh % kv_heads, count = row_count(job->counts, b, num_pages);
    for (int64_t item = first; item < last; item++) {
        if (n >= count) {
            job->out[item] = UNSCORED;
        } else {
            if (n + RECORD_PREFETCH_PAGES < count) {
                const int64_t ahead = h * job->pages_total + job->page_table[b * num_pages + n + RECORD_PREFETCH_PAGES];
                prefetch_record(job->mean, ahead * dim, dim, fmt >= FMT_INT8 ? FMT_INT8 : fmt);
                if (fmt == FMT_INT4) /* its basis rows' bytes, counted as int8 elements */
                    prefetch_record(job->basis, ahead * rank * INT5_ROW_BYTES(dim), rank * INT5_ROW_BYTES(dim), FMT_INT8);
                else
                    prefetch_record(job->basis, ahead * rank * dim, rank * dim, fmt);
                if (fmt == FMT_INT4) /* its coordinates' bytes, likewise */
                    prefetch_record(job->coords, ahead * INT4_COORD_BYTES(rank, page_size),
                                    INT4_COORD_BYTES(rank, page_size), FMT_INT8);
                else
                    prefetch_record(job->coords, ahead * rank * page_size, rank * page_size, fmt);
                if (fmt >= FMT_INT8) /* fp16: 2-byte elements like bf16 */
                    prefetch_record(job->scales, ahead * (1 + rank), 1 + rank, FMT_BF16);
            }
            int64_t record = h * job->pages_total + job->page_table[b * num_pages + n];
            float sc_values[1 + AVX2_MAX_RANK] __attribute__((aligned(32)));
            const float *sc = NULL;
            if (fmt >= FMT_INT8) {
                widen_scales(sc_values, job->scales + record * (1 + rank), 1 + rank);
                sc = sc_values;
            }
#ifdef SCORE_INT4_WIDE_READY
            if (fmt == FMT_INT4 && int4_wide_takes(dim, rank, page_size))
                job->out[item] = score_page_int4_wide(job->qs + bh * group4 * dim, job->qbs + bh * group4 * dim,
                                                      job->mean, job->basis, job->coords, sc, record, job->group,
                                                      group4, dim, rank, page_size);
            else
#endif
            job->out[item] = score_page_avx2(job->qs + bh * group4 * dim, job->qbs + bh * group4 * dim, job->mean,
                                             job->basis, job->coords, sc, record, job->group, group4, dim, rank,
                                             page_size, fmt);
        }
        if (++n == num_pages) {
            n = 0;
            bh++;
            b = bh / kv_heads;
            h = bh % kv_heads;
            count = b < 0 ? 0 : row_count(job->counts, b, num_pages);
        }
    }
}

typedef void (*score_range_fn)(const struct score_job *, int64_t, int64_t);

#define RANGE_FN(FMT, DIM, RANK, PAGE, NAME)                                                                  \
    static void NAME(const struct score_job *job, int64_t first, int64_t last) {                              \
        score_range(job, first, last, DIM, RANK, PAGE, FMT);                                                  \
    }
#define RANGE_FNS(FMT, TAG)                                                                                   \
    RANGE_FN(FMT, job->dim, job->rank, job->page_size, range_##TAG)                                           \
    RANGE_FN(FMT, 64, 4, 32, range_##TAG##_64_4_32)                                                           \
    RANGE_FN(FMT, 64, 8, 32, range_##TAG##_64_8_32)                                                           \
    RANGE_FN(FMT, 64, 8, 16, range_##TAG##_64_8_16)                                                           \
    RANGE_FN(FMT, 64, 8, 64, range_##TAG##_64_8_64)                                                           \
    RANGE_FN(FMT, 128, 4, 32, range_##TAG##_128_4_32)                                                         \
    RANGE_FN(FMT, 128, 8, 32, range_##TAG##_128_8_32)                                                         \
    static score_range_fn pick_##TAG(int64_t dim, int64_t rank, int64_t page) {                               \
        if (dim == 64 && page == 32 && rank == 4) return range_##TAG##_64_4_32;                               \
        if (dim == 64 && page == 32 && rank == 8) return range_##TAG##_64_8_32;                               \
        if (dim == 64 && page == 16 && rank == 8) return range_##TAG##_64_8_16;                               \
        if (dim == 64 && page == 64 && rank == 8) return range_##TAG##_64_8_64;                               \
        if (dim == 128 && page == 32 && rank == 4) return range_##TAG##_128_4_32;                             \
        if (dim == 128 && page == 32 && rank == 8) return range_##TAG##_128_8_32;                             \
        return range_##TAG;                                                                                   \
    }
RANGE_FNS(FMT_F32, f32)
RANGE_FNS(FMT_BF16, bf16)
RANGE_FNS(FMT_INT8, int8)
RANGE_FNS(FMT_INT4, int4)

/* Returns 0, or 3 without memory for the padded queries. */
static int oval_scores_avx2(const float *restrict q, const float *restrict qb, const void *mean, const void *basis,
                            const void *coords, const uint16_t *scales, const int64_t *restrict page_table,
                            const int64_t *restrict counts, int64_t batch, int64_t kv_heads, int64_t group,
                            int64_t dim, int64_t rank, int64_t page_size, int64_t num_pages, int64_t pages_total,
                            float scale, float *restrict out, int64_t threads, int fmt) {
    const int64_t group4 = (group + 3) / 4 * 4, pairs = batch * kv_heads, block = pairs * group4 * dim;
    /* The queries of every (b, h), scaled once and padded with zero rows to a multiple of 4: [B * Hkv, G4, D];
     * then the basis rows' queries likewise (the same values unless the record is int4). */
    float *qs = (float *)calloc((size_t)(2 * block), sizeof(float));
    if (!qs) return 3;
    const float unit = scale * LOG2_E;
    for (int64_t bh = 0; bh < pairs; bh++)
        for (int64_t j = 0; j < group * dim; j++) {
            qs[bh * group4 * dim + j] = unit * q[bh * group * dim + j];
            qs[block + bh * group4 * dim + j] = unit * qb[bh * group * dim + j];
        }
#ifdef SCORE_INT4_WIDE_READY
    if (fmt == FMT_INT4 && int4_wide_takes(dim, rank, page_size)) deinterleave_int4(qs + block, pairs * group4, dim);
#endif
    const struct score_job job = {qs, qs + block, mean, basis, coords, scales, page_table, counts, kv_heads, group,
                                  group4, dim, rank, page_size, num_pages, pages_total, out};
    score_range_fn range = fmt == FMT_F32 ? pick_f32(dim, rank, page_size)
                           : fmt == FMT_BF16 ? pick_bf16(dim, rank, page_size)
                           : fmt == FMT_INT8 ? pick_int8(dim, rank, page_size) : pick_int4(dim, rank, page_size);
    const int64_t items = pairs * num_pages;
#ifdef _OPENMP
    if (threads > 1 && items >= MIN_PAGES_PER_THREAD * 2) {
#pragma omp parallel num_threads(threads)
        { /* equal shares of the flat page order, one per thread */
            const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
            range(&job, items * me / team, items * (me + 1) / team);
        }
    } else
#endif
        range(&job, 0, items);
    free(qs);
    return 0;
}
