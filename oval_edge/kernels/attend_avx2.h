/* The AVX2 + FMA inner loops of attend_kernels.c's attention, included by it when the compiler targets AVX2 and FMA
 * and used for head dims that are multiples of 64. Same sums as the plain loops; only the summation order differs.
 *
 * Why: the plain loops widen each row into a buffer, end every query's dot product in its own horizontal sum and
 * keep the [G, D] value accumulator in memory (a load, an FMA and a store per 8 values, per query, per token); a
 * dense layer at 32k tokens then ran at ~16 GB/s on one core, compute-bound, where the memory gives ~30. Here a
 * row is widened in registers as it is used, four queries share each K vector and three horizontal adds, and the
 * value accumulators of up to three queries stay in registers over a block of tokens (attention of a 32k decode
 * step: 2.5 -> 2.2 ms, measured; the rest is memory latency).
 */
#define ATTEND_AVX2_READY 1
#define VALUE_BLOCK 32 /* tokens per value block: its rows stay in L1 while each 64 columns and 3 queries are summed */

static inline int attend_avx2_takes(int64_t dim) { return dim % 64 == 0; }

/* Values d..d+7 of K or V row r as fp32 (int8: code * scales[r]); kv is a constant after inlining. */
static inline __attribute__((always_inline)) __m256 widen8_kv(const void *rows, const float *scales, int64_t r,
                                                              int64_t d, int64_t dim, int kv) {
    if (kv == KV_F32) return _mm256_loadu_ps((const float *)rows + r * dim + d);
    if (kv == KV_BF16) {
        __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)rows + r * dim + d));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    }
    __m128i codes = _mm_loadl_epi64((const __m128i *)((const int8_t *)rows + r * dim + d));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), _mm256_set1_ps(scales[r]));
}

/* logit[g] = qs_g . k_r for the G4 padded queries qs [G4, dim] (four at a time: one K vector, four FMAs). */
static inline __attribute__((always_inline)) void key_logits_avx2(float *restrict logit, const float *restrict qs,
                                                                  const void *k_rows, const float *k_scales,
                                                                  int64_t r, int64_t group4, int64_t dim, int kv) {
    for (int64_t g = 0; g < group4; g += 4) {
        const float *q = qs + g * dim;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d += 8) {
            __m256 k = widen8_kv(k_rows, k_scales, r, d, dim, kv);
            a0 = _mm256_fmadd_ps(k, _mm256_load_ps(q + d), a0);
            a1 = _mm256_fmadd_ps(k, _mm256_load_ps(q + dim + d), a1);
            a2 = _mm256_fmadd_ps(k, _mm256_load_ps(q + 2 * dim + d), a2);
            a3 = _mm256_fmadd_ps(k, _mm256_load_ps(q + 3 * dim + d), a3);
        }
        __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        _mm_store_ps(logit + g, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
    }
}

/* Columns d..d+63 of n queries' accumulators a [n, dim] (row stride dim) += sum over the valid slots t in
 * [t0, t1) of w[i * slots + t] * v_t. n is a constant (1 to 3) after inlining, so the 8n accumulators stay in
 * registers (24 of the 32 with AVX-512VL's upper ones; an AVX2-only CPU spills some). */
static inline __attribute__((always_inline)) void value_columns(float *restrict a, const float *restrict w,
                                                                const void *v_rows, const float *v_scales,
                                                                const int64_t *restrict idx,
                                                                const uint8_t *restrict ok, int64_t t0, int64_t t1,
                                                                int64_t last, int64_t d, int64_t dim, int64_t slots,
                                                                int n, int kv) {
    __m256 s[3][8];
    for (int i = 0; i < n; i++)
        for (int j = 0; j < 8; j++) s[i][j] = _mm256_loadu_ps(a + i * dim + 8 * j);
    for (int64_t t = t0; t < t1; t++) {
        if (!ok[t]) continue;
        if (d == 0 && t + PREFETCH_SLOTS < last && ok[t + PREFETCH_SLOTS])
            prefetch_row(v_rows, idx[t + PREFETCH_SLOTS], dim, kv);
        __m256 v[8];
        for (int j = 0; j < 8; j++) v[j] = widen8_kv(v_rows, v_scales, idx[t], d + 8 * j, dim, kv);
        for (int i = 0; i < n; i++) {
            const __m256 wi = _mm256_broadcast_ss(w + i * slots + t);
            for (int j = 0; j < 8; j++) s[i][j] = _mm256_fmadd_ps(wi, v[j], s[i][j]);
        }
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(a + i * dim + 8 * j, s[i][j]);
}

/* acc [G, dim] += sum over the valid slots t in [first, last) of weights[g * slots + t] * v_t: per block of
 * VALUE_BLOCK slots, per 64 columns, per three queries. */
static inline __attribute__((always_inline)) void accumulate_values_avx2(
    float *restrict acc, const float *restrict weights, const void *v_rows, const float *v_scales,
    const int64_t *restrict idx, const uint8_t *restrict ok, int64_t first, int64_t last, int64_t group,
    int64_t dim, int64_t slots, int kv) {
    for (int64_t t0 = first; t0 < last; t0 += VALUE_BLOCK) {
        const int64_t t1 = t0 + VALUE_BLOCK < last ? t0 + VALUE_BLOCK : last;
        for (int64_t d = 0; d < dim; d += 64)
            for (int64_t g = 0; g < group; g += 3) {
                float *a = acc + g * dim + d;
                const float *w = weights + g * slots;
                switch (group - g) { /* one instantiation per chunk size */
                case 1: value_columns(a, w, v_rows, v_scales, idx, ok, t0, t1, last, d, dim, slots, 1, kv); break;
                case 2: value_columns(a, w, v_rows, v_scales, idx, ok, t0, t1, last, d, dim, slots, 2, kv); break;
                default: value_columns(a, w, v_rows, v_scales, idx, ok, t0, t1, last, d, dim, slots, 3, kv);
                }
            }
    }
}
