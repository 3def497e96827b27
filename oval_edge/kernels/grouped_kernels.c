/* Projections held in the grouped integer format (runtime/model/grouped/layout.py): a GGUF file's own blocks
 * (Q4_0, Q4_1, Q8_0, Q5_x, the K-quants) or a 16-bit checkpoint quantized to 4-bit codes with a scale and a min per
 * 32 weights. Called through ctypes by oval_edge/kernels/cpu.py (NativeKernels.gemv_grouped, dequantize_grouped) and
 * built into the same library as the other kernels.
 *
 * Why a format of our own rather than GGML's block structs: every classic GGML type is integer codes times a scale
 * plus a min per 16 or 32 weights (K-quants fold their super-block scale into those), so one layout with 4- or 8-bit
 * codes and separate fp16 scale/min planes holds them all, exactly or within fp16 rounding of a K-quant's sub-block
 * scale, and one kernel per code width serves every file. The planes keep the codes of a row contiguous (one stream
 * per row) and are what the Triton and torch paths read too.
 *
 * Layout of a weight W [n_out, k], k a multiple of 32, group g in {16, 32}:
 *   bits 4: codes [n_out, k / 2] uint8; in each 32-weight chunk c of a row, byte 16c + i holds weight 32c + i in its
 *           low nibble and weight 32c + i + 16 in its high nibble (GGML's own nibble order, so a 16-byte load gives
 *           two runs of 16 consecutive weights);
 *   bits 8: codes [n_out, k] uint8, in order;
 *   scales, mins: [n_out, k / g] fp16.  Weight = scale * code + min, formed in fp32 (one fma), as the torch
 *   reference forms it; products and sums in fp32, output fp32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* the bodies below and F16C's conversions, each behind its own feature test */
#endif

#define CHUNK 32       /* weights per chunk along k (one nibble block of 16 bytes in 4 bits) */
#define ROW_TILE 4     /* rows of x multiplied per pass over a weight row: a decode batch reads the codes once */
#define MAX_THREADS 64

/* fp16 -> fp32, exact for every finite value (the planes hold no inf or NaN). */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    uint32_t bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: value = mantissa * 2^-24, exact in fp32 */
            float v = (float)mantissa * (1.0f / 16777216.0f);
            memcpy(&bits, &v, 4);
            bits |= sign;
        }
    } else {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
#endif
}

/* Weight j (0..31) of chunk c of a row, as an integer code. */
static inline int code_at(const uint8_t *row, int bits, int64_t c, int j) {
    if (bits == 8) return row[c * CHUNK + j];
    const uint8_t byte = row[c * 16 + (j & 15)];
    return j < 16 ? (byte & 0x0F) : (byte >> 4);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The 32 codes of chunk c as bytes: weights 0..15 in lo, 16..31 in hi (the nibble order makes both one mask). */
static inline __attribute__((always_inline)) void chunk_codes(const uint8_t *row, int bits, int64_t c, __m128i *lo,
                                                              __m128i *hi) {
    if (bits == 4) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + c * 16));
        const __m128i mask = _mm_set1_epi8(0x0F);
        *lo = _mm_and_si128(bytes, mask);
        *hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    } else {
        *lo = _mm_loadu_si128((const __m128i *)(row + c * CHUNK));
        *hi = _mm_loadu_si128((const __m128i *)(row + c * CHUNK + 16));
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX2__) && defined(__FMA__) \
    && defined(__F16C__)
#include "grouped_bf16.h" /* defines GROUPED_BF16: gemv_grouped_f32 multiplies through vdpbf16ps */
#endif

#if defined(__AVX512F__) && defined(__F16C__)
/* The 32 weights of chunk c as two 16-lane vectors (weights 0..15, 16..31), scale * code + min in fp32. */
static inline __attribute__((always_inline)) void chunk_weights(const uint8_t *row, int bits, int64_t c, int group,
                                                                const float *scales, const float *mins,
                                                                __m512 w[2]) {
    __m128i lo, hi;
    chunk_codes(row, bits, c, &lo, &hi);
    const int64_t g0 = c * CHUNK / group, g1 = (c * CHUNK + 16) / group; /* equal when group is 32 */
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), _mm512_set1_ps(scales[g0]),
                           _mm512_set1_ps(mins[g0]));
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), _mm512_set1_ps(scales[g1]),
                           _mm512_set1_ps(mins[g1]));
}

/* Chunk c's products for `tile` rows of x added to acc[r] (two sums a row: the chunk's halves). */
static inline __attribute__((always_inline)) void chunk_fma(const uint8_t *row, int bits, int64_t c, int group,
                                                            const float *scales, const float *mins, const float *x,
                                                            int64_t x_stride, int tile, __m512 acc[ROW_TILE][2]) {
    __m512 w[2];
    chunk_weights(row, bits, c, group, scales, mins, w);
    for (int r = 0; r < tile; r++) {
        const float *xr = x + r * x_stride + c * CHUNK;
        acc[r][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xr), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr + 16), acc[r][1]);
    }
}

/* dots[r] = weight row . x row r for `tile` rows. Even and odd chunks add into separate sums (four a row): one chain
 * would wait on the previous chunk's fma latency. The sums are indexed by constants only, so they stay in
 * registers (an index computed from the chunk number put them in memory). */
static inline __attribute__((always_inline)) void weight_row(const uint8_t *row, const float *scales,
                                                             const float *mins, int bits, int group,
                                                             const float *x, int64_t x_stride, int tile, int64_t k,
                                                             float *dots) {
    __m512 even[ROW_TILE][2], odd[ROW_TILE][2];
    for (int r = 0; r < ROW_TILE; r++) even[r][0] = even[r][1] = odd[r][0] = odd[r][1] = _mm512_setzero_ps();
    const int64_t chunks = k / CHUNK;
    int64_t c = 0;
    for (; c + 1 < chunks; c += 2) {
        chunk_fma(row, bits, c, group, scales, mins, x, x_stride, tile, even);
        chunk_fma(row, bits, c + 1, group, scales, mins, x, x_stride, tile, odd);
    }
    if (c < chunks) chunk_fma(row, bits, c, group, scales, mins, x, x_stride, tile, even);
    for (int r = 0; r < tile; r++)
        dots[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(even[r][0], even[r][1]),
                                                     _mm512_add_ps(odd[r][0], odd[r][1])));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

/* The 32 weights of chunk c as four 8-lane vectors, in order. */
static inline __attribute__((always_inline)) void chunk_weights(const uint8_t *row, int bits, int64_t c, int group,
                                                                const float *scales, const float *mins,
                                                                __m256 w[4]) {
    __m128i lo, hi;
    chunk_codes(row, bits, c, &lo, &hi);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int j = 0; j < 4; j++) {
        const int64_t g = (c * CHUNK + 8 * j) / group;
        w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])),
                               _mm256_set1_ps(scales[g]), _mm256_set1_ps(mins[g]));
    }
}

static inline __attribute__((always_inline)) void weight_row(const uint8_t *row, const float *scales,
                                                             const float *mins, int bits, int group,
                                                             const float *x, int64_t x_stride, int tile, int64_t k,
                                                             float *dots) {
    /* four sums per row for a single row (one per 8 weights of a chunk), two per row in a tile: a chain would wait
     * on the previous fma's latency */
    const int mask = tile == 1 ? 3 : 1;
    __m256 sums[ROW_TILE][4];
    for (int r = 0; r < ROW_TILE; r++)
        for (int j = 0; j < 4; j++) sums[r][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k / CHUNK; c++) {
        __m256 w[4];
        chunk_weights(row, bits, c, group, scales, mins, w);
        for (int r = 0; r < tile; r++) {
            const float *xr = x + r * x_stride + c * CHUNK;
            for (int j = 0; j < 4; j++)
                sums[r][j & mask] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j), sums[r][j & mask]);
        }
    }
    for (int r = 0; r < tile; r++)
        dots[r] = sum8(_mm256_add_ps(_mm256_add_ps(sums[r][0], sums[r][1]), _mm256_add_ps(sums[r][2], sums[r][3])));
}
#elif defined(__ARM_NEON)
#include "grouped_neon.h" /* weight_row in Advanced SIMD (Arm boards) */
#else
/* The portable form (older x86, other CPUs): the same weights, formed one at a time; -O3 vectorises the inner sum. */
static inline __attribute__((always_inline)) void weight_row(const uint8_t *row, const float *scales,
                                                             const float *mins, int bits, int group,
                                                             const float *x, int64_t x_stride, int tile, int64_t k,
                                                             float *dots) {
    float total[ROW_TILE] = {0};
    for (int64_t c = 0; c < k / CHUNK; c++) {
        float w[CHUNK];
        for (int j = 0; j < CHUNK; j++) {
            const int64_t g = (c * CHUNK + j) / group;
            w[j] = (float)code_at(row, bits, c, j) * scales[g] + mins[g];
        }
        for (int r = 0; r < tile; r++) {
            const float *xr = x + r * x_stride + c * CHUNK;
            float s = 0.0f;
            for (int j = 0; j < CHUNK; j++) s += w[j] * xr[j];
            total[r] += s;
        }
    }
    for (int r = 0; r < tile; r++) dots[r] = total[r];
}
#endif

#define MAX_GROUPS 8192 /* a row's scales and mins are widened to fp32 on the stack: 64 KiB at most */

static int refuses(int64_t rows, int64_t n_out, int64_t k, int bits, int group) {
    return rows < 0 || n_out < 0 || k <= 0 || k % CHUNK != 0 || (bits != 4 && bits != 8)
           || (group != 16 && group != 32) || k / group > MAX_GROUPS;
}

/* A row's fp16 scales or mins -> fp32, once per row rather than once per chunk and row of x (vcvtph2ps on 8 at a
 * time where the build has F16C). */
static inline void widen_halves(const uint16_t *h, int64_t n, float *out) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = half_to_float(h[i]);
}

/* out [rows, n_out] fp32 (row stride out_stride) = x [rows, k] fp32 (row stride x_stride) @ W^T (+ bias [n_out]
 * fp32, or NULL), W in the layout above, output rows of W split over `threads` threads of torch's OpenMP team
 * (head_kernels.c says why the team). Returns 0, or 1 (refused: the shapes above, threads outside 1..MAX_THREADS)
 * so the caller runs the torch path. */
int gemv_grouped_f32(const float *x, int64_t rows, int64_t x_stride, const uint8_t *codes, const uint16_t *scales,
                     const uint16_t *mins, int64_t bits, int64_t group, const float *bias, int64_t n_out, int64_t k,
                     float *out, int64_t out_stride, int64_t threads) {
    if (refuses(rows, n_out, k, (int)bits, (int)group) || threads < 1 || threads > MAX_THREADS) return 1;
    if (rows == 0 || n_out == 0) return 0;
    if (threads > n_out) threads = n_out;
    const int64_t row_bytes = k * bits / 8, groups = k / group;
#ifdef GROUPED_BF16
    uint16_t *xb = malloc((size_t)(rows * k) * sizeof(uint16_t));
    float *xsum = malloc((size_t)(rows * groups) * sizeof(float));
    if (xb == NULL || xsum == NULL) {
        free(xb);
        free(xsum);
        return 1;
    }
    round_inputs(x, rows, x_stride, k, group, xb, xsum);
    const __m512i ones = small_int_bf16_table(1), sixteens = small_int_bf16_table(16);
    /* 4-bit codes in groups of 32 (Q4_0, Q4_1, Q4_K, our int4) take the 512-bit chunk-pair path (wide_rows) */
    uint16_t *xp = bits == 4 && group == 32 ? malloc((size_t)(rows * k) * sizeof(uint16_t)) : NULL;
    for (int64_t r = 0; xp != NULL && r < rows; r++) pair_order(xb + r * k, k, xp + r * k);
#endif
#ifdef GROUPED_BF16
    if (rows == 1 && bits == 4) { /* one row of x (single-stream decode): output rows in pairs */
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
        for (int64_t pair = 0; pair < n_out / 2; pair++) {
            const int64_t a = 2 * pair, b = a + 1;
            float dots[2];
            if (xp != NULL)
                wide_pair(codes + a * row_bytes, codes + b * row_bytes, scales + a * groups, scales + b * groups,
                          mins + a * groups, mins + b * groups, xb, xp, xsum, k, dots);
            else
                nibble_pair(codes + a * row_bytes, codes + b * row_bytes, scales + a * groups, scales + b * groups,
                            mins + a * groups, mins + b * groups, (int)group, xb, xsum, k, dots);
            out[a] = bias != NULL ? dots[0] + bias[a] : dots[0];
            out[b] = bias != NULL ? dots[1] + bias[b] : dots[1];
        }
        if (n_out % 2) { /* the odd last row alone */
            const int64_t a = n_out - 1;
            float dot;
            const uint8_t *row = codes + a * row_bytes;
            if (xp != NULL) wide_rows(row, scales + a * groups, mins + a * groups, xb, xp, xsum, 1, k, &dot);
            else nibble_row(row, scales + a * groups, mins + a * groups, (int)group, xb, xsum, 1, k, &dot);
            out[a] = bias != NULL ? dot + bias[a] : dot;
        }
        free(xp);
        free(xb);
        free(xsum);
        return 0;
    }
#endif
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int64_t o = 0; o < n_out; o++) {
        const uint8_t *row = codes + o * row_bytes;
#ifdef GROUPED_BF16
        const uint16_t *s = scales + o * groups, *m = mins + o * groups; /* read as fp16 where used */
#else
        float s[MAX_GROUPS], m[MAX_GROUPS];
        widen_halves(scales + o * groups, groups, s);
        widen_halves(mins + o * groups, groups, m);
#endif
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int64_t tile = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            float dots[ROW_TILE];
#ifdef GROUPED_BF16
            const uint16_t *xr = xb + r0 * k;
            const float *sums = xsum + r0 * groups;
            /* constant tiles and code widths let the compiler unroll and drop the branches */
            if (xp != NULL && tile == ROW_TILE) wide_rows(row, s, m, xr, xp + r0 * k, sums, ROW_TILE, k, dots);
            else if (xp != NULL) wide_rows(row, s, m, xr, xp + r0 * k, sums, (int)tile, k, dots);
            else if (bits == 8 && tile == 1)
                weight_row_bf16(row, s, m, 8, (int)group, xr, sums, 1, k, ones, sixteens, dots);
            else weight_row_bf16(row, s, m, (int)bits, (int)group, xr, sums, (int)tile, k, ones, sixteens, dots);
#else
            const float *xr = x + r0 * x_stride;
            /* constant tiles let the compiler unroll the row loop; the code width is fixed per call */
            if (bits == 4 && group == 32 && tile == ROW_TILE) weight_row(row, s, m, 4, 32, xr, x_stride, ROW_TILE, k, dots);
            else if (bits == 4 && group == 32 && tile == 1) weight_row(row, s, m, 4, 32, xr, x_stride, 1, k, dots);
            else if (bits == 8 && tile == ROW_TILE) weight_row(row, s, m, 8, (int)group, xr, x_stride, ROW_TILE, k, dots);
            else if (bits == 8 && tile == 1) weight_row(row, s, m, 8, (int)group, xr, x_stride, 1, k, dots);
            else weight_row(row, s, m, (int)bits, (int)group, xr, x_stride, (int)tile, k, dots);
#endif
            for (int64_t r = 0; r < tile; r++)
                out[(r0 + r) * out_stride + o] = bias != NULL ? dots[r] + bias[o] : dots[r];
        }
    }
#ifdef GROUPED_BF16
    free(xp);
    free(xb);
    free(xsum);
#endif
    return 0;
}

/* 1 when gemv_grouped_f32 rounds x to bf16 (the AVX512-BF16 body), else 0: for the startup report and the checks. */
int grouped_rounds_inputs(void) {
#ifdef GROUPED_BF16
    return 1;
#else
    return 0;
#endif
}

/* fp32 -> bf16 bits, rounded to nearest even (the weights hold no NaN). */
static inline uint16_t float_to_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* One chunk's 32 weights (scale * code + min, fp32) in order, written so that -O3 vectorises it on any CPU: the 16
 * code bytes (or 32) are read once, each half's group scale and min are scalars. */
static inline void chunk_values(const uint8_t *row, int bits, int64_t c, int group, const float *scales,
                                const float *mins, float w[CHUNK]) {
    const int64_t g0 = c * CHUNK / group, g1 = (c * CHUNK + 16) / group;
    const float s0 = scales[g0], m0 = mins[g0], s1 = scales[g1], m1 = mins[g1];
    if (bits == 4) {
        const uint8_t *bytes = row + c * 16;
        for (int j = 0; j < 16; j++) {
            w[j] = (float)(bytes[j] & 0x0F) * s0 + m0;
            w[j + 16] = (float)(bytes[j] >> 4) * s1 + m1;
        }
    } else {
        const uint8_t *bytes = row + c * CHUNK;
        for (int j = 0; j < 16; j++) {
            w[j] = (float)bytes[j] * s0 + m0;
            w[j + 16] = (float)bytes[j + 16] * s1 + m1;
        }
    }
}

/* W rows first..last-1 -> out [last - first, k] (scale * code + min), fp32, or bf16 when as_bf16 (rounded to nearest
 * even): the prefill path, where one dense matmul over many rows beats decoding every code once per row, and a bf16
 * matmul runs at twice the fp32 rate on CPUs with AVX512-BF16. Returns 0, or 1 for refused shapes. */
int dequantize_grouped(const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int64_t bits,
                       int64_t group, int64_t n_out, int64_t k, int64_t first, int64_t last, void *out,
                       int64_t as_bf16, int64_t threads) {
    if (refuses(0, n_out, k, (int)bits, (int)group) || first < 0 || last > n_out || first > last || threads < 1
        || threads > MAX_THREADS)
        return 1;
    const int64_t row_bytes = k * bits / 8, groups = k / group;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int64_t o = first; o < last; o++) {
        float s[MAX_GROUPS], m[MAX_GROUPS], w[CHUNK];
        widen_halves(scales + o * groups, groups, s);
        widen_halves(mins + o * groups, groups, m);
        const uint8_t *row = codes + o * row_bytes;
        for (int64_t c = 0; c < k / CHUNK; c++) {
            chunk_values(row, (int)bits, c, (int)group, s, m, w);
            if (as_bf16) {
                uint16_t *dst = (uint16_t *)out + (o - first) * k + c * CHUNK;
                for (int j = 0; j < CHUNK; j++) dst[j] = float_to_bf16(w[j]);
            } else {
                memcpy((float *)out + (o - first) * k + c * CHUNK, w, sizeof(w));
            }
        }
    }
    return 0;
}
