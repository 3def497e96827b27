/* The int4 record's page score on 512-bit vectors, included by score_avx2.h when the build targets AVX-512F. Same
 * scores as score_page_avx2; only the summation order differs.
 *
 * Why: score_page_avx2 widens every record row into an L1 buffer (13 instructions per 16 int4 values: a nibble
 * split, an unpack into element order, two widenings, two bias subtractions, two converts, two stores) and then
 * reloads it for the dot products: at the default record (int4, r = 8, D = 64, P = 32) ~1,650 instructions and
 * ~390 cycles a page and KV head, bound by their issue. Here 32 values (16 bytes) widen with one zero-extension into
 * 16 32-bit lanes, the low nibbles (the even elements) by a mask and the high ones (the odd elements) by a shift,
 * and go straight into the FMAs. The nibbles come out in the order "16 even elements, then 16 odd ones" per 32
 * values; the basis rows' queries are stored in that order once per call (deinterleave_int4) and a page's logits
 * are summed in any order, so nothing is shuffled per page. The fifth bits of the basis rows and of the first
 * coordinate rows (score_kernels.c's layout) are one 32-bit load per 32 values, shifted into each lane by its
 * element index (widen32_int5).
 * Takes: head dim and page size multiples of 32 (the rest of avx2_takes); anything else takes score_page_avx2. */
#define SCORE_INT4_WIDE_READY 1

static inline int int4_wide_takes(int64_t dim, int64_t rank, int64_t page_size) {
    return dim % 32 == 0 && page_size % 32 == 0 && avx2_takes(dim, rank, page_size);
}

/* rows [n, dim] in place: each 32 values reordered to the 16 even elements, then the 16 odd ones. */
static void deinterleave_int4(float *rows, int64_t n, int64_t dim) {
    float chunk[32];
    for (int64_t c = 0; c < n * dim; c += 32) {
        for (int j = 0; j < 16; j++) {
            chunk[j] = rows[c + 2 * j];
            chunk[16 + j] = rows[c + 2 * j + 1];
        }
        memcpy(rows + c, chunk, sizeof chunk);
    }
}

/* 32 int4 levels from 16 bytes (stored as q + 8): the even elements' levels into *even, the odd ones' into *odd. */
static inline __attribute__((always_inline)) void widen32_int4(const uint8_t *src, __m512 *even, __m512 *odd) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
    const __m512i bias = _mm512_set1_epi32(8);
    *even = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(15)), bias));
    *odd = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bytes, 4), bias));
}

/* 32 5-bit levels of an int4 record's basis row (score_kernels.c's layout): 16 bytes of low nibbles and the 32
 * fifth bits `fifth` (element j's is bit j), in widen32_int4's order: even elements' levels, then odd ones'. */
static inline __attribute__((always_inline)) void widen32_int5(const uint8_t *src, uint32_t fifth, __m512 *even,
                                                               __m512 *odd) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
    const __m512i bias = _mm512_set1_epi32(16), one = _mm512_set1_epi32(1), high = _mm512_set1_epi32((int)fifth);
    const __m512i even_bits = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd_bits = _mm512_add_epi32(even_bits, one);
    const __m512i even_high = _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(high, even_bits), one), 4);
    const __m512i odd_high = _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(high, odd_bits), one), 4);
    const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(15));
    *even = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(low, even_high), bias));
    *odd = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(_mm512_srli_epi32(bytes, 4), odd_high), bias));
}

/* Four 16-lane sums -> [4]: each folded to 8 lanes, then three horizontal adds. */
static inline __attribute__((always_inline)) __m128 reduce4_wide(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(fold16(a0), fold16(a1)), _mm256_hadd_ps(fold16(a2), fold16(a3)));
    return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

/* One int4 record's basis row [INT5_ROW_BYTES(dim)] (5-bit levels) dotted with n (3 or 4, a constant) queries
 * q [n, dim] in deinterleaved order -> [4]. */
static inline __attribute__((always_inline)) __m128 dot_int5_row(const uint8_t *row, const float *q, int64_t n,
                                                                 int64_t dim) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < dim; d += 32) {
        __m512 even, odd;
        uint32_t fifth;
        memcpy(&fifth, row + dim / 2 + d / 8, sizeof fifth);
        widen32_int5(row + d / 2, fifth, &even, &odd);
        a0 = _mm512_fmadd_ps(odd, _mm512_loadu_ps(q + d + 16), _mm512_fmadd_ps(even, _mm512_loadu_ps(q + d), a0));
        a1 = _mm512_fmadd_ps(odd, _mm512_loadu_ps(q + dim + d + 16),
                             _mm512_fmadd_ps(even, _mm512_loadu_ps(q + dim + d), a1));
        a2 = _mm512_fmadd_ps(odd, _mm512_loadu_ps(q + 2 * dim + d + 16),
                             _mm512_fmadd_ps(even, _mm512_loadu_ps(q + 2 * dim + d), a2));
        if (n == 4)
            a3 = _mm512_fmadd_ps(odd, _mm512_loadu_ps(q + 3 * dim + d + 16),
                                 _mm512_fmadd_ps(even, _mm512_loadu_ps(q + 3 * dim + d), a3));
    }
    return reduce4_wide(a0, a1, a2, a3);
}

/* The int8 mean [dim] dotted with n (3 or 4) queries q [n, dim] in element order -> [4]. */
static inline __attribute__((always_inline)) __m128 dot_int8_row(const int8_t *row, const float *q, int64_t n,
                                                                 int64_t dim) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < dim; d += 16) {
        const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d))));
        a0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(q + d), a0);
        a1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(q + dim + d), a1);
        a2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(q + 2 * dim + d), a2);
        if (n == 4) a3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(q + 3 * dim + d), a3);
    }
    return reduce4_wide(a0, a1, a2, a3);
}

#if defined(__AVX512VL__)
/* projected[(g + i) * 8 + j] = basis row j . q_{g+i} for the n (1 to 3, a constant) queries from g, at rank 8: the
 * 8 x n accumulators stay in registers over the rows and each query's eight sums end in one sum8_lanes. */
static inline __attribute__((always_inline)) void project8_int5(float *projected, const uint8_t *basis_rows,
                                                                const float *qbs, int64_t g, int n, int64_t dim) {
    __m512 a[3][8];
    for (int i = 0; i < n; i++)
        for (int j = 0; j < 8; j++) a[i][j] = _mm512_setzero_ps();
    for (int j = 0; j < 8; j++) {
        const uint8_t *row = basis_rows + j * INT5_ROW_BYTES(dim);
        for (int64_t d = 0; d < dim; d += 32) {
            __m512 even, odd;
            uint32_t fifth;
            memcpy(&fifth, row + dim / 2 + d / 8, sizeof fifth);
            widen32_int5(row + d / 2, fifth, &even, &odd);
            for (int i = 0; i < n; i++) {
                const float *q = qbs + (g + i) * dim;
                a[i][j] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(q + d + 16),
                                          _mm512_fmadd_ps(even, _mm512_loadu_ps(q + d), a[i][j]));
            }
        }
    }
    for (int i = 0; i < n; i++) _mm256_storeu_ps(projected + (g + i) * 8, sum8_lanes(a[i]));
}
#endif

/* exp2_nonpositive on 16 lanes (the same polynomial). */
static inline __m512 exp2_nonpositive16(__m512 x) {
    const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(clamped, _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(clamped, n);
    const __m512 p = EXP2_TAYLOR(_mm512_fmadd_ps, _mm512_set1_ps, f);
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* One page's score from its int4 record (score_page_avx2's arguments; qbs deinterleaved by deinterleave_int4). */
static inline __attribute__((always_inline)) float score_page_int4_wide(
    const float *restrict qs, const float *restrict qbs, const void *mean, const void *basis, const void *coords,
    const float *sc, int64_t record, int64_t group, int64_t group4, int64_t dim, int64_t rank, int64_t page_size) {
    float offset[MAX_GROUP] __attribute__((aligned(16)));                    /* [G4]: mu . q_g */
    float projected[AVX2_MAX_RANK * MAX_GROUP] __attribute__((aligned(16))); /* [r, G4]: B^T q_g */
    float coord[AVX2_MAX_RANK * AVX2_MAX_PAGE] __attribute__((aligned(64))); /* [r, P], tokens deinterleaved */
    float logits[MAX_GROUP * AVX2_MAX_PAGE] __attribute__((aligned(64)));    /* [G, P], the same token order */
    const int8_t *mean_row = (const int8_t *)mean + record * dim;
    const uint8_t *basis_rows = (const uint8_t *)basis + record * rank * INT5_ROW_BYTES(dim);
    const uint8_t *coord_rows = (const uint8_t *)coords + record * INT4_COORD_BYTES(rank, page_size);
    /* projected[i * rank_stride + g * group_stride]: [r, G4], or [G, 8] where rank 8 takes project8_int5 */
    int64_t rank_stride = group4, group_stride = 1;
    for (int64_t g = 0; g < group4; g += 4)
        _mm_store_ps(offset + g, group - g == 3 ? dot_int8_row(mean_row, qs + g * dim, 3, dim)
                                                : dot_int8_row(mean_row, qs + g * dim, 4, dim));
#if defined(__AVX512VL__)
    if (rank == 8) {
        rank_stride = 1, group_stride = 8;
        for (int64_t g = 0; g < group; g += 3)
            switch (group - g) { /* one instantiation per chunk size */
            case 1: project8_int5(projected, basis_rows, qbs, g, 1, dim); break;
            case 2: project8_int5(projected, basis_rows, qbs, g, 2, dim); break;
            default: project8_int5(projected, basis_rows, qbs, g, 3, dim);
            }
    } else
#endif
    for (int64_t g = 0; g < group4; g += 4)
        for (int64_t i = 0; i < rank; i++)
            _mm_store_ps(projected + i * group4 + g,
                         group - g == 3 ? dot_int5_row(basis_rows + i * INT5_ROW_BYTES(dim), qbs + g * dim, 3, dim)
                                        : dot_int5_row(basis_rows + i * INT5_ROW_BYTES(dim), qbs + g * dim, 4, dim));
    for (int64_t j = 0; j < rank * page_size; j += 32) { /* 32 tokens of rank j / P's row */
        __m512 even, odd;
        if (j < FIFTH_RANKS(rank) * page_size) { /* a row with fifth bits: its 32 tokens' bits in 4 bytes */
            uint32_t fifth;
            memcpy(&fifth, coord_rows + rank * page_size / 2 + j / 8, sizeof fifth);
            widen32_int5(coord_rows + j / 2, fifth, &even, &odd);
        } else {
            widen32_int4(coord_rows + j / 2, &even, &odd);
        }
        _mm512_store_ps(coord + j, even);
        _mm512_store_ps(coord + j + 16, odd);
    }
    for (int64_t g = 0; g < group; g++) offset[g] *= sc[0]; /* value = scale * level (score_page_avx2) */
    for (int64_t i = 0; i < rank; i++)
        for (int64_t g = 0; g < group; g++) /* rank i's folded scale */
            projected[i * rank_stride + g * group_stride] *= sc[1 + i];
    __m512 peak16 = _mm512_set1_ps(-3.0e38f);
    for (int64_t g = 0; g < group; g++) {
        const __m512 base = _mm512_set1_ps(offset[g]);
        for (int64_t p = 0; p < page_size; p += 16) {
            __m512 acc = base;
            for (int64_t i = 0; i < rank; i++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(projected[i * rank_stride + g * group_stride]),
                                      _mm512_load_ps(coord + i * page_size + p), acc);
            _mm512_store_ps(logits + g * page_size + p, acc);
            peak16 = _mm512_max_ps(peak16, acc);
        }
    }
    const float peak = _mm512_reduce_max_ps(peak16);
    const __m512 shift = _mm512_set1_ps(peak);
    __m512 total16 = _mm512_setzero_ps();
    for (int64_t j = 0; j < group * page_size; j += 16)
        total16 = _mm512_add_ps(total16, exp2_nonpositive16(_mm512_sub_ps(_mm512_load_ps(logits + j), shift)));
    return page_score(_mm512_reduce_add_ps(total16), peak);
}
