/* What the decode kernels share (score_kernels.c, attend_kernels.c): storage widening, a 2^x without libm, row
 * bounds. A header of static inline functions, so each file inlines and vectorises them where they are called.
 * cpu_build.py hashes it with the sources (a change rebuilds the library). */
#ifndef OVAL_KERNEL_MATH_H
#define OVAL_KERNEL_MATH_H

#include <stdint.h>
#include <string.h>

#define MAX_DIM 256   /* head dim */
#define MAX_GROUP 32  /* query heads per KV head */
#define UNSCORED (-3.0e38f) /* the score of a page a row's count leaves out, and an unread slot's logit (finite:
                             * the library is built with finite math) */
#define LOG2_E 1.4426950408889634f
#define LN_2 0.6931471805599453f

static inline float widen_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* IEEE half -> float (the quantized oval records' scales, page_record.py), without F16C: a subnormal half is its
 * mantissa times 2^-24; a normal one moves its exponent from bias 15 to bias 127; inf and NaN stay so. */
static inline float widen_fp16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0) {
        const float tiny = (float)mantissa * 5.9604644775390625e-08f;
        return sign ? -tiny : tiny;
    }
    const uint32_t bits = sign | ((exponent == 31 ? 255u : exponent + 112u) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 2^x for x <= 0 without libm, so the compiler vectorises the loops that call it. x = n + f with n = round(x),
 * |f| <= 1/2, 2^f by its Taylor series to degree 6 (relative error < 1.3e-7, about fp32's rounding), 2^n from
 * the exponent bits. x is clamped at -126, so terms below 2^-126 count as 2^-126 (~1e-38): next to the largest
 * term, which is 1, that changes no sum, and unread slots are skipped by the caller, not weighted by this. */
/* 2^f of that series by Horner's rule, written once for every vector width: FMA(a, b, c) = a * b + c and SET1(c)
 * a constant of the width (score_avx2.h's 8 lanes, score_int4_avx512.h's 16). Coefficients ln2^k / k!, k = 6..0. */
#define EXP2_TAYLOR(FMA, SET1, f)                                                                              \
    FMA(FMA(FMA(FMA(FMA(FMA(SET1(1.5403530e-04f), f, SET1(1.3333558e-03f)), f, SET1(9.6181291e-03f)), f,      \
                    SET1(5.5504109e-02f)), f, SET1(2.4022651e-01f)), f, SET1(6.9314718e-01f)), f, SET1(1.0f))
#define SCALAR_FMA(a, b, c) ((a) * (b) + (c))
#define SCALAR_SET1(c) (c)

static inline float exp2_nonpositive(float x) {
    float clamped = x < -126.0f ? -126.0f : x;
    float n = __builtin_floorf(clamped + 0.5f);
    float f = clamped - n;
    float p = EXP2_TAYLOR(SCALAR_FMA, SCALAR_SET1, f);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* A row's share of a padded axis: counts[b] clamped to [0, width], or the whole width without counts. */
static inline int64_t row_count(const int64_t *counts, int64_t b, int64_t width) {
    if (!counts) return width;
    int64_t c = counts[b];
    return c < 0 ? 0 : (c > width ? width : c);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The largest of 8 lanes. */
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* The sum of 8 lanes. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#if defined(__AVX512F__)
/* 16 lanes folded to 8 (pairwise sums): where a 512-bit sum meets the 256-bit horizontal adds. */
static inline __attribute__((always_inline)) __m256 fold16(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

#if defined(__AVX512VL__)
/* Eight dot products ended at once (attend_avx2.h's K pass, score_int4_avx512.h's basis projection): lane i of the
 * result (i < 8) = the sum of the 16 lanes of x[i]. Pairs of vectors are folded into one, twice by 128-bit quarters
 * and twice within them, then one permute puts the sums in order: 24 instructions, where ending each dot product on
 * its own takes a fold and horizontal adds (~6 instructions a sum when four share them). */
static inline __attribute__((always_inline)) __m256 sum8_lanes(const __m512 *x) {
    __m512 y[4], z[2];
    for (int k = 0; k < 4; k++) /* y_k: x[2k] folded to 8 lanes, then x[2k+1] */
        y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xEE));
    for (int k = 0; k < 2; k++) /* quarter j of z_k: x[4k + j] folded to 4 lanes */
        z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0xDD));
    /* quarter j: x[j] in 2 lanes, x[4 + j] in 2; then each pair summed into both of its lanes */
    __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x44), _mm512_shuffle_ps(z[0], z[1], 0xEE));
    w = _mm512_add_ps(w, _mm512_shuffle_ps(w, w, 0xB1));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, w));
}
#endif
#endif

/* Dot products of one row with several queries, each row vector loaded once for all of them (score_avx2.h's page
 * scoring, group_kernels.c's coarse bounds). */
/* The four dot products of row [dim] with q0..q3 [dim] -> [4] (dim a multiple of 8). */
static inline __attribute__((always_inline)) __m128 dot4(const float *restrict row, const float *q0, const float *q1,
                                                         const float *q2, const float *q3, int64_t dim) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
        __m256 r = _mm256_loadu_ps(row + d);
        a0 = _mm256_fmadd_ps(r, _mm256_loadu_ps(q0 + d), a0);
        a1 = _mm256_fmadd_ps(r, _mm256_loadu_ps(q1 + d), a1);
        a2 = _mm256_fmadd_ps(r, _mm256_loadu_ps(q2 + d), a2);
        a3 = _mm256_fmadd_ps(r, _mm256_loadu_ps(q3 + d), a3);
    }
    __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

/* The three dot products of row [dim] with q0..q2 [dim] -> [4] (the last lane 0): a GQA group of 3 (SmolLM2). */
static inline __attribute__((always_inline)) __m128 dot3(const float *restrict row, const float *q0, const float *q1,
                                                         const float *q2, int64_t dim) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
        __m256 r = _mm256_loadu_ps(row + d);
        a0 = _mm256_fmadd_ps(r, _mm256_loadu_ps(q0 + d), a0);
        a1 = _mm256_fmadd_ps(r, _mm256_loadu_ps(q1 + d), a1);
        a2 = _mm256_fmadd_ps(r, _mm256_loadu_ps(q2 + d), a2);
    }
    __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, _mm256_setzero_ps()));
    return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}
#endif

#endif
