/* The Advanced SIMD (NEON) body of the grouped GEMV (grouped_kernels.c's weight_row), for Arm boards: included by
 * grouped_kernels.c in place of its portable body where the compiler targets Advanced SIMD. Same products as the
 * portable body (weight = scale * code + min in fp32, one fma; fp32 sums); only the summation order differs.
 *
 * Why: the portable body forms the 32 weights of a chunk one at a time through code_at (a branch on the nibble
 * half per weight), which gcc does not vectorise; here a chunk's 16 code bytes are split into its two runs of 16
 * codes with one and + one shift, widened four lanes at a time and turned into weights by one vfmaq each.
 * Needs CHUNK (32) and ROW_TILE from grouped_kernels.c, and the group size 16 or 32 (refuses() there): a run of 16
 * codes then lies in one group. */
#include <arm_neon.h>

#define GROUPED_NEON 1

/* 16 codes (bytes) -> 4 vectors of weights scale * code + min. */
static inline __attribute__((always_inline)) void run_weights(uint8x16_t codes, float scale, float min,
                                                              float32x4_t w[4]) {
    const uint16x8_t low = vmovl_u8(vget_low_u8(codes)), high = vmovl_high_u8(codes);
    const float32x4_t s = vdupq_n_f32(scale), m = vdupq_n_f32(min);
    w[0] = vfmaq_f32(m, vcvtq_f32_u32(vmovl_u16(vget_low_u16(low))), s);
    w[1] = vfmaq_f32(m, vcvtq_f32_u32(vmovl_high_u16(low)), s);
    w[2] = vfmaq_f32(m, vcvtq_f32_u32(vmovl_u16(vget_low_u16(high))), s);
    w[3] = vfmaq_f32(m, vcvtq_f32_u32(vmovl_high_u16(high)), s);
}

/* dots[r] = weight row . x row r for `tile` rows (scales, mins: the row's, widened to fp32). Two sums a row (even
 * and odd vectors of a chunk): one chain would wait on the previous fma's latency. */
static inline __attribute__((always_inline)) void weight_row(const uint8_t *row, const float *scales,
                                                             const float *mins, int bits, int group,
                                                             const float *x, int64_t x_stride, int tile, int64_t k,
                                                             float *dots) {
    float32x4_t sums[ROW_TILE][2];
    for (int r = 0; r < ROW_TILE; r++) sums[r][0] = sums[r][1] = vdupq_n_f32(0.0f);
    for (int64_t c = 0; c < k / CHUNK; c++) {
        uint8x16_t first, second; /* codes of weights 0..15 and 16..31 of the chunk */
        if (bits == 4) { /* byte i: weight i in its low nibble, weight i + 16 in its high one */
            const uint8x16_t bytes = vld1q_u8(row + c * 16);
            first = vandq_u8(bytes, vdupq_n_u8(0x0F));
            second = vshrq_n_u8(bytes, 4);
        } else {
            first = vld1q_u8(row + c * CHUNK);
            second = vld1q_u8(row + c * CHUNK + 16);
        }
        const int64_t g0 = c * CHUNK / group, g1 = (c * CHUNK + 16) / group; /* equal when group is 32 */
        float32x4_t w[8];
        run_weights(first, scales[g0], mins[g0], w);
        run_weights(second, scales[g1], mins[g1], w + 4);
        for (int r = 0; r < tile; r++) {
            const float *xr = x + r * x_stride + c * CHUNK;
            for (int j = 0; j < 8; j += 2) {
                sums[r][0] = vfmaq_f32(sums[r][0], w[j], vld1q_f32(xr + 4 * j));
                sums[r][1] = vfmaq_f32(sums[r][1], w[j + 1], vld1q_f32(xr + 4 * j + 4));
            }
        }
    }
    for (int r = 0; r < tile; r++) dots[r] = vaddvq_f32(vaddq_f32(sums[r][0], sums[r][1]));
}
