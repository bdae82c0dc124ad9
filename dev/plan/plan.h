/*
dev/plan/plan.h: the cluster planner, a tool built on llmpar.h (not part of it: a copier of llmpar.h gets
the engine alone). It answers "how should I run this model on N GPUs?": every t x p x cp x d grid, ZeRO stage,
recomputation and offload that fits a GPU, each step simulated on a stated machine from the engine's own
costs (llmpar.h section 11: FLOPs, memory, the pipeline partition) and schedules (section 4). Include it
after llmpar.h. Its program is dev/plan/plan_gpt.c (`make plan_gpt && ./plan_gpt --plan 8 -e d12`).

    defines: LPGpu, lp_gpus, LPCluster, lp_clusters, LPSoftware, lp_softwares, LPPlanMachine, lp_plan_machine,
             LPPlanModel, lp_plan_model_of, lp_plan_model_is_engine, lp_plan_layer_params, lp_plan_layer_flops,
             lp_plan_flops_per_token, lp_plan_model_params, lp_software_refuses, lp_plan_memory, lp_plan_straggle,
             lp_gemm_seconds, lp_allreduce_seconds, lp_plan_chunk, LPPlan, lp_plan_least_max, lp_plan_memory_floor, LPPlanPipes, lp_plan_makespan, lp_plan_makespan_floor,
             lp_plan_simulate,
             LPPlanLimits, lp_published_mfu, lp_plan_outside, lp_plan
*/
#ifndef LLMPAR_PLAN_H
#define LLMPAR_PLAN_H
// The configuration advisor (--plan N): the ways to train model c on n GPUs with sequence length T and
// `tokens` per step (t x p x d grid, interleaving, sequence parallelism, scatter/gather, ZeRO stage,
// recomputation, offload, expert parallelism, micro-batch B) that fit a GPU's memory, fastest first, each
// step simulated on a stated machine running a stated software (LPSoftware: what it can run, how, how it
// keeps its memory, how far its predictions were checked). It plans GPUs on any build (bf16 memory).
//
// The machine (LPPlanMachine): a GPU (lp_gpus: peak, memory, HBM, SMs, and the share of the peak its
// fastest GEMM and flash attention reach, as others measured them), a node (the GPUs of one NVLink
// domain and NCCL's bus bandwidth per GPU among them), the network (per GPU: the node's ports shared by
// its GPUs), a latency per collective or send. lp_clusters holds whole clusters as presets.
//
// One step, simulated:
//   chunk     one micro-batch's forward and backward of each chunk on one rank (lp_plan_chunk): its GEMMs,
//             each at lp_gemm_seconds; flash attention's products at the GPU's attention share (the masked
//             half skipped), the cublas path's as batched GEMMs and its probabilities through HBM;
//             LayerNorms, residual adds and GELU read and written once at HBM bandwidth; backward twice the
//             forward's GEMMs plus what it recomputes. On the critical path as the engine runs them: TP's
//             all-reduces (SP: all-gathers and reduce-scatters), EP's all-to-alls; ZeRO-2/3's per-layer
//             reductions and gathers overlap the layer beside them (--overlap), their excess exposed;
//   pipeline  the schedule's own action lists (lp_schedule_stage) run by the simulator (lp_schedule_run),
//             each message between stages taking its time: B T C values, 1/t of them per TP rank with
//             scatter/gather (then all-gathered inside the node) or SP; the sender held until delivery
//             where the software's sends wait; on shared cores (LPCluster.alone) a stage alone faster;
//   step end  what the engine does after backward, exposed: ZeRO-0's all-reduce (in the software's buckets)
//             beyond what hides under the last micro-batch's backward (all of it without --overlap), ZeRO-1's
//             reduce-scatter and all-gather, ZeRO-2's all-gather of the updated weights, ZeRO-2/3's
//             reduce-scatter of the tensors outside the layers and ZeRO-3's gather of them; AdamW's 32
//             bytes per value of the shard through HBM; or offload's host link, host memory and NVMe (the
//             slowest of the three);
//   stragglers  the work stretched by the slowest of the n ranks (lp_plan_straggle; none unless asked).
// Collectives run as NCCL's rings: an all-reduce moves 2 (g-1)/g of its bytes per rank, a reduce-scatter,
// all-gather or all-to-all (g-1)/g, at the bus bandwidth of its link, plus the latency; an all-reduce across
// nodes runs as NCCL's tree where its model says so (lp_allreduce_seconds). A group's link is
// the node's when its ranks (neighbours in rank order, with every axis inside it) fill whole groups of a
// node, else the network. A TP group is planned inside a node (t divides its GPUs) or over whole nodes
// (then at the network's bandwidth), never straddling two.
// Pruning: a configuration's busiest stage's work plus its step end bounds its step from below. Those that
// fit are simulated in the order of their bounds until a bound passes the slowest of the best ten
// simulated: none after it could enter the table (they keep their bound as their step, marked). Before its
// partition (most of a large plan's time), a floor under a configuration's memory (lp_plan_memory_floor)
// sets aside one that cannot fit.
typedef struct {
    const char* name;
    double peak_flops;  // dense bf16 FLOP/s
    double memory;      // bytes of HBM
    double hbm_bw;      // bytes/s of HBM
    int sms;            // streaming multiprocessors: a GEMM's output tiles run in waves of one per SM
    double gemm;        // the share of the peak the fastest bf16 GEMM of any shape reaches (measured)
    double attention;   // the share of the peak a causal flash attention's forward and backward reach (measured)
    int fp32;           // 1: the CPU engine (fp32 values, attention's probabilities kept, BLAS without GEMM tiles)
} LPGpu;

// Peaks, memory and HBM: NVIDIA's data sheets. gemm: the "maximum achievable matmul FLOPS" measured by the
// best shape of a sweep (stas00/ml-engineering, compute/accelerator). attention: FlashAttention-2's
// published forward + backward at head size 64, causal (A100 ~119 TFLOP/s, H100 ~192); Blackwell's is
// not published for it and is taken as the H100's share (an assumption). cpu: a rank of the CPU engine
// on one of the CI machine's kinds (AVX2 AMD EPYC), 2 cores shared by 4 ranks (the plan's calibration on
// a machine we have): a quarter of OpenBLAS's measured sgemm on both cores (dev/bench_sgemm.c, 145.5
// GFLOP/s) and of the memory bandwidth measured (two numpy copies at once: 19.4 GB/s, read and written);
// `gemm` is the share of that rate the engine's d4 step reached with data parallelism on the 4 ranks
// (0.54 and 0.55 in two runs). `bench_plan.sh cpu` measures the machine it runs on instead (--gpu-tflops,
// --gpu-gbs) and fits its own share.
static const LPGpu lp_gpus[] = {
    {"a100", 312e12, 80.0 * 1073741824.0, 2.039e12, 108, 0.869, 0.38, 0},
    {"h100", 989.4e12, 80.0 * 1073741824.0, 3.35e12, 132, 0.803, 0.19, 0},
    {"h200", 989.4e12, 141e9, 4.8e12, 132, 0.803, 0.19, 0},
    {"b200", 2250e12, 180e9, 8.0e12, 148, 0.776, 0.19, 0},
    {"gb200", 2500e12, 186e9, 8.0e12, 148, 0.729, 0.19, 0},
    {"cpu", 145.5e9 / 4, 24.0 * 1073741824.0 / 4, 20e9 / 4, 1, 0.55, 0.0, 1},
};

typedef struct {
    const char* name;
    const char* gpu;    // lp_gpus' name
    int node_gpus;      // GPUs on one NVLink domain
    double node_bw;     // NCCL's bus bandwidth per GPU among them, bytes/s (measured, large messages)
    int ports;          // network ports per node ...
    double port_bw;     // ... and what NCCL moves through each, bytes/s
    int nccl;           // 1: collectives are NCCL's rings (lp_nccl_protocols), on a stream of their own beside
                        // the compute; 0: MPI's, at `latency` each, progressing only inside MPI's calls (Open MPI
                        // has no progress thread: nothing overlaps) and its sends of more than a few KB waiting
                        // for their receiver
    double latency;     // seconds each collective or send takes beyond its bytes, whatever its size, on top
    double alone;       // how much faster a rank runs while the other ranks of its node wait (1: a GPU each;
                        // more where ranks share fewer cores, a waiting rank's share serving the others)
    const char* about;
} LPCluster;

// Bus bandwidths: NCCL's maintainers in nccl-tests issues 149 (A100, ~230 GB/s) and 212 (H100 ring,
// ~370); B200 740 GB/s measured at 4 GiB (ml-engineering, network). Ports: 46 GB/s of a 400 Gb/s NDR
// port (nccl-tests issue 290), 23 of a 200 Gb/s HDR one (the same share). cpu: Open MPI's all-reduce
// among 4 ranks on 2 cores, measured (a quiet machine, 2026-11-26): 9 us for 4 bytes, 1.1 GB/s of bus
// bandwidth at 256 KB to 1 MB.
static const LPCluster lp_clusters[] = {
    {"dgx-a100", "a100", 8, 230e9, 8, 23e9, 1, 0.0, 1.0, "DGX A100 SuperPOD (the PTD-P paper's Selene): 8 A100 80GB on NVSwitch, 8 HDR 200 Gb/s ports a node"},
    {"dgx-h100", "h100", 8, 370e9, 8, 46e9, 1, 0.0, 1.0, "DGX H100: 8 H100 on NVSwitch, 8 NDR 400 Gb/s ports a node"},
    {"nvl72", "gb200", 72, 740e9, 72, 46e9, 1, 0.0, 1.0, "GB200 NVL72: 72 GPUs on one NVLink domain, a 400 Gb/s port each"},
    {"cpu", "cpu", 4, 1.1e9, 4, 1.1e9, 0, 9e-6, 2.0, "the CI machine's kind: 2 AMD EPYC cores under 4 ranks of the CPU engine, MPI in shared memory"},
};

// The software running the step, described: what it can run (the search offers only those grids, and a grid
// typed that it cannot run is refused), how it runs a step, how it keeps its memory, and how far its
// predictions have been checked (its calibration: dev/plan/README.md, "How far the plan can be believed").
//   llmpar     this engine: every setting the planner knows (context parallelism too, with experts and the Llama
//              family; its ring's blocks priced at flash attention's rate, as the CUDA build runs them on its flash
//              kernels, never timed on a GPU), GPT-2's blocks and the Llama family's (its CPU build trains them on
//              every axis), sends that do not wait, no dropout, memory as its CUDA build keeps it (llmpar.h
//              section 11, lp_chunk_memory);
//   megatron   Megatron-LM as the selective-recomputation paper ran it (arXiv 2205.05198; the PTD-P paper's
//              runs, arXiv 2104.04473 with commit 6985e58 and examples/sc21, the same but for SP and selective
//              recomputation, which they did not have): TP with SP, interleaved 1F1B with scatter/gather,
//              full or selective recomputation, its distributed optimizer (ZeRO-1, with or without a
//              pipeline) and no ZeRO-2/3 or offload; dropout 0.1 on attention's probabilities and both
//              residual branches (masks of a byte a value); pipeline messages through batch_isend_irecv,
//              waited on, then torch.cuda.synchronize() (a stage that sends holds until delivery); with a
//              pipeline its gradients reduced after the flush; full recomputation reruns a layer's whole
//              forward; its materialised attention (torch.baddbmm into a buffer of the scores, the fused
//              masked softmax, dropout, torch.bmm) priced with a fixed cost per output tile, and its GEMMs at a
//              share of the GPU's best: both fitted together to that paper's eight step times (its Table 5)
//              by `bash dev/plan/bench_plan.sh fit`. Memory by that paper's count (lp_plan_memory);
//   megatron-2021  the same a year older, as the PTD-P paper ran it: no SP, selective recomputation or
//              distributed optimizer, on a GPU paced 1/1.095 (LP_PACE_2021: both papers ran the same 530B and 1T
//              pipelines: the older steps were 1.103x and 1.087x);
//   deepspeed  Megatron-DeepSpeed (BLOOM's and MT-NLG's software): Megatron-LM's layers as of 2021 (its TP without
//              SP, its GEMMs and attention as above, at megatron-2021's pace: the fork stayed Megatron-LM of 2021,
//              ~800 commits behind and without SP or flash attention, until July 2023: microsoft/Megatron-DeepSpeed
//              issue 105 and PR 159; BigScience's fork of it, PR 29) under DeepSpeed: ZeRO 1-3 without a pipeline, only ZeRO-1
//              with one (its PipelineEngine refuses ZeRO-2/3), ZeRO-Offload of the optimizer and ZeRO-3's
//              parameters (ZeRO-Infinity: NVMe); its pipeline engine runs plain 1F1B (no interleaving; DeepSpeed
//              issue 1110), partitions a boundary over the TP ranks (is_pipe_partitioned: scatter/gather), waits
//              for its sends, reduces gradients after the flush (ZeRO's overlap_comm is refused with a pipeline);
//              full recomputation only (DeepSpeed's activation checkpointing). Memory by the ZeRO
//              paper's count (Rajbhandari et al. 2020, section 3: 2 + 2 + 12 bytes a parameter, sharded by
//              stage) and the selective-recomputation paper's activations.
// Context parallelism: llmpar's alone (Megatron-LM gained it in Megatron-Core, after the runs these entries describe): the
// search offers cp > 1 only where LPSoftware.cp is set. A mixture of experts: this engine's on every axis; Megatron-DeepSpeed's
// (DeepSpeed-MoE) without a pipeline (its MoE example: "we don't support PP for MoE", microsoft/Megatron-DeepSpeed issue
// 151; DeepSpeed PR 5338 added it in 2024); neither Megatron-LM entry has one (Megatron-Core's came later).
enum { LP_MEMORY_ENGINE, LP_MEMORY_MEGATRON, LP_MEMORY_DEEPSPEED };
typedef struct {
    const char* name;
    // what it can run
    int pp;              // pipeline parallelism
    int sp;              // sequence parallelism in the TP group
    int interleaved;     // interleaved 1F1B (v > 1)
    int selective;       // selective recomputation (full recomputation: every software)
    int zero, zero_pp;   // the highest ZeRO stage without a pipeline, and with one
    unsigned offload;    // the LP_OFFLOAD_* kinds it has, as bits (none: always)
    int llama;           // grouped-query attention and SwiGLU MLPs (LPPlanModel; this engine: as its LPConfig describes them)
    int cp;              // context parallelism (a sequence split over cp ranks, attention a ring)
    int moe;             // a mixture of experts (expert parallelism over the data-parallel ranks): 0 none, 1 without a
                         // pipeline, 2 with one
    // how it runs a step
    double gemm;         // the share of the GPU's fastest GEMM (LPGpu.gemm) its GEMMs reach
    double attention_tile_k;  // its materialised attention's batched products: a fixed cost per output tile, in
                              // steps of the inner dimension (0: none beyond the GEMM's share)
    int recompute_all;   // full recomputation reruns: 1, a layer's whole forward; 0, up to the MLP's GELU (this
                         // engine: backward needs no output of the MLP's second projection)
    int blocking;        // 1: a pipeline send holds its stage until the message is delivered
    int dropout;         // 1: dropout on the residual branches and on materialised attention probabilities
    int pp_overlap;      // with a pipeline, 1: gradients reduced under backward; 0: after the flush
    double bucket_mb;    // ZeRO-0 all-reduces its gradients in buckets of this many MiB (at least a layer's; 0: all at once)
    double pace;         // the GPU's peak and HBM bandwidth as its kernels and framework reach them, a share (1: as measured)
    int memory;          // LP_MEMORY_*: how it keeps its memory
    // how far it is believed: predicted/published throughput over its calibration set, lowest and highest (a
    // prediction P's band: published within P/hi .. P/lo), and the runs that set spans
    double lo, hi;
    const char* calibrated_gpu;  // the GPUs (lp_gpus' names, space-separated) its calibration ran on
    int calibrated_gpus, calibrated_T;  // the most GPUs and the longest sequence in it
    const char* calibration;
    const char* about;
} LPSoftware;

#define LP_OFFLOAD_ALL (1u << LP_OFFLOAD_NONE | 1u << LP_OFFLOAD_OPTIMIZER | 1u << LP_OFFLOAD_PARAMS | 1u << LP_OFFLOAD_NVME)
// Megatron-LM's layers of 2021 on an A100: the PTD-P paper's steps (2021) on the two pipelines both papers ran were 1.103x
// and 1.087x the selective-recomputation paper's (2022), to which megatron's costs are fitted
#define LP_PACE_2021 (1.0 / 1.095)
static const LPSoftware lp_softwares[] = {
    {"llmpar", 1, 1, 1, 1, 3, 3, LP_OFFLOAD_ALL, 1, 1, 2, 1.0, 0.0, 0, 0, 0, 1, 25.0, 1.0, LP_MEMORY_ENGINE, 0.94, 1.09, "h100 cpu", 4, 1024,
     "this engine's one H100 step (GPT-2 124M) and 9 grids of its CPU build on 4 ranks", "this engine: sends that do not wait, no dropout"},
    {"megatron", 1, 1, 1, 1, 1, 1, 1u << LP_OFFLOAD_NONE, 1, 0, 0, 0.903, 576.0, 1, 1, 1, 0, 25.0, 1.0, LP_MEMORY_MEGATRON, 0.98, 1.13, "a100", 3072,
     2048, "the selective-recomputation paper's Table 5 (8 runs, fitted) and the PTD-P paper's Tables 1 and 2 (16 runs of Megatron-LM)",
     "Megatron-LM (2022): SP, interleaving, selective recomputation, ZeRO-1; dropout, blocking pipeline sends, GEMMs and attention at "
     "fitted costs, memory by Korthikanti et al."},
    {"megatron-2021", 1, 0, 1, 0, 0, 0, 1u << LP_OFFLOAD_NONE, 0, 0, 0, 0.903, 576.0, 1, 1, 1, 0, 25.0, LP_PACE_2021, LP_MEMORY_MEGATRON,
     0.91, 1.04, "a100", 3072, 2048, "the PTD-P paper's Tables 1 and 2 (16 runs; its 530B and 1T rows set the pace)",
     "Megatron-LM as the PTD-P paper ran it (2021): no SP, selective recomputation or distributed optimizer; megatron's fitted costs "
     "on an A100 paced 1/1.095 (the two papers' steps on the same pipelines)"},
    {"deepspeed", 1, 0, 0, 0, 3, 1, LP_OFFLOAD_ALL, 0, 0, 1, 0.903, 576.0, 1, 1, 1, 0, 953.7, LP_PACE_2021, LP_MEMORY_DEEPSPEED, 1.29, 1.43, "a100",
     2240, 2048, "the PTD-P paper's Table 2 (5 runs of DeepSpeed's ZeRO-3, 384-2240 GPUs)",
     "Megatron-DeepSpeed: Megatron-LM's layers of 2021 (megatron-2021's pace) without SP, ZeRO 1-3 (1 with a pipeline), offload, "
     "DeepSpeed's 1F1B pipeline (blocking sends, no interleaving), memory by the ZeRO paper"},
};

typedef struct {
    const LPSoftware* software;  // what runs the step: its features bound the search, its memory accounting (LPSoftware)
    LPGpu gpu;          // (gpu.gemm: the software's share of the peak)
    double attention_tile_k;  // the software's materialised attention: a fixed cost per tile of its batched products (LPSoftware)
    int recompute_all;  // the software's full recomputation reruns the whole layer (LPSoftware)
    int blocking;       // the software's pipeline sends wait for delivery
    int dropout;        // the software drops out (LPSoftware)
    double alone;       // a pipeline stage's pace while the others wait (LPCluster)
    double jitter;      // stragglers: the coefficient of variation of a rank's work in a step (lp_plan_straggle; 0: none)
    double gpu_bytes;   // memory a plan may fill per GPU
    int gpus_per_node;  // GPUs sharing one NVLink domain
    double node_bw;     // NCCL bus bandwidth per GPU inside a node, bytes/s
    double net_bw;      // ... between nodes: the node's ports shared by its GPUs
    int nccl;           // collectives as NCCL's rings (lp_nccl_protocols) beside the compute, else MPI's (LPCluster)
    double latency;     // seconds each collective or send takes beyond NCCL's model (MPI: all of its latency)
    double host_bw;     // bytes/s per GPU each way between the GPU and host memory (--offload)
    double host_mem_bw; // bytes/s of host memory per GPU for the CPU's AdamW (--offload)
    double nvme_bw;     // bytes/s per GPU to and from its offload files (--offload nvme)
} LPPlanMachine;

// The GPU or cluster of that name, or NULL.
static inline const LPGpu* lp_gpu_named(const char* name) {
    for (size_t k = 0; k < sizeof(lp_gpus) / sizeof(lp_gpus[0]); k++)
        if (strcmp(lp_gpus[k].name, name) == 0) return &lp_gpus[k];
    return NULL;
}
static inline const LPCluster* lp_cluster_named(const char* name) {
    for (size_t k = 0; k < sizeof(lp_clusters) / sizeof(lp_clusters[0]); k++)
        if (strcmp(lp_clusters[k].name, name) == 0) return &lp_clusters[k];
    return NULL;
}
static inline const LPSoftware* lp_software_named(const char* name) {
    for (size_t k = 0; k < sizeof(lp_softwares) / sizeof(lp_softwares[0]); k++)
        if (strcmp(lp_softwares[k].name, name) == 0) return &lp_softwares[k];
    return NULL;
}

// The machine of cluster preset k with its GPUs (or `gpu`'s, when not NULL) running software sw, 90% of a
// GPU's memory for the plan (10% for CUDA, cuBLAS, NCCL); the host side: PCIe 5 x16, a 400 GB/s host shared
// by 8 GPUs, one PCIe 4 NVMe drive per GPU.
static inline LPPlanMachine lp_plan_machine(const LPCluster* k, const LPGpu* gpu, const LPSoftware* sw) {
    LPPlanMachine m;
    m.gpu = gpu ? *gpu : *lp_gpu_named(k->gpu);
    m.software = sw;
    m.gpu.gemm *= sw->gemm;
    m.gpu.peak_flops *= sw->pace;
    m.gpu.hbm_bw *= sw->pace;
    m.blocking = sw->blocking || !k->nccl;  // (MPI's sends of more than a few KB wait for their receiver)
    m.dropout = sw->dropout;
    m.attention_tile_k = sw->attention_tile_k;
    m.recompute_all = sw->recompute_all;
    m.gpu_bytes = 0.9 * m.gpu.memory;
    m.gpus_per_node = k->node_gpus;
    m.node_bw = k->node_bw;
    m.net_bw = k->ports * k->port_bw / k->node_gpus;
    m.nccl = k->nccl;
    m.latency = k->latency;
    m.alone = k->alone;
    m.jitter = 0.0;
    m.host_bw = 55e9;
    m.host_mem_bw = 50e9;
    m.nvme_bw = 6e9;
    return m;
}

// The model planned: the engine's shape (LPConfig: GPT-2's blocks, a mixture of experts, or the Llama family's), or a
// modern dense block of the planner's own for Megatron-LM: grouped-query attention (kv_heads key/value heads shared by
// the query heads), a gated MLP (SwiGLU: two up projections to ffn, their product projected down) of any width. The
// engine's blocks (GPT-2's, the Llama family's, either with experts) have their weights and FLOPs counted by the engine
// (lp_param_sizes, lp_layer_flops); the planner's own by its formula (lp_plan_layer_params, lp_plan_layer_flops);
// the pipeline partition and this engine's memory weigh cfg's layers (the engine's Llama where cfg is one; the
// planner's own block: GPT-2's layers of the same L, C, NH and V, the same share of a layer against the head).
typedef struct {
    LPConfig cfg;
    int kv_heads;  // key/value heads (cfg.num_heads: every head its own)
    int ffn;       // the MLP's hidden width (4 C: GPT-2's)
    int swiglu;    // 1: a gated MLP (SwiGLU), 0: GELU's
} LPPlanModel;

static inline int lp_plan_model_is_gpt(const LPPlanModel* model) {
    return model->kv_heads == model->cfg.num_heads && model->ffn == 4 * model->cfg.channels && !model->swiglu;
}
// The engine's model of shape c, its blocks as c says (GPT-2's, or the Llama family's K/V heads and SwiGLU width).
static inline LPPlanModel lp_plan_model_of(const LPConfig* c) {
    LPPlanModel m = {*c, lp_kv_heads(c), lp_ffn_hidden(c), c->swiglu};
    return m;
}
// Whether cfg describes the model's blocks (so this engine's memory count, lp_chunk_memory, is the model's): not a
// block of the planner's own.
static inline int lp_plan_model_is_engine(const LPPlanModel* model) {
    const LPConfig* c = &model->cfg;
    return model->kv_heads == lp_kv_heads(c) && model->ffn == lp_ffn_hidden(c) && model->swiglu == c->swiglu;
}

// Whether a step drops out: where its software does (LPSoftware.dropout: Megatron-LM's GPT defaults, 0.1) on GPT-2's
// blocks. Llama's blocks have no dropout (Llama 3's architecture, as Llama 2's; Megatron-LM's own Llama 3 recipe
// sets both to 0: examples/llama/train_llama3_8b_h100_fp8.sh, --attention-dropout 0.0 --hidden-dropout 0.0).
static inline int lp_plan_dropout(const LPPlanModel* model, const LPPlanMachine* mach) {
    return mach->dropout && lp_plan_model_is_gpt(model);
}

// The weights of an average layer on a TP rank of t: the engine's (lp_param_sizes, biases and norms too, every expert) for its
// blocks; else attention's C (C + 2 kv hs) + C^2, the MLP's (2 or 3) C F, over t, and two RMSNorms' C.
static inline double lp_plan_layer_params(const LPPlanModel* model, int t) {
    const LPConfig* c = &model->cfg;
    double C = c->channels, hs = C / c->num_heads, layer = 0.0;
    if (!lp_plan_model_is_engine(model)) return (C * (C + 2.0 * model->kv_heads * hs) + C * C + (model->swiglu ? 3.0 : 2.0) * C * model->ffn) / t + 2.0 * C;
    size_t sizes[LP_NUM_PARAMS];
    lp_param_sizes(sizes, c, t);
    for (int i = 0; i < LP_NUM_PARAMS; i++) layer += lp_is_layer_tensor(i) ? (double)sizes[i] / c->num_layers : 0.0;
    return layer;
}

// Parameters one rank of chunk k with `layers` layers holds (lp_chunk_params for the engine's blocks; else its layers
// and, on the first chunk, the embeddings, on the last the final norm and an untied LM head).
static inline double lp_plan_chunk_params(const LPPlanModel* model, const LPPipeShape* s, int k, int layers, double* experts) {
    if (lp_plan_model_is_engine(model)) return lp_chunk_params(&model->cfg, s, k, layers, experts);
    double C = model->cfg.channels, Vl = (double)model->cfg.padded_vocab_size / s->par->tp, last = k == s->par->pp * s->par->vpp - 1;
    return layers * lp_plan_layer_params(model, s->par->tp) + (k == 0 ? Vl * C : 0.0) + (last ? Vl * C + C : 0.0);
}

// Training FLOPs per token of an average layer (lp_layer_flops for the engine's blocks): 6 per weight of its GEMMs
// and 12 C T of attention, and what recomputation reruns (full: the whole forward; selective: q k^T, 2 C T).
static inline double lp_plan_layer_flops(const LPPlanModel* model, int T, int recompute, int whole) {
    const LPConfig* c = &model->cfg;
    if (lp_plan_model_is_engine(model)) return lp_layer_flops(c, T, recompute, whole);
    double C = c->channels, weights = (lp_plan_layer_params(model, 1) - 2.0 * C), flops = 6.0 * weights + 12.0 * C * T;
    if (recompute == LP_RECOMPUTE_FULL) flops += 2.0 * weights + 4.0 * C * T;
    if (recompute == LP_RECOMPUTE_SELECTIVE) flops += 2.0 * C * T;
    return flops;
}

// Model FLOPs per token (lp_flops_per_token for the engine's blocks): the layers' and the LM head's 6 V C.
static inline double lp_plan_flops_per_token(const LPPlanModel* model, int T) {
    if (lp_plan_model_is_engine(model)) return lp_flops_per_token(&model->cfg, T);
    return model->cfg.num_layers * lp_plan_layer_flops(model, T, LP_RECOMPUTE_NONE, 0) + 6.0 * model->cfg.padded_vocab_size * model->cfg.channels;
}

// The model's parameters (lp_config_num_params for the engine's blocks).
static inline double lp_plan_model_params(const LPPlanModel* model) {
    if (lp_plan_model_is_engine(model)) return (double)lp_config_num_params(&model->cfg);
    return model->cfg.num_layers * lp_plan_layer_params(model, 1) + 2.0 * model->cfg.padded_vocab_size * model->cfg.channels + model->cfg.channels;
}

// NULL when software sw can run configuration par, else why not (naming the flags). Only the settings in
// `fixed` (LP_FIX_* bits, below) are weighed: the search passes all, plan_gpt those typed.
static inline const char* lp_software_refuses(const LPSoftware* sw, const LPParallel* par, unsigned fixed, char* why, size_t size);

// Bytes one rank of chunk k (`layers` layers, `slots` micro-batches' activations kept) holds as software
// mach->software keeps them. This engine: lp_chunk_memory. Megatron-LM and Megatron-DeepSpeed: model states
// (Megatron-LM: bf16 weights, fp32 gradients, fp32 master weights, m and v, 18 bytes a parameter, the last 12
// sharded over d by its distributed optimizer; DeepSpeed: the ZeRO paper's 2 + 2 + 12, each stage sharding one
// more of them over d; ZeRO-3 gathers two layers' weights at a time; offload moves the sharded optimizer state
// to the host, ZeRO-3's weights too), and activations by the selective-recomputation paper's count (Korthikanti
// et al. 2022, section 4; s b h bytes a unit for a micro-batch of b sequences of s tokens, h channels, a heads):
// a layer keeps s b h (10 + 24/t + 5 a s/(h t)) without SP, s b h (34 + 5 a s/h)/t with it; selective
// recomputation drops the 5 a s/h term; full recomputation keeps the layer's input, 2 s b h (/t with SP), and
// one layer's whole set while it reruns; the micro-batches in flight as Megatron-LM's schedules keep them (the
// paper's p on the first stage of 1F1B, (1 + (p-1)/(p v)) p interleaved: fewer than this engine's schedule, whose
// chunks' peaks are summed); the first chunk a byte a value of the embeddings' dropout mask, the
// last its LayerNorm's 4 s b h (/t with SP) and the logits in fp32 for the loss, 4 s b V/t.
static inline double lp_plan_memory(const LPPlanModel* model, const LPPipeShape* s, const LPPlanMachine* mach, int k, int layers, int slots) {
    // (`slots`: this engine's schedule's count for the chunk; the others count their own schedules' in-flight micro-batches)
    const LPSoftware* sw = mach->software;
    const LPConfig* c = &model->cfg;
    if (sw->memory == LP_MEMORY_ENGINE) return lp_chunk_memory(c, s, k, layers, slots);
    const LPParallel* par = s->par;
    int chunks = par->pp * par->vpp;
    double t = par->tp, d = par->dp, n = lp_plan_chunk_params(model, s, k, layers, NULL), layer = lp_plan_layer_params(model, par->tp), states;
    if (sw->memory == LP_MEMORY_MEGATRON) {
        states = 6.0 * n + 12.0 * n / (par->zero >= 1 ? d : 1.0);
    } else {
        double shard = n / d, offloaded = par->offload != LP_OFFLOAD_NONE;
        if (par->zero == 0) states = 16.0 * n;
        else if (par->zero == 1) states = 4.0 * n + 12.0 * (1.0 - offloaded) * shard;
        else if (par->zero == 2) states = 2.0 * n + 2.0 * shard + 12.0 * (1.0 - offloaded) * shard;
        else states = (par->offload == LP_OFFLOAD_PARAMS ? 0.0 : 4.0 * shard) +
                      12.0 * (1.0 - offloaded) * shard + 2.0 * 2.0 * (layers ? layer : 0.0);
    }
    // a layer's bytes, in units of s b h: 10 that TP does not split (the two norms' inputs, the two blocks' inputs, the
    // two dropout masks: 8 without dropout), and split by t: q, k and v (2 + 4 kv/a), attention's output (2), the MLP's
    // (GELU's input and output, 4 F/h; SwiGLU's two up projections and their product, 6 F/h), materialised attention's
    // probabilities, mask and dropped probabilities (5 a s/h; 2 a s/h without dropout; flash keeps none): GPT's 10 + 24
    // + 5 a s/h
    int dropout = lp_plan_dropout(model, mach);
    double S = s->T, b = s->B, h = c->channels, a = c->num_heads, sbh = S * b * h, whole = dropout ? 10.0 : 8.0;
    double split = 4.0 + 4.0 * model->kv_heads / a + (model->swiglu ? 6.0 : 4.0) * model->ffn / h;
    double attention = s->attention == LP_ATTENTION_CUBLAS ? (dropout ? 5.0 : 2.0) * a * S / h : 0.0;
    double full = par->sp ? sbh * (whole + split + attention) / t : sbh * (whole + split / t + attention / t);
    double kept = full;
    if (par->recompute == LP_RECOMPUTE_SELECTIVE) kept = par->sp ? sbh * (whole + split) / t : sbh * (whole + split / t);
    if (par->recompute == LP_RECOMPUTE_FULL) kept = 2.0 * sbh / (par->sp ? t : 1.0);
    // micro-batches in flight on the chunk's stage as Megatron-LM's schedules keep them (stage r of 1F1B: p - r; interleaved:
    // its warm-up's 2 (p - r - 1) + (v - 1) p chunks' forwards and one more), an even share of them the chunk's
    double p = par->pp, v = par->vpp, r = k % par->pp;
    double inflight = fmin((double)par->micro_batches * v, v > 1 ? 2.0 * (p - r - 1.0) + (v - 1.0) * p + 1.0 : p - r) / v;
    double activations = inflight * layers * kept + (par->recompute == LP_RECOMPUTE_FULL && layers ? full : 0.0);
    if (k == 0 && dropout) activations += inflight * sbh / (par->sp ? t : 1.0);  // (the embeddings' dropout mask)
    if (k == chunks - 1) activations += 4.0 * sbh / (par->sp ? t : 1.0) + 4.0 * S * b * c->padded_vocab_size / t;
    return states + activations;
}

// Stragglers: each rank's work in a step varies independently, normally, by a coefficient of variation `jitter`;
// a step waits for the slowest of its n ranks, on average jitter sqrt(2 ln n) above the mean (the maximum of n
// normals, to first order): the share a step's work grows by. 1% costs 2.9% on 64 GPUs, 4.3% on 8,192, 4.4% on 16,384.
static inline double lp_plan_straggle(const LPPlanMachine* mach, int n) {
    return n > 1 ? mach->jitter * sqrt(2.0 * log((double)n)) : 0.0;
}

// Seconds of `batch` GEMMs of an M x N output summed over K on g: at the share of the peak its fastest
// GEMM reaches, less tile quantization (128 x 128 output tiles, cuBLAS's for large problems) and wave
// quantization (tiles run in waves of one per SM: a part-full last wave idles the rest), each tile paying
// tile_k steps of K more where the software's kernels have a fixed cost per tile, or, when thin, at HBM's
// pace (bf16 inputs read and the output written once).
static inline double lp_gemm_seconds(const LPGpu* g, double M, double N, double K, double batch, double tile_k) {
    double tiles = batch * ceil(M / 128.0) * ceil(N / 128.0), waves = ceil(tiles / g->sms), X = g->fp32 ? 4.0 : 2.0;
    double used = g->fp32 ? 1.0 : batch * M * N / (waves * g->sms * 128.0 * 128.0);  // of what the waves' tiles could compute
    return fmax(2.0 * batch * M * N * (K + tile_k) / (g->peak_flops * g->gemm * used), X * batch * (M * K + K * N + M * N) / g->hbm_bw);
}

// A linear layer of M rows, K inputs and N outputs (`batch` of them): its forward GEMM into *f, its
// backward's two (the input's gradient, M x K over N; the weight's, K x N over M) into *b.
static inline void lp_linear_seconds(const LPGpu* g, double M, double K, double N, double batch, double* f, double* b) {
    *f += lp_gemm_seconds(g, M, N, K, batch, 0.0);
    *b += lp_gemm_seconds(g, M, K, N, batch, 0.0) + lp_gemm_seconds(g, K, N, M, batch, 0.0);
}

// The link of a group whose ranks, with every axis inside it, span `inner` consecutive ranks.
static inline double lp_plan_link(const LPPlanMachine* mach, int inner) {
    return mach->gpus_per_node % inner == 0 ? mach->node_bw : mach->net_bw;
}

// NCCL's rings by protocol, as NCCL's own tuning model prices them (src/graph/tuning.cc of NCCL 2.8, the
// PTD-P paper's time): the latency at the start, of each step of the ring over NVLink and of each between
// nodes, and the share of the bus bandwidth it reaches (LL: a flag in every 8 bytes, a quarter; LL128: 120
// of 128 bytes). NCCL runs each collective in whichever protocol is fastest for its size: LL for small
// messages, Simple for large.
typedef struct {
    double start, hop_node, hop_net, share;
} LPNcclProtocol;
static const LPNcclProtocol lp_nccl_protocols[] = {
    {3.6e-6, 0.47e-6, 2.7e-6, 0.25},  // LL
    {10.0e-6, 1.9e-6, 4.0e-6, 0.92},  // LL128
    {8.4e-6, 3.4e-6, 9.6e-6, 1.0},    // Simple
};

// `steps` steps of a ring, `across` of them between nodes, each moving `bytes` at bus bandwidth bw.
static inline double lp_ring_seconds(const LPPlanMachine* mach, double steps, double across, double bytes, double bw) {
    if (!mach->nccl) return steps * bytes / bw + mach->latency;
    double best = INFINITY;
    for (size_t k = 0; k < sizeof(lp_nccl_protocols) / sizeof(lp_nccl_protocols[0]); k++) {
        const LPNcclProtocol* q = &lp_nccl_protocols[k];
        best = fmin(best, q->start + (steps - across) * q->hop_node + across * q->hop_net + steps * bytes / (q->share * bw));
    }
    return best + mach->latency;
}

// The nodes a group spanning `inner` consecutive ranks reaches (1: inside one node).
static inline double lp_group_nodes(const LPPlanMachine* mach, int inner) {
    return mach->gpus_per_node % inner == 0 ? 1.0 : fmax(2.0, ceil((double)inner / mach->gpus_per_node));
}

// One collective of a group of g ranks spanning `inner` consecutive ranks (lp_plan_link), each holding
// `bytes`, as a ring: an all-reduce (`allreduce` 1) takes 2(g-1) steps, a reduce-scatter, all-gather or
// all-to-all g-1, each moving 1/g of the bytes; one step between nodes for each node the ring crosses.
static inline double lp_collective_seconds(const LPPlanMachine* mach, double bytes, int allreduce, double g, int inner) {
    double nodes = lp_group_nodes(mach, inner);
    double steps = (allreduce ? 2.0 : 1.0) * (g - 1.0), across = fmin(steps, (allreduce ? 2.0 : 1.0) * (nodes - 1.0));
    return lp_ring_seconds(mach, steps, across, bytes / g, lp_plan_link(mach, inner));
}

// NCCL's trees for an all-reduce across nodes (the same tuning.cc): a reduction up a tree and a broadcast down it,
// latency at the start and per hop, 2 ((ranks a node - 1) hops inside it + log2(nodes) between nodes), whatever the
// number of nodes; half the bus bandwidth (each byte crosses a link up and down), 0.9 of the ring's and at most 80
// GB/s over more than 2 nodes (LL a 3.8th of that, LL128 0.915), and less at medium sizes (NCCL's own correction
// table, by log2 of the bytes over 64, 64 B to 128 MB). Simple's hops are a 256 kB chunk's.
static const LPNcclProtocol lp_nccl_trees[] = {
    {4.4e-6, 0.52e-6, 5.0e-6, 1.0 / 3.8},  // LL
    {4.4e-6, 1.2e-6, 8.5e-6, 0.915},      // LL128
    {0.0, 28e-6, 50e-6, 1.0},             // Simple
};
static const float lp_nccl_tree_correction[3][22] = {
    {1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0},
    {1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0},
    {.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9}};

// An all-reduce of `bytes` over g ranks spanning `inner` consecutive ranks: inside a node NCCL's ring
// (lp_collective_seconds); across nodes the faster of its ring and its tree in each protocol, as NCCL's model
// prices them: the ring's Simple latency 1.9x for messages of at least g/16 x 64 KiB (its "plateau"), LL's hops
// inside a node 1.8x. A ring's latency grows with the ranks (2 (g-1) steps), a tree's with log2 of the nodes: at
// thousands of ranks the tree wins up to tens of MB.
static inline double lp_allreduce_seconds(const LPPlanMachine* mach, double bytes, double g, int inner) {
    double nodes = fmin(lp_group_nodes(mach, inner), g);
    if (!mach->nccl || nodes < 2.0) return lp_collective_seconds(mach, bytes, 1, g, inner);
    double bw = lp_plan_link(mach, inner), ppn = fmax(1.0, g / nodes), steps = 2.0 * (g - 1.0), across = 2.0 * (nodes - 1.0);
    int size = (int)floor(log2(fmax(bytes / 64.0, 1.0))), best_set = 0;
    double best = 0.0;
    for (int p = 0; p < 3; p++) {
        const LPNcclProtocol *r = &lp_nccl_protocols[p], *q = &lp_nccl_trees[p];
        double ll = p == 0 ? 1.8 : 1.0, plateau = p == 2 && bytes >= g / 16.0 * 65536.0 ? 1.9 : 1.0;
        double ring = (r->start + (steps - across) * ll * r->hop_node + across * r->hop_net) * plateau + steps * bytes / g / (r->share * bw);
        double tree_bw = 0.5 * fmin(0.9 * bw, nodes > 2.0 ? 80e9 : 110e9) * q->share * (size < 22 ? lp_nccl_tree_correction[p][size] : 1.0);
        double tree = q->start + 2.0 * ((ppn - 1.0) * ll * q->hop_node + floor(log2(nodes)) * q->hop_net) + bytes / tree_bw;
        double t = fmin(ring, tree);
        if (!best_set || t < best) best = t, best_set = 1;
    }
    return best + mach->latency;
}

// A message of `bytes` between two ranks of a group spanning `inner` consecutive ranks: one step.
static inline double lp_send_seconds(const LPPlanMachine* mach, double bytes, int inner) {
    return lp_ring_seconds(mach, 1.0, mach->gpus_per_node % inner != 0, bytes, lp_plan_link(mach, inner));
}

// One micro-batch of chunk k (running `layers` layers) on one rank: seconds of its forward and backward,
// and of what they hold (compute, TP's collectives, EP's all-to-alls, the context-parallel ring's exposed sends,
// ZeRO-2/3's exposed collectives). With context parallelism s->T is the rank's share of a sequence (T/cp rows,
// as the engine's LPPipeShape holds it): its rows score keys of the whole sequence, cp T.
typedef struct {
    double fwd, bwd;
    double compute, tp, ep, cp, dp;
} LPChunkTime;

static inline LPChunkTime lp_plan_chunk(const LPPlanModel* model, const LPPipeShape* s, const LPPlanMachine* mach, int k, int layers) {
    const LPConfig* c = &model->cfg;
    const LPGpu* g = &mach->gpu;
    const LPParallel* par = s->par;
    double t = par->tp, ep = par->ep, C = c->channels, Cl = C / t, T = s->T, N = (double)s->B * T, X = g->fp32 ? 4.0 : 2.0;
    double cp = par->cp, S = T * cp, d = (double)par->dp * par->cp;  // (the whole sequence; the ranks ZeRO shards over, cp d)
    double heads = (double)c->num_heads / t, hs = C / c->num_heads, E = c->moe_experts, K = c->moe_topk;
    double moe = (double)lp_layers_having(c, LP_ROUTERW, 0, c->num_layers) / c->num_layers;  // the share of MoE layers
    double Fl = (double)model->ffn / t;  // the MLP's hidden width on a TP rank
    int dropout = lp_plan_dropout(model, mach);
    // an average layer's compute: attention's linear layers (q, and k and v of its kv heads), the MLP's (SwiGLU: two up
    // projections; a MoE layer's router and its E/ep experts, each the MLP's shape, taking K N ep / E rows on average)
    double f = 0.0, b = 0.0, mf = 0.0, mb = 0.0, ef = 0.0, eb = 0.0, pf = 0.0, pb = 0.0;
    lp_linear_seconds(g, N, C, Cl + 2.0 * model->kv_heads * hs / t, 1.0, &f, &b);
    lp_linear_seconds(g, N, Cl, C, 1.0, &f, &b);
    lp_linear_seconds(g, N, C, (model->swiglu ? 2.0 : 1.0) * Fl, 1.0, &mf, &mb);
    lp_linear_seconds(g, N, Fl, C, 1.0, &pf, &pb);  // (the dense MLP's second projection)
    mf += pf, mb += pb;
    if (moe > 0.0) {
        lp_linear_seconds(g, N, C, E, 1.0, &ef, &eb);
        lp_linear_seconds(g, K * N * ep / E, C, (model->swiglu ? 2.0 : 1.0) * Fl, E / ep, &ef, &eb);  // (an expert: the MLP's shape)
        lp_linear_seconds(g, K * N * ep / E, Fl, C, E / ep, &ef, &eb);
    }
    f += (1.0 - moe) * mf + moe * ef;
    b += (1.0 - moe) * mb + moe * eb;
    double af, ab;  // attention's products
    // (T rows against S keys: the ring's cp blocks; the causal mask's half split evenly by the chunk layout)
    if ((s->attention == LP_ATTENTION_FLASH || cp > 1) && !g->fp32) {  // causal: half of q k^T's and att v's 4 T^2 hs per
                                                                        // head; backward 5 to 2 (the ring is flash's)
        af = 2.0 * s->B * heads * T * S * hs / (g->peak_flops * g->attention);
        ab = 2.5 * af;
    } else {  // batched GEMMs; the probabilities written, then read, and backward's read and written (dropout: read,
              // written and a mask of a byte each way)
        double tk = mach->attention_tile_k;
        af = lp_gemm_seconds(g, T, S, hs, s->B * heads, tk) + lp_gemm_seconds(g, T, hs, S, s->B * heads, tk);
        ab = 2.0 * af;
        af += (2.0 * X + dropout * (2.0 * X + 1.0)) * s->B * heads * T * S / g->hbm_bw;
        ab += (3.0 * X + dropout * (2.0 * X + 1.0)) * s->B * heads * T * S / g->hbm_bw;
    }
    // context parallelism's ring (llmpar.h, lp_ring_attention_forward/backward): forward passes a K/V block (B T rows of
    // the rank's 2 KV/t heads) on cp - 1 times, each send posted before the block's attention and hidden under it (NCCL:
    // a stream of its own; MPI progresses nothing beside the compute); backward passes the blocks again under their
    // attention, and after each block the keys' and values' gradients so far, waited for before the next (exposed).
    // A group of t cp consecutive ranks: inside a node or over the network
    double ring_f = 0.0, ring_b = 0.0;
    if (cp > 1) {
        double block = lp_send_seconds(mach, s->B * T * 2.0 * model->kv_heads / t * hs * X, par->tp * par->cp);
        double under_f = mach->nccl ? af / cp : 0.0, under_b = mach->nccl ? ab / cp : 0.0;
        ring_f = (cp - 1.0) * fmax(0.0, block - under_f);
        ring_b = (cp - 1.0) * fmax(0.0, block - under_b) + cp * block;
    }
    double rows = par->sp ? N / t : N;  // LayerNorms and residual adds (10 C a row, read and written; split by SP), GELU
                                        // (F/t read and written; SwiGLU: 2 F/t read, F/t written)
    double ew = X * (10.0 * rows * C + (model->swiglu ? 3.0 : 2.0) * N * Fl) / g->hbm_bw, masks = dropout * 2.0 * rows * C / g->hbm_bw;
    f += af + ew + masks;  // (dropout's two masks written forward, read backward)
    b += ab + 2.0 * ew + masks;
    // full recomputation: the forward again, this engine's without the dense MLP's second projection
    if (par->recompute == LP_RECOMPUTE_FULL) b += f - (mach->recompute_all ? 0.0 : (1.0 - moe) * pf);
    if (par->recompute == LP_RECOMPUTE_SELECTIVE) b += af;
    // TP: 2 all-reduces of the B T C activations forward and 2 backward (SP: 2 all-gathers and 2 reduce-scatters
    // forward; backward 4 all-gathers, the LayerNorms' outputs gathered again for the weights' gradients, and 2
    // reduce-scatters)
    double tp_f = !(t > 1) ? 0.0 : par->sp ? 4.0 * lp_collective_seconds(mach, N * C * X, 0, t, par->tp) : 2.0 * lp_allreduce_seconds(mach, N * C * X, t, par->tp);
    double tp_b = par->sp ? 1.5 * tp_f : tp_f;
    // ... and under full recomputation forward's again, this engine's up to the GELU (of a dense layer's 2 all-reduces
    // the first; SP: 3 of its 4 collectives)
    double tp_r = mach->recompute_all ? tp_f : tp_f * (moe + (1.0 - moe) * (par->sp ? 0.75 : 0.5));
    double ep_f = ep > 1 ? moe * 2.0 * lp_collective_seconds(mach, K * N * C * X, 0, ep, par->tp * par->ep) : 0.0;
    double full = par->recompute == LP_RECOMPUTE_FULL ? 1.0 : 0.0;
    // ZeRO-2/3: each layer's gradients reduce-scattered in backward, ZeRO-3's weights gathered before its forward and
    // backward; the dense part over d (cp d), the experts over their d/ep replicas
    double dz_f = 0.0, dz_b = 0.0;
    if (d > 1 && par->zero >= 2) {
        size_t sizes[LP_NUM_PARAMS];
        lp_param_sizes(sizes, c, par->tp);
        double dense = 0.0, experts = 0.0, de = d / ep;
        if (!lp_plan_model_is_engine(model)) dense = lp_plan_layer_params(model, par->tp);
        else
            for (int i = 0; i < LP_NUM_PARAMS; i++)
                if (lp_is_layer_tensor(i)) *(lp_is_expert_tensor(i) ? &experts : &dense) += (double)sizes[i] / c->num_layers;
        int inner = par->tp * par->cp * par->dp;
        double once = lp_collective_seconds(mach, dense * X, 0, d, inner);  // (a reduce-scatter or a gather of a layer)
        if (experts > 0.0 && de > 1) once += lp_collective_seconds(mach, experts / ep * X, 0, de, inner);
        // (backward's reduce-scatter and ZeRO-3's gather share the DP link: together they outlast the layer or not)
        double hide_f = par->overlap && mach->nccl ? f : 0.0, hide_b = par->overlap && mach->nccl ? b : 0.0;
        dz_b = fmax(0.0, (par->zero >= 3 ? 2.0 : 1.0) * once - hide_b);
        if (par->zero >= 3) dz_f = fmax(0.0, once - hide_f);
    }
    LPChunkTime out;
    out.compute = layers * (f + b);
    out.tp = layers * (tp_f + tp_r * full + tp_b);
    out.ep = layers * ep_f * (2.0 + full);
    out.cp = layers * (ring_f * (1.0 + full) + ring_b);
    out.dp = layers * (dz_f + dz_b);
    out.fwd = layers * (f + tp_f + ep_f + dz_f + ring_f);
    out.bwd = layers * (b + tp_r * full + tp_b + ep_f * (1.0 + full) + dz_b + ring_b + ring_f * full);
    double hf = 0.0, hb = 0.0, Vl = c->padded_vocab_size / t;  // the first chunk's embedding, the last's head and loss
    if (k == 0) hf += 2.0 * X * N * C / g->hbm_bw, hb += 2.0 * X * N * C / g->hbm_bw;
    if (k == par->pp * par->vpp - 1) {
        lp_linear_seconds(g, N, C, Vl, 1.0, &hf, &hb);
        hf += X * (rows * 2.0 * C + 2.0 * N * Vl) / g->hbm_bw;  // the final LayerNorm; the logits written and read for the loss
        hb += X * (rows * 4.0 * C + 2.0 * N * Vl) / g->hbm_bw;
    }
    out.compute += hf + hb;
    out.fwd += hf;
    out.bwd += hb;
    return out;
}

typedef struct {
    LPParallel par;         // the configuration
    int B;                  // and its micro-batch
    int estimated;          // its partition and memory known, or its memory floored above the GPU's (0: bounded out,
                            // step_s is a lower bound)
    int floored;            // memory is lp_plan_memory_floor's floor, above the GPU's: it cannot fit (not partitioned,
                            // its times the bound's, its host memory not counted)
    int fits;               // memory <= the GPU's (when estimated)
    int simulated;          // its pipeline simulated (0: step_s is the busiest stage's work and the step end)
    double memory, host_memory;  // bytes on the fullest rank; of state in host memory
    // seconds per step: the busiest stage's compute, TP collectives, EP all-to-alls, the context-parallel ring's
    // exposed sends and ZeRO-2/3's exposed collectives; the pipeline's idle time on it (bubble and waits on
    // messages); the step's end (exposed DP collectives, the optimizer or offload); the whole step
    double compute_s, tp_s, ep_s, cp_s, zero_s, bubble_s, end_s, step_s;
    double busy_s;          // the busiest stage's work: compute + tp + ep + cp + zero
    double flops;           // training FLOPs of a step, recomputation counted
} LPPlan;

// Those that fit first, fastest first (simulated, then estimated, then bounded); among equally fast plans
// the larger micro-batch (GEMMs run better), then less memory.
static inline int lp_plan_order(const void* a, const void* b) {
    const LPPlan *x = (const LPPlan*)a, *y = (const LPPlan*)b;
    if (x->fits != y->fits) return x->fits ? -1 : 1;
    if (x->estimated != y->estimated) return x->estimated ? -1 : 1;
    if (x->simulated != y->simulated) return x->simulated ? -1 : 1;
    if (x->step_s != y->step_s) return x->step_s < y->step_s ? -1 : 1;
    if (x->B != y->B) return x->B > y->B ? -1 : 1;
    if (x->memory != y->memory) return x->memory < y->memory ? -1 : 1;
    return x->par.cp - y->par.cp;  // (then the sequence split over fewer ranks)
}

// The step's end on a stage holding `params` parameters per rank (`experts` of them a mixture of experts')
// whose backward of one micro-batch takes `bwd`: its shard's exposed DP collectives (over the cp d ranks that hold
// the same weights; the experts' over their d/ep replicas), then AdamW's or offload's update; *host: the state
// offload keeps in host memory.
static inline double lp_plan_end(const LPPlanModel* model, const LPPipeShape* s, const LPPlanMachine* mach, double params, double experts,
                                 double bwd, double* host) {
    const LPConfig* c = &model->cfg;
    const LPParallel* par = s->par;
    double d = (double)par->dp * par->cp, ep = par->ep, de = d / ep, m = par->micro_batches, X = mach->gpu.fp32 ? 4.0 : 2.0, end = 0.0;
    double stage_layers = ceil((double)c->num_layers / par->pp);  // (a collective a layer)
    int inner = par->tp * par->cp * par->dp;
    double rs = d > 1 ? stage_layers * lp_collective_seconds(mach, (params - experts) * X / stage_layers, 0, d, inner) : 0.0;  // a reduce-scatter or all-gather
    double rs_dense = rs;
    if (de > 1 && experts > 0.0) rs += stage_layers * lp_collective_seconds(mach, experts * X / stage_layers, 0, de, inner);
    if (par->zero == 0 && d > 1) {  // an all-reduce, in the software's buckets (at least a layer; the dense part's, the experts' as above)
        double total = (params - experts) * X, bucket = mach->software->bucket_mb * 1048576.0;
        double message = bucket > 0.0 ? fmin(total, fmax(bucket, total / stage_layers)) : total, count = ceil(total / message - 1e-9);
        double all = count * lp_allreduce_seconds(mach, total / count, d, inner) + (de > 1 && experts > 0.0 ? 2.0 * (rs - rs_dense) : 0.0);
        end = par->overlap && mach->nccl ? fmax(all / count, all - bwd) : all;
    }
    // the tensors outside the layers (embeddings, final norm, head): ZeRO-2/3 reduce-scatter their gradients here, at
    // the step's end, not under backward, and ZeRO-3 gathers their updated weights here too (lp_zero_average,
    // lp_zero_gather_updated)
    double outside = fmax(0.0, params - experts - stage_layers * lp_plan_layer_params(model, par->tp));
    double rs_outside = d > 1 && outside > 0.0 ? lp_collective_seconds(mach, outside * X, 0, d, inner) : 0.0;
    if (par->zero == 1) end = 2.0 * rs;
    if (par->zero == 2) end = rs + rs_outside;  // the updated weights gathered
    if (par->zero == 3) end = 2.0 * rs_outside;
    double shard = par->zero >= 1 ? ceil(params / d) : params;  // the busiest rank's
    double update = 32.0 * shard / mach->gpu.hbm_bw;  // AdamW: fp32 master, m and v read and written, bf16 gradient in, weight out
    *host = 0.0;
    if (par->offload != LP_OFFLOAD_NONE) {  // the CPU's AdamW instead, its state in host memory (nvme: in files)
        int params_too = par->offload == LP_OFFLOAD_PARAMS;  // (the updated weights then stay on the host)
        double link = (params_too ? 1.0 : 2.0) * X * shard / mach->host_bw;
        double cpu = 28.0 * shard / mach->host_mem_bw;
        double file = par->offload == LP_OFFLOAD_NVME ? 16.0 * shard / mach->nvme_bw : 0.0;
        double gathers = params_too ? 2.0 * m * X * shard / mach->host_bw : 0.0;  // each layer's part up, twice per micro-batch
        update = fmax(link, fmax(cpu, file)) + gathers;
        *host = (par->offload == LP_OFFLOAD_NVME ? 4.0 : params_too ? 12.0 + X : 12.0) * shard;
    }
    return end + update;
}

// A lower bound of configuration s's step, before its partition, memory or pipeline: a stage's share of the
// whole model's work w per micro-batch, over the m micro-batches and the pipeline's fill and drain
// ((m + (p-1)/v) w: the first micro-batch passes every stage, and the busiest stage does at least the
// average), and the step end of a stage holding its share of the parameters (the end grows with them)
// under the whole model's backward (which hides the most).
static inline double lp_plan_bound(const LPPlanModel* model, const LPPipeShape* s, const LPPlanMachine* mach) {
    const LPConfig* c = &model->cfg;
    int chunks = s->par->pp * s->par->vpp;
    LPChunkTime all = lp_plan_chunk(model, s, mach, 0, c->num_layers), head = lp_plan_chunk(model, s, mach, chunks - 1, 0);
    double work = (all.fwd + all.bwd + (chunks > 1 ? head.fwd + head.bwd : 0.0)) / s->par->pp, experts = 0.0, host;
    double params = lp_plan_chunk_params(model, s, 0, c->num_layers, &experts);
    return (s->par->micro_batches + (s->par->pp - 1.0) / s->par->vpp) * work +
           lp_plan_end(model, s, mach, params / s->par->pp, experts / s->par->pp, all.bwd + head.bwd, &host);
}

// The most layers each chunk can run within cost `most` (cost[k][n]: chunk k running n layers, rising with n but for
// INFINITY at n = 0 where it must have one) into hi[k]; whether L layers can be so placed, each chunk within it.
static inline int lp_plan_within(const double* cost, int chunks, int L, double most, int* hi) {
    int total = 0, need = 0;
    for (int k = 0; k < chunks; k++) {
        const double* row = cost + (size_t)k * (L + 1);
        int first = row[0] == INFINITY, a = first - 1, b = L;  // (the last entry within it, by bisection: row[a] <= most < row[b + 1])
        while (a < b) {
            int mid = (a + b + 1) / 2;
            if (row[mid] <= most) a = mid;
            else b = mid - 1;
        }
        if (a < first) return 0;
        hi[k] = a, total += a, need += !(row[0] <= most);
    }
    return total >= L && need <= L;
}

// lp_partition_minmax's value without its table of every split (chunks x L^2 steps), where each chunk's cost rises
// with its layers (INFINITY at n = 0 where it must have one), so that any counts within a level that sum to L make a
// partition: the least entry at which the chunks reach L layers, by bisection over each distinct row; INFINITY where
// none does. *hi: each chunk's most layers within it.
static inline double lp_plan_least_max(const double* cost, int chunks, int L, int* hi) {
    double least = INFINITY;
    for (int k = 0; k < chunks; k++) {
        const double* row = cost + (size_t)k * (L + 1);
        if (k > 0 && memcmp(row, row - (L + 1), (L + 1) * sizeof(double)) == 0) continue;  // (the middle chunks' rows alike)
        int a = row[0] == INFINITY, b = L + 1;  // (the first entry that reaches L: row[b]; row[a - 1] does not)
        while (a < b) {
            int mid = (a + b) / 2;
            if (lp_plan_within(cost, chunks, L, row[mid], hi)) b = mid;
            else a = mid + 1;
        }
        if (b <= L) least = fmin(least, row[b]);
    }
    if (least < INFINITY) lp_plan_within(cost, chunks, L, least, hi);
    return least;
}

// A floor under the memory of configuration s's fullest rank, found without the engine's balanced partition (whose
// tables weigh every chunk at every layer count: most of a large plan's time); 0 where it does not apply (another
// partition than balanced, or a schedule the engine refuses: lp_plan_one finds out). The partition's first
// criterion is the least work on the costliest chunk (lp_chunk_flops, lp_partition_minmax), so none it returns gives
// chunk k more layers than keep its work within that least (hi), nor fewer than L less the others' most (lo). A
// chunk's memory grows from lo by at least its least step between lo and hi a layer (each step evaluated; 0 if one
// is negative); the floor is the lowest level every stage could stay under with the layers above the lo's placed
// where they cost least (a continuous relaxation, by bisection). Tested against lp_plan_one (test_plan_floor).
static inline double lp_plan_memory_floor(const LPPlanModel* model, const LPPipeShape* s, const LPPlanMachine* mach) {
    const LPConfig* c = &model->cfg;
    const LPParallel* par = s->par;
    int chunks = par->pp * par->vpp, p = par->pp, L = c->num_layers, lo[LP_MAX_CHUNKS], hi[LP_MAX_CHUNKS], most = 0, spare = L;
    char why[256];
    if (strcmp(par->partition, "balanced") != 0 || chunks > LP_MAX_CHUNKS ||
        lp_schedule_check(par->schedule, par->pp, par->vpp, par->micro_batches, why, sizeof(why)))
        return 0.0;
    double* flops = (double*)lp_host_malloc((size_t)chunks * (L + 1) * sizeof(double), "memory floor");
    int rising = 1;
    for (int k = 0; k < chunks; k++)
        for (int n = 0; n <= L; n++) {  // (as lp_pp_partition weighs them: only the end chunks may have no layers)
            double* x = &flops[k * (L + 1) + n];
            *x = n > 0 || k == 0 || k == chunks - 1 ? lp_chunk_flops(c, s, k, n) : INFINITY;
            rising &= n == 0 || *x >= x[-1] || (n == 1 && x[-1] == INFINITY);
        }
    double least = rising ? lp_plan_least_max(flops, chunks, L, hi) : INFINITY;
    free(flops);
    if (least == INFINITY) return 0.0;  // (no partition: lp_plan_one says why)
    for (int k = 0; k < chunks; k++) most += hi[k];
    double base[LP_MAX_CHUNKS], step[LP_MAX_CHUNKS], level = 0.0, top = 0.0;
    for (int r = 0; r < p; r++) base[r] = 0.0;
    for (int k = 0; k < chunks; k++) {
        lo[k] = L - (most - hi[k]);
        if (lo[k] < (k == 0 || k == chunks - 1 ? 0 : 1)) lo[k] = k == 0 || k == chunks - 1 ? 0 : 1;
        int slots = lp_chunk_slots(s, k);
        double at = lp_plan_memory(model, s, mach, k, lo[k], slots);
        base[k % p] += at;
        step[k] = INFINITY;
        for (int n = lo[k]; n < hi[k]; n++) {
            double next = lp_plan_memory(model, s, mach, k, n + 1, slots);
            step[k] = fmin(step[k], next - at);
            at = next;
        }
        if (step[k] < 0.0) return 0.0;
        spare -= lo[k];
        level = fmax(level, base[k % p]);
        if (hi[k] > lo[k]) top += (hi[k] - lo[k]) * step[k];
    }
    // the least level z at which the stages, each filling its chunks cheapest first up to z, take the spare layers
    int order[LP_MAX_CHUNKS];  // (the chunks by stage, each stage's cheapest first: an insertion sort)
    for (int k = 0; k < chunks; k++) {
        int at = k;
        for (; at > 0; at--) {
            int j = order[at - 1];
            if (j % p < k % p || (j % p == k % p && step[j] <= step[k])) break;
            order[at] = j;
        }
        order[at] = k;
    }
    top += level;
    for (int round = 0; round < 60 && spare > 0; round++) {
        double z = 0.5 * (level + top), taken = 0.0, budget = 0.0;
        for (int j = 0; j < chunks; j++) {
            int k = order[j];
            if (j == 0 || k % p != order[j - 1] % p) budget = z - base[k % p];
            if (hi[k] == lo[k]) continue;
            double room = hi[k] - lo[k], take = step[k] > 0.0 ? fmin(room, fmax(0.0, budget) / step[k]) : room;
            taken += take;
            budget -= take * step[k];
        }
        if (taken >= spare) top = z;
        else level = z;
    }
    return level;
}

// Estimate configuration s without its pipeline simulated (step_s: its busiest stage's work and step end):
// 0, *out and its partition layers[p v] filled if it can run (fitting or not).
static inline int lp_plan_one(const LPPlanModel* model, const LPPipeShape* s, const LPPlanMachine* mach, LPPlan* out, int* layers) {
    const LPConfig* c = &model->cfg;
    int chunks = s->par->pp * s->par->vpp;
    double stage_memory[LP_MAX_CHUNKS], stage_params[LP_MAX_CHUNKS], stage_busy[LP_MAX_CHUNKS], stage_bwd[LP_MAX_CHUNKS];
    char why[256];
    if (lp_pp_partition(c, s, layers, why, sizeof(why))) return 1;
    double m = s->par->micro_batches, memory = 0.0, params = 0.0, experts = 0.0, busy = 0.0, bwd = 0.0;
    LPChunkTime ct[LP_MAX_CHUNKS];
    int busiest = 0;
    for (int k = 0; k < chunks; k++) {  // chunk k runs on stage k % p
        int st = k % s->par->pp;
        double ex = 0.0;
        if (k < s->par->pp) stage_memory[st] = stage_params[st] = stage_busy[st] = stage_bwd[st] = 0.0;
        stage_memory[st] += lp_plan_memory(model, s, mach, k, layers[k], lp_chunk_slots(s, k));
        stage_params[st] += lp_plan_chunk_params(model, s, k, layers[k], &ex);
        ct[k] = lp_plan_chunk(model, s, mach, k, layers[k]);
        stage_busy[st] += m * (ct[k].fwd + ct[k].bwd);
        stage_bwd[st] += ct[k].bwd;
        memory = fmax(memory, stage_memory[st]);
        if (stage_params[st] > params) params = stage_params[st], experts = ex;
        if (stage_busy[st] > busy) busy = stage_busy[st], bwd = stage_bwd[st], busiest = st;
    }
    out->compute_s = out->tp_s = out->ep_s = out->cp_s = out->zero_s = 0.0;  // the busiest stage's totals over its chunks
    for (int k = busiest; k < chunks; k += s->par->pp)
        out->compute_s += m * ct[k].compute, out->tp_s += m * ct[k].tp, out->ep_s += m * ct[k].ep, out->cp_s += m * ct[k].cp,
            out->zero_s += m * ct[k].dp;
    out->estimated = 1;
    out->memory = memory;
    out->fits = memory <= mach->gpu_bytes;
    out->busy_s = busy;
    out->end_s = lp_plan_end(model, s, mach, params, experts, bwd, &out->host_memory);
    out->step_s = busy * (1.0 + lp_plan_straggle(mach, s->par->tp * s->par->cp * s->par->pp * s->par->dp)) + out->end_s;
    return 0;
}

// The pipelines one lp_plan has simulated: each row the inputs of a run (schedule, p, v, m, the sends' time, blocking,
// alone, each virtual stage's forward and backward cost) and its makespan. Configurations that differ only in what their
// chunks' costs do not hold (ZeRO 0 or 1, offload) run the same pipeline: found here by their inputs compared whole, so
// the makespan is the same bits as a run's.
typedef struct {
    int count, cap;
    double** rows;  // count rows of 7 + 2 chunks inputs, then the makespan
} LPPlanPipes;

static inline void lp_plan_pipes_free(LPPlanPipes* pipes) {
    for (int k = 0; k < pipes->count; k++) free(pipes->rows[k]);
    free(pipes->rows);
}

// The makespan of schedule `kind` (p stages, v chunks each, m micro-batches) whose virtual stage k's forward and backward
// take cost[k] and cost[p v + k], each message between stages `link` (mach: whether a send waits, a stage alone's pace);
// from *pipes when run before there (NULL: run it).
static inline double lp_plan_makespan(int kind, int p, int v, int m, const double* cost, double link, const LPPlanMachine* mach,
                                      LPPlanPipes* pipes) {
    int V = p * v, width = 7 + 2 * V;
    double key[7 + 2 * LP_MAX_CHUNKS] = {(double)kind, (double)p, (double)v, (double)m, link, (double)mach->blocking, mach->alone};
    memcpy(key + 7, cost, 2 * V * sizeof(double));
    for (int k = 0; pipes && k < pipes->count; k++)
        if (memcmp(pipes->rows[k], key, width * sizeof(double)) == 0)
            return pipes->rows[k][width];
    LPSimulation sim;
    char why[256];
    if (lp_schedule_lists(&sim, kind, p, v, m, 0.0, 0.0, cost, why, sizeof(why))) lp_fail("internal: plan %s", why);
    sim.link = link, sim.blocking = mach->blocking, sim.alone = mach->alone;
    if (lp_schedule_run(&sim, why, sizeof(why))) lp_fail("internal: plan %s", why);
    double makespan = sim.makespan;
    lp_simulation_free(&sim);
    if (pipes) {
        if (pipes->count == pipes->cap) {
            pipes->cap = pipes->cap ? 2 * pipes->cap : 64;
            pipes->rows = (double**)realloc(pipes->rows, pipes->cap * sizeof(double*));
            if (!pipes->rows) lp_fail("out of host memory for the plans");
        }
        double* row = (double*)lp_host_malloc((width + 1) * sizeof(double), "plans");
        memcpy(row, key, width * sizeof(double));
        row[width] = makespan;
        pipes->rows[pipes->count++] = row;
    }
    return makespan;
}

// A floor under the makespan of schedule `kind` (1F1B or interleaved 1F1B; costs, link and mach as lp_plan_makespan's),
// found without running it: stage s cannot start before the first micro-batch's forward has passed the virtual stages
// before it, then works its whole list, which ends with the backward of its first chunk (virtual stage s), after which
// that micro-batch's backward still passes the virtual stages before it. 0 where stages run faster alone (mach->alone > 1:
// a busy stage's work is no floor).
static inline double lp_plan_makespan_floor(int p, int v, int m, const double* cost, double link, const LPPlanMachine* mach) {
    int V = p * v;
    double floor = 0.0, before = 0.0;  // (before: the forwards and backwards of the virtual stages before stage s, and their sends)
    if (mach->alone > 1.0) return 0.0;
    for (int s = 0; s < p; s++) {
        double work = 0.0;
        for (int c = 0; c < v; c++) work += m * (cost[c * p + s] + cost[V + c * p + s]);
        floor = fmax(floor, before + work);
        before += cost[s] + cost[V + s] + 2.0 * link;
    }
    return floor;
}

// Simulate plan x's pipeline (the schedule's action lists, lp_plan_chunk's costs, messages between stages
// taking their time): its step, bubble, and the time its messages add (*sends, when not NULL: the same
// pipeline simulated without them). `partition`: its layers per chunk as lp_plan_one found them (NULL: found again).
// T: the whole sequence (a rank's share of it with context parallelism: T/cp). pipes: the pipelines run before
// (lp_plan_makespan; NULL: none). Returns 1; 0 where the step's floor (lp_plan_makespan_floor) is above `above` (x
// then stays unsimulated: it cannot be faster than that).
static inline int lp_plan_simulate(const LPPlanModel* model, int T, int attention, const LPPlanMachine* mach, LPPlan* x,
                                   const int* partition, double* sends, LPPlanPipes* pipes, double above) {
    const LPConfig* c = &model->cfg;
    const LPParallel* par = &x->par;
    LPPipeShape s = {par, x->B, T / par->cp, attention, !mach->gpu.fp32};
    int found[LP_MAX_CHUNKS], V = par->pp * par->vpp;
    const int* layers = partition ? partition : found;
    char why[256];
    if (!partition && lp_pp_partition(c, &s, found, why, sizeof(why))) lp_fail("internal: plan %s", why);
    double cost[2 * LP_MAX_CHUNKS], t = par->tp, X = mach->gpu.fp32 ? 4.0 : 2.0, N = (double)x->B * s.T;
    for (int k = 0; k < V; k++) {
        LPChunkTime ct = lp_plan_chunk(model, &s, mach, k, layers[k]);
        cost[k] = ct.fwd, cost[V + k] = ct.bwd;
    }
    // a boundary: B T C values, a TP rank's 1/t with scatter/gather (then all-gathered in the node) or SP
    double split = t > 1 && (par->sp || par->scatter_gather), bytes = N * c->channels * X / (split ? t : 1.0);
    double link = lp_send_seconds(mach, bytes, par->tp * par->cp * par->dp * par->pp);
    if (t > 1 && par->scatter_gather && !par->sp) link += lp_collective_seconds(mach, N * c->channels * X, 0, t, par->tp);
    double straggle = 1.0 + lp_plan_straggle(mach, par->tp * par->cp * par->pp * par->dp);
    // (the margin: the simulator's sums of times round otherwise than the floor's)
    if (lp_plan_makespan_floor(par->pp, par->vpp, par->micro_batches, cost, link, mach) * straggle + x->end_s > above * (1.0 + 1e-6)) return 0;
    double makespan = lp_plan_makespan(par->schedule, par->pp, par->vpp, par->micro_batches, cost, link, mach, pipes);
    x->bubble_s = makespan - x->busy_s;
    if (x->bubble_s < 1e-9 * makespan) x->bubble_s = 0.0;  // (0 within rounding when nothing waits)
    x->step_s = makespan * straggle + x->end_s;
    if (sends) {
        makespan = lp_plan_makespan(par->schedule, par->pp, par->vpp, par->micro_batches, cost, 0.0, mach, pipes);
        *sends = x->step_s - x->end_s - makespan;
        if (*sends < 1e-9 * makespan) *sends = 0.0;
    }
    x->simulated = 1;
    return 1;
}

// What a plan may not choose: the bits of `fixed` name the settings taken from `par` and B. A fixed
// scatter/gather (either way) also keeps SP off unless SP is fixed too: it chooses between the boundary's
// two forms without SP.
enum { LP_FIX_TP = 1, LP_FIX_PP = 2, LP_FIX_VPP = 4, LP_FIX_EP = 8, LP_FIX_ZERO = 16, LP_FIX_RECOMPUTE = 32, LP_FIX_OFFLOAD = 64,
       LP_FIX_SP = 128, LP_FIX_SG = 256, LP_FIX_B = 512, LP_FIX_CP = 1024 };
typedef struct {
    unsigned fixed;
    LPParallel par;
    int B;
} LPPlanLimits;

static inline const char* lp_software_refuses(const LPSoftware* sw, const LPParallel* par, unsigned fixed, char* why, size_t size) {
    const char* off = lp_offload_names[par->offload];
    if (fixed & LP_FIX_PP && par->pp > 1 && !sw->pp)
        snprintf(why, size, "%s %d: %s has no pipeline parallelism", LP_SETTING(pp), par->pp, sw->name);
    else if (fixed & LP_FIX_SP && par->sp && !sw->sp)
        snprintf(why, size, "%s: %s has no sequence parallelism", LP_SETTING(sp), sw->name);
    else if (fixed & LP_FIX_VPP && par->vpp > 1 && !sw->interleaved)
        snprintf(why, size, "%s %d: %s's pipeline does not interleave chunks", LP_SETTING(vpp), par->vpp, sw->name);
    else if (fixed & LP_FIX_RECOMPUTE && par->recompute == LP_RECOMPUTE_SELECTIVE && !sw->selective)
        snprintf(why, size, "%s selective: %s recomputes whole layers only (full)", LP_SETTING(recompute), sw->name);
    else if (fixed & LP_FIX_ZERO && par->zero > sw->zero)
        snprintf(why, size, "%s %d: %s has ZeRO up to stage %d", LP_SETTING(zero), par->zero, sw->name, sw->zero);
    else if (fixed & LP_FIX_ZERO && fixed & LP_FIX_PP && par->pp > 1 && par->zero > sw->zero_pp)
        snprintf(why, size, "%s %d with %s %d: %s combines ZeRO up to stage %d with a pipeline", LP_SETTING(zero), par->zero,
                 LP_SETTING(pp), par->pp, sw->name, sw->zero_pp);
    else if (fixed & LP_FIX_OFFLOAD && !(sw->offload & 1u << par->offload))
        snprintf(why, size, "%s %s: %s does not offload that", LP_SETTING(offload), off, sw->name);
    else if (fixed & LP_FIX_CP && par->cp > 1 && !sw->cp)
        snprintf(why, size, "%s %d: %s has no context parallelism", LP_SETTING(cp), par->cp, sw->name);
    else
        return NULL;
    return why;
}

// The best MFU published for dense bf16 training on a GPU (model FLOPs, recomputation not counted), whatever the
// software: A100 56.3% (Korthikanti et al. 2022, Table 5: the 1T model, selective recomputation, 512 GPUs), H100
// 48% (Megatron-LM's README, "Training Speed and Scalability": 47-48% for its largest weak-scaled models, up to
// 6,144 H100s). No other GPU has one here.
static const struct { const char* gpu; double mfu; } lp_published_mfu[] = {{"a100", 0.563}, {"h100", 0.48}};

// Where plan x (n GPUs, sequences of T, at MFU mfu) lies outside what its software's calibration covers: the
// reasons, comma-separated, into why (empty when inside); returns how many. gpu: not the GPU it was calibrated
// on; gpus: more GPUs than its largest calibrated run; T: longer sequences; zero3>1k: ZeRO-3 over more than 1,000
// ranks (the PTD-P paper's ZeRO-3 runs at 1,536 and 2,240 GPUs came 1.3-1.5x slower than this model prices them);
// mfu: above the best published for that GPU (lp_published_mfu), or none published; shape: not GPT-2's blocks (every
// calibration ran them; GQA and SwiGLU are counted, not measured); cp: context parallelism (its ring is priced from the
// engine's algorithm, never timed against a run); experts: a mixture of experts (no calibration ran one).
static inline int lp_plan_outside(const LPPlanModel* model, const LPPlanMachine* mach, int T, int n, const LPPlan* x, double mfu, char* why,
                                  size_t size) {
    const LPSoftware* sw = mach->software;
    double best = 0.0;
    for (size_t k = 0; k < sizeof(lp_published_mfu) / sizeof(lp_published_mfu[0]); k++)
        if (strcmp(lp_published_mfu[k].gpu, mach->gpu.name) == 0) best = lp_published_mfu[k].mfu;
    const char* tag[8] = {"gpu", "gpus", "T", "zero3>1k", "mfu", "shape", "cp", "experts"};
    char name[32];
    snprintf(name, sizeof(name), " %s ", mach->gpu.name);
    char calibrated[64];
    snprintf(calibrated, sizeof(calibrated), " %s ", sw->calibrated_gpu);
    int out[8] = {!strstr(calibrated, name), n > sw->calibrated_gpus, T > sw->calibrated_T,
                  x->par.zero == 3 && x->par.dp * x->par.cp > 1000, mfu > best, !lp_plan_model_is_gpt(model), x->par.cp > 1,
                  model->cfg.moe_experts > 0}, count = 0;
    why[0] = '\0';
    for (int k = 0; k < 8; k++)
        if (out[k]) snprintf(why + strlen(why), size - strlen(why), "%s%s", count++ ? "," : "", tag[k]);
    return count;
}

// Add configuration s (s->T: a rank's share of a sequence, T/cp) to the n plans in *plans (room for *cap, grown as
// needed), with its bound.
static inline void lp_plan_add(const LPPlanModel* model, const LPPipeShape* s, const LPPlanMachine* mach, LPPlan** plans, int* n, int* cap) {
    const LPConfig* c = &model->cfg;
    if (*n == *cap) {
        *cap *= 2;
        *plans = (LPPlan*)realloc(*plans, *cap * sizeof(LPPlan));
        if (!*plans) lp_fail("out of host memory for the plans");
    }
    LPPlan* x = &(*plans)[(*n)++];
    memset(x, 0, sizeof(*x));
    x->par = *s->par;
    x->B = s->B;
    x->step_s = lp_plan_bound(model, s, mach);
    int T = s->T * s->par->cp;
    x->flops = (double)s->par->micro_batches * s->par->dp * s->B * T *
               (c->num_layers * lp_plan_layer_flops(model, T, s->par->recompute, mach->recompute_all) +
                6.0 * c->padded_vocab_size * c->channels);
}

// Every configuration of n GPUs with the given attention path (LP_ATTENTION_*) and limits (NULL: none)
// into *plans (malloc'd), those that fit first, fastest first; returns how many. In the order of their
// bounds each is estimated and, if it fits, simulated, until a bound passes the `shown`-th fastest step
// simulated: no configuration after it could be among the fastest `shown` (they stay bounded, unestimated).
// One whose memory floor is above the GPU's is not partitioned (floored: it cannot fit). With none fitting every
// one is estimated, the floored too (the least memory is known).
static inline int lp_plan(const LPPlanModel* model, int T, long long tokens, int n, int attention, const LPPlanMachine* mach,
                          const LPPlanLimits* limits, int shown, LPPlan** plans) {
    const LPConfig* c = &model->cfg;
    int count = 0, cap = 64;
    unsigned fix = limits ? limits->fixed : 0;
    const LPParallel* want = limits ? &limits->par : &lp_parallel_one;
    *plans = (LPPlan*)lp_host_malloc(cap * sizeof(LPPlan), "plans");
    char why[256];
    for (int t = 1; t <= n; t++) {  // (a TP group inside a node, or whole nodes over the network: never a straddle)
        if (n % t || (mach->gpus_per_node % t && t % mach->gpus_per_node) || lp_tp_check(c, t, why, sizeof(why)) ||
            (fix & LP_FIX_TP && t != want->tp))
            continue;
        for (int p = 1; p <= n / t && p <= c->num_layers; p++) {
            if (n / t % p || (fix & LP_FIX_PP && p != want->pp) || (c->moe_experts && p > 1 && mach->software->moe < 2)) continue;
            for (int cp = 1; cp <= n / t / p; cp++) {  // (context parallelism: T in 2 cp chunks, where the software has it)
                if (n / t / p % cp || (cp > 1 && (!mach->software->cp || T % (2 * cp))) || (fix & LP_FIX_CP && cp != want->cp))
                    continue;
                int d = n / t / p / cp, Tc = T / cp;  // (a rank's share of each sequence)
                for (long long B = 1; B * T * d <= tokens && B <= 4096; B *= 2) {
                    if (tokens % (B * T * d) || (fix & LP_FIX_B && B != limits->B)) continue;
                    // (B and cp sharing a factor g, here 2: cp/g ranks with B/g sequences run the same rows on a shorter ring, never
                    // slower nor fuller; cp 1 where cp divides B)
                    if (cp % 2 == 0 && B > 1 && !(fix & (LP_FIX_CP | LP_FIX_B))) continue;
                    int m = (int)(tokens / (B * T * d));
                    for (int v = 1; v <= (p > 1 ? 8 : 1); v++)
                        for (int sp = 0; sp <= (t > 1 && Tc % t == 0); sp++)
                            for (int sg = 0; sg <= (t > 1 && p > 1 && !sp); sg++)
                                for (int zero = 0; zero <= 3; zero++)
                                    for (int r = LP_RECOMPUTE_NONE; r <= LP_RECOMPUTE_FULL; r++)
                                        for (int off = LP_OFFLOAD_NONE; off <= LP_OFFLOAD_PARAMS; off++)
                                            for (int ep = 1; ep <= (c->moe_experts ? d : 1); ep++) {  // (a mixture of experts: every ep)
                                                if (d % ep || (c->moe_experts && c->moe_experts % ep)) continue;
                                                if (off == LP_OFFLOAD_PARAMS ? zero < 3 : d * cp == 1 && zero > 0) continue;  // (one rank a shard: ZeRO-3 only to offload params)
                                                if ((fix & LP_FIX_VPP && v != want->vpp) || (fix & LP_FIX_SP && sp != want->sp) ||
                                                    (fix & LP_FIX_SG && (sg != want->scatter_gather || (sp && !(fix & LP_FIX_SP)))) ||
                                                    (fix & LP_FIX_ZERO && zero != want->zero) || (fix & LP_FIX_RECOMPUTE && r != want->recompute) ||
                                                    (fix & LP_FIX_OFFLOAD && off != want->offload) || (fix & LP_FIX_EP && ep != want->ep))
                                                    continue;
                                                if (v > 1 && c->num_layers < p * v) continue;
                                                LPParallel x = lp_parallel_one;
                                                x.tp = t, x.pp = p, x.cp = cp, x.dp = d, x.ep = ep, x.vpp = v, x.micro_batches = m, x.zero = zero;
                                                x.recompute = r;
                                                x.offload = off, x.sp = sp, x.scatter_gather = sg;
                                                x.overlap = want->overlap && (p == 1 || mach->software->pp_overlap);
                                                if (lp_software_refuses(mach->software, &x, ~0u, why, sizeof(why))) continue;
                                                x.schedule = v > 1 ? LP_SCHEDULE_INTERLEAVED : LP_SCHEDULE_1F1B;
                                                LPPipeShape s = {&x, (int)B, Tc, attention, !mach->gpu.fp32};
                                                lp_plan_add(model, &s, mach, plans, &count, &cap);
                                            }
                }
            }
        }
    }
    qsort(*plans, count, sizeof(LPPlan), lp_plan_order);  // (by bound: none is estimated yet)
    int layers[LP_MAX_CHUNKS];  // (the partition of the configuration estimated last)
    double* best = (double*)lp_host_malloc((size_t)(shown > 0 ? shown : 1) * sizeof(double), "plans");  // ascending
    int have = 0, fitting = 0;
    LPPlanPipes pipes = {0, 0, NULL};
    for (int k = 0; k < count; k++) {
        LPPlan* x = &(*plans)[k];
        if (shown > 0 && have == shown && x->step_s >= best[shown - 1]) break;  // (its bound, and every later one, cannot enter)
        LPPipeShape s = {&x->par, x->B, T / x->par.cp, attention, !mach->gpu.fp32};
        double least_bytes = lp_plan_memory_floor(model, &s, mach);
        if (least_bytes > mach->gpu_bytes * (1.0 + 1e-9)) {  // (it cannot fit: not partitioned, unless none fits; the margin: rounding)
            x->estimated = x->floored = 1, x->memory = least_bytes;
            continue;
        }
        if (lp_plan_one(model, &s, mach, x, layers)) x->B = 0;  // (it cannot run: dropped below)
        fitting += x->fits;
        if (!x->fits || shown <= 0) continue;
        if (!lp_plan_simulate(model, T, attention, mach, x, layers, NULL, &pipes, have == shown ? best[shown - 1] : INFINITY)) continue;
        if (have < shown) have++;
        else if (x->step_s >= best[shown - 1]) continue;
        int at = have - 1;
        while (at > 0 && best[at - 1] > x->step_s) best[at] = best[at - 1], at--;
        best[at] = x->step_s;
    }
    free(best);
    lp_plan_pipes_free(&pipes);
    for (int k = 0; k < count && !fitting; k++) {  // (none fits: the least memory is known exactly)
        LPPlan* x = &(*plans)[k];
        LPPipeShape s = {&x->par, x->B, T / x->par.cp, attention, !mach->gpu.fp32};
        if (x->floored && lp_plan_one(model, &s, mach, x, layers)) x->B = 0;
        x->floored = 0;
    }
    int kept = 0;
    for (int k = 0; k < count; k++)
        if ((*plans)[k].B) (*plans)[kept++] = (*plans)[k];
    qsort(*plans, kept, sizeof(LPPlan), lp_plan_order);
    return kept;
}


#endif  // LLMPAR_PLAN_H
