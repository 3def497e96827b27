/* The 4-bit (NF4/FP4) projections of a decode step on CPUs where bitsandbytes has no fused kernel, called through
 * ctypes by oval_edge/kernels/cpu.py (NativeKernels.gemv_4bit) and built into the same library as oval_kernels.c.
 *
 * Why: bitsandbytes' fused CPU GEMV needs AVX512-BF16. Elsewhere (AVX2 x86: most client and cloud CPUs; AVX-512F
 * without BF16) its Linear4bit dequantizes the whole weight to 16 bits and then multiplies: 4.5 bytes moved per
 * weight instead of 0.5, a third of a decode step's CPU time in `dequantize_4bit` alone (SmolLM2, measured). Here the
 * codes are looked up in the 16-entry table as they are read and multiplied in registers.
 *
 * Layout is bitsandbytes' own, unchanged (the module keeps using it for prefill): the weight [n_out, k] flattened
 * row-major, two codes a byte (element 2i in the high nibble of byte i, 2i+1 in the low), one fp32 absmax per
 * `blocksize` consecutive elements (un-nested once at load by runtime/model/quantize.unnest_absmax, as bitsandbytes'
 * own repack does).
 * Arithmetic is the module's (Linear4bit with a bf16 compute dtype): x rounded to bf16, the dot product in fp32, the
 * result rounded to bf16, plus the bias rounded again. Only the weights differ: code * absmax stays fp32 here, where
 * the module rounds it to bf16 first (tests/test_projections.py bounds the difference).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#define CHUNK 32       /* elements per 16 bytes of codes: the kernel's unit along k */
#define ROW_TILE 4     /* rows of x multiplied per pass over a weight row (a decode batch reads the codes once) */
#define MAX_THREADS 64

static inline float round_bf16(float v) { /* round to nearest even at bf16's precision, kept in an fp32 */
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&v, &u, 4);
    return v;
}

/* Where element e (0..31) of a CHUNK sits in the reordered inputs. Code byte i (0..15) holds elements 2i (high
 * nibble) and 2i+1 (low); the vector lookup below yields byte quad j = i / 4 as one 8-lane vector: the high nibbles
 * of bytes 4j..4j+3, then their low nibbles. So element 2i goes to 8j + i % 4, element 2i+1 to 8j + 4 + i % 4. */
static inline int chunk_slot(int e) {
    const int i = e / 2;
    return 8 * (i / 4) + 4 * (e % 2) + i % 4;
}

/* x rows [rows, k] (row stride x_stride) -> xs [rows, k], bf16-rounded, each CHUNK in chunk_slot order: the weights
 * of one lookup vector then meet their inputs in one load. */
static void split_inputs(const float *x, int64_t rows, int64_t x_stride, int64_t k, float *xs) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < k; c += CHUNK)
            for (int e = 0; e < CHUNK; e++) xs[r * k + c + chunk_slot(e)] = round_bf16(x[r * x_stride + c + e]);
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The table's fp32 values as four byte planes (plane b: byte b of each of the 16 floats), in both 128-bit lanes:
 * vpshufb then looks up 32 codes per instruction and per plane, where an fp32 permute looks up 8. */
static inline void table_planes(const float *table, __m256i planes[4]) {
    uint8_t bytes[4][16];
    for (int t = 0; t < 16; t++) {
        uint32_t u;
        memcpy(&u, &table[t], 4);
        for (int b = 0; b < 4; b++) bytes[b][t] = (uint8_t)(u >> (8 * b));
    }
    for (int b = 0; b < 4; b++) planes[b] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes[b]));
}

/* 16 code bytes -> their 32 weights (table values, exact) as 4 vectors in chunk_slot order. */
static inline void lookup32(const uint8_t *codes, const __m256i planes[4], __m256 w[4]) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)codes));
    /* lane 0: the high nibbles of the 16 bytes, lane 1: the low ones */
    const __m256i index = _mm256_and_si256(_mm256_blend_epi32(_mm256_srli_epi16(both, 4), both, 0xF0),
                                           _mm256_set1_epi8(0x0F));
    const __m256i b0 = _mm256_shuffle_epi8(planes[0], index), b1 = _mm256_shuffle_epi8(planes[1], index);
    const __m256i b2 = _mm256_shuffle_epi8(planes[2], index), b3 = _mm256_shuffle_epi8(planes[3], index);
    const __m256i low01 = _mm256_unpacklo_epi8(b0, b1), high01 = _mm256_unpackhi_epi8(b0, b1);
    const __m256i low23 = _mm256_unpacklo_epi8(b2, b3), high23 = _mm256_unpackhi_epi8(b2, b3);
    w[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(low01, low23));   /* bytes 0..3 */
    w[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(low01, low23));   /* bytes 4..7 */
    w[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(high01, high23)); /* bytes 8..11 */
    w[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(high01, high23)); /* bytes 12..15 */
}

/* dots[r] = row `codes` of the weight . xs row r, for `tile` rows (the compiler unrolls a constant tile). Each weight
 * is code * absmax in fp32, as bitsandbytes' dequantize forms it, then multiplied into 4 / tile (at least 2)
 * independent sums per row: one sum per row would wait on the FMA latency, 4 per row of a tile of 4 spill. */
static inline __attribute__((always_inline)) void weight_row(const uint8_t *codes, const float *absmax,
                                                             const float *xs, int tile, int64_t k,
                                                             int64_t blocksize, const __m256i planes[4],
                                                             float *dots) {
    const int chains = tile == 1 ? 4 : 2;
    __m256 sums[ROW_TILE][4];
    for (int r = 0; r < ROW_TILE; r++)
        for (int j = 0; j < 4; j++) sums[r][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / blocksize; b++) {
        const __m256 scale = _mm256_set1_ps(absmax[b]);
        for (int64_t c = b * blocksize; c < (b + 1) * blocksize; c += CHUNK) {
            __m256 w[4];
            lookup32(codes + c / 2, planes, w);
            for (int j = 0; j < 4; j++) {
                const __m256 weight = _mm256_mul_ps(w[j], scale);
                for (int r = 0; r < tile; r++)
                    sums[r][j % chains] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(xs + r * k + c + 8 * j),
                                                          sums[r][j % chains]);
            }
        }
    }
    for (int r = 0; r < tile; r++) {
        __m256 total = sums[r][0];
        for (int j = 1; j < chains; j++) total = _mm256_add_ps(total, sums[r][j]);
        dots[r] = sum8(total);
    }
}
#elif defined(__ARM_NEON)
/* 16 codes (0..15) -> their table values w[0..3], in order. The table's 64 bytes sit in four registers, which one
 * tbl reads as a single 64-byte table: each code c becomes the offsets 4c..4c+3 of its float's bytes, so one tbl
 * gathers four floats. */
static inline __attribute__((always_inline)) void lookup16(uint8x16_t codes, uint8x16x4_t table, float32x4_t w[4]) {
    static const uint8_t spread[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}; /* code of each byte lane */
    static const uint8_t within[16] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3}; /* byte of its float */
    const uint8x16_t starts = vshlq_n_u8(codes, 2), lane_code = vld1q_u8(spread), lane_byte = vld1q_u8(within);
    for (int q = 0; q < 4; q++) { /* codes 4q..4q+3 */
        const uint8x16_t offsets = vaddq_u8(vqtbl1q_u8(starts, vaddq_u8(lane_code, vdupq_n_u8((uint8_t)(4 * q)))),
                                            lane_byte);
        w[q] = vreinterpretq_f32_u8(vqtbl4q_u8(table, offsets));
    }
}

/* dots[r] = row `codes` of the weight . xs row r, for `tile` rows: per CHUNK, the 16 high nibbles (elements 2i) and
 * the 16 low ones (2i + 1) are looked up, times absmax in fp32, and meet xs in chunk_slot order (quad j of the
 * even elements at 8j, of the odd ones at 8j + 4). Two sums a row: one chain would wait on the fma latency. */
static inline __attribute__((always_inline)) void weight_row(const uint8_t *codes, const float *absmax,
                                                             const float *xs, int tile, int64_t k,
                                                             int64_t blocksize, uint8x16x4_t table,
                                                             float *dots) {
    float32x4_t sums[ROW_TILE][2];
    for (int r = 0; r < ROW_TILE; r++) sums[r][0] = sums[r][1] = vdupq_n_f32(0.0f);
    for (int64_t c = 0; c < k; c += CHUNK) {
        const float32x4_t scale = vdupq_n_f32(absmax[c / blocksize]);
        const uint8x16_t bytes = vld1q_u8(codes + c / 2);
        float32x4_t even[4], odd[4];
        lookup16(vshrq_n_u8(bytes, 4), table, even);
        lookup16(vandq_u8(bytes, vdupq_n_u8(0x0F)), table, odd);
        for (int j = 0; j < 4; j++) {
            const float32x4_t w_even = vmulq_f32(even[j], scale), w_odd = vmulq_f32(odd[j], scale);
            for (int r = 0; r < tile; r++) {
                sums[r][0] = vfmaq_f32(sums[r][0], w_even, vld1q_f32(xs + r * k + c + 8 * j));
                sums[r][1] = vfmaq_f32(sums[r][1], w_odd, vld1q_f32(xs + r * k + c + 8 * j + 4));
            }
        }
    }
    for (int r = 0; r < tile; r++) dots[r] = vaddvq_f32(vaddq_f32(sums[r][0], sums[r][1]));
}
#else
/* The portable form (older x86, other CPUs): the same products, weight = code * absmax in fp32. */
static inline __attribute__((always_inline)) void weight_row(const uint8_t *codes, const float *absmax,
                                                             const float *xs, int tile, int64_t k,
                                                             int64_t blocksize, const float *table, float *dots) {
    float total[ROW_TILE] = {0};
    for (int64_t c = 0; c < k; c += CHUNK) {
        const float scale = absmax[c / blocksize];
        for (int i = 0; i < CHUNK / 2; i++) {
            const uint8_t byte = codes[c / 2 + i];
            const float w_even = table[byte >> 4] * scale, w_odd = table[byte & 0xF] * scale;
            const int64_t slot = c + 8 * (i / 4) + i % 4;
            for (int r = 0; r < tile; r++) total[r] += w_even * xs[r * k + slot] + w_odd * xs[r * k + slot + 4];
        }
    }
    for (int r = 0; r < tile; r++) dots[r] = total[r];
}
#endif

/* out [rows, n_out] fp32 (row stride out_stride) = x [rows, k] fp32 (row stride x_stride) @ W^T (+ bias [n_out]
 * fp32, or NULL), W the 4-bit codes [n_out * k / 2] with absmax [n_out * k / blocksize] fp32 and the code table
 * [16] fp32, output columns split over `threads` threads of torch's OpenMP team (head_kernels.c says why the team).
 * Returns 0, or 1 (refused: k or blocksize not a multiple of 32, k not a multiple of blocksize, threads outside
 * 1..MAX_THREADS, no memory for the split inputs) so the caller runs bitsandbytes' own path. */
int gemv_4bit_f32(const float *x, int64_t rows, int64_t x_stride, const uint8_t *codes, const float *absmax,
                  const float *table, const float *bias, int64_t n_out, int64_t k, int64_t blocksize, float *out,
                  int64_t out_stride, int64_t threads) {
    if (k <= 0 || blocksize <= 0 || k % CHUNK != 0 || blocksize % CHUNK != 0 || k % blocksize != 0 || rows < 0
        || n_out < 0 || threads < 1 || threads > MAX_THREADS)
        return 1;
    if (rows == 0 || n_out == 0) return 0;
    float *xs = malloc((size_t)(rows * k) * sizeof(float));
    if (xs == NULL) return 1;
    split_inputs(x, rows, x_stride, k, xs);
    if (threads > n_out) threads = n_out;
#if defined(__AVX2__) && defined(__FMA__)
    __m256i planes[4];
    table_planes(table, planes);
#define LOOKUP planes
#elif defined(__ARM_NEON)
    const uint8x16x4_t table_bytes = vld1q_u8_x4((const uint8_t *)table);
#define LOOKUP table_bytes
#else
#define LOOKUP table
#endif
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int64_t o = 0; o < n_out; o++) {
        const uint8_t *row_codes = codes + o * (k / 2);
        const float *row_absmax = absmax + o * (k / blocksize);
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int64_t tile = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            float dots[ROW_TILE];
            if (tile == ROW_TILE) weight_row(row_codes, row_absmax, xs + r0 * k, ROW_TILE, k, blocksize, LOOKUP, dots);
            else if (tile == 1) weight_row(row_codes, row_absmax, xs + r0 * k, 1, k, blocksize, LOOKUP, dots);
            else weight_row(row_codes, row_absmax, xs + r0 * k, (int)tile, k, blocksize, LOOKUP, dots);
            for (int64_t r = 0; r < tile; r++) {
                float v = round_bf16(dots[r]);
                if (bias != NULL) v = round_bf16(v + bias[o]);
                out[(r0 + r) * out_stride + o] = v;
            }
        }
    }
    free(xs);
    return 0;
}
