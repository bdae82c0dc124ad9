/*
model_check.cu: the launches `scripts/bench_gpu.sh emu check` models one by one, counted by the emulator
(a counting build, like test_cudaemu): two shared-memory test kernels whose only difference is a bank
conflict (every lane of a warp on its own bank, or all 32 on one), the attention kernels of both paths
(flash, and cublas: its permutes, softmax kernels and batched products) for one head at GPT-2 124M's
T = 1024 and head size 64 (modelled at B = 64 and 12 heads: 768 such heads), and the
LayerNorm kernels at 124M's B = 64, T = 1024, C = 768, and the classifier's (the two launches of a
vocab-parallel rank and t = 1's single pass) at 124M's vocabulary for B = 1 (modelled at B = 64), all on
fresh random data. Run it with
CUDAEMU_PROFILE=FILE (and CUDAEMU_HAZARDS=1: every launch is checked for shared-memory hazards too), then
`dev/cudaemu/roofline.py check FILE` prints each launch's roofs.

    make dev/cudaemu/model_check && CUDAEMU_PROFILE=counts.tsv dev/cudaemu/model_check
*/
#define LLMPAR_IMPLEMENTATION  // this file defines llmpar.h's globals (one file of a program does)
#include "../../llmpar.h"

// Each thread stores a shared word and loads its neighbour's, 32 times: lane l at word l * stride of its
// warp's 32 * stride words. Stride 1 puts the lanes on 32 banks (one wavefront a request), 32 on one bank
// (32 wavefronts).
__global__ void shared_stride_kernel(float* out, int stride) {
    float* s = (float*)cudaemu_dynamic_shared() + threadIdx.x / 32 * 32 * stride;
    int lane = threadIdx.x % 32;
    float x = (float)lane;
    for (int i = 0; i < 32; i++) {
        s[lane * stride] = x;
        __syncwarp();
        x = s[(lane + 1) % 32 * stride] + 1.0f;
        __syncwarp();
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}

static floatX* random_bf16(size_t n, uint64_t* rng) {
    floatX* h = (floatX*)lp_host_malloc(n * sizeof(floatX), "model_check");
    for (size_t i = 0; i < n; i++) h[i] = lp_xf(2.0f * lp_rand_f32(rng) - 1.0f);
    floatX* d = (floatX*)lp_device_malloc(n * sizeof(floatX), "model_check");
    cudaCheck(cudaMemcpy(d, h, n * sizeof(floatX), cudaMemcpyHostToDevice));
    free(h);
    return d;
}

int main(void) {
    LPProcess proc;
    memset(&proc, 0, sizeof(proc));
    proc.world = 1;
    LPParallel alone = lp_parallel_one;
    lp_grid_init(&proc, &alone);
    lp_device_init(&proc);
    uint64_t rng = 29;
    int blocks = 264, threads = 128;
    float* out = (float*)lp_device_malloc((size_t)blocks * threads * sizeof(float), "model_check");
    cudaemu_launch("shared_conflict_free", shared_stride_kernel, blocks, threads, 32 * threads * sizeof(float), 0, out, 1);
    cudaemu_launch("shared_conflict_32way", shared_stride_kernel, blocks, threads, 32 * threads * sizeof(float), 0, out, 32);

    int T = 1024, C = 64, NH = 1;  // one head of 124M's attention
    floatX *qkv = random_bf16((size_t)T * 3 * C, &rng), *y = random_bf16((size_t)T * C, &rng);
    floatX *dy = random_bf16((size_t)T * C, &rng), *dqkv = random_bf16((size_t)T * 3 * C, &rng);
    float* lse = (float*)lp_device_malloc((size_t)NH * T * sizeof(float), "model_check");
    lp_flash_attention_forward_gpu(y, lse, qkv, 1, T, C, NH, NH);
    lp_flash_attention_backward_gpu(dqkv, dy, y, qkv, lse, 1, T, C, NH, NH);
    // the cublas path's (--attention cublas): permutes, the batched products, the softmax and its backward
    floatX *qkvr = random_bf16((size_t)3 * T * C, &rng), *att = random_bf16((size_t)T * T, &rng);
    floatX *dqkvr = random_bf16((size_t)3 * T * C, &rng), *datt = random_bf16((size_t)T * T, &rng);
    floatX* scratch = random_bf16((size_t)T * C, &rng);
    lp_attention_forward_gpu(y, qkvr, att, qkv, 1, T, C, NH, NH);
    lp_attention_backward_gpu(dqkv, dqkvr, datt, scratch, dy, qkvr, att, 1, T, C, NH, NH);

    int N = 64 * 1024;  // 124M's LayerNorm rows at B = 64
    C = 768;
    floatX *x = random_bf16((size_t)N * C, &rng), *w = random_bf16(C, &rng), *b = random_bf16(C, &rng);
    floatX *ln = random_bf16((size_t)N * C, &rng), *dln = random_bf16((size_t)N * C, &rng), *dx = random_bf16((size_t)N * C, &rng);
    floatX *dw = random_bf16(C, &rng), *db = random_bf16(C, &rng);
    float *mean = (float*)lp_device_malloc(N * sizeof(float), "model_check"), *rstd = (float*)lp_device_malloc(N * sizeof(float), "model_check");
    lp_layernorm_forward_gpu(ln, mean, rstd, x, w, b, N, C, 1e-5f);
    lp_layernorm_backward_gpu(dx, dw, db, dln, x, w, mean, rstd, N, C);

    N = 1024;  // 124M's classifier rows at B = 1, its (padded) vocabulary
    int V = 50257, Vp = 50304;
    floatX *logits = random_bf16((size_t)N * Vp, &rng), *logits2 = random_bf16((size_t)N * Vp, &rng);
    int* targets_host = (int*)lp_host_malloc(N * sizeof(int), "model_check");
    for (int i = 0; i < N; i++) targets_host[i] = (int)(lp_rand_u32(&rng) % V);
    int* targets = (int*)lp_device_malloc(N * sizeof(int), "model_check");
    cudaCheck(cudaMemcpy(targets, targets_host, N * sizeof(int), cudaMemcpyHostToDevice));
    float *stats = (float*)lp_device_malloc(3 * N * sizeof(float), "model_check"), *losses = (float*)lp_device_malloc(N * sizeof(float), "model_check");
    lp_classifier_stats_gpu(stats, logits, targets, N, Vp, 0, V);
    lp_classifier_grad_gpu(logits, losses, stats, 1, 1.0f / N, targets, N, Vp, 0, V);
    lp_classifier_fused_gpu(logits2, losses, 1.0f / N, targets, N, Vp, V);
    cudaCheck(cudaDeviceSynchronize());
    printf("model_check: counted\n");
    return 0;
}
