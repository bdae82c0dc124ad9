/*
cudaemu.h: run CUDA C on the CPU, for machines without a GPU. Force-included (g++ -include) into the
CUDA build's sources, with cudaemu.cpp linked in place of libcudart, cuBLASLt and NCCL.

  - kernels: every GPU thread is a fiber that runs until a barrier or a warp operation and waits there
    for its block or its lanes, so __syncthreads and __shfl_*_sync have their exact meaning; blocks and
    threads can run forward, reversed or shuffled, and a race check reruns each launch in all three
    orders and requires the same bytes;
  - the runtime: device memory with guard bytes and NaN-filled fresh allocations, streams and events as
    queues run by a device thread in a seeded order that respects only what CUDA promises;
  - cuBLASLt: the subset llmpar uses, as a reference GEMM that enforces the documented argument rules;
  - NCCL: the calls llmpar makes, over MPI (one emulated GPU per rank), asynchronous on their stream.

CUDA's own headers supply the types (cuda_bf16.h's and cuda_fp16.h's host code do the bf16 and fp16
rounding, so it is NVIDIA's).
What it proves and what it cannot: dev/cudaemu/README.md.
*/
#ifndef CUDAEMU_H
#define CUDAEMU_H
#define LLMPAR_CUDAEMU 1

// CUDA's qualifiers, erased before CUDA's headers define them. __shared__ variables are per OS thread,
// and one OS thread runs one block at a time, so they are per block.
#define __global__
#define __device__
#define __host__
#define __shared__ static thread_local
#define __launch_bounds__(...)

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cublasLt.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef __cplusplus
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#endif

#ifdef LLMPAR_MPI
// The NCCL shim calls MPI from the device thread while the program calls it from its own, so MPI starts
// with MPI_THREAD_MULTIPLE; at the end the device thread stops before MPI does.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
int cudaemu_mpi_init(int* argc, char*** argv);
int cudaemu_mpi_finalize(void);
#define MPI_Init cudaemu_mpi_init
#define MPI_Finalize cudaemu_mpi_finalize
#endif
#ifdef LLMPAR_NCCL
#include <nccl.h>
#endif

// ---- what a kernel sees: its thread's and block's coordinates, set by the scheduler on every switch
struct cudaemu_thread {
    uint3 idx;
};
struct cudaemu_block {
    uint3 idx;
    dim3 dim, grid;
    void* dynamic_shared;
};
extern thread_local cudaemu_thread* cudaemu_self;
extern thread_local cudaemu_block* cudaemu_blk;
#define threadIdx (cudaemu_self->idx)
#define blockIdx (cudaemu_blk->idx)
#define blockDim (cudaemu_blk->dim)
#define gridDim (cudaemu_blk->grid)
static const int warpSize = 32;

#define CUDAEMU_STR2(x) #x
#define CUDAEMU_STR(x) CUDAEMU_STR2(x)
#define CUDAEMU_SITE __FILE__ ":" CUDAEMU_STR(__LINE__)

// ---- barriers and warp operations: each waits for its block or its lanes (named by the mask)
void cudaemu_syncthreads(const char* site);
#define __syncthreads() cudaemu_syncthreads(CUDAEMU_SITE)

enum { CUDAEMU_SHFL_IDX, CUDAEMU_SHFL_XOR, CUDAEMU_SHFL_UP, CUDAEMU_SHFL_DOWN, CUDAEMU_SYNCWARP, CUDAEMU_BALLOT };
uint64_t cudaemu_warp_op(const char* site, int kind, unsigned mask, uint64_t bits, int arg, int width);

#ifdef __cplusplus
template <typename T>
static inline T cudaemu_shfl(const char* site, int kind, unsigned mask, T v, int arg, int width) {
    static_assert(sizeof(T) <= 8, "cudaemu: shuffles move values of up to 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    bits = cudaemu_warp_op(site, kind, mask, bits, arg, width);
    T out;
    memcpy(&out, &bits, sizeof(T));
    return out;
}
#define __shfl_sync(mask, v, lane, ...) cudaemu_shfl(CUDAEMU_SITE, CUDAEMU_SHFL_IDX, mask, v, lane, cudaemu_width(__VA_ARGS__ + 0))
#define __shfl_xor_sync(mask, v, m, ...) cudaemu_shfl(CUDAEMU_SITE, CUDAEMU_SHFL_XOR, mask, v, m, cudaemu_width(__VA_ARGS__ + 0))
#define __shfl_up_sync(mask, v, d, ...) cudaemu_shfl(CUDAEMU_SITE, CUDAEMU_SHFL_UP, mask, v, d, cudaemu_width(__VA_ARGS__ + 0))
#define __shfl_down_sync(mask, v, d, ...) cudaemu_shfl(CUDAEMU_SITE, CUDAEMU_SHFL_DOWN, mask, v, d, cudaemu_width(__VA_ARGS__ + 0))
static inline int cudaemu_width(int w) { return w ? w : 32; }  // the optional width argument, 32 when absent
#define __syncwarp(...) ((void)cudaemu_warp_op(CUDAEMU_SITE, CUDAEMU_SYNCWARP, cudaemu_mask(__VA_ARGS__ + 0u), 0, 0, 32))
static inline unsigned cudaemu_mask(unsigned m) { return m ? m : 0xffffffffu; }
#define __ballot_sync(mask, pred) ((unsigned)cudaemu_warp_op(CUDAEMU_SITE, CUDAEMU_BALLOT, mask, (pred) != 0, 0, 32))
#endif

// ---- tensor cores: the instruction mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, or .f16 (`type`
// CUDA_R_16BF or CUDA_R_16F: llmpar's lp_mma issues it by inline PTX under nvcc, with floatX's type, and
// calls this here): D (16 x 8) = A (16 x 16) B (16 x 8) + C,
// warp-collective like a full-mask shuffle (all 32 lanes must arrive: a partial or divergent warp is an
// error). Each lane passes its registers as the PTX ISA places them (g = lane / 4, t = lane % 4; a
// register's lower 16 bits hold the lower column, or row for B): a[0] A's row g, columns 2t and 2t + 1;
// a[1] row g + 8, the same columns; a[2], a[3] those rows at columns 2t + 8, 2t + 9; b[0] B's rows 2t,
// 2t + 1 of column g, b[1] rows 2t + 8, 2t + 9; c and d: c[0], c[1] row g, columns 2t and 2t + 1, c[2],
// c[3] row g + 8. Sums in fp32 from C up over k in order.
void cudaemu_mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4], cudaDataType type);
// Its operand loader ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (lp_ldmatrix): four 8 x 8 bf16
// matrices from shared memory, warp-collective as above. Lane l names row l % 8 of matrix l / 8 (16 bytes,
// 16-byte aligned); matrix i lands in register d[i], lane l holding its row l / 4, columns 2 (l % 4) and
// 2 (l % 4) + 1 (the lower column in the low half); with trans, its column l / 4 at those rows: what mma
// wants as B from a row-major tile.
void cudaemu_ldmatrix_x4(uint32_t d[4], const void* row, int trans);
// Asynchronous copies to shared memory (llmpar's lp_cp_async16, lp_cp_async_commit, lp_cp_async_wait), the
// PTX instructions cp.async.cg.shared.global [dst], [src], 16, src_bytes (16 bytes to dynamic shared memory,
// both addresses 16-byte aligned: src_bytes of them from global memory, the rest zeros), cp.async.commit_group
// (the thread's copies since its last commit become a group) and cp.async.wait_group n (every group but the
// n most recent is complete, and its bytes visible to this thread; other threads see them after a barrier).
// A copy lands at any legal time, a different one in each thread order; with the hazard check, a read or
// write of its bytes before the wait that covers it is an error.
void cudaemu_cp_async16(void* dst, const void* src, int src_bytes);
void cudaemu_cp_async_commit(void);
void cudaemu_cp_async_wait(int n);

// ---- device intrinsics the host compiler lacks
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
// The special functions a GPU computes on its SFU (MUFU.EX2, LG2, RSQ, RCP, TANH...): each call from a kernel
// is one such warp instruction to the counting build (cudaemu_sfu, section "counting" below), whatever the
// host computes it with. Other code (the CPU loops) calls them as ever: cudaemu_sfu counts only in kernels.
void cudaemu_sfu(void);
static inline float cudaemu_expf(float x) { cudaemu_sfu(); return expf(x); }
static inline float cudaemu_exp2f(float x) { cudaemu_sfu(); return exp2f(x); }
static inline float cudaemu_logf(float x) { cudaemu_sfu(); return logf(x); }
static inline float cudaemu_log2f(float x) { cudaemu_sfu(); return log2f(x); }
static inline float cudaemu_tanhf(float x) { cudaemu_sfu(); return tanhf(x); }
static inline float cudaemu_sqrtf(float x) { cudaemu_sfu(); return sqrtf(x); }
#define expf cudaemu_expf
#define exp2f cudaemu_exp2f
#define logf cudaemu_logf
#define log2f cudaemu_log2f
#define tanhf cudaemu_tanhf
#define sqrtf cudaemu_sqrtf
static inline float rsqrtf(float x) { cudaemu_sfu(); return 1.0f / __builtin_sqrtf(x); }
static inline float __fdividef(float a, float b) { cudaemu_sfu(); return a / b; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }

// Dynamic shared memory of the running block (the launch's third argument), filled with NaN bytes.
void* cudaemu_dynamic_shared(void);

#ifdef __cplusplus
// Loads and stores with a cache hint (__ldcs: streaming, __ldcg: L2 only, ...): plain accesses here, the
// hint is a GPU's caching policy, which the emulator does not model. Always inlined, so that the counting
// build sees each call as its own access site; a 16- or 8-byte value (int4, float2) moves as one vector
// access, one instruction as nvcc's LDG.128 is (g++ would copy an int4 as four 4-byte loads: four requests).
#define CUDAEMU_INLINE static inline __attribute__((always_inline))
template <typename T> CUDAEMU_INLINE T cudaemu_load(const T* p) {
    if constexpr (sizeof(T) == 16 || sizeof(T) == 8) {
        typedef int v __attribute__((vector_size(sizeof(T)), aligned(sizeof(T)), may_alias));
        v bits = *(const v*)p;
        T out;
        memcpy(&out, &bits, sizeof(T));
        return out;
    } else {
        return *p;
    }
}
template <typename T> CUDAEMU_INLINE void cudaemu_store(T* p, T x) {
    if constexpr (sizeof(T) == 16 || sizeof(T) == 8) {
        typedef int v __attribute__((vector_size(sizeof(T)), aligned(sizeof(T)), may_alias));
        v bits;
        memcpy(&bits, &x, sizeof(T));
        *(v*)p = bits;
    } else {
        *p = x;
    }
}
template <typename T> CUDAEMU_INLINE T __ldcs(const T* p) { return cudaemu_load(p); }
template <typename T> CUDAEMU_INLINE T __ldcg(const T* p) { return cudaemu_load(p); }
template <typename T> CUDAEMU_INLINE T __ldg(const T* p) { return cudaemu_load(p); }
template <typename T> CUDAEMU_INLINE void __stcs(T* p, T v) { cudaemu_store(p, v); }
template <typename T> CUDAEMU_INLINE void __stcg(T* p, T v) { cudaemu_store(p, v); }

// ---- cooperative groups: the part llm.c's dev/cuda kernels use (the block, its tiles of 1 to 32 lanes,
// a tile's shuffles and cg::reduce), built on the barriers and warp operations above, so a tile's
// operations wait for its lanes as a GPU's do.
// cg::reduce of a float is a butterfly of log2(N) shuffles, what nvcc emits for it (SHFL.BFLY); CUDA's
// own uses redux.sync for integers on sm_80 and later, one instruction, so integer reductions count more
// shuffles here than a GPU issues.
// CUDA's headers are kept out (reduce.h would pull in libcu++ without nvcc): their include guards, set here.
#define _COOPERATIVE_GROUPS_H_
#define _COOPERATIVE_GROUPS_REDUCE_H
namespace cooperative_groups {
struct thread_block {
    unsigned thread_rank() const { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
    unsigned size() const { return blockDim.x * blockDim.y * blockDim.z; }
    unsigned num_threads() const { return size(); }
    dim3 group_index() const { return blockIdx; }
    dim3 thread_index() const { return threadIdx; }
    void sync() const { cudaemu_syncthreads(CUDAEMU_SITE); }
};
static inline thread_block this_thread_block(void) { return thread_block(); }
static inline void sync(const thread_block& b) { b.sync(); }

template <unsigned N>
struct thread_block_tile {  // lanes thread_rank() of tile meta_group_rank(): the block's threads N at a time
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "cudaemu: tiles of 1, 2, 4, 8, 16 or 32 lanes");
    unsigned linear;
    unsigned thread_rank() const { return linear % N; }
    static constexpr unsigned size() { return N; }
    static constexpr unsigned num_threads() { return N; }
    unsigned meta_group_rank() const { return linear / N; }
    unsigned meta_group_size() const { return (thread_block().size() + N - 1) / N; }
    unsigned mask() const { return (N == 32 ? 0xffffffffu : (1u << N) - 1) << (linear % 32 / N * N); }  // its lanes in the warp
    void sync() const { (void)cudaemu_warp_op(CUDAEMU_SITE, CUDAEMU_SYNCWARP, mask(), 0, 0, 32); }
    template <typename T> T shfl(T v, int src) const { return cudaemu_shfl(CUDAEMU_SITE, CUDAEMU_SHFL_IDX, mask(), v, src, N); }
    template <typename T> T shfl_xor(T v, int m) const { return cudaemu_shfl(CUDAEMU_SITE, CUDAEMU_SHFL_XOR, mask(), v, m, N); }
    template <typename T> T shfl_up(T v, int d) const { return cudaemu_shfl(CUDAEMU_SITE, CUDAEMU_SHFL_UP, mask(), v, d, N); }
    template <typename T> T shfl_down(T v, int d) const { return cudaemu_shfl(CUDAEMU_SITE, CUDAEMU_SHFL_DOWN, mask(), v, d, N); }
    unsigned ballot(int pred) const {  // the tile's own lanes, from bit 0
        return (unsigned)cudaemu_warp_op(CUDAEMU_SITE, CUDAEMU_BALLOT, mask(), pred != 0, 0, 32) >> (linear % 32 / N * N) &
               (N == 32 ? 0xffffffffu : (1u << N) - 1);
    }
    int any(int pred) const { return ballot(pred) != 0; }
    int all(int pred) const { return ballot(pred) == (N == 32 ? 0xffffffffu : (1u << N) - 1); }
};
template <unsigned N>
static inline thread_block_tile<N> tiled_partition(const thread_block& b) {
    return thread_block_tile<N>{b.thread_rank()};
}
template <unsigned N>
static inline void sync(const thread_block_tile<N>& t) { t.sync(); }

template <typename T> struct plus { T operator()(T a, T b) const { return a + b; } };
template <typename T> struct greater { T operator()(T a, T b) const { return a < b ? b : a; } };  // reduce: the largest
template <typename T> struct less { T operator()(T a, T b) const { return b < a ? b : a; } };     // reduce: the smallest
template <typename T, unsigned N, typename Op>
static inline T reduce(const thread_block_tile<N>& t, T v, Op op) {  // every lane gets the result, as on a GPU
    for (unsigned m = N / 2; m > 0; m /= 2) v = op(v, t.shfl_xor(v, (int)m));
    return v;
}
}  // namespace cooperative_groups
#endif

// ---- controls for tests: the race check reruns every launch in three thread orders (forward, reversed,
// shuffled) from the same starting bytes and stops with an error naming the kernel when they differ.
void cudaemu_racecheck(int on);
void cudaemu_refuse_grad_epilogues(int on);  // as CUDAEMU_REFUSE_GRAD_EPILOGUES=1: no algorithm for DGELU(_BGRAD) or BGRADB
// cudaFree calls so far (each waits for the whole device on a GPU: a training step should make none).
long cudaemu_device_frees(void);

// ---- counting, for a model of the step on a GPU (README: "Counting bytes and FLOPs"). A binary whose
// kernels were compiled with -fsanitize=thread (make train_gpt_emu_prof) sees each load and store; with
// CUDAEMU_PROFILE=FILE, or cudaemu_profile(1), it counts per kernel launch the global-memory bytes as
// 32-byte sectors per warp request and as distinct sectors of the launch, and each cuBLASLt matmul's bytes
// and FLOPs. cudaemu_profile_counts sums what was counted under one name (a kernel's, or a matmul's
// "cublasLt ..." name) since counting began.
struct cudaemu_counts {
    long launches;
    double read_bytes, write_bytes;                // sectors of each warp request, times 32
    double unique_read_bytes, unique_write_bytes;  // distinct sectors of each launch, times 32
    double flops;                                  // matmuls: 2 m n k per batch; kernels: tensor-core products
    // kernels' warp instructions by class (each a warp's, however many of its lanes take part)
    double global_loads, global_stores, shared_loads, shared_stores;
    double shared_load_wavefronts, shared_store_wavefronts;  // shared-memory cycles: the most distinct words on one bank
    double shared_ideal_wavefronts;                          // what conflict-free requests would take: 128 bytes each
    double shuffles, syncs, tensor, sfu;                     // shuffles and votes; barriers; mma; special functions
};
void cudaemu_profile(int on);
cudaemu_counts cudaemu_profile_counts(const char* name);
// Per source line, for the model's count of every instruction (dev/cudaemu/sass.py): the warp instructions
// of one class ("gld", "gst", "lds", "sts", "shfl", "vote", "warpsync", "bar", "mma", "sfu") that kernel
// `name` ran at `where` ("file.cu:LINE": the innermost line of the program's own code), and the bytes a lane
// moved (loads and stores). CUDAEMU_PROFILE files list them all at exit, as "site" lines.
double cudaemu_profile_site(const char* name, const char* cls, const char* where, unsigned* width);
// The hazard check (a counting build only): with CUDAEMU_HAZARDS=1, or cudaemu_hazards(1), a shared-memory
// word written by one thread and read or written by another with no __syncthreads, or no warp operation
// both lanes took part in, between them stops the run naming the kernel and both source lines, whatever
// the bytes turn out to be (compute-sanitizer's racecheck; the race check's three orders see only bytes).
void cudaemu_hazards(int on);

// ---- kernel launch: kernel<<<grid, block, shmem, stream>>>(args) becomes
// cudaemu_launch("name", kernel, grid, block, shmem, stream, args...)
#ifdef __cplusplus
struct cudaemu_arg {  // a kernel argument that is a pointer must be device or page-locked memory
    const void* ptr;
    int index;  // its position in the kernel's parameter list, from 0
};
void cudaemu_launch_kernel(const char* name, const void* kernel, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream,
                           const cudaemu_arg* pointers, int npointers, std::function<void()> body);

template <typename T>
static inline void cudaemu_note_pointer(const T& v, int index, cudaemu_arg* out, int* n) {
    if constexpr (std::is_pointer<T>::value) out[(*n)++] = cudaemu_arg{(const void*)v, index};
    (void)v, (void)index, (void)out, (void)n;
}

// cudaFuncSetAttribute(kernel, ...) on a kernel itself, as cuda_runtime.h lets nvcc's code call it
template <typename... P>
static inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
    return cudaFuncSetAttribute((const void*)kernel, attr, value);
}

template <typename T>
struct cudaemu_same {  // keeps the arguments out of template deduction: they convert as in a plain call
    typedef T type;
};

template <typename... P>
static inline void cudaemu_launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t shmem,
                                  cudaStream_t stream, typename cudaemu_same<P>::type... args) {
    std::tuple<typename std::decay<P>::type...> params(args...);
    cudaemu_arg pointers[sizeof...(P) + 1];
    int n = 0, index = 0;
    std::apply([&](const auto&... p) { (cudaemu_note_pointer(p, index++, pointers, &n), ...); }, params);
    cudaemu_launch_kernel(name, (const void*)kernel, grid, block, shmem, stream, pointers, n,
                          [kernel, params]() { std::apply(kernel, params); });
}
#endif

#endif  // CUDAEMU_H
