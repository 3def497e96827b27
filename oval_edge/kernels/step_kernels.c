/* Small fused CPU kernels of the static decode step (runtime/engine/static_step.py), called through ctypes by
 * oval_edge/kernels/cpu.py and built into the same library as oval_kernels.c.
 *
 * Why: on a CPU a decode step of a small model is bound by per-op overhead (~4 us per dispatched torch op on this
 * project's 2-core test machine). Each kernel here replaces a run of tiny torch ops that a compiler would fuse: the
 * RMSNorm (one fused torch op that still costs ~20 us per call) and the page selection of a sparse layer (~22 ops).
 * The torch code stays the reference and the fallback (and what torch.compile traces).
 */
#include <stdint.h>
#include <math.h>

#define MAX_TOP_K 64 /* pages picked per KV head; above it the caller falls back to torch */

/* RMSNorm of fp32 rows (Llama's: x * rsqrt(mean(x^2) + eps) * weight, in fp32).
 * x, out [rows, dim] contiguous fp32 (out may alias x); weight [dim]. */
int rms_norm_f32(const float *x, const float *weight, int64_t rows, int64_t dim, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float sum = 0.0f;
        for (int64_t d = 0; d < dim; d++) sum += xr[d] * xr[d];
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) o[d] = xr[d] * inv * weight[d];
    }
    return 0;
}

/* Flat pool row of position pos of row b, KV head h: (page_table[b, pos / P] * Hkv + h) * P + pos % P. */
static inline int64_t flat_row(const int64_t *table, int64_t num_pages, int64_t kv_heads, int64_t h, int64_t P,
                               int64_t pos) {
    int64_t logical = pos / P;
    if (logical > num_pages - 1) logical = num_pages - 1;
    return (table[logical] * kv_heads + h) * P + pos % P;
}

/* The slots one sparse layer attends to (sparse/selection.py DecodePlan.select, detail=False), in its layout:
 *   [sink pages | top-k pages | last window_slots positions],  T = (sink_pages + top_k) * P + window_slots
 * scores [B, Hkv, Np] fp32; page_table [B, Np]; lengths [B] (after this step); sealed [B] (pages with records);
 * start [B, start_heads] the window start (start_heads 1: the same for every KV head, or Hkv).
 * Rows with length <= T attend densely to positions 0..L-1. Otherwise the candidates are the pages j with
 * sink_pages <= j, j < sealed, j * P < length - window_min and j * P < start; the top_k of them by score (ties:
 * the lower page first, as torch.topk) are read below the window start, the sink below it, the window from it.
 * flat, valid [B, Hkv, T]: pool rows (in bounds even where invalid) and whether each is attended.
 * Returns 1 when top_k exceeds MAX_TOP_K or the layout does not add up (the caller falls back). */
int select_slots(const float *scores, const int64_t *page_table, const int64_t *lengths, const int64_t *sealed,
                 const int64_t *start, int64_t start_heads, int64_t batch, int64_t kv_heads, int64_t num_pages,
                 int64_t P, int64_t sink_pages, int64_t top_k, int64_t window_slots, int64_t window_min,
                 int64_t slots, int64_t *flat, uint8_t *valid) {
    if (top_k > MAX_TOP_K || slots != (sink_pages + top_k) * P + window_slots || num_pages < 1) return 1;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t *table = page_table + b * num_pages;
        int64_t length = lengths[b];
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t *f = flat + (b * kv_heads + h) * slots;
            uint8_t *ok = valid + (b * kv_heads + h) * slots;
            if (length <= slots) { /* short row: dense over 0..L-1 */
                for (int64_t t = 0; t < slots; t++) {
                    ok[t] = t < length;
                    f[t] = flat_row(table, num_pages, kv_heads, h, P, t < length ? t : 0);
                }
                continue;
            }
            int64_t ws = start[b * start_heads + (start_heads > 1 ? h : 0)];
            int64_t limit = sealed[b] * P; /* a candidate starts before the sealed end, the window, and ws */
            if (length - window_min < limit) limit = length - window_min;
            if (ws < limit) limit = ws;
            const float *s = scores + (b * kv_heads + h) * num_pages;
            int64_t picked[MAX_TOP_K];
            float best[MAX_TOP_K];
            int64_t count = 0;
            for (int64_t j = sink_pages; j < num_pages && j * P < limit; j++) {
                float v = s[j];
                if (!(v == v)) continue; /* NaN: never picked (torch.topk would rank it first; scores are finite) */
                if (count == top_k && !(v > best[count - 1])) continue;
                int64_t at = count < top_k ? count++ : top_k - 1;
                while (at > 0 && v > best[at - 1]) { /* strictly greater: on ties the earlier page stays first */
                    best[at] = best[at - 1];
                    picked[at] = picked[at - 1];
                    at--;
                }
                best[at] = v;
                picked[at] = j;
            }
            int64_t t = 0;
            for (; t < sink_pages * P; t++) {
                ok[t] = t < ws;
                f[t] = flat_row(table, num_pages, kv_heads, h, P, t);
            }
            for (int64_t c = 0; c < top_k; c++) {
                int64_t page = c < count ? picked[c] : 0;
                for (int64_t j = 0; j < P; j++, t++) {
                    ok[t] = c < count && page * P + j < ws;
                    f[t] = (table[page] * kv_heads + h) * P + j;
                }
            }
            for (int64_t i = 0; i < window_slots; i++, t++) {
                int64_t pos = length - window_slots + i;
                ok[t] = pos >= ws && pos >= 0;
                f[t] = flat_row(table, num_pages, kv_heads, h, P, pos > 0 ? pos : 0);
            }
        }
    }
    return 0;
}
