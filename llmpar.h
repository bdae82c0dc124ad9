/*
llmpar.h: everything reusable for training GPT-2. Each section builds on those above it, in the order a
training step meets them: the tokens (6), the ops (7), where weights and gradients live (8), forward and backward
(9), the optimizer (10), the pipeline stage (12) and the step itself (13), whose four calls go down through the
rest; then what keeps a run between steps, its files (14).

  1. basics      errors that name what failed, files, timers, RNG, device memory
                 defines: lp_fail, lp_log, lp_fopen, lp_time_s, lp_rand_u32, lp_device_malloc
  2. config      the model's shape (a mixture of experts' too; the Llama 3 family's choices), GPT-2 and Llama presets,
                 parameter tensor sizes
                 defines: LPConfig, lp_config_from_name, lp_param_sizes, lp_layer_has
  3. topology    every parallel setting (LPParallel), MPI start-up (the CPU's BLAS kernels chosen first), the t x d x p
                 grid of ranks as data (its axes; expert parallelism's two inside d) and its groups, GPU choice
                 defines: LPParallel, lp_parallel_one, LP_SETTING, lp_axes, LPProcess, LPGroup, lp_blas_init,
                 lp_process_init, lp_grid_init, lp_device_init
  4. schedules   pipeline schedules (GPipe, 1F1B, interleaved) as pure functions, their simulator
                 defines: LPAction, lp_schedule_stage (a stage's action list), LPSimulation, lp_schedule_simulate,
                 lp_schedule_slots
  5. comm        collectives on a group: NCCL (CUDA, one GPU per rank) or MPI; the watchdog over their waits
                 defines: lp_comm_init, lp_all_reduce, lp_reduce_scatter, lp_all_gather, lp_all_to_all, LPPending, lp_wait,
                 lp_watch, lp_watch_done, lp_watchdog_start
  6. data        llm.c token shards and their manifest, per-DP-rank slices, shuffled or file order, resumable position;
                 llm.c's multiple-choice eval files (HellaSwag)
                 defines: LPDataOptions, LPDataLoader, lp_dataloader_init, lp_dataloader_next, lp_dataloader_seek,
                 LPEvalSet, lp_evalset_load, lp_evalset_batch, lp_evalset_score
  7. kernels     each op as a CPU loop (the oracle) beside its CUDA kernel, same signature (a mixture of experts'
                 routing, rows into expert order and back, gated sum among them)
                 defines: lp_OP_cpu and lp_OP_gpu for each op, lp_OP bound to this build's (its last lines)
  8. zero        data parallelism and ZeRO: where weights, gradients and AdamW state live (memory, or a file:
                 offload), where gradients are averaged over dp; the hooks forward and backward call around each layer
                 defines: LPOffload, LPHostOptim, LPZero, lp_zero_create, lp_zero_fetch, lp_zero_layer_done,
                 lp_zero_average
  9. model       parameters (one rank's TP slice), activations, the TP operators, a mixture of experts' MLP,
                 forward, backward
                 defines: LPMoEOptions, LPModelOptions, LPModel, LPLayerActs, lp_model_create,
                 lp_moe_forward, lp_model_forward, lp_model_backward
 10. optimizer   AdamW with fp32 master weights, global grad-norm clipping, replicas that train apart (DiLoCo's
                 outer step, gossip's mixing), dynamic loss scaling, LR schedule
                 defines: LPAdamW, lp_zero_state_get/put (the optimizer's shard a chunk at a time), lp_models_grad_norm,
                 lp_models_adamw, LPOuterSGD, lp_replicas_outer, lp_replicas_gossip, LPLossScaler, lp_lr_schedule,
                 LPLossWindow
 11. costs       FLOPs per token and per chunk, memory per chunk, the pipeline partition, the device's peak (MFU)
                 defines: lp_active_params, lp_flops_per_token, LPPipeShape, lp_chunk_memory, lp_pp_partition,
                 lp_device_peak_flops
 12. pipeline    a rank's pipeline stage: its chunks, activation slots, send/recv of a micro-batch's boundary
                 defines: LPStage, lp_stage_create, lp_stage_forward, lp_stage_backward, lp_stage_bubble
 13. step        one optimizer step in four phases, each one call, each naming where ranks communicate
                 defines: lp_step_forward_backward, lp_step_reduce_grads, lp_step_grad_norm, lp_step_update,
                 lp_step_replicas
 14. files       model files (llm.c format; llmpar's version 6 for experts), checkpoints, tokenizer (samples printed as valid UTF-8)
                 defines: lp_model_load, lp_model_save, LPTrainState, lp_checkpoint_save/load, lp_dir_lock, LPTokenizer,
                 LPUtf8

Not here: the cluster planner (how to run a model on N GPUs, each step simulated), a tool built on this
header's costs and schedules: dev/plan (`make plan_gpt && ./plan_gpt --plan 8 -e d12`).

Two builds from one source. `nvcc` builds the CUDA engine: bf16 params and activations (fp16 with
-DLLMPAR_FP16, make train_gpt_fp16, and dynamic loss scaling: LPLossScaler), fp32 master weights and
optimizer state, cuBLASLt. `mpicc -x c -DLLMPAR_CPU` builds the CPU engine: everything fp32,
OpenMP loops. The CPU loops are compiled in both builds, so a GPU test checks each kernel against its loop.
The model code calls lp_op, bound at the end of section 7 to the build's lp_op_cpu or lp_op_gpu. Without a GPU
the CUDA build's code runs under the CUDA emulator (dev/cudaemu: g++ instead of nvcc, LLMPAR_CUDAEMU).

Names: B, T, C, L, V (batch, sequence, channels, layers, vocabulary) and N = B*T rows; a rank's grid is
t x d x p (tensor, data, pipeline), with v chunks per pipeline stage and m micro-batches per step, as in
Megatron-LM's papers; sections 4 and 11-13 use those letters alone, so there m is never a model. Elsewhere
m is an LPModel, proc an LPProcess, st a pipeline stage (LPStage), z a model's LPZero.

Use as a library: one header, stb-style. Exactly one file of the program says #define LLMPAR_IMPLEMENTATION
before its #include "llmpar.h": it compiles the library's functions, kernels and few mutable globals (lp_rank,
the GPU's handles and scratch buffers); every other file includes the header plain, which declares them (the
interface below this comment: the functions a program calls, and the types in their sections), and shares
them. Without the define in any file the program fails to link (undefined lp_process_init, ...). A training loop on a t x d x p grid, as dev/examples/train_loop.cu
compiles it with the define above its main (`make test` builds and runs it on each build, with and without
MPI, on one rank, on 2 x 2 x 2 and on t=2 p=2; the same from two files: dev/examples/two_files_main.cu and
two_files_eval.cu):

    int B = 4, T = 64, steps = argc > 1 ? atoi(argv[1]) : 20;
    LPProcess proc;                             // alone, a process is the whole world; under mpirun, each
    lp_process_init(&proc, &argc, &argv);       //   rank takes a place on the grid below
    LPParallel par = lp_parallel_one;           // how the work is split: t x d x p ranks, d the rest
    par.tp = argc > 2 ? atoi(argv[2]) : 1;      // tensor parallel: each layer's heads and MLP over t ranks
    par.pp = argc > 3 ? atoi(argv[3]) : 1;      // pipeline parallel: the layers over p stages, 1F1B
    par.micro_batches = 2;                      // m: micro-batches per step, through the pipeline
    lp_grid_init(&proc, &par);                  // this rank's coordinates and groups; par.dp = ranks / (t p)
    lp_device_init(&proc);                      // CUDA: the rank's GPU, cuBLASLt (CPU build: nothing)
    lp_comm_init(&proc);                        // NCCL between GPUs, else MPI
    LPConfig cfg;
    lp_config_from_name(&cfg, "d2");            // a preset: d12 is GPT-2 124M; dN: N layers, 64N channels
    cfg.max_seq_len = T;
    LPModelOptions model = {.proc = &proc};     // the model split over the grid as par says
    LPStage stage;                              // this rank's pipeline stage: its chunks of the model
    lp_stage_create(&stage, &cfg, &model, B, T);
    for (int c = 0; c < par.vpp; c++) lp_model_init_random(&stage.chunks[c], 1337);  // (a file: lp_model_set_weights)
    LPDataOptions shards = {.pattern = "dev/data/tinyshakespeare/tiny_shakespeare_train.bin", .B = B, .T = T,
                            .rank = proc.coord[LP_DP], .ranks = par.dp, .vocab_size = cfg.vocab_size, .scan = 1};
    LPDataLoader data;                          // llm.c shards: this replica's B x T slice of each batch
    lp_dataloader_init(&data, &shards);
    LPAdamW opt = {0.9f, 0.95f, 1e-8f, 0.1f, 1.0f};  // beta1, beta2, eps, weight decay, grad-norm clip (train_gpt's)
    for (int step = 1; step <= steps; step++) {
        float loss = lp_step_forward_backward(&stage, &data);  // m micro-batches: TP inside layers, PP sends
        lp_step_reduce_grads(&stage);           // DP: the gradients averaged over the replicas
        float norm = lp_step_grad_norm(&stage); // their global norm, over every rank's part
        lp_step_update(&stage, 1e-3f, norm, &opt);  // clipping, then AdamW at lr 1e-3
        lp_log("step %d/%d | loss %.4f | norm %.4f\n", step, steps, loss, norm);  // rank 0 prints
    }
    lp_dataloader_free(&data); lp_stage_free(&stage); lp_process_finish(&proc);

Your own tokens instead of shards: a model made alone (lp_model_create(&m, &cfg, NULL)) takes B*T of them,
lp_model_forward(&m, inputs, targets, B, T, 1.0f / (B * T)) then lp_model_backward(&m, 1) (section 9).
Build: CPU `cc -x c -std=gnu11 -O3 -fopenmp -DLLMPAR_CPU app.cu -lm` (mpicc and -DLLMPAR_MPI for ranks,
-DLLMPAR_BLAS and OpenBLAS for fast matmuls); CUDA `nvcc -O3 -std=c++17 -arch=sm_90 -Xcompiler -fopenmp
app.cu -lcublasLt -lcublas` (the Makefile's dev/examples targets show both, MPI and NCCL flags included).
Options, defined before the include (in each file, as stb's STBI_NO_*): LLMPAR_NO_WATCHDOG leaves out the
watchdog (section 5: a thread per rank that ends the job when a rank has waited past a timeout; train_gpt.cu
needs it), LLMPAR_NO_REEXEC keeps the program from executing itself again for better OpenBLAS kernels
(lp_blas_init), LLMPAR_NO_NVTX leaves out the CUDA build's NVTX ranges (section 1's timeline marks, named
for Nsight Systems). LLMPAR_TEST_HOOKS is for llmpar's own tests: crashes, losses, overflows and offload chunk sizes injected
through environment variables (make's train_gpt_cpu_hooks and co.); no other build reads them.
More: LPParallel (section 3) lists every setting (ZeRO, recomputation, schedules, offload, ...), each call's
comment says what it does; train_gpt.cu's lp_train is the full driver (LR schedule, checkpoints, evaluation,
the divergence guard); README.md.
*/
#ifndef LLMPAR_H
#define LLMPAR_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE  // O_DIRECT (offload files, section 8)
#endif
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>  // sched_getaffinity: the cores OpenMP may use (lp_threads_bound)
#include <fnmatch.h>
#include <glob.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>  // offsetof: the settings and the grid's axes name LPParallel fields
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef LLMPAR_MPI
#define OMPI_SKIP_MPICXX 1  // C API only: Open MPI's C++ bindings do not compile warning-free
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

#ifdef LLMPAR_CPU
#ifdef LLMPAR_BLAS
#include <cblas.h>  // cblas_sgemm: the CPU build's matmuls when a BLAS was found (the plain loops otherwise)
#endif
typedef float floatX;  // the CPU build computes in fp32 throughout
#define LP_FLOATX_NAME "fp32"
#define LP_HD
#define LP_BUILD_GPU 0  // which engine this build is (memory counts name the one they count: LPPipeShape.gpu)
#else
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#ifdef LLMPAR_NCCL
#include <nccl.h>
#endif
#ifndef LLMPAR_NO_NVTX
#include <nvtx3/nvToolsExt.h>  // nvtxRangePushA, nvtxRangePop: the timeline's ranges for Nsight Systems (header-only)
#endif
// params, grads and activations; master weights and Adam state are fp32. bf16 by default; fp16 where
// LLMPAR_FP16 is defined (make train_gpt_fp16: GPUs and recipes without bf16; dynamic loss scaling,
// LPLossScaler, keeps its gradients in range). A build-time choice, as llm.c's PRECISION: every kernel and
// library call is typed through floatX, its cuBLASLt type LP_CUDA_FLOATX and its NCCL type LP_NCCL_FLOATX.
#ifdef LLMPAR_FP16
typedef __half floatX;
#define LP_FLOATX_NAME "fp16"
#define LP_CUDA_FLOATX CUDA_R_16F
#define LP_NCCL_FLOATX ncclFloat16
#else
typedef __nv_bfloat16 floatX;
#define LP_FLOATX_NAME "bf16"
#define LP_CUDA_FLOATX CUDA_R_16BF
#define LP_NCCL_FLOATX ncclBfloat16
#endif
#define LP_HD __host__ __device__
#define LP_BUILD_GPU 1
#ifdef LLMPAR_CUDNN
// --attention cudnn (llmpar_cudnn.cpp, make USE_CUDNN=1): the flash path's layouts and results. NULL, or why not.
const char* lp_cudnn_attention_forward(void* out, float* lse, const void* qkv, int B, int T, int C, int NH);
const char* lp_cudnn_attention_backward(void* dqkv, const void* dout, const void* out, const void* qkv, const float* lse, int B, int T,
                                        int C, int NH);
void lp_cudnn_free(void);
#endif
#endif
// The optimizer's fp32 master weights are a copy beside bf16 params; fp32 params are their own.
#define LP_MASTER_COPY (sizeof(floatX) != sizeof(float))

// ----------------------------------------------------------------------------------------------------
// The interface (stb-style): the functions a program calls, by section. Their types and constants are in
// their sections below, which every file sees; the bodies, the kernels and the mutable globals are
// compiled once, in the file that defines LLMPAR_IMPLEMENTATION (there the sections' own helpers are
// callable too).
#define LP_PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))  // the compiler checks the arguments against the format
typedef struct LPAction LPAction;
typedef struct LPAdamW LPAdamW;
typedef struct LPBubble LPBubble;
typedef struct LPConfig LPConfig;
typedef struct LPDataLoader LPDataLoader;
typedef struct LPDataOptions LPDataOptions;
typedef struct LPEvalSet LPEvalSet;
typedef struct LPGroup LPGroup;
typedef struct LPLossScaler LPLossScaler;
typedef struct LPLossWindow LPLossWindow;
typedef struct LPModel LPModel;
typedef struct LPModelOptions LPModelOptions;
typedef struct LPParallel LPParallel;
typedef struct LPPipeShape LPPipeShape;
typedef struct LPProcess LPProcess;
typedef struct LPSimulation LPSimulation;
typedef struct LPStage LPStage;
typedef struct LPTokenizer LPTokenizer;
typedef struct LPTrainState LPTrainState;
typedef struct LPUtf8 LPUtf8;
typedef struct LPZero LPZero;

// 1. basics (section)
void lp_fail(const char* fmt, ...) LP_PRINTF(1, 2);  // print one line naming what failed, then stop every rank (exit 1)
void lp_log(const char* fmt, ...) LP_PRINTF(1, 2);  // printf on rank 0 only, flushed
void* lp_host_malloc(size_t bytes, const char* what);  // malloc, or an error naming `what` and its size
FILE* lp_fopen(const char* path, const char* mode);  // fopen, or an error naming the path and why
// a NULL-terminated list of names as errors list them: "a, b or c"
const char* lp_names_text(char* buf, size_t size, const char* const* names);
// format a path into buf (LP_PATH_MAX); too long is an error, never cut
void lp_path(char* buf, const char* fmt, ...) LP_PRINTF(2, 3);
double lp_time_s(void);  // monotonic wall clock in seconds
uint32_t lp_rand_u32(uint64_t* state);  // xorshift64*: the next 32 random bits of *state
float lp_rand_f32(uint64_t* state);  // a uniform float in [0, 1) from *state
void lp_to_host_float(float* dst, const floatX* src, size_t n);  // n device values of the compute type (floatX) into host floats

// 2. config (section)
int lp_config_differs(const LPConfig* a, const LPConfig* b);  // the first of lp_config_fields in which a and b differ, or -1
int lp_is_layer_tensor(int i);  // whether parameter tensor i (LP_WTE ...) has one matrix per layer
int lp_is_expert_tensor(int i);  // whether tensor i is one of the experts' four (a MoE layer's MLP)
// how many of the layers [l0, l1) have tensor i (MoE layers have the router and experts)
int lp_layers_having(const LPConfig* c, int i, int l0, int l1);
// each tensor's size on one rank of a t-way tensor-parallel group (t = 1: the whole model)
void lp_param_sizes(size_t* sizes, const LPConfig* c, int t);
size_t lp_config_num_params(const LPConfig* c);  // parameters of the whole model
// a shape the engine can run, or one error naming `source` (a file, a flag)
void lp_config_validate(const LPConfig* c, const char* source);
// a preset by name (d12: GPT-2 124M; dN: N layers, 64N channels); 0 if unknown
int lp_config_from_name(LPConfig* c, const char* name);

// 3. topology (section)
// an error every rank detects alike: rank 0 prints it, every rank exits 1
void lp_fail_all(const char* fmt, ...) LP_PRINTF(1, 2);
// place this rank on par's t x cp x d x p grid (sets par->dp) and make its groups
void lp_grid_init(LPProcess* proc, LPParallel* par);
// the ranks averaging this one's gradients: its dp group, with context parallelism its cp x d ranks
const LPGroup* lp_dp_group(const LPProcess* proc);
// NULL when model c splits over t tensor-parallel ranks, else why not (into why)
const char* lp_tp_check(const LPConfig* c, int t, char* why, size_t size);
void lp_grid_check(const LPProcess* proc, const LPConfig* c);  // lp_tp_check on the process's grid: an error on every rank if not
// start MPI when launched by mpirun or srun, learn this rank; BLAS and OpenMP set up first
void lp_process_init(LPProcess* proc, int* argc, char*** argv);
void lp_device_init(LPProcess* proc);  // CUDA: the rank's GPU (the launcher's local rank) and cuBLASLt; CPU: nothing
void lp_device_sync(void);  // wait for the GPU's queued work (timing); CPU: nothing
double lp_device_memory_used_mib(void);  // device memory in use, MiB (CPU: 0)
const char* lp_engine_name(void);  // one line naming what computes: the GPU, or the CPU's matmul kernels and threads
void lp_process_finish(LPProcess* proc);  // free the groups and leave MPI

// 4. schedules (section)
// stage s's actions for schedule `kind` (LP_SCHEDULE_*), in order, into out; their count
int lp_schedule_stage(int kind, int p, int v, int m, int s, LPAction* out);
// run sim's lists in time order with its costs: makespan, bubble; NULL, or why it deadlocks
const char* lp_schedule_run(LPSimulation* sim, char* why, size_t size);
// fill sim with a schedule's lists for p stages, v chunks, m micro-batches and its costs
const char* lp_schedule_lists(LPSimulation* sim, int kind, int p, int v, int m, double f, double b, const double* cost,
                              char* why, size_t size);
// lp_schedule_lists, then lp_schedule_run: NULL, or why it cannot run
const char* lp_schedule_simulate(LPSimulation* sim, int kind, int p, int v, int m, double f, double b, const double* cost,
                                 char* why, size_t size);
void lp_simulation_free(LPSimulation* sim);  // free a simulation's lists and times
void lp_schedule_print(FILE* out, const LPSimulation* sim, int kind);  // draw a simulated timeline, a row per stage, to out

// 5. comm (section)
// sum (average = 1: mean) n host floats over the group, in place
void lp_all_reduce_host(const LPGroup* g, float* x, size_t n, int average);
// every rank's `bytes` at mine into all (rank-major), over the whole job
void lp_world_all_gather(const LPProcess* proc, const void* mine, size_t bytes, void* all);
// rank r's bytes[r] bytes at mine to rank 0, into all one after another in rank order
void lp_world_gather(const LPProcess* proc, const void* mine, const int* bytes, void* all);
// `bytes` at buf from world rank root to every rank
void lp_world_broadcast(const LPProcess* proc, void* buf, size_t bytes, int root);
// `bytes` of host memory from the group's rank root to its ranks
void lp_broadcast_host(const LPGroup* g, void* buf, size_t bytes, int root);
void lp_barrier(const LPGroup* g);  // wait until every rank of the group is here
void lp_comm_init(LPProcess* proc);  // choose the transport for device tensors (NCCL, or MPI) and start it

// 6. data (section)
// context parallelism: the query-key pairs rank `rank` of cp scores in a sequence of T tokens (its two chunks)
double lp_cp_attention_pairs(int T, int rank, int cp);
// go to (epoch, shard, pos), as a checkpoint's state names them
void lp_dataloader_seek(LPDataLoader* d, int epoch, int shard, size_t pos);
// open the shards o->pattern matches, this data-parallel rank's slice of each batch
void lp_dataloader_init(LPDataLoader* d, const LPDataOptions* o);
void lp_dataloader_reset(LPDataLoader* d);  // back to the start (the first epoch's first batch)
void lp_dataloader_next(LPDataLoader* d);  // fill d->inputs and d->targets with this rank's next (B, T) batch
size_t lp_dataloader_batches_per_epoch(const LPDataLoader* d);  // batches in one pass over the data
void lp_dataloader_free(LPDataLoader* d);  // close the shards and free the batch
// read and check a multiple-choice eval file (llm.c's HellaSwag format)
void lp_evalset_load(LPEvalSet* s, const char* path, const char* label, int vocab_size);
// rows r0 .. r0+n-1 into inputs and targets (T each), padded to `multiple` rows; returns T
int lp_evalset_batch(const LPEvalSet* s, int r0, int n, int multiple, int* inputs, int* targets);
// the sum of row r's completion losses, from its batch row's (T) losses
double lp_evalset_row_loss(const LPEvalSet* s, int r, const float* losses);
// of examples e0 .. e1-1, how many are right by summed (acc) and mean (acc_norm) loss
void lp_evalset_score(const LPEvalSet* s, int e0, int e1, const double* loss, int* acc, int* acc_norm);
void lp_evalset_free(LPEvalSet* s);  // free an eval set

// 9. model (section)
// whether attention kind `attention` keeps its probabilities (CPU loops, cublas path)
int lp_attention_materialised(int attention);
LPZero* lp_model_part(const LPModel* m, int p);  // the model's part p: 0 its dense weights' LPZero, 1 its experts'
// allocate a model of shape cfg, split as the options say (NULL: whole, on this rank)
void lp_model_create(LPModel* m, const LPConfig* cfg, const LPModelOptions* o);
// set the weights from fp32 host values in the canonical (llm.c file) layout
void lp_model_set_weights(LPModel* m, const float* canon);
void lp_model_init_random(LPModel* m, uint64_t seed);  // GPT-2's initialisation from `seed`, the same weights on any grid
// activations for micro-batches of (B, T), `slots` of them in flight
void lp_model_alloc_activations(LPModel* m, int B, int T, int slots);
// forward of (B, T) host tokens; with targets the mean loss (dloss: its gradient's scale)
float lp_model_forward(LPModel* m, const int* inputs, const int* targets, int B, int T, float dloss);
void lp_model_zero_grad(LPModel* m);  // zero the gradients
// backward of the last forward, adding into the gradients (last: the step's last micro-batch)
void lp_model_backward(LPModel* m, int last);
void lp_model_free(LPModel* m);  // free a model

// 10. optimizer (section)
// the global norm of the n models' reduced gradients, the same on every rank (pp: NULL alone)
float lp_models_grad_norm(LPModel* ms, int n, const LPGroup* pp);
// clip to opt->grad_clip given the norm, then AdamW at lr; returns whether all weights stay finite
int lp_models_adamw(LPModel* ms, int n, const LPGroup* pp, float lr, float norm, const LPAdamW* opt);
void lp_loss_window_add(LPLossWindow* w, float loss);  // add a step's loss to the window the spike check reads
// after a step's norm (lp_step_grad_norm): 1 if its gradients overflowed (skip its update; the scale backs
// off), else 0 (a clean step counts toward growth; a norm not finite at scale 1 is left to the divergence guard)
int lp_loss_scaler_update(LPLossScaler* s, float norm);
float lp_loss_window_mean(const LPLossWindow* w);  // the window's mean loss (0 until it is full)
// linear warmup, then cosine (or linear) decay to lr * final_frac at max_steps
float lp_lr_schedule(int step, int max_steps, int warmup, float lr, float final_frac, int cosine);

// 11. costs (section)
size_t lp_active_params(const LPConfig* c);  // the parameters one token meets (a MoE layer's top-K experts, not all)
double lp_flops_per_token(const LPConfig* c, int T);  // training FLOPs per token at sequence length T (3x forward), for MFU
// training FLOPs per token of an average layer (recompute adds its forward again)
double lp_layer_flops(const LPConfig* c, int T, int recompute, int whole);
// training FLOPs per token of pipeline chunk k with `layers` layers
double lp_chunk_flops(const LPConfig* c, const LPPipeShape* s, int k, int layers);
// the most micro-batches whose activations chunk k keeps at once under the schedule
int lp_chunk_slots(const LPPipeShape* s, int k);
// parameters one rank of chunk k holds (its TP slice); *experts: the experts' share
double lp_chunk_params(const LPConfig* c, const LPPipeShape* s, int k, int layers, double* experts);
// bytes one rank of chunk k holds, with `slots` micro-batches' activations
double lp_chunk_memory(const LPConfig* c, const LPPipeShape* s, int k, int layers, int slots);
// layers per chunk (par->partition: uniform, balanced or a list); NULL, or why not
const char* lp_pp_partition(const LPConfig* c, const LPPipeShape* s, int* layers, char* why, size_t size);
double lp_device_peak_flops(void);  // this GPU's dense bf16 peak in FLOP/s, 0 when unknown

// 12. pipeline (section)
// this rank's pipeline stage: its chunks of the model, on base->proc's grid
void lp_stage_create(LPStage* st, const LPConfig* cfg, const LPModelOptions* base, int B, int T);
// one forward of (B, T) tokens through the whole pipeline (evaluation); the mean loss
float lp_stage_forward_only(LPStage* st, const int* inputs, const int* targets, int B, int T);
void lp_stage_time_step(LPStage* st);  // add the last step's timings to the bubble report's sums
LPBubble lp_stage_bubble(LPStage* st);  // the pipeline bubble measured and simulated from those sums
void lp_stage_free(LPStage* st);  // free a stage and its chunks

// 13. step (section)
// m micro-batches forward and backward in the schedule's order; the step's mean loss
float lp_step_forward_backward(LPStage* st, LPDataLoader* train);
void lp_step_reduce_grads(LPStage* st);  // the gradients averaged over the data-parallel replicas (ZeRO: reduce-scattered)
float lp_step_grad_norm(LPStage* st);  // the global gradient norm over the whole grid, the same on every rank
// clipping and AdamW on every chunk, new weights made whole; returns whether all stay finite
int lp_step_update(LPStage* st, float lr, float norm, const LPAdamW* opt);

// 14. files (section)
void lp_config_of_header(const int* h, LPConfig* cfg);  // the shape a model file's header h gives, unchecked
// read a model file's header into cfg; returns its version (3, 5 or 6)
int lp_model_file_header(const char* path, LPConfig* cfg, FILE* f);
// a model file's fp32 weights, read by one rank of `group` and sent to the others
float* lp_model_file_read_shared(const char* path, LPConfig* cfg, const LPGroup* group);
uint32_t lp_crc32c(uint32_t crc, const unsigned char* p, size_t n);  // CRC32C (Castagnoli) of n bytes, continuing from crc
// save the n models (a stage's chunks) and training state as DIR/step_N, atomically; collective
void lp_checkpoint_save(const LPModel* ms, int n_models, const LPTrainState* st, const char* dir, const LPGroup* world);
// one run per output directory: lock dir; the descriptor, or -1 and why
int lp_dir_lock(const char* dir, char* why, size_t size);
int lp_checkpoint_latest(const char* dir, int before);  // the newest complete checkpoint under dir before step `before`, or -1
// what is wrong with DIR/step_N for this config, or NULL
const char* lp_checkpoint_problem(const char* dir, int step, const LPConfig* cfg, int* optim_h, int* state_h, int sums,
                                  char* why, size_t size);
// the model shape of DIR/step_N's model.bin into cfg: 0, or -1 where it has none
int lp_checkpoint_shape(const char* dir, int step, LPConfig* cfg);
char* lp_checkpoint_identity(const char* dir, int step);  // the run identity DIR/step_N/state.bin holds, as a string
// remove all but the newest `keep` checkpoints: 0, or an errno and the path in failed
int lp_checkpoint_prune(const char* dir, int keep, char* failed);
// remove every checkpoint under dir (--overwrite): 0, or an errno and the path in failed
int lp_checkpoint_clear(const char* dir, char* failed, int* hidden);
// load weights, optimizer and training state from DIR/step_N into the n models, any grid
void lp_checkpoint_load(LPModel* ms, int n_models, LPTrainState* st, const char* dir, int step);
int lp_tokenizer_load(LPTokenizer* t, const char* path);  // read llm.c's tokenizer file; 0 (with a notice) when there is none
int lp_sample_start(const LPConfig* c);  // the token a sample starts from: its vocabulary's document start
void lp_utf8_end(LPUtf8* u, FILE* out);  // the text ends: an unfinished character prints as U+FFFD
void lp_tokenizer_print(const LPTokenizer* t, int id, LPUtf8* u, FILE* out);  // print a token's bytes through u, as valid UTF-8
void lp_tokenizer_free(LPTokenizer* t);  // free a tokenizer

// ----------------------------------------------------------------------------------------------------
// 1. basics

// The mutable globals (lp_rank below, the GPU's handles and scratch buffers, the watchdog) are declared in
// every file that includes this header and defined, zero-initialised, in the one that defines
// LLMPAR_IMPLEMENTATION first, so a program has one copy of each, shared by all its files.
#ifdef LLMPAR_IMPLEMENTATION
#define LP_STATE
#else
#define LP_STATE extern
#endif

LP_STATE int lp_rank;  // this process's rank, set by lp_process_init (0 before); only rank 0 prints progress
#ifndef LLMPAR_NO_WATCHDOG
LP_STATE volatile int lp_ending;  // the watchdog (section 5) is ending the job: lp_fail leaves the last word to it
#endif

#ifdef LLMPAR_IMPLEMENTATION
// Print one line naming what failed, then stop every rank with a non-zero exit.
LP_PRINTF(1, 2) void lp_fail(const char* fmt, ...) {
#ifndef LLMPAR_NO_WATCHDOG
    while (lp_ending) pause();  // (an error the watchdog's abort caused, on another thread: its exit comes)
#endif
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "llmpar: error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
#ifdef LLMPAR_MPI
    int inited = 0, world = 1;
    MPI_Initialized(&inited);
    if (inited) MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (world > 1) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
    exit(1);
}

// printf on rank 0 only, flushed so progress shows up at once under mpirun
LP_PRINTF(1, 2) void lp_log(const char* fmt, ...) {
    if (lp_rank != 0) return;
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
}

void* lp_host_malloc(size_t bytes, const char* what) {
    void* p = malloc(bytes ? bytes : 1);
    if (!p) lp_fail("out of host memory allocating %s (%.1f MiB)", what, bytes / 1048576.0);
    return p;
}

// (A folder opens for reading on Linux, and its first read fails: refused here, named as what it is.)
FILE* lp_fopen(const char* path, const char* mode) {
    FILE* f = fopen(path, mode);
    if (!f) lp_fail("cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) lp_fail("%s: is a folder, not a file", path);
    return f;
}

static inline void lp_fread(void* dst, size_t size, size_t count, FILE* f, const char* path) {
    size_t got = fread(dst, size, count, f);
    if (got != count) lp_fail("%s: file is truncated (wanted %zu bytes, got %zu)", path, size * count, size * got);
}

// Writes report the cause (a full disk is the usual one); the caller removes its partial file.
static inline int lp_fwrite(const void* src, size_t size, size_t count, FILE* f) {
    return fwrite(src, size, count, f) == count ? 0 : -1;
}

static inline long long lp_file_size(const char* path) {
    struct stat st;
    if (stat(path, &st) != 0) lp_fail("cannot open %s: %s", path, strerror(errno));
    return (long long)st.st_size;
}

// A NULL-terminated list of names as an error message lists them: "a, b or c".
const char* lp_names_text(char* buf, size_t size, const char* const* names) {
    int n = 0;
    buf[0] = '\0';
    while (names[n]) n++;
    for (int j = 0; j < n; j++)
        snprintf(buf + strlen(buf), size - strlen(buf), "%s%s", j == 0 ? "" : j == n - 1 ? " or " : ", ", names[j]);
    return buf;
}
#endif  // LLMPAR_IMPLEMENTATION

// Format a file path; a path too long for the buffer is an error, never silently cut.
#define LP_PATH_MAX 4096
#ifdef LLMPAR_IMPLEMENTATION
LP_PRINTF(2, 3) void lp_path(char* buf, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, LP_PATH_MAX, fmt, ap);
    va_end(ap);
    if (n < 0 || n >= LP_PATH_MAX) lp_fail("path too long (over %d characters): %.60s...", LP_PATH_MAX, buf);
}

double lp_time_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// xorshift64*: small, fast, and the same sequence on every build
uint32_t lp_rand_u32(uint64_t* state) {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (uint32_t)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}
float lp_rand_f32(uint64_t* state) { return (lp_rand_u32(state) >> 8) / 16777216.0f; }
static inline float lp_rand_normal(uint64_t* state) {  // Box-Muller
    float u1 = lp_rand_f32(state), u2 = lp_rand_f32(state);
    if (u1 < 1e-12f) u1 = 1e-12f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.283185307179586f * u2);
}

#ifndef LLMPAR_CPU
#define cudaCheck(call) lp_cuda_check((call), #call, __FILE__, __LINE__)
static inline void lp_cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) lp_fail("CUDA: %s failed at %s:%d: %s", call, file, line, cudaGetErrorString(err));
}
#define cublasCheck(call) lp_cublas_check((call), #call, __FILE__, __LINE__)
static inline void lp_cublas_check(cublasStatus_t st, const char* call, const char* file, int line) {
    if (st != CUBLAS_STATUS_SUCCESS) lp_fail("cuBLAS: %s failed at %s:%d: status %d", call, file, line, (int)st);
}
#endif
#endif  // LLMPAR_IMPLEMENTATION

// --- the step's timeline (--trace): what this rank does, as begin/end events on its clock, kept in memory
// while lp_trace.on; the driver gathers every rank's and writes them as one Chrome trace (train_gpt.cu).
// An event names what it is ("F", "B", "all-reduce", ...), its kind ("compute", "step", "io", "comm": a
// blocking call, "launch": a collective started without blocking or a send posted, an instant),
// for a collective or a send its group and bytes, for a micro-batch its number and chunk. Off, each mark
// returns at its first test. On the CPU engine the clock is the work's. On the CUDA engine the host's
// events say when the host issued the work; the GPU's own are timed by CUDA events on its streams: each
// micro-batch's forward and backward (and recomputation) on the compute stream, each collective the comm
// stream runs (overlapped reductions and gathers) there, put on the host's clock through one event
// recorded when the trace starts (lp_trace_clock). The same marks are NVTX ranges, the trace on or off,
// so an `nsys profile` of the CUDA engine shows them by the same names (without a profiler a range is a
// test of one pointer).
typedef struct {
    char name[40], kind[8], group[8];  // (fixed sizes, cut to fit: events travel between ranks as bytes)
    double t0, t1;                     // seconds since the trace started (lp_trace_start)
    double bytes;                      // a collective's tensor, a send's or receive's message; else 0
    int micro, chunk, peer;            // -1 where they do not apply
    int track;                         // where it ran: 0 the host, 1 the GPU's compute stream, 2 its comm stream, 3 the ring's
} LPTraceEvent;
typedef struct {
    int on;
    double origin;  // lp_time_s() at the start
    LPTraceEvent* ev;
    int n, cap;
    int wait;       // 1 + the event of the blocking call under way (lp_watch's), or 0
#ifndef LLMPAR_CPU
    cudaEvent_t* marks;  // event i's begin (2i) and end (2i+1) on its stream, where its track is a stream
    cudaEvent_t zero;    // recorded on the compute stream when the host's clock read zero_t (lp_trace_clock)
    double zero_t;
    int stream_event;    // 1 + the comm stream's event under way (a collective being enqueued), or 0
#endif
} LPTrace;
LP_STATE LPTrace lp_trace;

#ifdef LLMPAR_IMPLEMENTATION
// A new event on the host's track (the trace is on).
static inline int lp_trace_new(const char* kind, const char* name, int micro, int chunk) {
    if (lp_trace.n == lp_trace.cap) {
        int cap = lp_trace.cap ? 2 * lp_trace.cap : 1024;
        LPTraceEvent* grown = (LPTraceEvent*)realloc(lp_trace.ev, (size_t)cap * sizeof(LPTraceEvent));
        if (!grown) lp_fail("out of host memory for the trace's %d events", cap);
        lp_trace.ev = grown;
#ifndef LLMPAR_CPU
        cudaEvent_t* marks = (cudaEvent_t*)realloc(lp_trace.marks, 2 * (size_t)cap * sizeof(cudaEvent_t));
        if (!marks) lp_fail("out of host memory for the trace's %d events", cap);
        memset(marks + 2 * lp_trace.cap, 0, 2 * (size_t)(cap - lp_trace.cap) * sizeof(cudaEvent_t));
        lp_trace.marks = marks;
#endif
        lp_trace.cap = cap;
    }
    LPTraceEvent* e = &lp_trace.ev[lp_trace.n];
    memset(e, 0, sizeof(*e));
    snprintf(e->kind, sizeof(e->kind), "%.*s", (int)sizeof(e->kind) - 1, kind);
    snprintf(e->name, sizeof(e->name), "%.*s", (int)sizeof(e->name) - 1, name);
    e->micro = micro;
    e->chunk = chunk;
    e->peer = -1;
    e->t0 = lp_time_s() - lp_trace.origin;
    return lp_trace.n++;
}
#ifndef LLMPAR_CPU
// Event id's begin (end = 0) or end (1) as the stream reaches it, on stream s.
static inline void lp_trace_mark(int id, int end, cudaStream_t s) {
    cudaEvent_t* m = &lp_trace.marks[2 * id + end];
    if (!*m) cudaCheck(cudaEventCreate(m));  // (made once, kept for later windows)
    cudaCheck(cudaEventRecord(*m, s));
}
#endif
// Begin an event; returns its number for lp_trace_end (-1 when off). The CUDA build: an NVTX range too,
// on or off, and the compute kind ("F", "B", "recompute") timed on the compute stream.
static inline int lp_trace_begin(const char* kind, const char* name, int micro, int chunk) {
#if !defined(LLMPAR_CPU) && !defined(LLMPAR_NO_NVTX)
    nvtxRangePushA(name);
#endif
    if (!lp_trace.on) return -1;
    int id = lp_trace_new(kind, name, micro, chunk);
#ifndef LLMPAR_CPU
    if (strcmp(kind, "compute") == 0) lp_trace.ev[id].track = 1, lp_trace_mark(id, 0, 0);
#endif
    return id;
}
// A communication event on the host (the trace is on): its group ("tp", "dp", ...; NULL: none), bytes and
// peer (-1: a collective).
static inline int lp_trace_comm(const char* name, const char* group, double bytes, int peer) {
    int id = lp_trace_new("comm", name, -1, -1);
    snprintf(lp_trace.ev[id].group, sizeof(lp_trace.ev[id].group), "%.*s", (int)sizeof(lp_trace.ev[id].group) - 1, group ? group : "");
    lp_trace.ev[id].bytes = bytes;
    lp_trace.ev[id].peer = peer;
    return id;
}
// End an event of lp_trace_new's (no NVTX range).
static inline void lp_trace_close(int id) {
    if (id < 0) return;
    lp_trace.ev[id].t1 = lp_time_s() - lp_trace.origin;
#ifndef LLMPAR_CPU
    if (lp_trace.ev[id].track == 1) lp_trace_mark(id, 1, 0);
#endif
}
// End an event of lp_trace_begin's (and its NVTX range).
static inline void lp_trace_end(int id) {
#if !defined(LLMPAR_CPU) && !defined(LLMPAR_NO_NVTX)
    nvtxRangePop();
#endif
    lp_trace_close(id);
}
#ifndef LLMPAR_CPU
// The trace's clock on the GPU: the compute stream's zero event, reached now (the GPU idle), at the host's
// zero_t. Called as the trace starts.
static inline void lp_trace_clock(void) {
    if (!lp_trace.zero) cudaCheck(cudaEventCreate(&lp_trace.zero));
    cudaCheck(cudaDeviceSynchronize());
    cudaCheck(cudaEventRecord(lp_trace.zero, 0));
    cudaCheck(cudaEventSynchronize(lp_trace.zero));
    lp_trace.zero_t = lp_time_s() - lp_trace.origin;
}
// The GPU's events on the host's clock, once the window's work is done: each stream event's begin and end
// as their records were reached, counted from the zero event.
static inline void lp_trace_device_times(void) {
    cudaCheck(cudaDeviceSynchronize());
    for (int i = 0; i < lp_trace.n; i++) {
        LPTraceEvent* e = &lp_trace.ev[i];
        if (!e->track) continue;
        float ms0 = 0.0f, ms1 = 0.0f;
        cudaCheck(cudaEventElapsedTime(&ms0, lp_trace.zero, lp_trace.marks[2 * i]));
        cudaCheck(cudaEventElapsedTime(&ms1, lp_trace.zero, lp_trace.marks[2 * i + 1]));
        e->t0 = lp_trace.zero_t + 1e-3 * ms0;
        e->t1 = lp_trace.zero_t + 1e-3 * (ms1 > ms0 ? ms1 : ms0);
    }
}
#endif

// Device memory: cudaMalloc on the CUDA build, malloc on the CPU build. Out of memory names the buffer
// and says how much was needed and how much is free.
static inline void* lp_device_malloc(size_t bytes, const char* what) {
#ifdef LLMPAR_CPU
    return lp_host_malloc(bytes, what);
#else
    void* p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1);
    if (err == cudaErrorMemoryAllocation) {
        size_t free_b = 0, total_b = 0;
        cudaGetLastError();
        cudaMemGetInfo(&free_b, &total_b);
        lp_fail("out of GPU memory allocating %s: need %.1f MiB, %.1f MiB free of %.1f MiB (try a smaller -b)",
                what, bytes / 1048576.0, free_b / 1048576.0, total_b / 1048576.0);
    }
    cudaCheck(err);
    return p;
#endif
}
static inline void lp_device_free(void* p) {
#ifdef LLMPAR_CPU
    free(p);
#else
    cudaCheck(cudaFree(p));
#endif
}
// Page-locked host memory, zeroed: the CUDA build's copies to and from it run at full PCIe speed and
// asynchronously (malloc on the CPU build).
static inline void* lp_pinned_malloc(size_t bytes, const char* what) {
#ifdef LLMPAR_CPU
    void* p = lp_host_malloc(bytes ? bytes : 1, what);
#else
    void* p = NULL;
    if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();
        lp_fail("out of pinned host memory allocating %s: need %.1f MiB", what, bytes / 1048576.0);
    }
#endif
    memset(p, 0, bytes);
    return p;
}
static inline void lp_pinned_free(void* p) {
    if (!p) return;
#ifdef LLMPAR_CPU
    free(p);
#else
    cudaCheck(cudaFreeHost(p));
#endif
}
static inline void lp_copy_to_device(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;  // (an empty part's pointer may be one past its end)
#ifdef LLMPAR_CPU
    memcpy(dst, src, bytes);
#else
    cudaCheck(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
#endif
}
static inline void lp_copy_to_host(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;  // (an empty part's pointer may be one past its end)
#ifdef LLMPAR_CPU
    memcpy(dst, src, bytes);
#else
    cudaCheck(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
#endif
}
static inline void lp_copy_device(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;  // (an empty part's pointer may be one past its end)
#ifdef LLMPAR_CPU
    memcpy(dst, src, bytes);
#else
    cudaCheck(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
#endif
}
static inline void lp_device_zero(void* p, size_t bytes) {
#ifdef LLMPAR_CPU
    // a block per thread: one core's stores cannot fill the memory bus (a step zeroes all gradients)
#pragma omp parallel if (bytes >= (1 << 20))
    {
#ifdef _OPENMP
        size_t k = (size_t)omp_get_thread_num(), n = (size_t)omp_get_num_threads();
#else
        size_t k = 0, n = 1;
#endif
        size_t a = bytes / n * k, b = k + 1 == n ? bytes : bytes / n * (k + 1);
        memset((char*)p + a, 0, b - a);
    }
#else
    cudaCheck(cudaMemset(p, 0, bytes));
#endif
}
#endif  // LLMPAR_IMPLEMENTATION

#ifndef LLMPAR_CPU
// Page-locked host memory for the copies below (they then run at full PCIe speed); grows on demand.
LP_STATE void* lp_pinned;
LP_STATE size_t lp_pinned_bytes;
#ifdef LLMPAR_IMPLEMENTATION
static inline floatX* lp_pinned_buffer(size_t n) {
    if (n * sizeof(floatX) > lp_pinned_bytes) {
        lp_pinned_free(lp_pinned);
        lp_pinned = lp_pinned_malloc(n * sizeof(floatX), "a staging buffer");
        lp_pinned_bytes = n * sizeof(floatX);
    }
    return (floatX*)lp_pinned;
}
#endif  // LLMPAR_IMPLEMENTATION
#endif

#ifdef LLMPAR_IMPLEMENTATION
#ifndef LLMPAR_CPU
// The compute type (bf16 or fp16) to float, and float to it rounded to nearest (even), on the host and the GPU.
static LP_HD inline float lp_bf(floatX x) {
#ifdef LLMPAR_FP16
    return __half2float(x);
#else
    return __bfloat162float(x);
#endif
}
static LP_HD inline floatX lp_xf(float x) {
#ifdef LLMPAR_FP16
    return __float2half_rn(x);
#else
    return __float2bfloat16_rn(x);
#endif
}
#endif

// Host floats <-> device values of the compute type (loading weights; reading params, grads, logits;
// staging collectives over MPI).
static inline void lp_to_floatX(floatX* dst, const float* src, size_t n) {  // host to host, rounded to nearest
#ifdef LLMPAR_CPU
    memcpy(dst, src, n * sizeof(float));
#else
    for (size_t i = 0; i < n; i++) dst[i] = lp_xf(src[i]);
#endif
}
static inline void lp_to_device_floatX(floatX* dst, const float* src, size_t n) {
#ifdef LLMPAR_CPU
    memcpy(dst, src, n * sizeof(float));
#else
    floatX* tmp = lp_pinned_buffer(n);
    lp_to_floatX(tmp, src, n);
    lp_copy_to_device(dst, tmp, n * sizeof(floatX));
#endif
}

void lp_to_host_float(float* dst, const floatX* src, size_t n) {
#ifdef LLMPAR_CPU
    memcpy(dst, src, n * sizeof(float));
#else
    floatX* tmp = lp_pinned_buffer(n);
    lp_copy_to_host(tmp, src, n * sizeof(floatX));
    for (size_t i = 0; i < n; i++) dst[i] = lp_bf(tmp[i]);
#endif
}
#endif  // LLMPAR_IMPLEMENTATION

// ----------------------------------------------------------------------------------------------------
// 2. config

// Limits, each a bound on an array sized by it, and each checked where its value is read.
#define LP_MAX_LAYERS 1024  // a model's layers (model files asking for more are refused)
#define LP_MAX_CHUNKS 1024  // pipeline chunks, p x v
#define LP_MAX_SHARDS 1024  // data-parallel ranks ZeRO shards over
#define LP_MAX_EXPERTS 1024 // experts of a MoE layer
#define LP_MAX_TOPK 16      // experts per token

typedef struct LPConfig {
    int max_seq_len;        // T of the position table (wpe), and the longest sequence (RoPE too)
    int vocab_size;         // V: real tokens (50257 for GPT-2)
    int padded_vocab_size;  // Vp: V rounded up so the LM head matmul is fast (50304); padding rows stay 0
    int num_layers;         // L
    int num_heads;          // NH
    int channels;           // C
    // mixture of experts (0 experts: a dense model): layer l's MLP is moe_experts expert MLPs of the dense
    // one's shape when l % moe_every == 0 (every layer for 1), each token sent to moe_topk of them (section 9)
    int moe_experts, moe_topk, moe_every;
    // the architecture's family, each choice on its own (zeros: GPT-2's; the Llama 3 family sets all six):
    int rope;               // positions: 0 learned (wpe), 1 rotary (RoPE on q and k: rope_theta, rope_scaled)
    int rmsnorm;            // norms: 0 LayerNorm (weight and bias), 1 RMSNorm (weight; no centering)
    int swiglu;             // MLP: 0 GELU of 4C, 1 SwiGLU of lp_ffn_hidden (ffn_dim_multiplier, multiple_of)
    int num_kv_heads;       // attention's K and V heads (grouped-query): 0 or NH multi-head, 1 multi-query
    int no_bias;            // 1: no biases in the projections (Llama)
    int untied;             // 1: the LM head is a tensor of its own (headw), not wte
    int rope_scaled;        // Llama 3.1's scaled RoPE (factor 8, low 1, high 4, original context 8192)
    int multiple_of;        // SwiGLU's hidden size is a multiple of it
    float ffn_dim_multiplier;  // and scaled by it first (0: not)
    float rope_theta;       // RoPE's base (Llama 3: 500000)
    float norm_eps;         // the norms' epsilon (0: GPT-2's 1e-5)
} LPConfig;

// LPConfig's fields by what they mean, for errors that say how two shapes differ (lp_config_differs); the
// mixture of experts' three, then the family's (the last three floats, compared by their bits).
static const struct { const char* what; size_t offset; } lp_config_fields[] = {
    {"layers", offsetof(LPConfig, num_layers)}, {"channels", offsetof(LPConfig, channels)}, {"heads", offsetof(LPConfig, num_heads)},
    {"vocabulary size", offsetof(LPConfig, vocab_size)}, {"padded vocabulary size", offsetof(LPConfig, padded_vocab_size)},
    {"maximum sequence length", offsetof(LPConfig, max_seq_len)}, {"experts per MoE layer", offsetof(LPConfig, moe_experts)},
    {"experts per token (top-k)", offsetof(LPConfig, moe_topk)}, {"MoE layer spacing (every)", offsetof(LPConfig, moe_every)},
    {"positions (rope)", offsetof(LPConfig, rope)}, {"norm (rmsnorm)", offsetof(LPConfig, rmsnorm)},
    {"MLP (swiglu)", offsetof(LPConfig, swiglu)}, {"KV heads", offsetof(LPConfig, num_kv_heads)},
    {"biases (no_bias)", offsetof(LPConfig, no_bias)}, {"head (untied)", offsetof(LPConfig, untied)},
    {"scaled RoPE", offsetof(LPConfig, rope_scaled)}, {"SwiGLU multiple_of", offsetof(LPConfig, multiple_of)},
    {"SwiGLU ffn_dim_multiplier", offsetof(LPConfig, ffn_dim_multiplier)}, {"RoPE theta", offsetof(LPConfig, rope_theta)},
    {"norm epsilon", offsetof(LPConfig, norm_eps)}};
// Field k's value as an int (the floats' bits: what lp_config_differs compares).
static inline int lp_config_field(const LPConfig* c, int k) {
    int v;
    memcpy(&v, (const char*)c + lp_config_fields[k].offset, sizeof(v));
    return v;
}
#define LP_CONFIG_FIELD(c, k) lp_config_field(c, k)

#ifdef LLMPAR_IMPLEMENTATION
// The first of lp_config_fields in which a and b differ, or -1.
int lp_config_differs(const LPConfig* a, const LPConfig* b) {
    for (int k = 0; k < (int)(sizeof(lp_config_fields) / sizeof(lp_config_fields[0])); k++)
        if (LP_CONFIG_FIELD(a, k) != LP_CONFIG_FIELD(b, k)) return k;
    return -1;
}
#endif  // LLMPAR_IMPLEMENTATION

// The family's derived sizes: K and V heads (grouped-query attention: query head h reads KV head
// h / (NH / KV)); the MLP's hidden size H as Llama computes it (2/3 of 4C, times ffn_dim_multiplier, rounded up
// to a multiple of multiple_of; GELU's: 4C); the norms' epsilon.
static inline int lp_kv_heads(const LPConfig* c) { return c->num_kv_heads ? c->num_kv_heads : c->num_heads; }
static inline int lp_ffn_hidden(const LPConfig* c) {
    if (!c->swiglu) return 4 * c->channels;
    long h = 2 * (4L * c->channels) / 3, k = c->multiple_of > 0 ? c->multiple_of : 1;
    if (c->ffn_dim_multiplier > 0.0f) h = (long)(c->ffn_dim_multiplier * (float)h);  // (float, as Llama's Python computes it)
    return (int)((h + k - 1) / k * k);
}
static inline size_t lp_qkv_rows(const LPConfig* c) {  // q's NH heads, then k's and v's KV heads each
    return (size_t)c->channels + 2 * (size_t)lp_kv_heads(c) * (c->channels / c->num_heads);
}
static inline float lp_norm_eps(const LPConfig* c) { return c->norm_eps > 0.0f ? c->norm_eps : 1e-5f; }
// Whether the config is GPT-2's architecture (learned positions, LayerNorm, GELU, multi-head attention, biases,
// tied head); else the Llama family's (or a mixture of its choices).
static inline int lp_config_is_gpt2(const LPConfig* c) {
    return !c->rope && !c->rmsnorm && !c->swiglu && lp_kv_heads(c) == c->num_heads && !c->no_bias && !c->untied;
}

// The parameter tensors in file order: llm.c's 16, the untied LM head, then a mixture of experts' 5 (none
// in a dense model). Weights are (out, in) row-major. A layer tensor holds one matrix per layer that has it:
// the dense MLP's four in the dense layers, the router and the experts' four in the MoE layers, the rest in
// every layer. A tensor the family lacks has size 0: wpe with RoPE, the LayerNorm biases with RMSNorm, the
// projections' biases without biases, headw with a tied head. So a dense Llama's are llm.c's Llama 3 file's
// tensors in its order (wte, ln1w, qkvw, attprojw, ln2w, fcw, fcprojw, lnfw, headw), but for fcw: per layer
// SwiGLU's gate and up blocks, where llm.c's file holds every layer's up (c_fc), then every layer's gate (c_fc2).
enum {
    LP_WTE, LP_WPE, LP_LN1W, LP_LN1B, LP_QKVW, LP_QKVB, LP_ATTPROJW, LP_ATTPROJB,
    LP_LN2W, LP_LN2B, LP_FCW, LP_FCB, LP_FCPROJW, LP_FCPROJB, LP_LNFW, LP_LNFB,
    LP_HEADW, LP_ROUTERW, LP_EXPFCW, LP_EXPFCB, LP_EXPFCPROJW, LP_EXPFCPROJB, LP_NUM_PARAMS
};
static const char* const lp_param_names[LP_NUM_PARAMS] = {
    "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
    "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb",
    "headw", "routerw", "expfcw", "expfcb", "expfcprojw", "expfcprojb"};

// Tensor parallelism splits each tensor of the (out, in) weight matrices one of three ways:
//   rows     column-parallel layers (qkv, fc, each expert's fc) and the vocab-parallel wte and headw: each
//            rank holds 1/t of the outputs of each block of rows (qkv: 1/t of the heads in each of q, k and
//            v, so its rows come in 3 blocks, of NH, KV and KV heads; SwiGLU's fc: of its gate and up; the
//            experts' fc: 1/t of each expert's, E blocks, 2E with SwiGLU);
//   columns  row-parallel layers (attproj, fcproj, the experts' fcproj): each rank holds 1/t of the inputs;
//   none     replicated: wpe, LayerNorms, the router, and the row-parallel biases (added once, after the
//            reduction; an expert's, before its gate: by TP rank 0).
enum { LP_REPLICATED, LP_SPLIT_ROWS, LP_SPLIT_COLS };
static const int lp_param_split[LP_NUM_PARAMS] = {
    LP_SPLIT_ROWS, LP_REPLICATED, LP_REPLICATED, LP_REPLICATED, LP_SPLIT_ROWS, LP_SPLIT_ROWS, LP_SPLIT_COLS, LP_REPLICATED,
    LP_REPLICATED, LP_REPLICATED, LP_SPLIT_ROWS, LP_SPLIT_ROWS, LP_SPLIT_COLS, LP_REPLICATED, LP_REPLICATED, LP_REPLICATED,
    LP_SPLIT_ROWS, LP_REPLICATED, LP_SPLIT_ROWS, LP_SPLIT_ROWS, LP_SPLIT_COLS, LP_REPLICATED};

#ifdef LLMPAR_IMPLEMENTATION
int lp_is_layer_tensor(int i) { return (i >= LP_LN1W && i <= LP_FCPROJB) || i >= LP_ROUTERW; }
// The experts' four: with expert parallelism each rank holds some of the experts (section 9's LPModel.experts).
int lp_is_expert_tensor(int i) { return i >= LP_EXPFCW; }
static inline int lp_is_moe_layer(const LPConfig* c, int l) { return c->moe_experts > 0 && l % c->moe_every == 0; }
// Whether layer l (of the model) has tensor i.
static inline int lp_layer_has(const LPConfig* c, int i, int l) {
    if (i >= LP_FCW && i <= LP_FCPROJB) return !lp_is_moe_layer(c, l);
    if (i >= LP_ROUTERW) return lp_is_moe_layer(c, l);
    return lp_is_layer_tensor(i);
}
// How many of the layers [l0, l1) have tensor i (the MoE layers among them: the multiples of every).
int lp_layers_having(const LPConfig* c, int i, int l0, int l1) {
    if (!lp_is_layer_tensor(i) || l1 <= l0) return 0;
    int moe = c->moe_experts > 0 ? (l1 + c->moe_every - 1) / c->moe_every - (l0 + c->moe_every - 1) / c->moe_every : 0;
    return i >= LP_ROUTERW ? moe : i >= LP_FCW && i <= LP_FCPROJB ? l1 - l0 - moe : l1 - l0;
}

// Whether the family has tensor i (sizes 0 where not).
static inline int lp_family_has(const LPConfig* c, int i) {
    switch (i) {
        case LP_WPE: return !c->rope;
        case LP_LN1B: case LP_LN2B: case LP_LNFB: return !c->rmsnorm;
        case LP_QKVB: case LP_ATTPROJB: case LP_FCB: case LP_FCPROJB: case LP_EXPFCB: case LP_EXPFCPROJB: return !c->no_bias;
        case LP_HEADW: return c->untied;
        default: return 1;
    }
}

// Tensor i as `count` matrices (one per layer that has it, or one) of rows x cols, the rows in `blocks` blocks
// that TP splits separately (lp_param_block: 3 for q, k, v; 2 for SwiGLU's gate and up; E for the experts'
// fc, 2E with SwiGLU: each expert's gate, then its up; else 1). A vector is a matrix of one row (or one column,
// when it is the bias of a rows-split layer).
static inline void lp_param_shape(const LPConfig* c, int i, size_t* count, size_t* rows, size_t* cols, int* blocks) {
    size_t C = c->channels, E = c->moe_experts, QKV = lp_qkv_rows(c);
    size_t H = lp_ffn_hidden(c), F = c->swiglu ? 2 * H : H;  // the MLP's hidden size, and fc's rows (SwiGLU: gate, up)
    *count = lp_is_layer_tensor(i) ? (size_t)lp_layers_having(c, i, 0, c->num_layers) : 1;
    int gated = c->swiglu ? 2 : 1;  // (fc's blocks in an MLP: SwiGLU's gate and up)
    *blocks = i == LP_QKVW || i == LP_QKVB ? 3 : i == LP_EXPFCW || i == LP_EXPFCB ? (int)E * gated : i == LP_FCW || i == LP_FCB ? gated : 1;
    *rows = 1;
    *cols = C;
    switch (i) {
        case LP_WTE: case LP_HEADW: *rows = c->padded_vocab_size; break;
        case LP_WPE: *rows = c->max_seq_len; break;
        case LP_QKVW: *rows = QKV; break;
        case LP_QKVB: *rows = QKV; *cols = 1; break;
        case LP_ATTPROJW: *rows = C; break;
        case LP_FCW: *rows = F; break;
        case LP_FCB: *rows = F; *cols = 1; break;
        case LP_FCPROJW: *rows = C; *cols = H; break;
        case LP_ROUTERW: *rows = E; break;
        case LP_EXPFCW: *rows = E * F; break;
        case LP_EXPFCB: *rows = E * F; *cols = 1; break;
        case LP_EXPFCPROJW: *rows = E * C; *cols = H; break;
        case LP_EXPFCPROJB: *rows = E; break;
        default: break;  // LayerNorm weights and biases, row-parallel biases: one row of C
    }
    if (!lp_family_has(c, i)) *count = 0;
}

// Block k of tensor i's rows (lp_param_shape's blocks): its first row, returns its rows. Equal blocks but qkv's:
// q's NH heads, then k's and v's KV heads each.
static inline size_t lp_param_block(const LPConfig* c, int i, int k, size_t* r0) {
    size_t count, rows, cols;
    int blocks;
    lp_param_shape(c, i, &count, &rows, &cols, &blocks);
    if (i == LP_QKVW || i == LP_QKVB) {
        size_t C = c->channels, KVC = (rows - C) / 2;
        *r0 = k == 0 ? 0 : C + (size_t)(k - 1) * KVC;
        return k == 0 ? C : KVC;
    }
    *r0 = k * (rows / blocks);
    return rows / blocks;
}

// Sizes of the tensors one rank of a t-way tensor-parallel group holds (t = 1: the whole model).
void lp_param_sizes(size_t* sizes, const LPConfig* c, int t) {  // (LP_NUM_PARAMS sizes)
    for (int i = 0; i < LP_NUM_PARAMS; i++) {
        size_t count, rows, cols;
        int blocks;
        lp_param_shape(c, i, &count, &rows, &cols, &blocks);
        sizes[i] = count * rows * cols / (lp_param_split[i] == LP_REPLICATED ? 1 : t);
    }
}

size_t lp_config_num_params(const LPConfig* c) {
    size_t sizes[LP_NUM_PARAMS], n = 0;
    lp_param_sizes(sizes, c, 1);
    for (int i = 0; i < LP_NUM_PARAMS; i++) n += sizes[i];
    return n;
}

// Where the canonical values [canon, canon + n) of a model of shape c lie in its llm.c model file's values: a
// GPT-2 file holds the canonical layout (lp_param_shape's); a Llama 3 file the same tensors but for V rows of wte
// and the head where the canonical has Vp (the padding zero), and fcw, which the file holds as every layer's up,
// then every layer's gate, and the canonical as each layer's gate, then up (its two blocks). Returns how many of
// them (at least 1, at most n) lie one after another in the file from its value *file, or are padding rows the
// file lacks (*file = -1).
static inline size_t lp_file_run(const LPConfig* c, size_t canon, size_t n, long long* file) {
    *file = (long long)canon;
    if (!c->untied) return n;
    size_t at = 0, fat = 0, C = c->channels, HC = (size_t)lp_ffn_hidden(c) * C, VC = (size_t)c->vocab_size * C;
    for (int i = 0; i < LP_NUM_PARAMS; i++) {
        size_t count, rows, cols, end, o = canon - at;
        int blocks;
        lp_param_shape(c, i, &count, &rows, &cols, &blocks);
        size_t size = count * rows * cols, head = i == LP_WTE || i == LP_HEADW;
        if (canon >= at + size) {
            at += size;
            fat += head ? VC : size;
            continue;
        }
        if (head && o >= VC) {  // padding rows
            *file = -1;
            end = size;
        } else if (i == LP_FCW) {  // layer l's gate (block 0) is the file's gate l, after the L ups; its up (1) the file's up l
            size_t l = o / (2 * HC), up = o / HC % 2;
            *file = (long long)(fat + (up ? l : count + l) * HC + o % HC);
            end = o - o % HC + HC;
        } else {
            *file = (long long)(fat + o);
            end = head ? VC : size;
        }
        return end - o < n ? end - o : n;
    }
    lp_fail("internal: canonical value %zu outside the model's %zu", canon, at);
    return 0;
}

// Matrices get weight decay; biases and LayerNorm parameters do not (as in GPT-2 and llm.c).
static inline int lp_param_decays(int i) {
    return i == LP_WTE || i == LP_WPE || i == LP_QKVW || i == LP_ATTPROJW || i == LP_FCW || i == LP_FCPROJW || i == LP_HEADW || i == LP_ROUTERW ||
           i == LP_EXPFCW || i == LP_EXPFCPROJW;
}

#define LP_FLASH_MAX_HS 128  // the largest head the CUDA build's attention kernels take (register tiles)
// `source` names where the config came from (a file or a flag) so the error can say so.
void lp_config_validate(const LPConfig* c, const char* source) {
    if (c->num_layers < 1 || c->channels < 1 || c->num_heads < 1 || c->max_seq_len < 1 || c->vocab_size < 1)
        lp_fail("%s: model shape must be positive (L=%d C=%d NH=%d maxT=%d V=%d)", source, c->num_layers,
                c->channels, c->num_heads, c->max_seq_len, c->vocab_size);
    if (c->num_layers > LP_MAX_LAYERS || c->channels > 65536 || c->max_seq_len > 1 << 20 || c->padded_vocab_size > 1 << 17)
        lp_fail("%s: model shape out of range (L=%d of at most %d, C=%d of 65536, maxT=%d of 1048576, padded V=%d of 131072)",
                source, c->num_layers, LP_MAX_LAYERS, c->channels, c->max_seq_len, c->padded_vocab_size);
    if (c->channels % c->num_heads != 0)
        lp_fail("%s: channels %d not divisible by heads %d", source, c->channels, c->num_heads);
    if (c->padded_vocab_size < c->vocab_size)
        lp_fail("%s: padded vocab %d smaller than vocab %d", source, c->padded_vocab_size, c->vocab_size);
    if (c->moe_experts < 0 || c->moe_experts > LP_MAX_EXPERTS)
        lp_fail("%s: %d experts per MoE layer, outside 0 .. %d", source, c->moe_experts, LP_MAX_EXPERTS);
    if (c->moe_experts && (c->moe_topk < 1 || c->moe_topk > c->moe_experts || c->moe_topk > LP_MAX_TOPK))
        lp_fail("%s: top-%d routing: a token's experts must be 1 .. %d, at most the layer's %d", source, c->moe_topk, LP_MAX_TOPK,
                c->moe_experts);
    if (c->moe_experts && c->moe_every < 1) lp_fail("%s: MoE every %d layers: must be 1 or more", source, c->moe_every);
    int KV = lp_kv_heads(c);
    if (KV < 1 || KV > c->num_heads || c->num_heads % KV)
        lp_fail("%s: %d KV heads do not divide the %d heads into equal groups", source, KV, c->num_heads);
    if (c->swiglu && (c->multiple_of < 1 || c->ffn_dim_multiplier < 0.0f || !(lp_ffn_hidden(c) > 0 && lp_ffn_hidden(c) <= 1 << 20)))
        lp_fail("%s: SwiGLU's hidden size from multiple_of %d and ffn_dim_multiplier %g is %d, not 1 .. 1048576", source, c->multiple_of,
                c->ffn_dim_multiplier, lp_ffn_hidden(c));
    if (c->rope && (c->channels / c->num_heads % 2 || !(c->rope_theta > 1.0f) || !isfinite(c->rope_theta)))
        lp_fail("%s: RoPE needs an even head size (C/NH = %d) and a theta above 1 (%g)", source, c->channels / c->num_heads, c->rope_theta);
    if (!(c->norm_eps >= 0.0f && c->norm_eps < 1.0f)) lp_fail("%s: norm epsilon %g outside [0, 1)", source, c->norm_eps);
#ifndef LLMPAR_CPU
    if (c->channels / c->num_heads > LP_FLASH_MAX_HS)
        lp_fail("%s: head size C/NH = %d/%d = %d is above %d, the most the CUDA build's flash attention takes (more heads, or "
                "./train_gpt_cpu)", source, c->channels, c->num_heads, c->channels / c->num_heads, LP_FLASH_MAX_HS);
#endif
}

// A new model's shape by name: "dN" (GPT-2's sizes for d12/d24/d36/d48, else head size 64 with N heads;
// maxT 1024) or "L,C,NH[,V]" (any shape: GPT-3 175B is 96,12288,96; V 50257 unless given, padded to a
// multiple of 128; maxT 2048). "llama:" before either is the Llama 3 family's (RoPE theta 500000, RMSNorm
// eps 1e-5, SwiGLU of multiple_of 256, no biases, untied head) of that shape, "llama:dN" with N/2 KV heads
// (N odd: N) and "llama:L,C,NH,KV[,V]" with KV. Returns 0 when `name` is none of these (a file name); the
// shape is checked by lp_config_validate.
int lp_config_from_name(LPConfig* c, const char* name) {
    int llama = strncmp(name, "llama:", 6) == 0;
    if (llama) name += 6;
    long v[5] = {0, 0, 0, 0, 50257};  // L, C, NH, KV (llama), V
    int n = 0, most = llama ? 5 : 4;
    if (name[0] == 'd') {
        if (name[1] == '\0') return 0;
        for (const char* p = name + 1; *p; p++) if (*p < '0' || *p > '9') return 0;
        v[0] = strtol(name + 1, NULL, 10);
    } else {
        long got[5];
        for (const char* p = name;;) {  // numbers and commas only
            char* end;
            if (*p < '0' || *p > '9') return 0;
            got[n++] = strtol(p, &end, 10);
            if (*end == '\0') break;
            if (*end != ',' || n == most) return 0;
            p = end + 1;
        }
        if (n < most - 1) return 0;
        for (int k = 0; k < n; k++) v[k < 3 || llama ? k : 4] = got[k];  // (GPT-2's 4th number is V)
    }
    for (int k = 0; k < 5; k++) if (v[k] > 1 << 20) v[k] = 1 << 20;  // lp_config_validate refuses it; this keeps ints
    memset(c, 0, sizeof(*c));  // dense, GPT-2's family
    c->num_layers = (int)v[0];
    c->max_seq_len = n ? 2048 : 1024;
    c->vocab_size = (int)v[4];
    c->padded_vocab_size = (int)((v[4] + 127) / 128 * 128);
    if (n) { c->channels = (int)v[1]; c->num_heads = (int)v[2]; }
    else if (v[0] == 12 && !llama) { c->channels = 768; c->num_heads = 12; }
    else if (v[0] == 24 && !llama) { c->channels = 1024; c->num_heads = 16; }
    else if (v[0] == 36 && !llama) { c->channels = 1280; c->num_heads = 20; }
    else if (v[0] == 48 && !llama) { c->channels = 1600; c->num_heads = 25; }
    else { c->channels = 64 * (int)v[0]; c->num_heads = (int)v[0]; }
    if (llama) {
        c->rope = c->rmsnorm = c->swiglu = c->no_bias = c->untied = 1;
        c->num_kv_heads = n ? (int)v[3] : c->num_heads % 2 ? c->num_heads : c->num_heads / 2;
        c->multiple_of = 256;
        c->rope_theta = 500000.0f;
        c->norm_eps = 1e-5f;
    }
    return 1;
}
#endif  // LLMPAR_IMPLEMENTATION

// ----------------------------------------------------------------------------------------------------
// 3. topology
//
// How training is split over the ranks is one LPParallel, every parallel setting declared once: a
// program's designated initialisers (or train_gpt.cu's flags) fill it; lp_grid_init places the ranks by
// it, and the model, the pipeline stage, the costs and the plan read it. The letters are Megatron-LM's: a
// grid of t x d x p ranks, v model chunks per pipeline stage, m micro-batches per step.
typedef struct LPParallel {
    int tp, dp, pp;          // t, d, p: tensor, data and pipeline parallel sizes (dp: the ranks left, lp_grid_init sets it)
    int ep;                  // expert parallelism inside DP: a MoE layer's experts split over ep of the d ranks (section 9)
    int cp;                  // context parallelism: each sequence's tokens split over cp ranks, attention a ring (section 9)
    int vpp;                 // v: model chunks per pipeline stage (interleaving)
    int schedule;            // the pipeline's order of forwards and backwards, LP_SCHEDULE_* (section 4)
    const char* partition;   // layers per chunk: "balanced", "uniform" or a list "L1,L2,..." (lp_pp_partition)
    int micro_batches;       // m: micro-batches per step (the pipeline's; gradient accumulation)
    int sp;                  // sequence parallelism inside the TP group (t > 1)
    int scatter_gather;      // a pipeline boundary sent 1/t by each TP rank, all-gathered by the receivers
    int zero;                // ZeRO stage 0..3 over DP (section 8)
    int overlap;             // the layers' gradients reduced during backward, overlapped with the layers below
    float bucket_mb;         // ZeRO-0 with overlap: layers reduced together once this many MiB of them are done
    int recompute;           // which activations backward recomputes, LP_RECOMPUTE_* (section 9)
    int offload;             // where the optimizer state lives, LP_OFFLOAD_* (section 8)
    const char* offload_dir; // LP_OFFLOAD_NVME's directory
    const char* comm;        // the transport of device tensors: "auto", "nccl" or "mpi" (lp_comm_init)
    // data-parallel replicas that train apart, no gradient all-reduce between them (section 10, lp_replicas_*):
    int diloco;              // DiLoCo: H inner steps, then one outer step on the replicas' mean change (0: off)
    int gossip;              // gossip: after each step a replica mixes its weights with K neighbours' (0: off)
} LPParallel;

// The values of its schedule, offload and recompute fields, with their flags' names (what each does:
// sections 4, 8 and 9).
enum { LP_SCHEDULE_GPIPE, LP_SCHEDULE_1F1B, LP_SCHEDULE_INTERLEAVED };
static const char* const lp_schedule_names[] = {"gpipe", "1f1b", "interleaved", NULL};
enum { LP_OFFLOAD_NONE, LP_OFFLOAD_NVME, LP_OFFLOAD_OPTIMIZER, LP_OFFLOAD_PARAMS };
static const char* const lp_offload_names[] = {"none", "nvme", "optimizer", "params", NULL};
enum { LP_RECOMPUTE_NONE, LP_RECOMPUTE_SELECTIVE, LP_RECOMPUTE_FULL };
static const char* const lp_recompute_names[] = {"none", "selective", "full", NULL};

// One rank alone, nothing split: a model made without a grid; a start for a program's own LPParallel (the
// defaults of train_gpt.cu's flags).
static const LPParallel lp_parallel_one = {
    1, 1, 1,           // tp, dp, pp
    1, 1,              // ep, cp
    1,                 // vpp
    LP_SCHEDULE_1F1B,  // schedule
    "balanced",        // partition
    1,                 // micro_batches
    0, 1,              // sp, scatter_gather
    0, 1, 25.0f,       // zero, overlap, bucket_mb
    LP_RECOMPUTE_NONE, LP_OFFLOAD_NONE, "",  // recompute, offload, offload_dir
    "auto",            // comm
    0, 0               // diloco, gossip
};

// Errors about a setting name it as the user of the program knows it: "LPParallel.tp", or what the
// program's lp_setting_namer returns for that field (train_gpt.cu: its flag, "--tp").
LP_STATE const char* (*lp_setting_namer)(size_t offset);  // offsetof(LPParallel, field) -> a name, or NULL
#ifdef LLMPAR_IMPLEMENTATION
static inline const char* lp_setting_name(size_t offset, const char* field) {
    const char* name = lp_setting_namer ? lp_setting_namer(offset) : NULL;
    return name ? name : field;
}
#endif  // LLMPAR_IMPLEMENTATION
#define LP_SETTING(field) lp_setting_name(offsetof(LPParallel, field), "LPParallel." #field)

// The grid as data: its axes, innermost first. TP is innermost because tensor-parallel ranks exchange the
// most data (they should share a node), then CP (its ring sends each layer's keys and values), then DP, then
// PP outermost. A rank's coordinate on an axis is its rank divided by the sizes of the axes inside, modulo
// the axis's size:
//     rank = ((pp_rank * d + dp_rank) * cp + cp_rank) * t + tp_rank
// and each axis has a group: the ranks that differ from this one on that axis alone. A new axis is one
// entry here (and one size in LPParallel).
// Context parallelism's cp ranks hold the same weights and each a share of every sequence of their replica's
// batch, so the gradients are averaged, and ZeRO shards, over the cp x d ranks together (group LP_DPCP,
// Megatron-LM's data-parallel group with context parallelism; lp_dp_group).
// Expert parallelism splits DP in two (Megatron-LM's expert and expert-data-parallel groups): the d ranks
// are d/ep replicas of ep neighbours, dp_rank = edp_rank * ep + ep_rank. The ep neighbours (group LP_EP)
// hold a MoE layer's experts between them and send each other the tokens (section 9); the replicas of
// the same experts (group LP_EDP) average those experts' gradients. Dense tensors stay with LP_DP. With
// both, each cp rank sends its own rows' tokens to the ep neighbours of its cp coordinate, and the experts'
// gradients average over the edp replicas' cp ranks (group LP_EDPCP).
enum { LP_TP, LP_CP, LP_DP, LP_PP, LP_AXES, LP_EP = LP_AXES, LP_EDP, LP_DPCP, LP_EDPCP, LP_GROUPS };
typedef struct {
    const char* name;  // the group's, in error messages
    size_t size;       // offsetof(LPParallel, its size)
} LPAxis;
static const LPAxis lp_axes[LP_AXES] = {{"tp", offsetof(LPParallel, tp)}, {"cp", offsetof(LPParallel, cp)},
                                        {"dp", offsetof(LPParallel, dp)}, {"pp", offsetof(LPParallel, pp)}};
#ifdef LLMPAR_IMPLEMENTATION
static inline int lp_axis_size(const LPParallel* par, int a) { return *(const int*)((const char*)par + lp_axes[a].size); }
#endif  // LLMPAR_IMPLEMENTATION

typedef struct LPGroup {
#ifdef LLMPAR_MPI
    MPI_Comm comm;
#endif
#ifdef LLMPAR_NCCL
    ncclComm_t nccl;   // NULL: this group's collectives go over MPI
    ncclComm_t ring;   // the cp group's second communicator, for its ring's exchanges on a stream of their own
#endif
    int rank, size;
    const char* name;  // "tp", "cp", "dp", "pp", "ep", "edp", "dpcp" or "world", for error messages
    // device-tensor traffic so far, per kind of operation (LP_ALL_REDUCE, ...): calls, and bytes of the
    // whole tensor each moved (an all-reduce's buffer; a reduce-scatter's input; an all-gather's output;
    // what a send sent)
    long long calls[5];
    double bytes[5];
} LPGroup;
enum { LP_ALL_REDUCE, LP_REDUCE_SCATTER, LP_ALL_GATHER, LP_SEND, LP_ALL_TO_ALL };

// The watchdog (section 5) watches the set-up too: MPI's start, the splits into groups, NCCL's start
// (LLMPAR_NO_WATCHDOG: these do nothing).
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_watchdog_start(double timeout_s);
static inline void lp_watchdog_stop(void);
static inline double lp_watchdog_timeout_or(double fallback);
static inline void lp_watch_phase(const char* what);
static inline void lp_watch(const char* what, const LPGroup* g);
static inline void lp_watch_done(void);
#endif  // LLMPAR_IMPLEMENTATION

typedef struct LPProcess {
    int rank, world;
    const LPParallel* par;          // the grid's sizes and every parallel setting (lp_grid_init)
    int coord[LP_GROUPS];           // this rank's coordinate on each axis (and DP's two): coord[LP_TP] is its TP rank
    LPGroup group[LP_GROUPS];       // its group on each: group[LP_CP] runs the ring attention, group[LP_EP] holds the experts,
                                    //   lp_dp_group averages the gradients
    LPGroup world_group;
    int device;                     // the GPU this rank uses (CUDA build)
    int gpus;                       // distinct GPUs in the run (ranks may share one, as in tests on one GPU)
    int shares_gpu_with;            // a rank driving this rank's GPU too, or -1
} LPProcess;

#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_mpi_finalize(void) {
#ifdef LLMPAR_MPI
    int inited = 0;
    MPI_Initialized(&inited);
    if (inited) MPI_Finalize();
#endif
}

// Every rank stops together, after its error was printed.
static inline void lp_exit_all(void) {
    lp_mpi_finalize();
    exit(1);
}

// An error that every rank detects alike (a flag, the grid): printed once, by rank 0; every rank exits.
LP_PRINTF(1, 2) void lp_fail_all(const char* fmt, ...) {
    if (lp_rank == 0) {
        va_list ap;
        va_start(ap, fmt);
        fprintf(stderr, "llmpar: error: ");
        vfprintf(stderr, fmt, ap);
        fprintf(stderr, "\n");
        va_end(ap);
        fflush(stderr);
    }
    lp_exit_all();
}

// Replicas that train apart (diloco, gossip) hold each its whole state, weights and optimizer alike: nothing
// that shards or spreads across the d data-parallel ranks (ZeRO, expert parallelism, the optimizer state
// elsewhere) goes with them. Every rank checks alike; one line names the settings.
static inline void lp_replicas_check(const LPParallel* par) {
    const char* mode = par->diloco ? LP_SETTING(diloco) : LP_SETTING(gossip);
    int value = par->diloco ? par->diloco : par->gossip;
    if (par->diloco < 0 || par->gossip < 0)
        lp_fail_all("%s %d %s %d: must be >= 0 (0: off)", LP_SETTING(diloco), par->diloco, LP_SETTING(gossip), par->gossip);
    if (!value) return;
    if (par->diloco && par->gossip)
        lp_fail_all("%s %d and %s %d: two ways of training the replicas apart; choose one", LP_SETTING(diloco), par->diloco,
                    LP_SETTING(gossip), par->gossip);
    if (par->dp < 2)
        lp_fail_all("%s %d: needs 2 or more data-parallel replicas, this grid has d = ranks / (t p) = %d", mode, value, par->dp);
    int most = 0;  // the most neighbours: hops 2^(K-1) < d
    while (most < 30 && (1 << most) < par->dp) most++;
    if (par->gossip > most)
        lp_fail_all("%s %d: the graph's hops 1, 2, ..., 2^(K-1) must each be below d = %d, so that the K neighbours are distinct "
                    "replicas (K <= %d here)", mode, value, par->dp, most);
    if (par->zero)
        lp_fail_all("%s %d with %s %d: ZeRO shards the weights and optimizer state over the data-parallel replicas, which %s "
                    "trains apart (each holds its whole state); use %s 0", mode, value, LP_SETTING(zero), par->zero, mode,
                    LP_SETTING(zero));
    if (par->ep > 1)
        lp_fail_all("%s %d with %s %d: expert parallelism spreads the experts over the data-parallel replicas, which %s trains "
                    "apart", mode, value, LP_SETTING(ep), par->ep, mode);
    if (par->offload)  // (not LP_OFFLOAD_NONE, 0)
        lp_fail_all("%s %d with %s %s: the replicas' exchange works on the optimizer state in memory", mode, value, LP_SETTING(offload),
                    lp_offload_names[par->offload]);
}

// Place this rank on the grid par describes, d = world / (t cp p) (par->dp is set), and make its group on
// each axis. par is the caller's and must outlive proc.
void lp_grid_init(LPProcess* proc, LPParallel* par) {
    const char *tp = LP_SETTING(tp), *pp = LP_SETTING(pp);
    long long tpp = (long long)par->tp * par->cp * par->pp, world = proc->world;
    char cp[64] = "";  // (named where it is set: the messages of a grid without it stay t*p's)
    if (par->cp != 1) snprintf(cp, sizeof(cp), " %s %d", LP_SETTING(cp), par->cp);
    const char* product = par->cp != 1 ? "t*cp*p" : "t*p";
    if (par->tp < 1 || par->pp < 1 || par->ep < 1 || par->cp < 1)
        lp_fail_all("%s %d%s %s %d %s %d: sizes must be >= 1", tp, par->tp, cp, pp, par->pp, LP_SETTING(ep), par->ep);
    if (tpp > world)
        lp_fail_all("%s %d%s %s %d: the grid needs at least %s = %lld ranks, this run has %d", tp, par->tp, cp, pp, par->pp, product, tpp,
                    proc->world);
    if (world % tpp)
        lp_fail_all("%s %d%s %s %d: %s = %lld does not divide the %d ranks (world = %s*d)", tp, par->tp, cp, pp, par->pp, product, tpp,
                    proc->world, product);
    par->dp = (int)(world / tpp);
    proc->par = par;
    int stride = 1;
    for (int a = 0; a < LP_AXES; a++) {
        int n = lp_axis_size(par, a);
        LPGroup* g = &proc->group[a];
        proc->coord[a] = proc->rank / stride % n;
        g->name = lp_axes[a].name;
        g->size = n;
        g->rank = proc->coord[a];
#ifdef LLMPAR_MPI
        // groups of one need no communicator (nor MPI_Init); the members of a group share every other
        // coordinate, so the rank with this one zeroed names the group
        if (proc->world > 1) {
            lp_watch("splitting the world into groups (MPI_Comm_split)", NULL);
            MPI_Comm_split(MPI_COMM_WORLD, proc->rank - proc->coord[a] * stride, proc->coord[a], &g->comm);
            lp_watch_done();
            MPI_Comm_set_errhandler(g->comm, MPI_ERRORS_RETURN);  // so failures name the collective
        }
#endif
        stride *= n;
    }
    if (par->dp % par->ep)
        lp_fail_all("%s %d: expert parallelism splits the d = %d data-parallel ranks, which %d does not divide", LP_SETTING(ep), par->ep,
                    par->dp, par->ep);
    LPGroup* dpcp = &proc->group[LP_DPCP];  // the ranks sharing this one's t and p coordinates, in rank order
    dpcp->name = "dpcp";
    dpcp->size = par->cp * par->dp;
    dpcp->rank = proc->coord[LP_DP] * par->cp + proc->coord[LP_CP];
#ifdef LLMPAR_MPI
    if (proc->world > 1 && par->cp > 1) {  // (cp = 1: lp_dp_group is the dp group)
        lp_watch("splitting the world into groups (MPI_Comm_split)", NULL);
        MPI_Comm_split(MPI_COMM_WORLD, proc->coord[LP_TP] + proc->coord[LP_PP] * par->tp, dpcp->rank, &dpcp->comm);
        lp_watch_done();
        MPI_Comm_set_errhandler(dpcp->comm, MPI_ERRORS_RETURN);
    }
#endif
    int dp_rank = proc->coord[LP_DP], sub[2] = {dp_rank % par->ep, dp_rank / par->ep}, sizes[2] = {par->ep, par->dp / par->ep};
    for (int k = 0; k < 2; k++) {  // DP's two: ep neighbours, and the replicas of this rank's place among them
        LPGroup* g = &proc->group[LP_EP + k];
        proc->coord[LP_EP + k] = sub[k];
        g->name = k ? "edp" : "ep";
        g->size = sizes[k];
        g->rank = sub[k];
#ifdef LLMPAR_MPI
        if (proc->world > 1) {
            lp_watch("splitting the world into groups (MPI_Comm_split)", NULL);
            MPI_Comm_split(proc->group[LP_DP].comm, sub[1 - k], sub[k], &g->comm);
            lp_watch_done();
            MPI_Comm_set_errhandler(g->comm, MPI_ERRORS_RETURN);
        }
#endif
    }
    LPGroup* edpcp = &proc->group[LP_EDPCP];  // the dpcp ranks of this one's ep coordinate (cp 1: edp is it)
    edpcp->name = "edpcp";
    edpcp->size = par->cp * sizes[1];
    edpcp->rank = sub[1] * par->cp + proc->coord[LP_CP];
#ifdef LLMPAR_MPI
    if (proc->world > 1 && par->cp > 1 && par->ep > 1) {
        lp_watch("splitting the world into groups (MPI_Comm_split)", NULL);
        MPI_Comm_split(dpcp->comm, sub[0], edpcp->rank, &edpcp->comm);
        lp_watch_done();
        MPI_Comm_set_errhandler(edpcp->comm, MPI_ERRORS_RETURN);
    }
#endif
    lp_replicas_check(par);
}

// The ranks that hold the same weights and average their gradients (ZeRO shards over them): the d
// data-parallel replicas, and with context parallelism every cp rank of each (cp x d ranks, each of which
// trains on its share of its replica's tokens).
const LPGroup* lp_dp_group(const LPProcess* proc) { return proc->par->cp > 1 ? &proc->group[LP_DPCP] : &proc->group[LP_DP]; }
// With expert parallelism, the ranks that hold the same experts and average their gradients: the edp replicas
// (and with context parallelism each one's cp ranks).
static inline const LPGroup* lp_experts_group(const LPProcess* proc) {
    return proc->par->cp > 1 ? &proc->group[LP_EDPCP] : &proc->group[LP_EDP];
}
#endif  // LLMPAR_IMPLEMENTATION

#ifndef LLMPAR_CPU
LP_STATE cublasLtHandle_t lp_cublaslt;
LP_STATE void* lp_cublaslt_workspace;
static const size_t lp_cublaslt_workspace_size = 32 << 20;
LP_STATE cudaDeviceProp lp_device_prop;
#endif

#ifdef LLMPAR_IMPLEMENTATION
// Whether model c splits over t tensor-parallel ranks (its query heads, K/V heads, MLP width and padded vocabulary):
// NULL, or why not (written into why). Layers over pipeline stages: lp_pp_partition. Grouped-query attention's KV
// K/V heads split as the query heads do, each rank keeping whole groups (query heads with their K/V head), so t must
// divide KV, as Megatron-LM asks too: with t > KV a K/V head would be replicated over t/KV ranks, a tensor replicated
// within part of the group whose gradients those ranks sum, which nothing else here is.
const char* lp_tp_check(const LPConfig* c, int t, char* why, size_t size) {
    int KV = lp_kv_heads(c), H = lp_ffn_hidden(c);
    if (c->num_heads % t)
        snprintf(why, size, "%s %d: the model's %d heads do not split evenly over %d tensor-parallel ranks", LP_SETTING(tp), t, c->num_heads, t);
    else if (KV % t)
        snprintf(why, size, "%s %d: the model's %d K/V heads do not split evenly over %d tensor-parallel ranks (grouped-query "
                 "attention: each rank keeps whole K/V heads, none is replicated)", LP_SETTING(tp), t, KV, t);
    else if (H % t)
        snprintf(why, size, "%s %d: the MLP width %d does not split evenly over %d tensor-parallel ranks", LP_SETTING(tp), t, H, t);
    else if (c->padded_vocab_size % t)
        snprintf(why, size, "%s %d: the padded vocabulary %d does not split evenly over %d tensor-parallel ranks", LP_SETTING(tp),
                 t, c->padded_vocab_size, t);
    else
        return NULL;
    return why;
}
// Every rank checks alike, so rank 0 alone prints.
void lp_grid_check(const LPProcess* proc, const LPConfig* c) {
    char why[256];
    if (lp_tp_check(c, proc->par->tp, why, sizeof(why))) lp_fail_all("%s", why);
}

// Starts MPI (when built with it) and learns this process's rank; lp_grid_init places it on the grid.
// A process started alone (no mpirun or srun: none of their variables) is the whole world and skips
// MPI_Init, whose singleton start-up costs seconds (the tests start hundreds of one-rank runs).
static inline int lp_launched_by_mpi(void) {
    const char* vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_FD"};
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++)
        if (getenv(vars[i])) return 1;
    return 0;
}

// OpenBLAS picks its kernels for the CPU it recognises when it loads, and a release older than the CPU
// falls back to an older set: Debian 12's 0.3.21 runs AMD Zen 4 on its AVX2 Haswell kernels, at about half
// the sgemm rate of its AVX-512 SkylakeX ones (245 against 457 GFLOP/s on 2 cores). The set to use instead
// of `chosen`, or NULL: SkylakeX where the CPU has the AVX-512 its kernels use (F, BW, DQ, VL) and OpenBLAS
// chose a set without AVX-512.
static inline int lp_cpu_has_avx512(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}
static inline const char* lp_blas_better_kernels(const char* chosen, int avx512) {
    static const char* with_avx512[] = {"SkylakeX", "Cooperlake", "SapphireRapids"};
    if (!avx512) return NULL;
    for (int k = 0; k < 3; k++)
        if (strcmp(chosen, with_avx512[k]) == 0) return NULL;
    return "SkylakeX";
}
// The BLAS set up for the engine, first thing (before MPI starts, so each rank does so). Where
// lp_blas_better_kernels names a set and the user set no OPENBLAS_CORETYPE, the program executes itself
// again with it set (OpenBLAS reads it only as it loads; LLMPAR_NO_REEXEC: never, OpenBLAS's choice runs).
// An OpenBLAS built with its own threads (not OpenMP's) keeps one: the engine's tiles are the parallelism
// (lp_gemm_strided_cpu).
static inline void lp_blas_init(char** argv) {
#if defined(LLMPAR_CPU) && defined(OPENBLAS_VERSION)
    if (openblas_get_parallel() == 1) openblas_set_num_threads(1);
#endif
#if defined(LLMPAR_CPU) && defined(OPENBLAS_VERSION) && !defined(LLMPAR_NO_REEXEC)
    if (getenv("OPENBLAS_CORETYPE")) return;
    const char* better = lp_blas_better_kernels(openblas_get_corename(), lp_cpu_has_avx512());
    if (!better) return;
    setenv("OPENBLAS_CORETYPE", better, 1);
    execv("/proc/self/exe", argv);  // returns only on failure: then the kernels OpenBLAS chose run
#else
    (void)argv;
#endif
}

// OpenMP's threads at most the cores this process may run on, before any parallel region: more only
// oversubscribe them, and an absurd OMP_NUM_THREADS (100000) crashes inside the OpenMP runtime at the first
// region. A notice says so. Results do not depend on the thread count (fixed-order reductions).
static inline void lp_threads_bound(void) {
#ifdef _OPENMP
    cpu_set_t set;
    int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    int asked = omp_get_max_threads();
    if (cores < 1 || asked <= cores) return;
    omp_set_num_threads(cores);
    lp_log("notice: %d OpenMP threads asked (OMP_NUM_THREADS), %d cores to run them: using %d\n", asked, cores, cores);
#endif
}

void lp_process_init(LPProcess* proc, int* argc, char*** argv) {
    lp_blas_init(*argv);
    memset(proc, 0, sizeof(*proc));
    proc->world = 1;
    proc->shares_gpu_with = -1;
#ifdef LLMPAR_MPI
    if (lp_launched_by_mpi()) {
        // the watchdog from MPI's start on: a rank that never comes, or stops in the set-up, ends the job
        // (its timeout: lp_watchdog.timeout_s where the program set it before this call, else 10 minutes)
        lp_watchdog_start(lp_watchdog_timeout_or(600.0));
        lp_watch_phase("MPI's start (MPI_Init)");
        MPI_Init(argc, argv);
        MPI_Comm_rank(MPI_COMM_WORLD, &proc->rank);
        MPI_Comm_size(MPI_COMM_WORLD, &proc->world);
        lp_rank = proc->rank;
        if (proc->world > 1) {  // the world group, before any grid (a program may plan its grid over it: --auto)
            MPI_Comm_dup(MPI_COMM_WORLD, &proc->world_group.comm);
            MPI_Comm_set_errhandler(proc->world_group.comm, MPI_ERRORS_RETURN);
        }
        if (proc->world == 1) lp_watchdog_stop();  // (nobody to wait for)
        lp_watch_phase("the set-up");
    }
#else
    (void)argc;
    (void)argv;
#endif
    lp_rank = proc->rank;
    proc->world_group.name = "world";
    proc->world_group.size = proc->world;
    proc->world_group.rank = proc->rank;
    lp_threads_bound();
}

// Picks the GPU from the launcher's local rank (Open MPI, then Slurm, else rank) and sets up cuBLASLt.
void lp_device_init(LPProcess* proc) {
#ifdef LLMPAR_CPU
    (void)proc;
#else
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0)  // without a driver CUDA only says the driver is "insufficient"
        lp_fail("no CUDA GPU found (%s); the CPU engine is `make train_gpt_cpu && ./train_gpt_cpu`",
                access("/proc/driver/nvidia/version", F_OK) != 0 ? "no NVIDIA driver is loaded on this machine"
                : err != cudaSuccess                             ? cudaGetErrorString(err)
                                                                 : "the driver sees no device");
    const char* local = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    if (!local) local = getenv("SLURM_LOCALID");
    proc->device = (local ? atoi(local) : proc->rank) % count;
    cudaCheck(cudaSetDevice(proc->device));
    cudaCheck(cudaGetDeviceProperties(&lp_device_prop, proc->device));
    cublasCheck(cublasLtCreate(&lp_cublaslt));
    lp_cublaslt_workspace = lp_device_malloc(lp_cublaslt_workspace_size, "cuBLASLt workspace");
#endif
}

// Wait for the GPU's queued work (timing); nothing on the CPU build.
void lp_device_sync(void) {
#ifndef LLMPAR_CPU
    cudaCheck(cudaDeviceSynchronize());
#endif
}

// Wait for the compute stream only, not for the communication streams: a pipeline's NCCL sends wait
// there for their receivers, and waiting for them would make sends block.
static inline void lp_compute_sync(void) {
#ifndef LLMPAR_CPU
    cudaCheck(cudaStreamSynchronize(0));
#endif
}

// Device memory in use right now in MiB (CUDA build; 0 on the CPU build). All of llmpar's buffers are
// allocated at start-up, so after the first step this is the run's peak.
double lp_device_memory_used_mib(void) {
#ifdef LLMPAR_CPU
    return 0.0;
#else
    size_t free_b = 0, total_b = 0;
    cudaCheck(cudaMemGetInfo(&free_b, &total_b));
    return (total_b - free_b) / 1048576.0;
#endif
}

#ifdef OPENBLAS_VERSION
static inline const char* lp_openblas_version(void) {  // "0.3.21" from " OpenBLAS 0.3.21 "
    static char v[64];
    if (sscanf(OPENBLAS_VERSION, " OpenBLAS %63s", v) != 1) snprintf(v, sizeof(v), "?");
    return v;
}
#endif
// One line saying what computes: the GPU's name, or the CPU's matmul kernels and thread count.
const char* lp_engine_name(void) {
    static char name[512];
#ifdef LLMPAR_CPU
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    char matmuls[256];
#if defined(OPENBLAS_VERSION)
    snprintf(matmuls, sizeof(matmuls), "OpenBLAS %s matmuls on its %s kernels", lp_openblas_version(), openblas_get_corename());
#elif defined(LLMPAR_BLAS)
    snprintf(matmuls, sizeof(matmuls), "BLAS matmuls");
#else
    snprintf(matmuls, sizeof(matmuls), "plain-loop matmuls (no BLAS was found at build time)");
#endif
    snprintf(name, sizeof(name), "CPU, fp32, %s, %d OpenMP threads", matmuls, threads);
#else
    snprintf(name, sizeof(name), "CUDA, " LP_FLOATX_NAME " with fp32 master weights, %s", lp_device_prop.name);
#endif
    return name;
}

#ifdef LLMPAR_NCCL
static inline void lp_nccl_comm_destroy(ncclComm_t comm);  // section 5
#endif
void lp_process_finish(LPProcess* proc) {
#ifdef LLMPAR_NCCL
    for (int a = 0; a < LP_GROUPS; a++) {
        if (proc->group[a].nccl) lp_nccl_comm_destroy(proc->group[a].nccl);
        if (proc->group[a].ring) lp_nccl_comm_destroy(proc->group[a].ring);
    }
#endif
#ifndef LLMPAR_CPU
    if (lp_cublaslt_workspace) {
        lp_device_free(lp_cublaslt_workspace);
        cublasLtDestroy(lp_cublaslt);
    }
#endif
#ifdef LLMPAR_CUDNN
    lp_cudnn_free();
#endif
    (void)proc;
    lp_mpi_finalize();
}
#endif  // LLMPAR_IMPLEMENTATION

// ----------------------------------------------------------------------------------------------------
// 4. schedules
//
// Pipeline parallelism runs m micro-batches through p stages. The model's layers are cut into p*v chunks
// (v "virtual stages" per rank, interleaving); stage s owns chunks s, s+p, s+2p, ... A schedule is, for
// each stage, the ordered list of its actions: forward or backward of (micro-batch, chunk). The messages
// follow from the chunks: a forward of virtual stage k = chunk*p + s receives its input from k-1 and
// sends its output to k+1; a backward receives from k+1 and sends to k-1. These are pure functions of
// (schedule, p, v, m, s); lp_schedule_simulate runs them against each other to prove they fit. The
// schedules' values, LP_SCHEDULE_*, sit beside LPParallel (section 3).

typedef struct LPAction {
    int forward;  // 1 forward, 0 backward
    int micro;    // micro-batch 0 .. m-1
    int chunk;    // this stage's chunk 0 .. v-1 (virtual stage chunk*p + s)
} LPAction;

#ifdef LLMPAR_IMPLEMENTATION
// Why (schedule, p, v, m) cannot run, or NULL when it can. The settings name the fix.
static inline const char* lp_schedule_check(int kind, int p, int v, int m, char* why, size_t size) {
    if (p < 1 || v < 1 || m < 1)
        snprintf(why, size, "%s %d, %s %d and %d micro-batches (%s) must be >= 1", LP_SETTING(pp), p, LP_SETTING(vpp), v, m,
                 LP_SETTING(micro_batches));
    else if (kind != LP_SCHEDULE_INTERLEAVED && v != 1)
        snprintf(why, size, "%s %d: chunks per stage need %s interleaved (%s runs one chunk per stage)", LP_SETTING(vpp), v,
                 LP_SETTING(schedule), lp_schedule_names[kind]);
    else if (kind == LP_SCHEDULE_INTERLEAVED && m % p != 0)
        snprintf(why, size, "%s interleaved: the %d micro-batches per step (%s) must be a multiple of %s %d", LP_SETTING(schedule),
                 m, LP_SETTING(micro_batches), LP_SETTING(pp), p);
    else return NULL;
    return why;
}

// A stage's k-th forward (or backward) in the 1F1B orders: micro-batches go in groups of p through each
// chunk in turn (forwards chunk 0 first, backwards the last chunk first).
static inline LPAction lp_schedule_action(int k, int forward, int p, int v) {
    LPAction a;
    int chunk = k % (p * v) / p;
    a.forward = forward;
    a.micro = k / (p * v) * p + k % p;
    a.chunk = forward ? chunk : v - 1 - chunk;
    return a;
}

// Stage s's actions, in order, into out (2*m*v of them).
//   gpipe (all forwards, then all backwards): every stage holds all m micro-batches' activations.
//   1f1b: stage s runs p-s-1 warm-up forwards, then alternates one forward and one backward, then drains
//     the backwards: at most p-s micro-batches in flight, the same bubble as gpipe.
//   interleaved 1f1b (Megatron-LM): the same with v chunks per stage, taken in groups of p micro-batches
//     (chunk 0 for micro-batches 0..p-1, chunk 1 for them, ..., then the next p); the warm-up is
//     2(p-s-1) + (v-1)p chunk-forwards, and the bubble shrinks v times. When m = p it is all warm-up.
// (Stage s's warm-up: the forwards before its first backward, at most all m v of them; gpipe's are all.)
static inline int lp_schedule_warmup(int kind, int p, int v, int m, int s) {
    int total = m * v, warmup = kind == LP_SCHEDULE_GPIPE ? total : kind == LP_SCHEDULE_1F1B ? p - s - 1 : m == p ? total : 2 * (p - s - 1) + (v - 1) * p;
    return warmup < total ? warmup : total;
}
int lp_schedule_stage(int kind, int p, int v, int m, int s, LPAction* out) {
    int n = 0, total = m * v;
    if (kind == LP_SCHEDULE_GPIPE) {
        for (int i = 0; i < m; i++) { out[n].forward = 1; out[n].micro = i; out[n++].chunk = 0; }
        for (int i = 0; i < m; i++) { out[n].forward = 0; out[n].micro = i; out[n++].chunk = 0; }
        return n;
    }
    int warmup = lp_schedule_warmup(kind, p, v, m, s);
    for (int k = 0; k < warmup; k++) out[n++] = lp_schedule_action(k, 1, p, v);
    for (int k = 0; k < total - warmup; k++) {
        out[n++] = lp_schedule_action(k + warmup, 1, p, v);
        out[n++] = lp_schedule_action(k, 0, p, v);
    }
    for (int k = total - warmup; k < total; k++) out[n++] = lp_schedule_action(k, 0, p, v);
    return n;
}
#endif  // LLMPAR_IMPLEMENTATION

// The result of running every stage's list: each action's start time, and what the run shows.
typedef struct LPSimulation {
    int p, v, m, per_stage;  // per_stage = 2*m*v actions
    LPAction* actions;       // (p, per_stage): stage s's list
    double* start;           // (p, per_stage): when each action starts
    double f, b;             // cost of one chunk's forward and backward ...
    double* cost;            // ... or (2, p*v) of each virtual stage: forwards, then backwards (NULL: f, b)
    double link;             // the time a message between two stages takes (0: none)
    int blocking;            // 1: a stage that sends a message waits until it is delivered (0: it sends and goes on)
    double alone;            // how much faster a stage runs while the others wait (> 1: they share cores that a
                             // waiting stage leaves to the rest, the CPU engine's ranks on fewer cores; 1: GPUs)
    double makespan;         // when the last action ends
    double work;             // the busiest stage's compute: m*v*(f+b) with uniform costs
    double bubble;           // idle share of the busiest stage: (makespan - work) / work
    int* peak;               // (p): most micro-batch chunks whose activations a stage holds at once
} LPSimulation;

#ifdef LLMPAR_IMPLEMENTATION
// Run sim's lists (sim->actions) with sim's costs per chunk forward and backward, in time order: an action
// starts when its stage is free and its input has arrived (each message between stages taking sim->link;
// with sim->blocking a stage is free only once the message its last action sent is delivered). While n of
// the p stages run, each runs at min(sim->alone, p/n) times its cost's pace (1 with alone <= 1). Each
// stage's list must hold each (micro-batch, chunk) forward and backward once, a backward after its forward.
// Returns NULL, or why not (an action out of range or repeated, a backward before its forward, or the
// stages waiting on each other forever, naming each waiting action).
const char* lp_schedule_run(LPSimulation* sim, char* why, size_t size) {
    int p = sim->p, v = sim->v, m = sim->m, per = sim->per_stage, V = p * v;
    sim->makespan = 0.0;
    // done[(fwd, virtual stage, micro)]: when that action ends, -1 until it has run
    double* done = (double*)lp_host_malloc((size_t)2 * V * m * sizeof(double), "schedule");
    int* next = (int*)lp_host_malloc((size_t)p * sizeof(int), "schedule");
    double* free_at = (double*)lp_host_malloc((size_t)p * sizeof(double), "schedule");
    double* left = (double*)lp_host_malloc((size_t)p * sizeof(double), "schedule");  // the running action's work left, -1 idle
    for (size_t i = 0; i < (size_t)2 * V * m; i++) done[i] = -1.0;
    const char* err = NULL;
    for (int s = 0; s < p && !err; s++) {
        next[s] = 0;
        free_at[s] = 0.0;
        left[s] = -1.0;
        sim->peak[s] = 0;
        LPAction* a = sim->actions + (size_t)s * per;
        int* seen = (int*)calloc((size_t)2 * v * m, sizeof(int));  // each (fwd, chunk, micro) once
        for (int k = 0; k < per && !err; k++) {
            if (a[k].micro < 0 || a[k].micro >= m || a[k].chunk < 0 || a[k].chunk >= v || seen[(a[k].forward * v + a[k].chunk) * m + a[k].micro]++) {
                snprintf(why, size, "stage %d: action %d (%s of micro-batch %d, chunk %d) is out of range or repeated", s, k,
                         a[k].forward ? "forward" : "backward", a[k].micro, a[k].chunk);
                err = why;
            }
        }
        free(seen);
    }
    int remaining = p * per, running = 0;
    int* in_flight = (int*)calloc((size_t)p, sizeof(int));
    double now = 0.0;
    while (remaining > 0 && !err) {
        double soonest = INFINITY;  // the next time a stage that waits could start
        for (int s = 0; s < p && !err; s++) {  // start every action whose stage is free and whose input is there
            if (left[s] >= 0.0 || next[s] == per) continue;
            LPAction* a = sim->actions + (size_t)s * per + next[s];
            int k = a->chunk * p + s;  // virtual stage
            double ready;
            if (a->forward) {
                ready = k == 0 ? 0.0 : done[((size_t)1 * V + k - 1) * m + a->micro];
                if (k > 0 && ready >= 0.0) ready += sim->link;
            } else {
                double fwd = done[((size_t)1 * V + k) * m + a->micro];
                if (fwd < 0.0) {  // (this stage's earlier actions have all ended: its forward is later in the list)
                    snprintf(why, size, "stage %d: backward of micro-batch %d, chunk %d comes before its forward", s, a->micro, a->chunk);
                    err = why;
                    break;
                }
                ready = k == V - 1 ? fwd : done[((size_t)0 * V + k + 1) * m + a->micro];
                if (k < V - 1 && ready >= 0.0) ready += sim->link;
            }
            if (ready < 0.0) continue;  // its input has not been produced yet: a finish will produce it
            double t0 = fmax(ready, free_at[s]);
            if (t0 > now) {
                soonest = fmin(soonest, t0);
                continue;
            }
            sim->start[(size_t)s * per + next[s]] = now;
            left[s] = sim->cost ? sim->cost[(size_t)!a->forward * V + k] : a->forward ? sim->f : sim->b;
            running++;
            in_flight[s] += a->forward ? 1 : -1;
            if (in_flight[s] > sim->peak[s]) sim->peak[s] = in_flight[s];
        }
        if (err) break;
        if (running == 0) {
            if (soonest < INFINITY) {
                now = soonest;
                continue;
            }  // every unfinished stage waits on another: a deadlock; name them all
            size_t len = (size_t)snprintf(why, size, "deadlock, stages wait forever:");
            for (int s = 0; s < p && len < size; s++)
                if (next[s] < per) {
                    LPAction* a = sim->actions + (size_t)s * per + next[s];
                    len += (size_t)snprintf(why + len, size - len, " stage %d at its action %d (%s of micro-batch %d, chunk %d);", s,
                                            next[s], a->forward ? "forward" : "backward", a->micro, a->chunk);
                }
            if (len < size) why[len - 1] = '\0';  // the last ';'
            err = why;
            break;
        }
        // run until the first running action ends or a waiting one can start, all at one pace
        double pace = fmax(1.0, fmin(sim->alone, (double)p / running)), until = soonest;
        for (int s = 0; s < p; s++)
            if (left[s] >= 0.0) until = fmin(until, now + left[s] / pace);
        for (int s = 0; s < p; s++) {
            if (left[s] < 0.0) continue;
            const LPAction* a = sim->actions + (size_t)s * per + next[s];
            int k = a->chunk * p + s;
            left[s] = now + left[s] / pace <= until ? 0.0 : left[s] - (until - now) * pace;
            if (left[s] > 0.0) continue;
            done[((size_t)a->forward * V + k) * m + a->micro] = free_at[s] = until;  // it ends
            if (sim->blocking && (a->forward ? k < V - 1 : k > 0)) free_at[s] += sim->link;  // (it sent its output)
            left[s] = -1.0;
            running--;
            remaining--;
            next[s]++;
        }
        now = until;
    }
    sim->work = 0.0;
    for (int s = 0; s < p; s++) {
        double work = 0.0;
        for (int c = 0; c < v; c++) work += m * (sim->cost ? sim->cost[c * p + s] + sim->cost[V + c * p + s] : sim->f + sim->b);
        if (work > sim->work) sim->work = work;
        if (free_at[s] > sim->makespan) sim->makespan = free_at[s];
    }
    sim->bubble = (sim->makespan - sim->work) / sim->work;
    free(in_flight);
    free(done);
    free(next);
    free(free_at);
    free(left);
    return err;
}

// Fill sim with schedule `kind`'s lists for p stages, v chunks each, m micro-batches, with costs f and b for
// every chunk (unit costs: 1 and 1), or with each virtual stage's own (cost: forwards, then backwards, as
// measured); no time between stages, stages that do not share (set sim's link, blocking and alone before
// lp_schedule_run to change them). Returns NULL, or why the schedule cannot run; sim is freed by the caller
// either way.
const char* lp_schedule_lists(LPSimulation* sim, int kind, int p, int v, int m, double f, double b, const double* cost,
                                            char* why, size_t size) {
    memset(sim, 0, sizeof(*sim));
    if (lp_schedule_check(kind, p, v, m, why, size)) return why;
    sim->p = p; sim->v = v; sim->m = m; sim->per_stage = 2 * m * v; sim->f = f; sim->b = b; sim->alone = 1.0;
    if (cost) {
        sim->cost = (double*)lp_host_malloc((size_t)2 * p * v * sizeof(double), "schedule");
        memcpy(sim->cost, cost, (size_t)2 * p * v * sizeof(double));
    }
    sim->actions = (LPAction*)lp_host_malloc((size_t)p * sim->per_stage * sizeof(LPAction), "schedule");
    sim->start = (double*)lp_host_malloc((size_t)p * sim->per_stage * sizeof(double), "schedule");
    sim->peak = (int*)lp_host_malloc((size_t)p * sizeof(int), "schedule");
    for (int s = 0; s < p; s++) lp_schedule_stage(kind, p, v, m, s, sim->actions + (size_t)s * sim->per_stage);
    return NULL;
}

// The lists of lp_schedule_lists, run (lp_schedule_run). Returns NULL, or why they cannot run.
const char* lp_schedule_simulate(LPSimulation* sim, int kind, int p, int v, int m, double f, double b,
                                               const double* cost, char* why, size_t size) {
    return lp_schedule_lists(sim, kind, p, v, m, f, b, cost, why, size) ? why : lp_schedule_run(sim, why, size);
}

void lp_simulation_free(LPSimulation* sim) {
    free(sim->actions);
    free(sim->start);
    free(sim->peak);
    free(sim->cost);
    memset(sim, 0, sizeof(*sim));
}

// Draw the simulated timeline, one row per stage, one cell per time unit (costs must be whole numbers):
// "F3" a forward of micro-batch 3 (with chunks: "F3b" its chunk 1), "B3" a backward, "." idle.
void lp_schedule_print(FILE* out, const LPSimulation* sim, int kind) {
    int digits = 1;
    for (int x = sim->m - 1; x >= 10; x /= 10) digits++;
    int w = 2 + digits + (sim->v > 1);  // cell width: kind, micro-batch, chunk letter, a space
    int ticks = (int)(sim->makespan + 0.5);
    char* row = (char*)lp_host_malloc((size_t)ticks * w + 1, "timeline");
    fprintf(out, "schedule %s: p=%d stages, v=%d chunks per stage, m=%d micro-batches; forward %g, backward %g per chunk\n",
            lp_schedule_names[kind], sim->p, sim->v, sim->m, sim->f, sim->b);
    for (int s = 0; s < sim->p; s++) {
        memset(row, ' ', (size_t)ticks * w);
        for (int t = 0; t < ticks; t++) row[(size_t)t * w + w / 2 - 1] = '.';
        for (int k = 0; k < sim->per_stage; k++) {
            const LPAction* a = sim->actions + (size_t)s * sim->per_stage + k;
            int t0 = (int)(sim->start[(size_t)s * sim->per_stage + k] + 0.5), len = (int)((a->forward ? sim->f : sim->b) + 0.5);
            char label[32];
            snprintf(label, sizeof(label), "%c%d", a->forward ? 'F' : 'B', a->micro);
            if (sim->v > 1) snprintf(label + strlen(label), sizeof(label) - strlen(label), "%c", 'a' + a->chunk);
            memset(row + (size_t)t0 * w, ' ', (size_t)len * w);
            memcpy(row + (size_t)t0 * w, label, strlen(label));
            for (int t = 1; t < len; t++) row[(size_t)(t0 + t) * w + w / 2 - 1] = '-';  // a longer action goes on
        }
        row[(size_t)ticks * w] = '\0';
        fprintf(out, "stage %d | %s| peak %d in flight\n", s, row, sim->peak[s]);
    }
    fprintf(out, "time %.0f units for %.0f of work per stage: bubble %.1f%%\n", sim->makespan, sim->work, 100.0 * sim->bubble);
    free(row);
}

// The most micro-batches chunk c holds activations of at once, in a stage's list of n actions (at least 1).
static inline int lp_schedule_slots(const LPAction* actions, int n, int c) {
    int in_flight = 0, most = 1;
    for (int k = 0; k < n; k++)
        if (actions[k].chunk == c && (in_flight += actions[k].forward ? 1 : -1) > most) most = in_flight;
    return most;
}
#endif  // LLMPAR_IMPLEMENTATION

// ----------------------------------------------------------------------------------------------------
// 5. comm
//
// Collectives on a group, over two transports. NCCL: the CUDA build's default, on the GPU's own buffers
// and stream. MPI: the CPU build hands MPI its fp32 buffers; the CUDA build uses it when ranks share a
// GPU (NCCL refuses that), staging bf16 tensors through host fp32 buffers (MPI has no bf16 sum). Host
// values (losses, norms, flags) always go over MPI. A group of one rank returns at once.

#ifdef LLMPAR_IMPLEMENTATION
#ifdef LLMPAR_MPI
static inline void lp_mpi_check(int err, const char* op, const LPGroup* g) {
    if (err == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(err, msg, &len);
    lp_fail("MPI %s on group %s (rank %d of %d) failed: %s", op, g->name, g->rank, g->size, msg);
}

// MPI counts are int: large buffers go in chunks
static inline void lp_mpi_all_reduce_f32(const LPGroup* g, float* x, size_t n) {
    for (size_t off = 0; off < n; off += (size_t)1 << 30) {
        int count = (int)(n - off < ((size_t)1 << 30) ? n - off : ((size_t)1 << 30));
        lp_mpi_check(MPI_Allreduce(MPI_IN_PLACE, x + off, count, MPI_FLOAT, MPI_SUM, g->comm), "all-reduce", g);
    }
}
#endif
#endif  // LLMPAR_IMPLEMENTATION

#ifdef LLMPAR_NCCL
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_nccl_check(ncclResult_t r, const char* op, const LPGroup* g) {
    if (r != ncclSuccess)
        lp_fail("NCCL %s on group %s (rank %d of %d) failed: %s", op, g->name, g->rank, g->size, ncclGetErrorString(r));
}
#endif  // LLMPAR_IMPLEMENTATION

// Every NCCL communicator the process holds, for the watchdog to abort: made and destroyed through these
// two, at set-up and teardown (a communicator joins the list once made: its slot is written before the count).
#define LP_MAX_NCCL_COMMS 16  // a rank's groups (7), its stage's head (1) and links (4 at most)
LP_STATE ncclComm_t lp_nccl_comms[LP_MAX_NCCL_COMMS];
LP_STATE int lp_nccl_comm_count;
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_nccl_comm_init(ncclComm_t* comm, int ranks, ncclUniqueId id, int rank, const char* op, const LPGroup* g) {
    if (lp_nccl_comm_count == LP_MAX_NCCL_COMMS) lp_fail("internal: more than %d NCCL communicators", LP_MAX_NCCL_COMMS);
    lp_watch("NCCL's start (ncclCommInitRank)", g);
    lp_nccl_check(ncclCommInitRank(comm, ranks, id, rank), op, g);
    lp_watch_done();
    lp_nccl_comms[lp_nccl_comm_count] = *comm;
    lp_nccl_comm_count++;
}
static inline void lp_nccl_comm_destroy(ncclComm_t comm) {
    for (int k = 0; k < lp_nccl_comm_count; k++)
        if (lp_nccl_comms[k] == comm) lp_nccl_comms[k] = lp_nccl_comms[--lp_nccl_comm_count];
    ncclCommDestroy(comm);
}
#endif  // LLMPAR_IMPLEMENTATION
#endif

// --- the watchdog. A rank whose peer has stopped (a hung GPU, a stalled file system, a lost link) would
// wait in its collective forever, and the job would never end for a supervisor to relaunch it. So each
// blocking call marks what it waits in (lp_watch), and a thread per rank (lp_watchdog_start) ends the
// whole job when nothing has moved for timeout_s seconds: one line naming the step, the call and its
// group (a receive: its sender), then exit status 124; the launcher (mpirun, srun) then ends the other
// ranks, a stopped one too. Each rank that gives up says so: the ranks waiting on the stopped one, and the
// stopped one itself if the launcher resumes it (Open MPI sends SIGCONT before it kills). On the CUDA
// build it first aborts the process's NCCL communicators (ncclCommAbort: NCCL's way to end a communicator's
// uncompleted operations, called from this thread as PyTorch's NCCL watchdog does), so that a collective
// stuck in the GPU ends and the process can exit. A call's return is marked too (lp_watch_done): the time
// between is the rank's waiting, which the straggler report leaves out of its compute time.
// Optional: a program built with LLMPAR_NO_WATCHDOG has none (no thread; the marks below do nothing).
#ifndef LLMPAR_NO_WATCHDOG
typedef struct {
    volatile double moved;          // lp_time_s() of the last mark
    const char* volatile what;      // the call waited in, or the phase between calls
    const LPGroup* volatile group;  // its group (NULL: none)
    volatile int peer;              // a receive's sender, as the group's rank (-1: a collective)
    volatile int step;              // the step under way (counted from 1)
    volatile double timeout_s;      // 0: off
    int running;                    // its thread started
    int waiting;                    // inside a marked call (one made inside another counts once)
    double wait_start, waited;      // its start; seconds waited in marked calls so far
} LPWatchdog;
LP_STATE LPWatchdog lp_watchdog;
#ifdef LLMPAR_IMPLEMENTATION
// Its state at each mark (below): a phase of the loop ("the step", not a wait), a blocking call's start, its return.
static inline void lp_watch_phase(const char* what) {
    lp_watchdog.what = what;
    lp_watchdog.group = NULL;
    lp_watchdog.moved = lp_time_s();
}
static inline void lp_watchdog_wait(const char* what, const LPGroup* g, int peer) {
    double now = lp_time_s();
    lp_watchdog.what = what;
    lp_watchdog.group = g;
    lp_watchdog.peer = peer;
    lp_watchdog.moved = now;
    if (!lp_watchdog.waiting) {
        lp_watchdog.waiting = 1;
        lp_watchdog.wait_start = now;
    }
}
static inline void lp_watchdog_done(void) {
    if (!lp_watchdog.waiting) return;  // (the inner call of two ended the wait)
    lp_watchdog.waiting = 0;
    lp_watchdog.waited += lp_time_s() - lp_watchdog.wait_start;
}
static inline void* lp_watchdog_loop(void* arg) {
    (void)arg;
    for (;;) {
        usleep(100000);
        double timeout = lp_watchdog.timeout_s, idle = lp_time_s() - lp_watchdog.moved;
        if (timeout <= 0.0 || idle <= timeout) continue;
        const LPGroup* g = lp_watchdog.group;
        char where[256];
        int peer = lp_watchdog.peer;
        if (g && peer >= 0)
            snprintf(where, sizeof(where), "waiting in %s from rank %d of group %s (this is its rank %d)", lp_watchdog.what, peer,
                     g->name, g->rank);
        else if (g)
            snprintf(where, sizeof(where), "waiting in %s on group %s (rank %d of %d)", lp_watchdog.what, g->name, g->rank, g->size);
        else
            snprintf(where, sizeof(where), "in %s", lp_watchdog.what);
        lp_ending = 1;
        char aborting[64] = "";
#ifdef LLMPAR_NCCL
        if (lp_nccl_comm_count)
            snprintf(aborting, sizeof(aborting), "aborting its %d NCCL communicator%s and ", lp_nccl_comm_count,
                     lp_nccl_comm_count > 1 ? "s" : "");
#endif
        char when[32] = "in the set-up";
        if (lp_watchdog.step > 0) snprintf(when, sizeof(when), "at step %d", lp_watchdog.step);
        fprintf(stderr, "llmpar: error: rank %d: no progress for %.0f s %s, %s; %sending the job (a rank it waits for "
                "has stopped? --timeout-minutes)\n", lp_rank, idle, when, where, aborting);
        fflush(stderr);
#ifdef LLMPAR_NCCL
        alarm(10);  // an abort can itself hang behind a kernel that never ends: SIGALRM then ends the process
        for (int k = 0; k < lp_nccl_comm_count; k++) ncclCommAbort(lp_nccl_comms[k]);
#endif
        _exit(124);
    }
    return NULL;
}
// Arm the watchdog with timeout_s (its thread started once; lp_process_init does, under MPI).
static inline void lp_watchdog_start(double timeout_s) {
    lp_watch_phase("the set-up");
    lp_watchdog.timeout_s = timeout_s;
    if (lp_watchdog.running) return;
    pthread_t thread;
    if (pthread_create(&thread, NULL, lp_watchdog_loop, NULL) != 0) lp_fail("cannot start the watchdog thread");
    pthread_detach(thread);
    lp_watchdog.running = 1;
}
static inline void lp_watchdog_stop(void) { lp_watchdog.timeout_s = 0.0; }  // (its thread idles)
// The timeout a program set before lp_process_init, or fallback.
static inline double lp_watchdog_timeout_or(double fallback) { return lp_watchdog.timeout_s > 0.0 ? lp_watchdog.timeout_s : fallback; }
#endif  // LLMPAR_IMPLEMENTATION
#else
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_watch_phase(const char* what) { (void)what; }
static inline void lp_watchdog_wait(const char* what, const LPGroup* g, int peer) { (void)what, (void)g, (void)peer; }
static inline void lp_watchdog_done(void) {}
static inline void lp_watchdog_start(double timeout_s) { (void)timeout_s; }
static inline void lp_watchdog_stop(void) {}
static inline double lp_watchdog_timeout_or(double fallback) { return fallback; }
#endif  // LLMPAR_IMPLEMENTATION
#endif

#ifdef LLMPAR_IMPLEMENTATION
// The marks: each blocking call marks what it waits in, its group and a receive's sender (lp_watch_peer),
// and its return (lp_watch_done): the watchdog and the timeline listen (the loop's phases, lp_watch_phase,
// are the watchdog's alone). A call made inside another (lp_all_reduce's host staging) counts as the outer one.
static inline void lp_watch_peer(const char* what, const LPGroup* g, int peer) {
    lp_watchdog_wait(what, g, peer);
    if (lp_trace.on && !lp_trace.wait) {  // named without its article: "an all-reduce" -> "all-reduce"
        const char* name = strncmp(what, "an ", 3) == 0 ? what + 3 : strncmp(what, "a ", 2) == 0 ? what + 2
                           : strncmp(what, "the ", 4) == 0 ? what + 4 : what;
        lp_trace.wait = 1 + lp_trace_comm(name, g->name, 0.0, peer);
    }
}
static inline void lp_watch(const char* what, const LPGroup* g) { lp_watch_peer(what, g, -1); }
// The bytes the blocking call under way moves, on its timeline event.
static inline void lp_trace_wait_bytes(double bytes) {
    if (lp_trace.wait) lp_trace.ev[lp_trace.wait - 1].bytes = bytes;
}
static inline void lp_watch_done(void) {
    lp_watchdog_done();
    if (lp_trace.wait) lp_trace_close(lp_trace.wait - 1);
    lp_trace.wait = 0;
}

// Count a collective on g's device tensors (the groups are the process's own: counting is their only change).
// On the timeline: the bytes of the blocking call under way; a collective started without blocking (and a
// send, which never blocks) as an instant event of its own.
static inline void lp_traffic(const LPGroup* g, int kind, size_t bytes) {
    static const char* const names[] = {"all-reduce start", "reduce-scatter start", "all-gather start", "send", "all-to-all start"};
    ((LPGroup*)g)->calls[kind]++;
    ((LPGroup*)g)->bytes[kind] += (double)bytes;
    if (lp_trace.wait) {
        lp_trace_wait_bytes((double)bytes);
    } else if (lp_trace.on) {
        int id = lp_trace_comm(names[kind], g->name, (double)bytes, -1);
        snprintf(lp_trace.ev[id].kind, sizeof(lp_trace.ev[id].kind), "launch");
        lp_trace_close(id);
    }
}

// Sum (or average) n host floats over the group, in place: losses, norms, error flags, staged tensors.
void lp_all_reduce_host(const LPGroup* g, float* x, size_t n, int average) {
    if (g->size == 1 || n == 0) return;  // (MPI's of 0 values would return at once, waiting for no peer)
    lp_watch("an all-reduce of host values", g);
    lp_trace_wait_bytes((double)(n * sizeof(float)));
#ifdef LLMPAR_MPI
    lp_mpi_all_reduce_f32(g, x, n);
    lp_watch_done();
    if (average)
        for (size_t i = 0; i < n; i++) x[i] /= g->size;
#else
    (void)x;
    (void)n;
    (void)average;
#endif
}

// Every rank's `bytes` at mine into all (rank-major, world * bytes), over the whole job; and a broadcast
// from `root` over it. For the start, before the grid's groups exist (lp_grid_init).
void lp_world_all_gather(const LPProcess* proc, const void* mine, size_t bytes, void* all) {
    memcpy(all, mine, bytes);
#ifdef LLMPAR_MPI
    if (proc->world > 1 && MPI_Allgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, MPI_COMM_WORLD) != MPI_SUCCESS)
        lp_fail("MPI_Allgather of %zu bytes at the start failed", bytes);
#else
    (void)proc;
#endif
}
void lp_world_broadcast(const LPProcess* proc, void* buf, size_t bytes, int root) {
#ifdef LLMPAR_MPI
    if (proc->world > 1 && MPI_Bcast(buf, (int)bytes, MPI_BYTE, root, MPI_COMM_WORLD) != MPI_SUCCESS)
        lp_fail("MPI_Bcast of %zu bytes at the start failed", bytes);
#else
    (void)proc;
    (void)buf;
    (void)bytes;
    (void)root;
#endif
}

// Rank r's bytes[r] bytes at mine to rank 0, into all one after another in rank order (the timeline's
// events, a different number on each rank); all is read on rank 0 only.
void lp_world_gather(const LPProcess* proc, const void* mine, const int* bytes, void* all) {
#ifdef LLMPAR_MPI
    if (proc->world > 1) {
        int* at = (int*)lp_host_malloc((size_t)proc->world * sizeof(int), "gather offsets");
        long long total = 0;
        for (int r = 0; r < proc->world; r++) {
            if (total + bytes[r] > INT_MAX) lp_fail("gathering %lld bytes to rank 0: more than MPI's int counts", total + bytes[r]);
            at[r] = (int)total;
            total += bytes[r];
        }
        lp_watch("a gather to rank 0", &proc->world_group);
        lp_mpi_check(MPI_Gatherv(mine, bytes[proc->rank], MPI_BYTE, all, bytes, at, MPI_BYTE, 0, MPI_COMM_WORLD), "gather",
                     &proc->world_group);
        lp_watch_done();
        free(at);
        return;
    }
#else
    (void)proc;
#endif
    memcpy(all, mine, (size_t)bytes[0]);
}

// Send `bytes` of host memory from the group's rank `root` to all its ranks (one reader of a model file
// serves the whole group).
void lp_broadcast_host(const LPGroup* g, void* buf, size_t bytes, int root) {
    if (g->size == 1) return;
    lp_watch("a broadcast", g);
#ifdef LLMPAR_MPI
    for (size_t off = 0; off < bytes; off += (size_t)1 << 30) {
        int count = (int)(bytes - off < ((size_t)1 << 30) ? bytes - off : ((size_t)1 << 30));
        lp_mpi_check(MPI_Bcast((char*)buf + off, count, MPI_BYTE, root, g->comm), "broadcast", g);
    }
    lp_watch_done();
#else
    (void)buf;
    (void)bytes;
    (void)root;
#endif
}

// Send n host floats to the group's rank `to` while receiving n from rank `from` (gossip's exchange with
// a neighbour: each rank sends to one and receives from another, so no pair waits on the other).
static inline void lp_sendrecv_host(const LPGroup* g, const float* send, int to, float* recv, int from, size_t n) {
    lp_watch_peer("an exchange of weights", g, from);
#ifdef LLMPAR_MPI
    for (size_t off = 0; off < n; off += (size_t)1 << 28) {
        int count = (int)(n - off < ((size_t)1 << 28) ? n - off : ((size_t)1 << 28));
        lp_mpi_check(MPI_Sendrecv(send + off, count, MPI_FLOAT, to, 0, recv + off, count, MPI_FLOAT, from, 0, g->comm,
                                  MPI_STATUS_IGNORE), "send-receive", g);
    }
#else
    (void)send, (void)to, (void)recv, (void)n;
    lp_fail("send-receive on group %s: this build has no MPI", g->name);
#endif
    lp_watch_done();
}

// Sum a device tensor of the compute type over the group, in place; divide by the group size when
// `average` (DP gradient averaging).
static inline void lp_all_reduce(const LPGroup* g, floatX* x, size_t n, int average) {
    if (g->size == 1 || n == 0) return;  // (a tensor the model lacks, size 0: nothing to wait for)
    lp_watch("an all-reduce", g);
    lp_traffic(g, LP_ALL_REDUCE, n * sizeof(floatX));
#ifdef LLMPAR_NCCL
    if (g->nccl) {
        lp_nccl_check(ncclAllReduce(x, x, n, LP_NCCL_FLOATX, average ? ncclAvg : ncclSum, g->nccl, 0), "all-reduce", g);
        lp_watch_done();
        return;
    }
#endif
#ifdef LLMPAR_CPU
    lp_all_reduce_host(g, x, n, average);
#else
    float* sum = (float*)lp_host_malloc(n * sizeof(float), "all-reduce staging");
    lp_to_host_float(sum, x, n);
    lp_all_reduce_host(g, sum, n, average);
    lp_to_device_floatX(x, sum, n);
    free(sum);
#endif
    lp_watch_done();
}

// x holds size * shard values; afterwards this rank's shard x[rank*shard ...] holds their sum (or average)
// over the group (ZeRO: each rank keeps only the gradients of the parameters it updates).
static inline void lp_reduce_scatter(const LPGroup* g, floatX* x, size_t shard, int average) {
    if (g->size == 1) return;
    lp_watch("a reduce-scatter", g);
    lp_traffic(g, LP_REDUCE_SCATTER, shard * g->size * sizeof(floatX));
#ifdef LLMPAR_NCCL
    if (g->nccl) {  // in place: this rank's block is its output
        lp_nccl_check(ncclReduceScatter(x, x + shard * g->rank, shard, LP_NCCL_FLOATX, average ? ncclAvg : ncclSum,
                                        g->nccl, 0), "reduce-scatter", g);
        lp_watch_done();
        return;
    }
#endif
#ifdef LLMPAR_MPI
    if (shard > (size_t)1 << 30) lp_fail("reduce-scatter on group %s: shard of %zu values is too large for MPI", g->name, shard);
    size_t mine = shard * g->rank;
#ifdef LLMPAR_CPU
    float* sum = x;
#else
    float* sum = (float*)lp_host_malloc(shard * g->size * sizeof(float), "reduce-scatter staging");
    lp_to_host_float(sum, x, shard * g->size);
#endif
    // in place, MPI leaves this rank's reduced block at the start of the buffer
    lp_mpi_check(MPI_Reduce_scatter_block(MPI_IN_PLACE, sum, (int)shard, MPI_FLOAT, MPI_SUM, g->comm), "reduce-scatter", g);
    lp_watch_done();
    memmove(sum + mine, sum, shard * sizeof(float));
    if (average)
        for (size_t i = mine; i < mine + shard; i++) sum[i] /= g->size;
#ifndef LLMPAR_CPU
    lp_to_device_floatX(x + mine, sum + mine, shard);
    free(sum);
#endif
#else
    (void)x;
    (void)shard;
    (void)average;
#endif
}

// Each rank's block of `bytes` at x + rank*bytes goes to every rank: afterwards x holds all size blocks.
// A plain copy, so any element type (ZeRO's updated weights, TP's classifier statistics).
static inline void lp_all_gather(const LPGroup* g, void* x, size_t bytes) {
    if (g->size == 1) return;
    lp_watch("an all-gather", g);
    lp_traffic(g, LP_ALL_GATHER, bytes * g->size);
#ifdef LLMPAR_NCCL
    if (g->nccl) {  // in place: this rank's block is its input
        lp_nccl_check(ncclAllGather((char*)x + bytes * g->rank, x, bytes, ncclChar, g->nccl, 0), "all-gather", g);
        lp_watch_done();
        return;
    }
#endif
#ifdef LLMPAR_MPI
    if (bytes > (size_t)INT_MAX) lp_fail("all-gather on group %s: block of %zu bytes is too large for MPI", g->name, bytes);
#ifdef LLMPAR_CPU
    char* buf = (char*)x;
#else
    char* buf = (char*)lp_pinned_buffer((bytes * g->size + sizeof(floatX) - 1) / sizeof(floatX));
    lp_copy_to_host(buf + bytes * g->rank, (char*)x + bytes * g->rank, bytes);
#endif
    lp_mpi_check(MPI_Allgather(MPI_IN_PLACE, 0, MPI_BYTE, buf, (int)bytes, MPI_BYTE, g->comm), "all-gather", g);
    lp_watch_done();
#ifndef LLMPAR_CPU
    lp_copy_to_device(x, buf, bytes * g->size);
#endif
#else
    (void)x;
    (void)bytes;
#endif
}

// This rank sends send_rows[r] rows of row_bytes each to rank r (its rows for each rank one after another, in
// rank order) and receives recv_rows[r] rows from rank r, laid out the same way: a mixture of experts'
// dispatch of tokens to their experts' ranks and back (section 9). Blocking; its own block is a copy.
static inline void lp_all_to_all(const LPGroup* g, const void* send, const int* send_rows, void* recv, const int* recv_rows,
                                 size_t row_bytes) {
    size_t so = 0, ro = 0, sent = 0, got = 0;
    for (int r = 0; r < g->size; r++) sent += send_rows[r], got += recv_rows[r];
    for (int r = 0; r < g->rank; r++) so += send_rows[r], ro += recv_rows[r];
    if (send_rows[g->rank] != recv_rows[g->rank]) lp_fail("internal: all-to-all on group %s keeps %d rows but takes %d", g->name,
                                                          send_rows[g->rank], recv_rows[g->rank]);
    if (send_rows[g->rank]) lp_copy_device((char*)recv + ro * row_bytes, (const char*)send + so * row_bytes, send_rows[g->rank] * row_bytes);
    if (g->size == 1) return;
    lp_watch("an all-to-all", g);
    lp_traffic(g, LP_ALL_TO_ALL, (sent - send_rows[g->rank]) * row_bytes);
#ifdef LLMPAR_NCCL
    if (g->nccl) {  // a send and a receive per other rank, launched together
        lp_nccl_check(ncclGroupStart(), "group start", g);
        for (int r = 0, s = 0, t = 0; r < g->size; s += send_rows[r], t += recv_rows[r], r++) {
            if (r == g->rank) continue;
            if (send_rows[r])
                lp_nccl_check(ncclSend((const char*)send + s * row_bytes, send_rows[r] * row_bytes, ncclChar, r, g->nccl, 0), "send", g);
            if (recv_rows[r])
                lp_nccl_check(ncclRecv((char*)recv + t * row_bytes, recv_rows[r] * row_bytes, ncclChar, r, g->nccl, 0), "receive", g);
        }
        lp_nccl_check(ncclGroupEnd(), "group end", g);
        lp_watch_done();
        return;
    }
#endif
#ifdef LLMPAR_MPI
    if (sent * row_bytes > (size_t)INT_MAX || got * row_bytes > (size_t)INT_MAX)
        lp_fail("all-to-all on group %s: %zu rows of %zu bytes are too many for MPI", g->name, sent > got ? sent : got, row_bytes);
    int* args = (int*)lp_host_malloc(4 * (size_t)g->size * sizeof(int), "all-to-all counts");  // bytes: sent, at, received, at
    for (int r = 0, s = 0, t = 0; r < g->size; s += send_rows[r], t += recv_rows[r], r++) {
        int self = r == g->rank;  // (copied above)
        args[r] = self ? 0 : (int)(send_rows[r] * row_bytes);
        args[g->size + r] = (int)(s * row_bytes);
        args[2 * g->size + r] = self ? 0 : (int)(recv_rows[r] * row_bytes);
        args[3 * g->size + r] = (int)(t * row_bytes);
    }
#ifdef LLMPAR_CPU
    const char* sbuf = (const char*)send;
    char* rbuf = (char*)recv;
#else
    char* sbuf = (char*)lp_host_malloc(sent * row_bytes + 1, "all-to-all staging");
    char* rbuf = (char*)lp_host_malloc(got * row_bytes + 1, "all-to-all staging");
    lp_copy_to_host(sbuf, send, sent * row_bytes);
#endif
    lp_mpi_check(MPI_Alltoallv(sbuf, args, args + g->size, MPI_BYTE, rbuf, args + 2 * g->size, args + 3 * g->size, MPI_BYTE, g->comm),
                 "all-to-all", g);
    lp_watch_done();
#ifndef LLMPAR_CPU
    for (int r = 0, t = 0; r < g->size; t += recv_rows[r], r++)  // (its own block is in place already)
        if (r != g->rank && recv_rows[r]) lp_copy_to_device((char*)recv + t * row_bytes, rbuf + t * row_bytes, recv_rows[r] * row_bytes);
    free(sbuf);
    free(rbuf);
#endif
    free(args);
#else
    (void)recv;
#endif
}

void lp_barrier(const LPGroup* g) {
    if (g->size == 1) return;
    lp_watch("a barrier", g);
#ifdef LLMPAR_MPI
    lp_mpi_check(MPI_Barrier(g->comm), "barrier", g);
#endif
    lp_watch_done();
}
#endif  // LLMPAR_IMPLEMENTATION

// --- point-to-point between pipeline stages (and context parallelism's ring, section 9). A send never holds
// its sender up: the data is copied out and handed to MPI_Isend, and lp_sends_wait finishes the sends. That
// is the model under which the schedule simulator (lp_schedule_run) proves a schedule free of deadlock; a
// receive blocks until its data is there. Tags name the message, so each receive gets its own data whatever
// order messages travel in. Both builds go over MPI; the CUDA build stages through host memory (also when
// NCCL carries the collectives).
typedef struct {
#ifdef LLMPAR_MPI
    MPI_Request* req;
#endif
    void** buf;
    int count, cap;
} LPSends;

#ifdef LLMPAR_IMPLEMENTATION
// Send n values of x to the group's rank `peer`.
static inline void lp_send(const LPGroup* g, const floatX* x, size_t n, int peer, int tag, LPSends* s) {
    size_t bytes = n * sizeof(floatX);
    lp_traffic(g, LP_SEND, bytes);
#ifdef LLMPAR_MPI
    if (bytes > (size_t)INT_MAX) lp_fail("send on group %s: %zu bytes is too large for one MPI message", g->name, bytes);
    if (s->count == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 16;
        s->req = (MPI_Request*)realloc(s->req, (size_t)s->cap * sizeof(MPI_Request));
        s->buf = (void**)realloc(s->buf, (size_t)s->cap * sizeof(void*));
        if (!s->req || !s->buf) lp_fail("out of host memory for pending sends");
    }
    void* buf = lp_host_malloc(bytes, "send buffer");
    lp_copy_to_host(buf, x, bytes);
    lp_mpi_check(MPI_Isend(buf, (int)bytes, MPI_BYTE, peer, tag, g->comm, &s->req[s->count]), "send", g);
    s->buf[s->count++] = buf;
#else
    (void)x, (void)peer, (void)tag, (void)s;
    lp_fail("send on group %s: this build has no MPI", g->name);
#endif
}

// A receive posted now and finished by lp_recv_wait, so that the data travels while this rank computes (the
// ring attention posts the next block's receive before it works on the current one): n values from the
// group's rank `peer` into x. The CUDA build receives into a host buffer of its own, copied to x at the wait.
typedef struct {
#ifdef LLMPAR_MPI
    MPI_Request req;
#endif
    const LPGroup* g;
    floatX* x;
    void* buf;  // where MPI writes: x (CPU build) or the host buffer
    size_t n;
    int peer;
} LPRecv;
static inline void lp_recv_start(const LPGroup* g, floatX* x, size_t n, int peer, int tag, LPRecv* r) {
    r->g = g;
    r->x = x;
    r->n = n;
    r->peer = peer;
#ifdef LLMPAR_MPI
    size_t bytes = n * sizeof(floatX);
    if (bytes > (size_t)INT_MAX) lp_fail("receive on group %s: %zu bytes is too large for one MPI message", g->name, bytes);
#ifdef LLMPAR_CPU
    r->buf = x;
#else
    r->buf = lp_host_malloc(bytes, "receive buffer");
#endif
    lp_mpi_check(MPI_Irecv(r->buf, (int)bytes, MPI_BYTE, peer, tag, g->comm, &r->req), "receive", g);
#else
    (void)tag;
    lp_fail("receive on group %s: this build has no MPI", g->name);
#endif
}
// Wait until the receive r has arrived in its x.
static inline void lp_recv_wait(LPRecv* r) {
    lp_watch_peer("a receive", r->g, r->peer);
    lp_trace_wait_bytes((double)(r->n * sizeof(floatX)));
#ifdef LLMPAR_MPI
    lp_mpi_check(MPI_Wait(&r->req, MPI_STATUS_IGNORE), "receive", r->g);
#endif
    lp_watch_done();
#ifndef LLMPAR_CPU
    lp_copy_to_device(r->x, r->buf, r->n * sizeof(floatX));
    free(r->buf);
#endif
}
// Receive n values from the group's rank `peer` into x; blocks until they have arrived.
static inline void lp_recv(const LPGroup* g, floatX* x, size_t n, int peer, int tag) {
    LPRecv r;
    lp_recv_start(g, x, n, peer, tag, &r);
    lp_recv_wait(&r);
}

// Finish every send started on s and free their buffers.
static inline void lp_sends_wait(const LPGroup* g, LPSends* s) {
    lp_watch("the sends' completion", g);
#ifdef LLMPAR_MPI
    if (s->count) lp_mpi_check(MPI_Waitall(s->count, s->req, MPI_STATUSES_IGNORE), "send", g);
#else
    (void)g;
#endif
    lp_watch_done();
    for (int k = 0; k < s->count; k++) free(s->buf[k]);
    s->count = 0;
}

static inline void lp_sends_free(LPSends* s) {
#ifdef LLMPAR_MPI
    free(s->req);
#endif
    free(s->buf);
    memset(s, 0, sizeof(*s));
}
#endif  // LLMPAR_IMPLEMENTATION

// Overlap: collectives started now and finished together by lp_wait, while compute goes on. NCCL runs
// them on a stream of their own, ordered after the compute stream's work so far; each LPPending records
// its own event there after its last collective, and lp_wait makes the compute stream wait for that event
// alone, not for collectives started later on other LPPendings (the next layer's reduce, a prefetch). The CPU build uses MPI's nonblocking calls. The CUDA build over
// MPI cannot overlap (its staging is synchronous): there a start runs the collective at once.
#define LP_MAX_PENDING 1024
typedef struct {
#if defined(LLMPAR_MPI) && defined(LLMPAR_CPU)
    MPI_Request req[LP_MAX_PENDING];
    float* average[LP_MAX_PENDING];  // an all-reduce's buffer, divided by the group size when done
    float* block[LP_MAX_PENDING];    // a reduce-scatterv's buffer: MPI leaves this rank's block at its start,
    size_t at[LP_MAX_PENDING];       //   which then moves to its place, `at`
    size_t n[LP_MAX_PENDING];
    int* args[LP_MAX_PENDING];  // counts (and displacements) MPI reads until the operation completes
#endif
#ifdef LLMPAR_NCCL
    cudaEvent_t done;  // on the comm stream, after this pending's last collective (created on first use)
#endif
    int count;
} LPPending;
#ifdef LLMPAR_NCCL
LP_STATE cudaStream_t lp_comm_stream;
LP_STATE cudaEvent_t lp_comm_event;
LP_STATE cudaStream_t lp_ring_stream;  // context parallelism's exchanges (lp_exchange_start)
LP_STATE cudaEvent_t lp_ring_done[2];  // the ends of its two exchanges in flight (tags 0 and 1)
#ifdef LLMPAR_IMPLEMENTATION
// A collective is about to be enqueued on the comm stream, after the compute stream's work so far. On the
// timeline (on) it is the comm stream's event, named as lp_traffic's launch just before it.
static inline void lp_comm_stream_follows_compute(void) {
    cudaCheck(cudaEventRecord(lp_comm_event, 0));
    cudaCheck(cudaStreamWaitEvent(lp_comm_stream, lp_comm_event, 0));
    if (lp_trace.on && lp_trace.n && strcmp(lp_trace.ev[lp_trace.n - 1].kind, "launch") == 0) {
        const LPTraceEvent* launch = &lp_trace.ev[lp_trace.n - 1];
        char name[sizeof(launch->name)];
        snprintf(name, sizeof(name), "%.*s", (int)(strcspn(launch->name, " ")), launch->name);  // "all-reduce start" -> "all-reduce"
        int id = lp_trace_comm(name, launch->group, launch->bytes, -1);
        lp_trace.ev[id].track = 2;
        lp_trace_mark(id, 0, lp_comm_stream);
        lp_trace.stream_event = 1 + id;
    }
}
// A collective of p's is enqueued on the comm stream: p's event moves to after it (and the timeline's ends).
static inline void lp_pending_enqueued(LPPending* pend) {
    if (!pend->done) cudaCheck(cudaEventCreateWithFlags(&pend->done, cudaEventDisableTiming));
    cudaCheck(cudaEventRecord(pend->done, lp_comm_stream));
    pend->count++;
    if (lp_trace.stream_event) lp_trace_mark(lp_trace.stream_event - 1, 1, lp_comm_stream), lp_trace.stream_event = 0;
}
#endif  // LLMPAR_IMPLEMENTATION
#endif
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_pending_free(LPPending* pend) {
#ifdef LLMPAR_NCCL
    if (pend->done) cudaCheck(cudaEventDestroy(pend->done));
#endif
    memset(pend, 0, sizeof(*pend));
}
#if defined(LLMPAR_MPI) && defined(LLMPAR_CPU)
static inline int lp_pending_slot(LPPending* pend, const LPGroup* g) {
    if (pend->count == LP_MAX_PENDING) lp_fail("more than %d collectives in flight on group %s", LP_MAX_PENDING, g->name);
    int k = pend->count++;
    pend->average[k] = pend->block[k] = NULL;
    pend->args[k] = NULL;
    return k;
}
#endif

// Start averaging x over the group (lp_all_reduce, nonblocking).
static inline void lp_all_reduce_start(const LPGroup* g, floatX* x, size_t n, LPPending* pend) {
    if (g->size == 1) return;
    lp_traffic(g, LP_ALL_REDUCE, n * sizeof(floatX));
#ifdef LLMPAR_NCCL
    if (g->nccl) {
        lp_comm_stream_follows_compute();
        lp_nccl_check(ncclAllReduce(x, x, n, LP_NCCL_FLOATX, ncclAvg, g->nccl, lp_comm_stream), "all-reduce", g);
        lp_pending_enqueued(pend);
        return;
    }
#endif
#if defined(LLMPAR_MPI) && defined(LLMPAR_CPU)
    if (n > (size_t)1 << 30) lp_fail("all-reduce on group %s: %zu values is too large for one MPI call", g->name, n);
    int k = lp_pending_slot(pend, g);
    pend->average[k] = x;
    pend->n[k] = n;
    lp_mpi_check(MPI_Iallreduce(MPI_IN_PLACE, x, (int)n, MPI_FLOAT, MPI_SUM, g->comm, &pend->req[k]), "all-reduce", g);
#else
    (void)pend;
    lp_all_reduce(g, x, n, 1);
#endif
}

// Start gathering: each rank contributes counts[rank] values (mine); out receives all ranks' blocks,
// rank by rank (ZeRO-3: a layer's weights from the shards that hold them). Blocks may be empty.
static inline void lp_all_gatherv_start(const LPGroup* g, const floatX* mine, floatX* out, const int* counts, LPPending* pend) {
    size_t n = 0;
    for (int r = 0; r < g->size; r++) n += counts[r];
    if (g->size == 1) {  // a group of one: its block is everything
        if (out != mine) lp_copy_device(out, mine, n * sizeof(floatX));
        return;
    }
    lp_traffic(g, LP_ALL_GATHER, n * sizeof(floatX));
#ifdef LLMPAR_NCCL
    if (g->nccl) {  // one broadcast per owner, launched together
        lp_comm_stream_follows_compute();
        lp_nccl_check(ncclGroupStart(), "group start", g);
        for (int r = 0, off = 0; r < g->size; r++) {
            if (counts[r]) lp_nccl_check(ncclBroadcast(mine, out + off, counts[r], LP_NCCL_FLOATX, r, g->nccl, lp_comm_stream), "broadcast", g);
            off += counts[r];
        }
        lp_nccl_check(ncclGroupEnd(), "group end", g);
        lp_pending_enqueued(pend);
        return;
    }
#endif
#ifdef LLMPAR_MPI
    // a plain copy: the compute type's bytes, as MPI_BYTE
    int* args = (int*)lp_host_malloc(2 * (size_t)g->size * sizeof(int), "all-gather counts");
    for (int r = 0, off = 0; r < g->size; r++) {
        args[r] = counts[r] * (int)sizeof(floatX);
        args[g->size + r] = (int)(off * sizeof(floatX));
        off += counts[r];
    }
#ifdef LLMPAR_CPU
    int k = lp_pending_slot(pend, g);
    pend->args[k] = args;
    lp_mpi_check(MPI_Iallgatherv(mine, args[g->rank], MPI_BYTE, out, args, args + g->size, MPI_BYTE, g->comm, &pend->req[k]),
                 "all-gather", g);
#else
    char* send = (char*)lp_host_malloc((size_t)args[g->rank] + 1, "all-gather staging");
    char* recv = (char*)lp_pinned_buffer(n);
    lp_copy_to_host(send, mine, (size_t)args[g->rank]);
    lp_mpi_check(MPI_Allgatherv(send, args[g->rank], MPI_BYTE, recv, args, args + g->size, MPI_BYTE, g->comm), "all-gather", g);
    lp_copy_to_device(out, recv, n * sizeof(floatX));
    free(send);
    free(args);
    (void)pend;
#endif
#else
    (void)mine;
    (void)out;
    (void)pend;
#endif
}

// Where this rank's block starts in a buffer of counts[0] + ... + counts[size-1] values, rank by rank.
static inline size_t lp_block_start(const LPGroup* g, const int* counts) {
    size_t at = 0;
    for (int r = 0; r < g->rank; r++) at += (size_t)counts[r];
    return at;
}

// Start summing over the group, in place: x holds counts[0] + ... + counts[size-1] values, rank by rank;
// afterwards this rank's block (lp_block_start, counts[rank] values) holds its sum and the others are
// undefined. Blocks may differ in size and be empty (ZeRO-2: a layer's gradients cut at the shard
// boundaries). In place, so ZeRO-2 needs no receive buffers.
static inline void lp_reduce_scatterv_start(const LPGroup* g, floatX* x, const int* counts, LPPending* pend) {
    if (g->size == 1) return;  // a group of one: its block is everything, summed
    size_t n = 0;
    for (int r = 0; r < g->size; r++) n += counts[r];
    lp_traffic(g, LP_REDUCE_SCATTER, n * sizeof(floatX));
#ifdef LLMPAR_NCCL
    if (g->nccl) {  // one reduce per owner, each in place, launched together
        lp_comm_stream_follows_compute();
        lp_nccl_check(ncclGroupStart(), "group start", g);
        for (int r = 0, off = 0; r < g->size; r++) {
            if (counts[r])
                lp_nccl_check(ncclReduce(x + off, x + off, counts[r], LP_NCCL_FLOATX, ncclSum, r, g->nccl, lp_comm_stream), "reduce", g);
            off += counts[r];
        }
        lp_nccl_check(ncclGroupEnd(), "group end", g);
        lp_pending_enqueued(pend);
        return;
    }
#endif
#if defined(LLMPAR_MPI) && defined(LLMPAR_CPU)
    int k = lp_pending_slot(pend, g);
    pend->args[k] = (int*)lp_host_malloc((size_t)g->size * sizeof(int), "reduce-scatter counts");
    memcpy(pend->args[k], counts, (size_t)g->size * sizeof(int));
    pend->block[k] = x;
    pend->at[k] = lp_block_start(g, counts);
    pend->n[k] = (size_t)counts[g->rank];
    lp_mpi_check(MPI_Ireduce_scatter(MPI_IN_PLACE, x, pend->args[k], MPI_FLOAT, MPI_SUM, g->comm, &pend->req[k]), "reduce-scatter", g);
#elif defined(LLMPAR_MPI)
    size_t mine = (size_t)counts[g->rank];
    float* send = (float*)lp_host_malloc(n * sizeof(float), "reduce-scatter staging");
    float* recv = (float*)lp_host_malloc((mine ? mine : 1) * sizeof(float), "reduce-scatter staging");
    lp_to_host_float(send, x, n);
    lp_mpi_check(MPI_Reduce_scatter(send, recv, counts, MPI_FLOAT, MPI_SUM, g->comm), "reduce-scatter", g);
    lp_to_device_floatX(x + lp_block_start(g, counts), recv, mine);
    free(send);
    free(recv);
    (void)pend;
#else
    (void)x, (void)pend;
    lp_fail("reduce-scatter on group %s: this build has no MPI", g->name);
#endif
}

// Finish every collective started on p.
static inline void lp_wait(const LPGroup* g, LPPending* pend) {
    if (pend->count == 0) return;
    lp_watch("an overlapped collective's completion", g);
#ifdef LLMPAR_NCCL
    if (g->nccl) {  // the compute stream waits for p's collectives, and only for them
        cudaCheck(cudaStreamWaitEvent(0, pend->done, 0));
        pend->count = 0;
        lp_watch_done();
        return;
    }
#endif
#if defined(LLMPAR_MPI) && defined(LLMPAR_CPU)
    lp_mpi_check(MPI_Waitall(pend->count, pend->req, MPI_STATUSES_IGNORE), "wait", g);
    lp_watch_done();
    for (int k = 0; k < pend->count; k++) {
        if (pend->average[k])  // sums -> averages
            for (size_t i = 0; i < pend->n[k]; i++) pend->average[k][i] /= g->size;
        if (pend->block[k]) memmove(pend->block[k] + pend->at[k], pend->block[k], pend->n[k] * sizeof(float));
        free(pend->args[k]);
    }
#else
    (void)g;
#endif
    pend->count = 0;
}

// One step of a ring (context parallelism's attention, section 9): n values of x on to the group's rank
// `next` while n values from rank `prev` arrive in y, under way until lp_exchange_wait while this rank
// computes. Over NCCL the send and the receive are one group (a send waits for its peer's receive: issued
// apart, every rank's send would wait on its neighbour's), device to device, on a stream and a communicator of
// the ring's own (on the comm stream a layer's exchange would queue behind the data-parallel reduction of the
// layer above),
// after the compute stream's work so far; the wait puts the compute stream behind it alone. Otherwise MPI's
// point-to-point above: the receive posted, the send staged. At most two exchanges are in flight, tags 0
// and 1 (the ring's blocks and their gradients). lp_exchange_free finishes the sends.
typedef struct {
    int tag;
    LPSends sends;  // MPI's
    LPRecv recv;
} LPExchange;
static inline void lp_exchange_start(const LPGroup* g, const floatX* x, floatX* y, size_t n, int next, int prev, int tag, LPExchange* e) {
#ifdef LLMPAR_NCCL
    if (g->ring) {
        size_t bytes = n * sizeof(floatX);
        lp_traffic(g, LP_SEND, bytes);
        cudaCheck(cudaEventRecord(lp_comm_event, 0));
        cudaCheck(cudaStreamWaitEvent(lp_ring_stream, lp_comm_event, 0));
        int id = lp_trace.on ? lp_trace_comm("ring exchange", g->name, (double)bytes, next) : -1;  // (on the timeline: the stream's times)
        if (id >= 0) lp_trace.ev[id].track = 3, lp_trace_mark(id, 0, lp_ring_stream);
        lp_nccl_check(ncclGroupStart(), "group start", g);
        lp_nccl_check(ncclSend(x, bytes, ncclChar, next, g->ring, lp_ring_stream), "send", g);
        lp_nccl_check(ncclRecv(y, bytes, ncclChar, prev, g->ring, lp_ring_stream), "receive", g);
        lp_nccl_check(ncclGroupEnd(), "group end", g);
        if (id >= 0) lp_trace_mark(id, 1, lp_ring_stream);
        cudaCheck(cudaEventRecord(lp_ring_done[tag], lp_ring_stream));
        e->tag = tag;
        return;
    }
#endif
    lp_recv_start(g, y, n, prev, tag, &e->recv);
    lp_send(g, x, n, next, tag, &e->sends);
}
static inline void lp_exchange_wait(const LPGroup* g, LPExchange* e) {
#ifdef LLMPAR_NCCL
    if (g->ring) {
        cudaCheck(cudaStreamWaitEvent(0, lp_ring_done[e->tag], 0));
        return;
    }
#else
    (void)g;
#endif
    lp_recv_wait(&e->recv);
}
static inline void lp_exchange_free(const LPGroup* g, LPExchange* e) {
    lp_sends_wait(g, &e->sends);
    lp_sends_free(&e->sends);
}

#ifdef LLMPAR_NCCL
// An NCCL communicator over the group's ranks: its rank 0 makes the id and broadcasts it over the group's MPI one.
static inline void lp_group_nccl_init(LPGroup* g, ncclComm_t* comm) {
    if (g->size == 1) return;
    ncclUniqueId id;
    if (g->rank == 0) lp_nccl_check(ncclGetUniqueId(&id), "unique id", g);
    lp_mpi_check(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, g->comm), "broadcast of the NCCL id", g);
    lp_nccl_comm_init(comm, g->size, id, g->rank, "communicator init", g);
}
#endif

#ifndef LLMPAR_CPU
// How many distinct GPUs the run has (ranks may share one, as in tests on one GPU) and which other rank,
// if any, drives this rank's: one "host/bus id" string per rank.
static inline void lp_count_gpus(LPProcess* proc) {
    char mine[256], bus[64] = "", host[128] = "";
    gethostname(host, sizeof(host) - 1);
    cudaCheck(cudaDeviceGetPCIBusId(bus, sizeof(bus), proc->device));
    snprintf(mine, sizeof(mine), "%s/%s", host, bus);
    char* all = (char*)lp_host_malloc((size_t)proc->world * 256, "GPU ids");
    memcpy(all, mine, 256);
#ifdef LLMPAR_MPI
    if (proc->world > 1)
        lp_mpi_check(MPI_Allgather(mine, 256, MPI_CHAR, all, 256, MPI_CHAR, MPI_COMM_WORLD), "all-gather of GPU ids", &proc->world_group);
#endif
    proc->gpus = 0;
    for (int r = 0; r < proc->world; r++) {
        int seen = 0;
        for (int q = 0; q < r && !seen; q++) seen = strcmp(all + 256 * q, all + 256 * r) == 0;
        proc->gpus += !seen;
        if (r != proc->rank && proc->shares_gpu_with < 0 && strcmp(all + 256 * r, mine) == 0) proc->shares_gpu_with = r;
    }
    free(all);
}
#endif

// Choose the transport for device tensors. NCCL (the CUDA default) needs one GPU per rank: when ranks
// share a GPU (several ranks on one card, as in tests on one GPU) the run uses MPI, with a notice.
// The choice is LPParallel's comm: "auto", "nccl" or "mpi". Every rank calls it, after lp_device_init. (CUDA
// build: it also counts the run's distinct GPUs, proc->gpus, which MFU divides by.)
void lp_comm_init(LPProcess* proc) {
    const char* choice = proc->par->comm;
    if (strcmp(choice, "auto") != 0 && strcmp(choice, "nccl") != 0 && strcmp(choice, "mpi") != 0)
        lp_fail_all("%s: transport must be auto, nccl or mpi, got '%s'", LP_SETTING(comm), choice);
#ifndef LLMPAR_CPU
    lp_count_gpus(proc);
#endif
#ifdef LLMPAR_NCCL
    if (proc->world == 1 || strcmp(choice, "mpi") == 0) return;
    if (proc->gpus < proc->world) {  // some ranks share a GPU
        if (strcmp(choice, "nccl") == 0) {
            if (proc->shares_gpu_with >= 0)
                lp_fail("%s nccl: ranks %d and %d share a GPU; NCCL needs one GPU per rank (use %s mpi)", LP_SETTING(comm),
                        proc->rank, proc->shares_gpu_with, LP_SETTING(comm));
            lp_exit_all();
        }
        lp_log("notice: ranks share a GPU, so collectives go over MPI through host memory (slower than NCCL)\n");
        return;
    }
    const LPParallel* par = proc->par;
    for (int a = 0; a < LP_GROUPS; a++) {  // (ep 1: the experts' groups are unused; cp 1: so are dpcp and edpcp)
        int used = a < LP_AXES || (a == LP_DPCP ? par->cp > 1 : a == LP_EDPCP ? par->cp > 1 && par->ep > 1 : par->ep > 1);
        if (used) lp_group_nccl_init(&proc->group[a], &proc->group[a].nccl);
    }
    // the ring's own communicator: one communicator's operations on two streams (the gradients' reductions
    // over cp under --diloco or --gossip, on the comm stream) could run in different orders on different ranks
    if (par->cp > 1) lp_group_nccl_init(&proc->group[LP_CP], &proc->group[LP_CP].ring);
    cudaCheck(cudaStreamCreateWithFlags(&lp_comm_stream, cudaStreamNonBlocking));
    cudaCheck(cudaStreamCreateWithFlags(&lp_ring_stream, cudaStreamNonBlocking));
    for (int k = 0; k < 2; k++) cudaCheck(cudaEventCreateWithFlags(&lp_ring_done[k], cudaEventDisableTiming));
    cudaCheck(cudaEventCreateWithFlags(&lp_comm_event, cudaEventDisableTiming));
#else
    if (strcmp(choice, "nccl") == 0 && proc->world > 1)
        lp_fail_all("%s nccl: this build has no NCCL (the CPU build, or nccl.h was not found)", LP_SETTING(comm));
    (void)proc;
#endif
}
#endif  // LLMPAR_IMPLEMENTATION

// ----------------------------------------------------------------------------------------------------
// 6. data
//
// llm.c token shards: a 256 x int32 header (magic, version, token count), then the tokens: GPT-2's format
// (20240520, version 1) holds them as uint16, the Llama 3 one (20240801, version 7) as uint32, for
// vocabularies beyond 65,536. One data set is one of the two: a pattern matching both is refused.
// The loader cuts each shard into windows of `window` tokens (+1 for the last target; training: the tokens
// of one optimizer step, so a step never straddles shards and reads the same tokens on every grid). It
// visits the shards in an order and each shard's windows in an order: file order, or shuffled (llm.c's
// behaviour), a permutation drawn from (seed, epoch) for the shards and (seed, epoch, shard) for the
// windows, new every epoch. Each call of next() reads the next ranks*B*T tokens of the window, rank r
// taking the r-th B*T slice. (epoch, shard, pos) is the whole state, so runs resume exactly.

#define LP_HEADER_INTS 256
#define LP_SHARD_MAGIC 20240520        // uint16 tokens, version 1
#define LP_SHARD32_MAGIC 20240801      // uint32 tokens, version 7
#define LP_MODEL_MAGIC 20240326
#define LP_TOKENIZER_MAGIC 20240328

typedef struct LPDataLoader {
    glob_t files;
    int num_files;
    size_t* shard_tokens;  // tokens in each shard
    int B, T, rank, world;
    size_t window;         // tokens per window, a multiple of world*B*T
    int shuffle;           // 1: shards and windows in a seeded random order, new each epoch; 0: file order
    uint64_t seed;
    int epoch;             // passes over the data completed
    int shard;             // position in this epoch's shard order
    size_t pos;            // tokens read of that shard, in window order: window pos / window, offset pos % window
    size_t* shard_order;   // this epoch's order of the shards
    size_t* window_order;  // the current shard's order of its windows
    FILE* file;
    int token_bytes;       // 2 (uint16 shards) or 4 (uint32)
    unsigned char* buffer; // B*T+1 tokens read
    int* inputs;           // (B,T)
    int* targets;          // (B,T)
} LPDataLoader;

#ifdef LLMPAR_IMPLEMENTATION
// --- context parallelism's share of a sequence (section 9's ring attention). The cp ranks of a replica read
// the same batch. Each sequence's T tokens are cut into 2 cp chunks of T/(2 cp), and rank i keeps chunks i and
// 2 cp - 1 - i, in that order: a sequence of T/cp rows, one early chunk and one late, so that under the causal
// mask (a row attends to the positions up to its own) every rank scores as many query-key pairs.
//     cp = 2, T = 16:  positions   0-3   4-7   8-11  12-15
//                      chunk        0     1     2     3
//                      rank         0     1     1     0
// Row t of rank i's Tl = T/cp rows is at position lp_cp_position(t, Tl, i, cp); within a rank they ascend.
// cp = 1 keeps the sequence whole, in order (any Tl).
static inline int lp_cp_position(int t, int Tl, int rank, int cp) {
    int half = Tl / 2;  // a chunk
    return t < half ? rank * half + t : (2 * cp - 1 - rank) * half + (t - half);
}
// Rank `rank`'s rows of a (B, T) batch of tokens into dst (B, T/cp).
static inline void lp_cp_take(int* dst, const int* src, int B, int T, int rank, int cp) {
    int Tl = T / cp;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < Tl; t++) dst[(size_t)b * Tl + t] = src[(size_t)b * T + lp_cp_position(t, Tl, rank, cp)];
}
// The query-key pairs a rank's rows of a sequence of T tokens score under the causal mask: a row at position
// p scores p + 1 (attention's FLOPs are 4 HS per pair and head forward). Rank i's two chunks score
// Tc^2 (2 cp - 1) + Tc (Tc + 1) pairs, Tc = T/(2 cp): the same on every rank.
double lp_cp_attention_pairs(int T, int rank, int cp) {
    double pairs = 0.0;
    for (int t = 0, Tl = T / cp; t < Tl; t++) pairs += lp_cp_position(t, Tl, rank, cp) + 1.0;
    return pairs;
}

// A permutation of 0 .. n-1 (Fisher-Yates) drawn from seed and the key; the identity without shuffle.
static inline void lp_permutation(size_t* out, size_t n, int shuffle, uint64_t seed, uint64_t key) {
    for (size_t i = 0; i < n; i++) out[i] = i;
    if (!shuffle) return;
    uint64_t state = (seed ^ (key + 1) * 0x9E3779B97F4A7C15ull) | 1;  // xorshift needs a nonzero state
    for (size_t i = n - 1; i > 0; i--) {
        uint64_t hi = lp_rand_u32(&state);  // two statements: C leaves the order of two calls in one expression open
        uint64_t lo = lp_rand_u32(&state);
        size_t j = ((hi << 32) | lo) % (i + 1);
        size_t t = out[i];
        out[i] = out[j];
        out[j] = t;
    }
}

// Go to (epoch, shard, pos): draw the epoch's shard order and that shard's window order, open it.
void lp_dataloader_seek(LPDataLoader* d, int epoch, int shard, size_t pos) {
    if (epoch < 0 || shard < 0 || shard >= d->num_files)
        lp_fail("data position (epoch %d, shard %d) is outside the shards given", epoch, shard);
    lp_permutation(d->shard_order, (size_t)d->num_files, d->shuffle, d->seed, (uint64_t)epoch << 32);
    size_t file = d->shard_order[shard];
    size_t windows = (d->shard_tokens[file] - 1) / d->window;
    if (pos > windows * d->window) lp_fail("data position (shard %d, token %zu) is outside the shards given", shard, pos);
    free(d->window_order);
    d->window_order = (size_t*)lp_host_malloc(windows * sizeof(size_t), "window order");
    lp_permutation(d->window_order, windows, d->shuffle, d->seed, ((uint64_t)epoch << 32) + 1 + file);
    if (d->file) fclose(d->file);
    d->file = lp_fopen(d->files.gl_pathv[file], "rb");
    d->epoch = epoch;
    d->shard = shard;
    d->pos = pos;
}

// `flag` names the option the pattern came from (-i or -j) for the error messages.
// Token i of n stored as uint16 or uint32 (bytes = 2 or 4), little-endian as the files are.
static inline unsigned lp_token_at(const unsigned char* p, int bytes, size_t i) {
    if (bytes == 2) { uint16_t t; memcpy(&t, p + 2 * i, 2); return t; }
    uint32_t t;
    memcpy(&t, p + 4 * i, 4);
    return t;
}

// A token shard's header: the bytes of its tokens (2 or 4), or an error naming the file.
static inline int lp_shard_token_bytes(const char* path, const int* header) {
    if (header[0] == LP_SHARD_MAGIC) {
        if (header[1] != 1) lp_fail("%s: token shard version %d is not supported (expected 1 for uint16 tokens)", path, header[1]);
        return 2;
    }
    if (header[0] == LP_SHARD32_MAGIC) {
        if (header[1] != 7) lp_fail("%s: token shard version %d is not supported (expected 7 for uint32 tokens)", path, header[1]);
        return 4;
    }
    lp_fail("%s: not a token shard (magic %d, expected %d for uint16 tokens or %d for uint32; dev/data/prepare.py makes shards "
            "of text)", path, header[0], LP_SHARD_MAGIC, LP_SHARD32_MAGIC);
    return 0;
}

// Every token of the shard at path (n tokens of `bytes` each after the header) is below vocab_size: one
// pass when the data is opened, so a bad token stops the run at its start rather than when training reaches it.
static inline void lp_shard_scan(const char* path, size_t n, int bytes, int vocab_size) {
    size_t chunk = (size_t)1 << 20;
    unsigned char* buf = (unsigned char*)lp_host_malloc(chunk * bytes, "token scan");
    FILE* f = lp_fopen(path, "rb");
    if (fseek(f, LP_HEADER_INTS * 4, SEEK_SET) != 0) lp_fail("%s: seek failed", path);
    for (size_t done = 0; done < n; done += chunk) {
        size_t k = n - done < chunk ? n - done : chunk;
        lp_fread(buf, bytes, k, f, path);
        for (size_t i = 0; i < k; i++)
            if (lp_token_at(buf, bytes, i) >= (unsigned)vocab_size)
                lp_fail("%s: token id %u at token %zu is >= the model's vocabulary size %d", path, lp_token_at(buf, bytes, i),
                        done + i, vocab_size);
    }
    fclose(f);
    free(buf);
}
#endif  // LLMPAR_IMPLEMENTATION

// The shards' manifest, DIR/manifest.txt as dev/data/prepare.py writes it: a line "llmpar shards 1", then
// per shard "NAME BYTES TOKENS MAX_ID CRC32C" (the CRC, in hex, of the whole file; for tools, not read here).
// Where a shard's folder has one, the start checks the shard against its line instead of reading every
// token: the same size means the tokens prepare.py counted, whose largest id the line gives. A manifest that
// does not match (no line for the shard, another size or count) is refused rather than passed over: the
// shards changed after it was written, so it no longer describes them, and silently scanning instead would
// hide that. --check-data full (LP_CHECK_FULL) reads every token and ignores manifests.
enum { LP_CHECK_MANIFEST, LP_CHECK_FULL };
static const char* const lp_check_data_names[] = {"manifest", "full", NULL};
#define LP_SHARD_MANIFEST_HEAD "llmpar shards 1"

typedef struct {
    char name[256];
    long long bytes, tokens;
    int max_id;
} LPShardEntry;

typedef struct {
    char dir[LP_PATH_MAX];   // the folder loaded ("" before the first)
    char path[LP_PATH_MAX];  // its manifest.txt, for errors
    int present;             // 0: the folder has no shard manifest (its shards are scanned)
    int n;
    LPShardEntry* e;         // sorted by name
} LPShardManifest;

#ifdef LLMPAR_IMPLEMENTATION
static int lp_shard_entry_cmp(const void* a, const void* b) {
    return strcmp(((const LPShardEntry*)a)->name, ((const LPShardEntry*)b)->name);
}

// Load dir's manifest.txt into m (a manifest.txt that does not start with the head line is not ours: absent).
static inline void lp_shard_manifest_load(LPShardManifest* m, const char* dir) {
    free(m->e);
    memset(m, 0, sizeof(*m));
    snprintf(m->dir, sizeof(m->dir), "%s", dir);
    lp_path(m->path, "%s/manifest.txt", dir);
    FILE* f = fopen(m->path, "r");
    if (!f) return;
    char line[LP_PATH_MAX];
    if (!fgets(line, sizeof(line), f) || strcmp(line, LP_SHARD_MANIFEST_HEAD "\n") != 0) {
        fclose(f);
        return;
    }
    m->present = 1;
    int cap = 0;
    for (int number = 2; fgets(line, sizeof(line), f); number++) {
        if (line[strspn(line, " \t\r\n")] == '\0') continue;
        if (m->n == cap) {
            cap = cap ? 2 * cap : 64;
            LPShardEntry* grown = (LPShardEntry*)realloc(m->e, cap * sizeof(LPShardEntry));
            if (!grown) lp_fail("out of host memory reading %s", m->path);
            m->e = grown;
        }
        LPShardEntry* e = &m->e[m->n++];
        unsigned crc;
        if (sscanf(line, "%255s %lld %lld %d %x", e->name, &e->bytes, &e->tokens, &e->max_id, &crc) != 5)
            lp_fail("%s: line %d is not 'NAME BYTES TOKENS MAX_ID CRC32C'", m->path, number);
    }
    fclose(f);
    qsort(m->e, m->n, sizeof(LPShardEntry), lp_shard_entry_cmp);
}

// 1 when the manifest of the shard's folder vouches for the shard at path (size bytes, n tokens), its ids
// below vocab_size; 0 when that folder has no manifest. A mismatch is an error naming the manifest.
static inline int lp_shard_check_manifest(LPShardManifest* m, const char* path, long long size, size_t n, int vocab_size) {
    char dir[LP_PATH_MAX];
    snprintf(dir, sizeof(dir), "%s", path);
    char* slash = strrchr(dir, '/');
    const char* name = slash ? path + (slash - dir) + 1 : path;
    if (slash) *slash = '\0';
    else snprintf(dir, sizeof(dir), ".");
    if (strcmp(dir, m->dir) != 0) lp_shard_manifest_load(m, dir);
    if (!m->present) return 0;
    LPShardEntry key;
    snprintf(key.name, sizeof(key.name), "%s", name);
    const LPShardEntry* e = (const LPShardEntry*)bsearch(&key, m->e, m->n, sizeof(LPShardEntry), lp_shard_entry_cmp);
    const char* why = "the shards changed after dev/data/prepare.py wrote it; --check-data full reads every token instead";
    if (!e) lp_fail("%s: has no line for %s (%s)", m->path, name, why);
    if (e->bytes != size || e->tokens != (long long)n)
        lp_fail("%s: says %s is %lld bytes (%lld tokens), the file is %lld bytes (%zu tokens) (%s)", m->path, name, e->bytes,
                e->tokens, size, n, why);
    if (e->max_id >= vocab_size)
        lp_fail("%s: token id %d (the largest, from %s) is >= the model's vocabulary size %d", path, e->max_id, m->path, vocab_size);
    return 1;
}

// A data set is whole or refused (rank 0, when it checks the shards): in each folder of the shards found,
// no shard its manifest lists that the pattern matches may be missing, and no dev/data/prepare.py job for
// these shards may be unfinished (its staging folder .NAME.prepare.tmp/ with job.json is left by a job
// killed before it moved every shard into place, which then leaves some shards, or old ones, under the
// manifest's names). Either is an error naming what is missing; --check-data full does not change that.
static inline void lp_shards_whole(const glob_t* found, const char* pattern, const char* flag) {
    LPShardManifest m = {0};
    char dir[LP_PATH_MAX], path[LP_PATH_MAX];
    for (size_t s = 0; s < found->gl_pathc; s++) {
        const char* shard = found->gl_pathv[s];
        const char* slash = strrchr(shard, '/');
        int prefix = slash ? (int)(slash - shard) + 1 : 0;  // the path up to the name, as the pattern spelled it
        lp_path(dir, "%.*s", slash ? prefix - 1 : 1, slash ? shard : ".");
        if (slash == shard) lp_path(dir, "/");
        if (m.dir[0] && strcmp(dir, m.dir) == 0) continue;
        lp_shard_manifest_load(&m, dir);
        int missing = 0, listed = 0;
        const char* first = NULL;
        for (int k = 0; k < m.n; k++) {
            lp_path(path, "%.*s%s", prefix, shard, m.e[k].name);
            if (fnmatch(pattern, path, FNM_PATHNAME | FNM_PERIOD) != 0) continue;
            listed++;
            size_t j = 0;
            while (j < found->gl_pathc && strcmp(found->gl_pathv[j], path) != 0) j++;
            if (j == found->gl_pathc && !missing++) first = m.e[k].name;
        }
        if (missing)
            lp_fail("%s %s: %s lists %s, which is not there (%d of the %d shards it lists that the pattern matches are missing: "
                    "a dev/data/prepare.py that did not finish? run it again)", flag, pattern, m.path, first, missing, listed);
        glob_t jobs;
        lp_path(path, "%.*s.*.prepare.tmp/job.json", prefix, shard);
        if (glob(path, 0, NULL, &jobs) != 0) continue;
        for (size_t j = 0; j < jobs.gl_pathc; j++) {
            const char* job = jobs.gl_pathv[j] + prefix + 1;  // NAME.prepare.tmp/job.json
            int name = (int)(strstr(job, ".prepare.tmp/") - job);
            for (size_t k = 0; k < found->gl_pathc; k++) {
                const char* base = found->gl_pathv[k] + prefix;
                if (strncmp(found->gl_pathv[k], shard, prefix) == 0 && strncmp(base, job, name) == 0 && base[name] == '_')
                    lp_fail("%s %s: %s: dev/data/prepare.py has not finished making the %.*s shards (run the same command again: it "
                            "continues)", flag, pattern, jobs.gl_pathv[j], name, job);
            }
        }
        globfree(&jobs);
    }
    free(m.e);
}
#endif  // LLMPAR_IMPLEMENTATION

// What a loader reads: set by name, the rest 0 (`LPDataOptions o = {.pattern = "x_*.bin", .B = 4, .T = 64};`).
typedef struct LPDataOptions {
    const char* pattern;  // the shards: a path, or a glob
    const char* label;    // how errors name them (train_gpt.cu: its flag, "-i"; NULL: "data")
    int B, T;             // this rank's batch
    int rank, ranks;      // this rank of the data-parallel ranks that share each window (0, 0: alone)
    size_t window;        // tokens per window (0: one batch of every rank, ranks*B*T)
    int shuffle;          // 1: shards and windows in an order drawn from seed, new each epoch; 0: file order
    uint64_t seed;
    int vocab_size;       // with scan: every token is checked to be below it when the loader opens
    int scan;
    int check;            // with scan: LP_CHECK_MANIFEST, from the folder's manifest.txt where there is one (else
                          // every token); LP_CHECK_FULL, every token
} LPDataOptions;

#ifdef LLMPAR_IMPLEMENTATION
// Open the shards o->pattern matches for this data-parallel rank, in windows of o->window tokens, in file
// order or shuffled; with o->scan, check every token id first (from the manifest where o->check allows).
void lp_dataloader_init(LPDataLoader* d, const LPDataOptions* o) {
    memset(d, 0, sizeof(*d));
    int B = o->B, T = o->T;
    size_t window = o->window;
    const char* flag = o->label ? o->label : "data";
    d->B = B;
    d->T = T;
    d->rank = o->rank;
    d->world = o->ranks ? o->ranks : 1;
    d->window = window ? window : (size_t)d->world * B * T;
    d->shuffle = o->shuffle;
    d->seed = o->seed;
    if (glob(o->pattern, 0, NULL, &d->files) != 0 || d->files.gl_pathc == 0)
        lp_fail("%s %s: no token shard matches", flag, o->pattern);
    d->num_files = (int)d->files.gl_pathc;
    d->shard_tokens = (size_t*)lp_host_malloc(d->num_files * sizeof(size_t), "shard sizes");
    LPShardManifest manifest = {0};
    for (int s = 0; s < d->num_files; s++) {
        const char* path = d->files.gl_pathv[s];
        FILE* f = lp_fopen(path, "rb");
        int header[LP_HEADER_INTS];
        lp_fread(header, sizeof(int), LP_HEADER_INTS, f, path);
        fclose(f);
        int bytes = lp_shard_token_bytes(path, header);
        if (s > 0 && bytes != d->token_bytes)
            lp_fail("%s %s: %s holds uint%d tokens, %s uint%d: one data set, one token format", flag, o->pattern, path, 8 * bytes,
                    d->files.gl_pathv[0], 8 * d->token_bytes);
        d->token_bytes = bytes;
        long long expect = (long long)LP_HEADER_INTS * 4 + (long long)bytes * (unsigned)header[2];
        long long size = lp_file_size(path);
        if (size < expect)
            lp_fail("%s: file is truncated (header says %u tokens: %lld bytes, file has %lld)", path, (unsigned)header[2], expect, size);
        if (size > expect) lp_fail("%s: file is longer than its header says (%lld bytes, expected %lld)", path, size, expect);
        d->shard_tokens[s] = (unsigned)header[2];
        if (d->shard_tokens[s] < d->window + 1)
            lp_fail("%s: %zu tokens is too few for one %s (%zu tokens + 1)", path, d->shard_tokens[s],
                    window ? "step" : "batch of ranks*B*T", d->window);
        if (o->scan && !(o->check == LP_CHECK_MANIFEST &&
                         lp_shard_check_manifest(&manifest, path, size, d->shard_tokens[s], o->vocab_size)))
            lp_shard_scan(path, d->shard_tokens[s], bytes, o->vocab_size);
    }
    free(manifest.e);
    if (o->scan) lp_shards_whole(&d->files, o->pattern, flag);
    d->buffer = (unsigned char*)lp_host_malloc((size_t)(B * T + 1) * d->token_bytes, "token buffer");
    d->inputs = (int*)lp_host_malloc((size_t)B * T * sizeof(int), "input tokens");
    d->targets = (int*)lp_host_malloc((size_t)B * T * sizeof(int), "target tokens");
    d->shard_order = (size_t*)lp_host_malloc(d->num_files * sizeof(size_t), "shard order");
    lp_dataloader_seek(d, 0, 0, 0);
}

void lp_dataloader_reset(LPDataLoader* d) { lp_dataloader_seek(d, 0, 0, 0); }

// Fill d->inputs and d->targets with this rank's next (B,T) batch: the next ranks*B*T tokens of the current
// window; past the shard's last window, the next shard; past the last shard, the next epoch.
void lp_dataloader_next(LPDataLoader* d) {
    size_t global = (size_t)d->world * d->B * d->T;
    if (d->pos >= (d->shard_tokens[d->shard_order[d->shard]] - 1) / d->window * d->window) {
        if (d->shard + 1 < d->num_files) lp_dataloader_seek(d, d->epoch, d->shard + 1, 0);
        else lp_dataloader_seek(d, d->epoch + 1, 0, 0);
    }
    size_t start = d->window_order[d->pos / d->window] * d->window + d->pos % d->window + (size_t)d->rank * d->B * d->T;
    size_t n = (size_t)d->B * d->T;
    const char* path = d->files.gl_pathv[d->shard_order[d->shard]];
    if (fseek(d->file, LP_HEADER_INTS * 4 + (long)(start * d->token_bytes), SEEK_SET) != 0) lp_fail("%s: seek failed", path);
    lp_fread(d->buffer, d->token_bytes, n + 1, d->file, path);  // ids checked when opened (scan or manifest)
    for (size_t i = 0; i < n; i++) {
        d->inputs[i] = (int)lp_token_at(d->buffer, d->token_bytes, i);
        d->targets[i] = (int)lp_token_at(d->buffer, d->token_bytes, i + 1);
    }
    d->pos += global;
}

// Batches in one pass over the data (for validation: all val shards once).
size_t lp_dataloader_batches_per_epoch(const LPDataLoader* d) {
    size_t n = 0;
    for (int s = 0; s < d->num_files; s++) n += (d->shard_tokens[s] - 1) / d->window;
    return n * (d->window / ((size_t)d->world * d->B * d->T));
}

void lp_dataloader_free(LPDataLoader* d) {
    if (d->file) fclose(d->file);
    globfree(&d->files);
    free(d->shard_tokens);
    free(d->shard_order);
    free(d->window_order);
    free(d->buffer);
    free(d->inputs);
    free(d->targets);
    memset(d, 0, sizeof(*d));
}
#endif  // LLMPAR_IMPLEMENTATION

// Multiple-choice evaluations (HellaSwag), llm.c's file (dev/data/hellaswag.py writes HellaSwag's val
// split): a 256 x int32 header (magic 20240522, version 1, examples, the longest example's bytes), then per
// example a stream of uint16: 65535, the example's bytes (these fields included), its index, the label (the
// right completion), the number of completions, the context's length and tokens, then each completion's
// length and tokens. A completion is scored on its own tokens only, read after the context: each of an
// example's rows is context + completion, and the losses of the completion's tokens decide.
#define LP_EVAL_MAGIC 20240522

typedef struct {
    int context, context_len;        // where its context's tokens start in LPEvalSet.tokens, and how many
    int completion, completion_len;  // its completion's
} LPEvalRow;

typedef struct LPEvalSet {
    int num_examples, num_rows;
    int* label;        // (examples): the right completion
    int* first_row;    // (examples + 1): example e's completions are rows first_row[e] .. first_row[e+1]-1
    LPEvalRow* rows;   // (rows): each completion after its context
    uint16_t* tokens;  // the file's examples as read
    int longest_row, longest_example;  // the most tokens in a row (context + completion), and whose
} LPEvalSet;

#ifdef LLMPAR_IMPLEMENTATION
// Row r's tokens (context, then completion): token i of context_len + completion_len.
static inline int lp_evalset_token(const LPEvalSet* s, int r, int i) {
    const LPEvalRow* w = &s->rows[r];
    return i < w->context_len ? s->tokens[w->context + i] : s->tokens[w->completion + i - w->context_len];
}

// Read and check an eval file: every field where llm.c's format puts it, every token below vocab_size.
// `label` names where the path came from in errors (train_gpt.cu: its flag).
void lp_evalset_load(LPEvalSet* s, const char* path, const char* label, int vocab_size) {
    memset(s, 0, sizeof(*s));
    FILE* f = fopen(path, "rb");
    if (!f) lp_fail("%s %s: cannot open: %s", label, path, strerror(errno));
    int header[LP_HEADER_INTS];
    long long size = lp_file_size(path), words = (size - LP_HEADER_INTS * 4) / 2;
    if (size < LP_HEADER_INTS * 4 || fread(header, sizeof(int), LP_HEADER_INTS, f) != LP_HEADER_INTS)
        lp_fail("%s %s: file is truncated (%lld bytes, shorter than the %d-byte header)", label, path, size, LP_HEADER_INTS * 4);
    if (header[0] != LP_EVAL_MAGIC)
        lp_fail("%s %s: not an llm.c eval file (magic %d, expected %d; dev/data/hellaswag.py writes one)", label, path,
                header[0], LP_EVAL_MAGIC);
    if (header[1] != 1) lp_fail("%s %s: eval file version %d is not supported (expected 1)", label, path, header[1]);
    // the smallest example is 9 words (6 fields, a context token, a completion's length and token): the file bounds
    // the count before anything of that size is allocated
    if (header[2] < 1 || header[2] > words / 9)
        lp_fail("%s %s: the header says %d examples, its %lld bytes after the header hold 1 .. %lld", label, path, header[2],
                size - LP_HEADER_INTS * 4, words / 9);
    if (words > INT_MAX) lp_fail("%s %s: %lld bytes, more than this format's int offsets reach", label, path, size);
    s->num_examples = header[2];
    s->tokens = (uint16_t*)lp_host_malloc((size_t)words * sizeof(uint16_t), "eval file");
    if (fread(s->tokens, sizeof(uint16_t), (size_t)words, f) != (size_t)words) lp_fail("%s %s: read failed", label, path);
    fclose(f);
    s->label = (int*)lp_host_malloc((size_t)s->num_examples * sizeof(int), "eval labels");
    s->first_row = (int*)lp_host_malloc((size_t)(s->num_examples + 1) * sizeof(int), "eval rows");
    s->rows = (LPEvalRow*)lp_host_malloc((size_t)(words / 2 + 1) * sizeof(LPEvalRow), "eval rows");  // a row takes 2+ words
    long long at = 0;
    for (int e = 0; e < s->num_examples; e++) {
        const uint16_t* x = s->tokens + at;  // 65535, bytes, index, label, completions, context length
        if (at + 6 > words)
            lp_fail("%s %s: file is truncated at example %d of the %d its header says", label, path, e, s->num_examples);
        if (x[0] != 65535 || x[2] != (uint16_t)e)
            lp_fail("%s %s: example %d does not start where the one before ends (delimiter %d, index %d)", label, path, e, x[0],
                    x[2]);
        long long end = at + x[1] / 2, next = at + 6 + x[5];
        if (x[1] % 2) lp_fail("%s %s: example %d says it is %d bytes, an odd number (its fields are uint16)", label, path, e, x[1]);
        if (end > words) lp_fail("%s %s: file is truncated in example %d (%d bytes)", label, path, e, x[1]);
        if (x[4] < 1 || x[3] >= x[4]) lp_fail("%s %s: example %d: label %d of %d completions", label, path, e, x[3], x[4]);
        if (x[5] < 1) lp_fail("%s %s: example %d has an empty context", label, path, e);
        s->label[e] = x[3];
        s->first_row[e] = s->num_rows;
        for (int c = 0; c < x[4]; c++) {
            int len = next < end ? s->tokens[next] : 0;
            if (len < 1 || next + 1 + len > end)
                lp_fail("%s %s: example %d: completion %d is empty or runs past the example's %d bytes", label, path, e, c, x[1]);
            LPEvalRow row = {(int)at + 6, x[5], (int)next + 1, len};
            s->rows[s->num_rows++] = row;
            if (x[5] + len > s->longest_row) {
                s->longest_row = x[5] + len;
                s->longest_example = e;
            }
            next += 1 + len;
        }
        if (next != end) lp_fail("%s %s: example %d holds %lld bytes after its last completion", label, path, e, 2 * (end - next));
        at = end;
    }
    if (size != LP_HEADER_INTS * 4 + 2 * at)
        lp_fail("%s %s: file is longer than its %d examples (%lld bytes more)", label, path, s->num_examples,
                size - LP_HEADER_INTS * 4 - 2 * at);
    s->first_row[s->num_examples] = s->num_rows;
    for (int e = 0; e < s->num_examples; e++)
        for (int r = s->first_row[e]; r < s->first_row[e + 1]; r++)
            for (int i = 0; i < s->rows[r].context_len + s->rows[r].completion_len; i++)
                if (lp_evalset_token(s, r, i) >= vocab_size)
                    lp_fail("%s %s: example %d: token id %d is >= the model's vocabulary size %d", label, path, e,
                            lp_evalset_token(s, r, i), vocab_size);
}

// A batch of rows r0 .. r0+n-1, one per batch row, as (n, T) inputs and targets, T the longest row's tokens
// less one (the last token is only a target), rounded up to a multiple of `multiple` (sequence parallelism
// splits the n*T positions over its ranks). Row r's completion is scored by the losses at positions
// context_len-1 .. context_len+completion_len-2. Returns T.
int lp_evalset_batch(const LPEvalSet* s, int r0, int n, int multiple, int* inputs, int* targets) {
    int T = 1;
    for (int r = r0; r < r0 + n; r++)
        if (s->rows[r].context_len + s->rows[r].completion_len - 1 > T) T = s->rows[r].context_len + s->rows[r].completion_len - 1;
    T = (T + multiple - 1) / multiple * multiple;
    for (int b = 0; b < n; b++) {
        int r = r0 + b, len = s->rows[r].context_len + s->rows[r].completion_len;
        for (int t = 0; t < T; t++) {  // past the row: token 0, which causal attention keeps from the row and no loss reads
            inputs[b * T + t] = t < len ? lp_evalset_token(s, r, t) : 0;
            targets[b * T + t] = t + 1 < len ? lp_evalset_token(s, r, t + 1) : 0;
        }
    }
    return T;
}

// The sum of row r's completion losses, from the (T) losses of its batch row.
double lp_evalset_row_loss(const LPEvalSet* s, int r, const float* losses) {
    double sum = 0.0;
    for (int i = 0; i < s->rows[r].completion_len; i++) sum += losses[s->rows[r].context_len - 1 + i];
    return sum;
}

// How many of examples e0 .. e1-1 are right, given each row's summed completion loss (loss[r - first_row[e0]]):
// acc counts an example right when its label's completion has the lowest sum, acc_norm when it has the lowest
// mean per token (llm.c reports acc_norm). Ties go to the first, as llm.c's.
void lp_evalset_score(const LPEvalSet* s, int e0, int e1, const double* loss, int* acc, int* acc_norm) {
    *acc = *acc_norm = 0;
    int r0 = s->first_row[e0];
    for (int e = e0; e < e1; e++) {
        int best = s->first_row[e], best_norm = best;
        for (int r = best + 1; r < s->first_row[e + 1]; r++) {
            if (loss[r - r0] < loss[best - r0]) best = r;
            if (loss[r - r0] / s->rows[r].completion_len < loss[best_norm - r0] / s->rows[best_norm].completion_len) best_norm = r;
        }
        *acc += best - s->first_row[e] == s->label[e];
        *acc_norm += best_norm - s->first_row[e] == s->label[e];
    }
}

void lp_evalset_free(LPEvalSet* s) {
    free(s->label);
    free(s->first_row);
    free(s->rows);
    free(s->tokens);
    memset(s, 0, sizeof(*s));
}
#endif  // LLMPAR_IMPLEMENTATION

// ----------------------------------------------------------------------------------------------------
// 7. kernels
//
// Shapes: B batch, T time, C channels, N = B*T rows, OC output channels, NH heads, HS = C/NH.
// The CPU loops take float; the CUDA launchers take floatX (bf16). On the CPU build floatX is float, so
// lp_op (bound at the end of this section) is the loop with the same call. Conventions shared by both:
//   - "dinp" outputs of matmul and attention are overwritten; weight and bias grads accumulate (+=), so
//     gradient accumulation over micro-batches needs no extra buffers;
//   - layernorm_backward accumulates into dinp, which is the residual stream's gradient.

#ifdef LLMPAR_IMPLEMENTATION
// exp and tanh in plain arithmetic, which the compiler vectorises (a libm call it cannot: GELU's tanhf was
// a tenth of the CPU step, the classifier's expf most of its time). e^x = 2^n e^r with n = round(x / ln 2),
// |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error below 1e-8) and 2^n put in the exponent
// bits: within 1 ulp of the true value (tested; expf: half an ulp). Below -87 it returns 0 (expf: at most 1.6e-38), above 88 infinity
// (expf: from 88.72); NaN stays NaN. Clamps are compares (fminf must treat NaN apart, so it stays a libm
// call that stops vectorisation).
static inline LP_HD float lp_expf(float x) {
    float c = x < 88.0f ? x : 88.0f;  // NaN becomes 88 here and is put back at the end
    c = c > -87.0f ? c : -87.0f;
    float n = rintf(c * 1.442695041f);
    float r = c - n * 0.693145752f - n * 1.428606765e-6f;  // ln 2 in two parts: r exact to fp32
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720 + r * (1.0f / 5040)))))));
    union { int i; float f; } two_n = {((int)n + 127) << 23};  // n is within -126 .. 127
    float e = p * two_n.f;
    return x < -87.0f ? 0.0f : x > 88.0f ? INFINITY : x == x ? e : x;
}
// tanh(u) = 1 - 2 / (1 + e^2u). Absolute error below 2.5e-7 against tanhf (tested); u is clamped where tanh
// is +-1 in fp32 anyway (NaN becomes 40 here).
static inline LP_HD float lp_tanhf(float u) {
    u = u < 40.0f ? u : 40.0f;
    u = u > -40.0f ? u : -40.0f;
    return 1.0f - 2.0f / (1.0f + lp_expf(2.0f * u));
}

#define LP_GELU_SCALE 0.7978845608028654f  // sqrt(2/pi)
static inline LP_HD float lp_gelu(float x) {
    return 0.5f * x * (1.0f + lp_tanhf(LP_GELU_SCALE * (x + 0.044715f * x * x * x)));
}
static inline LP_HD float lp_gelu_grad(float x) {
    float u = LP_GELU_SCALE * (x + 0.044715f * x * x * x);
    float th = lp_tanhf(u);
    float sech2 = 1.0f - th * th;
    return 0.5f * (1.0f + th) + 0.5f * x * sech2 * LP_GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
}
#endif  // LLMPAR_IMPLEMENTATION

#ifndef LLMPAR_CPU
// CUDA building blocks shared by the kernels below: launch sizes, warp and block reductions, scratch
// buffers that grow on demand, and one cuBLASLt GEMM used by every matmul.
#define LP_THREADS 256
#ifdef LLMPAR_IMPLEMENTATION
static inline unsigned lp_grid(size_t n, int threads) { return (unsigned)((n + threads - 1) / threads); }

// Launch a kernel on the compute stream and check the launch. LP_SHARED is the launch's dynamic shared
// memory as an array. Under the CUDA emulator (dev/cudaemu, no GPU) the same lines run on the CPU.
#ifndef LLMPAR_CUDAEMU
#define LP_LAUNCH(kernel, grid, block, shmem, ...) \
    do { kernel<<<grid, block, shmem>>>(__VA_ARGS__); cudaCheck(cudaGetLastError()); } while (0)
#define LP_SHARED(type, name) extern __shared__ type name[]
#else
#define LP_LAUNCH(kernel, grid, block, shmem, ...) \
    do { cudaemu_launch(#kernel, kernel, grid, block, shmem, 0, __VA_ARGS__); cudaCheck(cudaGetLastError()); } while (0)
#define LP_SHARED(type, name) type* name = (type*)cudaemu_dynamic_shared()
#endif

#endif  // LLMPAR_IMPLEMENTATION

// 128-bit access for the memory-bound elementwise kernels: a thread takes 8 bf16 values [i, i + 8) with
// one 16-byte load or store (ld.global.v4) instead of eight 2-byte ones. Where the 8 are not all there
// (the tail) or p + i is not 16-byte aligned (a slice at an odd offset) it goes value by value; padding
// lanes read as 0 and are not written.
#define LP_PACK 8
typedef union {
    uint4 bits;
    floatX x[LP_PACK];
} LPPack;
#ifdef LLMPAR_IMPLEMENTATION
static __device__ inline LPPack lp_load_pack(const floatX* p, size_t i, size_t n) {
    LPPack q;
    if (i + LP_PACK <= n && ((uintptr_t)(p + i) & 15) == 0) {
        q.bits = *(const uint4*)(p + i);
        return q;
    }
#pragma unroll
    for (int k = 0; k < LP_PACK; k++) q.x[k] = i + k < n ? p[i + k] : lp_xf(0.0f);
    return q;
}
static __device__ inline void lp_store_pack(floatX* p, size_t i, size_t n, LPPack q) {
    if (i + LP_PACK <= n && ((uintptr_t)(p + i) & 15) == 0) {
        *(uint4*)(p + i) = q.bits;
        return;
    }
#pragma unroll
    for (int k = 0; k < LP_PACK; k++)  // (constant indices keep the pack in registers)
        if (i + k < n) p[i + k] = q.x[k];
}
#endif  // LLMPAR_IMPLEMENTATION

// The same for fp32 values: 8 of them [i, i + 8) as two 16-byte accesses.
typedef union {
    float4 q[2];
    float x[LP_PACK];
} LPPackF;
#ifdef LLMPAR_IMPLEMENTATION
static __device__ inline LPPackF lp_load_packf(const float* p, size_t i, size_t n) {
    LPPackF q;
    if (i + LP_PACK <= n && ((uintptr_t)(p + i) & 15) == 0) {
        q.q[0] = ((const float4*)(p + i))[0];
        q.q[1] = ((const float4*)(p + i))[1];
        return q;
    }
#pragma unroll
    for (int k = 0; k < LP_PACK; k++) q.x[k] = i + k < n ? p[i + k] : 0.0f;
    return q;
}
static __device__ inline void lp_store_packf(float* p, size_t i, size_t n, LPPackF q) {
    if (i + LP_PACK <= n && ((uintptr_t)(p + i) & 15) == 0) {
        ((float4*)(p + i))[0] = q.q[0];
        ((float4*)(p + i))[1] = q.q[1];
        return;
    }
#pragma unroll
    for (int k = 0; k < LP_PACK; k++)
        if (i + k < n) p[i + k] = q.x[k];
}

static __device__ inline float lp_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static __device__ inline float lp_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Sum (or max) over the block; every thread gets the result. blockDim.x is a multiple of 32.
static __device__ inline float lp_block_reduce(float v, int is_max) {
    __shared__ float partial[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = is_max ? lp_warp_max(v) : lp_warp_sum(v);
    __syncthreads();  // the previous call's readers are done with `partial`
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : (is_max ? -INFINITY : 0.0f);
    return is_max ? lp_warp_max(v) : lp_warp_sum(v);
}

// Two sums over the block at once, in the same order, with one pair of barriers (the LayerNorm backward's
// two per row); every thread gets both. blockDim.x is a multiple of 32.
static __device__ inline float2 lp_block_sum2(float a, float b) {
    __shared__ float2 partial[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    a = lp_warp_sum(a);
    b = lp_warp_sum(b);
    __syncthreads();  // the previous call's readers are done with `partial`
    if (lane == 0) partial[warp] = make_float2(a, b);
    __syncthreads();
    float2 p = lane < warps ? partial[lane] : make_float2(0.0f, 0.0f);
    return make_float2(lp_warp_sum(p.x), lp_warp_sum(p.y));
}
#endif  // LLMPAR_IMPLEMENTATION

// A device buffer that grows to the largest size asked for; kernels use it for partial sums.
typedef struct { void* ptr; size_t bytes; } LPScratch;
#ifdef LLMPAR_IMPLEMENTATION
static inline void* lp_scratch(LPScratch* s, size_t bytes, const char* what) {
    if (bytes > s->bytes) {
        if (s->ptr) lp_device_free(s->ptr);
        s->ptr = lp_device_malloc(bytes, what);
        s->bytes = bytes;
    }
    return s->ptr;
}
#endif  // LLMPAR_IMPLEMENTATION
LP_STATE LPScratch lp_partials;  // fp32 partial sums of the deterministic two-pass reductions

#ifdef LLMPAR_IMPLEMENTATION
// D = alpha * op(A) op(B) + beta * D in cuBLAS's column-major terms (a row-major matrix is its own
// transpose there), bf16 in and out, fp32 accumulation, then cuBLASLt's epilogue: DEFAULT; BIAS (+ bias,
// length m, broadcast over columns); GELU_AUX(_BIAS) (GELU, the pre-activation written to aux); DGELU
// (times GELU's derivative at the pre-activation read from aux: GELU's backward fused); BGRADB (op(B)'s
// column sums written to bias, length n: a bias gradient fused). aux has D's leading dimension. batch > 1
// runs strided batches. Returns 0, having run nothing, where cuBLASLt has no algorithm for it (the
// backward's epilogues have fallbacks); lp_gemm fails instead.
static inline int lp_gemm_epilogue(int transA, int transB, int m, int n, int k, const floatX* A, int lda, long long strideA,
                                   const floatX* B, int ldb, long long strideB, floatX* D, int ldd, long long strideD,
                                   int batch, float alpha, float beta, cublasLtEpilogue_t epilogue, const floatX* bias,
                                   const floatX* aux) {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasOperation_t opA = transA ? CUBLAS_OP_T : CUBLAS_OP_N, opB = transB ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasCheck(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opA, sizeof(opA)));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opB, sizeof(opB)));
    cublasCheck(cublasLtMatrixLayoutCreate(&la, LP_CUDA_FLOATX, transA ? k : m, transA ? m : k, lda));
    cublasCheck(cublasLtMatrixLayoutCreate(&lb, LP_CUDA_FLOATX, transB ? n : k, transB ? k : n, ldb));
    cublasCheck(cublasLtMatrixLayoutCreate(&ld, LP_CUDA_FLOATX, m, n, ldd));
    if (batch > 1) {
        cublasLtMatrixLayout_t layouts[3] = {la, lb, ld};
        long long strides[3] = {strideA, strideB, strideD};
        for (int i = 0; i < 3; i++) {
            cublasCheck(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)));
            cublasCheck(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                         &strides[i], sizeof(strides[i])));
        }
    }
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    if (bias) {
        cudaDataType_t bias_type = LP_CUDA_FLOATX;
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    }
    if (aux) {
        long long aux_ld = ldd;
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
    }
    cublasLtMatmulPreference_t pref;
    cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                     &lp_cublaslt_workspace_size, sizeof(lp_cublaslt_workspace_size)));
    // tell the heuristic how aligned the matrices really are (it assumes 256 bytes), batch strides included
    const void* ptrs[3] = {A, B, D};
    long long strides[3] = {strideA, strideB, strideD};
    cublasLtMatmulPreferenceAttributes_t align_attr[3] = {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 3; i++) {
        uint64_t bits = (uint64_t)(uintptr_t)ptrs[i] | (batch > 1 ? (uint64_t)strides[i] * sizeof(floatX) : 0) | 256;
        uint32_t align = (uint32_t)(bits & (~bits + 1));  // the lowest set bit: the largest power of 2 dividing all
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align, sizeof(align)));
        if (i == 2)  // C is D here (in place)
            cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align, sizeof(align)));
    }
    cublasLtMatmulHeuristicResult_t heuristic;
    int found = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lp_cublaslt, desc, la, lb, ld, ld, pref, 1, &heuristic, &found);
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) cublasCheck(st);
    if (st == CUBLAS_STATUS_SUCCESS && found > 0)
        cublasCheck(cublasLtMatmul(lp_cublaslt, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &heuristic.algo,
                                   lp_cublaslt_workspace, lp_cublaslt_workspace_size, 0));
    cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
    cublasCheck(cublasLtMatrixLayoutDestroy(la));
    cublasCheck(cublasLtMatrixLayoutDestroy(lb));
    cublasCheck(cublasLtMatrixLayoutDestroy(ld));
    cublasCheck(cublasLtMatmulDescDestroy(desc));
    return st == CUBLAS_STATUS_SUCCESS && found > 0;
}
// The forward epilogues by what is given: + bias, GELU with its pre-activation kept in gelu_aux.
static inline void lp_gemm(int transA, int transB, int m, int n, int k, const floatX* A, int lda, long long strideA,
                           const floatX* B, int ldb, long long strideB, floatX* D, int ldd, long long strideD,
                           int batch, float alpha, float beta, const floatX* bias, floatX* gelu_aux) {
    cublasLtEpilogue_t epilogue = bias && gelu_aux ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : bias ? CUBLASLT_EPILOGUE_BIAS
                                  : gelu_aux       ? CUBLASLT_EPILOGUE_GELU_AUX
                                                   : CUBLASLT_EPILOGUE_DEFAULT;
    if (!lp_gemm_epilogue(transA, transB, m, n, k, A, lda, strideA, B, ldb, strideB, D, ldd, strideD, batch, alpha, beta, epilogue,
                          bias, gelu_aux))
        lp_fail("cuBLASLt has no algorithm for a %s%s GEMM m=%d n=%d k=%d batch=%d (epilogue %d)", transA ? "T" : "N",
                transB ? "T" : "N", m, n, k, batch, (int)epilogue);
}
#endif  // LLMPAR_IMPLEMENTATION
#endif

#ifdef LLMPAR_IMPLEMENTATION
// --- embedding: out[i,:] = wte[token_i] for the tokens in the slice [v0, v0 + Vl) of the vocabulary that
// wte holds; the other rows of out are left as they are (zeroed by the caller). Tensor parallelism: each
// rank owns Vl rows of wte, and the partial embeddings are summed over the group; ZeRO-3 fills out a
// gathered piece of wte at a time. Without either the slice is the whole vocabulary.
static inline void lp_embedding_forward_cpu(float* out, const int* tokens, const float* wte, int v0, int Vl, int N, int C) {
#pragma omp parallel for
    for (int i = 0; i < N; i++) {
        int v = tokens[i] - v0;
        if (v < 0 || v >= Vl) continue;
        float* o = out + (size_t)i * C;
        for (int c = 0; c < C; c++) o[c] = wte[(size_t)v * C + c];
    }
}

// Backward scatters into wte rows by token. `tokens` are HOST memory in both builds: the CUDA version
// groups positions by token on the host so its sums need no atomics and are deterministic.
static inline void lp_embedding_backward_cpu(float* dwte, const float* dout, const int* tokens, int v0, int Vl, int N, int C) {
    // rows of wte may repeat, so this loop runs serially over positions; it is a small share of a step
    for (int i = 0; i < N; i++) {
        int v = tokens[i] - v0;
        if (v < 0 || v >= Vl) continue;
        float* dw = dwte + (size_t)v * C;
        const float* d = dout + (size_t)i * C;
        for (int c = 0; c < C; c++) dw[c] += d[c];
    }
}

// --- positions: out[i,:] = inp[i,:] + wpe[pos[(row0 + i) % T]] for `rows` rows of a (B,T) batch starting at
// row row0 (sequence parallelism: a rank holds a block of the rows). pos (T, device) is each row's position in
// its sequence, distinct: 0 .. T-1 for a whole sequence, the cache's offset onward for sampling, the rank's
// chunks under context parallelism (lp_cp_position).
static inline void lp_positions_forward_cpu(float* out, const float* inp, const float* wpe, const int* pos, int row0, int rows, int T,
                                            int C) {
#pragma omp parallel for
    for (int i = 0; i < rows; i++) {
        const float* p = wpe + (size_t)pos[(row0 + i) % T] * C;
        for (int c = 0; c < C; c++) out[(size_t)i * C + c] = inp[(size_t)i * C + c] + p[c];
    }
}
static inline void lp_positions_backward_cpu(float* dwpe, const float* dout, const int* pos, int row0, int rows, int T, int C) {
#pragma omp parallel for
    for (int t = 0; t < T; t++)
        for (int i = ((t - row0) % T + T) % T; i < rows; i += T)  // the rows at position pos[t], in order
            for (int c = 0; c < C; c++) dwpe[(size_t)pos[t] * C + c] += dout[(size_t)i * C + c];
}
#endif  // LLMPAR_IMPLEMENTATION

#ifndef LLMPAR_CPU
#ifdef LLMPAR_IMPLEMENTATION
static __global__ void lp_embedding_forward_kernel(floatX* out, const int* tokens, const floatX* wte, int v0, int Vl, int N, int C) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)N * C) return;
    int v = tokens[i / C] - v0;
    if (v >= 0 && v < Vl) out[i] = wte[(size_t)v * C + i % C];
}
static inline void lp_embedding_forward_gpu(floatX* out, const int* tokens, const floatX* wte, int v0, int Vl, int N, int C) {
    size_t n = (size_t)N * C;
    LP_LAUNCH(lp_embedding_forward_kernel, lp_grid(n, LP_THREADS), LP_THREADS, 0, out, tokens, wte, v0, Vl, N, C);
}

// dwte: one thread per (distinct token, channel) sums that token's positions in order.
// index = [local rows (U)] [start (U+1)] [positions], positions grouped by token.
static __global__ void lp_embedding_backward_kernel(floatX* dwte, const floatX* dout, const int* index, int U, int C) {
    int u = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;  // u in x: up to V distinct tokens
    if (c >= C) return;
    const int* start = index + U;
    const int* positions = index + 2 * U + 1;
    float s = 0.0f;
    for (int j = start[u]; j < start[u + 1]; j++) s += lp_bf(dout[(size_t)positions[j] * C + c]);
    size_t w = (size_t)index[u] * C + c;
    dwte[w] = lp_xf(lp_bf(dwte[w]) + s);
}
#endif  // LLMPAR_IMPLEMENTATION
LP_STATE LPScratch lp_embedding_index;  // device copy of the grouping below
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_embedding_backward_gpu(floatX* dwte, const floatX* dout, const int* tokens, int v0, int Vl, int N, int C) {
    // counting sort of this slice's positions by token on the host: deterministic sums without atomics
    int* count = (int*)calloc((size_t)Vl + 1, sizeof(int));
    int* index = (int*)lp_host_malloc((size_t)(3 * N + 1) * sizeof(int), "embedding backward index");
    if (!count) lp_fail("out of host memory in the embedding backward");
    int M = 0;  // positions whose token is in the slice
    for (int i = 0; i < N; i++) {
        int v = tokens[i] - v0;
        if (v >= 0 && v < Vl) { count[v + 1]++; M++; }
    }
    if (M == 0) { free(count); free(index); return; }
    int U = 0;
    for (int v = 0; v < Vl; v++) U += count[v + 1] > 0;
    int* uniq = index;
    int* start = index + U;
    int* positions = index + 2 * U + 1;
    for (int v = 0, u = 0; v < Vl; v++) {  // count[v] becomes the first slot of row v
        count[v + 1] += count[v];
        if (count[v + 1] > count[v]) { uniq[u] = v; start[u] = count[v]; u++; }
    }
    start[U] = M;
    for (int i = 0; i < N; i++) {  // in increasing position order
        int v = tokens[i] - v0;
        if (v >= 0 && v < Vl) positions[count[v]++] = i;
    }
    size_t bytes = (size_t)(2 * U + 1 + M) * sizeof(int);
    int* d_index = (int*)lp_scratch(&lp_embedding_index, bytes, "embedding backward index");
    lp_copy_to_device(d_index, index, bytes);
    free(count);
    free(index);
    dim3 grid(U, lp_grid(C, LP_THREADS));
    LP_LAUNCH(lp_embedding_backward_kernel, grid, LP_THREADS, 0, dwte, dout, d_index, U, C);
}

static __global__ void lp_positions_forward_kernel(floatX* out, const floatX* inp, const floatX* wpe, const int* pos, int row0, int rows,
                                                   int T, int C) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * C) return;
    out[i] = lp_xf(lp_bf(inp[i]) + lp_bf(wpe[(size_t)pos[(row0 + i / C) % T] * C + i % C]));
}
static inline void lp_positions_forward_gpu(floatX* out, const floatX* inp, const floatX* wpe, const int* pos, int row0, int rows, int T,
                                            int C) {
    size_t n = (size_t)rows * C;
    LP_LAUNCH(lp_positions_forward_kernel, lp_grid(n, LP_THREADS), LP_THREADS, 0, out, inp, wpe, pos, row0, rows, T, C);
}
static __global__ void lp_positions_backward_kernel(floatX* dwpe, const floatX* dout, const int* pos, int row0, int rows, int T, int C) {
    size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x;  // (t, c): row t's position
    if (k >= (size_t)T * C) return;
    int t = (int)(k / C), c = (int)(k % C);
    float s = 0.0f;
    for (int i = ((t - row0) % T + T) % T; i < rows; i += T) s += lp_bf(dout[(size_t)i * C + c]);
    size_t w = (size_t)pos[t] * C + c;
    dwpe[w] = lp_xf(lp_bf(dwpe[w]) + s);
}
static inline void lp_positions_backward_gpu(floatX* dwpe, const floatX* dout, const int* pos, int row0, int rows, int T, int C) {
    LP_LAUNCH(lp_positions_backward_kernel, lp_grid((size_t)T * C, LP_THREADS), LP_THREADS, 0, dwpe, dout, pos, row0, rows, T, C);
}
#endif  // LLMPAR_IMPLEMENTATION
#endif

#ifdef LLMPAR_IMPLEMENTATION
// --- layernorm (biased variance; eps: lp_norm_eps, GPT-2's 1e-5); mean and rstd are kept in fp32 for the backward
// pass. RMSNorm (Llama) is the same loop with the centering and the bias switched off: mean NULL (x's mean taken
// as 0, so rstd = 1 / sqrt(mean(x^2) + eps)) and b NULL (a LayerNorm without bias: only b NULL).
static inline void lp_layernorm_forward_cpu(float* out, float* mean, float* rstd, const float* inp,
                                            const float* w, const float* b, int N, int C, float eps) {
#pragma omp parallel for
    for (int i = 0; i < N; i++) {
        const float* x = inp + (size_t)i * C;
        float m = 0.0f, v = 0.0f;
        if (mean) {
            for (int c = 0; c < C; c++) m += x[c];
            m /= C;
        }
        for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
        float s = 1.0f / sqrtf(v / C + eps);
        float* o = out + (size_t)i * C;
        for (int c = 0; c < C; c++) o[c] = (x[c] - m) * s * w[c] + (b ? b[c] : 0.0f);
        if (mean) mean[i] = m;
        rstd[i] = s;
    }
}

// residual = inp1 + (inp2 + bias), then out = layernorm(residual): one pass over the residual stream, not
// two. inp2 is a row-parallel projection's output, summed over tensor-parallel ranks before its bias is
// added here, once (NULL: none, a MoE layer's experts add theirs). out NULL: the residual only (a pipeline chunk's last layer, whose LayerNorm is in the
// next chunk).
static inline void lp_residual_layernorm_forward_cpu(float* residual, float* out, float* mean, float* rstd,
                                                     const float* inp1, const float* inp2, const float* bias,
                                                     const float* w, const float* b, int N, int C, float eps) {
#pragma omp parallel for
    for (size_t i = 0; i < (size_t)N * C; i++) residual[i] = inp1[i] + (inp2[i] + (bias ? bias[i % C] : 0.0f));
    if (out) lp_layernorm_forward_cpu(out, mean, rstd, residual, w, b, N, C, eps);
}

// dinp += the input's gradient, dw (and db, unless NULL) += the weight's (and bias's); mean NULL: RMSNorm's
// (without the mean's term).
static inline void lp_layernorm_backward_cpu(float* dinp, float* dw, float* db, const float* dout,
                                             const float* inp, const float* w, const float* mean,
                                             const float* rstd, int N, int C) {
#pragma omp parallel for
    for (int i = 0; i < N; i++) {
        const float* x = inp + (size_t)i * C;
        const float* d = dout + (size_t)i * C;
        float mi = mean ? mean[i] : 0.0f, dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
        for (int c = 0; c < C; c++) {
            float norm = (x[c] - mi) * rstd[i];
            dnorm_mean += d[c] * w[c];
            dnorm_norm_mean += d[c] * w[c] * norm;
        }
        dnorm_mean = mean ? dnorm_mean / C : 0.0f;
        dnorm_norm_mean /= C;
        float* di = dinp + (size_t)i * C;
        for (int c = 0; c < C; c++) {
            float norm = (x[c] - mi) * rstd[i];
            di[c] += (d[c] * w[c] - dnorm_mean - norm * dnorm_norm_mean) * rstd[i];
        }
    }
    // weight and bias grads sum over rows: one thread per channel keeps it race-free
#pragma omp parallel for
    for (int c = 0; c < C; c++) {
        float sw = 0.0f, sb = 0.0f;
        for (int i = 0; i < N; i++) {
            float d = dout[(size_t)i * C + c];
            sw += d * (inp[(size_t)i * C + c] - (mean ? mean[i] : 0.0f)) * rstd[i];
            sb += d;
        }
        dw[c] += sw;
        if (db) db[c] += sb;
    }
}

#ifndef LLMPAR_CPU
// Rows of LayerNorm on the GPU: a block walks a fixed set of rows, one row at a time, each thread owning one
// 128-bit pack of channels (LPPack), so a block is C / 8 threads rounded up to whole warps; a row wider than
// 1024 packs is split into chunks (blockIdx.y), each chunk's blocks reading the whole row for its sums and
// writing their own packs. A thread keeps its pack's values and its w, b in registers from the row's sums
// to its output: everything is read from global memory once, and nothing is staged in shared memory.
// A row's sums are the block's (a warp's in a fixed tree, then the warps' in order: lp_block_reduce).
// Blocks: enough to give every SM 1024 threads, which 64 registers a thread keep resident at once (the
// launch bounds hold nvcc to them, and let a block of 1024 threads launch at all).
#define LP_LN_SM_THREADS 1024
static inline int lp_ln_threads(int C, int* chunks) {
    int packs = (C + LP_PACK - 1) / LP_PACK;
    *chunks = (packs + 1023) / 1024;
    int per = (packs + *chunks - 1) / *chunks;
    return (per + 31) / 32 * 32;
}
static inline int lp_ln_blocks(int N, int C) {
    int chunks, threads = lp_ln_threads(C, &chunks);
    int blocks = lp_device_prop.multiProcessorCount * (LP_LN_SM_THREADS / threads) / chunks;
    if (blocks < 1) blocks = 1;
    return blocks < N ? blocks : N;
}

// Forward. With inp2 non-NULL the row is first residual = inp1 + (inp2 + bias) (stored, rounded to bf16)
// and the LayerNorm reads the rounded values, exactly what the backward pass will see; with out NULL it
// stops there. The mean, then the variance about it (two sums, as the CPU loop); RMSNorm as the CPU loop
// switches it: mean NULL (the mean taken as 0, its sum not reduced), b NULL.
static __device__ inline LPPack lp_ln_row_pack(const floatX* inp1, const floatX* inp2, LPPack bias, size_t base, int c, int C) {
    LPPack p = lp_load_pack(inp1 + base, c, C);
    if (inp2) {
        LPPack q = lp_load_pack(inp2 + base, c, C);
        for (int k = 0; k < LP_PACK; k++) p.x[k] = lp_xf(lp_bf(p.x[k]) + (lp_bf(q.x[k]) + lp_bf(bias.x[k])));
    }
    return p;  // (padding reads as 0)
}
static __global__ void __launch_bounds__(LP_LN_SM_THREADS)
lp_layernorm_forward_kernel(floatX* residual, floatX* out, float* mean, float* rstd, const floatX* inp1, const floatX* inp2,
                            const floatX* bias, const floatX* w, const floatX* b, int N, int C, float eps) {
    int mine = (blockIdx.y * blockDim.x + threadIdx.x) * LP_PACK;  // this thread's first channel
    int Cb = inp2 && bias ? C : 0;                                 // (no bias: zeros)
    LPPack wc = lp_load_pack(w, mine, C), bc = lp_load_pack(b, mine, b ? C : 0), biasc = lp_load_pack(bias, mine, Cb), x = wc;
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        size_t base = (size_t)row * C;
        float s = 0.0f;
        for (int c = threadIdx.x * LP_PACK; c < C; c += blockDim.x * LP_PACK) {  // (once, unless the row is chunked)
            LPPack p = lp_ln_row_pack(inp1, inp2, c == mine ? biasc : lp_load_pack(bias, c, Cb), base, c, C);
            if (c == mine) x = p;
            for (int k = 0; k < LP_PACK; k++) s += lp_bf(p.x[k]);
        }
        if (inp2 && mine < C) lp_store_pack(residual + base, mine, C, x);
        if (!out) continue;
        float m = mean ? lp_block_reduce(s, 0) / C : 0.0f, v = 0.0f;
        for (int c = threadIdx.x * LP_PACK; c < C; c += blockDim.x * LP_PACK) {
            LPPack p = c == mine ? x : lp_ln_row_pack(inp1, inp2, lp_load_pack(bias, c, Cb), base, c, C);
            for (int k = 0; k < LP_PACK; k++) {
                float d = c + k < C ? lp_bf(p.x[k]) - m : 0.0f;
                v += d * d;
            }
        }
        float r = rsqrtf(lp_block_reduce(v, 0) / C + eps);
        if (mine < C) {
#pragma unroll
            for (int k = 0; k < LP_PACK; k++) x.x[k] = lp_xf((lp_bf(x.x[k]) - m) * r * lp_bf(wc.x[k]) + lp_bf(bc.x[k]));
            lp_store_pack(out + base, mine, C, x);
        }
        if (threadIdx.x == 0 && blockIdx.y == 0) {
            if (mean) mean[row] = m;
            rstd[row] = r;
        }
    }
}
static inline void lp_residual_layernorm_forward_gpu(floatX* residual, floatX* out, float* mean, float* rstd,
                                                     const floatX* inp1, const floatX* inp2, const floatX* bias,
                                                     const floatX* w, const floatX* b, int N, int C, float eps) {
    int chunks, threads = lp_ln_threads(C, &chunks);
    LP_LAUNCH(lp_layernorm_forward_kernel, dim3(lp_ln_blocks(N, C), chunks), threads, 0, residual, out, mean, rstd, inp1, inp2,
              bias, w, b, N, C, eps);
}
static inline void lp_layernorm_forward_gpu(floatX* out, float* mean, float* rstd, const floatX* inp, const floatX* w,
                                            const floatX* b, int N, int C, float eps) {
    lp_residual_layernorm_forward_gpu(NULL, out, mean, rstd, inp, NULL, NULL, w, b, N, C, eps);
}

// Backward in two passes, deterministic: each thread keeps its channels' shares of dw and db in registers
// over all its block's rows and writes them once as the block's partials; a second kernel sums the blocks'
// partials in block order. No atomics: a run repeats bit for bit. RMSNorm's: mean NULL, db NULL.
static __global__ void __launch_bounds__(LP_LN_SM_THREADS)
lp_layernorm_backward_kernel(floatX* dinp, float* partials, const floatX* dout, const floatX* inp, const floatX* w,
                             const float* mean, const float* rstd, int N, int C) {
    int mine = (blockIdx.y * blockDim.x + threadIdx.x) * LP_PACK;  // this thread's first channel
    LPPack wc = lp_load_pack(w, mine, C), x = wc, g = wc;
    float dw[LP_PACK] = {0}, db[LP_PACK] = {0};
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        size_t base = (size_t)row * C;
        float m = mean ? mean[row] : 0.0f, r = rstd[row], dnorm = 0.0f, dnorm_norm = 0.0f;
        for (int c = threadIdx.x * LP_PACK; c < C; c += blockDim.x * LP_PACK) {  // (once, unless the row is chunked)
            LPPack xc = lp_load_pack(inp + base, c, C), gc = lp_load_pack(dout + base, c, C);
            LPPack wk = c == mine ? wc : lp_load_pack(w, c, C);
            if (c == mine) {
                x = xc;
                g = gc;
            }
            for (int k = 0; k < LP_PACK; k++) {  // (padding: dout 0)
                float d = lp_bf(gc.x[k]) * lp_bf(wk.x[k]);
                dnorm += d;
                dnorm_norm += d * (lp_bf(xc.x[k]) - m) * r;
            }
        }
        float2 sums = lp_block_sum2(dnorm, dnorm_norm);
        if (mine >= C) continue;
        float dnorm_mean = mean ? sums.x / C : 0.0f, dnorm_norm_mean = sums.y / C;
        LPPack di = lp_load_pack(dinp + base, mine, C);
#pragma unroll
        for (int k = 0; k < LP_PACK; k++) {
            float norm = (lp_bf(x.x[k]) - m) * r, gk = lp_bf(g.x[k]);
            di.x[k] = lp_xf(lp_bf(di.x[k]) + (gk * lp_bf(wc.x[k]) - dnorm_mean - norm * dnorm_norm_mean) * r);
            dw[k] += gk * norm;
            db[k] += gk;
        }
        lp_store_pack(dinp + base, mine, C, di);
    }
    float* out = partials + (size_t)blockIdx.x * 2 * C;
#pragma unroll
    for (int k = 0; k < LP_PACK; k++)
        if (mine + k < C) {
            out[mine + k] = dw[k];
            out[C + mine + k] = db[k];
        }
}
// out[c] += the sum of partials' rows (rows, stride floats apart) at column c < n, in a fixed order: each block
// sums 32 columns, its 8 warps reading 8 rows at a time (a warp a row, coalesced), then adds their 8 sums.
static __global__ void lp_sum_partials_kernel(floatX* out, const float* partials, int rows, int stride, int n) {
    __shared__ float sums[8][32];
    int c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (c < n)
        for (int p = threadIdx.y; p < rows; p += 8) s += partials[(size_t)p * stride + c];
    sums[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y > 0 || c >= n) return;
    s = 0.0f;
    for (int k = 0; k < 8; k++) s += sums[k][threadIdx.x];
    out[c] = lp_xf(lp_bf(out[c]) + s);
}
static inline void lp_sum_partials_gpu(floatX* out, const float* partials, int rows, int stride, int n) {
    LP_LAUNCH(lp_sum_partials_kernel, lp_grid(n, 32), dim3(32, 8), 0, out, partials, rows, stride, n);
}
static inline void lp_layernorm_backward_gpu(floatX* dinp, floatX* dw, floatX* db, const floatX* dout, const floatX* inp,
                                             const floatX* w, const float* mean, const float* rstd, int N, int C) {
    int chunks, threads = lp_ln_threads(C, &chunks), blocks = lp_ln_blocks(N, C);
    float* partials = (float*)lp_scratch(&lp_partials, (size_t)blocks * 2 * C * sizeof(float), "reduction partials");
    LP_LAUNCH(lp_layernorm_backward_kernel, dim3(blocks, chunks), threads, 0, dinp, partials, dout, inp, w, mean, rstd, N, C);
    lp_sum_partials_gpu(dw, partials, blocks, 2 * C, C);
    if (db) lp_sum_partials_gpu(db, partials + C, blocks, 2 * C, C);
}
#endif

// out = gelu(inp): the fused matmul's last pass on the CPU, and its own op for recomputation in backward
// (one loop for both, so a recomputed GELU equals the kept one bit for bit)
static inline void lp_gelu_forward_cpu(float* out, const float* inp, size_t n) {
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) out[i] = lp_gelu(inp[i]);
}
// dinp = gelu'(inp) * dout; dinp may alias dout
static inline void lp_gelu_backward_cpu(float* dinp, const float* inp, const float* dout, int N) {
#pragma omp parallel for
    for (int i = 0; i < N; i++) dinp[i] = lp_gelu_grad(inp[i]) * dout[i];
}

// --- SwiGLU (Llama's MLP): out (N,H) = silu(gate) * up, where each row of fch (N,2H), fc's output, holds its gate
// then its up (fc's two blocks of rows); silu(x) = x sigmoid(x). Backward: dfch (N,2H) from dout (N,H).
static inline LP_HD float lp_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline void lp_swiglu_forward_cpu(float* out, const float* fch, int N, int H) {
#pragma omp parallel for
    for (int i = 0; i < N; i++)
        for (int j = 0; j < H; j++) {
            float g = fch[(size_t)i * 2 * H + j], u = fch[(size_t)i * 2 * H + H + j];
            out[(size_t)i * H + j] = g * lp_sigmoid(g) * u;
        }
}
static inline void lp_swiglu_backward_cpu(float* dfch, const float* fch, const float* dout, int N, int H) {
#pragma omp parallel for
    for (int i = 0; i < N; i++)
        for (int j = 0; j < H; j++) {
            float g = fch[(size_t)i * 2 * H + j], u = fch[(size_t)i * 2 * H + H + j], d = dout[(size_t)i * H + j], sg = lp_sigmoid(g);
            dfch[(size_t)i * 2 * H + j] = d * u * sg * (1.0f + g * (1.0f - sg));
            dfch[(size_t)i * 2 * H + H + j] = d * g * sg;
        }
}
#ifndef LLMPAR_CPU
// The same on the GPU, one fused elementwise pass each way: a thread takes a pack of 8 hidden units of a row,
// its gate's and up's packs in; forward (dout NULL) out's pack out (N,H), backward the two packs of dout's
// gradient out (N,2H), each value as the CPU loop computes it.
static __global__ void lp_swiglu_kernel(floatX* out, const floatX* fch, const floatX* dout, int N, int H) {
    int packs = (H + LP_PACK - 1) / LP_PACK;
    size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x, i = k / packs;
    if (i >= (size_t)N) return;
    int j = (int)(k % packs) * LP_PACK;
    const floatX* row = fch + i * 2 * H;
    LPPack g = lp_load_pack(row, j, H), u = lp_load_pack(row + H, j, H);
    if (!dout) {
#pragma unroll
        for (int e = 0; e < LP_PACK; e++) g.x[e] = lp_xf(lp_bf(g.x[e]) * lp_sigmoid(lp_bf(g.x[e])) * lp_bf(u.x[e]));
        lp_store_pack(out + i * H, j, H, g);
        return;
    }
    LPPack d = lp_load_pack(dout + i * H, j, H);
#pragma unroll
    for (int e = 0; e < LP_PACK; e++) {
        float gf = lp_bf(g.x[e]), uf = lp_bf(u.x[e]), df = lp_bf(d.x[e]), sg = lp_sigmoid(gf);
        g.x[e] = lp_xf(df * uf * sg * (1.0f + gf * (1.0f - sg)));
        u.x[e] = lp_xf(df * gf * sg);
    }
    lp_store_pack(out + i * 2 * H, j, H, g);
    lp_store_pack(out + i * 2 * H + H, j, H, u);
}
static inline void lp_swiglu_forward_gpu(floatX* out, const floatX* fch, int N, int H) {
    size_t n = (size_t)N * ((H + LP_PACK - 1) / LP_PACK);
    LP_LAUNCH(lp_swiglu_kernel, lp_grid(n, LP_THREADS), LP_THREADS, 0, out, fch, (const floatX*)NULL, N, H);
}
static inline void lp_swiglu_backward_gpu(floatX* dfch, const floatX* fch, const floatX* dout, int N, int H) {
    size_t n = (size_t)N * ((H + LP_PACK - 1) / LP_PACK);
    LP_LAUNCH(lp_swiglu_kernel, lp_grid(n, LP_THREADS), LP_THREADS, 0, dfch, fch, dout, N, H);
}
#endif

// --- matmul: out = inp @ weight^T + bias, weight (OC, C). With pre_gelu non-NULL the GELU is fused:
// pre_gelu keeps the pre-activation for backward and out = gelu(pre_gelu). bias may be NULL.
// The CPU build calls a BLAS's sgemm when one was found (lp_matmul_*_cpu), else these plain loops, which
// stay as the readable reference the BLAS path is tested against. Rows go in blocks of LP_ROW_BLOCK, so
// each weight row is read from memory once per block, not once per row (the LM head's weights are far
// larger than the caches).
#define LP_ROW_BLOCK 8
static inline void lp_matmul_forward_loops(float* out, float* pre_gelu, const float* inp, const float* weight,
                                           const float* bias, int N, int C, int OC) {
#pragma omp parallel for
    for (int i0 = 0; i0 < N; i0 += LP_ROW_BLOCK) {
        int rows = N - i0 < LP_ROW_BLOCK ? N - i0 : LP_ROW_BLOCK;
        for (int o = 0; o < OC; o++) {
            const float* wrow = weight + (size_t)o * C;
            for (int r = 0; r < rows; r++) {
                const float* x = inp + (size_t)(i0 + r) * C;
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 partial sums let the compiler vectorise
                int c = 0;
                for (; c + 8 <= C; c += 8)
                    for (int k = 0; k < 8; k++) acc[k] += x[c + k] * wrow[c + k];
                float s = bias ? bias[o] : 0.0f;
                for (; c < C; c++) s += x[c] * wrow[c];
                for (int k = 0; k < 8; k++) s += acc[k];
                (pre_gelu ? pre_gelu : out)[(size_t)(i0 + r) * OC + o] = s;
            }
        }
    }
    if (pre_gelu) lp_gelu_forward_cpu(out, pre_gelu, (size_t)N * OC);
}

// dbias (OC) += the column sums of dout (N,OC), each column in row order, a block of 64 columns per task so
// the reads run along rows (the same result as one column at a time)
static inline void lp_bias_backward_cpu(float* dbias, const float* dout, int N, int OC) {
#pragma omp parallel for
    for (int o0 = 0; o0 < OC; o0 += 64) {
        int cols = OC - o0 < 64 ? OC - o0 : 64;
        float sb[64] = {0};
        for (int i = 0; i < N; i++)
            for (int o = 0; o < cols; o++) sb[o] += dout[(size_t)i * OC + o0 + o];
        for (int o = 0; o < cols; o++) dbias[o0 + o] += sb[o];
    }
}

// dinp = dout @ weight (overwritten; with pre_gelu non-NULL, times GELU's derivative there: the backward
// of a GELU that fed this matmul, fused); dweight += dout^T @ inp; dbias += column sums of dout (if non-NULL);
// dpre_bias += column sums of dinp (if non-NULL): the bias gradient of the matmul whose output fed that GELU
// (fc's, in fcproj's backward), so that matmul's own backward is given no dbias
static inline void lp_matmul_backward_loops(float* dinp, float* dweight, float* dbias, float* dpre_bias, const float* dout,
                                            const float* inp, const float* weight, int N, int C, int OC, const float* pre_gelu) {
#pragma omp parallel for
    for (int i0 = 0; i0 < N; i0 += LP_ROW_BLOCK) {
        int rows = N - i0 < LP_ROW_BLOCK ? N - i0 : LP_ROW_BLOCK;
        for (size_t c = 0; c < (size_t)rows * C; c++) dinp[(size_t)i0 * C + c] = 0.0f;
        for (int o = 0; o < OC; o++) {
            const float* wrow = weight + (size_t)o * C;
            for (int r = 0; r < rows; r++) {
                float d = dout[(size_t)(i0 + r) * OC + o];
                float* di = dinp + (size_t)(i0 + r) * C;
                for (int c = 0; c < C; c++) di[c] += d * wrow[c];
            }
        }
    }
    if (pre_gelu) lp_gelu_backward_cpu(dinp, pre_gelu, dinp, N * C);
    if (dpre_bias) lp_bias_backward_cpu(dpre_bias, dinp, N, C);
#pragma omp parallel for
    for (int o = 0; o < OC; o++) {
        float* dw = dweight + (size_t)o * C;
        float sb = 0.0f;
        for (int i = 0; i < N; i++) {
            float d = dout[(size_t)i * OC + o];
            const float* x = inp + (size_t)i * C;
            for (int c = 0; c < C; c++) dw[c] += d * x[c];
            sb += d;
        }
        if (dbias) dbias[o] += sb;
    }
}

// --- strided matmul: C (M,N) = op(A) @ op(B), or C += it (accumulate), row-major with leading dimensions
// lda, ldb, ldc, op transposing A (stored (K,M)) when ta is set and B (stored (N,K)) when tb is set. The LM
// head runs on a piece of the vocabulary at a time (ZeRO-2/3 hold wte in pieces): a piece's columns of the
// logits. sgemm when the CPU build has a BLAS, else this loop.
static inline void lp_gemm_strided_loops(int ta, int tb, int M, int N, int K, const float* A, int lda, const float* B,
                                         int ldb, int accumulate, float* C, int ldc) {
#pragma omp parallel for
    for (int i = 0; i < M; i++) {
        float* c = C + (size_t)i * ldc;
        if (!accumulate)
            for (int j = 0; j < N; j++) c[j] = 0.0f;
        if (tb) {  // B's rows: dot products
            for (int j = 0; j < N; j++) {
                const float* b = B + (size_t)j * ldb;
                float s = 0.0f;
                for (int k = 0; k < K; k++) s += (ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k]) * b[k];
                c[j] += s;
            }
        } else {  // C's row is a sum of B's rows, scaled
            for (int k = 0; k < K; k++) {
                float a = ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
                const float* b = B + (size_t)k * ldb;
                for (int j = 0; j < N; j++) c[j] += a * b[j];
            }
        }
    }
}
#ifdef LLMPAR_BLAS
// The CPU build's one sgemm. Its result must not depend on the number of threads (so a grid that only
// splits the model equals one rank bit for bit, on any machine), but a BLAS's own threads split a product
// by their count, which changes its kernels' summation order (OpenBLAS's Haswell kernels: 1 and 2 threads
// differ in 9% of a 256x768x768 product's values). So C is cut into tiles whose shape follows from the
// product alone, each tile one single-threaded sgemm (sgemv for one row) inside our parallel loop (OpenBLAS's OpenMP build runs
// single-threaded inside an OpenMP region): every value is summed by the same call on any thread. Tiles:
// a power of two of them, up to 16, about 64M multiply-adds each, in strips of at least 256 along each side
// (each tile packs its own parts of A and B, so fewer, larger tiles repack less).
#define LP_GEMM_MAX_TILES 16
static inline void lp_gemm_strided_cpu(int ta, int tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb,
                                       int accumulate, float* C, int ldc) {
    if (M <= 0 || N <= 0) return;
    int tiles = 1;
    while (tiles < LP_GEMM_MAX_TILES && (double)M * N * K / tiles > 64e6) tiles *= 2;
    int nn = tiles, nm;  // tiles along N (the longer side first), then along M
    int longer = N >= M ? N : M, shorter = N >= M ? M : N;
    while (nn > 1 && longer / nn < 256) nn /= 2;
    nm = tiles / nn;
    while (nm > 1 && shorter / nm < 256) nm /= 2;
    if (N < M) { int t = nn; nn = nm; nm = t; }
    int tm = (M + nm - 1) / nm, tn = (N + nn - 1) / nn;
#pragma omp parallel for schedule(dynamic)
    for (int t = 0; t < nm * nn; t++) {
        int i0 = t / nn * tm, j0 = t % nn * tn;
        int m = M - i0 < tm ? M - i0 : tm, n = N - j0 < tn ? N - j0 : tn;
        if (m == 1) {  // one row (a sampled token's): sgemv reads op(B) once, where sgemm would copy all of it first
            cblas_sgemv(CblasRowMajor, tb ? CblasNoTrans : CblasTrans, tb ? n : K, tb ? K : n, 1.0f, tb ? B + (size_t)j0 * ldb : B + j0,
                        ldb, ta ? A + i0 : A + (size_t)i0 * lda, ta ? lda : 1, accumulate ? 1.0f : 0.0f, C + (size_t)i0 * ldc + j0, 1);
            continue;
        }
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, K, 1.0f,
                    ta ? A + i0 : A + (size_t)i0 * lda, lda, tb ? B + (size_t)j0 * ldb : B + j0, ldb, accumulate ? 1.0f : 0.0f,
                    C + (size_t)i0 * ldc + j0, ldc);
    }
}
#else
#define lp_gemm_strided_cpu lp_gemm_strided_loops
#endif

#ifdef LLMPAR_BLAS
// The same through the one sgemm (row-major: out (N,OC) = inp (N,C) @ weight^T), then the bias, then the GELU.
static inline void lp_matmul_forward_cpu(float* out, float* pre_gelu, const float* inp, const float* weight,
                                         const float* bias, int N, int C, int OC) {
    float* dst = pre_gelu ? pre_gelu : out;
    lp_gemm_strided_cpu(0, 1, N, OC, C, inp, C, weight, C, 0, dst, OC);
    if (bias) {
#pragma omp parallel for
        for (int i = 0; i < N; i++)
            for (int o = 0; o < OC; o++) dst[(size_t)i * OC + o] += bias[o];
    }
    if (pre_gelu) lp_gelu_forward_cpu(out, pre_gelu, (size_t)N * OC);
}
static inline void lp_matmul_backward_cpu(float* dinp, float* dweight, float* dbias, float* dpre_bias, const float* dout,
                                          const float* inp, const float* weight, int N, int C, int OC, const float* pre_gelu) {
    lp_gemm_strided_cpu(0, 0, N, C, OC, dout, OC, weight, C, 0, dinp, C);
    if (pre_gelu) lp_gelu_backward_cpu(dinp, pre_gelu, dinp, N * C);
    if (dpre_bias) lp_bias_backward_cpu(dpre_bias, dinp, N, C);
    lp_gemm_strided_cpu(1, 0, OC, C, N, dout, OC, inp, C, 1, dweight, C);
    if (dbias) lp_bias_backward_cpu(dbias, dout, N, OC);
}
#else
#define lp_matmul_forward_cpu lp_matmul_forward_loops
#define lp_matmul_backward_cpu lp_matmul_backward_loops
#endif


#ifndef LLMPAR_CPU
// Row-major out (N,OC) is column-major (OC,N): out = weight (C,OC)^T-as-stored times inp, so the GEMM is
// m=OC, n=N, k=C with the weight transposed. Bias and GELU ride in cuBLASLt's epilogue.
// cuBLASLt takes the GELU epilogue's pre-activation buffer only with a leading dimension that is a
// multiple of 8: other widths write the pre-activation and run GELU as a kernel.
static __global__ void lp_gelu_forward_kernel(floatX* out, const floatX* inp, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * LP_PACK;
    if (i >= n) return;
    LPPack x = lp_load_pack(inp, i, n);
    for (int k = 0; k < LP_PACK; k++) x.x[k] = lp_xf(lp_gelu(lp_bf(x.x[k])));
    lp_store_pack(out, i, n, x);
}
static inline void lp_gelu_forward_gpu(floatX* out, const floatX* inp, size_t n) {
    LP_LAUNCH(lp_gelu_forward_kernel, lp_grid((n + LP_PACK - 1) / LP_PACK, LP_THREADS), LP_THREADS, 0, out, inp, n);
}
static __global__ void lp_gelu_backward_kernel(floatX* dinp, const floatX* inp, const floatX* dout, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * LP_PACK;
    if (i >= n) return;
    LPPack x = lp_load_pack(inp, i, n), g = lp_load_pack(dout, i, n);
    for (int k = 0; k < LP_PACK; k++) x.x[k] = lp_xf(lp_gelu_grad(lp_bf(x.x[k])) * lp_bf(g.x[k]));
    lp_store_pack(dinp, i, n, x);
}
static inline void lp_gelu_backward_gpu(floatX* dinp, const floatX* inp, const floatX* dout, int N) {
    LP_LAUNCH(lp_gelu_backward_kernel, lp_grid(((size_t)N + LP_PACK - 1) / LP_PACK, LP_THREADS), LP_THREADS, 0, dinp, inp, dout,
              (size_t)N);
}
static inline void lp_matmul_forward_gpu(floatX* out, floatX* pre_gelu, const floatX* inp, const floatX* weight,
                                         const floatX* bias, int N, int C, int OC) {
    if (pre_gelu && OC % 8) {
        lp_gemm(1, 0, OC, N, C, weight, C, 0, inp, C, 0, pre_gelu, OC, 0, 1, 1.0f, 0.0f, bias, NULL);
        lp_gelu_forward_gpu(out, pre_gelu, (size_t)N * OC);
        return;
    }
    lp_gemm(1, 0, OC, N, C, weight, C, 0, inp, C, 0, out, OC, 0, 1, 1.0f, 0.0f, bias, pre_gelu);
}

// Column sums of dout (N,OC) added to dbias, two passes for determinism: row chunks into partials, then in
// order (where no cuBLASLt epilogue takes them).
#define LP_BIAS_CHUNKS 64
static __global__ void lp_bias_partials_kernel(float* partials, const floatX* dout, int N, int OC) {
    int o = blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y;
    if (o >= OC) return;
    int rows = (N + gridDim.y - 1) / gridDim.y, end = min(N, (chunk + 1) * rows);
    float s = 0.0f;
    for (int i = chunk * rows; i < end; i++) s += lp_bf(dout[(size_t)i * OC + o]);
    partials[(size_t)chunk * OC + o] = s;
}
static inline void lp_bias_backward_gpu(floatX* dbias, const floatX* dout, int N, int OC) {
    float* partials = (float*)lp_scratch(&lp_partials, (size_t)LP_BIAS_CHUNKS * OC * sizeof(float), "reduction partials");
    dim3 grid(lp_grid(OC, LP_THREADS), LP_BIAS_CHUNKS);
    LP_LAUNCH(lp_bias_partials_kernel, grid, LP_THREADS, 0, partials, dout, N, OC);
    lp_sum_partials_gpu(dbias, partials, LP_BIAS_CHUNKS, OC, OC);
}
static inline void lp_add_scaled_gpu(floatX* dst, const floatX* src, size_t n, float scale);  // (below)
static inline void lp_matmul_backward_gpu(floatX* dinp, floatX* dweight, floatX* dbias, floatX* dpre_bias, const floatX* dout,
                                          const floatX* inp, const floatX* weight, int N, int C, int OC, const floatX* pre_gelu) {
    // The bias gradients the epilogues write (bf16, in lp_partials' scratch) before they are added in
    floatX* bgrad = dbias || dpre_bias ? (floatX*)lp_scratch(&lp_partials, (size_t)LP_BIAS_CHUNKS * (OC > C ? OC : C) * sizeof(float),
                                                             "reduction partials")
                                       : NULL;
    // dinp (N,C) = dout (N,OC) @ weight (OC,C): column-major m=C, n=N, k=OC; overwritten. GELU's backward
    // rides in cuBLASLt's DGELU epilogue where it has one (the pre-activation's leading dimension a multiple
    // of 8), and with dpre_bias in its DGELU_BGRAD: dinp's column sums are D's row sums, written as the
    // epilogue makes D (fc's bias gradient without a pass of its own over dinp); else kernels
    cublasLtEpilogue_t dgelu = dpre_bias ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
    if (pre_gelu && C % 8 == 0 && lp_gemm_epilogue(0, 0, C, N, OC, weight, C, 0, dout, OC, 0, dinp, C, 0, 1, 1.0f, 0.0f, dgelu,
                                                   dpre_bias ? bgrad : NULL, pre_gelu)) {
        if (dpre_bias) lp_add_scaled_gpu(dpre_bias, bgrad, (size_t)C, 1.0f);
    } else {
        lp_gemm(0, 0, C, N, OC, weight, C, 0, dout, OC, 0, dinp, C, 0, 1, 1.0f, 0.0f, NULL, NULL);
        if (pre_gelu) lp_gelu_backward_gpu(dinp, pre_gelu, dinp, N * C);
        if (dpre_bias) lp_bias_backward_gpu(dpre_bias, dinp, N, C);
    }
    // dweight (OC,C) += dout^T @ inp: column-major m=C, n=OC, k=N; accumulated (beta 1). The bias gradient,
    // dout's column sums, is op(B)'s sums over k: cuBLASLt's BGRADB epilogue writes them (in bf16) as the
    // GEMM reads dout, and they are added in; where it has no algorithm, a deterministic two-pass kernel
    if (dbias && lp_gemm_epilogue(0, 1, C, OC, N, inp, C, 0, dout, OC, 0, dweight, C, 0, 1, 1.0f, 1.0f, CUBLASLT_EPILOGUE_BGRADB, bgrad, NULL)) {
        lp_add_scaled_gpu(dbias, bgrad, (size_t)OC, 1.0f);
        return;
    }
    lp_gemm(0, 1, C, OC, N, inp, C, 0, dout, OC, 0, dweight, C, 0, 1, 1.0f, 1.0f, NULL, NULL);
    if (dbias) lp_bias_backward_gpu(dbias, dout, N, OC);
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: B's storage read as column-major is B^T,
// so B goes first, transposed when tb is set, then A.
static inline void lp_gemm_strided_gpu(int ta, int tb, int M, int N, int K, const floatX* A, int lda, const floatX* B, int ldb,
                                       int accumulate, floatX* C, int ldc) {
    lp_gemm(tb, ta, N, M, K, B, ldb, 0, A, lda, 0, C, ldc, 0, 1, 1.0f, accumulate ? 1.0f : 0.0f, NULL, NULL);
}

#endif

// --- causal self-attention. The CPU build's loop materialises the probabilities:
//   permute qkv (B,T,3,NH,HS) -> qkvr (3,B,NH,T,HS); att = softmax(scale * q k^T) with the causal mask
//   (attention_probs, which backward also calls to recompute att); y = att v into the qkv buffer (no
//   longer needed: backward reads qkvr); unpermute y -> out (B,T,C).
// att (B,NH,T,T) holds the probabilities, zero above the diagonal. The CUDA build computes the same by
// one of two paths (--attention): the same steps as kernels and cuBLASLt batches (cublas, just below), or
// flash attention (further below), which keeps no probabilities; these loops are the oracle of both.
static inline float lp_attention_scale(int C, int NH) { return 1.0f / sqrtf((float)(C / NH)); }
#define LP_LOG2E 1.4426950408889634f  // exp(x) = exp2(x log2(e)): the scale is folded into one multiply

// One head's product C (M,N) = op(A) @ op(B), row-major, op transposing when ta / tb is set (A is (K,M)
// then, B (N,K)); C is overwritten. sgemm when the CPU build has a BLAS (it runs single-threaded inside
// the heads' parallel loop), else the plain loop; accumulate: C += it. Whole (T,T) products: the masked upper triangle is
// computed too and zeroed after.
static inline void lp_head_gemm(int ta, int tb, int M, int N, int K, const float* A, const float* B, float* C, int accumulate) {
#ifdef LLMPAR_BLAS
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A,
                ta ? M : K, B, tb ? K : N, accumulate ? 1.0f : 0.0f, C, N);
#else
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float s = 0.0f;
            for (int p = 0; p < K; p++) s += (ta ? A[(size_t)p * M + i] : A[(size_t)i * K + p]) * (tb ? B[(size_t)j * K + p] : B[(size_t)p * N + j]);
            C[(size_t)i * N + j] = accumulate ? C[(size_t)i * N + j] + s : s;
        }
#endif
}

// Grouped-query attention: the qkv rows hold NH query heads, then KV key and KV value heads (KV = NH: multi-head),
// and qkvr is q (B,NH,T,HS), k and v (B,KV,T,HS) each; query head h reads K/V head h / (NH / KV).
static inline void lp_attention_probs_cpu(float* att, const float* qkvr, int B, int T, int C, int NH, int KV) {
    int HS = C / NH, G = NH / KV;
    size_t plane = (size_t)B * NH * T * HS;  // q in qkvr
    float scale = lp_attention_scale(C, NH);
#pragma omp parallel for
    for (int bh = 0; bh < B * NH; bh++) {
        const float* q = qkvr + (size_t)bh * T * HS;
        const float* k = qkvr + plane + (size_t)(bh / NH * KV + bh % NH / G) * T * HS;
        lp_head_gemm(0, 1, T, T, HS, q, k, att + (size_t)bh * T * T, 0);  // q k^T
        for (int t1 = 0; t1 < T; t1++) {
            float* a = att + ((size_t)bh * T + t1) * T;
            float maxv = -INFINITY;
            for (int t2 = 0; t2 <= t1; t2++)
                if (a[t2] > maxv) maxv = a[t2];
            float sum = 0.0f;
            for (int t2 = 0; t2 <= t1; t2++) {
                a[t2] = expf(scale * (a[t2] - maxv));
                sum += a[t2];
            }
            for (int t2 = 0; t2 <= t1; t2++) a[t2] /= sum;
            for (int t2 = t1 + 1; t2 < T; t2++) a[t2] = 0.0f;
        }
    }
}

// qkv (B,T,(NH+2KV)HS) <-> qkvr: to_heads 1 permutes qkv into qkvr, 0 back.
static inline void lp_attention_permute_cpu(float* qkvr, float* qkv, int B, int T, int NH, int KV, int HS, int to_heads) {
    int heads = NH + 2 * KV;
    size_t plane = (size_t)B * NH * T * HS, kvplane = (size_t)B * KV * T * HS;
#pragma omp parallel for
    for (int bh = 0; bh < B * heads; bh++) {
        int b = bh / heads, h = bh % heads, which = h < NH ? 0 : h < NH + KV ? 1 : 2, n = which ? KV : NH;
        int hw = h - (which ? NH + (which - 1) * KV : 0);  // the head among q's, k's or v's
        float* r = qkvr + (which ? plane + (which - 1) * kvplane : 0) + ((size_t)b * n + hw) * T * HS;
        for (int t = 0; t < T; t++)
            for (int d = 0; d < HS; d++) {
                float* x = qkv + ((size_t)b * T + t) * heads * HS + (size_t)h * HS + d;
                if (to_heads) r[(size_t)t * HS + d] = *x;
                else *x = r[(size_t)t * HS + d];
            }
    }
}

static inline void lp_attention_forward_cpu(float* out, float* qkvr, float* att, float* qkv, int B, int T,
                                            int C, int NH, int KV) {
    int HS = C / NH, G = NH / KV;
    size_t plane = (size_t)B * NH * T * HS, kvplane = (size_t)B * KV * T * HS;
    lp_attention_permute_cpu(qkvr, qkv, B, T, NH, KV, HS, 1);
    lp_attention_probs_cpu(att, qkvr, B, T, C, NH, KV);
#pragma omp parallel for
    for (int bh = 0; bh < B * NH; bh++)  // y = att v; qkv is free now: it holds y in (B,NH,T,HS)
        lp_head_gemm(0, 0, T, HS, T, att + (size_t)bh * T * T, qkvr + plane + kvplane + (size_t)(bh / NH * KV + bh % NH / G) * T * HS,
                     qkv + (size_t)bh * T * HS, 0);
#pragma omp parallel for
    for (int bh = 0; bh < B * NH; bh++) {
        int b = bh / NH, h = bh % NH;
        for (int t = 0; t < T; t++)
            for (int d = 0; d < HS; d++)
                out[((size_t)b * T + t) * C + h * HS + d] = qkv[((size_t)bh * T + t) * HS + d];
    }
}

// Backward, same steps reversed: permute dout -> dy (scratch); datt = dy v^T; dv = att^T dy;
// dpre = scale * softmax_backward(datt); dq = dpre k; dk = dpre^T q; unpermute dqkvr -> dqkv. A K/V head's
// gradients are the sums over its group's query heads, in head order (one task a K/V head).
static inline void lp_attention_backward_cpu(float* dqkv, float* dqkvr, float* datt, float* scratch,
                                             const float* dout, const float* qkvr, const float* att, int B,
                                             int T, int C, int NH, int KV) {
    int HS = C / NH, G = NH / KV;
    size_t plane = (size_t)B * NH * T * HS, kvplane = (size_t)B * KV * T * HS;
    float scale = lp_attention_scale(C, NH);
#pragma omp parallel for
    for (int bg = 0; bg < B * KV; bg++) {
        int b = bg / KV;
        const float* k = qkvr + plane + (size_t)bg * T * HS;
        const float* v = k + kvplane;
        float* dk = dqkvr + plane + (size_t)bg * T * HS;
        float* dv = dk + kvplane;
        for (int h = bg % KV * G; h < (bg % KV + 1) * G; h++) {
            size_t bh = (size_t)b * NH + h;
            int first = h % G == 0;  // the group's first head writes dk and dv, the others add
            const float* q = qkvr + bh * T * HS;
            float* dq = dqkvr + bh * T * HS;
            float* dy = scratch + bh * T * HS;
            const float* a = att + bh * T * T;
            float* da = datt + bh * T * T;
            for (int t = 0; t < T; t++)
                for (int d = 0; d < HS; d++) dy[(size_t)t * HS + d] = dout[((size_t)b * T + t) * C + h * HS + d];
            lp_head_gemm(0, 1, T, T, HS, dy, v, da, 0);       // datt = dy v^T
            lp_head_gemm(1, 0, T, HS, T, a, dy, dv, !first);  // dv (+)= att^T dy (att is zero above the diagonal)
            for (int t1 = 0; t1 < T; t1++) {  // the softmax backward, row by row: datt -> dpre
                const float* ar = a + (size_t)t1 * T;
                float* dr = da + (size_t)t1 * T;
                float dot = 0.0f;  // sum over t2 of att * datt
                for (int t2 = 0; t2 <= t1; t2++) dot += ar[t2] * dr[t2];
                for (int t2 = 0; t2 <= t1; t2++) dr[t2] = scale * ar[t2] * (dr[t2] - dot);
                for (int t2 = t1 + 1; t2 < T; t2++) dr[t2] = 0.0f;
            }
            lp_head_gemm(0, 0, T, HS, T, da, k, dq, 0);       // dq = dpre k
            lp_head_gemm(1, 0, T, HS, T, da, q, dk, !first);  // dk (+)= dpre^T q
        }
    }
    lp_attention_permute_cpu(dqkvr, dqkv, B, T, NH, KV, HS, 0);
}

// --- attention against one block of keys: context parallelism's ring (section 9) meets a sequence's keys and
// values a block at a time. The T query rows of B sequences, at positions qpos, attend to a block of Tk keys
// and values at positions kpos (ascending): a query to the keys at its own position or before, so to a prefix
// of the block (none: a block wholly after it is skipped; the block of its own rows: the causal diagonal).
// The scores merge into a running result with the online softmax's statistics, as flash attention's do: out
// (B,T,NH HS) holds each row's attention over the blocks met so far (normalised: a bf16 out between blocks
// loses no more than the final one), rmax and rsum (B,NH,T) its running max and its sum of exp(score - max);
// `first` starts them (the first block a row meets holds its own position). block_end leaves each row's
// logsumexp in rmax. qkv: the projection's rows (B,T,(NH+2KV)HS), of which q is read; kv (B,Tk,2 KV HS): each
// key row's KV keys, then its KV values (lp_attention_kv_copy). qpos and kpos: (device) tables.
static inline LP_HD int lp_keys_upto(const int* kpos, int Tk, int p) {  // how many of the ascending kpos are <= p
    int lo = 0, hi = Tk;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (kpos[mid] <= p) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}
// A (sequence, head) task's view of a block: its query rows that score any key, rows t0 .. T-1 (the rows
// ascend, so those that see none come first), and the keys the last of them sees, 0 .. nk-1 (the rest
// none sees). The scores are then one product of those rows and keys, the mask within it by row.
static inline void lp_block_extent(const int* qpos, const int* kpos, int T, int Tk, int* t0, int* nk) {
    *nk = T ? lp_keys_upto(kpos, Tk, qpos[T - 1]) : 0;
    *t0 = *nk ? lp_keys_upto(qpos, T, kpos[0] - 1) : T;
}
// Rows [t0, T) of one head (`stride` values apart, HS each) into x (T - t0, HS); _add adds x back onto them.
static inline void lp_block_rows_get(float* x, const float* src, int t0, int T, size_t stride, int HS) {
    for (int t = t0; t < T; t++) memcpy(x + (size_t)(t - t0) * HS, src + (size_t)t * stride, (size_t)HS * sizeof(float));
}
static inline void lp_block_rows_add(float* dst, const float* x, int t0, int T, size_t stride, int HS) {
    for (int t = t0; t < T; t++)
        for (int d = 0; d < HS; d++) dst[(size_t)t * stride + d] += x[(size_t)(t - t0) * HS + d];
}
// Per (sequence, head) task, in scratch of its thread: q (Tq,HS), the K/V head's k and v (nk,HS), the scores
// s (Tq,nk) = q k^T as one product, each row's masked softmax merged into its running statistics, and p v as
// another (lp_head_gemm: sgemm with a BLAS), added to the rescaled output. Every row from t0 sees a key.
static inline void lp_attention_block_forward_cpu(float* out, float* rmax, float* rsum, const float* qkv, const float* kv,
                                                  const int* qpos, const int* kpos, int B, int T, int Tk, int C, int NH, int KV,
                                                  int first) {
    int HS = C / NH, G = NH / KV, heads = NH + 2 * KV, t0, nk;
    float scale = lp_attention_scale(C, NH);
    lp_block_extent(qpos, kpos, T, Tk, &t0, &nk);
    if (nk == 0) return;  // (a block wholly after every row)
    int Tq = T - t0;
#pragma omp parallel
    {
        float* q = (float*)lp_host_malloc(((size_t)2 * Tq * HS + (size_t)2 * nk * HS + (size_t)Tq * nk) * sizeof(float), "ring attention");
        float *k = q + (size_t)Tq * HS, *v = k + (size_t)nk * HS, *o = v + (size_t)nk * HS, *sc = o + (size_t)Tq * HS;
#pragma omp for
        for (int bh = 0; bh < B * NH; bh++) {
            int b = bh / NH, h = bh % NH;
            lp_block_rows_get(q, qkv + (size_t)b * T * heads * HS + (size_t)h * HS, t0, T, (size_t)heads * HS, HS);
            const float* kb = kv + (size_t)b * Tk * 2 * KV * HS + (size_t)(h / G) * HS;
            lp_block_rows_get(k, kb, 0, nk, (size_t)2 * KV * HS, HS);
            lp_block_rows_get(v, kb + (size_t)KV * HS, 0, nk, (size_t)2 * KV * HS, HS);
            lp_block_rows_get(o, out + (size_t)b * T * C + (size_t)h * HS, t0, T, C, HS);
            lp_head_gemm(0, 1, Tq, nk, HS, q, k, sc, 0);  // q k^T
            for (int i = 0; i < Tq; i++) {
                size_t r = (size_t)bh * T + t0 + i;
                int n = lp_keys_upto(kpos, nk, qpos[t0 + i]);
                float *srow = sc + (size_t)i * nk, mx = first ? -INFINITY : rmax[r], old = mx, sum = 0.0f;
                for (int j = 0; j < n; j++) mx = fmaxf(mx, scale * srow[j]);
                for (int j = 0; j < nk; j++) {
                    srow[j] = j < n ? expf(scale * srow[j] - mx) : 0.0f;
                    sum += srow[j];
                }
                // what was summed before shrinks by exp(old - max); the output held it divided by its sum
                float before = first ? 0.0f : rsum[r] * expf(old - mx);
                for (int d = 0; d < HS; d++) o[(size_t)i * HS + d] = first ? 0.0f : o[(size_t)i * HS + d] * before;  // (first: out unset)
                rmax[r] = mx;
                rsum[r] = before + sum;
            }
            lp_head_gemm(0, 0, Tq, HS, nk, sc, v, o, 1);  // + p v
            for (int i = 0; i < Tq; i++) {
                size_t r = (size_t)bh * T + t0 + i;
                float* orow = out + ((size_t)b * T + t0 + i) * C + (size_t)h * HS;
                for (int d = 0; d < HS; d++) orow[d] = o[(size_t)i * HS + d] / rsum[r];
            }
        }
        free(q);
    }
}
static inline void lp_attention_block_end_cpu(float* rmax, const float* rsum, int rows) {
    for (int r = 0; r < rows; r++) rmax[r] += logf(rsum[r]);
}
// Backward of one block, from the rows' logsumexp (lse): p = exp(score - lse) of each pair a query scores;
// dv += p^T dout, dp = dout v^T, ds = p (dp - D) with D = dout . out (the row's sum of p dp, whatever block);
// dq += scale ds k (into the q part of dqkv), dk += scale ds^T q (dkv, laid out as kv): five products per
// head. A task per (sequence, K/V head): its group's query heads in order, so the sums into its keys need no
// atomics.
static inline void lp_attention_block_backward_cpu(float* dqkv, float* dkv, const float* dout, const float* out, const float* lse,
                                                   const float* qkv, const float* kv, const int* qpos, const int* kpos, int B,
                                                   int T, int Tk, int C, int NH, int KV) {
    int HS = C / NH, G = NH / KV, heads = NH + 2 * KV, t0, nk;
    float scale = lp_attention_scale(C, NH);
    lp_block_extent(qpos, kpos, T, Tk, &t0, &nk);
    if (nk == 0) return;
    int Tq = T - t0;
    size_t kvrow = (size_t)2 * KV * HS;
#pragma omp parallel
    {
        float* q = (float*)lp_host_malloc(((size_t)4 * Tq * HS + (size_t)4 * nk * HS + (size_t)2 * Tq * nk) * sizeof(float), "ring attention");
        float *dy = q + (size_t)Tq * HS, *dq = dy + (size_t)Tq * HS, *D = dq + (size_t)Tq * HS, *k = D + Tq, *v = k + (size_t)nk * HS;
        float *dk = v + (size_t)nk * HS, *dv = dk + (size_t)nk * HS, *p = dv + (size_t)nk * HS, *ds = p + (size_t)Tq * nk;
#pragma omp for
        for (int bg = 0; bg < B * KV; bg++) {
            int b = bg / KV, g = bg % KV;
            const float* kb = kv + (size_t)b * Tk * kvrow + (size_t)g * HS;
            lp_block_rows_get(k, kb, 0, nk, kvrow, HS);
            lp_block_rows_get(v, kb + (size_t)KV * HS, 0, nk, kvrow, HS);
            memset(dk, 0, (size_t)2 * nk * HS * sizeof(float));  // (dk, dv)
            for (int h = g * G; h < (g + 1) * G; h++) {
                size_t row0 = (size_t)b * T;
                lp_block_rows_get(q, qkv + row0 * heads * HS + (size_t)h * HS, t0, T, (size_t)heads * HS, HS);
                lp_block_rows_get(dy, dout + row0 * C + (size_t)h * HS, t0, T, C, HS);
                for (int i = 0; i < Tq; i++) {
                    const float *dyr = dy + (size_t)i * HS, *yr = out + (row0 + t0 + i) * C + (size_t)h * HS;
                    float s = 0.0f;
                    for (int d = 0; d < HS; d++) s += dyr[d] * yr[d];
                    D[i] = s;
                }
                lp_head_gemm(0, 1, Tq, nk, HS, q, k, p, 0);    // scores q k^T
                lp_head_gemm(0, 1, Tq, nk, HS, dy, v, ds, 0);  // dp = dout v^T
                for (int i = 0; i < Tq; i++) {
                    int n = lp_keys_upto(kpos, nk, qpos[t0 + i]);
                    float l = lse[((size_t)b * NH + h) * T + t0 + i], *pr = p + (size_t)i * nk, *dr = ds + (size_t)i * nk;
                    for (int j = 0; j < nk; j++) {
                        pr[j] = j < n ? expf(scale * pr[j] - l) : 0.0f;
                        dr[j] = scale * pr[j] * (dr[j] - D[i]);
                    }
                }
                lp_head_gemm(0, 0, Tq, HS, nk, ds, k, dq, 0);  // dq = ds k
                lp_block_rows_add(dqkv + row0 * heads * HS + (size_t)h * HS, dq, t0, T, (size_t)heads * HS, HS);
                lp_head_gemm(1, 0, nk, HS, Tq, ds, q, dk, 1);  // dk += ds^T q
                lp_head_gemm(1, 0, nk, HS, Tq, p, dy, dv, 1);  // dv += p^T dout
            }
            lp_block_rows_add(dkv + (size_t)b * Tk * kvrow + (size_t)g * HS, dk, 0, nk, kvrow, HS);
            lp_block_rows_add(dkv + (size_t)b * Tk * kvrow + (size_t)(KV + g) * HS, dv, 0, nk, kvrow, HS);
        }
        free(q);
    }
}
// Each row's keys and values between the projection's rows qkv (B,T,(NH+2KV)HS) and a block kv (B,T,2 KV HS):
// to_block 1 copies them into the block, 0 back into qkv's key and value heads.
static inline void lp_attention_kv_copy_cpu(float* kv, float* qkv, int B, int T, int NH, int KV, int HS, int to_block) {
    size_t n = (size_t)2 * KV * HS;
#pragma omp parallel for
    for (int bt = 0; bt < B * T; bt++) {
        float* row = qkv + (size_t)bt * (NH + 2 * KV) * HS + (size_t)NH * HS;
        if (to_block) memcpy(kv + bt * n, row, n * sizeof(float));
        else memcpy(row, kv + bt * n, n * sizeof(float));
    }
}

// --- rotary positions (RoPE), Llama's layout: in each query and key head, the pair of channels (2i, 2i+1) at
// position p is rotated by the angle p freq_i, freq_i = theta^(-2i/HS); Llama 3.1's scaled RoPE divides the
// low frequencies by 8 and blends the middle ones (wavelengths between 8192/4 and 8192, its original context).
// In place on the qkv rows (B,T,(NH+2KV)HS) of the projection, row t at position pos[t] (a device table: t, the
// rows' places in a key-value cache, or context parallelism's chunks' positions), the V heads untouched; inverse rotates by -angle: the backward pass (a
// rotation's transpose), on the gradient of the rotated q and k.
static inline LP_HD double lp_rope_freq(int i, int HS, float theta, int scaled) {
    double f = pow((double)theta, -2.0 * i / HS);
    if (!scaled) return f;
    double wavelen = 2.0 * M_PI / f, factor = 8.0, low = 1.0, high = 4.0, context = 8192.0;
    if (wavelen < context / high) return f;
    if (wavelen > context / low) return f / factor;
    double smooth = (context / wavelen - low) / (high - low);
    return (1.0 - smooth) * f / factor + smooth * f;
}
static inline void lp_rope_cpu(float* qkv, int B, int T, const int* pos, int NH, int KV, int HS, float theta, int scaled, int inverse) {
    int heads = NH + 2 * KV;
#pragma omp parallel for
    for (int bt = 0; bt < B * T; bt++) {
        int at = pos[bt % T];
        float* row = qkv + (size_t)bt * heads * HS;
        for (int i = 0; i < HS / 2; i++) {
            double angle = at * lp_rope_freq(i, HS, theta, scaled);
            float c = (float)cos(angle), s = inverse ? -(float)sin(angle) : (float)sin(angle);
            for (int h = 0; h < NH + KV; h++) {
                float* x = row + (size_t)h * HS + 2 * i;
                float x0 = x[0], x1 = x[1];
                x[0] = x0 * c - x1 * s;
                x[1] = x0 * s + x1 * c;
            }
        }
    }
}
#ifndef LLMPAR_CPU
// The same on the GPU: a thread per (row, pair i) takes the angle as the CPU loop does (in double: the same
// cos and sin) and turns pair i of the row's NH + KV query and key heads (consecutive threads, consecutive
// pairs of a head). A pass of its own over q and k, not fused into the flash kernels' loads or the qkv
// projection's epilogue (cuBLASLt has none for it): it reads and writes 4 (NH + KV) HS bytes a row, for Llama
// 3 8B under 1% of a layer's time (its bytes at an H100's bandwidth against the layer's FLOPs), while fused
// it would sit in both flash kernels' tile loads (which land in shared memory by cp.async, so a pass over the
// tile of its own) and the backward's dq and dk stores, and again in the cublas path's permutes.
static __global__ void lp_rope_kernel(floatX* qkv, int N, int T, const int* pos, int NH, int KV, int HS, float theta, int scaled,
                                      int inverse) {
    size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (size_t)N * (HS / 2)) return;
    int bt = (int)(k / (HS / 2)), i = (int)(k % (HS / 2));
    double angle = pos[bt % T] * lp_rope_freq(i, HS, theta, scaled);
    float c = (float)cos(angle), s = inverse ? -(float)sin(angle) : (float)sin(angle);
    floatX* x = qkv + (size_t)bt * (NH + 2 * KV) * HS + 2 * i;
    for (int h = 0; h < NH + KV; h++, x += HS) {
        float x0 = lp_bf(x[0]), x1 = lp_bf(x[1]);
        x[0] = lp_xf(x0 * c - x1 * s);
        x[1] = lp_xf(x0 * s + x1 * c);
    }
}
static inline void lp_rope_gpu(floatX* qkv, int B, int T, const int* pos, int NH, int KV, int HS, float theta, int scaled, int inverse) {
    size_t n = (size_t)B * T * (HS / 2);
    LP_LAUNCH(lp_rope_kernel, lp_grid(n, LP_THREADS), LP_THREADS, 0, qkv, B * T, T, pos, NH, KV, HS, theta, scaled, inverse);
}
#endif

#ifndef LLMPAR_CPU
// The same algorithm on the GPU (--attention cublas, llm.c's attention without cuDNN): the products as
// cuBLASLt strided batches and small kernels for the rest. It keeps q, k, v permuted (qkvr's heads layout)
// and the bf16 probabilities (B NH T T) for backward, as the CPU loop does. A batch entry is a K/V head
// (b, g) with its group of G = NH / KV query heads, whose q rows (G T, HS) lie together in qkvr and whose
// scores are (G T, T) of att: so q k^T and p v are one product each per K/V head, and dk = ds^T q and
// dv = p^T dy sum over the group inside their products (multi-head: G = 1, a head per entry).

// Row-major C (M,N) = op(A) op(B) for each of `heads` heads, like lp_head_gemm: each operand is one
// contiguous matrix per head (A M*K values, B K*N, C M*N), so the batch strides follow from the shape.
static inline void lp_heads_gemm_gpu(int ta, int tb, int M, int N, int K, const floatX* A, const floatX* B, floatX* C,
                                     int heads) {
    lp_gemm(tb, ta, N, M, K, B, tb ? K : N, (long long)K * N, A, ta ? M : K, (long long)M * K, C, N, (long long)M * N, heads,
            1.0f, 0.0f, NULL, NULL);
}

// Between a projection's rows layout (B,T,NH+2KV,HS) and the heads layout the batched products take, q
// (B,NH,T,HS) then k and v (B,KV,T,HS) each (lp_attention_permute_cpu's); KV = 0 for y (B,T,NH,HS). A
// thread moves one 16-byte pack of a head's row, consecutive threads consecutive packs of the rows layout;
// a head's row is HS contiguous values on both sides.
static __global__ void lp_attention_permute_kernel(floatX* dst, const floatX* src, int B, int T, int NH, int KV, int HS, int to_heads) {
    int packs = (HS + LP_PACK - 1) / LP_PACK, H = NH + 2 * KV;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)B * T * H * packs) return;
    size_t r = i / packs;  // the head's row in the rows layout: (b T + t) H + hh
    int j = (int)(i % packs) * LP_PACK, hh = (int)(r % H), which = hh < NH ? 0 : hh < NH + KV ? 1 : 2, n = which ? KV : NH;
    int h = hh - (which ? NH + (which - 1) * KV : 0);  // the head among q's, k's or v's
    size_t bt = r / H, b = bt / T, t = bt % T;
    size_t rows = r * HS, heads = (which ? (size_t)B * (NH + (which - 1) * KV) * T * HS : 0) + (((size_t)b * n + h) * T + t) * HS;
    lp_store_pack(dst + (to_heads ? heads : rows), j, HS, lp_load_pack(src + (to_heads ? rows : heads), j, HS));
}
static inline void lp_attention_permute_gpu(floatX* dst, const floatX* src, int B, int T, int NH, int KV, int HS, int to_heads) {
    size_t n = (size_t)B * T * (NH + 2 * KV) * ((HS + LP_PACK - 1) / LP_PACK);
    LP_LAUNCH(lp_attention_permute_kernel, lp_grid(n, LP_THREADS), LP_THREADS, 0, dst, src, B, T, NH, KV, HS, to_heads);
}

// The causal softmax in place: row t of each head's (T,T) scores q k^T becomes softmax(scale * its first
// t + 1 values), zeros after. A warp per row: lane l reads packs l, l + 32, ... of the row's first t + 1
// values (those past the diagonal read as 0 without a load) keeping a running max and a sum rescaled when
// the max grows; shuffles combine the lanes; a second pass reads the scores again (from cache) and writes
// the probabilities over the whole row.
static __global__ void lp_attention_softmax_kernel(floatX* att, int rows, int T, float scale) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = row % T;
    floatX* a = att + (size_t)row * T;
    float s2 = scale * LP_LOG2E, m = -INFINITY, l = 0.0f;  // max and sum in units of s2 * score
    for (int j = lane * LP_PACK; j <= t; j += 32 * LP_PACK) {
        LPPack p = lp_load_pack(a, j, t + 1);
        float pm = m;
#pragma unroll
        for (int k = 0; k < LP_PACK; k++)
            if (j + k <= t) pm = fmaxf(pm, lp_bf(p.x[k]) * s2);
        l *= exp2f(m - pm);  // 0 on the first pack (m = -inf)
#pragma unroll
        for (int k = 0; k < LP_PACK; k++)
            if (j + k <= t) l += exp2f(lp_bf(p.x[k]) * s2 - pm);
        m = pm;
    }
    float mw = lp_warp_max(m);  // finite: lane 0 holds the row's first value
    float inv = 1.0f / lp_warp_sum(l * exp2f(m - mw));
    for (int j = lane * LP_PACK; j < T; j += 32 * LP_PACK) {
        LPPack p = lp_load_pack(a, j, t + 1);
#pragma unroll
        for (int k = 0; k < LP_PACK; k++) p.x[k] = lp_xf(j + k <= t ? exp2f(lp_bf(p.x[k]) * s2 - mw) * inv : 0.0f);
        lp_store_pack(a, j, T, p);
    }
}
static inline void lp_attention_probs_gpu(floatX* att, const floatX* qkvr, int B, int T, int C, int NH, int KV) {
    int HS = C / NH, G = NH / KV, rows = B * NH * T;
    lp_heads_gemm_gpu(0, 1, G * T, T, HS, qkvr, qkvr + (size_t)B * NH * T * HS, att, B * KV);  // q k^T
    LP_LAUNCH(lp_attention_softmax_kernel, lp_grid((size_t)rows * 32, LP_THREADS), LP_THREADS, 0, att, rows, T,
              lp_attention_scale(C, NH));
}

// qkv (B,T,(NH+2KV)HS) is scratch: it holds y afterwards, as the CPU loop leaves it.
static inline void lp_attention_forward_gpu(floatX* out, floatX* qkvr, floatX* att, floatX* qkv, int B, int T, int C, int NH, int KV) {
    int HS = C / NH, G = NH / KV;
    lp_attention_permute_gpu(qkvr, qkv, B, T, NH, KV, HS, 1);
    lp_attention_probs_gpu(att, qkvr, B, T, C, NH, KV);
    lp_heads_gemm_gpu(0, 0, G * T, HS, T, att, qkvr + (size_t)B * (NH + KV) * T * HS, qkv, B * KV);  // y = att v, into qkv
    lp_attention_permute_gpu(out, qkv, B, T, NH, 0, HS, 0);
}

// The softmax backward in place, a warp per row as the forward: datt's row t becomes
// dpre = scale * att * (datt - sum(att * datt)) over its first t + 1 values, zeros after.
static __global__ void lp_attention_softmax_backward_kernel(floatX* datt, const floatX* att, int rows, int T, float scale) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = row % T;
    const floatX* a = att + (size_t)row * T;
    floatX* d = datt + (size_t)row * T;
    float dot = 0.0f;
    for (int j = lane * LP_PACK; j <= t; j += 32 * LP_PACK) {
        LPPack p = lp_load_pack(a, j, t + 1), g = lp_load_pack(d, j, t + 1);  // 0 past the diagonal
#pragma unroll
        for (int k = 0; k < LP_PACK; k++) dot += lp_bf(p.x[k]) * lp_bf(g.x[k]);
    }
    dot = lp_warp_sum(dot);
    for (int j = lane * LP_PACK; j < T; j += 32 * LP_PACK) {
        LPPack p = lp_load_pack(a, j, t + 1), g = lp_load_pack(d, j, t + 1);
#pragma unroll
        for (int k = 0; k < LP_PACK; k++)
            g.x[k] = lp_xf(j + k <= t ? scale * lp_bf(p.x[k]) * (lp_bf(g.x[k]) - dot) : 0.0f);
        lp_store_pack(d, j, T, g);
    }
}

// dqkv is overwritten; dqkvr, datt and scratch (dy, B NH T HS) are scratch; qkvr and att as the forward
// (or lp_attention_probs_gpu) left them.
static inline void lp_attention_backward_gpu(floatX* dqkv, floatX* dqkvr, floatX* datt, floatX* scratch, const floatX* dout,
                                             const floatX* qkvr, const floatX* att, int B, int T, int C, int NH, int KV) {
    int HS = C / NH, G = NH / KV, groups = B * KV, rows = B * NH * T;
    size_t plane = (size_t)B * NH * T * HS, kvplane = (size_t)B * KV * T * HS;
    const floatX *q = qkvr, *k = q + plane, *v = k + kvplane;
    floatX *dq = dqkvr, *dk = dq + plane, *dv = dk + kvplane, *dy = scratch;
    lp_attention_permute_gpu(dy, dout, B, T, NH, 0, HS, 1);
    lp_heads_gemm_gpu(0, 1, G * T, T, HS, dy, v, datt, groups);  // datt = dy v^T
    lp_heads_gemm_gpu(1, 0, T, HS, G * T, att, dy, dv, groups);  // dv = att^T dy, over the group
    LP_LAUNCH(lp_attention_softmax_backward_kernel, lp_grid((size_t)rows * 32, LP_THREADS), LP_THREADS, 0, datt, att, rows, T,
              lp_attention_scale(C, NH));
    lp_heads_gemm_gpu(0, 0, G * T, HS, T, datt, k, dq, groups);  // dq = dpre k
    lp_heads_gemm_gpu(1, 0, T, HS, G * T, datt, q, dk, groups);  // dk = dpre^T q, over the group
    lp_attention_permute_gpu(dqkv, dqkvr, B, T, NH, KV, HS, 0);
}
#endif
#endif  // LLMPAR_IMPLEMENTATION

// --- attention with a key-value cache (sampling: lp_model_forward with LPModel.cache): N new rows of each of
// B sequences, at positions [pos, pos + N), first add their keys and values to the cache at those positions,
// then each row's query attends to the cache's positions [0, its own]. cache (2,B,KV,Tc,HS): keys, then
// values, each K/V head's positions contiguous (qkvr's layout without q); qkv (B,N,(NH+2KV)HS) as the qkv
// projection writes it (RoPE turned at the rows' positions); out (B,N,C). Grouped-query attention caches the KV
// heads alone, query head h reading K/V head h / (NH/KV). The causal softmax of lp_attention_forward_cpu, each
// query alone and in one pass over its keys (a running max rescales the sum and the output when it grows), so
// one sampled token costs its own row's work, not a (T,T) product.
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_attention_cached_forward_cpu(float* out, float* cache, const float* qkv, int B, int N, int pos, int Tc, int C,
                                                   int NH, int KV) {
    int HS = C / NH, G = NH / KV, KVC = KV * HS, row = C + 2 * KVC;
    size_t plane = (size_t)B * KV * Tc * HS;
    float scale = lp_attention_scale(C, NH);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < N; i++)
            for (int which = 0; which < 2; which++)
                for (int c = 0; c < KVC; c++)
                    cache[which * plane + (((size_t)b * KV + c / HS) * Tc + pos + i) * HS + c % HS] =
                        qkv[((size_t)b * N + i) * row + C + which * KVC + c];
#pragma omp parallel for
    for (int r = 0; r < B * N * NH; r++) {
        int h = r % NH, i = r / NH % N, b = r / NH / N;
        const float* q = qkv + ((size_t)b * N + i) * row + h * HS;
        const float* k = cache + ((size_t)b * KV + h / G) * Tc * HS;
        const float* v = k + plane;
        float* y = out + ((size_t)b * N + i) * C + h * HS;
        float m = -INFINITY, l = 0.0f;
        for (int d = 0; d < HS; d++) y[d] = 0.0f;
        for (int j = 0; j <= pos + i; j++) {
            float s = 0.0f;
            for (int d = 0; d < HS; d++) s += q[d] * k[(size_t)j * HS + d];
            if (s > m) {  // (the first key: exp(-inf) = 0 scales nothing yet)
                float shrink = expf(scale * (m - s));
                l *= shrink;
                for (int d = 0; d < HS; d++) y[d] *= shrink;
                m = s;
            }
            float p = expf(scale * (s - m));
            l += p;
            for (int d = 0; d < HS; d++) y[d] += p * v[(size_t)j * HS + d];
        }
        for (int d = 0; d < HS; d++) y[d] /= l;
    }
}

#ifndef LLMPAR_CPU
// The same on the GPU: a thread copies one key or value channel into the cache; then a warp takes one (row,
// query head), lane l holding dimensions l, l + 32, ... of its query and output (HS <= 128: 4 each), each key's
// score a warp sum, the running max and sum the same in every lane; query head h reads K/V head h / (NH/KV).
static __global__ void lp_kv_append_kernel(floatX* cache, const floatX* qkv, int B, int N, int pos, int Tc, int C, int NH, int KV) {
    int HS = C / NH, KVC = KV * HS;
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * N * 2 * KVC) return;
    int c = (int)(idx % KVC), which = (int)(idx / KVC % 2), i = (int)(idx / KVC / 2 % N), b = (int)(idx / KVC / 2 / N);
    cache[which * (size_t)B * KV * Tc * HS + (((size_t)b * KV + c / HS) * Tc + pos + i) * HS + c % HS] =
        qkv[((size_t)b * N + i) * (C + 2 * KVC) + C + which * KVC + c];
}
#define LP_CACHED_DIMS (LP_FLASH_MAX_HS / 32)
static __global__ void lp_attention_cached_kernel(floatX* out, const floatX* cache, const floatX* qkv, int B, int N, int pos, int Tc,
                                                  int C, int NH, int KV, float scale) {
    int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= B * N * NH) return;  // (a whole warp)
    int h = r % NH, i = r / NH % N, b = r / NH / N, HS = C / NH;
    const floatX* q = qkv + ((size_t)b * N + i) * (C + 2 * KV * HS) + h * HS;
    const floatX* k = cache + ((size_t)b * KV + h / (NH / KV)) * Tc * HS;
    const floatX* v = k + (size_t)B * KV * Tc * HS;
    float qd[LP_CACHED_DIMS], y[LP_CACHED_DIMS], m = -INFINITY, l = 0.0f;
#pragma unroll
    for (int u = 0; u < LP_CACHED_DIMS; u++) {
        int d = lane + 32 * u;
        qd[u] = d < HS ? lp_bf(q[d]) : 0.0f;
        y[u] = 0.0f;
    }
    for (int j = 0; j <= pos + i; j++) {
        float s = 0.0f;
#pragma unroll
        for (int u = 0; u < LP_CACHED_DIMS; u++)
            if (lane + 32 * u < HS) s += qd[u] * lp_bf(k[(size_t)j * HS + lane + 32 * u]);
        s = lp_warp_sum(s);
        if (s > m) {
            float shrink = expf(scale * (m - s));
            l *= shrink;
#pragma unroll
            for (int u = 0; u < LP_CACHED_DIMS; u++) y[u] *= shrink;
            m = s;
        }
        float p = expf(scale * (s - m));
        l += p;
#pragma unroll
        for (int u = 0; u < LP_CACHED_DIMS; u++)
            if (lane + 32 * u < HS) y[u] += p * lp_bf(v[(size_t)j * HS + lane + 32 * u]);
    }
#pragma unroll
    for (int u = 0; u < LP_CACHED_DIMS; u++)
        if (lane + 32 * u < HS) out[((size_t)b * N + i) * C + h * HS + lane + 32 * u] = lp_xf(y[u] / l);
}
static inline void lp_attention_cached_forward_gpu(floatX* out, floatX* cache, const floatX* qkv, int B, int N, int pos, int Tc, int C,
                                                   int NH, int KV) {
    size_t n = (size_t)B * N * 2 * KV * (C / NH), warps = (size_t)B * N * NH;
    LP_LAUNCH(lp_kv_append_kernel, lp_grid(n, LP_THREADS), LP_THREADS, 0, cache, qkv, B, N, pos, Tc, C, NH, KV);
    LP_LAUNCH(lp_attention_cached_kernel, lp_grid(warps * 32, LP_THREADS), LP_THREADS, 0, out, cache, qkv, B, N, pos, Tc, C, NH, KV,
              lp_attention_scale(C, NH));
}

#endif
#endif  // LLMPAR_IMPLEMENTATION

#ifndef LLMPAR_CPU
// Flash attention, in FlashAttention-2's form: the results of lp_attention_forward_cpu and
// lp_attention_backward_cpu (their oracles) without the (B,NH,T,T) probabilities. A block of 4 warps owns 64
// or 128 rows of one (b,h) (queries in the forward, 16 or 32 a warp; a tile of 64 keys at a time in the
// backward), and walks the tiles of 64 of the other side at or below the diagonal, each staged once in
// shared memory for all its warps by cp.async, the next one in flight while this one computes; only the
// tiles the diagonal crosses are masked. The products run on tensor cores (mma m16n8k16, bf16 in, fp32
// accumulate) with a warp's own operands, scores and accumulators in registers: the forward's scores never
// touch shared memory, and the probabilities become the next product's A operand in place. q, k, v are read from qkv (B,T,3C) in place,
// y written to out (B,T,C), gradients straight into dqkv (B,T,3C); with KV heads (grouped-query attention),
// rows of (NH + 2 KV) HS, query head h reading K/V head h / (NH / KV) where it lies. The head size HS is padded to HP in
// {16, 32, 64, 128}, a template parameter (register arrays need compile-time sizes); the padding and rows
// past T read as zeros. lp_config_validate refuses larger heads.
#define LP_FLASH_ROWS 64      // rows of a staged tile (keys, or the backward's queries)
#define LP_FLASH_THREADS 128  // 4 warps
// Blocks of a flash kernel an SM must hold at once (__launch_bounds__: at most 255 registers a thread for 2,
// 168 for 3): a warp's work is a chain of dependent instructions, so more warps are what hides their
// latency (the GPU model's latency roof; Nsight Compute measured 2-4 warps a scheduler, 0.2-0.35 of them
// ready, with 3 blocks of the earlier kernels). The forward's m-tiles (16 query rows each) per warp: 2
// (blocks of 128 rows, as FlashAttention-2's for heads up to 64), which halves the ldmatrix per mma, where
// registers allow, at 2 blocks an SM; at HP 128 two would need more than 255 registers (ptxas spills 1.3
// KB), and it keeps 1, also at 2 blocks. The backward holds 3 below HP 64 and 2 from it, where 3 would
// spill (nvcc -Xptxas -v for sm_90: dev/docs/figures.md).
#define LP_FLASH_MT(HP) ((HP) <= 64 ? 2 : 1)
#define LP_FLASH_FWD_BLOCKS 2
#define LP_FLASH_BWD_BLOCKS(HP) ((HP) >= 64 ? 2 : 3)
#ifdef LLMPAR_IMPLEMENTATION
static inline int lp_flash_width(int HS) { return HS <= 16 ? 16 : HS <= 32 ? 32 : HS <= 64 ? 64 : HS <= 128 ? 128 : 0; }
#endif  // LLMPAR_IMPLEMENTATION
#define LP_LN2 0.6931471805599453f

// A shared-memory address as ldmatrix takes it: 32 bits under nvcc, so that a tile's fragments are one
// register plus constant offsets (converting a pointer at every load costs more than the load); a pointer
// under the emulator. lp_smem_at: so many bf16 elements further.
#ifdef LLMPAR_CUDAEMU
typedef const floatX* lp_smem;
#ifdef LLMPAR_IMPLEMENTATION
static __device__ inline lp_smem lp_smem_of(const floatX* p) { return p; }
static __device__ inline lp_smem lp_smem_at(lp_smem a, int elements) { return a + elements; }
#endif  // LLMPAR_IMPLEMENTATION
#else
typedef uint32_t lp_smem;
#ifdef LLMPAR_IMPLEMENTATION
static __device__ inline lp_smem lp_smem_of(const floatX* p) { return (uint32_t)__cvta_generic_to_shared(p); }
static __device__ inline lp_smem lp_smem_at(lp_smem a, int elements) { return a + 2 * elements; }
#endif  // LLMPAR_IMPLEMENTATION
#endif

// The instructions the flash kernels give nvcc as inline PTX, and their twins under the emulator, each
// one macro: lp_mma, lp_ldmatrix and lp_exp2 call it on one line, which both builds then name as its
// source line (the GPU model matches the emulator's counts per line to nvcc's machine code,
// dev/cudaemu/sass.py).
// The mma's operand type: floatX's (.bf16, or .f16 in the fp16 build).
#ifdef LLMPAR_FP16
#define LP_MMA_TYPE "f16"
#else
#define LP_MMA_TYPE "bf16"
#endif
#ifdef LLMPAR_CUDAEMU
#define LP_PTX_MMA(d, a, b, c) cudaemu_mma_m16n8k16(d, a, b, c, LP_CUDA_FLOATX)
#define LP_PTX_LDMATRIX(d, row, trans) cudaemu_ldmatrix_x4(d, row, trans)
#define LP_PTX_EX2(y, x) ((y) = exp2f(x))
#define LP_PTX_CP_ASYNC16(dst, src, bytes) cudaemu_cp_async16(dst, src, bytes)
#define LP_PTX_CP_COMMIT() cudaemu_cp_async_commit()
#define LP_PTX_CP_WAIT(n) cudaemu_cp_async_wait(n)
#else
#define LP_PTX_MMA(d, a, b, c)                                                                                          \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." LP_MMA_TYPE "." LP_MMA_TYPE ".f32 "                              \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"                                  \
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                                       \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]))
#define LP_PTX_LDMATRIX(d, row, trans)                                                                                  \
    do {                                                                                                                \
        if (trans)                                                                                                      \
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"                        \
                         : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])                                               \
                         : "r"(row));                                                                                   \
        else                                                                                                            \
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"                              \
                         : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])                                               \
                         : "r"(row));                                                                                   \
    } while (0)
#define LP_PTX_EX2(y, x) asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x))
#define LP_PTX_CP_ASYNC16(dst, src, bytes)                                                                              \
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src), \
                 "r"(bytes)                                                                                             \
                 : "memory")
#define LP_PTX_CP_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#define LP_PTX_CP_WAIT(n) asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory")
#endif

#ifdef LLMPAR_IMPLEMENTATION
// D = A B + C for a warp on tensor cores: A (16,16) and B (16,8) of the compute type, C and D (16,8) fp32, the PTX
// instruction mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (.f16 for fp16; all 32 lanes take part). Registers as
// the PTX ISA places them ("Matrix Fragments for mma.m16n8k16 with floating point type",
// docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-fragment-mma-16816-float), with
// g = lane / 4, t = lane % 4 and a register's lower 16 bits holding the lower column (row, for B): a[0] =
// A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9]; b[0] =
// B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]; c[0], c[1] = C[g][2t, 2t+1], c[2], c[3] = C[g+8][2t, 2t+1].
static __device__ inline void lp_mma(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    LP_PTX_MMA(d, a, b, c);
}
// Four 8 x 8 bf16 blocks of shared memory into d[0..3]: ldmatrix.sync.aligned.m8n8.x4. Lane l gives the
// address of row l % 8 of block l / 8 (16 bytes, 16-byte aligned) and gets, in d[i], block i's row l / 4
// at columns 2 (l % 4) and 2 (l % 4) + 1; with trans (.trans), its column l / 4 at those rows (PTX ISA,
// docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-instructions-ldmatrix). trans is a
// constant at every call.
static __device__ inline void lp_ldmatrix(uint32_t d[4], lp_smem row, int trans) {
    LP_PTX_LDMATRIX(d, row, trans);
}
// 2^x on the SFU alone: ex2.approx.ftz, one MUFU.EX2 where exp2f wraps it in a fix-up for subnormal results
// (four instructions, on every probability of the flash kernels). Those results flush to 0, far below what
// a bf16 probability keeps; 2^-inf = 0 as the masks need. The emulator computes exp2f.
static __device__ inline float lp_exp2(float x) {
    float y;
    LP_PTX_EX2(y, x);
    return y;
}
// Asynchronous copies of 16 bytes from global to shared memory (PTX ISA, cp.async,
// docs.nvidia.com/cuda/parallel-thread-execution/#data-movement-and-conversion-instructions-cp-async): the
// copy runs beside the thread's work; src_bytes of the 16 come from src (the rest are zeros, so a piece past
// the matrix reads nothing), both addresses 16-byte aligned. lp_cp_async_commit makes the thread's copies
// since the last commit a group; lp_cp_async_wait<N> waits until at most the N most recent groups are in
// flight, after which their bytes are visible to this thread, and to the block after a barrier.
static __device__ inline void lp_cp_async16(floatX* dst, const floatX* src, int src_bytes) { LP_PTX_CP_ASYNC16(dst, src, src_bytes); }
static __device__ inline void lp_cp_async_commit(void) { LP_PTX_CP_COMMIT(); }
template <int N>
static __device__ inline void lp_cp_async_wait(void) {
    LP_PTX_CP_WAIT(N);
}
// Two fp32 values as the compute type in a register, the first in the low half.
static __device__ inline uint32_t lp_pack2f(float lo, float hi) {
#ifdef LLMPAR_FP16
    __half2 v = __floats2half2_rn(lo, hi);  // one conversion instruction for both
#else
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
#endif
    uint32_t u;
    memcpy(&u, &v, sizeof(u));
    return u;
}

// Tiles in shared memory are bf16 rows of HP values at a pitch of HP + 8 (16 bytes of padding), so that a
// warp's fragment loads hit 32 different banks: a pitch of HP / 2 + 4 words puts row g at bank
// 4g + (HP / 2) g (mod 32), and the 8 rows x 16 bytes of each block ldmatrix reads fill all 32 banks for
// every HP in {16, 32, 64, 128}. Staging writes whole 16-byte pieces, 8 lanes a row's neighbours: free of
// conflicts at HP 64 and 128, 2-way on a few banks at HP 16 and 32 (once per tile).
//
// Each fragment loader below takes the lane's own address in a 16 x 16 block of a tile at pitch ld: the
// block's address plus lp_lane_rows2(ld) or lp_lane_cols(ld) elements, an offset a kernel computes once.
static __device__ inline int lp_lane_rows2(int ld) {
    int lane = threadIdx.x % 32;
    return (lane % 8 + 8 * (lane / 16)) * ld + 8 * (lane / 8 % 2);
}
static __device__ inline int lp_lane_cols(int ld) {
    int lane = threadIdx.x % 32;
    return (lane % 8 + 8 * (lane / 8 % 2)) * ld + 8 * (lane / 16);
}
// Two B fragments (16,8) with B[k][n] = tile[n][k] (the tile's rows are B's columns: k for q k^T), for the
// block's rows 0 .. 7 and 8 .. 15: each register two neighbours in a row, which ldmatrix gathers from the
// blocks (rows 0, 8 x columns 0, 8) in one instruction. at: lp_lane_rows2.
static __device__ inline void lp_frag_rows2(uint32_t b[2][2], lp_smem at) {
    uint32_t d[4];
    lp_ldmatrix(d, at, 0);
    b[0][0] = d[0], b[0][1] = d[1], b[1][0] = d[2], b[1][1] = d[3];
}
// Two B fragments (16,8), columns 0 .. 7 and 8 .. 15, with B[k][n] = tile[k][n] (v for p v): each register
// a column's two neighbouring rows, which ldmatrix's transposing load gathers from the blocks (rows 0, 8 x
// columns 0, 8) in one instruction. at: lp_lane_cols.
static __device__ inline void lp_frag_cols(uint32_t b[2][2], lp_smem at) {
    uint32_t d[4];
    lp_ldmatrix(d, at, 1);
    b[0][0] = d[0], b[0][1] = d[1], b[1][0] = d[2], b[1][1] = d[3];
}
// A fragment (16,16) of a row-major tile: its blocks (rows 0, 8 x columns 0, 8) in the order mma wants
// them, in one ldmatrix. at: lp_lane_cols.
static __device__ inline void lp_frag_a(uint32_t a[4], lp_smem at) { lp_ldmatrix(a, at, 0); }

// ROWS rows t0.. of a (T,stride) matrix's channels 0 .. HS - 1 (src: its row 0, first channel) into a
// tile, zero past T and HS; or back (lp_flash_store, rows past T and channels past HS left alone). In
// 16-byte pieces, by threads first, first + STEP, ... of the block or the warp. Where the rows allow (HS and
// the stride multiples of 8, src 16-byte aligned) each piece is a cp.async, zero-filled past T and HS, in
// flight until the thread's lp_cp_async_wait covers it (the caller commits the group); else the thread
// loads and stores it itself.
template <int HP, int ROWS, int STEP>
static __device__ inline void lp_flash_load(floatX* tile, const floatX* src, int stride, int t0, int T, int HS, int first) {
    const int PER_ROW = HP / 8;
    int vec = HS % 8 == 0 && stride % 8 == 0 && ((uintptr_t)src & 15) == 0;
#pragma unroll
    for (int k = 0; k < ROWS * PER_ROW / STEP; k++) {
        int i = first + k * STEP, r = i / PER_ROW, d = i % PER_ROW * 8, t = t0 + r, in = t < T && d < HS;
        const floatX* s = src + (size_t)t * stride + d;
        if (vec) {
            lp_cp_async16(tile + r * (HP + 8) + d, in ? s : src, in ? 16 : 0);
            continue;
        }
        LPPack q;
#pragma unroll
        for (int e = 0; e < 8; e++) q.x[e] = t < T && d + e < HS ? s[e] : lp_xf(0.0f);
        *(uint4*)(tile + r * (HP + 8) + d) = q.bits;
    }
}
template <int HP>
static __device__ inline void lp_flash_store(floatX* dst, int stride, const floatX* tile, int t0, int T, int HS, int rows, int first,
                                             int step) {
    int vec = HS % 8 == 0 && stride % 8 == 0 && ((uintptr_t)dst & 15) == 0;
    for (int i = first; i < rows * HP / 8; i += step) {
        int r = i / (HP / 8), d = i % (HP / 8) * 8, t = t0 + r;
        if (t >= T || d >= HS) continue;
        floatX* s = dst + (size_t)t * stride + d;
        LPPack q;
        q.bits = *(const uint4*)(tile + r * (HP + 8) + d);
        if (vec) {
            *(uint4*)s = q.bits;
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++)
                if (d + k < HS) s[k] = q.x[k];
        }
    }
}
// A warp's (16,8N) fp32 accumulators as bf16 rows of a tile at pitch ld, rows g scaled by f0 and g + 8 by f8.
template <int N>
static __device__ inline void lp_flash_put(floatX* tile, int ld, const float acc[N][4], float f0, float f8) {
    int lane = threadIdx.x % 32;
    floatX* p = tile + lane / 4 * ld + 2 * (lane % 4);
#pragma unroll
    for (int n = 0; n < N; n++) {
        *(uint32_t*)(p + 8 * n) = lp_pack2f(acc[n][0] * f0, acc[n][1] * f0);
        *(uint32_t*)(p + 8 * ld + 8 * n) = lp_pack2f(acc[n][2] * f8, acc[n][3] * f8);
    }
}
// The other way: a (16,8N) block of a bf16 matrix at pitch ld added onto a warp's fp32 accumulators, rows g
// scaled by f0 and g + 8 by f8; its rows from `rows` and columns from `cols` on read as zeros.
template <int N>
static __device__ inline void lp_flash_get(float acc[N][4], const floatX* src, int ld, int rows, int cols, float f0, float f8) {
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int r = lane / 4 + 8 * (e / 2), c = 8 * n + 2 * (lane % 4) + e % 2;
            if (r < rows && c < cols) acc[n][e] += lp_bf(src[(size_t)r * ld + c]) * (e < 2 ? f0 : f8);
        }
}

// The warp's two products per tile, for its MT blocks of 16 rows (m-tiles). s (16,8NB) = a b^T per m-tile:
// a (16,HP) as A fragments in registers, b the tile's first 8NB rows (NB = 8: all 64; tile: the lane's
// address at lp_lane_rows2); s[mt][j] holds columns 8j .. 8j + 7 (element e: row g + 8 (e >= 2), column
// 8j + 2t + e % 2). Only the column blocks j in [lo, hi) are computed, the others are zeros (wholly masked,
// or past T). Each B fragment is loaded once for all MT m-tiles: two m-tiles halve the ldmatrix per mma.
// The column blocks are the inner loop, so that consecutive products go to different accumulators (one
// accumulator's chain of products would wait on each in turn).
// Column blocks go in pairs, one ldmatrix each (lo is even; a pair's block at or past hi is loaded, from the
// tile, and not used).
template <int HP, int NB, int MT>
static __device__ inline void lp_flash_abt(float s[][NB][4], const uint32_t a[][HP / 16][4], lp_smem tile, int lo, int hi) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < NB; j++) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
#pragma unroll
    for (int k = 0; k < HP / 16; k++)
#pragma unroll
        for (int j = 0; j < NB; j += 2) {
            if (j < lo || j >= hi) continue;
            uint32_t b[2][2];
            lp_frag_rows2(b, lp_smem_at(tile, 8 * j * (HP + 8) + 16 * k));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                lp_mma(s[mt][j], a[mt][k], b[0], s[mt][j]);
                if (j + 1 < hi) lp_mma(s[mt][j + 1], a[mt][k], b[1], s[mt][j + 1]);
            }
        }
}
// acc (16,HP) += p b per m-tile: p (16,8NB) the fp32 accumulators of lp_flash_abt, rounded to bf16 as A
// fragments in place (columns 16k .. 16k + 15 are s[2k] and s[2k + 1]: FlashAttention-2's register reuse),
// b the tile's first 8NB rows (tile: the lane's address at lp_lane_cols), each fragment loaded once for
// every m-tile; the 16-column steps wholly outside [lo, hi) are skipped.
template <int HP, int NB, int MT>
static __device__ inline void lp_flash_apb(float acc[][HP / 8][4], const float p[][NB][4], lp_smem tile, int lo, int hi) {
#pragma unroll
    for (int k = 0; k < NB / 2; k++) {
        if (2 * k + 1 < lo || 2 * k >= hi) continue;
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            a[mt][0] = lp_pack2f(p[mt][2 * k][0], p[mt][2 * k][1]), a[mt][1] = lp_pack2f(p[mt][2 * k][2], p[mt][2 * k][3]);
            a[mt][2] = lp_pack2f(p[mt][2 * k + 1][0], p[mt][2 * k + 1][1]), a[mt][3] = lp_pack2f(p[mt][2 * k + 1][2], p[mt][2 * k + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < HP / 8; n += 2) {
            uint32_t b[2][2];
            lp_frag_cols(b, lp_smem_at(tile, 16 * k * (HP + 8) + 8 * n));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                lp_mma(acc[mt][n], a[mt], b[0], acc[mt][n]);
                lp_mma(acc[mt][n + 1], a[mt], b[1], acc[mt][n + 1]);
            }
        }
    }
}

// Where a query meets the keys. One sequence's causal attention (RING 0): a query sees the keys at its own
// row or before. A ring block (RING 1, context parallelism): the rows' positions in the sequence are tables,
// qpos of the T queries and kpos of the Tk keys (both ascending, device memory), and a query sees the keys at
// its position or before; a tile's first or last key and query tell whether a whole tile is seen, none of
// it, or a part (the mask below). lp_flash_seen: how many keys a query at position p sees (a prefix).
template <int RING>
static __device__ inline int lp_flash_pos(const int* pos, int i) { return RING ? pos[i] : i; }
template <int RING>
static __device__ inline int lp_flash_seen(const int* kpos, int Tk, int p) { return RING ? lp_keys_upto(kpos, Tk, p) : min(p + 1, Tk); }
// The mask on a tile the diagonal crosses: -infinity where the key comes after the query (a ring block: or
// past Tk). Element (r, c) of the warp's 16 x 8NB scores is query q0 + r and key k0 + c, or with keys_in_rows
// (dk, dv) key k0 + r and query q0 + c. A query row past T takes row T - 1's place (its values are not kept).
// One sequence's test is written as an offset (column - row against q0 - k0): as key > query, HP 64's forward
// spills 12 bytes (nvcc 13, sm_90).
template <int NB, int RING>
static __device__ inline void lp_flash_mask(float s[NB][4], const int* qpos, const int* kpos, int q0, int k0, int T, int Tk,
                                            int keys_in_rows) {
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < NB; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int r = lane / 4 + 8 * (e / 2), c = 8 * j + 2 * (lane % 4) + e % 2;
            int query = q0 + (keys_in_rows ? c : r), key = k0 + (keys_in_rows ? r : c);
            if (RING ? key >= Tk || kpos[key] > qpos[min(query, T - 1)] : (keys_in_rows ? r - c : c - r) > q0 - k0) s[j][e] = -INFINITY;
        }
}

// One step of the online softmax over a tile of a warp's scores: a lane holds rows g and g + 8 (i = 0, 1),
// spread over the 4 lanes of its quad, whose maxima meet by shuffles. m is the running row max of the
// scores times scale log2(e), l this lane's part of the sum of exp2(that - m); when m grows, l and the
// output rows are rescaled. Leaves s = exp2(score scale log2(e) - m), the unnormalised probabilities.
// Every row sees key 0 in the first tile, so m is finite from then on and exp2(-inf - m) = 0.
template <int HP>
static __device__ inline void lp_flash_softmax(float s[8][4], float m[2], float l[2], float o[HP / 8][4], float sl2) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        float mx = -INFINITY, sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) mx = fmaxf(mx, fmaxf(s[j][2 * i], s[j][2 * i + 1]));
        mx = fmaxf(m[i], mx * sl2);  // sl2 > 0: the max of the scaled scores
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float alpha = lp_exp2(m[i] - mx);  // 0 on the first tile (m = -inf)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 2 * i; e < 2 * i + 2; e++) {
                s[j][e] = lp_exp2(fmaf(s[j][e], sl2, -mx));
                sum += s[j][e];
            }
        l[i] = l[i] * alpha + sum;
        m[i] = mx;
#pragma unroll
        for (int n = 0; n < HP / 8; n++) o[n][2 * i] *= alpha, o[n][2 * i + 1] *= alpha;
    }
}

// A ring block's rows resumed from the blocks before (lp_flash_attention_forward_kernel): the running max
// rmax (natural units: m takes it times log2 e), the sum rsum (the quad's first lane holds it, as the lanes'
// parts are summed at the end) and o = out rsum, the normalised output scaled back.
template <int HP, int MT>
static __device__ inline void lp_flash_resume(float o[][HP / 8][4], float m[][2], float l[][2], const floatX* out, int C,
                                              const float* rmax, const float* rsum, int r0, int T, int HS) {
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        int t0 = r0 + 16 * mt;
        float sum[2] = {};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int t = t0 + lane / 4 + 8 * i;
            if (t >= T) continue;
            sum[i] = rsum[t];
            m[mt][i] = rmax[t] * LP_LOG2E;
            l[mt][i] = lane % 4 == 0 ? sum[i] : 0.0f;
        }
        if (t0 < T) lp_flash_get<HP / 8>(o[mt], out + (size_t)t0 * C, C, T - t0, HS, sum[0], sum[1]);
    }
}

// Forward: each warp keeps its 16 MT rows of q as A fragments, and per row the running max m, sum l and
// output o (online softmax), in registers, over the key tiles up to its diagonal; at the end y = o / l
// goes out through shared memory (whole 16-byte pieces), and lse = (m + log2 l) ln 2, the natural
// logsumexp of the scaled scores, is kept for the backward. The key tiles (k and v, 64 rows each) stream
// through two buffers: while the warps work on one tile, the next one's cp.async copies are in flight
// into the other (q, at the start, is staged in the second). A block's query tiles run along x, the
// grid's fast axis, so the blocks resident at once are mostly one head's and share its k and v in L2;
// within a head, the tiles with the most keys start first.
// A ring block (RING 1, lp_attention_block_forward_gpu) reads its Tk keys and values from kv (rows of 2 KV
// HS) and carries the rows' state between blocks as the CPU loop does: the running max in lse and the sum
// in rsum (natural units), the output normalised in out; after the first block (`first`, which every row
// sees the first key of) the kernel starts from them (o = out l) and a warp whose rows see none of the
// block writes nothing.
template <int HP, int RING>
static __global__ void __launch_bounds__(LP_FLASH_THREADS, LP_FLASH_FWD_BLOCKS)
    lp_flash_attention_forward_kernel(floatX* out, float* lse, float* rsum, const floatX* qkv, const floatX* kv, const int* qpos,
                                      const int* kpos, int T, int Tk, int C, int NH, int KV, int first, float scale) {
    const int LD = HP + 8, MT = LP_FLASH_MT(HP), WR = 16 * MT, KR = LP_FLASH_ROWS;  // rows: a warp's queries, a tile's keys
    if (!RING) Tk = T;  // (one sequence's keys are its rows: a register less, where HP 64 would spill)
    int HS = C / NH, W = C + 2 * KV * HS, KW = RING ? 2 * KV * HS : W, bh = blockIdx.y, b = bh / NH, h = bh % NH;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int q0 = (gridDim.x - 1 - blockIdx.x) * 4 * WR, r0 = q0 + WR * warp;  // the block's and the warp's first row
    int last = min(r0 + WR, T) - 1;                                        // the warp's last row (RING)
    int tiles = (lp_flash_seen<RING>(kpos, Tk, lp_flash_pos<RING>(qpos, min(q0 + 4 * WR, T) - 1)) + KR - 1) / KR;  // up to the block's last row
    if (RING && tiles == 0) return;  // (a block of rows before every key)
    LP_SHARED(floatX, smem);
    floatX* buf1 = smem + 2 * KR * LD;  // two buffers (smem, buf1) of a k tile and a v tile (KR,HP) each, pitch LD
    const floatX* src = qkv + (size_t)b * T * W + h * HS;
    const floatX* ksrc = (RING ? kv + (size_t)b * Tk * KW : qkv + (size_t)b * T * W + C) + h / (NH / KV) * HS, *vsrc = ksrc + KV * HS;
    lp_flash_load<HP, 4 * WR, LP_FLASH_THREADS>(buf1, src, W, q0, T, HS, threadIdx.x);  // q (4 WR <= 2 KR rows)
    lp_cp_async_commit();
    lp_flash_load<HP, KR, LP_FLASH_THREADS>(smem, ksrc, KW, 0, Tk, HS, threadIdx.x);
    lp_flash_load<HP, KR, LP_FLASH_THREADS>(smem + KR * LD, vsrc, KW, 0, Tk, HS, threadIdx.x);
    lp_cp_async_commit();
    lp_cp_async_wait<1>();  // q has landed (tile 0 may still be in flight)
    __syncthreads();
    uint32_t qf[MT][HP / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int k = 0; k < HP / 16; k++) lp_frag_a(qf[mt][k], lp_smem_of(buf1 + (r0 - q0 + 16 * mt) * LD + lp_lane_cols(LD) + 16 * k));
    float o[MT][HP / 8][4] = {}, m[MT][2], l[MT][2] = {}, sl2 = scale * LP_LOG2E;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) m[mt][0] = m[mt][1] = -INFINITY;
    if (RING && !first) lp_flash_resume<HP, MT>(o, m, l, out + (size_t)b * T * C + h * HS, C, lse + (size_t)bh * T, rsum + (size_t)bh * T, r0, T, HS);
    int seen = 0;  // tiles the warp worked on
    for (int j = 0; j < tiles; j++) {
        int j0 = j * KR;
        __syncthreads();  // every warp is done with the buffer the next tile goes into (tile j - 1, or q)
        if (j + 1 < tiles) {
            floatX* next = (j + 1) % 2 ? buf1 : smem;
            lp_flash_load<HP, KR, LP_FLASH_THREADS>(next, ksrc, KW, j0 + KR, Tk, HS, threadIdx.x);
            lp_flash_load<HP, KR, LP_FLASH_THREADS>(next + KR * LD, vsrc, KW, j0 + KR, Tk, HS, threadIdx.x);
        }
        lp_cp_async_commit();   // (an empty group after the last tile, so that one wait fits every tile)
        lp_cp_async_wait<1>();  // this thread's part of tile j has landed ...
        __syncthreads();        // ... and every thread's
        // Skipped: a warp past T (the last block of a ragged T; it only helps load), and a tile wholly after
        // the warp's rows (the last of a block of 128 rows, for its first warps). Every row a warp works on
        // sees the tile's first key, so its running max is finite from its first tile on.
        if (r0 >= T || (RING ? kpos[j0] > qpos[last] : j0 > r0 + WR - 1)) continue;
        seen++;
        const floatX *ks = j % 2 ? buf1 : smem, *vs = ks + KR * LD;
        lp_smem kr = lp_smem_of(ks + lp_lane_rows2(LD)), vc = lp_smem_of(vs + lp_lane_cols(LD));
        // key blocks of 8 that any of its rows sees, and whether a key of them comes after a row (or past Tk)
        int hi = RING ? min(8, (lp_keys_upto(kpos, Tk, qpos[last]) - j0 + 7) / 8) : min(min(8, (r0 + WR - j0 + 7) / 8), (T - j0 + 7) / 8);
        int masked = RING ? j0 + 8 * hi > Tk || kpos[j0 + 8 * hi - 1] > qpos[r0] : j0 + 8 * hi - 1 > r0;
        float s[MT][8][4];
        if (hi == 8 && !masked) {  // a whole tile, most of them: with constant bounds the checks compile away
            lp_flash_abt<HP, 8, MT>(s, qf, kr, 0, 8);  // s = q k^T
#pragma unroll
            for (int mt = 0; mt < MT; mt++) lp_flash_softmax<HP>(s[mt], m[mt], l[mt], o[mt], sl2);
            lp_flash_apb<HP, 8, MT>(o, s, vc, 0, 8);  // o += p v
            continue;
        }
        lp_flash_abt<HP, 8, MT>(s, qf, kr, 0, hi);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            lp_flash_mask<8, RING>(s[mt], qpos, kpos, r0 + 16 * mt, j0, T, Tk, 0);
            lp_flash_softmax<HP>(s[mt], m[mt], l[mt], o[mt], sl2);
        }
        lp_flash_apb<HP, 8, MT>(o, s, vc, 0, hi);
    }
    __syncthreads();  // every warp is done with the tiles; the first buffer now takes y
    if (r0 >= T || (RING && !seen)) return;
    floatX* ys = smem + (r0 - q0) * LD;  // the warp's own rows
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            l[mt][i] += __shfl_xor_sync(0xffffffffu, l[mt][i], 1);
            l[mt][i] += __shfl_xor_sync(0xffffffffu, l[mt][i], 2);
        }
        lp_flash_put<HP / 8>(ys + 16 * mt * LD, LD, o[mt], 1.0f / l[mt][0], 1.0f / l[mt][1]);
    }
    __syncwarp();
    lp_flash_store<HP>(out + (size_t)b * T * C + h * HS, C, ys, r0, T, HS, WR, lane, 32);
    for (int mt = 0; mt < MT; mt++)
        for (int i = 0; i < 2 && lane % 4 == 0; i++) {
            int t = r0 + 16 * mt + lane / 4 + 8 * i;
            if (t >= T) continue;
            if (RING) lse[(size_t)bh * T + t] = m[mt][i] * LP_LN2, rsum[(size_t)bh * T + t] = l[mt][i];
            else lse[(size_t)bh * T + t] = (m[mt][i] + log2f(l[mt][i])) * LP_LN2;
        }
}

// Backward, in FlashAttention-2's one pass per key tile, with D = rowsum(dy * y) per query row: for each
// query tile at or below the key tile's diagonal, five products: s = q k^T and dp = dy v^T (recomputed as
// their transposes, keys in the rows: p^T = exp(scale k q^T - lse)), ds = scale p (dp - D), then dv += p^T
// dy and dk += ds^T q, which the key tile's block sums over its query tiles in registers, and dq += ds k,
// whose contributions from a head's key tiles must meet. They meet without atomics, in a fixed order: a
// head's key tiles are dealt to `splits` blocks (tile j to block j mod splits, which walks its tiles in
// turn), each block adds its contributions into its own fp32 partial of the head's dq (its first key tile
// writes it), and a last kernel sums the partials in split order into dqkv (FlashAttention-2's
// deterministic mode keeps partials too). What that costs: the partials, splits x B NH T HS floats, and
// per (key tile, query tile) a read and a write of the query tile's 64 x HS fp32 partial beside its 2 x 64
// x HS bf16 of q and dy, then the last kernel's pass over the partials; splits is as small as reaching
// LP_FLASH_BLOCKS_WANTED blocks allows (1 for GPT-2 124M at B = 64: a block walks all 16 key tiles of a head).
// D for every query row, (B,NH,T) like lse, once before the tile kernel: `lanes` lanes a row (a power of
// 2, lp_flash_d_lanes), each over 8 channels at a time in one 16-byte load where the row allows, so that a
// warp sums 32 / lanes rows at once (one row a warp issued ~190 instructions for 64 channels).
static inline int lp_flash_d_lanes(int HS) {
    int lanes = 1;
    while (lanes < 32 && LP_PACK * lanes < HS) lanes *= 2;
    return lanes;
}
static __global__ void lp_flash_attention_backward_d_kernel(float* D, const floatX* dout, const floatX* out, int B, int T, int C, int NH,
                                                            int lanes) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, row = i / lanes;  // row: (b, h, t)
    int HS = C / NH;
    float dot = 0.0f;
    if (row < (size_t)B * NH * T) {  // (rows past the end still take part in the shuffles)
        int t = (int)(row % T), bh = (int)(row / T), b = bh / NH, h = bh % NH;
        size_t at = ((size_t)b * T + t) * C + (size_t)h * HS;
        for (int d = (int)(i % lanes) * LP_PACK; d < HS; d += lanes * LP_PACK) {
            LPPack dy = lp_load_pack(dout + at, d, HS), y = lp_load_pack(out + at, d, HS);
#pragma unroll
            for (int k = 0; k < LP_PACK; k++) dot += lp_bf(dy.x[k]) * lp_bf(y.x[k]);
        }
    }
    for (int o = lanes / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (row < (size_t)B * NH * T && i % lanes == 0) D[row] = dot;
}
// From s (scores) and dp of a tile: p = exp2(s scale log2(e) - lse log2(e)) and ds = scale p (dp - D) in
// their place, each element with its query's lse2 = lse log2(e) and D: per column from arrays (dk, dv) or
// per row, the lane's two (dq). A query past T has lse2 = +inf, so p = 0.
template <int NB>
static __device__ inline void lp_flash_grads(float s[NB][4], float dp[NB][4], const float* lse2, const float* D, int queries_in_cols,
                                             float sl2, float scale) {
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < NB; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int q = queries_in_cols ? 8 * j + 2 * (lane % 4) + e % 2 : e / 2;
            float p = lp_exp2(fmaf(s[j][e], sl2, -lse2[q]));
            s[j][e] = p;
            dp[j][e] = scale * p * (dp[j][e] - D[q]);
        }
}
// The backward's blocks per (b, K/V head): at least LP_FLASH_BLOCKS_WANTED in all where the key tiles allow
// (about two rounds of an H100's 132 SMs at 2 blocks each); and the floats of their dq partials, one per query
// head, for any number of K/V heads up to B KV (a TP rank's share too): splits x K/V heads is at most both of
// these bounds, each K/V head's block keeping NH / KV partials.
#define LP_FLASH_BLOCKS_WANTED 512
static inline int lp_flash_splits(int heads, int T) {
    int tiles = (T + LP_FLASH_ROWS - 1) / LP_FLASH_ROWS, s = LP_FLASH_BLOCKS_WANTED / heads;
    return s < 1 ? 1 : s > tiles ? tiles : s;
}
static inline size_t lp_flash_dq_partial_floats(int B, int T, int Tk, int C, int NH, int KV) {  // T queries, Tk keys
    size_t heads = (size_t)B * KV, tiles = (Tk + LP_FLASH_ROWS - 1) / LP_FLASH_ROWS;
    size_t blocks = heads > LP_FLASH_BLOCKS_WANTED ? heads : LP_FLASH_BLOCKS_WANTED;
    if (tiles * heads < blocks) blocks = tiles * heads;
    return blocks * (NH / KV) * T * (C / NH);
}
// Query tile i0.. into a buffer of the backward: q and dy (R,HP) by cp.async (the caller commits), and the
// rows' lse2 = lse log2(e) (+inf past T, so that p = 0 there) and D by the first R threads.
template <int HP>
static __device__ inline void lp_flash_load_queries(floatX* qs, float* stats, const floatX* src, const floatX* dsrc, const float* lse,
                                                    const float* D, int bh, int i0, int T, int C, int W, int HS) {
    const int R = LP_FLASH_ROWS;
    lp_flash_load<HP, R, LP_FLASH_THREADS>(qs, src, W, i0, T, HS, threadIdx.x);
    lp_flash_load<HP, R, LP_FLASH_THREADS>(qs + R * (HP + 8), dsrc, C, i0, T, HS, threadIdx.x);
    if (threadIdx.x < R) {
        int t = i0 + threadIdx.x;
        stats[threadIdx.x] = t < T ? lse[(size_t)bh * T + t] * LP_LOG2E : INFINITY;
        stats[R + threadIdx.x] = t < T ? D[(size_t)bh * T + t] : 0.0f;
    }
}
// A block walks its key tiles; for each, warps own 16 keys each for dk and dv (k and v as A fragments,
// dk and dv in registers) and 16 queries each of every query tile for dq. The query tiles (q, dy, lse2, D)
// stream through two buffers, the next in flight while this one computes; ds^T goes from the key-owning
// warps to the query-owning ones through shared memory, where ldmatrix's transposing load reads it back as
// dS's A fragments. Blocks run along x, (b, K/V head) along y (up to 65535). Grouped-query attention: a
// block's key tile is its K/V head's, and it walks the query tiles of each of the head's group of NH / KV
// query heads in turn, so dk and dv sum over the group in registers (K and V read once, not copied) and each
// query head's dq goes to its own partial.
// A ring block (RING 1, lp_attention_block_backward_gpu): the Tk keys and values from kv (rows of 2 KV HS),
// the positions qpos and kpos, and dk and dv added onto dkv (laid out as kv). A key tile's queries are then
// those from the first that sees its first key (no key tile: none), and a tile pair is masked where some
// query of it comes before some key.
template <int HP, int RING>
static __global__ void __launch_bounds__(LP_FLASH_THREADS, LP_FLASH_BWD_BLOCKS(HP))
    lp_flash_attention_backward_kernel(floatX* dqkv, floatX* dkv, float* dq_partials, const floatX* dout, const float* D,
                                       const floatX* qkv, const floatX* kv, const int* qpos, const int* kpos, const float* lse, int T,
                                       int Tk, int C, int NH, int KV, float scale) {
    const int LD = HP + 8, R = LP_FLASH_ROWS, LDS = R + 8;  // LDS: the pitch of ds^T (keys, queries)
    const int NB = HP > 64 ? 2 : 4, NQ = HP / 8 > 4 ? 4 : HP / 8;  // query blocks of 8, and dq's columns of 8, per pass: registers
    if (!RING) Tk = T;
    int HS = C / NH, W = C + 2 * KV * HS, KW = RING ? 2 * KV * HS : W, G = NH / KV, b = blockIdx.y / KV, bh0 = blockIdx.y * G;  // bh0: the group's first query head
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tiles = (Tk + R - 1) / R, qtiles = (T + R - 1) / R;
    LP_SHARED(floatX, smem);  // buffer u (0, 1): q at smem + 2 R LD u, dy R LD further; then k, ds^T, lse2 and D per buffer
    floatX *ks = smem + 4 * R * LD, *dss = ks + R * LD;
    float* stats = (float*)(dss + R * LDS);
    // the group's first query head's q and dy (head g: g HS further) and K/V head's k (v: KV HS further)
    const floatX *src = qkv + (size_t)b * T * W + (bh0 % NH) * HS, *dsrc = dout + (size_t)b * T * C + (bh0 % NH) * HS;
    size_t kat = (RING ? (size_t)b * Tk * KW : (size_t)b * T * W + C) + blockIdx.y % KV * HS;  // in kv (qkv) and dkv (dqkv)
    const floatX* ksrc = (RING ? kv : qkv) + kat;
    float* part = dq_partials + ((size_t)blockIdx.x * gridDim.y * G + bh0) * T * HS;  // the block's dq partial of head bh0 (g: g T HS further)
    float sl2 = scale * LP_LOG2E;
    lp_smem dsa = lp_smem_of(dss + lp_lane_rows2(LDS) + 16 * warp), kc = lp_smem_of(ks + lp_lane_cols(LD));
    for (int j = blockIdx.x; j < tiles; j += gridDim.x) {  // the block's key tiles
        int k0 = j * R, c0 = k0 + 16 * warp;                // the tile's and the warp's first key
        int first = RING ? lp_keys_upto(qpos, T, kpos[k0] - 1) : k0;  // the first query that sees key k0
        if (RING && first == T) break;                      // (nor any later key tile)
        int i_first = first / R, klast = lp_flash_pos<RING>(kpos, min(k0 + R, Tk) - 1);
        __syncthreads();                                    // the last key tile's readers are done
        lp_flash_load<HP, R, LP_FLASH_THREADS>(ks, ksrc, KW, k0, Tk, HS, threadIdx.x);
        lp_flash_load<HP, R, LP_FLASH_THREADS>(smem + 2 * R * LD, ksrc + KV * HS, KW, k0, Tk, HS, threadIdx.x);  // v, staged in buffer 1
        lp_cp_async_commit();
        lp_flash_load_queries<HP>(smem, stats, src, dsrc, lse, D, bh0, i_first * R, T, C, W, HS);  // the first head's first query tile
        lp_cp_async_commit();
        lp_cp_async_wait<1>();  // k and v have landed ...
        __syncthreads();        // ... every thread's
        uint32_t kf[HP / 16][4], vf[HP / 16][4];  // k's fragments are reloaded for every pass at HP 128 (registers)
#pragma unroll
        for (int k = 0; k < HP / 16; k++) {
            if (HP <= 64) lp_frag_a(kf[k], lp_smem_at(kc, 16 * warp * LD + 16 * k));
            lp_frag_a(vf[k], lp_smem_of(smem + 2 * R * LD + 16 * warp * LD + lp_lane_cols(LD) + 16 * k));
        }
        float dk[HP / 8][4] = {}, dv[HP / 8][4] = {};
        int span = qtiles - i_first, steps = G * span;
        for (int step = 0; step < steps; step++) {  // the group's query heads g in turn, each's query tiles i from the diagonal down
            int g = step / span, i = i_first + step % span, i0 = i * R, u = step % 2;
            int diag = RING ? lp_flash_pos<RING>(qpos, i0) < klast : i == j;  // a query before a key: masked
            __syncthreads();  // every warp is done with the other buffer (v, or the last query tile) and with ds^T
            if (step + 1 < steps) {
                int g1 = (step + 1) / span, i1 = i_first + (step + 1) % span;
                lp_flash_load_queries<HP>(smem + 2 * R * LD * (1 - u), stats + 2 * R * (1 - u), src + g1 * HS, dsrc + g1 * HS, lse, D, bh0 + g1,
                                          i1 * R, T, C, W, HS);
            }
            lp_cp_async_commit();   // (an empty group after the last tile, so that one wait fits every tile)
            lp_cp_async_wait<1>();  // this thread's part of query tile i has landed ...
            __syncthreads();        // ... and every thread's
            const floatX *qs = smem + 2 * R * LD * u, *dys = qs + R * LD;
            const float *ls = stats + 2 * R * u, *Ds = ls + R;
            lp_smem qr = lp_smem_of(qs + lp_lane_rows2(LD)), qc = lp_smem_of(qs + lp_lane_cols(LD));
            lp_smem dyr = lp_smem_of(dys + lp_lane_rows2(LD)), dyc = lp_smem_of(dys + lp_lane_cols(LD));
            // dk, dv and ds^T by the warp's keys: query blocks of 8 that see a key (from the pair of blocks that
            // holds the first query seeing the warp's first key), none for keys past Tk
            int lo = !diag ? 0 : RING ? (min(max(lp_keys_upto(qpos, T, kpos[min(c0, Tk - 1)] - 1) - i0, 0), R) / 8) & ~1 : 2 * warp;
            int hi = c0 < Tk ? min(8, (T - i0 + 7) / 8) : 0;
#pragma unroll
            for (int c = 0; c < 8; c += NB) {  // the tile's query blocks c .. c + NB - 1
                int at = 8 * c * LD;          // the pass's first query row
                float s[NB][4], dp[NB][4];
#pragma unroll
                for (int k = 0; k < HP / 16 && HP > 64; k++) lp_frag_a(kf[k], lp_smem_at(kc, 16 * warp * LD + 16 * k));
                if (hi == 8 && !diag) {  // a whole tile, most of them: with constant bounds the checks compile away
                    lp_flash_abt<HP, NB, 1>(&s, &kf, lp_smem_at(qr, at), 0, NB);    // s^T = k q^T
                    lp_flash_abt<HP, NB, 1>(&dp, &vf, lp_smem_at(dyr, at), 0, NB);  // dp^T = v dy^T
                    lp_flash_grads<NB>(s, dp, ls + 8 * c, Ds + 8 * c, 1, sl2, scale);
                    lp_flash_apb<HP, NB, 1>(&dv, &s, lp_smem_at(dyc, at), 0, NB);  // dv += p^T dy
                    lp_flash_apb<HP, NB, 1>(&dk, &dp, lp_smem_at(qc, at), 0, NB);  // dk += ds^T q
                } else if (hi <= c || lo >= c + NB) {  // no query of the pass sees the warp's keys: ds = 0
#pragma unroll
                    for (int q = 0; q < NB; q++) dp[q][0] = dp[q][1] = dp[q][2] = dp[q][3] = 0.0f;
                } else {
                    lp_flash_abt<HP, NB, 1>(&s, &kf, lp_smem_at(qr, at), lo - c, hi - c);
                    lp_flash_abt<HP, NB, 1>(&dp, &vf, lp_smem_at(dyr, at), lo - c, hi - c);
                    if (diag) lp_flash_mask<NB, RING>(s, qpos, kpos, i0 + 8 * c, c0, T, Tk, 1);  // (blocks before lo too: their ds is 0)
                    lp_flash_grads<NB>(s, dp, ls + 8 * c, Ds + 8 * c, 1, sl2, scale);
                    lp_flash_apb<HP, NB, 1>(&dv, &s, lp_smem_at(dyc, at), lo - c, hi - c);
                    lp_flash_apb<HP, NB, 1>(&dk, &dp, lp_smem_at(qc, at), lo - c, hi - c);
                }
                lp_flash_put<NB>(dss + 16 * warp * LDS + 8 * c, LDS, dp, 1.0f, 1.0f);  // ds^T, every query of the pass
            }
            __syncthreads();  // ds^T is whole
            // dq += ds k by the warp's queries, HP / 8 / NQ passes of NQ column blocks, added to the partial
            int r0 = i0 + 16 * warp;
            if (r0 >= T) continue;
#pragma unroll
            for (int n0 = 0; n0 < HP / 8; n0 += NQ) {
                float dq[NQ][4] = {};
#pragma unroll
                for (int k = 0; k < 4; k++) {  // keys 16k .. 16k + 15
                    if (diag && (RING ? k0 + 16 * k >= Tk || kpos[k0 + 16 * k] > qpos[min(r0 + 15, T - 1)] : k > warp)) break;  // keys after every query of the warp: ds = 0
                    uint32_t a[4];
                    lp_ldmatrix(a, lp_smem_at(dsa, 16 * k * LDS), 1);  // ds (16 queries, 16 keys) from ds^T
#pragma unroll
                    for (int n = 0; n < NQ; n += 2) {
                        uint32_t bk[2][2];
                        lp_frag_cols(bk, lp_smem_at(kc, 16 * k * LD + 8 * (n0 + n)));
                        lp_mma(dq[n], a, bk[0], dq[n]);
                        lp_mma(dq[n + 1], a, bk[1], dq[n + 1]);
                    }
                }
#pragma unroll
                for (int n = 0; n < NQ; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int t = r0 + lane / 4 + 8 * (e / 2), d = 8 * (n0 + n) + 2 * (lane % 4) + e % 2;
                        if (t >= T || d >= HS) continue;
                        float* p = part + ((size_t)g * T + t) * HS + d;
                        *p = j == (int)blockIdx.x ? dq[n][e] : *p + dq[n][e];  // the block's first key tile writes
                    }
            }
        }
        __syncthreads();  // every warp is done with the tiles; buffer 0 takes dk and dv
        if (c0 >= Tk) continue;
        floatX *dks = smem + 16 * warp * LD, *dvs = dks + R * LD;
        floatX* dst = (RING ? dkv : dqkv) + kat;  // the K/V head's dk (dv: KV HS further)
        if (RING) {  // onto the block's gradient so far, in fp32: one rounding a block
            lp_flash_get<HP / 8>(dk, dst + (size_t)c0 * KW, KW, Tk - c0, HS, 1.0f, 1.0f);
            lp_flash_get<HP / 8>(dv, dst + (size_t)c0 * KW + KV * HS, KW, Tk - c0, HS, 1.0f, 1.0f);
        }
        lp_flash_put<HP / 8>(dks, LD, dk, 1.0f, 1.0f);
        lp_flash_put<HP / 8>(dvs, LD, dv, 1.0f, 1.0f);
        __syncwarp();
        lp_flash_store<HP>(dst, KW, dks, c0, Tk, HS, 16, lane, 32);
        lp_flash_store<HP>(dst + KV * HS, KW, dvs, c0, Tk, HS, 16, lane, 32);
    }
}
// dq = the splits' partials summed in split order (those of the splits that reached the row's query tile:
// split s's first key tile is s, which reaches the tiles from the first query that sees its first key), as
// bf16 into dqkv (a ring block: added onto it); a thread per value of (B,NH,T,HS).
template <int RING>
static __global__ void lp_flash_attention_backward_dq_kernel(floatX* dqkv, const float* dq_partials, const int* qpos, const int* kpos,
                                                             int B, int T, int Tk, int C, int NH, int KV, int splits) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, n = (size_t)B * T * C;
    if (i >= n) return;
    int HS = C / NH, d = (int)(i % HS), t = (int)(i / HS % T), bh = (int)(i / HS / T), b = bh / NH, h = bh % NH, R = LP_FLASH_ROWS;
    int tile_last = lp_flash_pos<RING>(qpos, min(t / R * R + R, T) - 1);  // the row's query tile's last position
    float sum = 0.0f;
    for (int s = 0; s < splits && s * R < Tk && lp_flash_pos<RING>(kpos, s * R) <= tile_last; s++) sum += dq_partials[(size_t)s * n + i];
    floatX* g = dqkv + ((size_t)b * T + t) * (C + 2 * KV * HS) + h * HS + d;
    *g = lp_xf(RING ? lp_bf(*g) + sum : sum);
}

// Launches for one HP, one sequence's causal attention (kv NULL) or a ring block (RING 1). The forward: its
// query tiles of 64 MT rows along x, the (b,h) along y (up to 65535 of them); two buffers of a k and a v
// tile, above the 48 KiB a kernel gets unasked at HP 128. The backward: splits along x, the (b, K/V head)
// along y; two buffers of a query tile, the key tile and ds^T.
template <int HP>
static inline void lp_flash_forward_hp(floatX* out, float* lse, float* rsum, const floatX* qkv, const floatX* kv, const int* qpos,
                                       const int* kpos, int B, int T, int Tk, int C, int NH, int KV, int first) {
    const int rows = 4 * 16 * LP_FLASH_MT(HP);
    if (B * NH > 65535) lp_fail("flash attention: B * NH = %d heads, more than the grid's 65535", B * NH);
    dim3 grid((T + rows - 1) / rows, B * NH);
    size_t bytes = 4 * LP_FLASH_ROWS * (HP + 8) * sizeof(floatX);
    float scale = lp_attention_scale(C, NH);
    static int opted_in;
    if (!opted_in) {
        cudaCheck(cudaFuncSetAttribute(lp_flash_attention_forward_kernel<HP, 0>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
        cudaCheck(cudaFuncSetAttribute(lp_flash_attention_forward_kernel<HP, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    }
    opted_in = 1;
    if (kv)
        LP_LAUNCH((lp_flash_attention_forward_kernel<HP, 1>), grid, LP_FLASH_THREADS, bytes, out, lse, rsum, qkv, kv, qpos, kpos, T, Tk, C,
                  NH, KV, first, scale);
    else
        LP_LAUNCH((lp_flash_attention_forward_kernel<HP, 0>), grid, LP_FLASH_THREADS, bytes, out, lse, rsum, qkv, kv, qpos, kpos, T, Tk, C,
                  NH, KV, first, scale);
}
template <int HP>
static inline void lp_flash_backward_hp(floatX* dqkv, floatX* dkv, float* dq_partials, const floatX* dout, const float* D, const floatX* qkv,
                                        const floatX* kv, const int* qpos, const int* kpos, const float* lse, int B, int T, int Tk, int C,
                                        int NH, int KV) {
    const int R = LP_FLASH_ROWS;
    if (B * KV > 65535) lp_fail("flash attention: B * KV = %d K/V heads, more than the grid's 65535", B * KV);
    int splits = lp_flash_splits(B * KV, Tk);
    size_t bytes = (5 * R * (HP + 8) + R * (R + 8)) * sizeof(floatX) + 4 * R * sizeof(float), n = (size_t)B * T * C;
    float scale = lp_attention_scale(C, NH);
    static int opted_in;
    if (!opted_in) {
        cudaCheck(cudaFuncSetAttribute(lp_flash_attention_backward_kernel<HP, 0>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
        cudaCheck(cudaFuncSetAttribute(lp_flash_attention_backward_kernel<HP, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    }
    opted_in = 1;
    if (kv) {
        LP_LAUNCH((lp_flash_attention_backward_kernel<HP, 1>), dim3(splits, B * KV), LP_FLASH_THREADS, bytes, dqkv, dkv, dq_partials, dout, D,
                  qkv, kv, qpos, kpos, lse, T, Tk, C, NH, KV, scale);
        LP_LAUNCH(lp_flash_attention_backward_dq_kernel<1>, lp_grid(n, LP_THREADS), LP_THREADS, 0, dqkv, dq_partials, qpos, kpos, B, T, Tk,
                  C, NH, KV, splits);
    } else {
        LP_LAUNCH((lp_flash_attention_backward_kernel<HP, 0>), dim3(splits, B * KV), LP_FLASH_THREADS, bytes, dqkv, dkv, dq_partials, dout, D,
                  qkv, kv, qpos, kpos, lse, T, Tk, C, NH, KV, scale);
        LP_LAUNCH(lp_flash_attention_backward_dq_kernel<0>, lp_grid(n, LP_THREADS), LP_THREADS, 0, dqkv, dq_partials, qpos, kpos, B, T, Tk,
                  C, NH, KV, splits);
    }
}
// f<HP>(args) for the head size's padded width.
#define LP_FLASH_DISPATCH(HS, f, ...)                                                                              \
    switch (lp_flash_width(HS)) {                                                                                  \
    case 16: f<16>(__VA_ARGS__); break;                                                                            \
    case 32: f<32>(__VA_ARGS__); break;                                                                            \
    case 64: f<64>(__VA_ARGS__); break;                                                                            \
    case 128: f<128>(__VA_ARGS__); break;                                                                          \
    default: lp_fail("flash attention: head size %d is above the %d it supports", HS, LP_FLASH_MAX_HS);              \
    }

static inline void lp_flash_attention_forward_gpu(floatX* out, float* lse, const floatX* qkv, int B, int T, int C, int NH, int KV) {
    LP_FLASH_DISPATCH(C / NH, lp_flash_forward_hp, out, lse, NULL, qkv, NULL, NULL, NULL, B, T, T, C, NH, KV, 1);
}
// D = rowsum(dout out) per query row, then the tile kernel and the dq partials' sum. D and the partials share
// the reduction scratch (lp_scratch_reserve sizes it for the model's shapes).
static inline void lp_flash_backward_gpu(floatX* dqkv, floatX* dkv, const floatX* dout, const floatX* out, const float* lse, const floatX* qkv,
                                         const floatX* kv, const int* qpos, const int* kpos, int B, int T, int Tk, int C, int NH, int KV) {
    size_t rows = (size_t)B * NH * T;
    float* D = (float*)lp_scratch(&lp_partials, (rows + lp_flash_dq_partial_floats(B, T, Tk, C, NH, KV)) * sizeof(float), "reduction partials");
    int lanes = lp_flash_d_lanes(C / NH);
    LP_LAUNCH(lp_flash_attention_backward_d_kernel, lp_grid(rows * lanes, LP_THREADS), LP_THREADS, 0, D, dout, out, B, T, C, NH, lanes);
    LP_FLASH_DISPATCH(C / NH, lp_flash_backward_hp, dqkv, dkv, D + rows, dout, D, qkv, kv, qpos, kpos, lse, B, T, Tk, C, NH, KV);
}
// dqkv is overwritten; dout, out (the forward's y) and lse as the forward left them.
static inline void lp_flash_attention_backward_gpu(floatX* dqkv, const floatX* dout, const floatX* out, const floatX* qkv,
                                                   const float* lse, int B, int T, int C, int NH, int KV) {
    lp_flash_backward_gpu(dqkv, NULL, dout, out, lse, qkv, NULL, NULL, NULL, B, T, T, C, NH, KV);
}

// Context parallelism's block ops (lp_attention_block_forward_cpu and the rest) on the GPU: the flash kernels
// above with RING 1, their CPU loops' results at the flash tolerances. The forward merges a block into the rows'
// running output, max and sum in the kernel's registers (loaded at its start, stored at its end: one bf16
// rounding of the output a block, as the CPU loop's float output has none); the backward adds each block's dk
// and dv onto dkv and dq onto dqkv, the sums rounded to bf16 once a block.
static __global__ void lp_attention_kv_copy_kernel(floatX* kv, floatX* qkv, int N, int NH, int KV, int HS, int to_block) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, n = (size_t)2 * KV * HS;
    if (i >= (size_t)N * n) return;
    floatX* row = qkv + i / n * (NH + 2 * KV) * HS + (size_t)NH * HS + i % n;
    if (to_block) kv[i] = *row;
    else *row = kv[i];
}
static inline void lp_attention_kv_copy_gpu(floatX* kv, floatX* qkv, int B, int T, int NH, int KV, int HS, int to_block) {
    size_t n = (size_t)B * T * 2 * KV * HS;
    LP_LAUNCH(lp_attention_kv_copy_kernel, lp_grid(n, LP_THREADS), LP_THREADS, 0, kv, qkv, B * T, NH, KV, HS, to_block);
}
static inline void lp_attention_block_forward_gpu(floatX* out, float* rmax, float* rsum, const floatX* qkv, const floatX* kv,
                                                  const int* qpos, const int* kpos, int B, int T, int Tk, int C, int NH, int KV,
                                                  int first) {
    LP_FLASH_DISPATCH(C / NH, lp_flash_forward_hp, out, rmax, rsum, qkv, kv, qpos, kpos, B, T, Tk, C, NH, KV, first);
}
static __global__ void lp_attention_block_end_kernel(float* rmax, const float* rsum, int rows) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows) rmax[r] += logf(rsum[r]);
}
static inline void lp_attention_block_end_gpu(float* rmax, const float* rsum, int rows) {
    LP_LAUNCH(lp_attention_block_end_kernel, lp_grid(rows, LP_THREADS), LP_THREADS, 0, rmax, rsum, rows);
}
static inline void lp_attention_block_backward_gpu(floatX* dqkv, floatX* dkv, const floatX* dout, const floatX* out, const float* lse,
                                                   const floatX* qkv, const floatX* kv, const int* qpos, const int* kpos, int B,
                                                   int T, int Tk, int C, int NH, int KV) {
    lp_flash_backward_gpu(dqkv, dkv, dout, out, lse, qkv, kv, qpos, kpos, B, T, Tk, C, NH, KV);
}
#endif  // LLMPAR_IMPLEMENTATION
#endif

// --- mixture of experts: a MoE layer (section 9) routes each token to k of its E experts. Here the router's
// softmax and top-k, the rows moved into expert order and back, the gated sum of the experts' outputs, and
// their backwards. Routing runs in fp32 on either build; every sum runs in a fixed order (no atomics).

#ifdef LLMPAR_IMPLEMENTATION
// Token t's routing, from its E router logits (in probs on entry): their softmax into probs, its logsumexp
// (the z-loss's), its k experts of highest probability (ties to the lower index), best first, and their
// gates: the probabilities renormalised to sum 1 for k >= 2 (GShard, Mixtral), the probability itself for
// k = 1 (Switch: with a gate of 1 the router would learn from the balance loss alone).
static inline LP_HD void lp_moe_route_row(float* probs, float* lse, int* expert, float* gate, int E, int K) {
    float mx = -INFINITY, sum = 0.0f, chosen = 0.0f;
    for (int e = 0; e < E; e++) mx = fmaxf(mx, probs[e]);
    for (int e = 0; e < E; e++) {
        probs[e] = expf(probs[e] - mx);
        sum += probs[e];
    }
    for (int e = 0; e < E; e++) probs[e] /= sum;
    *lse = mx + logf(sum);
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= expert[j] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        expert[k] = best;
        chosen += probs[best];
    }
    for (int k = 0; k < K; k++) gate[k] = K == 1 ? probs[expert[k]] : probs[expert[k]] / chosen;
}
static inline void lp_moe_route_cpu(float* probs, float* lse, int* expert, float* gate, const float* logits, int N, int E, int K) {
#pragma omp parallel for
    for (int t = 0; t < N; t++) {
        float* p = probs + (size_t)t * E;
        for (int e = 0; e < E; e++) p[e] = logits[(size_t)t * E + e];
        lp_moe_route_row(p, lse + t, expert + (size_t)t * K, gate + (size_t)t * K, E, K);
    }
}

// The balance and z-losses' statistics: sums[e] = the probabilities of expert e summed over the N tokens,
// sums[E] = the tokens' squared logsumexps summed. In the order the GPU's two passes sum (so both builds give
// the same bits): chunks of LP_MOE_STATS_ROWS tokens, each 8 running sums over its tokens in turn added in
// order; then 8 running sums over the chunks in turn, added in order.
#define LP_MOE_STATS_ROWS 256
static inline void lp_moe_stats_cpu(float* sums, const float* probs, const float* lse, int N, int E) {
#pragma omp parallel for
    for (int e = 0; e <= E; e++) {
        float total[8] = {0.0f};
        for (int p = 0, t0 = 0; t0 < N; p++, t0 += LP_MOE_STATS_ROWS) {
            float part[8] = {0.0f}, chunk = 0.0f;
            for (int t = t0; t < N && t < t0 + LP_MOE_STATS_ROWS; t++) part[(t - t0) % 8] += e < E ? probs[(size_t)t * E + e] : lse[t] * lse[t];
            for (int y = 0; y < 8; y++) chunk += part[y];
            total[p % 8] += chunk;
        }
        float s = 0.0f;
        for (int y = 0; y < 8; y++) s += total[y];
        sums[e] = s;
    }
}

// The dispatch of N tokens' K choices each (expert, (N,K)) into expert order: expert e takes at most cap of
// the rows that chose it, first come first served in token order; the others are dropped. Writes the
// layer's routes (its E+1 row offsets, expert e's rows [offsets[e], offsets[e + 1]), then the E counts before
// dropping, then room for lp_moe_stats' E+1 sums: so the host gets all three in one copy), each choice's row
// pos (-1: dropped) and each row's token src.
static inline LP_HD int* lp_moe_counts(int* routes, int E) { return routes + E + 1; }
static inline LP_HD float* lp_moe_sums(int* routes, int E) { return (float*)(routes + 2 * E + 1); }  // (lp_moe_stats' E+1)
static inline size_t lp_moe_dispatch_ints(int E) { return 3 * (size_t)E + 2; }
static inline void lp_moe_dispatch_cpu(int* pos, int* src, int* routes, const int* expert, int N, int E, int K, int cap) {
    int *offsets = routes, *counts = lp_moe_counts(routes, E), taken[LP_MAX_EXPERTS] = {0};
    memset(counts, 0, (size_t)E * sizeof(int));
    for (int i = 0; i < N * K; i++) counts[expert[i]]++;
    offsets[0] = 0;
    for (int e = 0; e < E; e++) offsets[e + 1] = offsets[e] + (counts[e] < cap ? counts[e] : cap);
    for (int i = 0; i < N * K; i++) {
        int e = expert[i];
        pos[i] = taken[e] < offsets[e + 1] - offsets[e] ? offsets[e] + taken[e]++ : -1;
        if (pos[i] >= 0) src[pos[i]] = i / K;
    }
}

// Expert parallelism's order of the R rows a rank receives (sender by sender, each sender's in its expert
// order) among its experts' rows (expert by expert, each expert's sender by sender): the received rows come
// in `groups` runs (sender r, local expert j: r * El + j), run g beginning at plan[g] among those received
// and at plan[groups + g] among the experts' (lp_moe_exchange_plan). order[k]: the received row that is
// the experts' row k; inv, the reverse.
static inline LP_HD int lp_moe_run_of(const int* begin, int groups, int q) {  // the last run that begins at or before q
    int lo = 0, hi = groups - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (begin[mid] <= q) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}
static inline void lp_moe_exchange_order_cpu(int* order, int* inv, const int* plan, int groups, int R) {
#pragma omp parallel for
    for (int q = 0; q < R; q++) {
        int g = lp_moe_run_of(plan, groups, q), k = plan[groups + g] + q - plan[g];
        order[k] = q;
        inv[q] = k;
    }
}

// Rows into expert order: xp[j] = x[src[j]] for the M rows kept.
static inline void lp_moe_permute_cpu(float* xp, const float* x, const int* src, int M, int C) {
#pragma omp parallel for
    for (int j = 0; j < M; j++) memcpy(xp + (size_t)j * C, x + (size_t)src[j] * C, (size_t)C * sizeof(float));
}

// Rows back to their tokens, summed: y[t] = the sum over token t's kept choices k of w[t, k] * rows[pos[t, k]]
// (w NULL: 1; 0 when all were dropped), written, not added. With the gates it is the layer's output (a
// dropped token: the residual alone carries it); without, the permutation's backward (each token's
// gradient from its experts).
static inline void lp_moe_gather_sum_cpu(float* y, const float* rows, const int* pos, const float* w, int N, int K, int C) {
#pragma omp parallel for
    for (int t = 0; t < N; t++) {
        float* o = y + (size_t)t * C;
        for (int c = 0; c < C; c++) o[c] = 0.0f;
        for (int k = 0; k < K; k++)
            if (pos[t * K + k] >= 0)
                for (int c = 0; c < C; c++) o[c] += (w ? w[t * K + k] : 1.0f) * rows[(size_t)pos[t * K + k] * C + c];
    }
}
static inline void lp_moe_unpermute_cpu(float* dx, const float* dxp, const int* pos, int N, int K, int C) {
    lp_moe_gather_sum_cpu(dx, dxp, pos, NULL, N, K, C);
}
static inline void lp_moe_combine_cpu(float* y, const float* yp, const int* pos, const float* gate, int N, int K, int C) {
    lp_moe_gather_sum_cpu(y, yp, pos, gate, N, K, C);
}
// Its backward from dy: each kept row's gradient dyp[pos[t, k]] = gate[t, k] * dy[t], and each gate's
// dgate[t, k] = dy[t] . yp[pos[t, k]] (0 for a dropped choice).
static inline void lp_moe_combine_backward_cpu(float* dyp, float* dgate, const float* dy, const float* yp, const int* pos,
                                               const float* gate, int N, int K, int C) {
#pragma omp parallel for
    for (int t = 0; t < N; t++)
        for (int k = 0; k < K; k++) {
            int j = pos[t * K + k];
            float dot = 0.0f;
            for (int c = 0; c < C && j >= 0; c++) {
                dyp[(size_t)j * C + c] = gate[t * K + k] * dy[(size_t)t * C + c];
                dot += dy[(size_t)t * C + c] * yp[(size_t)j * C + c];
            }
            dgate[t * K + k] = dot;
        }
}

// The router's backward for token t, from its gates' gradients dgate (K; `parts` partial ones, each TP
// rank's, (N,K) apart, added in rank order): through the renormalisation (k >= 2) into the gradients of the
// chosen probabilities, coef[k] for probs[expert[k]]; returns sum_e probs[e] dp[e] over every probability's
// gradient dp, which also holds the balance loss's daux[e] (its coefficient times E times the share of the
// rows that chose e, weighted as the loss is). Then each logit's gradient is lp_moe_router_dlogit's:
// through the softmax, plus the z-loss's dz * 2 lse * probs[e].
static inline LP_HD float lp_moe_router_row(float* coef, const float* probs, const int* expert, const float* gate,
                                            const float* dgate, int parts, size_t stride, const float* daux, int E, int K) {
    float chosen = 0.0f, dot = 0.0f, s = 0.0f;
    for (int k = 0; k < K; k++) {
        coef[k] = 0.0f;
        for (int r = 0; r < parts; r++) coef[k] += dgate[r * stride + k];
        chosen += probs[expert[k]];
        dot += coef[k] * gate[k];
    }
    for (int k = 0; k < K; k++) coef[k] = K == 1 ? coef[k] : (coef[k] - dot) / chosen;
    for (int e = 0; e < E; e++) s += probs[e] * daux[e];
    for (int k = 0; k < K; k++) s += probs[expert[k]] * coef[k];
    return s;
}
static inline LP_HD float lp_moe_router_dlogit(int e, const float* coef, float s, const float* probs, float lse, const int* expert,
                                               const float* daux, float dz, int K) {
    float dp = daux[e];
    for (int k = 0; k < K; k++) dp += expert[k] == e ? coef[k] : 0.0f;
    return probs[e] * (dp - s) + dz * 2.0f * lse * probs[e];
}
// The balance loss's gradient of each expert's probability, daux[e] = its coefficient times E times the
// share of the K N rows that chose e (the routes' counts), weighted as the loss is (dloss).
static inline LP_HD float lp_moe_aux_grad_of(float coef, int E, int count, int N, int K, float dloss) {
    return coef * E * ((float)count / ((float)N * K)) * dloss;
}
static inline void lp_moe_aux_grad_cpu(float* daux, const int* routes, float coef, float dloss, int N, int E, int K) {
    for (int e = 0; e < E; e++) daux[e] = lp_moe_aux_grad_of(coef, E, routes[E + 1 + e], N, K, dloss);
}
static inline void lp_moe_router_backward_cpu(float* dlogits, const float* probs, const float* lse, const int* expert,
                                              const float* gate, const float* dgate, int parts, const float* daux, float dz,
                                              int N, int E, int K) {
#pragma omp parallel for
    for (int t = 0; t < N; t++) {
        float coef[LP_MAX_TOPK];
        const float *p = probs + (size_t)t * E;
        const int* x = expert + (size_t)t * K;
        float s = lp_moe_router_row(coef, p, x, gate + (size_t)t * K, dgate + (size_t)t * K, parts, (size_t)N * K, daux, E, K);
        for (int e = 0; e < E; e++) dlogits[(size_t)t * E + e] = lp_moe_router_dlogit(e, coef, s, p, lse[t], x, daux, dz, K);
    }
}
#endif  // LLMPAR_IMPLEMENTATION

#ifndef LLMPAR_CPU
#ifdef LLMPAR_IMPLEMENTATION
// The kernels: a thread per token for the routing and the router's backward, per (row, channel) for the
// moves and the gated sum; each sums in the CPU loop's order.
static __global__ void lp_moe_route_kernel(float* probs, float* lse, int* expert, float* gate, const floatX* logits, int N, int E,
                                           int K) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= N) return;
    float* p = probs + (size_t)t * E;
    for (int e = 0; e < E; e++) p[e] = lp_bf(logits[(size_t)t * E + e]);
    lp_moe_route_row(p, lse + t, expert + (size_t)t * K, gate + (size_t)t * K, E, K);
}
static inline void lp_moe_route_gpu(float* probs, float* lse, int* expert, float* gate, const floatX* logits, int N, int E, int K) {
    LP_LAUNCH(lp_moe_route_kernel, lp_grid(N, LP_THREADS), LP_THREADS, 0, probs, lse, expert, gate, logits, N, E, K);
}
// The statistics in two passes: blocks of (32, 8) threads, a column each 32 (of the E+1) and 8 running sums
// each over LP_MOE_STATS_ROWS tokens (a chunk) into partials (chunks, E+1); then the same over the chunks.
static __global__ void lp_moe_stats_kernel(float* partials, const float* probs, const float* lse, int N, int E) {
    __shared__ float part[8][32];
    int e = blockIdx.x * 32 + threadIdx.x, t0 = blockIdx.y * LP_MOE_STATS_ROWS, t1 = min(N, t0 + LP_MOE_STATS_ROWS);
    float s = 0.0f;
    for (int t = t0 + threadIdx.y; t < t1 && e <= E; t += 8) s += e < E ? probs[(size_t)t * E + e] : lse[t] * lse[t];
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y > 0 || e > E) return;
    s = 0.0f;
    for (int y = 0; y < 8; y++) s += part[y][threadIdx.x];
    partials[(size_t)blockIdx.y * (E + 1) + e] = s;
}
static __global__ void lp_moe_stats_sum_kernel(float* sums, const float* partials, int chunks, int n) {
    __shared__ float part[8][32];
    int c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    for (int p = threadIdx.y; p < chunks && c < n; p += 8) s += partials[(size_t)p * n + c];
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y > 0 || c >= n) return;
    s = 0.0f;
    for (int y = 0; y < 8; y++) s += part[y][threadIdx.x];
    sums[c] = s;
}
#endif  // LLMPAR_IMPLEMENTATION
// The scratch of the statistics' partial sums and the dispatch's counts per tile: at most so many bytes.
LP_STATE LPScratch lp_moe_scratch;
#define LP_MOE_TILE 256  // the dispatch's choices per block
#ifdef LLMPAR_IMPLEMENTATION
static inline size_t lp_moe_scratch_bytes(size_t N, int E, int K) { return lp_grid(N * K, LP_MOE_TILE) * ((size_t)E + 1) * 4; }
static inline void lp_moe_stats_gpu(float* sums, const float* probs, const float* lse, int N, int E) {
    int chunks = lp_grid(N, LP_MOE_STATS_ROWS);
    float* partials = (float*)lp_scratch(&lp_moe_scratch, lp_moe_scratch_bytes(N, E, 1), "expert statistics");
    LP_LAUNCH(lp_moe_stats_kernel, dim3(lp_grid(E + 1, 32), chunks), dim3(32, 8), 0, partials, probs, lse, N, E);
    LP_LAUNCH(lp_moe_stats_sum_kernel, lp_grid(E + 1, 32), dim3(32, 8), 0, sums, partials, chunks, E + 1);
}

// The dispatch, as a counting sort in four launches (no atomics, no host): each block of LP_MOE_TILE
// choices counts each expert's choices in it (tiles: (tiles, E)) and ranks each choice among its tile's of
// the same expert; a block per expert turns its column of counts into each tile's first rank (a prefix sum
// over the tiles) and its total; one block sums the kept rows (capacity) into the offsets; and each choice
// takes its row, or is dropped. So the rows of an expert stay in token order, as the CPU loop's.
// An exclusive prefix sum of v over the block's threads (a multiple of 32); *total: the block's sum.
static __device__ inline int lp_block_prefix_sum(int v, int* total) {
    __shared__ int warp_sums[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, x = v, before = 0;
    for (int d = 1; d < 32; d *= 2) {
        int y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
    }
    __syncthreads();  // the previous call's readers are done with warp_sums
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    *total = 0;
    for (int w = 0; w < (int)blockDim.x / 32; w++) {
        before += w < warp ? warp_sums[w] : 0;
        *total += warp_sums[w];
    }
    return before + x - v;
}
static __global__ void lp_moe_count_kernel(int* pos, int* tiles, const int* expert, int n, int E) {
    __shared__ int chosen[LP_MOE_TILE];
    int i = blockIdx.x * LP_MOE_TILE + threadIdx.x, len = min(LP_MOE_TILE, n - (int)blockIdx.x * LP_MOE_TILE);
    int e = i < n ? expert[i] : -1, before = 0, after = 0;
    int* count = tiles + (size_t)blockIdx.x * E;
    chosen[threadIdx.x] = e;
    for (int j = threadIdx.x; j < E; j += LP_MOE_TILE) count[j] = 0;
    __syncthreads();
    for (int j = 0; j < len; j++) {
        before += j < (int)threadIdx.x && chosen[j] == e;
        after += j > (int)threadIdx.x && chosen[j] == e;
    }
    if (i >= n) return;
    pos[i] = before;                       // its rank in the tile, until lp_moe_place_kernel
    if (after == 0) count[e] = before + 1;  // the tile's last choice of e counts them
}
static __global__ void lp_moe_scan_tiles_kernel(int* routes, int* tiles, int ntiles, int E) {
    int e = blockIdx.x, carry = 0;
    for (int i0 = 0; i0 < ntiles; i0 += blockDim.x) {
        int i = i0 + threadIdx.x, total, n = i < ntiles ? tiles[(size_t)i * E + e] : 0, before = lp_block_prefix_sum(n, &total);
        if (i < ntiles) tiles[(size_t)i * E + e] = carry + before;
        carry += total;
    }
    if (threadIdx.x == 0) lp_moe_counts(routes, E)[e] = carry;
}
static __global__ void lp_moe_offsets_kernel(int* routes, int E, int cap) {
    int e = threadIdx.x, total, kept = e < E ? min(lp_moe_counts(routes, E)[e], cap) : 0, before = lp_block_prefix_sum(kept, &total);
    if (e < E) routes[e] = before;
    if (e == 0) routes[E] = total;
}
static __global__ void lp_moe_place_kernel(int* pos, int* src, const int* routes, const int* tiles, const int* expert, int n, int E, int K) {
    int i = blockIdx.x * LP_MOE_TILE + threadIdx.x;
    if (i >= n) return;
    int e = expert[i], r = tiles[(size_t)blockIdx.x * E + e] + pos[i], kept = routes[e + 1] - routes[e];
    pos[i] = r < kept ? routes[e] + r : -1;
    if (r < kept) src[routes[e] + r] = i / K;
}
static inline void lp_moe_dispatch_gpu(int* pos, int* src, int* routes, const int* expert, int N, int E, int K, int cap) {
    int n = N * K, ntiles = lp_grid(n, LP_MOE_TILE);
    int* tiles = (int*)lp_scratch(&lp_moe_scratch, lp_moe_scratch_bytes(N, E, K), "expert dispatch");
    LP_LAUNCH(lp_moe_count_kernel, ntiles, LP_MOE_TILE, 0, pos, tiles, expert, n, E);
    LP_LAUNCH(lp_moe_scan_tiles_kernel, E, LP_THREADS, 0, routes, tiles, ntiles, E);
    LP_LAUNCH(lp_moe_offsets_kernel, 1, lp_grid(E, 32) * 32, 0, routes, E, cap);
    LP_LAUNCH(lp_moe_place_kernel, ntiles, LP_MOE_TILE, 0, pos, src, routes, tiles, expert, n, E, K);
}
static __global__ void lp_moe_exchange_order_kernel(int* order, int* inv, const int* plan, int groups, int R) {
    int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= R) return;
    int g = lp_moe_run_of(plan, groups, q), k = plan[groups + g] + q - plan[g];
    order[k] = q;
    inv[q] = k;
}
static inline void lp_moe_exchange_order_gpu(int* order, int* inv, const int* plan, int groups, int R) {
    if (R > 0) LP_LAUNCH(lp_moe_exchange_order_kernel, lp_grid(R, LP_THREADS), LP_THREADS, 0, order, inv, plan, groups, R);
}
static __global__ void lp_moe_permute_kernel(floatX* xp, const floatX* x, const int* src, int M, int C) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)M * C) return;
    xp[i] = x[(size_t)src[i / C] * C + i % C];
}
static inline void lp_moe_permute_gpu(floatX* xp, const floatX* x, const int* src, int M, int C) {
    if (M > 0) LP_LAUNCH(lp_moe_permute_kernel, lp_grid((size_t)M * C, LP_THREADS), LP_THREADS, 0, xp, x, src, M, C);
}
// lp_moe_gather_sum_cpu's, a thread per value.
static __global__ void lp_moe_gather_sum_kernel(floatX* y, const floatX* rows, const int* pos, const float* w, int N, int K, int C) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)N * C) return;
    size_t t = i / C, c = i % C;
    float s = 0.0f;
    for (int k = 0; k < K; k++)
        if (pos[t * K + k] >= 0) s += (w ? w[t * K + k] : 1.0f) * lp_bf(rows[(size_t)pos[t * K + k] * C + c]);
    y[i] = lp_xf(s);
}
static inline void lp_moe_unpermute_gpu(floatX* dx, const floatX* dxp, const int* pos, int N, int K, int C) {
    LP_LAUNCH(lp_moe_gather_sum_kernel, lp_grid((size_t)N * C, LP_THREADS), LP_THREADS, 0, dx, dxp, pos, (const float*)NULL, N, K, C);
}
static inline void lp_moe_combine_gpu(floatX* y, const floatX* yp, const int* pos, const float* gate, int N, int K, int C) {
    LP_LAUNCH(lp_moe_gather_sum_kernel, lp_grid((size_t)N * C, LP_THREADS), LP_THREADS, 0, y, yp, pos, gate, N, K, C);
}
// lp_moe_combine_backward_cpu's: a warp per 32 choices, their rows moved 32 channels at a time (a lane a
// channel: coalesced); each choice's dot product summed by its own lane, in channel order as the CPU loop's,
// from the products the warp leaves in shared memory.
#define LP_MOE_WARPS 4  // the combine backward's warps per block
static __global__ void lp_moe_combine_backward_kernel(floatX* dyp, float* dgate, const floatX* dy, const floatX* yp, const int* pos,
                                                      const float* gate, int N, int K, int C) {
    __shared__ float prod[LP_MOE_WARPS][32][33];  // (padded: a lane's row of 32 on 32 banks)
    __shared__ int rows[LP_MOE_WARPS][32];
    __shared__ float gates[LP_MOE_WARPS][32];
    int lane = threadIdx.x, w = threadIdx.y, i0 = (blockIdx.x * LP_MOE_WARPS + w) * 32, mine = i0 + lane;
    rows[w][lane] = mine < N * K ? pos[mine] : -1;
    gates[w][lane] = mine < N * K ? gate[mine] : 0.0f;
    __syncwarp();
    float dot = 0.0f;
    for (int c0 = 0; c0 < C; c0 += 32) {
        int c = c0 + lane;
        for (int r = 0; r < 32; r++) {
            int j = rows[w][r];
            if (j < 0 || c >= C) continue;
            float d = lp_bf(dy[(size_t)(i0 + r) / K * C + c]);
            dyp[(size_t)j * C + c] = lp_xf(gates[w][r] * d);
            prod[w][r][lane] = d * lp_bf(yp[(size_t)j * C + c]);
        }
        __syncwarp();
        for (int k = 0; k < 32 && c0 + k < C && rows[w][lane] >= 0; k++) dot += prod[w][lane][k];
        __syncwarp();
    }
    if (mine < N * K) dgate[mine] = dot;
}
static inline void lp_moe_combine_backward_gpu(floatX* dyp, float* dgate, const floatX* dy, const floatX* yp, const int* pos,
                                               const float* gate, int N, int K, int C) {
    LP_LAUNCH(lp_moe_combine_backward_kernel, lp_grid((size_t)N * K, 32 * LP_MOE_WARPS), dim3(32, LP_MOE_WARPS), 0, dyp, dgate, dy, yp, pos,
              gate, N, K, C);
}
static __global__ void lp_moe_aux_grad_kernel(float* daux, const int* routes, float coef, float dloss, int N, int E, int K) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < E) daux[e] = lp_moe_aux_grad_of(coef, E, routes[E + 1 + e], N, K, dloss);
}
static inline void lp_moe_aux_grad_gpu(float* daux, const int* routes, float coef, float dloss, int N, int E, int K) {
    LP_LAUNCH(lp_moe_aux_grad_kernel, lp_grid(E, LP_THREADS), LP_THREADS, 0, daux, routes, coef, dloss, N, E, K);
}
static __global__ void lp_moe_router_backward_kernel(floatX* dlogits, const float* probs, const float* lse, const int* expert,
                                                     const float* gate, const float* dgate, int parts, const float* daux, float dz,
                                                     int N, int E, int K) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= N) return;
    float coef[LP_MAX_TOPK];
    const float* p = probs + (size_t)t * E;
    const int* x = expert + (size_t)t * K;
    float s = lp_moe_router_row(coef, p, x, gate + (size_t)t * K, dgate + (size_t)t * K, parts, (size_t)N * K, daux, E, K);
    for (int e = 0; e < E; e++) dlogits[(size_t)t * E + e] = lp_xf(lp_moe_router_dlogit(e, coef, s, p, lse[t], x, daux, dz, K));
}
static inline void lp_moe_router_backward_gpu(floatX* dlogits, const float* probs, const float* lse, const int* expert,
                                              const float* gate, const float* dgate, int parts, const float* daux, float dz,
                                              int N, int E, int K) {
    LP_LAUNCH(lp_moe_router_backward_kernel, lp_grid(N, LP_THREADS), LP_THREADS, 0, dlogits, probs, lse, expert, gate, dgate, parts,
              daux, dz, N, E, K);
}
#endif  // LLMPAR_IMPLEMENTATION
#endif

#ifdef LLMPAR_IMPLEMENTATION
// --- classifier (cross-entropy over the vocabulary), vocab-parallel: each rank holds the logits of its
// slice [v0, v0 + Vl) of the padded vocabulary, and the full row of logits is never gathered. Per row,
// classifier_stats writes this slice's (max, sum of exp(logit - max), target's logit or 0) over the real
// tokens (< V); the ranks' triples are all-gathered (t of them); classifier_grad combines them into the
// row's softmax normaliser, writes loss = log(sum) + max - target logit, and overwrites the logits with
// their gradient (softmax - onehot) * dloss (0 on the padding). Without TP (t = 1, v0 = 0) nothing crosses
// ranks and classifier_fused does both in one pass over the rows (the same arithmetic, the same bits).
static inline void lp_classifier_row_stats_cpu(float* stats, const float* row, int target, int real) {
    float maxv = -INFINITY, sum = 0.0f;
    // simd: a vector of partial maxima and sums (a fixed order, so still deterministic)
#pragma omp simd reduction(max : maxv)
    for (int v = 0; v < real; v++) maxv = row[v] > maxv ? row[v] : maxv;
#pragma omp simd reduction(+ : sum)
    for (int v = 0; v < real; v++) sum += lp_expf(row[v] - maxv);
    stats[0] = maxv;
    stats[1] = sum;
    stats[2] = target >= 0 && target < real ? row[target] : 0.0f;
}
static inline void lp_classifier_stats_cpu(float* stats, const float* logits, const int* targets, int N, int Vl, int v0, int V) {
    int real = V - v0 < Vl ? V - v0 : Vl;  // real tokens in the slice (may be none)
#pragma omp parallel for
    for (int i = 0; i < N; i++) lp_classifier_row_stats_cpu(stats + 3 * i, logits + (size_t)i * Vl, targets[i] - v0, real);
}

// The softmax normaliser of row i from the t slices' stats (t, N, 3): max and sum over the whole row.
static inline LP_HD void lp_classifier_combine(const float* stats, int t, int N, int i, float* maxv, float* sum, float* target) {
    float m = -INFINITY, s = 0.0f, x = 0.0f;
    for (int k = 0; k < t; k++) m = fmaxf(m, stats[3 * ((size_t)k * N + i)]);
    for (int k = 0; k < t; k++) {
        const float* st = stats + 3 * ((size_t)k * N + i);
        if (st[1] > 0.0f) s += st[1] * expf(st[0] - m);  // a slice without real tokens adds nothing
        x += st[2];
    }
    *maxv = m;
    *sum = s;
    *target = x;
}

// A row's loss, and its logits overwritten by their gradient, from the whole row's max, sum and target logit.
static inline void lp_classifier_row_grad_cpu(float* row, float* loss, float maxv, float sum, float target_logit, float dloss,
                                              int target, int Vl, int v0, int V) {
    *loss = logf(sum) + maxv - target_logit;
    for (int v = 0; v < Vl; v++)
        row[v] = v0 + v < V ? (lp_expf(row[v] - maxv) / sum - (v == target ? 1.0f : 0.0f)) * dloss : 0.0f;
}
static inline void lp_classifier_grad_cpu(float* logits, float* losses, const float* stats, int t, float dloss,
                                          const int* targets, int N, int Vl, int v0, int V) {
#pragma omp parallel for
    for (int i = 0; i < N; i++) {
        float maxv, sum, target_logit;
        lp_classifier_combine(stats, t, N, i, &maxv, &sum, &target_logit);
        lp_classifier_row_grad_cpu(logits + (size_t)i * Vl, losses + i, maxv, sum, target_logit, dloss, targets[i] - v0, Vl, v0, V);
    }
}

// t = 1: the whole padded row (N,Vp) with its V real tokens, both steps a row at a time.
static inline void lp_classifier_fused_cpu(float* logits, float* losses, float dloss, const int* targets, int N, int Vp, int V) {
#pragma omp parallel for
    for (int i = 0; i < N; i++) {
        float st[3], *row = logits + (size_t)i * Vp;
        lp_classifier_row_stats_cpu(st, row, targets[i], V);
        lp_classifier_row_grad_cpu(row, losses + i, st[0], st[1], st[2], dloss, targets[i], Vp, 0, V);
    }
}

#ifndef LLMPAR_CPU
// One block per row. Stats: one read of the bf16 row, each thread keeping a running (max, sum) that the
// block then rescales to the common max and adds up. Grad: one more read and a write. exp as 2^x on the
// SFU (lp_exp2, as the flash kernels) and the running sum rescaled once a pack: a handful of instructions
// a value, so HBM sets their pace, not the issue slots (with expf and a rescale a value it did not).
// The fused kernel runs both on a row in one launch: its second read finds the row (~100 KB at GPT-2's
// vocabulary) still in L2, so HBM sees it read once and written once, as llm.c's fused classifier.
// Every thread gets the row's (max, sum); thread 0 reads the target's logit, before any thread can
// overwrite it.
static __device__ inline void lp_classifier_row_stats(const floatX* row, int target, int real, float* maxv_out, float* sum_out,
                                                      float* target_logit) {
    float maxv = -INFINITY, sum = 0.0f;  // sum of exp(x - maxv), as 2^(x log2(e) - maxv log2(e)) on the SFU
    for (int v = threadIdx.x * LP_PACK; v < real; v += blockDim.x * LP_PACK) {
        LPPack p = lp_load_pack(row, v, real);
        float x[LP_PACK], top = maxv;
#pragma unroll
        for (int k = 0; k < LP_PACK; k++) {
            x[k] = v + k < real ? lp_bf(p.x[k]) : -INFINITY;  // (a value past the vocabulary adds exp(-inf) = 0)
            top = fmaxf(top, x[k]);
        }
        if (top > maxv) {  // rescaled once a pack, not once a value
            sum *= lp_exp2((maxv - top) * LP_LOG2E);
            maxv = top;
        }
#pragma unroll
        for (int k = 0; k < LP_PACK; k++) sum += lp_exp2(fmaf(x[k], LP_LOG2E, -maxv * LP_LOG2E));
    }
    if (threadIdx.x == 0) *target_logit = target >= 0 && target < real ? lp_bf(row[target]) : 0.0f;
    float block_max = lp_block_reduce(maxv, 1);  // (its barriers order thread 0's read before any write)
    *sum_out = lp_block_reduce(sum > 0.0f ? sum * expf(maxv - block_max) : 0.0f, 0);
    *maxv_out = block_max;
}
static __device__ inline void lp_classifier_row_grad(floatX* row, float maxv, float sum, float dloss, int target, int Vl, int v0,
                                                     int V) {
    float scale = dloss / sum, m2 = maxv * LP_LOG2E;
    for (int v = threadIdx.x * LP_PACK; v < Vl; v += blockDim.x * LP_PACK) {
        LPPack p = lp_load_pack(row, v, Vl);
#pragma unroll
        for (int k = 0; k < LP_PACK; k++) {
            float g = lp_exp2(fmaf(lp_bf(p.x[k]), LP_LOG2E, -m2)) * scale - (v + k == target ? dloss : 0.0f);
            p.x[k] = lp_xf(v0 + v + k < V ? g : 0.0f);
        }
        lp_store_pack(row, v, Vl, p);
    }
}
static __global__ void lp_classifier_stats_kernel(float* stats, const floatX* logits, const int* targets, int Vl, int v0, int real) {
    float maxv, sum, target_logit = 0.0f;
    lp_classifier_row_stats(logits + (size_t)blockIdx.x * Vl, targets[blockIdx.x] - v0, real, &maxv, &sum, &target_logit);
    if (threadIdx.x == 0) {
        float* st = stats + 3 * (size_t)blockIdx.x;
        st[0] = maxv;
        st[1] = sum;
        st[2] = target_logit;
    }
}
static inline void lp_classifier_stats_gpu(float* stats, const floatX* logits, const int* targets, int N, int Vl, int v0, int V) {
    int real = V - v0 < Vl ? V - v0 : Vl;
    LP_LAUNCH(lp_classifier_stats_kernel, N, 1024, 0, stats, logits, targets, Vl, v0, real);
}
static __global__ void lp_classifier_grad_kernel(floatX* logits, float* losses, const float* stats, int t, float dloss,
                                                 const int* targets, int N, int Vl, int v0, int V) {
    int i = blockIdx.x;
    float maxv, sum, target_logit;
    lp_classifier_combine(stats, t, N, i, &maxv, &sum, &target_logit);
    if (threadIdx.x == 0) losses[i] = logf(sum) + maxv - target_logit;
    lp_classifier_row_grad(logits + (size_t)i * Vl, maxv, sum, dloss, targets[i] - v0, Vl, v0, V);
}
static inline void lp_classifier_grad_gpu(floatX* logits, float* losses, const float* stats, int t, float dloss,
                                          const int* targets, int N, int Vl, int v0, int V) {
    LP_LAUNCH(lp_classifier_grad_kernel, N, 1024, 0, logits, losses, stats, t, dloss, targets, N, Vl, v0, V);
}
static __global__ void lp_classifier_fused_kernel(floatX* logits, float* losses, float dloss, const int* targets, int Vp, int V) {
    floatX* row = logits + (size_t)blockIdx.x * Vp;
    int target = targets[blockIdx.x];
    float maxv, sum, target_logit = 0.0f;
    lp_classifier_row_stats(row, target, V, &maxv, &sum, &target_logit);
    // as classifier_combine over one slice: its sum times expf(0) = 1, so the same bits as the two launches
    if (threadIdx.x == 0) losses[blockIdx.x] = logf(sum) + maxv - target_logit;
    lp_classifier_row_grad(row, maxv, sum, dloss, target, Vp, 0, V);
}
static inline void lp_classifier_fused_gpu(floatX* logits, float* losses, float dloss, const int* targets, int N, int Vp, int V) {
    LP_LAUNCH(lp_classifier_fused_kernel, N, 1024, 0, logits, losses, dloss, targets, Vp, V);
}
#endif

// --- dst += scale * src (ZeRO-2 adds each micro-batch's reduced gradients into the rank's shard)
static inline void lp_add_scaled_cpu(float* dst, const float* src, size_t n, float scale) {
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) dst[i] += scale * src[i];
}
#ifndef LLMPAR_CPU
static __global__ void lp_add_scaled_kernel(floatX* dst, const floatX* src, size_t n, float scale) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * LP_PACK;
    if (i >= n) return;
    LPPack d = lp_load_pack(dst, i, n), s = lp_load_pack(src, i, n);
    for (int k = 0; k < LP_PACK; k++) d.x[k] = lp_xf(lp_bf(d.x[k]) + scale * lp_bf(s.x[k]));
    lp_store_pack(dst, i, n, d);
}
static inline void lp_add_scaled_gpu(floatX* dst, const floatX* src, size_t n, float scale) {
    if (n == 0) return;
    LP_LAUNCH(lp_add_scaled_kernel, lp_grid((n + LP_PACK - 1) / LP_PACK, LP_THREADS), LP_THREADS, 0, dst, src, n, scale);
}
#endif

// --- AdamW.
// One value's step, shared by the CPU loop, the kernel and the CUDA build's host update (--offload): the
// moments m and v move toward the (scaled) gradient g; returns the updated weight.
static inline LP_HD float lp_adamw_value(float g, float* m, float* v, float w, float lr, float beta1, float beta2,
                                         float beta1_corr, float beta2_corr, float eps, float weight_decay) {
    float mi = beta1 * *m + (1.0f - beta1) * g;
    float vi = beta2 * *v + (1.0f - beta2) * g * g;
    *m = mi;
    *v = vi;
    return w - lr * ((mi / beta1_corr) / (sqrtf(vi / beta2_corr) + eps) + weight_decay * w);
}

// AdamW on one tensor. master (fp32) is the truth; params are its copy in the compute type (the CUDA
// kernel rounds stochastically to bf16 or fp16, seeded per step and tensor). grads are scaled by grad_scale
// (global-norm clipping) before use. beta corrections are 1 - beta^t. On the CPU build params are the
// master weights themselves (LP_MASTER_COPY 0), so the loop writes master alone: storing to both would
// fail the compiler's overlap check at run time and send it down its scalar loop (twice as slow at 124M).
static inline void lp_adamw_cpu(float* params, float* master, const float* grads, float* m, float* v, size_t n,
                                float lr, float beta1, float beta2, float beta1_corr, float beta2_corr,
                                float eps, float weight_decay, float grad_scale, uint32_t seed) {
    (void)params;
    (void)seed;
#pragma omp parallel for
    for (size_t i = 0; i < n; i++)
        master[i] = lp_adamw_value(grads[i] * grad_scale, &m[i], &v[i], master[i], lr, beta1, beta2, beta1_corr, beta2_corr,
                                   eps, weight_decay);
}

#ifndef LLMPAR_CPU
// Stochastic rounding fp32 -> bf16: add 16 random bits below bf16's last mantissa bit, then truncate.
// The result rounds up with probability equal to the dropped fraction, so E[bf16] = fp32 and updates
// smaller than half a bf16 step still move the weights on average. fp16 (LLMPAR_FP16), whose subnormals
// below 2^-14 keep fewer mantissa bits than its normal numbers (so no fixed count of fp32 bits is dropped):
// x's neighbours toward and away from zero, the one away drawn with probability (x - lower) / (upper - lower),
// in steps of 2^-16 as bf16's; beyond fp16's largest, 65504 (toward zero), which it saturates at.
// Host and device: the CUDA build's host update (--offload) rounds as the kernel does.
static LP_HD inline floatX lp_stochastic_round(float x, uint32_t seed, size_t i) {
    uint32_t h = (uint32_t)i * 0x9E3779B1u ^ (uint32_t)(i >> 32) ^ seed;  // murmur3's finaliser as a hash
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
#ifdef LLMPAR_FP16
    floatX lo = __float2half_rz(x);
    float l = __half2float(lo);
    if (l == x) return lo;
    floatX up = __ushort_as_half((unsigned short)(__half_as_ushort(lo) + 1));  // (sign and magnitude: a step further from 0)
    float u = __half2float(up);
    return (float)(h & 0xFFFFu) < (x - l) / (u - l) * 65536.0f ? up : lo;
#else
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits = (bits + (h & 0xFFFFu)) & 0xFFFF0000u;
    memcpy(&x, &bits, 4);
    return __float2bfloat16_rz(x);
#endif
}
// A thread updates the 8 values [i, i + 8) with 128-bit loads and stores (LPPack, LPPackF); value i's
// stochastic rounding is drawn from index i of the launch, as the CPU loop of --offload draws it.
static __global__ void lp_adamw_kernel(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t n,
                                       float lr, float beta1, float beta2, float beta1_corr, float beta2_corr, float eps,
                                       float weight_decay, float grad_scale, uint32_t seed) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * LP_PACK;
    if (i >= n) return;
    LPPack g = lp_load_pack(grads, i, n), p;
    LPPackF w = lp_load_packf(master, i, n), mk = lp_load_packf(m, i, n), vk = lp_load_packf(v, i, n);
#pragma unroll
    for (int k = 0; k < LP_PACK; k++) {  // (values past n are zeros here, and not stored)
        w.x[k] = lp_adamw_value(lp_bf(g.x[k]) * grad_scale, &mk.x[k], &vk.x[k], w.x[k], lr, beta1, beta2, beta1_corr,
                                beta2_corr, eps, weight_decay);
        p.x[k] = lp_stochastic_round(w.x[k], seed, i + k);
    }
    lp_store_packf(master, i, n, w);
    lp_store_packf(m, i, n, mk);
    lp_store_packf(v, i, n, vk);
    lp_store_pack(params, i, n, p);
}
// The kernel on the CPU (OpenMP), for the CUDA build's --offload: master, m and v in host memory, params and
// grads host copies of bf16 values; i0 is the first value's index in the kernel's launch (the stochastic
// rounding's stream), so a tensor updated in pieces rounds as in one launch.
static inline void lp_adamw_host(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t n,
                                 size_t i0, float lr, float beta1, float beta2, float beta1_corr, float beta2_corr, float eps,
                                 float weight_decay, float grad_scale, uint32_t seed) {
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) {
        float w = lp_adamw_value(lp_bf(grads[i]) * grad_scale, &m[i], &v[i], master[i], lr, beta1, beta2, beta1_corr,
                                 beta2_corr, eps, weight_decay);
        master[i] = w;
        params[i] = lp_stochastic_round(w, seed, i0 + i);
    }
}
// The compute-type weights rounded from the master weights as lp_adamw_kernel rounds them (value i with
// index i's draw), on the GPU and on the CPU: a loaded checkpoint's weights as its run had them.
static __global__ void lp_stochastic_round_kernel(floatX* params, const float* master, size_t n, uint32_t seed) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) params[i] = lp_stochastic_round(master[i], seed, i);
}
static inline void lp_stochastic_round_gpu(floatX* params, const float* master, size_t n, uint32_t seed) {
    LP_LAUNCH(lp_stochastic_round_kernel, lp_grid(n, LP_THREADS), LP_THREADS, 0, params, master, n, seed);
}
static inline void lp_stochastic_round_host(floatX* params, const float* master, size_t n, size_t i0, uint32_t seed) {
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) params[i] = lp_stochastic_round(master[i], seed, i0 + i);
}
static inline void lp_adamw_gpu(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t n,
                                float lr, float beta1, float beta2, float beta1_corr, float beta2_corr, float eps,
                                float weight_decay, float grad_scale, uint32_t seed) {
    LP_LAUNCH(lp_adamw_kernel, lp_grid((n + LP_PACK - 1) / LP_PACK, LP_THREADS), LP_THREADS, 0, params, master, grads, m, v, n,
              lr, beta1, beta2, beta1_corr, beta2_corr, eps, weight_decay, grad_scale, seed);
}
#endif

// --- the replicas' exchange (section 10, lp_replicas_*). DiLoCo's outer step: SGD with Nesterov momentum
// mu and learning rate lr on the pseudo-gradient delta = outer - mean (outer: the weights at the round's
// start, as the last outer step left them; mean: the replicas' mean weights after their inner steps):
//   mom <- mu mom + delta;   w <- outer - lr (delta + mu mom)
// written from the mean, w = mean + (1 - lr) delta - lr mu mom: equal in exact arithmetic, and in floats
// the mean itself, bit for bit, at lr 1 and mu 0 (the replicas plainly averaged). w is the next round's outer.
static inline LP_HD float lp_outer_value(float mean, float* outer, float* mom, float lr, float mu) {
    float delta = *outer - mean, m = mu * *mom + delta;
    float w = mean + (1.0f - lr) * delta - lr * mu * m;
    *mom = m;
    *outer = w;
    return w;
}
// Gossip's mixing: a replica's weight w and its K neighbours' (recv[k * stride]), each weighted 1/(K+1).
static inline LP_HD float lp_mix_value(float w, const float* recv, size_t stride, int K) {
    for (int k = 0; k < K; k++) w += recv[k * stride];
    return w / (float)(K + 1);
}
// Each over n values of a tensor: the master weights updated, and (CUDA) the compute-type weights rounded
// from them stochastically, with the draws of the AdamW step just taken (seed), as a resume rounds them.
static inline void lp_outer_step_cpu(floatX* params, float* master, float* outer, float* mom, const float* mean, size_t n,
                                     float lr, float mu, uint32_t seed) {
    (void)params, (void)seed;  // (the CPU build's params are its master weights)
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) master[i] = lp_outer_value(mean[i], &outer[i], &mom[i], lr, mu);
}
static inline void lp_mix_cpu(floatX* params, float* master, const float* recv, size_t stride, int K, size_t n, uint32_t seed) {
    (void)params, (void)seed;
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) master[i] = lp_mix_value(master[i], recv + i, stride, K);
}
#ifndef LLMPAR_CPU
static __global__ void lp_outer_step_kernel(floatX* params, float* master, float* outer, float* mom, const float* mean, size_t n,
                                            float lr, float mu, uint32_t seed) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float w = lp_outer_value(mean[i], &outer[i], &mom[i], lr, mu);
    master[i] = w;
    params[i] = lp_stochastic_round(w, seed, i);
}
static inline void lp_outer_step_gpu(floatX* params, float* master, float* outer, float* mom, const float* mean, size_t n,
                                     float lr, float mu, uint32_t seed) {
    if (n) LP_LAUNCH(lp_outer_step_kernel, lp_grid(n, LP_THREADS), LP_THREADS, 0, params, master, outer, mom, mean, n, lr, mu, seed);
}
static __global__ void lp_mix_kernel(floatX* params, float* master, const float* recv, size_t stride, int K, size_t n, uint32_t seed) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float w = lp_mix_value(master[i], recv + i, stride, K);
    master[i] = w;
    params[i] = lp_stochastic_round(w, seed, i);
}
static inline void lp_mix_gpu(floatX* params, float* master, const float* recv, size_t stride, int K, size_t n, uint32_t seed) {
    if (n) LP_LAUNCH(lp_mix_kernel, lp_grid(n, LP_THREADS), LP_THREADS, 0, params, master, recv, stride, K, n, seed);
}
#endif

// --- sums of squares (the gradient norm, the finiteness check of the weights). The CPU loop sums blocks of
// a fixed size in double, each a vector of partial sums, then the blocks in order: the same bits for any
// thread count (an OpenMP reduction would combine the threads' sums in their number and in any order). The
// CUDA version reduces in fp32 per block.
#define LP_NORM_BLOCK 32768
static inline float lp_norm_squared_cpu(const float* x, size_t n) {
    size_t blocks = (n + LP_NORM_BLOCK - 1) / LP_NORM_BLOCK;
    double* part = (double*)lp_host_malloc((blocks + 1) * sizeof(double), "norm partial sums");
#pragma omp parallel for
    for (size_t k = 0; k < blocks; k++) {
        size_t end = (k + 1) * LP_NORM_BLOCK < n ? (k + 1) * LP_NORM_BLOCK : n;
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (size_t i = k * LP_NORM_BLOCK; i < end; i++) s += (double)x[i] * x[i];
        part[k] = s;
    }
    double s = 0.0;
    for (size_t k = 0; k < blocks; k++) s += part[k];
    free(part);
    return (float)s;
}
#endif  // LLMPAR_IMPLEMENTATION
// Several spans of x, span k's sum of squares added to parts[spans[k].slot].
typedef struct {
    size_t at, n;
    int slot;
} LPSpan;
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_norm_squared_spans_cpu(float* parts, const float* x, const LPSpan* spans, int n) {
    for (int k = 0; k < n; k++) parts[spans[k].slot] += lp_norm_squared_cpu(x + spans[k].at, spans[k].n);
}
#endif  // LLMPAR_IMPLEMENTATION

#ifndef LLMPAR_CPU
// All the spans in one launch: span k gets blocks [first[k], first[k+1]), one per 2048 values up to
// LP_NORM_BLOCKS, so a small span costs a block and the grid follows from the sizes alone (the partial
// sums and their order the same on every call: deterministic); owner[b] is block b's span. Then a block
// per span adds its partials in order.
#define LP_NORM_BLOCKS 512
#ifdef LLMPAR_IMPLEMENTATION
static __global__ void lp_norm_squared_kernel(float* partials, const floatX* x, const LPSpan* spans, const int* first, const int* owner) {
    int k = owner[blockIdx.x];
    LPSpan sp = spans[k];
    size_t b = blockIdx.x - first[k], blocks = first[k + 1] - first[k];
    float s = 0.0f;
    for (size_t i = (b * blockDim.x + threadIdx.x) * LP_PACK; i < sp.n; i += blocks * blockDim.x * LP_PACK) {
        LPPack q = lp_load_pack(x + sp.at, i, sp.n);
        for (int j = 0; j < LP_PACK; j++) s += lp_bf(q.x[j]) * lp_bf(q.x[j]);
    }
    s = lp_block_reduce(s, 0);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}
static __global__ void lp_sum_kernel(float* out, const float* partials, const int* first) {  // block k: span k's partials
    float s = 0.0f;
    for (int i = first[blockIdx.x] + threadIdx.x; i < first[blockIdx.x + 1]; i += blockDim.x) s += partials[i];
    s = lp_block_reduce(s, 0);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}
static inline int lp_norm_blocks(size_t n) {
    size_t blocks = (n + (size_t)LP_THREADS * LP_PACK - 1) / ((size_t)LP_THREADS * LP_PACK);
    return (int)(blocks < LP_NORM_BLOCKS ? blocks : LP_NORM_BLOCKS);
}
#endif  // LLMPAR_IMPLEMENTATION
LP_STATE LPScratch lp_norm_scratch;  // the spans, their first blocks and each block's span; the partial sums; the spans' sums
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_norm_squared_spans_gpu(float* parts, const floatX* x, const LPSpan* spans, int n) {
    if (n <= 0) return;
    int total = 0;
    for (int k = 0; k < n; k++) total += lp_norm_blocks(spans[k].n);
    size_t table = ((size_t)n * sizeof(LPSpan) + (n + 1 + (size_t)total) * sizeof(int) + 255) / 256 * 256;
    char* host = (char*)lp_host_malloc(table, "norm spans");
    int *first = (int*)(host + (size_t)n * sizeof(LPSpan)), *owner = first + n + 1;
    memcpy(host, spans, (size_t)n * sizeof(LPSpan));
    first[0] = 0;
    for (int k = 0; k < n; k++) {
        first[k + 1] = first[k] + lp_norm_blocks(spans[k].n);
        for (int b = first[k]; b < first[k + 1]; b++) owner[b] = k;
    }
    char* scratch = (char*)lp_scratch(&lp_norm_scratch, table + ((size_t)total + n) * sizeof(float), "norm partial sums");
    lp_copy_to_device(scratch, host, table);
    float *partials = (float*)(scratch + table), *results = partials + total;
    const int* d_first = (const int*)(scratch + (size_t)n * sizeof(LPSpan));
    if (total)
        LP_LAUNCH(lp_norm_squared_kernel, total, LP_THREADS, 0, partials, x, (const LPSpan*)scratch, d_first, d_first + n + 1);
    LP_LAUNCH(lp_sum_kernel, n, LP_THREADS, 0, results, partials, d_first);
    float* sums = (float*)host;  // (the table is copied: its memory holds the sums now, n floats fit)
    lp_copy_to_host(sums, results, (size_t)n * sizeof(float));
    for (int k = 0; k < n; k++) parts[spans[k].slot] += sums[k];
    free(host);
}
static inline float lp_norm_squared_gpu(const floatX* x, size_t n) {
    LPSpan all = {0, n, 0};
    float result = 0.0f;
    lp_norm_squared_spans_gpu(&result, x, &all, 1);
    return result;
}

// The scratch buffers at their largest for batches of up to N rows of C channels in NH heads (bias
// gradients of up to 4C outputs), sized once at set-up: growing one later frees it, and cudaFree waits
// for the whole device.
static inline void lp_scratch_reserve(int B, int T, int C, int NH, int KV) {
    size_t N = (size_t)B * T, partials = (size_t)lp_ln_blocks((int)N, C) * 2 * C;  // layernorm backward
    if ((size_t)LP_BIAS_CHUNKS * 4 * C > partials) partials = (size_t)LP_BIAS_CHUNKS * 4 * C;
    size_t attention = N * NH + lp_flash_dq_partial_floats(B, T, T, C, NH, KV);  // flash attention backward's D and dq partials
    if (attention > partials) partials = attention;
    lp_scratch(&lp_partials, partials * sizeof(float), "reduction partials");
    lp_scratch(&lp_embedding_index, (3 * N + 1) * sizeof(int), "embedding backward index");  // 2U + 1 + M, U and M <= N
}
#endif  // LLMPAR_IMPLEMENTATION
#endif

// The ops the model calls, bound to this build's version: the CPU loop, or the CUDA launcher.
#ifdef LLMPAR_CPU
#define lp_embedding_forward          lp_embedding_forward_cpu
#define lp_embedding_backward         lp_embedding_backward_cpu
#define lp_positions_forward          lp_positions_forward_cpu
#define lp_positions_backward         lp_positions_backward_cpu
#define lp_layernorm_forward          lp_layernorm_forward_cpu
#define lp_residual_layernorm_forward lp_residual_layernorm_forward_cpu
#define lp_layernorm_backward         lp_layernorm_backward_cpu
#define lp_matmul_forward             lp_matmul_forward_cpu
#define lp_matmul_backward            lp_matmul_backward_cpu
#define lp_gemm_strided               lp_gemm_strided_cpu
#define lp_gelu_forward               lp_gelu_forward_cpu
#define lp_gelu_backward              lp_gelu_backward_cpu
#define lp_attention_probs            lp_attention_probs_cpu
#define lp_attention_forward          lp_attention_forward_cpu
#define lp_attention_backward         lp_attention_backward_cpu
#define lp_attention_cached_forward   lp_attention_cached_forward_cpu
#define lp_attention_block_forward    lp_attention_block_forward_cpu
#define lp_attention_block_end        lp_attention_block_end_cpu
#define lp_attention_block_backward   lp_attention_block_backward_cpu
#define lp_attention_kv_copy          lp_attention_kv_copy_cpu
#define lp_rope                       lp_rope_cpu
#define lp_swiglu_forward             lp_swiglu_forward_cpu
#define lp_swiglu_backward            lp_swiglu_backward_cpu
#define lp_moe_route                  lp_moe_route_cpu
#define lp_moe_stats                  lp_moe_stats_cpu
#define lp_moe_dispatch               lp_moe_dispatch_cpu
#define lp_moe_exchange_order         lp_moe_exchange_order_cpu
#define lp_moe_permute                lp_moe_permute_cpu
#define lp_moe_unpermute              lp_moe_unpermute_cpu
#define lp_moe_combine                lp_moe_combine_cpu
#define lp_moe_combine_backward       lp_moe_combine_backward_cpu
#define lp_moe_router_backward        lp_moe_router_backward_cpu
#define lp_moe_aux_grad               lp_moe_aux_grad_cpu
#define lp_classifier_stats           lp_classifier_stats_cpu
#define lp_classifier_grad            lp_classifier_grad_cpu
#define lp_classifier_fused           lp_classifier_fused_cpu
#define lp_add_scaled                 lp_add_scaled_cpu
#define lp_adamw                      lp_adamw_cpu
#define lp_outer_step                 lp_outer_step_cpu
#define lp_mix                        lp_mix_cpu
#define lp_norm_squared               lp_norm_squared_cpu
#define lp_norm_squared_spans         lp_norm_squared_spans_cpu
#else
#define lp_embedding_forward          lp_embedding_forward_gpu
#define lp_embedding_backward         lp_embedding_backward_gpu
#define lp_positions_forward          lp_positions_forward_gpu
#define lp_positions_backward         lp_positions_backward_gpu
#define lp_layernorm_forward          lp_layernorm_forward_gpu
#define lp_residual_layernorm_forward lp_residual_layernorm_forward_gpu
#define lp_layernorm_backward         lp_layernorm_backward_gpu
#define lp_matmul_forward             lp_matmul_forward_gpu
#define lp_matmul_backward            lp_matmul_backward_gpu
#define lp_gemm_strided               lp_gemm_strided_gpu
#define lp_gelu_forward               lp_gelu_forward_gpu
#define lp_gelu_backward              lp_gelu_backward_gpu
#define lp_attention_probs            lp_attention_probs_gpu
#define lp_attention_forward          lp_attention_forward_gpu
#define lp_attention_backward         lp_attention_backward_gpu
#define lp_attention_cached_forward   lp_attention_cached_forward_gpu
#define lp_attention_block_forward    lp_attention_block_forward_gpu
#define lp_attention_block_end        lp_attention_block_end_gpu
#define lp_attention_block_backward   lp_attention_block_backward_gpu
#define lp_attention_kv_copy          lp_attention_kv_copy_gpu
#define lp_rope                       lp_rope_gpu
#define lp_swiglu_forward             lp_swiglu_forward_gpu
#define lp_swiglu_backward            lp_swiglu_backward_gpu
#define lp_moe_route                  lp_moe_route_gpu
#define lp_moe_stats                  lp_moe_stats_gpu
#define lp_moe_dispatch               lp_moe_dispatch_gpu
#define lp_moe_exchange_order         lp_moe_exchange_order_gpu
#define lp_moe_permute                lp_moe_permute_gpu
#define lp_moe_unpermute              lp_moe_unpermute_gpu
#define lp_moe_combine                lp_moe_combine_gpu
#define lp_moe_combine_backward       lp_moe_combine_backward_gpu
#define lp_moe_router_backward        lp_moe_router_backward_gpu
#define lp_moe_aux_grad               lp_moe_aux_grad_gpu
#define lp_classifier_stats           lp_classifier_stats_gpu
#define lp_classifier_grad            lp_classifier_grad_gpu
#define lp_classifier_fused           lp_classifier_fused_gpu
#define lp_add_scaled                 lp_add_scaled_gpu
#define lp_adamw                      lp_adamw_gpu
#define lp_outer_step                 lp_outer_step_gpu
#define lp_mix                        lp_mix_gpu
#define lp_norm_squared               lp_norm_squared_gpu
#define lp_norm_squared_spans         lp_norm_squared_spans_gpu
#endif

// ----------------------------------------------------------------------------------------------------
// 8. zero
//
// Data parallelism and ZeRO in one place: where a model's weights, gradients and AdamW state live on this
// rank, and where its gradients are averaged over the data-parallel group dp. The model's parameters are
// one flat array (its tensors back to back; a layer tensor holds its L layers one after another), which
// ZeRO cuts into equal shards, one per DP rank: a rank updates its shard only.
//
//   stage  a rank keeps of the layers       where gradients are averaged over dp
//   0      everything                       lp_zero_average, at the step's end (an all-reduce); with
//                                           overlap, lp_zero_layer_done starts it in buckets of layers
//                                           while the last micro-batch's backward goes on
//   1      a shard of the master weights    lp_zero_average (a reduce-scatter to the shards' owners); the
//          and AdamW state                  updated weights are all-gathered (lp_zero_gather_updated)
//   2      ... and of the gradients         lp_zero_layer_done, for each layer of every micro-batch as its
//                                           backward finishes (a reduce-scatter, in one-layer buffers)
//   3      ... and of the weights           as stage 2; lp_zero_fetch gathers each layer's weights just
//                                           before it runs, the next layer's on the way meanwhile
// wte (the embedding and the tied LM head, most of a small model's weights) is sharded like a layer in
// stages 2-3 when the model holds its only copy (no pipeline; or an untied head, whose first chunk alone holds
// wte, when that chunk has layers): it is used a piece of rows at a time (at most a layer's worth), each piece's weights gathered when
// needed (stage 3) and its gradients reduce-scattered as soon as they are computed (lp_zero_wte,
// lp_zero_wte_grad). The other tensors outside the layers, wpe, lnf (smaller than a layer), an untied head's
// headw, and wte when pipeline stages hold copies of it, stay whole: their
// gradients are accumulated over the micro-batches and reduce-scattered by lp_zero_average, their
// weights gathered after each update.
//
// The model reaches it through per-layer hooks: lp_zero_fetch (layer l's weights are here), lp_zero_weights
// and lp_zero_grads (where tensor i of layer l is), lp_zero_layer_begin and lp_zero_layer_done around a
// layer's backward, lp_zero_backward_done after the last one; lp_zero_wte and lp_zero_wte_grad (/_done)
// for wte's pieces; the optimizer through lp_zero_average, lp_zero_shard_grads / lp_zero_shard_params and
// lp_zero_gather_updated.

// --- Offload (--offload nvme): this rank's AdamW state lives in a file instead of memory, and each update
// streams it through two buffers a chunk at a time. A helper thread reads the next chunk while this one is
// updated and writes the updated one behind it, in the order they were asked (so a buffer is written out
// before the next chunk is read into it). The file holds chunk k at k * stride bytes: its m then its v
// (each `chunk` values, padded), so every transfer is one large aligned pread or pwrite; O_DIRECT where
// the filesystem takes it (past the page cache), else plain. The file is unlinked once open: it is scratch
// (checkpoints hold the state), so a run that dies leaves nothing behind. On the CPU build the params are
// the master weights, so m and v are all there is to move.
#define LP_OFFLOAD_ALIGN 4096
#define LP_OFFLOAD_CHUNK ((size_t)1 << 20)  // values per chunk: 2 x 4 MiB per transfer
#define LP_OFFLOAD_JOBS 4  // queued at most: the last chunk's write, the next's read, this one's, the one after's
typedef struct {
    int fd, direct;
    char path[LP_PATH_MAX];   // the file's name, for errors (it is unlinked)
    size_t chunk, chunks;     // values per chunk (a multiple of LP_OFFLOAD_ALIGN / 4), chunks in the shard
    size_t written;           // chunks the file holds; the others read as zeros (a fresh state)
    float* buf[2];            // each: a chunk's m, then its v
    // the helper's queue: jobs [done, queued) in LP_OFFLOAD_JOBS slots; err: the first failure's errno
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct { int write; size_t chunk; float* buf; } job[LP_OFFLOAD_JOBS];
    long queued, done, ready[2];  // ready[b]: the job that fills buffer b
    int err, err_write, stop;
    long crash_at, writes;  // tests (LLMPAR_TEST_HOOKS), LLMPAR_OFFLOAD_CRASH_AT=k: die (status 137) after the k-th chunk written
} LPOffload;

#ifdef LLMPAR_IMPLEMENTATION
// Read (write = 0) or write chunk k of the file from or into buf, all of it; returns 0 or an errno. A
// chunk the file does not hold yet reads as zeros.
static inline int lp_offload_io(LPOffload* o, size_t k, float* buf, int write) {
    size_t bytes = 2 * o->chunk * sizeof(float);
    if (!write && k >= o->written) {
        memset(buf, 0, bytes);
        return 0;
    }
    for (size_t at = 0; at < bytes;) {
        off_t pos = (off_t)(k * bytes + at);
        ssize_t n = write ? pwrite(o->fd, (char*)buf + at, bytes - at, pos) : pread(o->fd, (char*)buf + at, bytes - at, pos);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return n < 0 ? errno : EIO;
        at += (size_t)n;
    }
    if (write && o->crash_at > 0 && ++o->writes == o->crash_at) _exit(137);
    return 0;
}

// How many of `count` values chunk k holds.
static inline size_t lp_offload_part(const LPOffload* o, size_t k, size_t count) {
    size_t at = k * o->chunk;
    return at >= count ? 0 : count - at < o->chunk ? count - at : o->chunk;
}

static inline void* lp_offload_helper(void* arg) {
    LPOffload* o = (LPOffload*)arg;
    pthread_mutex_lock(&o->lock);
    for (;;) {
        while (o->done == o->queued && !o->stop) pthread_cond_wait(&o->cond, &o->lock);
        if (o->done == o->queued) break;
        int slot = (int)(o->done % LP_OFFLOAD_JOBS), write = o->job[slot].write, failed = o->err != 0;
        size_t k = o->job[slot].chunk;
        float* buf = o->job[slot].buf;
        pthread_mutex_unlock(&o->lock);
        int err = failed ? 0 : lp_offload_io(o, k, buf, write);  // after a failure the rest are dropped
        pthread_mutex_lock(&o->lock);
        if (err) o->err = err, o->err_write = write;
        o->done++;
        pthread_cond_broadcast(&o->cond);
    }
    pthread_mutex_unlock(&o->lock);
    return NULL;
}

// Queue a transfer of chunk k; returns its job number.
static inline long lp_offload_queue(LPOffload* o, size_t k, float* buf, int write) {
    pthread_mutex_lock(&o->lock);
    while (o->queued - o->done >= LP_OFFLOAD_JOBS) pthread_cond_wait(&o->cond, &o->lock);
    int slot = (int)(o->queued % LP_OFFLOAD_JOBS);
    o->job[slot].write = write;
    o->job[slot].chunk = k;
    o->job[slot].buf = buf;
    long id = o->queued++;
    pthread_cond_broadcast(&o->cond);
    pthread_mutex_unlock(&o->lock);
    return id;
}

// Wait for job `id` (and those before it); a failure so far stops the run, naming the file.
static inline void lp_offload_wait(LPOffload* o, long id) {
    pthread_mutex_lock(&o->lock);
    while (o->done <= id) pthread_cond_wait(&o->cond, &o->lock);
    int err = o->err, write = o->err_write;
    pthread_mutex_unlock(&o->lock);
    if (err)
        lp_fail("%s: cannot %s the optimizer state in %s: %s", LP_SETTING(offload_dir), write ? "write" : "read", o->path, strerror(err));
}

// Values per chunk for a state of `values` values: LP_OFFLOAD_CHUNK (tests: LLMPAR_OFFLOAD_CHUNK in a
// LLMPAR_TEST_HOOKS build, so a tiny model spans many), or all of them when fewer, in whole aligned blocks.
static inline size_t lp_offload_chunk(size_t values) {
    size_t align = LP_OFFLOAD_ALIGN / sizeof(float), most = LP_OFFLOAD_CHUNK;
#ifdef LLMPAR_TEST_HOOKS
    if (getenv("LLMPAR_OFFLOAD_CHUNK")) most = (size_t)atol(getenv("LLMPAR_OFFLOAD_CHUNK")) / align * align;
#endif
    if (most == 0) most = align;
    size_t chunk = values < most ? (values + align - 1) / align * align : most;
    return chunk ? chunk : align;
}

// The state file for `values` values in dir (`tag` tells a rank's models apart), and its helper thread.
static inline LPOffload* lp_offload_open(const char* dir, int tag, size_t values) {
    LPOffload* o = (LPOffload*)lp_host_malloc(sizeof(LPOffload), "offload");
    memset(o, 0, sizeof(*o));
#ifdef LLMPAR_TEST_HOOKS
    o->crash_at = getenv("LLMPAR_OFFLOAD_CRASH_AT") ? atol(getenv("LLMPAR_OFFLOAD_CRASH_AT")) : 0;
#endif
    o->chunk = lp_offload_chunk(values);
    o->chunks = (values + o->chunk - 1) / o->chunk;
    lp_path(o->path, "%s/llmpar-offload-%d-%d.bin", dir, (int)getpid(), tag);
    for (int b = 0; b < 2; b++) {
        void* p = NULL;
        if (posix_memalign(&p, LP_OFFLOAD_ALIGN, 2 * o->chunk * sizeof(float)) != 0)
            lp_fail("out of host memory allocating the offload buffers (%.1f MiB)", 2 * o->chunk * sizeof(float) / 1048576.0);
        o->buf[b] = (float*)p;
    }
    o->fd = -1;
#ifdef O_DIRECT
    o->fd = open(o->path, O_RDWR | O_CREAT | O_EXCL | O_DIRECT, 0600);
    if (o->fd >= 0) {  // some filesystems open with O_DIRECT and refuse the transfers: try one
        memset(o->buf[0], 0, LP_OFFLOAD_ALIGN);
        o->direct = pwrite(o->fd, o->buf[0], LP_OFFLOAD_ALIGN, 0) == LP_OFFLOAD_ALIGN;
        if (!o->direct) {
            close(o->fd);
            unlink(o->path);
            o->fd = -1;
        }
    }
#endif
    if (o->fd < 0) o->fd = open(o->path, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (o->fd < 0) lp_fail("%s: cannot create %s: %s", LP_SETTING(offload_dir), o->path, strerror(errno));
    unlink(o->path);
    if (ftruncate(o->fd, 0) != 0) lp_fail("%s: cannot write %s: %s", LP_SETTING(offload_dir), o->path, strerror(errno));
    pthread_mutex_init(&o->lock, NULL);
    pthread_cond_init(&o->cond, NULL);
    if (pthread_create(&o->thread, NULL, lp_offload_helper, o) != 0) lp_fail("cannot start the offload thread");
    return o;
}

static inline void lp_offload_close(LPOffload* o) {
    if (!o) return;
    pthread_mutex_lock(&o->lock);
    o->stop = 1;
    pthread_cond_broadcast(&o->cond);
    pthread_mutex_unlock(&o->lock);
    pthread_join(o->thread, NULL);
    pthread_mutex_destroy(&o->lock);
    pthread_cond_destroy(&o->cond);
    close(o->fd);
    free(o->buf[0]);
    free(o->buf[1]);
    free(o);
}
#endif  // LLMPAR_IMPLEMENTATION

// Where this rank's optimizer state (and weights) live (--offload). NVME: AdamW m and v in a file
// (LPOffload); on the CUDA build the master weights then sit in pinned host memory and the update runs on
// the CPU, as with OPTIMIZER (the CUDA build's): master weights, m and v in pinned host memory. PARAMS
// (the CUDA build's, ZeRO-3): OPTIMIZER, and the shard of bf16 weights in pinned host memory too, each
// layer's part coming up to the GPU as its gather starts. (LP_OFFLOAD_*: beside LPParallel, section 3.)

#ifndef LLMPAR_CPU
// --- The update on the host (the CUDA build's --offload): the CPU updates the shard a chunk at a time
// (lp_adamw_host, OpenMP) while chunk c+1's gradients come down (stream `down`) and chunk c-1's bf16
// weights go up (stream `up`), each through two pinned buffers that events hand over.
typedef struct {
    floatX *grads[2], *params[2];        // pinned: a chunk's gradients down, its updated weights up
    cudaStream_t down, up;
    cudaEvent_t ready, got[2], sent[2];  // gradients complete; buffer b's download and upload done
} LPHostOptim;

#ifdef LLMPAR_IMPLEMENTATION
static inline LPHostOptim* lp_host_optim_create(size_t chunk) {
    LPHostOptim* h = (LPHostOptim*)lp_host_malloc(sizeof(LPHostOptim), "host optimizer");
    for (int b = 0; b < 2; b++) {
        h->grads[b] = (floatX*)lp_pinned_malloc(chunk * sizeof(floatX), "a chunk of gradients");
        h->params[b] = (floatX*)lp_pinned_malloc(chunk * sizeof(floatX), "a chunk of weights");
        cudaCheck(cudaEventCreateWithFlags(&h->got[b], cudaEventDisableTiming));
        cudaCheck(cudaEventCreateWithFlags(&h->sent[b], cudaEventDisableTiming));
    }
    cudaCheck(cudaEventCreateWithFlags(&h->ready, cudaEventDisableTiming));
    cudaCheck(cudaStreamCreateWithFlags(&h->down, cudaStreamNonBlocking));
    cudaCheck(cudaStreamCreateWithFlags(&h->up, cudaStreamNonBlocking));
    return h;
}
static inline void lp_host_optim_free(LPHostOptim* h) {
    if (!h) return;
    for (int b = 0; b < 2; b++) {
        lp_pinned_free(h->grads[b]);
        lp_pinned_free(h->params[b]);
        cudaCheck(cudaEventDestroy(h->got[b]));
        cudaCheck(cudaEventDestroy(h->sent[b]));
    }
    cudaCheck(cudaEventDestroy(h->ready));
    cudaCheck(cudaStreamDestroy(h->down));
    cudaCheck(cudaStreamDestroy(h->up));
    free(h);
}
#endif  // LLMPAR_IMPLEMENTATION
#endif

typedef struct LPZero {
    const LPGroup* dp;        // gradients are averaged over this group (NULL: one replica)
    const LPParallel* par;    // its ZeRO stage (par->zero: "stage" below), overlap, buckets and offload
    // the flat parameters: tensor i at param_offsets[i], param_sizes[i] values; a layer tensor holds
    // layer_size[i] values of each of the L layers [layer0, layer0 + L) of cfg that has it (lp_layer_has:
    // a MoE layer has the router and experts where a dense one has its MLP). One layer's slices, packed one
    // after another (layer_offsets; a MoE layer's experts where a dense layer's MLP is), make at most
    // layer_params values
    LPConfig cfg;
    int L, layer0;
    size_t num_params, param_sizes[LP_NUM_PARAMS], param_offsets[LP_NUM_PARAMS];
    size_t layer_size[LP_NUM_PARAMS], layer_offsets[LP_NUM_PARAMS], layer_params;
    // this rank's shard [shard_start, shard_start + shard_size) of the flat parameters padded to a multiple
    // of dp's size (stage 0: everything)
    size_t padded_params, shard_start, shard_size;
    size_t outside;             // values of the tensors outside the layers held whole (stage 2-3)
    floatX* params;             // compute-type weights used by forward/backward (stage 3: `outside` only)
    floatX* grads;              // their gradients, accumulated over micro-batches (stage 2-3: `outside` only)
    floatX* w[LP_NUM_PARAMS];   // each tensor's weights in params (stage 3's layers and cut wte: NULL)
    floatX* g[LP_NUM_PARAMS];   // and gradients in grads (stage 2-3's layers and cut wte: NULL)
    float* master;              // fp32 master weights of this rank's shard: the truth the optimizer updates
                                // (the CPU build's fp32 params are their own: master points into them)
    float* adam_m;              // AdamW first moment (fp32), this rank's shard
    float* adam_v;              // AdamW second moment (fp32), this rank's shard
    LPOffload* off;             // --offload nvme: m and v in a file instead (adam_m, adam_v NULL); else NULL
    int host_state;             // the CUDA build's --offload: master (and adam_m, adam_v) in pinned host memory
    int params_on_host;         // --offload params: param_shard (stage 3) in pinned host memory too
    size_t state_chunk;         // the update walks the shard in chunks of this many values (in memory: all)
#ifndef LLMPAR_CPU
    LPHostOptim* host;          // host_state: the update's streams and buffers
#endif
    int adam_step;
    float grad_scale;           // what the optimizer and the norm scale the averaged gradients by (expert parallelism's 1/ep)
    // replicas that train apart (par->diloco, par->gossip; dp is NULL): their group, and fp32 buffers of this
    // rank's values: DiLoCo's outer weights (as the last outer step left them) and outer momentum; `mix`, what
    // the exchange brings (DiLoCo: the replicas' mean weights; gossip: the K neighbours' weights, in turn)
    const LPGroup* replicas;
    float *outer_w, *outer_m, *mix;
    size_t param_bytes, grad_bytes;  // weight and gradient memory of this rank
    // stage 0 with overlap: layers [l+1, unreduced) are done but not yet reducing; once reductions were
    // started (layers_reducing), lp_zero_average waits for them
    int unreduced, layers_reducing;
    LPPending reducing;
    // stage 2-3: layer l's gradients go to buffer l % 2 (layer_grads while its backward runs), a cut wte's
    // piece k's to buffer k % 2; their reduction to the owners runs on, in place, while the next layer's or
    // piece's are computed in the other buffer; once it has arrived, this rank's sums (reduce_add_src, n)
    // are added into grad_shard (at reduce_add_at)
    floatX* grad_shard;         // this rank's averaged gradients, accumulated over micro-batches
    floatX* grad_buf[2];        // each a layer's worth (a piece of wte is at most that)
    floatX* layer_grads;
    LPPending reducing_buf[2];
    int reduce_adds[2];
    floatX* reduce_add_src[2][LP_NUM_PARAMS];
    size_t reduce_add_at[2][LP_NUM_PARAMS], reduce_add_n[2][LP_NUM_PARAMS];
    // stage 3: the layers' weights live in shards too, gathered a layer at a time into one of two buffers
    floatX* param_shard;        // this rank's weights [shard_start, shard_start + shard_size)
    floatX* layer_buf[2];
    int layer_in_buf[2];        // the layer each buffer holds (or is being gathered into it), -1 for none
    LPPending gathering[2];     // each buffer's gather in flight
    // wte in pieces of piece_rows of its wte_rows rows: cut (stage 2-3, the only copy), piece k's weights
    // gathered into piece_w[k % 2] (stage 3; the next piece's on the way while one is used) and its
    // gradients computed in grad_buf; else one piece, the whole
    int wte_cut, pieces;
    size_t wte_rows, piece_rows;
    floatX* piece_w[2];
    int piece_in_buf[2];        // the piece each holds (or is being gathered into it), -1 for none
    LPPending piece_gathering[2];
    LPPending now;              // a collective waited for at once: a piece's, or a whole tensor's at the end
} LPZero;

#ifdef LLMPAR_IMPLEMENTATION
// The rows of a piece of wte (rows x cols): as many as make at most one layer's parameters, a multiple of
// 64 when that leaves any (so each piece's columns of the logits start 128-byte aligned for the GEMM).
static inline size_t lp_zero_piece_rows(size_t rows, size_t cols, size_t layer_params) {
    size_t r = layer_params / cols;
    if (r >= 64) r -= r % 64;
    return r < 1 ? 1 : r > rows ? rows : r;
}

// Tensor i is outside the layers and held whole (not wte in pieces).
static inline int lp_zero_whole(const LPZero* z, int i) {
    return !lp_is_layer_tensor(i) && !(i == LP_WTE && z->wte_cut);
}

// How many of layers 0 .. l-1 (local) have tensor i: where layer l's slice of it is, in layer_size steps.
static inline size_t lp_zero_layer_index(const LPZero* z, int i, int l) {
    return (size_t)lp_layers_having(&z->cfg, i, z->layer0, z->layer0 + l);
}

// Lay out the flat parameters from their sizes (a layer tensor's for the layers [layer0, layer0 + L) of cfg
// that have it; wte's of wte_rows rows) and allocate what this rank keeps of them at par's ZeRO stage over
// dp, the optimizer state where par->offload says (LP_OFFLOAD_*; NVME: a file in par->offload_dir, `tag`
// telling a rank's models apart). wte_alone: the model holds the only copy of wte, so stages 2-3 may cut it
// in pieces.
static inline void lp_zero_create(LPZero* z, const size_t sizes[LP_NUM_PARAMS], const LPConfig* cfg, int layer0, int L,
                                  size_t wte_rows, int wte_alone, const LPGroup* dp, const LPParallel* par, int tag) {
    memset(z, 0, sizeof(*z));
    int stage = par->zero, offload = par->offload;
    if (stage >= 1 && !dp) lp_fail("%s %d: ZeRO needs a data-parallel group", LP_SETTING(zero), stage);
    z->dp = dp;
    z->par = par;
    z->grad_scale = 1.0f;
    z->cfg = *cfg;
    z->layer0 = layer0;
    z->L = L;
    z->wte_rows = wte_rows;
    size_t mlp[2] = {0, 0};  // a layer's slices: those every layer has, then a dense MLP's or the experts' at the same place
    for (int i = 0; i < LP_NUM_PARAMS; i++) {
        z->param_sizes[i] = sizes[i];
        z->param_offsets[i] = z->num_params;
        z->num_params += sizes[i];
        if (!lp_is_layer_tensor(i)) continue;
        size_t having = lp_zero_layer_index(z, i, L);
        z->layer_size[i] = having ? sizes[i] / having : 0;
        int kind = i >= LP_ROUTERW ? 1 : i >= LP_FCW ? 0 : -1;
        if (kind < 0) {
            z->layer_offsets[i] = z->layer_params;
            z->layer_params += z->layer_size[i];
        } else {
            z->layer_offsets[i] = mlp[kind];  // (relative until the common part's end is known)
            mlp[kind] += z->layer_size[i];
        }
    }
    for (int i = LP_FCW; i < LP_NUM_PARAMS; i++)
        if (lp_is_layer_tensor(i)) z->layer_offsets[i] += z->layer_params;
    z->layer_params += mlp[0] > mlp[1] ? mlp[0] : mlp[1];
    z->unreduced = L;
    size_t cols = wte_rows ? sizes[LP_WTE] / wte_rows : 0;
    z->wte_cut = stage >= 2 && wte_alone && wte_rows > 0;
    z->piece_rows = z->wte_cut ? lp_zero_piece_rows(wte_rows, cols, z->layer_params) : wte_rows;
    z->pieces = wte_rows ? (int)((wte_rows + z->piece_rows - 1) / z->piece_rows) : 0;
    size_t piece = z->wte_cut ? z->piece_rows * cols : 0;
    int parts = stage >= 1 ? dp->size : 1;
    z->padded_params = (z->num_params + parts - 1) / parts * parts;
    z->shard_size = z->padded_params / parts;
    z->shard_start = stage >= 1 ? z->shard_size * dp->rank : 0;
    size_t n = z->padded_params, k = z->shard_size;
    for (int i = 0; i < LP_NUM_PARAMS; i++) z->outside += lp_zero_whole(z, i) ? sizes[i] : 0;
    size_t outside = z->outside;
    if (offload == LP_OFFLOAD_PARAMS && (stage < 3 || LP_MASTER_COPY == 0))
        lp_fail("%s params: the CUDA build's, with ZeRO-3 (it moves the weight shard that ZeRO-3 gathers from)", LP_SETTING(offload));
    z->params_on_host = offload == LP_OFFLOAD_PARAMS;
    if (stage >= 3) {  // whole weights only for the tensors outside the layers, packed
        z->params = (floatX*)lp_device_malloc(outside * sizeof(floatX), "parameters outside the layers");
        z->param_shard = z->params_on_host ? (floatX*)lp_pinned_malloc(k * sizeof(floatX), "parameter shard")
                                           : (floatX*)lp_device_malloc(k * sizeof(floatX), "parameter shard");
        for (int b = 0; b < 2; b++) {
            z->layer_buf[b] = (floatX*)lp_device_malloc(z->layer_params * sizeof(floatX), "gathered layer");
            z->layer_in_buf[b] = -1;
        }
        size_t off = 0;
        for (int i = 0; i < LP_NUM_PARAMS; i++)
            if (lp_zero_whole(z, i)) { z->w[i] = z->params + off; off += sizes[i]; }
        lp_device_zero(z->params, outside * sizeof(floatX));
        for (int b = 0; b < 2; b++) {
            if (piece) z->piece_w[b] = (floatX*)lp_device_malloc(piece * sizeof(floatX), "gathered piece of wte");
            z->piece_in_buf[b] = -1;
        }
        z->param_bytes = (outside + (z->params_on_host ? 0 : k) + 2 * z->layer_params + 2 * piece) * sizeof(floatX);
    } else {
        z->params = (floatX*)lp_device_malloc(n * sizeof(floatX), "parameters");
        lp_device_zero(z->params, n * sizeof(floatX));
        for (int i = 0; i < LP_NUM_PARAMS; i++) z->w[i] = z->params + z->param_offsets[i];
        z->param_bytes = n * sizeof(floatX);
    }
#ifdef LLMPAR_CPU
    if (offload == LP_OFFLOAD_OPTIMIZER)
        lp_fail("%s optimizer: moves GPU state to host memory, where the CPU build's already is", LP_SETTING(offload));
#else
    z->host_state = offload != LP_OFFLOAD_NONE;  // the update on the CPU, master weights in pinned host memory
#endif
    z->state_chunk = offload != LP_OFFLOAD_NONE ? lp_offload_chunk(k) : (k ? k : 1);
    if (z->host_state) {
        z->master = (float*)lp_pinned_malloc(k * sizeof(float), "fp32 master weights");
    } else if (LP_MASTER_COPY) {
        z->master = (float*)lp_device_malloc(k * sizeof(float), "fp32 master weights");
        lp_device_zero(z->master, k * sizeof(float));
    } else {  // fp32 params are their own master weights: this rank's shard of them
        z->master = (float*)(stage >= 3 ? z->param_shard : z->params + z->shard_start);
    }
    if (offload == LP_OFFLOAD_NVME) {
        z->off = lp_offload_open(par->offload_dir, tag, k);
    } else if (z->host_state) {
        z->adam_m = (float*)lp_pinned_malloc(k * sizeof(float), "AdamW first moment");
        z->adam_v = (float*)lp_pinned_malloc(k * sizeof(float), "AdamW second moment");
    } else {
        z->adam_m = (float*)lp_device_malloc(k * sizeof(float), "AdamW first moment");
        z->adam_v = (float*)lp_device_malloc(k * sizeof(float), "AdamW second moment");
        lp_device_zero(z->adam_m, k * sizeof(float));
        lp_device_zero(z->adam_v, k * sizeof(float));
    }
#ifndef LLMPAR_CPU
    if (z->host_state) z->host = lp_host_optim_create(z->state_chunk);
#endif
    if (stage >= 2) {  // whole gradients only for the tensors outside the layers, packed
        size_t off = 0;
        z->grads = (floatX*)lp_device_malloc(outside * sizeof(floatX), "gradients outside the layers");
        for (int i = 0; i < LP_NUM_PARAMS; i++)
            if (lp_zero_whole(z, i)) { z->g[i] = z->grads + off; off += sizes[i]; }
        z->grad_shard = (floatX*)lp_device_malloc(k * sizeof(floatX), "gradient shard");
        for (int b = 0; b < 2; b++)
            z->grad_buf[b] = (floatX*)lp_device_malloc(z->layer_params * sizeof(floatX), "one layer's gradients");
        z->layer_grads = z->grad_buf[0];
        z->grad_bytes = (outside + 2 * z->layer_params + k) * sizeof(floatX);
    } else {
        z->grads = (floatX*)lp_device_malloc(n * sizeof(floatX), "gradients");
        for (int i = 0; i < LP_NUM_PARAMS; i++) z->g[i] = z->grads + z->param_offsets[i];
        z->grad_bytes = n * sizeof(floatX);
    }
}

// Replicas that train apart (par->diloco or par->gossip): the group of the d replicas, which z averages
// nothing over (its dp is NULL), and the buffers their exchange needs (LPZero.replicas), zeroed.
static inline void lp_zero_replicas(LPZero* z, const LPGroup* replicas) {
    size_t k = z->shard_size, mixed = z->par->diloco ? 1 : (size_t)z->par->gossip;
    z->replicas = replicas;
    if (z->par->diloco) {
        z->outer_w = (float*)lp_device_malloc(k * sizeof(float), "DiLoCo's outer weights");
        z->outer_m = (float*)lp_device_malloc(k * sizeof(float), "DiLoCo's outer momentum");
        lp_device_zero(z->outer_w, k * sizeof(float));
        lp_device_zero(z->outer_m, k * sizeof(float));
    }
    z->mix = (float*)lp_device_malloc(mixed * k * sizeof(float), "the replicas' exchange");
    lp_device_zero(z->mix, mixed * k * sizeof(float));
}

static inline void lp_zero_free(LPZero* z) {
    lp_device_free(z->params);
    lp_device_free(z->grads);
    if (z->par->zero >= 2) {
        lp_device_free(z->grad_shard);
        for (int b = 0; b < 2; b++) lp_device_free(z->grad_buf[b]);
    }
    if (z->par->zero >= 3) {
        if (z->params_on_host) lp_pinned_free(z->param_shard);
        else lp_device_free(z->param_shard);
        for (int b = 0; b < 2; b++) lp_device_free(z->layer_buf[b]);
    }
    if (z->host_state) {
        lp_pinned_free(z->master);
        lp_pinned_free(z->adam_m);
        lp_pinned_free(z->adam_v);
#ifndef LLMPAR_CPU
        lp_host_optim_free(z->host);
#endif
    } else {
        if (LP_MASTER_COPY) lp_device_free(z->master);
        lp_device_free(z->adam_m);
        lp_device_free(z->adam_v);
    }
    lp_offload_close(z->off);
    lp_device_free(z->outer_w);
    lp_device_free(z->outer_m);
    lp_device_free(z->mix);
    for (int b = 0; b < 2; b++) {
        lp_device_free(z->piece_w[b]);
        lp_pending_free(&z->reducing_buf[b]);
        lp_pending_free(&z->gathering[b]);
        lp_pending_free(&z->piece_gathering[b]);
    }
    lp_pending_free(&z->reducing);
    lp_pending_free(&z->now);
    memset(z, 0, sizeof(*z));
}

// Tensor i of layer l (a layer tensor that layer has): its weights, and where its gradient accumulates.
static inline floatX* lp_zero_weights(const LPZero* z, int i, int l) {
    if (z->par->zero >= 3) {
        for (int b = 0; b < 2; b++)
            if (z->layer_in_buf[b] == l) return z->layer_buf[b] + z->layer_offsets[i];
        lp_fail("ZeRO-3: layer %d's weights were used before they were gathered", l);
    }
    return z->w[i] + lp_zero_layer_index(z, i, l) * z->layer_size[i];
}
static inline floatX* lp_zero_grads(const LPZero* z, int i, int l) {
    if (z->par->zero >= 2) return z->layer_grads + z->layer_offsets[i];
    return z->g[i] + lp_zero_layer_index(z, i, l) * z->layer_size[i];
}

// How many of this rank's shard are real parameters (the last shard may end in padding).
static inline size_t lp_zero_shard_count(const LPZero* z) {
    if (z->shard_start >= z->num_params) return 0;
    size_t left = z->num_params - z->shard_start;
    return left < z->shard_size ? left : z->shard_size;
}
// This rank's part [a, b) of tensor i, in its shard's coordinates; 0 when the shard holds none of it.
static inline int lp_zero_tensor_in_shard(const LPZero* z, int i, size_t* a, size_t* b) {
    size_t lo = z->shard_start, hi = lo + lp_zero_shard_count(z);
    size_t x = z->param_offsets[i] > lo ? z->param_offsets[i] : lo;
    size_t y = z->param_offsets[i] + z->param_sizes[i] < hi ? z->param_offsets[i] + z->param_sizes[i] : hi;
    *a = x - lo;
    *b = y > x ? y - lo : x - lo;
    return y > x;
}
// This rank's shard of the averaged gradients and of the compute-type weights (what AdamW updates).
static inline const floatX* lp_zero_shard_grads(const LPZero* z) {
    return z->par->zero >= 2 ? z->grad_shard : z->grads + z->shard_start;
}
static inline floatX* lp_zero_shard_params(const LPZero* z) {
    return z->par->zero >= 3 ? z->param_shard : z->params + z->shard_start;
}
// Copies of fp32 optimizer state (master, adam_m, adam_v) out to and in from host memory: a memcpy when it
// lives there (the CUDA build's --offload), else a device copy (the CPU build's: a memcpy).
static inline void lp_zero_state_out(const LPZero* z, void* dst, const void* src, size_t bytes) {
    if (z->host_state) memcpy(dst, src, bytes);
    else lp_copy_to_host(dst, src, bytes);
}
static inline void lp_zero_state_in(const LPZero* z, void* dst, const void* src, size_t bytes) {
    if (z->host_state) memcpy(dst, src, bytes);
    else lp_copy_to_device(dst, src, bytes);
}

// Set the weights from fp32 host values of the whole flat array: the compute-type params get all of them
// (stage 3: the tensors outside the layers, and this rank's shard), the master weights this rank's shard.
static inline void lp_zero_set_weights(LPZero* z, const float* flat) {
    if (z->par->zero >= 3) {
        for (int i = 0; i < LP_NUM_PARAMS; i++)
            if (lp_zero_whole(z, i)) lp_to_device_floatX(z->w[i], flat + z->param_offsets[i], z->param_sizes[i]);
        if (z->params_on_host) lp_to_floatX(z->param_shard, flat + z->shard_start, lp_zero_shard_count(z));
        else lp_to_device_floatX(z->param_shard, flat + z->shard_start, lp_zero_shard_count(z));
        z->layer_in_buf[0] = z->layer_in_buf[1] = z->piece_in_buf[0] = z->piece_in_buf[1] = -1;
    } else {
        lp_to_device_floatX(z->params, flat, z->num_params);
    }
    lp_zero_state_in(z, z->master, flat + z->shard_start, lp_zero_shard_count(z) * sizeof(float));
}

// Zero the gradients for a new step (stage 2-3: the shard, and the whole tensors outside the layers).
static inline void lp_zero_clear_grads(LPZero* z) {
    if (z->par->zero >= 2) {
        lp_device_zero(z->grads, z->outside * sizeof(floatX));
        lp_device_zero(z->grad_shard, z->shard_size * sizeof(floatX));
    } else {
        lp_device_zero(z->grads, z->num_params * sizeof(floatX));
    }
}

// The part of the flat parameters [first, first + n) in each rank's shard, as counts in rank order.
static inline void lp_zero_owner_counts(const LPZero* z, size_t first, size_t n, int* counts) {
    if (z->dp->size > LP_MAX_SHARDS)
        lp_fail("ZeRO supports at most %d data-parallel ranks, got %d", LP_MAX_SHARDS, z->dp->size);
    for (int r = 0; r < z->dp->size; r++) {
        size_t lo = z->shard_size * r, hi = lo + z->shard_size;
        size_t a = first > lo ? first : lo, b = first + n < hi ? first + n : hi;
        counts[r] = b > a ? (int)(b - a) : 0;
    }
}

// Stage 3: start gathering the weights of the flat parameters [flat, flat + count) from their shards.
static inline void lp_zero_gather_start(LPZero* z, floatX* dst, size_t flat, size_t count, LPPending* pend) {
    int counts[LP_MAX_SHARDS];
    lp_zero_owner_counts(z, flat, count, counts);
    size_t mine = flat > z->shard_start ? flat - z->shard_start : 0;
    const floatX* src = z->param_shard + mine;
#ifndef LLMPAR_CPU
    if (z->params_on_host) {  // --offload params: this rank's part comes up into its place in dst, gathered in place
        floatX* at = dst + lp_block_start(z->dp, counts);  // (on the compute stream, which the gather follows)
        if (counts[z->dp->rank]) cudaCheck(cudaMemcpyAsync(at, src, counts[z->dp->rank] * sizeof(floatX), cudaMemcpyHostToDevice, 0));
        src = at;
    }
#endif
    lp_all_gatherv_start(z->dp, src, dst, counts, pend);
}

// Stage 3: start gathering layer l's weights (if not there or on their way) into the buffer that does not
// hold layer `keep` (-1: none), else the one holding the layer furthest from l.
static inline void lp_zero_prefetch(LPZero* z, int l, int keep) {
    if (z->par->zero < 3 || l < 0 || l >= z->L || z->layer_in_buf[0] == l || z->layer_in_buf[1] == l) return;
    int d0 = z->layer_in_buf[0] < 0 ? 1 << 30 : abs(z->layer_in_buf[0] - l);
    int d1 = z->layer_in_buf[1] < 0 ? 1 << 30 : abs(z->layer_in_buf[1] - l);
    int b = z->layer_in_buf[0] == keep ? 1 : z->layer_in_buf[1] == keep ? 0 : d0 >= d1 ? 0 : 1;
    for (int i = 0; i < LP_NUM_PARAMS; i++)
        if (lp_layer_has(&z->cfg, i, z->layer0 + l))
            lp_zero_gather_start(z, z->layer_buf[b] + z->layer_offsets[i], z->param_offsets[i] + lp_zero_layer_index(z, i, l) *
                                 z->layer_size[i], z->layer_size[i], &z->gathering[b]);
    z->layer_in_buf[b] = l;
}

// Hook, before layer l's weights are used: they are here (stage 3: gathered and arrived), and layer
// `next`'s start coming into the other buffer while l runs (-1: none; forward prefetches l+1, backward
// l-1). Other stages hold every layer's weights: nothing to do.
static inline void lp_zero_fetch(LPZero* z, int l, int next) {
    if (z->par->zero < 3) return;
    lp_zero_prefetch(z, l, -1);
    lp_wait(z->dp, &z->gathering[z->layer_in_buf[0] == l ? 0 : 1]);
    lp_zero_prefetch(z, next, l);
}

// Stage 2-3: sum the gradients src of the flat parameters [flat, flat + count) over dp, in place; each
// rank adds the average of its part into grad_shard, and src is left undefined. (The tensors held whole,
// at the step's end.)
static inline void lp_zero_reduce_grads(LPZero* z, floatX* src, size_t flat, size_t count) {
    const LPGroup* g = z->dp;
    int counts[LP_MAX_SHARDS] = {0};
    lp_zero_owner_counts(z, flat, count, counts);
    lp_reduce_scatterv_start(g, src, counts, &z->now);
    lp_wait(g, &z->now);
    size_t start = flat > z->shard_start ? flat - z->shard_start : 0;
    lp_add_scaled(z->grad_shard + start, src + lp_block_start(g, counts), (size_t)counts[g->rank], 1.0f / g->size);
}

// Stage 2-3: start reducing the gradients of the flat parameters [flat, flat + count), at x in grad_buf[b],
// to their owners, in place: each rank's part is summed where it lies in the buffer.
static inline void lp_zero_reduce_start(LPZero* z, int b, floatX* x, size_t flat, size_t count) {
    const LPGroup* g = z->dp;
    int counts[LP_MAX_SHARDS];
    lp_zero_owner_counts(z, flat, count, counts);
    lp_reduce_scatterv_start(g, x, counts, &z->reducing_buf[b]);
    if (counts[g->rank] == 0) return;
    int k = z->reduce_adds[b]++;
    z->reduce_add_src[b][k] = x + lp_block_start(g, counts);
    z->reduce_add_at[b][k] = flat > z->shard_start ? flat - z->shard_start : 0;
    z->reduce_add_n[b][k] = (size_t)counts[g->rank];
}
// ... layer l's, in grad_buf[b] ...
static inline void lp_zero_reduce_layer_start(LPZero* z, int l, int b) {
    for (int i = 0; i < LP_NUM_PARAMS; i++)
        if (lp_layer_has(&z->cfg, i, z->layer0 + l))
            lp_zero_reduce_start(z, b, z->grad_buf[b] + z->layer_offsets[i], z->param_offsets[i] + lp_zero_layer_index(z, i, l) *
                                 z->layer_size[i], z->layer_size[i]);
}
// ... and once buffer b's have arrived, add the averages into grad_shard; buffer b is free again.
static inline void lp_zero_reduce_finish(LPZero* z, int b) {
    lp_wait(z->dp, &z->reducing_buf[b]);
    for (int k = 0; k < z->reduce_adds[b]; k++)
        lp_add_scaled(z->grad_shard + z->reduce_add_at[b][k], z->reduce_add_src[b][k], z->reduce_add_n[b][k],
                      1.0f / z->dp->size);
    z->reduce_adds[b] = 0;
}

// Hook, before layer l's backward: stage 2-3 give its gradients buffer l % 2, zeroed, once layer l+2's
// have left it.
static inline void lp_zero_layer_begin(LPZero* z, int l) {
    if (z->par->zero < 2) return;
    lp_zero_reduce_finish(z, l % 2);
    z->layer_grads = z->grad_buf[l % 2];
    lp_device_zero(z->layer_grads, z->layer_params * sizeof(floatX));
}

// Hook, after layer l's backward (its gradients for this micro-batch are complete; `last`: the step's last
// micro-batch). Stage 2-3: they start their reduction to the owners (with overlap it runs on while layer
// l-1's backward does). Stage 0 with overlap, on the last micro-batch: once the done layers not yet
// reducing hold bucket_bytes (or l is the first layer), they start their all-reduce: in the flat layout
// each tensor's slices of consecutive layers are contiguous, so a bucket is one all-reduce per tensor.
static inline void lp_zero_layer_done(LPZero* z, int l, int last) {
    if (z->par->zero >= 2) {
        lp_zero_reduce_layer_start(z, l, l % 2);
        if (!z->par->overlap) lp_zero_reduce_finish(z, l % 2);
    } else if (last && z->par->overlap && z->par->zero == 0 && z->dp && z->dp->size > 1 &&
               (l == 0 || (z->unreduced - l) * z->layer_params * sizeof(floatX) >= z->par->bucket_mb * 1048576.0)) {
        for (int i = 0; i < LP_NUM_PARAMS; i++) {  // (the layers [l, unreduced) that have tensor i)
            size_t n = (lp_zero_layer_index(z, i, z->unreduced) - lp_zero_layer_index(z, i, l)) * z->layer_size[i];
            if (lp_is_layer_tensor(i) && n) lp_all_reduce_start(z->dp, lp_zero_grads(z, i, l), n, &z->reducing);
        }
        z->unreduced = l;
        z->layers_reducing = 1;
    }
}

// Hook, after the whole backward: stage 2-3's last layer reductions arrive.
static inline void lp_zero_backward_done(LPZero* z) {
    for (int b = 0; b < 2 && z->par->zero >= 2; b++) lp_zero_reduce_finish(z, b);
    z->unreduced = z->L;
}

// wte's piece k: its first row (*r0) and its number of rows.
static inline size_t lp_zero_piece(const LPZero* z, int k, size_t* r0) {
    *r0 = (size_t)k * z->piece_rows;
    return z->wte_rows - *r0 < z->piece_rows ? z->wte_rows - *r0 : z->piece_rows;
}

// Stage 3, wte cut: start gathering piece k's weights into piece_w[k % 2] (unless there or on their way).
static inline void lp_zero_piece_prefetch(LPZero* z, int k) {
    if (k >= z->pieces || z->piece_in_buf[k % 2] == k) return;
    size_t r0, rows = lp_zero_piece(z, k, &r0), cols = z->param_sizes[LP_WTE] / z->wte_rows;
    lp_zero_gather_start(z, z->piece_w[k % 2], z->param_offsets[LP_WTE] + r0 * cols, rows * cols, &z->piece_gathering[k % 2]);
    z->piece_in_buf[k % 2] = k;
}
// Hook: the weights of wte's piece k (stage 3, wte cut: gathered from the shards that hold them, arrived,
// and piece k+1's on the way into the other buffer while k is used: the model walks the pieces in order).
static inline const floatX* lp_zero_wte(LPZero* z, int k) {
    size_t r0;
    lp_zero_piece(z, k, &r0);
    if (!z->wte_cut || z->par->zero < 3) return z->w[LP_WTE] + r0 * (z->param_sizes[LP_WTE] / z->wte_rows);
    lp_zero_piece_prefetch(z, k);
    lp_wait(z->dp, &z->piece_gathering[k % 2]);
    lp_zero_piece_prefetch(z, k + 1);
    return z->piece_w[k % 2];
}
// Hook: where the gradient of wte's piece k accumulates (wte cut: grad_buf[k % 2], zeroed, once what it
// held has arrived at its owners); once it is complete, lp_zero_wte_grad_done starts reducing a cut piece
// to its owners (with overlap it runs on while the next piece is computed; lp_zero_layer_begin and
// lp_zero_backward_done add it to the shard).
static inline floatX* lp_zero_wte_grad(LPZero* z, int k) {
    size_t r0, rows = lp_zero_piece(z, k, &r0), cols = z->param_sizes[LP_WTE] / z->wte_rows;
    if (!z->wte_cut) return z->g[LP_WTE] + r0 * cols;
    lp_zero_reduce_finish(z, k % 2);
    lp_device_zero(z->grad_buf[k % 2], rows * cols * sizeof(floatX));
    return z->grad_buf[k % 2];
}
static inline void lp_zero_wte_grad_done(LPZero* z, int k) {
    if (!z->wte_cut) return;
    size_t r0, rows = lp_zero_piece(z, k, &r0), cols = z->param_sizes[LP_WTE] / z->wte_rows;
    lp_zero_reduce_start(z, k % 2, z->grad_buf[k % 2], z->param_offsets[LP_WTE] + r0 * cols, rows * cols);
    if (!z->par->overlap) lp_zero_reduce_finish(z, k % 2);
}

// The step's gradients averaged over dp, for the optimizer: all-reduced (stage 0; with overlap the layers'
// reductions are already under way), reduce-scattered so each rank holds the average for its shard
// (stage 1), or, for the layers, already reduced during backward (stage 2-3): the tensors outside the
// layers were accumulated whole over the micro-batches and are reduced now.
static inline void lp_zero_average(LPZero* z) {
    const LPGroup* dp = z->dp;
    if (z->par->zero >= 2) {
        for (int i = 0; i < LP_NUM_PARAMS; i++)
            if (lp_zero_whole(z, i)) lp_zero_reduce_grads(z, z->g[i], z->param_offsets[i], z->param_sizes[i]);
    } else if (dp && dp->size > 1) {
        if (z->par->zero == 1) {
            lp_reduce_scatter(dp, z->grads, z->shard_size, 1);
        } else if (z->layers_reducing) {  // finish the layers', reduce the rest
            lp_wait(dp, &z->reducing);
            for (int i = 0; i < LP_NUM_PARAMS; i++)
                if (!lp_is_layer_tensor(i)) lp_all_reduce(dp, z->g[i], z->param_sizes[i], 1);
        } else {
            lp_all_reduce(dp, z->grads, z->num_params, 1);
        }
    }
    z->layers_reducing = 0;
}
#endif  // LLMPAR_IMPLEMENTATION

// ----------------------------------------------------------------------------------------------------
// 9. model
//
// One rank's GPT-2: the math of forward and backward, and the activations the backward pass needs, per
// layer. Its parameters (the 16 tensors back to back, llm.c order: one flat array), their gradients and
// the optimizer state live in an LPZero (section 8): layer tensors are reached through lp_layer_param /
// lp_layer_grad, which ask it, and around each layer forward and backward call its hooks (lp_zero_fetch,
// lp_zero_layer_begin, lp_zero_layer_done), which gather, buffer and average over dp as the ZeRO stage
// says. The forward pass fuses each residual add with the LayerNorm that follows it, so the residual
// stream is read once per block half.
//
// Tensor parallelism (Megatron-LM), t ranks in the group tp, each holding its slice of every split tensor
// (lp_param_split):
//
//                        x (N,C), the same on every rank
//                        |
//        f ------------- | -------------  forward: identity (SP: all-gather rows) / backward: all-reduce
//          qkv: W (3C,C) split by rows, heads/t heads per rank     fc: W (4C,C) split by rows
//            rank 0: [q0 k0 v0]  rank 1: [q1 k1 v1]                  rank 0: h0   rank 1: h1
//          attention on the rank's own heads                        GELU on the rank's own h
//          attproj: W (C,C) split by columns                        fcproj: W (C,4C) split by columns
//            rank r: y_r = att_r W[:, r]  (a partial sum)             rank r: y_r = h_r W[:, r]
//        g ------------- | -------------  forward: all-reduce (SP: reduce-scatter rows) / backward: identity
//                        y = y_0 + y_1 + ... ; + bias, + residual, LayerNorm: replicated (SP: on N/t rows)
//
// The embedding is vocab-parallel (wte split by rows; a rank's partial embedding is zero for tokens outside
// its slice, summed by a g), and so is the tied LM head (a column-parallel matmul after an f, its
// cross-entropy reduced over the group without gathering the logits: classifier_stats / classifier_grad).
// The Llama family splits the same way what it has: qkv's three blocks of NH, KV and KV heads each by rows
// (t divides KV: a rank keeps its query heads' K/V heads, lp_tp_check), SwiGLU's fc (2H,C) in its gate and up
// blocks, fcproj (C,H) by columns, and the untied head (headw) by rows as the tied one; RMSNorm and RoPE need no
// communication.

// Activation recomputation (--recompute): what backward computes again instead of keeping it from forward.
//   none       keep everything;
//   selective  the attention probabilities (B NH T T per layer: at T = 1024 as large as all the rest of a
//              GPT-2 124M layer's activations) and the GELU output, cheap to redo from what is kept (q, k
//              and the MLP's pre-activation): Megatron-LM's selective recomputation, plus llm.c's GELU.
//              The CUDA build's flash attention keeps no probabilities (its backward recomputes them from
//              q, k and each row's logsumexp whatever the flag), so there selective drops the GELU output;
//              its cublas attention keeps them as the CPU build does, and selective drops both;
//   full       only each layer's input, the residual stream: backward reruns the layer's forward up to
//              the GELU first (its TP collectives too), about a quarter more compute for the least memory.
// What is recomputed has room for one layer, in the scratch that the micro-batches in flight share.
// (LP_RECOMPUTE_*: beside LPParallel, section 3.)

// Attention (--attention): the CUDA build's choice of path. flash: FlashAttention-2's form, keeping q, k, v as
// the projection wrote them and each row's logsumexp; cublas: llm.c's attention without cuDNN, keeping q, k,
// v permuted per head and the (B,NH,T,T) probabilities, as the CPU build's loops always do; cudnn: cuDNN's
// fused attention (a build with it: make USE_CUDNN=1, llmpar_cudnn.cpp), keeping what flash keeps.
enum { LP_ATTENTION_FLASH, LP_ATTENTION_CUBLAS, LP_ATTENTION_CUDNN };
static const char* const lp_attention_names[] = {"flash", "cublas", "cudnn", NULL};
#ifdef LLMPAR_IMPLEMENTATION
// Whether attention keeps its probabilities (the CPU build's loops, the CUDA build's cublas path).
int lp_attention_materialised(int attention) {
#ifdef LLMPAR_CPU
    (void)attention;
    return 1;
#else
    return attention == LP_ATTENTION_CUBLAS;
#endif
}

#ifndef LLMPAR_CPU
// The attention that keeps no probabilities (lp_attention_materialised is 0): flash, or cuDNN's (multi-head
// only: lp_model_create refuses it with KV heads).
static inline void lp_fused_attention_forward_gpu(int attention, floatX* out, float* lse, const floatX* qkv, int B, int T, int C, int NH,
                                                  int KV) {
#ifdef LLMPAR_CUDNN
    if (attention == LP_ATTENTION_CUDNN) {
        const char* why = lp_cudnn_attention_forward(out, lse, qkv, B, T, C, NH);
        if (why) lp_fail("%s", why);
        return;
    }
#endif
    (void)attention;
    lp_flash_attention_forward_gpu(out, lse, qkv, B, T, C, NH, KV);
}
static inline void lp_fused_attention_backward_gpu(int attention, floatX* dqkv, const floatX* dout, const floatX* out, const floatX* qkv,
                                                   const float* lse, int B, int T, int C, int NH, int KV) {
#ifdef LLMPAR_CUDNN
    if (attention == LP_ATTENTION_CUDNN) {
        const char* why = lp_cudnn_attention_backward(dqkv, dout, out, qkv, lse, B, T, C, NH);
        if (why) lp_fail("%s", why);
        return;
    }
#endif
    (void)attention;
    lp_flash_attention_backward_gpu(dqkv, dout, out, qkv, lse, B, T, C, NH, KV);
}
#endif
#endif  // LLMPAR_IMPLEMENTATION

typedef struct {
    floatX* encoded;    // (Nr,C)      wte + wpe: the residual stream entering layer 0
    floatX* ln1;        // (L,Nr,C)
    float* ln1_mean;    // (L,Nr)
    float* ln1_rstd;    // (L,Nr)
    // materialised attention (lp_attention_materialised) keeps qkvr and att, flash attention qkvs and lse
    floatX* qkvr;       // (L,B,NHl+2KVl,T,HS) this rank's q, k, v permuted per head
    floatX* att;        // (L,B,NHl,T,T)  attention probabilities
    floatX* qkvs;       // (L,N,QKVl)  this rank's q, k, v as the qkv projection wrote them
    float* lse;         // (L,B,NHl,T) logsumexp of each attention row's scaled scores
    floatX* atty;       // (L,N,Cl)    attention output before its projection
    floatX* residual2;  // (L,Nr,C)    residual after attention
    floatX* ln2;        // (L,Nr,C)
    float* ln2_mean;    // (L,Nr)
    float* ln2_rstd;    // (L,Nr)
    floatX* fch;        // (Ld,N,Ff)   MLP pre-activation (the dense layers'; SwiGLU: each row's gate, then up)
    floatX* fch_gelu;   // (Ld,N,Fl)
    // the MoE layers' MLP (Lm of them): N tokens routed to K experts each, so at most KN rows in expert order
    float* probs;       // (Lm,N,E)    the router's softmax
    float* rlse;        // (Lm,N)      logsumexp of the router's logits (the z-loss)
    int* expert;        // (Lm,N,K)    each token's experts, best first
    float* gate;        // (Lm,N,K)    and their gates
    int* pos;           // (Lm,N,K)    the row of each (token, choice) in expert order; -1: dropped
    int* src;           // (Lm,KN)     the token of each row in expert order
    int* routes;        // (Lm,3E+2)   the dispatch's row offsets and counts, the statistics' sums (lp_moe_dispatch)
    floatX* xp;         // (Lm,KN,C)   the MLP's input rows in expert order
    // the rows this rank's experts take: its own (R = KN), or with expert parallelism every EP rank's that
    // chose its experts (R: lp_moe_expert_rows), in its experts' order
    floatX* xe;         // (Lm,R,C)    their input (expert parallelism; else xp)
    int* eorder;        // (Lm,R)      expert parallelism: each one's place among the rows received
    int* einv;          // (Lm,R)      and each received row's place among them
    floatX* efch;       // (Lm,R,Ff)   the experts' pre-activation (SwiGLU: each row's gate, then up)
    floatX* efch_gelu;  // (Lm,R,Fl)
    floatX* yp;         // (Lm,KN,C)   the experts' outputs for this rank's rows (TP: partial sums)
    floatX* residual3;  // (L,Nr,C)    residual after the MLP (the block's output)
    floatX* lnf;        // (Nr,C)
    float* lnf_mean;    // (Nr)
    float* lnf_rstd;    // (Nr)
    floatX* logits;     // (N,Vl)      overwritten by their gradient in classifier_grad
    float* losses;      // (N)
    float* stats;       // (t,N,3)     classifier statistics of each rank's slice of the vocabulary
    // scratch, reused within a step
    floatX* qkv;        // (N,QKVl) forward: qkv; backward: dqkv
    floatX* btc;        // (N,C)    partial sums: row-parallel outputs, column-parallel input gradients
    floatX* full;       // (N,C)    sequence parallelism: rows gathered from the group (else unused)
    floatX* dresidual;  // (Nr,C)   gradient of the residual stream
    floatX* dfch;       // (N,Ff)     fc's output gradient (Ff: Fl, SwiGLU 2 Fl)
    floatX* dact;       // (N,Fl)     SwiGLU's output gradient (a MoE layer's: one expert's rows, up to R)
    floatX* dqkvr;      // (N,QKVl) materialised attention's backward
    floatX* datt;       // (B,NHl,T,T)
    floatX* dy;         // (B,NHl,T,HS) attention output gradient, permuted
    floatX* ring;       // (4,N,2 KVl HS) context parallelism's ring: two K/V blocks in flight, then (backward) their gradients
    float* ring_sum;    // (B,NHl,T) its rows' running sums of exp(score - max)
    floatX* rlogits;    // (N,E)    a MoE layer's router logits, then their gradient
    float* dgate;       // (t,N,K)  the gates' gradients, each TP rank's part (of its experts' partial outputs)
    float* daux;        // (E)      the balance loss's gradient of each expert's probability
    int* eplan;         // (2E)     expert parallelism: where the received rows' runs begin (lp_moe_exchange_order)
    floatX* dyp;        // (KN,C)   the experts' output gradients for this rank's rows, then their input gradients
    floatX* dye;        // (R,C)    expert parallelism: the same in its experts' order (forward: their outputs)
    floatX* dyr;        // (R,C)    expert parallelism: as received, in the senders' order (forward: the inputs)
    floatX* defch;      // (R,Ff)
    floatX* rdx;        // (N,C)    the router's input gradient
    floatX* aux_lnf;    // (Nr,C)   auxiliary losses, recomputed in backward: the final LayerNorm's output,
    float* aux_mean;    // (Nr)
    float* aux_rstd;    // (Nr)
    floatX* aux_logits; // (N,Vl)   and the logits, then their gradient
} LPActivations;
// Shapes: N = B*T rows; Nr the rows of the residual stream this rank holds (N, or N/t with sequence
// parallelism); Cl = C/t, NHl = NH/t, KVl = KV/t, QKVl = (NHl + 2 KVl) HS, Fl = H/t (GELU's H: 4C), Vl = Vp/t:
// this rank's channels of attention, heads, K/V heads, qkv rows, MLP width and vocabulary slice. A norm's mean
// is NULL with RMSNorm. A mixture of experts: E experts, K per token; of the chunk's L layers,
// Ld dense and Lm MoE.

// Where the rank's flat parameters sit in the canonical layout (the llm.c file's, unsplit): runs of values
// contiguous in both, `local` in the flat parameters of part `part` (LPModel's zero, or its experts). A
// `copy` run holds values another rank holds too and writes to files: a tensor TP replicates (TP rank 0
// writes it), or the last pipeline chunk's wte (the first chunk's is the original).
typedef struct {
    size_t local, canon, n;
    int part, copy;
} LPRun;

// How a mixture of experts trains (section 9's MoE layer): what its experts take and the losses that
// balance them. Zeros: no dropping, no balance loss, no z-loss.
typedef struct {
    float capacity;  // an expert takes at most ceil(capacity * K N / E) of a micro-batch's K N rows (0: all of them)
    float aux_coef;  // the balance loss's coefficient (Switch: E * sum_e f_e P_e)
    float z_coef;    // the router z-loss's (ST-MoE: the mean squared logsumexp of the router's logits)
} LPMoEOptions;

// A mixture of experts' statistics over a step, as sums (so micro-batches, chunks and ranks add them): the
// balance and z-losses of its MoE layers (each micro-batch's weighted as its loss is: dloss N), the rows
// routed and dropped, and over `passes` (a MoE layer's forward of a micro-batch) the busiest expert's share
// of the rows.
typedef struct {
    double aux, z, routed, dropped, busiest, passes;
} LPMoEStats;
#define LP_MOE_STATS 6

// What lp_model_create makes, besides the shape: set by name, `LPModelOptions o = {.proc = &proc};`, the
// rest 0. A model with no options (NULL) is the whole model on one rank.
typedef struct LPModelOptions {
    // the grid: this rank's TP slice and DP groups, and every parallel setting (proc->par); NULL: one rank
    const LPProcess* proc;
    // pipeline: this model is chunk `chunk` of `chunks` (0: the whole model), running the model's layers
    // [layer0, layer0 + layers); the first chunk holds the embedding, the last the final LayerNorm and head
    int chunk, chunks, layer0, layers;
    // auxiliary losses: the outputs of the model's layers aux[0..num_aux) (counted from 1) also go through
    // the final LayerNorm and the tied head, their losses weighted by aux_weight and added to the loss
    const int* aux;
    int num_aux;
    float aux_weight;
    int attention;  // LP_ATTENTION_*: the CUDA build's attention path
    LPMoEOptions moe;  // a mixture of experts' training settings (the shape is cfg's)
} LPModelOptions;

// Sampling's key-value cache (lp_model_cache_alloc; kv NULL when not sampling): every layer's keys and values
// for positions [0, T) of B sequences, this rank's heads. A forward while it is set runs its (B, N) rows at
// positions [pos, pos + N): the rows' keys and values join the cache there and their queries attend to the
// positions up to their own (lp_attention_cached_forward), so a sampled token's forward is its row alone.
typedef struct {
    floatX* kv;  // (L,2,B,KVl,T,HS)
    int B, T, pos;
} LPKVCache;

typedef struct LPModel {
    LPConfig cfg;         // the whole model's shape
    // pipeline chunk: the model's layers [layer0, layer0 + L) (local layer l is the model's layer0 + l). The
    // first chunk holds wpe and wte (the embedding). The head (lnf, and the LM head's weights: a tied head's are
    // wte, an untied one's headw) is held by the last chunk and any with an auxiliary loss, and a tied head by the
    // first too (its wte): the chunks with `head` set. The first chunk's wte and the last's lnf and headw are the
    // originals, the other holders' are copies (bits of `copies`): their gradients are summed
    // (lp_step_reduce_grads), each counted and saved once. An untied head shares nothing with the embedding, so
    // the first and the last chunk hold no copies of each other's tensors.
    int L, layer0, first, last, head;
    unsigned copies;
    // auxiliary losses of this chunk: after local layer aux[j] (the model's layer aux_id[j], counted from
    // 1), weighted by aux_weight; aux_loss[j] sums their values over the step's micro-batches
#define LP_MAX_AUX 16
    int num_aux, aux[LP_MAX_AUX], aux_id[LP_MAX_AUX];
    float aux_weight, aux_loss[LP_MAX_AUX];
    size_t total_params;  // the whole model's parameter count
    LPRun* runs;          // this rank's parameters in the canonical layout (files)
    int num_runs;
    // how it is split (par->sp: sequence parallelism, par->recompute, ZeRO's settings); tensor parallelism:
    // this rank's slice of the heads, MLP and vocabulary (with sp, of the rows too)
    const LPParallel* par;
    const LPGroup* tp;
    int tp_size, tp_rank;
    // context parallelism (par->cp): a forward's T rows of a sequence are this rank's two chunks of it
    // (lp_cp_position), and attention is a ring over the group cp (lp_ring_attention_forward)
    const LPGroup* cp;
    int cp_size, cp_rank;
    int attention;        // LP_ATTENTION_*: the CUDA build's attention path
    // a mixture of experts: its settings, and its statistics summed over the step's micro-batches
    LPMoEOptions moe;
    LPMoEStats moe_stats;
    // this rank's weights, gradients and AdamW state, their flat layout, and how data parallelism and
    // ZeRO hold and average them (section 8); tensor i of layer l: lp_layer_param / lp_layer_grad. A mixture
    // of experts keeps its experts' tensors apart, in a second part (parts = 2) with its own LPZero, since
    // expert parallelism averages and shards them over another group; the router stays with the rest.
    // ep_size, ep_rank: the expert-parallel group's size and this rank's place in it (its experts).
    LPZero zero, experts;
    int parts, ep_size, ep_rank;
    const LPGroup* ep;
    // activations, allocated for (B, T) on the first forward; later passes may use any smaller (B, T).
    // A pipeline stage holds several micro-batches in flight: each has a slot of the activations backward
    // needs (and its input tokens); the scratch buffers are shared. act is the slot in use.
    int B, T;
    int cur_B, cur_T;   // shape of the last forward, which backward differentiates
    float dloss;        // the last forward's gradient seed: its loss's weight in the step times loss_scale (the
                        // auxiliary losses' seeds are scaled by it too)
    float loss_scale;   // dynamic loss scaling's multiplier of the gradients (LPLossScaler), 1 without; the stage
                        // sets it each step (LPStage.loss_scale)
    LPActivations act;
    int num_slots;
    LPActivations* slot_act;  // (num_slots)
    int* slot_inputs;   // (num_slots,B,T)
    // each MoE layer's dispatch, host (backward reads it): of each slot and MoE layer, its E+1 row offsets
    // and its E counts (LPLayerActs.offsets, counts); moe_routes is the slot's in use
    int *slot_moe_routes, *moe_routes;
    int* moe_host;      // (2E) host scratch: expert parallelism's plan of the received rows (lp_moe_exchange_order)
    void* act_memory;
    size_t act_bytes;
    int* inputs;        // (B,T) device
    int* targets;       // (B,T) device
    int* positions;     // (cp,T) device: the last forward's rows' positions in their sequences, every cp rank's (its
                        // rows: lp_model_rows_positions; the whole table: the ring's blocks), for wpe and RoPE
    int* inputs_host;   // (B,T) the slot's tokens, for the embedding backward
    // the first chunk's embedding gradient over a step's micro-batches, in rows of its own: row r for token
    // emb_tokens[r] (emb_row[token] = r, or -1), emb_rows in use of emb_cap; lp_model_embedding_backward
    floatX* emb_grad;
    int *emb_row, *emb_tokens, emb_rows, emb_cap;
    float* losses_host; // (B,T)
    LPKVCache cache;    // sampling's (kv NULL: a forward runs at positions [0, T) and keeps no cache)
} LPModel;

#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_model_add_run(LPModel* m, size_t local, size_t canon, size_t n, int part, int copy, int* cap) {
    LPRun* last = m->num_runs ? &m->runs[m->num_runs - 1] : NULL;
    if (last && last->local + last->n == local && last->canon + last->n == canon && last->part == part && last->copy == copy) {
        last->n += n;
        return;
    }
    if (m->num_runs == *cap) {
        *cap = *cap ? 2 * *cap : 64;
        m->runs = (LPRun*)realloc(m->runs, (size_t)*cap * sizeof(LPRun));
        if (!m->runs) lp_fail("out of host memory for the parameter layout");
    }
    LPRun* r = &m->runs[m->num_runs++];
    r->local = local;
    r->canon = canon;
    r->n = n;
    r->part = part;
    r->copy = copy;
}

// A MoE layer's dispatch on the host, of each slot (LPLayerActs.offsets ...): its E+1 row offsets, E
// counts and E+1 statistics (the device's routes, copied), and with expert parallelism the rows sent to and received from each of the ep ranks and its own
// experts' E/ep+1 row offsets: so many ints.
static inline size_t lp_moe_route_ints(const LPModel* m) {
    return lp_moe_dispatch_ints(m->cfg.moe_experts) + 2 * (size_t)m->ep_size + (size_t)m->cfg.moe_experts / m->ep_size + 1;
}
// The rows a rank's experts may take in a MoE layer of a micro-batch of N rows: its own K N without
// expert parallelism; with it, every rank's choices of its experts: ep K N at most, or E per-expert
// capacities (each of the ep ranks sends an expert at most its capacity).
static inline size_t lp_moe_expert_rows(const LPModel* m, size_t N) {
    size_t E = m->cfg.moe_experts, K = m->cfg.moe_topk, ep = m->ep_size, most = ep * K * N;
    if (ep == 1 || m->moe.capacity <= 0.0f) return most;
    size_t cap = (size_t)ceil((double)m->moe.capacity * K * N / E);
    return E * cap < most ? E * cap : most;
}

// The model's part p: its dense tensors (0) or its experts' (1).
LPZero* lp_model_part(const LPModel* m, int p) { return (LPZero*)(p ? &m->experts : &m->zero); }
static inline LPZero* lp_tensor_part(const LPModel* m, int i) { return lp_model_part(m, m->parts > 1 && lp_is_expert_tensor(i)); }

// Map this rank's flat parameters to the canonical layout, tensor by tensor (of a layer tensor, the
// chunk's layers): a rows-split matrix gives one run per block (its rows are contiguous), a columns-split
// one a run per row. An expert tensor's rows come in E equal groups, one per expert: this rank's are the
// groups of its experts (an expert's fc is one of the E blocks TP splits; with SwiGLU two, its gate and up).
static inline void lp_model_build_runs(LPModel* m) {
    int t = m->tp_size, r = m->tp_rank, cap = 0, E = m->cfg.moe_experts, El = E / m->ep_size, e0 = m->ep_rank * El;
    size_t local[2] = {0, 0}, canon = 0;
    for (int i = 0; i < LP_NUM_PARAMS; i++) {
        size_t count, rows, cols;
        int blocks, split = lp_param_split[i], p = m->parts > 1 && lp_is_expert_tensor(i), ex = p;
        lp_param_shape(&m->cfg, i, &count, &rows, &cols, &blocks);
        if (!count) continue;  // a tensor the family lacks
        int layer = lp_is_layer_tensor(i), l0 = layer ? m->layer0 : 0, l1 = layer ? l0 + m->L : m->zero.param_sizes[i] > 0;
        int copy = (split == LP_REPLICATED && r > 0) || (m->copies >> i & 1);
        size_t g0 = ex ? rows / E * e0 : 0, g1 = ex ? rows / E * (e0 + El) : rows;  // this rank's experts' rows
        for (int l = l0; l < l1; l++) {
            if (layer && !lp_layer_has(&m->cfg, i, l)) continue;
            size_t mat = canon + (layer ? (size_t)lp_layers_having(&m->cfg, i, 0, l) : 0) * rows * cols;  // this layer's matrix
            if (split == LP_REPLICATED) {
                lp_model_add_run(m, local[p], mat + g0 * cols, (g1 - g0) * cols, p, copy, &cap);
                local[p] += (g1 - g0) * cols;
            } else if (split == LP_SPLIT_ROWS) {
                int per_expert = ex ? blocks / E : 0;  // (its fc's blocks: 1, SwiGLU's 2)
                for (int k = ex ? e0 * per_expert : 0; k < (ex ? (e0 + El) * per_expert : blocks); k++) {
                    size_t b0, per = lp_param_block(&m->cfg, i, k, &b0) / t;  // this rank's rows of block k
                    lp_model_add_run(m, local[p], mat + (b0 + r * per) * cols, per * cols, p, copy, &cap);
                    local[p] += per * cols;
                }
            } else {
                size_t w = cols / t;  // this rank's columns of each row
                for (size_t j = g0; j < g1; j++, local[p] += w) lp_model_add_run(m, local[p], mat + j * cols + r * w, w, p, copy, &cap);
            }
        }
        canon += count * rows * cols;
    }
    for (int p = 0; p < m->parts; p++)
        if (local[p] != lp_model_part(m, p)->num_params)
            lp_fail("internal: parameter layout covers %zu of %zu values", local[p], lp_model_part(m, p)->num_params);
    m->total_params = canon;
}

// Allocate a model of shape cfg as the options say (NULL: the whole model on one rank): split over the grid
// of o->proc as its LPParallel says (ZeRO over its DP group: section 8).
void lp_model_create(LPModel* m, const LPConfig* cfg, const LPModelOptions* o) {
    memset(m, 0, sizeof(*m));
    m->cfg = *cfg;
    LPModelOptions none;
    memset(&none, 0, sizeof(none));
    const LPModelOptions* split = o ? o : &none;
    const LPProcess* proc = split->proc;
    m->par = proc ? proc->par : &lp_parallel_one;
    m->tp = proc ? &proc->group[LP_TP] : NULL;
    m->tp_size = m->tp ? m->tp->size : 1;
    m->tp_rank = m->tp ? m->tp->rank : 0;
    m->cp = proc ? &proc->group[LP_CP] : NULL;
    m->cp_size = m->cp ? m->cp->size : 1;
    m->cp_rank = m->cp ? m->cp->rank : 0;
    if (m->par->sp && m->tp_size < 2) lp_fail_all("%s: sequence parallelism splits rows over a TP group of 2 or more", LP_SETTING(sp));
    int chunks = split->chunks ? split->chunks : 1;
    m->layer0 = split->chunks ? split->layer0 : 0;
    m->L = split->chunks ? split->layers : cfg->num_layers;
    m->first = split->chunk == 0;
    m->last = split->chunk == chunks - 1;
    if (m->layer0 < 0 || m->L < 0 || m->layer0 + m->L > cfg->num_layers)
        lp_fail("internal: chunk layers [%d, %d) outside the model's %d", m->layer0, m->layer0 + m->L, cfg->num_layers);
    m->aux_weight = split->aux_weight;
    m->loss_scale = 1.0f;
    m->moe = split->moe;
    if (m->moe.capacity < 0.0f || m->moe.aux_coef < 0.0f || m->moe.z_coef < 0.0f)
        lp_fail("a mixture of experts' capacity %g, balance loss %g and z-loss %g coefficients must be 0 or more", m->moe.capacity,
                m->moe.aux_coef, m->moe.z_coef);
    m->attention = split->attention;
#ifndef LLMPAR_CPU
    if (m->attention == LP_ATTENTION_CUDNN && lp_kv_heads(cfg) != cfg->num_heads)
        lp_fail_all("flag --attention cudnn: not yet for grouped-query attention (%d KV heads of %d; --attention flash or cublas)",
                    lp_kv_heads(cfg), cfg->num_heads);
#endif
#if !defined(LLMPAR_CPU) && !defined(LLMPAR_CUDNN)
    if (m->attention == LP_ATTENTION_CUDNN)
        lp_fail_all("flag --attention cudnn: this build has no cuDNN; build one with make cudnn-frontend && make USE_CUDNN=1 train_gpt");
#endif
    for (int j = 0; j < split->num_aux; j++) {
        int l = split->aux[j] - 1 - m->layer0;  // the local layer whose output it is
        if (l < 0 || l >= m->L) continue;
        if (m->num_aux == LP_MAX_AUX) lp_fail("at most %d auxiliary losses", LP_MAX_AUX);
        m->aux_id[m->num_aux] = split->aux[j];
        m->aux[m->num_aux++] = l;
    }
    m->head = m->last || m->num_aux > 0 || (m->first && !cfg->untied);
    unsigned lm = 1u << LP_LNFW | 1u << LP_LNFB | (cfg->untied ? 1u << LP_HEADW : 1u << LP_WTE);  // the head's tensors
    unsigned holds = (m->first ? 1u << LP_WPE | 1u << LP_WTE : 0u) | (m->head ? lm : 0u);       // of those outside the layers
    m->copies = holds & ((m->first ? 0u : 1u << LP_WTE) | (m->last ? 0u : lm & ~(1u << LP_WTE)));
    m->parts = cfg->moe_experts ? 2 : 1;
    m->ep = proc ? &proc->group[LP_EP] : NULL;
    m->ep_size = m->ep ? m->ep->size : 1;
    m->ep_rank = m->ep ? m->ep->rank : 0;
    if (m->ep_size > 1 && !cfg->moe_experts)
        lp_fail_all("%s %d: expert parallelism splits a mixture of experts, and this model is dense", LP_SETTING(ep), m->ep_size);
    if (cfg->moe_experts % m->ep_size)
        lp_fail_all("%s %d: a MoE layer's %d experts do not split over %d ranks", LP_SETTING(ep), m->ep_size, cfg->moe_experts, m->ep_size);
    size_t sizes[2][LP_NUM_PARAMS];  // this rank's tensors of each part: its TP slice (its experts), of the chunk's layers
    lp_param_sizes(sizes[0], cfg, m->tp_size);
    for (int i = 0; i < LP_NUM_PARAMS; i++) {
        int having = lp_layers_having(cfg, i, 0, cfg->num_layers);
        if (lp_is_layer_tensor(i)) sizes[0][i] = having ? sizes[0][i] / having * lp_layers_having(cfg, i, m->layer0, m->layer0 + m->L) : 0;
        else if (!(holds >> i & 1)) sizes[0][i] = 0;  // held by another chunk
        sizes[1][i] = lp_is_expert_tensor(i) ? sizes[0][i] / m->ep_size : 0;
        if (lp_is_expert_tensor(i)) sizes[0][i] = 0;
    }
    size_t wte_rows = holds >> LP_WTE & 1 ? (size_t)cfg->padded_vocab_size / m->tp_size : 0;  // this rank's vocabulary slice
    // replicas that train apart average no gradients between them; a replica's cp ranks do (they train one model)
    int apart = m->par->diloco || m->par->gossip;
    const LPGroup* dp = !proc ? NULL : !apart ? lp_dp_group(proc) : m->par->cp > 1 ? &proc->group[LP_CP] : NULL;
    // the only copy of wte, beside layers (its pieces are at most a layer's): ZeRO-2/3 may cut it (section 8)
    int wte_alone = m->first && (m->last || cfg->untied) && m->L > 0;
    lp_zero_create(&m->zero, sizes[0], cfg, m->layer0, m->L, wte_rows, wte_alone, dp, m->par, split->chunk);
    if (m->parts > 1) {  // the experts: with expert parallelism averaged over their replicas (edp), their gradients
                         // sums over the ep ranks' batches, so the optimizer takes 1/ep of them (grad_scale)
        lp_zero_create(&m->experts, sizes[1], cfg, m->layer0, m->L, 0, 0, m->ep_size > 1 ? lp_experts_group(proc) : dp, m->par,
                       LP_MAX_CHUNKS + split->chunk);
        m->experts.grad_scale = 1.0f / m->ep_size;
    }
    for (int p = 0; p < m->parts && apart && proc; p++) lp_zero_replicas(lp_model_part(m, p), &proc->group[LP_DP]);
    lp_model_build_runs(m);
}

// Tensor i of layer l (a layer tensor that layer has): its weights, and where its gradient accumulates.
// NULL: a tensor the family lacks (a bias, an RMSNorm's), which the ops take as none.
static inline floatX* lp_layer_param(const LPModel* m, int i, int l) {
    return lp_family_has(&m->cfg, i) ? lp_zero_weights(lp_tensor_part(m, i), i, l) : NULL;
}
static inline floatX* lp_layer_grad(const LPModel* m, int i, int l) {
    return lp_family_has(&m->cfg, i) ? lp_zero_grads(lp_tensor_part(m, i), i, l) : NULL;
}
// The same of a tensor outside the layers (wpe, the final norm's, the head's).
static inline floatX* lp_model_param(const LPModel* m, int i) { return lp_family_has(&m->cfg, i) ? m->zero.w[i] : NULL; }
static inline floatX* lp_model_grad(const LPModel* m, int i) { return lp_family_has(&m->cfg, i) ? m->zero.g[i] : NULL; }

// ZeRO's hooks around a layer (section 8), on each of the model's parts.
static inline void lp_model_fetch(LPModel* m, int l, int next) {
    for (int p = 0; p < m->parts; p++) lp_zero_fetch(lp_model_part(m, p), l, next);
}
static inline void lp_model_layer_begin(LPModel* m, int l) {
    for (int p = 0; p < m->parts; p++) lp_zero_layer_begin(lp_model_part(m, p), l);
}
static inline void lp_model_layer_done(LPModel* m, int l, int last) {
    for (int p = 0; p < m->parts; p++) lp_zero_layer_done(lp_model_part(m, p), l, last);
}

// Set the weights from fp32 host values in the canonical layout: this rank's slice of them, as its flat
// parameters (section 8 keeps what ZeRO says).
void lp_model_set_weights(LPModel* m, const float* canon) {
    for (int p = 0; p < m->parts; p++) {
        LPZero* z = lp_model_part(m, p);
        float* host = (float*)lp_host_malloc((z->num_params ? z->num_params : 1) * sizeof(float), "weights");
        for (int k = 0; k < m->num_runs; k++)
            if (m->runs[k].part == p) memcpy(host + m->runs[k].local, canon + m->runs[k].canon, m->runs[k].n * sizeof(float));
        lp_zero_set_weights(z, host);
        free(host);
    }
}

// The fp32 master weights of a model that holds all of them (made alone: no ZeRO, TP, pipeline or expert
// split) in the canonical layout: canon, total_params values.
static inline void lp_model_get_weights(const LPModel* m, float* canon) {
    if (m->par->zero >= 1 || m->tp_size > 1 || m->ep_size > 1 || m->L != m->cfg.num_layers)
        lp_fail("internal: the weights of a sharded model are read a shard at a time (lp_checkpoint_save)");
    for (int p = 0; p < m->parts; p++) {
        LPZero* z = lp_model_part(m, p);
        float* host = (float*)lp_host_malloc((z->num_params ? z->num_params : 1) * sizeof(float), "weights");
        lp_zero_state_out(z, host, z->master, z->num_params * sizeof(float));
        for (int k = 0; k < m->num_runs; k++)
            if (m->runs[k].part == p) memcpy(canon + m->runs[k].canon, host + m->runs[k].local, m->runs[k].n * sizeof(float));
        free(host);
    }
}

// Read or write this rank's values [lo, lo + count) of part p's flat parameters (buf, host) at their places
// in f, whose values, in the model file's layout (lp_file_run: a GPT-2 file's is the canonical one), start at
// byte `base`. A write skips the copies (another rank writes the same values); a read leaves the padding rows a
// Llama 3 file lacks as they were in buf. Returns 0 or an errno.
static inline int lp_model_canonical_io(const LPModel* m, int p, FILE* f, long long base, float* buf, size_t lo, size_t count,
                                        int write) {
    for (int k = 0; k < m->num_runs; k++) {
        const LPRun* r = &m->runs[k];
        size_t a = r->local > lo ? r->local : lo, b = r->local + r->n < lo + count ? r->local + r->n : lo + count;
        if (r->part != p || a >= b || (write && r->copy)) continue;
        for (size_t x = a, n; x < b; x += n) {
            long long at;
            n = lp_file_run(&m->cfg, r->canon + (x - r->local), b - x, &at);
            if (at < 0) continue;
            if (fseeko(f, base + 4LL * at, SEEK_SET) != 0) return errno ? errno : EIO;
            size_t done = write ? fwrite(buf + (x - lo), sizeof(float), n, f) : fread(buf + (x - lo), sizeof(float), n, f);
            if (done != n) return errno ? errno : EIO;
        }
    }
    return 0;
}

// GPT-2 initialisation: N(0, 0.02) weights, the residual projections scaled by 1/sqrt(2L) so the
// residual stream's variance does not grow with depth; zero biases; LayerNorm (RMSNorm) weight 1, bias 0; the
// padding rows of wte (and of an untied head) stay zero. The whole model is drawn on every rank, so any split starts alike.
void lp_model_init_random(LPModel* m, uint64_t seed) {
    const LPConfig* c = &m->cfg;
    size_t sizes[LP_NUM_PARAMS];
    lp_param_sizes(sizes, c, 1);
    float* w = (float*)lp_host_malloc(m->total_params * sizeof(float), "initial weights");
    memset(w, 0, m->total_params * sizeof(float));
    uint64_t rng = seed ? seed : 1;
    float residual_std = 0.02f / sqrtf(2.0f * c->num_layers);
    float* t = w;
    for (int i = 0; i < LP_NUM_PARAMS; t += sizes[i], i++) {
        size_t n = sizes[i];
        if (i == LP_LN1W || i == LP_LN2W || i == LP_LNFW) {
            for (size_t j = 0; j < n; j++) t[j] = 1.0f;
        } else if (lp_param_decays(i)) {
            float std = (i == LP_ATTPROJW || i == LP_FCPROJW || i == LP_EXPFCPROJW) ? residual_std : 0.02f;
            if (i == LP_WTE || i == LP_HEADW) n = sizes[i] ? (size_t)c->vocab_size * c->channels : 0;
            for (size_t j = 0; j < n; j++) t[j] = std * lp_rand_normal(&rng);
        }
    }
    lp_model_set_weights(m, w);
    free(w);
}

// Lay out one slot of the activations: the ones backward reads at `stored`, the scratch at `scratch`.
// Called to count (NULL bases), then to carve. Returns the stored bytes; *scratch_bytes the scratch's.
// gpu: count them as the CUDA build keeps them (bf16, and flash attention's no probabilities), 0 as the CPU
// build does (fp32, the probabilities kept), on any build as the planner (dev/plan) does; a carve passes LP_BUILD_GPU.
static inline size_t lp_activations_layout(LPActivations* a, const LPModel* m, int B, int T, int gpu, char* stored, char* scratch,
                                           size_t* scratch_bytes) {
    const LPConfig* c = &m->cfg;
    size_t t = m->tp_size, L = m->L, C = c->channels, NHl = c->num_heads / t, Cl = C / t, Fl = lp_ffn_hidden(c) / t;
    size_t QKVl = lp_qkv_rows(c) / t, Ff = c->swiglu ? 2 * Fl : Fl, rms = c->rmsnorm;  // (fc's outputs: SwiGLU's gate and up)
    size_t N = (size_t)B * T, Nr = m->par->sp ? N / t : N, Vl = m->last ? c->padded_vocab_size / t : 0, off[2] = {0, 0};
    size_t head = m->last ? Nr : 0;  // the final LayerNorm and the logits live on the last chunk
    // recomputed activations: one layer's room, in scratch (region 1). Full recomputation keeps only the
    // residual stream (residual3, and encoded); selective drops the attention probabilities and GELU output
    int full = m->par->recompute == LP_RECOMPUTE_FULL, sel = m->par->recompute != LP_RECOMPUTE_NONE;
    size_t Lf = full ? (L > 0) : L, Ls = sel ? (L > 0) : L, x = gpu ? 2 : 4;
    size_t ring = m->cp_size > 1, mat = (gpu ? m->attention == LP_ATTENTION_CUBLAS : 1) && !ring;  // (the ring keeps what flash keeps)
    size_t E = c->moe_experts, K = c->moe_topk, Lm = lp_layers_having(c, LP_ROUTERW, m->layer0, m->layer0 + m->L), Ld = L - Lm;
    size_t Ldf = full ? (Ld > 0) : Ld, Lds = sel ? (Ld > 0) : Ld, Lmf = full ? (Lm > 0) : Lm, Lms = sel ? (Lm > 0) : Lm;
#define LP_BYTES_floatX x
#define LP_BYTES_float sizeof(float)
#define LP_BYTES_int sizeof(int)
#define LP_CARVE(region, field, type, count)                                                  \
    do {                                                                                      \
        char* base = region ? scratch : stored;                                               \
        a->field = base ? (type*)(base + off[region]) : NULL;                                 \
        off[region] += ((count) * LP_BYTES_##type + 255) & ~(size_t)255; /* aligned */        \
    } while (0)
    LP_CARVE(0, encoded, floatX, Nr * C);
    LP_CARVE(full, ln1, floatX, Lf * Nr * C);
    LP_CARVE(full, ln1_mean, float, !rms * Lf * Nr);
    LP_CARVE(full, ln1_rstd, float, Lf * Nr);
    LP_CARVE(full, qkvr, floatX, mat * Lf * N * QKVl);
    LP_CARVE(sel, att, floatX, mat * Ls * B * NHl * T * T);
    LP_CARVE(full, qkvs, floatX, !mat * Lf * N * QKVl);
    LP_CARVE(full, lse, float, !mat * Lf * B * NHl * T);
    LP_CARVE(full, atty, floatX, Lf * N * Cl);
    LP_CARVE(full, residual2, floatX, Lf * Nr * C);
    LP_CARVE(full, ln2, floatX, Lf * Nr * C);
    LP_CARVE(full, ln2_mean, float, !rms * Lf * Nr);
    LP_CARVE(full, ln2_rstd, float, Lf * Nr);
    LP_CARVE(full, fch, floatX, Ldf * N * Ff);
    LP_CARVE(sel, fch_gelu, floatX, Lds * N * Fl);
    LP_CARVE(full, probs, float, Lmf * N * E);
    LP_CARVE(full, rlse, float, Lmf * N);
    LP_CARVE(full, expert, int, Lmf * N * K);
    LP_CARVE(full, gate, float, Lmf * N * K);
    LP_CARVE(full, pos, int, Lmf * N * K);
    LP_CARVE(full, src, int, Lmf * K * N);
    LP_CARVE(full, routes, int, Lmf * lp_moe_dispatch_ints(E));
    LP_CARVE(full, xp, floatX, Lmf * K * N * C);
    size_t R = Lm ? lp_moe_expert_rows(m, N) : 0, ep = m->ep_size > 1;
    LP_CARVE(full, xe, floatX, ep * Lmf * R * C);
    LP_CARVE(full, eorder, int, ep * Lmf * R);
    LP_CARVE(full, einv, int, ep * Lmf * R);
    LP_CARVE(full, efch, floatX, Lmf * R * Ff);
    LP_CARVE(sel, efch_gelu, floatX, Lms * R * Fl);
    LP_CARVE(full, yp, floatX, Lmf * K * N * C);
    LP_CARVE(0, residual3, floatX, L * Nr * C);
    LP_CARVE(0, lnf, floatX, head * C);
    LP_CARVE(0, lnf_mean, float, !rms * head);
    LP_CARVE(0, lnf_rstd, float, head);
    LP_CARVE(0, logits, floatX, N * Vl);
    LP_CARVE(1, losses, float, N);
    LP_CARVE(1, stats, float, t * N * 3);
    LP_CARVE(1, qkv, floatX, N * QKVl);
    LP_CARVE(1, btc, floatX, N * C);
    LP_CARVE(1, full, floatX, m->par->sp ? N * C : 0);
    LP_CARVE(1, dresidual, floatX, Nr * C);
    LP_CARVE(1, dfch, floatX, N * Ff);
    LP_CARVE(1, dact, floatX, c->swiglu ? (Lm && R > N ? R : N) * Fl : 0);
    LP_CARVE(1, dqkvr, floatX, mat * N * QKVl);
    LP_CARVE(1, datt, floatX, mat * B * NHl * T * T);
    LP_CARVE(1, dy, floatX, mat * N * Cl);
    LP_CARVE(1, ring, floatX, ring * 4 * N * (QKVl - NHl * (C / c->num_heads)));  // (a row's K/V heads: 2 KVl HS)
    LP_CARVE(1, ring_sum, float, ring * B * NHl * T);
    size_t moe = Lm > 0;
    LP_CARVE(1, rlogits, floatX, moe * N * E);
    LP_CARVE(1, dgate, float, moe * t * N * K);
    LP_CARVE(1, daux, float, moe * E);
    LP_CARVE(1, eplan, int, ep * 2 * E);
    LP_CARVE(1, dyp, floatX, moe * K * N * C);
    LP_CARVE(1, dye, floatX, ep * R * C);
    LP_CARVE(1, dyr, floatX, ep * R * C);
    LP_CARVE(1, defch, floatX, moe * R * Ff);
    LP_CARVE(1, rdx, floatX, moe * N * C);
    size_t aux = m->num_aux ? 1 : 0;
    LP_CARVE(1, aux_lnf, floatX, aux * Nr * C);
    LP_CARVE(1, aux_mean, float, !rms * aux * Nr);
    LP_CARVE(1, aux_rstd, float, aux * Nr);
    LP_CARVE(1, aux_logits, floatX, aux * N * c->padded_vocab_size / t);
#undef LP_CARVE
    if (rms) a->ln1_mean = a->ln2_mean = a->lnf_mean = a->aux_mean = NULL;  // RMSNorm: no centering (lp_layernorm_forward)
#undef LP_BYTES_floatX
#undef LP_BYTES_float
#undef LP_BYTES_int
    *scratch_bytes = off[1];
    return off[0];
}

// Activations for micro-batches of (B, T), `slots` of them in flight at once.
void lp_model_alloc_activations(LPModel* m, int B, int T, int slots) {
    if ((long long)T * m->cp_size > m->cfg.max_seq_len)  // (context parallelism: T of the cp T positions)
        lp_fail("sequence length T = %lld exceeds the model's maximum %d", (long long)T * m->cp_size, m->cfg.max_seq_len);
    if (m->par->sp && (size_t)B * T % m->tp_size)
        lp_fail("sequence parallelism: the %d x %d rows of a batch do not split over %d ranks", B, T, m->tp_size);
    m->B = B;
    m->T = T;
    m->num_slots = slots;
    size_t scratch, stored = lp_activations_layout(&m->act, m, B, T, LP_BUILD_GPU, NULL, NULL, &scratch);
    m->act_bytes = scratch + slots * stored;
    m->act_memory = lp_device_malloc(m->act_bytes, "activations");
    size_t BT = (size_t)B * T;
    m->slot_act = (LPActivations*)lp_host_malloc(slots * sizeof(LPActivations), "activation slots");
    m->slot_inputs = (int*)lp_host_malloc(slots * BT * sizeof(int), "input tokens");
    for (int k = 0; k < slots; k++)
        lp_activations_layout(&m->slot_act[k], m, B, T, LP_BUILD_GPU, (char*)m->act_memory + scratch + k * stored, (char*)m->act_memory,
                              &scratch);
    m->inputs = (int*)lp_device_malloc(BT * sizeof(int), "input tokens");
    m->targets = (int*)lp_device_malloc(BT * sizeof(int), "target tokens");
    m->positions = (int*)lp_device_malloc((size_t)m->cp_size * T * sizeof(int), "positions");
    size_t Lm = lp_layers_having(&m->cfg, LP_ROUTERW, m->layer0, m->layer0 + m->L);
    if (Lm) {
        m->slot_moe_routes = (int*)lp_host_malloc(slots * Lm * lp_moe_route_ints(m) * sizeof(int), "expert routes");
        m->moe_host = (int*)lp_host_malloc(2 * (size_t)m->cfg.moe_experts * sizeof(int), "expert routes");
        m->moe_routes = m->slot_moe_routes;
    }
    m->losses_host = (float*)lp_host_malloc(BT * sizeof(float), "losses");
    m->act = m->slot_act[0];
    m->inputs_host = m->slot_inputs;
#ifndef LLMPAR_CPU
    lp_scratch_reserve(B, T, m->cfg.channels, m->cfg.num_heads, lp_kv_heads(&m->cfg));
    if (Lm) lp_scratch(&lp_moe_scratch, lp_moe_scratch_bytes(BT, m->cfg.moe_experts, m->cfg.moe_topk), "expert dispatch");
#endif
}

// Forward and backward work on slot k's activations from now on.
static inline void lp_model_use_slot(LPModel* m, int k) {
    m->act = m->slot_act[k];
    m->inputs_host = m->slot_inputs + (size_t)k * m->B * m->T;
    if (m->slot_moe_routes)
        m->moe_routes = m->slot_moe_routes + (size_t)k * lp_layers_having(&m->cfg, LP_ROUTERW, m->layer0, m->layer0 + m->L) *
                                                 lp_moe_route_ints(m);
}

static inline void lp_check_tokens(const int* tokens, size_t n, int V, const char* what) {
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            lp_fail("%s token id %d at batch position %zu is outside the vocabulary [0, %d)", what, tokens[i], i, V);
}

// --- tensor parallelism's conjugate operators, Megatron-LM's f and g. A column-parallel matmul (qkv, fc,
// the LM head) needs the whole input x on every rank and makes this rank's slice of the outputs; a
// row-parallel one (attproj, fcproj) takes that slice and makes a partial sum of the whole output.
//   f, before a column-parallel matmul: forward the identity (every rank has x), backward an all-reduce
//      (each rank's slice of the outputs gave a partial gradient of x);
//   g, after a row-parallel matmul: forward an all-reduce (add the partial outputs), backward the
//      identity (every rank needs the whole output gradient, and has it).
// With sequence parallelism (sp) a rank holds only its N/t rows of the residual stream, so f's forward
// is an all-gather of the rows and its backward a reduce-scatter; g's forward a reduce-scatter and its
// backward an all-gather. Same bytes on the wire as an all-reduce (which is a reduce-scatter followed by
// an all-gather), while LayerNorm, the residual adds and their activations are split t ways.
// f's forward and g's backward are one operation (rows in, whole tensor out); so are f's backward and
// g's forward (partial sums in, this rank's rows of their sum out).

// f forward: the whole (N,C) input of a column-parallel matmul from this rank's rows of it.
static inline const floatX* lp_tp_f_forward(LPModel* m, const floatX* rows, int N, int C) {
    if (!m->par->sp) return rows;
    size_t block = (size_t)N / m->tp_size * C;
    lp_copy_device(m->act.full + block * m->tp_rank, rows, block * sizeof(floatX));
    lp_all_gather(m->tp, m->act.full, block * sizeof(floatX));
    return m->act.full;
}
// f backward: partial (N,C) holds this rank's part of the input gradient; returns this rank's rows of
// the sum, in place.
static inline floatX* lp_tp_f_backward(LPModel* m, floatX* partial, int N, int C) {
    if (m->tp_size == 1) return partial;
    if (!m->par->sp) {
        lp_all_reduce(m->tp, partial, (size_t)N * C, 0);
        return partial;
    }
    size_t block = (size_t)N / m->tp_size * C;
    lp_reduce_scatter(m->tp, partial, block, 0);
    return partial + block * m->tp_rank;
}
// g forward: the sum of the ranks' partial outputs, this rank's rows of it.
static inline floatX* lp_tp_g_forward(LPModel* m, floatX* partial, int N, int C) { return lp_tp_f_backward(m, partial, N, C); }
// g backward: the whole output gradient from this rank's rows of it.
static inline const floatX* lp_tp_g_backward(LPModel* m, const floatX* rows, int N, int C) { return lp_tp_f_forward(m, rows, N, C); }

// The loss of logits (N,Vl) against m->targets, vocab-parallel: each rank's statistics of its slice are
// gathered over TP, never the logits. Leaves dloss * (softmax - onehot) in logits; returns the mean loss.
static inline float lp_model_classifier(LPModel* m, floatX* logits, int N, float dloss) {
    const LPConfig* c = &m->cfg;
    LPActivations* a = &m->act;
    int t = m->tp_size, Vl = c->padded_vocab_size / t, v0 = m->tp_rank * Vl;
    if (t == 1)
        lp_classifier_fused(logits, a->losses, dloss, m->targets, N, Vl, c->vocab_size);
    else {  // the slices' stats cross the group between the two launches
        lp_classifier_stats(a->stats + (size_t)3 * N * m->tp_rank, logits, m->targets, N, Vl, v0, c->vocab_size);
        lp_all_gather(m->tp, a->stats, (size_t)3 * N * sizeof(float));
        lp_classifier_grad(logits, a->losses, a->stats, t, dloss, m->targets, N, Vl, v0, c->vocab_size);
    }
    lp_copy_to_host(m->losses_host, a->losses, (size_t)N * sizeof(float));
    double sum = 0.0;
    for (int i = 0; i < N; i++) sum += m->losses_host[i];
    return (float)(sum / N);
}

// The LM head's weights in pieces of rows, column-parallel over the vocabulary (this rank's Vl rows): a tied
// head's are wte's pieces (ZeRO-2/3 may cut wte: lp_zero_wte gathers each), an untied head's headw, held whole
// (ZeRO-2/3 keep it whole as the other tensors outside the layers), one piece. Piece k: its weights, its first
// row (*r0) and its rows.
static inline int lp_model_head_pieces(const LPModel* m) { return m->cfg.untied ? 1 : m->zero.pieces; }
static inline const floatX* lp_model_head(LPModel* m, int k, size_t* r0, size_t* rows) {
    if (!m->cfg.untied) {
        *rows = lp_zero_piece(&m->zero, k, r0);
        return lp_zero_wte(&m->zero, k);
    }
    *r0 = 0;
    *rows = (size_t)m->cfg.padded_vocab_size / m->tp_size;
    return m->zero.w[LP_HEADW];
}
// ... and where piece k's gradient accumulates (a tied head's piece goes on to ZeRO with lp_zero_wte_grad_done).
static inline floatX* lp_model_head_grad(LPModel* m, int k, size_t* r0, size_t* rows) {
    if (!m->cfg.untied) {
        *rows = lp_zero_piece(&m->zero, k, r0);
        return lp_zero_wte_grad(&m->zero, k);
    }
    *r0 = 0;
    *rows = (size_t)m->cfg.padded_vocab_size / m->tp_size;
    return m->zero.g[LP_HEADW];
}

// The LM head: this rank's slice of the logits (N,Vl) from lnf, the final LayerNorm's output (this rank's rows of
// it; SP gathers them), a piece of the head's rows at a time. Padding rows of the head are zero.
static inline void lp_model_logits(LPModel* m, floatX* logits, const floatX* lnf, int N) {
    int C = m->cfg.channels, Vl = m->cfg.padded_vocab_size / m->tp_size;
    const floatX* x = lp_tp_f_forward(m, lnf, N, C);
    for (int k = 0; k < lp_model_head_pieces(m); k++) {
        size_t r0, rows;
        const floatX* w = lp_model_head(m, k, &r0, &rows);
        lp_gemm_strided(0, 1, N, (int)rows, C, x, C, w, C, 0, logits + r0, Vl);
    }
}

// Backward through the head from the logits' gradient: into the head's gradient (wte's or headw's), lnf's (lnf = layernorm(x),
// with its mean and rstd) and x's, added to act.dresidual.
static inline void lp_model_head_backward(LPModel* m, const floatX* x, const floatX* lnf, const float* mean, const float* rstd,
                                          const floatX* dlogits, int N) {
    int C = m->cfg.channels, Nr = m->par->sp ? N / m->tp_size : N, Vl = m->cfg.padded_vocab_size / m->tp_size;
    LPActivations* a = &m->act;
    LPZero* z = &m->zero;
    // LM head, piece by piece: the input's gradient (summed over the pieces), then the head's (SP gathers lnf's
    // rows again), each piece's handed to ZeRO when done; then lnf
    const floatX* xf = lp_tp_f_forward(m, lnf, N, C);
    for (int k = 0; k < lp_model_head_pieces(m); k++) {
        size_t r0, rows;
        const floatX* w = lp_model_head(m, k, &r0, &rows);
        lp_gemm_strided(0, 0, N, C, (int)rows, dlogits + r0, Vl, w, C, k > 0, a->btc, C);
    }
    for (int k = 0; k < lp_model_head_pieces(m); k++) {
        size_t r0, rows;
        floatX* dw = lp_model_head_grad(m, k, &r0, &rows);
        lp_gemm_strided(1, 0, (int)rows, C, N, dlogits + r0, Vl, xf, C, 1, dw, C);
        if (!m->cfg.untied) lp_zero_wte_grad_done(z, k);
    }
    lp_layernorm_backward(a->dresidual, z->g[LP_LNFW], lp_model_grad(m, LP_LNFB), lp_tp_f_backward(m, a->btc, N, C), x, z->w[LP_LNFW],
                           mean, rstd, Nr, C);
}
#endif  // LLMPAR_IMPLEMENTATION

// Layer l's activations in the slot in use, in the last forward's shape. What m->par->recompute drops has
// one layer's room, which every layer uses in turn.
typedef struct {
    const floatX* input;  // the residual stream entering the layer
    floatX *ln1, *atty, *residual2, *ln2, *fch, *fch_gelu, *residual3;
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd;
    floatX *qkvr, *att, *qkvs;  // (materialised attention's, flash attention's)
    float* lse;
    int moe;              // a MoE layer: its MLP's activations are these, not fch and fch_gelu
    float *probs, *rlse, *gate;
    int *expert, *pos, *src;
    floatX *xp, *efch, *efch_gelu, *yp;
    int* routes;          // (3E+2) device: the dispatch's offsets and counts, the statistics' sums (lp_moe_dispatch)
    int* offsets;         // (E+1) host: expert e's rows are [offsets[e], offsets[e + 1]) in expert order
    int* counts;          // (E) host: the rows that chose expert e, before any were dropped (then the sums)
    // expert parallelism: the rows sent to and received from each EP rank (ep each, host); the rows this
    // rank's experts take, in expert order (R of them: xe; without it, xp), local expert j's
    // [eoffsets[j], eoffsets[j + 1]) (host); where each came from in the received rows (eorder) and back (einv)
    int *sends, *recvs, *eoffsets;
    floatX* xe;
    int *eorder, *einv;
} LPLayerActs;
#ifdef LLMPAR_IMPLEMENTATION
static inline LPLayerActs lp_layer_acts(const LPModel* m, int l) {
    const LPActivations* a = &m->act;
    size_t t = m->tp_size, B = m->cur_B, T = m->cur_T, N = B * T, Nr = m->par->sp ? N / t : N, C = m->cfg.channels;
    size_t Fl = lp_ffn_hidden(&m->cfg) / t, Ff = m->cfg.swiglu ? 2 * Fl : Fl, NHl = m->cfg.num_heads / t, Cl = C / t;
    size_t QKVl = lp_qkv_rows(&m->cfg) / t;
    size_t f = m->par->recompute == LP_RECOMPUTE_FULL ? 0 : l, s = m->par->recompute == LP_RECOMPUTE_NONE ? l : 0;  // layer slots
    LPLayerActs x;
    memset(&x, 0, sizeof(x));  // (a dense layer's MoE fields stay NULL)
    // the MLP's: among the chunk's dense layers, or its MoE layers
    const LPConfig* c = &m->cfg;
    size_t E = c->moe_experts, K = c->moe_topk;
    x.moe = lp_is_moe_layer(c, m->layer0 + l);
    size_t kind = lp_layers_having(c, x.moe ? LP_ROUTERW : LP_FCW, m->layer0, m->layer0 + l);  // its place among them
    size_t kf = m->par->recompute == LP_RECOMPUTE_FULL ? 0 : kind, ks = m->par->recompute == LP_RECOMPUTE_NONE ? kind : 0;
    x.input = l == 0 ? a->encoded : a->residual3 + (size_t)(l - 1) * Nr * C;
    x.ln1 = a->ln1 + f * Nr * C;
    x.ln1_mean = a->ln1_mean ? a->ln1_mean + f * Nr : NULL;
    x.ln1_rstd = a->ln1_rstd + f * Nr;
    x.qkvr = a->qkvr + f * N * QKVl;
    x.att = a->att + s * B * NHl * T * T;
    x.qkvs = a->qkvs + f * N * QKVl;
    x.lse = a->lse + f * B * NHl * T;
    x.atty = a->atty + f * N * Cl;
    x.residual2 = a->residual2 + f * Nr * C;
    x.ln2 = a->ln2 + f * Nr * C;
    x.ln2_mean = a->ln2_mean ? a->ln2_mean + f * Nr : NULL;
    x.ln2_rstd = a->ln2_rstd + f * Nr;
    x.fch = a->fch + kf * N * Ff;
    x.fch_gelu = a->fch_gelu + ks * N * Fl;
    x.residual3 = a->residual3 + (size_t)l * Nr * C;
    if (!x.moe) return x;  // a dense layer: no routing, no experts
    x.probs = a->probs + kf * N * E;
    x.rlse = a->rlse + kf * N;
    x.expert = a->expert + kf * N * K;
    x.gate = a->gate + kf * N * K;
    x.pos = a->pos + kf * N * K;
    x.src = a->src + kf * K * N;
    x.routes = a->routes + kf * lp_moe_dispatch_ints(E);
    x.xp = a->xp + kf * K * N * C;
    x.efch = a->efch + kf * lp_moe_expert_rows(m, N) * Ff;
    x.efch_gelu = a->efch_gelu + ks * lp_moe_expert_rows(m, N) * Fl;
    x.yp = a->yp + kf * K * N * C;
    x.offsets = m->moe_routes + kind * lp_moe_route_ints(m);
    x.counts = lp_moe_counts(x.offsets, E);
    x.sends = x.offsets + lp_moe_dispatch_ints(E);
    x.recvs = x.sends + m->ep_size;
    x.eoffsets = x.recvs + m->ep_size;
    size_t R = lp_moe_expert_rows(m, N), ep = m->ep_size > 1;
    x.xe = ep ? a->xe + kf * R * C : x.xp;
    x.eorder = a->eorder + kf * R;
    x.einv = a->einv + kf * R;
    return x;
}

// --- A mixture of experts (Switch Transformer, GShard; Megatron-LM's MoE layer): in a MoE layer the MLP is
// E expert MLPs of the dense one's shape, and a router, a linear map (E,C) of the MLP's input, whose softmax
// chooses K experts for each token (lp_moe_route_row). Each expert runs its MLP on the rows that chose it,
// in expert order (one matmul per expert), and each token's output is its experts' outputs weighted by their
// gates. So the layer holds E times the MLP's weights, and a token meets K of them.
//
//          ln2 (N,C) ---- router (E,C): logits (N,E), softmax, top-K ---- expert, gate (N,K)
//            |                                                              |
//          permute: the rows that chose expert e, contiguous (src, offsets; capacity drops the rest)
//            |
//          expert e: fc (H,C) + GELU + fcproj (C,H) on its rows             |
//            (SwiGLU: fc (2H,C), its gate and up, + SwiGLU + fcproj (C,H), as the dense MLP's)
//            |                                                              |
//          combine: y[t] = sum_k gate[t,k] * out[pos[t,k]]  --------------------
//
// Capacity (--moe-capacity F): an expert takes at most ceil(F K N / E) of a micro-batch's K N rows, first
// come first served in token order; a dropped row adds nothing (its token goes on by the residual alone). The
// balance loss (Switch) coef * E * sum_e f_e P_e (f_e the share of the rows that chose e, P_e the mean
// probability of e) pushes the router toward even loads; the z-loss coef * mean(logsumexp^2) keeps its
// logits small. Both are a micro-batch's, weighted like its loss; their gradients reach the router's weights
// and, through its input (ln2's output), the layers below, as any loss's do.
// Tensor parallelism splits each expert's MLP as it splits the dense one (column- then row-parallel): the
// routing is every TP rank's (the same rows, the same router); TP rank 0 adds each expert's output bias; the
// combined output is a partial sum that the g after it adds up, as a dense MLP's is.

// Context parallelism splits each sequence over the cp group, while the balance loss is a micro-batch's (its
// sequences'): so the loads and probability sums it is made of (and the z-loss's sum) are summed over the
// group, and every cp rank computes that loss and its gradient from the whole sequences' statistics, as one
// rank holding them would (Megatron-Core sums them over its context-parallel group too). Sampling's cached
// passes run whole sequences on every rank: nothing to sum.
static inline int lp_moe_cp_split(const LPModel* m) { return m->cp_size > 1 && !m->cache.kv; }
// The rows the statistics of a micro-batch of N rows on this rank count: its sequences' whole.
static inline int lp_moe_stats_rows(const LPModel* m, int N) { return lp_moe_cp_split(m) ? N * m->cp_size : N; }
// Layer x's loads and sums on the host, summed over the cp group; the loads back to the device for the router's
// backward (lp_moe_aux_grad). This rank's row offsets stay its own: its experts run its rows.
static inline void lp_moe_cp_sum(LPModel* m, const LPLayerActs* x) {
    int E = m->cfg.moe_experts;
    float* sums = lp_moe_sums(x->offsets, E);
    float s[2 * LP_MAX_EXPERTS + 1];  // (the loads, exact in fp32, then the E+1 sums)
    for (int e = 0; e < E; e++) s[e] = (float)x->counts[e];
    memcpy(s + E, sums, (size_t)(E + 1) * sizeof(float));
    lp_all_reduce_host(m->cp, s, 2 * (size_t)E + 1, 0);
    for (int e = 0; e < E; e++) x->counts[e] = (int)s[e];
    memcpy(sums, s + E, (size_t)(E + 1) * sizeof(float));
    lp_copy_to_device(lp_moe_counts(x->routes, E), x->counts, (2 * (size_t)E + 1) * sizeof(int));
}

// Layer x's dispatch (lp_moe_dispatch_cpu) and routing statistics on the device, then the one copy of the
// layer's routing to the host (synchronous: the host needs its row offsets to launch the experts'
// matmuls, and its loads for the statistics): x->offsets, x->counts, the sums. Returns the rows kept, M.
static inline int lp_moe_dispatch_layer(LPModel* m, const LPLayerActs* x, int N) {
    int E = m->cfg.moe_experts, K = m->cfg.moe_topk;
    double cap = m->moe.capacity > 0.0f ? ceil((double)m->moe.capacity * K * N / E) : (double)N;  // (a count is at most N)
    lp_moe_dispatch(x->pos, x->src, x->routes, x->expert, N, E, K, cap < N ? (int)cap : N);
    lp_moe_stats(lp_moe_sums(x->routes, E), x->probs, x->rlse, N, E);
    lp_copy_to_host(x->offsets, x->routes, lp_moe_dispatch_ints(E) * sizeof(int));
    if (lp_moe_cp_split(m)) lp_moe_cp_sum(m, x);
    return x->offsets[E];
}

// Expert parallelism: the exchange of layer x's rows over the EP group. Each rank's kept rows per expert go
// round (an all-reduce of its row of an ep x E table), so this rank knows what it sends each rank (that
// rank's experts' rows: contiguous in expert order), what it receives from each (in the sender's expert
// order), and where each received row goes among its own experts' rows (local expert j's: rank 0's, then
// rank 1's, ...). Fills x->sends, recvs, eoffsets (host) and eorder, einv (device, from one copy of where
// each sender's rows of each local expert begin on either side).
static inline void lp_moe_exchange_plan(LPModel* m, const LPLayerActs* x) {
    int E = m->cfg.moe_experts, ep = m->ep_size, El = E / ep, me = m->ep_rank;
    float* table = (float*)lp_host_malloc((size_t)ep * E * sizeof(float), "expert exchange");  // (row counts: exact in fp32)
    memset(table, 0, (size_t)ep * E * sizeof(float));
    for (int e = 0; e < E; e++) table[(size_t)me * E + e] = (float)(x->offsets[e + 1] - x->offsets[e]);
    lp_all_reduce_host(m->ep, table, (size_t)ep * E, 0);
    int start[LP_MAX_SHARDS + 1] = {0};  // where each sender's rows begin among those received
    for (int r = 0; r < ep; r++) {
        x->sends[r] = x->offsets[(r + 1) * El] - x->offsets[r * El];
        x->recvs[r] = 0;
        for (int j = 0; j < El; j++) x->recvs[r] += (int)table[(size_t)r * E + me * El + j];
        start[r + 1] = start[r] + x->recvs[r];
    }
    int *plan = m->moe_host, groups = ep * El;  // (run r * El + j: sender r's rows of local expert j)
    x->eoffsets[0] = 0;
    for (int j = 0; j < El; j++) {
        int k = x->eoffsets[j];
        for (int r = 0; r < ep; r++) {
            int n = (int)table[(size_t)r * E + me * El + j];
            plan[r * El + j] = j == 0 ? start[r] : plan[r * El + j - 1] + (int)table[(size_t)r * E + me * El + j - 1];
            plan[groups + r * El + j] = k;
            k += n;
        }
        x->eoffsets[j + 1] = k;
    }
    free(table);
    lp_copy_to_device(m->act.eplan, plan, 2 * (size_t)groups * sizeof(int));
    lp_moe_exchange_order(x->eorder, x->einv, m->act.eplan, groups, start[ep]);
}

// The rows layer x's experts on this rank take (with expert parallelism, from every EP rank).
static inline int lp_moe_rows_taken(const LPModel* m, const LPLayerActs* x) {
    return m->ep_size > 1 ? x->eoffsets[m->cfg.moe_experts / m->ep_size] : x->offsets[m->cfg.moe_experts];
}

// Expert e's tensors in layer l (e among this rank's): its rows of the TP rank's fc (H/t of them; SwiGLU's
// gate, then up: 2H/t), its fcproj's columns, biases; each expert's values one after another, this many.
static inline size_t lp_expert_size(const LPModel* m, int i) {
    size_t C = m->cfg.channels, Fl = lp_ffn_hidden(&m->cfg) / m->tp_size, Ff = m->cfg.swiglu ? 2 * Fl : Fl;
    return i == LP_EXPFCW ? Ff * C : i == LP_EXPFCPROJW ? Fl * C : i == LP_EXPFCB ? Ff : C;
}
// (NULL: a tensor the family lacks, the biases without biases)
static inline floatX* lp_expert_param(const LPModel* m, int i, int l, int e) {
    floatX* w = lp_layer_param(m, i, l);
    return w ? w + e * lp_expert_size(m, i) : NULL;
}
static inline floatX* lp_expert_grad(const LPModel* m, int i, int l, int e) {
    floatX* g = lp_layer_grad(m, i, l);
    return g ? g + e * lp_expert_size(m, i) : NULL;
}

// Layer l's MoE MLP from ln2 to its experts' outputs (yp): the router and its choice, the dispatch, and each
// expert's MLP on its rows. (The gated sum follows in lp_model_forward, where a dense MLP's projection is.)
// With expert parallelism the rows go to their experts' ranks first (an all-to-all over the EP group), and
// the outputs come back the same way.
static inline void lp_moe_forward(LPModel* m, int l, const LPLayerActs* x) {
    int N = m->cur_B * m->cur_T, C = m->cfg.channels, Fl = lp_ffn_hidden(&m->cfg) / m->tp_size, E = m->cfg.moe_experts, K = m->cfg.moe_topk;
    int El = E / m->ep_size;
    LPActivations* a = &m->act;
    const floatX* in = lp_tp_f_forward(m, x->ln2, N, C);
    lp_matmul_forward(a->rlogits, NULL, in, lp_layer_param(m, LP_ROUTERW, l), NULL, N, C, E);
    lp_moe_route(x->probs, x->rlse, x->expert, x->gate, a->rlogits, N, E, K);
    lp_moe_permute(x->xp, in, x->src, lp_moe_dispatch_layer(m, x, N), C);
    const int* off = x->offsets;  // this rank's experts' rows in xe
    floatX* out = x->yp;          // and where their outputs go
    if (m->ep_size > 1) {         // every EP rank's rows for this rank's experts, received, in its experts' order
        lp_moe_exchange_plan(m, x);
        lp_all_to_all(m->ep, x->xp, x->sends, a->dyr, x->recvs, C * sizeof(floatX));
        lp_moe_permute(x->xe, a->dyr, x->eorder, lp_moe_rows_taken(m, x), C);
        off = x->eoffsets;
        out = a->dye;
    }
    for (int e = 0; e < El; e++) {
        size_t o = off[e];
        int n = off[e + 1] - off[e];
        if (n == 0) continue;
        if (m->cfg.swiglu) {  // fc's gate and up, then SwiGLU, as a dense layer's
            lp_matmul_forward(x->efch + o * 2 * Fl, NULL, x->xe + o * C, lp_expert_param(m, LP_EXPFCW, l, e),
                              lp_expert_param(m, LP_EXPFCB, l, e), n, C, 2 * Fl);
            lp_swiglu_forward(x->efch_gelu + o * Fl, x->efch + o * 2 * Fl, n, Fl);
        } else {
            lp_matmul_forward(x->efch_gelu + o * Fl, x->efch + o * Fl, x->xe + o * C, lp_expert_param(m, LP_EXPFCW, l, e),
                              lp_expert_param(m, LP_EXPFCB, l, e), n, C, Fl);
        }
        lp_matmul_forward(out + o * C, NULL, x->efch_gelu + o * Fl, lp_expert_param(m, LP_EXPFCPROJW, l, e),
                          m->tp_rank == 0 ? lp_expert_param(m, LP_EXPFCPROJB, l, e) : NULL, n, Fl, C);
    }
    if (m->ep_size > 1) {  // the outputs back to the ranks whose rows they are
        lp_moe_permute(a->dyr, a->dye, x->einv, lp_moe_rows_taken(m, x), C);
        lp_all_to_all(m->ep, a->dyr, x->recvs, x->yp, x->sends, C * sizeof(floatX));
    }
}

// The balance and z-losses of layer x's routing, and its loads, into the model's step statistics (forward
// only: full recomputation routes again in backward, the same way).
static inline void lp_moe_account(LPModel* m, const LPLayerActs* x, int N) {
    int E = m->cfg.moe_experts, K = m->cfg.moe_topk;
    float sums[LP_MAX_EXPERTS + 1];  // (lp_moe_dispatch_layer's, after the counts)
    memcpy(sums, x->counts + E, (size_t)(E + 1) * sizeof(float));
    double balance = 0.0, busiest = 0.0, weight = (double)m->dloss / m->loss_scale * N;  // (a micro-batch's weight in the step: 1 / micro-batches)
    double rows = lp_moe_stats_rows(m, N);  // (the counts' and sums' rows: under cp, the whole sequences')
    for (int e = 0; e < E; e++) {
        double f = (double)x->counts[e] / (rows * K);
        balance += f * sums[e] / rows;
        busiest = f > busiest ? f : busiest;
    }
    LPMoEStats* s = &m->moe_stats;
    s->aux += weight * m->moe.aux_coef * E * balance;
    s->z += weight * m->moe.z_coef * sums[E] / rows;
    s->routed += (double)N * K;
    s->dropped += (double)N * K - x->offsets[E];
    s->busiest += busiest;
    s->passes += 1.0;
}

// Backward through layer l's MoE MLP from the gradient of its output (dy, every row; TP: the whole of it),
// into its weights' gradients; leaves ln2's gradient (this rank's rows) in the returned rows of act.btc.
static inline floatX* lp_moe_backward(LPModel* m, int l, const LPLayerActs* x, const floatX* dy) {
    int t = m->tp_size, N = m->cur_B * m->cur_T, Nr = m->par->sp ? N / t : N, C = m->cfg.channels, Fl = lp_ffn_hidden(&m->cfg) / t;
    int E = m->cfg.moe_experts, K = m->cfg.moe_topk, swiglu = m->cfg.swiglu, Ff = swiglu ? 2 * Fl : Fl;
    LPActivations* a = &m->act;
    lp_moe_combine_backward(a->dyp, a->dgate + (size_t)m->tp_rank * N * K, dy, x->yp, x->pos, x->gate, N, K, C);
    if (t > 1) lp_all_gather(m->tp, a->dgate, (size_t)N * K * sizeof(float));  // each rank's part of the gates' gradients
    const int* off = x->offsets;  // this rank's experts' rows
    floatX* d = a->dyp;           // and their output gradients
    if (m->ep_size > 1) {         // to the experts' ranks, as the rows went
        lp_all_to_all(m->ep, a->dyp, x->sends, a->dyr, x->recvs, C * sizeof(floatX));
        lp_moe_permute(a->dye, a->dyr, x->eorder, lp_moe_rows_taken(m, x), C);
        off = x->eoffsets;
        d = a->dye;
    }
    for (int e = 0; e < E / m->ep_size; e++) {  // each expert's MLP backward; its input rows' gradients replace d's
        size_t o = off[e];
        int n = off[e + 1] - off[e];
        if (n == 0) continue;
        floatX* dfc = a->defch + o * Ff;  // fc's output gradient (GELU's: through it, fused into fcproj's backward)
        lp_matmul_backward(swiglu ? a->dact : dfc, lp_expert_grad(m, LP_EXPFCPROJW, l, e), lp_expert_grad(m, LP_EXPFCPROJB, l, e),
                           NULL, d + o * C, x->efch_gelu + o * Fl, lp_expert_param(m, LP_EXPFCPROJW, l, e), n, Fl, C,
                           swiglu ? NULL : x->efch + o * Fl);
        if (swiglu) lp_swiglu_backward(dfc, x->efch + o * Ff, a->dact, n, Fl);  // (into the gate's and the up's)
        lp_matmul_backward(d + o * C, lp_expert_grad(m, LP_EXPFCW, l, e), lp_expert_grad(m, LP_EXPFCB, l, e), NULL, dfc,
                           x->xe + o * C, lp_expert_param(m, LP_EXPFCW, l, e), n, C, Ff, NULL);
    }
    if (m->ep_size > 1) {  // the input rows' gradients back to their ranks
        lp_moe_permute(a->dyr, a->dye, x->einv, lp_moe_rows_taken(m, x), C);
        lp_all_to_all(m->ep, a->dyr, x->recvs, a->dyp, x->sends, C * sizeof(floatX));
    }
    lp_moe_unpermute(a->btc, a->dyp, x->pos, N, K, C);
    // the router: the balance loss's gradient of each probability, the gates', the z-loss's, into its logits
    lp_moe_aux_grad(a->daux, x->routes, m->moe.aux_coef, m->dloss, lp_moe_stats_rows(m, N), E, K);
    lp_moe_router_backward(a->rlogits, x->probs, x->rlse, x->expert, x->gate, a->dgate, t, a->daux, m->moe.z_coef * m->dloss, N, E, K);
    lp_matmul_backward(a->rdx, lp_layer_grad(m, LP_ROUTERW, l), NULL, NULL, a->rlogits, lp_tp_f_forward(m, x->ln2, N, C),
                       lp_layer_param(m, LP_ROUTERW, l), N, C, E, NULL);
    floatX* rows = lp_tp_f_backward(m, a->btc, N, C);  // the experts' parts summed over TP, then the router's (every rank's)
    lp_add_scaled(rows, a->rdx + (m->par->sp ? (size_t)m->tp_rank * Nr * C : 0), (size_t)Nr * C, 1.0f);
    return rows;
}

// --- context parallelism's ring attention (--cp). A rank's T rows of each sequence are two of its chunks
// (lp_cp_position), and their queries need the keys and values of every earlier position, which all cp ranks
// of the group hold between them. So the blocks travel around the ring: at step s = 0 .. cp-1 rank r works on
// the keys and values of rank r - s (mod cp) while it receives the next block from r - 1 and sends this one on to
// r + 1 (lp_exchange_start before the block's compute, so the transfer runs under it). Each block's scores merge
// into the rows' running output with the online softmax's statistics (lp_attention_block_forward), masked by
// the rows' true positions; the result is exact, as one rank's attention over the whole sequence. Backward
// passes the blocks around again, each with its keys' and values' gradient: a rank adds its queries' share and
// passes it on, and after cp steps each block's gradient arrives, complete, at the rank that owns it.
// Every rank keeps what flash attention keeps: q, k, v as the projection wrote them, the output, each row's
// logsumexp. Traffic per layer and rank: cp-1 sends of a block forward, 2 cp - 1 backward (its gradient too),
// a block being B T 2 C/t values (its K/V heads: 2 KV HS/t).
static inline int lp_model_attention_materialised(const LPModel* m) { return m->cp_size > 1 ? 0 : lp_attention_materialised(m->attention); }

// The positions of cp rank `rank`'s T rows (LPModel.positions' row of that rank).
static inline const int* lp_model_positions_of(const LPModel* m, int rank) { return m->positions + (size_t)rank * m->cur_T; }
static inline const int* lp_model_rows_positions(const LPModel* m) { return lp_model_positions_of(m, m->cp_rank); }

static inline void lp_ring_attention_forward(LPModel* m, floatX* out, float* lse, floatX* qkv, int B, int T, int Cl, int NHl, int KVl) {
    int n = m->cp_size, r = m->cp_rank, next = (r + 1) % n, prev = (r + n - 1) % n;
    size_t block = (size_t)B * T * 2 * KVl * (Cl / NHl);
    floatX* kv = m->act.ring;  // this step's block, the next
    float* rsum = m->act.ring_sum;  // (the running max: in lse)
    const int* pos = lp_model_rows_positions(m);
    LPExchange step = {0};
    lp_attention_kv_copy(kv, qkv, B, T, NHl, KVl, Cl / NHl, 1);
    for (int s = 0; s < n; s++) {
        floatX *here = kv + (size_t)(s % 2) * block, *coming = kv + (size_t)((s + 1) % 2) * block;
        if (s + 1 < n) lp_exchange_start(m->cp, here, coming, block, next, prev, 0, &step);
        lp_attention_block_forward(out, lse, rsum, qkv, here, pos, lp_model_positions_of(m, (r - s + n) % n), B, T, T, Cl, NHl, KVl,
                                   s == 0);
        if (s + 1 < n) lp_exchange_wait(m->cp, &step);
    }
    lp_attention_block_end(lse, rsum, B * NHl * T);
    lp_exchange_free(m->cp, &step);
}

// Backward into dqkv (the rows' q, k and v gradients) from the output's gradient dout.
static inline void lp_ring_attention_backward(LPModel* m, floatX* dqkv, const floatX* dout, const floatX* out, const float* lse,
                                              floatX* qkv, int B, int T, int Cl, int NHl, int KVl) {
    int n = m->cp_size, r = m->cp_rank, next = (r + 1) % n, prev = (r + n - 1) % n;
    size_t block = (size_t)B * T * 2 * KVl * (Cl / NHl);
    floatX *kv = m->act.ring, *dkv = kv + 2 * block;  // two blocks, then their gradients
    const int* pos = lp_model_rows_positions(m);
    LPExchange step = {0}, grad = {0};
    lp_attention_kv_copy(kv, qkv, B, T, NHl, KVl, Cl / NHl, 1);
    lp_device_zero(dkv, block * sizeof(floatX));  // this rank's block's gradient starts here
    lp_device_zero(dqkv, (size_t)B * T * (NHl + 2 * KVl) * (Cl / NHl) * sizeof(floatX));
    for (int s = 0; s < n; s++) {
        size_t here = (size_t)(s % 2) * block, coming = (size_t)((s + 1) % 2) * block;
        if (s + 1 < n) lp_exchange_start(m->cp, kv + here, kv + coming, block, next, prev, 0, &step);
        lp_attention_block_backward(dqkv, dkv + here, dout, out, lse, qkv, kv + here, pos, lp_model_positions_of(m, (r - s + n) % n), B, T,
                                    T, Cl, NHl, KVl);
        // the block's gradient on, the next block's so far in (the last: this rank's own, complete)
        lp_exchange_start(m->cp, dkv + here, dkv + coming, block, next, prev, 1, &grad);
        if (s + 1 < n) lp_exchange_wait(m->cp, &step);
        lp_exchange_wait(m->cp, &grad);
    }
    lp_attention_kv_copy(dkv + (size_t)(n % 2) * block, dqkv, B, T, NHl, KVl, Cl / NHl, 0);
    lp_exchange_free(m->cp, &step);
    lp_exchange_free(m->cp, &grad);
}

// Layer l from its ln1 (made by the residual add below it, fused) to the GELU output: the attention half
// (qkv projection, column-parallel; attention on this rank's heads; output projection, row-parallel; the
// residual add + bias fused with ln2) and the MLP's up projection with its GELU (column-parallel); a MoE
// layer's MLP up to its experts' outputs. Forward runs it, and under full recomputation backward runs it again.
static inline void lp_model_layer_forward(LPModel* m, int l, const LPLayerActs* x) {
    const LPConfig* c = &m->cfg;
    int t = m->tp_size, B = m->cur_B, T = m->cur_T, N = B * T, Nr = m->par->sp ? N / t : N;
    int C = c->channels, NHl = c->num_heads / t, KVl = lp_kv_heads(c) / t, Cl = C / t, Fl = lp_ffn_hidden(c) / t;
    int QKVl = (int)lp_qkv_rows(c) / t;
    LPActivations* a = &m->act;
    // materialised attention and the cache's take qkv as scratch (the first permutes it into qkvr)
    const LPKVCache* kv = &m->cache;
    int mat = lp_model_attention_materialised(m);
    floatX* qkv = mat || kv->kv ? a->qkv : x->qkvs;
    lp_matmul_forward(qkv, NULL, lp_tp_f_forward(m, x->ln1, N, C), lp_layer_param(m, LP_QKVW, l), lp_layer_param(m, LP_QKVB, l), N, C,
                      QKVl);
    if (c->rope) lp_rope(qkv, B, T, lp_model_rows_positions(m), NHl, KVl, C / c->num_heads, c->rope_theta, c->rope_scaled, 0);
    if (kv->kv)
        lp_attention_cached_forward(x->atty, kv->kv + (size_t)l * 2 * kv->B * kv->T * KVl * (C / c->num_heads), qkv, B, T, kv->pos, kv->T,
                                    Cl, NHl, KVl);
    else if (m->cp_size > 1) lp_ring_attention_forward(m, x->atty, x->lse, qkv, B, T, Cl, NHl, KVl);
    else if (mat) lp_attention_forward(x->atty, x->qkvr, x->att, qkv, B, T, Cl, NHl, KVl);
#ifndef LLMPAR_CPU
    else lp_fused_attention_forward_gpu(m->attention, x->atty, x->lse, qkv, B, T, Cl, NHl, KVl);
#endif
    lp_matmul_forward(a->btc, NULL, x->atty, lp_layer_param(m, LP_ATTPROJW, l), NULL, N, Cl, C);
    lp_residual_layernorm_forward(x->residual2, x->ln2, x->ln2_mean, x->ln2_rstd, x->input, lp_tp_g_forward(m, a->btc, N, C),
                                   lp_layer_param(m, LP_ATTPROJB, l), lp_layer_param(m, LP_LN2W, l),
                                   lp_layer_param(m, LP_LN2B, l), Nr, C, lp_norm_eps(c));
    if (x->moe) {
        lp_moe_forward(m, l, x);
    } else if (c->swiglu) {  // fc's gate and up, then SwiGLU
        lp_matmul_forward(x->fch, NULL, lp_tp_f_forward(m, x->ln2, N, C), lp_layer_param(m, LP_FCW, l), lp_layer_param(m, LP_FCB, l),
                           N, C, 2 * Fl);
        lp_swiglu_forward(x->fch_gelu, x->fch, N, Fl);
    } else {
        lp_matmul_forward(x->fch_gelu, x->fch, lp_tp_f_forward(m, x->ln2, N, C), lp_layer_param(m, LP_FCW, l),
                           lp_layer_param(m, LP_FCB, l), N, C, Fl);
    }
}

// Forward pass over (B,T) host tokens. With targets it also computes the loss, leaving dlogits =
// dloss * loss_scale * (softmax - onehot) in place for the backward pass, and returns the mean loss.
// dloss is 1 / (B*T*accumulation steps), so accumulated gradients are of the mean loss (times m->loss_scale).
// A pipeline chunk other than the first takes no tokens: its input, the residual stream after the chunk
// before, is already in act.encoded; one other than the last takes no targets and leaves its output at
// lp_model_output. With m->cache set (sampling) the T rows are positions [cache.pos, cache.pos + T) of the
// cached sequences, attending to the cache (forward only: no backward follows).
float lp_model_forward(LPModel* m, const int* inputs, const int* targets, int B, int T, float dloss) {
    const LPConfig* c = &m->cfg;
    if (m->act_memory == NULL) lp_model_alloc_activations(m, B, T, 1);
    if (B > m->B || T > m->T)
        lp_fail("forward with (B=%d, T=%d) but activations were sized for (B=%d, T=%d)", B, T, m->B, m->T);
    int t = m->tp_size, N = B * T, Nr = m->par->sp ? N / t : N;
    if (m->par->sp && N % t) lp_fail("sequence parallelism: the %d x %d rows do not split over %d ranks", B, T, t);
    if (m->cp_size > 1 && !m->cache.kv && T % 2)
        lp_fail("context parallelism: a rank's %d rows of a sequence are not two chunks of equal length", T);
    int pos = m->cache.kv ? m->cache.pos : 0;  // the first row's position
    if (m->cache.kv && (B != m->cache.B || pos < 0 || pos + T > m->cache.T))
        lp_fail("forward of (B=%d) x positions [%d, %d) outside the key-value cache's (B=%d) x [0, %d)", B, pos, pos + T, m->cache.B,
                m->cache.T);
    m->cur_B = B;
    m->cur_T = T;
    m->dloss = dloss * m->loss_scale;
    size_t npos = (size_t)m->cp_size * T;  // each cp rank's chunks', or (sampling: each rank its whole sequence) the cache's
    int* positions = (int*)lp_host_malloc(npos * sizeof(int), "positions");
    for (size_t i = 0; i < npos; i++)
        positions[i] = m->cache.kv ? pos + (int)(i % T) : lp_cp_position((int)(i % T), T, (int)(i / T), m->cp_size);
    lp_copy_to_device(m->positions, positions, npos * sizeof(int));
    free(positions);
    int L = m->L, C = c->channels, Fl = lp_ffn_hidden(c) / t, V = c->vocab_size;
    int Vl = c->padded_vocab_size / t, v0 = m->tp_rank * Vl;
    float eps = lp_norm_eps(c);
    LPActivations* a = &m->act;

    if (m->first) {  // vocab-parallel embedding: partial sums over the ranks' slices of wte (g), then positions
        lp_check_tokens(inputs, N, V, "input");
        memcpy(m->inputs_host, inputs, (size_t)N * sizeof(int));
        lp_copy_to_device(m->inputs, inputs, (size_t)N * sizeof(int));
        lp_device_zero(a->btc, (size_t)N * C * sizeof(floatX));
        for (int k = 0; k < m->zero.pieces; k++) {  // each piece of wte fills its tokens' rows
            size_t r0, rows = lp_zero_piece(&m->zero, k, &r0);
            lp_embedding_forward(a->btc, m->inputs, lp_zero_wte(&m->zero, k), v0 + (int)r0, (int)rows, N, C);
        }
        const floatX* emb = lp_tp_g_forward(m, a->btc, N, C);
        if (c->rope) lp_copy_device(a->encoded, emb, (size_t)Nr * C * sizeof(floatX));  // (RoPE turns q and k in each layer)
        else lp_positions_forward(a->encoded, emb, lp_model_param(m, LP_WPE), lp_model_rows_positions(m), m->par->sp ? m->tp_rank * Nr : 0, Nr, T, C);
    }
    if (L > 0) {
        lp_model_fetch(m, 0, -1);
        LPLayerActs x = lp_layer_acts(m, 0);
        lp_layernorm_forward(x.ln1, x.ln1_mean, x.ln1_rstd, a->encoded, lp_layer_param(m, LP_LN1W, 0),
                              lp_layer_param(m, LP_LN1B, 0), Nr, C, eps);
    } else if (m->last) {
        lp_layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, a->encoded, lp_model_param(m, LP_LNFW), lp_model_param(m, LP_LNFB), Nr,
                              C, eps);
    }
    for (int l = 0; l < L; l++) {
        lp_model_fetch(m, l, l + 1);  // ZeRO-3: the next layer's weights arrive while this one runs
        LPLayerActs x = lp_layer_acts(m, l);
        lp_model_layer_forward(m, l, &x);
        // the MLP's projection (row-parallel; a MoE layer's experts' outputs gated and summed), residual add
        // + bias + the next LayerNorm (ln1, lnf, or in a pipeline chunk's last layer none: the next chunk's ln1)
        if (x.moe) {
            lp_moe_account(m, &x, N);
            lp_moe_combine(a->btc, x.yp, x.pos, x.gate, N, c->moe_topk, C);
        } else {
            lp_matmul_forward(a->btc, NULL, x.fch_gelu, lp_layer_param(m, LP_FCPROJW, l), NULL, N, Fl, C);
        }
        const floatX* mlp = lp_tp_g_forward(m, a->btc, N, C);
        const floatX* mlp_bias = x.moe ? NULL : lp_layer_param(m, LP_FCPROJB, l);
        if (l + 1 < L) {
            lp_model_fetch(m, l + 1, -1);  // its ln1 runs now, fused with this residual add (l stays)
            LPLayerActs next = lp_layer_acts(m, l + 1);
            lp_residual_layernorm_forward(x.residual3, next.ln1, next.ln1_mean, next.ln1_rstd, x.residual2, mlp, mlp_bias,
                                           lp_layer_param(m, LP_LN1W, l + 1), lp_layer_param(m, LP_LN1B, l + 1), Nr, C, eps);
        } else {
            lp_residual_layernorm_forward(x.residual3, m->last ? a->lnf : NULL, a->lnf_mean, a->lnf_rstd, x.residual2, mlp,
                                           mlp_bias, lp_model_param(m, LP_LNFW), lp_model_param(m, LP_LNFB), Nr, C, eps);
        }
    }
    if (targets) {  // for the loss, and for the auxiliary losses' in backward
        lp_check_tokens(targets, N, V, "target");
        lp_copy_to_device(m->targets, targets, (size_t)N * sizeof(int));
    }
    if (!m->last) return 0.0f;
    lp_model_logits(m, a->logits, a->lnf, N);
    return targets ? lp_model_classifier(m, a->logits, N, m->dloss) : 0.0f;
}

// Rows of the residual stream this rank holds in the last forward's shape.
static inline int lp_model_rows(const LPModel* m) {
    int N = m->cur_B * m->cur_T;
    return m->par->sp ? N / m->tp_size : N;
}

// A pipeline chunk's output after forward: the residual stream after its last layer, (rows, C).
static inline floatX* lp_model_output(const LPModel* m) {
    return m->L ? m->act.residual3 + (size_t)(m->L - 1) * lp_model_rows(m) * m->cfg.channels : m->act.encoded;
}

void lp_model_zero_grad(LPModel* m) {
    memset(m->aux_loss, 0, sizeof(m->aux_loss));
    memset(&m->moe_stats, 0, sizeof(m->moe_stats));
    for (int p = 0; p < m->parts; p++) lp_zero_clear_grads(lp_model_part(m, p));
}

// Backward pass of the last forward (which must have had targets); adds into the gradients. A pipeline
// chunk other than the last starts from its output's gradient, put in act.dresidual by the caller; one other
// than the first ends with its input's gradient there. `last`: this is the step's last micro-batch, so the
// gradients are complete as each layer finishes: with sequence parallelism, the LayerNorm (and wpe)
// gradients, partial sums over each rank's rows, are summed over the TP group then (the layers' every
// micro-batch under ZeRO-2/3, whose layer gradients leave at once). Around each layer the ZeRO hooks of
// section 8 say where its gradients go and take them when they are complete (lp_zero_layer_done: the
// one place in backward where they may start their way over dp).
// The embedding's part of wte's gradient: each micro-batch's into rows of the step's own, one per distinct
// token of this rank's vocabulary slice [v0, v0 + Vl), added into wte's gradient after the last. So wte's
// gradient is the LM head's part plus the embedding's, each summed over the micro-batches first: what a
// pipeline computes with the two on different stages, and one rank (holding both) gives the same bits.
static inline void lp_model_embedding_backward(LPModel* m, const floatX* dout, int N, int v0, int Vl, int last) {
    int C = m->cfg.channels, V = m->cfg.padded_vocab_size, rows0 = m->emb_rows;
    if (!m->emb_row) {
        m->emb_row = (int*)lp_host_malloc((size_t)V * sizeof(int), "embedding rows");
        m->emb_tokens = (int*)lp_host_malloc((size_t)V * sizeof(int), "embedding rows");
        for (int v = 0; v < V; v++) m->emb_row[v] = -1;
    }
    int* mapped = (int*)lp_host_malloc((size_t)N * sizeof(int), "embedding rows");
    for (int i = 0; i < N; i++) {  // each position's row (-1: a token of another rank's slice)
        int tok = m->inputs_host[i];
        if (tok < v0 || tok >= v0 + Vl) { mapped[i] = -1; continue; }
        if (m->emb_row[tok] < 0) {
            m->emb_tokens[m->emb_rows] = tok;
            m->emb_row[tok] = m->emb_rows++;
        }
        mapped[i] = m->emb_row[tok];
    }
    if (m->emb_rows > m->emb_cap) {  // grow (the step's distinct tokens; at most Vl)
        int cap = m->emb_rows > 2 * m->emb_cap ? m->emb_rows : 2 * m->emb_cap;
        if (cap > Vl) cap = Vl;
        floatX* grown = (floatX*)lp_device_malloc((size_t)cap * C * sizeof(floatX), "embedding gradient rows");
        if (rows0) lp_copy_device(grown, m->emb_grad, (size_t)rows0 * C * sizeof(floatX));
        if (m->emb_grad) lp_device_free(m->emb_grad);
        m->emb_grad = grown;
        m->emb_cap = cap;
    }
    if (m->emb_rows > rows0) lp_device_zero(m->emb_grad + (size_t)rows0 * C, (size_t)(m->emb_rows - rows0) * C * sizeof(floatX));
    lp_embedding_backward(m->emb_grad, dout, mapped, 0, m->emb_rows, N, C);
    free(mapped);
    if (!last) return;
    for (int k = 0; k < m->zero.pieces; k++) {  // the rows into wte's gradient, a piece at a time (ZeRO: reduced as it goes)
        size_t r0, rows = lp_zero_piece(&m->zero, k, &r0);
        lp_embedding_backward(lp_zero_wte_grad(&m->zero, k), m->emb_grad, m->emb_tokens, v0 + (int)r0, (int)rows, m->emb_rows, C);
        lp_zero_wte_grad_done(&m->zero, k);
    }
    for (int r = 0; r < m->emb_rows; r++) m->emb_row[m->emb_tokens[r]] = -1;
    m->emb_rows = 0;
}

void lp_model_backward(LPModel* m, int last) {
    const LPConfig* c = &m->cfg;
    int B = m->cur_B, T = m->cur_T, t = m->tp_size, N = B * T, Nr = m->par->sp ? N / t : N;
    int L = m->L, C = c->channels, NHl = c->num_heads / t, KVl = lp_kv_heads(c) / t, Cl = C / t, Fl = lp_ffn_hidden(c) / t;
    int QKVl = (int)lp_qkv_rows(c) / t, Vl = c->padded_vocab_size / t, v0 = m->tp_rank * Vl;
    int sum_sp = m->par->sp && (last || m->par->zero >= 2);
    float eps = lp_norm_eps(c);
    LPActivations* a = &m->act;
    floatX** g = m->zero.g;

    if (m->last) {  // the loss's gradient, through the head
        lp_device_zero(a->dresidual, (size_t)Nr * C * sizeof(floatX));
        lp_model_head_backward(m, lp_model_output(m), a->lnf, a->lnf_mean, a->lnf_rstd, a->logits, N);
    }
    for (int l = L - 1; l >= 0; l--) {
        LPLayerActs x = lp_layer_acts(m, l);
        for (int j = 0; j < m->num_aux; j++) {  // an auxiliary loss on this layer's output: its head, recomputed
            if (m->aux[j] != l) continue;
            lp_layernorm_forward(a->aux_lnf, a->aux_mean, a->aux_rstd, x.residual3, lp_model_param(m, LP_LNFW), lp_model_param(m, LP_LNFB),
                                  Nr, C, eps);
            lp_model_logits(m, a->aux_logits, a->aux_lnf, N);
            m->aux_loss[j] += lp_model_classifier(m, a->aux_logits, N, m->aux_weight * m->dloss);
            lp_model_head_backward(m, x.residual3, a->aux_lnf, a->aux_mean, a->aux_rstd, a->aux_logits, N);
        }
        lp_model_fetch(m, l, l - 1);     // ZeRO-3: the layer below arrives while this one runs
        lp_model_layer_begin(m, l);      // ZeRO-2/3: a clean one-layer gradient buffer
        int redo = m->par->recompute ? lp_trace_begin("compute", "recompute", -1, -1) : -1;  // (on the timeline)
        if (m->par->recompute == LP_RECOMPUTE_FULL) {  // the layer's forward again, from its input
            lp_layernorm_forward(x.ln1, x.ln1_mean, x.ln1_rstd, x.input, lp_layer_param(m, LP_LN1W, l),
                                  lp_layer_param(m, LP_LN1B, l), Nr, C, eps);
            lp_model_layer_forward(m, l, &x);
        } else if (m->par->recompute == LP_RECOMPUTE_SELECTIVE) {  // the probabilities from q and k, GELU from its input
            if (lp_model_attention_materialised(m))  // (flash and ring attention keep none: nothing to redo)
                lp_attention_probs(x.att, x.qkvr, B, T, Cl, NHl, KVl);
            if (x.moe && c->swiglu) lp_swiglu_forward(x.efch_gelu, x.efch, lp_moe_rows_taken(m, &x), Fl);
            else if (x.moe) lp_gelu_forward(x.efch_gelu, x.efch, (size_t)lp_moe_rows_taken(m, &x) * Fl);
            else if (c->swiglu) lp_swiglu_forward(x.fch_gelu, x.fch, N, Fl);
            else lp_gelu_forward(x.fch_gelu, x.fch, (size_t)N * Fl);
        }
        if (m->par->recompute) lp_trace_end(redo);
        // MLP half: dresidual is the gradient of residual3 and, through the identity path, of residual2;
        // it is also fcproj's output gradient (g backward)
        floatX* dln2;
        if (x.moe) {
            dln2 = lp_moe_backward(m, l, &x, lp_tp_g_backward(m, a->dresidual, N, C));
        } else if (c->swiglu) {  // fcproj's, SwiGLU's (into fc's gate and up), fc's
            lp_matmul_backward(a->dact, lp_layer_grad(m, LP_FCPROJW, l), lp_layer_grad(m, LP_FCPROJB, l), NULL,
                                lp_tp_g_backward(m, a->dresidual, N, C), x.fch_gelu, lp_layer_param(m, LP_FCPROJW, l), N, Fl, C, NULL);
            lp_swiglu_backward(a->dfch, x.fch, a->dact, N, Fl);
            lp_matmul_backward(a->btc, lp_layer_grad(m, LP_FCW, l), lp_layer_grad(m, LP_FCB, l), NULL, a->dfch,
                                lp_tp_f_forward(m, x.ln2, N, C), lp_layer_param(m, LP_FCW, l), N, C, 2 * Fl, NULL);
            dln2 = lp_tp_f_backward(m, a->btc, N, C);
        } else {
            // through the GELU too: dfch is fc's output gradient, and its column sums fc's bias gradient
            lp_matmul_backward(a->dfch, lp_layer_grad(m, LP_FCPROJW, l), lp_layer_grad(m, LP_FCPROJB, l), lp_layer_grad(m, LP_FCB, l),
                                lp_tp_g_backward(m, a->dresidual, N, C), x.fch_gelu, lp_layer_param(m, LP_FCPROJW, l), N, Fl,
                                C, x.fch);
            lp_matmul_backward(a->btc, lp_layer_grad(m, LP_FCW, l), NULL, NULL, a->dfch,
                                lp_tp_f_forward(m, x.ln2, N, C), lp_layer_param(m, LP_FCW, l), N, C, Fl, NULL);
            dln2 = lp_tp_f_backward(m, a->btc, N, C);
        }
        lp_layernorm_backward(a->dresidual, lp_layer_grad(m, LP_LN2W, l), lp_layer_grad(m, LP_LN2B, l), dln2, x.residual2,
                               lp_layer_param(m, LP_LN2W, l), x.ln2_mean, x.ln2_rstd, Nr, C);
        // attention half
        lp_matmul_backward(a->btc, lp_layer_grad(m, LP_ATTPROJW, l), lp_layer_grad(m, LP_ATTPROJB, l), NULL,
                            lp_tp_g_backward(m, a->dresidual, N, C), x.atty, lp_layer_param(m, LP_ATTPROJW, l), N, Cl, C, NULL);
        if (m->cp_size > 1) lp_ring_attention_backward(m, a->qkv, a->btc, x.atty, x.lse, x.qkvs, B, T, Cl, NHl, KVl);
        else if (lp_model_attention_materialised(m))
            lp_attention_backward(a->qkv, a->dqkvr, a->datt, a->dy, a->btc, x.qkvr, x.att, B, T, Cl, NHl, KVl);
#ifndef LLMPAR_CPU
        else lp_fused_attention_backward_gpu(m->attention, a->qkv, a->btc, x.atty, x.qkvs, x.lse, B, T, Cl, NHl, KVl);
#endif
        if (c->rope) lp_rope(a->qkv, B, T, lp_model_rows_positions(m), NHl, KVl, C / c->num_heads, c->rope_theta, c->rope_scaled, 1);  // q's and k's, turned back
        lp_matmul_backward(a->btc, lp_layer_grad(m, LP_QKVW, l), lp_layer_grad(m, LP_QKVB, l), NULL, a->qkv,
                            lp_tp_f_forward(m, x.ln1, N, C), lp_layer_param(m, LP_QKVW, l), N, C, QKVl, NULL);
        lp_layernorm_backward(a->dresidual, lp_layer_grad(m, LP_LN1W, l), lp_layer_grad(m, LP_LN1B, l),
                               lp_tp_f_backward(m, a->btc, N, C), x.input, lp_layer_param(m, LP_LN1W, l), x.ln1_mean,
                               x.ln1_rstd, Nr, C);
        if (sum_sp) {
            const int ln[4] = {LP_LN1W, LP_LN1B, LP_LN2W, LP_LN2B};
            for (int k = 0; k < 4; k++)
                if (lp_family_has(c, ln[k])) lp_all_reduce(m->tp, lp_layer_grad(m, ln[k], l), C, 0);
        }
        lp_model_layer_done(m, l, last);  // the layer's gradients are complete: DP / ZeRO takes them
    }
    if (m->first) {  // the embedding's output gradient is the residual stream's (g backward); positions on this rank's rows
        lp_model_embedding_backward(m, lp_tp_g_backward(m, a->dresidual, N, C), N, v0, Vl, last);
        if (!c->rope) lp_positions_backward(g[LP_WPE], a->dresidual, lp_model_rows_positions(m), m->par->sp ? m->tp_rank * Nr : 0, Nr, T, C);
    }
    for (int p = 0; p < m->parts; p++) lp_zero_backward_done(lp_model_part(m, p));
    if (m->par->sp && last) {  // (ZeRO-2/3 reduce the tensors outside the layers once, in lp_zero_average)
        const int rows_only[3] = {LP_WPE, LP_LNFW, LP_LNFB};
        for (int k = 0; k < 3; k++)
            if (m->zero.param_sizes[rows_only[k]]) lp_all_reduce(m->tp, g[rows_only[k]], m->zero.param_sizes[rows_only[k]], 0);
    }
}

// Sampling's key-value cache for B sequences of up to T positions (LPKVCache): L x 2 x B x T x KV HS/t values
// (KV HS = C with multi-head attention), made when a sample begins and freed when it ends (lp_model_cache_free),
// so training never holds it.
static inline void lp_model_cache_alloc(LPModel* m, int B, int T) {
    if (T > m->cfg.max_seq_len) lp_fail("a key-value cache of %d positions exceeds the model's maximum %d", T, m->cfg.max_seq_len);
    m->cache.B = B;
    m->cache.T = T;
    m->cache.pos = 0;
    // (a chunk without layers keeps one layer's room: a kv that is not NULL says the cache is on)
    size_t kv = (size_t)lp_kv_heads(&m->cfg) / m->tp_size * (m->cfg.channels / m->cfg.num_heads);  // this rank's K/V channels
    m->cache.kv = (floatX*)lp_device_malloc((size_t)(m->L ? m->L : 1) * 2 * B * T * kv * sizeof(floatX), "key-value cache");
}
static inline void lp_model_cache_free(LPModel* m) {
    lp_device_free(m->cache.kv);
    memset(&m->cache, 0, sizeof(m->cache));
}

void lp_model_free(LPModel* m) {
    for (int p = 0; p < m->parts; p++) lp_zero_free(lp_model_part(m, p));
    if (m->emb_grad) lp_device_free(m->emb_grad);
    free(m->emb_row);
    free(m->emb_tokens);
    if (m->act_memory) {
        lp_device_free(m->act_memory);
        lp_device_free(m->inputs);
        lp_device_free(m->targets);
        lp_device_free(m->positions);
        free(m->slot_act);
        free(m->slot_inputs);
        free(m->losses_host);
        free(m->slot_moe_routes);
        free(m->moe_host);
    }
    free(m->runs);
    memset(m, 0, sizeof(*m));
}
#endif  // LLMPAR_IMPLEMENTATION

// ----------------------------------------------------------------------------------------------------
// 10. optimizer

typedef struct LPAdamW {
    float beta1, beta2, eps, weight_decay;
    float grad_clip;  // clip the global gradient norm to this (0: no clipping)
} LPAdamW;

// The optimizer walks this rank's shard a chunk at a time: lp_zero_state_begin gives the number of chunks
// (in device memory: one, the whole shard); lp_zero_state_get chunk c as LPStatePiece, waiting for what
// comes in (the file's m and v: read ahead; the CUDA build's host update: the gradients, down); and
// lp_zero_state_put hands it back updated (the file: written behind, the chunk after next read into its
// buffer; the host update: the weights up, the chunk after next's gradients down); lp_zero_state_end
// waits for the last of it.
typedef struct {
    size_t lo, hi;          // shard values [lo, hi); each pointer is at value lo
    float *master, *m, *v;  // fp32 master weights and AdamW moments
    const floatX* grads;    // the averaged gradients
    floatX* params;         // where the updated compute-type weights go
} LPStatePiece;

#ifdef LLMPAR_IMPLEMENTATION
static inline size_t lp_zero_state_begin(LPZero* z) {
    size_t count = lp_zero_shard_count(z), chunks = (count + z->state_chunk - 1) / z->state_chunk;
    LPOffload* o = z->off;
    if (o)
        for (size_t c = 0; c < 2 && c < o->chunks; c++) o->ready[c] = lp_offload_queue(o, c, o->buf[c], 0);
#ifndef LLMPAR_CPU
    LPHostOptim* h = z->host;
    if (h) {  // the copies start once the gradients are complete on the compute stream
        cudaCheck(cudaEventRecord(h->ready, 0));
        cudaCheck(cudaStreamWaitEvent(h->down, h->ready, 0));
        cudaCheck(cudaStreamWaitEvent(h->up, h->ready, 0));
        for (size_t c = 0; c < 2 && c < chunks; c++) {
            size_t lo = c * z->state_chunk, n = count - lo < z->state_chunk ? count - lo : z->state_chunk;
            cudaCheck(cudaMemcpyAsync(h->grads[c], lp_zero_shard_grads(z) + lo, n * sizeof(floatX), cudaMemcpyDeviceToHost, h->down));
            cudaCheck(cudaEventRecord(h->got[c], h->down));
        }
    }
#endif
    return chunks;
}
static inline void lp_zero_state_get(LPZero* z, size_t c, LPStatePiece* s) {
    size_t count = lp_zero_shard_count(z);
    s->lo = c * z->state_chunk;
    s->hi = count - s->lo < z->state_chunk ? count : s->lo + z->state_chunk;
    s->master = z->master + s->lo;
    s->grads = lp_zero_shard_grads(z) + s->lo;
    s->params = lp_zero_shard_params(z) + s->lo;
    LPOffload* o = z->off;
    if (o) {
        lp_offload_wait(o, o->ready[c % 2]);
        s->m = o->buf[c % 2];
        s->v = o->buf[c % 2] + o->chunk;
    } else {
        s->m = z->adam_m + s->lo;
        s->v = z->adam_v + s->lo;
    }
#ifndef LLMPAR_CPU
    LPHostOptim* h = z->host;
    if (h) {
        cudaCheck(cudaEventSynchronize(h->got[c % 2]));
        if (c >= 2) cudaCheck(cudaEventSynchronize(h->sent[c % 2]));  // chunk c-2's weights have left the buffer
        s->grads = h->grads[c % 2];
        if (!z->params_on_host) s->params = h->params[c % 2];  // (--offload params: the shard itself, on the host)
    }
#endif
}
static inline void lp_zero_state_put(LPZero* z, size_t c) {
    LPOffload* o = z->off;
    if (o) {
        lp_offload_queue(o, c, o->buf[c % 2], 1);
        if (c + 2 < o->chunks) o->ready[c % 2] = lp_offload_queue(o, c + 2, o->buf[c % 2], 0);
    }
#ifndef LLMPAR_CPU
    LPHostOptim* h = z->host;
    if (h) {
        size_t count = lp_zero_shard_count(z), lo = c * z->state_chunk, n = count - lo < z->state_chunk ? count - lo : z->state_chunk;
        if (!z->params_on_host)
            cudaCheck(cudaMemcpyAsync(lp_zero_shard_params(z) + lo, h->params[c % 2], n * sizeof(floatX), cudaMemcpyHostToDevice, h->up));
        cudaCheck(cudaEventRecord(h->sent[c % 2], h->up));
        lo += 2 * z->state_chunk;
        if (lo < count) {  // this buffer's gradients are used: chunk c+2's come into it
            n = count - lo < z->state_chunk ? count - lo : z->state_chunk;
            cudaCheck(cudaMemcpyAsync(h->grads[c % 2], lp_zero_shard_grads(z) + lo, n * sizeof(floatX), cudaMemcpyDeviceToHost, h->down));
            cudaCheck(cudaEventRecord(h->got[c % 2], h->down));
        }
    }
#endif
}
static inline void lp_zero_state_end(LPZero* z) {
    LPOffload* o = z->off;
    if (o) {
        lp_offload_wait(o, o->queued - 1);
        o->written = o->chunks;
    }
#ifndef LLMPAR_CPU
    if (z->host) cudaCheck(cudaStreamSynchronize(z->host->up));  // the weights are all up before anything reads them
#endif
}
#endif  // LLMPAR_IMPLEMENTATION

#ifdef LLMPAR_IMPLEMENTATION
// After the optimizer updated this rank's shard of the weights: stage 1-2 all-gather them, stage 3 the
// tensors outside the layers (the layers' are gathered when forward next needs them).
static inline void lp_zero_gather_updated(LPZero* z) {
    if (z->par->zero >= 3) {
        z->layer_in_buf[0] = z->layer_in_buf[1] = z->piece_in_buf[0] = z->piece_in_buf[1] = -1;
        for (int i = 0; i < LP_NUM_PARAMS; i++)
            if (lp_zero_whole(z, i)) lp_zero_gather_start(z, z->w[i], z->param_offsets[i], z->param_sizes[i], &z->now);
        lp_wait(z->dp, &z->now);
    } else if (z->par->zero >= 1) {
        lp_all_gather(z->dp, z->params, z->shard_size * sizeof(floatX));
    }
}

// The squared norm of this rank's shard of the averaged gradients, counting each of the model's
// parameters on one rank only (a tensor TP replicates on TP rank 0, a pipeline chunk's copies of the head
// (wte, lnf) not at all), in parts: each tensor's sum of squares per layer added to parts[i * L + layer]
// (L the whole model's layers; layer 0 for the tensors outside the layers). The norm adds the parts in
// that order, the model's, whichever stage or rank holds them, so a pipeline's norm is one rank's bit for bit.
static inline void lp_model_norm2_parts(const LPModel* m, int p, float* parts) {
    const LPZero* z = lp_model_part(m, p);
    LPSpan* spans = (LPSpan*)lp_host_malloc((size_t)LP_NUM_PARAMS * (m->L + 1) * sizeof(LPSpan), "norm spans");
    int n = 0, L = m->cfg.num_layers;
    size_t a, b, lo = z->shard_start;
    for (int i = 0; i < LP_NUM_PARAMS; i++) {
        if (!lp_zero_tensor_in_shard(z, i, &a, &b) || (lp_param_split[i] == LP_REPLICATED && m->tp_rank > 0) || (m->copies >> i & 1))
            continue;
        int layer = lp_is_layer_tensor(i), layers = layer ? m->L : 1;
        for (int l = 0; l < layers; l++) {  // layer l's values within the shard's [lo + a, lo + b)
            if (layer && !lp_layer_has(&m->cfg, i, m->layer0 + l)) continue;
            size_t x = z->param_offsets[i] + (layer ? lp_zero_layer_index(z, i, l) * z->layer_size[i] : 0);
            size_t y = x + (layer ? z->layer_size[i] : z->param_sizes[i]);
            if (x < lo + a) x = lo + a;
            if (y > lo + b) y = lo + b;
            if (y > x) spans[n++] = (LPSpan){x - lo, y - x, i * L + (layer ? m->layer0 + l : 0)};
        }
    }
    lp_norm_squared_spans(parts, lp_zero_shard_grads(z), spans, n);
    free(spans);
}
#endif  // LLMPAR_IMPLEMENTATION

// fn on each piece of a tensor in this rank's shard, the shard a chunk at a time (in device memory: one
// chunk): tensor i's values [at, at + n) of the chunk s, i0 of them before it in the tensor's shard (the
// stochastic rounding's index, as one launch over the tensor's shard would draw it); then ZeRO makes the
// updated weights whole where forward needs them (lp_zero_gather_updated).
typedef void (*LPPieceFn)(const LPZero* z, const LPStatePiece* s, int i, size_t at, size_t n, size_t i0, const void* ctx);
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_model_update_shard(LPModel* m, LPPieceFn fn, const void* ctx) {
    for (int p = 0; p < m->parts; p++) {
        LPZero* z = lp_model_part(m, p);
        size_t chunks = lp_zero_state_begin(z), a, b;
        LPStatePiece s;
        for (size_t c = 0; c < chunks; c++) {
            lp_zero_state_get(z, c, &s);
            for (int i = 0; i < LP_NUM_PARAMS; i++) {
                if (!lp_zero_tensor_in_shard(z, i, &a, &b)) continue;
                size_t x = a > s.lo ? a : s.lo, y = b < s.hi ? b : s.hi;
                if (x < y) fn(z, &s, i, x - s.lo, y - x, x - a, ctx);
            }
            lp_zero_state_put(z, c);
        }
        lp_zero_state_end(z);
        lp_zero_gather_updated(z);
    }
}

// The stochastic-rounding stream of tensor i's update at AdamW step t.
static inline uint32_t lp_adamw_seed(int t, int i) { return (uint32_t)(t * 1000003u + i * 7919u); }
#endif  // LLMPAR_IMPLEMENTATION

typedef struct {
    const LPAdamW* opt;
    float lr, scale, b1c, b2c;
} LPAdamWStep;
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_adamw_piece(const LPZero* z, const LPStatePiece* s, int i, size_t at, size_t n, size_t i0, const void* ctx) {
    const LPAdamWStep* u = (const LPAdamWStep*)ctx;
    const LPAdamW* opt = u->opt;
    uint32_t seed = lp_adamw_seed(z->adam_step, i);
    float decay = lp_param_decays(i) ? opt->weight_decay : 0.0f, scale = u->scale * z->grad_scale;
#ifndef LLMPAR_CPU
    if (z->host_state) {  // on the CPU
        lp_adamw_host(s->params + at, s->master + at, s->grads + at, s->m + at, s->v + at, n, i0, u->lr, opt->beta1, opt->beta2,
                      u->b1c, u->b2c, opt->eps, decay, scale, seed);
        return;
    }
#endif
    (void)i0;  // (one launch per tensor's shard: in device memory the chunk is the whole shard)
    lp_adamw(s->params + at, s->master + at, s->grads + at, s->m + at, s->v + at, n, u->lr, opt->beta1, opt->beta2, u->b1c,
             u->b2c, opt->eps, decay, scale, seed);
}

// AdamW on this rank's shard of each tensor, the gradients scaled by `scale` (clipping).
static inline void lp_model_adamw(LPModel* m, float lr, float scale, const LPAdamW* opt) {
    int t = ++m->zero.adam_step;
    m->experts.adam_step = t;
    LPAdamWStep u = {opt, lr, scale, 1.0f - powf(opt->beta1, (float)t), 1.0f - powf(opt->beta2, (float)t)};
    lp_model_update_shard(m, lp_adamw_piece, &u);
}

#ifndef LLMPAR_CPU
static inline void lp_round_piece(const LPZero* z, const LPStatePiece* s, int i, size_t at, size_t n, size_t i0, const void* ctx) {
    (void)ctx;
    uint32_t seed = lp_adamw_seed(z->adam_step, i);
    if (z->host_state) lp_stochastic_round_host(s->params + at, s->master + at, n, i0, seed);
    else lp_stochastic_round_gpu(s->params + at, s->master + at, n, seed);
}
#endif

// The compute-type weights as the last AdamW step left them, from the master weights of a loaded
// checkpoint: each rounded with that step's draw, so a resumed run goes on bit for bit. (Read from a file
// they are rounded to nearest, which is how a run starts; the CPU build's weights are the master weights.)
static inline void lp_model_round_as_updated(LPModel* m) {
#ifndef LLMPAR_CPU
    if (m->zero.adam_step > 0) lp_model_update_shard(m, lp_round_piece, NULL);
#else
    (void)m;
#endif
}

// x[0..n) summed over the ranks that hold different parts of the n models ms: the shards (over dp, when sharded),
// the TP slices (over tp) and the other pipeline stages (over pp; NULL for one stage).
static inline void lp_models_sum_parts(const LPModel* ms, const LPGroup* pp, float* x, int n) {
    if (ms->par->zero >= 1) lp_all_reduce_host(ms->zero.dp, x, n, 0);
    if (ms->tp_size > 1) lp_all_reduce_host(ms->tp, x, n, 0);
    if (pp) lp_all_reduce_host(pp, x, n, 0);
}

// The global norm (before clipping) of the n models' gradients once reduced (lp_zero_average), the same
// on every rank: ms are a pipeline stage's chunks (one model: n = 1, pp NULL). Of the gradients divided by
// the loss scale (exactly, for a power of two); an inf or NaN in any of them, on any rank, makes it not finite
// on every rank (the overflow check of loss scaling: each rank's parts carry it into the sums over the grid).
float lp_models_grad_norm(LPModel* ms, int n, const LPGroup* pp) {
    int slots = LP_NUM_PARAMS * ms->cfg.num_layers;
    float* parts = (float*)calloc((size_t)2 * slots, sizeof(float));  // (a part is one rank's: the sum over pp is exact)
    if (!parts) lp_fail("out of host memory for the gradient norm");
    for (int k = 0; k < n; k++)
        for (int p = 0; p < ms[k].parts; p++) lp_model_norm2_parts(&ms[k], p, parts + (size_t)p * slots);
    if (ms->parts > 1) {  // the experts' (in their own slots): scaled as the optimizer takes them; without ZeRO each EP
                          // rank holds other experts, so they add over ep (ZeRO's sum over dp covers ep and edp)
        if (ms->par->zero == 0 && ms->ep_size > 1) lp_all_reduce_host(ms->ep, parts + slots, slots, 0);
        float s2 = ms->experts.grad_scale * ms->experts.grad_scale;
        for (int j = 0; j < slots; j++) parts[j] += s2 * parts[slots + j];
    }
    lp_models_sum_parts(ms, pp, parts, slots);
    double norm2 = 0.0;
    for (int j = 0; j < slots; j++) norm2 += parts[j];
    free(parts);
    return sqrtf((float)norm2) / ms->loss_scale;
}

// Then clipping to opt->grad_clip given the norm, and AdamW, the gradients divided by the loss scale in the
// same factor. Returns whether every updated
// weight is finite on every rank: the sum of squares of the updated shards, which overflows only for a
// weight beyond ~1e19, so a diverged step is seen before the next forward or any checkpoint.
int lp_models_adamw(LPModel* ms, int n, const LPGroup* pp, float lr, float norm, const LPAdamW* opt) {
    float clip = (opt->grad_clip > 0.0f && norm > opt->grad_clip) ? opt->grad_clip / norm : 1.0f, w2 = 0.0f;
    float scale = clip / ms->loss_scale;
    for (int k = 0; k < n; k++) {
        LPModel* m = &ms[k];
        lp_model_adamw(m, lr, scale, opt);
        for (int p = 0; p < m->parts; p++) {
            LPZero* z = lp_model_part(m, p);
            size_t count = lp_zero_shard_count(z);
            if (count) w2 += lp_norm_squared(lp_zero_shard_params(z), count);  // (--offload params: pinned, read over PCIe)
        }
    }
    lp_models_sum_parts(ms, pp, &w2, 1);
    return isfinite(w2);
}
#endif  // LLMPAR_IMPLEMENTATION

// --- replicas that train apart (par->diloco, par->gossip). The d data-parallel replicas (each one rank, or a
// t x p grid) average no gradients: each takes AdamW steps on its own batches with its own AdamW state, and
// every rank exchanges its values in fp32 with the ranks at its place in the other replicas (its DP group),
// host-staged over MPI in both builds:
//   DiLoCo (Douillard et al. 2023): after H inner steps the replicas' weights are all-reduced to their mean,
//     once, and every replica takes the same outer step from it (lp_outer_value), so they start each round
//     equal. A ring all-reduce sends 2 (d-1)/d of the model per rank every H steps, where plain data
//     parallelism all-reduces the gradients every step.
//   gossip (decentralized SGD, Lian et al. 2017, on the exponential graph of Assran et al. 2019): after each
//     step replica i sends its weights to i + 1, i + 2, ..., i + 2^(K-1) and mixes its own with those of
//     i - 1, ..., i - 2^(K-1) (mod d), each weighted 1/(K+1). The mixing matrix is circulant and doubly
//     stochastic: the replicas' mean is kept and their spread shrinks; no collective, K sends of the model.
// The bytes are counted on the DP group as its device collectives are, for the end report.

typedef struct {
    float lr, momentum;  // DiLoCo's outer SGD: learning rate, Nesterov momentum
} LPOuterSGD;

#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_outer_piece(const LPZero* z, const LPStatePiece* s, int i, size_t at, size_t n, size_t i0, const void* ctx) {
    const LPOuterSGD* o = (const LPOuterSGD*)ctx;
    size_t x = s->lo + at;
    (void)i0;  // (in device memory the chunk is the whole shard)
    lp_outer_step(s->params + at, s->master + at, z->outer_w + x, z->outer_m + x, z->mix + x, n, o->lr, o->momentum,
                  lp_adamw_seed(z->adam_step, i));
}
static inline void lp_mix_piece(const LPZero* z, const LPStatePiece* s, int i, size_t at, size_t n, size_t i0, const void* ctx) {
    (void)i0, (void)ctx;
    lp_mix(s->params + at, s->master + at, z->mix + s->lo + at, lp_zero_shard_count(z), z->par->gossip, n,
           lp_adamw_seed(z->adam_step, i));
}

// DiLoCo, before a round's first inner step: the weights now are its outer weights.
static inline void lp_replicas_round_start(LPModel* ms, int n) {
    for (int k = 0; k < n; k++)
        for (int p = 0; p < ms[k].parts; p++) {
            LPZero* z = lp_model_part(&ms[k], p);
            lp_copy_device(z->outer_w, z->master, lp_zero_shard_count(z) * sizeof(float));
        }
}

// DiLoCo's outer step, after a round's inner steps: the replicas' mean weights, then the step from them.
static inline void lp_replicas_outer(LPModel* ms, int n, const LPOuterSGD* o) {
    for (int k = 0; k < n; k++) {
        for (int p = 0; p < ms[k].parts; p++) {
            LPZero* z = lp_model_part(&ms[k], p);
            size_t count = lp_zero_shard_count(z);
            float* h = (float*)lp_host_malloc((count ? count : 1) * sizeof(float), "the replicas' mean weights");
            lp_copy_to_host(h, z->master, count * sizeof(float));
            lp_all_reduce_host(z->replicas, h, count, 1);
            lp_traffic(z->replicas, LP_ALL_REDUCE, count * sizeof(float));
            lp_copy_to_device(z->mix, h, count * sizeof(float));
            free(h);
        }
        lp_model_update_shard(&ms[k], lp_outer_piece, o);
    }
}

// Gossip's exchange and mixing. Adds to sums[0] the squares of this rank's differences from its nearest
// in-neighbour's weights (before mixing), to sums[1] their count: the spread of the replicas.
static inline void lp_replicas_gossip(LPModel* ms, int n, float sums[2]) {
    for (int k = 0; k < n; k++) {
        for (int p = 0; p < ms[k].parts; p++) {
            LPZero* z = lp_model_part(&ms[k], p);
            const LPGroup* g = z->replicas;
            int K = z->par->gossip, d = g->size;
            size_t count = lp_zero_shard_count(z);
            float* own = (float*)lp_host_malloc((K + 1) * (count ? count : 1) * sizeof(float), "the neighbours' weights");
            float* in = own + count;
            lp_copy_to_host(own, z->master, count * sizeof(float));
            for (int j = 0; j < K; j++) {
                int hop = 1 << j;
                lp_sendrecv_host(g, own, (g->rank + hop) % d, in + j * count, (g->rank - hop + d) % d, count);  // (hop < d)
                lp_traffic(g, LP_SEND, count * sizeof(float));
            }
            double sq = 0.0;
            for (size_t i = 0; i < count; i++) sq += (double)(own[i] - in[i]) * (own[i] - in[i]);
            sums[0] += (float)sq;
            sums[1] += (float)count;
            lp_copy_to_device(z->mix, in, K * count * sizeof(float));
            free(own);
        }
        lp_model_update_shard(&ms[k], lp_mix_piece, NULL);
    }
}
#endif  // LLMPAR_IMPLEMENTATION

// The recent losses, for spotting a spike: a step's loss far above their mean. The mean is 0 until the
// window is full (early losses fall fast, so a shorter history would flag ordinary steps).
#define LP_SPIKE_WINDOW 20
typedef struct LPLossWindow {
    float loss[LP_SPIKE_WINDOW];
    int count;  // losses added so far
} LPLossWindow;
#ifdef LLMPAR_IMPLEMENTATION
void lp_loss_window_add(LPLossWindow* w, float loss) { w->loss[w->count++ % LP_SPIKE_WINDOW] = loss; }
float lp_loss_window_mean(const LPLossWindow* w) {
    if (w->count < LP_SPIKE_WINDOW) return 0.0f;
    double s = 0.0;
    for (int k = 0; k < LP_SPIKE_WINDOW; k++) s += w->loss[k];
    return (float)(s / LP_SPIKE_WINDOW);
}
#endif  // LLMPAR_IMPLEMENTATION

// Dynamic loss scaling, for fp16 (make train_gpt_fp16), whose gradients flush to 0 below 6e-8 and overflow
// above 65504. Backward starts from the loss's gradient times `scale` (lp_step_forward_backward: the seed
// of dlogits and of the auxiliary losses'), so small gradients stay representable; the norm is taken of
// them divided by it, and AdamW takes them divided by it within the clipping factor (no pass of its own).
// An inf or NaN in any gradient makes the global norm not finite on every rank (lp_step_grad_norm): that
// step overflowed, its update is skipped and the scale multiplied by `backoff`; after `window` clean steps
// in a row it is multiplied by `growth`. The scale stays within [1, 2^24]: an overflow at 1 is no scaling
// problem but a divergence (the driver's guard takes it), and at 2^24 a gradient of 2^-8 already overflows
// fp16 (the cap keeps the fp32 CPU engine's scale finite). The CPU engine runs the same logic in fp32, where
// scaling by powers of two changes no bit of a run that never overflows.
#define LP_LOSS_SCALE_MAX 16777216.0f
typedef struct LPLossScaler {
    float scale;            // the loss's gradient is multiplied by this; 0: no loss scaling
    float backoff, growth;  // the scale's factor after an overflow (< 1), and after `window` clean steps (>= 1)
    int window;
    int clean;    // clean steps since the last overflow or growth
    int skipped;  // steps skipped for an overflow (in the run so far, resumes included)
} LPLossScaler;

#ifdef LLMPAR_IMPLEMENTATION
int lp_loss_scaler_update(LPLossScaler* s, float norm) {
    if (s->scale == 0.0f) return 0;
    if (!isfinite(norm)) {
        if (s->scale <= 1.0f) return 0;  // (the divergence guard's)
        s->scale = fmaxf(s->scale * s->backoff, 1.0f);
        s->clean = 0;
        s->skipped++;
        return 1;
    }
    if (++s->clean >= s->window) {
        s->scale = fminf(s->scale * s->growth, LP_LOSS_SCALE_MAX);
        s->clean = 0;
    }
    return 0;
}

// Linear warmup over `warmup` steps, then cosine (or linear) decay from lr to lr * final_frac at max_steps.
float lp_lr_schedule(int step, int max_steps, int warmup, float lr, float final_frac, int cosine) {
    if (step < warmup) return lr * (step + 1) / warmup;
    float floor_lr = lr * final_frac;
    float progress = max_steps > warmup ? (float)(step - warmup) / (float)(max_steps - warmup) : 1.0f;
    if (progress > 1.0f) progress = 1.0f;
    if (cosine) return floor_lr + 0.5f * (lr - floor_lr) * (1.0f + cosf(3.14159265358979f * progress));
    return lr - (lr - floor_lr) * progress;
}
#endif  // LLMPAR_IMPLEMENTATION

// ----------------------------------------------------------------------------------------------------
// 11. costs

#ifdef LLMPAR_IMPLEMENTATION
// The MLP weights a token meets in an average layer: in its up projection (GELU's H x C; SwiGLU's gate and up,
// 2 H x C; a MoE layer: the router, and top-k experts' of E) into *up, in its down projection (C x H) into *down.
static inline void lp_mlp_active_weights(const LPConfig* c, double* up, double* down) {
    double C = c->channels, L = c->num_layers, moe = lp_layers_having(c, LP_ROUTERW, 0, c->num_layers);
    double E = c->moe_experts, K = c->moe_topk, H = lp_ffn_hidden(c), F = c->swiglu ? 2.0 * H : H;
    *up = ((L - moe) * F * C + moe * (K * F * C + E * C)) / L;
    *down = ((L - moe) + moe * K) * H * C / L;
}
// The attention weights of a layer: qkv's (C + 2 KV HS) x C (grouped-query attention's K and V are smaller) and
// the projection's C x C.
static inline double lp_attention_weights(const LPConfig* c) { return ((double)lp_qkv_rows(c) + c->channels) * c->channels; }

// The parameters one token meets: all of a dense model's; of a MoE layer's experts, K of E.
size_t lp_active_params(const LPConfig* c) {
    size_t sizes[LP_NUM_PARAMS], n = lp_config_num_params(c), E = c->moe_experts, K = c->moe_topk;
    lp_param_sizes(sizes, c, 1);
    size_t experts = sizes[LP_EXPFCW] + sizes[LP_EXPFCB] + sizes[LP_EXPFCPROJW] + sizes[LP_EXPFCPROJB];
    return E ? n - experts / E * (E - K) : n;
}

// Training FLOPs per token (forward + backward = 3x forward): 6 per weight in a matmul that the token
// meets (the LM head counts its Vp x C, wte's or headw's; the embedding, wpe, the norms and RoPE do no matmul
// work; a MoE layer counts its router and top-k experts) plus attention's q k^T and att v over the query heads:
// 12 L C T.
double lp_flops_per_token(const LPConfig* c, int T) {
    double C = c->channels, up, down;
    lp_mlp_active_weights(c, &up, &down);
    double matmul_weights = (double)c->padded_vocab_size * C + c->num_layers * (lp_attention_weights(c) + up + down);
    return 6.0 * matmul_weights + 12.0 * c->num_layers * C * (double)T;
}
#endif  // LLMPAR_IMPLEMENTATION

// --- pipeline partition: how many of the L layers each of the p*v chunks runs (chunk k is virtual stage
// k: stage k % p, its chunk k / p). The first chunk also runs the embedding, the last the final LayerNorm
// and the tied LM head, which costs 6 Vp C FLOPs per token: for GPT-2 124M as much as 4.5 layers.
//   uniform   L/(p v) layers each (L must divide);
//   balanced  from FLOP and memory estimates: first the least work on the costliest chunk (training FLOPs
//             per token); among the partitions that reach it, the least memory on the fullest chunk (its
//             parameters, gradients and AdamW state as ZeRO shards them, and the activations of every
//             micro-batch the schedule keeps in flight on it: under 1F1B stage s keeps p-s, so stage 0
//             gives up layers first). Ties: later chunks take more layers. Only the end chunks may have
//             no layers (the LM head alone can outweigh a layer). With v = 1 a chunk is a stage, so this
//             is the fullest stage; with v > 1 it is the fullest chunk;
//   L1,L2,... as listed (p v counts summing to L).
// What the costs weigh: the grid and its settings (the schedule, its m micro-batches, how TP, SP, d, ZeRO,
// recomputation and offload split and keep each chunk), a micro-batch's shape, and the attention path.
typedef struct LPPipeShape {
    const LPParallel* par;
    int B, T;           // micro-batch
    int attention;      // LP_ATTENTION_*: which attention activations each micro-batch keeps
    int gpu;            // 1: count bytes as the CUDA build keeps them (bf16 values, fp32 master weights), 0: as
                        // the CPU build does (fp32 values, attention's probabilities kept), on any build (the planner
                        // plans either; the engine's own partition passes LP_BUILD_GPU)
} LPPipeShape;

#ifdef LLMPAR_IMPLEMENTATION
// The bytes of a stored value, and whether fp32 master weights are kept beside them, for shape s.
static inline size_t lp_shape_value_bytes(const LPPipeShape* s) { return s->gpu ? 2 : 4; }
static inline int lp_shape_master_copy(const LPPipeShape* s) { return s->gpu; }

// Training FLOPs per token of an average layer (lp_attention_weights, lp_mlp_active_weights): 3x its forward's
// (6 per weight, 12 C T of attention), plus what backward recomputes: under full recomputation all but a dense
// MLP's projection (GPT-2's: 16 C^2 + 4 C T for a dense layer; a MoE layer's experts' too), or with `whole` the
// whole forward (a checkpointed layer, as Megatron-LM reruns it: 24 C^2 + 4 C T), under selective q k^T (2 C T).
double lp_layer_flops(const LPConfig* c, int T, int recompute, int whole) {
    double C = c->channels, A = lp_attention_weights(c), up, down;
    lp_mlp_active_weights(c, &up, &down);
    double moe = (double)lp_layers_having(c, LP_ROUTERW, 0, c->num_layers) / c->num_layers;
    double flops = 6.0 * (A + up + down) + 12.0 * C * T;
    if (recompute == LP_RECOMPUTE_FULL) flops += 2.0 * (A + up + (whole ? 1.0 : moe) * down) + 4.0 * C * T;
    if (recompute == LP_RECOMPUTE_SELECTIVE) flops += 2.0 * C * T;
    return flops;
}
// ... and of chunk k running `layers` layers (the last chunk also the LM head).
double lp_chunk_flops(const LPConfig* c, const LPPipeShape* s, int k, int layers) {
    double head = k == s->par->pp * s->par->vpp - 1 ? 6.0 * c->padded_vocab_size * c->channels : 0.0;
    return layers * lp_layer_flops(c, s->T, s->par->recompute, 0) + head;
}

// The most micro-batches whose activations chunk k (virtual stage k) keeps at once under the shape's schedule: what
// lp_schedule_slots counts on its stage's list, counted without the list (the planner asks it of every chunk of
// thousands of configurations). The list's i-th forward and j-th backward are of chunk c of the stage where i % (p v) / p
// is c, and (j % (p v)) / p is v - 1 - c (lp_schedule_action); right after its i-th forward the stage has run its
// backwards before the (i - w)-th (w: its warm-up; after it a forward and a backward alternate).
static inline int lp_schedule_count(int n, int p, int v, int c) {  // (how many of the indices 0..n-1 are chunk c's)
    return n / (p * v) * p + (n % (p * v) > c * p ? (n % (p * v) - c * p < p ? n % (p * v) - c * p : p) : 0);
}
int lp_chunk_slots(const LPPipeShape* s, int k) {
    int p = s->par->pp, v = s->par->vpp, m = s->par->micro_batches, c = k / p, most = 1;
    int warmup = lp_schedule_warmup(s->par->schedule, p, v, m, k % p);
    for (int i = 0; i < m * v; i++) {
        if (i % (p * v) / p != c) continue;
        int held = lp_schedule_count(i + 1, p, v, c) - lp_schedule_count(i > warmup ? i - warmup : 0, p, v, v - 1 - c);
        if (held > most) most = held;
    }
    return most;
}

// Parameters one rank of chunk k with `layers` layers holds (its TP slice, whose tensors' sizes are `sizes`:
// lp_param_sizes at t). (*experts, when not NULL: how many of them are a mixture of experts' experts, this rank's E/ep.)
static inline double lp_chunk_params_of(const size_t* sizes, const LPConfig* c, const LPPipeShape* s, int k, int layers, double* experts) {
    int chunks = s->par->pp * s->par->vpp;
    double params = 0.0, held = 0.0;
    for (int i = 0; i < LP_NUM_PARAMS; i++) {
        if (lp_is_layer_tensor(i)) {
            held = (double)sizes[i] / c->num_layers * layers / (lp_is_expert_tensor(i) ? s->par->ep : 1);  // (an average layer's)
            params += held;
            if (experts && lp_is_expert_tensor(i)) *experts += held;
        } else if (i == LP_WPE ? k == 0 : i == LP_WTE ? k == 0 || (!c->untied && k == chunks - 1) : k == chunks - 1) {
            params += sizes[i];
        }
    }
    return params;
}
double lp_chunk_params(const LPConfig* c, const LPPipeShape* s, int k, int layers, double* experts) {
    size_t sizes[LP_NUM_PARAMS];
    lp_param_sizes(sizes, c, s->par->tp);
    return lp_chunk_params_of(sizes, c, s, k, layers, experts);
}

// The rows of each piece of a TP rank's wte (Vp/t rows of C) under ZeRO-2/3 without a pipeline (section 8), from the
// rank's tensors' sizes (lp_param_sizes at t).
static inline size_t lp_wte_piece_rows(const size_t* sizes, const LPConfig* c, int t) {
    size_t layer = 0;  // one layer's parameters on a TP rank (an average layer's)
    for (int i = 0; i < LP_NUM_PARAMS; i++) layer += lp_is_layer_tensor(i) ? sizes[i] / c->num_layers : 0;
    return lp_zero_piece_rows((size_t)c->padded_vocab_size / t, (size_t)c->channels, layer);
}

// Bytes one rank of chunk k with `layers` layers holds, keeping `slots` micro-batches' activations.
// ZeRO shards over d ranks what it shards of the flat parameters in equal parts (a shard each); stages 2
// and 3 keep wpe, lnf and an untied head (`outside`) whole, and wte too in a pipeline with a tied head (copies on
// two stages; else stage 3 gathers it a piece at a time into two buffers), plus two layers' buffers of gradients (reduced in place,
// wte's pieces too) or weights when the chunk has layers (section 8).
double lp_chunk_memory(const LPConfig* c, const LPPipeShape* s, int k, int layers, int slots) {
    int chunks = s->par->pp * s->par->vpp;
    size_t sizes[LP_NUM_PARAMS];
    lp_param_sizes(sizes, c, s->par->tp);
    double layer = 0.0, experts = 0.0;  // one layer's parameters on a TP rank (an average layer's; its experts E/ep)
    for (int i = 0; i < LP_NUM_PARAMS; i++)
        layer += lp_is_layer_tensor(i) ? (double)sizes[i] / c->num_layers / (lp_is_expert_tensor(i) ? s->par->ep : 1) : 0.0;
    double n = lp_chunk_params_of(sizes, c, s, k, layers, &experts);  // (the sizes once: the partition weighs every chunk at every count)
    // ZeRO shards the dense part over d (with context parallelism, cp d), the experts over their d/ep replicas
    double outside = n - layer * layers, parts = s->par->zero >= 1 ? s->par->dp * s->par->cp : 1, X = lp_shape_value_bytes(s);
    double shard = ceil((n - experts) / parts) + ceil(experts / (s->par->zero >= 1 ? s->par->dp / s->par->ep : 1));
    parts = shard > 0.0 ? n / shard : 1.0;  // (what a shard is of the whole the rank holds)
    double buffer = layers ? layer : 0.0, piece = 0.0;
    if (s->par->zero >= 2 && (chunks == 1 || (c->untied && k == 0 && layers > 0))) {  // the only copy of wte, in pieces (section 8)
        outside -= (double)sizes[LP_WTE];
        piece = (double)lp_wte_piece_rows(sizes, c, s->par->tp) * c->channels;
    }
    double params = s->par->zero >= 3 ? outside + (s->par->offload == LP_OFFLOAD_PARAMS ? 0.0 : shard) + 2 * buffer + 2 * piece : shard * parts;
    double grads = s->par->zero >= 2 ? outside + 2 * buffer + shard : shard * parts;
    // only what lp_activations_layout reads, to count the chunk's activation bytes (the rest of an LPModel,
    // its ZeRO state's buffers of pending collectives, is ~0.8 MB: on the heap, not the stack, and not cleared)
    LPModel* shape = (LPModel*)lp_host_malloc(sizeof(LPModel), "chunk shape");
    shape->cfg = *c;
    shape->par = s->par;
    shape->tp_size = s->par->tp;
    shape->ep_size = s->par->ep;
    shape->cp_size = s->par->cp;
    shape->attention = s->attention;
    shape->L = layers;
    shape->layer0 = 0;
    shape->last = k == chunks - 1;
    shape->num_aux = 0;
    shape->moe.capacity = 0.0f;  // (a mixture of experts' buffers for the most rows an expert may take)
    LPActivations a;
    size_t scratch, stored = lp_activations_layout(&a, shape, s->B, s->T, s->gpu, NULL, NULL, &scratch);
    free(shape);
    int master = lp_shape_master_copy(s);
    double state = (master ? 3.0 : 2.0) * shard;  // fp32: the master weights (a copy: the CUDA build), m and v
    if (s->par->offload != LP_OFFLOAD_NONE)  // the CUDA build: all of it on the host; the CPU build's file: two buffers of m, v
        state = master ? 0.0 : 4.0 * lp_offload_chunk((size_t)shard);
    return (params + grads) * X + state * sizeof(float) + (double)slots * stored + scratch;
}

// The partition of L layers over the chunks whose largest cost[k][n] (chunk k running n layers; INFINITY
// where not allowed) is least; returns that cost. Dynamic programming over the chunks in order:
// best[k][l] is the least largest cost of chunks 0..k running layers 0..l-1.
static inline double lp_partition_minmax(const double* cost, int chunks, int L, int* layers) {
    if (chunks < 1 || L < 0) lp_fail("internal: a partition of %d layers over %d chunks", L, chunks);
    double* best = (double*)lp_host_malloc((size_t)chunks * (L + 1) * sizeof(double), "partition");
    int* take = (int*)lp_host_malloc((size_t)chunks * (L + 1) * sizeof(int), "partition");
    for (int k = 0; k < chunks; k++)
        for (int l = 0; l <= L; l++) {
            best[k * (L + 1) + l] = INFINITY;
            take[k * (L + 1) + l] = 0;
            for (int n = l; n >= 0; n--) {  // from the most layers down: ties leave chunk k the most
                double before = k ? best[(k - 1) * (L + 1) + l - n] : (n == l ? 0.0 : INFINITY);
                double here = cost[k * (L + 1) + n], worst = before > here ? before : here;  // (not fmax: a libm call)
                if (worst < best[k * (L + 1) + l]) {
                    best[k * (L + 1) + l] = worst;
                    take[k * (L + 1) + l] = n;
                }
            }
        }
    double result = best[(chunks - 1) * (L + 1) + L];
    for (int k = chunks - 1, l = L; k >= 0; l -= layers[k], k--) layers[k] = take[k * (L + 1) + l];
    free(best);
    free(take);
    return result;
}

// Fill layers[p v]; returns NULL, or why the partition cannot be (naming the flag).
const char* lp_pp_partition(const LPConfig* c, const LPPipeShape* s, int* layers, char* why, size_t size) {
    const char *mode = s->par->partition, *pp = LP_SETTING(pp), *vpp = LP_SETTING(vpp), *partition = LP_SETTING(partition);
    int chunks = s->par->pp * s->par->vpp, L = c->num_layers;
    if (s->par->pp < 1 || s->par->vpp < 1 || (long long)s->par->pp * s->par->vpp > LP_MAX_CHUNKS) {
        snprintf(why, size, "%s %d %s %d: 1 .. %d chunks", pp, s->par->pp, vpp, s->par->vpp, LP_MAX_CHUNKS);
        return why;
    }
    if (s->par->vpp > 1 && s->par->pp < 2) {
        snprintf(why, size, "%s %d: interleaving chunks needs a pipeline, %s 2 or more", vpp, s->par->vpp, pp);
        return why;
    }
    if (lp_schedule_check(s->par->schedule, s->par->pp, s->par->vpp, s->par->micro_batches, why, size)) return why;
    if (strcmp(mode, "uniform") == 0) {
        if (L % chunks) {
            snprintf(why, size, "%s uniform: the model's %d layers do not split evenly over %d chunks (%s %d x %s %d); "
                     "use balanced or a list", partition, L, chunks, pp, s->par->pp, vpp, s->par->vpp);
            return why;
        }
        for (int k = 0; k < chunks; k++) layers[k] = L / chunks;
    } else if (strcmp(mode, "balanced") == 0) {
        double* flops = (double*)lp_host_malloc((size_t)chunks * (L + 1) * sizeof(double), "partition");
        double* memory = (double*)lp_host_malloc((size_t)chunks * (L + 1) * sizeof(double), "partition");
        for (int k = 0; k < chunks; k++) {
            int slots = lp_chunk_slots(s, k);
            for (int n = 0; n <= L; n++) {
                int allowed = n > 0 || k == 0 || k == chunks - 1;
                flops[k * (L + 1) + n] = allowed ? lp_chunk_flops(c, s, k, n) : INFINITY;
                memory[k * (L + 1) + n] = lp_chunk_memory(c, s, k, n, slots);
            }
        }
        double least = lp_partition_minmax(flops, chunks, L, layers);
        for (int x = 0; x < chunks * (L + 1); x++)
            if (flops[x] > least) memory[x] = INFINITY;  // only partitions as fast as the fastest
        lp_partition_minmax(memory, chunks, L, layers);
        free(flops);
        free(memory);
    } else {
        const char* q = mode;
        int n = 0, sum = 0;
        while (*q && n <= chunks) {
            char* end;
            long x = strtol(q, &end, 10);
            if (end == q || x < 0 || (*end && *end != ',')) {
                snprintf(why, size, "%s '%s': expected balanced, uniform or a list of layer counts like 4,4,3,1", partition, mode);
                return why;
            }
            if (n < chunks) layers[n] = (int)x;
            n++;
            sum += (int)x;
            q = *end ? end + 1 : end;
        }
        if (n != chunks || sum != L) {
            snprintf(why, size, "%s %s: needs %d counts (%s %d x %s %d) summing to the model's %d layers", partition, mode, chunks,
                     pp, s->par->pp, vpp, s->par->vpp, L);
            return why;
        }
    }
    for (int k = 1; k < chunks - 1; k++)
        if (layers[k] == 0) {
            snprintf(why, size, "%s %d %s %d: chunk %d of %d gets no layers (the model has %d); every chunk but the first "
                     "and the last needs one", pp, s->par->pp, vpp, s->par->vpp, k, chunks, L);
            return why;
        }
    return NULL;
}

// Dense bf16 peak of this GPU in FLOP/s, 0 when unknown (then MFU is not printed).
double lp_device_peak_flops(void) {
#ifdef LLMPAR_CPU
    return 0.0;
#else
    const char* name = lp_device_prop.name;
    if (strstr(name, "H100") && strstr(name, "PCIe")) return 756e12;
    if (strstr(name, "H100") && strstr(name, "NVL")) return 835e12;
    if (strstr(name, "H100") || strstr(name, "H200") || strstr(name, "H800") || strstr(name, "GH200")) return 989.4e12;
    if (strstr(name, "A100") || strstr(name, "A800")) return 312e12;
    if (strstr(name, "L40S")) return 362e12;
    if (strstr(name, "4090")) return 165.2e12;
    if (strstr(name, "3090")) return 71e12;
    return 0.0;
#endif
}
#endif  // LLMPAR_IMPLEMENTATION

// ----------------------------------------------------------------------------------------------------
// 12. pipeline
//
// This rank's stage s of a p-stage pipeline: its v chunks of the model (chunk c is virtual stage
// k = c*p + s and runs the layers lp_pp_partition gave chunk k) and its schedule (lp_schedule_stage). A
// forward of (micro-batch i, chunk c) receives the residual stream from virtual stage k-1 (k = 0 embeds the
// tokens instead), runs the chunk and sends its output on to k+1 (the last computes the loss); a backward
// receives its output's gradient from k+1 and sends its input's gradient back to k-1. A micro-batch keeps
// its activations in one of the chunk's slots from its forward to its backward: as many slots as the
// schedule has micro-batches in flight on that chunk (1F1B: p-s; GPipe: m).
// Scatter-gather: with tensor parallelism but no sequence parallelism the tensor at a boundary is the same
// on all t ranks of a TP group, so each sends only its 1/t of the rows, and the receivers all-gather them.
// With p = 1 the stage is the whole model and 1F1B is plain gradient accumulation: F0 B0 F1 B1 ...

typedef struct LPStage {
    const LPParallel* par;  // p stages, v chunks per stage, m micro-batches per step, the schedule, ...
    int s;                  // this stage
    int layers[LP_MAX_CHUNKS];  // the partition: layers per chunk (of all p v)
    LPModel* chunks;        // (v) chunk c is virtual stage c*p + s
    const LPGroup* pp;      // this pipeline's stages
    const LPGroup* cp;      // context parallelism: the ranks sharing each sequence (lp_cp_take: this rank's rows)
    LPGroup head;           // the stages holding the head (wte, lnf): 0, p-1 and those with auxiliary losses
    int num_aux;            // auxiliary losses: the model's layers whose outputs have one, and the last step's
    int aux[LP_MAX_AUX];    // mean values (on every rank of the pipeline)
    float aux_loss[LP_MAX_AUX];
    LPMoEStats moe_stats;   // a mixture of experts': the last step's, summed over the grid (aux, z: their mean over DP)
    LPAction* actions;      // (2 m v) this stage's schedule
    int* slot_owner;        // (v, m) the micro-batch in each of a chunk's slots, -1 free
    int* tokens;            // (m, 2, B, T/cp) the step's inputs and targets (this rank's rows of them)
    LPSends sends;          // MPI sends in flight
    int inner;              // DiLoCo (par->diloco): inner steps taken in the round under way (0: none since an outer step)
    float loss_scale;       // the next step's loss scale (LPLossScaler.scale; 1, lp_stage_create's: none)
#ifdef LLMPAR_NCCL
    // NCCL point-to-point, when the pipeline group runs on NCCL: a two-rank communicator per link between
    // neighbouring stages and direction, so each is used from one stream only. link[0] carries
    // activations, link[1] gradients; link[d][0] is with the next stage, link[d][1] with the previous.
    // Sends go on their direction's stream (never holding up compute), receives on the compute stream.
    ncclComm_t link[2][2];
    cudaStream_t send_stream[2];
    cudaEvent_t ready;
#endif
    // the last step's seconds: each chunk's forwards, then backwards (2, v), each synchronised; waiting to
    // receive; in all
    double* chunk_s;
    double wait_s, wall_s;
    // sums of these over the timed steps (lp_stage_time_step), for the bubble report (lp_stage_bubble)
    double* chunk_sum;
    double wall_sum;
    int timed_steps;
} LPStage;

#ifdef LLMPAR_IMPLEMENTATION
// This rank's stage of the pipeline, on base->proc's grid as its LPParallel says (p = 1: the whole model): the
// model's layers partitioned over the p v chunks (par->partition; "balanced" weighs micro-batches of B x T),
// this stage's chunks made with base's other options (unset weights), its actions in the schedule, and
// activations for micro-batches of B x T in as many slots as each chunk has micro-batches in flight (with
// context parallelism, of this rank's B x T/cp rows: T splits into 2 cp chunks).
void lp_stage_create(LPStage* st, const LPConfig* cfg, const LPModelOptions* base, int B, int T) {
    memset(st, 0, sizeof(*st));
    const LPProcess* proc = base->proc;
    if (!proc) lp_fail("lp_stage_create: the stage needs the grid (LPModelOptions.proc, after lp_grid_init)");
    const LPParallel* par = st->par = proc->par;
    int p = par->pp, v = par->vpp, m = par->micro_batches;
    st->s = proc->coord[LP_PP];
    st->pp = &proc->group[LP_PP];
    st->cp = &proc->group[LP_CP];
    if (par->cp > 1 && T % (2 * par->cp))
        lp_fail_all("%s %d: the sequence length T = %d does not split into 2 cp = %d chunks of equal length", LP_SETTING(cp), par->cp, T,
                    2 * par->cp);
    T /= par->cp;
    LPPipeShape shape = {par, B, T, base->attention, LP_BUILD_GPU};
    char why[512];
    if (lp_pp_partition(cfg, &shape, st->layers, why, sizeof(why))) lp_fail_all("%s", why);
    if (base->num_aux > LP_MAX_AUX) lp_fail_all("at most %d auxiliary losses, got %d", LP_MAX_AUX, base->num_aux);
    st->num_aux = base->num_aux;
    for (int j = 0; j < st->num_aux; j++) st->aux[j] = base->aux[j];
    if (2LL * p * v * m > 32767)  // the tags MPI guarantees (lp_stage_tag)
        lp_fail_all("%s %d %s %d: %d micro-batches per step are too many to tag their messages (at most %d)", LP_SETTING(pp), p,
                    LP_SETTING(vpp), v, m, 32767 / (2 * p * v));
    st->actions = (LPAction*)lp_host_malloc((size_t)2 * m * v * sizeof(LPAction), "schedule");
    st->chunk_s = (double*)calloc((size_t)2 * v, sizeof(double));
    st->chunk_sum = (double*)calloc((size_t)2 * v, sizeof(double));
    lp_schedule_stage(par->schedule, p, v, m, st->s, st->actions);
    st->loss_scale = 1.0f;
    st->chunks = (LPModel*)lp_host_malloc((size_t)v * sizeof(LPModel), "model chunks");
    for (int c = 0; c < v; c++) {
        LPModelOptions chunk = *base;
        chunk.chunk = c * p + st->s;
        chunk.chunks = p * v;
        chunk.layer0 = 0;
        for (int k = 0; k < chunk.chunk; k++) chunk.layer0 += st->layers[k];
        chunk.layers = st->layers[chunk.chunk];
        lp_model_create(&st->chunks[c], cfg, &chunk);
    }
    st->slot_owner = (int*)lp_host_malloc((size_t)v * m * sizeof(int), "activation slots");
    st->tokens = (int*)lp_host_malloc((size_t)m * 2 * B * T * sizeof(int), "micro-batch tokens");
    for (int c = 0; c < v; c++) lp_model_alloc_activations(&st->chunks[c], B, T, lp_schedule_slots(st->actions, 2 * m * v, c));
#ifdef LLMPAR_NCCL
    if (st->pp->nccl) {  // link l joins stage l (its member 0) and stage l+1 (member 1), for each direction
        for (int dir = 0; dir < 2; dir++)
            for (int l = 0; l < st->par->pp; l++) {
                ncclUniqueId id;
                if (st->s == l) lp_nccl_check(ncclGetUniqueId(&id), "unique id", st->pp);
                lp_mpi_check(MPI_Bcast(&id, sizeof(id), MPI_BYTE, l, st->pp->comm), "broadcast of the NCCL id", st->pp);
                if (st->s == l) lp_nccl_comm_init(&st->link[dir][0], 2, id, 0, "link init", st->pp);
                if (st->s == (l + 1) % st->par->pp) lp_nccl_comm_init(&st->link[dir][1], 2, id, 1, "link init", st->pp);
            }
        for (int dir = 0; dir < 2; dir++) cudaCheck(cudaStreamCreateWithFlags(&st->send_stream[dir], cudaStreamNonBlocking));
        cudaCheck(cudaEventCreateWithFlags(&st->ready, cudaEventDisableTiming));
        // send copies come from the default pool, freed on the send streams: it must never hand the compute
        // stream a block whose send is still pending (that would make compute wait on a send, and an
        // interleaved schedule can then deadlock); when short of memory it then fails with out of memory.
        // The pool keeps what it has (release threshold: all of it), so each step's sends reuse the memory
        // the first step mapped instead of mapping it again after every synchronisation.
        cudaMemPool_t pool;
        int never = 0;
        uint64_t keep = UINT64_MAX;
        cudaCheck(cudaDeviceGetDefaultMemPool(&pool, proc->device));
        cudaCheck(cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &never));
        cudaCheck(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    }
#endif
    // the head group: a communicator of the stages whose chunks hold the head
    int holds = 0;
    for (int c = 0; c < v; c++) holds |= st->chunks[c].head;
    st->head.name = "head";
    st->head.size = 1;
#ifdef LLMPAR_MPI
    if (st->pp->size > 1) {
        MPI_Comm_split(st->pp->comm, holds ? 0 : MPI_UNDEFINED, st->s, &st->head.comm);
        if (holds) {
            MPI_Comm_size(st->head.comm, &st->head.size);
            MPI_Comm_rank(st->head.comm, &st->head.rank);
            MPI_Comm_set_errhandler(st->head.comm, MPI_ERRORS_RETURN);
#ifdef LLMPAR_NCCL
            if (st->pp->nccl) lp_group_nccl_init(&st->head, &st->head.nccl);  // the head's gradient sum on the GPU, like the stages' traffic
#endif
        }
    }
#endif
}

// Messages are told apart by the virtual stage receiving them, the micro-batch and the direction.
static inline int lp_stage_tag(const LPStage* st, int k, int micro, int backward) { return (k * st->par->micro_batches + micro) * 2 + backward; }

// The tensor at a chunk's boundary in a (B, T) pass is (rows, C), rows = B*T (or this rank's B*T/t with
// sequence parallelism). Scatter-gather sends only this TP rank's block of the rows.
static inline int lp_stage_scatters(const LPStage* st, const LPModel* c, int B, int T) {
    return st->par->scatter_gather && c->tp_size > 1 && !c->par->sp && (size_t)B * T % c->tp_size == 0;
}
static inline size_t lp_stage_boundary(const LPStage* st, const LPModel* c, int B, int T, size_t* offset) {
    size_t n = (size_t)B * T * c->cfg.channels / (c->par->sp ? c->tp_size : 1);
    *offset = 0;
    if (lp_stage_scatters(st, c, B, T)) {
        n /= c->tp_size;
        *offset = n * c->tp_rank;
    }
    return n;
}
// Send x's boundary of micro-batch i to virtual stage k: activations (dir 0) to the next stage, gradients
// (dir 1) to the previous one.
static inline void lp_stage_send(LPStage* st, const LPModel* c, const floatX* x, int B, int T, int k, int i, int dir) {
    size_t off, n = lp_stage_boundary(st, c, B, T, &off);
#ifdef LLMPAR_NCCL
    if (st->pp->nccl) {  // a copy, as x may change before the receiver takes it; freed when sent
        size_t bytes = n * sizeof(floatX);
        void* buf;
        cudaCheck(cudaMallocAsync(&buf, bytes, 0));
        cudaCheck(cudaMemcpyAsync(buf, x + off, bytes, cudaMemcpyDeviceToDevice, 0));
        cudaCheck(cudaEventRecord(st->ready, 0));
        cudaCheck(cudaStreamWaitEvent(st->send_stream[dir], st->ready, 0));
        lp_nccl_check(ncclSend(buf, bytes, ncclChar, dir ? 0 : 1, st->link[dir][dir], st->send_stream[dir]), "send", st->pp);
        cudaCheck(cudaFreeAsync(buf, st->send_stream[dir]));
        lp_traffic(st->pp, LP_SEND, bytes);
        return;
    }
#endif
    lp_send(st->pp, x + off, n, (st->s + (dir ? st->par->pp - 1 : 1)) % st->par->pp, lp_stage_tag(st, k, i, dir), &st->sends);
}

// Receive into x virtual stage k's boundary of micro-batch i, sent as in lp_stage_send; time spent waiting
// counts in wait_s.
static inline void lp_stage_recv(LPStage* st, const LPModel* c, floatX* x, int B, int T, int k, int i, int dir) {
    size_t off, n = lp_stage_boundary(st, c, B, T, &off);
    double t0 = lp_time_s();
#ifdef LLMPAR_NCCL
    if (st->pp->nccl) {
        lp_nccl_check(ncclRecv(x + off, n * sizeof(floatX), ncclChar, dir ? 1 : 0, st->link[dir][1 - dir], 0), "receive", st->pp);
        lp_compute_sync();  // to time the wait
    } else
#endif
    lp_recv(st->pp, x + off, n, (st->s + (dir ? 1 : st->par->pp - 1)) % st->par->pp, lp_stage_tag(st, k, i, dir));
    st->wait_s += lp_time_s() - t0;
    if (lp_stage_scatters(st, c, B, T)) lp_all_gather(c->tp, x, n * sizeof(floatX));
}

// Forward of micro-batch i through chunk c, its activations in slot `slot`. Returns the loss on the last
// virtual stage (else 0).
static inline float lp_stage_forward(LPStage* st, int c, int i, int slot, const int* inputs, const int* targets, int B, int T,
                                     float dloss) {
    LPModel* mc = &st->chunks[c];
    int p = st->par->pp, k = c * p + st->s, K = p * st->par->vpp;
    lp_model_use_slot(mc, slot);
    if (k > 0) lp_stage_recv(st, mc, mc->act.encoded, B, T, k, i, 0);
    double t0 = lp_time_s();
    int ev = lp_trace_begin("compute", "F", i, c);
    float loss = lp_model_forward(mc, k == 0 ? inputs : NULL, k == K - 1 || mc->num_aux ? targets : NULL, B, T, dloss);
    lp_trace_end(ev);
    if (k < K - 1) lp_stage_send(st, mc, lp_model_output(mc), B, T, k + 1, i, 0);
    lp_compute_sync();
    st->chunk_s[c] += lp_time_s() - t0;
    return loss;
}

// Backward of micro-batch i through chunk c, from slot `slot`; `last`: the chunk's last backward of the
// step. Auxiliary losses need the micro-batch's targets again.
static inline void lp_stage_backward(LPStage* st, int c, int i, int slot, int last, const int* targets) {
    LPModel* mc = &st->chunks[c];
    int p = st->par->pp, k = c * p + st->s, K = p * st->par->vpp, B = mc->cur_B, T = mc->cur_T;
    lp_model_use_slot(mc, slot);
    if (mc->num_aux) lp_copy_to_device(mc->targets, targets, (size_t)B * T * sizeof(int));
    if (k < K - 1) lp_stage_recv(st, mc, mc->act.dresidual, B, T, k, i, 1);
    double t0 = lp_time_s();
    int ev = lp_trace_begin("compute", "B", i, c);
    lp_model_backward(mc, last);
    lp_trace_end(ev);
    if (k > 0) lp_stage_send(st, mc, mc->act.dresidual, B, T, k - 1, i, 1);
    lp_compute_sync();
    st->chunk_s[st->par->vpp + c] += lp_time_s() - t0;
}

// One forward of (B, T) tokens through the whole pipeline, chunk after chunk, in slot 0 (evaluation,
// sampling: the last chunk keeps the logits). Returns the mean loss (with targets), on every rank. With
// context parallelism each rank runs its rows of the sequences and the loss is their mean; sampling's cached
// passes (lp_stage_forward_cached) run whole on every rank.
float lp_stage_forward_only(LPStage* st, const int* inputs, const int* targets, int B, int T) {
    int split = st->cp->size > 1 && !st->chunks[0].cache.kv;
    if (split) {  // (the tokens' room holds a micro-batch's inputs and targets)
        int* mine = st->tokens;
        lp_cp_take(mine, inputs, B, T, st->cp->rank, st->cp->size);
        if (targets) lp_cp_take(mine + (size_t)B * T / st->cp->size, targets, B, T, st->cp->rank, st->cp->size);
        T /= st->cp->size;
        inputs = mine;
        targets = targets ? mine + (size_t)B * T : NULL;
    }
    float loss = 0.0f;
    for (int c = 0; c < st->par->vpp; c++) loss += lp_stage_forward(st, c, 0, 0, inputs, targets, B, T, 0.0f);
    lp_sends_wait(st->pp, &st->sends);
    lp_all_reduce_host(st->pp, &loss, 1, 0);
    if (split) lp_all_reduce_host(st->cp, &loss, 1, 1);
    return loss;
}

// Sampling: every chunk's key-value cache for B sequences of up to T positions (lp_model_cache_alloc), for
// lp_stage_forward_cached's passes; lp_stage_cache_free ends it.
static inline void lp_stage_cache_alloc(LPStage* st, int B, int T) {
    for (int c = 0; c < st->par->vpp; c++) lp_model_cache_alloc(&st->chunks[c], B, T);
}
static inline void lp_stage_cache_free(LPStage* st) {
    for (int c = 0; c < st->par->vpp; c++) lp_model_cache_free(&st->chunks[c]);
}
// lp_stage_forward_only's pass of (B, N) tokens at positions [pos, pos + N) of the cached sequences: their
// keys and values join the caches, and the last chunk's logits are theirs.
static inline void lp_stage_forward_cached(LPStage* st, const int* inputs, int B, int N, int pos) {
    for (int c = 0; c < st->par->vpp; c++) st->chunks[c].cache.pos = pos;
    lp_stage_forward_only(st, inputs, NULL, B, N);
}

// The token a sample starts from, the one its vocabulary begins a document with: Llama 3's (128,256 tokens)
// <|begin_of_text|>, 128000; any other's last token, GPT-2's <|endoftext|> (50256 of 50,257), which is also
// where a Llama on GPT-2's tokenizer (llama:dN) starts, and the tests' tiny vocabularies.
int lp_sample_start(const LPConfig* c) { return c->vocab_size == 128256 ? 128000 : c->vocab_size - 1; }

// The token drawn from a row of logits over the V tokens of the vocabulary with coin in [0, 1): the first
// whose cumulative softmax probability passes coin. Overwrites logits with exp(logit - max).
static inline int lp_sample_draw(float* logits, int V, float coin) {
    float maxv = logits[0], sum = 0.0f;
    for (int v = 1; v < V; v++) if (logits[v] > maxv) maxv = logits[v];
    for (int v = 0; v < V; v++) sum += logits[v] = expf(logits[v] - maxv);
    float target = coin * sum, acc = 0.0f;
    for (int v = 0; v < V; v++) {
        acc += logits[v];
        if (target < acc) return v;
    }
    return V - 1;
}

// Add the last step's timings to the sums the bubble report reads (the driver leaves out the first step,
// which warms up).
void lp_stage_time_step(LPStage* st) {
    for (int k = 0; k < 2 * st->par->vpp; k++) st->chunk_sum[k] += st->chunk_s[k];
    st->wall_sum += st->wall_s;
    st->timed_steps++;
}
#endif  // LLMPAR_IMPLEMENTATION

// The pipeline's bubble over the timed steps, the same on every stage (collective over the pipeline):
// measured, the forward-backward wall time over the busiest stage's compute, less 1; and as the schedule's
// simulator predicts it from the measured cost of each chunk's forward and backward, and from unit costs.
typedef struct LPBubble {
    double measured, simulated, unit;  // fractions of the busiest stage's compute
    double wall_s, busy_s;             // per step
} LPBubble;
#ifdef LLMPAR_IMPLEMENTATION
LPBubble lp_stage_bubble(LPStage* st) {
    int K = st->par->pp * st->par->vpp, m = st->par->micro_batches;
    LPBubble b;
    memset(&b, 0, sizeof(b));
    if (st->timed_steps == 0) return b;
    float* sum = (float*)calloc((size_t)2 * K, sizeof(float));  // each virtual stage's forwards, then backwards
    for (int c = 0; c < st->par->vpp; c++)
        for (int dir = 0; dir < 2; dir++) sum[dir * K + c * st->par->pp + st->s] = (float)st->chunk_sum[dir * st->par->vpp + c];
    lp_all_reduce_host(st->pp, sum, 2 * K, 0);  // each stage adds its chunks'
    double* cost = (double*)calloc((size_t)2 * K, sizeof(double));
    for (int k = 0; k < 2 * K; k++) cost[k] = sum[k] / ((double)st->timed_steps * m);  // one micro-batch
    for (int s = 0; s < st->par->pp; s++) {  // the busiest stage's compute per step
        double busy = 0.0;
        for (int c = 0; c < st->par->vpp; c++) busy += (cost[c * st->par->pp + s] + cost[K + c * st->par->pp + s]) * m;
        if (busy > b.busy_s) b.busy_s = busy;
    }
    float wall = (float)(st->wall_sum / st->timed_steps);
    lp_all_reduce_host(st->pp, &wall, 1, 1);
    b.wall_s = wall;
    b.measured = wall / b.busy_s - 1.0;
    LPSimulation sim;
    char why[512];
    if (lp_schedule_simulate(&sim, st->par->schedule, st->par->pp, st->par->vpp, m, 1.0, 1.0, NULL, why, sizeof(why))) lp_fail_all("%s", why);
    b.unit = sim.bubble;
    lp_simulation_free(&sim);
    if (lp_schedule_simulate(&sim, st->par->schedule, st->par->pp, st->par->vpp, m, 0.0, 0.0, cost, why, sizeof(why))) lp_fail_all("%s", why);
    b.simulated = sim.bubble;
    lp_simulation_free(&sim);
    free(sum);
    free(cost);
    return b;
}

void lp_stage_free(LPStage* st) {
    for (int c = 0; c < st->par->vpp; c++) lp_model_free(&st->chunks[c]);
    free(st->chunks);
    free(st->actions);
    free(st->chunk_s);
    free(st->chunk_sum);
    free(st->slot_owner);
    free(st->tokens);
    lp_sends_free(&st->sends);
#ifdef LLMPAR_MPI
    if (st->head.size > 1) MPI_Comm_free(&st->head.comm);
#endif
#ifdef LLMPAR_NCCL
    if (st->pp->nccl) {
        cudaCheck(cudaDeviceSynchronize());
        if (st->head.nccl) lp_nccl_comm_destroy(st->head.nccl);
        for (int dir = 0; dir < 2; dir++)  // in the order they were made: destroying one waits for its peer
            for (int l = 0; l < st->par->pp; l++) {
                if (st->s == l) lp_nccl_comm_destroy(st->link[dir][0]);
                if (st->s == (l + 1) % st->par->pp) lp_nccl_comm_destroy(st->link[dir][1]);
            }
        for (int dir = 0; dir < 2; dir++) cudaCheck(cudaStreamDestroy(st->send_stream[dir]));
        cudaCheck(cudaEventDestroy(st->ready));
    }
#endif
    memset(st, 0, sizeof(*st));
}
#endif  // LLMPAR_IMPLEMENTATION

// ----------------------------------------------------------------------------------------------------
// 13. step
//
// One optimizer step of this rank's pipeline stage (p = 1: the whole model), in four phases, each one
// call in the driver's loop; each names where the ranks communicate:
//   lp_step_forward_backward  m micro-batches in the schedule's order. TP inside every layer (the Megatron
//                             all-reduces, or with SP reduce-scatters and all-gathers), PP between stages
//                             (sends and receives), and the DP reduction of each layer's gradients started
//                             as soon as its last backward ends (ZeRO's hooks, overlapped with the layers below)
//   lp_step_reduce_grads      the rest of the gradient reduction: the head's copies summed over the stages
//                             holding them, then every gradient averaged over DP (ZeRO 1-3: to its shard)
//   lp_step_grad_norm         the global gradient norm: each rank's part, summed over the grid
//   lp_step_update            clipping and AdamW on this rank's shard; ZeRO 1-3 all-gather the new weights
//   lp_step_replicas          replicas that train apart (no DP in the phases above): DiLoCo's outer step
//                             after every H-th update (an all-reduce over DP), or gossip's mixing (K sends)
// The driver looks at the loss and the norm before it updates (the divergence guard).

#ifdef LLMPAR_IMPLEMENTATION
// The step's forwards and backwards of m micro-batches from `train`, in the schedule's order; gradients
// accumulate in the chunks, times st->loss_scale. Every stage reads the micro-batches (the first needs the inputs, the last the
// targets, and all keep the loader's place). Returns the step's mean loss over the whole batch (summed over
// the pipeline and averaged over DP), on every rank; the auxiliary losses' means in st->aux_loss likewise.
float lp_step_forward_backward(LPStage* st, LPDataLoader* train) {
    int B = train->B, T = train->T / st->cp->size, m = st->par->micro_batches, v = st->par->vpp;  // (T: this rank's rows of a sequence)
    size_t BT = (size_t)B * T;
    double t0 = lp_time_s();
    int phase = lp_trace_begin("step", "forward-backward", -1, -1);
    memset(st->chunk_s, 0, (size_t)2 * v * sizeof(double));
    st->wait_s = 0.0;
    for (int i = 0; i < m; i++) {
        int ev = lp_trace_begin("io", "data", i, -1);
        lp_dataloader_next(train);
        lp_trace_end(ev);
        lp_cp_take(st->tokens + 2 * i * BT, train->inputs, B, train->T, st->cp->rank, st->cp->size);
        lp_cp_take(st->tokens + (2 * i + 1) * BT, train->targets, B, train->T, st->cp->rank, st->cp->size);
    }
    for (int c = 0; c < v; c++) {
        lp_model_zero_grad(&st->chunks[c]);
        st->chunks[c].loss_scale = st->loss_scale;
    }
    for (int k = 0; k < v * m; k++) st->slot_owner[k] = -1;
    int done[LP_MAX_CHUNKS] = {0};  // backwards run per chunk
    float loss = 0.0f;
    for (int n = 0; n < 2 * m * v; n++) {
        LPAction a = st->actions[n];
        int* owner = st->slot_owner + (size_t)a.chunk * m, slot = 0;
        while (owner[slot] != (a.forward ? -1 : a.micro)) slot++;  // a free slot; the micro-batch's slot
        owner[slot] = a.forward ? a.micro : -1;
        if (a.forward)
            loss += lp_stage_forward(st, a.chunk, a.micro, slot, st->tokens + 2 * a.micro * BT, st->tokens + (2 * a.micro + 1) * BT,
                                     B, T, 1.0f / ((float)BT * m));
        else
            lp_stage_backward(st, a.chunk, a.micro, slot, ++done[a.chunk] == m, st->tokens + (2 * a.micro + 1) * BT);
    }
    lp_sends_wait(st->pp, &st->sends);
    loss /= m;
    lp_all_reduce_host(st->pp, &loss, 1, 0);  // only the last stage's is not zero
    for (int j = 0; j < st->num_aux; j++) {  // each on the stage holding its layer
        st->aux_loss[j] = 0.0f;
        for (int c = 0; c < v; c++)
            for (int q = 0; q < st->chunks[c].num_aux; q++)
                if (st->chunks[c].aux_id[q] == st->aux[j]) st->aux_loss[j] += st->chunks[c].aux_loss[q] / m;
    }
    lp_all_reduce_host(st->pp, st->aux_loss, st->num_aux, 0);
    // the replicas' batches: their mean (z->dp's; of replicas that train apart too, for the log: z->replicas', after
    // the mean over each one's cp ranks, its z->dp, if any)
    const LPZero* z = &st->chunks[0].zero;
    const LPGroup* groups[2] = {z->dp, z->replicas};
    int ranks = 1;
    for (int g = 0; g < 2; g++) {
        if (!groups[g]) continue;
        lp_all_reduce_host(groups[g], &loss, 1, 1);
        if (st->num_aux) lp_all_reduce_host(groups[g], st->aux_loss, st->num_aux, 1);
        ranks *= groups[g]->size;
    }
    if (st->chunks[0].cfg.moe_experts) {  // the MoE layers' statistics: of every stage and replica (TP ranks have the same)
        float sums[LP_MOE_STATS] = {0};
        for (int c = 0; c < v; c++)
            for (int k = 0; k < LP_MOE_STATS; k++) sums[k] += (float)((const double*)&st->chunks[c].moe_stats)[k];
        lp_all_reduce_host(st->pp, sums, LP_MOE_STATS, 0);
        for (int g = 0; g < 2; g++)
            if (groups[g]) lp_all_reduce_host(groups[g], sums, LP_MOE_STATS, 0);
        double* out = (double*)&st->moe_stats;
        for (int k = 0; k < LP_MOE_STATS; k++) out[k] = sums[k];
        st->moe_stats.aux /= ranks;
        st->moe_stats.z /= ranks;
    }
    lp_device_sync();  // the backward's last kernels and sends (the host runs ahead of the GPU): the phase's time too
    lp_trace_end(phase);
    st->wall_s = lp_time_s() - t0;
    return loss;
}

// The gradient reduction's end. First every copy of the head (wte and lnf: the embedding's on the first
// chunk, the LM head's on the last, the auxiliary losses' in between; an untied head's headw and lnf, on the last
// and the auxiliary losses' chunks, none on the first) gets the sum of all their gradients,
// summed within this rank and then over the head group, so the copies take the same step and stay equal;
// then each chunk's gradients are averaged over DP (lp_zero_average: what backward started arrives, the
// rest is reduced now).
void lp_step_reduce_grads(LPStage* st) {
    int phase = lp_trace_begin("step", "gradient reduction", -1, -1);
    const int head[3] = {st->chunks[0].cfg.untied ? LP_HEADW : LP_WTE, LP_LNFW, LP_LNFB};
    LPModel* sum = NULL;  // this rank's first chunk holding the head
    for (int c = 0; c < st->par->vpp; c++) {
        LPModel* mc = &st->chunks[c];
        if (!mc->head) continue;
        if (!sum) sum = mc;
        else for (int k = 0; k < 3; k++) lp_add_scaled(sum->zero.g[head[k]], mc->zero.g[head[k]], sum->zero.param_sizes[head[k]], 1.0f);
    }
    if (sum && st->head.size > 1)
        for (int k = 0; k < 3; k++) lp_all_reduce(&st->head, sum->zero.g[head[k]], sum->zero.param_sizes[head[k]], 0);
    for (int c = 0; c < st->par->vpp; c++)
        if (st->chunks[c].head && &st->chunks[c] != sum)
            for (int k = 0; k < 3; k++) lp_copy_device(st->chunks[c].zero.g[head[k]], sum->zero.g[head[k]], sum->zero.param_sizes[head[k]] * sizeof(floatX));
    for (int c = 0; c < st->par->vpp; c++)
        for (int p = 0; p < st->chunks[c].parts; p++) lp_zero_average(lp_model_part(&st->chunks[c], p));
    lp_trace_end(phase);
}

// The global norm of the reduced gradients (before clipping, the loss scale divided out), taken over the
// whole grid, the same on every rank. Replicas that train apart (DiLoCo, gossip) sum no gradients, so each
// has its own norm; there one all-reduce of the replicas' flags makes a norm that is not finite (an overflow,
// a divergence) every replica's, and all skip or stop alike.
float lp_step_grad_norm(LPStage* st) {
    int phase = lp_trace_begin("step", "gradient norm", -1, -1);
    float norm = lp_models_grad_norm(st->chunks, st->par->vpp, st->pp->size > 1 ? st->pp : NULL);
    const LPGroup* replicas = st->chunks[0].zero.replicas;
    if (replicas) {
        float bad = !isfinite(norm);
        lp_all_reduce_host(replicas, &bad, 1, 0);
        if (bad > 0.0f) norm = NAN;
    }
    lp_trace_end(phase);
    return norm;
}

// Clipping to opt->grad_clip given the norm, AdamW on every chunk, the new weights made whole where forward
// needs them. Returns whether all the updated weights are finite (on every rank alike).
int lp_step_update(LPStage* st, float lr, float norm, const LPAdamW* opt) {
    int phase = lp_trace_begin("step", "optimizer", -1, -1);
    if (st->par->diloco && st->inner == 0) lp_replicas_round_start(st->chunks, st->par->vpp);
    int finite = lp_models_adamw(st->chunks, st->par->vpp, st->pp->size > 1 ? st->pp : NULL, lr, norm, opt);
    lp_trace_end(phase);
    return finite;
}

// DiLoCo's outer step now, ending the round under way (after its H-th inner step; the driver ends a round
// early at the run's last step and before a save a signal asks for, so every checkpoint is of equal replicas).
static inline void lp_step_outer(LPStage* st, const LPOuterSGD* o) {
    if (st->inner == 0) return;
    lp_replicas_outer(st->chunks, st->par->vpp, o);
    st->inner = 0;
}

// After an update: DiLoCo counts the round's inner steps and takes the outer step after the H-th; gossip
// mixes the weights with the neighbours'. Returns gossip's spread, the root-mean-square difference of a
// replica's weights from its nearest in-neighbour's before mixing, over the grid (one all-reduce of 2
// values, for the step line); otherwise 0.
static inline float lp_step_replicas(LPStage* st, const LPOuterSGD* o) {
    const LPParallel* par = st->par;
    if (par->diloco && ++st->inner == par->diloco) lp_step_outer(st, o);
    if (!par->gossip) return 0.0f;
    float sums[2] = {0.0f, 0.0f};
    lp_replicas_gossip(st->chunks, par->vpp, sums);
    const LPModel* m = &st->chunks[0];
    lp_all_reduce_host(m->zero.replicas, sums, 2, 0);
    if (m->tp_size > 1) lp_all_reduce_host(m->tp, sums, 2, 0);
    lp_all_reduce_host(st->pp, sums, 2, 0);
    return sqrtf(sums[0] / sums[1]);
}
#endif  // LLMPAR_IMPLEMENTATION

// ----------------------------------------------------------------------------------------------------
// 14. files
//
// Model file (llm.c): 256 x int32 header [magic 20240326, version, maxT, V, L, NH, C, Vp], then the 16
// tensors in order, fp32 (version 3) or bf16 (version 5). A mixture of experts (llmpar's): version 6, the
// header's next three [E, K, every] (lp_is_moe_layer), then the 21 tensors in order, fp32. The Llama 3 family
// (llm.c's train_llama3.py): 256 x int32 [magic 20240803, version 3 or 5, block size (maxT), V, L, NH, KV heads,
// C, multiple_of, use_scaled_rope, major, minor] then 256 x float32 [ffn_dim_multiplier (0: none), norm_eps,
// rope_theta], then wte (V rows), and per layer ln1w, qkvw, attprojw, ln2w, every layer's up (c_fc), every
// layer's gate (c_fc2), fcprojw, then lnfw and the head (V rows): lp_llama_file_layout. A Llama with a mixture of
// experts (llmpar's; no llm.c file holds one): that file at version 6, fp32, the ints' next three [E, K, every]
// after llm.c's twelve, the tensors as above (the MLP's up, gate and fcprojw: the dense layers' only), then
// after the head the router and the experts' fc (each expert's gate, then its up) and fcproj, as
// lp_param_shape orders them. Files and checkpoints are written under a .tmp
// name and renamed, so a crash or a full disk never leaves a half-written file under the real name.

#ifdef LLMPAR_IMPLEMENTATION
static inline float lp_bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define LP_LLAMA_MAGIC 20240803
#define LP_LLAMA_FLOATS 256  // the Llama 3 file's float header, after the ints

// The shape a model file's header h gives, unchecked (a Llama 3 file's floats: lp_config_of_llama_floats).
void lp_config_of_header(const int* h, LPConfig* cfg) {  // (h: LP_HEADER_INTS ints)
    memset(cfg, 0, sizeof(*cfg));
    if (h[0] == LP_LLAMA_MAGIC) {
        cfg->max_seq_len = h[2];
        cfg->vocab_size = h[3];
        cfg->padded_vocab_size = h[3] > 0 && h[3] <= 1 << 30 ? (h[3] + 127) / 128 * 128 : h[3];  // as lp_config_from_name pads
        cfg->num_layers = h[4];
        cfg->num_heads = h[5];
        cfg->num_kv_heads = h[6] > 0 ? h[6] : -1;  // (0 would read as multi-head: lp_config_validate refuses -1)
        cfg->channels = h[7];
        cfg->multiple_of = h[8];
        cfg->rope_scaled = h[9] != 0;
        cfg->rope = cfg->rmsnorm = cfg->swiglu = cfg->no_bias = cfg->untied = 1;
        if (h[1] == 6) {  // (llmpar's: a mixture of experts)
            cfg->moe_experts = h[12];
            cfg->moe_topk = h[13];
            cfg->moe_every = h[14];
        }
        return;
    }
    if (h[1] == 6) {
        cfg->moe_experts = h[8];
        cfg->moe_topk = h[9];
        cfg->moe_every = h[10];
    }
    cfg->max_seq_len = h[2];
    cfg->vocab_size = h[3];
    cfg->num_layers = h[4];
    cfg->num_heads = h[5];
    cfg->channels = h[6];
    cfg->padded_vocab_size = h[7];
}

// A Llama 3 file's float header into cfg.
static inline void lp_config_of_llama_floats(const float hf[LP_LLAMA_FLOATS], LPConfig* cfg) {
    cfg->ffn_dim_multiplier = hf[0];
    cfg->norm_eps = hf[1];
    cfg->rope_theta = hf[2];
}

// The values a model file of shape cfg holds (a Llama 3 file: V rows of wte and the head, not Vp), and the
// bytes of its header.
static inline size_t lp_model_file_values(const LPConfig* c) {
    return lp_config_num_params(c) - (c->untied ? 2 : 0) * (size_t)(c->padded_vocab_size - c->vocab_size) * c->channels;
}
static inline long long lp_model_file_header_bytes(const LPConfig* c) { return (LP_HEADER_INTS + (c->untied ? LP_LLAMA_FLOATS : 0)) * 4LL; }

// Read a model file's header into cfg; returns the version (3, 5 or 6).
int lp_model_file_header(const char* path, LPConfig* cfg, FILE* f) {
    int h[LP_HEADER_INTS];
    lp_fread(h, sizeof(int), LP_HEADER_INTS, f, path);
    if (h[0] != LP_MODEL_MAGIC && h[0] != LP_LLAMA_MAGIC)
        lp_fail("%s: not an llm.c model file (magic %d, expected %d, or %d for the Llama 3 family)", path, h[0], LP_MODEL_MAGIC,
                LP_LLAMA_MAGIC);
    if (h[1] != 3 && h[1] != 5 && h[1] != 6)
        lp_fail("%s: model file version %d is not supported (3 = fp32, 5 = bf16, 6 = fp32 mixture of experts%s)", path, h[1],
                h[0] == LP_LLAMA_MAGIC ? ", in a Llama 3 file" : "");
    lp_config_of_header(h, cfg);
    if (h[0] == LP_LLAMA_MAGIC) {
        float hf[LP_LLAMA_FLOATS];
        lp_fread(hf, sizeof(float), LP_LLAMA_FLOATS, f, path);
        lp_config_of_llama_floats(hf, cfg);
    }
    if (h[1] == 6 && cfg->moe_experts < 1) lp_fail("%s: a mixture-of-experts file (version 6) with %d experts", path, cfg->moe_experts);
    lp_config_validate(cfg, path);
    // the size the header implies, before anything of that size is allocated (a damaged header can ask for a lot)
    long long expect = lp_model_file_header_bytes(cfg) + (long long)lp_model_file_values(cfg) * (h[1] == 5 ? 2 : 4);
    long long size = lp_file_size(path);
    if (size < expect) lp_fail("%s: file is truncated (its header's model needs %lld bytes, the file has %lld)", path, expect, size);
    if (size > expect) lp_fail("%s: file is longer than its header's model (%lld bytes, expected %lld)", path, size, expect);
    return h[1];
}

// Open an llm.c model file and check its header and size: its shape into cfg, its version (3, 5, 6) into
// *version; returns it positioned at the weights.
static inline FILE* lp_model_file_open(const char* path, LPConfig* cfg, int* version) {
    FILE* f = lp_fopen(path, "rb");
    *version = lp_model_file_header(path, cfg, f);  // the file's size checked against the header's shape too
    return f;
}

// A model file's values (file) from the canonical layout (canon, lp_param_shape's) and back (lp_file_run):
// to_file 1: canon into file; 0: file into canon (the padding rows zero).
static inline void lp_llama_file_layout(const LPConfig* c, float* file, float* canon, int to_file) {
    size_t n = lp_config_num_params(c);
    if (!to_file) memset(canon, 0, n * sizeof(float));
    for (size_t at = 0, k; at < n; at += k) {
        long long f;
        k = lp_file_run(c, at, n - at, &f);
        if (f >= 0) memcpy(to_file ? file + f : canon + at, to_file ? canon + at : file + f, k * sizeof(float));
    }
}

// Read an llm.c model file: its shape into cfg, its weights returned as host fp32 in the canonical layout (the
// caller frees).
static inline float* lp_model_file_read(const char* path, LPConfig* cfg) {
    int version;
    FILE* f = lp_model_file_open(path, cfg, &version);
    size_t n = lp_config_num_params(cfg), nf = lp_model_file_values(cfg);
    float* w = (float*)lp_host_malloc(n * sizeof(float), "model weights");
    float* values = cfg->untied ? (float*)lp_host_malloc(nf * sizeof(float), "model weights") : w;  // (a Llama 3 file's order)
    if (version != 5) {
        lp_fread(values, sizeof(float), nf, f, path);
    } else {
        uint16_t* b = (uint16_t*)lp_host_malloc(nf * sizeof(uint16_t), "bf16 model weights");
        lp_fread(b, sizeof(uint16_t), nf, f, path);
        for (size_t i = 0; i < nf; i++) values[i] = lp_bf16_to_float(b[i]);
        free(b);
    }
    fclose(f);
    if (values != w) {
        lp_llama_file_layout(cfg, values, w, 0);
        free(values);
    }
    size_t bad = 0;  // training would only spread them, and no checkpoint may hold one
    for (size_t i = 0; i < n; i++) bad += !isfinite(w[i]);
    if (bad) lp_fail("%s: %zu of its %zu weights are not finite", path, bad, n);
    return w;
}

// lp_model_file_read on one rank of `group` (NULL: this rank alone), broadcast to the others.
float* lp_model_file_read_shared(const char* path, LPConfig* cfg, const LPGroup* group) {
    float* w = NULL;
    if (!group || group->rank == 0) w = lp_model_file_read(path, cfg);
    if (group && group->size > 1) {
        lp_broadcast_host(group, cfg, sizeof(*cfg), 0);
        size_t n = lp_config_num_params(cfg);
        if (!w) w = (float*)lp_host_malloc(n * sizeof(float), "model weights");
        lp_broadcast_host(group, w, n * sizeof(float), 0);
    }
    return w;
}

// Create m from an llm.c model file, with lp_model_create's options. Within a data-parallel group one rank
// reads the file and broadcasts it.
static inline void lp_model_load(LPModel* m, const char* path, const LPModelOptions* o) {
    LPConfig cfg;
    float* w = lp_model_file_read_shared(path, &cfg, o && o->proc ? &o->proc->group[LP_DP] : NULL);
    lp_model_create(m, &cfg, o);
    lp_model_set_weights(m, w);
    free(w);
}

static inline void lp_model_file_header_of(int h[LP_HEADER_INTS], const LPConfig* c) {
    memset(h, 0, LP_HEADER_INTS * sizeof(int));
    h[0] = LP_MODEL_MAGIC;
    h[1] = c->moe_experts ? 6 : 3;
    h[2] = c->max_seq_len;
    h[3] = c->vocab_size;
    h[4] = c->num_layers;
    h[5] = c->num_heads;
    h[6] = c->channels;
    h[7] = c->padded_vocab_size;
    if (c->moe_experts) {
        h[8] = c->moe_experts;
        h[9] = c->moe_topk;
        h[10] = c->moe_every;
    }
}

// Write header + payload to path via path.tmp. Returns 0, or an errno with the partial file removed.
static inline int lp_write_file(const char* path, const int* header, const void* payload, size_t bytes) {
    char tmp[LP_PATH_MAX];
    lp_path(tmp, "%s.tmp", path);
    FILE* f = fopen(tmp, "wb");
    if (!f) return errno;
    int bad = lp_fwrite(header, sizeof(int), LP_HEADER_INTS, f) || (bytes && lp_fwrite(payload, 1, bytes, f));
    int err = bad ? errno : 0;
    if (fclose(f) != 0 && !err) err = errno;
    if (!err && rename(tmp, path) != 0) err = errno;
    if (err) remove(tmp);
    return err;
}

// The Llama 3 file's header of c: ints h, floats hf.
static inline void lp_llama_file_header_of(int h[LP_HEADER_INTS], float hf[LP_LLAMA_FLOATS], const LPConfig* c) {
    memset(h, 0, LP_HEADER_INTS * sizeof(int));
    memset(hf, 0, LP_LLAMA_FLOATS * sizeof(float));
    int fields[15] = {LP_LLAMA_MAGIC, c->moe_experts ? 6 : 3, c->max_seq_len, c->vocab_size, c->num_layers, c->num_heads,
                      lp_kv_heads(c), c->channels, c->multiple_of, c->rope_scaled, 3, 1,  // (Llama 3.1)
                      c->moe_experts, c->moe_topk, c->moe_every};  // (llmpar's, version 6; zeros in a dense model's)
    memcpy(h, fields, sizeof(fields));
    hf[0] = c->ffn_dim_multiplier;
    hf[1] = lp_norm_eps(c);
    hf[2] = c->rope_theta;
}

// The header of a model file of shape c, lp_model_file_header_bytes(c) of these bytes: llm.c's ints (a Llama 3
// file's, then its floats).
typedef struct {
    int h[LP_HEADER_INTS];
    float hf[LP_LLAMA_FLOATS];
} LPFileHeader;
static inline void lp_model_file_head(LPFileHeader* head, const LPConfig* c) {
    memset(head, 0, sizeof(*head));
    if (c->untied) lp_llama_file_header_of(head->h, head->hf, c);
    else lp_model_file_header_of(head->h, c);
}

// Save an unsharded model's fp32 master weights as an llm.c version-3 model file (a mixture of experts: 6; the
// Llama 3 family: llm.c's Llama 3 file, version 3, or llmpar's 6 with experts). A mixture of the two families'
// choices has no file.
static inline void lp_model_save(const LPModel* m, const char* path) {
    const LPConfig* c = &m->cfg;
    if (m->par->zero >= 1 || m->tp_size > 1 || m->ep_size > 1 || m->L != c->num_layers)
        lp_fail("%s: a sharded model is saved by lp_checkpoint_save", path);
    int llama = c->rope && c->rmsnorm && c->swiglu && c->no_bias && c->untied;
    if (!llama && !lp_config_is_gpt2(c))
        lp_fail("%s: no llm.c model file holds this mixture of GPT-2's and Llama's choices (positions, norm, MLP, biases, head)", path);
    int h[LP_HEADER_INTS];
    float hf[LP_LLAMA_FLOATS];
    size_t bytes = m->total_params * sizeof(float), fbytes = lp_model_file_values(c) * sizeof(float);
    float* w = (float*)lp_host_malloc(bytes, "model weights");
    lp_model_get_weights(m, w);
    char* payload = (char*)w;  // the file's values after the ints: a Llama 3 file's floats, then its order
    if (llama) {
        lp_llama_file_header_of(h, hf, c);
        payload = (char*)lp_host_malloc(sizeof(hf) + fbytes, "model file");
        memcpy(payload, hf, sizeof(hf));
        lp_llama_file_layout(c, (float*)(payload + sizeof(hf)), w, 1);
        fbytes += sizeof(hf);
    } else {
        lp_model_file_header_of(h, c);
    }
    int err = lp_write_file(path, h, payload, fbytes);
    if (payload != (char*)w) free(payload);
    free(w);
    if (err) lp_fail("cannot write %s: %s", path, strerror(err));
}

// CRC32C (Castagnoli) of a file: a checkpoint's manifest holds each file's, checked on --resume.
uint32_t lp_crc32c(uint32_t crc, const unsigned char* p, size_t n) {
    static uint32_t table[256];
    if (!table[1])
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
            table[i] = c;
        }
    crc = ~crc;
    for (size_t i = 0; i < n; i++) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return ~crc;
}
// Returns 0, or an errno.
static inline int lp_file_crc32c(const char* path, uint32_t* crc, long long* size) {
    *crc = 0;
    *size = 0;
    FILE* f = fopen(path, "rb");
    if (!f) return errno;
    size_t chunk = (size_t)1 << 20, got;
    unsigned char* buf = (unsigned char*)lp_host_malloc(chunk, "checksum");
    while ((got = fread(buf, 1, chunk, f)) > 0) {
        *crc = lp_crc32c(*crc, buf, got);
        *size += (long long)got;
    }
    int err = ferror(f) ? EIO : 0;
    fclose(f);
    free(buf);
    return err;
}
#endif  // LLMPAR_IMPLEMENTATION

// --- checkpoints: DIR/step_NNNNNNNN/{model.bin, optim.bin, state.bin, manifest.txt}, built in step_NNNNNNNN.tmp/ and
// renamed when complete. Rank 0 creates the files; then every rank writes the slice it owns at its
// canonical offset, so the files never depend on how the run was split and can be resumed on any grid.
// manifest.txt, written last: "llmpar checkpoint 1", then per file "NAME BYTES CRC32C" (hex).
// optim.bin: header [20241122, 1, adam step, n low 31 bits, n high bits] then m and v (fp32, the model
// file's layout); a DiLoCo run's (par->diloco), whose R replicas each keep their own AdamW state, is version 2:
// header [20241122, 2, adam step, n low, n high, R] then replica 0's m and v, replica 1's, ..., and the outer
// momentum (its outer weights are model.bin's: it saves only between rounds, its replicas equal); a reader of
// version 1 alone refuses it, naming the version. state.bin: header [20241123, 2, step, shard, pos (2), rng (3),
// B, T, tokens per step, run id, epoch, shuffle, data seed (3), identity bytes, loss scale (the float's bits),
// clean steps, skipped steps], then that many bytes of the run's identity (text, the driver's: the flags that
// shape its trajectory, lp_checkpoint_identity); version 1, before loss scaling, is read as a run without it
// (scale 0); checkpoints from before the epoch field read as epoch 0 in file order, from before the identity as
// having none.

#define LP_OPTIM_MAGIC 20241122
#define LP_STATE_MAGIC 20241123
#define LP_IDENTITY_MAX 65536  // bytes of a run's identity in state.bin

typedef struct LPTrainState {
    int step;            // steps completed
    int epoch, shard;    // data position of the next batch (LPDataLoader)
    size_t pos;
    int shuffle;         // the data order: file order (0), or shuffled with data_seed
    uint64_t data_seed;
    uint64_t rng;        // sampling RNG
    int B, T, total_batch;
    int run_id;          // the run's name: random, drawn by its first launch and kept by every resume
    const char* identity;// what makes the run this run (text; NULL: none), saved for a resume to compare; load leaves it
    LPLossScaler scaler; // dynamic loss scaling (scale 0: none): its scale, clean and skipped steps are saved and
                         // loaded, its factors and window are the run's (load leaves them)
} LPTrainState;

#ifdef LLMPAR_IMPLEMENTATION
// Remove a checkpoint directory and the files in it (a save killed mid-write leaves files like
// state.bin.tmp, which would keep the directory and so every later save of that step from working).
// state.bin goes first: without it the directory is no checkpoint (lp_checkpoint_latest), so a removal
// stopped half-way never leaves one that looks whole. A folder inside, which no save makes, is not removed
// and stops it. Returns 0 (also when dir does not exist), or an errno with the path it stopped at in
// `failed` (LP_PATH_MAX).
static inline int lp_checkpoint_remove(const char* dir, char* failed) {
    lp_path(failed, "%s/state.bin", dir);
    if (unlink(failed) != 0 && errno != ENOENT) return errno;
    DIR* d = opendir(dir);
    if (!d) {
        lp_path(failed, "%s", dir);
        return errno == ENOENT ? 0 : errno;
    }
    int err = 0;
    for (struct dirent* e; !err && (e = readdir(d)) != NULL;) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        lp_path(failed, "%s/%s", dir, e->d_name);
        if (remove(failed) != 0) err = errno;
    }
    closedir(d);
    if (err) return err;
    lp_path(failed, "%s", dir);
    return rmdir(dir) != 0 ? errno : 0;
}

// A file of header_bytes of header + payload_bytes (zeros until the ranks fill it in place). Returns 0 or an errno.
static inline int lp_create_file(const char* path, const void* header, long long header_bytes, long long payload_bytes) {
    FILE* f = fopen(path, "wb");
    if (!f) return errno;
    int err = lp_fwrite(header, 1, (size_t)header_bytes, f) ? errno : 0;
    if (!err && fflush(f) != 0) err = errno;
    if (!err && ftruncate(fileno(f), header_bytes + payload_bytes) != 0) err = errno;
    if (fclose(f) != 0 && !err) err = errno;
    return err;
}

// Write this rank's shard of the device floats src (count values from flat position lo) at their
// canonical places in an existing file whose canonical array starts at byte base. Returns 0 or an errno.
static inline int lp_write_shard(const LPModel* m, int p, const char* path, long long base, const float* src, size_t lo, size_t count) {
    if (count == 0) return 0;
    float* h = (float*)lp_host_malloc(count * sizeof(float), "checkpoint staging");
    lp_zero_state_out(lp_model_part(m, p), h, src, count * sizeof(float));
    int err = 0;
    FILE* f = fopen(path, "r+b");
    if (!f) err = errno;
    else {
        err = lp_model_canonical_io(m, p, f, base, h, lo, count, 1);
        if (fclose(f) != 0 && !err) err = errno;
    }
    free(h);
    return err;
}

// Write this rank's offloaded AdamW state (m at byte base, v at base + 4n of a canonical file of n
// values) a chunk at a time, through the offload's buffer. Returns 0 or an errno.
static inline int lp_write_offloaded(const LPModel* m, int p, const char* path, long long base, size_t n) {
    const LPZero* z = lp_model_part(m, p);
    LPOffload* o = z->off;
    size_t lo = z->shard_start, count = lp_zero_shard_count(z);
    FILE* f = fopen(path, "r+b");
    if (!f) return errno;
    int err = 0;
    for (size_t c = 0; c < o->chunks && !err; c++) {
        size_t at = c * o->chunk, k = lp_offload_part(o, c, count);
        if ((err = lp_offload_io(o, c, o->buf[0], 0))) break;
        err = lp_model_canonical_io(m, p, f, base, o->buf[0], lo + at, k, 1);
        if (!err) err = lp_model_canonical_io(m, p, f, base + 4LL * (long long)n, o->buf[0] + o->chunk, lo + at, k, 1);
    }
    if (fclose(f) != 0 && !err) err = errno;
    return err;
}

// End of a write phase: if any rank failed, each failing rank says why, rank 0 removes the partial
// checkpoint, and every rank stops.
// `verb` says what failed on path ("write", "remove").
static inline void lp_checkpoint_check(const LPGroup* world, int err, const char* verb, const char* path, const char* tmp_dir) {
    float bad = err ? 1.0f : 0.0f;
    lp_all_reduce_host(world, &bad, 1, 0);
    if (bad == 0.0f) return;
    if (err) {
        fprintf(stderr, "llmpar: error: cannot %s %s: %s\n", verb, path, strerror(err));
        fflush(stderr);
    }
    char failed[LP_PATH_MAX];  // (a partial step_N.tmp/ is no checkpoint, and the next save clears it: a second line would only add noise)
    if (world->rank == 0) lp_checkpoint_remove(tmp_dir, failed);
    lp_exit_all();
}
#endif  // LLMPAR_IMPLEMENTATION

// Crash injection for the tests, in a build with LLMPAR_TEST_HOOKS (make's *_hooks binaries): with
// LLMPAR_CRASH_AT=k the process dies (exit status 137, as killed) at the k-th of these points, counted over
// the run's checkpoint saves: one after each file operation. Other builds: nothing.
#ifdef LLMPAR_TEST_HOOKS
LP_STATE int lp_crash_points;  // the points passed so far (one count, whichever file saves)
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_crash_point(void) {
    const char* at = getenv("LLMPAR_CRASH_AT");
    if (at && ++lp_crash_points == atoi(at)) _exit(137);
}
#endif  // LLMPAR_IMPLEMENTATION
#else
#ifdef LLMPAR_IMPLEMENTATION
static inline void lp_crash_point(void) {}
#endif  // LLMPAR_IMPLEMENTATION
#endif

#ifdef LLMPAR_IMPLEMENTATION
// The replicas whose AdamW states optim.bin holds: DiLoCo's d (version 2), else 1.
static inline int lp_optim_replicas(const LPModel* m) { return m->par->diloco ? m->zero.replicas->size : 1; }

// Save the n models ms (a pipeline stage's chunks; else n = 1). Collective: every rank of `world` calls it.
// The weights are finite: model files are checked when read, and every update after it (lp_models_adamw).
void lp_checkpoint_save(const LPModel* ms, int n_models, const LPTrainState* st, const char* dir, const LPGroup* world) {
    const LPModel* m = ms;
    char final_dir[LP_PATH_MAX], tmp_dir[LP_PATH_MAX], model_path[LP_PATH_MAX], optim_path[LP_PATH_MAX], state_path[LP_PATH_MAX];
    lp_path(final_dir, "%s/step_%08d", dir, st->step);
    lp_path(tmp_dir, "%s.tmp", final_dir);
    lp_path(model_path, "%s/model.bin", tmp_dir);
    lp_path(optim_path, "%s/optim.bin", tmp_dir);
    lp_path(state_path, "%s/state.bin", tmp_dir);
    size_t n = lp_model_file_values(&m->cfg);  // (a Llama 3 file lacks the padding rows)
    long long model_base = lp_model_file_header_bytes(&m->cfg);
    int err = 0, replicas = lp_optim_replicas(m);
    char removing[LP_PATH_MAX];
    const char* failed = tmp_dir;
    const char* verb = "write";
    if (world->rank == 0) {
        if ((err = lp_checkpoint_remove(tmp_dir, removing))) failed = removing, verb = "remove";  // what a crashed save may have left
        lp_crash_point();
        if (!err && mkdir(tmp_dir, 0755) != 0) err = errno;
        lp_crash_point();
        LPFileHeader head;
        lp_model_file_head(&head, &m->cfg);
        if (!err && (err = lp_create_file(model_path, &head, model_base, (long long)n * 4))) failed = model_path;
        int h[LP_HEADER_INTS];
        lp_crash_point();
        memset(h, 0, sizeof(h));
        h[0] = LP_OPTIM_MAGIC;
        h[1] = replicas > 1 ? 2 : 1;
        h[2] = m->zero.adam_step;
        h[3] = (int)(n & 0x7fffffff);
        h[4] = (int)(n >> 31);
        h[5] = replicas > 1 ? replicas : 0;
        if (!err && (err = lp_create_file(optim_path, h, LP_HEADER_INTS * 4LL, (2LL * replicas + (replicas > 1)) * n * 4))) failed = optim_path;
        lp_crash_point();
        memset(h, 0, sizeof(h));
        h[0] = LP_STATE_MAGIC;
        h[1] = 2;
        h[2] = st->step;
        h[3] = st->shard;
        h[4] = (int)(st->pos & 0x7fffffff);
        h[5] = (int)(st->pos >> 31);
        h[6] = (int)(st->rng & 0x7fffffff);
        h[7] = (int)((st->rng >> 31) & 0x7fffffff);
        h[8] = (int)(st->rng >> 62);
        h[9] = st->B;
        h[10] = st->T;
        h[11] = st->total_batch;
        h[12] = st->run_id;
        h[13] = st->epoch;
        h[14] = st->shuffle;
        h[15] = (int)(st->data_seed & 0x7fffffff);
        h[16] = (int)((st->data_seed >> 31) & 0x7fffffff);
        h[17] = (int)(st->data_seed >> 62);
        h[18] = st->identity ? (int)strlen(st->identity) : 0;
        memcpy(&h[19], &st->scaler.scale, sizeof(float));
        h[20] = st->scaler.clean;
        h[21] = st->scaler.skipped;
        if (!err && (err = lp_write_file(state_path, h, st->identity, (size_t)h[18]))) failed = state_path;
        lp_crash_point();
    }
    lp_checkpoint_check(world, err, verb, failed, tmp_dir);
    for (int k = 0; k < n_models && !err; k++) {
        m = &ms[k];
        for (int p = 0; p < m->parts && !err; p++) {
            const LPZero* z = lp_model_part(m, p);
            int replica = z->replicas ? z->replicas->rank : 0;  // (replicas that train apart: this rank's)
            if (m->par->zero == 0 && ((z->dp && z->dp->rank > 0) || (replica > 0 && replicas == 1)))
                continue;  // unsharded DP replicas are equal: the first writes (gossip's: the first's weights and state)
            size_t lo = z->shard_start, count = lp_zero_shard_count(z);
            long long base = LP_HEADER_INTS * 4LL, own = base + (replicas > 1 ? 8LL * (long long)n * replica : 0);
            if (replica == 0 && (err = lp_write_shard(m, p, model_path, model_base, z->master, lo, count))) failed = model_path;
            lp_crash_point();
            if (z->off) {  // offloaded: m and v a chunk at a time from the file
                if (!err && (err = lp_write_offloaded(m, p, optim_path, base, n))) failed = optim_path;
                lp_crash_point();
            } else {
                if (!err && (err = lp_write_shard(m, p, optim_path, own, z->adam_m, lo, count))) failed = optim_path;
                lp_crash_point();
                if (!err && (err = lp_write_shard(m, p, optim_path, own + (long long)n * 4, z->adam_v, lo, count))) failed = optim_path;
                lp_crash_point();
            }
            if (replicas > 1 && replica == 0 && !err &&
                (err = lp_write_shard(m, p, optim_path, base + 8LL * (long long)n * replicas, z->outer_m, lo, count)))
                failed = optim_path;
        }
    }
    lp_checkpoint_check(world, err, verb, failed, tmp_dir);
    if (world->rank == 0) {  // the manifest: every file's size and checksum, once all are complete
        char manifest[LP_PATH_MAX], line[3][LP_PATH_MAX + 64];
        const char* paths[3] = {model_path, optim_path, state_path};
        const char* names[3] = {"model.bin", "optim.bin", "state.bin"};
        for (int i = 0; i < 3 && !err; i++) {
            uint32_t crc = 0;
            long long size = 0;
            if ((err = lp_file_crc32c(paths[i], &crc, &size))) failed = paths[i];
            snprintf(line[i], sizeof(line[i]), "%s %lld %08x\n", names[i], size, crc);
        }
        lp_path(manifest, "%s/manifest.txt", tmp_dir);
        FILE* f = err ? NULL : fopen(manifest, "w");
        if (!err && !f) err = errno, failed = manifest;
        if (f) {
            if (fprintf(f, "llmpar checkpoint 1\n%s%s%s", line[0], line[1], line[2]) < 0) err = errno, failed = manifest;
            if (fclose(f) != 0 && !err) err = errno, failed = manifest;
        }
        lp_crash_point();
    }
    lp_checkpoint_check(world, err, verb, failed, tmp_dir);
    if (world->rank == 0) {
        if ((err = lp_checkpoint_remove(final_dir, removing)))  // a damaged checkpoint of this step, which --resume passed over
            lp_fail("cannot remove %s (to replace %s with this save): %s", removing, final_dir, strerror(err));
        lp_crash_point();
        if (rename(tmp_dir, final_dir) != 0) lp_fail("cannot rename %s to %s: %s", tmp_dir, final_dir, strerror(errno));
        lp_crash_point();
    }
    lp_barrier(world);
}

// One run per output directory: an exclusive flock(2) on DIR/lock, held while the returned descriptor is
// open, so for the run's life. The kernel releases it when the process ends, however it ends, so a killed
// run's lock never stands in a resume's way: the lock is the flock, not the file's existence, which is why
// the file is not created with O_EXCL (a killed run's file stays behind and is taken over). It is opened with
// O_NOFOLLOW and must be a regular file: a symbolic link named lock is refused, never followed to overwrite
// its target. Returns the descriptor, or -1 with the reason in `why`: another process holds it (the line
// its file holds, "host H pid P since DATE", waiting up to a second for a holder that has the lock but has
// not yet written it), or the file cannot be made or taken.
int lp_dir_lock(const char* dir, char* why, size_t size) {
    char path[LP_PATH_MAX];
    lp_path(path, "%s/lock", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int err = errno;
        if (fd < 0 && err == ELOOP) snprintf(why, size, "%s: is a symbolic link; the lock is a file of the run's own (remove the link)", path);
        else if (fd < 0) snprintf(why, size, "cannot create %s: %s", path, strerror(err));
        else if (!S_ISREG(sb.st_mode)) snprintf(why, size, "%s: is not a regular file; the lock is a file of the run's own", path);
        else if (err != EWOULDBLOCK) snprintf(why, size, "cannot lock %s: %s", path, strerror(err));
        else {
            char holder[256] = "a process that has not said which";
            for (int tries = 0; tries < 20; tries++) {
                ssize_t n = pread(fd, holder, sizeof(holder) - 1, 0);
                if (n > 0) {
                    holder[n] = '\0';
                    holder[strcspn(holder, "\n")] = '\0';
                    break;
                }
                usleep(50000);
            }
            snprintf(why, size, "%s is in use by another run (%s: %s)", dir, path, holder);
        }
        if (fd >= 0) close(fd);
        return -1;
    }
    char line[512], host[256] = "?";
    gethostname(host, sizeof(host) - 1);
    time_t now = time(NULL);
    char when[64];
    strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", localtime(&now));
    int len = snprintf(line, sizeof(line), "host %s pid %d since %s\n", host, (int)getpid(), when);
    if (ftruncate(fd, 0) != 0 || pwrite(fd, line, (size_t)len, 0) != len) {
        snprintf(why, size, "cannot write %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

// The newest complete checkpoint under dir older than step `before`, as its step, or -1 when there is none.
int lp_checkpoint_latest(const char* dir, int before) {
    glob_t g;
    char pattern[LP_PATH_MAX];
    lp_path(pattern, "%s/step_*/state.bin", dir);
    int best = -1;
    if (glob(pattern, 0, NULL, &g) == 0) {
        for (size_t i = 0; i < g.gl_pathc; i++) {
            const char* s = strstr(g.gl_pathv[i], "/step_");
            int step = -1;
            char tail[64];
            if (s && sscanf(s, "/step_%d/%63s", &step, tail) == 2 && strcmp(tail, "state.bin") == 0 && step > best && step < before)
                best = step;
        }
        globfree(&g);
    }
    return best;
}

// What is wrong with DIR/step_NNNNNNNN, or NULL: magics, versions, sizes and the model's shape against cfg,
// and with `sums` every file's checksum against the manifest (a checkpoint without one, from an older
// llmpar, is taken as it is). Fills the optimizer and state files' headers. The reason names the file.
const char* lp_checkpoint_problem(const char* dir, int step, const LPConfig* cfg, int* optim_h, int* state_h, int sums,
                                  char* why, size_t size) {  // (optim_h, state_h: LP_HEADER_INTS ints each)
    const char* names[3] = {"model.bin", "optim.bin", "state.bin"};
    LPFileHeader model_h, want;  // (a Llama 3 file's floats too)
    int* headers[3] = {model_h.h, optim_h, state_h};
    lp_model_file_head(&want, cfg);
    memset(&model_h, 0, sizeof(model_h));
    size_t n = lp_model_file_values(cfg), head_bytes = (size_t)lp_model_file_header_bytes(cfg);
    long long sizes[3] = {(long long)head_bytes + 4LL * (long long)n, 0, LP_HEADER_INTS * 4LL};
    char path[LP_PATH_MAX];
    for (int i = 0; i < 3; i++) {
        lp_path(path, "%s/step_%08d/%s", dir, step, names[i]);
        FILE* f = fopen(path, "rb");
        size_t bytes = i ? LP_HEADER_INTS * sizeof(int) : head_bytes, got = f ? fread(headers[i], 1, bytes, f) : 0;
        if (f) fclose(f);
        struct stat sb;
        if (!f || got != bytes || stat(path, &sb) != 0) {
            snprintf(why, size, "%s: cannot read its header", path);
            return why;
        }
        int* h = headers[i];
        size_t fn = (size_t)(unsigned)h[3] | ((size_t)(unsigned)h[4] << 31);
        int replicas = h[1] == 2 ? h[5] : 1;  // optim.bin's AdamW states (version 2: DiLoCo's replicas, and its momentum)
        float scale = 0.0f;  // state.bin's loss scale (version 2): 0, or 1 .. 2^24
        if (i == 2 && h[1] == 2) memcpy(&scale, &h[19], sizeof(float));
        if (i == 1) sizes[1] = LP_HEADER_INTS * 4LL + (8LL * replicas + 4LL * (replicas > 1)) * (long long)n;
        if (i == 0 && memcmp(&model_h, &want, head_bytes) != 0)
            snprintf(why, size, "%s: checkpoint model shape differs from the model being trained", path);
        else if (i == 1 && (h[0] != LP_OPTIM_MAGIC || (h[1] != 1 && h[1] != 2) || (h[1] == 2 && (replicas < 2 || replicas > 1 << 20))))
            snprintf(why, size, "%s: not an llmpar optimizer file (magic %d version %d)", path, h[0], h[1]);
        else if (i == 1 && fn != n)
            snprintf(why, size, "%s: optimizer state holds %zu parameters, the model has %zu", path, fn, n);
        else if (i == 2 && (h[0] != LP_STATE_MAGIC || (h[1] != 1 && h[1] != 2) || h[18] < 0 || h[18] > LP_IDENTITY_MAX))
            snprintf(why, size, "%s: not an llmpar state file (magic %d version %d)", path, h[0], h[1]);
        else if (i == 2 && (!(scale == 0.0f || (scale >= 1.0f && scale <= LP_LOSS_SCALE_MAX)) || h[20] < 0 || h[21] < 0))
            snprintf(why, size, "%s: its loss scale %g (clean steps %d, skipped %d) is outside 0 and 1 .. 2^24", path, scale, h[20], h[21]);
        else if ((long long)sb.st_size != sizes[i] + (i == 2 ? h[18] : 0))
            snprintf(why, size, "%s: file is truncated or too long (%lld bytes, expected %lld)", path, (long long)sb.st_size,
                     sizes[i] + (i == 2 ? h[18] : 0));
        else
            continue;
        return why;
    }
    lp_path(path, "%s/step_%08d/manifest.txt", dir, step);
    FILE* mf = sums ? fopen(path, "r") : NULL;
    if (!mf) return NULL;
    char line[LP_PATH_MAX + 64], name[64];
    int ok = fgets(line, sizeof(line), mf) && strcmp(line, "llmpar checkpoint 1\n") == 0;
    for (int i = 0; i < 3 && ok; i++) {
        long long bytes;
        unsigned crc;
        ok = fgets(line, sizeof(line), mf) && sscanf(line, "%63s %lld %x", name, &bytes, &crc) == 3 && strcmp(name, names[i]) == 0;
        char file[LP_PATH_MAX];
        lp_path(file, "%s/step_%08d/%s", dir, step, names[i]);
        uint32_t got = 0;
        long long got_bytes = 0;
        if (ok && (lp_file_crc32c(file, &got, &got_bytes) != 0 || got != crc || got_bytes != bytes)) {
            fclose(mf);
            snprintf(why, size, "%s: its checksum differs from the manifest's (the file was damaged after it was written)", file);
            return why;
        }
    }
    fclose(mf);
    if (!ok) {
        snprintf(why, size, "%s: not an llmpar checkpoint manifest", path);
        return why;
    }
    return NULL;
}

// The model shape of DIR/step_NNNNNNNN/model.bin's header into cfg: 0, or -1 where it has none (no such
// file, or not a model file: a damaged checkpoint, which lp_checkpoint_problem names).
int lp_checkpoint_shape(const char* dir, int step, LPConfig* cfg) {
    char path[LP_PATH_MAX];
    lp_path(path, "%s/step_%08d/model.bin", dir, step);
    LPFileHeader head;
    FILE* f = fopen(path, "rb");
    int ok = f && fread(head.h, sizeof(int), LP_HEADER_INTS, f) == LP_HEADER_INTS &&
             (head.h[0] == LP_MODEL_MAGIC || (head.h[0] == LP_LLAMA_MAGIC && fread(head.hf, sizeof(float), LP_LLAMA_FLOATS, f) == LP_LLAMA_FLOATS));
    if (f) fclose(f);
    if (ok) lp_config_of_header(head.h, cfg);
    if (ok && head.h[0] == LP_LLAMA_MAGIC) lp_config_of_llama_floats(head.hf, cfg);
    return ok ? 0 : -1;
}

// The run identity DIR/step_NNNNNNNN/state.bin holds (a checkpoint lp_checkpoint_problem passed), as a string
// the caller frees; NULL for a checkpoint saved without one.
char* lp_checkpoint_identity(const char* dir, int step) {
    char path[LP_PATH_MAX];
    lp_path(path, "%s/step_%08d/state.bin", dir, step);
    FILE* f = lp_fopen(path, "rb");
    int h[LP_HEADER_INTS];
    lp_fread(h, sizeof(int), LP_HEADER_INTS, f, path);
    char* text = NULL;
    if (h[18] > 0 && h[18] <= LP_IDENTITY_MAX) {
        text = (char*)lp_host_malloc((size_t)h[18] + 1, "run identity");
        lp_fread(text, 1, (size_t)h[18], f, path);
        text[h[18]] = '\0';
    }
    fclose(f);
    return text;
}

// Remove the checkpoints under dir but the newest `keep`. Returns 0, or an errno with the path in `failed`.
int lp_checkpoint_prune(const char* dir, int keep, char* failed) {
    char path[LP_PATH_MAX];
    int kept = 0;
    for (int step = lp_checkpoint_latest(dir, INT_MAX); step >= 0; step = lp_checkpoint_latest(dir, step))
        if (++kept > keep) {
            lp_path(path, "%s/step_%08d", dir, step);
            int err = lp_checkpoint_remove(path, failed);
            if (err) return err;
        }
    return 0;
}

// Take every checkpoint under dir away (--overwrite). Each is first renamed to step_NNNNNNNN.removed, out of
// --resume's sight: when a rename fails, those renamed are put back, so the old run is either wholly there
// (and resumable) or wholly gone, never half. Then the renamed ones are removed. Returns 0, or an errno with
// the path in `failed` and *hidden: 0 when a rename failed (nothing changed), 1 when only a removal did.
int lp_checkpoint_clear(const char* dir, char* failed, int* hidden) {
    int n = 0, cap = 16, err = 0;
    int* steps = (int*)lp_host_malloc(cap * sizeof(int), "checkpoint list");
    for (int step = lp_checkpoint_latest(dir, INT_MAX); step >= 0; step = lp_checkpoint_latest(dir, step)) {
        if (n == cap) {
            int* grown = (int*)realloc(steps, (cap *= 2) * sizeof(int));
            if (!grown) lp_fail("out of host memory listing the checkpoints in %s", dir);
            steps = grown;
        }
        steps[n++] = step;
    }
    char from[LP_PATH_MAX], to[LP_PATH_MAX];
    int renamed = 0;
    for (; renamed < n && !err; renamed++) {
        lp_path(from, "%s/step_%08d", dir, steps[renamed]);
        lp_path(to, "%s.removed", from);
        if (rename(from, to) != 0) err = errno, lp_path(failed, "%s", from);
    }
    *hidden = !err;
    if (err) renamed--;  // (the one that failed)
    for (int k = 0; k < renamed; k++) {
        lp_path(from, "%s/step_%08d", dir, steps[k]);
        lp_path(to, "%s.removed", from);
        if (!*hidden) rename(to, from);  // put back (it was just renamed the other way: it goes back)
        else if (!err) err = lp_checkpoint_remove(to, failed);
    }
    free(steps);
    return err;
}

// Load weights, optimizer state and training state from DIR/step_NNNNNNNN into the n models ms (created
// with the same shape, any split) and st. Every rank reads the whole model file (its params) and its own
// slices of the optimizer state.
void lp_checkpoint_load(LPModel* ms, int n_models, LPTrainState* st, const char* dir, int step) {
    int optim_h[LP_HEADER_INTS], state_h[LP_HEADER_INTS];
    char why[LP_PATH_MAX + 200];
    if (lp_checkpoint_problem(dir, step, &ms->cfg, optim_h, state_h, 0, why, sizeof(why))) lp_fail("%s", why);
    char path[LP_PATH_MAX];
    lp_path(path, "%s/step_%08d/model.bin", dir, step);
    LPConfig cfg;
    float* w = lp_model_file_read(path, &cfg);
    for (int k = 0; k < n_models; k++) lp_model_set_weights(&ms[k], w);
    free(w);

    lp_path(path, "%s/step_%08d/optim.bin", dir, step);
    int saved = optim_h[1] == 2 ? optim_h[5] : 1, replicas = lp_optim_replicas(ms);
    if (saved > 1 && saved != replicas)  // (one replica's state from a file of one: every DiLoCo replica starts from it)
        lp_fail_all("%s: holds the AdamW states of %d DiLoCo replicas; resume it with %s and %d data-parallel replicas", path,
                    saved, LP_SETTING(diloco), saved);
    FILE* f = lp_fopen(path, "rb");
    size_t n = lp_model_file_values(&ms->cfg);  // (optim.bin's values are in the model file's layout)
    for (int c = 0; c < n_models; c++) {
        LPModel* m = &ms[c];
        for (int p = 0; p < m->parts; p++) {
            LPZero* z = lp_model_part(m, p);
            size_t count = lp_zero_shard_count(z);
            long long own = LP_HEADER_INTS * 4LL + (saved > 1 ? 8LL * (long long)n * z->replicas->rank : 0);
            z->adam_step = optim_h[2];
            LPOffload* o = z->off;
            if (o) {  // offloaded: read m and v a chunk at a time into its buffer, and write it to the file
                for (size_t k = 0; k < o->chunks; k++) {
                    size_t at = k * o->chunk, part = lp_offload_part(o, k, count);
                    memset(o->buf[0], 0, 2 * o->chunk * sizeof(float));
                    for (int h = 0; h < 2; h++) {
                        int err = lp_model_canonical_io(m, p, f, LP_HEADER_INTS * 4LL + 4LL * (long long)(h * n), o->buf[0] + h * o->chunk,
                                                        z->shard_start + at, part, 0);
                        if (err) lp_fail("%s: cannot read: %s", path, strerror(err));
                    }
                    int err = lp_offload_io(o, k, o->buf[0], 1);
                    if (err) lp_fail("%s: cannot write the optimizer state in %s: %s", LP_SETTING(offload_dir), o->path, strerror(err));
                }
                o->written = o->chunks;
                continue;
            }
            float* buf = (float*)lp_host_malloc((count ? count : 1) * sizeof(float), "optimizer state");
            float* dst[3] = {z->adam_m, z->adam_v, z->outer_m};  // (DiLoCo's momentum: 0 from a file without it)
            long long at[3] = {own, own + 4LL * (long long)n, LP_HEADER_INTS * 4LL + 8LL * (long long)n * saved};
            for (int k = 0; k < (replicas > 1 ? 3 : 2); k++) {
                memset(buf, 0, (count ? count : 1) * sizeof(float));
                int err = k < 2 || saved > 1 ? lp_model_canonical_io(m, p, f, at[k], buf, z->shard_start, count, 0) : 0;
                if (err) lp_fail("%s: cannot read: %s", path, strerror(err));
                lp_zero_state_in(z, dst[k], buf, count * sizeof(float));
            }
            free(buf);
        }
    }
    fclose(f);
    for (int c = 0; c < n_models; c++) lp_model_round_as_updated(&ms[c]);

    st->step = state_h[2];
    st->shard = state_h[3];
    st->pos = (size_t)(unsigned)state_h[4] | ((size_t)(unsigned)state_h[5] << 31);
    st->rng = (uint64_t)(unsigned)state_h[6] | ((uint64_t)(unsigned)state_h[7] << 31) | ((uint64_t)(unsigned)state_h[8] << 62);
    st->B = state_h[9];
    st->T = state_h[10];
    st->total_batch = state_h[11];
    st->run_id = state_h[12];
    st->epoch = state_h[13];
    st->shuffle = state_h[14];
    st->data_seed = (uint64_t)(unsigned)state_h[15] | ((uint64_t)(unsigned)state_h[16] << 31) | ((uint64_t)(unsigned)state_h[17] << 62);
    st->scaler.scale = 0.0f;  // (version 1: no loss scaling)
    st->scaler.clean = st->scaler.skipped = 0;
    if (state_h[1] >= 2) {
        memcpy(&st->scaler.scale, &state_h[19], sizeof(float));
        st->scaler.clean = state_h[20];
        st->scaler.skipped = state_h[21];
    }
}
#endif  // LLMPAR_IMPLEMENTATION

// --- tokenizer (llm.c's gpt2_tokenizer.bin): header [20240328, version 1|2, vocab, eot (v2)], then per
// token one length byte and the token's bytes. Only used to print samples; without it, ids are printed.

typedef struct LPTokenizer {
    int vocab_size, eot;
    char** tokens;  // NUL-terminated token bytes
} LPTokenizer;

#ifdef LLMPAR_IMPLEMENTATION
// Returns 0 (with a notice) when the file does not exist; a corrupt file is an error.
int lp_tokenizer_load(LPTokenizer* t, const char* path) {
    memset(t, 0, sizeof(*t));
    FILE* f = fopen(path, "rb");
    if (!f) {
        lp_log("notice: tokenizer %s not found, samples print token ids\n", path);
        return 0;
    }
    int h[LP_HEADER_INTS];
    lp_fread(h, sizeof(int), LP_HEADER_INTS, f, path);
    if (h[0] != LP_TOKENIZER_MAGIC) lp_fail("%s: not a tokenizer file (magic %d, expected %d)", path, h[0], LP_TOKENIZER_MAGIC);
    if (h[1] != 1 && h[1] != 2) lp_fail("%s: tokenizer version %d is not supported (1 or 2)", path, h[1]);
    // each token takes at least its length byte: the file bounds the count before anything of that size is allocated
    long long size = lp_file_size(path), most = size - LP_HEADER_INTS * 4;
    if (h[2] < 1 || h[2] > most)
        lp_fail("%s: the header says %d tokens, its %lld bytes after the header hold 1 .. %lld", path, h[2], most, most);
    if (h[1] == 2 && (h[3] < 0 || h[3] >= h[2])) lp_fail("%s: end-of-text token %d is outside its %d tokens", path, h[3], h[2]);
    t->vocab_size = h[2];
    t->eot = h[1] == 2 ? h[3] : 50256;
    t->tokens = (char**)lp_host_malloc((size_t)t->vocab_size * sizeof(char*), "tokenizer");
    long long at = LP_HEADER_INTS * 4;
    for (int i = 0; i < t->vocab_size; i++) {
        unsigned char len = 0;
        if (at < size) lp_fread(&len, 1, 1, f, path);
        if (at >= size || at + 1 + len > size)
            lp_fail("%s: file is truncated in token %d of the %d its header says", path, i, t->vocab_size);
        t->tokens[i] = (char*)lp_host_malloc((size_t)len + 1, "tokenizer");
        lp_fread(t->tokens[i], 1, len, f, path);
        t->tokens[i][len] = '\0';
        at += 1 + len;
    }
    fclose(f);
    if (at != size) lp_fail("%s: file is longer than its %d tokens (%lld bytes more)", path, t->vocab_size, size - at);
    return 1;
}
#endif  // LLMPAR_IMPLEMENTATION

// Text out as valid UTF-8. GPT-2's tokens are bytes, and a token may end inside a character, so a
// character's bytes wait in `held` until it is complete; a byte that can neither start nor continue one
// prints as U+FFFD, one per maximal invalid piece, as Python's decode(errors="replace") does. Without it a
// sample can leave a log that grep calls binary.
typedef struct LPUtf8 {
    unsigned char held[4];
    int n, len;  // bytes held, and the length of the character they begin
} LPUtf8;
#define LP_UTF8_REPLACEMENT "\xEF\xBF\xBD"
#ifdef LLMPAR_IMPLEMENTATION
static inline int lp_utf8_length(unsigned char lead) {  // 0: not a first byte
    return lead < 0x80 ? 1 : lead < 0xC2 ? 0 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : lead < 0xF5 ? 4 : 0;
}
static inline int lp_utf8_continues(const LPUtf8* u, unsigned char b) {  // b as byte u->n of the held character
    unsigned char lo = 0x80, hi = 0xBF;  // the second byte rules out overlong forms, surrogates, > U+10FFFF
    if (u->n == 1 && u->held[0] == 0xE0) lo = 0xA0;
    if (u->n == 1 && u->held[0] == 0xED) hi = 0x9F;
    if (u->n == 1 && u->held[0] == 0xF0) lo = 0x90;
    if (u->n == 1 && u->held[0] == 0xF4) hi = 0x8F;
    return b >= lo && b <= hi;
}
static inline void lp_utf8_put(LPUtf8* u, unsigned char b, FILE* out) {
    if (u->n > 0) {
        if (lp_utf8_continues(u, b)) {
            u->held[u->n++] = b;
            if (u->n == u->len) {
                fwrite(u->held, 1, u->n, out);
                u->n = 0;
            }
            return;
        }
        fputs(LP_UTF8_REPLACEMENT, out);  // the unfinished character; b starts afresh
        u->n = 0;
    }
    u->len = lp_utf8_length(b);
    if (u->len == 0) fputs(LP_UTF8_REPLACEMENT, out);
    else if (u->len == 1) fputc(b, out);
    else u->held[u->n++] = b;
}
void lp_utf8_end(LPUtf8* u, FILE* out) {  // the text ends: an unfinished character is U+FFFD
    if (u->n > 0) fputs(LP_UTF8_REPLACEMENT, out);
    u->n = 0;
}

// Print a token (its id in <> without a tokenizer) through u, skipping lone control bytes.
void lp_tokenizer_print(const LPTokenizer* t, int id, LPUtf8* u, FILE* out) {
    if (!t->tokens || id < 0 || id >= t->vocab_size) {
        fprintf(out, "<%d>", id);
        return;
    }
    const char* s = t->tokens[id];
    if (s[0] && !s[1] && (unsigned char)s[0] < 32 && s[0] != '\n' && s[0] != '\t') return;
    for (; *s; s++) lp_utf8_put(u, (unsigned char)*s, out);
}

void lp_tokenizer_free(LPTokenizer* t) {
    for (int i = 0; t->tokens && i < t->vocab_size; i++) free(t->tokens[i]);
    free(t->tokens);
    memset(t, 0, sizeof(*t));
}
#endif  // LLMPAR_IMPLEMENTATION

#endif  // LLMPAR_H
