/* The vector inner loops of attend_kernels.c's attention, included by it when the compiler targets AVX2 and FMA
 * (512-bit vectors where it targets AVX-512F), for head dims that are multiples of 64. Same sums as the plain loops;
 * only the summation order differs.
 *
 * Why: the plain loops widen each row into a buffer, end every query's dot product in its own horizontal sum and
 * keep the [G, D] value accumulator in memory (a load, an FMA and a store per 8 values, per query, per token): a
 * K pass of ~110 instructions a token, bound by their issue rather than by the FMA units or the memory. Here a row
 * is widened in registers as it is used, each K vector is dotted with up to four queries that end in one fold and
 * three horizontal adds, and the value accumulators of up to three queries stay in registers over a block of
 * tokens. Measured (one dense layer, SmolLM2's shape, bf16, this 2-core AVX-512 VM): 2k tokens in cache on one
 * thread 76 -> 51 us; 32k tokens from DRAM 1.70 -> 1.38 ms on one thread, ~0.85 ms on two either way (there the
 * rows' memory latency bounds it).
 */
#define ATTEND_AVX2_READY 1
#define VALUE_BLOCK 32 /* tokens per value block: its rows stay in L1 while each 64 columns and 3 queries are summed */

static inline int attend_avx2_takes(int64_t dim) { return dim % 64 == 0; }

/* vec: the widest float vector the build targets; LANES floats. */
#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define vec_zero _mm512_setzero_ps
#define vec_load _mm512_loadu_ps
#define vec_store _mm512_storeu_ps
#define vec_fma _mm512_fmadd_ps
#define vec_set1 _mm512_set1_ps
static inline __m256 vec_fold(vec v) { return fold16(v); } /* kernel_math.h */
#else
typedef __m256 vec;
#define LANES 8
#define vec_zero _mm256_setzero_ps
#define vec_load _mm256_loadu_ps
#define vec_store _mm256_storeu_ps
#define vec_fma _mm256_fmadd_ps
#define vec_set1 _mm256_set1_ps
static inline __m256 vec_fold(vec v) { return v; }
#endif

/* Values d..d+LANES-1 of K or V row r as fp32 (int8: code * scales[r]); kv is a constant after inlining. */
static inline __attribute__((always_inline)) vec widen_kv(const void *rows, const float *scales, int64_t r, int64_t d,
                                                          int64_t dim, int kv) {
    if (kv == KV_F32) return vec_load((const float *)rows + r * dim + d);
#if defined(__AVX512F__)
    if (kv == KV_BF16) {
        __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)rows + r * dim + d));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    __m128i codes = _mm_loadu_si128((const __m128i *)((const int8_t *)rows + r * dim + d));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), _mm512_set1_ps(scales[r]));
#else
    if (kv == KV_BF16) {
        __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)rows + r * dim + d));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    }
    __m128i codes = _mm_loadl_epi64((const __m128i *)((const int8_t *)rows + r * dim + d));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), _mm256_set1_ps(scales[r]));
#endif
}

/* logit[0..n) = q_i . k_r for n (1 to 4, a constant after inlining) queries q [n, dim]: each K vector is loaded once
 * for the n queries, and the n dot products end in one fold and three horizontal adds. */
static inline __attribute__((always_inline)) void key_logits(float *restrict logit, const float *restrict q,
                                                             const void *k_rows, const float *k_scales, int64_t r,
                                                             int64_t dim, int n, int kv) {
    vec a[4] = {vec_zero(), vec_zero(), vec_zero(), vec_zero()};
    for (int64_t d = 0; d < dim; d += LANES) {
        const vec k = widen_kv(k_rows, k_scales, r, d, dim, kv);
        for (int i = 0; i < n; i++) a[i] = vec_fma(k, vec_load(q + i * dim + d), a[i]);
    }
    __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(vec_fold(a[0]), vec_fold(a[1])),
                                 _mm256_hadd_ps(vec_fold(a[2]), vec_fold(a[3])));
    float four[4];
    _mm_storeu_ps(four, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
    for (int i = 0; i < n; i++) logit[i] = four[i];
}

/* logit[g] = qs_g . k_r for the G queries qs [G, dim], four at a time (one instantiation per chunk size). */
static inline __attribute__((always_inline)) void key_logits_avx2(float *restrict logit, const float *restrict qs,
                                                                  const void *k_rows, const float *k_scales,
                                                                  int64_t r, int64_t group, int64_t dim, int kv) {
    for (int64_t g = 0; g < group; g += 4) {
        switch (group - g) {
        case 1: key_logits(logit + g, qs + g * dim, k_rows, k_scales, r, dim, 1, kv); break;
        case 2: key_logits(logit + g, qs + g * dim, k_rows, k_scales, r, dim, 2, kv); break;
        case 3: key_logits(logit + g, qs + g * dim, k_rows, k_scales, r, dim, 3, kv); break;
        default: key_logits(logit + g, qs + g * dim, k_rows, k_scales, r, dim, 4, kv);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512VL__)
/* The K pass eight slots at a time (512-bit builds). Why: key_logits ends every slot's dot products in a fold and
 * three horizontal adds, ~30 of the ~90 instructions a slot and KV head costs at SmolLM2's shape, and the dense
 * layers' attention is bound by instructions, not memory, on a 2.1 GHz core (measured: 27 ns a slot and KV head on
 * one thread, the same in cache as from DRAM). Here the 8 x n accumulators of a block stay in registers and each
 * query's eight sums come out of one transposing reduction (24 instructions for 8 dot products), stored, masked
 * and maxed as one vector. */
#define KEYS_BLOCKED_READY 1
#define KEY_BLOCK 8

/* Slots [t0, t0 + n) (n <= KEY_BLOCK) of n_q (1 to 3, a constant after inlining) queries q [n_q, dim]: logits
 * into w[i * slots + t] (UNSCORED where !ok[t]), peaks into peak8[i]; returns the mask of valid slots. */
static inline __attribute__((always_inline)) unsigned key_block(
    float *restrict w, __m256 *peak8, const float *restrict q, const void *k_rows, const float *k_scales,
    const int64_t *restrict idx, const uint8_t *restrict ok, int64_t t0, int64_t n, int64_t last, int64_t dim,
    int64_t slots, int n_q, int kv) {
    __m512 a[3][KEY_BLOCK];
    unsigned valid = 0;
#pragma GCC unroll 8
    for (int s = 0; s < KEY_BLOCK; s++) {
        for (int i = 0; i < n_q; i++) a[i][s] = _mm512_setzero_ps();
        if (s >= n || !ok[t0 + s]) continue;
        valid |= 1u << s;
        if (t0 + s + PREFETCH_SLOTS < last) prefetch_row(k_rows, idx[t0 + s + PREFETCH_SLOTS], dim, kv);
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512 k = widen_kv(k_rows, k_scales, idx[t0 + s], d, dim, kv);
            for (int i = 0; i < n_q; i++) a[i][s] = _mm512_fmadd_ps(k, _mm512_loadu_ps(q + i * dim + d), a[i][s]);
        }
    }
    const __mmask8 mask = (__mmask8)valid, in_block = (__mmask8)((1u << n) - 1);
    for (int i = 0; i < n_q; i++) {
        const __m256 logits = _mm256_mask_blend_ps(mask, _mm256_set1_ps(UNSCORED), sum8_lanes(a[i]));
        _mm256_mask_storeu_ps(w + i * slots + t0, in_block, logits);
        peak8[i] = _mm256_max_ps(peak8[i], logits);
    }
    return valid;
}

/* The K pass of attend_piece over slots [first, last): weights [G, slots] (log2 units, UNSCORED where invalid),
 * peak [G]; returns how many slots are valid. dim a multiple of 16. */
static inline __attribute__((always_inline)) int64_t key_logits_blocked(
    float *restrict weights, float *peak, const float *restrict qs, const void *k_rows, const float *k_scales,
    const int64_t *restrict idx, const uint8_t *restrict ok, int64_t first, int64_t last, int64_t group, int64_t dim,
    int64_t slots, int kv) {
    int64_t seen = 0;
    for (int64_t g = 0; g < group; g += 3) {
        const int n_q = group - g < 3 ? (int)(group - g) : 3;
        __m256 peak8[3] = {_mm256_set1_ps(UNSCORED), _mm256_set1_ps(UNSCORED), _mm256_set1_ps(UNSCORED)};
        float *w = weights + g * slots;
        const float *q = qs + g * dim;
        for (int64_t t0 = first; t0 < last; t0 += KEY_BLOCK) {
            const int64_t n = last - t0 < KEY_BLOCK ? last - t0 : KEY_BLOCK;
            unsigned valid;
            switch (n_q) { /* one instantiation per chunk size */
            case 1: valid = key_block(w, peak8, q, k_rows, k_scales, idx, ok, t0, n, last, dim, slots, 1, kv); break;
            case 2: valid = key_block(w, peak8, q, k_rows, k_scales, idx, ok, t0, n, last, dim, slots, 2, kv); break;
            default: valid = key_block(w, peak8, q, k_rows, k_scales, idx, ok, t0, n, last, dim, slots, 3, kv);
            }
            if (g == 0) seen += __builtin_popcount(valid);
        }
        for (int i = 0; i < n_q; i++) peak[g + i] = hmax8(peak8[i]);
    }
    return seen;
}
#endif

/* Columns d..d+63 of n queries' accumulators a [n, dim] (row stride dim) += sum over the valid slots t in
 * [t0, t1) of w[i * slots + t] * v_t. n is a constant (1 to 3) after inlining, so the 64n / LANES accumulators stay
 * in registers (24 of the 32 with AVX-512VL's upper ones in 256-bit code; an AVX2-only CPU spills some). */
#define COLUMN_VECS (64 / LANES)
static inline __attribute__((always_inline)) void value_columns(float *restrict a, const float *restrict w,
                                                                const void *v_rows, const float *v_scales,
                                                                const int64_t *restrict idx,
                                                                const uint8_t *restrict ok, int64_t t0, int64_t t1,
                                                                int64_t last, int64_t d, int64_t dim, int64_t slots,
                                                                int n, int kv) {
    vec s[3][COLUMN_VECS];
    for (int i = 0; i < n; i++)
        for (int j = 0; j < COLUMN_VECS; j++) s[i][j] = vec_load(a + i * dim + LANES * j);
    for (int64_t t = t0; t < t1; t++) {
        if (!ok[t]) continue;
        if (d == 0 && t + PREFETCH_SLOTS < last && ok[t + PREFETCH_SLOTS])
            prefetch_row(v_rows, idx[t + PREFETCH_SLOTS], dim, kv);
        vec v[COLUMN_VECS];
        for (int j = 0; j < COLUMN_VECS; j++) v[j] = widen_kv(v_rows, v_scales, idx[t], d + LANES * j, dim, kv);
        for (int i = 0; i < n; i++) {
            const vec wi = vec_set1(w[i * slots + t]);
            for (int j = 0; j < COLUMN_VECS; j++) s[i][j] = vec_fma(wi, v[j], s[i][j]);
        }
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < COLUMN_VECS; j++) vec_store(a + i * dim + LANES * j, s[i][j]);
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
