/* What the decode kernels' Arm bodies share (score_neon.h, attend_kernels.c, group_kernels.c): record rows widened
 * to fp32 four lanes at a time, one row dotted with a group's queries, a 4-lane 2^x. Included where the compiler
 * targets Advanced SIMD (every aarch64 CPU, the Orin's Cortex-A78AE among them).
 *
 * Why: the plain C bodies leave gcc to vectorise each of a page's (r + 1) * G dot products on its own, each ended by
 * a horizontal sum and followed by a scalar tail, and it cannot vectorise the packed nibble reads at all: counted in
 * the aarch64 objects, the scoring and attention files had 15 and 147 vector multiply-adds against 85 and 531
 * scalar ones. Here a row is widened once and each vector of it meets four queries. */
#ifndef OVAL_KERNEL_NEON_H
#define OVAL_KERNEL_NEON_H

#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

/* Row element formats (the same numbering as score_kernels.c's FMT_* and attend_kernels.c's KV_*). */
#define NEON_F32 0
#define NEON_BF16 1
#define NEON_INT8 2

/* n values (a multiple of 8) from element `first` of base in format fmt -> fp32 dst. */
static inline __attribute__((always_inline)) void neon_widen(float *restrict dst, const void *base, int64_t first,
                                                             int64_t n, int fmt) {
    if (fmt == NEON_F32) {
        const float *src = (const float *)base + first;
        for (int64_t i = 0; i < n; i += 4) vst1q_f32(dst + i, vld1q_f32(src + i));
    } else if (fmt == NEON_BF16) { /* bf16 is the high half of an fp32 */
        const uint16_t *src = (const uint16_t *)base + first;
        for (int64_t i = 0; i < n; i += 8) {
            const uint16x8_t h = vld1q_u16(src + i);
            vst1q_f32(dst + i, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)));
            vst1q_f32(dst + i + 4, vreinterpretq_f32_u32(vshll_high_n_u16(h, 16)));
        }
    } else {
        const int8_t *src = (const int8_t *)base + first;
        for (int64_t i = 0; i < n; i += 8) {
            const int16x8_t w = vmovl_s8(vld1_s8(src + i));
            vst1q_f32(dst + i, vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))));
            vst1q_f32(dst + i + 4, vcvtq_f32_s32(vmovl_high_s16(w)));
        }
    }
}

/* 16 unsigned bytes -> fp32 dst[0..16) minus bias. */
static inline __attribute__((always_inline)) void neon_store_u8(float *restrict dst, uint8x16_t v, int32_t bias) {
    const uint16x8_t lo = vmovl_u8(vget_low_u8(v)), hi = vmovl_high_u8(v);
    const int32x4_t b = vdupq_n_s32(bias);
    vst1q_f32(dst, vcvtq_f32_s32(vsubq_s32(vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(lo))), b)));
    vst1q_f32(dst + 4, vcvtq_f32_s32(vsubq_s32(vreinterpretq_s32_u32(vmovl_high_u16(lo)), b)));
    vst1q_f32(dst + 8, vcvtq_f32_s32(vsubq_s32(vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(hi))), b)));
    vst1q_f32(dst + 12, vcvtq_f32_s32(vsubq_s32(vreinterpretq_s32_u32(vmovl_high_u16(hi)), b)));
}

/* 16 4-bit codes from 8 bytes (value 2j in byte j's low nibble, 2j + 1 in its high one) -> 16 bytes in order. */
static inline __attribute__((always_inline)) uint8x16_t neon_nibbles16(const uint8_t *src) {
    const uint8x8_t bytes = vld1_u8(src);
    return vcombine_u8(vzip1_u8(vand_u8(bytes, vdup_n_u8(0x0F)), vshr_n_u8(bytes, 4)),
                       vzip2_u8(vand_u8(bytes, vdup_n_u8(0x0F)), vshr_n_u8(bytes, 4)));
}

/* n (a multiple of 16) packed 4-bit levels (stored as q + 8) -> fp32 dst. */
static inline __attribute__((always_inline)) void neon_widen_int4(float *restrict dst, const uint8_t *nibbles,
                                                                  int64_t n) {
    for (int64_t i = 0; i < n; i += 16) neon_store_u8(dst + i, neon_nibbles16(nibbles + i / 2), 8);
}

/* n (a multiple of 16) 5-bit levels (stored as q + 16): low nibbles packed two a byte at `nibbles`, fifth bits at
 * `fifth` (element m's is bit m % 8 of byte m / 8) -> fp32 dst. */
static inline __attribute__((always_inline)) void neon_widen_int5(float *restrict dst, const uint8_t *nibbles,
                                                                  const uint8_t *fifth, int64_t n) {
    static const uint8_t lane_bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t bit = vld1q_u8(lane_bit);
    for (int64_t i = 0; i < n; i += 16) {
        const uint8x16_t planes = vcombine_u8(vdup_n_u8(fifth[i / 8]), vdup_n_u8(fifth[i / 8 + 1]));
        const uint8x16_t high = vandq_u8(vtstq_u8(planes, bit), vdupq_n_u8(16)); /* 16 where the bit is set */
        neon_store_u8(dst + i, vorrq_u8(neon_nibbles16(nibbles + i / 2), high), 16);
    }
}

/* out[g] = row . q_g for the G queries q [G, dim] (dim a multiple of 4): four queries share each load of the row. */
static inline __attribute__((always_inline)) void neon_dot_queries(float *restrict out, const float *restrict row,
                                                                   const float *restrict q, int64_t group,
                                                                   int64_t dim) {
    int64_t g = 0;
    for (; g + 4 <= group; g += 4) {
        const float *q0 = q + g * dim, *q1 = q0 + dim, *q2 = q1 + dim, *q3 = q2 + dim;
        float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < dim; d += 4) {
            const float32x4_t r = vld1q_f32(row + d);
            a0 = vfmaq_f32(a0, r, vld1q_f32(q0 + d));
            a1 = vfmaq_f32(a1, r, vld1q_f32(q1 + d));
            a2 = vfmaq_f32(a2, r, vld1q_f32(q2 + d));
            a3 = vfmaq_f32(a3, r, vld1q_f32(q3 + d));
        }
        /* pairwise adds end the four sums in one vector */
        vst1q_f32(out + g, vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3)));
    }
    for (; g < group; g++) { /* the group's last 1..3 queries: two chains a query */
        const float *qg = q + g * dim;
        float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;
        int64_t d = 0;
        for (; d + 8 <= dim; d += 8) {
            a0 = vfmaq_f32(a0, vld1q_f32(row + d), vld1q_f32(qg + d));
            a1 = vfmaq_f32(a1, vld1q_f32(row + d + 4), vld1q_f32(qg + d + 4));
        }
        if (d < dim) a0 = vfmaq_f32(a0, vld1q_f32(row + d), vld1q_f32(qg + d));
        out[g] = vaddvq_f32(vaddq_f32(a0, a1));
    }
}

/* exp2_nonpositive (kernel_math.h) on 4 lanes: the same clamp, rounding and polynomial. */
#define NEON_FMA(a, b, c) vfmaq_f32((c), (a), (b))
static inline __attribute__((always_inline)) float32x4_t neon_exp2_nonpositive(float32x4_t x) {
    const float32x4_t clamped = vmaxq_f32(x, vdupq_n_f32(-126.0f));
    const float32x4_t n = vrndmq_f32(vaddq_f32(clamped, vdupq_n_f32(0.5f)));
    const float32x4_t f = vsubq_f32(clamped, n);
    const float32x4_t p = EXP2_TAYLOR(NEON_FMA, vdupq_n_f32, f);
    const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(bits));
}

/* w[i] = 2^(w[i] - peak) for i < n (all <= 0 after the shift), returning their sum. The last n % 4 values go
 * through the same vector code from a padded copy (padded with -3e38: 2^-126 each, which no sum of weights >= 1
 * notices, and is not stored), so there is no scalar tail. */
static inline __attribute__((always_inline)) float neon_exp2_shifted(float *restrict w, int64_t n, float peak) {
    const float32x4_t shift = vdupq_n_f32(peak);
    float32x4_t total = vdupq_n_f32(0.0f);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t e = neon_exp2_nonpositive(vsubq_f32(vld1q_f32(w + i), shift));
        vst1q_f32(w + i, e);
        total = vaddq_f32(total, e);
    }
    if (i < n) {
        float tail[4] = {-3.0e38f, -3.0e38f, -3.0e38f, -3.0e38f};
        memcpy(tail, w + i, (size_t)(n - i) * sizeof(float));
        const float32x4_t e = neon_exp2_nonpositive(vsubq_f32(vld1q_f32(tail), shift));
        vst1q_f32(tail, e);
        memcpy(w + i, tail, (size_t)(n - i) * sizeof(float));
        total = vaddq_f32(total, e);
    }
    return vaddvq_f32(total);
}

#endif
