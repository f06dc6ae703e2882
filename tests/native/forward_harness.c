/* es_forward as a program, for builds this process cannot load (another architecture, run under qemu-user):
     forward_harness MODEL CALLS OUT
   MODEL: the es_model struct as the loading process laid it out (the same LP64 layout on every 64-bit target),
   then its pointers as relocations, each replaced here by a copy of the bytes it pointed to:
     int64 struct_bytes, the struct's bytes, int64 n_relocs, then per relocation
       int64 offset (of the pointer field in the struct), int64 count (-1: one array; n: a table of n arrays),
       then per array: int64 nbytes (0: NULL), the bytes
   CALLS: int64 B, Hkv, D, cap, threads, n_calls, then per call: int64 S, int64 start[B], int64 ids[B S]
     (the calls run in order on one cache: a call's rows stay for the next, as the caller commits them)
   OUT: per call, float32 logits (B, S, V), int64 next_ids (B, S), float32 hidden (B, S, E)
   Exit status: es_forward's return code if it failed, 2 for bad arguments or files, else 0. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int64_t es_scratch_floats(const void *m, int64_t T);
int es_forward(const void *m, int64_t B, int64_t S, const int64_t *ids, const float *x_in, const int64_t *start,
               float *const *kc, float *const *vc, int64_t cap, float *logits, int64_t *next_ids, float *hidden,
               float *scratch, int threads);

static FILE *in;

static int64_t i64(void) {
    int64_t v;
    if (fread(&v, 8, 1, in) != 1) { fprintf(stderr, "forward_harness: file ends early\n"); exit(2); }
    return v;
}

static void *blob(int64_t n) {  /* n bytes from the file, 64-byte aligned (the kernels load whole panels) */
    if (n == 0) return NULL;
    void *p = NULL;
    if (n < 0 || posix_memalign(&p, 64, (size_t)n) || fread(p, 1, (size_t)n, in) != (size_t)n) {
        fprintf(stderr, "forward_harness: could not read %lld bytes\n", (long long)n);
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL CALLS OUT\n", argv[0]);
        return 2;
    }
    if (!(in = fopen(argv[1], "rb"))) return 2;
    const int64_t size = i64();
    unsigned char *model = blob(size);
    const int64_t E = ((int64_t *)model)[0], V = ((int64_t *)model)[5], L = ((int64_t *)model)[6];
    for (int64_t r = 0, n = i64(); r < n; r++) {
        const int64_t off = i64(), count = i64();
        void *p;
        if (count < 0) p = blob(i64());
        else {
            void **table = calloc((size_t)count, sizeof(void *));
            for (int64_t j = 0; j < count; j++) table[j] = blob(i64());
            p = table;
        }
        if (off < 0 || off + 8 > size) return 2;
        memcpy(model + off, &p, sizeof p);
    }
    fclose(in);
    if (!(in = fopen(argv[2], "rb"))) return 2;
    const int64_t B = i64(), Hkv = i64(), D = i64(), cap = i64(), threads = i64(), calls = i64();
    float **kc = calloc((size_t)(B * L), sizeof(float *)), **vc = calloc((size_t)(B * L), sizeof(float *));
    for (int64_t j = 0; j < B * L; j++) {  /* rows never written read as NaN: none may reach an output */
        kc[j] = malloc((size_t)(Hkv * cap * D) * 4), vc[j] = malloc((size_t)(Hkv * cap * D) * 4);
        for (int64_t i = 0; i < Hkv * cap * D; i++) kc[j][i] = vc[j][i] = __builtin_nanf("");
    }
    FILE *out = fopen(argv[3], "wb");
    if (!out) return 2;
    for (int64_t c = 0; c < calls; c++) {
        const int64_t S = i64(), T = B * S;
        int64_t *start = blob(B * 8), *ids = blob(T * 8);
        float *logits = malloc((size_t)(T * V) * 4), *hidden = malloc((size_t)(T * E) * 4);
        int64_t *next = malloc((size_t)T * 8);
        float *scratch = malloc((size_t)es_scratch_floats(model, T) * 4);
        const int rc = es_forward(model, B, S, ids, NULL, start, kc, vc, cap, logits, next, hidden, scratch,
                                  (int)threads);
        if (rc != 0) return rc < 0 ? -rc + 2 : rc;
        fwrite(logits, 4, (size_t)(T * V), out), fwrite(next, 8, (size_t)T, out);
        fwrite(hidden, 4, (size_t)(T * E), out);
        free(start), free(ids), free(logits), free(hidden), free(next), free(scratch);
    }
    return fclose(out) ? 2 : 0;
}
