/* DRAM read bandwidth: a native read loop over a buffer far larger than the last-level cache, the ceiling a
 * decode step that streams its weights can reach (the roofline of bench/bench_realsize.py and bench/bench_native_profile.py).
 *
 *     cc -O3 -march=native -fopenmp bench/lib/membw.c -o membw && ./membw 512 7 2
 *
 * Arguments: buffer MiB (default 512), repetitions (default 7), OpenMP threads (default: OpenMP's). Each repetition
 * sums every 64-bit word of the buffer twice (a static split across the threads, unrolled by hand and vectorised by
 * the compiler), once with a software prefetch ahead and once without; the buffer is written once before timing
 * (first touch by the thread that reads it). On Linux the buffer is advised for transparent huge pages, as the native
 * step's weights are (edgespec/backends/hugepages.py): 2 MiB pages read 5-15% faster here than 4 KiB ones, and the
 * ceiling is the faster reading. Prints one JSON object: the GB/s of each loop in each repetition
 * (bytes read / wall time, 1 GB = 1e9 bytes), each repetition's faster loop ("gbs"), their best and median, and a
 * checksum (so the loops are not optimised away). Exit 2 on bad arguments or when the buffer cannot be allocated.
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    long mib = argc > 1 ? atol(argv[1]) : 512;
    int reps = argc > 2 ? atoi(argv[2]) : 7;
    int threads = argc > 3 ? atoi(argv[3]) : 0;
    if (mib < 1 || reps < 1 || reps > 1000 || threads < 0) {
        fprintf(stderr, "usage: membw [MiB >= 1] [repetitions 1..1000] [threads >= 0]\n");
        return 2;
    }
    if (threads > 0) omp_set_num_threads(threads);
    size_t n = (size_t)mib * 1024 * 1024 / sizeof(uint64_t);
    const size_t huge = (size_t)2 << 20, bytes = (n * sizeof(uint64_t) + huge - 1) / huge * huge;
    uint64_t *a = aligned_alloc(huge, bytes);
#ifdef MADV_HUGEPAGE
    if (a) madvise(a, bytes, MADV_HUGEPAGE); /* a hint: without huge pages the loop still runs, on 4 KiB pages */
#endif
    if (!a) {
        fprintf(stderr, "membw: cannot allocate %ld MiB\n", mib);
        return 2;
    }
    int used = 1;
#pragma omp parallel
    {
#pragma omp single
        used = omp_get_num_threads();
#pragma omp for schedule(static)
        for (size_t i = 0; i < n; i++) a[i] = i ^ 0x9e3779b97f4a7c15ULL;
    }
    /* each repetition times two loops back to back, one relying on the hardware prefetcher and one that also asks
     * for the line 2 KiB ahead: which reads faster depends on the CPU (an Intel Xeon VM read 20-23 GB/s without the
     * request while a decode step streamed 30; bench/results/NOTES.md, "prefetch"), and the ceiling is the faster */
    double *gbs = malloc(3 * reps * sizeof(double)), *plain = gbs + reps, *ahead = gbs + 2 * reps;
    uint64_t check = 0;
    for (int r = 0; r < reps; r++) {
        for (int v = 0; v < 2; v++) {
            uint64_t s = 0;
            double t0 = omp_get_wtime();
            /* eight words a step in independent pairs (n is a multiple of 8): on this project's 2-core EPYC this
             * read 15-25% more per thread than `s += a[i]` in alternating runs, as fast as four explicit AVX2
             * accumulators */
            if (v == 0) {
#pragma omp parallel for schedule(static) reduction(+ : s)
                for (size_t i = 0; i < n; i += 8)
                    s += ((a[i] + a[i + 1]) + (a[i + 2] + a[i + 3])) + ((a[i + 4] + a[i + 5]) + (a[i + 6] + a[i + 7]));
            } else {
#pragma omp parallel for schedule(static) reduction(+ : s)
                for (size_t i = 0; i < n; i += 8) {
                    __builtin_prefetch(a + i + 256);
                    s += ((a[i] + a[i + 1]) + (a[i + 2] + a[i + 3])) + ((a[i + 4] + a[i + 5]) + (a[i + 6] + a[i + 7]));
                }
            }
            double t = omp_get_wtime() - t0;
            check += s;
            (v ? ahead : plain)[r] = (double)(n * sizeof(uint64_t)) / t / 1e9;
        }
        gbs[r] = plain[r] > ahead[r] ? plain[r] : ahead[r];
    }
    printf("{\"threads\": %d, \"mib\": %ld, \"repetitions\": %d, \"gbs_plain\": [", used, mib, reps);
    for (int r = 0; r < reps; r++) printf("%s%.3f", r ? ", " : "", plain[r]);
    printf("], \"gbs_prefetch\": [");
    for (int r = 0; r < reps; r++) printf("%s%.3f", r ? ", " : "", ahead[r]);
    printf("], \"gbs\": [");
    for (int r = 0; r < reps; r++) printf("%s%.3f", r ? ", " : "", gbs[r]);
    qsort(gbs, reps, sizeof(double), cmp);
    printf("], \"gbs_best\": %.3f, \"gbs_median\": %.3f, \"checksum\": %llu}\n", gbs[reps - 1],
           reps % 2 ? gbs[reps / 2] : 0.5 * (gbs[reps / 2 - 1] + gbs[reps / 2]), (unsigned long long)check);
    free(gbs);
    free(a);
    return 0;
}
