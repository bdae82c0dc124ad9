// cudaemu.cpp: the CUDA emulator's runtime (see cudaemu.h). Sections:
//   1. errors and settings       5. streams, events and the device thread
//   2. fibers                    6. kernel launches and the race check
//   3. a block of threads        7. the CUDA runtime API
//   4. device memory             8. cuBLASLt          9. NCCL over MPI
//                                                     10. counting bytes and FLOPs
#include "cudaemu.h"
#ifdef LLMPAR_MPI
#undef MPI_Init  // here they are MPI's own
#undef MPI_Finalize
#endif

#include <dlfcn.h>
#include <link.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

// ----------------------------------------------------------------------------------------------------
// 1. errors and settings

// What a GPU would report asynchronously (a fault inside a kernel, a corrupted allocation) stops the
// process with one line; what CUDA returns as a code is returned, with the detail in cudaGetErrorString.
[[noreturn]] static void emu_fatal(const char* fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fflush(stdout);
    fprintf(stderr, "cudaemu: error: %s\n", msg);
    fflush(stderr);
    _exit(1);
}

enum { ORDER_FORWARD, ORDER_REVERSE, ORDER_SHUFFLE };
static struct {
    size_t capacity;  // CUDAEMU_MEMORY_GIB, default 80: the emulated device's memory
    int order;        // CUDAEMU_ORDER=forward|reverse|shuffle: blocks and threads within a block
    uint64_t seed;    // CUDAEMU_SEED: the shuffle and the streams' order
    int racecheck;    // CUDAEMU_RACECHECK=1, or cudaemu_racecheck(1)
    int hazards;      // CUDAEMU_HAZARDS=1, or cudaemu_hazards(1): the shared-memory hazard check (section 10)
    int eager;        // CUDAEMU_EAGER=1: run queued work at once instead of when the host waits or idles
    int shared_gpu;   // CUDAEMU_SHARED_GPU=1: every rank reports the same PCI bus id (ranks sharing a GPU)
    int refuse_grads; // CUDAEMU_REFUSE_GRAD_EPILOGUES=1, or cudaemu_refuse_grad_epilogues(1): the heuristic finds no
                      // algorithm for DGELU(_BGRAD) or BGRADB, as cuBLASLt may for a shape, so the caller's fallback runs
    const char* profile;  // CUDAEMU_PROFILE=FILE: count bytes and FLOPs into FILE (section 10)
    int profile_skip;     // CUDAEMU_PROFILE_SKIP=N: count from the N-th cudaDeviceSynchronize on
} cfg;

static void read_settings(void) {
    const char* s = getenv("CUDAEMU_MEMORY_GIB");
    cfg.capacity = (size_t)((s ? atof(s) : 80.0) * (1 << 30));
    s = getenv("CUDAEMU_ORDER");
    cfg.order = !s || !strcmp(s, "forward") ? ORDER_FORWARD : !strcmp(s, "reverse") ? ORDER_REVERSE
              : !strcmp(s, "shuffle") ? ORDER_SHUFFLE : -1;
    if (cfg.order < 0) emu_fatal("CUDAEMU_ORDER must be forward, reverse or shuffle, got '%s'", s);
    s = getenv("CUDAEMU_SEED");
    cfg.seed = s ? strtoull(s, NULL, 10) : 1;
    s = getenv("CUDAEMU_RACECHECK");
    cfg.racecheck = s && atoi(s);
    s = getenv("CUDAEMU_HAZARDS");
    cfg.hazards = s && atoi(s);
    s = getenv("CUDAEMU_EAGER");
    cfg.eager = s && atoi(s);
    s = getenv("CUDAEMU_SHARED_GPU");
    cfg.shared_gpu = s && atoi(s);
    s = getenv("CUDAEMU_REFUSE_GRAD_EPILOGUES");
    cfg.refuse_grads = s && atoi(s);
    cfg.profile = getenv("CUDAEMU_PROFILE");
    s = getenv("CUDAEMU_PROFILE_SKIP");
    cfg.profile_skip = s ? atoi(s) : 0;
}

static uint64_t rng_next(uint64_t* s) {  // splitmix64
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// n items in the order asked for
static void order_items(std::vector<int>& v, int n, int order, uint64_t* rng) {
    v.resize(n);
    for (int i = 0; i < n; i++) v[i] = order == ORDER_REVERSE ? n - 1 - i : i;
    if (order == ORDER_SHUFFLE)
        for (int i = n - 1; i > 0; i--) std::swap(v[i], v[rng_next(rng) % (uint64_t)(i + 1)]);
}

// ----------------------------------------------------------------------------------------------------
// 2. fibers: each GPU thread runs on its own small stack; switching saves the callee-saved registers

extern "C" void cudaemu_ctx_switch(void** save_sp, void* to_sp);
extern "C" void cudaemu_ctx_entry(void);
#if defined(__x86_64__)
__asm__(
    ".text\n"
    ".globl cudaemu_ctx_switch\n"
    ".type cudaemu_ctx_switch,@function\n"
    "cudaemu_ctx_switch:\n"  // (rdi: where to save this stack pointer, rsi: the stack to resume)
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size cudaemu_ctx_switch,.-cudaemu_ctx_switch\n"
    ".globl cudaemu_ctx_entry\n"
    ".type cudaemu_ctx_entry,@function\n"
    "cudaemu_ctx_entry:\n"  // a new fiber starts here: fn (r13) of arg (r12); fn never returns
    "  movq %r12, %rdi\n  callq *%r13\n  ud2\n"
    ".size cudaemu_ctx_entry,.-cudaemu_ctx_entry\n");
#else
#error "cudaemu: the fiber switch is written for x86-64"
#endif

static const size_t kStackBytes = 256 << 10;
static const size_t kPage = 4096;

// A stack for a fiber that will call fn(arg) when first switched to: the frame cudaemu_ctx_switch pops.
// (The floating-point control words are not switched: no kernel changes rounding modes.)
static void* fiber_stack_init(char* stack, void (*fn)(void*), void* arg) {
    // its top moved down by 0 to 63 cache lines (from where the stack lies), so that the tops of a block's
    // stacks, which a switch touches, do not all fall in the same cache sets
    size_t color = ((uintptr_t)stack / kPage % 64) * 64;
    uint64_t* sp = (uint64_t*)(stack + kPage + kStackBytes - 72 - color);  // 16-byte aligned at the call in entry
    memset(sp, 0, 48);
    sp[2] = (uint64_t)(uintptr_t)fn;   // r13
    sp[3] = (uint64_t)(uintptr_t)arg;  // r12
    sp[6] = (uint64_t)(uintptr_t)cudaemu_ctx_entry;
    return sp;
}

// Stacks are reused: a thread that finishes without waiting hands its stack to the next one, so a
// kernel without barriers costs one stack, not one per thread. The lowest page of each is a guard.
struct StackPool {
    std::vector<char*> free_stacks;
    char* get() {
        if (!free_stacks.empty()) {
            char* s = free_stacks.back();
            free_stacks.pop_back();
            return s;
        }
        void* p = mmap(NULL, kPage + kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) emu_fatal("cannot map a fiber stack");
        mprotect(p, kPage, PROT_NONE);
        return (char*)p;
    }
    void put(char* s) { free_stacks.push_back(s); }
};
static thread_local StackPool stack_pool;

// ----------------------------------------------------------------------------------------------------
// 3. a block of threads: run until every thread is done, releasing barriers and warp operations

enum { F_NEW, F_RUN, F_BARRIER, F_WARP, F_DONE };
struct AsyncCopy {  // a cp.async of a thread: 16 bytes to shared memory, `bytes` of them from src, the rest zeros
    char* dst;
    const char* src;
    int bytes;
    uint32_t group;  // the group it belongs to: the thread's count of committed groups when it was issued
    bool landed;     // written to shared memory already (it may land any time before the wait that covers it)
    uintptr_t site;
};
struct Fiber {
    cudaemu_thread t;  // first: cudaemu_self points here
    void* sp;
    char* stack;
    int linear, state;
    const char* site;  // the barrier or warp operation it waits at
    int kind, arg, width;
    unsigned mask;
    uint64_t in, out;
    uint32_t bars, wops;  // barriers passed; the last warp operation it took part in (its warp's count then)
    std::vector<struct AsyncCopy> copies;  // its cp.async copies not yet waited for, oldest first
    uint32_t groups;                       // cp.async groups it committed
};
struct BlockRun {
    cudaemu_block blk;
    std::vector<Fiber> f;
    int n, done, at_barrier, order;
    std::vector<int> warp_waiting;  // per warp: lanes waiting at a warp operation
    std::vector<std::vector<unsigned>> warp_ops;  // per warp: the masks of its warp operations so far (the hazard check)
    size_t shmem;                   // dynamic shared memory bytes (at blk.dynamic_shared)
    std::vector<int> runq;          // the threads that can run, the next one last (taken and woken at the back)
    void* sched_sp;
    const std::function<void()>* body;
    const char* kernel;
    uint64_t rng;
};
thread_local cudaemu_thread* cudaemu_self;
thread_local cudaemu_block* cudaemu_blk;
static thread_local BlockRun* cur_run;

// Counting (section 10): while a launch is counted, every kernel thread's loads and stores are sorted into
// warp requests; these mark where a block and a thread begin. The hazard check watches shared memory.
static bool prof_in_kernel, haz_in_kernel;
static bool prof_instrumented;  // __tsan_init ran: the kernels of this binary call the hooks
static double prof_kernel_flops;  // the launch's tensor-core FLOPs (cudaemu_mma_m16n8k16), while counting
enum { I_SHFL, I_SYNC, I_TENSOR, I_SFU, I_CLASSES };
static double prof_inst[I_CLASSES];  // warp instructions the runtime sees: shuffles, barriers, mma, (SFU by the hooks)
static void prof_block_start(void);
static void prof_thread_start(int linear);
static void prof_warp_done(int warp);  // a warp's lanes all passed a warp operation or a barrier
static void prof_access(uintptr_t a, size_t size, int write, uintptr_t site);  // a kernel thread's load or store
// Per access site, the warp instructions it issued (section 10): the classes of SASS roofline.py weighs by them.
enum { S_GLD, S_GST, S_LDS, S_STS, S_SHFL, S_VOTE, S_WARPSYNC, S_BAR, S_MMA, S_SFU, S_CLASSES };
static void prof_site_inst(uintptr_t site, int cls, unsigned width, double n = 1);
static void haz_block_start(void);
static void haz_async(uintptr_t a, int pending, const struct Fiber* f, uintptr_t site);  // a cp.async's bytes: pending, or waited for
#define PROF_SITE ((uintptr_t)__builtin_return_address(0))  // where a hook was called from: the access site

static Fiber* cur_fiber(const char* what) {
    if (!cur_run) emu_fatal("%s called outside a kernel", what);
    return (Fiber*)cudaemu_self;
}

static void async_land_all(Fiber* f);
static bool mem_range_ok(const void* p, size_t bytes, int kind);  // section 4, and its kinds of memory:
enum { MEM_DEVICE, MEM_PINNED };

static void fiber_main(void* arg) {
    Fiber* f = (Fiber*)arg;
    (*cur_run->body)();
    async_land_all(f);  // its copies still land (the hazard check still sees them pending: no wait covered them)
    f->state = F_DONE;
    cudaemu_ctx_switch(&f->sp, cur_run->sched_sp);
}

// The next thread to run, as the order picks it from the run queue (a new one gets its stack), made the
// running one; nullptr when none can run.
static Fiber* take_next(BlockRun* R) {
    if (R->runq.empty()) return nullptr;
    size_t at = R->runq.size() - 1 - (R->order == ORDER_SHUFFLE ? rng_next(&R->rng) % R->runq.size() : 0);
    int i = R->runq[at];
    R->runq.erase(R->runq.begin() + at);
    Fiber* f = &R->f[i];
    if (f->state == F_NEW) {
        if (prof_in_kernel) prof_thread_start(i);
        f->stack = stack_pool.get();
        f->sp = fiber_stack_init(f->stack, fiber_main, f);
        f->state = F_RUN;
    }
    cudaemu_self = &f->t;
    return f;
}

// A thread that waits switches straight to the next one (the scheduler sees only a thread that ends, whose
// stack it takes back, or that none can run).
static void yield_to_next(Fiber* f) {
    Fiber* next = take_next(cur_run);
    if (next != f) cudaemu_ctx_switch(&f->sp, next ? next->sp : cur_run->sched_sp);
}

// Make threads runnable again (lanes of a warp, or the whole block: n ids, ascending). Forward and
// reversed run them next, lowest or highest first, so a warp runs ahead as far as it can before the others
// move (lower or higher warps first); shuffled picks the next thread at random from all that can run.
static void wake(BlockRun* R, const int* ids, int n) {
    for (int k = 0; k < n; k++) R->f[ids[k]].state = F_RUN;
    if (R->order == ORDER_REVERSE) R->runq.insert(R->runq.end(), ids, ids + n);
    else
        for (int k = n - 1; k >= 0; k--) R->runq.push_back(ids[k]);
}

static std::string block_name(const BlockRun* R) {
    char b[160];
    snprintf(b, sizeof(b), "%s block (%u,%u,%u)", R->kernel, R->blk.idx.x, R->blk.idx.y, R->blk.idx.z);
    return b;
}

static bool same_site(const char* a, const char* b) { return a == b || strcmp(a, b) == 0; }

static void async_maybe_land(Fiber* f);

void cudaemu_syncthreads(const char* site) {
    Fiber* f = cur_fiber("__syncthreads");
    BlockRun* R = cur_run;
    async_maybe_land(f);
    f->state = F_BARRIER;
    f->site = site;
    if (++R->at_barrier == R->n) {
        static thread_local std::vector<int> all;  // (kept: no allocation a barrier)
        all.clear();
        for (int i = 0; i < R->n; i++) {
            if (!same_site(R->f[i].site, site))
                emu_fatal("%s: threads wait at different barriers, %s and %s (__syncthreads in divergent code)",
                          block_name(R).c_str(), site, R->f[i].site);
            R->f[i].bars++;
            all.push_back(i);
        }
        if (prof_in_kernel) {
            prof_inst[I_SYNC] += (R->n + 31) / 32;  // one BAR per warp
            prof_site_inst(PROF_SITE, S_BAR, 4, (R->n + 31) / 32);
            for (int w = 0; w < (R->n + 31) / 32; w++) prof_warp_done(w);
        }
        R->at_barrier = 0;
        wake(R, all.data(), R->n);
    }
    yield_to_next(f);
}

// A warp operation; `collective`, when given, runs in the last lane to arrive with every lane's `bits` (as
// pointers, nullptr for lanes outside the mask) before any lane goes on (the tensor-core product).
static uint64_t warp_op(const char* site, uintptr_t pc, int kind, unsigned mask, uint64_t bits, int arg, int width,
                        void (*collective)(void* const* lanes)) {
    Fiber* f = cur_fiber("a warp operation");
    BlockRun* R = cur_run;
    async_maybe_land(f);
    int lane = f->linear % 32, base = f->linear - lane, lanes = std::min(32, R->n - base);
    if (!(mask >> lane & 1u))
        emu_fatal("%s thread %d: %s: the mask 0x%08x leaves out the calling lane %d", block_name(R).c_str(), f->linear, site,
                  mask, lane);
    if (lanes < 32 && (mask >> lanes))
        emu_fatal("%s: %s: the mask 0x%08x names lanes this block's last warp does not have (%d lanes)",
                  block_name(R).c_str(), site, mask, lanes);
    if (width < 1 || width > 32 || (width & (width - 1)))
        emu_fatal("%s: %s: width %d is not a power of 2 up to 32", block_name(R).c_str(), site, width);
    f->state = F_WARP;
    f->site = site;
    f->kind = kind;
    f->mask = mask;
    f->in = bits;
    f->arg = arg;
    f->width = width;
    int& waiting = R->warp_waiting[f->linear / 32];
    bool all = ++waiting >= __builtin_popcount(mask);  // then look closer: are they all this mask's lanes?
    for (int l = 0; all && l < 32; l++) {
        if (!(mask >> l & 1u)) continue;
        Fiber& g = R->f[base + l];
        if (g.state != F_WARP) {
            all = false;
            continue;
        }
        if (g.mask != mask || g.kind != kind || !same_site(g.site, site))
            emu_fatal("%s: lanes %d and %d of one warp wait at different warp operations (%s, mask 0x%08x; %s, mask 0x%08x)",
                      block_name(R).c_str(), lane, l, site, mask, g.site, g.mask);
    }
    if (all) {
        if (prof_in_kernel) {
            if (!collective) {
                prof_inst[kind == CUDAEMU_SYNCWARP ? I_SYNC : I_SHFL]++;
                prof_site_inst(pc, kind == CUDAEMU_SYNCWARP ? S_WARPSYNC : kind == CUDAEMU_BALLOT ? S_VOTE : S_SHFL, 4);
            }
            if ((mask | (lanes < 32 ? ~0u << lanes : 0u)) == ~0u) prof_warp_done(f->linear / 32);  // every lane it has
        }
        std::vector<unsigned>& ops = R->warp_ops[f->linear / 32];
        if (haz_in_kernel) ops.push_back(mask);  // the hazard check's history of the warp's operations
        if (collective) {
            void* lanes[32] = {};
            for (int l = 0; l < 32; l++)
                if (mask >> l & 1u) lanes[l] = (void*)(uintptr_t)R->f[base + l].in;
            collective(lanes);
        }
        int ids[32], woken = 0;
        unsigned ballot = 0;
        for (int l = 0; l < 32; l++)
            if ((mask >> l & 1u) && R->f[base + l].in) ballot |= 1u << l;
        for (int l = 0; l < 32; l++) {
            if (!(mask >> l & 1u)) continue;
            Fiber& g = R->f[base + l];
            int seg = l - l % width, src = l;
            if (kind == CUDAEMU_SHFL_IDX) src = seg + ((arg % width) + width) % width;
            else if (kind == CUDAEMU_SHFL_XOR) src = (l ^ arg) < seg + width ? l ^ arg : l;
            else if (kind == CUDAEMU_SHFL_UP) src = l - arg >= seg ? l - arg : l;
            else if (kind == CUDAEMU_SHFL_DOWN) src = l + arg < seg + width ? l + arg : l;
            if (src < 0 || src >= 32 || !(mask >> src & 1u))
                emu_fatal("%s: %s: lane %d reads lane %d, which is not in the mask 0x%08x", block_name(R).c_str(), site, l, src, mask);
            g.out = kind == CUDAEMU_BALLOT ? ballot : kind == CUDAEMU_SYNCWARP ? 0 : R->f[base + src].in;
            g.wops = (uint32_t)ops.size();
            ids[woken++] = base + l;
        }
        waiting -= woken;
        wake(R, ids, woken);
    }
    yield_to_next(f);
    return f->out;
}

uint64_t cudaemu_warp_op(const char* site, int kind, unsigned mask, uint64_t bits, int arg, int width) {
    return warp_op(site, PROF_SITE, kind, mask, bits, arg, width, nullptr);
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, or .f16 (cudaemu.h): a full-warp operation whose last
// lane to arrive places every lane's registers in A (16 x 16), B (16 x 8) and C (16 x 8) as the PTX ISA does
// and computes D for all of them.
struct MmaCall {
    float* d;
    const uint32_t *a, *b;
    const float* c;
    cudaDataType type;  // the operands': CUDA_R_16BF or CUDA_R_16F
};
static float operand_half(uint32_t r, int high, cudaDataType type) {  // a register's element: the lower index in the low 16 bits
    uint16_t u = (uint16_t)(high ? r >> 16 : r & 0xffffu);
    if (type == CUDA_R_16F) return __half2float(__ushort_as_half(u));
    return __bfloat162float(__ushort_as_bfloat16(u));
}
static void mma_m16n8k16_all(void* const* lanes) {
    if (prof_in_kernel) {
        prof_kernel_flops += 2.0 * 16 * 8 * 16;  // a warp's product: 16 x 8 x 16 multiply-adds
        prof_inst[I_TENSOR]++;                   // one HMMA instruction
    }
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; l++) {
        const MmaCall* m = (const MmaCall*)lanes[l];
        int g = l / 4, t = l % 4;
        cudaDataType type = ((const MmaCall*)lanes[0])->type;
        if (m->type != type) emu_fatal("mma.sync.m16n8k16: lanes 0 and %d give other operand types (one instruction has one)", l);
        for (int i = 0; i < 8; i++) {  // element i: register i / 2; row g + 8 (register 1, 3), column 2t + i % 2 + 8 (i >= 4)
            A[g + 8 * (i / 2 % 2)][2 * t + i % 2 + 8 * (i / 4)] = operand_half(m->a[i / 2], i % 2, type);
            if (i < 4) B[2 * t + i % 2 + 8 * (i / 2)][g] = operand_half(m->b[i / 2], i % 2, type);  // row 2t + i % 2 + 8 (i >= 2)
            if (i < 4) C[g + 8 * (i / 2)][2 * t + i % 2] = m->c[i];
        }
    }
    for (int l = 0; l < 32; l++) {  // after every lane's C was read: d and c may be one array
        const MmaCall* m = (const MmaCall*)lanes[l];
        for (int i = 0; i < 4; i++) {
            int r = l / 4 + 8 * (i / 2), c = 2 * (l % 4) + i % 2;
            float s = C[r][c];
            for (int k = 0; k < 16; k++) s += A[r][k] * B[k][c];  // bf16 and fp16 products are exact in fp32
            m->d[i] = s;
        }
    }
}

static void prof_warp_inst(uintptr_t site, int cls);
void cudaemu_mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4], cudaDataType type) {
    prof_warp_inst(PROF_SITE, S_MMA);
    if (type != CUDA_R_16BF && type != CUDA_R_16F) emu_fatal("mma.sync.m16n8k16: the operands are .bf16 or .f16 here, not type %d", (int)type);
    MmaCall m{d, a, b, c, type};
    warp_op("mma.sync.m16n8k16", PROF_SITE, CUDAEMU_SYNCWARP, 0xffffffffu, (uint64_t)(uintptr_t)&m, 0, 32, mma_m16n8k16_all);
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 (cudaemu.h): the last lane to arrive reads the four 8 x 8
// matrices whose rows the lanes name (lanes 8i .. 8i + 7: matrix i's rows 0 .. 7) and hands each lane its
// registers, so all rows are read before any lane goes on.
struct LdmatrixCall {
    uint32_t* d;
    const uint16_t* row;
};
static void ldmatrix_x4(void* const* lanes, bool trans) {
    uint16_t M[4][8][8];
    for (int l = 0; l < 32; l++) memcpy(M[l / 8][l % 8], ((const LdmatrixCall*)lanes[l])->row, 16);
    for (int l = 0; l < 32; l++)  // lane l gets row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1, or transposed
        for (int i = 0; i < 4; i++) {
            int r = l / 4, c = 2 * (l % 4);
            ((const LdmatrixCall*)lanes[l])->d[i] = trans ? M[i][c][r] | (uint32_t)M[i][c + 1][r] << 16
                                                          : M[i][r][c] | (uint32_t)M[i][r][c + 1] << 16;
        }
}
static void ldmatrix_x4_all(void* const* lanes) { ldmatrix_x4(lanes, false); }
static void ldmatrix_x4_trans_all(void* const* lanes) { ldmatrix_x4(lanes, true); }

void cudaemu_ldmatrix_x4(uint32_t d[4], const void* row, int trans) {
    Fiber* f = cur_fiber("ldmatrix");
    if ((uintptr_t)row % 16)
        emu_fatal("%s thread %d: ldmatrix: the row address %p is not 16-byte aligned", block_name(cur_run).c_str(), f->linear, row);
    prof_access((uintptr_t)row, 16, 0, PROF_SITE);  // the lane's row: a shared load of the warp's request (counts, hazards)
    LdmatrixCall m{d, (const uint16_t*)row};
    warp_op(trans ? "ldmatrix.sync.m8n8.x4.trans" : "ldmatrix.sync.m8n8.x4", PROF_SITE, CUDAEMU_SYNCWARP, 0xffffffffu, (uint64_t)(uintptr_t)&m, 0,
            32, trans ? ldmatrix_x4_trans_all : ldmatrix_x4_all);
}

// cp.async.cg.shared.global [dst], [src], 16, src_bytes; cp.async.commit_group; cp.async.wait_group n (PTX ISA,
// "Data Movement and Conversion Instructions: cp.async"). A copy is asynchronous: it reads its source and
// writes shared memory at some time between its issue and the wait_group that covers its group, which
// makes its bytes visible to the waiting thread alone (others see them after a barrier). Each thread order
// picks a different legal time: forward lands a copy at that wait (the latest), reversed at its issue (the
// earliest), shuffled at random points of the thread between the two (its barriers, warp operations and
// cp.async calls). So a read before the wait, or a copy into bytes other warps still read, gives other
// bytes in one of the orders; the hazard check (section 10) names it whatever the bytes.
static void async_land(AsyncCopy& c) {
    if (c.landed) return;
    memcpy(c.dst, c.src, c.bytes);
    memset(c.dst + c.bytes, 0, 16 - c.bytes);
    c.landed = true;
}
static void async_land_all(Fiber* f) {
    for (AsyncCopy& c : f->copies) async_land(c);
}
static void async_maybe_land(Fiber* f) {
    if (cur_run->order != ORDER_SHUFFLE) return;
    for (AsyncCopy& c : f->copies)
        if (rng_next(&cur_run->rng) & 1) async_land(c);
}

void cudaemu_cp_async16(void* dst, const void* src, int src_bytes) {
    Fiber* f = cur_fiber("cp.async");
    BlockRun* R = cur_run;
    uintptr_t d = (uintptr_t)dst, shared = (uintptr_t)R->blk.dynamic_shared;
    if (d % 16 || (src_bytes > 0 && (uintptr_t)src % 16))
        emu_fatal("%s thread %d: cp.async: the %s address %p is not 16-byte aligned", block_name(R).c_str(), f->linear,
                  d % 16 ? "shared" : "global", d % 16 ? dst : src);
    if (src_bytes < 0 || src_bytes > 16)
        emu_fatal("%s thread %d: cp.async: %d source bytes, not 0 to 16", block_name(R).c_str(), f->linear, src_bytes);
    if (d - shared + 16 > R->shmem)
        emu_fatal("%s thread %d: cp.async: the destination %p is not in the block's dynamic shared memory", block_name(R).c_str(),
                  f->linear, dst);
    if (src_bytes > 0 && !mem_range_ok(src, src_bytes, MEM_DEVICE))
        emu_fatal("%s thread %d: cp.async: the source %p (%d bytes) is not in a device allocation", block_name(R).c_str(), f->linear,
                  src, src_bytes);
    async_maybe_land(f);
    uintptr_t site = PROF_SITE;
    if (src_bytes > 0) prof_access((uintptr_t)src, src_bytes, 0, site);  // the global load and the shared store (counts, hazards)
    prof_access(d, 16, 1, site);
    if (haz_in_kernel) haz_async(d, 1, f, site);
    f->copies.push_back(AsyncCopy{(char*)dst, (const char*)src, src_bytes, f->groups, false, site});
    if (R->order == ORDER_REVERSE) async_land(f->copies.back());
}
void cudaemu_cp_async_commit(void) {
    Fiber* f = cur_fiber("cp.async.commit_group");
    async_maybe_land(f);
    f->groups++;
}
// Every group but the n most recently committed is complete: their copies land (if they have not) and their
// bytes are this thread's writes from now on. Uncommitted copies are not waited for.
void cudaemu_cp_async_wait(int n) {
    Fiber* f = cur_fiber("cp.async.wait_group");
    size_t kept = 0;
    for (size_t i = 0; i < f->copies.size(); i++) {
        AsyncCopy& c = f->copies[i];
        if (c.group + (uint32_t)n < f->groups) {
            async_land(c);
            if (haz_in_kernel) haz_async((uintptr_t)c.dst, 0, f, c.site);
        } else {
            f->copies[kept++] = c;
        }
    }
    f->copies.resize(kept);
}

void* cudaemu_dynamic_shared(void) {
    cur_fiber("dynamic shared memory");
    return cur_run->blk.dynamic_shared;
}

// Nothing can run and some threads wait: say who waits for what.
[[noreturn]] static void block_stuck(BlockRun* R) {
    for (int i = 0; i < R->n; i++) {
        Fiber& f = R->f[i];
        if (f.state == F_WARP) {
            int base = i - i % 32;
            for (int l = 0; l < 32; l++) {
                if (!(f.mask >> l & 1u)) continue;
                Fiber& g = R->f[base + l];
                if (g.state == F_DONE)
                    emu_fatal("%s: lane %d waits at %s (mask 0x%08x) for lane %d, which has exited (a shuffle with inactive lanes)",
                              block_name(R).c_str(), i % 32, f.site, f.mask, l);
                if (g.state == F_BARRIER)
                    emu_fatal("%s: deadlock: lane %d waits at %s for lane %d, which waits at the barrier %s",
                              block_name(R).c_str(), i % 32, f.site, l, g.site);
            }
        }
    }
    for (int i = 0; i < R->n; i++)
        if (R->f[i].state == F_BARRIER)
            emu_fatal("%s: the barrier %s is reached by %d of %d threads; %d exited without it (__syncthreads in divergent code)",
                      block_name(R).c_str(), R->f[i].site, R->at_barrier, R->n, R->done);
    emu_fatal("%s: threads wait and none can run", block_name(R).c_str());
}

static void run_block(BlockRun* R, const std::vector<int>& first_order) {
    R->done = R->at_barrier = 0;
    R->warp_waiting.assign((R->n + 31) / 32, 0);
    R->warp_ops.assign((R->n + 31) / 32, std::vector<unsigned>());
    R->runq.assign(first_order.rbegin(), first_order.rend());
    for (int i = 0; i < R->n; i++) R->f[i].state = F_NEW, R->f[i].bars = R->f[i].wops = R->f[i].groups = 0, R->f[i].copies.clear();
    for (Fiber* f = take_next(R); f; f = take_next(R)) {
        cudaemu_ctx_switch(&R->sched_sp, f->sp);
        Fiber* last = (Fiber*)cudaemu_self;  // the thread that ended, or the last that waited
        if (last->state == F_DONE) {
            stack_pool.put(last->stack);
            R->done++;
        }
    }
    if (R->done != R->n) block_stuck(R);
    cudaemu_self = NULL;
}

// One launch, all its blocks, in the given order.
struct Launch {
    std::string name;
    dim3 grid, block;
    size_t shmem;
    std::function<void()> body;
    int racecheck, hazards;         // as set when it was launched
    std::vector<uintptr_t> allocs;  // the allocations its pointer arguments point into
};

static void run_grid(const Launch& L, int order, uint64_t seed) {
    BlockRun R;
    R.kernel = L.name.c_str();
    R.body = &L.body;
    R.order = order;
    R.rng = seed;
    R.n = (int)(L.block.x * L.block.y * L.block.z);
    R.f.resize(R.n);
    for (int i = 0; i < R.n; i++) {
        R.f[i].linear = i;
        R.f[i].t.idx = make_uint3(i % L.block.x, i / L.block.x % L.block.y, i / (L.block.x * L.block.y));
        R.f[i].site = "";
    }
    R.blk.dim = L.block;
    R.blk.grid = L.grid;
    std::vector<char> shared((L.shmem ? L.shmem : 1) + 128);  // aligned to 128 bytes, as a GPU's is at least
    R.blk.dynamic_shared = shared.data() + (128 - (uintptr_t)shared.data() % 128) % 128;
    R.shmem = L.shmem;
    int blocks = (int)(L.grid.x * L.grid.y * L.grid.z);
    std::vector<int> block_order, thread_order;
    order_items(block_order, blocks, order, &R.rng);
    BlockRun* saved = cur_run;
    cur_run = &R;
    cudaemu_blk = &R.blk;
    for (int b : block_order) {
        R.blk.idx = make_uint3(b % L.grid.x, b / L.grid.x % L.grid.y, b / (L.grid.x * L.grid.y));
        memset(shared.data(), 0xff, shared.size());  // NaN in every float type: reading before writing shows
        if (prof_in_kernel) prof_block_start();
        if (haz_in_kernel) haz_block_start();
        order_items(thread_order, R.n, order, &R.rng);
        run_block(&R, thread_order);
    }
    cur_run = saved;
    cudaemu_blk = NULL;
}

// ----------------------------------------------------------------------------------------------------
// 4. device memory: every allocation has guard bytes on both sides, checked after each kernel that was
// handed a pointer into it, at synchronizations and at free; fresh memory is filled with 0xff (NaN)

static const size_t kGuard = 256;
static const unsigned char kGuardByte = 0xcd;
struct Alloc {
    size_t size, span;  // asked for; guards and padding included
    int kind;
    char* raw;
};
static std::mutex& mem_mu = *new std::mutex();  // never destroyed: the device thread outlives exit()
static std::map<uintptr_t, Alloc>& allocs = *new std::map<uintptr_t, Alloc>();  // by the address handed out
static size_t mem_used;
static uint64_t mem_version;  // changes with every allocation and free (section 10 keeps a copy of the map)

static const Alloc* find_alloc(const void* p, uintptr_t* base) {  // the allocation holding p (its end included)
    auto it = allocs.upper_bound((uintptr_t)p);
    if (it == allocs.begin()) return NULL;
    --it;
    if ((uintptr_t)p > it->first + it->second.size) return NULL;
    if (base) *base = it->first;
    return &it->second;
}

static void* mem_alloc(size_t size, int kind) {
    size_t padded = (size + 255) / 256 * 256, span = kGuard + padded + kGuard;
    char* raw = (char*)aligned_alloc(256, span);
    if (!raw) return NULL;
    char* user = raw + kGuard;
    memset(raw, kGuardByte, kGuard);
    memset(user, 0xff, size);
    memset(user + size, kGuardByte, span - kGuard - size);
    std::lock_guard<std::mutex> lk(mem_mu);
    allocs[(uintptr_t)user] = Alloc{size, span, kind, raw};
    mem_version++;
    if (kind == MEM_DEVICE) mem_used += padded;
    return user;
}

static bool guards_intact(uintptr_t user, const Alloc& a) {
    const unsigned char* r = (const unsigned char*)a.raw;
    for (size_t i = 0; i < kGuard; i++)
        if (r[i] != kGuardByte) return false;
    for (size_t i = kGuard + a.size; i < a.span; i++)
        if (r[i] != kGuardByte) return false;
    (void)user;
    return true;
}

static void check_guards(const char* when, const std::vector<uintptr_t>* only) {
    std::lock_guard<std::mutex> lk(mem_mu);
    auto check = [&](uintptr_t user, const Alloc& a) {
        if (!guards_intact(user, a))
            emu_fatal("%s: a write outside the %zu-byte %s allocation at %p (its guard bytes changed)", when, a.size,
                      a.kind == MEM_DEVICE ? "device" : "page-locked host", (void*)user);
    };
    if (only) {
        for (uintptr_t u : *only) {
            auto it = allocs.find(u);
            if (it != allocs.end()) check(it->first, it->second);
        }
    } else {
        for (auto& kv : allocs) check(kv.first, kv.second);
    }
}

static cudaError_t mem_free(void* p, int kind, const char* call) {
    if (!p) return cudaSuccess;
    std::lock_guard<std::mutex> lk(mem_mu);
    auto it = allocs.find((uintptr_t)p);
    if (it == allocs.end() || it->second.kind != kind) return cudaErrorInvalidValue;
    if (!guards_intact(it->first, it->second))
        emu_fatal("%s(%p): a write outside this %zu-byte allocation (its guard bytes changed)", call, p, it->second.size);
    if (kind == MEM_DEVICE) mem_used -= it->second.span - 2 * kGuard;
    free(it->second.raw);
    allocs.erase(it);
    mem_version++;
    return cudaSuccess;
}

// Is [p, p + bytes) inside one allocation of the kind? (-1: any kind)
static bool mem_range_ok(const void* p, size_t bytes, int kind) {
    std::lock_guard<std::mutex> lk(mem_mu);
    uintptr_t base;
    const Alloc* a = find_alloc(p, &base);
    return a && (kind < 0 || a->kind == kind) && (uintptr_t)p + bytes <= base + a->size;
}
static bool is_device(const void* p) {
    std::lock_guard<std::mutex> lk(mem_mu);
    const Alloc* a = find_alloc(p, NULL);
    return a && a->kind == MEM_DEVICE;
}

// ----------------------------------------------------------------------------------------------------
// 5. streams, events and the device thread. Work is queued per stream; the device thread runs the
// head of a stream that is ready (not waiting for an event, NCCL calls in their communicator's order),
// picking among ready streams at random (seeded). By default it waits to run anything until the host
// waits for the GPU or has made no CUDA call for a few milliseconds: queues grow, and the order
// between streams is decided late, so a missing cudaStreamWaitEvent changes results.

struct CommOp;
struct Op {
    enum { RUN, RECORD, WAIT, COMM } kind;
    std::function<void()> run;
    cudaEvent_t ev;
    uint64_t gen;
    CommOp* comm;
    uint64_t epoch;  // the host's waits before it was queued (the profile's replay: section 10)
};
struct CUstream_st {
    std::deque<Op*> q;
    bool started;  // the head is running (a kernel) or in flight (an NCCL call)
    int id;        // 0 the default stream, then in order of creation (the profile names streams by it)
};
struct CUevent_st {
    uint64_t recorded, completed;  // records queued, records reached
    int id;                        // in order of creation, for the profile
    double reached_s;              // the host's steady clock when the latest record was reached (cudaEventElapsedTime)
};

static std::mutex& mu = *new std::mutex();  // these too live past exit()
static std::condition_variable& cv_work = *new std::condition_variable();
static std::condition_variable& cv_done = *new std::condition_variable();
static std::vector<cudaStream_t>& streams = *new std::vector<cudaStream_t>();  // [0] is the default stream
static CUstream_st& default_stream = *new CUstream_st();
static int host_waiting;
static uint64_t host_epoch;  // host waits so far: work queued after the k-th cannot start before it returned
static int next_stream_id = 1, next_event_id;
static std::chrono::steady_clock::time_point last_call;
static uint64_t stream_rng;
static bool device_up;
static cudaError_t last_error = cudaSuccess;
static cudaError_t detail_code = cudaSuccess;
static char detail[600];

static bool comm_ready(CommOp* c);   // 9: its communicator's previous calls have started
static void comm_start(CommOp* c);   // 9: post its MPI requests
static bool comm_poll(CommOp* c);    // 9: done? then finish (reduce, copy) and free it

static cudaStream_t S(cudaStream_t s) { return s ? s : &default_stream; }

static bool queues_empty(void) {
    for (cudaStream_t s : streams)
        if (!s->q.empty()) return false;
    return true;
}

[[noreturn]] static void streams_stuck(void) {
    std::string why;
    for (size_t i = 0; i < streams.size(); i++) {
        if (streams[i]->q.empty()) continue;
        Op* h = streams[i]->q.front();
        char b[160];
        snprintf(b, sizeof(b), "%sstream %zu waits %s", why.empty() ? "" : "; ", i,
                 h->kind == Op::WAIT ? "for an event no stream will reach" : "to start an NCCL call behind one that cannot start");
        why += b;
    }
    emu_fatal("the streams deadlock: %s", why.c_str());
}

static void prof_open(void);  // section 10: CUDAEMU_PROFILE
static void prof_call(const char* name, const char* kind, size_t read, size_t written);  // counts a copy, memset or wait
static void prof_running(cudaStream_t s, const Op* h);  // section 10: which stream the device thread runs, for the counts
static void prof_event(const char* what, cudaStream_t s, const Op* h);  // an event recorded or waited for, reached
static void prof_comm(cudaStream_t s, const Op* h);     // an NCCL call posted

static void* device_main(void*) {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
        bool inflight = false;
        for (cudaStream_t s : streams) inflight |= s->started;
        if (queues_empty()) {
            cv_work.wait(lk);
            continue;
        }
        if (!cfg.eager && !host_waiting && !inflight) {
            auto idle = std::chrono::steady_clock::now() - last_call;
            if (idle < std::chrono::milliseconds(5)) {
                cv_work.wait_for(lk, std::chrono::milliseconds(5) - idle);
                continue;
            }
        }
        // finish what is in flight; retire reached events and waits; collect the ready heads
        std::vector<cudaStream_t> ready;
        bool progress = false;
        for (cudaStream_t s : streams) {
            while (!s->q.empty()) {
                Op* h = s->q.front();
                if (s->started) {
                    if (!comm_poll(h->comm)) break;
                    s->started = false;
                } else if (h->kind == Op::RECORD) {
                    h->ev->completed = std::max(h->ev->completed, h->gen);
                    h->ev->reached_s = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
                    prof_event("record", s, h);
                } else if (h->kind == Op::WAIT) {
                    if (h->ev->completed < h->gen) break;
                    prof_event("wait", s, h);
                } else {
                    if (h->kind != Op::COMM || comm_ready(h->comm)) ready.push_back(s);
                    break;
                }
                s->q.pop_front();
                delete h;
                progress = true;
            }
        }
        if (progress) cv_done.notify_all();
        if (ready.empty()) {
            if (inflight) {  // an NCCL call waits for other ranks
                lk.unlock();
                usleep(50);
                lk.lock();
                continue;
            }
            if (!progress) streams_stuck();
            continue;
        }
        cudaStream_t s = ready[rng_next(&stream_rng) % ready.size()];
        Op* h = s->q.front();
        s->started = true;
        if (h->kind == Op::COMM) {
            prof_comm(s, h);
            comm_start(h->comm);
            continue;
        }
        prof_running(s, h);
        lk.unlock();
        h->run();
        lk.lock();
        s->started = false;
        s->q.pop_front();
        delete h;
        cv_done.notify_all();
    }
    return NULL;
}

// Every API call starts here: settings and the device thread on first use; the host's last call is
// when the device thread may start running queued work.
static void touch(void) {
    std::lock_guard<std::mutex> lk(mu);
    last_call = std::chrono::steady_clock::now();
    if (device_up) return;
    read_settings();
    prof_open();
    stream_rng = cfg.seed;
    streams.push_back(&default_stream);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 << 20);
    if (pthread_create(&t, &attr, device_main, NULL) != 0) emu_fatal("cannot start the device thread");
    device_up = true;
}

static void enqueue(cudaStream_t s, Op* op) {
    std::lock_guard<std::mutex> lk(mu);
    op->epoch = host_epoch;
    S(s)->q.push_back(op);
    cv_work.notify_one();
}
static void enqueue_run(cudaStream_t s, std::function<void()> f) {
    Op* op = new Op();
    op->kind = Op::RUN;
    op->run = std::move(f);
    enqueue(s, op);
}

static void prof_host(uint64_t epoch, const char* what);  // section 10: a host wait returned

// The host waits until pred holds (called with mu held), letting the device thread run meanwhile. what
// says for what ("device", "stream 3", "event 5 12"): the profile's replay waits for the same.
template <typename F>
static void host_wait(const char* what, F pred) {
    std::unique_lock<std::mutex> lk(mu);
    host_waiting++;
    cv_work.notify_one();
    cv_done.wait(lk, pred);
    host_waiting--;
    prof_host(++host_epoch, what);
    last_call = std::chrono::steady_clock::now();
}
static std::string stream_name(cudaStream_t s) { return "stream " + std::to_string(S(s)->id); }
static void device_sync(void) {
    host_wait("device", [] {
        if (!queues_empty()) return false;
        for (cudaStream_t s : streams)
            if (s->started) return false;
        return true;
    });
    check_guards("at a synchronization", NULL);
}

static cudaError_t fail(cudaError_t code, const char* fmt, ...) {  // a returned error, with its detail
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof(detail), fmt, ap);
    va_end(ap);
    detail_code = code;
    return code;
}

// ----------------------------------------------------------------------------------------------------
// 6. kernel launches and the race check

static long device_frees;  // cudaFree calls, for cudaemu_device_frees
long cudaemu_device_frees(void) { return device_frees; }

void cudaemu_hazards(int on) {
    touch();
    cfg.hazards = on;
}

void cudaemu_racecheck(int on) {
    touch();
    cfg.racecheck = on;
}
void cudaemu_refuse_grad_epilogues(int on) {
    touch();
    cfg.refuse_grads = on;
}

static void prof_launch_begin(const Launch& L);  // section 10: counts this launch if counting is on
static void prof_launch_end(const Launch& L);

static void run_launch(const Launch& L) {
    if (!L.racecheck) {
        prof_launch_begin(L);
        run_grid(L, cfg.order, cfg.seed);
        prof_launch_end(L);
    } else {  // forward, reversed and shuffled from the same bytes must end in the same bytes
        std::vector<std::vector<char>> start, first;
        {
            std::lock_guard<std::mutex> lk(mem_mu);
            for (uintptr_t u : L.allocs) start.emplace_back((char*)u, (char*)u + allocs[u].size);
        }
        const char* names[3] = {"forward", "reversed", "shuffled"};
        for (int order = ORDER_FORWARD; order <= ORDER_SHUFFLE; order++) {
            for (size_t i = 0; i < L.allocs.size(); i++) memcpy((void*)L.allocs[i], start[i].data(), start[i].size());
            if (order == ORDER_FORWARD) prof_launch_begin(L);  // the reruns are not counted
            run_grid(L, order, cfg.seed + order);
            if (order == ORDER_FORWARD) prof_launch_end(L);
            for (size_t i = 0; i < L.allocs.size(); i++) {
                const char* now = (const char*)L.allocs[i];
                if (order == ORDER_FORWARD) {
                    first.emplace_back(now, now + start[i].size());
                    continue;
                }
                if (memcmp(now, first[i].data(), first[i].size()) == 0) continue;
                size_t at = 0;
                while (now[at] == first[i][at]) at++;
                emu_fatal("%s: a race: run with threads and blocks %s it writes other bytes than forward (the %zu-byte "
                          "allocation at %p differs from byte %zu)",
                          L.name.c_str(), names[order], first[i].size(), (void*)L.allocs[i], at);
            }
        }
    }
    char when[200];
    snprintf(when, sizeof(when), "after kernel %s", L.name.c_str());
    check_guards(when, &L.allocs);
}

// Dynamic shared memory a kernel may take, above the 48 KiB every kernel gets: what the program opted in
// to with cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), up to the
// device's sharedMemPerBlockOptin (an H100's 227 KiB).
#define CUDAEMU_SHARED_OPTIN (227 * 1024)  // also what cudaGetDeviceProperties reports
static std::mutex shared_mu;
static std::map<const void*, int> shared_optin;
cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attr, int value) {
    touch();
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
        return fail(cudaErrorNotSupported, "cudaFuncSetAttribute: only cudaFuncAttributeMaxDynamicSharedMemorySize is emulated");
    if (value < 0 || value > CUDAEMU_SHARED_OPTIN)
        return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: %d bytes of dynamic shared memory, more than the "
                    "device's %d (sharedMemPerBlockOptin)", value, CUDAEMU_SHARED_OPTIN);
    std::lock_guard<std::mutex> lk(shared_mu);
    shared_optin[kernel] = value;
    return cudaSuccess;
}

// Where code is, by addr2line on this binary (the counting builds carry line tables): a return address as
// "file:line", or a function's name ("lp_kernel<64>").
static std::string code_line(uintptr_t pc, bool function = false) {
    Dl_info info;
    char cmd[600], out[600] = "";
    if (!dladdr((void*)pc, &info) || !info.dli_fname) return "?";
    snprintf(cmd, sizeof(cmd), "addr2line -e '%s' %s 0x%lx 2>/dev/null", info.dli_fname, function ? "-f -C" : "-i",
             (unsigned long)(pc - !function - (uintptr_t)info.dli_fbase));
    FILE* p = popen(cmd, "r");
    if (p && fgets(out, sizeof(out), p)) out[strcspn(out, "\n")] = 0;
    if (p) pclose(p);
    if (function) {  // "void name<64>(args)": the name and its template arguments
        const char* at = strchr(out, ' ') ? strchr(out, ' ') + 1 : out;
        return std::string(at, strcspn(at, "("));
    }
    const char* slash = strrchr(out, '/');
    return out[0] ? (slash ? slash + 1 : out) : "?";
}

void cudaemu_launch_kernel(const char* name, const void* kernel, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream,
                           const cudaemu_arg* pointers, int npointers, std::function<void()> body) {
    touch();
    if (strchr(name, '<') && prof_instrumented) {  // a template's launch names its parameter ("k<HP>"): counts name its value
        static std::mutex mu;
        static std::map<const void*, std::string>& names = *new std::map<const void*, std::string>();
        std::lock_guard<std::mutex> lk(mu);
        auto it = names.find(kernel);
        if (it == names.end()) it = names.emplace(kernel, code_line((uintptr_t)kernel, true)).first;
        name = it->second.c_str();
    }
    uint64_t threads = (uint64_t)block.x * block.y * block.z;
    if (!block.x || !block.y || !block.z || !grid.x || !grid.y || !grid.z || threads > 1024 || block.z > 64 ||
        grid.y > 65535 || grid.z > 65535 || grid.x > 2147483647u) {
        last_error = fail(cudaErrorInvalidConfiguration, "%s<<<(%u,%u,%u), (%u,%u,%u)>>>: blocks hold 1 to 1024 threads (z up to 64), "
                          "grids up to (2^31-1, 65535, 65535) blocks", name, grid.x, grid.y, grid.z, block.x, block.y, block.z);
        return;
    }
    size_t most = 48 * 1024;
    {
        std::lock_guard<std::mutex> lk(shared_mu);
        auto it = shared_optin.find(kernel);
        if (it != shared_optin.end() && (size_t)it->second > most) most = it->second;
    }
    if (shmem > most) {
        last_error = fail(cudaErrorInvalidValue, "%s: %zu bytes of dynamic shared memory, more than the %zu a block gets "
                          "(48 KiB, or what cudaFuncSetAttribute opted in to)", name, shmem, most);
        return;
    }
    Launch* L = new Launch{name, grid, block, shmem, std::move(body), cfg.racecheck, cfg.hazards, {}};
    {
        std::lock_guard<std::mutex> lk(mem_mu);
        for (int i = 0; i < npointers; i++) {
            if (!pointers[i].ptr) continue;
            uintptr_t base;
            if (!find_alloc(pointers[i].ptr, &base))
                emu_fatal("kernel %s: argument %d (%p) is neither device memory nor page-locked host memory", name,
                          pointers[i].index + 1, pointers[i].ptr);
            if (std::find(L->allocs.begin(), L->allocs.end(), base) == L->allocs.end()) L->allocs.push_back(base);
        }
    }
    enqueue_run(stream, [L] {
        run_launch(*L);
        delete L;
    });
}

// ----------------------------------------------------------------------------------------------------
// 7. the CUDA runtime API (what llmpar calls, and a little around it)

static int world_rank_for_bus_id = -1;  // set when MPI starts (ranks are separate emulated GPUs)

extern "C" {

const char* cudaGetErrorString(cudaError_t e) {
    static thread_local char msg[800];
    const char* base = e == cudaSuccess ? "no error" : e == cudaErrorInvalidValue ? "invalid argument"
                     : e == cudaErrorMemoryAllocation ? "out of memory" : e == cudaErrorInvalidConfiguration ? "invalid configuration argument"
                     : e == cudaErrorInvalidResourceHandle ? "invalid resource handle" : e == cudaErrorNotSupported ? "operation not supported"
                     : e == cudaErrorInvalidMemcpyDirection ? "invalid copy direction for memcpy" : "unknown error";
    if (e != cudaSuccess && e == detail_code) {
        snprintf(msg, sizeof(msg), "%s (cudaemu: %s)", base, detail);
        return msg;
    }
    return base;
}
const char* cudaGetErrorName(cudaError_t e) { return cudaGetErrorString(e); }

cudaError_t cudaGetLastError(void) {
    touch();
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return last_error; }

cudaError_t cudaGetDeviceCount(int* count) {
    touch();
    *count = 1;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
    touch();
    return device == 0 ? cudaSuccess : fail(cudaErrorInvalidValue, "device %d: the emulator has device 0 only", device);
}
cudaError_t cudaGetDevice(int* device) {
    *device = 0;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
    touch();
    if (device != 0) return fail(cudaErrorInvalidValue, "device %d: the emulator has device 0 only", device);
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "cudaemu (CUDA emulated on the CPU)");
    p->totalGlobalMem = cfg.capacity;
    p->sharedMemPerBlock = 48 * 1024;
    p->sharedMemPerBlockOptin = CUDAEMU_SHARED_OPTIN;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 2147483647;
    p->maxGridSize[1] = p->maxGridSize[2] = 65535;
    p->major = 9;
    p->minor = 0;
    p->multiProcessorCount = 132;
    p->pciBusID = cfg.shared_gpu ? 1 : world_rank_for_bus_id + 2;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char* bus, int len, int device) {
    touch();
    if (device != 0) return fail(cudaErrorInvalidValue, "device %d: the emulator has device 0 only", device);
    snprintf(bus, (size_t)len, "0000:%02x:00.0", cfg.shared_gpu ? 1 : (world_rank_for_bus_id + 2) & 0xff);
    return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
    touch();
    *p = NULL;
    size_t padded = (bytes + 255) / 256 * 256;
    {
        std::lock_guard<std::mutex> lk(mem_mu);
        if (mem_used + padded > cfg.capacity)
            return fail(cudaErrorMemoryAllocation, "%zu bytes asked, %zu of %zu in use (CUDAEMU_MEMORY_GIB sets the capacity)",
                        bytes, mem_used, cfg.capacity);
    }
    *p = mem_alloc(bytes, MEM_DEVICE);
    return *p ? cudaSuccess : fail(cudaErrorMemoryAllocation, "the host has no memory for %zu bytes", bytes);
}
cudaError_t cudaFree(void* p) {  // like CUDA's, it waits for the device first
    touch();
    device_frees++;
    device_sync();
    prof_call("cudaFree (waits for the device)", "wait", 0, 0);
    return mem_free(p, MEM_DEVICE, "cudaFree") == cudaSuccess
               ? cudaSuccess : fail(cudaErrorInvalidValue, "cudaFree(%p): not an address cudaMalloc returned", p);
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
    touch();
    *p = mem_alloc(bytes, MEM_PINNED);
    return *p ? cudaSuccess : fail(cudaErrorMemoryAllocation, "the host has no memory for %zu page-locked bytes", bytes);
}
cudaError_t cudaFreeHost(void* p) {
    touch();
    device_sync();
    return mem_free(p, MEM_PINNED, "cudaFreeHost") == cudaSuccess
               ? cudaSuccess : fail(cudaErrorInvalidValue, "cudaFreeHost(%p): not an address cudaMallocHost returned", p);
}

cudaError_t cudaMemGetInfo(size_t* free_b, size_t* total_b) {
    touch();
    std::lock_guard<std::mutex> lk(mem_mu);
    *free_b = cfg.capacity - mem_used;
    *total_b = cfg.capacity;
    return cudaSuccess;
}

// A copy's direction must match where its pointers are, and device ranges must lie in one allocation.
static cudaError_t copy_check(const char* call, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    bool dst_dev = is_device(dst), src_dev = is_device(src);
    if (kind == cudaMemcpyDefault) kind = dst_dev ? (src_dev ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                                  : (src_dev ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
    bool want_dst = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    bool want_src = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if (dst_dev != want_dst || src_dev != want_src)
        return fail(cudaErrorInvalidValue, "%s: the direction says %s to %s but the source is %s and the destination %s memory", call,
                    want_src ? "device" : "host", want_dst ? "device" : "host", src_dev ? "device" : "host", dst_dev ? "device" : "host");
    if (want_dst && !mem_range_ok(dst, bytes, MEM_DEVICE))
        return fail(cudaErrorInvalidValue, "%s: %zu bytes to %p run past the end of its allocation", call, bytes, dst);
    if (want_src && !mem_range_ok(src, bytes, MEM_DEVICE))
        return fail(cudaErrorInvalidValue, "%s: %zu bytes from %p run past the end of its allocation", call, bytes, src);
    return cudaSuccess;
}

// cudaMemcpy runs on the default stream. Host to device: the source is copied at the call (as CUDA
// stages pageable memory) and written in stream order; device to host returns when done.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    touch();
    cudaError_t e = copy_check("cudaMemcpy", dst, src, bytes, kind);
    if (e != cudaSuccess) return e;
    if (!is_device(src) && !is_device(dst)) {
        memcpy(dst, src, bytes);
        return cudaSuccess;
    }
    if (!is_device(src)) {
        std::vector<char>* staged = new std::vector<char>((const char*)src, (const char*)src + bytes);
        enqueue_run(NULL, [dst, staged] {
            memcpy(dst, staged->data(), staged->size());
            prof_call("cudaMemcpy HtoD", "pcie", 0, staged->size());
            delete staged;
        });
        return cudaSuccess;
    }
    bool to_host = !is_device(dst);
    enqueue_run(NULL, [dst, src, bytes, to_host] {
        memcpy(dst, src, bytes);
        if (to_host) prof_call("cudaMemcpy DtoH", "pcie", bytes, 0);
        else prof_call("cudaMemcpy DtoD", "copy", bytes, bytes);
    });
    if (to_host) {  // device to host: wait for the default stream
        CUstream_st* s = &default_stream;
        host_wait("stream 0", [s] { return s->q.empty(); });
    }
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
    touch();
    cudaError_t e = copy_check("cudaMemcpyAsync", dst, src, bytes, kind);
    if (e != cudaSuccess) return e;
    bool from_dev = is_device(src), to_dev = is_device(dst);
    enqueue_run(stream, [dst, src, bytes, from_dev, to_dev] {
        memcpy(dst, src, bytes);
        if (from_dev && to_dev) prof_call("cudaMemcpyAsync DtoD", "copy", bytes, bytes);
        else prof_call(to_dev ? "cudaMemcpyAsync HtoD" : "cudaMemcpyAsync DtoH", "pcie", from_dev ? bytes : 0, to_dev ? bytes : 0);
    });
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
    touch();
    if (!mem_range_ok(p, bytes, MEM_DEVICE))
        return fail(cudaErrorInvalidValue, "cudaMemset: %zu bytes at %p are not inside one device allocation", bytes, p);
    enqueue_run(stream, [p, value, bytes] {
        memset(p, value, bytes);
        prof_call("cudaMemset", "copy", 0, bytes);
    });
    return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) { return cudaMemsetAsync(p, value, bytes, NULL); }

static void prof_synchronized(void);  // section 10: marks the file, and CUDAEMU_PROFILE_SKIP counts these

cudaError_t cudaDeviceSynchronize(void) {
    touch();
    device_sync();
    prof_synchronized();
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    touch();
    CUstream_st* s = S(stream);
    host_wait(stream_name(s).c_str(), [s] { return s->q.empty(); });
    check_guards("at a synchronization", NULL);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
    touch();
    if (!(flags & cudaStreamNonBlocking))  // llmpar's streams never synchronize with the default stream
        return fail(cudaErrorNotSupported, "streams that synchronize with the default stream are not emulated; use cudaStreamNonBlocking");
    std::lock_guard<std::mutex> lk(mu);
    *stream = new CUstream_st();
    (*stream)->id = next_stream_id++;
    streams.push_back(*stream);
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    touch();
    host_wait(stream_name(stream).c_str(), [stream] { return stream->q.empty(); });
    std::lock_guard<std::mutex> lk(mu);
    streams.erase(std::find(streams.begin(), streams.end(), stream));
    delete stream;
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* ev, unsigned int) {
    touch();
    std::lock_guard<std::mutex> lk(mu);
    *ev = new CUevent_st();
    (*ev)->id = next_event_id++;
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* ev) { return cudaEventCreateWithFlags(ev, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t ev) {
    touch();
    std::string what = "event " + std::to_string(ev->id) + " " + std::to_string(ev->recorded);
    host_wait(what.c_str(), [ev] { return ev->completed >= ev->recorded; });
    delete ev;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t stream) {
    touch();
    Op* op = new Op();
    op->kind = Op::RECORD;
    op->ev = ev;
    std::lock_guard<std::mutex> lk(mu);
    op->gen = ++ev->recorded;
    op->epoch = host_epoch;
    S(stream)->q.push_back(op);
    cv_work.notify_one();
    return cudaSuccess;
}
// The milliseconds between two events' latest records, as the stream worker reached them (the emulator runs a
// stream's work in order, so a record is reached once the work before it is done); waits for both.
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    cudaEventSynchronize(start);
    cudaEventSynchronize(end);
    std::lock_guard<std::mutex> lk(mu);
    if (!start->completed || !end->completed) return cudaErrorInvalidResourceHandle;
    *ms = (float)((end->reached_s - start->reached_s) * 1e3);
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t ev, unsigned int) {  // waits for the latest record
    touch();
    Op* op = new Op();
    op->kind = Op::WAIT;
    op->ev = ev;
    std::lock_guard<std::mutex> lk(mu);
    op->gen = ev->recorded;
    op->epoch = host_epoch;
    S(stream)->q.push_back(op);
    cv_work.notify_one();
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
    touch();
    uint64_t gen;
    {
        std::lock_guard<std::mutex> lk(mu);
        gen = ev->recorded;
    }
    std::string what = "event " + std::to_string(ev->id) + " " + std::to_string(gen);
    host_wait(what.c_str(), [ev, gen] { return ev->completed >= gen; });
    return cudaSuccess;
}

// Stream-ordered allocation: memory is handed out at once, and freed when the stream reaches the free.
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t) { return cudaMalloc(p, bytes); }
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
    touch();
    if (!is_device(p)) return fail(cudaErrorInvalidValue, "cudaFreeAsync(%p): not an address cudaMallocAsync returned", p);
    enqueue_run(stream, [p] { mem_free(p, MEM_DEVICE, "cudaFreeAsync"); });
    return cudaSuccess;
}
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int) {
    static int the_pool;
    *pool = (cudaMemPool_t)&the_pool;
    return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void*) { return cudaSuccess; }

}  // extern "C"

// ----------------------------------------------------------------------------------------------------
// 8. cuBLASLt: a reference GEMM (fp32 accumulation, bf16, fp16 or fp32 matrices) that checks the arguments
// against cuBLASLt's documented rules first and stops with the rule's name when one is broken

struct cublasLtContext {
    int alive;
};
namespace {
struct Desc {
    cublasComputeType_t compute;
    cudaDataType_t scale;
    int transa = 0, transb = 0;
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    const void* bias = NULL;
    cudaDataType_t bias_type = CUDA_R_16BF;
    bool bias_type_set = false;
    void* aux = NULL;
    int64_t aux_ld = 0;
};
struct Layout {
    cudaDataType type;
    uint64_t rows, cols;
    int64_t ld;
    int batch = 1;
    int64_t stride = 0;
};
struct Pref {
    size_t workspace = 0;
    uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D: what cuBLASLt assumes unless told
};
const uint64_t kAlgoMagic = 0x637564616d6d6c74ull;  // marks an algorithm this heuristic returned
}  // namespace

[[noreturn]] static void lt_rule(const char* call, const char* fmt, ...) {
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    emu_fatal("cuBLASLt %s: %s", call, msg);
}

static size_t type_bytes(cudaDataType t) { return t == CUDA_R_32F ? 4 : 2; }

// The rules cuBLASLt documents for the calls llmpar makes; a broken one stops with its name.
static void lt_check(const char* call, const Desc& d, const Layout& A, const Layout& B, const Layout& C, const Layout& D) {
    if (d.compute != CUBLAS_COMPUTE_32F || d.scale != CUDA_R_32F)
        lt_rule(call, "only CUBLAS_COMPUTE_32F with CUDA_R_32F scaling is emulated");
    const Layout* ls[4] = {&A, &B, &C, &D};
    const char* names = "ABCD";
    for (int i = 0; i < 4; i++) {
        if (ls[i]->type != CUDA_R_16BF && ls[i]->type != CUDA_R_16F && ls[i]->type != CUDA_R_32F)
            lt_rule(call, "matrix %c: only CUDA_R_16BF, CUDA_R_16F and CUDA_R_32F are emulated", names[i]);
        if (ls[i]->ld < (int64_t)std::max<uint64_t>(1, ls[i]->rows))
            lt_rule(call, "matrix %c: leading dimension %lld is less than its %llu rows (column-major)", names[i],
                    (long long)ls[i]->ld, (unsigned long long)ls[i]->rows);
        if (ls[i]->batch != D.batch)
            lt_rule(call, "matrix %c: CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT %d differs from D's %d", names[i], ls[i]->batch, D.batch);
    }
    if (A.type != B.type) lt_rule(call, "A and B must have the same type");
    uint64_t m = D.rows, n = D.cols, k = d.transa ? A.rows : A.cols;
    if ((d.transa ? A.cols : A.rows) != m) lt_rule(call, "op(A) has %llu rows but D has %llu", (unsigned long long)(d.transa ? A.cols : A.rows), (unsigned long long)m);
    if ((d.transb ? B.rows : B.cols) != n) lt_rule(call, "op(B) has %llu columns but D has %llu", (unsigned long long)(d.transb ? B.rows : B.cols), (unsigned long long)n);
    if ((d.transb ? B.cols : B.rows) != k) lt_rule(call, "op(A) is %llu wide but op(B) %llu tall", (unsigned long long)k, (unsigned long long)(d.transb ? B.cols : B.rows));
    if (C.rows != m || C.cols != n) lt_rule(call, "C must have D's shape");
    if (D.batch > 1 && D.stride < D.ld * (int64_t)n)
        lt_rule(call, "D's CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET %lld is smaller than one matrix (%lld): the batches overlap",
                (long long)D.stride, (long long)(D.ld * (int64_t)n));
    bool wants_bias = d.epilogue == CUBLASLT_EPILOGUE_BIAS || d.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    bool dgelu_bgrad = d.epilogue == CUBLASLT_EPILOGUE_DGELU_BGRAD;
    bool wants_aux = d.epilogue == CUBLASLT_EPILOGUE_GELU_AUX || d.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
                     d.epilogue == CUBLASLT_EPILOGUE_DGELU || dgelu_bgrad;
    bool bgradb = d.epilogue == CUBLASLT_EPILOGUE_BGRADB;
    if (d.epilogue != CUBLASLT_EPILOGUE_DEFAULT && !wants_bias && !wants_aux && !bgradb)
        lt_rule(call, "epilogue %d is not emulated (DEFAULT, BIAS, GELU_AUX, GELU_AUX_BIAS, DGELU, DGELU_BGRAD, BGRADB are)",
                (int)d.epilogue);
    if (wants_bias && !d.bias) lt_rule(call, "the BIAS epilogues need CUBLASLT_MATMUL_DESC_BIAS_POINTER");
    if (wants_bias && d.bias_type_set && d.bias_type != D.type && d.bias_type != CUDA_R_32F)
        lt_rule(call, "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE must be D's type or CUDA_R_32F");
    if (bgradb) {  // the bias gradient: op(B)'s column sums over k, one per column of D, in C's type
        if (!d.bias) lt_rule(call, "BGRADB needs CUBLASLT_MATMUL_DESC_BIAS_POINTER (where the bias gradient goes)");
        if (d.bias_type_set && d.bias_type != C.type) lt_rule(call, "BGRADB: the bias gradient's type must be C's");
        if (D.batch > 1) lt_rule(call, "BGRADB with batches is not emulated");
    }
    if (dgelu_bgrad) {  // the bias gradient: D's row sums after the GELU gradient, one per row of D, in C's type
        if (!d.bias) lt_rule(call, "DGELU_BGRAD needs CUBLASLT_MATMUL_DESC_BIAS_POINTER (where the bias gradient goes)");
        if (d.bias_type_set && d.bias_type != C.type) lt_rule(call, "DGELU_BGRAD: the bias gradient's type must be C's");
    }
    if (wants_aux) {
        if (!d.aux) lt_rule(call, "the GELU_AUX and DGELU epilogues need CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER");
        if (d.aux_ld % 8) lt_rule(call, "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD %lld must be divisible by 8", (long long)d.aux_ld);
        if (d.aux_ld < (int64_t)m) lt_rule(call, "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD %lld is less than D's %llu rows", (long long)d.aux_ld, (unsigned long long)m);
        if (D.batch > 1) lt_rule(call, "the GELU epilogues with batches need CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE (not emulated)");
    }
}

static float lt_load(const void* p, cudaDataType t, size_t i) {
    if (t == CUDA_R_32F) return ((const float*)p)[i];
    if (t == CUDA_R_16F) return __half2float(((const __half*)p)[i]);
    return __bfloat162float(((const __nv_bfloat16*)p)[i]);
}
static void lt_store(void* p, cudaDataType t, size_t i, float v) {  // rounded to nearest even, as cuBLASLt's epilogue stores
    if (t == CUDA_R_32F) ((float*)p)[i] = v;
    else if (t == CUDA_R_16F) ((__half*)p)[i] = __float2half_rn(v);
    else ((__nv_bfloat16*)p)[i] = __float2bfloat16_rn(v);
}

static float gelu_tanh(float x) {  // cuBLASLt's GELU epilogue is the tanh approximation
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
static float gelu_tanh_grad(float x) {  // and DGELU its derivative
    float th = tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
}

// Dot products of one row x of op(A) with J columns of op(B), each summed exactly as the reference
// defines it: 8 running sums over k (element kk into sum kk % 8), added in a fixed tree. J columns at once
// read x once for all of them; the 8 sums are two 4-lane vectors, so the order of every addition is
// unchanged (SSE2, no fused multiply-add).
typedef float lt_v4 __attribute__((vector_size(16)));
template <int J>
static void lt_dots(const float* x, const float* const* y, size_t k, float* out) {
    lt_v4 lo[J], hi[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; j++) lo[j] = hi[j] = lt_v4{0, 0, 0, 0};
    size_t k8 = k / 8 * 8;
    for (size_t kk = 0; kk < k8; kk += 8) {
        lt_v4 xl, xh, yl, yh;
        memcpy(&xl, x + kk, 16);
        memcpy(&xh, x + kk + 4, 16);
#pragma GCC unroll 4
        for (int j = 0; j < J; j++) {
            memcpy(&yl, y[j] + kk, 16);
            memcpy(&yh, y[j] + kk + 4, 16);
            lo[j] += xl * yl;
            hi[j] += xh * yh;
        }
    }
    for (int j = 0; j < J; j++) {
        float s[8];
        memcpy(s, &lo[j], 16);
        memcpy(s + 4, &hi[j], 16);
        for (size_t kk = k8; kk < k; kk++) s[kk - k8] += x[kk] * y[j][kk];
        out[j] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    }
}

static void lt_gemm(const Desc& d, const Layout& LA, const Layout& LB, const Layout& LC, const Layout& LD, float alpha, float beta,
                    const void* A, const void* B, const void* Cp, void* Dp) {
    size_t m = LD.rows, n = LD.cols, k = d.transa ? LA.rows : LA.cols;
    const size_t rows_per_task = 32;  // this many rows of op(A) stay in cache while every column passes
    // the epilogue (lt_check allowed it): + bias; GELU keeping its pre-activation in aux; or times GELU's
    // derivative at the pre-activation read from aux
    bool add_bias = d.epilogue == CUBLASLT_EPILOGUE_BIAS || d.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    bool gelu = d.epilogue == CUBLASLT_EPILOGUE_GELU_AUX || d.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    bool dgelu_bgrad = d.epilogue == CUBLASLT_EPILOGUE_DGELU_BGRAD, dgelu = d.epilogue == CUBLASLT_EPILOGUE_DGELU || dgelu_bgrad;
    static std::vector<float> a, b;
    if (d.epilogue == CUBLASLT_EPILOGUE_BGRADB)  // (one batch) the bias gradient: each column of op(B) summed over k, in order
        for (size_t j = 0; j < n; j++) {
            float s = 0.0f;
            for (size_t kk = 0; kk < k; kk++) s += lt_load(B, LB.type, d.transb ? j + kk * LB.ld : kk + j * LB.ld);
            lt_store((void*)d.bias, LC.type, j, s);  // (the bias gradient case: an output)
        }  // kept between calls (the device thread's alone): no fresh pages each GEMM
    a.resize(std::max(a.size(), m * k));
    b.resize(std::max(b.size(), n * k));
    for (int bt = 0; bt < LD.batch; bt++) {
        size_t oa = (size_t)bt * LA.stride, ob = (size_t)bt * LB.stride, oc = (size_t)bt * LC.stride, od = (size_t)bt * LD.stride;
        for (size_t i = 0; i < m; i++)  // rows of op(A), contiguous over k
            for (size_t kk = 0; kk < k; kk++)
                a[i * k + kk] = lt_load(A, LA.type, oa + (d.transa ? kk + i * LA.ld : i + kk * LA.ld));
        for (size_t j = 0; j < n; j++)  // columns of op(B), contiguous over k
            for (size_t kk = 0; kk < k; kk++)
                b[j * k + kk] = lt_load(B, LB.type, ob + (d.transb ? j + kk * LB.ld : kk + j * LB.ld));
        // each output element is written by one task (its rows), so the tasks' order does not matter; a
        // product under 2^22 multiply-adds (a millisecond) runs on this thread alone, since waking the team
        // costs more (on a loaded machine a time slice, while the idle threads spin)
#pragma omp parallel for schedule(dynamic, 1) if (m * n * k >= ((size_t)1 << 22))
        for (size_t i0 = 0; i0 < m; i0 += rows_per_task) {
            float row_sums[rows_per_task] = {0};  // DGELU_BGRAD's: each row of D over its columns in order, before rounding
            for (size_t j0 = 0; j0 < n; j0 += 4) {
                size_t jn = std::min<size_t>(4, n - j0);
                const float* y[4];
                for (size_t j = 0; j < jn; j++) y[j] = &b[(j0 + j) * k];
                for (size_t i = i0; i < std::min(m, i0 + rows_per_task); i++) {
                    float dot[4];
                    if (jn == 4) lt_dots<4>(&a[i * k], y, k, dot);
                    else
                        for (size_t j = 0; j < jn; j++) lt_dots<1>(&a[i * k], y + j, k, dot + j);
                    for (size_t j = j0; j < j0 + jn; j++) {
                        float v = alpha * dot[j - j0];
                        if (beta != 0.0f) v += beta * lt_load(Cp, LC.type, oc + i + j * LC.ld);
                        if (add_bias) v += lt_load(d.bias, d.bias_type_set ? d.bias_type : LD.type, i);
                        if (gelu) {  // GELU_AUX(_BIAS): the pre-activation is written
                            lt_store(d.aux, LD.type, i + j * d.aux_ld, v);
                            v = gelu_tanh(v);
                        } else if (dgelu) {  // DGELU(_BGRAD): it is read
                            v *= gelu_tanh_grad(lt_load(d.aux, LD.type, i + j * d.aux_ld));
                            row_sums[i - i0] += v;
                        }
                        lt_store(Dp, LD.type, od + i + j * LD.ld, v);
                    }
                }
            }
            if (dgelu_bgrad)  // (the bias gradient case: an output)
                for (size_t i = i0; i < std::min(m, i0 + rows_per_task); i++) lt_store((void*)d.bias, LC.type, i, row_sums[i - i0]);
        }
    }
}

static void prof_gemm(const Desc& d, const Layout& LA, const Layout& LB, const Layout& LC, const Layout& LD, float beta);  // section 10

template <typename T>
static T attr_value(const char* call, const void* buf, size_t size) {
    if (size != sizeof(T)) lt_rule(call, "the attribute's value has %zu bytes, its type %zu", size, sizeof(T));
    T v;
    memcpy(&v, buf, sizeof(T));
    return v;
}

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
    touch();
    *h = new cublasLtContext{1};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute, cudaDataType_t scale) {
    Desc* d = new Desc();
    d->compute = compute;
    d->scale = scale;
    *desc = (cublasLtMatmulDesc_t)d;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
    delete (Desc*)desc;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* buf, size_t size) {
    Desc* d = (Desc*)desc;
    const char* call = "cublasLtMatmulDescSetAttribute";
    switch (attr) {
        case CUBLASLT_MATMUL_DESC_TRANSA: d->transa = attr_value<cublasOperation_t>(call, buf, size) != CUBLAS_OP_N; break;
        case CUBLASLT_MATMUL_DESC_TRANSB: d->transb = attr_value<cublasOperation_t>(call, buf, size) != CUBLAS_OP_N; break;
        case CUBLASLT_MATMUL_DESC_EPILOGUE: d->epilogue = attr_value<cublasLtEpilogue_t>(call, buf, size); break;
        case CUBLASLT_MATMUL_DESC_BIAS_POINTER: d->bias = attr_value<const void*>(call, buf, size); break;
        case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
            d->bias_type = attr_value<cudaDataType_t>(call, buf, size);
            d->bias_type_set = true;
            break;
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: d->aux = attr_value<void*>(call, buf, size); break;
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: d->aux_ld = attr_value<int64_t>(call, buf, size); break;
        default: lt_rule(call, "matmul attribute %d is not emulated", (int)attr);
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld) {
    Layout* l = new Layout();
    l->type = type;
    l->rows = rows;
    l->cols = cols;
    l->ld = ld;
    *layout = (cublasLtMatrixLayout_t)l;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
    delete (Layout*)layout;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr, const void* buf, size_t size) {
    Layout* l = (Layout*)layout;
    const char* call = "cublasLtMatrixLayoutSetAttribute";
    if (attr == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT) l->batch = attr_value<int32_t>(call, buf, size);
    else if (attr == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET) l->stride = attr_value<int64_t>(call, buf, size);
    else lt_rule(call, "layout attribute %d is not emulated", (int)attr);
    if (l->batch < 1) lt_rule(call, "CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT must be at least 1");
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
    *pref = (cublasLtMatmulPreference_t) new Pref();
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
    delete (Pref*)pref;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t size) {
    Pref* p = (Pref*)pref;
    const char* call = "cublasLtMatmulPreferenceSetAttribute";
    switch (attr) {
        case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: p->workspace = attr_value<uint64_t>(call, buf, size); break;
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: p->align[0] = attr_value<uint32_t>(call, buf, size); break;
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: p->align[1] = attr_value<uint32_t>(call, buf, size); break;
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: p->align[2] = attr_value<uint32_t>(call, buf, size); break;
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: p->align[3] = attr_value<uint32_t>(call, buf, size); break;
        default: lt_rule(call, "preference attribute %d is not emulated", (int)attr);
    }
    return CUBLAS_STATUS_SUCCESS;
}

// Every legal problem has one algorithm; it remembers the alignments the caller promised.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t* out,
                                              int* returned) {
    touch();
    if (requested < 1) lt_rule("cublasLtMatmulAlgoGetHeuristic", "requestedAlgoCount must be at least 1");
    lt_check("cublasLtMatmulAlgoGetHeuristic", *(Desc*)desc, *(Layout*)a, *(Layout*)b, *(Layout*)c, *(Layout*)d);
    memset(out, 0, sizeof(*out));
    cublasLtEpilogue_t e = ((Desc*)desc)->epilogue;
    if (cfg.refuse_grads && (e == CUBLASLT_EPILOGUE_DGELU || e == CUBLASLT_EPILOGUE_DGELU_BGRAD || e == CUBLASLT_EPILOGUE_BGRADB)) {
        *returned = 0;  // what cuBLASLt answers when no algorithm fits
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    const Pref* p = (const Pref*)pref;
    out->algo.data[0] = kAlgoMagic;
    for (int i = 0; i < 4; i++) out->algo.data[1 + i] = p->align[i];
    out->workspaceSize = 0;
    out->state = CUBLAS_STATUS_SUCCESS;
    out->wavesCount = 1.0f;
    *returned = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void* alpha, const void* A, cublasLtMatrixLayout_t la,
                              const void* B, cublasLtMatrixLayout_t lb, const void* beta, const void* C, cublasLtMatrixLayout_t lc,
                              void* D, cublasLtMatrixLayout_t ld, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
    touch();
    const char* call = "cublasLtMatmul";
    if (!h || !h->alive) lt_rule(call, "the handle was not made by cublasLtCreate");
    Desc d = *(Desc*)desc;
    Layout LA = *(Layout*)la, LB = *(Layout*)lb, LC = *(Layout*)lc, LD = *(Layout*)ld;
    lt_check(call, d, LA, LB, LC, LD);
    if (!algo || algo->data[0] != kAlgoMagic) lt_rule(call, "the algorithm did not come from cublasLtMatmulAlgoGetHeuristic");
    // each matrix must be as aligned as the heuristic was told (batch strides included) and lie in device memory
    const void* ptrs[4] = {A, B, C, D};
    const Layout* ls[4] = {&LA, &LB, &LC, &LD};
    for (int i = 0; i < 4; i++) {
        uint64_t bits = (uint64_t)(uintptr_t)ptrs[i] | (LD.batch > 1 ? (uint64_t)ls[i]->stride * type_bytes(ls[i]->type) : 0);
        if (bits % algo->data[1 + i])
            lt_rule(call, "matrix %c at %p (batch stride %lld) is not %llu-byte aligned, as CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_%c_BYTES promised",
                    "ABCD"[i], ptrs[i], (long long)ls[i]->stride, (unsigned long long)algo->data[1 + i], "ABCD"[i]);
        size_t last = (size_t)(LD.batch - 1) * ls[i]->stride + (size_t)(ls[i]->cols - 1) * ls[i]->ld + ls[i]->rows;
        if (!mem_range_ok(ptrs[i], last * type_bytes(ls[i]->type), MEM_DEVICE))
            lt_rule(call, "matrix %c (%p, %llu x %llu, ld %lld, %d batches) does not lie inside one device allocation", "ABCD"[i], ptrs[i],
                    (unsigned long long)ls[i]->rows, (unsigned long long)ls[i]->cols, (long long)ls[i]->ld, LD.batch);
    }
    uint64_t bias_n = d.epilogue == CUBLASLT_EPILOGUE_BGRADB ? LD.cols : LD.rows;
    if (d.bias && !mem_range_ok(d.bias, bias_n * type_bytes(d.bias_type_set ? d.bias_type : LD.type), MEM_DEVICE))
        lt_rule(call, "the bias vector (%llu values) does not lie inside one device allocation", (unsigned long long)bias_n);
    if (d.aux && !mem_range_ok(d.aux, ((LD.cols - 1) * d.aux_ld + LD.rows) * type_bytes(LD.type), MEM_DEVICE))
        lt_rule(call, "the GELU pre-activation buffer (ld %lld) does not lie inside one device allocation", (long long)d.aux_ld);
    if (workspace_bytes && !mem_range_ok(workspace, workspace_bytes, MEM_DEVICE))
        lt_rule(call, "the workspace (%zu bytes) does not lie inside one device allocation", workspace_bytes);
    float a, b;  // host pointer mode: the scalars are read now
    memcpy(&a, alpha, 4);
    memcpy(&b, beta, 4);
    enqueue_run(stream, [=] {
        lt_gemm(d, LA, LB, LC, LD, a, b, A, B, C, D);
        prof_gemm(d, LA, LB, LC, LD, b);
    });
    return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"

// ----------------------------------------------------------------------------------------------------
// 9. NCCL over MPI: each rank is one emulated GPU; a call is queued on its stream like a kernel and, when
// the device thread reaches it, posts nonblocking MPI operations and finishes (reduces in rank order,
// copies out) when they complete. Reductions go through fp32 and round once, in the same order on every
// rank, so every rank gets the same bits.

#ifdef LLMPAR_MPI
static MPI_Comm emu_world = MPI_COMM_NULL;  // the emulator's own copy of MPI_COMM_WORLD

int cudaemu_mpi_init(int* argc, char*** argv) {
    int provided = 0;
    int err = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    if (err != MPI_SUCCESS) return err;
    if (provided < MPI_THREAD_MULTIPLE) emu_fatal("this MPI does not offer MPI_THREAD_MULTIPLE, which the emulated NCCL needs");
    MPI_Comm_dup(MPI_COMM_WORLD, &emu_world);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_for_bus_id);
    return MPI_SUCCESS;
}
int cudaemu_mpi_finalize(void) {
    if (device_up) device_sync();
    MPI_Comm_free(&emu_world);
    return MPI_Finalize();
}
#endif

#ifdef LLMPAR_NCCL
struct ncclComm {
    MPI_Comm comm;
    int rank, size;
    uint64_t issued, started;  // calls queued and calls posted: they post in the order they were made
    bool aborted;              // by ncclCommAbort: every later call on it is refused
};

namespace {
enum { C_ALLREDUCE, C_REDUCESCATTER, C_ALLGATHER, C_BROADCAST, C_REDUCE, C_SEND, C_RECV };
struct Call {
    int kind;
    const void* send;
    void* recv;
    size_t count;  // elements: per rank for reduce-scatter and all-gather
    ncclDataType_t type;
    ncclRedOp_t op;
    int root;  // or the peer
    std::vector<char> tmp;
};
}  // namespace
struct CommOp {
    ncclComm_t comm;
    uint64_t seq;
    std::vector<Call> calls;  // one, or a group's
    std::vector<MPI_Request> reqs;
};

static size_t nccl_bytes(ncclDataType_t t) {
    switch (t) {
        case ncclInt8: case ncclUint8: return 1;
        case ncclFloat16: case ncclBfloat16: return 2;
        case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
        default: return 8;
    }
}
static float nccl_load(const char* p, ncclDataType_t t, size_t i) {
    if (t == ncclFloat32) return ((const float*)p)[i];
    if (t == ncclFloat16) return __half2float(((const __half*)p)[i]);
    return __bfloat162float(((const __nv_bfloat16*)p)[i]);
}

// out[i] = op over ranks (in rank order) of blocks[r][i]
static void nccl_reduce(void* out, const char* blocks, size_t count, const Call& c, int ranks) {
    size_t eb = nccl_bytes(c.type), stride = count * eb;
    for (size_t i = 0; i < count; i++) {
        float acc = nccl_load(blocks, c.type, i);
        for (int r = 1; r < ranks; r++) acc += nccl_load(blocks + r * stride, c.type, i);
        if (c.op == ncclAvg) acc /= ranks;
        if (c.type == ncclFloat32) ((float*)out)[i] = acc;
        else if (c.type == ncclFloat16) ((__half*)out)[i] = __float2half_rn(acc);  // (an fp16 sum past 65504 is inf, as NCCL's)
        else ((__nv_bfloat16*)out)[i] = __float2bfloat16_rn(acc);
    }
}

static bool comm_ready(CommOp* c) { return c->comm->started == c->seq; }

static void comm_start(CommOp* c) {
    c->comm->started++;
    MPI_Comm mc = c->comm->comm;
    int n = c->comm->size, me = c->comm->rank;
    for (Call& k : c->calls) {
        size_t bytes = k.count * nccl_bytes(k.type);
        if (bytes > (size_t)INT32_MAX) emu_fatal("NCCL call of %zu bytes: the emulator's MPI messages stop at 2 GiB", bytes);
        int b = (int)bytes;
        c->reqs.emplace_back();
        MPI_Request* r = &c->reqs.back();
        switch (k.kind) {
            case C_ALLREDUCE:
            case C_ALLGATHER:
                k.tmp.resize(bytes * n);
                MPI_Iallgather(k.send, b, MPI_BYTE, k.tmp.data(), b, MPI_BYTE, mc, r);
                break;
            case C_REDUCESCATTER:
                k.tmp.resize(bytes * n);
                MPI_Ialltoall(k.send, b, MPI_BYTE, k.tmp.data(), b, MPI_BYTE, mc, r);
                break;
            case C_BROADCAST:
                k.tmp.resize(bytes);
                if (me == k.root) memcpy(k.tmp.data(), k.send, bytes);
                MPI_Ibcast(k.tmp.data(), b, MPI_BYTE, k.root, mc, r);
                break;
            case C_REDUCE:
                k.tmp.resize(me == k.root ? bytes * n : 0);
                MPI_Igather(k.send, b, MPI_BYTE, k.tmp.data(), b, MPI_BYTE, k.root, mc, r);
                break;
            case C_SEND:
                k.tmp.assign((const char*)k.send, (const char*)k.send + bytes);
                MPI_Isend(k.tmp.data(), b, MPI_BYTE, k.root, 0, mc, r);
                break;
            case C_RECV:
                MPI_Irecv(k.recv, b, MPI_BYTE, k.root, 0, mc, r);
                break;
        }
    }
}

static bool comm_poll(CommOp* c) {
    int done = 0;
    MPI_Testall((int)c->reqs.size(), c->reqs.data(), &done, MPI_STATUSES_IGNORE);
    if (!done) return false;
    int n = c->comm->size, me = c->comm->rank;
    for (Call& k : c->calls) {
        size_t bytes = k.count * nccl_bytes(k.type);
        if (k.kind == C_ALLREDUCE) nccl_reduce(k.recv, k.tmp.data(), k.count, k, n);
        else if (k.kind == C_REDUCESCATTER) nccl_reduce(k.recv, k.tmp.data(), k.count, k, n);
        else if (k.kind == C_ALLGATHER) memcpy(k.recv, k.tmp.data(), bytes * n);
        else if (k.kind == C_BROADCAST) memcpy(k.recv, k.tmp.data(), bytes);
        else if (k.kind == C_REDUCE && me == k.root) nccl_reduce(k.recv, k.tmp.data(), k.count, k, n);
    }
    delete c;
    return true;
}

// Calls between ncclGroupStart and ncclGroupEnd are posted together, one queued operation per stream.
static int group_depth;
static std::vector<std::pair<cudaStream_t, CommOp*>> group_ops;

static ncclResult_t nccl_call(const char* name, Call k, ncclComm_t comm, cudaStream_t stream, size_t send_bytes, size_t recv_bytes) {
    touch();
    if (!comm) emu_fatal("%s: the communicator is NULL", name);
    if (k.kind == C_ALLREDUCE || k.kind == C_REDUCESCATTER || k.kind == C_REDUCE) {
        if (k.type != ncclBfloat16 && k.type != ncclFloat16 && k.type != ncclFloat32)
            emu_fatal("%s: reductions are emulated for ncclBfloat16, ncclFloat16 and ncclFloat32", name);
        if (k.op != ncclSum && k.op != ncclAvg) emu_fatal("%s: only ncclSum and ncclAvg are emulated", name);
    }
    if (send_bytes && !mem_range_ok(k.send, send_bytes, MEM_DEVICE))
        emu_fatal("%s: the send buffer %p (%zu bytes) is not inside one device allocation", name, k.send, send_bytes);
    if (recv_bytes && !mem_range_ok(k.recv, recv_bytes, MEM_DEVICE))
        emu_fatal("%s: the receive buffer %p (%zu bytes) is not inside one device allocation", name, k.recv, recv_bytes);
    std::lock_guard<std::mutex> lk(mu);
    if (comm->aborted) return ncclInvalidUsage;  // (under the lock: an abort from another thread is seen whole)
    stream = S(stream);
    for (auto& g : group_ops)
        if (group_depth && g.first == stream && g.second->comm == comm) {
            g.second->calls.push_back(k);
            return ncclSuccess;
        }
    CommOp* c = new CommOp{comm, comm->issued++, {k}, {}};
    if (group_depth) {
        group_ops.push_back({stream, c});
        return ncclSuccess;
    }
    Op* op = new Op();
    op->kind = Op::COMM;
    op->comm = c;
    op->epoch = host_epoch;
    stream->q.push_back(op);
    cv_work.notify_one();
    return ncclSuccess;
}

extern "C" {

const char* ncclGetErrorString(ncclResult_t r) {
    return r == ncclSuccess ? "no error" : r == ncclInvalidUsage ? "invalid usage (cudaemu: a communicator used after ncclCommAbort)"
                                                                  : "NCCL error (cudaemu)";
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    static int serial;
    memset(id, 0, sizeof(*id));
    int me = 0;
    MPI_Comm_rank(emu_world, &me);
    int fields[2] = {me, ++serial};
    memcpy(id->internal, "cudaemu", 8);
    memcpy(id->internal + 8, fields, sizeof(fields));
    return ncclSuccess;
}

// The members tell the id's creator their world ranks; it sends the list back, and they make an MPI
// communicator of exactly those ranks (so only the members take part, as with NCCL). The creator must
// be a member, as it is in llmpar.
ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
    touch();
    if (memcmp(id.internal, "cudaemu", 8) != 0) emu_fatal("ncclCommInitRank: the id did not come from ncclGetUniqueId");
    if (emu_world == MPI_COMM_NULL) emu_fatal("ncclCommInitRank before MPI_Init");
    int fields[2], me;
    memcpy(fields, id.internal + 8, sizeof(fields));
    MPI_Comm_rank(emu_world, &me);
    int creator = fields[0], tag = 1 + fields[1] % 30000;
    std::vector<int> members(nranks, -1);
    if (me == creator) {
        members[rank] = me;
        for (int i = 1; i < nranks; i++) {
            int msg[2];
            MPI_Recv(msg, 2, MPI_INT, MPI_ANY_SOURCE, tag, emu_world, MPI_STATUS_IGNORE);
            if (msg[1] < 0 || msg[1] >= nranks || members[msg[1]] >= 0) emu_fatal("ncclCommInitRank: two ranks claim rank %d", msg[1]);
            members[msg[1]] = msg[0];
        }
        for (int r = 0; r < nranks; r++)
            if (r != rank) MPI_Send(members.data(), nranks, MPI_INT, members[r], tag, emu_world);
    } else {
        int msg[2] = {me, rank};
        MPI_Send(msg, 2, MPI_INT, creator, tag, emu_world);
        MPI_Recv(members.data(), nranks, MPI_INT, creator, tag, emu_world, MPI_STATUS_IGNORE);
    }
    MPI_Group world_group, group;
    MPI_Comm_group(emu_world, &world_group);
    MPI_Group_incl(world_group, nranks, members.data(), &group);
    ncclComm* c = new ncclComm{MPI_COMM_NULL, rank, nranks, 0, 0};
    MPI_Comm_create_group(emu_world, group, tag, &c->comm);
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    *out = c;
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    touch();
    if (comm->aborted) return ncclInvalidUsage;
    host_wait("device", [comm] { return comm->started == comm->issued; });
    device_sync();
    MPI_Comm_free(&comm->comm);
    delete comm;
    return ncclSuccess;
}

// Local, from any thread, never waiting for other ranks: the communicator's calls still queued or in flight
// (a collective whose peer has stopped) leave their streams, which go on, and it refuses every later call.
// MPI cannot cancel a collective's requests, so the dropped calls keep their buffers for MPI to the end
// (as after NCCL's abort, the process is expected to end), and the MPI communicator is not freed, which
// would need the other ranks.
ncclResult_t ncclCommAbort(ncclComm_t comm) {
    touch();
    std::lock_guard<std::mutex> lk(mu);
    if (comm->aborted) return ncclInvalidUsage;
    comm->aborted = true;
    for (cudaStream_t s : streams)
        for (auto it = s->q.begin(); it != s->q.end();) {
            if ((*it)->kind != Op::COMM || (*it)->comm->comm != comm) {
                ++it;
                continue;
            }
            if (it == s->q.begin()) s->started = false;  // (a kernel running at the head is never a call)
            delete *it;                                   // (its CommOp stays, MPI may still write its buffers)
            it = s->q.erase(it);
        }
    for (auto it = group_ops.begin(); it != group_ops.end();)
        it = it->second->comm == comm ? group_ops.erase(it) : it + 1;
    cv_work.notify_one();
    cv_done.notify_all();
    return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
    std::lock_guard<std::mutex> lk(mu);
    group_depth++;
    return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
    std::lock_guard<std::mutex> lk(mu);
    if (--group_depth > 0) return ncclSuccess;
    for (auto& g : group_ops) {
        Op* op = new Op();
        op->kind = Op::COMM;
        op->comm = g.second;
        op->epoch = host_epoch;
        g.first->q.push_back(op);
    }
    group_ops.clear();
    cv_work.notify_one();
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
    size_t b = count * nccl_bytes(t);
    return nccl_call("ncclAllReduce", Call{C_ALLREDUCE, send, recv, count, t, op, 0, {}}, comm, s, b, b);
}
ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
    size_t b = count * nccl_bytes(t);
    return nccl_call("ncclReduceScatter", Call{C_REDUCESCATTER, send, recv, count, t, op, 0, {}}, comm, s, b * (comm ? comm->size : 1), b);
}
ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t t, ncclComm_t comm, cudaStream_t s) {
    size_t b = count * nccl_bytes(t);
    return nccl_call("ncclAllGather", Call{C_ALLGATHER, send, recv, count, t, ncclSum, 0, {}}, comm, s, b, b * (comm ? comm->size : 1));
}
ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm, cudaStream_t s) {
    size_t b = count * nccl_bytes(t);
    return nccl_call("ncclBroadcast", Call{C_BROADCAST, send, recv, count, t, ncclSum, root, {}}, comm, s, comm && comm->rank == root ? b : 0, b);
}
ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t s) {
    size_t b = count * nccl_bytes(t);
    return nccl_call("ncclReduce", Call{C_REDUCE, send, recv, count, t, op, root, {}}, comm, s, b, comm && comm->rank == root ? b : 0);
}
ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s) {
    size_t b = count * nccl_bytes(t);
    return nccl_call("ncclSend", Call{C_SEND, send, NULL, count, t, ncclSum, peer, {}}, comm, s, b, 0);
}
ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s) {
    size_t b = count * nccl_bytes(t);
    return nccl_call("ncclRecv", Call{C_RECV, NULL, recv, count, t, ncclSum, peer, {}}, comm, s, 0, b);
}

}  // extern "C"
#else
static bool comm_ready(CommOp*) { return true; }
static void comm_start(CommOp*) {}
static bool comm_poll(CommOp*) { return true; }
#endif

// ----------------------------------------------------------------------------------------------------
// 10. counting bytes and FLOPs. A build whose kernels are compiled with GCC's -fsanitize=thread calls a
// __tsan_* function before each load and store; they are defined here (no libtsan is linked) and count,
// while a launch is counted, the accesses of kernel threads to device memory:
//   - per warp request: the lanes of a warp that run the same access site (the instruction, named by its
//     return address) for the same time (the lane's n-th run of it) form one request, as a GPU issues
//     it; its distinct 32-byte sectors are counted. Uncoalesced access shows as more sectors;
//   - per launch: its distinct sectors, read and written (a lower bound on its DRAM traffic).
// cuBLASLt matmuls count each matrix once (their minimum traffic) and 2 m n k FLOPs per batch; copies and
// memsets their bytes. With CUDAEMU_PROFILE=FILE each launch is a line of FILE, and each
// cudaDeviceSynchronize a line starting with '#'.

namespace {
struct ProfRange {  // a device allocation, and where its sectors' bits start (a multiple of 64)
    uintptr_t base, end;
    size_t bit0;
    bool touched;  // it has bits set in this launch
};
struct ProfChunk {  // the ranges that overlap a 64 KiB chunk of the address space: a lookup table
    uint64_t chunk;    // address / 64 KiB; 0: a free slot (no allocation lies in the first 64 KiB)
    int32_t range[2];  // -1: none; range[1] -2: more than two (then the ranges are searched)
};
struct ProfReq {  // a sector of a warp request: warp and access site, the lane's n-th run of that site
    uint64_t site_warp, sector;
    uint32_t nth, gen;  // gen: the block it belongs to; entries of older blocks are free
    uint32_t most, words;  // a shared request's entry: the most distinct words on one bank, and on all; a bank's: its words
};
struct ProfTable {  // one warp's open requests (open addressing, a power of 2 long); entries of an older gen are free
    std::vector<ProfReq> e;
    size_t live = 0;
    uint32_t gen = 1;
};
struct ProfLane {  // a thread's access sites, in the order first run, with how often each ran
    std::vector<std::pair<uintptr_t, uint32_t>> sites;
    size_t last;  // the one run last: a loop runs its sites in order, so the next is usually last + 1
};
struct Prof {
    std::atomic<bool> on{false};
    FILE* out = NULL;
    int syncs = 0;
    std::mutex mu;  // the file and the sums: the device thread writes them, the host reads them
    std::map<std::string, cudaemu_counts> sums;
    // the launch being counted (device thread only)
    uint64_t version = ~0ull;  // mem_version the ranges were taken at
    std::vector<ProfRange> ranges;
    std::vector<ProfChunk> chunks;  // open addressing, a power of 2 long
    size_t hit = 0;
    std::vector<uint64_t> bits[2];  // a bit per sector of the ranges: read, written
    double req[2], uniq[2];         // sectors: per warp request, distinct
    double greq[2], sreq[2];        // warp requests (instructions): global, shared
    double waves[2], ideal;         // shared-memory wavefronts: loads, stores; and conflict-free, both
    std::vector<ProfTable> tables;  // per warp of the block
    std::vector<ProfLane> lanes;    // per thread of the block
};
}  // namespace
static Prof& prof = *new Prof();  // lives past exit(), like the device thread
// Per kernel (by name, over its launches) and site (a return address in the kernel's code): the warp
// instructions of each class it issued, and its bytes per lane (loads and stores). Written at exit as lines
// "site KERNEL CLASS LINES INSTRUCTIONS BYTES", LINES the site's source line and the lines it was inlined
// at, innermost first ("llmpar.h:2760<llmpar.h:2800<..."), for dev/cudaemu/sass.py to weigh nvcc's machine
// code for the same lines by how often they ran.
struct ProfSite {
    double n;
    unsigned width;
};
typedef std::map<std::pair<uintptr_t, int>, ProfSite> ProfSites;
static std::map<std::string, ProfSites>& prof_sites = *new std::map<std::string, ProfSites>();
static ProfSites* prof_kernel_sites;  // the running launch's (device thread only)

static void prof_site_inst(uintptr_t site, int cls, unsigned width, double n) {
    ProfSite& c = (*prof_kernel_sites)[{site, cls}];
    c.n += n;
    c.width = std::max(c.width, width);
}

static const char* const site_class[S_CLASSES] = {"gld", "gst", "lds", "sts", "shfl", "vote", "warpsync", "bar", "mma", "sfu"};

// Every site's lines (above), by one addr2line call per 256 sites (code_line's popen each would take
// minutes): the frames of the program's own code, not those of a system header (CUDA's bf16 type) or of
// cudaemu.h's wrappers (expf, shuffles), which are where nvcc's machine code for them is too. The file's
// name only.
static std::map<uintptr_t, std::string> site_lines(void) {
    std::vector<uintptr_t> pcs;
    for (auto& k : prof_sites)
        for (auto& kv : k.second) pcs.push_back(kv.first.first);
    std::sort(pcs.begin(), pcs.end());
    pcs.erase(std::unique(pcs.begin(), pcs.end()), pcs.end());
    std::map<uintptr_t, std::string> out;
    Dl_info info;
    if (pcs.empty() || !dladdr((void*)pcs[0], &info) || !info.dli_fname) return out;
    for (size_t i = 0; i < pcs.size(); i += 256) {
        std::string cmd = "addr2line -a -i -e '" + std::string(info.dli_fname) + "'";
        size_t n = std::min(pcs.size() - i, (size_t)256);
        for (size_t j = 0; j < n; j++) {
            char a[24];
            snprintf(a, sizeof(a), " 0x%lx", (unsigned long)(pcs[i + j] - 1 - (uintptr_t)info.dli_fbase));
            cmd += a;
        }
        FILE* p = popen((cmd + " 2>/dev/null").c_str(), "r");
        char line[600];
        long j = -1;  // the site whose frames follow
        while (p && fgets(line, sizeof(line), p)) {
            line[strcspn(line, "\n ")] = 0;  // "0xADDRESS" starts a site, then "path:line (discriminator n)" per frame
            if (strncmp(line, "0x", 2) == 0) {
                j++;
                continue;
            }
            const char* slash = strrchr(line, '/');
            const char* name = slash ? slash + 1 : line;
            if (j < 0 || (size_t)j >= n || strncmp(line, "/usr/", 5) == 0 || strncmp(name, "cudaemu.h:", 10) == 0) continue;
            std::string& at = out[pcs[i + j]];
            at += (at.empty() ? "" : "<") + std::string(name);
        }
        if (p) pclose(p);
    }
    return out;
}

static void prof_sites_write(void) {
    std::lock_guard<std::mutex> lk(prof.mu);
    if (!prof.out) return;
    std::map<uintptr_t, std::string> lines = site_lines();
    for (auto& k : prof_sites)
        for (auto& kv : k.second)
            fprintf(prof.out, "site\t%s\t%s\t%s\t%.0f\t%u\n", k.first.c_str(), site_class[kv.first.second],
                    lines[kv.first.first].c_str(), kv.second.n, kv.second.width);
    fflush(prof.out);
}

double cudaemu_profile_site(const char* name, const char* cls, const char* where, unsigned* width) {
    touch();
    device_sync();
    std::lock_guard<std::mutex> lk(prof.mu);
    std::map<uintptr_t, std::string> lines = site_lines();
    double n = 0;
    for (auto& kv : prof_sites[name])
        if (strcmp(site_class[kv.first.second], cls) == 0 && lines[kv.first.first].substr(0, lines[kv.first.first].find('<')) == where) {
            n += kv.second.n;
            if (width) *width = kv.second.width;
        }
    return n;
}

static thread_local int prof_stream = -1;   // the stream the device thread runs (-1: a call on the host)
static thread_local uint64_t prof_epoch;    // and the host epoch it was queued in

static void prof_open(void) {
    if (!cfg.profile) return;
    if (!prof_instrumented)
        emu_fatal("CUDAEMU_PROFILE is set, but this binary's kernels were not compiled for counting (make train_gpt_emu_prof)");
    prof.out = fopen(cfg.profile, "w");
    if (!prof.out) emu_fatal("CUDAEMU_PROFILE: cannot write %s", cfg.profile);
    fprintf(prof.out, "# cudaemu counts: kind, name, bytes read and written (sectors of warp requests), distinct bytes read "
                      "and written, FLOPs, stream, host epoch; kernels also: blocks, threads per block, dynamic shared bytes, "
                      "warp instructions (global loads, stores, shared loads, stores), shared wavefronts (loads, stores, "
                      "conflict-free), shuffles, barriers, mma, special functions\n");
    prof.on = cfg.profile_skip <= 0;
    atexit(prof_sites_write);
}

void cudaemu_profile(int on) {
    touch();
    if (on && !prof_instrumented) emu_fatal("cudaemu_profile: this binary's kernels were not compiled for counting (-fsanitize=thread)");
    device_sync();
    prof.on = on;
}

cudaemu_counts cudaemu_profile_counts(const char* name) {
    touch();
    device_sync();
    std::lock_guard<std::mutex> lk(prof.mu);
    auto it = prof.sums.find(name);
    return it == prof.sums.end() ? cudaemu_counts{} : it->second;
}

// What a kernel launch adds to a line: its shape and its warp instructions (prof_launch_end).
struct ProfKernel {
    unsigned blocks, threads;
    size_t shmem;
    double gld, gst, lds, sts, wave_ld, wave_st, ideal, shfl, sync, tensor, sfu;
};

static void prof_record(const char* kind, const std::string& name, double read, double written, double uread, double uwritten,
                        double flops, const ProfKernel* k = nullptr) {
    std::lock_guard<std::mutex> lk(prof.mu);
    cudaemu_counts& c = prof.sums[name];
    c.launches++;
    c.read_bytes += read;
    c.write_bytes += written;
    c.unique_read_bytes += uread;
    c.unique_write_bytes += uwritten;
    c.flops += flops;
    if (k) {
        c.global_loads += k->gld, c.global_stores += k->gst, c.shared_loads += k->lds, c.shared_stores += k->sts;
        c.shared_load_wavefronts += k->wave_ld, c.shared_store_wavefronts += k->wave_st, c.shared_ideal_wavefronts += k->ideal;
        c.shuffles += k->shfl, c.syncs += k->sync, c.tensor += k->tensor, c.sfu += k->sfu;
    }
    if (prof.out) {
        fprintf(prof.out, "%s\t%s\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%d\t%llu", kind, name.c_str(), read, written, uread, uwritten,
                flops, prof_stream, (unsigned long long)prof_epoch);
        if (k)
            fprintf(prof.out, "\t%u\t%u\t%zu\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f", k->blocks,
                    k->threads, k->shmem, k->gld, k->gst, k->lds, k->sts, k->wave_ld, k->wave_st, k->ideal, k->shfl, k->sync,
                    k->tensor, k->sfu);
        fputc('\n', prof.out);
        fflush(prof.out);
    }
}

// The order of work between streams, for replaying a step with modelled durations (roofline.py): every
// line above carries its stream and the host epoch it was queued in (the number of host waits before
// it); an event's record and a stream's wait for it, when the device thread reaches them, are lines
// "# record EVENT GEN STREAM EPOCH" and "# wait STREAM EVENT GEN EPOCH" (GEN: which record of the event;
// a wait for 0 waits for nothing); a host wait, when it returns, "# host EPOCH what" (what it waited
// for: "device", "stream S" or "event E GEN": work of it on lines above). Called with mu held.
static void prof_line(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void prof_line(const char* fmt, ...) {
    std::lock_guard<std::mutex> lk(prof.mu);
    if (!prof.on || !prof.out) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(prof.out, fmt, ap);
    va_end(ap);
    fflush(prof.out);
}
static void prof_running(cudaStream_t s, const Op* h) {
    prof_stream = s->id;
    prof_epoch = h->epoch;
}
static void prof_event(const char* what, cudaStream_t s, const Op* h) {
    if (what[0] == 'r') prof_line("# record %d %llu %d %llu\n", h->ev->id, (unsigned long long)h->gen, s->id, (unsigned long long)h->epoch);
    else prof_line("# wait %d %d %llu %llu\n", s->id, h->ev->id, (unsigned long long)h->gen, (unsigned long long)h->epoch);
}
static void prof_host(uint64_t epoch, const char* what) { prof_line("# host %llu %s\n", (unsigned long long)epoch, what); }

// An NCCL call (or a group's calls on one stream) as a line of kind "nccl": the bytes this rank sends
// and receives over its links if NCCL runs a ring (all-reduce 2(n-1)/n of the buffer each way,
// reduce-scatter and all-gather (n-1)/n of the whole, broadcast and reduce the buffer, send and receive
// theirs); named by its calls and the ranks.
static void prof_comm(cudaStream_t s, const Op* h) {
#ifdef LLMPAR_NCCL
    if (!prof.on) return;
    static const char* names[] = {"ncclAllReduce", "ncclReduceScatter", "ncclAllGather", "ncclBroadcast", "ncclReduce", "ncclSend", "ncclRecv"};
    double n = h->comm->comm->size, out = 0, in = 0;
    std::string name;
    for (const Call& k : h->comm->calls) {
        double b = (double)k.count * nccl_bytes(k.type);
        if (k.kind == C_ALLREDUCE) out += 2 * (n - 1) / n * b, in += 2 * (n - 1) / n * b;
        else if (k.kind == C_REDUCESCATTER || k.kind == C_ALLGATHER) out += (n - 1) * b, in += (n - 1) * b;
        else if (k.kind == C_SEND) out += b;
        else if (k.kind == C_RECV) in += b;
        else out += b, in += b;
        name += (name.empty() ? "" : "+") + std::string(names[k.kind]);
    }
    name += " of " + std::to_string((int)n) + " ranks";
    prof_stream = s->id;
    prof_epoch = h->epoch;
    prof_record("nccl", name, out, in, out, in, 0);
#else
    (void)s, (void)h;  // no NCCL, no calls
#endif
}

static void prof_synchronized(void) {
    std::lock_guard<std::mutex> lk(prof.mu);
    prof.syncs++;
    if (cfg.profile && prof.syncs == cfg.profile_skip) prof.on = true;
    if (prof.out) {
        fprintf(prof.out, "# cudaDeviceSynchronize %d\n", prof.syncs);
        fflush(prof.out);
    }
}

static void prof_call(const char* name, const char* kind, size_t read, size_t written) {
    if (prof.on) prof_record(kind, name, read, written, read, written, 0);
}

static void prof_gemm(const Desc& d, const Layout& LA, const Layout& LB, const Layout& LC, const Layout& LD, float beta) {
    if (!prof.on) return;
    double m = LD.rows, n = LD.cols, k = d.transa ? LA.rows : LA.cols, batch = LD.batch;
    double read = batch * (LA.rows * LA.cols * type_bytes(LA.type) + LB.rows * LB.cols * type_bytes(LB.type));
    if (beta != 0.0f) read += batch * LC.rows * LC.cols * type_bytes(LC.type);
    bool dgelu_bgrad = d.epilogue == CUBLASLT_EPILOGUE_DGELU_BGRAD, dgelu = d.epilogue == CUBLASLT_EPILOGUE_DGELU || dgelu_bgrad;
    bool bgradb = d.epilogue == CUBLASLT_EPILOGUE_BGRADB;
    if (d.bias && !bgradb && !dgelu_bgrad) read += m * type_bytes(d.bias_type_set ? d.bias_type : LD.type);
    if (d.aux && dgelu) read += m * n * type_bytes(LD.type);  // DGELU reads the pre-activation, GELU_AUX writes it
    double written = batch * m * n * type_bytes(LD.type) + (d.aux && !dgelu ? m * n * type_bytes(LD.type) : 0);
    if (bgradb) written += n * type_bytes(LC.type);  // the bias gradient (B itself is read once for both)
    if (dgelu_bgrad) written += m * type_bytes(LC.type);  // the bias gradient, from D as it is made
    char name[160];
    snprintf(name, sizeof(name), "cublasLt %c%c %.0fx%.0fx%.0f%s%s%s", d.transa ? 'T' : 'N', d.transb ? 'T' : 'N', m, n, k,
             beta != 0.0f ? " +C" : "", d.bias ? (bgradb ? " +bgradb" : dgelu_bgrad ? " +bgrad" : " +bias") : "", d.aux ? (dgelu ? " +dgelu" : " +gelu") : "");
    if (batch > 1) snprintf(name + strlen(name), sizeof(name) - strlen(name), " x%.0f", batch);
    prof_record("gemm", name, read, written, read, written, 2 * m * n * k * batch);
}

// The slot of a chunk in the table: its own, or the free one where it would go.
static ProfChunk* prof_chunk(uint64_t c) {
    size_t mask = prof.chunks.size() - 1;
    size_t i = (size_t)((c * 0x9E3779B97F4A7C15ull) >> 20) & mask;
    while (prof.chunks[i].chunk != c && prof.chunks[i].chunk != 0) i = (i + 1) & mask;
    return &prof.chunks[i];
}

static void prof_launch_begin(const Launch& L) {
    if (L.hazards && !prof_instrumented)
        emu_fatal("CUDAEMU_HAZARDS is set, but this binary's kernels were not compiled for counting (make train_gpt_emu_prof)");
    haz_in_kernel = L.hazards;
    if (!prof.on) return;
    std::lock_guard<std::mutex> lk(mem_mu);
    if (prof.version != mem_version) {  // allocations changed: take the map again (none change while a kernel runs)
        prof.ranges.clear();
        size_t bits = 0;
        for (auto& kv : allocs) {
            if (kv.second.kind != MEM_DEVICE) continue;
            prof.ranges.push_back(ProfRange{kv.first, kv.first + kv.second.size, bits, false});
            bits += (kv.second.size + 32 * 64 - 1) / (32 * 64) * 64;
        }
        for (int w = 0; w < 2; w++) prof.bits[w].assign(bits / 64, 0);
        size_t nchunks = 0;
        for (const ProfRange& r : prof.ranges) nchunks += ((r.end - 1) >> 16) - (r.base >> 16) + 1;
        size_t slots = 16;
        while (slots < 2 * nchunks) slots *= 2;
        prof.chunks.assign(slots, ProfChunk{0, {-1, -1}});
        for (size_t i = 0; i < prof.ranges.size(); i++)
            for (uint64_t c = prof.ranges[i].base >> 16; c <= (prof.ranges[i].end - 1) >> 16; c++) {
                ProfChunk* e = prof_chunk(c);
                e->chunk = c;
                if (e->range[0] < 0) e->range[0] = (int32_t)i;
                else e->range[1] = e->range[1] == -1 ? (int32_t)i : -2;
            }
        prof.version = mem_version;
        prof.hit = 0;
    }
    for (int w = 0; w < 2; w++) prof.req[w] = prof.uniq[w] = prof.greq[w] = prof.sreq[w] = prof.waves[w] = 0;
    prof.ideal = 0;
    prof_kernel_flops = 0;
    for (double& c : prof_inst) c = 0;
    prof_kernel_sites = &prof_sites[L.name];
    prof.lanes.resize(L.block.x * L.block.y * L.block.z);
    prof.tables.resize((prof.lanes.size() + 31) / 32);
    for (ProfTable& t : prof.tables)
        if (t.e.empty()) t.e.resize(1 << 10);
    prof_in_kernel = true;
}

static void prof_launch_end(const Launch& L) {
    haz_in_kernel = false;
    if (!prof.on) return;
    prof_in_kernel = false;
    for (ProfRange& r : prof.ranges) {
        if (!r.touched) continue;
        size_t words = (r.end - r.base + 32 * 64 - 1) / (32 * 64);
        for (int w = 0; w < 2; w++) memset(&prof.bits[w][r.bit0 / 64], 0, words * 8);
        r.touched = false;
    }
    ProfKernel k{L.grid.x * L.grid.y * L.grid.z, L.block.x * L.block.y * L.block.z, L.shmem, prof.greq[0], prof.greq[1],
                 prof.sreq[0], prof.sreq[1], prof.waves[0], prof.waves[1], prof.ideal, prof_inst[I_SHFL], prof_inst[I_SYNC],
                 prof_inst[I_TENSOR], prof_inst[I_SFU]};
    prof_record("kernel", L.name, 32 * prof.req[0], 32 * prof.req[1], 32 * prof.uniq[0], 32 * prof.uniq[1], prof_kernel_flops, &k);
}

// A warp's requests are closed once all its lanes have passed a warp operation or a barrier together: their
// entries are freed (so the tables stay small), and later runs of a site are later requests anyway.
static void prof_warp_done(int warp) {
    ProfTable& t = prof.tables[warp];
    if (++t.gen == 0) {  // after 2^32: free every entry for real
        for (ProfReq& e : t.e) e.gen = 0;
        t.gen = 1;
    }
    t.live = 0;
}
static void prof_block_start(void) {
    for (size_t w = 0; w < prof.tables.size(); w++) prof_warp_done((int)w);
}

static void prof_thread_start(int linear) { prof.lanes[linear].sites.clear(); }

static size_t prof_slot(uint64_t site_warp, uint64_t sector, uint32_t nth, size_t mask) {
    uint64_t h = site_warp * 0x9E3779B97F4A7C15ull ^ sector * 0xC2B2AE3D27D4EB4Full ^ nth * 0x165667B19E3779F9ull;
    return (h ^ h >> 29) & mask;
}

// Room in a warp's table for n more entries without passing half full (entries found after stay where they
// are until the next).
static void prof_reserve(ProfTable& t, size_t n) {
    if (2 * (t.live + n) <= t.e.size()) return;
    size_t size = t.e.size();
    while (2 * (t.live + n) > size) size *= 2;
    std::vector<ProfReq> old(size);
    old.swap(t.e);
    size_t mask = t.e.size() - 1;
    for (const ProfReq& e : old) {
        if (e.gen != t.gen) continue;
        size_t i = prof_slot(e.site_warp, e.sector, e.nth, mask);
        while (t.e[i].gen == t.gen) i = (i + 1) & mask;
        t.e[i] = e;
    }
}

// The entry of (site_warp, sector, nth), made if new (*fresh then); after prof_reserve.
static ProfReq* prof_entry(ProfTable& t, uint64_t site_warp, uint64_t sector, uint32_t nth, bool* fresh) {
    size_t mask = t.e.size() - 1;
    for (size_t i = prof_slot(site_warp, sector, nth, mask);; i = (i + 1) & mask) {
        ProfReq& e = t.e[i];
        if (e.gen != t.gen) {
            e = ProfReq{site_warp, sector, nth, t.gen, 0, 0};
            t.live++;
            *fresh = true;
            return &e;
        }
        if (e.site_warp == site_warp && e.sector == sector && e.nth == nth) {
            *fresh = false;
            return &e;
        }
    }
}

// The entries' kinds, in the top bits of site_warp (sites are user-space addresses, below 2^47; the warp
// is in bits 56-60): a global sector (0), a shared word, a shared bank, a warp instruction.
static const uint64_t K_WORD = 1ull << 61, K_BANK = 2ull << 61, K_INST = 3ull << 61;
enum { INST_GLOBAL, INST_SHARED, INST_OTHER };  // the sector field of a K_INST entry (INST_OTHER + its class)

// The running thread's n-th run of an access site (from 0), and the site and warp as one key: lanes of a
// warp that run a site for the n-th time are one warp request, as a GPU issues it.
static uint64_t prof_site(uintptr_t site, uint32_t* nth) {
    int linear = ((Fiber*)cudaemu_self)->linear;
    ProfLane& lane = prof.lanes[linear];
    size_t n = lane.sites.size(), i = 0;
    while (i < n && lane.sites[(lane.last + 1 + i) % n].first != site) i++;
    if (i == n) {
        lane.sites.push_back({site, 0});
        lane.last = n;
    } else {
        lane.last = (lane.last + 1 + i) % n;
    }
    *nth = i == n ? 0 : ++lane.sites[lane.last].second;
    return site | (uint64_t)(linear / 32) << 56;
}

// A global access: its sectors in its warp request, and in the launch's distinct sectors.
static void prof_global(uintptr_t a, size_t size, int write, uintptr_t site) {
    if (prof.ranges.empty()) return;
    ProfRange* r = &prof.ranges[prof.hit];
    if (a - r->base >= r->end - r->base) {  // not the allocation found last: look up its chunk
        const ProfChunk* e = prof_chunk(a >> 16);
        int found = -1;
        for (int j = 0; j < 2; j++)
            if (e->range[j] >= 0 && a - prof.ranges[e->range[j]].base < prof.ranges[e->range[j]].end - prof.ranges[e->range[j]].base)
                found = e->range[j];
        if (found < 0 && e->range[1] == -2) {  // a chunk of many small allocations: search them
            auto it = std::upper_bound(prof.ranges.begin(), prof.ranges.end(), a,
                                       [](uintptr_t x, const ProfRange& q) { return x < q.base; });
            if (it != prof.ranges.begin() && a < (it - 1)->end) found = (int)(it - 1 - prof.ranges.begin());
        }
        if (found < 0) return;  // the stack, parameters
        prof.hit = found;
        r = &prof.ranges[found];
    }
    uint32_t nth;
    uint64_t site_warp = prof_site(site, &nth);
    ProfTable& t = prof.tables[site_warp >> 56 & 31];
    uintptr_t last = std::min<uintptr_t>(a + size, r->end) - 1;
    prof_reserve(t, last / 32 - a / 32 + 2);
    bool fresh;
    prof_entry(t, site_warp | K_INST, INST_GLOBAL, nth, &fresh);
    if (fresh) prof.greq[write]++, prof_site_inst(site, write ? S_GST : S_GLD, (unsigned)size);
    for (uint64_t sector = a / 32; sector <= last / 32; sector++) {
        prof_entry(t, site_warp, sector, nth, &fresh);
        if (fresh) prof.req[write]++;
        size_t bit = r->bit0 + sector - r->base / 32;
        uint64_t& w = prof.bits[write][bit / 64];
        if (w >> (bit % 64) & 1) continue;
        w |= 1ull << (bit % 64);
        prof.uniq[write]++;
        r->touched = true;
    }
}

// A shared access (offset `at` in its region, 4-byte words on 32 banks): a warp request takes as many
// wavefronts (shared-memory cycles) as the most distinct words its lanes touch on one bank; lanes reading
// one word share it (a broadcast). Conflict-free it would take one per 128 bytes of distinct words.
static void prof_shared(uintptr_t at, size_t size, int write, uintptr_t site) {
    uint32_t nth;
    uint64_t site_warp = prof_site(site, &nth);
    ProfTable& t = prof.tables[site_warp >> 56 & 31];
    uintptr_t first = at / 4, last = (at + size - 1) / 4;
    prof_reserve(t, 2 * (last - first + 1) + 1);
    bool fresh;
    ProfReq* req = prof_entry(t, site_warp | K_INST, INST_SHARED, nth, &fresh);
    if (fresh) prof.sreq[write]++, prof_site_inst(site, write ? S_STS : S_LDS, (unsigned)size);
    for (uintptr_t word = first; word <= last; word++) {
        prof_entry(t, site_warp | K_WORD, word, nth, &fresh);
        if (!fresh) continue;
        if (req->words++ % 32 == 0) prof.ideal++;
        ProfReq* bank = prof_entry(t, site_warp | K_BANK, word % 32, nth, &fresh);
        if (++bank->words > req->most) {
            req->most = bank->words;
            prof.waves[write]++;
        }
    }
}

// An instruction the runtime sees once per lane (a special function, an mma's site): one warp instruction
// per warp request of its site.
static void prof_warp_inst(uintptr_t site, int cls) {
    if (!cur_run || !prof_in_kernel) return;
    uint32_t nth;
    uint64_t site_warp = prof_site(site, &nth);
    ProfTable& t = prof.tables[site_warp >> 56 & 31];
    prof_reserve(t, 1);
    bool fresh;
    prof_entry(t, site_warp | K_INST, INST_OTHER + cls, nth, &fresh);
    if (!fresh) return;
    if (cls == S_SFU) prof_inst[I_SFU]++;
    prof_site_inst(site, cls, 4);
}
void cudaemu_sfu(void) { prof_warp_inst(PROF_SITE, S_SFU); }  // cudaemu.h's wrappers of expf, sqrtf...

// The hazard check: per shared byte of the block (threads may write the two bf16 halves of one word), its
// last write (thread, barriers it had passed, its last warp operation) and the reads since (in one barrier
// interval: the warps that read, their lanes, the earliest warp operation among them). An access is ordered after another of the same barrier interval
// only within one warp, by a warp operation after the first that both lanes took part in.
namespace {
struct HazByte {
    uint32_t gen;                        // the block it belongs to (older: no accesses yet)
    int32_t writer;                      // -1: not written in this block
    uint32_t w_bars, w_wops, r_bars, r_wops;
    uint32_t readers, r_lanes;           // warps that read since the write (in r_bars), and their lanes (one warp)
    uintptr_t w_site, r_site;
    int32_t async;  // the thread whose cp.async into it has not been waited for (-1: none)
};
}  // namespace
static std::vector<HazByte> haz_dynamic;                 // the dynamic shared memory's bytes
static std::map<uintptr_t, HazByte> haz_static;          // the bytes of __shared__ variables, by address
static uint32_t haz_gen;

static void haz_block_start(void) {
    if (++haz_gen == 0) {  // after 2^32 blocks: clear for real
        for (HazByte& h : haz_dynamic) h.gen = 0;
        haz_gen = 1;
    }
    haz_static.clear();
    if (haz_dynamic.size() < cur_run->shmem) haz_dynamic.resize(cur_run->shmem);
}

// Did lanes of warp w take part together in one of its warp operations after the since-th, up to the upto-th?
static bool haz_ordered(int w, uint32_t since, uint32_t upto, unsigned lanes) {
    const std::vector<unsigned>& ops = cur_run->warp_ops[w];
    for (uint32_t j = since; j < upto && j < ops.size(); j++)
        if ((ops[j] & lanes) == lanes) return true;
    return false;
}

[[noreturn]] static void haz_report(const char* what, uintptr_t byte, const char* region, Fiber* f, uintptr_t site,
                                    int other, uintptr_t other_site) {
    char who[40] = "another thread";
    if (other >= 0) snprintf(who, sizeof(who), "thread %d", other);
    emu_fatal("%s: a shared-memory hazard (%s): thread %d at %s and %s at %s, %s 0x%lx, with no __syncthreads or "
              "warp operation of both lanes between them", block_name(cur_run).c_str(), what, f->linear,
              code_line(site).c_str(), who, code_line(other_site).c_str(), region, (unsigned long)byte);
}

static void haz_access(uintptr_t byte, const char* region, HazByte& h, int write, uintptr_t site) {
    Fiber* f = (Fiber*)cudaemu_self;
    int me = f->linear, warp = me / 32;
    unsigned lane = 1u << (me % 32);
    if (h.gen != haz_gen) h = HazByte{haz_gen, -1, 0, 0, 0, 0, 0, 0, 0, 0, -1};
    if (h.async >= 0)  // its copy may land at any time until the wait: any access before it is a hazard
        emu_fatal("%s: a shared-memory hazard (%s before the cp.async into it was waited for): thread %d at %s and thread %d's "
                  "cp.async at %s, %s 0x%lx, before a cp.async.wait_group of thread %d covers the copy",
                  block_name(cur_run).c_str(), write ? "write" : "read", me, code_line(site).c_str(), h.async,
                  code_line(h.w_site).c_str(), region, (unsigned long)byte, h.async);
    if (h.writer >= 0 && h.writer != me && h.w_bars == f->bars &&
        (h.writer / 32 != warp || !haz_ordered(warp, h.w_wops, f->wops, lane | 1u << (h.writer % 32))))
        haz_report(write ? "write after write" : "read after write", byte, region, f, site, h.writer, h.w_site);
    if (write) {
        if (h.readers && h.r_bars == f->bars && !(h.readers == 1u << warp && (h.r_lanes == lane ||
                                                                              haz_ordered(warp, h.r_wops, f->wops, h.r_lanes | lane))))
            haz_report("write after read", byte, region, f, site, -1, h.r_site);
        h.writer = me, h.w_bars = f->bars, h.w_wops = f->wops, h.w_site = site, h.readers = 0;
        return;
    }
    if (!h.readers || h.r_bars != f->bars) h.readers = h.r_lanes = 0, h.r_bars = f->bars, h.r_wops = f->wops;
    if (!(h.readers >> warp & 1u) && h.readers) h.r_lanes = 0;  // two warps read: any write before a barrier is a hazard
    h.readers |= 1u << warp, h.r_lanes |= lane, h.r_wops = std::min(h.r_wops, f->wops), h.r_site = site;
}

// A cp.async's 16 bytes of dynamic shared memory at a, issued (pending: haz_access has checked them as a
// write) or covered by a wait of thread f: from then on its write, made at the wait.
static void haz_async(uintptr_t a, int pending, const Fiber* f, uintptr_t site) {
    for (uintptr_t b = a - (uintptr_t)cur_run->blk.dynamic_shared, e = b + 16; b < e; b++) {
        HazByte& h = haz_dynamic[b];
        h.async = pending ? f->linear : -1;
        if (!pending) h.writer = f->linear, h.w_bars = f->bars, h.w_wops = f->wops, h.w_site = site, h.readers = 0;
    }
}

// Where this OS thread's __shared__ variables live: cudaemu.h makes them thread_local, and this program's
// thread-local block ends at the thread pointer (x86-64's TLS variant II). cudaemu_self and cudaemu_blk,
// the emulator's own, live there too and are not shared memory.
static thread_local uintptr_t tls_lo, tls_len;
static int tls_find(struct dl_phdr_info* info, size_t, void* out) {
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_TLS) {
            size_t align = info->dlpi_phdr[i].p_align ? info->dlpi_phdr[i].p_align : 1;
            *(size_t*)out = (info->dlpi_phdr[i].p_memsz + align - 1) / align * align;
        }
    return 1;  // the first object is the program itself
}
static bool static_shared(uintptr_t a) {
    if (!tls_len) {
        size_t size = 0;
        dl_iterate_phdr(tls_find, &size);
        uintptr_t tp;
        __asm__("mov %%fs:0, %0" : "=r"(tp));
        tls_lo = tp - size, tls_len = size ? size : 1;
    }
    return a - tls_lo < tls_len && a != (uintptr_t)&cudaemu_self && a != (uintptr_t)&cudaemu_blk;
}

// Every load and store of a kernel thread, while a launch is counted or checked: shared memory (the
// block's dynamic buffer, or a __shared__ variable) or global (device allocations; the rest, the thread's
// stack and the kernel's parameters, is neither).
static void prof_access(uintptr_t a, size_t size, int write, uintptr_t site) {
    if (!cur_run || !(prof_in_kernel || haz_in_kernel) || !size) return;  // host threads, the race check's reruns
    uintptr_t dyn = (uintptr_t)cur_run->blk.dynamic_shared;
    bool dynamic = a - dyn < cur_run->shmem;
    if (dynamic || static_shared(a)) {
        uintptr_t at = dynamic ? a - dyn : a;
        if (haz_in_kernel)
            for (uintptr_t b = at; b < at + size; b++)
                haz_access(b, dynamic ? "dynamic shared memory at offset" : "a __shared__ variable at",
                           dynamic ? haz_dynamic[b] : haz_static[b], write, site);
        if (prof_in_kernel) prof_shared(at, size, write, site);
        return;
    }
    if (prof_in_kernel) prof_global(a, size, write, site);
}

// The calls GCC's -fsanitize=thread (--param=tsan-instrument-func-entry-exit=0) makes: aligned and
// unaligned accesses of 1 to 16 bytes (16: vector loads and stores), byte ranges, and its module constructor.
#define PROF_HOOKS(n)                                                                                   \
    void __tsan_read##n(void* p) { prof_access((uintptr_t)p, n, 0, PROF_SITE); }                       \
    void __tsan_write##n(void* p) { prof_access((uintptr_t)p, n, 1, PROF_SITE); }                      \
    void __tsan_unaligned_read##n(void* p) { prof_access((uintptr_t)p, n, 0, PROF_SITE); }             \
    void __tsan_unaligned_write##n(void* p) { prof_access((uintptr_t)p, n, 1, PROF_SITE); }
extern "C" {
void __tsan_init(void) { prof_instrumented = true; }
void __tsan_read1(void* p) { prof_access((uintptr_t)p, 1, 0, PROF_SITE); }
void __tsan_write1(void* p) { prof_access((uintptr_t)p, 1, 1, PROF_SITE); }
PROF_HOOKS(2)
PROF_HOOKS(4)
PROF_HOOKS(8)
PROF_HOOKS(16)
void __tsan_read_range(void* p, unsigned long size) { prof_access((uintptr_t)p, size, 0, PROF_SITE); }
void __tsan_write_range(void* p, unsigned long size) { prof_access((uintptr_t)p, size, 1, PROF_SITE); }
}
