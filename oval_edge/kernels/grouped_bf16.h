/* grouped_kernels.c's body for CPUs with AVX512-BF16: the codes' products with x through vdpbf16ps.
 *
 * Why: the fp32 bodies form every weight (scale * code + min: a conversion and an fma per 16 weights) before the
 * products, which keeps them at ~5-6 cycles per 32 weights; bitsandbytes' fused NF4 kernel on the same CPUs takes
 * ~2.3 (its bf16 dot product), and a decode step is bound by these products. Here the integer codes are looked up
 * as bf16 (exact: integers up to 256) and multiplied with x rounded to bf16, 32 products per instruction, and the
 * group's scale and min are applied to the sums: dot = sum_g scale_g * (codes_g . x_g) + min_g * sum(x_g).
 * Arithmetic: x rounded to bf16 (round to nearest even, as bitsandbytes' kernel rounds it), products and sums in
 * fp32; the weights themselves are not rounded. cpu_check.py and tests/test_grouped_bodies.py compare against the
 * reference on bf16-rounded inputs.
 *
 * Code words: a 4-bit code q becomes the bf16 word 0x4300 | q, which is 128 + q exactly: one or and one and per 16
 * codes instead of a table lookup (the lookups and byte widenings were the kernel's bottleneck, all on the one
 * shuffle port); the extra 128 * sum(x_g) is taken out through the min (min_g - 128 scale_g). An 8-bit code is
 * 16 * high + low nibble, each looked up in a table of bf16(0..15) or bf16(16 * (0..15)): two products.
 *
 * 4-bit codes in groups of 32 (the common case) go two chunks per 512-bit pass (wide_decode / wide_apply) against x
 * reordered once per call (pair_order); groups of 16 and an odd last chunk take the 256-bit nibble_chunk.
 */
#include <immintrin.h>
#include <stdlib.h>

#define GROUPED_BF16 1

/* bf16(i) for i = 0..31 (16-bit words), the lookup table of vpermw: bf16 of a small integer is its fp32 bits >> 16. */
static inline __m512i small_int_bf16_table(int times) {
    uint16_t words[32];
    for (int i = 0; i < 32; i++) {
        const float v = (float)(i * times);
        uint32_t u;
        memcpy(&u, &v, 4);
        words[i] = (uint16_t)(u >> 16);
    }
    return _mm512_loadu_si512(words);
}

/* x rows [rows, k] (row stride x_stride) -> xb [rows, k] bf16 and each group's sum of those rounded values
 * xsum [rows, k / group] fp32. */
static void round_inputs(const float *x, int64_t rows, int64_t x_stride, int64_t k, int64_t group, uint16_t *xb,
                         float *xsum) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < k; c += 16) {
            const __m256bh half = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * x_stride + c));
            _mm256_storeu_si256((__m256i *)(xb + r * k + c), (__m256i)half);
        }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < k / group; g++) {
            float total = 0.0f;
            for (int64_t j = 0; j < group; j++) {
                const uint32_t u = (uint32_t)xb[r * k + g * group + j] << 16;
                float v;
                memcpy(&v, &u, 4);
                total += v;
            }
            xsum[r * (k / group) + g] = total;
        }
}

/* Chunk c's products for `tile` rows of x, scaled and added to acc[r] (acc: one of the rows' two chains). */
static inline __attribute__((always_inline)) void chunk_bf16(const uint8_t *row, const uint16_t *scales, int bits,
                                                             int group, const uint16_t *xb, int tile, int64_t k,
                                                             int64_t c, __m512i ones, __m512i sixteens,
                                                             __m512 acc[ROW_TILE]) {
    __m128i lo, hi;
    chunk_codes(row, bits, c, &lo, &hi);
    const __m512i words = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo)); /* codes 0..31 in order */
    __m512i w_low, w_high = _mm512_setzero_si512();
    if (bits == 4) {
        w_low = _mm512_permutexvar_epi16(words, ones);
    } else {
        w_low = _mm512_permutexvar_epi16(_mm512_and_si512(words, _mm512_set1_epi16(0x0F)), ones);
        w_high = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), sixteens);
    }
    /* lane j holds the products of codes 2j and 2j + 1: lanes 0..7 are the chunk's first 16 codes */
    const __m512 scale = group == 32 ? _mm512_set1_ps(_cvtsh_ss(scales[c]))
                                     : _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(_cvtsh_ss(scales[2 * c])),
                                                            _mm512_set1_ps(_cvtsh_ss(scales[2 * c + 1])));
    for (int r = 0; r < tile; r++) {
        const __m512bh xr = (__m512bh)_mm512_loadu_si512(xb + r * k + c * CHUNK);
        __m512 sums = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w_low, xr);
        if (bits == 8) sums = _mm512_dpbf16_ps(sums, (__m512bh)w_high, xr);
        acc[r] = _mm512_fmadd_ps(sums, scale, acc[r]);
    }
}

/* Eight fp16 scales or mins -> fp32 (the weight's planes are read as stored: no per-row widening pass). */
static inline __m256 widen8(const uint16_t *h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)); }

#define NIBBLE_WORD 0x4300 /* bf16 of 128.0: OR-ing a code below 128 into its mantissa gives bf16(128 + code) */

/* Chunk c of 4-bit codes for `tile` rows, 256 bits at a time: weights 0..15 and 16..31 of the chunk are the low and
 * high nibbles of its 16 bytes, each widened to a word and made 128 + code (NIBBLE_WORD). */
static inline __attribute__((always_inline)) void nibble_chunk(const uint8_t *row, const uint16_t *scales, int group,
                                                               const uint16_t *xb, int tile, int64_t k, int64_t c,
                                                               __m256 acc[ROW_TILE]) {
    const __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + c * 16)));
    const __m256i word = _mm256_set1_epi16(NIBBLE_WORD);
    const __m256i low = _mm256_or_si256(_mm256_and_si256(raw, _mm256_set1_epi16(0x0F)), word);
    const __m256i high = _mm256_or_si256(_mm256_srli_epi16(raw, 4), word);
    for (int r = 0; r < tile; r++) {
        const uint16_t *xr = xb + r * k + c * CHUNK;
        const __m256bh x_low = (__m256bh)_mm256_loadu_si256((const __m256i *)xr);
        const __m256bh x_high = (__m256bh)_mm256_loadu_si256((const __m256i *)(xr + 16));
        if (group == 32) {
            const __m256 sums = _mm256_dpbf16_ps(_mm256_dpbf16_ps(_mm256_setzero_ps(), (__m256bh)low, x_low),
                                                 (__m256bh)high, x_high);
            acc[r] = _mm256_fmadd_ps(sums, _mm256_set1_ps(_cvtsh_ss(scales[c])), acc[r]);
        } else {
            acc[r] = _mm256_fmadd_ps(_mm256_dpbf16_ps(_mm256_setzero_ps(), (__m256bh)low, x_low),
                                     _mm256_set1_ps(_cvtsh_ss(scales[2 * c])), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_dpbf16_ps(_mm256_setzero_ps(), (__m256bh)high, x_high),
                                     _mm256_set1_ps(_cvtsh_ss(scales[2 * c + 1])), acc[r]);
        }
    }
}

/* A row's dot from its code sums `acc` (scaled, 8 lanes) and the mins' part, sum_g (min_g - 128 scale_g) * sum(x_g)
 * over one row of x's group sums, eight groups a vector. */
static inline __attribute__((always_inline)) float nibble_total(const uint16_t *scales, const uint16_t *mins,
                                                                const float *xsum, int64_t groups, __m256 acc) {
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set1_ps(128.0f), widen8(scales + g), widen8(mins + g)),
                              _mm256_loadu_ps(xsum + g), acc);
    float total = sum8(acc);
    for (; g < groups; g++) total += (_cvtsh_ss(mins[g]) - 128.0f * _cvtsh_ss(scales[g])) * xsum[g];
    return total;
}

/* One row of x's bf16 words xb [k] reordered for wide_chunks: for each pair of chunks (c, c + 1), the 32 words that
 * meet the pair's low nibbles (x[32c .. 32c + 15], x[32c + 32 .. 32c + 47]) and then the 32 that meet the high ones
 * (x[32c + 16 .. 32c + 31], x[32c + 48 .. 32c + 63]); an odd last chunk is read from xb itself. Done once per call,
 * shared by every output row. */
static void pair_order(const uint16_t *xb, int64_t k, uint16_t *xp) {
    for (int64_t c = 0; c + 1 < k / CHUNK; c += 2) {
        const uint16_t *src = xb + c * CHUNK;
        uint16_t *dst = xp + c * CHUNK;
        memcpy(dst, src, 16 * sizeof(uint16_t));
        memcpy(dst + 16, src + 32, 16 * sizeof(uint16_t));
        memcpy(dst + 32, src + 16, 16 * sizeof(uint16_t));
        memcpy(dst + 48, src + 48, 16 * sizeof(uint16_t));
    }
}

/* Chunks c and c + 1 of a row's 4-bit codes (group 32) as bf16 words, with their scales spread over the product
 * lanes: the 32 code bytes widen to 32 words (bytes of chunk c, then of c + 1), so lanes 0..7 of the products hold
 * chunk c and lanes 8..15 chunk c + 1. One 512-bit pass does what two nibble_chunk calls do in half the
 * instructions: on CPUs with full-width 512-bit units (this one: gate_up, one row, one thread, 49 -> 34 us) the
 * 256-bit form was bound by the instruction count, not by the multiplies. */
typedef struct {
    __m512i low, high; /* 128 + code (NIBBLE_WORD) of the low and high nibbles */
    __m512 scale;      /* [scale_c x 8, scale_c+1 x 8] */
} wide_codes;

static inline __attribute__((always_inline)) wide_codes wide_decode(const uint8_t *row, const uint16_t *scales,
                                                                    int64_t c) {
    const __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + c * 16)));
    const __m512i word = _mm512_set1_epi16(NIBBLE_WORD);
    wide_codes w;
    w.low = _mm512_ternarylogic_epi32(raw, _mm512_set1_epi16(0x0F), word, 0xEA); /* 0xEA: (raw & 0x0F) | word */
    w.high = _mm512_or_si512(_mm512_srli_epi16(raw, 4), word);
    /* scales c and c + 1 (two fp16 words): each 128-bit lane of the broadcast holds both, the shuffle picks one */
    uint32_t both;
    memcpy(&both, scales + c, sizeof(both));
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)both),
                                               _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                                                2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3));
    w.scale = _mm512_cvtph_ps(spread);
    return w;
}

/* acc + the scaled products of decoded chunks (c, c + 1) with one row of pair-ordered x (pair_order). */
static inline __attribute__((always_inline)) __m512 wide_apply(wide_codes w, const uint16_t *xp, int64_t c,
                                                               __m512 acc) {
    const __m512bh x_low = (__m512bh)_mm512_loadu_si512(xp + c * CHUNK);
    const __m512bh x_high = (__m512bh)_mm512_loadu_si512(xp + c * CHUNK + 32);
    const __m512 sums = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w.low, x_low),
                                         (__m512bh)w.high, x_high);
    return _mm512_fmadd_ps(sums, w.scale, acc);
}

/* The mins' part of a row's dot, sum_g (min_g - 128 scale_g) * sum(x_g), sixteen groups a vector and the rest masked,
 * added to acc and summed across lanes. */
static inline __attribute__((always_inline)) float wide_total(const uint16_t *scales, const uint16_t *mins,
                                                              const float *xsum, int64_t groups, __m512 acc) {
    const __m512 bias = _mm512_set1_ps(128.0f);
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16) {
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + g)));
        acc = _mm512_fmadd_ps(_mm512_fnmadd_ps(bias, s, m), _mm512_loadu_ps(xsum + g), acc);
    }
    if (g < groups) { /* masked lanes load zeros: their terms are 0 */
        const __mmask16 rest = (__mmask16)((1u << (groups - g)) - 1u);
        const __m512 s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(rest, scales + g));
        const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(rest, mins + g));
        acc = _mm512_fmadd_ps(_mm512_fnmadd_ps(bias, s, m), _mm512_maskz_loadu_ps(rest, xsum + g), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* Two output rows (a, b), 4-bit codes in groups of 32, against one row of x (xb natural order, xp pair_order): four
 * chunks a step, each row's even and odd pairs in separate sums (four chains in flight); an odd last chunk through
 * nibble_chunk. */
static inline __attribute__((always_inline)) void wide_pair(const uint8_t *row_a, const uint8_t *row_b,
                                                            const uint16_t *scales_a, const uint16_t *scales_b,
                                                            const uint16_t *mins_a, const uint16_t *mins_b,
                                                            const uint16_t *xb, const uint16_t *xp, const float *xsum,
                                                            int64_t k, float dots[2]) {
    const int64_t chunks = k / CHUNK;
    __m512 even_a = _mm512_setzero_ps(), odd_a = even_a, even_b = even_a, odd_b = even_a;
    int64_t c = 0;
    for (; c + 3 < chunks; c += 4) {
        even_a = wide_apply(wide_decode(row_a, scales_a, c), xp, c, even_a);
        even_b = wide_apply(wide_decode(row_b, scales_b, c), xp, c, even_b);
        odd_a = wide_apply(wide_decode(row_a, scales_a, c + 2), xp, c + 2, odd_a);
        odd_b = wide_apply(wide_decode(row_b, scales_b, c + 2), xp, c + 2, odd_b);
    }
    if (c + 1 < chunks) {
        even_a = wide_apply(wide_decode(row_a, scales_a, c), xp, c, even_a);
        even_b = wide_apply(wide_decode(row_b, scales_b, c), xp, c, even_b);
        c += 2;
    }
    if (c < chunks) {
        __m256 last_a[ROW_TILE], last_b[ROW_TILE];
        last_a[0] = last_b[0] = _mm256_setzero_ps();
        nibble_chunk(row_a, scales_a, 32, xb, 1, k, c, last_a);
        nibble_chunk(row_b, scales_b, 32, xb, 1, k, c, last_b);
        odd_a = _mm512_add_ps(odd_a, _mm512_zextps256_ps512(last_a[0]));
        odd_b = _mm512_add_ps(odd_b, _mm512_zextps256_ps512(last_b[0]));
    }
    dots[0] = wide_total(scales_a, mins_a, xsum, k / 32, _mm512_add_ps(even_a, odd_a));
    dots[1] = wide_total(scales_b, mins_b, xsum, k / 32, _mm512_add_ps(even_b, odd_b));
}

/* One output row (4-bit codes, group 32) against `tile` rows of x (xb natural order, xp pair_order, both [tile, k]):
 * each pair of chunks decoded once for every row of x, even and odd pairs in separate sums. */
static inline __attribute__((always_inline)) void wide_rows(const uint8_t *row, const uint16_t *scales,
                                                            const uint16_t *mins, const uint16_t *xb,
                                                            const uint16_t *xp, const float *xsum, int tile,
                                                            int64_t k, float *dots) {
    const int64_t chunks = k / CHUNK, groups = k / 32;
    __m512 even[ROW_TILE], odd[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) even[r] = odd[r] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 3 < chunks; c += 4) {
        const wide_codes first = wide_decode(row, scales, c), second = wide_decode(row, scales, c + 2);
        for (int r = 0; r < tile; r++) {
            even[r] = wide_apply(first, xp + r * k, c, even[r]);
            odd[r] = wide_apply(second, xp + r * k, c + 2, odd[r]);
        }
    }
    if (c + 1 < chunks) {
        const wide_codes first = wide_decode(row, scales, c);
        for (int r = 0; r < tile; r++) even[r] = wide_apply(first, xp + r * k, c, even[r]);
        c += 2;
    }
    if (c < chunks) {
        __m256 last[ROW_TILE];
        for (int r = 0; r < ROW_TILE; r++) last[r] = _mm256_setzero_ps();
        nibble_chunk(row, scales, 32, xb, tile, k, c, last);
        for (int r = 0; r < tile; r++) odd[r] = _mm512_add_ps(odd[r], _mm512_zextps256_ps512(last[r]));
    }
    for (int r = 0; r < tile; r++)
        dots[r] = wide_total(scales, mins, xsum + r * groups, groups, _mm512_add_ps(even[r], odd[r]));
}

/* weight_row_bf16 for 4-bit codes (nibble_chunk), even and odd chunks in separate sums. */
static inline __attribute__((always_inline)) void nibble_row(const uint8_t *row, const uint16_t *scales,
                                                             const uint16_t *mins, int group, const uint16_t *xb,
                                                             const float *xsum, int tile, int64_t k, float *dots) {
    const int64_t groups = k / group, chunks = k / CHUNK;
    __m256 even[ROW_TILE], odd[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) even[r] = odd[r] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 1 < chunks; c += 2) {
        nibble_chunk(row, scales, group, xb, tile, k, c, even);
        nibble_chunk(row, scales, group, xb, tile, k, c + 1, odd);
    }
    if (c < chunks) nibble_chunk(row, scales, group, xb, tile, k, c, even);
    for (int r = 0; r < tile; r++)
        dots[r] = nibble_total(scales, mins, xsum + r * groups, groups, _mm256_add_ps(even[r], odd[r]));
}

/* Two output rows (a, b) against one row of x: the same chunks as nibble_row, interleaved, so the x loads are shared
 * and four sums are in flight; a single row's horizontal sum and mins' part were a third of its time at SmolLM2's
 * widths (~20 cycles a row against ~3 a chunk). */
static inline __attribute__((always_inline)) void nibble_pair(const uint8_t *row_a, const uint8_t *row_b,
                                                              const uint16_t *scales_a, const uint16_t *scales_b,
                                                              const uint16_t *mins_a, const uint16_t *mins_b,
                                                              int group, const uint16_t *xb, const float *xsum,
                                                              int64_t k, float dots[2]) {
    const int64_t groups = k / group, chunks = k / CHUNK;
    __m256 even_a[ROW_TILE], odd_a[ROW_TILE], even_b[ROW_TILE], odd_b[ROW_TILE];
    even_a[0] = odd_a[0] = even_b[0] = odd_b[0] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 1 < chunks; c += 2) {
        nibble_chunk(row_a, scales_a, group, xb, 1, k, c, even_a);
        nibble_chunk(row_b, scales_b, group, xb, 1, k, c, even_b);
        nibble_chunk(row_a, scales_a, group, xb, 1, k, c + 1, odd_a);
        nibble_chunk(row_b, scales_b, group, xb, 1, k, c + 1, odd_b);
    }
    if (c < chunks) {
        nibble_chunk(row_a, scales_a, group, xb, 1, k, c, even_a);
        nibble_chunk(row_b, scales_b, group, xb, 1, k, c, even_b);
    }
    dots[0] = nibble_total(scales_a, mins_a, xsum, groups, _mm256_add_ps(even_a[0], odd_a[0]));
    dots[1] = nibble_total(scales_b, mins_b, xsum, groups, _mm256_add_ps(even_b[0], odd_b[0]));
}

/* dots[r] = weight row . x row r for `tile` rows from the bf16 inputs (round_inputs). Even and odd chunks add into
 * separate sums: one chain would wait on the previous chunk's fma (4 cycles), about as long as a chunk takes. */
static inline __attribute__((always_inline)) void weight_row_bf16(const uint8_t *row, const uint16_t *scales,
                                                                  const uint16_t *mins, int bits, int group,
                                                                  const uint16_t *xb, const float *xsum, int tile,
                                                                  int64_t k, __m512i ones, __m512i sixteens,
                                                                  float *dots) {
    if (bits == 4) {
        nibble_row(row, scales, mins, group, xb, xsum, tile, k, dots);
        return;
    }
    const int64_t groups = k / group, chunks = k / CHUNK;
    __m512 even[ROW_TILE], odd[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) even[r] = odd[r] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 1 < chunks; c += 2) {
        chunk_bf16(row, scales, bits, group, xb, tile, k, c, ones, sixteens, even);
        chunk_bf16(row, scales, bits, group, xb, tile, k, c + 1, ones, sixteens, odd);
    }
    if (c < chunks) chunk_bf16(row, scales, bits, group, xb, tile, k, c, ones, sixteens, even);
    for (int r = 0; r < tile; r++) {
        float total = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
        for (int64_t g = 0; g < groups; g++) total += _cvtsh_ss(mins[g]) * xsum[r * groups + g];
        dots[r] = total;
    }
}
