/*
dev/plan/plan_gpt.c: the cluster planner's program. `make plan_gpt && ./plan_gpt --plan 8 -e d12 -t 1024
-d 524288` prints every way to train the model on 8 GPUs of a cluster that fits a GPU, fastest first by a
simulated step, and the train_gpt command that runs the fastest. The planner is dev/plan/plan.h; the model
shapes, costs and schedules it weighs are the engine's own (llmpar.h). One build, plain C: it plans GPUs
(memory as the CUDA build keeps it) whatever machine it runs on. -h lists the flags.
*/
#define LLMPAR_IMPLEMENTATION  // this program's one file
#include "../../llmpar.h"
#include "plan.h"

// What the flags say. The model and grid flags are train_gpt's (the same names and meanings); a grid
// setting typed is kept, the others are searched.
typedef struct {
    int plan;                 // --plan N: GPUs
    const char* init;         // -e
    int B, T, total_batch;    // -b, -t, -d
    LPParallel par;           // --tp --pp --vpp --ep --cp --sp --pp-scatter-gather --zero --recompute --offload --overlap
    int attention;            // --attention
    int moe_experts, moe_topk, moe_every;
    int kv_heads, ffn, swiglu;  // a modern block: --kv-heads (GQA), --ffn, --swiglu
    const char* cluster;      // the machine: --cluster's preset (lp_clusters), changed by the flags below
    const char* gpu;          // --gpu (lp_gpus; "": the cluster's)
    float gpu_mem, gpu_tflops, gpu_gbs;
    int node_gpus;
    float node_gbs, net_gbs, latency_us, jitter;
    const char* software;     // --software (lp_softwares)
    float gemm_share, attention_tile_k, train_tokens;
    unsigned char given[64];  // given[k]: row k of lp_plan_flags was typed
} LPPlanFlags;

typedef enum { LP_PF_INT, LP_PF_FLOAT, LP_PF_STRING, LP_PF_SWITCH, LP_PF_CHOICE } LPPlanFlagType;
typedef struct {
    const char* name;
    LPPlanFlagType type;
    size_t field;                // offsetof(LPPlanFlags, ...)
    const char* value;           // the default, as typed (NULL: a switch, off)
    const char* const* choices;  // LP_PF_CHOICE: the names it takes
    const char* help;
} LPPlanFlag;

#define LP_PF(x) offsetof(LPPlanFlags, x)
static const LPPlanFlag lp_plan_flags[] = {
    {"--plan", LP_PF_INT, LP_PF(plan), NULL, NULL, "N: the number of GPUs to plan for, 1 .. 1048576 (needed)"},
    {"-e", LP_PF_STRING, LP_PF(init), "d12", NULL,
     "the model, as train_gpt's -e: an llm.c model file (GPT-2's or Llama 3's), dN (GPT-2 of depth N), L,C,NH[,V] or "
     "llama:L,C,NH,KV[,V] (the Llama family: RoPE, RMSNorm, SwiGLU, GQA, untied head) (here V up to 262144, and -t up to "
     "131072); or llama3-8b, llama3-70b, llama3-405b (Llama 3's shapes)"},
    {"-t", LP_PF_INT, LP_PF(T), "1024", NULL, "sequence length"},
    {"-d", LP_PF_INT, LP_PF(total_batch), "0", NULL, "tokens per optimizer step (0: -b * -t * N)"},
    {"-b", LP_PF_INT, LP_PF(B), "16", NULL, "micro-batch size: kept when typed"},
    {"--tp", LP_PF_INT, LP_PF(par.tp), "1", NULL, "tensor-parallel size: kept when typed"},
    {"--pp", LP_PF_INT, LP_PF(par.pp), "1", NULL, "pipeline stages: kept when typed"},
    {"--vpp", LP_PF_INT, LP_PF(par.vpp), "1", NULL, "model chunks per stage (interleaved 1F1B): kept when typed"},
    {"--ep", LP_PF_INT, LP_PF(par.ep), "1", NULL, "expert parallelism (a mixture of experts): kept when typed"},
    {"--cp", LP_PF_INT, LP_PF(par.cp), "1", NULL,
     "context parallelism: each sequence split over N ranks in 2N chunks, attention a ring (--software llmpar): kept when typed"},
    {"--sp", LP_PF_SWITCH, LP_PF(par.sp), NULL, NULL, "sequence parallelism: kept when typed"},
    {"--pp-scatter-gather", LP_PF_INT, LP_PF(par.scatter_gather), "1", NULL, "0 or 1, as train_gpt's: kept when typed (with SP off)"},
    {"--zero", LP_PF_INT, LP_PF(par.zero), "0", NULL, "ZeRO stage 0..3: kept when typed"},
    {"--recompute", LP_PF_CHOICE, LP_PF(par.recompute), "none", lp_recompute_names, "none | selective | full: kept when typed"},
    {"--offload", LP_PF_CHOICE, LP_PF(par.offload), "none", lp_offload_names, "none | optimizer | params | nvme: kept when typed"},
    {"--overlap", LP_PF_INT, LP_PF(par.overlap), "1", NULL, "1: gradient reductions overlapped with backward, as train_gpt's"},
    {"--attention", LP_PF_CHOICE, LP_PF(attention), "flash", lp_attention_names, "flash | cublas, as train_gpt's"},
    {"--moe-experts", LP_PF_INT, LP_PF(moe_experts), "0", NULL, "with -e dN: a mixture of E experts per MoE layer (0: dense)"},
    {"--moe-topk", LP_PF_INT, LP_PF(moe_topk), "2", NULL, "with --moe-experts: experts per token"},
    {"--moe-every", LP_PF_INT, LP_PF(moe_every), "1", NULL, "with --moe-experts: every N-th layer is a MoE layer"},
    {"--kv-heads", LP_PF_INT, LP_PF(kv_heads), "0", NULL,
     "with -e L,C,NH[,V]: grouped-query attention's key/value heads, dividing NH (0: NH, every head its own)"},
    {"--ffn", LP_PF_INT, LP_PF(ffn), "0", NULL, "with -e L,C,NH[,V]: the MLP's hidden width (0: 4 C, GPT-2's)"},
    {"--swiglu", LP_PF_SWITCH, LP_PF(swiglu), NULL, NULL, "with -e L,C,NH[,V]: a gated MLP (SwiGLU: two up projections to --ffn)"},
    {"--cluster", LP_PF_STRING, LP_PF(cluster), "dgx-h100", NULL,
     "dgx-a100 (the PTD-P paper's Selene), dgx-h100, nvl72 (GB200 NVL72) or cpu (2 cores under 4 ranks of the CPU "
     "engine: the plan's calibration); the flags below change it"},
    {"--gpu", LP_PF_STRING, LP_PF(gpu), "", NULL, "a100, h100, h200, b200, gb200 or cpu (\"\": the cluster's)"},
    {"--gpu-mem", LP_PF_FLOAT, LP_PF(gpu_mem), "0", NULL, "GiB per GPU (0: the GPU's; plans use 90% of it)"},
    {"--gpu-tflops", LP_PF_FLOAT, LP_PF(gpu_tflops), "0", NULL,
     "the GPU's dense peak, TFLOP/s (bf16; on cpu the rank's share of sgemm's rate) (0: the GPU's)"},
    {"--gpu-gbs", LP_PF_FLOAT, LP_PF(gpu_gbs), "0", NULL,
     "the GPU's memory bandwidth, GB/s (on cpu the rank's share of the memory's) (0: the GPU's)"},
    {"--node-gpus", LP_PF_INT, LP_PF(node_gpus), "0", NULL, "GPUs per node, on one NVLink domain (0: the cluster's)"},
    {"--node-gbs", LP_PF_FLOAT, LP_PF(node_gbs), "0", NULL, "GB/s per GPU inside a node, NCCL's bus bandwidth (0: the cluster's)"},
    {"--net-gbs", LP_PF_FLOAT, LP_PF(net_gbs), "0", NULL, "GB/s per GPU between nodes (0: the cluster's ports shared by a node's GPUs)"},
    {"--latency-us", LP_PF_FLOAT, LP_PF(latency_us), "0", NULL,
     "microseconds each collective or send takes beyond its bytes: added to NCCL's ring latencies on a GPU cluster, all "
     "of MPI's on cpu (0: the cluster's)"},
    {"--jitter", LP_PF_FLOAT, LP_PF(jitter), "0", NULL,
     "stragglers: the coefficient of variation of a rank's work in a step, e.g. 0.01; a step waits for the slowest of its N "
     "ranks, jitter x sqrt(2 ln N) above the mean (0: none)"},
    {"--software", LP_PF_STRING, LP_PF(software), "llmpar", NULL,
     "what runs the step, described (dev/plan/README.md): llmpar (this engine), megatron (Megatron-LM 2022: SP, "
     "interleaving, selective recomputation, ZeRO-1, no offload), megatron-2021 (the PTD-P paper's: none of SP, selective "
     "recomputation or ZeRO) or deepspeed (Megatron-DeepSpeed: ZeRO 1-3, 1 with a pipeline, offload, plain 1F1B, experts without a pipeline): only grids "
     "it can run, its memory as it keeps it"},
    {"--gemm-share", LP_PF_FLOAT, LP_PF(gemm_share), "0", NULL,
     "the share of the GPU's peak its fastest GEMMs reach (0: the GPU's measured best times the software's)"},
    {"--attention-tile-k", LP_PF_FLOAT, LP_PF(attention_tile_k), "-1", NULL,
     "with --attention cublas, a fixed cost per 128 x 128 output tile of attention's batched products, in steps of "
     "their inner dimension (-1: the software's; megatron's is fitted with its GEMM share)"},
    {"--train-tokens", LP_PF_FLOAT, LP_PF(train_tokens), "0", NULL,
     "also the days the fastest takes to train F tokens (e.g. 300e9), and 8TP/(nX) beside them"},
};
#define LP_NUM_PLAN_FLAGS (int)(sizeof(lp_plan_flags) / sizeof(lp_plan_flags[0]))

static const LPPlanFlag* lp_plan_flag_of(size_t field) {
    for (int k = 0; k < LP_NUM_PLAN_FLAGS; k++)
        if (lp_plan_flags[k].field == field) return &lp_plan_flags[k];
    lp_fail("no flag sets field %zu of LPPlanFlags", field);
    return NULL;
}
#define LP_PLAN_FLAG(x) lp_plan_flag_of(offsetof(LPPlanFlags, x))->name

// The header names a parallel setting by its LPParallel field; here, by the flag that sets it.
static const char* lp_plan_setting_flag(size_t offset) {
    for (int k = 0; k < LP_NUM_PLAN_FLAGS; k++)
        if (lp_plan_flags[k].field == offsetof(LPPlanFlags, par) + offset) return lp_plan_flags[k].name;
    return NULL;
}

static void lp_plan_usage(void) {
    lp_log("usage: plan_gpt --plan N [flags]\n"
           "The ways to train -e with -t and -d tokens per step on N GPUs of --cluster (t x p x cp x d grid, interleaving, SP,\n"
           "scatter/gather, ZeRO stage, recomputation, offload, ep, -b; those typed are kept) that fit a GPU, fastest first by\n"
           "a simulated step; the fastest's MFU, bubble and exposed communication; the train_gpt command that runs it.\n"
           "Defaults in brackets.\n");
    for (int k = 0; k < LP_NUM_PLAN_FLAGS; k++) {
        const LPPlanFlag* s = &lp_plan_flags[k];
        lp_log("  %-20s %s", s->name, s->help);
        if (s->value) lp_log(" [%s]", s->value[0] ? s->value : "none");
        lp_log("\n");
    }
}

// Stores v in s's field of f.
static void lp_plan_flag_set(LPPlanFlags* f, const LPPlanFlag* s, const char* v) {
    char* p = (char*)f + s->field;
    char* end = NULL;
    switch (s->type) {
    case LP_PF_INT: {
        long x = strtol(v, &end, 10);
        if (*v == '\0' || *end != '\0' || x < -2147483647L || x > 2147483647L) lp_fail("flag %s: '%s' is not an integer", s->name, v);
        *(int*)p = (int)x;
        break;
    }
    case LP_PF_FLOAT:
        *(float*)p = strtof(v, &end);
        if (*v == '\0' || *end != '\0' || !isfinite(*(float*)p)) lp_fail("flag %s: '%s' is not a number", s->name, v);
        break;
    case LP_PF_STRING: *(const char**)p = v; break;
    case LP_PF_SWITCH: *(int*)p = 1; break;
    case LP_PF_CHOICE: {
        int k = 0;
        while (s->choices[k] && strcmp(v, s->choices[k]) != 0) k++;
        *(int*)p = k;
        if (s->choices[k]) break;
        char names[256];
        lp_fail("flag %s: must be %s, got '%s'", s->name, lp_names_text(names, sizeof(names), s->choices), v);
    }
    }
}

// Returns 0 when -h was given.
static int lp_plan_parse(LPPlanFlags* f, int argc, char** argv) {
    memset(f, 0, sizeof(*f));
    f->par = lp_parallel_one;
    for (int k = 0; k < LP_NUM_PLAN_FLAGS; k++)
        if (lp_plan_flags[k].value) lp_plan_flag_set(f, &lp_plan_flags[k], lp_plan_flags[k].value);
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) return 0;
        int k = 0;
        while (k < LP_NUM_PLAN_FLAGS && strcmp(a, lp_plan_flags[k].name) != 0) k++;
        if (k == LP_NUM_PLAN_FLAGS) lp_fail("unknown flag %s (see -h; training's flags are train_gpt's)", a);
        const char* v = NULL;
        if (lp_plan_flags[k].type != LP_PF_SWITCH) {
            if (i + 1 >= argc) lp_fail("flag %s needs a value", a);
            v = argv[++i];
        }
        lp_plan_flag_set(f, &lp_plan_flags[k], v);
        f->given[k] = 1;
    }
    if (f->plan < 1 || f->plan > 1 << 20)
        lp_fail("flag %s: the number of GPUs must be 1 .. %d, got %d", LP_PLAN_FLAG(plan), 1 << 20, f->plan);
    if (f->B < 1 || f->T < 1 || f->total_batch < 0)
        lp_fail("flags %s %s %s: -b and -t must be >= 1, -d >= 0, got %d, %d, %d", LP_PLAN_FLAG(B), LP_PLAN_FLAG(T),
                LP_PLAN_FLAG(total_batch), f->B, f->T, f->total_batch);
    if (f->par.tp < 1 || f->par.pp < 1 || f->par.vpp < 1 || f->par.ep < 1 || f->par.zero < 0 || f->par.zero > 3)
        lp_fail("flags %s %s %s %s must be >= 1 and %s 0..3", LP_PLAN_FLAG(par.tp), LP_PLAN_FLAG(par.pp), LP_PLAN_FLAG(par.vpp),
                LP_PLAN_FLAG(par.ep), LP_PLAN_FLAG(par.zero));
    if (f->par.cp < 1 || (f->par.cp > 1 && f->T % (2 * f->par.cp)))
        lp_fail("flag %s %d: must be >= 1, and the sequence length %s %d split into 2*%d = %d chunks of equal length", LP_PLAN_FLAG(par.cp),
                f->par.cp, LP_PLAN_FLAG(T), f->T, f->par.cp, 2 * f->par.cp);
    if (f->gpu_mem < 0.0f || f->gpu_tflops < 0.0f || f->gpu_gbs < 0.0f || f->node_gpus < 0 || f->node_gbs < 0.0f || f->net_gbs < 0.0f ||
        f->latency_us < 0.0f || f->train_tokens < 0.0f || f->jitter < 0.0f)
        lp_fail("flags %s %s %s %s %s %s %s %s %s must not be negative (0: the cluster's)", LP_PLAN_FLAG(gpu_mem), LP_PLAN_FLAG(gpu_tflops),
                LP_PLAN_FLAG(gpu_gbs), LP_PLAN_FLAG(node_gpus), LP_PLAN_FLAG(node_gbs), LP_PLAN_FLAG(net_gbs), LP_PLAN_FLAG(latency_us),
                LP_PLAN_FLAG(train_tokens), LP_PLAN_FLAG(jitter));
    if (f->attention_tile_k < 0.0f && f->attention_tile_k != -1.0f)
        lp_fail("flag %s: steps of the inner dimension, >= 0 (-1: the software's), got %g", LP_PLAN_FLAG(attention_tile_k),
                f->attention_tile_k);
    if (!(f->gemm_share >= 0.0f && f->gemm_share <= 1.0f))
        lp_fail("flag %s: a share of the GPU's peak, 0 .. 1 (0: the GPU's best times the software's), got %g", LP_PLAN_FLAG(gemm_share),
                f->gemm_share);
    return 1;
}

// Llama 3's shapes (Grattafiori et al. 2024, arXiv 2407.21783, Table 3) as the engine's Llama family: L, C, NH, KV
// heads, V; SwiGLU's width from Meta's params.json (ffn_dim_multiplier, multiple_of: 14336, 28672, 53248).
static const struct { const char* name; const char* shape; float ffn_dim_multiplier; int multiple_of; } lp_plan_llamas[] = {
    {"llama3-8b", "llama:32,4096,32,8,128256", 1.3f, 1024}, {"llama3-70b", "llama:80,8192,64,8,128256", 1.3f, 4096},
    {"llama3-405b", "llama:126,16384,128,8,128256", 1.2f, 4096}};

// The model's shape from -e: a dN preset (with --moe-experts, a mixture of experts), L,C,NH[,V] (with --kv-heads, --ffn,
// --swiglu, the planner's own modern block), llama:... (the engine's Llama family), a Llama 3 preset, or an llm.c file's
// header. *engine_e: whether train_gpt takes -e as typed (not a preset's name).
static void lp_plan_model(const LPPlanFlags* f, LPPlanModel* model, int* engine_e) {
    char source[LP_PATH_MAX];
    LPConfig* cfg = &model->cfg;
    const char* init = f->init;
    int kv = f->kv_heads, ffn = f->ffn, swiglu = f->swiglu, modern = kv || ffn || swiglu, preset = -1;
    for (size_t k = 0; k < sizeof(lp_plan_llamas) / sizeof(lp_plan_llamas[0]); k++)
        if (strcmp(f->init, lp_plan_llamas[k].name) == 0) init = lp_plan_llamas[k].shape, preset = (int)k;
    *engine_e = preset < 0;
    lp_path(source, "-e %s", f->init);
    if (lp_config_from_name(cfg, init)) {
        if (preset >= 0) cfg->ffn_dim_multiplier = lp_plan_llamas[preset].ffn_dim_multiplier, cfg->multiple_of = lp_plan_llamas[preset].multiple_of;
        if (modern && !lp_config_is_gpt2(cfg))
            lp_fail("flags --kv-heads --ffn --swiglu: -e %s has its own (%d, %d, SwiGLU)", f->init, lp_kv_heads(cfg), lp_ffn_hidden(cfg));
        if (f->moe_experts) {
            if (modern) lp_fail("flag --moe-experts: the planner's experts are GPT-2's MLPs, not with --kv-heads, --ffn or --swiglu");
            cfg->moe_experts = f->moe_experts;
            cfg->moe_topk = f->moe_topk;
            cfg->moe_every = f->moe_every;
            lp_path(source, "-e %s --moe-experts %d --moe-topk %d --moe-every %d", f->init, f->moe_experts, f->moe_topk, f->moe_every);
        }
        // the planner reads no token shards: vocabularies past uint16's 65,536 up to 262,144 (the checks but that one are
        // the engine's); a shape of numbers takes -t up to 131,072, its position table as long
        LPConfig shards = *cfg;
        if (cfg->vocab_size > 262144) lp_fail("%s: vocabulary %d, the planner takes up to 262144", source, cfg->vocab_size);
        shards.vocab_size = shards.padded_vocab_size = cfg->vocab_size < 65536 ? cfg->vocab_size : 65536;
        const char* numbers = strncmp(init, "llama:", 6) == 0 ? init + 6 : init;
        if (numbers[0] >= '0' && numbers[0] <= '9' && f->T > cfg->max_seq_len && f->T <= 131072) cfg->max_seq_len = shards.max_seq_len = f->T;
        lp_config_validate(&shards, source);
        *model = lp_plan_model_of(cfg);
        if (kv < 0 || kv > cfg->num_heads || (kv && cfg->num_heads % kv) || ffn < 0)
            lp_fail("flags --kv-heads %d --ffn %d: key/value heads must divide the %d heads, the width be >= 0", kv, ffn, cfg->num_heads);
        if (kv) model->kv_heads = kv;
        if (ffn) model->ffn = ffn;
        if (modern) model->swiglu = swiglu;
        return;
    }
    if (modern) lp_fail("flags --kv-heads --ffn --swiglu: for -e L,C,NH[,V] shapes, not the model file %s", f->init);
    FILE* file = lp_fopen(f->init, "rb");
    lp_model_file_header(f->init, cfg, file);
    fclose(file);
    if (f->moe_experts && f->moe_experts != cfg->moe_experts)
        lp_fail("flag --moe-experts %d: %s has %d experts per MoE layer (a model file's shape is its own)", f->moe_experts, f->init,
                cfg->moe_experts);
    *model = lp_plan_model_of(cfg);
}

// The machine: --cluster's preset running --software, with --gpu, --gpu-mem, --gpu-tflops, --gpu-gbs,
// --gemm-share, --attention-tile-k, --node-gpus, --node-gbs, --net-gbs and --latency-us over it.
static LPPlanMachine lp_plan_flags_machine(const LPPlanFlags* f, const LPCluster** cluster) {
    char names[256] = "";
    const LPCluster* k = *cluster = lp_cluster_named(f->cluster);
    for (size_t j = 0; j < sizeof(lp_clusters) / sizeof(lp_clusters[0]); j++)
        snprintf(names + strlen(names), sizeof(names) - strlen(names), "%s%s", j ? ", " : "", lp_clusters[j].name);
    if (!k) lp_fail("flag %s: no cluster '%s' (%s)", LP_PLAN_FLAG(cluster), f->cluster, names);
    const LPSoftware* sw = lp_software_named(f->software);
    names[0] = '\0';
    for (size_t j = 0; j < sizeof(lp_softwares) / sizeof(lp_softwares[0]); j++)
        snprintf(names + strlen(names), sizeof(names) - strlen(names), "%s%s", j ? ", " : "", lp_softwares[j].name);
    if (!sw) lp_fail("flag %s: no software '%s' (%s)", LP_PLAN_FLAG(software), f->software, names);
    const LPGpu* g = NULL;  // (the cluster's)
    if (f->gpu[0]) {
        g = lp_gpu_named(f->gpu);
        names[0] = '\0';
        for (size_t j = 0; j < sizeof(lp_gpus) / sizeof(lp_gpus[0]); j++)
            snprintf(names + strlen(names), sizeof(names) - strlen(names), "%s%s", j ? ", " : "", lp_gpus[j].name);
        if (!g) lp_fail("flag %s: no GPU '%s' (%s)", LP_PLAN_FLAG(gpu), f->gpu, names);
    }
    LPPlanMachine mach = lp_plan_machine(k, g, sw);
    if (f->gemm_share > 0.0f) mach.gpu.gemm = f->gemm_share;
    if (f->attention_tile_k >= 0.0f) mach.attention_tile_k = f->attention_tile_k;
    if (f->gpu_mem > 0.0f) mach.gpu_bytes = 0.9 * f->gpu_mem * 1073741824.0;
    if (f->gpu_tflops > 0.0f) mach.gpu.peak_flops = f->gpu_tflops * 1e12;
    if (f->gpu_gbs > 0.0f) mach.gpu.hbm_bw = f->gpu_gbs * 1e9;
    if (f->node_gpus > 0) mach.gpus_per_node = f->node_gpus;
    if (f->node_gbs > 0.0f) mach.node_bw = f->node_gbs * 1e9;
    if (f->net_gbs > 0.0f) mach.net_bw = f->net_gbs * 1e9;
    if (f->latency_us > 0.0f) mach.latency = f->latency_us * 1e-6;
    mach.jitter = f->jitter;
    return mach;
}

// --plan N: every way to train the -e model on N GPUs of the machine with -t and -d tokens per step (the
// grid settings typed kept), those that fit first, fastest first (lp_plan: each step simulated), what the
// fastest achieves, and the command that runs it.
static void lp_print_plan(const LPPlanFlags* f) {
    LPPlanModel model;
    int engine_e;
    lp_plan_model(f, &model, &engine_e);
    const LPConfig cfg = model.cfg;
    int n = f->plan;
    if (f->T > cfg.max_seq_len) lp_fail("flag -t: sequence length %d exceeds the model's maximum %d", f->T, cfg.max_seq_len);
    long long tokens = f->total_batch ? f->total_batch : (long long)f->B * f->T * n;
    const LPCluster* cluster;
    LPPlanMachine mach = lp_plan_flags_machine(f, &cluster);
    struct { size_t field; unsigned bit; } kept[] = {
        {LP_PF(par.tp), LP_FIX_TP}, {LP_PF(par.pp), LP_FIX_PP}, {LP_PF(par.vpp), LP_FIX_VPP}, {LP_PF(par.ep), LP_FIX_EP},
        {LP_PF(par.cp), LP_FIX_CP}, {LP_PF(par.zero), LP_FIX_ZERO}, {LP_PF(par.recompute), LP_FIX_RECOMPUTE}, {LP_PF(par.offload), LP_FIX_OFFLOAD},
        {LP_PF(par.sp), LP_FIX_SP}, {LP_PF(par.scatter_gather), LP_FIX_SG}, {LP_PF(B), LP_FIX_B}};
    LPPlanLimits limits = {0, f->par, f->B};
    for (size_t k = 0; k < sizeof(kept) / sizeof(kept[0]); k++)
        if (f->given[lp_plan_flag_of(kept[k].field) - lp_plan_flags]) limits.fixed |= kept[k].bit;
    char why[256];
    if (lp_software_refuses(mach.software, &limits.par, limits.fixed, why, sizeof(why)))
        lp_fail("flag %s %s: %s", LP_PLAN_FLAG(software), f->software, why);
    LPPlan* plans;
    if (!lp_plan_model_is_gpt(&model) && !mach.software->llama)
        lp_fail("flag %s %s: -e %s has grouped-query attention or another MLP than GPT-2's, which %s does not run (--software megatron)",
                LP_PLAN_FLAG(software), f->software, f->init, f->software);
    if (cfg.moe_experts && mach.software->moe == 0)
        lp_fail("flag %s %s: -e %s has experts (--moe-experts), which %s does not run (--software llmpar or deepspeed)", LP_PLAN_FLAG(software),
                f->software, f->init, f->software);
    if (cfg.moe_experts && mach.software->moe == 1 && limits.fixed & LP_FIX_PP && limits.par.pp > 1)
        lp_fail("flag %s %s: --pp %d: %s runs experts without a pipeline", LP_PLAN_FLAG(software), f->software, limits.par.pp, f->software);
    if (mach.software->memory == LP_MEMORY_ENGINE && !lp_plan_model_is_engine(&model))  // (its memory is the engine's count of cfg)
        lp_fail("flag %s %s: --kv-heads, --ffn and --swiglu make the planner's own block, not this engine's (its Llama family: -e "
                "llama:L,C,NH,KV[,V]); --software megatron plans them", LP_PLAN_FLAG(software), f->software);
    int count = lp_plan(&model, f->T, tokens, n, f->attention, &mach, &limits, 10, &plans), fit = 0, estimated = 0;
    while (fit < count && plans[fit].fits) fit++;
    double least = INFINITY, GiB = 1073741824.0;
    for (int k = 0; k < count; k++)
        if (plans[k].estimated) estimated++, least = fmin(least, plans[k].memory);
    if (fit == 0) {
        if (count == 0) lp_fail("--plan %d: no grid of %d GPU(s) can run %s with -t %d and -d %lld", n, n, f->init, f->T, tokens);
        lp_fail("--plan %d: no configuration of %s on %d GPU(s) fits 90%% of %.3g GiB per GPU (-t %d, -d %lld); the least needs %.3g GiB",
                n, f->init, n, mach.gpu_bytes / 0.9 / GiB, f->T, tokens, least / GiB);
    }
    char block[96] = "";
    if (!lp_plan_model_is_gpt(&model))
        snprintf(block, sizeof(block), " KV=%d F=%d%s", model.kv_heads, model.ffn, model.swiglu ? " SwiGLU" : "");
    lp_log("plan: %s (L=%d C=%d NH=%d%s, %.4g B parameters) on %d GPU(s), T=%d, %lld tokens per step\n", f->init, cfg.num_layers,
           cfg.channels, cfg.num_heads, block, lp_plan_model_params(&model) / 1e9, n, f->T, tokens);
    char latency[128] = "collectives as NCCL's rings and trees";
    if (!mach.nccl) snprintf(latency, sizeof(latency), "%.0f us per collective or send", mach.latency * 1e6);
    else if (mach.latency > 0.0) snprintf(latency, sizeof(latency), "collectives as NCCL's rings and trees and %.0f us", mach.latency * 1e6);
    if (mach.jitter > 0.0)
        snprintf(latency + strlen(latency), sizeof(latency) - strlen(latency), "; stragglers: jitter %.3g, +%.2g%% of the work", mach.jitter,
                 100.0 * lp_plan_straggle(&mach, n));
    char tiles[64] = "";
    if (mach.attention_tile_k > 0.0) snprintf(tiles, sizeof(tiles), "; materialised: %.0f more K a tile", mach.attention_tile_k);
    lp_log("machine: %s%s: %s, %.4g TFLOP/s bf16 (GEMMs at best %.0f%%, attention %.0f%%%s), %.3g GiB (90%% for the plan), %.0f GB/s "
           "HBM; %d GPUs per node at %.0f GB/s each, %.0f GB/s per GPU between nodes, %s; offload: %.0f "
           "GB/s to the host, %.0f GB/s of host memory, %.0f GB/s of NVMe per GPU; bf16 memory (the CUDA build's); software: %s (%s)\n",
           cluster->name, f->gpu[0] || f->gpu_mem > 0.0f || f->gpu_tflops > 0.0f || f->gpu_gbs > 0.0f || f->gemm_share > 0.0f ||
           f->attention_tile_k >= 0.0f || f->node_gpus || f->node_gbs > 0.0f || f->net_gbs > 0.0f || f->latency_us > 0.0f || f->jitter > 0.0f ? " as changed" : "",
           mach.gpu.name, mach.gpu.peak_flops / 1e12, 100 * mach.gpu.gemm, 100 * mach.gpu.attention, tiles, mach.gpu_bytes / 0.9 / GiB,
           mach.gpu.hbm_bw / 1e9, mach.gpus_per_node, mach.node_bw / 1e9, mach.net_bw / 1e9, latency, mach.host_bw / 1e9,
           mach.host_mem_bw / 1e9, mach.nvme_bw / 1e9, f->software, lp_software_named(f->software)->about);
    int shown = 0;
    while (shown < fit && shown < 10 && plans[shown].simulated) shown++;
    lp_log("%d configurations, %d of them estimated (the rest bounded out: their steps cannot be shorter than the %d "
           "fastest's); the fastest %d that fit, each step simulated (ms per step, on the busiest stage):\n", count, estimated, shown, shown);
    int moe = cfg.moe_experts > 0, ring = f->par.cp > 1;  // (a mixture of experts: expert parallelism's columns too; a sequence
    for (int k = 0; k < shown; k++) ring |= plans[k].par.cp > 1;  // split: context parallelism's)
    lp_log("| t | p | v |%s d |%s sp | sg | ZeRO | recompute | offload | B | m | GiB per GPU | host GiB | compute | TP |%s%s ZeRO comm | bubble "
           "| end | step | MFU | band | outside |\n", ring ? " cp |" : "", moe ? " ep |" : "", moe ? " EP |" : "", ring ? " CP |" : "");
    lp_log("|---|---|---|%s---|%s---|---|---|---|---|---|---|---|---|---|---|%s%s---|---|---|---|---|---|---|\n", ring ? "---|" : "", moe ? "---|" : "",
           moe ? "---|" : "", ring ? "---|" : "");
    double model_flops = lp_plan_flops_per_token(&model, f->T) * (double)tokens, peak = n * mach.gpu.peak_flops;
    for (int k = 0; k < shown; k++) {
        const LPPlan* x = &plans[k];
        char ep[16] = "", ep_ms[24] = "", cp[16] = "", cp_ms[24] = "";
        if (moe) snprintf(ep, sizeof(ep), " %d |", x->par.ep), snprintf(ep_ms, sizeof(ep_ms), " %.4g |", x->ep_s * 1e3);
        if (ring) snprintf(cp, sizeof(cp), " %d |", x->par.cp), snprintf(cp_ms, sizeof(cp_ms), " %.4g |", x->cp_s * 1e3);
        double mfu = model_flops / (x->step_s * peak);
        char outside[64];
        lp_plan_outside(&model, &mach, f->T, n, x, mfu, outside, sizeof(outside));
        lp_log("| %d | %d | %d |%s %d |%s %d | %d | %d | %s | %s | %d | %d | %.3g | %.3g | %.4g | %.4g |%s%s %.4g | %.4g | %.4g | %.4g | %.1f%% | "
               "%.1f-%.1f%% | %s |\n", x->par.tp, x->par.pp, x->par.vpp, cp, x->par.dp, ep, x->par.sp, x->par.scatter_gather, x->par.zero,
               lp_recompute_names[x->par.recompute], lp_offload_names[x->par.offload], x->B, x->par.micro_batches, x->memory / GiB,
               x->host_memory / GiB, x->compute_s * 1e3, x->tp_s * 1e3, ep_ms, cp_ms, x->zero_s * 1e3, x->bubble_s * 1e3, x->end_s * 1e3,
               x->step_s * 1e3, 100.0 * mfu, 100.0 * mfu / mach.software->hi, 100.0 * mfu / mach.software->lo, outside[0] ? outside : "-");
    }
    LPPlan best = plans[0];
    double sends;
    lp_plan_simulate(&model, f->T, f->attention, &mach, &best, NULL, &sends, NULL, INFINITY);
    double per_gpu = best.flops / best.step_s / n, mfu = model_flops / (best.step_s * peak);
    const LPSoftware* sw = mach.software;
    char outside[64], cp_s[48] = "";
    if (best.par.cp > 1) snprintf(cp_s, sizeof(cp_s), ", CP ring %.4g", best.cp_s);
    lp_log("the fastest: %.4g s per step, %.4g tokens/s, MFU %.1f%% (model FLOPs: %.4g per token), %.4g TFLOP/s per GPU with "
           "recomputation counted; bubble %.1f%% of the step; exposed communication %.4g s (TP %.4g, EP %.4g%s, ZeRO-2/3 %.4g, "
           "pipeline sends %.4g, step end %.4g)\n", best.step_s, tokens / best.step_s, 100.0 * model_flops / (best.step_s * peak),
           lp_plan_flops_per_token(&model, f->T), per_gpu / 1e12, 100.0 * best.bubble_s / best.step_s,
           best.tp_s + best.ep_s + best.cp_s + best.zero_s + sends + best.end_s, best.tp_s, best.ep_s, cp_s, best.zero_s, sends, best.end_s);
    lp_log("its band: %.4g-%.4g TFLOP/s per GPU, MFU %.1f-%.1f%% (%s's predictions were %.2f-%.2fx the throughput of its calibration "
           "set: %s)\n", per_gpu / sw->hi / 1e12, per_gpu / sw->lo / 1e12, 100.0 * mfu / sw->hi, 100.0 * mfu / sw->lo, sw->name, sw->lo,
           sw->hi, sw->calibration);
    if (lp_plan_outside(&model, &mach, f->T, n, &best, mfu, outside, sizeof(outside)))
        lp_log("outside its calibration: %s (%s was calibrated on %s, up to %d GPUs and T=%d; MFU above the best published for the "
               "GPU is not believed)\n", outside, sw->name, sw->calibrated_gpu, sw->calibrated_gpus, sw->calibrated_T);
    if (f->train_tokens > 0.0f) {
        double P = lp_plan_model_params(&model), D = f->train_tokens;
        lp_log("time to train %.4g tokens: %.1f days simulated; 8TP/(nX) with X = %.4g TFLOP/s: %.1f days\n", D,
               D / (tokens / best.step_s) / 86400.0, per_gpu / 1e12, 8.0 * D * P / (n * per_gpu) / 86400.0);
    }
    const LPParallel* b = &best.par;
    if (!engine_e || !lp_plan_model_is_engine(&model)) {  // (a preset's name, or the planner's own block)
        lp_log("run the fastest: not with train_gpt, whose -e takes GPT-2's shapes, the Llama family's as llama:L,C,NH,KV[,V] (SwiGLU "
               "multiple_of 256) and llm.c model files\n");
        free(plans);
        return;
    }
    lp_log("run the fastest:\n  mpirun -np %d ./train_gpt -e %s -t %d -d %lld -b %d", n, f->init, f->T, tokens, best.B);
    if (f->moe_experts) lp_log(" --moe-experts %d --moe-topk %d --moe-every %d", f->moe_experts, f->moe_topk, f->moe_every);
    if (b->tp > 1) lp_log(" --tp %d%s%s", b->tp, b->sp ? " --sp" : "", b->pp > 1 && !b->sp ? (b->scatter_gather ? "" : " --pp-scatter-gather 0") : "");
    if (b->cp > 1) lp_log(" --cp %d", b->cp);
    if (b->pp > 1) lp_log(" --pp %d", b->pp);
    if (b->ep > 1) lp_log(" --ep %d", b->ep);
    if (b->vpp > 1) lp_log(" --vpp %d --schedule interleaved", b->vpp);
    if (b->zero) lp_log(" --zero %d", b->zero);
    if (!b->overlap) lp_log(" --overlap 0");
    if (b->recompute) lp_log(" --recompute %s", lp_recompute_names[b->recompute]);
    if (f->attention != LP_ATTENTION_FLASH) lp_log(" --attention %s", lp_attention_names[f->attention]);
    if (b->offload) lp_log(" --offload %s%s", lp_offload_names[b->offload], b->offload == LP_OFFLOAD_NVME ? " --offload-dir DIR" : "");
    lp_log("\n");
    free(plans);
}

int main(int argc, char** argv) {
    LPPlanFlags flags;
    lp_setting_namer = lp_plan_setting_flag;  // the header's errors name this program's flags
    if (argc == 1 || !lp_plan_parse(&flags, argc, argv)) lp_plan_usage();
    else lp_print_plan(&flags);
    return 0;
}
