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
 * Layout (int4_fp32.py packs it): outputs in blocks of 16; per block, per input k, 8 bytes, byte
 * j holding output j (low nibble) and output j + 8 (high nibble); scales and lows per block, per
 * group, 16 floats each.
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
static inline void v_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 v_bcast(const float *p) { return _mm512_set1_ps(*p); }
static inline v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v_codes(const uint8_t *q) { /* the 16 outputs' codes, in order */
    __m128i b = _mm_loadl_epi64((const __m128i *)q), mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)));
}
#else
typedef struct {
    __m256 a, b; /* outputs 0-7 and 8-15 */
} v16;
static inline v16 v_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 v_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
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
static inline v16 v_codes(const uint8_t *q) {
    __m128i b = _mm_loadl_epi64((const __m128i *)q), mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    return (v16){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                 _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))};
}
#endif

/* The 16 weights of input k: fma(q, scale, low), their exact fp32 values. */
static inline v16 weights(const uint8_t *q, v16 d, v16 l) { return v_fma(v_codes(q), d, l); }

/* Rows [0, R) of x against one block's weights dequantized on the fly (small batches). */
#define DIRECT(R)                                                                              \
    static void direct_##R(const float *x, int64_t ldx, int64_t K, int64_t g, const uint8_t *q, \
                           const float *sc, const float *lw, float *y, int64_t ldy) {         \
        v16 acc[R];                                                                            \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) acc[r] = v_zero();                 \
        for (int64_t k0 = 0; k0 < K; k0 += g) {                                                \
            v16 d = v_load(sc + (k0 / g) * NB), l = v_load(lw + (k0 / g) * NB);                \
            for (int64_t k = k0; k < k0 + g; k++) {                                            \
                v16 w = weights(q + k * 8, d, l);                                              \
                _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                            \
                    acc[r] = v_fma(v_bcast(x + r * ldx + k), w, acc[r]);                       \
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
                        const float *sc, const float *lw, int64_t sstride, float *y) {
    v16 acc[WIDE], d[WIDE], l[WIDE];
    _Pragma("GCC unroll 4") for (int b = 0; b < WIDE; b++) acc[b] = v_zero();
    for (int64_t k0 = 0; k0 < K; k0 += g) {
        int64_t off = (k0 / g) * NB;
        _Pragma("GCC unroll 4") for (int b = 0; b < WIDE; b++) {
            d[b] = v_load(sc + b * sstride + off);
            l[b] = v_load(lw + b * sstride + off);
        }
        for (int64_t k = k0; k < k0 + g; k++) {
            v16 xb = v_bcast(x + k);
            _Pragma("GCC unroll 4") for (int b = 0; b < WIDE; b++)
                acc[b] = v_fma(xb, weights(q + b * qstride + k * 8, d[b], l[b]), acc[b]);
        }
    }
    _Pragma("GCC unroll 4") for (int b = 0; b < WIDE; b++) v_store(y + b * NB, acc[b]);
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
        v16 d = v_load(sc + (k0 / g) * NB), l = v_load(lw + (k0 / g) * NB);
        for (int64_t k = k0; k < k0 + g; k++) v_store(w + k * NB, weights(q + k * 8, d, l));
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
