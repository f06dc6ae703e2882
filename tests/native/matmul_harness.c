/* es_matmul as a program, for builds this process cannot load (another architecture, run under qemu-user):
     matmul_harness KIND K N T THREADS X W Y
   reads X (T x K float32) and W (the packed matrix: native_format.pack / pack_blocks) from files, writes
   Y (T x N float32) to a file. Exit status: es_matmul's return code, or 2 for bad arguments or files. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int es_matmul(int kind, const float *x, int64_t T, const void *w, int64_t K, int64_t N, float *y, int threads);

static void *slurp(const char *path, long *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *size = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = malloc(*size ? *size : 1);
    if (buf && fread(buf, 1, *size, f) != (size_t)*size) { free(buf); buf = NULL; }
    fclose(f);
    return buf;
}

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: %s KIND K N T THREADS X W Y\n", argv[0]);
        return 2;
    }
    const int kind = atoi(argv[1]), threads = atoi(argv[5]);
    const int64_t K = atoll(argv[2]), N = atoll(argv[3]), T = atoll(argv[4]);
    long xs, ws;
    float *x = slurp(argv[6], &xs);
    void *w = slurp(argv[7], &ws);
    if (!x || !w || xs != (long)(T * K * 4)) {
        fprintf(stderr, "%s: could not read X (%ld bytes, expected %lld) or W\n", argv[0], xs, (long long)(T * K * 4));
        return 2;
    }
    float *y = calloc((size_t)(T * N), sizeof(float));
    const int rc = es_matmul(kind, x, T, w, K, N, y, threads);
    FILE *f = fopen(argv[8], "wb");
    if (!f || fwrite(y, sizeof(float), (size_t)(T * N), f) != (size_t)(T * N)) return 2;
    fclose(f);
    return rc;
}
