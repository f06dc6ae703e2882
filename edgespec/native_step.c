/* One decoder call of a contract model (every family export/checkpoint.py reads) on the CPU: B sequences of
   S new tokens each, float32 arithmetic, weights read as float16 or as blocks of int8 / int4.

   The bundled checkpoints store float16 weights; the fp32 ONNX engine reads each of them as 4 bytes. This
   step reads them as the 2 bytes they are, converts each to float32 on the fly (exact: every float16 is a
   float32) and accumulates in float32, so it computes the same function as the fp32 engine in a different
   summation order. int8 and int4 weights are blocks of QB = 32 values along the input dimension with one
   float16 scale per block and output column, w = q * scale (symmetric: q in -127..127 or -8..7); a block's
   products are summed in float32, then multiplied by its scale (export/native.py quantizes, edgespec/backends/native.py
   loads; tests compare every kernel with numpy and each build with the others).

   es_forward: B sequences, S new tokens each; sequence b's tokens at positions start[b]..start[b]+S-1
     ids (B, S)                   token ids (read when x_in is NULL)
     x_in (B, S, E) or NULL       the input rows themselves (an inputs_embeds engine: a VLA policy's decoder)
     kc[b L + l], vc[b L + l]     sequence b's layer l key / value cache (Hkv, cap, D); rows 0..start[b]-1 are
                                  read, rows start[b]..start[b]+S-1 written in place; no other row is touched,
                                  so stale rows (NaN included) never reach the output
     logits (B, S, V), next_ids (B, S)   next_ids: argmax over [argmax_lo, argmax_hi), or -1 where a row's
                                  logits are not all finite (the contract's NONFINITE_ID)
     hidden (B, S, E) or NULL     the final normed hidden state
   The B S rows go through every matrix product together, so a step reads each weight once whatever B is.
   Every product goes through matmul_rows (below): weights packed in panels of 16 output columns, each output
   one fixed chain of float32 fused multiply-adds over the inputs in order, whatever the call's B and S and
   whichever kernel (one row, several rows; AVX-512, AVX2 or portable C) computes it, so a token's row does
   not depend on the call. N is a multiple of 16, K of 32 for integer weights, head_dim of 8 (native.py checks).

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
   with the embedding rows times embed_scale, and logits = rmsnorm(x, norm) lm_head.

   Threads: each parallel loop (a matrix product, the attention, the norms) is a job of independent chunks
   that the calling thread and the pool's helpers claim one at a time (pool, below). Nobody waits at a barrier
   for a thread that has not claimed work, and a chunk held by a helper the OS has descheduled is computed
   again by the caller after a short wait (its result committed once, by whoever finishes first), so a busy
   machine slows a step down to the speed of the threads that actually run, not to the slowest one. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ES_AVX2 1
#endif
#if defined(ES_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define ES_AVX512 1 /* a panel is one 16-lane register */
#endif
/* 64-bit Arm (a Jetson's Cortex-A78AE, Graviton, Apple): NEON for the products, four columns per register, and
   the dot-product instructions (SDOT, Armv8.2's dotprod, -march=native where the core has them) for integer
   weights. -DES_PORTABLE keeps the portable C on any CPU (the tests compare the builds bit for bit). */
#if !defined(ES_AVX2) && defined(__aarch64__) && defined(__ARM_NEON) && !defined(ES_PORTABLE)
#include <arm_neon.h>
#define ES_NEON 1
#if defined(__ARM_FEATURE_DOTPROD)
#define ES_SDOT 1
#endif
#endif
#define MAX_ROWS 12 /* rows of x per pass over a panel */
#define CHUNK_PANELS_MAX 64 /* panels of a matrix product's chunk, at most */
#ifndef CHUNK_MIN_BYTES /* weight bytes a chunk streams, at least, where the matrix has enough */
#define CHUNK_MIN_BYTES (64 << 10)
#endif
#ifndef CHUNKS_PER_THREAD /* a product's chunks per thread, at most (-D for bench_native_profile --cflags) */
#define CHUNKS_PER_THREAD 16
#endif

enum { ES_SILU = 0, ES_GELU_TANH = 1 };
enum { ES_F16 = 0, ES_Q8 = 1, ES_Q4 = 2 }; /* how a weight matrix is stored (es_model.wkind, head_kind) */
#define QB 32                     /* integer weights: values per block along K */
#define Q8_BLOCK (32 + QB * 16)   /* bytes of one (block, panel): 16 float16 scales, then 8 groups of 64 bytes:
                                     group g, byte 4 c + t holds q[4 g + t][c] + 128 */
#define Q4_BLOCK (32 + QB * 8)    /* 16 float16 scales, then 4 groups of 64 bytes: group g, byte 4 c + t holds
                                     q[8 g + t][c] + 8 (low nibble) and q[8 g + 4 + t][c] + 8 (high nibble) */

typedef struct {
    int64_t E, H, Hkv, D, I, V, L, argmax_lo, argmax_hi;
    int64_t R;                 /* rotary dims of each head (even, <= D): the first R rotate, the rest pass */
    int64_t n_ropes;           /* distinct rotaries (0: no layer has one) */
    int64_t act;               /* ES_SILU (SwiGLU) or ES_GELU_TANH (GeGLU) */
    int64_t wkind, head_kind;  /* ES_F16 / ES_Q8 / ES_Q4: the layers' matrices, the lm_head */
    float eps, embed_scale, attn_scale; /* embed_scale multiplies the embedding rows (1: none) */
    const float *inv_freq;     /* (n_ropes, R/2) */
    const float *rope_scale;   /* (n_ropes): attention scaling folded into cos and sin */
    const int64_t *layer_rope; /* (L): layer l's rotary, -1 = none; NULL = rotary 0 everywhere */
    const int64_t *layer_window; /* (L): layer l's window, 0 = every row; NULL = no windows */
    const uint16_t *embed;     /* (V, E) fp16 */
    const void *lm_head;       /* (V, E) in head_kind's panels */
    const float *norm;         /* (E) */
    const float *const *ln1;   /* L x (E) */
    const float *const *ln2;   /* L x (E): the MLP's input norm */
    const void *const *wqkv;   /* L x ((H + 2 Hkv) D, E), in wkind's panels */
    const void *const *wo;     /* L x (E, H D) */
    const void *const *wgu;    /* L x (2 I, E): gate rows, then up rows */
    const void *const *wd;     /* L x (E, I) */
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

/* Bytes a kernel prefetches ahead in each weight stream. With several rows the core computes long enough per
   cache line that the hardware prefetcher falls behind and the products alternate between waiting for memory
   and computing; asking for the lines ahead overlaps the two (bench/results/NOTES.md, "prefetch"). */
#ifndef ES_PREFETCH
#define ES_PREFETCH 2048
#endif
/* The fewest rows a product prefetches for (es_set_prefetch_rows). Below it some CPUs' hardware prefetcher keeps
   up alone, and the extra requests then slow the product (bench/results/NOTES.md, "prefetch";
   bench/bench_products.py measures a machine). */
static _Atomic int pf_rows = 1;

/* whether this is an AMD x86 CPU: the per-CPU defaults below follow how its hardware prefetcher behaved */
static int cpu_is_amd(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_is("amd");
#else
    return 0;
#endif
}

/* rows <= 0: this CPU's default (7 on AMD, else 1); -> the value now in force */
int es_set_prefetch_rows(int rows) {
    if (rows <= 0) rows = cpu_is_amd() ? 7 : 1;
    atomic_store(&pf_rows, rows);
    return rows;
}

int es_prefetch_rows(void) { return atomic_load(&pf_rows); }

/* Panels a one-row int4 product streams per pass in the x86 kernels (es_set_q4_row_panels; qpanels_for). One panel
   is one address sequence, which AMD's hardware prefetcher follows best; Intel's keeps four interleaved streams fed
   and then reads faster (bench/results/NOTES.md, "one panel at a time" and "int4 one-row panels"). */
static _Atomic int q4_row1 = 1;
int es_q4_row_panels(void);

/* n <= 0: this CPU's default (1 on AMD, else 4); n in {1, 2, 4}: that; other n: -1, nothing changed. -> the value
   now in force (1 in builds whose integer kernel streams one panel at a time: Arm, portable C) */
int es_set_q4_row_panels(int n) {
    if (n > 0 && n != 1 && n != 2 && n != 4) return -1;
    atomic_store(&q4_row1, n > 0 ? n : cpu_is_amd() ? 1 : 4);
    return es_q4_row_panels();
}

#define ES_PF(ptr) __builtin_prefetch((const char *)(ptr) + ES_PREFETCH)

/* The prefetch of stream q of a pass over NP panels of ps bytes, qs bytes apart from p (stream q reads the panel
   at p + q qs), at byte o of its panel: the line ES_PREFETCH bytes ahead. Past the panel's end that line lies in
   the panel this stream reads next pass (split streams, job_matmul), except where the pass's panels are
   consecutive (qs = ps: chunks of consecutive panels): there it lies in panel q + 1, which another
   stream of this pass is reading already, so the request goes as far into panel q + NP instead, the one this
   stream reads next. (Straight ahead left each new pass's first lines to DRAM's latency: a product over short
   panels (K = 896: 8 KB of int4) paid that on every pass. -DES_PF_NEXT_PASS=0: straight ahead,
   bench/bench_products.py's comparison.) With NP = 1 both are the same address. */
#ifndef ES_PF_NEXT_PASS
#define ES_PF_NEXT_PASS 1
#endif
#ifndef ES_STREAM_SPLIT /* -DES_STREAM_SPLIT=0: a chunk is consecutive panels, and so is each pass (job_matmul) */
#define ES_STREAM_SPLIT 1
#endif
#ifndef ES_SPLIT_PANEL_MAX /* the longest panel (bytes) whose products take split streams (job_matmul) */
#define ES_SPLIT_PANEL_MAX (16 << 10)
#endif
static inline __attribute__((always_inline)) void pf_stream(const void *p, int q, int NP, int64_t ps, int64_t qs,
                                                            int64_t o) {
    const int64_t a = o + ES_PREFETCH;
    const int64_t next_pass = ES_PF_NEXT_PASS && a >= ps && qs == ps;
    __builtin_prefetch((const char *)p + (next_pass ? (q + NP) * ps + a - ps : q * qs + a));
}
#define PF_ON(R) ((R) >= atomic_load_explicit(&pf_rows, memory_order_relaxed))

#ifdef ES_NEON
/* one panel row (16 float16 weights) as four float32x4 (exact: every float16 is a float32) */
static inline __attribute__((always_inline)) void neon_panel_row(const uint16_t *w, float32x4_t *out) {
    const float16x8_t h0 = vreinterpretq_f16_u16(vld1q_u16(w)), h1 = vreinterpretq_f16_u16(vld1q_u16(w + 8));
    out[0] = vcvt_f32_f16(vget_low_f16(h0));
    out[1] = vcvt_high_f32_f16(h0);
    out[2] = vcvt_f32_f16(vget_low_f16(h1));
    out[3] = vcvt_high_f32_f16(h1);
}
#endif

/* one row: y[0 .. 16 np) = x (K) @ np panels (np <= 4), panel q at p + q qs (qs >= K 16 values) */
__attribute__((unused)) static void row_panels(const float *x, const uint16_t *p, int np, int64_t K, float *y,
                                               int64_t qs) {
#ifdef ES_AVX2
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    const int64_t stride = qs;
    const int pf = PF_ON(1);
    if (np == 4) { /* the common case: 8 chains in flight */
        for (int64_t k = 0; k < K; k++) {
            __m256 xv = _mm256_broadcast_ss(x + k);
            if (pf && !(k & 1))
                for (int q = 0; q < 4; q++) pf_stream(p, q, 4, 2 * K * PANEL, 2 * stride, 2 * k * PANEL);
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
#elif defined(ES_NEON)
    float32x4_t a[16]; /* np panels x 4 quarters: 4 np chains in flight */
    for (int j = 0; j < 4 * np; j++) a[j] = vdupq_n_f32(0.f);
    const int64_t stride = qs;
    const int pf = PF_ON(1);
    for (int64_t k = 0; k < K; k++) {
        const float32x4_t xv = vdupq_n_f32(x[k]);
        for (int q = 0; q < np; q++) {
            if (pf && !(k & 1)) pf_stream(p, q, np, 2 * K * PANEL, 2 * stride, 2 * k * PANEL);
            float32x4_t w[4];
            neon_panel_row(p + q * stride + k * PANEL, w);
            for (int j = 0; j < 4; j++) a[4 * q + j] = vfmaq_f32(a[4 * q + j], xv, w[j]);
        }
    }
    for (int j = 0; j < 4 * np; j++) vst1q_f32(y + 4 * j, a[j]);
#else
    for (int q = 0; q < np; q++)
        for (int c = 0; c < PANEL; c++) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(x[k], half_to_float(p[q * qs + k * PANEL + c]), acc);
            y[q * PANEL + c] = acc;
        }
#endif
}

#if defined(ES_AVX512)
/* R rows x NP panels, panel q at p + q qs (R, NP constants at each call site; R * NP <= 24 of the 32 registers):
   out[r * NP * PANEL + q * PANEL + c] = x[r] (K) @ column c of panel q */
static inline __attribute__((always_inline)) void rows_panels_r(const float *const *x, const int R, const uint16_t *p,
                                                                const int NP, int64_t K, float *out, int64_t qs) {
    __m512 a[24];
    for (int i = 0; i < R * NP; i++) a[i] = _mm512_setzero_ps();
    const int pf = PF_ON(R);
    for (int64_t k = 0; k < K; k++) {
        __m512 w[8];
        if (pf && !(k & 1)) /* one 64-byte line of each panel per two k */
            for (int q = 0; q < NP; q++) pf_stream(p, q, NP, 2 * K * PANEL, 2 * qs, 2 * k * PANEL);
        for (int q = 0; q < NP; q++)
            w[q] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + q * qs + k * PANEL)));
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_set1_ps(x[r][k]);
            for (int q = 0; q < NP; q++) a[r * NP + q] = _mm512_fmadd_ps(xv, w[q], a[r * NP + q]);
        }
    }
    for (int i = 0; i < R * NP; i++) _mm512_storeu_ps(out + i * PANEL, a[i]);
}

/* how many panels a pass over R rows takes: enough chains in flight for few rows, registers for many */
static int panels_for(int R) { return R == 1 ? 4 : R <= 2 ? 8 : R <= 5 ? 4 : 2; }

#define RP_CASE(n) case n: { if (np == panels_for(n)) rows_panels_r(x, n, p, panels_for(n), K, out, qs); \
                             else rows_panels_r(x, n, p, 1, K, out, qs); } break;
/* np is panels_for(R), or 1 (the last panels of a matrix); panel q at p + q qs */
static void rows_panels(const float *const *x, int R, const uint16_t *p, int np, int64_t K, float *out, int64_t qs) {
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
    const int pf = PF_ON(R);
    for (int r0 = 0; r0 < R; r0 += 6) { /* 16 ymm registers: 6 rows x 2 halves at a time */
        const int n = R - r0 < 6 ? R - r0 : 6;
        __m256 a[6][2];
        for (int r = 0; r < 6; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k++) {
            if (pf && !(k & 1)) ES_PF(p + k * PANEL);
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
#elif defined(ES_NEON)
    const int pf = PF_ON(R);
    for (int r0 = 0; r0 < R; r0 += 6) { /* 32 registers: 6 rows x 4 quarters of the panel at a time */
        const int n = R - r0 < 6 ? R - r0 : 6;
        float32x4_t a[6][4];
        for (int r = 0; r < 6; r++)
            for (int j = 0; j < 4; j++) a[r][j] = vdupq_n_f32(0.f);
        for (int64_t k = 0; k < K; k++) {
            if (pf && !(k & 1)) ES_PF(p + k * PANEL);
            float32x4_t w[4];
            neon_panel_row(p + k * PANEL, w);
            for (int r = 0; r < n; r++) {
                const float32x4_t xv = vdupq_n_f32(x[r0 + r][k]);
                for (int j = 0; j < 4; j++) a[r][j] = vfmaq_f32(a[r][j], xv, w[j]); /* a + x w, fused */
            }
        }
        for (int r = 0; r < n; r++)
            for (int j = 0; j < 4; j++) vst1q_f32(out + (r0 + r) * PANEL + 4 * j, a[r][j]);
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
static void rows_panels(const float *const *x, int R, const uint16_t *p, int np, int64_t K, float *out, int64_t qs) {
    (void)np, (void)qs; /* one panel */
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

/* v[0..n) = e^(v - mx), returns their sum: lane j % 8 sums v[j] in order, then reduce8 (eight chains in flight
   instead of one; every build adds the same way) */
static float exp_shift(float *v, int64_t n, float mx) {
    int64_t i = 0;
#ifdef ES_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(v + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lane[8];
    _mm256_storeu_ps(lane, acc);
#else
    float lane[8] = {0};
#endif
    for (int64_t j = i; j < n; j++) v[j] = expf(v[j] - mx);
#ifndef ES_AVX2
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lane[l] += v[i + l];
#endif
    for (int64_t j = i; j < n; j++) lane[j - i] += v[j];
    return reduce8(lane);
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

#ifndef ES_AVX2
/* o (D) = sum over r < n of p[r] v_r (v rows of D), each column one chain in order of r */
static void weighted_rows(const float *p, const float *v, int64_t n, int64_t D, float *o) {
    for (int64_t d = 0; d < D; d++) {
        float acc = 0.f;
        for (int64_t r = 0; r < n; r++) acc = fmaf(p[r], v[r * D + d], acc);
        o[d] = acc;
    }
}
#endif

/* Attention for GS query heads that read one kv head (GS <= 8: attn_group), so each key and value row is loaded
   once for all of them. Each (head, row) score and each output column is the same chain as dotD and
   weighted_rows compute for one head, so the grouping changes no bit. */
#define ATT_GROUP_MAX 8

/* Before scoring key rows t..t+RT-1: ask for the key rows ATT_PF_ROWS ahead and for value rows t..t+RT-1, which
   the weighted sum reads next. Once the weights of a step have streamed through the cache, a layer's cached rows
   come from DRAM, and without this each attention chunk waited on them row by row. */
#define ATT_PF_ROWS 8
#ifndef ES_ATTN_PF /* -DES_ATTN_PF=0: no such prefetch (bench/bench_native_profile.py --cflags compares) */
#define ES_ATTN_PF 1
#endif
static inline __attribute__((always_inline)) void attn_prefetch(const float *k, const float *v, int64_t t, int RT,
                                                                int64_t n, int64_t D) {
    for (int u = 0; u < RT * ES_ATTN_PF; u++) {
        const int64_t tk = t + u + ATT_PF_ROWS;
        for (int64_t d = 0; d < D; d += 16) {
            if (tk < n) __builtin_prefetch(k + tk * D + d);
            __builtin_prefetch(v + (t + u) * D + d);
        }
    }
}

#ifdef ES_AVX2
/* out[j] = ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of a[j], j < 8: reduce8's order */
static inline void reduce8x8(const __m256 *a, float *out) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}

/* sc[g ss + t] = q_g . k_t for g < GS, t < n: 8 / GS key rows at a time (rounded down: GS = 3 takes 2 rows and
   leaves 2 of the 8 sums idle), each loaded once for the GS heads */
static inline __attribute__((always_inline)) void group_scores_r(const float *q, const int GS, const float *k,
                                                                 int64_t n, int64_t D, float *sc, int64_t ss,
                                                                 const float *v) {
    const int RT = 8 / GS;
    int64_t t = 0;
    for (; t + RT <= n; t += RT) {
        attn_prefetch(k, v, t, RT, n, D);
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            __m256 kv[8];
            for (int u = 0; u < RT; u++) kv[u] = _mm256_loadu_ps(k + (t + u) * D + d);
            for (int g = 0; g < GS; g++) {
                const __m256 qv = _mm256_loadu_ps(q + g * D + d);
                for (int u = 0; u < RT; u++) a[u * GS + g] = _mm256_fmadd_ps(qv, kv[u], a[u * GS + g]);
            }
        }
        float out[8];
        reduce8x8(a, out);
        for (int u = 0; u < RT; u++)
            for (int g = 0; g < GS; g++) sc[g * ss + t + u] = out[u * GS + g];
    }
    for (; t < n; t++)
        for (int g = 0; g < GS; g++) sc[g * ss + t] = dotD(q + g * D, k + t * D, D);
}

/* o[g D + d] = sum over t < n of p[g ps + t] v_t[d], in order of t, for g < GS: 32 columns at a time for up to 4
   heads, 16 for more (the sums stay in registers) */
static inline __attribute__((always_inline)) void group_weighted_r(const float *p, int64_t ps, const int GS,
                                                                   const float *v, int64_t n, int64_t D, float *o) {
    const int CV = GS <= 4 ? 4 : 2, CW = 8 * CV; /* vectors and columns per pass */
    int64_t d0 = 0;
    for (; d0 + CW <= D; d0 += CW) {
        __m256 a[ATT_GROUP_MAX][4];
        for (int g = 0; g < GS; g++)
            for (int c = 0; c < CV; c++) a[g][c] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const float *vr = v + t * D + d0;
            __m256 vv[4];
            for (int c = 0; c < CV; c++) vv[c] = _mm256_loadu_ps(vr + 8 * c);
            for (int g = 0; g < GS; g++) {
                const __m256 pv = _mm256_broadcast_ss(p + g * ps + t);
                for (int c = 0; c < CV; c++) a[g][c] = _mm256_fmadd_ps(pv, vv[c], a[g][c]);
            }
        }
        for (int g = 0; g < GS; g++)
            for (int c = 0; c < CV; c++) _mm256_storeu_ps(o + g * D + d0 + 8 * c, a[g][c]);
    }
    for (int g = 0; g < GS; g++)
        for (int64_t d = d0; d < D; d++) {
            float acc = 0.f;
            for (int64_t t = 0; t < n; t++) acc = fmaf(p[g * ps + t], v[t * D + d], acc);
            o[g * D + d] = acc;
        }
}

#define GROUP_CASES(f, ...)                                                                                       \
    switch (GS) {                                                                                                 \
    case 8: f(__VA_ARGS__, 8); break;                                                                             \
    case 7: f(__VA_ARGS__, 7); break;                                                                             \
    case 6: f(__VA_ARGS__, 6); break;                                                                             \
    case 5: f(__VA_ARGS__, 5); break;                                                                             \
    case 4: f(__VA_ARGS__, 4); break;                                                                             \
    case 3: f(__VA_ARGS__, 3); break;                                                                             \
    case 2: f(__VA_ARGS__, 2); break;                                                                             \
    default: f(__VA_ARGS__, 1); break;                                                                            \
    }
#define SCORES_GS(q, k, n, D, sc, ss, v, G) group_scores_r(q, G, k, n, D, sc, ss, v)
#define WEIGHTED_GS(p, ps, v, n, D, o, G) group_weighted_r(p, ps, G, v, n, D, o)

static void group_scores(const float *q, int GS, const float *k, int64_t n, int64_t D, float *sc, int64_t ss,
                         const float *v) {
    GROUP_CASES(SCORES_GS, q, k, n, D, sc, ss, v)
}

static void group_weighted(const float *p, int64_t ps, int GS, const float *v, int64_t n, int64_t D, float *o) {
    GROUP_CASES(WEIGHTED_GS, p, ps, v, n, D, o)
}
#else
static void group_scores(const float *q, int GS, const float *k, int64_t n, int64_t D, float *sc, int64_t ss,
                         const float *v) {
    for (int64_t t = 0; t < n; t++) {
        attn_prefetch(k, v, t, 1, n, D);
        for (int g = 0; g < GS; g++) sc[g * ss + t] = dotD(q + g * D, k + t * D, D);
    }
}

static void group_weighted(const float *p, int64_t ps, int GS, const float *v, int64_t n, int64_t D, float *o) {
    for (int g = 0; g < GS; g++) weighted_rows(p + g * ps, v, n, D, o + g * D);
}
#endif

/* query heads per attention chunk: the largest divisor of the heads per kv head up to ATT_GROUP_MAX (Qwen2.5-0.5B's
   7 take one chunk per kv head; -DES_ATTN_GROUP=1: one head per chunk, the tests' build that shows the grouping
   changes no bit) */
static int64_t attn_group(int64_t H, int64_t Hkv) {
    const int64_t G = H / Hkv;
#ifdef ES_ATTN_GROUP
    if (G % ES_ATTN_GROUP == 0) return ES_ATTN_GROUP;
#endif
    for (int64_t g = ATT_GROUP_MAX; g > 1; g--)
        if (G % g == 0) return g;
    return 1;
}

/* one row: h (E) = w * x * rsqrt(mean(x^2) + eps), the reference's order: normalise, then scale (h may be x) */
static void norm_row(const float *x, const float *w, int64_t E, float eps, float *h) {
    float ss = 0.f;
    for (int64_t e = 0; e < E; e++) ss += x[e] * x[e];
    float r = 1.0f / sqrtf(ss / (float)E + eps);
    for (int64_t e = 0; e < E; e++) h[e] = w[e] * (x[e] * r);
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


/* Integer weights. A matrix of kind ES_Q8 / ES_Q4 is N/16 panels, each K/QB blocks of Q8_BLOCK / Q4_BLOCK
   bytes (layout at the defines above). Its input rows are quantized too, per block of QB values (quantize_row):
   xq = round(x 127 / max|x|) in -127..127, with dx = max|x| / 127. Output column c of a panel, for one row:
       dot_b[c] = sum over k in block b of q[k][c] xq[k]         (an exact integer)
       y[c]     = sum over blocks b, in order, of (float)dot_b[c] * (dx_b * scale_b[c])
   the sum a chain of float32 fused multiply-adds from 0. The weights are stored offset to unsigned bytes
   (u = q + 128, or q + 8), so the kernels sum u xq and take off 128 or 8 times the block's sum of xq: the
   same integer. AVX-512 VNNI's vpdpbusd sums 4 such products per lane and instruction; the portable kernel
   does the same sums one at a time. Every kernel gives the same bits. */

static int64_t block_bytes(int kind) { return kind == ES_Q8 ? Q8_BLOCK : Q4_BLOCK; }
static int weight_offset(int kind) { return kind == ES_Q8 ? 128 : 8; }

/* the unsigned value u of weight k < QB, column c < 16, of block `blk` */
__attribute__((unused)) static int wu(const uint8_t *blk, int kind, int k, int c) {
    if (kind == ES_Q8) return blk[32 + (k >> 2) * 64 + 4 * c + (k & 3)];
    const uint8_t byte = blk[32 + (k >> 3) * 64 + 4 * c + (k & 3)];
    return (k & 7) < 4 ? byte & 15 : byte >> 4;
}

/* a row's activations for integer weights: xq (K) int8, and per block dx (K/QB) and the sum of its xq; the
   AVX-512 version computes the same values (max, one product, round to nearest even, clamp: each exact or
   rounded once, in the same order) */
#ifdef ES_AVX512
static void quantize_row(const float *x, int64_t K, int8_t *xq, float *dx, int32_t *xs) {
    const __m512 inf = _mm512_set1_ps(INFINITY), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (int64_t b = 0; b < K / QB; b++) {
        const __m512 a0 = _mm512_loadu_ps(x + b * QB), a1 = _mm512_loadu_ps(x + b * QB + 16);
        const __m512 m0 = _mm512_abs_ps(a0), m1 = _mm512_abs_ps(a1);
        const int finite = (_mm512_cmp_ps_mask(m0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(m1, inf, _CMP_LT_OQ)) == 0xFFFF;
        const float amax = finite ? _mm512_reduce_max_ps(_mm512_max_ps(m0, m1)) : 0.f;
        if (finite && amax > 0.f) {
            const __m512 id = _mm512_set1_ps(127.f / amax);
            const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(a0, id), r), lo), hi));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(a1, id), r), lo), hi));
            _mm_storeu_si128((__m128i *)(xq + b * QB), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(xq + b * QB + 16), _mm512_cvtepi32_epi8(q1));
            xs[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            dx[b] = amax / 127.f;
        } else {
            memset(xq + b * QB, 0, QB);
            dx[b] = finite ? 0.f : NAN;
            xs[b] = 0;
        }
    }
}
#else
static void quantize_row(const float *x, int64_t K, int8_t *xq, float *dx, int32_t *xs) {
    for (int64_t b = 0; b < K / QB; b++) {
        const float *v = x + b * QB;
        float amax = 0.f;
        int finite = 1;
        for (int k = 0; k < QB; k++) {
            const float a = fabsf(v[k]);
            finite &= isfinite(a) != 0;
            amax = a > amax ? a : amax;
        }
        int32_t sum = 0;
        if (finite && amax > 0.f) {
            const float id = 127.f / amax;
            for (int k = 0; k < QB; k++) {
                float r = nearbyintf(v[k] * id);
                r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
                xq[b * QB + k] = (int8_t)r;
                sum += (int32_t)r;
            }
            dx[b] = amax / 127.f;
        } else { /* zeros; or a block with NaN or inf, which must reach the output: dx NaN */
            memset(xq + b * QB, 0, QB);
            dx[b] = finite ? 0.f : NAN;
        }
        xs[b] = sum;
    }
}
#endif

#if defined(ES_AVX512) && defined(__AVX512VNNI__)
#define ES_VNNI 1
/* R rows x NP panels, panel q at p + q qs bytes (R, NP constants at each call site; R * NP <= 12):
   out[(r NP + q) 16 + c] */
static inline __attribute__((always_inline)) void qrows_r(const int8_t *const *xq, const float *const *dx,
                                                          const int32_t *const *xs, const int R, const uint8_t *p,
                                                          const int NP, int64_t K, const int kind, float *out,
                                                          int64_t qs) {
    const int64_t nb = K / QB, bb = block_bytes(kind), ps = nb * bb; /* bytes per panel */
    const __m512i low4 = _mm512_set1_epi8(15);
    const int32_t off = weight_offset(kind);
    __m512 tot[12];
    __m512i acc[12];
    for (int i = 0; i < R * NP; i++) tot[i] = _mm512_setzero_ps();
    const int pf = PF_ON(R);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = p + b * bb;
        /* a block is 4.5 (int4) or 8.5 (int8) lines: one prefetch per line and one more covers them */
        if (pf)
            for (int q = 0; q < NP; q++)
                for (int64_t o = 0; o <= bb; o += 64) pf_stream(p, q, NP, ps, qs, b * bb + o);
        /* each sum starts at -offset x the block's input sum: the stored weights are q + offset */
        for (int r = 0; r < R; r++) {
            const __m512i start = _mm512_set1_epi32(-off * xs[r][b]);
            for (int q = 0; q < NP; q++) acc[r * NP + q] = start;
        }
        if (kind == ES_Q8) {
            for (int g = 0; g < QB / 4; g++) {
                __m512i w[4];
                for (int q = 0; q < NP; q++) w[q] = _mm512_loadu_si512((const void *)(blk + q * qs + 32 + g * 64));
                for (int r = 0; r < R; r++) {
                    int32_t x4;
                    memcpy(&x4, xq[r] + b * QB + 4 * g, 4);
                    const __m512i xv = _mm512_set1_epi32(x4);
                    for (int q = 0; q < NP; q++) acc[r * NP + q] = _mm512_dpbusd_epi32(acc[r * NP + q], w[q], xv);
                }
            }
        } else {
            for (int g = 0; g < QB / 8; g++) {
                __m512i lo[4], hi[4];
                for (int q = 0; q < NP; q++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(blk + q * qs + 32 + g * 64));
                    lo[q] = _mm512_and_si512(v, low4);
                    hi[q] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                }
                for (int r = 0; r < R; r++) {
                    int32_t x0, x1;
                    memcpy(&x0, xq[r] + b * QB + 8 * g, 4);
                    memcpy(&x1, xq[r] + b * QB + 8 * g + 4, 4);
                    const __m512i v0 = _mm512_set1_epi32(x0), v1 = _mm512_set1_epi32(x1);
                    for (int q = 0; q < NP; q++) {
                        acc[r * NP + q] = _mm512_dpbusd_epi32(acc[r * NP + q], lo[q], v0);
                        acc[r * NP + q] = _mm512_dpbusd_epi32(acc[r * NP + q], hi[q], v1);
                    }
                }
            }
        }
        for (int q = 0; q < NP; q++) {
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + q * qs)));
            for (int r = 0; r < R; r++) {
                const __m512 ds = _mm512_mul_ps(_mm512_set1_ps(dx[r][b]), s);
                tot[r * NP + q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r * NP + q]), ds, tot[r * NP + q]);
            }
        }
    }
    for (int i = 0; i < R * NP; i++) _mm512_storeu_ps(out + i * PANEL, tot[i]);
}

/* panels per pass over R rows. One int4 row takes es_set_q4_row_panels' count: on AMD one panel at a time, so
   each thread reads its weights as one address sequence that the hardware prefetcher follows (with four panels'
   288-byte blocks interleaved it falls behind and the kernel waits on DRAM); on Intel four, whose prefetcher keeps
   four streams fed. int8 blocks (544 bytes) do not show it, and keep four panels' chains in flight
   (bench/results/NOTES.md, "one panel at a time", "int4 one-row panels"). With more rows the arithmetic per byte
   is larger and several panels' shared inputs pay (two rows: four; up to six: two); past six the registers run
   out.
   -DES_QPANELS_ROW1=n (1, 2 or 4) sets the one-row choice for both kinds (bench/bench_products.py --panels-row1). */
static int qpanels_for(int kind, int R) {
#ifdef ES_QPANELS_ROW1
    if (R == 1) return ES_QPANELS_ROW1;
#endif
    if (R == 1) return kind == ES_Q4 ? atomic_load_explicit(&q4_row1, memory_order_relaxed) : 4;
    return R <= 2 ? 4 : R <= 6 ? 2 : 1;
}

#define QP_CASE(n, K8)                                                                              \
    case n:                                                                                         \
        if (np == qpanels_for(K8, n)) qrows_r(xq, dx, xs, n, p, qpanels_for(K8, n), K, K8, out, qs); \
        else qrows_r(xq, dx, xs, n, p, 1, K, K8, out, qs);                                          \
        break;
/* one row: np is set at run time (es_set_q4_row_panels), so each of its values has its own inlined kernel */
#define QP_ROW1(K8)                                                                                 \
    case 1:                                                                                         \
        if (np == 4) qrows_r(xq, dx, xs, 1, p, 4, K, K8, out, qs);                                  \
        else if (np == 2) qrows_r(xq, dx, xs, 1, p, 2, K, K8, out, qs);                             \
        else qrows_r(xq, dx, xs, 1, p, 1, K, K8, out, qs);                                          \
        break;
/* np is qpanels_for(kind, R), or 1; panel q at p + q qs bytes */
static void qrows(const int8_t *const *xq, const float *const *dx, const int32_t *const *xs, int R, const uint8_t *p,
                  int np, int64_t K, int kind, float *out, int64_t qs) {
    if (kind == ES_Q8) {
        switch (R) {
        QP_CASE(12, ES_Q8) QP_CASE(11, ES_Q8) QP_CASE(10, ES_Q8) QP_CASE(9, ES_Q8) QP_CASE(8, ES_Q8)
        QP_CASE(7, ES_Q8) QP_CASE(6, ES_Q8) QP_CASE(5, ES_Q8) QP_CASE(4, ES_Q8) QP_CASE(3, ES_Q8)
        QP_CASE(2, ES_Q8) QP_ROW1(ES_Q8)
        }
    } else {
        switch (R) {
        QP_CASE(12, ES_Q4) QP_CASE(11, ES_Q4) QP_CASE(10, ES_Q4) QP_CASE(9, ES_Q4) QP_CASE(8, ES_Q4)
        QP_CASE(7, ES_Q4) QP_CASE(6, ES_Q4) QP_CASE(5, ES_Q4) QP_CASE(4, ES_Q4) QP_CASE(3, ES_Q4)
        QP_CASE(2, ES_Q4) QP_ROW1(ES_Q4)
        }
    }
}
#elif defined(ES_AVX2)
/* One panel per pass for several rows: the outputs of R rows x NP panels would not fit sixteen registers. One int4
   row takes es_set_q4_row_panels' count (q4row_avx2). */
static int qpanels_for(int kind, int R) {
#ifdef ES_QPANELS_ROW1
    if (R == 1 && kind == ES_Q4) return ES_QPANELS_ROW1;
#endif
    return R == 1 && kind == ES_Q4 ? atomic_load_explicit(&q4_row1, memory_order_relaxed) : 1;
}

/* AVX2 without VNNI (AMD Zen 2/3, Intel client and pre-Ice Lake server cores): the same integer sums and the same
   float chain per column as the AVX-512 kernel, eight columns per register, so the same bits. A group is 16 columns
   x 4 weights, 32 bytes per eight columns. The sums are exact integers whatever their order:
     int4: maddubs(u, x) adds two u (0..15) x x (-127..127) products into int16; eight of them per column and block
           reach at most 8 x 3810 = 30480, inside int16, and one madd with ones widens each column's pair;
     int8: u is q + 128 with q in -127..127 (quantize_blocks), so q = u ^ 0x80 as int8 and maddubs(|x|, sign(q, x))
           adds two q x products (at most 2 x 127 x 127 = 32258), widened to int32 at once; the sum of q x is the
           AVX-512 kernel's -128 sum(x) + sum(u x). */
/* RT rows over NP panels, panel q at p + q qs bytes (constants at each call, RT x NP <= 4): each group's weights
   are loaded and unpacked once for the RT rows, and the NP panels' groups are interleaved, so NP address streams
   are read at once (one int4 row: es_set_q4_row_panels). outs[r] + 16 q: row r's outputs of panel q. */
static inline __attribute__((always_inline)) void qrows_avx2_np(const int8_t *const *xq, const float *const *dx,
                                                                const int32_t *const *xs, const int RT,
                                                                const uint8_t *p, const int NP, int64_t nb, int kind,
                                                                float *const *outs, int64_t qs) {
    const int64_t bb = block_bytes(kind), ps = nb * bb; /* bytes per panel */
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    const int32_t off = weight_offset(kind);
    const int pf = PF_ON(RT);
    __m256 t0[4], t1[4]; /* [r NP + q]: columns 0..7, 8..15 */
    for (int i = 0; i < RT * NP; i++) t0[i] = t1[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = p + b * bb;
        if (pf)
            for (int q = 0; q < NP; q++)
                for (int64_t o = 0; o <= bb; o += 64) pf_stream(p, q, NP, ps, qs, b * bb + o);
        __m256i a0[4], a1[4];
        if (kind == ES_Q8) {
            for (int i = 0; i < RT * NP; i++) a0[i] = a1[i] = _mm256_setzero_si256();
            for (int g = 0; g < QB / 4; g++)
                for (int q = 0; q < NP; q++) {
                    const uint8_t *w = blk + q * qs + 32 + g * 64;
                    const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)w), flip);
                    const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 32)), flip);
                    for (int r = 0; r < RT; r++) {
                        int32_t x4;
                        memcpy(&x4, xq[r] + b * QB + 4 * g, 4);
                        const __m256i xv = _mm256_set1_epi32(x4), ax = _mm256_abs_epi8(xv);
                        const __m256i p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xv));
                        const __m256i p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xv));
                        a0[r * NP + q] = _mm256_add_epi32(a0[r * NP + q], _mm256_madd_epi16(p0, ones));
                        a1[r * NP + q] = _mm256_add_epi32(a1[r * NP + q], _mm256_madd_epi16(p1, ones));
                    }
                }
        } else {
            __m256i s0[4], s1[4]; /* int16 pairs */
            for (int i = 0; i < RT * NP; i++) s0[i] = s1[i] = _mm256_setzero_si256();
            for (int g = 0; g < QB / 8; g++)
                for (int q = 0; q < NP; q++) {
                    const uint8_t *w = blk + q * qs + 32 + g * 64;
                    const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);
                    const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
                    const __m256i l0 = _mm256_and_si256(w0, low4), l1 = _mm256_and_si256(w1, low4);
                    const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), low4);
                    const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), low4);
                    for (int r = 0; r < RT; r++) {
                        int32_t x0, x1;
                        memcpy(&x0, xq[r] + b * QB + 8 * g, 4);
                        memcpy(&x1, xq[r] + b * QB + 8 * g + 4, 4);
                        const __m256i v0 = _mm256_set1_epi32(x0), v1 = _mm256_set1_epi32(x1);
                        const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(l0, v0),
                                                            _mm256_maddubs_epi16(h0, v1));
                        const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(l1, v0),
                                                            _mm256_maddubs_epi16(h1, v1));
                        s0[r * NP + q] = _mm256_add_epi16(s0[r * NP + q], p0);
                        s1[r * NP + q] = _mm256_add_epi16(s1[r * NP + q], p1);
                    }
                }
            for (int r = 0; r < RT; r++) {
                const __m256i start = _mm256_set1_epi32(-off * xs[r][b]);
                for (int q = 0; q < NP; q++) {
                    a0[r * NP + q] = _mm256_add_epi32(start, _mm256_madd_epi16(s0[r * NP + q], ones));
                    a1[r * NP + q] = _mm256_add_epi32(start, _mm256_madd_epi16(s1[r * NP + q], ones));
                }
            }
        }
        for (int q = 0; q < NP; q++) {
            const __m256 sc0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + q * qs)));
            const __m256 sc1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + q * qs + 16)));
            for (int r = 0; r < RT; r++) {
                const __m256 d = _mm256_set1_ps(dx[r][b]);
                const int i = r * NP + q;
                t0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0[i]), _mm256_mul_ps(d, sc0), t0[i]);
                t1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1[i]), _mm256_mul_ps(d, sc1), t1[i]);
            }
        }
    }
    for (int r = 0; r < RT; r++)
        for (int q = 0; q < NP; q++) {
            _mm256_storeu_ps(outs[r] + q * PANEL, t0[r * NP + q]);
            _mm256_storeu_ps(outs[r] + q * PANEL + 8, t1[r * NP + q]);
        }
}

/* RT (1..4) rows over one panel: outs[r], row r's 16 outputs */
static inline __attribute__((always_inline)) void qrows_avx2(const int8_t *const *xq, const float *const *dx,
                                                             const int32_t *const *xs, const int RT, const uint8_t *p,
                                                             int64_t nb, int kind, float *const *outs) {
    qrows_avx2_np(xq, dx, xs, RT, p, 1, nb, kind, outs, nb * block_bytes(kind));
}

/* one int4 row over NP (2 or 4) panels qs bytes apart: out, NP x 16 outputs */
static inline __attribute__((always_inline)) void q4row_avx2(const int8_t *const *xq, const float *const *dx,
                                                             const int32_t *const *xs, const uint8_t *p, const int NP,
                                                             int64_t nb, float *out, int64_t qs) {
    qrows_avx2_np(xq, dx, xs, 1, p, NP, nb, ES_Q4, &out, qs);
}

#define QROWS_KERNEL qrows_avx2 /* qrows below: up to 4 rows a call */
#define Q4ROW_KERNEL q4row_avx2 /* and one int4 row over 2 or 4 panels */
#elif defined(ES_SDOT)
static int qpanels_for(int kind, int R) { (void)kind; (void)R; return 1; }

/* Arm with the dot-product instructions: the same integer sums and float chain per column as the other kernels,
   four columns per register, so the same bits. A group's 64 bytes are 16 columns x 4 weights, column c at bytes
   4c..4c+3, so 16 bytes hold 4 columns and one SDOT adds each column's 4 products (w x) to its int32 lane:
     int8: u = q + 128, so q = u ^ 0x80 as int8, and the lanes sum q x directly;
     int4: each nibble u = q + 8 (0..15, an int8 as it is): the lanes sum u x, started at -8 sum(x).
   RT (1..4, a constant at each call) rows over one panel; outs[r]: row r's 16 outputs. */
static inline __attribute__((always_inline)) void qrows_sdot(const int8_t *const *xq, const float *const *dx,
                                                             const int32_t *const *xs, const int RT, const uint8_t *p,
                                                             int64_t nb, int kind, float *const *outs) {
    const int64_t bb = block_bytes(kind);
    const int32_t off = weight_offset(kind);
    const uint8x16_t flip = vdupq_n_u8(0x80), low4 = vdupq_n_u8(15);
    const int pf = PF_ON(RT);
    float32x4_t t[4][4]; /* rows x quarters of the panel */
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < 4; j++) t[r][j] = vdupq_n_f32(0.f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = p + b * bb;
        if (pf)
            for (int64_t o = 0; o <= bb; o += 64) ES_PF(blk + o);
        int32x4_t a[4][4];
        if (kind == ES_Q8) {
            for (int r = 0; r < RT; r++)
                for (int j = 0; j < 4; j++) a[r][j] = vdupq_n_s32(0);
            for (int g = 0; g < QB / 4; g++) {
                int8x16_t w[4];
                for (int j = 0; j < 4; j++) w[j] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(blk + 32 + g * 64 + 16 * j), flip));
                for (int r = 0; r < RT; r++) {
                    int32_t x4;
                    memcpy(&x4, xq[r] + b * QB + 4 * g, 4);
                    const int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x4));
                    for (int j = 0; j < 4; j++) a[r][j] = vdotq_s32(a[r][j], w[j], xv);
                }
            }
        } else {
            for (int r = 0; r < RT; r++)
                for (int j = 0; j < 4; j++) a[r][j] = vdupq_n_s32(-off * xs[r][b]);
            for (int g = 0; g < QB / 8; g++) {
                int8x16_t lo[4], hi[4];
                for (int j = 0; j < 4; j++) {
                    const uint8x16_t raw = vld1q_u8(blk + 32 + g * 64 + 16 * j);
                    lo[j] = vreinterpretq_s8_u8(vandq_u8(raw, low4));
                    hi[j] = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
                }
                for (int r = 0; r < RT; r++) {
                    int32_t x0, x1;
                    memcpy(&x0, xq[r] + b * QB + 8 * g, 4);
                    memcpy(&x1, xq[r] + b * QB + 8 * g + 4, 4);
                    const int8x16_t v0 = vreinterpretq_s8_s32(vdupq_n_s32(x0)), v1 = vreinterpretq_s8_s32(vdupq_n_s32(x1));
                    for (int j = 0; j < 4; j++) a[r][j] = vdotq_s32(vdotq_s32(a[r][j], lo[j], v0), hi[j], v1);
                }
            }
        }
        float32x4_t sc[4]; /* the block's 16 float16 scales */
        const float16x8_t s0 = vreinterpretq_f16_u8(vld1q_u8(blk)), s1 = vreinterpretq_f16_u8(vld1q_u8(blk + 16));
        sc[0] = vcvt_f32_f16(vget_low_f16(s0));
        sc[1] = vcvt_high_f32_f16(s0);
        sc[2] = vcvt_f32_f16(vget_low_f16(s1));
        sc[3] = vcvt_high_f32_f16(s1);
        for (int r = 0; r < RT; r++) {
            const float32x4_t d = vdupq_n_f32(dx[r][b]);
            for (int j = 0; j < 4; j++) t[r][j] = vfmaq_f32(t[r][j], vcvtq_f32_s32(a[r][j]), vmulq_f32(d, sc[j]));
        }
    }
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < 4; j++) vst1q_f32(outs[r] + 4 * j, t[r][j]);
}

#define QROWS_KERNEL qrows_sdot /* qrows below: up to 4 rows a call */
#else
static int qpanels_for(int kind, int R) { (void)kind; (void)R; return 1; }

/* the portable kernel: the same integer sums and float chain, one output at a time */
static void qrows(const int8_t *const *xq, const float *const *dx, const int32_t *const *xs, int R, const uint8_t *p,
                  int np, int64_t K, int kind, float *out, int64_t qs) {
    const int64_t nb = K / QB, bb = block_bytes(kind);
    const int o = weight_offset(kind);
    for (int r = 0; r < R; r++)
        for (int q = 0; q < np; q++)
            for (int c = 0; c < PANEL; c++) {
                float tot = 0.f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = p + q * qs + b * bb;
                    uint16_t s16;
                    memcpy(&s16, blk + 2 * c, 2);
                    int32_t dot = 0;
                    for (int k = 0; k < QB; k++) dot += wu(blk, kind, k, c) * (int32_t)xq[r][b * QB + k];
                    dot -= o * xs[r][b];
                    tot = fmaf((float)dot, dx[r][b] * half_to_float(s16), tot);
                }
                out[(r * np + q) * PANEL + c] = tot;
            }
}
#endif

#ifdef QROWS_KERNEL
/* R rows, np panels (panel q at p + q qs bytes): 4 rows at a time through QROWS_KERNEL (rows a constant in each
   case) */
static void qrows(const int8_t *const *xq, const float *const *dx, const int32_t *const *xs, int R, const uint8_t *p,
                  int np, int64_t K, int kind, float *out, int64_t qs) {
    const int64_t nb = K / QB;
#ifdef Q4ROW_KERNEL
    if (R == 1 && kind == ES_Q4 && (np == 2 || np == 4)) {
        if (np == 4) Q4ROW_KERNEL(xq, dx, xs, p, 4, nb, out, qs);
        else Q4ROW_KERNEL(xq, dx, xs, p, 2, nb, out, qs);
        return;
    }
#endif
    for (int q = 0; q < np; q++)
        for (int r0 = 0; r0 < R; r0 += 4) {
            float *outs[4];
            const int rt = R - r0 < 4 ? R - r0 : 4;
            for (int r = 0; r < rt; r++) outs[r] = out + ((r0 + r) * np + q) * PANEL;
            const int8_t *const *x = xq + r0;
            const float *const *d = dx + r0;
            const int32_t *const *xsum = xs + r0;
            switch (rt) {
            case 4: QROWS_KERNEL(x, d, xsum, 4, p + q * qs, nb, kind, outs); break;
            case 3: QROWS_KERNEL(x, d, xsum, 3, p + q * qs, nb, kind, outs); break;
            case 2: QROWS_KERNEL(x, d, xsum, 2, p + q * qs, nb, kind, outs); break;
            default: QROWS_KERNEL(x, d, xsum, 1, p + q * qs, nb, kind, outs);
            }
        }
}
#endif

/* a weight matrix as the kernels take it */
typedef struct {
    const void *w;
    int kind;
    int64_t K, N;
} es_mat;

static int64_t panel_bytes(const es_mat *a) {
    return a->kind == ES_F16 ? a->K * PANEL * 2 : (a->K / QB) * block_bytes(a->kind);
}

/* the panels per pass a one-row int4 product takes in this build now */
int es_q4_row_panels(void) { return qpanels_for(ES_Q4, 1); }

/* panels a pass over R rows takes, for this matrix's kind */
static int mat_panels_for(int kind, int R) { return kind == ES_F16 ? panels_for(R) : qpanels_for(kind, R); }

/* a block of rows of a product's input: floats, and (integer weights) their quantized form (quantize_row) */
typedef struct {
    const float *x[MAX_ROWS];
    const int8_t *xq[MAX_ROWS];
    const float *dx[MAX_ROWS];
    const int32_t *xs[MAX_ROWS];
} es_rows;

/* out[(r np + j) 16 + c] = row r (K) @ column c of panel p0 + j stride, for r < R, j < np: np is 1, or
   mat_panels_for(kind, R), or (R = 1, float16) up to 4 */
static void mat_rows(const es_mat *a, const es_rows *rows, int R, int64_t p0, int np, int64_t stride, float *out) {
    const uint8_t *p = (const uint8_t *)a->w + p0 * panel_bytes(a);
    const int64_t qs = stride * panel_bytes(a); /* bytes from one of the pass's panels to the next */
    if (a->kind == ES_F16) {
        const uint16_t *h = (const uint16_t *)p;
#ifdef ES_AVX512 /* one row takes rows_panels' 16-lane path: a conversion and an FMA per 16 weights */
        if (R == 1 && np != panels_for(1))
            for (int j = 0; j < np; j++) rows_panels(rows->x, 1, h + j * (qs / 2), 1, a->K, out + j * PANEL, qs / 2);
        else rows_panels(rows->x, R, h, np, a->K, out, qs / 2);
#else
        if (R == 1 && np <= 4) row_panels(rows->x[0], h, np, a->K, out, qs / 2);
        else rows_panels(rows->x, R, h, np, a->K, out, qs / 2);
#endif
    } else
        qrows(rows->xq, rows->dx, rows->xs, R, p, np, a->K, a->kind, out, qs);
}

/* ---- the pool: jobs of independent chunks, claimed one at a time ----

   A job is n chunks. Each thread claims the next chunk (one atomic counter), computes it into its own
   scratch (run_chunk), then commits it (write_chunk) if nobody has: a chunk's state word holds the sequence
   number of the last job that committed it, and a compare-and-swap from an older number to this job's makes
   exactly one committer. The caller (the thread in es_forward) claims chunks like the helpers; once none is
   left it waits for the claimed ones, and after a short wait computes the ones still uncommitted itself:
   a helper the OS has descheduled holds the step up for that wait, not for its time slice. Its late result
   loses the compare-and-swap and is dropped, and its reads of buffers the caller has since moved on from
   are harmless (they are computed into its own scratch and never committed). Python calls es_quiesce()
   before it frees a buffer a helper may still be reading. Helpers spin briefly between jobs, then sleep. */
#define ES_MAX_THREADS 64
#define IDX_BITS 24 /* chunks per job < 2^24; the job number takes the other 40 bits */
#define IDX_MASK ((UINT64_C(1) << IDX_BITS) - 1)
#define SPIN_NS 100000 /* a helper spins this long for the next job before it sleeps */
#ifndef ES_MIN_PARALLEL /* the tests' -DES_MIN_PARALLEL=1: every job of more than one chunk on the pool */
#define ES_MIN_PARALLEL 300000
#endif
#define MIN_PARALLEL ES_MIN_PARALLEL /* multiply-adds below which a job runs on the caller alone: handing out a few
                                        microseconds of work costs more than it saves */

enum { J_NORM, J_ADDNORM, J_MATMUL, J_KV, J_ATTN, J_ACT, J_ARGMAX, J_QUANT, J_KINDS };

typedef struct { /* one es_forward call */
    const es_model *m;
    int64_t B, S, T, cap, NQKV; /* T = B S rows */
    int64_t gs, ss;             /* attention: query heads per chunk (attn_group), and its scores' row stride */
    const int64_t *start;
    float *const *kc, *const *vc;
    float *x, *h, *qkv, *att, *gu, *act, *rc, *logits;
    int64_t *next_ids;
    int8_t *xq; /* (T, K) a product's input quantized for integer weights (J_QUANT), with per block */
    float *xd;  /* (T, K / QB) its scale */
    int32_t *xs; /* (T, K / QB) and the sum of its values */
} es_call;

typedef struct {
    int kind, active;        /* active: threads taking part (the caller is thread 0) */
    int64_t n, local;        /* chunks; floats of scratch a chunk needs */
    int64_t cost;            /* about how many multiply-adds the job takes (MIN_PARALLEL) */
    _Atomic uint64_t *state; /* (n) per chunk: the last job that committed it */
    es_call c;
    int64_t l;               /* layer */
    const float *src, *w, *bias; /* J_NORM, J_ADDNORM: rows of src normed by w; J_MATMUL: src @ mat + bias */
    float *dst;              /* J_NORM: dst = ..; J_ADDNORM: dst += ..; J_MATMUL: dst = or += (residual) */
    es_mat mat;
    int residual, np, kw;    /* J_MATMUL: panels per chunk; panels per kernel pass (np is a multiple) */
    int64_t lq, sp, cps;     /* J_MATMUL, split streams (lq > 0): panels per stream, per stream and chunk; chunks
                                per thread's share (job_matmul) */
    int quant;               /* J_NORM, J_ACT: each written row also quantized (J_QUANT's output) for the integer
                                product that reads it next, which then skips its own J_QUANT job */
    int64_t row_groups;      /* J_MATMUL: chunks per panel group (of MAX_ROWS rows) */
} es_job;

/* A job's chunks are split into one contiguous range per taking-part thread. A thread claims its own range's
   chunks from the front, in order, so it streams its share of a matrix as one address sequence that the hardware
   prefetcher follows across chunk boundaries; when its range is empty it takes other ranges' chunks from their
   back, so a descheduled or slower thread's share is still spread over the others. One word per range, on its
   own cache line: job tag (16 bits) | front (24) | back (24). The tag keeps a claim by a thread that still holds
   an old job from moving a new job's cursors in all but one of 65536 jobs, and that one is harmless: a chunk
   claimed under an old job is never committed for the new one, and the caller computes the chunks left
   uncommitted (run_job_timed). */
typedef struct {
    _Alignas(64) _Atomic uint64_t w;
} es_range;

typedef struct {
    _Atomic uint64_t claim;       /* job number << IDX_BITS (a new job's announcement; chunks: `range`) */
    es_range range[ES_MAX_THREADS];
    _Atomic uint64_t version;     /* 2 x the job number whose description is in `job`; odd while written */
    _Atomic int64_t done;         /* chunks committed in the current job */
    _Atomic uint32_t wake;        /* futex word, bumped for each job */
    _Atomic int sleepers;
    _Atomic int busy[ES_MAX_THREADS];
    es_job job;
    uint64_t seq;                 /* the caller's: the last job number */
    int started;                  /* helpers running (threads 1..started) */
    _Atomic uint64_t *state;
    int64_t state_cap;
    float *local[ES_MAX_THREADS];
    int64_t local_cap[ES_MAX_THREADS];
    pthread_mutex_t lock;         /* one es_forward at a time uses the pool; another runs on its own thread */
} es_pool;

static es_pool pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* The next matrix product's weights, for helpers with nothing to do. While the caller runs the small jobs between
   two products alone (norms, the cache rows, the activation), and while the host runs between two calls, the
   memory bus is idle: a waiting helper asks for the first ES_IDLE_PF bytes of the share of the next product that
   it will stream itself (thread t of n: bytes [t B / n, (t + 1) B / n), as run_job_timed splits the chunks), so
   that share starts from its cache and the helper then takes more of the caller's share from its back. es_forward
   names the next product after each one (idle_ahead). A hint read while it changes only sends a few requests to
   the wrong lines (a prefetch never faults). -DES_IDLE_PF=0: none. */
#ifndef ES_IDLE_PF
#define ES_IDLE_PF (128 << 10)
#endif
#ifndef ES_IDLE_PF_LINES /* lines asked for between two looks for a job */
#define ES_IDLE_PF_LINES 1
#endif
typedef struct {
    _Alignas(64) _Atomic uint64_t gen; /* bumped for each new hint */
    _Atomic uintptr_t p;
    _Atomic int64_t bytes;
    _Atomic int threads;
} es_ahead;
static es_ahead ahead;

static void idle_ahead(int pooled, int threads, const void *w, int64_t bytes) {
    if (!ES_IDLE_PF || !pooled || threads < 2 || atomic_load_explicit(&ahead.p, memory_order_relaxed) == (uintptr_t)w)
        return;
    atomic_store_explicit(&ahead.p, (uintptr_t)w, memory_order_relaxed);
    atomic_store_explicit(&ahead.bytes, bytes, memory_order_relaxed);
    atomic_store_explicit(&ahead.threads, threads, memory_order_relaxed);
    atomic_fetch_add_explicit(&ahead.gen, 1, memory_order_release);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *w, uint32_t val) {
#ifdef __linux__
    struct timespec t = {0, 50000000}; /* 50 ms: a lost wake-up costs at most this */
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT_PRIVATE, val, &t, NULL, 0);
#else
    (void)w; (void)val;
    struct timespec t = {0, 50000};
    nanosleep(&t, NULL);
#endif
}

static void futex_wake_all(_Atomic uint32_t *w) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, 1 << 30, NULL, NULL, 0);
#else
    (void)w;
#endif
}

/* thread tid's scratch of at least n floats (each thread grows only its own) */
static float *local_buf(int tid, int64_t n) {
    if (pool.local_cap[tid] < n) {
        float *p = (float *)realloc(pool.local[tid], (size_t)n * sizeof(float));
        if (!p) return NULL;
        pool.local[tid] = p;
        pool.local_cap[tid] = n;
    }
    return pool.local[tid];
}

static void run_chunk(const es_job *j, int64_t i, float *local);
static void write_chunk(const es_job *j, int64_t i, const float *local);

static int commit_chunk(const es_job *j, uint64_t s, int64_t i, const float *local) {
    uint64_t v = atomic_load_explicit(&j->state[i], memory_order_acquire);
    while (v < s)
        if (atomic_compare_exchange_weak(&j->state[i], &v, s)) {
            write_chunk(j, i, local);
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
            return 1;
        }
    return 0;
}

static _Atomic int64_t stolen; /* chunks the caller computed after a helper had claimed them (es_stolen) */

/* claim, compute and commit chunks of job s until none is left (tid: 0 the caller, else a helper): -> chunks
   computed */
#define TAG(s) ((uint64_t)(s) & 0xFFFF)
static uint64_t range_word(uint64_t s, int64_t front, int64_t back) {
    return TAG(s) << 48 | (uint64_t)front << IDX_BITS | (uint64_t)back;
}

/* the next chunk of job s for thread tid of `active`: its own range's front, else another range's back; -1 when
   every range is empty */
static int64_t claim(uint64_t s, int tid, int active) {
    for (int k = 0; k < active; k++) {
        _Atomic uint64_t *w = &pool.range[(tid + k) % active].w;
        uint64_t v = atomic_load_explicit(w, memory_order_acquire);
        for (;;) {
            const int64_t front = (int64_t)(v >> IDX_BITS & IDX_MASK), back = (int64_t)(v & IDX_MASK);
            if (v >> 48 != TAG(s) || front >= back) break;
            const uint64_t next = k == 0 ? range_word(s, front + 1, back) : range_word(s, front, back - 1);
            if (atomic_compare_exchange_weak_explicit(w, &v, next, memory_order_acq_rel, memory_order_acquire))
                return k == 0 ? front : back - 1;
        }
    }
    return -1;
}

#ifdef ES_TEST_CLAIMS /* the tests' build: the claims of the pool's jobs in the order they were made */
#define CLAIM_LOG 4096
static _Atomic int64_t claim_log[CLAIM_LOG], claim_count;
/* out (2 n): thread and chunk of the first claims since the last call, -> how many were made (may exceed n) */
int64_t es_claims(int64_t *out, int64_t n) {
    const int64_t c = atomic_exchange(&claim_count, 0);
    for (int64_t i = 0; i < n && i < c && i < CLAIM_LOG; i++) {
        const int64_t v = atomic_load(&claim_log[i]);
        out[2 * i] = v >> 32, out[2 * i + 1] = v & 0xFFFFFFFF;
    }
    return c;
}
#endif

static int64_t work(const es_job *j, uint64_t s, float *local, int tid) {
    int64_t count = 0;
    for (;;) {
        if ((atomic_load_explicit(&pool.claim, memory_order_acquire) >> IDX_BITS) != s) return count;
        const int64_t i = claim(s, tid, j->active);
        if (i < 0) return count;
#ifdef ES_TEST_CLAIMS
        const int64_t at = atomic_fetch_add(&claim_count, 1);
        if (at < CLAIM_LOG) atomic_store(&claim_log[at], (int64_t)tid << 32 | i);
#endif
        run_chunk(j, i, local);
#ifdef ES_TEST_STALL /* the tests' build: a helper "descheduled" for 2 ms in every 3rd chunk it holds */
        if (tid && i % 3 == 1) {
            struct timespec t = {0, 2000000};
            nanosleep(&t, NULL);
        }
#else
        (void)tid;
#endif
        commit_chunk(j, s, i, local);
        count++;
    }
}

int64_t es_stolen(void) { return atomic_load(&stolen); }

/* for the loader: sizeof es_model and where its pointers start (native.py checks its ctypes copy) */
int64_t es_model_layout(int64_t *inv_freq_offset) {
    *inv_freq_offset = (int64_t)offsetof(es_model, inv_freq);
    return (int64_t)sizeof(es_model);
}

static void *helper_main(void *arg) {
    const int tid = (int)(intptr_t)arg;
    uint64_t seen = 0, pf_gen = 0;
    const char *pf_base = NULL;
    int64_t pf_at = 0, pf_end = 0; /* the idle hint's lines this thread asks for (ahead) */
    es_job j;
    for (;;) {
        const uint64_t s = atomic_load_explicit(&pool.claim, memory_order_acquire) >> IDX_BITS;
        if (s != seen) {
            seen = s;
            atomic_store(&pool.busy[tid], 1);
            /* the job's description, checked against its version: a copy taken while the caller wrote the
               next one is dropped */
            if (atomic_load_explicit(&pool.version, memory_order_acquire) == 2 * s) {
                memcpy(&j, &pool.job, sizeof j);
                atomic_thread_fence(memory_order_acquire);
                if (atomic_load_explicit(&pool.version, memory_order_relaxed) == 2 * s && tid < j.active) {
                    float *local = local_buf(tid, j.local);
                    if (local) work(&j, s, local, tid);
                }
            }
            atomic_store(&pool.busy[tid], 0);
            continue;
        }
        const int64_t t0 = now_ns();
        for (int k = 1;; k++) { /* spin for the next job (asking for the next product's lines), then sleep */
            if ((atomic_load_explicit(&pool.claim, memory_order_acquire) >> IDX_BITS) != seen) break;
            if (ES_IDLE_PF) {
                const uint64_t g = atomic_load_explicit(&ahead.gen, memory_order_acquire);
                if (g != pf_gen) { /* a new hint: this thread's share of it */
                    const int n = atomic_load_explicit(&ahead.threads, memory_order_relaxed);
                    const int64_t b = atomic_load_explicit(&ahead.bytes, memory_order_relaxed);
                    pf_gen = g;
                    pf_base = (const char *)atomic_load_explicit(&ahead.p, memory_order_relaxed);
                    pf_at = tid < n ? b * tid / n / 64 * 64 : 0;
                    pf_end = tid < n ? b * (tid + 1) / n : 0;
                    pf_end = pf_end - pf_at > ES_IDLE_PF ? pf_at + ES_IDLE_PF : pf_end;
                }
                if (pf_at < pf_end) { /* a few lines at a time, then look for a job again */
                    for (int q = 0; q < ES_IDLE_PF_LINES && pf_at < pf_end; q++, pf_at += 64)
                        __builtin_prefetch(pf_base + pf_at, 0, 2);
                    continue;
                }
            }
            if ((k & 63) == 0 && now_ns() - t0 > SPIN_NS) {
                atomic_fetch_add(&pool.sleepers, 1);
                const uint32_t w = atomic_load(&pool.wake);
                if ((atomic_load(&pool.claim) >> IDX_BITS) == seen) futex_wait(&pool.wake, w);
                atomic_fetch_sub(&pool.sleepers, 1);
                break;
            }
            cpu_relax();
        }
    }
    return NULL;
}

static void after_fork_child(void) { /* the child has no helpers: every job runs on its caller */
    pool.started = 0;
    for (int i = 0; i < ES_MAX_THREADS; i++) atomic_store(&pool.busy[i], 0);
    atomic_store(&pool.sleepers, 0);
    pthread_mutex_init(&pool.lock, NULL);
}

/* helpers 1..want-1 running (called with pool.lock held) -> threads available */
static int start_helpers(int want) {
    static int registered = 0;
    if (!registered) {
        pthread_atfork(NULL, NULL, after_fork_child);
        registered = 1;
    }
    if (want > ES_MAX_THREADS) want = ES_MAX_THREADS;
    while (pool.started + 1 < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, helper_main, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.started++;
    }
    return pool.started + 1;
}

/* waits until no helper is inside a job: then no helper reads any buffer of an earlier call */
void es_quiesce(void) {
    for (int i = 1; i < ES_MAX_THREADS; i++)
        while (atomic_load(&pool.busy[i])) sched_yield();
}

/* runs job j: on the pool (pooled: pool.lock held), or here alone with `local` as scratch */
/* es_profile's counters, per job kind: jobs run, nanoseconds in them (the caller's wall time), and of those
   the nanoseconds the caller spent waiting for helpers after its own chunks ran out */
static _Atomic int64_t prof_jobs[J_KINDS], prof_ns[J_KINDS], prof_wait_ns[J_KINDS];

static void run_job_timed(es_job *j, int pooled, float *local);

static void run_job(es_job *j, int pooled, float *local) {
    const int64_t t0 = now_ns();
    run_job_timed(j, pooled, local);
    atomic_fetch_add_explicit(&prof_jobs[j->kind], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&prof_ns[j->kind], now_ns() - t0, memory_order_relaxed);
}

/* out (3 J_KINDS): the counters since the last reset (jobs, ns, wait ns per kind: J_NORM, J_ADDNORM, J_MATMUL,
   J_KV, J_ATTN, J_ACT, J_ARGMAX, J_QUANT); reset: zero them after reading. -> J_KINDS */
int es_profile(int64_t *out, int reset) {
    for (int k = 0; k < J_KINDS; k++) {
        out[k] = reset ? atomic_exchange(&prof_jobs[k], 0) : atomic_load(&prof_jobs[k]);
        out[J_KINDS + k] = reset ? atomic_exchange(&prof_ns[k], 0) : atomic_load(&prof_ns[k]);
        out[2 * J_KINDS + k] = reset ? atomic_exchange(&prof_wait_ns[k], 0) : atomic_load(&prof_wait_ns[k]);
    }
    return J_KINDS;
}

static void run_job_timed(es_job *j, int pooled, float *local) {
    if (j->n <= 0) return;
    if (!pooled || j->n == 1 || j->cost < MIN_PARALLEL || j->n > (int64_t)IDX_MASK) { /* (more chunks than a claim
                                                                                        word counts: alone) */
        if (pooled) local = local_buf(0, j->local);
        for (int64_t i = 0; i < j->n; i++) {
            run_chunk(j, i, local);
            write_chunk(j, i, local);
        }
        return;
    }
    if (pool.state_cap < j->n) { /* a bigger state array; the old one stays allocated (a late helper may hold it) */
        int64_t cap = j->n > 2 * pool.state_cap ? j->n : 2 * pool.state_cap;
        _Atomic uint64_t *st = (_Atomic uint64_t *)calloc((size_t)cap, sizeof(uint64_t));
        if (!st) { /* no memory for it: run alone */
            run_job_timed(j, 0, local_buf(0, j->local));
            return;
        }
        pool.state = st;
        pool.state_cap = cap;
    }
    j->state = pool.state;
    const uint64_t s = ++pool.seq;
    atomic_store_explicit(&pool.version, 2 * s - 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    pool.job = *j;
    atomic_store_explicit(&pool.version, 2 * s, memory_order_release);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    for (int t = 0; t < j->active; t++) /* thread t's share: chunks [t n / active, (t + 1) n / active) */
        atomic_store_explicit(&pool.range[t].w, range_word(s, t * j->n / j->active, (t + 1) * j->n / j->active),
                              memory_order_relaxed);
    atomic_store_explicit(&pool.claim, s << IDX_BITS, memory_order_seq_cst);
    atomic_fetch_add(&pool.wake, 1);
    if (atomic_load(&pool.sleepers) > 0) futex_wake_all(&pool.wake);
    local = local_buf(0, j->local);
    const int64_t t0 = now_ns();
    const int64_t mine = work(j, s, local, 0);
    /* the helpers' claimed chunks: wait about 4 of this thread's chunks (at least 20 us), then compute them */
    const int64_t per = mine ? (now_ns() - t0) / mine : 20000;
    const int64_t patience = 4 * per > 20000 ? 4 * per : 20000, t1 = now_ns();
    int took_over = 0;
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < j->n) {
        if (!took_over && now_ns() - t1 > patience) {
            for (int64_t i = 0; i < j->n; i++)
                if (atomic_load_explicit(&j->state[i], memory_order_acquire) < s) {
                    run_chunk(j, i, local);
                    if (commit_chunk(j, s, i, local)) atomic_fetch_add(&stolen, 1);
                }
            took_over = 1;
        }
        cpu_relax();
    }
    atomic_fetch_add_explicit(&prof_wait_ns[j->kind], now_ns() - t1, memory_order_relaxed);
}

/* ---- the chunks of each job ---- */

static int matmul_fits(int kind, int R, int np) {
    if (kind == ES_F16 && R == 1) return np <= 4;
    return np == mat_panels_for(kind, R);
}

/* A matrix product's chunk g into local[(r np + j) 16 + c] (rows r of its row group, rows->x ..). A pass reads one
   panel from each of kw address streams. Split (job_matmul, short panels): each stream runs through a kw-th of the
   thread's share, chunk after chunk. Consecutive (long panels, and -DES_STREAM_SPLIT=0): a chunk is np consecutive
   panels and a pass kw consecutive ones, so every stream jumps kw panels at each pass's end. Short panels paid for
   those jumps: on the Intel VM a one-row int4 product over 8 KB panels (K = 896) read 29 GB/s that way, where
   43 KB panels (K = 4864) read 34 (bench/results/NOTES.md, "split streams"). */
/* split streams: share t = g / cps is kw streams of lq consecutive panels, stream q from panel (t kw + q) lq;
   chunk g, the cc-th of its share, takes panels cc sp .. cc sp + len - 1 of each. -> len; *base: stream 0's first */
static int64_t split_span(const es_job *j, int64_t g, int64_t *base) {
    const int64_t t = g / j->cps, cc = g % j->cps;
    *base = t * j->kw * j->lq + cc * j->sp;
    return j->lq - cc * j->sp < j->sp ? j->lq - cc * j->sp : j->sp;
}

static void chunk_split(const es_job *j, int64_t g, const es_rows *rows, int rows_n, float *local) {
    /* len passes, each one panel of every stream */
    const es_mat *a = &j->mat;
    const int64_t panels = a->N / PANEL, L = j->lq, S = j->sp;
    int64_t base;
    const int64_t len = split_span(j, g, &base);
    const int full = matmul_fits(a->kind, rows_n, j->kw);
    for (int64_t k = 0; k < len; k++) {
        int w = 0; /* the streams that hold a panel at this offset (the matrix ends inside the last share) */
        while (w < j->kw && base + w * L + k < panels) w++;
        const int n = w == j->kw && full ? w : 1; /* one pass over every stream, else one panel at a time */
        for (int q0 = 0; q0 < w; q0 += n) {
            float tmp[MAX_ROWS * 8 * PANEL];
            mat_rows(a, rows, rows_n, base + q0 * L + k, n, L, tmp);
            for (int r = 0; r < rows_n; r++)
                for (int q = 0; q < n; q++)
                    memcpy(local + (r * j->np + (q0 + q) * S + k) * PANEL, tmp + (r * n + q) * PANEL,
                           PANEL * sizeof(float));
        }
    }
}

static void chunk_consecutive(const es_job *j, int64_t g, const es_rows *rows, int rows_n, float *local) {
    const es_mat *a = &j->mat;
    const int64_t panels = a->N / PANEL, p0 = g * j->np;
    float tmp[MAX_ROWS * 8 * PANEL];
    for (int64_t q = p0; q < p0 + j->np && q < panels;) {
        const int np = (panels - q >= j->kw && matmul_fits(a->kind, rows_n, j->kw)) ? j->kw : 1;
        mat_rows(a, rows, rows_n, q, np, 1, tmp);
        for (int r = 0; r < rows_n; r++)
            memcpy(local + (r * j->np + (q - p0)) * PANEL, tmp + r * np * PANEL, (size_t)np * PANEL * sizeof(float));
        q += np;
    }
}

static void run_chunk(const es_job *j, int64_t i, float *local) {
    const es_call *c = &j->c;
    const es_model *m = c->m;
    const int64_t E = m->E, H = m->H, Hkv = m->Hkv, D = m->D, I = m->I, V = m->V, R = m->R, T = c->T;
    switch (j->kind) {
    case J_NORM:
    case J_ADDNORM:
        norm_row(j->src + i * E, j->w, E, m->eps, local);
        break;
    case J_MATMUL: { /* rows rg MAX_ROWS.. of panels g np..: local[(r np + q) 16 + c] */
        const es_mat *a = &j->mat;
        const int64_t g = i / j->row_groups, s0 = (i % j->row_groups) * MAX_ROWS;
        const int rows_n = T - s0 < MAX_ROWS ? (int)(T - s0) : MAX_ROWS;
        es_rows rows;
        for (int r = 0; r < MAX_ROWS; r++) {
            const int64_t row = s0 + (r < rows_n ? r : 0);
            rows.x[r] = j->src + row * a->K;
            rows.xq[r] = c->xq + row * a->K;
            rows.dx[r] = c->xd + row * (a->K / QB);
            rows.xs[r] = c->xs + row * (a->K / QB);
        }
        if (j->lq) chunk_split(j, g, &rows, rows_n, local);
        else chunk_consecutive(j, g, &rows, rows_n, local);
        break;
    }
    case J_KV: { /* kv head kh, row r: local = its key (normed, rotated), then its value */
        const int64_t kh = i / T, r = i % T, s = r % c->S;
        const float *src = c->qkv + r * c->NQKV;
        const int64_t rj = m->layer_rope ? m->layer_rope[j->l] : (m->n_ropes ? 0 : -1);
        memcpy(local, src + H * D + kh * D, D * sizeof(float));
        memcpy(local + D, src + (H + Hkv) * D + kh * D, D * sizeof(float));
        if (m->kn) norm_row(local, m->kn[j->l], D, m->eps, local);
        if (rj >= 0) {
            const float *lrc = c->rc + (rj * T + r) * R;
            rope(local, R, lrc, lrc + R / 2);
        }
        (void)s;
        break;
    }
    case J_ATTN: { /* heads hh0..hh0+GS-1 (one kv head's), row r (sequence b, position pos) over its rows
                      lo..pos: local = the outputs (GS, D), then the scores (GS, ss) */
        const int64_t GS = c->gs, ss = c->ss, hh0 = i / T * GS, r = i % T, b = r / c->S, pos = c->start[b] + r % c->S;
        const int64_t kh = hh0 / (H / Hkv), win = m->layer_window ? m->layer_window[j->l] : 0;
        const int64_t lo = win && pos + 1 > win ? pos + 1 - win : 0, n = pos + 1 - lo;
        const int64_t rj = m->layer_rope ? m->layer_rope[j->l] : (m->n_ropes ? 0 : -1);
        float q[ATT_GROUP_MAX * 512], *sc = local + GS * D;
        for (int64_t g = 0; g < GS; g++) {
            float *qg = q + g * D;
            memcpy(qg, c->qkv + r * c->NQKV + (hh0 + g) * D, D * sizeof(float));
            if (m->qn) norm_row(qg, m->qn[j->l], D, m->eps, qg);
            if (rj >= 0) {
                const float *lrc = c->rc + (rj * T + r) * R;
                rope(qg, R, lrc, lrc + R / 2);
            }
            for (int64_t d = 0; d < D; d++) qg[d] *= m->attn_scale;
        }
        const float *K = c->kc[b * m->L + j->l] + (kh * c->cap + lo) * D;
        const float *Vv = c->vc[b * m->L + j->l] + (kh * c->cap + lo) * D;
        for (int64_t t = 0; t < ATT_PF_ROWS * ES_ATTN_PF && t < n; t++) /* the first rows; group_scores asks for
                                                                          the rest */
            for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(K + t * D + d);
        group_scores(q, (int)GS, K, n, D, sc, ss, Vv);
        for (int64_t g = 0; g < GS; g++) {
            float *sg = sc + g * ss, mx = -INFINITY;
            for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
            const float sum = exp_shift(sg, n, mx);
            for (int64_t t = 0; t < n; t++) sg[t] = sg[t] / sum;
        }
        group_weighted(sc, ss, (int)GS, Vv, n, D, local);
        break;
    }
    case J_ACT:
        if (m->act == ES_GELU_TANH) gelu_mul(c->gu + i * 2 * I, c->gu + i * 2 * I + I, local, I);
        else silu_mul(c->gu + i * 2 * I, c->gu + i * 2 * I + I, local, I);
        break;
    case J_QUANT: { /* row i of src (K = j->mat.K): local = its int8 values, then the blocks' scales and sums */
        const int64_t K = j->mat.K;
        quantize_row(j->src + i * K, K, (int8_t *)local, local + K / 4, (int32_t *)(local + K / 4 + K / QB));
        break;
    }
    case J_ARGMAX: {
        const float *row = c->logits + i * V;
        float total = 0.f;
        for (int64_t v = 0; v < V; v++) total += row[v];
        int64_t best = m->argmax_lo;
        for (int64_t v = m->argmax_lo + 1; v < m->argmax_hi; v++)
            if (row[v] > row[best]) best = v;
        best = isfinite(total) ? best : -1;
        memcpy(local, &best, sizeof best);
        break;
    }
    }
}

static void write_chunk(const es_job *j, int64_t i, const float *local) {
    const es_call *c = &j->c;
    const es_model *m = c->m;
    const int64_t E = m->E, H = m->H, D = m->D, I = m->I, T = c->T;
    switch (j->kind) {
    case J_NORM:
        memcpy(j->dst + i * E, local, E * sizeof(float));
        if (j->quant) quantize_row(j->dst + i * E, E, c->xq + i * E, c->xd + i * (E / QB), c->xs + i * (E / QB));
        break;
    case J_ADDNORM:
        for (int64_t e = 0; e < E; e++) j->dst[i * E + e] += local[e];
        break;
    case J_MATMUL: {
        const es_mat *a = &j->mat;
        const int64_t panels = a->N / PANEL, g = i / j->row_groups, s0 = (i % j->row_groups) * MAX_ROWS;
        const int64_t rows_n = T - s0 < MAX_ROWS ? T - s0 : MAX_ROWS;
        if (j->lq) { /* split: each stream's len panels from base + q lq (chunk_split) */
            int64_t base;
            const int64_t len = split_span(j, g, &base);
            for (int q = 0; q < j->kw; q++) {
                const int64_t p0 = base + q * j->lq, np = panels - p0 < len ? panels - p0 : len;
                for (int64_t r = 0; np > 0 && r < rows_n; r++)
                    put(j->dst + (s0 + r) * a->N + p0 * PANEL, local + (r * j->np + q * j->sp) * PANEL,
                        (int)(np * PANEL), j->residual, j->bias ? j->bias + p0 * PANEL : NULL);
            }
            break;
        }
        const int64_t p0 = g * j->np, np = panels - p0 < j->np ? panels - p0 : j->np; /* consecutive */
        for (int64_t r = 0; r < rows_n; r++)
            put(j->dst + (s0 + r) * a->N + p0 * PANEL, local + r * j->np * PANEL, (int)(np * PANEL), j->residual,
                j->bias ? j->bias + p0 * PANEL : NULL);
        break;
    }
    case J_KV: {
        const int64_t kh = i / T, r = i % T, b = r / c->S, row = c->start[b] + r % c->S;
        memcpy(c->kc[b * m->L + j->l] + (kh * c->cap + row) * D, local, D * sizeof(float));
        memcpy(c->vc[b * m->L + j->l] + (kh * c->cap + row) * D, local + D, D * sizeof(float));
        break;
    }
    case J_ATTN: {
        const int64_t r = i % T;
        memcpy(c->att + r * H * D + i / T * c->gs * D, local, c->gs * D * sizeof(float));
        break;
    }
    case J_ACT:
        memcpy(c->act + i * I, local, I * sizeof(float));
        if (j->quant) quantize_row(c->act + i * I, I, c->xq + i * I, c->xd + i * (I / QB), c->xs + i * (I / QB));
        break;
    case J_ARGMAX:
        memcpy(c->next_ids + i, local, sizeof(int64_t));
        break;
    case J_QUANT: {
        const int64_t K = j->mat.K;
        memcpy(c->xq + i * K, local, (size_t)K);
        memcpy(c->xd + i * (K / QB), local + K / 4, (size_t)(K / QB) * sizeof(float));
        memcpy(c->xs + i * (K / QB), local + K / 4 + K / QB, (size_t)(K / QB) * sizeof(int32_t));
        break;
    }
    }
}

/* ---- one call ---- */

#ifndef ES_FUSE_QUANT /* -DES_FUSE_QUANT=0: every integer product quantizes its input in a job of its own */
#define ES_FUSE_QUANT 1
#endif

typedef struct { /* how es_forward runs its jobs */
    es_call c;
    int pooled, threads;
    float *local; /* scratch when not pooled */
} es_runner;

/* u on the pool when threads > 1 and no other call holds it, else alone on a scratch of `local` floats of its
   own: 0, or -2 when that cannot be allocated */
static int runner_begin(es_runner *u, int threads, int64_t local) {
    u->threads = threads < 1 ? 1 : threads;
    u->pooled = u->threads > 1 && pthread_mutex_trylock(&pool.lock) == 0;
    if (u->pooled) {
        u->threads = start_helpers(u->threads);
        if (!local_buf(0, local)) u->threads = 1;
    }
    if (!u->pooled || u->threads == 1) {
        if (u->pooled) pthread_mutex_unlock(&pool.lock);
        u->pooled = 0, u->threads = 1;
        u->local = (float *)malloc((size_t)local * sizeof(float));
        if (!u->local) return -2;
    }
    return 0;
}

static void runner_end(es_runner *u) {
    if (u->pooled) pthread_mutex_unlock(&pool.lock);
    else free(u->local);
}

static void job_rows(es_runner *u, int kind, int64_t l, int64_t n, int64_t local, int64_t cost, const float *src,
                     const float *w, float *dst, int quant) {
    es_job j;
    memset(&j, 0, sizeof j);
    j.kind = kind, j.active = u->threads, j.n = n, j.local = local, j.cost = cost, j.c = u->c, j.l = l;
    j.src = src, j.w = w, j.dst = dst, j.quant = quant;
    run_job(&j, u->pooled, u->local);
}

/* dst (T, N) [+]= src (T, K) @ a (+ bias); quantized: the job before wrote src's quantized rows too (J_NORM,
   J_ACT with quant) */
static void job_matmul(es_runner *u, const float *src, const void *w, int kind, int64_t K, int64_t N, float *dst,
                       int residual, const float *bias, int quantized) {
    es_job j;
    memset(&j, 0, sizeof j);
    const int64_t T = u->c.T, panels = N / PANEL;
    j.kind = J_MATMUL, j.active = u->threads, j.c = u->c, j.src = src, j.dst = dst, j.bias = bias;
    j.residual = residual;
    j.mat.w = w, j.mat.kind = kind, j.mat.K = K, j.mat.N = N;
    /* kernel passes: one row, 4 panels (float16: 8 chains in flight; integer: 4 of 16 lanes), else the kernel's
       width. A chunk is several passes over consecutive panels, which lie one after another in memory, and
       a thread takes its own share's chunks in order (es_range), so its stream runs on across them; a
       chunk is still CHUNK_MIN_BYTES or more, and there are up to CHUNKS_PER_THREAD per thread, so a thread
       that finishes early takes work from the back of another's share in pieces that even out their
       finishing times. */
    j.kw = T == 1 ? (kind == ES_F16 ? 4 : mat_panels_for(kind, 1)) : mat_panels_for(kind, T < MAX_ROWS ? (int)T : MAX_ROWS);
    j.row_groups = (T + MAX_ROWS - 1) / MAX_ROWS;
    int64_t per_thread = panels * panel_bytes(&j.mat) / ((int64_t)u->threads * CHUNK_MIN_BYTES);
    per_thread = per_thread < 1 ? 1 : per_thread > CHUNKS_PER_THREAD ? CHUNKS_PER_THREAD : per_thread;
    if (ES_STREAM_SPLIT && panel_bytes(&j.mat) <= ES_SPLIT_PANEL_MAX) {
        /* split streams (chunk_split): thread t's share (as run_job_timed splits the chunks) is kw streams of lq
           consecutive panels, and each of its chunks takes the next sp panels of every stream, so the kernel's
           address streams run on from one chunk to the next through the whole share, and a chunk's size sets only
           how finely the threads' finishing times even out. Only short panels gain: on the Intel VM int4 (8 KB)
           and int8 (15 KB) panels read 1-4% faster a step, float16 ones (28 KB) 2-5% slower. */
        j.lq = (panels + (int64_t)u->threads * j.kw - 1) / ((int64_t)u->threads * j.kw);
        j.sp = (j.lq + per_thread - 1) / per_thread;
        j.sp = j.sp > CHUNK_PANELS_MAX / j.kw ? CHUNK_PANELS_MAX / j.kw : j.sp;
        j.cps = (j.lq + j.sp - 1) / j.sp;
        j.np = (int)(j.kw * j.sp);
        j.n = u->threads * j.cps * j.row_groups;
    } else { /* consecutive: chunks of np panels (chunk_consecutive) */
        int64_t np = (panels + per_thread * u->threads - 1) / (per_thread * u->threads);
        np = (np + j.kw - 1) / j.kw * j.kw;
        j.np = (int)(np < j.kw ? j.kw : np > CHUNK_PANELS_MAX ? CHUNK_PANELS_MAX / j.kw * j.kw : np);
        j.n = (panels + j.np - 1) / j.np * j.row_groups;
    }
    j.local = MAX_ROWS * CHUNK_PANELS_MAX * PANEL;
    j.cost = T * K * N;
    if (kind != ES_F16 && !quantized) { /* the input rows quantized first (K is a multiple of QB: native.py checks) */
        es_job qj;
        memset(&qj, 0, sizeof qj);
        qj.kind = J_QUANT, qj.active = u->threads, qj.n = T, qj.local = K / 4 + 2 * (K / QB), qj.cost = 4 * T * K;
        qj.c = u->c, qj.src = src, qj.mat.K = K;
        run_job(&qj, u->pooled, u->local);
    }
    run_job(&j, u->pooled, u->local);
}

static int64_t widest_input(const es_model *m) { /* the largest K of a layer's products */
    int64_t k = m->E > m->H * m->D ? m->E : m->H * m->D;
    return k > m->I ? k : m->I;
}

int64_t es_scratch_floats(const es_model *m, int64_t T) {
    const int64_t qkv = (m->H + 2 * m->Hkv) * m->D, K = widest_input(m);
    return T * (2 * m->E + qkv + m->H * m->D + 2 * m->I + m->I + m->n_ropes * m->R) /* x h qkv att gu act rc */
           + 2 * T * (K / QB + 1) + (T * K + 3) / 4;                                /* xd xs xq */
}

/* returns 0, or -1 when a position does not fit the cache, -2 when scratch memory could not be allocated */
int es_forward(const es_model *m, int64_t B, int64_t S, const int64_t *ids, const float *x_in, const int64_t *start,
               float *const *kc, float *const *vc, int64_t cap, float *logits, int64_t *next_ids, float *hidden,
               float *scratch, int threads) {
    for (int64_t b = 0; b < B; b++)
        if (start[b] < 0 || start[b] + S > cap) return -1;
    const int64_t E = m->E, H = m->H, Hkv = m->Hkv, D = m->D, I = m->I, V = m->V, R = m->R, T = B * S;
    const int64_t NQKV = (H + 2 * Hkv) * D;
    es_runner u;
    memset(&u, 0, sizeof u);
    es_call *c = &u.c;
    c->m = m, c->B = B, c->S = S, c->T = T, c->cap = cap, c->NQKV = NQKV, c->start = start, c->kc = kc, c->vc = vc;
    c->x = scratch, c->h = c->x + T * E, c->qkv = c->h + T * E, c->att = c->qkv + T * NQKV;
    c->gu = c->att + T * H * D, c->act = c->gu + T * 2 * I, c->rc = c->act + T * I;
    const int64_t Kw = widest_input(m);
    c->xd = c->rc + m->n_ropes * T * R, c->xs = (int32_t *)(c->xd + T * (Kw / QB + 1));
    c->xq = (int8_t *)(c->xs + T * (Kw / QB + 1));
    c->logits = logits, c->next_ids = next_ids;
    float *x = c->x, *h = c->h;
    if (x_in) /* an inputs_embeds engine: the call's rows as given */
        memcpy(x, x_in, (size_t)(T * E) * sizeof(float));
    else
        for (int64_t r = 0; r < T; r++)
            for (int64_t e = 0; e < E; e++) x[r * E + e] = half_to_float(m->embed[ids[r] * E + e]) * m->embed_scale;
    /* rc (n_ropes, T, R): per rotary, cos then sin (R/2 each) of each row's position times inv_freq, scaled */
    for (int64_t jr = 0; jr < m->n_ropes; jr++)
        for (int64_t r = 0; r < T; r++) {
            float *cs = c->rc + (jr * T + r) * R;
            const float p = (float)(start[r / S] + r % S);
            for (int64_t i = 0; i < R / 2; i++) {
                const float f = p * m->inv_freq[jr * (R / 2) + i];
                cs[i] = cosf(f) * m->rope_scale[jr];
                cs[R / 2 + i] = sinf(f) * m->rope_scale[jr];
            }
        }
    int64_t maxcap = 0, attended = 0; /* the longest attention row (its scores); rows a query reads, on average */
    for (int64_t b = 0; b < B; b++) {
        maxcap = start[b] + S > maxcap ? start[b] + S : maxcap;
        attended += start[b] + (S + 1) / 2;
    }
    attended = attended / B + 1;
    c->gs = attn_group(H, Hkv), c->ss = maxcap;
    int64_t local = c->gs * (D + maxcap);
    const int64_t needs[] = {2 * D, E, I, MAX_ROWS * CHUNK_PANELS_MAX * PANEL, 2, Kw / 4 + 2 * (Kw / QB)};
    for (size_t k = 0; k < sizeof needs / sizeof needs[0]; k++) local = needs[k] > local ? needs[k] : local;
    if (runner_begin(&u, threads, local) != 0) return -2;
    /* integer weights: the norms and the activation quantize the rows they write for the product after them */
    const int qw = m->wkind != ES_F16 && ES_FUSE_QUANT;
    const int64_t nq_cost = 3 * T * E + (qw ? 4 * T * E : 0);
    const int wk = (int)m->wkind;
    /* after each product, the next one's weights for the helpers' idle time (idle_ahead) */
#define AHEAD(w_, kind_, K_, N_) \
    idle_ahead(u.pooled, u.threads, (w_), (N_) / PANEL * panel_bytes(&(es_mat){(w_), (kind_), (K_), (N_)}))
    AHEAD(m->wqkv[0], wk, E, NQKV);

    for (int64_t l = 0; l < m->L; l++) {
        const float *post_attn = m->post_attn ? m->post_attn[l] : NULL;
        const float *post_mlp = m->post_mlp ? m->post_mlp[l] : NULL;
        job_rows(&u, J_NORM, l, T, E, nq_cost, x, m->ln1[l], h, qw);
        job_matmul(&u, h, m->wqkv[l], wk, E, NQKV, c->qkv, 0, m->bqkv ? m->bqkv[l] : NULL, qw);
        AHEAD(m->wo[l], wk, H * D, E);
        /* keys (normed, rotated) and values into the cache */
        job_rows(&u, J_KV, l, Hkv * T, 2 * D, 4 * Hkv * T * D, NULL, NULL, NULL, 0);
        /* cost in a matrix product's multiply-adds: one of attention's takes about 4 (its cache rows come from
           beyond L2 once the weights have streamed through, and the softmax adds its own), so a one-token step
           past a few dozen positions runs its attention on the pool */
        job_rows(&u, J_ATTN, l, H / c->gs * T, c->gs * (D + maxcap), 8 * H * T * D * attended, NULL, NULL, NULL, 0);
        const float *bo = m->bo ? m->bo[l] : NULL;
        if (post_attn) { /* x += norm(a Wo + bo): the product into h (free until ln2), normed into x */
            job_matmul(&u, c->att, m->wo[l], wk, H * D, E, h, 0, bo, 0);
            AHEAD(m->wgu[l], wk, E, 2 * I);
            job_rows(&u, J_ADDNORM, l, T, E, 3 * T * E, h, post_attn, x, 0);
        } else {
            job_matmul(&u, c->att, m->wo[l], wk, H * D, E, x, 1, bo, 0);
            AHEAD(m->wgu[l], wk, E, 2 * I);
        }
        job_rows(&u, J_NORM, l, T, E, nq_cost, x, m->ln2[l], h, qw);
        job_matmul(&u, h, m->wgu[l], wk, E, 2 * I, c->gu, 0, NULL, qw);
        AHEAD(m->wd[l], wk, I, E);
        job_rows(&u, J_ACT, l, T, I, 20 * T * I + (qw ? 4 * T * I : 0), NULL, NULL, NULL, qw);
        if (post_mlp) /* x += norm(m), below */
            job_matmul(&u, c->act, m->wd[l], wk, I, E, h, 0, NULL, qw);
        else
            job_matmul(&u, c->act, m->wd[l], wk, I, E, x, 1, NULL, qw);
        if (l + 1 < m->L)
            AHEAD(m->wqkv[l + 1], wk, E, NQKV);
        else
            AHEAD(m->lm_head, (int)m->head_kind, E, V);
        if (post_mlp)
            job_rows(&u, J_ADDNORM, l, T, E, 3 * T * E, h, post_mlp, x, 0);
    }
    const int qh = m->head_kind != ES_F16 && ES_FUSE_QUANT;
    job_rows(&u, J_NORM, 0, T, E, 3 * T * E + (qh ? 4 * T * E : 0), x, m->norm, h, qh);
    job_matmul(&u, h, m->lm_head, (int)m->head_kind, E, V, logits, 0, NULL, qh);
    AHEAD(m->wqkv[0], wk, E, NQKV); /* the next call's first product, while the host runs */
#undef AHEAD
    job_rows(&u, J_ARGMAX, 0, T, 2, 2 * T * V, NULL, NULL, NULL, 0);
    runner_end(&u);
    if (hidden) memcpy(hidden, h, (size_t)(T * E) * sizeof(float));
    return 0;
}

/* y (T, N) = x (T, K) @ a float16 panel matrix (N a multiple of PANEL, T <= MAX_ROWS), on the calling thread alone:
   the host drafts' small products (an attention head's), which must neither wake nor wait for the pool's threads */
int es_rows_f16(const float *x, int64_t T, const uint16_t *w, int64_t K, int64_t N, float *y) {
    if (T < 1 || T > MAX_ROWS || K < 1 || N < PANEL || N % PANEL) return -1;
    const float *rows[MAX_ROWS];
    for (int64_t t = 0; t < T; t++) rows[t] = x + t * K;
    float out[MAX_ROWS * 8 * PANEL];
    const int64_t panels = N / PANEL;
    const int np = panels_for((int)T);
    for (int64_t q = 0; q < panels;) {
        const int n = panels - q >= np ? np : 1; /* out[t * n * PANEL + j * PANEL + c]: row t, panel q + j */
        rows_panels(rows, (int)T, w + q * K * PANEL, n, K, out, K * PANEL);
        for (int64_t t = 0; t < T; t++)
            memcpy(y + t * N + q * PANEL, out + t * n * PANEL, (size_t)(n * PANEL) * sizeof(float));
        q += n;
    }
    return 0;
}

/* y (T, N) = x (T, K) @ a matrix of `kind` (panels), on `threads`: the kernels alone, for the tests */
int es_matmul(int kind, const float *x, int64_t T, const void *w, int64_t K, int64_t N, float *y, int threads) {
    es_model m;
    memset(&m, 0, sizeof m);
    es_runner u;
    memset(&u, 0, sizeof u);
    u.c.m = &m, u.c.T = T;
    const int64_t nb = K / QB + 1, local = MAX_ROWS * CHUNK_PANELS_MAX * PANEL > K / 4 + 2 * nb ? MAX_ROWS * CHUNK_PANELS_MAX * PANEL : K / 4 + 2 * nb;
    float *q = (float *)malloc((size_t)(2 * T * nb + (T * K + 3) / 4) * sizeof(float));
    if (!q) return -2;
    u.c.xd = q, u.c.xs = (int32_t *)(q + T * nb), u.c.xq = (int8_t *)(q + 2 * T * nb);
    if (runner_begin(&u, threads, local) != 0) {
        free(q);
        return -2;
    }
    job_matmul(&u, x, w, kind, K, N, y, 0, NULL, 0);
    runner_end(&u);
    es_quiesce(); /* q is freed next: no helper may still read it */
    free(q);
    return 0;
}
