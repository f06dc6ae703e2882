/* Just enough of CUDA to run edgespec/cuda_step.cu on the CPU, for the tests (tests/test_cuda_emulated.py):
   cuda_step.cu compiled with g++ -include emu.h runs every kernel block after block, each block's blockDim.x CUDA
   threads as fibers (ucontext) of the one calling host thread, with __syncthreads a barrier of the block and the
   warp shuffles an exchange between the 32 threads of a warp (each waits for its warp at a barrier, as the
   hardware's lanes step together). Memory is host memory; a stream runs its work at once; a captured graph is the
   list of the stream's launches and copies, their arguments taken when they were captured, replayed by
   cudaGraphLaunch as a real graph is.

   The scheduler always resumes the first fiber that can run, in thread order in one block and in reverse order in
   the next; each runs until it waits at a barrier (or ends). So the lowest (or highest) threads run ahead of the
   others as far as the barriers let them, and a missing __syncthreads reads a result before another thread
   writes it, or overwrites one before another reads it (the tests were checked against each barrier removed).
   One host thread, no OS scheduling: the tests' time does not depend on what else the machine runs (an emulator
   with a host thread per CUDA thread crawled beside one busy process). */
#pragma once
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#include <ucontext.h>
using std::isfinite;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static /* blocks run one at a time */

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct emu_idx { unsigned x, y, z; };
inline emu_idx threadIdx, blockIdx; /* the running fiber's: set by the scheduler before it resumes one */
inline dim3 blockDim, gridDim;

/* the fibers that play one block's CUDA threads; their stacks are made once and kept */
struct emu_fibers {
    static constexpr size_t STACK = 256 * 1024;
    struct fiber {
        ucontext_t ctx;
        char *stack;
        bool done;
        const unsigned *wait; /* the generation of the barrier it waits at (null: runnable) */
        unsigned seen;        /* ... as it was when it arrived */
    };
    std::vector<fiber> f;
    ucontext_t sched;
    unsigned cur = 0;
    bool descending = false; /* flipped every block */
    unsigned long releases = 0; /* barriers opened so far */
    const std::function<void()> *body = nullptr;

    static void entry();
    /* the running fiber waits until *gen differs from g */
    void wait(const unsigned *gen, unsigned g) {
        f[cur].wait = gen, f[cur].seen = g;
        swapcontext(&f[cur].ctx, &sched);
    }
    bool runnable(unsigned i) const { return !f[i].done && (!f[i].wait || *f[i].wait != f[i].seen); }
    void run(unsigned n, const std::function<void()> &b) { /* b() as threads 0 .. n - 1 of one block */
        while (f.size() < n) f.push_back({{}, static_cast<char *>(malloc(STACK)), true, nullptr, 0});
        body = &b;
        for (unsigned i = 0; i < n; i++) {
            getcontext(&f[i].ctx);
            f[i].ctx.uc_stack.ss_sp = f[i].stack;
            f[i].ctx.uc_stack.ss_size = STACK;
            f[i].ctx.uc_link = &sched;
            makecontext(&f[i].ctx, &emu_fibers::entry, 0);
            f[i].done = false, f[i].wait = nullptr;
        }
        descending = !descending;
        unsigned pos = 0, seen_releases = releases;
        for (unsigned left = n; left;) {
            if (releases != seen_releases) pos = 0, seen_releases = releases; /* a barrier opened: rescan */
            unsigned i = pos; /* the fibers before pos were waiting at the last scan, and no barrier opened since */
            for (; i < n; i++) /* the first runnable fiber in this block's order */
                if (runnable(descending ? n - 1 - i : i)) break;
            if (i == n) { /* every fiber waits: a barrier some thread never reaches */
                fprintf(stderr, "cuda emu: every thread of block (%u, %u, %u) waits at a barrier\n", blockIdx.x,
                        blockIdx.y, blockIdx.z);
                abort();
            }
            pos = i;
            cur = descending ? n - 1 - i : i;
            f[cur].wait = nullptr;
            threadIdx.x = cur;
            swapcontext(&sched, &f[cur].ctx);
            left -= f[cur].done;
        }
    }
};
inline emu_fibers *emu_fiber_pool = new emu_fibers; /* never destroyed: kept for the process's launches */
inline void emu_fibers::entry() {
    (*emu_fiber_pool->body)();
    emu_fiber_pool->f[emu_fiber_pool->cur].done = true; /* returns to sched (uc_link) */
}

/* a barrier of n fibers: a waiter hands the host thread to another fiber until the last one arrives */
struct emu_barrier {
    explicit emu_barrier(unsigned n) : n(n) {}
    void arrive_and_wait() {
        const unsigned g = gen;
        if (++count == n) {
            count = 0;
            gen++;
            emu_fiber_pool->releases++;
            return;
        }
        emu_fiber_pool->wait(&gen, g);
    }
    const unsigned n;
    unsigned count = 0, gen = 0;
};

struct emu_block {
    std::unique_ptr<emu_barrier> all;
    std::vector<std::unique_ptr<emu_barrier>> warps;
    std::vector<std::array<uint64_t, 32>> slots;
};
inline emu_block *emu_blk;

inline void __syncthreads() { emu_blk->all->arrive_and_wait(); }

template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) {
    static_assert(sizeof(T) <= 8, "a shuffle of at most 8 bytes");
    const unsigned t = threadIdx.x, w = t >> 5, l = t & 31;
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    emu_blk->slots[w][l] = bits;
    emu_blk->warps[w]->arrive_and_wait();
    const uint64_t other = emu_blk->slots[w][l ^ (unsigned)o];
    emu_blk->warps[w]->arrive_and_wait();
    T r;
    memcpy(&r, &other, sizeof(T));
    return r;
}

/* every thread of every block of a grid, block after block */
template <class F> void emu_run(dim3 g, dim3 b, const F &body) {
    const unsigned n = b.x * b.y * b.z;
    gridDim = g, blockDim = b;
    emu_block blk;
    blk.all = std::make_unique<emu_barrier>(n);
    for (unsigned w = 0; w < (n + 31) / 32; w++) blk.warps.push_back(std::make_unique<emu_barrier>(n - 32 * w < 32 ? n - 32 * w : 32));
    blk.slots.resize((n + 31) / 32);
    emu_blk = &blk;
    const std::function<void()> job = [&]() { body(); };
    for (unsigned bz = 0; bz < g.z; bz++)
        for (unsigned by = 0; by < g.y; by++)
            for (unsigned bx = 0; bx < g.x; bx++) {
                blockIdx = {bx, by, bz};
                emu_fiber_pool->run(n, job);
            }
}

typedef std::vector<std::function<void()>> emu_jobs;
inline emu_jobs *emu_capture = nullptr; /* the graph being captured, if any */

inline void emu_submit(std::function<void()> job) {
    if (emu_capture) emu_capture->push_back(std::move(job));
    else job();
}

template <class F, class... A> void emu_launch(dim3 g, dim3 b, F f, A... a) {
    emu_submit([=]() { emu_run(g, b, [&]() { f(a...); }); });
}
#define LAUNCH(kernel, grid, block, st, ...) emu_launch(dim3(grid), dim3(block), kernel, __VA_ARGS__)

/* float16 */
struct __half { uint16_t x; };
struct __half2 { __half a, b; };
struct float2 { float x, y; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint4 __ldg(const uint4 *p) { return *p; }
inline uint2 __ldg(const uint2 *p) { return *p; }
inline float __half2float(__half h) {
    uint32_t sign = (uint32_t)(h.x & 0x8000) << 16, exp = (h.x >> 10) & 0x1f, man = h.x & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {
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
inline float2 __half22float2(__half2 h) { return {__half2float(h.a), __half2float(h.b)}; }

/* the runtime */
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorMemoryAllocation = 2 };
inline const char *cudaGetErrorName(cudaError_t e) { return e ? "cudaErrorMemoryAllocation" : "cudaSuccess"; }
inline const char *cudaGetErrorString(cudaError_t e) { return e ? "out of memory (emulated)" : "no error"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
struct cudaDeviceProp {
    char name[256];
    int major, minor;
    size_t totalGlobalMem;
    int multiProcessorCount, integrated, l2CacheSize;
};
inline cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int) {
    memset(p, 0, sizeof *p);
    strcpy(p->name, "CUDA emulated on the CPU (tests/cuda_emu)");
    return cudaSuccess;
}
inline cudaError_t cudaMalloc(void **p, size_t n) {
    *p = aligned_alloc(256, (n + 255) / 256 * 256);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
enum { cudaHostAllocDefault = 0 };
inline cudaError_t cudaHostAlloc(void **p, size_t n, unsigned) { return cudaMalloc(p, n); }
inline cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }
inline cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice,
                      cudaMemcpyDefault };
inline cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind) { memcpy(d, s, n); return cudaSuccess; }
inline cudaError_t cudaMemset(void *d, int v, size_t n) { memset(d, v, n); return cudaSuccess; }

struct emu_stream { int unused; };
typedef emu_stream *cudaStream_t;
enum { cudaStreamNonBlocking = 1 };
enum cudaStreamCaptureMode { cudaStreamCaptureModeThreadLocal };
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) { *s = new emu_stream(); return cudaSuccess; }
inline cudaError_t cudaStreamDestroy(cudaStream_t s) { delete s; return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind, cudaStream_t) {
    emu_submit([=]() { memcpy(d, s, n); }); /* read at replay, as a graph's copy node reads its source */
    return cudaSuccess;
}

struct emu_event { double ms; };
typedef emu_event *cudaEvent_t;
inline cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = new emu_event{0}; return cudaSuccess; }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) { delete e; return cudaSuccess; }
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
    emu_submit([=]() {
        e->ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
    });
    return cudaSuccess;
}
inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) { *ms = (float)(b->ms - a->ms); return cudaSuccess; }

typedef emu_jobs *cudaGraph_t;
typedef emu_jobs *cudaGraphExec_t;
inline cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode) { emu_capture = new emu_jobs(); return cudaSuccess; }
inline cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t *g) { *g = emu_capture; emu_capture = nullptr; return cudaSuccess; }
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t *ex, cudaGraph_t g, unsigned long long) { *ex = new emu_jobs(*g); return cudaSuccess; }
inline cudaError_t cudaGraphDestroy(cudaGraph_t g) { delete g; return cudaSuccess; }
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t g) { delete g; return cudaSuccess; }
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t g, cudaStream_t) { for (auto &job : *g) job(); return cudaSuccess; }
