/*
llmc_driver.cu: launches one kernel version of one of llm.c's dev/cuda files once, on random data, under
the emulator's counting build, so that roofline.py can model the launch beside a published timing of it
(dev/docs/figures.md, "Calibration: published kernel timings against the model"). llm.c's code is not
part of this project: dev/cudaemu/calibrate_llmc.sh copies a user's checkout of it, rewrites each
kernel<<<grid, block, shmem, stream>>>(args) as cudaemu_launch("kernel", kernel, grid, block, shmem, stream,
args) (g++ does not parse the chevrons), and builds this file with the copy as LLMC_FILE (make llmc_driver).
The file's own main (its benchmark loop, timed with CUDA events on a GPU) is renamed away and never runs;
this main calls the file's own dispatch function (the one its benchmark times) with the version and block
size asked for, then checks the result against the file's own CPU reference.

    dev/cudaemu/llmc_driver VERSION BLOCK_SIZE B T C      # as the file's benchmark: ./layernorm_forward VERSION
*/
#define main llmc_main
#include LLMC_FILE
#undef main

// What the file's benchmark and setup call but this driver does not: cuBLAS (setup_main), events' elapsed
// time and the synchronous memset (benchmark_kernel). The emulator has none of them; they stop the run.
#define LLMC_ABSENT(call) (fprintf(stderr, "llmc_driver: %s is not emulated\n", call), exit(1))
extern "C" cublasStatus_t cublasCreate_v2(cublasHandle_t*) { LLMC_ABSENT("cublasCreate"); }
extern "C" cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { LLMC_ABSENT("cublasSetMathMode"); }
extern "C" cudaError_t cudaEventElapsedTime(float*, cudaEvent_t, cudaEvent_t) { LLMC_ABSENT("cudaEventElapsedTime"); }
cudaDeviceProp deviceProp;  // declared extern by common.h, defined by some of llm.c's files' mains

static float* device_random(size_t n, float lo, float hi, float** host) {
    *host = (float*)malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) (*host)[i] = lo + (hi - lo) * ((float)rand() / RAND_MAX);
    float* d;
    cudaCheck(cudaMalloc((void**)&d, n * sizeof(float)));
    cudaCheck(cudaMemcpy(d, *host, n * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}

int main(int argc, char** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s VERSION BLOCK_SIZE B T C\n", argv[0]);
        return 1;
    }
    int version = atoi(argv[1]), block_size = atoi(argv[2]), B = atoi(argv[3]), T = atoi(argv[4]), C = atoi(argv[5]);
    srand(0);
#if defined(LLMC_LAYERNORM_FORWARD)
    // dev/cuda/layernorm_forward.cu: layernorm_forward(version, ...) on fp32 x (B, T, C), weight and bias (C)
    size_t n = (size_t)B * T * C;
    float *x, *w, *b;
    float *d_x = device_random(n, -1.0f, 1.0f, &x), *d_w = device_random(C, -1.0f, 1.0f, &w), *d_b = device_random(C, -1.0f, 1.0f, &b);
    float *d_out, *d_mean, *d_rstd;
    cudaCheck(cudaMalloc((void**)&d_out, n * sizeof(float)));
    cudaCheck(cudaMalloc((void**)&d_mean, (size_t)B * T * sizeof(float)));
    cudaCheck(cudaMalloc((void**)&d_rstd, (size_t)B * T * sizeof(float)));
    layernorm_forward(version, d_out, d_mean, d_rstd, d_x, d_w, d_b, B, T, C, block_size);
    cudaCheck(cudaDeviceSynchronize());
    float *out = (float*)malloc(n * sizeof(float)), *mean = (float*)malloc((size_t)B * T * sizeof(float));
    float* rstd = (float*)malloc((size_t)B * T * sizeof(float));
    layernorm_forward_cpu(out, mean, rstd, x, w, b, B, T, C);
    validate_result(d_out, out, "out", n, 1e-5f);
    validate_result(d_mean, mean, "mean", (size_t)B * T, 1e-5f);
    validate_result(d_rstd, rstd, "rstd", (size_t)B * T, 1e-5f);
#else
#error "llmc_driver: no section for this file (calibrate_llmc.sh defines LLMC_<FILE>)"
#endif
    printf("llmc_driver: version %d, block size %d, B %d T %d C %d: launched once, matches the file's CPU reference\n",
           version, block_size, B, T, C);
    return 0;
}
