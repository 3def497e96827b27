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
#endif

#define CHUNK 16       /* elements per 8 bytes of codes: the kernel's unit along k */
#define ROW_TILE 4     /* rows of x multiplied per pass over a weight row (a decode batch reads the codes once) */
#define MAX_THREADS 64

static inline float round_bf16(float v) { /* round to nearest even at bf16's precision, kept in an fp32 */
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&v, &u, 4);
    return v;
}

/* x rows [rows, k] (row stride x_stride) -> xs [rows, k], bf16-rounded, each CHUNK reordered as its 8 even elements
 * then its 8 odd ones: the high nibbles of 8 code bytes then meet their inputs in one vector, and the low ones too. */
static void split_inputs(const float *x, int64_t rows, int64_t x_stride, int64_t k, float *xs) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < k; c += CHUNK)
            for (int j = 0; j < CHUNK / 2; j++) {
                xs[r * k + c + j] = round_bf16(x[r * x_stride + c + 2 * j]);
                xs[r * k + c + CHUNK / 2 + j] = round_bf16(x[r * x_stride + c + 2 * j + 1]);
            }
}

#if defined(__AVX2__) && defined(__FMA__)
/* The 16-entry table at 8 indices (0..15 in int32 lanes): two 8-wide permutes, chosen by the index's bit 3. */
static inline __m256 lookup16(__m256i index, __m256 low8, __m256 high8) {
    const __m256 low = _mm256_permutevar8x32_ps(low8, index), high = _mm256_permutevar8x32_ps(high8, index);
    return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* dots[r] = row `codes` of the weight . xs row r, for `tile` rows (the compiler unrolls a constant tile). */
static inline __attribute__((always_inline)) void weight_row(const uint8_t *codes, const float *absmax,
                                                             const float *xs, int tile, int64_t k,
                                                             int64_t blocksize, const float *table, float *dots) {
    const __m256 low8 = _mm256_loadu_ps(table), high8 = _mm256_loadu_ps(table + 8);
    const __m256i nibble = _mm256_set1_epi32(0xF);
    __m256 total[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) total[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / blocksize; b++) {
        __m256 even[ROW_TILE], odd[ROW_TILE];  /* two chains per row: FMA latency, not throughput, would bind one */
        for (int r = 0; r < ROW_TILE; r++) even[r] = odd[r] = _mm256_setzero_ps();
        for (int64_t c = b * blocksize; c < (b + 1) * blocksize; c += CHUNK) {
            const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + c / 2)));
            const __m256 w_even = lookup16(_mm256_srli_epi32(bytes, 4), low8, high8);
            const __m256 w_odd = lookup16(_mm256_and_si256(bytes, nibble), low8, high8);
            for (int r = 0; r < tile; r++) {
                even[r] = _mm256_fmadd_ps(w_even, _mm256_loadu_ps(xs + r * k + c), even[r]);
                odd[r] = _mm256_fmadd_ps(w_odd, _mm256_loadu_ps(xs + r * k + c + CHUNK / 2), odd[r]);
            }
        }
        const __m256 scale = _mm256_set1_ps(absmax[b]);
        for (int r = 0; r < tile; r++) total[r] = _mm256_fmadd_ps(_mm256_add_ps(even[r], odd[r]), scale, total[r]);
    }
    for (int r = 0; r < tile; r++) dots[r] = sum8(total[r]);
}
#else
/* The portable form (Arm boards, older x86): the same sums, in the same order of blocks. */
static inline __attribute__((always_inline)) void weight_row(const uint8_t *codes, const float *absmax,
                                                             const float *xs, int tile, int64_t k,
                                                             int64_t blocksize, const float *table, float *dots) {
    float total[ROW_TILE] = {0};
    for (int64_t b = 0; b < k / blocksize; b++) {
        float acc[ROW_TILE] = {0};
        for (int64_t c = b * blocksize; c < (b + 1) * blocksize; c += CHUNK)
            for (int j = 0; j < CHUNK / 2; j++) {
                const uint8_t byte = codes[c / 2 + j];
                const float w_even = table[byte >> 4], w_odd = table[byte & 0xF];
                for (int r = 0; r < tile; r++)
                    acc[r] += w_even * xs[r * k + c + j] + w_odd * xs[r * k + c + CHUNK / 2 + j];
            }
        for (int r = 0; r < tile; r++) total[r] += acc[r] * absmax[b];
    }
    for (int r = 0; r < tile; r++) dots[r] = total[r];
}
#endif

/* out [rows, n_out] fp32 (row stride out_stride) = x [rows, k] fp32 (row stride x_stride) @ W^T (+ bias [n_out]
 * fp32, or NULL), W the 4-bit codes [n_out * k / 2] with absmax [n_out * k / blocksize] fp32 and the code table
 * [16] fp32, output columns split over `threads` threads of torch's OpenMP team (head_kernels.c says why the team).
 * Returns 0, or 1 (refused: k or blocksize not a multiple of 16, k not a multiple of blocksize, threads outside
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
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int64_t o = 0; o < n_out; o++) {
        const uint8_t *row_codes = codes + o * (k / 2);
        const float *row_absmax = absmax + o * (k / blocksize);
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int64_t tile = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            float dots[ROW_TILE];
            if (tile == ROW_TILE) weight_row(row_codes, row_absmax, xs + r0 * k, ROW_TILE, k, blocksize, table, dots);
            else if (tile == 1) weight_row(row_codes, row_absmax, xs + r0 * k, 1, k, blocksize, table, dots);
            else weight_row(row_codes, row_absmax, xs + r0 * k, (int)tile, k, blocksize, table, dots);
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
