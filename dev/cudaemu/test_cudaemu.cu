/*
test_cudaemu.cu: the CUDA emulator's own tests. Each case is a small CUDA program run in a child process
(this binary with the case's name): the correct ones must run and give the right values, and each broken
one (a missing barrier, a divergent barrier, a shuffle with inactive lanes, a write past an allocation, a
missing stream wait, a bad GEMM leading dimension, ...) must be caught with a one-line error naming it.

    make dev/cudaemu/test_cudaemu && dev/cudaemu/test_cudaemu        # all cases; ends with N passed, N failed
    dev/cudaemu/test_cudaemu shuffles                                 # one case, in this process
*/
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <pthread.h>
#include <unistd.h>

#define CHECK(call)                                                                                     \
    do {                                                                                                \
        cudaError_t e_ = (call);                                                                        \
        if (e_ != cudaSuccess) {                                                                        \
            printf("%s failed: %s\n", #call, cudaGetErrorString(e_));                                   \
            exit(3);                                                                                    \
        }                                                                                               \
    } while (0)
#define LAUNCH(kernel, grid, block, shmem, stream, ...) cudaemu_launch(#kernel, kernel, grid, block, shmem, stream, __VA_ARGS__)

static int* device_ints(int n) {
    int* d;
    CHECK(cudaMalloc((void**)&d, n * sizeof(int)));
    CHECK(cudaMemset(d, 0, n * sizeof(int)));
    return d;
}
static void expect_ints(const int* d, const int* want, int n, const char* what) {
    int* h = (int*)malloc(n * sizeof(int));
    CHECK(cudaMemcpy(h, d, n * sizeof(int), cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (h[i] != want[i]) {
            printf("%s: element %d is %d, want %d\n", what, i, h[i], want[i]);
            exit(2);
        }
    free(h);
}

// ---- kernels

// Sum of a block's values through shared memory; `barrier` 0 leaves out the barrier between the writes
// and the reads.
__global__ void block_sum(int* out, const int* in, int barrier) {
    __shared__ int part[256];
    part[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
    if (barrier) __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (unsigned i = 0; i < blockDim.x; i++) s += part[i];
        out[blockIdx.x] = s;
    }
}

__global__ void divergent_barrier(int* out) {
    if (threadIdx.x < 16) __syncthreads();
    out[threadIdx.x] = 1;
}

__global__ void shuffles(int* out) {  // each lane's results of four shuffles, packed
    int lane = threadIdx.x % 32, v = 100 + lane;
    int x = __shfl_xor_sync(0xffffffffu, v, 5);
    int up = __shfl_up_sync(0xffffffffu, v, 3);
    int down = __shfl_down_sync(0xffffffffu, v, 3, 16);  // within 16-lane segments
    int idx = __shfl_sync(0xffffffffu, v, 7);
    out[threadIdx.x * 4 + 0] = x;
    out[threadIdx.x * 4 + 1] = up;
    out[threadIdx.x * 4 + 2] = down;
    out[threadIdx.x * 4 + 3] = idx;
}

__global__ void partial_warp_shuffle(int* out) {  // lanes 16..31 leave before the full-mask shuffle
    int v = threadIdx.x;
    if (threadIdx.x >= 16) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, 1);
}

__global__ void coordinates(int* out) {  // every thread of a 3-D grid of 3-D blocks writes its own slot once
    int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int per = blockDim.x * blockDim.y * blockDim.z;
    out[block * per + thread] += block * 1000 + thread;
}

__global__ void write_one_past(int* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i] = i;  // should be i < n
}

__global__ void fill(int* out, int n, int value) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
__global__ void twice(int* out, const int* in, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 2 * in[i];
}

__global__ void dynamic_shared_reverse(int* out) {  // dynamic shared memory, read back by another thread
    int* s = (int*)cudaemu_dynamic_shared();
    s[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}

// Kernels whose global-memory sectors are known (the counting case): coalesced, one sector per lane,
// a 32 x 32 matrix read by columns (each warp request spans 32 sectors, the launch 128 distinct ones),
// 16-byte vector copies, and 4-byte reads 2 bytes off alignment (a warp's 128 bytes span 5 sectors).
__global__ void copy_floats(float* out, const float* in) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = in[i];
}
__global__ void copy_strided(float* out, const float* in) {
    int i = (blockIdx.x * blockDim.x + threadIdx.x) * 32;
    out[i] = in[i];
}
__global__ void read_columns(float* out, const float* in) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = in[i % 32 * 32 + i / 32];
}
__global__ void copy_float4(float4* out, const float4* in) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = in[i];
}
struct __attribute__((packed)) unaligned_int {  // GCC 12 checks it with __tsan_read_range
    int v;
};
__global__ void read_unaligned(int* out, const char* in) {
    int i = blockIdx.x * blockDim.x + threadIdx.x, v = ((const unaligned_int*)(in + 2 + 4 * i))->v;
    memcpy(out + i, &v, 4);  // and __tsan_write_range for this
}

// Shared-memory requests whose wavefronts are known: lane l of each warp stores and loads word l * stride
// of its warp's region (stride 1: conflict-free, 2: two lanes per bank, 32: all on one), all lanes load
// word 0 (a broadcast: one), and each lane loads a float2 and a float4 of consecutive words (two and four).
__global__ void shared_banks(float* out, int stride) {
    float* s = (float*)cudaemu_dynamic_shared() + threadIdx.x / 32 * 128 * stride;
    int lane = threadIdx.x % 32;
    s[lane * stride] = lane;
    __syncwarp();
    out[threadIdx.x] = s[lane * stride] + s[0];
    ((float2*)(out + 64))[threadIdx.x] = ((const float2*)s)[lane];  // copied whole: one 8-byte load, one 16-byte
    ((float4*)(out + 192))[threadIdx.x] = ((const float4*)s)[lane];
}
// ldmatrix.x4 of 32 rows of 16 bytes, `pitch` bf16 apart: 8 packs them (4 wavefronts, the least for 512
// bytes), 64 puts every row on banks 0-3 (32 wavefronts).
__global__ void ldmatrix_rows(uint32_t* out, int pitch) {
    uint16_t* s = (uint16_t*)cudaemu_dynamic_shared();
    uint32_t r[4];
    cudaemu_ldmatrix_x4(r, s + threadIdx.x * pitch, 1);
    out[threadIdx.x] = r[0] + r[1] + r[2] + r[3];
}
// Three special functions per lane, and one more on half of each warp's lanes (still one instruction).
static const int special_functions_line = __LINE__ + 1;  // the kernel's first line, for the counts per line
__global__ void special_functions(float* out) {
    float x = out[threadIdx.x];
    for (int k = 0; k < 3; k++) x = expf(0.1f * x);
    if (threadIdx.x % 32 < 16) x = logf(x + 2.0f);
    out[threadIdx.x] = x;
}
// Cooperative groups as llm.c's dev/cuda kernels use them, in a 2-D block of 3 warps (32 x 3): 32-lane
// tiles (meta_group_rank, thread_rank, shfl_down) summing their lanes with cg::reduce, 8-lane tiles taking
// their largest, a float reduce; each thread writes what it got.
__global__ void cg_tiles(int* out) {
    namespace cg = cooperative_groups;
    cg::thread_block block = cg::this_thread_block();
    cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);
    cg::thread_block_tile<8> eight = cg::tiled_partition<8>(block);
    int i = (int)block.thread_rank();
    int* o = out + i * 7;
    o[0] = (int)warp.meta_group_rank();
    o[1] = (int)warp.thread_rank();
    o[2] = cg::reduce(warp, i, cg::plus<int>{});
    o[3] = cg::reduce(eight, i, cg::greater<int>{});
    o[4] = (int)eight.meta_group_size();
    o[5] = warp.shfl_down(i, 1);
    o[6] = (int)cg::reduce(warp, 0.5f * (float)i, cg::plus<float>{});
}
// Hazards the race check cannot see: every thread writes the same value to one word with no barrier (the
// bytes agree in every order), and a lane reading what its neighbour wrote, with or without __syncwarp.
__global__ void same_value(int* out) {
    __shared__ int flag;
    flag = 1;
    __syncthreads();
    if (threadIdx.x == 0) out[0] = flag;
}
__global__ void warp_exchange(int* out, int sync) {
    __shared__ int s[32];
    s[threadIdx.x] = threadIdx.x;
    if (sync) __syncwarp();
    out[threadIdx.x] = s[threadIdx.x ^ 1];
}

// float -> fp16 -> float in a kernel (__float2half_rn and __half2float, as a GPU converts), and the fp16
// bits.
__global__ void half_round_trip(float* back, unsigned short* bits, const float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    __half h = __float2half_rn(x[i]);
    back[i] = __half2float(h);
    bits[i] = __half_as_ushort(h);
}

// One m16n8k16 product per warp: each lane's registers (4 of A, 2 of B, 4 of C) as the host placed them,
// its 4 elements of D back in the same order; A and B of `type` (CUDA_R_16BF or CUDA_R_16F).
__global__ void mma_product(float* d, const uint32_t* a, const uint32_t* b, const float* c, int type) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    uint32_t ra[4] = {a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]}, rb[2] = {b[2 * i], b[2 * i + 1]};
    float rc[4] = {c[4 * i], c[4 * i + 1], c[4 * i + 2], c[4 * i + 3]}, rd[4];
    cudaemu_mma_m16n8k16(rd, ra, rb, rc, (cudaDataType)type);
    for (int k = 0; k < 4; k++) d[4 * i + k] = rd[k];
}

__global__ void mma_partial_warp(float* d, const uint32_t* a, const uint32_t* b, const float* c) {  // lanes 16..31 leave first
    if (threadIdx.x >= 16) return;
    float rd[4];
    cudaemu_mma_m16n8k16(rd, a, b, c, CUDA_R_16BF);
    d[threadIdx.x] = rd[0];
}

// A 16 x 24 bf16 matrix (pitch 24) staged in shared memory and read by ldmatrix.x4 (.trans): lane l names
// row rows[l] of column block cols[l]; each lane's 4 registers come back. `skew` (2 bytes) misaligns the rows.
__global__ void ldmatrix_load(uint32_t* d, const uint16_t* m, const int* rows, const int* cols, int skew, int trans) {
    int lane = threadIdx.x;
    uint16_t* s = (uint16_t*)cudaemu_dynamic_shared();
    for (int i = lane; i < 16 * 24; i += 32) s[i] = m[i];
    __syncwarp();
    uint32_t r[4];
    cudaemu_ldmatrix_x4(r, s + rows[lane] * 24 + 8 * cols[lane] + skew, trans);
    for (int i = 0; i < 4; i++) d[4 * lane + i] = r[i];
}
__global__ void ldmatrix_partial_warp(uint32_t* d, const uint16_t* m) {  // lanes 16..31 leave first
    if (threadIdx.x >= 16) return;
    uint32_t r[4];
    cudaemu_ldmatrix_x4(r, m, 1);
    d[threadIdx.x] = r[0];
}

// Tiles of 64 x 4 ints streamed through two shared buffers by cp.async, the next tile in flight while this
// one is read (a double-buffered pipeline, as the flash kernels run): each thread copies its own 16 bytes
// (the last 4 threads only 4 of them from global memory, the rest zeros) and reads its neighbour's, so each
// read needs the copier's wait and a barrier. out[i] = the sum over tiles of thread i + 1's 4 elements
// (mod 64). wait = 1 is correct; 2 reads a tile before its wait covers it; reuse = 0 leaves out the
// barrier before a buffer is copied into again (its readers may not be done).
__global__ void async_tiles(int* out, const int* in, int tiles, int wait, int reuse) {
    int* buf = (int*)cudaemu_dynamic_shared();  // 2 x 256 ints
    int i = threadIdx.x, next = (i + 1) % 64, bytes = i < 60 ? 16 : 4, sum = 0;
    cudaemu_cp_async16(buf + 4 * i, in + 4 * i, bytes);
    cudaemu_cp_async_commit();
    for (int t = 0; t < tiles; t++) {
        if (t + 1 < tiles) cudaemu_cp_async16(buf + 256 * ((t + 1) % 2) + 4 * i, in + 256 * (t + 1) + 4 * i, bytes);
        cudaemu_cp_async_commit();  // (an empty group on the last tile, so that one wait fits every tile)
        cudaemu_cp_async_wait(wait);
        __syncthreads();
        for (int k = 0; k < 4; k++) sum += buf[256 * (t % 2) + 4 * next + k];
        if (reuse) __syncthreads();
    }
    out[i] = sum;
}

// ---- cases: 0 and the right values, or an error

// mma.m16n8k16 for two warps, each with its own random A (16 x 16) and B (16 x 8) of `type` (bf16, or fp16:
// the .f16 instruction the fp16 build issues) and fp32 C, against a double-precision product. The registers are filled by the PTX ISA's formulas (section "Matrix Fragments
// for mma.m16n8k16 with floating point type"), written out here apart from the emulator's: with
// g = lane / 4, t = lane % 4, A's element ai (i = 0..7, two per register, lower i in the low half) sits at
// row g for i in {0, 1, 4, 5}, else g + 8, column 2t + (i & 1), + 8 for i >= 4; B's bi (i = 0..3) at row
// 2t + (i & 1), + 8 for i >= 2, column g; C's and D's ci at row g, + 8 for i >= 2, column 2t + (i & 1).
static uint16_t mma_operand(float x, int type, float* rounded) {  // x rounded to the type, and its bits
    if (type == CUDA_R_16F) {
        __half v = __float2half(x);
        *rounded = __half2float(v);
        return __half_as_ushort(v);
    }
    __nv_bfloat16 v = __float2bfloat16(x);
    *rounded = __bfloat162float(v);
    return __bfloat16_as_ushort(v);
}
static int case_mma(int type) {
    enum { WARPS = 2, LANES = 32 * WARPS };
    srand((unsigned)time(NULL));
    cudaemu_racecheck(1);
    float ha[WARPS][16][16], hb[WARPS][16][8], hc[WARPS][16][8], hd[LANES * 4], rc[LANES * 4];
    uint32_t ra[LANES * 4] = {}, rb[LANES * 2] = {};
    for (int w = 0; w < WARPS; w++)
        for (int l = 0; l < 32; l++) {
            int g = l / 4, t = l % 4, lane = 32 * w + l;
            for (int i = 0; i < 8; i++) {
                int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8, col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
                uint16_t v = mma_operand(2.0f * rand() / RAND_MAX - 1.0f, type, &ha[w][row][col]);
                ra[4 * lane + i / 2] |= (uint32_t)v << (16 * (i & 1));
            }
            for (int i = 0; i < 4; i++) {
                int row = 2 * t + (i & 1) + (i >= 2 ? 8 : 0);
                uint16_t v = mma_operand(2.0f * rand() / RAND_MAX - 1.0f, type, &hb[w][row][g]);
                rb[2 * lane + i / 2] |= (uint32_t)v << (16 * (i & 1));
                hc[w][g + (i >= 2 ? 8 : 0)][2 * t + (i & 1)] = rc[4 * lane + i] = 2.0f * rand() / RAND_MAX - 1.0f;
            }
        }
    uint32_t *a, *b;
    float *c, *d;
    CHECK(cudaMalloc((void**)&a, sizeof(ra)));
    CHECK(cudaMalloc((void**)&b, sizeof(rb)));
    CHECK(cudaMalloc((void**)&c, sizeof(rc)));
    CHECK(cudaMalloc((void**)&d, sizeof(hd)));
    CHECK(cudaMemcpy(a, ra, sizeof(ra), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b, rb, sizeof(rb), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(c, rc, sizeof(rc), cudaMemcpyHostToDevice));
    LAUNCH(mma_product, 1, LANES, 0, 0, d, a, b, c, type);
    CHECK(cudaMemcpy(hd, d, sizeof(hd), cudaMemcpyDeviceToHost));
    for (int lane = 0; lane < LANES; lane++)
        for (int i = 0; i < 4; i++) {
            int w = lane / 32, row = (lane % 32) / 4 + (i >= 2 ? 8 : 0), col = 2 * (lane % 4) + (i & 1);
            double ref = hc[w][row][col], mag = fabs(ref);
            for (int k = 0; k < 16; k++) {
                double p = (double)ha[w][row][k] * hb[w][k][col];
                ref += p, mag += fabs(p);
            }
            if (!(fabs(hd[4 * lane + i] - ref) <= 1e-6 * mag)) {  // 17 fp32 roundings of sums below mag
                printf("mma.m16n8k16: warp %d lane %d d%d (D[%d][%d]) = %.8g, want %.8g\n", w, lane % 32, i, row, col,
                       hd[4 * lane + i], ref);
                return 2;
            }
        }
    return 0;
}

// ldmatrix.x4: the rows of the four 8 x 8 matrices come from the lanes' addresses (here in a scrambled
// order, from a 16 x 24 matrix in shared memory), and by the PTX ISA (ldmatrix: each 4 lanes get a row,
// the first lane the first 2 elements; "Optional qualifier .trans indicates that the matrix is loaded in
// column-major format") lane l's register i holds matrix i's row l / 4 at columns 2 (l % 4) (low half) and
// 2 (l % 4) + 1, or with .trans its column l / 4 at those rows. skew: the addresses 2 bytes off alignment,
// an error.
static int case_ldmatrix(int skew, int trans) {
    cudaemu_racecheck(1);
    uint16_t hm[16 * 24];
    int rows[32], cols[32];
    srand((unsigned)time(NULL));
    for (int i = 0; i < 16 * 24; i++) hm[i] = (uint16_t)rand();
    for (int l = 0; l < 32; l++) rows[l] = (5 * l + 3) % 16, cols[l] = (l * 7 / 5) % 3;  // any rows, any 16-byte column blocks
    uint16_t* m;
    uint32_t* d;
    int *drows, *dcols;
    CHECK(cudaMalloc((void**)&m, sizeof(hm)));
    CHECK(cudaMalloc((void**)&d, 4 * 32 * sizeof(uint32_t)));
    CHECK(cudaMalloc((void**)&drows, sizeof(rows)));
    CHECK(cudaMalloc((void**)&dcols, sizeof(cols)));
    CHECK(cudaMemcpy(m, hm, sizeof(hm), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(drows, rows, sizeof(rows), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dcols, cols, sizeof(cols), cudaMemcpyHostToDevice));
    LAUNCH(ldmatrix_load, 1, 32, sizeof(hm) + 16, 0, d, m, drows, dcols, skew, trans);
    uint32_t hd[4 * 32];
    CHECK(cudaMemcpy(hd, d, sizeof(hd), cudaMemcpyDeviceToHost));
    for (int l = 0; l < 32; l++)
        for (int i = 0; i < 4; i++) {
            int r0 = 2 * (l % 4), c = l / 4, r = l / 4;  // trans: rows r0, r0 + 1 at column c (lanes 8i + r0, 8i + r0 + 1 named them)
            uint16_t lo = trans ? hm[rows[8 * i + r0] * 24 + 8 * cols[8 * i + r0] + c] : hm[rows[8 * i + r] * 24 + 8 * cols[8 * i + r] + r0];
            uint16_t hi = trans ? hm[rows[8 * i + r0 + 1] * 24 + 8 * cols[8 * i + r0 + 1] + c] : hm[rows[8 * i + r] * 24 + 8 * cols[8 * i + r] + r0 + 1];
            uint32_t want = lo | (uint32_t)hi << 16;
            if (hd[4 * l + i] != want) {
                printf("ldmatrix.x4%s: lane %d register %d is 0x%08x, want 0x%08x\n", trans ? ".trans" : "", l, i, hd[4 * l + i], want);
                return 2;
            }
        }
    return 0;
}

// The pipeline above: correct, it gives the sums in every thread order (the race check) and passes the
// hazard check; which = 1 (read before the wait) must fail the race check, 2 the same the hazard check, 3
// (a buffer copied into before its readers are done) the hazard check.
static int case_cp_async(int which) {
    enum { TILES = 5 };
    int h[TILES * 256], want[64] = {};
    srand((unsigned)time(NULL));
    for (int i = 0; i < TILES * 256; i++) h[i] = rand() % 1000;
    for (int t = 0; t < TILES; t++)
        for (int i = 0; i < 64; i++)
            for (int k = 0; k < ((i + 1) % 64 < 60 ? 4 : 1); k++) want[i] += h[256 * t + 4 * ((i + 1) % 64) + k];
    int *in = device_ints(TILES * 256), *out = device_ints(64);
    CHECK(cudaMemcpy(in, h, sizeof(h), cudaMemcpyHostToDevice));
    if (which <= 1) cudaemu_racecheck(1);
    if (which == 0 || which >= 2) cudaemu_hazards(1);
    LAUNCH(async_tiles, 1, 64, 2 * 256 * sizeof(int), 0, out, in, TILES, which == 1 || which == 2 ? 2 : 1, which != 3);
    CHECK(cudaDeviceSynchronize());
    expect_ints(out, want, 64, "cp.async pipeline");
    return 0;
}

static int case_block_sum(int barrier) {
    cudaemu_racecheck(1);
    int n = 4 * 256, *in = device_ints(n), *out = device_ints(4);
    int h[1024], want[4] = {0, 0, 0, 0};
    for (int i = 0; i < n; i++) {
        h[i] = i % 97;
        want[i / 256] += h[i];
    }
    CHECK(cudaMemcpy(in, h, sizeof(h), cudaMemcpyHostToDevice));
    LAUNCH(block_sum, 4, 256, 0, 0, out, in, barrier);
    expect_ints(out, want, 4, "block_sum");
    return 0;
}

static int case_shuffles(void) {
    cudaemu_racecheck(1);
    int *out = device_ints(64 * 4), want[64 * 4];
    for (int t = 0; t < 64; t++) {
        int l = t % 32, v = 100 + l;
        want[t * 4 + 0] = 100 + (l ^ 5);
        want[t * 4 + 1] = l >= 3 ? v - 3 : v;
        want[t * 4 + 2] = l % 16 + 3 < 16 ? v + 3 : v;
        want[t * 4 + 3] = 107;
    }
    LAUNCH(shuffles, 1, 64, 0, 0, out);
    expect_ints(out, want, 64 * 4, "shuffles");
    return 0;
}

static int case_cooperative_groups(void) {
    cudaemu_racecheck(1);
    cudaemu_profile(1);
    int *out = device_ints(96 * 7), want[96 * 7];
    for (int i = 0; i < 96; i++) {
        int w = i / 32, l = i % 32;
        int* x = want + i * 7;
        x[0] = w, x[1] = l, x[2] = 32 * 32 * w + 496, x[3] = i / 8 * 8 + 7, x[4] = 12, x[5] = l < 31 ? i + 1 : i;
        x[6] = (32 * 32 * w + 496) / 2;
    }
    LAUNCH(cg_tiles, 1, dim3(32, 3), 0, 0, out);
    expect_ints(out, want, 96 * 7, "cg_tiles");
    // per warp: 5 shuffles for each 32-lane reduce, 3 for each of its four 8-lane tiles' (a tile's shuffles
    // are its own warp operations here), 1 shfl_down
    cudaemu_counts c = cudaemu_profile_counts("cg_tiles");
    if (c.shuffles != 3 * (5 + 4 * 3 + 1 + 5)) {
        printf("cg_tiles: %.0f shuffles, want %d\n", c.shuffles, 3 * (5 + 4 * 3 + 1 + 5));
        return 5;
    }
    return 0;
}

static int case_coordinates(void) {
    cudaemu_racecheck(1);
    dim3 grid(3, 2, 2), block(4, 3, 2);
    int n = 12 * 24, *out = device_ints(n), want[12 * 24];
    for (int i = 0; i < n; i++) want[i] = i / 24 * 1000 + i % 24;
    LAUNCH(coordinates, grid, block, 0, 0, out);
    expect_ints(out, want, n, "coordinates");
    return 0;
}

static int case_dynamic_shared(void) {
    cudaemu_racecheck(1);
    int *out = device_ints(128), want[128];
    for (int i = 0; i < 128; i++) want[i] = 127 - i;
    LAUNCH(dynamic_shared_reverse, 1, 128, 128 * sizeof(int), 0, out);
    expect_ints(out, want, 128, "dynamic shared memory");
    return 0;
}

// Produce on one stream, consume on another: with the event wait the values are right in every order the
// emulator picks; without it the consumer can run first and reads the old values.
#ifdef LLMPAR_NCCL
// A receive whose send never comes (from itself, on a one-rank communicator) holds its stream, as a
// collective whose peer has stopped does; ncclCommAbort from another thread ends it: the host's wait returns,
// the stream's later work runs, and the communicator refuses further calls. (SIGALRM fails a hang.)
static ncclComm_t abort_comm;
static void* abort_later(void*) {
    usleep(200000);
    return (void*)(intptr_t)ncclCommAbort(abort_comm);
}
static int case_nccl_abort(void) {
    alarm(20);
    MPI_Init(NULL, NULL);
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    if (ncclCommInitRank(&abort_comm, 1, id, 0) != ncclSuccess) return 1;
    int* d = device_ints(64);
    int want[64];
    for (int i = 0; i < 64; i++) want[i] = 7;
    if (ncclRecv(d, 64, ncclInt32, 0, abort_comm, 0) != ncclSuccess) return 1;
    LAUNCH(fill, 1, 64, 0, 0, d, 64, 7);
    pthread_t t;
    void* aborted;
    pthread_create(&t, NULL, abort_later, NULL);
    CHECK(cudaDeviceSynchronize());
    pthread_join(t, &aborted);
    expect_ints(d, want, 64, "the stream's work after the aborted receive");
    if ((ncclResult_t)(intptr_t)aborted != ncclSuccess) return 1;
    ncclResult_t after = ncclAllReduce(d, d, 64, ncclFloat32, ncclSum, abort_comm, 0);  // (valid but for the abort)
    printf("a call after the abort: %s\n", ncclGetErrorString(after));
    fflush(stdout);
    _exit(after == ncclInvalidUsage ? 0 : 1);  // (MPI still holds the receive: no MPI_Finalize)
}
#endif

static int case_streams(int wait) {
    cudaStream_t a, b;
    cudaEvent_t done;
    CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    int n = 256, *x = device_ints(n), *y = device_ints(n), want[256];
    for (int i = 0; i < n; i++) want[i] = 14;
    for (int k = 0; k < 8; k++) LAUNCH(fill, 1, 256, 0, a, x, n, k);  // the producer's stream is busy first
    LAUNCH(fill, 1, 256, 0, a, x, n, 7);
    CHECK(cudaEventRecord(done, a));
    if (wait) CHECK(cudaStreamWaitEvent(b, done, 0));
    LAUNCH(twice, 1, 256, 0, b, y, x, n);
    CHECK(cudaDeviceSynchronize());
    expect_ints(y, want, n, wait ? "with the wait" : "a missing cudaStreamWaitEvent: the consumer read before the producer wrote");
    return 0;
}

// cudaEventElapsedTime: between two records on a stream, the time its work between them took (the emulator's
// clock): positive across 8 launches, and ordered (a to b plus b to c is a to c, within a microsecond).
static int case_event_times(void) {
    cudaStream_t s;
    cudaEvent_t e[3];
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (int k = 0; k < 3; k++) CHECK(cudaEventCreate(&e[k]));
    int n = 1 << 16, *x = device_ints(n);
    CHECK(cudaEventRecord(e[0], s));
    for (int k = 0; k < 8; k++) LAUNCH(fill, n / 256, 256, 0, s, x, n, k);
    CHECK(cudaEventRecord(e[1], s));
    LAUNCH(fill, n / 256, 256, 0, s, x, n, 9);
    CHECK(cudaEventRecord(e[2], s));
    float ab = 0.0f, bc = 0.0f, ac = 0.0f;
    CHECK(cudaEventElapsedTime(&ab, e[0], e[1]));
    CHECK(cudaEventElapsedTime(&bc, e[1], e[2]));
    CHECK(cudaEventElapsedTime(&ac, e[0], e[2]));
    printf("elapsed: %.4f + %.4f = %.4f ms\n", ab, bc, ac);
    return ab > 0.0f && bc > 0.0f && fabsf(ab + bc - ac) < 1e-3f ? 0 : 6;
}

// The counts of each kernel above, and of a GEMM, exactly (bytes are 32-byte sectors times 32).
static int expect_counts(const char* name, double read, double written, double unique_read, double unique_written, double flops) {
    cudaemu_counts c = cudaemu_profile_counts(name);
    if (c.launches == 1 && c.read_bytes == read && c.write_bytes == written && c.unique_read_bytes == unique_read &&
        c.unique_write_bytes == unique_written && c.flops == flops)
        return 0;
    printf("%s: %ld launches, bytes read %.0f written %.0f, distinct read %.0f written %.0f, %.0f FLOPs; want 1 launch, "
           "%.0f %.0f, %.0f %.0f, %.0f\n", name, c.launches, c.read_bytes, c.write_bytes, c.unique_read_bytes,
           c.unique_write_bytes, c.flops, read, written, unique_read, unique_written, flops);
    return 5;
}

static int case_counts(void) {
    const int n = 1024;  // threads of each launch, 4 blocks of 256
    float *in, *out;
    CHECK(cudaMalloc((void**)&in, 32 * n * sizeof(float)));
    CHECK(cudaMalloc((void**)&out, 32 * n * sizeof(float)));
    CHECK(cudaMemset(in, 0, 32 * n * sizeof(float)));
    cudaemu_profile(1);
    cudaemu_racecheck(1);  // its reruns are not counted
    LAUNCH(copy_floats, n / 256, 256, 0, 0, out, in);
    cudaemu_racecheck(0);
    LAUNCH(copy_strided, n / 256, 256, 0, 0, out, in);
    LAUNCH(read_columns, n / 256, 256, 0, 0, out, in);
    LAUNCH(copy_float4, n / 256, 256, 0, 0, (float4*)out, (const float4*)in);
    LAUNCH(read_unaligned, n / 256, 256, 0, 0, (int*)out, (const char*)in);
    cublasLtHandle_t h;  // D (64 x 32) = A (64 x 16) B (16 x 32), bf16
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    float alpha = 1.0f, beta = 0.0f;
    cublasLtCreate(&h);
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, 64, 16, 64);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, 16, 32, 16);
    cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, 64, 32, 64);
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, &heur, &found);
    cublasLtMatmul(h, desc, &alpha, in, la, in, lb, &beta, out, ld, out, ld, &heur.algo, NULL, 0, 0);
    LAUNCH(mma_product, 1, 64, 0, 0, out, (const uint32_t*)in, (const uint32_t*)in, in, (int)CUDA_R_16BF);
    cudaemu_counts mma = cudaemu_profile_counts("mma_product");  // 2 warps, a product (one instruction) each
    int bad = mma.flops == 2 * 2.0 * 16 * 8 * 16 && mma.tensor == 2 ? 0 : 5;
    if (bad) printf("mma_product: %.0f FLOPs, %.0f instructions counted, want %.0f, 2\n", mma.flops, mma.tensor, 2 * 2.0 * 16 * 8 * 16);
    bad |= expect_counts("copy_floats", 4 * n, 4 * n, 4 * n, 4 * n, 0);
    bad |= expect_counts("copy_strided", 32 * n, 32 * n, 32 * n, 32 * n, 0);
    bad |= expect_counts("read_columns", 32 * n, 4 * n, 4 * n, 4 * n, 0);
    bad |= expect_counts("copy_float4", 16 * n, 16 * n, 16 * n, 16 * n, 0);
    bad |= expect_counts("read_unaligned", 32 * 5 * (n / 32), 4 * n, 32 * (4 * n / 32 + 1), 4 * n, 0);
    cudaemu_counts c = cudaemu_profile_counts("copy_strided");  // one warp instruction each way, however many sectors
    if (c.global_loads != n / 32 || c.global_stores != n / 32)
        printf("copy_strided: %.0f global loads, %.0f stores; want %d each\n", c.global_loads, c.global_stores, n / 32), bad = 5;
    bad |= expect_counts("cublasLt NN 64x32x16", 2 * (64 * 16 + 16 * 32), 2 * 64 * 32, 2 * (64 * 16 + 16 * 32), 2 * 64 * 32,
                         2.0 * 64 * 32 * 16);
    return bad;
}

// Warp instructions and shared-memory wavefronts, exactly (2 warps each).
static int case_shared_counts(void) {
    float* out;
    CHECK(cudaMalloc((void**)&out, 448 * sizeof(float)));
    CHECK(cudaMemset(out, 0, 448 * sizeof(float)));
    cudaemu_profile(1);
    int bad = 0;
    const int strides[3] = {1, 2, 32};
    const char* names[3] = {"shared_banks 1", "shared_banks 2", "shared_banks 32"};
    for (int k = 0; k < 3; k++) {
        int stride = strides[k];
        cudaemu_launch(names[k], shared_banks, 1, 64, 2 * 128 * stride * sizeof(float), 0, out, stride);
        cudaemu_counts c = cudaemu_profile_counts(names[k]);
        // per warp: a store (stride wavefronts); loads of stride, 1, 2 and 4; conflict-free 1 + 1 + 1 + 2 + 4
        double want[7] = {2, 8, 2.0 * stride, 2.0 * (stride + 7), 18, 2, 6};
        double got[7] = {c.shared_stores, c.shared_loads, c.shared_store_wavefronts, c.shared_load_wavefronts,
                         c.shared_ideal_wavefronts, c.syncs, c.global_stores};
        const char* what[7] = {"shared stores", "shared loads", "store wavefronts", "load wavefronts", "conflict-free wavefronts",
                               "barriers", "global stores"};
        for (int i = 0; i < 7; i++)
            if (c.launches != 1 || got[i] != want[i]) {
                printf("%s: %s %.0f, want %.0f (%ld launches)\n", names[k], what[i], got[i], want[i], c.launches);
                bad = 5;
            }
    }
    for (int pitch = 8; pitch <= 64; pitch *= 8) {
        const char* name = pitch == 8 ? "ldmatrix_rows 8" : "ldmatrix_rows 64";
        cudaemu_launch(name, ldmatrix_rows, 1, 32, 32 * pitch * 2, 0, (uint32_t*)out, pitch);
        cudaemu_counts c = cudaemu_profile_counts(name);
        if (c.shared_loads != 1 || c.shared_load_wavefronts != (pitch == 8 ? 4 : 32) || c.shared_ideal_wavefronts != 4)
            printf("%s: %.0f shared loads, %.0f wavefronts (conflict-free %.0f); want 1, %d (4)\n", name, c.shared_loads,
                   c.shared_load_wavefronts, c.shared_ideal_wavefronts, pitch == 8 ? 4 : 32), bad = 5;
    }
    LAUNCH(special_functions, 1, 64, 0, 0, out);
    cudaemu_counts c = cudaemu_profile_counts("special_functions");
    if (c.sfu != 8) printf("special_functions: %.0f SFU instructions, want 8\n", c.sfu), bad = 5;
    // per line (the kernel's, not cudaemu.h's wrappers): its load, 3 expf a warp, logf, its store
    const char* cls[4] = {"gld", "sfu", "sfu", "gst"};
    double want[4] = {2, 6, 2, 2};
    for (int i = 0; i < 4; i++) {
        char where[64];
        unsigned width = 0;
        snprintf(where, sizeof(where), "test_cudaemu.cu:%d", special_functions_line + 1 + i);
        double n = cudaemu_profile_site("special_functions", cls[i], where, &width);
        if (n != want[i] || width != 4)
            printf("special_functions: %s at %s %.0f times, %u bytes a lane; want %.0f, 4\n", cls[i], where, n, width, want[i]), bad = 5;
    }
    return bad;
}

static int case_hazards(int which) {
    int* out = device_ints(256);
    int in[256], want[256];
    if (which == 0) {  // correct kernels are clean
        cudaemu_hazards(1);
        int* d = device_ints(256);
        for (int i = 0; i < 256; i++) in[i] = i, want[i] = i ^ 1;
        CHECK(cudaMemcpy(d, in, sizeof(in), cudaMemcpyHostToDevice));
        LAUNCH(block_sum, 1, 256, 0, 0, out, d, 1);
        LAUNCH(warp_exchange, 1, 32, 0, 0, out, 1);
        LAUNCH(dynamic_shared_reverse, 1, 128, 128 * sizeof(int), 0, out);
        LAUNCH(warp_exchange, 1, 32, 0, 0, out, 1);
        expect_ints(out, want, 32, "warp_exchange");
    } else if (which == 1) {  // the same-value race passes the race check ...
        cudaemu_racecheck(1);
        LAUNCH(same_value, 1, 64, 0, 0, out);
        want[0] = 1;
        expect_ints(out, want, 1, "same_value");
    } else {  // ... and not the hazard check; nor does a missing __syncwarp
        cudaemu_hazards(1);
        if (which == 2) LAUNCH(same_value, 1, 64, 0, 0, out);
        else LAUNCH(warp_exchange, 1, 32, 0, 0, out, 0);
    }
    CHECK(cudaDeviceSynchronize());
    return 0;
}

static int case_gemm_ld(int ld) {  // a 16 x 8 column-major A with leading dimension ld (>= 16 is legal)
    cublasLtHandle_t h;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    cublasLtCreate(&h);
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, 16, 8, ld);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, 8, 4, 8);
    cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, 16, 4, 16);
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, 1, &heur, &found);
    return found == 1 ? 0 : 4;
}

// fp16 as a GPU rounds it (the fp16 build's every store): a kernel's __float2half_rn against a reference
// written here from IEEE 754's binary16 (11 significant bits, exponents -14 .. 15, subnormals in steps of
// 2^-24, round to nearest with ties to even, overflow to inf from 65520), on the cases that tell roundings
// apart (ties either way, the subnormals' ties, the largest finite and the first overflow, signs, NaN) and
// on 4096 random values over fp16's range.
static double half_reference(double x) {
    if (x != x) return x;
    double a = fabs(x);
    if (a >= 65520.0) return copysign(INFINITY, x);  // (65504 + half a step: the tie rounds to even, which overflows)
    int e;
    frexp(a, &e);  // a = f 2^e, f in [0.5, 1): the step is 2^(e - 11), or 2^-24 below 2^-14
    double step = ldexp(1.0, (e - 1 < -14 ? -14 : e - 1) - 10), q = a / step, r = floor(q);
    if (q - r > 0.5 || (q - r == 0.5 && fmod(r, 2.0) == 1.0)) r += 1.0;
    return copysign(r * step, x);
}
static int case_half_rounding(void) {
    enum { FIXED = 20, N = FIXED + 4096 };
    static float x[N], back[N];
    static unsigned short bits[N];
    const float fixed[FIXED] = {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 1.0f + 0x1p-11f + 0x1p-20f, -(2.0f + 0x1p-10f),
                                65504.0f, 65519.0f, 65520.0f, -65536.0f, 0x1p-24f, 0x1p-25f, 3 * 0x1p-26f, 0x1p-26f,
                                0x1p-14f - 0x1p-25f, 0x1p-14f, -0x1p-15f - 0x1p-26f, 0.0f, -0.0f, 3.14159265f, NAN, 1e-30f};
    srand((unsigned)time(NULL));
    for (int i = 0; i < N; i++)
        x[i] = i < FIXED ? fixed[i] : (rand() % 2 ? -1.0f : 1.0f) * ldexpf((float)rand() / RAND_MAX, rand() % 42 - 25);
    float *dx, *dback;
    unsigned short* dbits;
    CHECK(cudaMalloc((void**)&dx, sizeof(x)));
    CHECK(cudaMalloc((void**)&dback, sizeof(back)));
    CHECK(cudaMalloc((void**)&dbits, sizeof(bits)));
    CHECK(cudaMemcpy(dx, x, sizeof(x), cudaMemcpyHostToDevice));
    LAUNCH(half_round_trip, (N + 255) / 256, 256, 0, 0, dback, dbits, (const float*)dx, (int)N);
    CHECK(cudaMemcpy(back, dback, sizeof(back), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(bits, dbits, sizeof(bits), cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; i++) {
        double want = half_reference(x[i]);
        int same = want != want ? back[i] != back[i] : (double)back[i] == want && signbit(back[i]) == signbit(want);
        if (!same) {
            printf("fp16 rounding of %.9g: %.9g (bits %04x), want %.9g\n", x[i], back[i], bits[i], want);
            return 2;
        }
    }
    if (bits[6] != 0x7C00 || bits[8] != 0x0001 || bits[16] != 0x8000) {  // 65520 -> +inf, 2^-24 the least subnormal, -0
        printf("fp16 bits: 65520 -> %04x (want 7c00), 2^-24 -> %04x (0001), -0 -> %04x (8000)\n", bits[6], bits[8], bits[16]);
        return 2;
    }
    return 0;
}

// cuBLASLt with fp16 matrices (CUDA_R_16F, the fp16 build's every matmul): D (24 x 20) = A (24 x 40) B (40 x
// 20) with fp32 accumulation, D rounded to fp16 once; against a double product of the same fp16 inputs:
// within half an fp16 step of the result plus fp32's sums (2^-20 of the terms' magnitudes).
static int case_gemm_f16(void) {
    enum { M = 24, K = 40, N = 20 };
    __half ha[M * K], hb[K * N], hd[M * N];
    srand((unsigned)time(NULL));
    for (int i = 0; i < M * K; i++) ha[i] = __float2half(4.0f * rand() / RAND_MAX - 2.0f);
    for (int i = 0; i < K * N; i++) hb[i] = __float2half(4.0f * rand() / RAND_MAX - 2.0f);
    __half *a, *b, *d;
    CHECK(cudaMalloc((void**)&a, sizeof(ha)));
    CHECK(cudaMalloc((void**)&b, sizeof(hb)));
    CHECK(cudaMalloc((void**)&d, sizeof(hd)));
    CHECK(cudaMemcpy(a, ha, sizeof(ha), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b, hb, sizeof(hb), cudaMemcpyHostToDevice));
    cublasLtHandle_t h;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    float alpha = 1.0f, beta = 0.0f;
    cublasLtCreate(&h);
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16F, M, K, M);  // column-major
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16F, K, N, K);
    cublasLtMatrixLayoutCreate(&ld, CUDA_R_16F, M, N, M);
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, &heur, &found);
    if (found != 1) return 4;
    cublasLtMatmul(h, desc, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &heur.algo, NULL, 0, 0);
    CHECK(cudaMemcpy(hd, d, sizeof(hd), cudaMemcpyDeviceToHost));
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double ref = 0.0, mag = 0.0;
            for (int k = 0; k < K; k++) {
                double p = (double)__half2float(ha[i + k * M]) * __half2float(hb[k + j * K]);
                ref += p, mag += fabs(p);
            }
            double got = __half2float(hd[i + j * M]), step = ldexp(1.0, (int)floor(log2(fabs(ref) > 0x1p-14 ? fabs(ref) : 0x1p-14)) - 10);
            if (!(fabs(got - ref) <= 0.5 * step + 0x1p-20 * mag)) {
                printf("cuBLASLt fp16: D[%d][%d] = %.8g, want %.8g\n", i, j, got, ref);
                return 2;
            }
        }
    return 0;
}

static int run_case(const char* name) {
    if (!strcmp(name, "block_sum")) return case_block_sum(1);
    if (!strcmp(name, "missing_syncthreads")) return case_block_sum(0);
    if (!strcmp(name, "shuffles")) return case_shuffles();
    if (!strcmp(name, "cooperative_groups")) return case_cooperative_groups();
    if (!strcmp(name, "coordinates")) return case_coordinates();
    if (!strcmp(name, "dynamic_shared")) return case_dynamic_shared();
    if (!strcmp(name, "divergent_barrier")) {
        int* out = device_ints(32);
        LAUNCH(divergent_barrier, 1, 32, 0, 0, out);
        CHECK(cudaDeviceSynchronize());
        return 0;
    }
    if (!strcmp(name, "partial_warp_shuffle")) {
        int* out = device_ints(32);
        LAUNCH(partial_warp_shuffle, 1, 32, 0, 0, out);
        CHECK(cudaDeviceSynchronize());
        return 0;
    }
    if (!strcmp(name, "mma")) return case_mma(CUDA_R_16BF);
    if (!strcmp(name, "mma_f16")) return case_mma(CUDA_R_16F);
    if (!strcmp(name, "half_rounding")) return case_half_rounding();
    if (!strcmp(name, "gemm_f16")) return case_gemm_f16();
    if (!strcmp(name, "mma_partial_warp")) {
        uint32_t* r;
        float* out;
        CHECK(cudaMalloc((void**)&r, 8 * sizeof(uint32_t)));
        CHECK(cudaMemset(r, 0, 8 * sizeof(uint32_t)));
        CHECK(cudaMalloc((void**)&out, 32 * sizeof(float)));
        LAUNCH(mma_partial_warp, 1, 32, 0, 0, out, r, r + 4, (const float*)r);
        CHECK(cudaDeviceSynchronize());
        return 0;
    }
    if (!strcmp(name, "ldmatrix")) return case_ldmatrix(0, 1) | case_ldmatrix(0, 0);
    if (!strcmp(name, "ldmatrix_misaligned")) return case_ldmatrix(1, 1);
    if (!strcmp(name, "ldmatrix_partial_warp")) {
        uint32_t* d;
        uint16_t* m;
        CHECK(cudaMalloc((void**)&d, 32 * sizeof(uint32_t)));
        CHECK(cudaMalloc((void**)&m, 64 * sizeof(uint16_t)));
        LAUNCH(ldmatrix_partial_warp, 1, 32, 0, 0, d, m);
        CHECK(cudaDeviceSynchronize());
        return 0;
    }
    if (!strcmp(name, "write_one_past")) {
        int* out = device_ints(100);
        LAUNCH(write_one_past, 1, 128, 0, 0, out, 100);
        CHECK(cudaDeviceSynchronize());
        return 0;
    }
#ifdef LLMPAR_NCCL
    if (!strcmp(name, "nccl_abort")) return case_nccl_abort();
#endif
    if (!strcmp(name, "stream_wait")) return case_streams(1);
    if (!strcmp(name, "missing_stream_wait")) return case_streams(0);
    if (!strcmp(name, "event_times")) return case_event_times();
    if (!strcmp(name, "gemm_ld")) return case_gemm_ld(16);
    if (!strcmp(name, "counts")) return case_counts();
    if (!strcmp(name, "bad_gemm_ld")) return case_gemm_ld(8);
    if (!strcmp(name, "shared_counts")) return case_shared_counts();
    if (!strcmp(name, "cp_async")) return case_cp_async(0);
    if (!strcmp(name, "cp_async_early_read")) return case_cp_async(1);
    if (!strcmp(name, "cp_async_early_read_hazard")) return case_cp_async(2);
    if (!strcmp(name, "cp_async_buffer_reused")) return case_cp_async(3);
    if (!strcmp(name, "hazards_clean")) return case_hazards(0);
    if (!strcmp(name, "same_value_race")) return case_hazards(1);
    if (!strcmp(name, "same_value_hazard")) return case_hazards(2);
    if (!strcmp(name, "missing_syncwarp")) return case_hazards(3);
    if (!strcmp(name, "block_too_large")) {
        int* out = device_ints(2048);
        LAUNCH(fill, 1, 2048, 0, 0, out, 2048, 1);
        CHECK(cudaGetLastError());
        return 0;
    }
    if (!strcmp(name, "host_pointer_argument")) {
        int* host = (int*)malloc(256 * sizeof(int));
        LAUNCH(fill, 1, 256, 0, 0, host, 256, 1);
        CHECK(cudaDeviceSynchronize());
        return 0;
    }
    if (!strcmp(name, "memcpy_past_end")) {
        int h[64], *d = device_ints(32);
        CHECK(cudaMemcpy(d, h, sizeof(h), cudaMemcpyHostToDevice));
        return 0;
    }
    if (!strcmp(name, "memcpy_wrong_direction")) {
        int h[32], *d = device_ints(32);
        CHECK(cudaMemcpy(d, h, sizeof(h), cudaMemcpyDeviceToHost));
        return 0;
    }
    if (!strcmp(name, "out_of_memory")) {  // run with CUDAEMU_MEMORY_GIB=0.001
        void* p;
        CHECK(cudaMalloc(&p, 4 << 20));
        return 0;
    }
    if (!strcmp(name, "too_much_shared")) {
        int* out = device_ints(128);
        LAUNCH(dynamic_shared_reverse, 1, 128, 64 * 1024, 0, out);
        CHECK(cudaGetLastError());
        return 0;
    }
    if (!strcmp(name, "opted_in_shared")) {  // 64 KiB after opting in: runs; 100 KiB: more than opted in to
        int *out = device_ints(128), want[128];
        for (int i = 0; i < 128; i++) want[i] = 127 - i;
        CHECK(cudaFuncSetAttribute(dynamic_shared_reverse, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
        LAUNCH(dynamic_shared_reverse, 1, 128, 64 * 1024, 0, out);
        CHECK(cudaGetLastError());
        expect_ints(out, want, 128, "dynamic shared memory opted in to");
        LAUNCH(dynamic_shared_reverse, 1, 128, 100 * 1024, 0, out);
        return cudaGetLastError() == cudaErrorInvalidValue ? 0 : 1;
    }
    if (!strcmp(name, "too_much_optin")) {
        CHECK(cudaFuncSetAttribute(dynamic_shared_reverse, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 * 1024));
        return 0;
    }
    printf("no case named %s\n", name);
    return 1;
}

int main(int argc, char** argv) {
    if (argc == 2) return run_case(argv[1]);
    struct {
        const char* name;
        const char* env;     // set for the child
        int ok;              // 1: must exit 0; 0: must fail
        const char* needle;  // what its output must say
    } cases[] = {
        {"block_sum", "", 1, ""},
        {"missing_syncthreads", "", 0, "cudaemu: error: block_sum: a race"},
        {"divergent_barrier", "", 0, "is reached by 16 of 32 threads"},
        {"shuffles", "", 1, ""},
        {"cooperative_groups", "", 1, ""},
        {"partial_warp_shuffle", "", 0, "which has exited (a shuffle with inactive lanes)"},
        {"mma", "", 1, ""},
        {"mma_f16", "", 1, ""},
        {"half_rounding", "", 1, ""},
        {"gemm_f16", "", 1, ""},
        {"mma_partial_warp", "", 0, "waits at mma.sync.m16n8k16 (mask 0xffffffff) for lane 16, which has exited"},
        {"ldmatrix", "", 1, ""},
        {"ldmatrix_misaligned", "", 0, "ldmatrix: the row address"},
        {"ldmatrix_partial_warp", "", 0, "waits at ldmatrix.sync.m8n8.x4.trans (mask 0xffffffff) for lane 16, which has exited"},
        {"coordinates", "", 1, ""},
        {"dynamic_shared", "", 1, ""},
        {"write_one_past", "", 0, "after kernel write_one_past: a write outside the 400-byte device allocation"},
#ifdef LLMPAR_NCCL
        {"nccl_abort", "", 1, ""},
#endif
        {"stream_wait", "", 1, ""},
        {"missing_stream_wait", "", 0, "a missing cudaStreamWaitEvent: the consumer read before the producer wrote"},
        {"event_times", "", 1, ""},
        {"gemm_ld", "", 1, ""},
        {"counts", "", 1, ""},
        {"bad_gemm_ld", "", 0, "matrix A: leading dimension 8 is less than its 16 rows"},
        {"shared_counts", "", 1, ""},
        {"cp_async", "", 1, ""},
        {"cp_async_early_read", "", 0, "cudaemu: error: async_tiles: a race"},
        {"cp_async_early_read_hazard", "", 0,
         "a shared-memory hazard (read before the cp.async into it was waited for): thread 0 at test_cudaemu.cu:"},
        {"cp_async_buffer_reused", "", 0, "async_tiles block (0,0,0): a shared-memory hazard (write after read): thread"},
        {"hazards_clean", "", 1, ""},
        {"same_value_race", "", 1, ""},
        {"same_value_hazard", "", 0, "a shared-memory hazard (write after write): thread 1 at test_cudaemu.cu:"},
        {"missing_syncwarp", "", 0, "warp_exchange block (0,0,0): a shared-memory hazard (write after read): thread 1 at test_cudaemu.cu:"},
        {"block_too_large", "", 0, "invalid configuration argument (cudaemu: fill<<<(1,1,1), (2048,1,1)>>>"},
        {"host_pointer_argument", "", 0, "kernel fill: argument 1"},
        {"memcpy_past_end", "", 0, "run past the end of its allocation"},
        {"memcpy_wrong_direction", "", 0, "the direction says device to host but the source is host"},
        {"out_of_memory", "CUDAEMU_MEMORY_GIB=0.001", 0, "out of memory (cudaemu: 4194304 bytes asked"},
        {"too_much_shared", "", 0, "65536 bytes of dynamic shared memory"},
        {"opted_in_shared", "", 1, ""},
        {"too_much_optin", "", 0, "233472 bytes of dynamic shared memory, more than the device's 232448"},
    };
    int passed = 0, failed = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char cmd[1024], out[8192];
        snprintf(cmd, sizeof(cmd), "%s %s %s 2>&1", cases[i].env, argv[0], cases[i].name);
        FILE* p = popen(cmd, "r");
        size_t got = p ? fread(out, 1, sizeof(out) - 1, p) : 0;
        out[got] = 0;
        int status = p ? pclose(p) : -1;
        int ok = cases[i].ok ? status == 0 : status != 0 && strstr(out, cases[i].needle) != NULL;
        printf("%s %s %s\n", ok ? "ok  " : "FAIL", cases[i].ok ? "runs:  " : "caught:", cases[i].name);
        if (!ok) printf("     exit status %d, output:\n%s\n", status, out);
        ok ? passed++ : failed++;
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
