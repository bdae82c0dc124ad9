// bench_sgemm: the fp32 matrix-multiply rate this CPU reaches through OpenBLAS, as a yardstick for the
// CPU engine (scripts/bench_cpu.sh), and the memory bandwidth its threads reach copying (the CPU machine
// of plan_gpt --cluster cpu: dev/plan/bench_plan.sh cpu). Times cblas_sgemm C = A*B on n x n x n matrices
// (default n = 2048): one warm-up call, then the best of REPS calls, with OpenBLAS's thread count from
// OMP_NUM_THREADS; then each thread copying its own 256 MiB, the best of REPS rounds.
// Prints "sgemm n=N threads=P: X GFLOP/s", counting 2*n^3 floating-point operations per call, and
// "copy threads=P: Y GB/s", counting the bytes read and written.
//   cc -O3 -march=native -fopenmp dev/bench_sgemm.c $(pkg-config --cflags --libs openblas) -o bench_sgemm
//   OMP_NUM_THREADS=2 ./bench_sgemm [n]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#include <cblas.h>

#define REPS 5

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
    int n = argc > 1 ? atoi(argv[1]) : 2048;
    float* a = malloc(sizeof(float) * n * n);
    float* b = malloc(sizeof(float) * n * n);
    float* c = malloc(sizeof(float) * n * n);
    if (!a || !b || !c) { fprintf(stderr, "bench_sgemm: out of memory\n"); return 1; }
    srand(1);
    for (long i = 0; i < (long)n * n; i++) {
        a[i] = rand() / (float)RAND_MAX - 0.5f;
        b[i] = rand() / (float)RAND_MAX - 0.5f;
    }
    double best = 1e30;
    for (int r = 0; r <= REPS; r++) {  // r = 0 is the warm-up (thread pool start, page faults on c)
        double t0 = now_s();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
        double t = now_s() - t0;
        if (r > 0 && t < best) best = t;
    }
    printf("sgemm n=%d threads=%d: %.1f GFLOP/s\n", n, omp_get_max_threads(), 2.0 * n * n * n / best / 1e9);
    free(a); free(b); free(c);
    // memory: far larger than any cache, each thread's pages first touched by that thread
    size_t len = (size_t)256 << 20;
    int threads = omp_get_max_threads(), failed = 0;
    best = 1e30;
#pragma omp parallel reduction(max: failed)
    {
        char* src = malloc(len);
        char* dst = malloc(len);
        failed = !src || !dst;
        if (!failed) memset(src, 1, len), memset(dst, 0, len);
        for (int r = 0; r <= REPS; r++) {
#pragma omp barrier
            double t0 = now_s();
            if (!failed) memcpy(dst, src, len);
#pragma omp barrier
#pragma omp master
            {
                double t = now_s() - t0;
                if (r > 0 && t < best) best = t;
            }
        }
        free(src); free(dst);
    }
    if (failed) { fprintf(stderr, "bench_sgemm: out of memory\n"); return 1; }
    printf("copy threads=%d: %.1f GB/s\n", threads, 2.0 * len * threads / best / 1e9);
    return 0;
}
