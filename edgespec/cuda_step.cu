/* One decoder call of a contract model on an NVIDIA GPU (provider "cuda-native"): native_step.c's job, from the
   same native.npz, with the weights, the KV cache and the scratch in device memory.

   The weights are native.npz's float16 panels uploaded as they are (edgespec/backends/cuda_native.py): panel p
   of an (N, K) matrix is (K, 16), row k holding input k's weights for columns 16 p .. 16 p + 15. Arithmetic is
   float32 (each float16 widened exactly), as on the CPU; the summation order differs (the tests and the device
   check compare the two).

   ecs_enqueue(model, io, S) enqueues one call on io->stream, B = io->B sequences of S new tokens each:
     1. params (device) <- params_host (pinned): start (B) the committed lengths, then the ids (B, S); for an
        inputs_embeds engine (a VLA policy's decoder) x (device) <- embeds_host (pinned), the call's rows
     2. the layers (below), every kernel reading start from params, so the same launches serve any lengths
     3. next_host (pinned) <- next (B S): argmax ids over [argmax_lo, argmax_hi), -1 where a row's logits are not
        all finite; logits (B S, V) and the final normed hidden state h (B S, E) stay on the device
   Nothing in it depends on the lengths or the ids on the host, so ecs_capture records it once per S as a CUDA
   graph and ecs_launch replays that graph call after call (cuda_native.py keeps the graphs).

   Per layer l, as native_step.c (its header lists the family options; a NULL table is an absent option):
     k_matmul      qkv = rmsnorm(x, ln1) Wqkv + bqkv   (the norm fused: each block norms the rows it reads)
     k_rope_kv     q, k normed per head (qn, kn), rotated over R dims; k, v written to the cache at start + s;
                   q scaled by attn_scale
     k_attn        softmax(q k^T) v over rows max(0, p - window + 1)..p, the rows split in nsplit parts (one block
                   each, online softmax), then k_attn_merge
     k_matmul      x += a Wo + bo; or tmp = a Wo + bo and k_norm adds rmsnorm(tmp, post_attn) to x
     k_matmul<GLU> mlp = act(g) * u, (g, u) = rmsnorm(x, ln2) (Wg, Wu)   (gate panel p and up panel p + I/16 in
                   one block, the norm fused)
     k_matmul      x += mlp Wd, or through post_mlp as above
   then k_norm h = rmsnorm(x, norm) (the hidden state), logits = h lm_head and k_argmax.

   Layout (cuda_native.py allocates, tests/test_cuda_native.py checks through a stand-in that runs native_step.c):
     KV cache        per layer one key and one value buffer (B, Hkv, cap, D) float32: io->kc[l], io->vc[l]
                     (host tables of device addresses)
     scratch rows    x, h, tmp (rows, E); qkv (rows, (H + 2 Hkv) D); q, att (rows, H D); mlp (rows, I);
                     part (rows H nsplit, D + 2); logits (rows, V); next (rows) int64 */
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifndef LAUNCH /* a kernel launch on stream st (tests/cuda_emu/emu.h defines its own: the kernels on the CPU) */
#define LAUNCH(kernel, grid, block, st, ...) kernel<<<(grid), (block), 0, (st)>>>(__VA_ARGS__)
#endif
#define PANEL 16
#define WARPS 8 /* warps per matrix-product block */
enum { ES_SILU = 0, ES_GELU_TANH = 1 };
enum { ES_F16 = 0, ES_Q8 = 1, ES_Q4 = 2 };

/* native_step.c's es_model, field for field (ecs_model_layout lets cuda_lib.py check). Here the arrays are
   device addresses, except layer_rope and layer_window (read on the host, per layer) and the per-layer tables
   themselves (host arrays of device addresses). */
typedef struct {
    int64_t E, H, Hkv, D, I, V, L, argmax_lo, argmax_hi;
    int64_t R, n_ropes, act, wkind, head_kind;
    float eps, embed_scale, attn_scale;
    const float *inv_freq;       /* device (n_ropes, R/2) */
    const float *rope_scale;     /* device (n_ropes) */
    const int64_t *layer_rope;   /* HOST (L) or NULL */
    const int64_t *layer_window; /* HOST (L) or NULL */
    const uint16_t *embed;       /* device (V, E) float16 */
    const void *lm_head;         /* device, panels */
    const float *norm;           /* device (E) */
    const float *const *ln1, *const *ln2;
    const void *const *wqkv, *const *wo, *const *wgu, *const *wd;
    const float *const *bqkv, *const *bo, *const *qn, *const *kn, *const *post_attn, *const *post_mlp;
} es_model;

/* one decoder's buffers (cuda_native.py's _Io, field for field) */
typedef struct {
    int64_t B;      /* sequences */
    int64_t rows;   /* token rows the scratch holds: B times the largest S */
    int64_t cap;    /* KV rows per sequence */
    int64_t nsplit; /* attention: parts of a row's context, one block each */
    float *const *kc, *const *vc; /* host tables (L) of device addresses: layer l's keys / values */
    int64_t *params_host;         /* pinned (B + rows): start, then the ids */
    int64_t *params;              /* device, the same */
    int64_t *next_host;           /* pinned (rows) */
    int64_t *next;                /* device (rows) */
    float *logits;                /* device (rows, V) */
    float *x, *h, *tmp, *qkv, *q, *att, *mlp, *part;
    void *stream;                 /* cudaStream_t */
    void *ev0, *ev1;              /* cudaEvent_t around the kernels (ecs_kernel_ms) */
    float *embeds_host;           /* pinned (rows, E): the call's input rows, for an inputs_embeds engine, else NULL */
} ecs_io;

static char last_error[512];

static int fail(const char *what, cudaError_t e) {
    snprintf(last_error, sizeof last_error, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
    return -1;
}
#define CK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) return fail(#call, e_); } while (0)

/* ---- reductions ---- */

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* the sum of v over the block (blockDim.x a multiple of 32), returned to every thread; sh: 32 floats */
__device__ float block_sum(float v, float *sh) {
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads(); /* sh may still be read by an earlier call */
    if (lane == 0) sh[w] = v;
    __syncthreads();
    return warp_sum(lane < nw ? sh[lane] : 0.f);
}

/* ---- the kernels ---- */

/* x (T, E) = embed[ids] * scale; grid T */
__global__ void k_embed(const int64_t *__restrict__ ids, const __half *__restrict__ embed, float scale,
                        float *__restrict__ x, int E) {
    const int64_t t = blockIdx.x, id = ids[t];
    for (int e = threadIdx.x; e < E; e += blockDim.x) x[t * E + e] = __half2float(embed[id * E + e]) * scale;
}

/* row t (grid T): if a, x += a (post NULL) or x += rmsnorm(a, post); then, if w, h = rmsnorm(x, w),
   native_step.c's norm_row order (normalise, then scale) */
__global__ void k_norm(float *__restrict__ x, const float *__restrict__ a, const float *__restrict__ post,
                       const float *__restrict__ w, float *__restrict__ h, int E, float eps) {
    __shared__ float sh[32];
    const int64_t t = blockIdx.x;
    float *xr = x + t * E;
    const float *ar = a ? a + t * E : NULL;
    float ra = 0.f;
    if (ar && post) {
        float ss = 0.f;
        for (int e = threadIdx.x; e < E; e += blockDim.x) ss += ar[e] * ar[e];
        ra = 1.0f / sqrtf(block_sum(ss, sh) / (float)E + eps);
    }
    float ss = 0.f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) { /* each thread rereads only what it wrote */
        float v = xr[e];
        if (ar) {
            v += post ? post[e] * (ar[e] * ra) : ar[e];
            xr[e] = v;
        }
        ss += v * v;
    }
    if (!w) return; /* only the residual add (the next product norms x itself) */
    const float r = 1.0f / sqrtf(block_sum(ss, sh) / (float)E + eps);
    for (int e = threadIdx.x; e < E; e += blockDim.x) h[t * E + e] = w[e] * (xr[e] * r);
}

__device__ __forceinline__ float activation(float g, int act) {
    if (act == ES_GELU_TANH) /* x / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): native_step.c's gelu_mul */
        return g / (1.0f + expf(-2.0f * 0.7978845608028654f * fmaf(0.044715f * (g * g), g, g)));
    return g / (1.0f + expf(-g));
}

__device__ __forceinline__ uint4 load16(const __half *p) { return __ldg(reinterpret_cast<const uint4 *>(p)); }

/* a product's epilogue: each warp's partial sums of panel p (red[warp][matrix][row][column], in shared memory)
   summed, then y = sum (+ bias), y += sum with residual, or with GLU act(gate) * up into y (T, N / 2) */
template <int ROWS, int NM, bool GLU>
__device__ void store_panel(float (*red)[NM][ROWS][PANEL], int p, int row0, int T, int N,
                            const float *__restrict__ bias, float *__restrict__ y, int residual, int act) {
    for (int i = threadIdx.x; i < ROWS * PANEL; i += blockDim.x) {
        const int r = i / PANEL, c = i % PANEL;
        if (row0 + r >= T) continue;
        float s[NM];
#pragma unroll
        for (int m = 0; m < NM; m++) {
            s[m] = 0.f;
            for (int wi = 0; wi < WARPS; wi++) s[m] += red[wi][m][r][c];
        }
        if (GLU) {
            y[(size_t)(row0 + r) * (N / 2) + p * PANEL + c] = activation(s[0], act) * s[NM - 1];
        } else {
            const size_t o = (size_t)(row0 + r) * N + p * PANEL + c;
            const float v = s[0] + (bias ? bias[p * PANEL + c] : 0.f);
            y[o] = residual ? y[o] + v : v;
        }
    }
}

/* nw non-NULL: the inverse RMS of rows row0 .. row0 + ROWS - 1 of x (K each) into inv (shared), so that a matrix
   product reads its rows normed, nw[k] * (x[k] * inv[r]) (native_step.c's norm_row, fused into the product that
   consumes it: one kernel less per norm). Every thread takes part (block_sum's barriers). */
template <int ROWS>
__device__ void rows_inv_rms(const float *__restrict__ x, int K, int T, int row0, const float *nw, float eps,
                             float *inv, float *sh) {
    if (!nw) return;
    for (int r = 0; r < ROWS; r++) {
        float ss = 0.f;
        if (row0 + r < T)
            for (int k = threadIdx.x; k < K; k += blockDim.x) {
                const float v = x[(size_t)(row0 + r) * K + k];
                ss += v * v;
            }
        ss = block_sum(ss, sh);
        if (threadIdx.x == 0) inv[r] = 1.0f / sqrtf(ss / (float)K + eps);
    }
    __syncthreads();
}

/* y (T, N) = x (T, K) @ W (+ bias), W in float16 panels; grid (N / 16, ceil(T / ROWS)), WARPS warps.
   Warp w takes inputs k0 = 16 w, 16 w + 16 WARPS, ...: its lane l reads 8 weights (16 bytes) of input
   k0 + l / 2, columns 8 (l & 1) .. + 7, so a warp reads 512 consecutive bytes of the panel at a time, and
   accumulates them against ROWS rows of x. The partial sums meet across the 16 lanes of the same column half
   (shuffles), then across warps (shared memory). residual: y += instead of y =. nw: the rows RMS-normed with
   weights nw first (rows_inv_rms).
   GLU: W is (2 I, K) with the gate rows first; block p computes gate panel p and up panel p + I / 16 and writes
   act(gate) * up into y (T, I). */
template <int ROWS, bool GLU>
__global__ void __launch_bounds__(WARPS * 32) k_matmul(const float *__restrict__ x, const __half *__restrict__ w,
                                                      int K, int N, int T, const float *__restrict__ bias,
                                                      float *__restrict__ y, int residual, int act,
                                                      const float *__restrict__ nw, float eps) {
    constexpr int NM = GLU ? 2 : 1;
    constexpr int UNROLL = ROWS <= 4 ? 4 : 2;
    const int p = blockIdx.x, row0 = blockIdx.y * ROWS, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __shared__ float inv[ROWS], sh[32];
    rows_inv_rms<ROWS>(x, K, T, row0, nw, eps, inv, sh);
    const int kl = lane >> 1, c0 = (lane & 1) * 8;
    const __half *wp[NM];
    wp[0] = w + (size_t)p * K * PANEL;
    if (GLU) wp[NM - 1] = w + (size_t)(p + N / 2 / PANEL) * K * PANEL;
    float acc[NM][ROWS][8];
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int r = 0; r < ROWS; r++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[m][r][j] = 0.f;
    for (int k0 = warp * PANEL; k0 < K; k0 += WARPS * PANEL * UNROLL) {
        uint4 wv[NM][UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int kk = k0 + u * WARPS * PANEL;
#pragma unroll
            for (int m = 0; m < NM; m++)
                wv[m][u] = kk < K ? load16(wp[m] + (size_t)(kk + kl) * PANEL + c0) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int kk = k0 + u * WARPS * PANEL;
            if (kk >= K) break;
            float xv[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                xv[r] = row0 + r < T ? x[(size_t)(row0 + r) * K + kk + kl] : 0.f;
                if (nw) xv[r] = nw[kk + kl] * (xv[r] * inv[r]);
            }
#pragma unroll
            for (int m = 0; m < NM; m++) {
                const __half2 *h2 = reinterpret_cast<const __half2 *>(&wv[m][u]);
                float wf[8];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float2 f = __half22float2(h2[i]);
                    wf[2 * i] = f.x, wf[2 * i + 1] = f.y;
                }
#pragma unroll
                for (int r = 0; r < ROWS; r++)
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[m][r][j] = fmaf(xv[r], wf[j], acc[m][r][j]);
            }
        }
    }
    __shared__ float red[WARPS][NM][ROWS][PANEL];
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int r = 0; r < ROWS; r++)
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float v = acc[m][r][j];
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                v += __shfl_xor_sync(0xffffffffu, v, 4);
                v += __shfl_xor_sync(0xffffffffu, v, 8);
                v += __shfl_xor_sync(0xffffffffu, v, 16);
                if (lane < 2) red[warp][m][r][c0 + j] = v;
            }
    __syncthreads();
    store_panel<ROWS, NM, GLU>(red, p, row0, T, N, bias, y, residual, act);
}

/* The same product over integer weights (es_model.wkind / head_kind ES_Q8 or ES_Q4: native_format.py's pack_blocks;
   native_step.c's header has the bytes): panel p is K / QB blocks of BLOCK bytes, each 16 float16 scales (one per
   column) then the values, w = q * scale. A warp takes one block at a time: its lanes read the block's values
   16 (int8) or 8 (int4) bytes each, all 32 together the whole block, so that lane l holds NC columns
   (c0 = NC (l % LG) ..) of NK consecutive inputs (NK (l / LG) ..) of the block. The weights are widened to float32
   (q - offset) and the sums are float32, each block's sum times its scale: the exact dequantized weights against
   the float32 rows (native_step.c quantizes the rows to int8 instead, so the two differ by that rounding). */
#define QB 32
template <int ROWS, bool GLU, int KIND>
__global__ void __launch_bounds__(WARPS * 32) k_matmul_q(const float *__restrict__ x, const uint8_t *__restrict__ w,
                                                        int K, int N, int T, const float *__restrict__ bias,
                                                        float *__restrict__ y, int residual, int act,
                                                        const float *__restrict__ nw, float eps) {
    constexpr int NM = GLU ? 2 : 1;
    constexpr int BB = KIND == ES_Q8 ? 32 + QB * 16 : 32 + QB * 8; /* bytes of one (block, panel) */
    constexpr int NC = KIND == ES_Q8 ? 4 : 2;                       /* columns per lane */
    constexpr int NK = KIND == ES_Q8 ? 4 : 8;                       /* inputs per lane and block */
    constexpr int LG = PANEL / NC;                                  /* lanes l and l + LG hold the same columns */
    const int p = blockIdx.x, row0 = blockIdx.y * ROWS, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nb = K / QB, c0 = (lane % LG) * NC, k0 = (lane / LG) * NK;
    __shared__ float inv[ROWS], sh[32];
    rows_inv_rms<ROWS>(x, K, T, row0, nw, eps, inv, sh);
    const uint8_t *wp[NM];
    wp[0] = w + (size_t)p * nb * BB;
    if (GLU) wp[NM - 1] = w + (size_t)(p + N / 2 / PANEL) * nb * BB;
    float acc[NM][ROWS][NC];
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int r = 0; r < ROWS; r++)
#pragma unroll
            for (int j = 0; j < NC; j++) acc[m][r][j] = 0.f;
    for (int kb = warp; kb < nb; kb += WARPS) {
        float xv[ROWS][NK];
#pragma unroll
        for (int r = 0; r < ROWS; r++)
#pragma unroll
            for (int i = 0; i < NK; i++) {
                const int k = kb * QB + k0 + i;
                xv[r][i] = row0 + r < T ? x[(size_t)(row0 + r) * K + k] : 0.f;
                if (nw) xv[r][i] = nw[k] * (xv[r][i] * inv[r]);
            }
#pragma unroll
        for (int m = 0; m < NM; m++) {
            const uint8_t *blk = wp[m] + (size_t)kb * BB;
            const __half *scales = reinterpret_cast<const __half *>(blk);
            uint8_t b[16];
            if (KIND == ES_Q8) {
                const uint4 v = __ldg(reinterpret_cast<const uint4 *>(blk + 32 + 16 * lane));
                memcpy(b, &v, 16);
            } else {
                const uint2 v = __ldg(reinterpret_cast<const uint2 *>(blk + 32 + 8 * lane));
                memcpy(b, &v, 8);
            }
#pragma unroll
            for (int j = 0; j < NC; j++) {
                float q[NK]; /* input k0 + i, column c0 + j; byte 4 j + t holds input t (int8), or t and t + 4 (int4) */
#pragma unroll
                for (int i = 0; i < NK; i++) {
                    if (KIND == ES_Q8) q[i] = (float)((int)b[4 * j + i] - 128);
                    else q[i] = (float)((i < 4 ? (b[4 * j + i] & 15) : (b[4 * j + i - 4] >> 4)) - 8);
                }
                const float sc = __half2float(scales[c0 + j]);
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    float d = 0.f;
#pragma unroll
                    for (int i = 0; i < NK; i++) d = fmaf(q[i], xv[r][i], d);
                    acc[m][r][j] = fmaf(d, sc, acc[m][r][j]);
                }
            }
        }
    }
    __shared__ float red[WARPS][NM][ROWS][PANEL];
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int r = 0; r < ROWS; r++)
#pragma unroll
            for (int j = 0; j < NC; j++) {
                float v = acc[m][r][j];
                for (int o = LG; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                if (lane < LG) red[warp][m][r][c0 + j] = v;
            }
    __syncthreads();
    store_panel<ROWS, NM, GLU>(red, p, row0, T, N, bias, y, residual, act);
}

/* grid (T, H + Hkv), 128 threads: head j of row t (sequence b = t / S at position start[b] + t % S). A query
   head (j < H) is normed (qn), rotated and scaled into q (T, H, D); a key head is normed (kn), rotated and
   written with its value to the cache at that position. inv_freq NULL: this layer has no rotary. */
__global__ void k_rope_kv(const float *__restrict__ qkv, const float *__restrict__ qn, const float *__restrict__ kn,
                          const float *__restrict__ inv_freq, const float *__restrict__ rope_scale, int R,
                          const int64_t *__restrict__ start, int S, int H, int Hkv, int D, float eps,
                          float attn_scale, float *__restrict__ q, float *__restrict__ kc, float *__restrict__ vc,
                          int64_t cap) {
    __shared__ float v[512];
    __shared__ float sh[32];
    const int64_t t = blockIdx.x, b = t / S, pos = start[b] + t % S;
    const int j = blockIdx.y, NQKV = (H + 2 * Hkv) * D;
    const float *src = qkv + t * NQKV + (int64_t)j * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) v[d] = src[d];
    const float *nw = j < H ? qn : kn;
    if (nw) { /* uniform over the block: block_sum's barriers are reached by every thread */
        float ss = 0.f;
        for (int d = threadIdx.x; d < D; d += blockDim.x) ss += v[d] * v[d];
        const float r = 1.0f / sqrtf(block_sum(ss, sh) / (float)D + eps);
        for (int d = threadIdx.x; d < D; d += blockDim.x) v[d] = nw[d] * (v[d] * r);
    }
    __syncthreads();
    if (inv_freq) {
        const float fp = (float)pos, sc = *rope_scale;
        for (int i = threadIdx.x; i < R / 2; i += blockDim.x) { /* rotate_half over the first R dims */
            const float f = fp * inv_freq[i], c = cosf(f) * sc, sn = sinf(f) * sc;
            const float a = v[i], bb = v[i + R / 2];
            v[i] = a * c - bb * sn;
            v[i + R / 2] = bb * c + a * sn;
        }
        __syncthreads();
    }
    if (j < H) {
        for (int d = threadIdx.x; d < D; d += blockDim.x) q[(t * H + j) * D + d] = v[d] * attn_scale;
    } else {
        const int kh = j - H;
        const int64_t row = ((b * Hkv + kh) * cap + pos) * D;
        const float *val = qkv + t * NQKV + (int64_t)(H + Hkv + kh) * D;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            kc[row + d] = v[d];
            vc[row + d] = val[d];
        }
    }
}

#define ATT_WARPS 4
#define DMAX_LANE 16 /* head dims per lane: D <= 512 */

/* grid (T H, nsplit), ATT_WARPS warps: part `split` of the rows lo..pos that row t's head hh attends to (window
   0: lo = 0), each warp every ATT_WARPS-th row with an online softmax, merged in shared memory; writes
   part[(t H + hh) nsplit + split] = (max score, sum of e^(score - max), sum of e^(score - max) v (D)) */
__global__ void __launch_bounds__(ATT_WARPS * 32) k_attn(const float *__restrict__ q, const float *__restrict__ kc,
                                                       const float *__restrict__ vc, const int64_t *__restrict__ start,
                                                       int S, int H, int Hkv, int D, int64_t cap, int64_t window,
                                                       float *__restrict__ part) {
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS], sacc[ATT_WARPS][512];
    const int64_t i = blockIdx.x, t = i / H, b = t / S, pos = start[b] + t % S;
    const int hh = (int)(i % H), kh = hh / (H / Hkv), split = blockIdx.y, nsplit = gridDim.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t lo = window && pos + 1 > window ? pos + 1 - window : 0, n = pos + 1 - lo;
    const int64_t chunk = (n + nsplit - 1) / nsplit, r0 = lo + split * chunk;
    const int64_t r1 = r0 + chunk < pos + 1 ? r0 + chunk : pos + 1;
    float qv[DMAX_LANE], acc[DMAX_LANE];
#pragma unroll
    for (int u = 0; u < DMAX_LANE; u++) {
        const int d = lane + 32 * u;
        qv[u] = d < D ? q[i * D + d] : 0.f;
        acc[u] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    const float *K = kc + ((b * Hkv + kh) * cap) * D, *V = vc + ((b * Hkv + kh) * cap) * D;
    for (int64_t r = r0 + warp; r < r1; r += ATT_WARPS) {
        float s = 0.f;
#pragma unroll
        for (int u = 0; u < DMAX_LANE; u++) {
            const int d = lane + 32 * u;
            if (d < D) s = fmaf(qv[u], K[r * D + d], s);
        }
        s = warp_sum(s);
        const float mn = fmaxf(m, s), corr = expf(m - mn), e = expf(s - mn);
        l = l * corr + e;
#pragma unroll
        for (int u = 0; u < DMAX_LANE; u++) {
            const int d = lane + 32 * u;
            if (d < D) acc[u] = fmaf(e, V[r * D + d], acc[u] * corr);
        }
        m = mn;
    }
    if (lane == 0) sm[warp] = m, sl[warp] = l;
#pragma unroll
    for (int u = 0; u < DMAX_LANE; u++) {
        const int d = lane + 32 * u;
        if (d < D) sacc[warp][d] = acc[u];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm[w]);
    float *out = part + (i * nsplit + split) * (D + 2);
    float f[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; w++) f[w] = M == -INFINITY ? 0.f : expf(sm[w] - M); /* a warp without rows: 0 */
    if (threadIdx.x == 0) {
        float L = 0.f;
        for (int w = 0; w < ATT_WARPS; w++) L += sl[w] * f[w];
        out[0] = M, out[1] = L;
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < ATT_WARPS; w++) a += sacc[w][d] * f[w];
        out[2 + d] = a;
    }
}

/* grid T H: att (T, H D) = the nsplit parts of row t's head hh merged */
__global__ void k_attn_merge(const float *__restrict__ part, int nsplit, int D, float *__restrict__ att) {
    const int64_t i = blockIdx.x;
    const float *p = part + i * nsplit * (D + 2);
    float M = -INFINITY;
    for (int s = 0; s < nsplit; s++) M = fmaxf(M, p[s * (D + 2)]);
    float L = 0.f;
    for (int s = 0; s < nsplit; s++) L += M == -INFINITY ? 0.f : p[s * (D + 2) + 1] * expf(p[s * (D + 2)] - M);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < nsplit; s++) {
            const float ms = p[s * (D + 2)];
            if (ms != -INFINITY) a += p[s * (D + 2) + 2 + d] * expf(ms - M);
        }
        att[i * D + d] = a / L;
    }
}

/* grid T, 1024 threads: next[t] = the first index of the largest logit in [lo, hi), or -1 when the row's sum
   over all V is not finite (native_step.c's J_ARGMAX) */
__global__ void k_argmax(const float *__restrict__ logits, int64_t V, int64_t lo, int64_t hi, int64_t *__restrict__ next) {
    __shared__ float sh[32], bv[32];
    __shared__ int64_t bi[32];
    const int64_t t = blockIdx.x;
    const float *row = logits + t * V;
    float total = 0.f, best = -INFINITY;
    int64_t arg = -1;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
        const float a = row[v];
        total += a;
        if (v >= lo && v < hi && (arg < 0 || a > best)) best = a, arg = v; /* v rises: the first maximum stays */
    }
    total = block_sum(total, sh);
    for (int o = 16; o; o >>= 1) { /* (value, index): larger value, then smaller index; -1 loses */
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int64_t oi = __shfl_xor_sync(0xffffffffu, arg, o);
        if (oi >= 0 && (arg < 0 || ov > best || (ov == best && oi < arg))) best = ov, arg = oi;
    }
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) bv[w] = best, bi[w] = arg;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < (int)(blockDim.x >> 5); k++)
            if (bi[k] >= 0 && (arg < 0 || bv[k] > best || (bv[k] == best && bi[k] < arg))) best = bv[k], arg = bi[k];
        next[t] = isfinite(total) ? (arg < 0 ? lo : arg) : -1;
    }
}

/* ---- the profiler: an event after every kernel of one enqueued call (ecs_profile), by kind ---- */

enum { P_START, P_EMBED, P_MATMUL, P_ROPE_KV, P_ATTN, P_MERGE, P_NORM, P_ARGMAX, P_KINDS };
static const char *prof_kinds = "start,embed,matmul,rope_kv,attention,attention_merge,norm,argmax";
#define PROF_MAX 2048
typedef struct {
    cudaEvent_t ev[PROF_MAX];
    int kind[PROF_MAX];
    int n, ready;
} es_prof;
static es_prof *prof = NULL; /* set by ecs_profile for one call; never while a graph is captured */

static void mark(int kind, cudaStream_t st) {
    if (prof && prof->n < PROF_MAX) {
        cudaEventRecord(prof->ev[prof->n], st);
        prof->kind[prof->n++] = kind;
    }
}

/* ---- launching ---- */

typedef struct { /* what a matrix product does beyond y = x W */
    const float *bias;  /* (N) added, or NULL */
    int residual;       /* y += instead of y = */
    int glu;            /* y (T, N / 2) = act(gate) * up */
    int act;            /* ES_SILU / ES_GELU_TANH, with glu */
    const float *norm;  /* (K): the rows RMS-normed with these weights first, or NULL */
    float eps;          /* the norm's epsilon */
} mm_opts;

template <int ROWS, bool GLU>
static void launch_mm(const float *x, const void *w, int K, int N, int T, float *y, mm_opts o, int kind,
                      cudaStream_t st) {
    const dim3 grid((GLU ? N / 2 : N) / PANEL, (T + ROWS - 1) / ROWS);
    if (kind == ES_F16) {
        void (*kern)(const float *, const __half *, int, int, int, const float *, float *, int, int, const float *,
                     float) = k_matmul<ROWS, GLU>;
        LAUNCH(kern, grid, WARPS * 32, st, x, (const __half *)w, K, N, T, o.bias, y, o.residual, o.act, o.norm, o.eps);
    } else {
        void (*kern)(const float *, const uint8_t *, int, int, int, const float *, float *, int, int, const float *,
                     float) = kind == ES_Q8 ? k_matmul_q<ROWS, GLU, ES_Q8> : k_matmul_q<ROWS, GLU, ES_Q4>;
        LAUNCH(kern, grid, WARPS * 32, st, x, (const uint8_t *)w, K, N, T, o.bias, y, o.residual, o.act, o.norm, o.eps);
    }
}

/* y (T, N) [+]= x (T, K) @ w of `kind` (ES_F16 panels, ES_Q8 / ES_Q4 blocks), with o's bias, residual add,
   norm of the rows and GLU. Row tiles of up to 16 (8 with glu). */
static void matmul(const float *x, const void *w, int64_t K, int64_t N, int64_t T, float *y, mm_opts o, int kind,
                   cudaStream_t st) {
    const int k = (int)K, n = (int)N, t = (int)T;
    if (o.glu) {
        if (T <= 1) launch_mm<1, true>(x, w, k, n, t, y, o, kind, st);
        else if (T <= 2) launch_mm<2, true>(x, w, k, n, t, y, o, kind, st);
        else if (T <= 4) launch_mm<4, true>(x, w, k, n, t, y, o, kind, st);
        else launch_mm<8, true>(x, w, k, n, t, y, o, kind, st);
    } else {
        if (T <= 1) launch_mm<1, false>(x, w, k, n, t, y, o, kind, st);
        else if (T <= 2) launch_mm<2, false>(x, w, k, n, t, y, o, kind, st);
        else if (T <= 4) launch_mm<4, false>(x, w, k, n, t, y, o, kind, st);
        else if (T <= 8) launch_mm<8, false>(x, w, k, n, t, y, o, kind, st);
        else launch_mm<16, false>(x, w, k, n, t, y, o, kind, st);
    }
    mark(P_MATMUL, st);
}

static mm_opts plain(void) { mm_opts o = {NULL, 0, 0, 0, NULL, 0.f}; return o; }

static const float *opt(const float *const *table, int64_t l) { return table ? table[l] : NULL; }

extern "C" {

const char *ecs_error(void) { return last_error; }

int64_t ecs_model_layout(int64_t *inv_freq_offset) {
    *inv_freq_offset = (int64_t)offsetof(es_model, inv_freq);
    return (int64_t)sizeof(es_model);
}

int64_t ecs_io_layout(void) { return (int64_t)sizeof(ecs_io); }

/* device `dev` made current; name (n bytes), info: compute major, minor, total memory, multiprocessors,
   integrated (a Jetson), L2 bytes */
int ecs_device(int dev, char *name, int n, int64_t *info) {
    int count = 0;
    CK(cudaGetDeviceCount(&count));
    if (dev < 0 || dev >= count) {
        snprintf(last_error, sizeof last_error, "CUDA device %d requested, %d present", dev, count);
        return -1;
    }
    CK(cudaSetDevice(dev));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, dev));
    snprintf(name, (size_t)n, "%s", p.name);
    info[0] = p.major, info[1] = p.minor, info[2] = (int64_t)p.totalGlobalMem, info[3] = p.multiProcessorCount;
    info[4] = p.integrated, info[5] = p.l2CacheSize;
    return 0;
}

void *ecs_malloc(int64_t n) {
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, (size_t)(n > 0 ? n : 1));
    if (e != cudaSuccess) {
        fail("cudaMalloc", e);
        return NULL;
    }
    return p;
}

void *ecs_host_alloc(int64_t n) { /* pinned: the graphs' copies read and write it directly */
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, (size_t)(n > 0 ? n : 1), cudaHostAllocDefault);
    if (e != cudaSuccess) {
        fail("cudaHostAlloc", e);
        return NULL;
    }
    return p;
}

int ecs_free(void *p) { CK(cudaFree(p)); return 0; }
int ecs_host_free(void *p) { CK(cudaFreeHost(p)); return 0; }

/* synchronous copies between host and device addresses (unified addressing tells which is which) */
int ecs_copy(void *dst, const void *src, int64_t n) { CK(cudaMemcpy(dst, src, (size_t)n, cudaMemcpyDefault)); return 0; }
int ecs_memset(void *dst, int64_t n) { CK(cudaMemset(dst, 0, (size_t)n)); return 0; }

void *ecs_stream_create(void) {
    cudaStream_t s = NULL;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        fail("cudaStreamCreateWithFlags", e);
        return NULL;
    }
    return (void *)s;
}
int ecs_stream_destroy(void *s) { CK(cudaStreamDestroy((cudaStream_t)s)); return 0; }
int ecs_stream_sync(void *s) { CK(cudaStreamSynchronize((cudaStream_t)s)); return 0; }

void *ecs_event_create(void) {
    cudaEvent_t ev = NULL;
    cudaError_t e = cudaEventCreate(&ev);
    if (e != cudaSuccess) {
        fail("cudaEventCreate", e);
        return NULL;
    }
    return (void *)ev;
}
int ecs_event_destroy(void *ev) { CK(cudaEventDestroy((cudaEvent_t)ev)); return 0; }

/* the last call's kernel time in milliseconds (between io->ev0 and io->ev1; the stream synchronised) */
float ecs_kernel_ms(const ecs_io *io) {
    float ms = -1.f;
    if (cudaEventElapsedTime(&ms, (cudaEvent_t)io->ev0, (cudaEvent_t)io->ev1) != cudaSuccess) return -1.f;
    return ms;
}

/* enqueue one call of S tokens per sequence (the header's steps 1-3) on io->stream: 0, or -1 (ecs_error) */
int ecs_enqueue(const es_model *m, const ecs_io *io, int64_t S) {
    const int64_t B = io->B, T = B * S, E = m->E, H = m->H, Hkv = m->Hkv, D = m->D, I = m->I, V = m->V;
    const int64_t NQKV = (H + 2 * Hkv) * D;
    cudaStream_t st = (cudaStream_t)io->stream;
    if (S < 1 || T > io->rows || D > 512 || m->wkind < ES_F16 || m->wkind > ES_Q4 || m->head_kind < ES_F16 ||
        m->head_kind > ES_Q4) {
        snprintf(last_error, sizeof last_error, "ecs_enqueue: S %lld, B S %lld rows of %lld, head_dim %lld (<= 512), "
                 "weights %lld / %lld (0..2)", (long long)S, (long long)T, (long long)io->rows, (long long)D,
                 (long long)m->wkind, (long long)m->head_kind);
        return -1;
    }
    const int64_t *start = io->params, *ids = io->params + B;
    CK(cudaMemcpyAsync(io->params, io->params_host, (size_t)(B + T) * sizeof(int64_t), cudaMemcpyHostToDevice, st));
    CK(cudaEventRecord((cudaEvent_t)io->ev0, st));
    mark(P_START, st);
    if (io->embeds_host) /* an inputs_embeds engine: x is the call's rows as given (a VLA encoder's prefix) */
        CK(cudaMemcpyAsync(io->x, io->embeds_host, (size_t)(T * E) * sizeof(float), cudaMemcpyHostToDevice, st));
    else
        LAUNCH(k_embed, (unsigned)T, 256, st, ids, (const __half *)m->embed, m->embed_scale, io->x, (int)E);
    mark(P_EMBED, st);
    const int act = (int)m->act, wk = (int)m->wkind;
    for (int64_t l = 0; l < m->L; l++) {
        mm_opts qkv = plain(); /* the layer's input norm, fused: the product reads x normed with ln1 */
        qkv.bias = opt(m->bqkv, l), qkv.norm = m->ln1[l], qkv.eps = m->eps;
        matmul(io->x, m->wqkv[l], E, NQKV, T, io->qkv, qkv, wk, st);
        const int64_t rj = m->layer_rope ? m->layer_rope[l] : (m->n_ropes ? 0 : -1);
        const float *inv = rj >= 0 ? m->inv_freq + rj * (m->R / 2) : NULL;
        LAUNCH(k_rope_kv, dim3((unsigned)T, (unsigned)(H + Hkv)), 128, st,
               io->qkv, opt(m->qn, l), opt(m->kn, l), inv, m->rope_scale + (rj >= 0 ? rj : 0), (int)m->R, start,
               (int)S, (int)H, (int)Hkv, (int)D, m->eps, m->attn_scale, io->q, io->kc[l], io->vc[l], io->cap);
        mark(P_ROPE_KV, st);
        const int64_t window = m->layer_window ? m->layer_window[l] : 0;
        LAUNCH(k_attn, dim3((unsigned)(T * H), (unsigned)io->nsplit), ATT_WARPS * 32, st,
               io->q, io->kc[l], io->vc[l], start, (int)S, (int)H, (int)Hkv, (int)D, io->cap, window, io->part);
        mark(P_ATTN, st);
        LAUNCH(k_attn_merge, (unsigned)(T * H), 128, st, io->part, (int)io->nsplit, (int)D, io->att);
        mark(P_MERGE, st);
        const float *post_attn = opt(m->post_attn, l), *post_mlp = opt(m->post_mlp, l);
        mm_opts o = plain();
        o.bias = opt(m->bo, l);
        if (post_attn) { /* x += rmsnorm(a Wo + bo, post_attn) */
            matmul(io->att, m->wo[l], H * D, E, T, io->tmp, o, wk, st);
            LAUNCH(k_norm, (unsigned)T, 256, st, io->x, io->tmp, post_attn, nullptr, nullptr, (int)E, m->eps);
            mark(P_NORM, st);
        } else { /* x += a Wo + bo */
            o.residual = 1;
            matmul(io->att, m->wo[l], H * D, E, T, io->x, o, wk, st);
        }
        mm_opts gu = plain(); /* the MLP's input norm, fused */
        gu.glu = 1, gu.act = act, gu.norm = m->ln2[l], gu.eps = m->eps;
        matmul(io->x, m->wgu[l], E, 2 * I, T, io->mlp, gu, wk, st);
        mm_opts d = plain();
        if (post_mlp) {
            matmul(io->mlp, m->wd[l], I, E, T, io->tmp, d, wk, st);
            LAUNCH(k_norm, (unsigned)T, 256, st, io->x, io->tmp, post_mlp, nullptr, nullptr, (int)E, m->eps);
            mark(P_NORM, st);
        } else {
            d.residual = 1;
            matmul(io->mlp, m->wd[l], I, E, T, io->x, d, wk, st);
        }
    }
    /* the final norm into h: the hidden state a text head reads, and the lm_head's input */
    LAUNCH(k_norm, (unsigned)T, 256, st, io->x, nullptr, nullptr, m->norm, io->h, (int)E, m->eps);
    mark(P_NORM, st);
    matmul(io->h, m->lm_head, E, V, T, io->logits, plain(), (int)m->head_kind, st);
    LAUNCH(k_argmax, (unsigned)T, 1024, st, io->logits, V, m->argmax_lo, m->argmax_hi, io->next);
    mark(P_ARGMAX, st);
    CK(cudaGetLastError());
    CK(cudaEventRecord((cudaEvent_t)io->ev1, st));
    CK(cudaMemcpyAsync(io->next_host, io->next, (size_t)T * sizeof(int64_t), cudaMemcpyDeviceToHost, st));
    return 0;
}

/* y (T, N) = x (T, K) @ w of `kind` (glu: y (T, N / 2) = act(gate) * up; norm: the rows RMS-normed with these
   weights first), device addresses, synchronously: the matrix kernels alone, for the tests
   (tests/test_cuda_emulated.py compares them with numpy) */
int ecs_matmul(int kind, const float *x, int64_t T, const void *w, int64_t K, int64_t N, float *y, int glu, int act,
               const float *norm, float eps) {
    if (kind < ES_F16 || kind > ES_Q4 || T < 1 || N % PANEL || (kind != ES_F16 && K % QB) || (glu && N % (2 * PANEL))) {
        snprintf(last_error, sizeof last_error, "ecs_matmul: kind %d, T %lld, K %lld, N %lld, glu %d", kind,
                 (long long)T, (long long)K, (long long)N, glu);
        return -1;
    }
    mm_opts o = plain();
    o.glu = glu, o.act = act, o.norm = norm, o.eps = eps;
    matmul(x, w, K, N, T, y, o, kind, (cudaStream_t)0);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    return 0;
}

const char *ecs_profile_kinds(void) { return prof_kinds; }

/* one call of S tokens enqueued (no graph) with an event after every kernel, run and timed: ms[k] the GPU time of
   kind k's kernels (prof_kinds' order; a kernel's time is from the event before it to its own), counts[k] how
   many ran; 0, or -1 (ecs_error) */
int ecs_profile(const es_model *m, const ecs_io *io, int64_t S, float *ms, int64_t *counts) {
    static es_prof state;
    if (!state.ready) {
        for (int i = 0; i < PROF_MAX; i++) CK(cudaEventCreate(&state.ev[i]));
        state.ready = 1;
    }
    state.n = 0;
    prof = &state;
    const int rc = ecs_enqueue(m, io, S);
    prof = NULL;
    if (rc != 0) return rc;
    CK(cudaStreamSynchronize((cudaStream_t)io->stream));
    for (int k = 0; k < P_KINDS; k++) ms[k] = 0.f, counts[k] = 0;
    for (int i = 1; i < state.n; i++) {
        float t = 0.f;
        CK(cudaEventElapsedTime(&t, state.ev[i - 1], state.ev[i]));
        ms[state.kind[i]] += t;
        counts[state.kind[i]]++;
    }
    if (state.n >= PROF_MAX) {
        snprintf(last_error, sizeof last_error, "ecs_profile: more than %d kernels in one call", PROF_MAX);
        return -1;
    }
    return 0;
}

/* ecs_enqueue recorded as a CUDA graph (an executable one: replay it with ecs_launch), or NULL (ecs_error) */
void *ecs_capture(const es_model *m, const ecs_io *io, int64_t S) {
    cudaStream_t st = (cudaStream_t)io->stream;
    cudaError_t e = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        fail("cudaStreamBeginCapture", e);
        return NULL;
    }
    const int rc = ecs_enqueue(m, io, S);
    cudaGraph_t g = NULL;
    e = cudaStreamEndCapture(st, &g); /* always ended, or the stream stays in capture mode */
    if (rc != 0 || e != cudaSuccess) {
        if (rc == 0) fail("cudaStreamEndCapture", e);
        if (g) cudaGraphDestroy(g);
        return NULL;
    }
    cudaGraphExec_t ex = NULL;
    e = cudaGraphInstantiate(&ex, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        fail("cudaGraphInstantiate", e);
        return NULL;
    }
    return (void *)ex;
}

int ecs_launch(void *graph, void *stream) { CK(cudaGraphLaunch((cudaGraphExec_t)graph, (cudaStream_t)stream)); return 0; }
int ecs_graph_destroy(void *graph) { CK(cudaGraphExecDestroy((cudaGraphExec_t)graph)); return 0; }

} /* extern "C" */
