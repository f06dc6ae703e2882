/* One decoder call of a contract model (every family export/checkpoint.py reads) on the CPU, with float16
   weights and float32 arithmetic.

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
   Every matrix product goes through matmul (below): weights packed in panels of 16 output columns, each
   output one fused multiply-add chain over the inputs in order, whatever S is, so a token's row does not
   depend on the call's S. N is a multiple of 16 and head_dim of 8 (native.py checks).

   Per layer l (export/checkpoint.py's ModelSpec writes the same computation out), with the family options
   as fields of es_model: a NULL table is an absent option, so Llama runs the same code with nothing added
   in its loops (every option is tested once per layer or per (head, row), never per element):

     h = rmsnorm(x, ln1);  q, k, v = h Wqkv + bqkv                     (bqkv: q/k/v biases, else NULL)
     q, k = rmsnorm(q, qn), rmsnorm(k, kn) over each head's D dims      (qn, kn: q/k norms, else NULL)
     q, k rotated over their first R dims with rotary layer_rope[l]     (-1: that layer has no rotary)
     a = softmax(q k^T attn_scale over rows max(0, p - window + 1)..p) v Wo + bo   (window 0: rows 0..p)
     x += a, or x += rmsnorm(a, post_attn)                              (post_attn, post_mlp: sandwich norms)
     h = rmsnorm(x, ln2);  m = act(h Wg) * (h Wu) Wd                    (act: SiLU, or tanh GELU)
     x += m, or x += rmsnorm(m, post_mlp)
   with the embedding rows times embed_scale, and logits = rmsnorm(x, norm) lm_head. */
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
#if defined(ES_AVX2) && defined(__AVX512F__)
#define ES_AVX512 1 /* a panel is one 16-lane register */
#endif
#define MAX_ROWS 12 /* rows of x per pass over a panel */

enum { ES_SILU = 0, ES_GELU_TANH = 1 };

typedef struct {
    int64_t E, H, Hkv, D, I, V, L, argmax_lo, argmax_hi;
    int64_t R;                 /* rotary dims of each head (even, <= D): the first R rotate, the rest pass */
    int64_t n_ropes;           /* distinct rotaries (0: no layer has one) */
    int64_t act;               /* ES_SILU (SwiGLU) or ES_GELU_TANH (GeGLU) */
    float eps, embed_scale, attn_scale; /* embed_scale multiplies the embedding rows (1: none) */
    const float *inv_freq;     /* (n_ropes, R/2) */
    const float *rope_scale;   /* (n_ropes): attention scaling folded into cos and sin */
    const int64_t *layer_rope; /* (L): layer l's rotary, -1 = none; NULL = rotary 0 everywhere */
    const int64_t *layer_window; /* (L): layer l's window, 0 = every row; NULL = no windows */
    const uint16_t *embed;     /* (V, E) fp16 */
    const uint16_t *lm_head;   /* (V, E) fp16 */
    const float *norm;         /* (E) */
    const float *const *ln1;   /* L x (E) */
    const float *const *ln2;   /* L x (E): the MLP's input norm */
    const uint16_t *const *wqkv; /* L x ((H + 2 Hkv) D, E) */
    const uint16_t *const *wo;   /* L x (E, H D) */
    const uint16_t *const *wgu;  /* L x (2 I, E): gate rows, then up rows */
    const uint16_t *const *wd;   /* L x (E, I) */
    /* options: NULL = absent */
    const float *const *bqkv;      /* L x ((H + 2 Hkv) D): q, k, v biases */
    const float *const *bo;        /* L x (E): output projection bias */
    const float *const *qn;        /* L x (D): q norm over each head */
    const float *const *kn;        /* L x (D): k norm over each head */
    const float *const *post_attn; /* L x (E): norm of the attention output before its residual add */
    const float *const *post_mlp;  /* L x (E): norm of the MLP output before its residual add */
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

/* The weight matrices are packed in panels of PANEL output columns: panel p is (K, PANEL), row k holding
   the weights of input k for columns p*PANEL..p*PANEL+PANEL-1 (export/native.py packs them). Every output is
   one float32 fused multiply-add chain over k = 0..K-1 in order, in every path below, so a row's result does
   not depend on the call's S or on which kernel computed it. */
#define PANEL 16

/* one row: y[0 .. 16 np) = x (K) @ np panels (np <= 4, consecutive in memory) */
static void row_panels(const float *x, const uint16_t *p, int np, int64_t K, float *y) {
#ifdef ES_AVX2
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    const int64_t stride = K * PANEL;
    if (np == 4) { /* the common case: 8 chains in flight */
        for (int64_t k = 0; k < K; k++) {
            __m256 xv = _mm256_broadcast_ss(x + k);
            for (int j = 0; j < 8; j++) {
                const uint16_t *w = p + (j >> 1) * stride + k * PANEL + (j & 1) * 8;
                a[j] = _mm256_fmadd_ps(xv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w)), a[j]);
            }
        }
    } else {
        for (int64_t k = 0; k < K; k++) {
            __m256 xv = _mm256_broadcast_ss(x + k);
            for (int j = 0; j < 2 * np; j++) {
                const uint16_t *w = p + (j >> 1) * stride + k * PANEL + (j & 1) * 8;
                a[j] = _mm256_fmadd_ps(xv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w)), a[j]);
            }
        }
    }
    for (int j = 0; j < 2 * np; j++) _mm256_storeu_ps(y + 8 * j, a[j]);
#else
    for (int q = 0; q < np; q++)
        for (int c = 0; c < PANEL; c++) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(x[k], half_to_float(p[q * K * PANEL + k * PANEL + c]), acc);
            y[q * PANEL + c] = acc;
        }
#endif
}

#if defined(ES_AVX512)
/* R rows x NP consecutive panels (R, NP constants at each call site; R * NP <= 24 of the 32 registers):
   out[r * NP * PANEL + q * PANEL + c] = x[r] (K) @ column c of panel q */
static inline __attribute__((always_inline)) void rows_panels_r(const float *const *x, const int R, const uint16_t *p,
                                                                const int NP, int64_t K, float *out) {
    __m512 a[24];
    for (int i = 0; i < R * NP; i++) a[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 w[8];
        for (int q = 0; q < NP; q++) w[q] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + q * K * PANEL + k * PANEL)));
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_set1_ps(x[r][k]);
            for (int q = 0; q < NP; q++) a[r * NP + q] = _mm512_fmadd_ps(xv, w[q], a[r * NP + q]);
        }
    }
    for (int i = 0; i < R * NP; i++) _mm512_storeu_ps(out + i * PANEL, a[i]);
}

/* how many panels a pass over R rows takes: enough chains in flight for few rows, registers for many */
static int panels_for(int R) { return R <= 2 ? 8 : R <= 5 ? 4 : 2; }

#define RP_CASE(n) case n: { if (np == panels_for(n)) rows_panels_r(x, n, p, panels_for(n), K, out); \
                             else rows_panels_r(x, n, p, 1, K, out); } break;
/* np is panels_for(R), or 1 (the last panels of a matrix) */
static void rows_panels(const float *const *x, int R, const uint16_t *p, int np, int64_t K, float *out) {
    switch (R) {
    RP_CASE(12) RP_CASE(11) RP_CASE(10) RP_CASE(9) RP_CASE(8) RP_CASE(7)
    RP_CASE(6) RP_CASE(5) RP_CASE(4) RP_CASE(3) RP_CASE(2) RP_CASE(1)
    }
}
#else
/* R rows (R <= MAX_ROWS, a constant at each call site): out[r * PANEL + c] = x[r] (K) @ column c of one panel */
static inline __attribute__((always_inline)) void rows_panel_r(const float *const *x, const int R, const uint16_t *p,
                                                               int64_t K, float *out) {
#if defined(ES_AVX2)
    for (int r0 = 0; r0 < R; r0 += 6) { /* 16 ymm registers: 6 rows x 2 halves at a time */
        const int n = R - r0 < 6 ? R - r0 : 6;
        __m256 a[6][2];
        for (int r = 0; r < 6; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k++) {
            __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + k * PANEL)));
            __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + k * PANEL + 8)));
            for (int r = 0; r < n; r++) {
                __m256 xv = _mm256_broadcast_ss(x[r0 + r] + k);
                a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
            }
        }
        for (int r = 0; r < n; r++) {
            _mm256_storeu_ps(out + (r0 + r) * PANEL, a[r][0]);
            _mm256_storeu_ps(out + (r0 + r) * PANEL + 8, a[r][1]);
        }
    }
#else
    for (int r = 0; r < R; r++)
        for (int c = 0; c < PANEL; c++) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(x[r][k], half_to_float(p[k * PANEL + c]), acc);
            out[r * PANEL + c] = acc;
        }
#endif
}

static int panels_for(int R) { (void)R; return 1; }

#define RP_CASE(n) case n: rows_panel_r(x, n, p, K, out); break;
static void rows_panels(const float *const *x, int R, const uint16_t *p, int np, int64_t K, float *out) {
    (void)np;
    switch (R) { /* R a constant in each branch, so the accumulators stay in registers */
    RP_CASE(12) RP_CASE(11) RP_CASE(10) RP_CASE(9) RP_CASE(8) RP_CASE(7)
    RP_CASE(6) RP_CASE(5) RP_CASE(4) RP_CASE(3) RP_CASE(2) RP_CASE(1)
    }
}
#endif

/* dst[0..n) [+]= v (+ b): the bias (NULL: none) is added to the product, then the product to the residual */
static void put(float *dst, const float *v, int n, int residual, const float *b) {
    if (!b)
        for (int j = 0; j < n; j++) dst[j] = residual ? dst[j] + v[j] : v[j];
    else
        for (int j = 0; j < n; j++) dst[j] = residual ? dst[j] + (v[j] + b[j]) : v[j] + b[j];
}

/* y (S, N) [+]= x (S, K) @ W (N columns in panels) (+ b (N), NULL: none), the panels split across the threads
   of the enclosing parallel region. residual: y += (the reference adds the product to the residual stream),
   the bias added to the product first. S = 1 runs 4
   panels at a time (8 chains in flight while the weights stream in); S > 1 runs each panel over groups of up
   to MAX_ROWS rows, so a panel is read once per group. */
static void matmul(const float *x, int64_t S, const uint16_t *w, int64_t K, int64_t N, float *y, int residual,
                   const float *b) {
    const int64_t panels = N / PANEL;
    if (S == 1) {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p += 4) {
            int np = panels - p < 4 ? (int)(panels - p) : 4;
            float out[4 * PANEL];
            row_panels(x, w + p * K * PANEL, np, K, out);
            put(y + p * PANEL, out, np * PANEL, residual, b ? b + p * PANEL : NULL);
        }
        return;
    }
    const int NP = panels_for(S < MAX_ROWS ? (int)S : MAX_ROWS); /* panels per task */
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p += NP) {
        for (int64_t s = 0; s < S; s += MAX_ROWS) { /* the task's panels stay in cache across row groups */
            const int R = S - s < MAX_ROWS ? (int)(S - s) : MAX_ROWS;
            const float *rows[MAX_ROWS];
            for (int r = 0; r < MAX_ROWS; r++) rows[r] = x + (s + (r < R ? r : 0)) * K;
            /* the whole task at once where R's kernel takes NP panels, else a panel at a time */
            const int np = (panels - p >= NP && panels_for(R) == NP) ? NP : 1;
            for (int64_t q = p; q < p + NP && q < panels; q += np) {
                float out[MAX_ROWS * 8 * PANEL];
                rows_panels(rows, R, w + q * K * PANEL, np, K, out);
                for (int r = 0; r < R; r++)
                    for (int j = 0; j < np; j++)
                        put(y + (s + r) * N + (q + j) * PANEL, out + (r * np + j) * PANEL, PANEL, residual,
                            b ? b + (q + j) * PANEL : NULL);
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

#ifdef ES_AVX2
/* e^x for 8 floats: x = n ln2 + r, |r| <= ln2/2, e^r by Cephes' expf polynomial (relative error ~2e-7,
   like expf); x is clamped to [-87.3, 88.7] (e^x of float32 range) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* v[0..n) = e^(v - mx), returns their sum (in order) */
static float exp_shift(float *v, int64_t n, float mx) {
    int64_t i = 0;
#ifdef ES_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(v + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(mx))));
#endif
    for (; i < n; i++) v[i] = expf(v[i] - mx);
    float sum = 0.f;
    for (int64_t j = 0; j < n; j++) sum += v[j];
    return sum;
}

/* act[0..n) = silu(gate) * up */
static void silu_mul(const float *gate, const float *up, float *act, int64_t n) {
    int64_t i = 0;
#ifdef ES_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(gate + i);
        __m256 e = exp8(_mm256_sub_ps(zero, a));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) act[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* act[0..n) = gelu_tanh(gate) * up: 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), computed as
   x / (1 + e^(-2u)) (the same number: 0.5 (1 + tanh(u)) = 1 / (1 + e^(-2u))), with the vector exp */
static void gelu_mul(const float *gate, const float *up, float *act, int64_t n) {
    const float c2 = -2.0f * 0.7978845608028654f, k3 = 0.044715f;
    int64_t i = 0;
#ifdef ES_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), vc = _mm256_set1_ps(c2), vk = _mm256_set1_ps(k3);
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(gate + i);
        __m256 t = _mm256_mul_ps(vc, _mm256_fmadd_ps(_mm256_mul_ps(vk, _mm256_mul_ps(a, a)), a, a));
        __m256 e = exp8(t);
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) {
        float a = gate[i];
        act[i] = a / (1.0f + expf(c2 * fmaf(k3 * (a * a), a, a))) * up[i];
    }
}

/* scores of 8 rows: out[j] = q . k_j over D, each as dotD computes it (lanes of 8, reduce8's order) */
static void dot8rows(const float *q, const float *k, int64_t D, float *out) {
#ifdef ES_AVX2
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * D + d), a[j]);
    }
    /* hadd pairs, then halves: out[j] = ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) of a[j], reduce8's order */
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
#else
    for (int j = 0; j < 8; j++) out[j] = dotD(q, k + j * D, D);
#endif
}

/* o (D) = sum over r < n of p[r] v_r (v rows of D), accumulated in registers 32 columns at a time */
static void weighted_rows(const float *p, const float *v, int64_t n, int64_t D, float *o) {
    int64_t d0 = 0;
#ifdef ES_AVX2
    for (; d0 + 32 <= D; d0 += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t r = 0; r < n; r++) {
            __m256 pv = _mm256_broadcast_ss(p + r);
            const float *vr = v + r * D + d0;
            a0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr), a0);
            a1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8), a1);
            a2 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 16), a2);
            a3 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 24), a3);
        }
        _mm256_storeu_ps(o + d0, a0);
        _mm256_storeu_ps(o + d0 + 8, a1);
        _mm256_storeu_ps(o + d0 + 16, a2);
        _mm256_storeu_ps(o + d0 + 24, a3);
    }
#endif
    for (int64_t d = d0; d < D; d++) {
        float acc = 0.f;
        for (int64_t r = 0; r < n; r++) acc = fmaf(p[r], v[r * D + d], acc);
        o[d] = acc;
    }
}

/* one row: h (E) = w * x * rsqrt(mean(x^2) + eps), the reference's order: normalise, then scale (h may be x) */
static void norm_row(const float *x, const float *w, int64_t E, float eps, float *h) {
    float ss = 0.f;
    for (int64_t e = 0; e < E; e++) ss += x[e] * x[e];
    float r = 1.0f / sqrtf(ss / (float)E + eps);
    for (int64_t e = 0; e < E; e++) h[e] = w[e] * (x[e] * r);
}

/* h (S, E) = rmsnorm of each row of x */
static void rmsnorm(const float *x, const float *w, int64_t S, int64_t E, float eps, float *h) {
#pragma omp for schedule(static)
    for (int64_t s = 0; s < S; s++) norm_row(x + s * E, w, E, eps, h + s * E);
}

/* sandwich norm: y (S, E) += rmsnorm of each row of t (S, E), t normed in place */
static void add_normed(float *t, const float *w, int64_t S, int64_t E, float eps, float *y) {
#pragma omp for schedule(static)
    for (int64_t s = 0; s < S; s++) {
        norm_row(t + s * E, w, E, eps, t + s * E);
        for (int64_t e = 0; e < E; e++) y[s * E + e] += t[s * E + e];
    }
}

/* the first R dims of x rotated: x*cos + rotate_half(x)*sin, with cs = cos, sn = sin (R/2 each) of its
   position; dims R.. pass */
static void rope(float *x, int64_t R, const float *cs, const float *sns) {
    int64_t half = R / 2;
    for (int64_t i = 0; i < half; i++) {
        float c = cs[i], sn = sns[i];
        float a = x[i], b = x[i + half];
        x[i] = a * c - b * sn;
        x[i + half] = b * c + a * sn;
    }
}

int64_t es_scratch_floats(const es_model *m, int64_t S, int64_t cap, int threads) {
    int64_t qkv = (m->H + 2 * m->Hkv) * m->D;
    return S * (2 * m->E + qkv + m->H * m->D + 2 * m->I + m->I + m->n_ropes * m->R) + (int64_t)threads * cap;
}

/* returns 0, or -1 when a position does not fit the cache */
int es_forward(const es_model *m, int64_t S, const int64_t *ids, int64_t start, float *const *kc, float *const *vc,
               int64_t cap, float *logits, int64_t *next_ids, float *hidden, float *scratch, int threads) {
    if (start < 0 || start + S > cap) return -1;
    const int64_t E = m->E, H = m->H, Hkv = m->Hkv, D = m->D, I = m->I, V = m->V, g = H / Hkv, R = m->R;
    const int64_t NQKV = (H + 2 * Hkv) * D;
    float *x = scratch, *h = x + S * E, *qkv = h + S * E, *att = qkv + S * NQKV, *gu = att + S * H * D,
          *act = gu + S * 2 * I, *rc = act + S * I, *scores = rc + m->n_ropes * S * R; /* scores: cap per thread */
    const float qscale = m->attn_scale, escale = m->embed_scale; /* x 1 is exact: no branch */
    for (int64_t s = 0; s < S; s++)
        for (int64_t e = 0; e < E; e++) x[s * E + e] = half_to_float(m->embed[ids[s] * E + e]) * escale;
    /* rc (n_ropes, S, R): per rotary, cos then sin (R/2 each) of each row's position times inv_freq, scaled:
       once per call */
    for (int64_t j = 0; j < m->n_ropes; j++)
        for (int64_t s = 0; s < S; s++) {
            float *c = rc + (j * S + s) * R;
            for (int64_t i = 0; i < R / 2; i++) {
                float f = (float)(start + s) * m->inv_freq[j * (R / 2) + i];
                c[i] = cosf(f) * m->rope_scale[j];
                c[R / 2 + i] = sinf(f) * m->rope_scale[j];
            }
        }

#pragma omp parallel num_threads(threads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *sc = scores + (int64_t)tid * cap;
        for (int64_t l = 0; l < m->L; l++) {
            /* this layer's options, once */
            const int64_t rj = m->layer_rope ? m->layer_rope[l] : (m->n_ropes ? 0 : -1);
            const float *lrc = rj >= 0 ? rc + rj * S * R : NULL; /* NULL: no rotary in this layer */
            const int64_t win = m->layer_window ? m->layer_window[l] : 0;
            const float *qn = m->qn ? m->qn[l] : NULL, *kn = m->kn ? m->kn[l] : NULL;
            const float *post_attn = m->post_attn ? m->post_attn[l] : NULL;
            const float *post_mlp = m->post_mlp ? m->post_mlp[l] : NULL;

            rmsnorm(x, m->ln1[l], S, E, m->eps, h);
            matmul(h, S, m->wqkv[l], E, NQKV, qkv, 0, m->bqkv ? m->bqkv[l] : NULL);
            /* keys and values of the S new rows into the cache, keys normed and rotated */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < Hkv * S; t++) {
                int64_t kh = t / S, s = t % S, row = start + s;
                float *kd = kc[l] + (kh * cap + row) * D, *vd = vc[l] + (kh * cap + row) * D;
                memcpy(kd, qkv + s * NQKV + H * D + kh * D, D * sizeof(float));
                memcpy(vd, qkv + s * NQKV + (H + Hkv) * D + kh * D, D * sizeof(float));
                if (kn) norm_row(kd, kn, D, m->eps, kd);
                if (lrc) rope(kd, R, lrc + s * R, lrc + s * R + R / 2);
            }
            /* attention of each (head, query) over its rows lo..start+s: 0.., or the last `win` of them */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < H * S; t++) {
                int64_t hh = t / S, s = t % S, kh = hh / g, pos = start + s;
                int64_t lo = win && pos + 1 > win ? pos + 1 - win : 0, n = pos + 1 - lo;
                float q[512];
                memcpy(q, qkv + s * NQKV + hh * D, D * sizeof(float));
                if (qn) norm_row(q, qn, D, m->eps, q);
                if (lrc) rope(q, R, lrc + s * R, lrc + s * R + R / 2);
                for (int64_t d = 0; d < D; d++) q[d] *= qscale;
                const float *K = kc[l] + (kh * cap + lo) * D, *Vv = vc[l] + (kh * cap + lo) * D;
                int64_t r = 0;
                for (; r + 8 <= n; r += 8) dot8rows(q, K + r * D, D, sc + r);
                for (; r < n; r++) sc[r] = dotD(q, K + r * D, D);
                float mx = -INFINITY;
                for (r = 0; r < n; r++) mx = sc[r] > mx ? sc[r] : mx;
                float sum = exp_shift(sc, n, mx);
                for (r = 0; r < n; r++) sc[r] = sc[r] / sum;
                weighted_rows(sc, Vv, n, D, att + s * H * D + hh * D);
            }
            const float *bo = m->bo ? m->bo[l] : NULL;
            if (post_attn) { /* x += norm(a Wo + bo): the product into h (free until ln2), normed there */
                matmul(att, S, m->wo[l], H * D, E, h, 0, bo);
                add_normed(h, post_attn, S, E, m->eps, x);
            } else
                matmul(att, S, m->wo[l], H * D, E, x, 1, bo);
            rmsnorm(x, m->ln2[l], S, E, m->eps, h);
            matmul(h, S, m->wgu[l], E, 2 * I, gu, 0, NULL);
            if (m->act == ES_GELU_TANH) {
#pragma omp for schedule(static)
                for (int64_t s = 0; s < S; s++) gelu_mul(gu + s * 2 * I, gu + s * 2 * I + I, act + s * I, I);
            } else {
#pragma omp for schedule(static)
                for (int64_t s = 0; s < S; s++) silu_mul(gu + s * 2 * I, gu + s * 2 * I + I, act + s * I, I);
            }
            if (post_mlp) { /* x += norm(m): the product into h (free again), normed there */
                matmul(act, S, m->wd[l], I, E, h, 0, NULL);
                add_normed(h, post_mlp, S, E, m->eps, x);
            } else
                matmul(act, S, m->wd[l], I, E, x, 1, NULL);
        }
        rmsnorm(x, m->norm, S, E, m->eps, h);
        matmul(h, S, m->lm_head, E, V, logits, 0, NULL);
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
