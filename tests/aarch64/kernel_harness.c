/* Every exported CPU kernel (the C files of oval_edge/kernels) on fixed pseudo-random inputs, results printed as text.
 *
 * Why: the kernels are built for an Arm board (-mcpu=cortex-a78ae) that CI does not have. This program is built
 * twice from the same sources: for aarch64 (run under qemu-aarch64) and for the host with the portable C bodies
 * (which the host's own check compares with torch). The inputs come from an integer generator, so both builds see
 * bit-identical inputs, and tests/aarch64/cross_kernels.py compares the two outputs kernel by kernel.
 *
 * Output: one line per result, `name count v0 v1 ...` (floats as %.9g, -inf for unscored pages), then a line
 * `bodies scores=<oval_scores_vectorised()> neon=<oval_scores_neon()> grouped_rounds=<grouped_rounds_inputs()>`. Exit 1 when a kernel refuses
 * shapes it should take (its return code is printed).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int scorer(const float *, const void *, const void *, const void *, const uint16_t *, const int64_t *,
                   const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                   float *, int64_t);
scorer oval_scores_f32, oval_scores_bf16, oval_scores_int8, oval_scores_int4;
typedef int attender(const float *, const void *, const void *, int64_t, const int64_t *, const uint8_t *,
                     const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float, float *, float *,
                     const float *, const float *, int64_t);
attender attend_slots_f32, attend_slots_bf16, attend_slots_int8;
int oval_grouped_scores(const float *, const void *, const void *, const void *, const float *, int64_t,
                        const int64_t *, int64_t, const void *, const void *, const void *, const uint16_t *, int64_t,
                        const int64_t *, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t, float, float *, int64_t);
int rms_norm_f32(const float *, const float *, int64_t, int64_t, float, float *);
int select_slots(const float *, const int64_t *, const int64_t *, const int64_t *, const int64_t *, int64_t, int64_t,
                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t *, uint8_t *);
int int8_head_f32(const float *, int64_t, const int8_t *, const float *, int64_t, int64_t, float *, int64_t);
int int8_rows_f32(const int8_t *, const float *, int64_t, int64_t, const int64_t *, int64_t, float *);
int gemv_4bit_f32(const float *, int64_t, int64_t, const uint8_t *, const float *, const float *, const float *,
                  int64_t, int64_t, int64_t, float *, int64_t, int64_t);
int gemv_grouped_f32(const float *, int64_t, int64_t, const uint8_t *, const uint16_t *, const uint16_t *, int64_t,
                     int64_t, const float *, int64_t, int64_t, float *, int64_t, int64_t);
int dequantize_grouped(const uint8_t *, const uint16_t *, const uint16_t *, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, void *, int64_t, int64_t);
int oval_scores_vectorised(void);
int oval_scores_neon(void);
int grouped_rounds_inputs(void);

/* xorshift64: the same integer sequence on every machine (floats are built from it exactly, below). */
static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 32);
}
/* uniform in [-1, 1) on a 2^-23 grid: exact in fp32, so identical on both builds */
static float uniform(void) { return (float)(next_u32() >> 8) / 8388608.0f - 1.0f; }
static float *floats(int64_t n, float scale) {
    float *v = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) v[i] = uniform() * scale;
    return v;
}
static uint8_t *bytes(int64_t n, uint32_t modulus) { /* values 0..modulus-1 */
    uint8_t *v = malloc((size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] = (uint8_t)(next_u32() % modulus);
    return v;
}
static int8_t *levels(int64_t n) { /* int8 codes in -127..127, as the quantizers store them */
    int8_t *v = malloc((size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] = (int8_t)((int)(next_u32() % 255) - 127);
    return v;
}
static uint16_t *bf16s(int64_t n) { /* the high halves of uniform floats */
    uint16_t *v = malloc((size_t)n * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++) {
        float f = uniform();
        uint32_t u;
        memcpy(&u, &f, 4);
        v[i] = (uint16_t)(u >> 16);
    }
    return v;
}
/* fp16 bits of positive normal values 2^(lo-15) .. 2^(hi-15) (scales), negated when negative (mins) */
static uint16_t *halves(int64_t n, int lo, int hi, int negative) {
    uint16_t *v = malloc((size_t)n * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++)
        v[i] = (uint16_t)((negative ? 0x8000u : 0u) | (uint32_t)(lo + (int)(next_u32() % (uint32_t)(hi - lo))) << 10
                          | (next_u32() & 0x3FFu));
    return v;
}
static int64_t *indices(int64_t n, int64_t bound) {
    int64_t *v = malloc((size_t)n * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) v[i] = (int64_t)(next_u32() % (uint32_t)bound);
    return v;
}

static void print(const char *name, const float *v, int64_t n) {
    printf("%s %lld", name, (long long)n);
    for (int64_t i = 0; i < n; i++) printf(v[i] < -3.0e38f ? " -inf" : " %.9g", (double)v[i]);
    printf("\n");
}
static int failures = 0;
static void refused(const char *name, int code) {
    if (code) {
        printf("refused %s %d\n", name, code);
        failures++;
    }
}

/* Page scores in each record format; (dim, page) shapes the vector bodies take and one odd shape that they leave
 * to the plain body. Record bytes per page: score_kernels.c's layout. */
static void check_scores(int64_t dim, int64_t page, int64_t rank, int64_t group, int64_t threads) {
    const int64_t batch = 2, hkv = 2, pages = 12, np = 5, recs = hkv * pages;
    float *q = floats(batch * hkv * group * dim, 1.0f), *out = malloc((size_t)(batch * hkv * np) * sizeof(float));
    int64_t *table = indices(batch * np, pages), counts[2] = {np, 3};
    scorer *fns[4] = {oval_scores_f32, oval_scores_bf16, oval_scores_int8, oval_scores_int4};
    const char *tags[4] = {"f32", "bf16", "int8", "int4"};
    for (int fmt = 0; fmt < 4; fmt++) {
        void *mean, *basis, *coords;
        if (fmt == 0) {
            mean = floats(recs * dim, 1.0f), basis = floats(recs * rank * dim, 0.3f), coords = floats(recs * rank * page, 3.0f);
        } else if (fmt == 1) {
            mean = bf16s(recs * dim), basis = bf16s(recs * rank * dim), coords = bf16s(recs * rank * page);
        } else if (fmt == 2) {
            mean = levels(recs * dim), basis = levels(recs * rank * dim), coords = levels(recs * rank * page);
        } else { /* int4: an int8 mean; packed 5-bit basis rows and 4/5-bit coordinates (any byte is valid) */
            mean = levels(recs * dim);
            basis = bytes(recs * rank * (dim / 2 + dim / 8), 256);
            coords = bytes(recs * (rank * page / 2 + 3 * rank / 4 * page / 8), 256);
        }
        uint16_t *scales = fmt >= 2 ? halves(recs * (1 + rank), 6, 11, 0) : NULL;
        char name[64];
        for (int counted = 0; counted < 2; counted++) {
            snprintf(name, sizeof name, "scores_%s_d%lld_p%lld_r%lld_g%lld_t%lld%s", tags[fmt], (long long)dim,
                     (long long)page, (long long)rank, (long long)group, (long long)threads, counted ? "_counts" : "");
            refused(name, fns[fmt](q, mean, basis, coords, scales, table, counted ? counts : NULL, batch, hkv, group,
                                   dim, rank, page, np, pages, 0.125f, out, threads));
            print(name, out, batch * hkv * np);
        }
        free(mean), free(basis), free(coords), free(scales);
    }
    free(q), free(out), free(table);
}

/* Decode attention over pool rows in each storage type, with limits, on one thread and on a team. */
static void check_attend(int64_t dim, int64_t group, int64_t slots, int64_t threads) {
    const int64_t batch = 2, hkv = 2, rows = 300;
    float *q = floats(batch * hkv * group * dim, 1.0f), *out = malloc((size_t)(batch * hkv * group * dim) * 4);
    float *scratch = malloc((size_t)(batch * hkv * group * slots) * 4);
    float *ks = floats(rows, 0.02f), *vs = floats(rows, 0.02f);
    int64_t *flat = indices(batch * hkv * slots, rows), limits[2] = {slots, slots * 2 / 3};
    uint8_t *valid = bytes(batch * hkv * slots, 2);
    attender *fns[3] = {attend_slots_f32, attend_slots_bf16, attend_slots_int8};
    const char *tags[3] = {"f32", "bf16", "int8"};
    for (int kv = 0; kv < 3; kv++) {
        void *k = kv == 0 ? (void *)floats(rows * dim, 1.0f) : kv == 1 ? (void *)bf16s(rows * dim) : (void *)levels(rows * dim);
        void *v = kv == 0 ? (void *)floats(rows * dim, 1.0f) : kv == 1 ? (void *)bf16s(rows * dim) : (void *)levels(rows * dim);
        char name[64];
        snprintf(name, sizeof name, "attend_%s_d%lld_g%lld_t%lld", tags[kv], (long long)dim, (long long)group,
                 (long long)threads);
        refused(name, fns[kv](q, k, v, rows, flat, valid, limits, batch, hkv, group, dim, slots, 0.125f, scratch, out,
                              kv == 2 ? ks : NULL, kv == 2 ? vs : NULL, threads));
        print(name, out, batch * hkv * group * dim);
        free(k), free(v);
    }
    free(q), free(out), free(scratch), free(ks), free(vs), free(flat), free(valid);
}

/* Two-level scores: coarse records of 8 groups (one without a record), int4 fine records. */
static void check_grouped_scores(int64_t dim, int64_t rank, int64_t coarse_bf16) {
    const int64_t batch = 2, hkv = 2, group = 3, page = 16, pages = 40, slots = 20, gp = 4, keep = 2, np = 32;
    const int64_t recs = hkv * pages;
    float *q = floats(batch * hkv * group * dim, 1.0f), *out = malloc((size_t)(batch * hkv * np) * 4);
    void *gmean = coarse_bf16 ? (void *)bf16s(slots * hkv * dim) : (void *)floats(slots * hkv * dim, 1.0f);
    int8_t *gbasis = levels(slots * hkv * rank * dim);
    float *gscales = floats(slots * hkv * rank, 0.01f), *box = floats(slots * hkv * 2 * rank, 2.0f);
    for (int64_t i = 0; i < slots * hkv; i++) /* lo <= hi */
        for (int64_t r = 0; r < rank; r++)
            if (box[i * 2 * rank + r] > box[i * 2 * rank + rank + r]) {
                float t = box[i * 2 * rank + r];
                box[i * 2 * rank + r] = box[i * 2 * rank + rank + r], box[i * 2 * rank + rank + r] = t;
            }
    void *gbounds = box;
    uint16_t *box16 = NULL;
    if (coarse_bf16) { /* bf16 bounds: the high halves (truncation keeps lo <= hi) */
        box16 = malloc((size_t)(slots * hkv * 2 * rank) * 2);
        for (int64_t i = 0; i < slots * hkv * 2 * rank; i++) {
            uint32_t u;
            memcpy(&u, &box[i], 4);
            box16[i] = (uint16_t)(u >> 16);
        }
        gbounds = box16;
    }
    int64_t *slot_of = indices(pages, slots), *table = indices(batch * np, pages), sealed[2] = {30, 13};
    slot_of[table[4 * gp - 1]] = -1; /* row 0's 4th group has no record: always kept */
    int8_t *mean = levels(recs * dim);
    uint8_t *basis = bytes(recs * rank * (dim / 2 + dim / 8), 256);
    uint8_t *coords = bytes(recs * (rank * page / 2 + 3 * rank / 4 * page / 8), 256);
    uint16_t *scales = halves(recs * (1 + rank), 6, 11, 0);
    char name[64];
    snprintf(name, sizeof name, "grouped_scores_d%lld_r%lld_bf16%lld", (long long)dim, (long long)rank,
             (long long)coarse_bf16);
    refused(name, oval_grouped_scores(q, gmean, gbasis, gbounds, gscales, coarse_bf16, slot_of, slots, mean, basis,
                                      coords, scales, 3, table, sealed, batch, hkv, group, dim, rank, page, np, pages,
                                      gp, keep, 0.125f, out, 2));
    print(name, out, batch * hkv * np);
    free(q), free(out), free(gmean), free(gbasis), free(gscales), free(box), free(box16), free(slot_of), free(table);
    free(mean), free(basis), free(coords), free(scales);
}

/* The step's small kernels, the 8-bit head, the 4-bit and grouped projections. */
static void check_projections(void) {
    float *x = floats(3 * 96, 2.0f), *w = floats(96, 1.0f), norm[3 * 96];
    refused("rms_norm", rms_norm_f32(x, w, 3, 96, 1e-5f, norm));
    print("rms_norm", norm, 3 * 96);
    free(x), free(w);

    const int64_t lengths[4] = {40, 96, 161, 300}, sealed[4] = {2, 6, 10, 18}, start[4] = {20, 76, 141, 280};
    int64_t *ptable = indices(4 * 20, 80), flat[4 * 2 * 116];
    float *scores = floats(4 * 2 * 20, 1.0f), picked[4 * 2 * 116 * 2];
    uint8_t valid[4 * 2 * 116];
    refused("select_slots", select_slots(scores, ptable, lengths, sealed, start, 1, 4, 2, 20, 16, 1, 5, 20, 20, 116,
                                         flat, valid));
    for (int64_t i = 0; i < 4 * 2 * 116; i++) picked[2 * i] = (float)flat[i], picked[2 * i + 1] = valid[i];
    print("select_slots", picked, 4 * 2 * 116 * 2);
    free(ptable), free(scores);

    const int64_t panels = 3, hidden = 64, ids[4] = {95, 0, 40, 40};
    int8_t *codes8 = levels(panels * hidden * 32);
    float *hscales = floats(panels * hidden, 0.01f), *hx = floats(9 * hidden, 1.0f), head[9 * 96], rows[4 * 64];
    for (int64_t threads = 1; threads <= 2; threads++) {
        refused("int8_head", int8_head_f32(hx, 9, codes8, hscales, panels, hidden, head, threads));
        print(threads == 1 ? "int8_head_t1" : "int8_head_t2", head, 9 * 96);
    }
    refused("int8_rows", int8_rows_f32(codes8, hscales, panels * 32, hidden, ids, 4, rows));
    print("int8_rows", rows, 4 * hidden);
    free(codes8), free(hscales), free(hx);

    const int64_t n_out = 24, k = 128;
    uint8_t *codes4 = bytes(n_out * k / 2, 256);
    float *absmax = floats(n_out * k / 64, 1.0f), *table = floats(16, 1.0f), *gx = floats(5 * k, 1.0f);
    float *bias = floats(n_out, 1.0f), out[5 * 24];
    for (int64_t rows_x = 1; rows_x <= 5; rows_x += 4) {
        refused("gemv_4bit", gemv_4bit_f32(gx, rows_x, k, codes4, absmax, table, bias, n_out, k, 64, out, n_out, 2));
        print(rows_x == 1 ? "gemv_4bit_rows1" : "gemv_4bit_rows5", out, rows_x * n_out);
    }
    free(codes4), free(absmax), free(table);

    float deq[8 * 128];
    for (int64_t bits = 4; bits <= 8; bits += 4) {
        const int64_t group = bits == 4 ? 32 : 16;
        uint8_t *codes = bytes(n_out * k * bits / 8, 256);
        uint16_t *gscales = halves(n_out * k / group, 9, 12, 0), *mins = halves(n_out * k / group, 12, 15, 1);
        for (int64_t rows_x = 1; rows_x <= 5; rows_x += 2) { /* one row, a tile of 3 (odd), 5: a tile of 4 and one */
            char name[48];
            snprintf(name, sizeof name, "gemv_grouped_%lldbit_rows%lld", (long long)bits, (long long)rows_x);
            refused(name, gemv_grouped_f32(gx, rows_x, k, codes, gscales, mins, bits, group, bias, n_out, k, out,
                                           n_out, 2));
            print(name, out, rows_x * n_out);
        }
        refused("dequantize_grouped", dequantize_grouped(codes, gscales, mins, bits, group, n_out, k, 3, 11, deq, 0, 2));
        print(bits == 4 ? "dequantize_grouped_4bit" : "dequantize_grouped_8bit", deq, 8 * k);
        free(codes), free(gscales), free(mins);
    }
    free(gx), free(bias);
}

int main(void) {
    check_scores(64, 32, 4, 3, 1);   /* SmolLM2's head dim, page 32 */
    check_scores(128, 16, 8, 4, 2);  /* Llama's head dim, a team of 2 */
    check_scores(48, 8, 3, 2, 1);    /* a shape only the plain body takes */
    check_attend(64, 3, 224, 1);
    check_attend(128, 4, 96, 2);
    check_attend(40, 2, 50, 1);
    check_grouped_scores(64, 4, 1);
    check_grouped_scores(64, 8, 0);
    check_projections();
    printf("bodies scores=%d neon=%d grouped_rounds=%d\n", oval_scores_vectorised(), oval_scores_neon(),
           grouped_rounds_inputs());
    return failures ? 1 : 0;
}
