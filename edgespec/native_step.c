/* One decoder call of a Llama-style contract model on the CPU, with float16 weights and float32 arithmetic.

   The bundled checkpoints store float16 weights; the fp32 ONNX engine reads each of them as 4 bytes. This
   step reads them as the 2 bytes they are, converts each to float32 on the fly (exact: every float16 is a
   float32) and accumulates in float32, so it computes the same function as the fp32 engine in a different
   summation order, reading half the weight bytes per token (edgespec/native.py loads it; tests compare it
   with the ONNX Runtime engine).

   es_forward: S new tokens of one sequence at positions start..start+S-1
     ids (S)                      token ids
     kc[l], vc[l] (Hkv, cap, D)   layer l's key / value cache of this sequence; rows 0..start-1 are read,
                                  rows start..start+S-1 are written in place; no other row is touched, so
                                  stale rows (NaN included) never reach the output
     logits (S, V), next_ids (S)  outputs; next_ids is the argmax over [argmax_lo, argmax_hi), or -1 where a
                                  row's logits are not all finite (the contract's NONFINITE_ID)
     hidden (S, E) or NULL        the final normed hidden state
   Every matrix product goes through matvec8: blocks of 8 output columns, one float32 partial sum per
   column and lane, reduced the same way whatever S is, so a token's row does not depend on the call's S.
   Weights are (N, K) row-major (PyTorch's Linear layout); K and N are multiples of 8 (native.py checks). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ES_AVX2 1
#endif

typedef struct {
    int64_t E, H, Hkv, D, I, V, L, argmax_lo, argmax_hi;
    float eps, rope_scale;
    const float *inv_freq;     /* (D/2) */
    const uint16_t *embed;     /* (V, E) fp16 */
    const uint16_t *lm_head;   /* (V, E) fp16 */
    const float *norm;         /* (E) */
    const float *const *ln1;   /* L x (E) */
    const float *const *ln2;   /* L x (E) */
    const uint16_t *const *wqkv; /* L x ((H + 2 Hkv) D, E) */
    const uint16_t *const *wo;   /* L x (E, H D) */
    const uint16_t *const *wgu;  /* L x (2 I, E): gate rows, then up rows */
    const uint16_t *const *wd;   /* L x (E, I) */
} es_model;

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float reduce8(const float *l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

/* y[n..n+7] = x (K) . w[n..n+7] (8 rows of K fp16): partial sums per lane of 8, then a fixed
   reduction */
static void dot8(const float *x, const uint16_t *w, int64_t K, float *out) {
#ifdef ES_AVX2
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 xv = _mm256_loadu_ps(x + k);
        for (int j = 0; j < 8; j++)
            a[j] = _mm256_fmadd_ps(xv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + j * K + k))), a[j]);
    }
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
#else
    for (int j = 0; j < 8; j++) {
        float lane[8] = {0};
        for (int64_t k = 0; k < K; k += 8)
            for (int l = 0; l < 8; l++) lane[l] = fmaf(x[k + l], half_to_float(w[j * K + k + l]), lane[l]);
        out[j] = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    }
#endif
}

/* rows x0..x(R-1) (K each) . 4 float32 rows of w (K each) -> out[r][j], R <= 3: the same lanes and the same
   reduction as dot8, so a row's result does not depend on which path computed it */
static inline __attribute__((always_inline)) void dot_rows_r(const float *const *x, const int R, const float *w,
                                                              int64_t K, float out[3][4]) {
#ifdef ES_AVX2
    __m256 a[3][4];
    for (int r = 0; r < 3; r++)
        for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k), w2 = _mm256_loadu_ps(w + 2 * K + k),
               w3 = _mm256_loadu_ps(w + 3 * K + k);
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_loadu_ps(x[r] + k);
            a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
            a[r][2] = _mm256_fmadd_ps(xv, w2, a[r][2]);
            a[r][3] = _mm256_fmadd_ps(xv, w3, a[r][3]);
        }
    }
    float lanes[8];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) { _mm256_storeu_ps(lanes, a[r][j]); out[r][j] = reduce8(lanes); }
#else
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) {
            float lane[8] = {0};
            for (int64_t k = 0; k < K; k += 8)
                for (int l = 0; l < 8; l++) lane[l] = fmaf(x[r][k + l], w[j * K + k + l], lane[l]);
            out[r][j] = reduce8(lane);
        }
#endif
}

/* dot_rows_r with R a constant in each branch, so the accumulators stay in registers */
static void dot_rows(const float *const *x, int R, const float *w, int64_t K, float out[3][4]) {
    if (R == 3) dot_rows_r(x, 3, w, K, out);
    else if (R == 2) dot_rows_r(x, 2, w, K, out);
    else dot_rows_r(x, 1, w, K, out);
}

/* y (S, N) [+]= x (S, K) @ w (N, K)^T, columns split across the threads of the enclosing parallel region.
   residual: y += instead of y = (the reference adds the product to the residual stream).
   S = 1 reads the float16 rows directly; S > 1 widens each block of 8 rows once into `tile` (8 K floats,
   this thread's) and reuses it for every row of x. */
static void matvec8(const float *x, int64_t S, const uint16_t *w, int64_t K, int64_t N, float *y, int residual,
                    float *tile) {
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n += 8) {
        if (S == 1) {
            float out[8];
            dot8(x, w + n * K, K, out);
            for (int j = 0; j < 8; j++) y[n + j] = residual ? y[n + j] + out[j] : out[j];
            continue;
        }
        const uint16_t *wb = w + n * K;
#ifdef ES_AVX2
        for (int64_t i = 0; i < 8 * K; i += 8)
            _mm256_storeu_ps(tile + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + i))));
#else
        for (int64_t i = 0; i < 8 * K; i++) tile[i] = half_to_float(wb[i]);
#endif
        for (int64_t s = 0; s < S; s += 3) {
            int R = S - s < 3 ? (int)(S - s) : 3;
            const float *rows[3] = {x + s * K, x + (s + (R > 1)) * K, x + (s + 2 * (R > 2)) * K};
            for (int half = 0; half < 2; half++) {
                float out[3][4];
                dot_rows(rows, R, tile + half * 4 * K, K, out);
                for (int r = 0; r < R; r++)
                    for (int j = 0; j < 4; j++) {
                        float *dst = y + (s + r) * N + n + half * 4 + j;
                        *dst = residual ? *dst + out[r][j] : out[r][j];
                    }
            }
        }
    }
}

/* q . k over D (a multiple of 8): lanes of 8, reduce8 */
static float dotD(const float *q, const float *k, int64_t D) {
#ifdef ES_AVX2
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
    float lanes[8];
    _mm256_storeu_ps(lanes, a);
    return reduce8(lanes);
#else
    float lane[8] = {0};
    for (int64_t d = 0; d < D; d += 8)
        for (int l = 0; l < 8; l++) lane[l] = fmaf(q[d + l], k[d + l], lane[l]);
    return reduce8(lane);
#endif
}

/* h (S, E) = w * x * rsqrt(mean(x^2) + eps), the reference's order: normalise, then scale */
static void rmsnorm(const float *x, const float *w, int64_t S, int64_t E, float eps, float *h) {
#pragma omp for schedule(static)
    for (int64_t s = 0; s < S; s++) {
        const float *xs = x + s * E;
        float ss = 0.f;
        for (int64_t e = 0; e < E; e++) ss += xs[e] * xs[e];
        float r = 1.0f / sqrtf(ss / (float)E + eps);
        for (int64_t e = 0; e < E; e++) h[s * E + e] = w[e] * (xs[e] * r);
    }
}

/* x (D) rotated: x*cos + rotate_half(x)*sin, with cs = cos, sn = sin (D/2 each) of its position */
static void rope(float *x, int64_t D, const float *cs, const float *sns) {
    int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        float c = cs[i], sn = sns[i];
        float a = x[i], b = x[i + half];
        x[i] = a * c - b * sn;
        x[i + half] = b * c + a * sn;
    }
}

int es_scratch_floats(const es_model *m, int64_t S, int64_t cap, int threads) {
    int64_t qkv = (m->H + 2 * m->Hkv) * m->D;
    int64_t kmax = m->E > m->I ? m->E : m->I;
    kmax = kmax > m->H * m->D ? kmax : m->H * m->D;
    return (int)(S * (2 * m->E + qkv + m->H * m->D + 2 * m->I + m->I + m->D) + (int64_t)threads * (cap + 8 * kmax));
}

/* returns 0, or -1 when a position does not fit the cache */
int es_forward(const es_model *m, int64_t S, const int64_t *ids, int64_t start, float *const *kc, float *const *vc,
               int64_t cap, float *logits, int64_t *next_ids, float *hidden, float *scratch, int threads) {
    if (start < 0 || start + S > cap) return -1;
    const int64_t E = m->E, H = m->H, Hkv = m->Hkv, D = m->D, I = m->I, V = m->V, g = H / Hkv;
    const int64_t NQKV = (H + 2 * Hkv) * D;
    float *x = scratch, *h = x + S * E, *qkv = h + S * E, *att = qkv + S * NQKV, *gu = att + S * H * D,
          *act = gu + S * 2 * I, *rc = act + S * I, *scores = rc + S * D; /* per thread: cap scores, a tile */
    int64_t kmax = E > I ? E : I;
    kmax = kmax > H * D ? kmax : H * D;
    const float qscale = 1.0f / sqrtf((float)D);
    for (int64_t s = 0; s < S; s++)
        for (int64_t e = 0; e < E; e++) x[s * E + e] = half_to_float(m->embed[ids[s] * E + e]);
    /* rc (S, D): cos then sin (D/2 each) of each row's position times inv_freq, scaled: once per call */
    for (int64_t s = 0; s < S; s++)
        for (int64_t i = 0; i < D / 2; i++) {
            float f = (float)(start + s) * m->inv_freq[i];
            rc[s * D + i] = cosf(f) * m->rope_scale;
            rc[s * D + D / 2 + i] = sinf(f) * m->rope_scale;
        }

#pragma omp parallel num_threads(threads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *sc = scores + (int64_t)tid * (cap + 8 * kmax), *tile = sc + cap;
        for (int64_t l = 0; l < m->L; l++) {
            rmsnorm(x, m->ln1[l], S, E, m->eps, h);
            matvec8(h, S, m->wqkv[l], E, NQKV, qkv, 0, tile);
            /* keys and values of the S new rows into the cache, keys rotated */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < Hkv * S; t++) {
                int64_t kh = t / S, s = t % S, row = start + s;
                float *kd = kc[l] + (kh * cap + row) * D, *vd = vc[l] + (kh * cap + row) * D;
                memcpy(kd, qkv + s * NQKV + H * D + kh * D, D * sizeof(float));
                memcpy(vd, qkv + s * NQKV + (H + Hkv) * D + kh * D, D * sizeof(float));
                rope(kd, D, rc + s * D, rc + s * D + D / 2);
            }
            /* attention of each (head, query) over its rows 0..start+s */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < H * S; t++) {
                int64_t hh = t / S, s = t % S, kh = hh / g, n = start + s + 1;
                float q[512];
                memcpy(q, qkv + s * NQKV + hh * D, D * sizeof(float));
                rope(q, D, rc + s * D, rc + s * D + D / 2);
                for (int64_t d = 0; d < D; d++) q[d] *= qscale;
                const float *K = kc[l] + kh * cap * D, *Vv = vc[l] + kh * cap * D;
                float mx = -INFINITY;
                for (int64_t r = 0; r < n; r++) {
                    float a = dotD(q, K + r * D, D);
                    sc[r] = a;
                    mx = a > mx ? a : mx;
                }
                float sum = 0.f;
                for (int64_t r = 0; r < n; r++) { sc[r] = expf(sc[r] - mx); sum += sc[r]; }
                float *o = att + s * H * D + hh * D;
                for (int64_t d = 0; d < D; d++) o[d] = 0.f;
                for (int64_t r = 0; r < n; r++) {
                    float p = sc[r] / sum;
                    for (int64_t d = 0; d < D; d++) o[d] += p * Vv[r * D + d];
                }
            }
            matvec8(att, S, m->wo[l], H * D, E, x, 1, tile);
            rmsnorm(x, m->ln2[l], S, E, m->eps, h);
            matvec8(h, S, m->wgu[l], E, 2 * I, gu, 0, tile);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < S * I; t++) {
                int64_t s = t / I, i = t % I;
                float a = gu[s * 2 * I + i], u = gu[s * 2 * I + I + i];
                act[t] = a / (1.0f + expf(-a)) * u;
            }
            matvec8(act, S, m->wd[l], I, E, x, 1, tile);
        }
        rmsnorm(x, m->norm, S, E, m->eps, h);
        matvec8(h, S, m->lm_head, E, V, logits, 0, tile);
#pragma omp for schedule(static)
        for (int64_t s = 0; s < S; s++) {
            const float *row = logits + s * V;
            float total = 0.f;
            for (int64_t v = 0; v < V; v++) total += row[v];
            int64_t best = m->argmax_lo;
            for (int64_t v = m->argmax_lo + 1; v < m->argmax_hi; v++)
                if (row[v] > row[best]) best = v;
            next_ids[s] = isfinite(total) ? best : -1;
        }
    }
    if (hidden) memcpy(hidden, h, S * E * sizeof(float));
    return 0;
}
