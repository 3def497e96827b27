/* The Advanced SIMD (NEON) page of page scoring, included by score_kernels.c on Arm (the Orin's Cortex-A78AE).
 * Same score as oval_scores_plain's page; only the summation order differs.
 *
 * Per page: the mean and the r basis rows are widened to fp32 one row at a time (bf16 by a shift, int8 by two
 * widenings, int4 nibbles and fifth bits by a byte zip and a bit test) and each vector of a row is dotted with four
 * queries at once (kernel_neon.h); the r coordinate rows are widened once into L1, then logits [G, P] = offset +
 * projected x R^T run four tokens a vector with the running peak, and their log-sum-exp uses a 4-lane 2^x. The plain
 * body calls it page by page (its OpenMP split and its per-shape instantiations stay).
 * Takes: head dim and page size multiples of 16 (int4 rows are widened 16 values at a time), rank <= 16,
 * page_size <= 128 (the shapes serving uses); anything else takes the plain page. */
#include "kernel_neon.h"

#define SCORE_NEON_READY 1
#define NEON_MAX_RANK 16
#define NEON_MAX_PAGE 128

static inline int neon_takes(int64_t dim, int64_t rank, int64_t page_size) {
    return dim % 16 == 0 && page_size % 16 == 0 && rank >= 1 && rank <= NEON_MAX_RANK && page_size <= NEON_MAX_PAGE;
}

/* One page's score. q, qb [G, dim]: the group's queries (qb: the basis rows', H q for the int4 record); sc: the
 * record's 1 + r scales (quantized formats) or NULL; record: the page's index in the layer's head-major tensors. */
static inline __attribute__((always_inline)) float score_page_neon(
    const float *restrict q, const float *restrict qb, const void *mean, const void *basis, const void *coords,
    const float *sc, int64_t record, float unit, int64_t group, int64_t dim, int64_t rank, int64_t page_size,
    int fmt) {
    const int mean_fmt = fmt >= FMT_INT8 ? FMT_INT8 : fmt; /* the int4 record keeps an int8 mean */
    float row[MAX_DIM];
    float coord[NEON_MAX_RANK * NEON_MAX_PAGE]; /* [r, P] */
    float offset[MAX_GROUP];                    /* [G]: mu . q_g, log2 units */
    float projected[NEON_MAX_RANK * MAX_GROUP]; /* [r, G]: B^T q_g, log2 units */
    neon_widen(row, mean, record * dim, dim, mean_fmt);
    neon_dot_queries(offset, row, q, group, dim);
    const float mean_unit = sc ? unit * sc[0] : unit;
    for (int64_t g = 0; g < group; g++) offset[g] *= mean_unit;
    for (int64_t i = 0; i < rank; i++) {
        if (fmt == FMT_INT4) {
            const uint8_t *packed = (const uint8_t *)basis + (record * rank + i) * INT5_ROW_BYTES(dim);
            neon_widen_int5(row, packed, packed + dim / 2, dim);
        } else {
            neon_widen(row, basis, (record * rank + i) * dim, dim, fmt);
        }
        float *p = projected + i * group;
        neon_dot_queries(p, row, qb, group, dim);
        const float folded = sc ? unit * sc[1 + i] : unit; /* rank i's basis and coordinate scales, one product */
        for (int64_t g = 0; g < group; g++) p[g] *= folded;
    }
    if (fmt == FMT_INT4) {
        const uint8_t *src = (const uint8_t *)coords + record * INT4_COORD_BYTES(rank, page_size);
        const int64_t wide = FIFTH_RANKS(rank) * page_size; /* values of the rows with fifth bits */
        neon_widen_int5(coord, src, src + rank * page_size / 2, wide);
        neon_widen_int4(coord + wide, src + wide / 2, rank * page_size - wide);
    } else {
        neon_widen(coord, coords, record * rank * page_size, rank * page_size, fmt);
    }
    float logits[MAX_GROUP * NEON_MAX_PAGE]; /* [G, P] */
    float32x4_t peak4 = vdupq_n_f32(-3.0e38f);
    for (int64_t p = 0; p < page_size; p += 4) {
        float32x4_t c[NEON_MAX_RANK]; /* tokens p..p+3's coordinates, loaded once for the whole group */
        for (int64_t i = 0; i < rank; i++) c[i] = vld1q_f32(coord + i * page_size + p);
        for (int64_t g = 0; g < group; g++) { /* logit = offset + sum_i projected[i, g] * coordinate i */
            float32x4_t logit = vdupq_n_f32(offset[g]);
            for (int64_t i = 0; i < rank; i++) logit = vfmaq_n_f32(logit, c[i], projected[i * group + g]);
            vst1q_f32(logits + g * page_size + p, logit);
            peak4 = vmaxq_f32(peak4, logit);
        }
    }
    const float peak = vmaxvq_f32(peak4);
    const float32x4_t shift = vdupq_n_f32(peak);
    float32x4_t total0 = vdupq_n_f32(0.0f), total1 = total0; /* two chains: page sizes are multiples of 16 */
    for (int64_t j = 0; j < group * page_size; j += 8) {
        total0 = vaddq_f32(total0, neon_exp2_nonpositive(vsubq_f32(vld1q_f32(logits + j), shift)));
        total1 = vaddq_f32(total1, neon_exp2_nonpositive(vsubq_f32(vld1q_f32(logits + j + 4), shift)));
    }
    return page_score(vaddvq_f32(vaddq_f32(total0, total1)), peak);
}
