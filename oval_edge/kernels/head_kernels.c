/* The 8-bit output head on a CPU: logits = x W^T with W stored as int8 codes and one fp32 scale per 32 weights (the
 * block of llama.cpp's Q8_0), called through ctypes by oval_edge/kernels/cpu.py and built into the same library.
 *
 * Why: the head is the largest matrix a small model multiplies per decode step (SmolLM2: 49152 x 576). In bf16 it
 * reads 57 MB a step and torch's bf16 GEMM rounds its output to bf16 (ties between top tokens); in 4 bits (NF4) it
 * reads 14 MB but costs +14% perplexity on SmolLM2 (measured, docs/serving.md). Int8 per 32-block reads 29 MB and
 * matches the 16-bit head within bf16's own rounding. Activations stay fp32 and logits come out fp32.
 *
 * The weights are read once for up to ROW_TILE rows of x (a decode batch), and the output columns are split over
 * `threads` threads: torch's OpenMP team when the library is built with -fopenmp (the same libgomp.so.1 torch and
 * bitsandbytes use), else pthreads. Why OpenMP: after each of the step's parallel torch/bitsandbytes ops the team's
 * worker spins for a few ms waiting for more work, and a fresh pthread then shares that core with the spinning
 * worker: the head measured 2.0 ms alone but 4.0 ms right after an OpenMP op (1 row; 4.5 vs 6.7 ms at 8 rows).
 * On the team, the spinning worker itself takes the second share.
 */
#include <pthread.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BLOCK 32     /* weights per scale along the input dimension */
#define PANEL 32     /* output columns stored together: codes [panels, k, PANEL], scales [panels, k / BLOCK, PANEL] */
#define ROW_TILE 8   /* rows of x multiplied per pass over the weights (register tile of accumulators) */
#define MAX_THREADS 64

typedef struct {
    const float *x;       /* [rows, k] */
    const int8_t *w;      /* [panels, k, PANEL] */
    const float *scales;  /* [panels, k / BLOCK, PANEL] */
    float *out;           /* [rows, panels * PANEL] */
    int64_t rows, k, n_cols, first, last; /* n_cols = panels * PANEL; this worker's panels: first..last-1 */
} HeadWork;

/* Why panels: with PANEL output columns side by side, one vector of codes serves every row of x at once
 * (x[r, j] broadcast), so there is no horizontal sum per output and one conversion feeds ROW_TILE FMAs. */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void head_panel(const float *x, const int tile, int64_t k,
                                                            const int8_t *wp, const float *sp, float *out,
                                                            int64_t n_out) {
    __m512 lo[ROW_TILE], hi[ROW_TILE];  /* columns 0..15 and 16..31 of the panel, per row */
    for (int r = 0; r < ROW_TILE; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / BLOCK; b++) {
        const __m512 s_lo = _mm512_loadu_ps(sp + b * PANEL), s_hi = _mm512_loadu_ps(sp + b * PANEL + 16);
        for (int64_t j = b * BLOCK; j < (b + 1) * BLOCK; j++) {
            const __m128i *codes = (const __m128i *)(wp + j * PANEL);
            __m512 w_lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes))), s_lo);
            __m512 w_hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes + 1))), s_hi);
            for (int r = 0; r < tile; r++) {  /* tile is ROW_TILE in a decode batch: the compiler unrolls it */
                const __m512 xr = _mm512_set1_ps(x[r * k + j]);
                lo[r] = _mm512_fmadd_ps(w_lo, xr, lo[r]);
                hi[r] = _mm512_fmadd_ps(w_hi, xr, hi[r]);
            }
        }
    }
    for (int r = 0; r < tile; r++) {
        _mm512_storeu_ps(out + r * n_out, lo[r]);
        _mm512_storeu_ps(out + r * n_out + 16, hi[r]);
    }
}
#else
/* The portable form of the same loop (Arm boards: -mcpu=native lets the compiler vectorise the PANEL-wide loops). */
static inline __attribute__((always_inline)) void head_panel(const float *x, const int tile, int64_t k,
                                                            const int8_t *wp, const float *sp, float *out,
                                                            int64_t n_out) {
    float acc[ROW_TILE][PANEL] = {{0}};
    for (int64_t j = 0; j < k; j++) {
        float w[PANEL];
        const float *s = sp + (j / BLOCK) * PANEL;
        for (int c = 0; c < PANEL; c++) w[c] = (float)wp[j * PANEL + c] * s[c];
        for (int r = 0; r < tile; r++) {
            const float xr = x[r * k + j];
            for (int c = 0; c < PANEL; c++) acc[r][c] += w[c] * xr;
        }
    }
    for (int r = 0; r < tile; r++)
        for (int c = 0; c < PANEL; c++) out[r * n_out + c] = acc[r][c];
}
#endif

static void *head_worker(void *arg) {
    const HeadWork *job = (const HeadWork *)arg;
    const int64_t blocks = job->k / BLOCK;
    for (int64_t r0 = 0; r0 < job->rows; r0 += ROW_TILE) {
        const int64_t tile = job->rows - r0 < ROW_TILE ? job->rows - r0 : ROW_TILE;
        const float *x = job->x + r0 * job->k;
        /* A full tile gets its own copy of the loop with a constant row count: its accumulators stay in registers. */
        for (int64_t p = job->first; p < job->last; p++) {
            const int8_t *wp = job->w + p * job->k * PANEL;
            const float *sp = job->scales + p * blocks * PANEL;
            float *out = job->out + r0 * job->n_cols + p * PANEL;
            if (tile == ROW_TILE) head_panel(x, ROW_TILE, job->k, wp, sp, out, job->n_cols);
            else head_panel(x, (int)tile, job->k, wp, sp, out, job->n_cols);
        }
    }
    return NULL;
}

/* out [rows, panels * 32] fp32 = x [rows, k] fp32 @ W^T, W the panel-packed int8 codes times their scales (above),
 * all contiguous. Returns 0, or 1 (refused: k not a multiple of 32, threads outside 1..MAX_THREADS) so the caller
 * runs its torch code. */
int int8_head_f32(const float *x, int64_t rows, const int8_t *w, const float *scales, int64_t panels, int64_t k,
                  float *out, int64_t threads) {
    if (k % BLOCK != 0 || threads < 1 || threads > MAX_THREADS || rows < 0 || panels < 0) return 1;
    if (threads > panels) threads = panels > 0 ? panels : 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++) {
        HeadWork job = {x, w, scales, out, rows, k, panels * PANEL, panels * t / threads, panels * (t + 1) / threads};
        head_worker(&job);
    }
#else
    HeadWork jobs[MAX_THREADS];
    pthread_t workers[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t t = 0; t < threads; t++) {
        jobs[t] = (HeadWork){x, w, scales, out, rows, k, panels * PANEL, panels * t / threads,
                             panels * (t + 1) / threads};
        /* The calling thread takes the last share; a thread that cannot start leaves its share to it too. */
        if (t + 1 < threads) started[t] = pthread_create(&workers[t], NULL, head_worker, &jobs[t]) == 0;
    }
    head_worker(&jobs[threads - 1]);
    for (int64_t t = 0; t + 1 < threads; t++) {
        if (started[t]) pthread_join(workers[t], NULL);
        else head_worker(&jobs[t]);
    }
#endif
    return 0;
}

/* The embedding's lookup from the same table: out [n, k] fp32 = rows ids [n] of W, dequantized (a row's codes sit
 * PANEL bytes apart in the panel layout, which torch's advanced indexing gathers ~10x slower).
 * Returns 0, or 2 when an id lies outside 0..vocab-1 (nothing is read for it). */
int int8_rows_f32(const int8_t *w, const float *scales, int64_t vocab, int64_t k, const int64_t *ids, int64_t n,
                  float *out) {
    if (k % BLOCK != 0) return 1;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) return 2;
    for (int64_t i = 0; i < n; i++) {
        const int64_t panel = ids[i] / PANEL, column = ids[i] % PANEL;
        const int8_t *codes = w + panel * k * PANEL + column;
        const float *s = scales + panel * (k / BLOCK) * PANEL + column;
        float *o = out + i * k;
        for (int64_t j = 0; j < k; j++) o[j] = (float)codes[j * PANEL] * s[(j / BLOCK) * PANEL];
    }
    return 0;
}
