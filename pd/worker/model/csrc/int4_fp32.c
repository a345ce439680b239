/* int4-fp32: a linear layer on int4 weights in groups (w = q * scale + low, as a GGUF's Q4_1
 * blocks store them), computed in fp32 with the same sum for a row whatever the batch.
 *
 * Each output y[m, n] is one fp32 accumulator that takes fma(x[m, k], w[k, n]) for k = 0, 1, ...,
 * K - 1 in order, with w = fma(q, scale, low) (exact: q * scale has at most 15 bits, one
 * rounding in all, as the weights' fp32 dequantization). Row and column blocking, threads and
 * the batch size change which outputs are computed together, never an output's sum: one row
 * alone and the same row among 511 others give the same bits.
 *
 * One source, two builds: with AVX-512 a block of 16 outputs is one register, with AVX2 two
 * (`v16` below); each lane's operations are the same, so the two give the same bits.
 *
 * Layout (int4_fp32.py packs it): outputs in blocks of 16; per block, per pair of inputs (k, k + 1),
 * 16 bytes, byte j holding output j's code for k (low nibble) and for k + 1 (high nibble): one
 * widening load gives 16 lanes whose low and high nibbles are two inputs' codes. Scales and lows
 * per block, per group, 16 values each: fp16 where they are exactly fp16 (a GGUF's Q4_1 blocks
 * store them so; `half` is 1), else fp32.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define NB 16 /* outputs per block */
#define MR 6  /* rows per micro-kernel */
#define MC 96 /* rows per pass over the weights (x's chunk stays in cache) */

#ifdef __AVX512F__
typedef __m512 v16;
static inline v16 v_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline v16 v_load_half(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline void v_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 v_bcast(const float *p) { return _mm512_set1_ps(*p); }
static inline v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
/* The 16 outputs' codes for inputs k and k + 1, from the pair's 16 bytes. */
static inline void v_codes(const uint8_t *q, v16 *k0, v16 *k1) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    *k0 = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
    *k1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#else
typedef struct {
    __m256 a, b; /* outputs 0-7 and 8-15 */
} v16;
static inline v16 v_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 v_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline v16 v_load_half(const uint16_t *p) {
    return (v16){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}
static inline void v_store(float *p, v16 v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
}
static inline v16 v_bcast(const float *p) {
    __m256 x = _mm256_broadcast_ss(p);
    return (v16){x, x};
}
static inline v16 v_fma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)};
}
static inline void v_codes(const uint8_t *q, v16 *k0, v16 *k1) {
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
    __m256i mask = _mm256_set1_epi32(0x0F);
    *k0 = (v16){_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)),
                _mm256_cvtepi32_ps(_mm256_and_si256(b, mask))};
    *k1 = (v16){_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)),
                _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
}
#endif

/* A group's 16 scales (or lows): `at` counts values; fp16 or fp32 as `half` says. */
static inline v16 v_params(const void *p, int64_t at, int half) {
    return half ? v_load_half((const uint16_t *)p + at) : v_load((const float *)p + at);
}

/* The 16 weights of inputs k and k + 1 (their exact fp32 values, fma(q, scale, low)); `q`
 * points at the pair's 16 bytes, k * 8 bytes into the block. */
static inline void weights(const uint8_t *q, v16 d, v16 l, v16 *w0, v16 *w1) {
    v16 c0, c1;
    v_codes(q, &c0, &c1);
    *w0 = v_fma(c0, d, l);
    *w1 = v_fma(c1, d, l);
}

/* Rows [0, R) of x against one block's weights dequantized on the fly (small batches). */
#define DIRECT(R)                                                                              \
    static void direct_##R(const float *x, int64_t ldx, int64_t K, int64_t g, const uint8_t *q, \
                           const void *sc, const void *lw, int half, float *y, int64_t ldy) { \
        v16 acc[R];                                                                            \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) acc[r] = v_zero();                 \
        for (int64_t k0 = 0; k0 < K; k0 += g) {                                                \
            v16 d = v_params(sc, (k0 / g) * NB, half), l = v_params(lw, (k0 / g) * NB, half);  \
            for (int64_t k = k0; k < k0 + g; k += 2) {                                         \
                v16 w0, w1;                                                                    \
                weights(q + k * 8, d, l, &w0, &w1);                                            \
                _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                          \
                    acc[r] = v_fma(v_bcast(x + r * ldx + k), w0, acc[r]);                      \
                    acc[r] = v_fma(v_bcast(x + r * ldx + k + 1), w1, acc[r]);                  \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) v_store(y + r * ldy, acc[r]);      \
    }

/* Rows [0, R) of x against one block's weights already dequantized into a K x 16 panel. */
#define PANEL(R)                                                                               \
    static void panel_##R(const float *x, int64_t ldx, int64_t K, const float *w, float *y,   \
                          int64_t ldy) {                                                       \
        v16 acc[R];                                                                            \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) acc[r] = v_zero();                 \
        for (int64_t k = 0; k < K; k++) {                                                      \
            v16 wk = v_load(w + k * NB);                                                       \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                                \
                acc[r] = v_fma(v_bcast(x + r * ldx + k), wk, acc[r]);                          \
        }                                                                                      \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) v_store(y + r * ldy, acc[r]);      \
    }

/* One row against WIDE blocks at once (their accumulators hide the FMA's latency, which one
 * block's do not; each block's scales and lows held for its group); the same sums as
 * direct_1. AVX-512 has the registers for four blocks, AVX2 for two. */
#ifdef __AVX512F__
#define WIDE 4
#else
#define WIDE 2
#endif
static void direct_wide(const float *x, int64_t K, int64_t g, const uint8_t *q, int64_t qstride,
                        const void *sc, const void *lw, int half, int64_t sstride, float *y) {
    v16 acc[WIDE], d[WIDE], l[WIDE];
    _Pragma("GCC unroll 4") for (int b = 0; b < WIDE; b++) acc[b] = v_zero();
    for (int64_t k0 = 0; k0 < K; k0 += g) {
        int64_t off = (k0 / g) * NB;
        _Pragma("GCC unroll 4") for (int b = 0; b < WIDE; b++) {
            d[b] = v_params(sc, b * sstride + off, half);
            l[b] = v_params(lw, b * sstride + off, half);
        }
        for (int64_t k = k0; k < k0 + g; k += 2) {
            v16 x0 = v_bcast(x + k), x1 = v_bcast(x + k + 1);
            _Pragma("GCC unroll 4") for (int b = 0; b < WIDE; b++) {
                v16 w0, w1;
                weights(q + b * qstride + k * 8, d[b], l[b], &w0, &w1);
                acc[b] = v_fma(x0, w0, acc[b]);
                acc[b] = v_fma(x1, w1, acc[b]);
            }
        }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < WIDE; b++) v_store(y + b * NB, acc[b]);
}

DIRECT(1) DIRECT(2) DIRECT(3) DIRECT(4) DIRECT(5) DIRECT(6)
PANEL(1) PANEL(2) PANEL(3) PANEL(4) PANEL(5) PANEL(6)

typedef void (*direct_fn)(const float *, int64_t, int64_t, int64_t, const uint8_t *,
                          const void *, const void *, int, float *, int64_t);
typedef void (*panel_fn)(const float *, int64_t, int64_t, const float *, float *, int64_t);
static const direct_fn DIRECT_FN[MR + 1] = {0, direct_1, direct_2, direct_3,
                                             direct_4, direct_5, direct_6};
static const panel_fn PANEL_FN[MR + 1] = {0, panel_1, panel_2, panel_3, panel_4, panel_5, panel_6};

static void dequant_panel(int64_t K, int64_t g, const uint8_t *q, const void *sc, const void *lw,
                          int half, float *w) {
    for (int64_t k0 = 0; k0 < K; k0 += g) {
        v16 d = v_params(sc, (k0 / g) * NB, half), l = v_params(lw, (k0 / g) * NB, half);
        for (int64_t k = k0; k < k0 + g; k += 2) {
            v16 w0, w1;
            weights(q + k * 8, d, l, &w0, &w1);
            v_store(w + k * NB, w0);
            v_store(w + (k + 1) * NB, w1);
        }
    }
}

/* y[M, N] = x[M, K] @ w.T, w [N, K] packed as above; N % 16 == 0, K % g == 0, g even;
 * `half`: scales and lows in fp16 (else fp32). */
int pd_int4_fp32_linear(const float *x, int64_t M, int64_t K, int64_t N, const uint8_t *q,
                        const void *scales, const void *lows, int half, int64_t g, float *y,
                        int threads) {
    int64_t blocks = N / NB, groups = K / g, bytes = half ? 2 : 4;
    const char *sc = scales, *lw = lows; /* a block's params start groups * NB values in */
    int failed = 0;
#define PARAMS(b) sc + (b) * groups * NB * bytes, lw + (b) * groups * NB * bytes
    if (M < 1)
        return 0;
    if (M == 1) {
        int64_t wide = blocks / WIDE;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < wide + blocks % WIDE; i++) {
            int64_t b = i < wide ? i * WIDE : wide * WIDE + (i - wide);
            if (i < wide)
                direct_wide(x, K, g, q + b * K * 8, K * 8, PARAMS(b), half, groups * NB,
                            y + b * NB);
            else
                direct_1(x, K, K, g, q + b * K * 8, PARAMS(b), half, y + b * NB, N);
        }
        return 0;
    }
    if (M <= MR) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            DIRECT_FN[M](x, K, K, g, q + b * K * 8, PARAMS(b), half, y + b * NB, N);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        float *w = aligned_alloc(64, (size_t)K * NB * sizeof(float));
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
                    dequant_panel(K, g, q + b * K * 8, PARAMS(b), half, w);
                    for (int64_t r = 0; r < mc; r += MR) {
                        int64_t rows = mc - r < MR ? mc - r : MR;
                        PANEL_FN[rows](x + (m0 + r) * K, K, K, w, y + (m0 + r) * N + b * NB, N);
                    }
                }
            }
        }
        free(w);
    }
#undef PARAMS
    return failed ? -1 : 0;
}
