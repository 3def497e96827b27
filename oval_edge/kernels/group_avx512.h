/* The coarse bound's basis part at rank 8 on 512-bit vectors, included by group_kernels.c when the build targets
 * AVX-512F and VL. Same bound as group_mass's loop over the rank; only the summation order differs.
 *
 * Why: that loop ends each basis row's dot products on its own (eight 8-lane steps, then horizontal adds) and takes
 * the box's maximum one scalar at a time: at the default shape (r = 8, D = 64, G = 3) a group and KV head cost about
 * as much as a fine page (~0.18 us on one 2.1 GHz core), so the coarse level of 64 groups was a third of a two-level
 * layer's scoring at 32k. Here the 8 x G accumulators stay in registers over the rows, each query's eight
 * projections end in one sum8_lanes (kernel_math.h), and the box bound is one vector maximum and one sum. */
#define GROUP_BOUND8_READY 1

/* bh[g + i] += sum_j max(p_j lo_j, p_j hi_j) for the n (1 to 3, a constant) queries from g: p = B^T q with the
 * basis rows [8, dim] int8 codes times their scales unit [8]; box [2, 8] fp32: the coordinates' min, then max.
 * qh [G, dim]: the KV head's queries in log2 units; dim a multiple of 16. */
static inline __attribute__((always_inline)) void box_bound8(float *bh, const float *qh, const int8_t *rows,
                                                             const float *unit, const float *box, int64_t g, int n,
                                                             int64_t dim) {
    __m512 a[3][8];
    for (int i = 0; i < n; i++)
        for (int j = 0; j < 8; j++) a[i][j] = _mm512_setzero_ps();
    for (int j = 0; j < 8; j++)
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512 r =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(rows + j * dim + d))));
            for (int i = 0; i < n; i++) a[i][j] = _mm512_fmadd_ps(r, _mm512_loadu_ps(qh + (g + i) * dim + d), a[i][j]);
        }
    const __m256 u = _mm256_loadu_ps(unit); /* each row's scale folds into its projections */
    const __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(box), u), hi = _mm256_mul_ps(_mm256_loadu_ps(box + 8), u);
    for (int i = 0; i < n; i++) {
        const __m256 p = sum8_lanes(a[i]);
        bh[g + i] += hsum8(_mm256_max_ps(_mm256_mul_ps(p, lo), _mm256_mul_ps(p, hi)));
    }
}
