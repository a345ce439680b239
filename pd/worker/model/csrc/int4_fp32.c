/* int4-fp32: a linear layer on int4 weights in groups (w = q * scale + low, as a GGUF's Q4_1
 * blocks store them), computed in fp32 with the same sum for a row whatever the batch.
 *
 * Each output y[m, n] is one fp32 accumulator that takes fma(x[m, k], w[k, n]) for k = 0, 1, ...,
 * K - 1 in order, with w = fma(q, scale, low) (exact: q * scale has at most 15 bits, one
 * rounding in all, as the weights' fp32 dequantization). Row and column blocking, threads and
 * the batch size change which outputs are computed together, never an output's sum: one row
 * alone and the same row among 511 others give the same bits.
 *
 * Layout (int4_fp32.py packs it): outputs in blocks of 16; per block, per input k, 8 bytes, byte
 * j holding output j (low nibble) and output j + 8 (high nibble); scales and lows per block, per
 * group, 16 floats each.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define NB 16        /* outputs per block */
#define MR 6         /* rows per micro-kernel */
#define MC 96        /* rows per pass over the weights (x's chunk stays in cache) */

static inline void dequant16(const uint8_t *q, __m256 d0, __m256 d1, __m256 l0, __m256 l1,
                             __m256 *w0, __m256 *w1) {
    __m128i b = _mm_loadl_epi64((const __m128i *)q);
    __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(b, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d0, l0);
    *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d1, l1);
}

/* Rows [0, R) of x against one block's weights dequantized on the fly (small batches). */
#define DIRECT(R)                                                                              \
    static void direct_##R(const float *x, int64_t ldx, int64_t K, int64_t g, const uint8_t *q,   \
                           const float *sc, const float *lw, float *y, int64_t ldy) {           \
        __m256 acc[R][2];                                                                      \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();               \
        for (int64_t k0 = 0; k0 < K; k0 += g) {                                                \
            const float *s = sc + (k0 / g) * NB, *l = lw + (k0 / g) * NB;                       \
            __m256 d0 = _mm256_loadu_ps(s), d1 = _mm256_loadu_ps(s + 8);                       \
            __m256 l0 = _mm256_loadu_ps(l), l1 = _mm256_loadu_ps(l + 8);                       \
            for (int64_t k = k0; k < k0 + g; k++) {                                            \
                __m256 w0, w1;                                                                 \
                dequant16(q + k * 8, d0, d1, l0, l1, &w0, &w1);                                \
                _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                  \
                    __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                          \
                    acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);                            \
                    acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);                            \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                          \
            _mm256_storeu_ps(y + r * ldy, acc[r][0]);                                          \
            _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);                                      \
        }                                                                                      \
    }

/* Rows [0, R) of x against one block's weights already dequantized into a K x 16 panel. */
#define PANEL(R)                                                                               \
    static void panel_##R(const float *x, int64_t ldx, int64_t K, const float *w, float *y,     \
                          int64_t ldy) {                                                       \
        __m256 acc[R][2];                                                                      \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();               \
        for (int64_t k = 0; k < K; k++) {                                                      \
            __m256 w0 = _mm256_load_ps(w + k * NB), w1 = _mm256_load_ps(w + k * NB + 8);       \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                      \
                __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                              \
                acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);                                \
                acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);                                \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                          \
            _mm256_storeu_ps(y + r * ldy, acc[r][0]);                                          \
            _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);                                      \
        }                                                                                      \
    }

/* One row against WIDE blocks at once (their accumulators hide the FMA's latency, which one
 * block's two do not); the same sums as direct_1. */
#define WIDE 4
static void direct_wide(const float *x, int64_t K, int64_t g, const uint8_t *q, int64_t qstride,
                        const float *sc, const float *lw, int64_t sstride, float *y) {
    __m256 acc[WIDE][2];
    _Pragma("GCC unroll 4") for (int b = 0; b < WIDE; b++) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += g) {
        int64_t off = (k0 / g) * NB;
        for (int64_t k = k0; k < k0 + g; k++) {
            __m256 xb = _mm256_broadcast_ss(x + k);
            _Pragma("GCC unroll 4") for (int b = 0; b < WIDE; b++) {
                const float *s = sc + b * sstride + off, *l = lw + b * sstride + off;
                __m256 w0, w1;
                dequant16(q + b * qstride + k * 8, _mm256_loadu_ps(s), _mm256_loadu_ps(s + 8),
                          _mm256_loadu_ps(l), _mm256_loadu_ps(l + 8), &w0, &w1);
                acc[b][0] = _mm256_fmadd_ps(xb, w0, acc[b][0]);
                acc[b][1] = _mm256_fmadd_ps(xb, w1, acc[b][1]);
            }
        }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < WIDE; b++) {
        _mm256_storeu_ps(y + b * NB, acc[b][0]);
        _mm256_storeu_ps(y + b * NB + 8, acc[b][1]);
    }
}

DIRECT(1) DIRECT(2) DIRECT(3) DIRECT(4) DIRECT(5) DIRECT(6)
PANEL(1) PANEL(2) PANEL(3) PANEL(4) PANEL(5) PANEL(6)

typedef void (*direct_fn)(const float *, int64_t, int64_t, int64_t, const uint8_t *,
                          const float *, const float *, float *, int64_t);
typedef void (*panel_fn)(const float *, int64_t, int64_t, const float *, float *, int64_t);
static const direct_fn DIRECT_FN[MR + 1] = {0, direct_1, direct_2, direct_3,
                                             direct_4, direct_5, direct_6};
static const panel_fn PANEL_FN[MR + 1] = {0, panel_1, panel_2, panel_3, panel_4, panel_5, panel_6};

static void dequant_panel(int64_t K, int64_t g, const uint8_t *q, const float *sc,
                          const float *lw, float *w) {
    for (int64_t k0 = 0; k0 < K; k0 += g) {
        const float *s = sc + (k0 / g) * NB, *l = lw + (k0 / g) * NB;
        __m256 d0 = _mm256_loadu_ps(s), d1 = _mm256_loadu_ps(s + 8);
        __m256 l0 = _mm256_loadu_ps(l), l1 = _mm256_loadu_ps(l + 8);
        for (int64_t k = k0; k < k0 + g; k++) {
            __m256 w0, w1;
            dequant16(q + k * 8, d0, d1, l0, l1, &w0, &w1);
            _mm256_store_ps(w + k * NB, w0);
            _mm256_store_ps(w + k * NB + 8, w1);
        }
    }
}

/* y[M, N] = x[M, K] @ w.T, w [N, K] packed as above; N % 16 == 0, K % g == 0. */
int pd_int4_fp32_linear(const float *x, int64_t M, int64_t K, int64_t N, const uint8_t *q,
                        const float *scales, const float *lows, int64_t g, float *y,
                        int threads) {
    int64_t blocks = N / NB, groups = K / g;
    int failed = 0;
    if (M == 1) {
        int64_t wide = blocks / WIDE;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < wide + blocks % WIDE; i++) {
            int64_t b = i < wide ? i * WIDE : wide * WIDE + (i - wide);
            if (i < wide)
                direct_wide(x, K, g, q + b * K * 8, K * 8, scales + b * groups * NB,
                            lows + b * groups * NB, groups * NB, y + b * NB);
            else
                direct_1(x, K, K, g, q + b * K * 8, scales + b * groups * NB,
                         lows + b * groups * NB, y + b * NB, N);
        }
        return 0;
    }
    if (M <= MR) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            DIRECT_FN[M](x, K, K, g, q + b * K * 8, scales + b * groups * NB,
                         lows + b * groups * NB, y + b * NB, N);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        float *w = aligned_alloc(32, (size_t)K * NB * sizeof(float));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            for (int64_t m0 = 0; m0 < M; m0 += MC) {
                int64_t mc = M - m0 < MC ? M - m0 : MC;
#pragma omp for schedule(static)
                for (int64_t b = 0; b < blocks; b++) {
                    dequant_panel(K, g, q + b * K * 8, scales + b * groups * NB,
                                  lows + b * groups * NB, w);
                    for (int64_t r = 0; r < mc; r += MR) {
                        int64_t rows = mc - r < MR ? mc - r : MR;
                        PANEL_FN[rows](x + (m0 + r) * K, K, K, w, y + (m0 + r) * N + b * NB, N);
                    }
                }
            }
        }
        free(w);
    }
    return failed ? -1 : 0;
}
