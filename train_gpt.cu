/*
train_gpt.cu: the llmpar driver. Flags, set-up, the step loop, validation, sampling, logging, checkpoints.

  make train_gpt && mpirun -np 1 ./train_gpt            CUDA engine (bf16 compute, fp32 master weights)
  make train_gpt_cpu && mpirun -np 1 ./train_gpt_cpu    CPU engine (fp32, OpenMP), same code

With no flags it trains a small GPT-2 on the tinyshakespeare shards shipped in dev/data/. Flags follow
llm.c's where they overlap; run with -h for the list.
*/
#define LLMPAR_IMPLEMENTATION  // this file defines llmpar.h's globals (one file of a program does)
#include "llmpar.h"
#include "dev/plan/plan.h"  // defines: lp_plan (--auto: the cluster planner chooses the grid)
#ifdef LLMPAR_NO_WATCHDOG
#error "train_gpt.cu needs llmpar.h's watchdog (--timeout-minutes, --straggler): build it without LLMPAR_NO_WATCHDOG"
#endif
#include <stddef.h>        // offsetof: the flag table names LPFlags fields
#include <setjmp.h>        // longjmp: a flag error returns to lp_parse_flags (lp_flag_fail)
#include <signal.h>        // sigaction: a signal stops the run at a step's end, with a checkpoint
#include <sys/resource.h>  // getrusage: the peak host memory, printed at the end

typedef struct {
    const char* train_data;  // -i
    const char* val_data;    // -j
    const char* init;        // -e  llm.c model file, or dN to start from scratch at depth N
    const char* out_dir;     // -o
    const char* tokenizer;   // --tokenizer
    int B;                   // -b  micro-batch size
    int T;                   // -t  sequence length
    int total_batch;         // -d  tokens per optimizer step (gradient accumulation derived)
    int max_steps;           // -x
    float lr;                // -l
    int warmup;              // -u
    float final_lr_frac;     // -q
    int decay;               // -k  cosine | linear (lp_decay_names)
    float weight_decay;      // -c
    float beta1, beta2, eps; // --beta1, --beta2, --eps: AdamW's
    float grad_clip;         // --grad-clip
    int dtype;               // --dtype: the compute type, the build's (lp_dtype_names)
    LPLossScaler scaler;     // --loss-scale, --loss-scale-backoff, --loss-scale-growth, --loss-scale-window
    int val_every;           // -v
    int val_batches;         // -m
    int sample_every;        // -s
    const char* hellaswag;   // --eval-hellaswag: llm.c's HellaSwag file ("" for none)
    int eval_every;          // --eval-every
    int gen_tokens;          // -g
    int ckpt_every;          // -n
    int keep;                // --keep: checkpoints kept (0: all)
    float ckpt_minutes;      // --ckpt-minutes: also checkpoint once this long has passed since the last (0: off)
    float timeout_minutes;   // --timeout-minutes: the watchdog's (0: max(10 minutes, 20x the median step so far))
    float straggler;         // --straggler: name a rank behind the median by more than this share of a step (0: off)
    const char* trace;       // --trace: the timeline's Chrome trace file ("" for none)
    const char* trace_steps; // --trace-steps A:B (""): the steps it records (default: the second step, or the first)
    int overwrite;           // --overwrite: a fresh run may replace the checkpoints in -o
    int on_divergence;       // --on-divergence: stop | skip | rollback (lp_divergence_names)
    float loss_spike;        // --loss-spike: a loss above this times the recent mean is a spike (0: off)
    int resume;              // --resume
    int resume_changed;      // --resume-changed: a resume may change flags of the run's identity (lp_run_identity)
    // --tp --pp --ep --vpp --schedule --pp-partition --sp --pp-scatter-gather --zero --overlap --bucket-mb
    // --recompute --offload --offload-dir --comm --diloco --gossip: how the run is split over the ranks
    // (d = ranks / (t p))
    LPParallel par;
    LPOuterSGD outer;        // --outer-lr, --outer-momentum: DiLoCo's outer step
    int auto_grid;           // --auto: the planner chooses the grid (lp_auto_grid)
    float gpu_mem;           // --gpu-mem: with --auto, a rank's memory in GiB (0: the machine's)
    int print_schedule;      // --print-schedule: draw the pipeline timeline and exit
    int print_flags;         // --print-flags: print every flag's value and exit
    const char* aux_layers;  // --aux-loss-layers: layers whose outputs also get the head and a loss
    float aux_weight;        // --aux-loss-weight
    int attention;           // --attention: flash | cublas (LP_ATTENTION_*)
    int moe_experts, moe_topk, moe_every;  // --moe-experts, --moe-topk, --moe-every: a new model's experts
    LPMoEOptions moe;        // --moe-capacity, --moe-aux-coef, --moe-z-coef
    int shuffle;             // --shuffle: each epoch's shards and windows in a seeded random order
    int check_data;          // --check-data: manifest | full (lp_check_data_names)
    unsigned long long seed; // --seed
    unsigned char given[128];// given[k]: flag row k was typed
} LPFlags;

// The flags, one row each: the table below is the only list of them. Parsing, the defaults, -h (and so
// dev/docs/flags.md's flags block, `make flags-doc`), --print-flags and the flag names in the errors after
// parsing all come from it.
// A switch takes no value; its llm.c letter takes llm.c's 0 or 1. LP_FLAG_SEED is an integer as typed,
// kept in 64 bits. LP_FLAG_CHOICE is one of the names in `choices`, kept as its index (an LP_* constant).
typedef enum { LP_FLAG_INT, LP_FLAG_FLOAT, LP_FLAG_STRING, LP_FLAG_SWITCH, LP_FLAG_SEED, LP_FLAG_CHOICE } LPFlagType;

typedef struct {
    const char* name;     // the long form, or NULL where llm.c's letter is the only one
    const char* letter;   // llm.c's form, meaning what it means in llm.c's train_gpt2.cu, or NULL
    LPFlagType type;
    size_t field;         // offsetof(LPFlags, ...)
    const char* cpu;      // the CPU build's default, as typed ("" for none; NULL for a switch: off)
    const char* cuda;     // the CUDA build's default
    const char* metavar;  // the value's name in -h
    const char* const* levels;  // the letter takes llm.c's level k, which means the k-th of these names
    const char* const* choices; // LP_FLAG_CHOICE: the names it takes (NULL-terminated)
    const char* help;
} LPFlagSpec;

// llm.c's -r: 0 none, 1 recompute GELU, 2 GELU and LayerNorm. The nearest here to both 1 and 2 is selective.
static const char* const lp_llmc_recompute[] = {"none", "selective", "selective", NULL};
static const char* const lp_decay_names[] = {"cosine", "linear", NULL};
enum { LP_STOP, LP_SKIP, LP_ROLLBACK };
static const char* const lp_divergence_names[] = {"stop", "skip", "rollback", NULL};
static const char* const lp_dtype_names[] = {"fp32", "bf16", "fp16", NULL};
// The CUDA build's --dtype, and its --loss-scale: on for fp16 (2^16, where Micikevicius et al. 2018 and PyTorch's
// GradScaler start), off for bf16
#ifdef LLMPAR_FP16
#define LP_CUDA_DTYPE "fp16"
#define LP_LOSS_SCALE_DEFAULT "65536"
#else
#define LP_CUDA_DTYPE "bf16"
#define LP_LOSS_SCALE_DEFAULT "0"
#endif

#define LP_FIELD(x) offsetof(LPFlags, x)
static const LPFlagSpec lp_flag_specs[] = {
    {NULL, "-i", LP_FLAG_STRING, LP_FIELD(train_data), "dev/data/tinyshakespeare/tiny_shakespeare_train.bin",
     "dev/data/tinyshakespeare/tiny_shakespeare_train.bin", "PATTERN", NULL, NULL,
     "train token shards: a glob, quoted ('data/mine_train_*.bin'), made by dev/data/prepare.py"},
    {NULL, "-j", LP_FLAG_STRING, LP_FIELD(val_data), "dev/data/tinyshakespeare/tiny_shakespeare_val.bin",
     "dev/data/tinyshakespeare/tiny_shakespeare_val.bin", "PATTERN", NULL, NULL,
     "val token shards (a glob; \"\" for none); every val shard needs at least B*T*d+1 tokens, every train shard "
     "one step's (-d) + 1"},
    {NULL, "-e", LP_FLAG_STRING, LP_FIELD(init), "d4", "d12", "MODEL", NULL, NULL,
     "llm.c model file (fp32 v3 or bf16 v5; llmpar's MoE v6; llm.c's Llama 3, 20240803, with experts llmpar's v6), or dN: a new GPT-2 of depth N "
     "(d12/d24/d36/d48 are GPT-2 124M/350M/774M/1558M; other N: C=64N, N heads), or L,C,NH[,V]: a new model of any shape "
     "(GPT-3 175B: 96,12288,96; V 50257 unless given; up to T=2048); llama:dN or llama:L,C,NH,KV[,V]: the same as a Llama 3 "
     "(RoPE, RMSNorm, SwiGLU, KV heads (dN: N/2), no biases, untied head; both engines, every grid)"},
    {NULL, "-o", LP_FLAG_STRING, LP_FIELD(out_dir), "", "", "DIR", NULL, NULL, "output directory: main.log and checkpoints; one run at a time (DIR/lock)"},
    {NULL, "-b", LP_FLAG_INT, LP_FIELD(B), "4", "16", "N", NULL, NULL, "micro-batch size"},
    {NULL, "-t", LP_FLAG_INT, LP_FIELD(T), "64", "1024", "N", NULL, NULL, "sequence length (at most the model's)"},
    {NULL, "-d", LP_FLAG_INT, LP_FIELD(total_batch), "0", "0", "N", NULL, NULL,
     "tokens per optimizer step; gradient accumulation steps = N / (b*t*d), d the data-parallel size "
     "(0: b*t*d, no accumulation)"},
    {NULL, "-x", LP_FLAG_INT, LP_FIELD(max_steps), "40", "200", "N", NULL, NULL,
     "training steps (0: no training and no train shard read: the val loss (none when -j is left at its default "
     "and that is not there), a sample with -s N, and with -o the model as loaded saved as checkpoint "
     "step_00000000, e.g. to convert or re-split a file; llm.c's -1, one epoch, is not here)"},
    {NULL, "-l", LP_FLAG_FLOAT, LP_FIELD(lr), "1e-3", "6e-4", "LR", NULL, NULL, "peak learning rate"},
    {NULL, "-u", LP_FLAG_INT, LP_FIELD(warmup), "5", "20", "N", NULL, NULL, "linear warmup steps"},
    {NULL, "-q", LP_FLAG_FLOAT, LP_FIELD(final_lr_frac), "0.1", "0.1", "F", NULL, NULL,
     "final learning rate as a fraction of -l"},
    {NULL, "-k", LP_FLAG_CHOICE, LP_FIELD(decay), "cosine", "cosine", "NAME", NULL, lp_decay_names,
     "decay after warmup: cosine | linear (llm.c's constant and wsd are not here)"},
    {NULL, "-c", LP_FLAG_FLOAT, LP_FIELD(weight_decay), "0.1", "0.1", "F", NULL, NULL,
     "AdamW weight decay (matrices only; not biases or LayerNorm)"},
    {"--beta1", NULL, LP_FLAG_FLOAT, LP_FIELD(beta1), "0.9", "0.9", "F", NULL, NULL,
     "AdamW's decay of the running mean of the gradient, 0 <= F < 1"},
    {"--beta2", NULL, LP_FLAG_FLOAT, LP_FIELD(beta2), "0.95", "0.95", "F", NULL, NULL,
     "AdamW's decay of the running mean of the squared gradient, 0 <= F < 1"},
    {"--eps", NULL, LP_FLAG_FLOAT, LP_FIELD(eps), "1e-8", "1e-8", "F", NULL, NULL,
     "AdamW's epsilon, added to the square root of the second moment; > 0"},
    {"--grad-clip", NULL, LP_FLAG_FLOAT, LP_FIELD(grad_clip), "1.0", "1.0", "F", NULL, NULL,
     "clip the global gradient norm to F (0: off)"},
    {"--dtype", NULL, LP_FLAG_CHOICE, LP_FIELD(dtype), "fp32", LP_CUDA_DTYPE, "NAME", NULL, lp_dtype_names,
     "the weights', gradients' and activations' type (master weights and AdamW state are fp32): fp32 | bf16 | fp16, "
     "chosen when the engine is built, so it must be the build's: the CPU engine computes in fp32, make train_gpt in bf16, "
     "make train_gpt_fp16 in fp16 (which turns --loss-scale on)"},
    {"--loss-scale", NULL, LP_FLAG_FLOAT, LP_FIELD(scaler.scale), "0", LP_LOSS_SCALE_DEFAULT, "S", NULL, NULL,
     "dynamic loss scaling, for fp16: backward starts from the loss's gradient times S and the update divides it out; a "
     "step whose gradients hold an inf or NaN (an overflow, seen in the gradient norm) is skipped on every rank and S "
     "multiplied by --loss-scale-backoff, and after --loss-scale-window clean steps S is multiplied by "
     "--loss-scale-growth (S stays within 1 .. 2^24; an overflow at 1 is a divergence, --on-divergence's). The step line "
     "shows S and the steps skipped; checkpoints keep S. 0: off. Default 65536 (2^16) in the fp16 build, off in the "
     "others (the CPU engine runs it in fp32 all the same)"},
    {"--loss-scale-backoff", NULL, LP_FLAG_FLOAT, LP_FIELD(scaler.backoff), "0.5", "0.5", "F", NULL, NULL,
     "with --loss-scale: the scale's factor after an overflow, 0 < F < 1"},
    {"--loss-scale-growth", NULL, LP_FLAG_FLOAT, LP_FIELD(scaler.growth), "2", "2", "F", NULL, NULL,
     "with --loss-scale: the scale's factor after --loss-scale-window clean steps in a row, F >= 1"},
    {"--loss-scale-window", NULL, LP_FLAG_INT, LP_FIELD(scaler.window), "1000", "1000", "N", NULL, NULL,
     "with --loss-scale: clean steps (no overflow) in a row before the scale grows, N >= 1"},
    {NULL, "-v", LP_FLAG_INT, LP_FIELD(val_every), "20", "50", "N", NULL, NULL, "val loss every N steps and at the end (0: never)"},
    {NULL, "-m", LP_FLAG_INT, LP_FIELD(val_batches), "4", "2", "N", NULL, NULL, "val batches per evaluation (0: the whole val set)"},
    {"--eval-hellaswag", NULL, LP_FLAG_STRING, LP_FIELD(hellaswag), "", "", "FILE", NULL, NULL,
     "HellaSwag accuracy (llm.c's -h): FILE is llm.c's hellaswag_val.bin (dev/data/hellaswag.py makes it); each "
     "completion is scored by its tokens' losses after the context, the ranks share the examples; prints acc (lowest "
     "summed loss) and acc_norm (lowest mean loss per token; main.log's eval, as llm.c's). An example whose context + "
     "completion exceeds -t is refused, as llm.c does"},
    {"--eval-every", NULL, LP_FLAG_INT, LP_FIELD(eval_every), "0", "0", "N", NULL, NULL,
     "with --eval-hellaswag: evaluate every N steps and at the end (0: every -v steps; at the end only when -v is 0)"},
    {NULL, "-s", LP_FLAG_INT, LP_FIELD(sample_every), "0", "50", "N", NULL, NULL,
     "print a sample every N steps and at the end (0: never); each token is one forward of its own row, the "
     "tokens before it held in a key-value cache"},
    {NULL, "-g", LP_FLAG_INT, LP_FIELD(gen_tokens), "64", "64", "N", NULL, NULL,
     "tokens per sample (at most -t minus 1, the positions after the start token: GPT-2's <|endoftext|>, Llama 3's "
     "<|begin_of_text|>)"},
    {"--tokenizer", NULL, LP_FLAG_STRING, LP_FIELD(tokenizer), "gpt2_tokenizer.bin", "gpt2_tokenizer.bin", "PATH", NULL, NULL,
     "tokenizer for samples (the default, when the working directory has none: the one beside the program)"},
    {"--seed", NULL, LP_FLAG_SEED, LP_FIELD(seed), "1337", "1337", "N", NULL, NULL,
     "seed of the initial weights, of sampling and of the data order"},
    {"--shuffle", NULL, LP_FLAG_INT, LP_FIELD(shuffle), "1", "1", "N", NULL, NULL,
     "1: each epoch visits the train shards, and each shard's steps (windows of -d tokens), in a random order "
     "drawn from --seed, as llm.c's loader does; 0: file order"},
    {"--check-data", NULL, LP_FLAG_CHOICE, LP_FIELD(check_data), "manifest", "manifest", "NAME", NULL, lp_check_data_names,
     "how rank 0 checks the shards' token ids at the start: manifest (the shards' folder's manifest.txt from "
     "dev/data/prepare.py where there is one: only headers are read; a manifest that does not match the shards is an "
     "error) | full (read every token). Under both, a manifest that lists shards the pattern matches but does not find, "
     "or an unfinished prepare.py job for these shards, is an error naming what is missing"},
    {NULL, "-n", LP_FLAG_INT, LP_FIELD(ckpt_every), "0", "0", "N", NULL, NULL,
     "checkpoint every N steps (needs -o; a checkpoint is always written at the end when -o is given)"},
    {"--resume", "-y", LP_FLAG_SWITCH, LP_FIELD(resume), NULL, NULL, NULL, NULL, NULL,
     "continue from the newest complete checkpoint in -o; one that is damaged (a bad header or size, or a checksum "
     "that differs from its manifest) is reported in one line and the one before it is used. -y 1 is llm.c's "
     "spelling; -y 0 (llm.c: restart) starts afresh, and an -o holding checkpoints still needs --overwrite"},
    {"--resume-changed", NULL, LP_FLAG_SWITCH, LP_FIELD(resume_changed), NULL, NULL, NULL, NULL, NULL,
     "with --resume: continue even though flags of the run's identity differ from its checkpoint's (-e, -i and the "
     "shards it finds, -l, -u, -q, -k, -c, --beta1, --beta2, --eps, --grad-clip, --seed, --shuffle, --aux-loss-layers, "
     "--aux-loss-weight, --moe-capacity, --moe-aux-coef, --moe-z-coef, --diloco, --outer-lr, --outer-momentum, --gossip): "
     "each difference is printed as a notice and the checkpoints from then on carry this run's. Without it such a resume is refused, naming the flag. The grid, -b and "
     "-x may change without it; -t, -d and the data order never"},
    {"--keep", "-nk", LP_FLAG_INT, LP_FIELD(keep), "0", "0", "N", NULL, NULL,
     "after each save keep the newest N checkpoints, removing older ones (0: all; one that cannot be removed is a "
     "notice, and the run goes on)"},
    {"--ckpt-minutes", NULL, LP_FLAG_FLOAT, LP_FIELD(ckpt_minutes), "0", "0", "M", NULL, NULL,
     "also checkpoint once M minutes have passed since the start or the last checkpoint (rank 0's clock decides; "
     "needs -o; 0: off)"},
    {"--timeout-minutes", NULL, LP_FLAG_FLOAT, LP_FIELD(timeout_minutes), "0", "0", "M", NULL, NULL,
     "with 2 or more ranks, a rank that has waited M minutes in one collective or send/receive (a peer stopped, "
     "hung or gone), or made no progress for M minutes in the set-up (MPI's start, the groups' splits, NCCL's "
     "start, loading), ends the job with one line naming the step or the set-up and the call, exit status 124, for "
     "a supervisor to relaunch; watched from MPI's start to the last checkpoint (0: max(10 minutes, 20 times the "
     "median step so far))"},
    {"--straggler", NULL, LP_FLAG_FLOAT, LP_FIELD(straggler), "0.1", "0.1", "F", NULL, NULL,
     "with 2 or more ranks, every 10 steps the ranks compare their compute time per step (forward-backward less "
     "its waits for other ranks), and a rank behind the median rank by more than F of a step (0.1: 10%) is named "
     "in one line, with its host and t, p, d coordinates, and in the end report (0: off)"},
    {"--trace", NULL, LP_FLAG_STRING, LP_FIELD(trace), "", "", "FILE", NULL, NULL,
     "write the timeline of --trace-steps to FILE, one Chrome trace (JSON; opens in Perfetto or chrome://tracing): a "
     "process per rank named by its t, p, d coordinates, each micro-batch's forward (F) and backward (B) per chunk, "
     "recomputation, every collective and send/receive with its group and bytes, data loading, the gradient reduction, "
     "norm and optimizer phases; on the CUDA engine also the GPU's own times, the compute and the comm stream's events "
     "(and with --cp the ring's stream's) as tracks of their own (dev/docs/parallelism.md)"},
    {"--trace-steps", NULL, LP_FLAG_STRING, LP_FIELD(trace_steps), "", "", "A:B", NULL, NULL,
     "the steps --trace records, A to B (counted from 1; default: step 2, the first after the warm-up step, or step 1 "
     "of a one-step run)"},
    {"--overwrite", NULL, LP_FLAG_SWITCH, LP_FIELD(overwrite), NULL, NULL, NULL, NULL, NULL,
     "without --resume, start even though -o holds checkpoints, removing them (otherwise that is an error: a later "
     "--resume would take the newest of either run). They are all renamed out of --resume's sight first: where one "
     "cannot be, the old run is left whole and this one stops before its first step"},
    {"--on-divergence", NULL, LP_FLAG_CHOICE, LP_FIELD(on_divergence), "stop", "stop", "NAME", NULL, lp_divergence_names,
     "a step whose loss or gradient norm is not finite, or whose update makes a weight not finite, or (skip, "
     "rollback) whose loss is a spike: stop (the newest checkpoint is the last good one) | skip (drop its batch and "
     "update) | rollback (reload the newest checkpoint, needs -o, and go on with the batches after the bad one); 3 in "
     "a row without progress stop the run"},
    {"--loss-spike", NULL, LP_FLAG_FLOAT, LP_FIELD(loss_spike), "3", "3", "F", NULL, NULL,
     "a step's loss above F times the mean of the last 20 steps' is a spike: reported, and under skip or rollback "
     "handled as a divergence (0: off)"},
    {"--tp", NULL, LP_FLAG_INT, LP_FIELD(par.tp), "1", "1", "N", NULL, NULL,
     "tensor-parallel size t: heads, MLP width and vocabulary split over t ranks"},
    {"--sp", NULL, LP_FLAG_SWITCH, LP_FIELD(par.sp), NULL, NULL, NULL, NULL, NULL,
     "sequence parallelism within the TP group: LayerNorms, residual adds and their activations on 1/t of the rows "
     "each (needs t > 1 and -t divisible by t)"},
    {"--pp", NULL, LP_FLAG_INT, LP_FIELD(par.pp), "1", "1", "N", NULL, NULL,
     "pipeline-parallel size: the layers split over N stages; data-parallel size d = ranks / (t*cp*p)"},
    {"--cp", NULL, LP_FLAG_INT, LP_FIELD(par.cp), "1", "1", "N", NULL, NULL,
     "context-parallel size: each sequence's -t tokens split over N ranks, rank i holding chunks i and 2N-1-i of "
     "2N (so that each scores as much causal attention), attention a ring passing keys and values around the N "
     "ranks; gradients averaged, and ZeRO sharded, over the cp*d ranks. -t must split into 2N chunks; the CPU "
     "build, GPT-2's family"},
    {"--ep", NULL, LP_FLAG_INT, LP_FIELD(par.ep), "1", "1", "N", NULL, NULL,
     "expert parallelism (a mixture of experts): each MoE layer's experts split over N of the d data-parallel ranks, "
     "tokens sent to their experts' ranks and back by all-to-all; N divides d and the experts"},
    {"--vpp", NULL, LP_FLAG_INT, LP_FIELD(par.vpp), "1", "1", "N", NULL, NULL, "model chunks per pipeline stage (--schedule interleaved)"},
    {"--schedule", NULL, LP_FLAG_CHOICE, LP_FIELD(par.schedule), "1f1b", "1f1b", "NAME", NULL, lp_schedule_names,
     "pipeline schedule: gpipe | 1f1b | interleaved"},
    {"--pp-partition", NULL, LP_FLAG_STRING, LP_FIELD(par.partition), "balanced", "balanced", "P", NULL, NULL,
     "layers per chunk: balanced (the least training FLOPs on the costliest chunk, counting the LM head; among "
     "those, the least estimated memory on the fullest chunk) | uniform | a list L1,L2,... of p*v counts"},
    {"--pp-scatter-gather", NULL, LP_FLAG_INT, LP_FIELD(par.scatter_gather), "1", "1", "N", NULL, NULL,
     "1: with --tp and no --sp, each TP rank sends 1/t of a stage boundary and the receivers all-gather it; 0: every "
     "rank sends the whole"},
    {"--aux-loss-layers", NULL, LP_FLAG_STRING, LP_FIELD(aux_layers), "", "", "L1,L2,...", NULL, NULL,
     "auxiliary losses: these layers' outputs (1 .. L-1) also go through the final norm and the head to a loss, "
     "weighted and added to the training loss"},
    {"--aux-loss-weight", NULL, LP_FLAG_FLOAT, LP_FIELD(aux_weight), "0.1", "0.1", "F", NULL, NULL,
     "the weight of each auxiliary loss"},
    {"--moe-experts", NULL, LP_FLAG_INT, LP_FIELD(moe_experts), "0", "0", "E", NULL, NULL,
     "a mixture of experts, with -e dN (or llama:dN, L,C,NH...): each MoE layer's MLP becomes E expert MLPs of its shape "
     "(GELU's, or the Llama family's SwiGLU) and a router (0: a dense model). A model file has its own (version 6); there "
     "this is 0 or the file's"},
    {"--moe-topk", NULL, LP_FLAG_INT, LP_FIELD(moe_topk), "2", "2", "K", NULL, NULL,
     "with --moe-experts: the experts each token goes to (1: Switch, the gate is the router's probability; 2: "
     "GShard/Mixtral, the K gates renormalised to sum 1)"},
    {"--moe-every", NULL, LP_FLAG_INT, LP_FIELD(moe_every), "1", "1", "N", NULL, NULL,
     "with --moe-experts: layers 0, N, 2N, ... (counted from 0) are MoE layers, the others dense (1: every layer)"},
    {"--moe-capacity", NULL, LP_FLAG_FLOAT, LP_FIELD(moe.capacity), "0", "0", "F", NULL, NULL,
     "capacity factor: an expert takes at most ceil(F*K*N/E) of a micro-batch's K*N token choices, first come first "
     "served in token order; the rest are dropped (the token goes on by the residual alone). 0: none dropped"},
    {"--moe-aux-coef", NULL, LP_FLAG_FLOAT, LP_FIELD(moe.aux_coef), "0.01", "0.01", "F", NULL, NULL,
     "the load-balancing loss's coefficient (Switch Transformer: coef * E * sum_e f_e P_e per MoE layer)"},
    {"--moe-z-coef", NULL, LP_FLAG_FLOAT, LP_FIELD(moe.z_coef), "0", "0", "F", NULL, NULL,
     "the router z-loss's coefficient (ST-MoE: coef * mean logsumexp(router logits)^2 per MoE layer)"},
    {"--recompute", "-r", LP_FLAG_CHOICE, LP_FIELD(par.recompute), "none", "none", "NAME", lp_llmc_recompute, lp_recompute_names,
     "activations backward recomputes instead of keeping: none | selective (the attention probabilities and the GELU "
     "output; the CUDA build's flash attention keeps no probabilities, so there only the GELU output) | full (it keeps only each layer's input and reruns the layer's forward). -r takes llm.c's levels, 0 "
     "none, 1 GELU, 2 GELU and LayerNorm: 1 and 2 both mean selective here, the nearest (it recomputes the attention "
     "probabilities too, and LayerNorm only under full)"},
    {"--attention", NULL, LP_FLAG_CHOICE, LP_FIELD(attention), "flash", "flash", "NAME", NULL, lp_attention_names,
     "the CUDA build's attention: flash (FlashAttention-2's form; keeps each row's logsumexp) | cublas (llm.c's "
     "without cuDNN: cuBLASLt batched products and a softmax kernel; keeps the B*NH*T*T probabilities of every layer, "
     "or of one under --recompute) | cudnn (cuDNN's fused attention, as llm.c's USE_CUDNN; keeps what flash keeps; a "
     "build made with make USE_CUDNN=1, run on a GPU only). flash is the default: as fast on an H100 at 124M with less "
     "memory when measured (dev/gpu_results.md), 2.3x faster since in the GPU model (dev/docs/figures.md). The CPU "
     "build has one attention, its loops (which keep the probabilities), and takes any value"},
    {"--zero", "-z", LP_FLAG_INT, LP_FIELD(par.zero), "0", "0", "N", NULL, NULL,
     "ZeRO stage. 0: every data-parallel rank holds the full AdamW state; 1: the fp32 master weights and AdamW state "
     "are sharded over the d ranks; 2: the gradients too; 3: the weights too, gathered a layer at a time"},
    {"--offload", NULL, LP_FLAG_CHOICE, LP_FIELD(par.offload), "none", "none", "NAME", NULL, lp_offload_names,
     "where this rank's optimizer state lives: none (with the weights) | optimizer (the CUDA build: the fp32 master "
     "weights and AdamW m and v in pinned host memory, updated on the CPU a chunk at a time, overlapped with the "
     "copies of gradients down and weights up) | params (the CUDA build, with --zero 3: as optimizer, and this rank's "
     "shard of the bf16 weights in pinned host memory too, each layer's part copied up as its gather starts) | nvme "
     "(AdamW m and v in a file under --offload-dir, streamed through two buffers of 8 MiB at each update; the CUDA "
     "build keeps the master weights in pinned memory and updates as with optimizer)"},
    {"--offload-dir", NULL, LP_FLAG_STRING, LP_FIELD(par.offload_dir), "", "", "DIR", NULL, NULL,
     "an existing, writable directory for --offload nvme: one file per rank (per model chunk), unlinked once open, "
     "so nothing is left behind"},
    {"--overlap", NULL, LP_FLAG_INT, LP_FIELD(par.overlap), "1", "1", "N", NULL, NULL,
     "1: reduce the layers' gradients during backward, overlapped with the layers below (ZeRO-0: all-reduces in "
     "buckets on the last micro-batch; ZeRO-2/3: each layer's reduce-scatter, every micro-batch); 0: ZeRO-0 "
     "all-reduces once after backward, ZeRO-2/3 wait for each layer's reduction"},
    {"--bucket-mb", NULL, LP_FLAG_FLOAT, LP_FIELD(par.bucket_mb), "25", "25", "F", NULL, NULL,
     "with --overlap: reduce consecutive layers together once F MiB of their gradients are done (0: every layer on "
     "its own)"},
    {"--comm", NULL, LP_FLAG_STRING, LP_FIELD(par.comm), "auto", "auto", "NAME", NULL, NULL,
     "collectives: auto (NCCL on the CUDA build; MPI when ranks share a GPU, and on the CPU build) | nccl | mpi"},
    {"--diloco", NULL, LP_FLAG_INT, LP_FIELD(par.diloco), "0", "0", "H", NULL, NULL,
     "DiLoCo: the d data-parallel replicas (each may be a t x p grid) train apart, each with its own AdamW state and no "
     "gradient all-reduce, and after every H steps all-reduce their weights once (fp32) and take the same outer step "
     "(SGD with Nesterov momentum) on the mean change since the last: H times fewer data-parallel bytes than plain "
     "data parallelism's gradient all-reduce (H/2 on the CUDA build, whose gradients are bf16). Needs d >= 2, --zero "
     "0, no --ep or --offload, -n a multiple of H; the run's last step, and a stop by signal, end the round under way "
     "with an outer step (0: off)"},
    {"--outer-lr", NULL, LP_FLAG_FLOAT, LP_FIELD(outer.lr), "0.7", "0.7", "F", NULL, NULL,
     "with --diloco: the outer step's learning rate, > 0 (DiLoCo's 0.7; 1 with --outer-momentum 0 sets the weights "
     "to the replicas' mean)"},
    {"--outer-momentum", NULL, LP_FLAG_FLOAT, LP_FIELD(outer.momentum), "0.9", "0.9", "F", NULL, NULL,
     "with --diloco: the outer step's Nesterov momentum, 0 <= F < 1 (DiLoCo's 0.9)"},
    {"--gossip", NULL, LP_FLAG_INT, LP_FIELD(par.gossip), "0", "0", "K", NULL, NULL,
     "gossip: the d data-parallel replicas train apart, each with its own AdamW state and no gradient all-reduce; "
     "after each step replica i sends its weights (fp32) to i+1, i+2, ..., i+2^(K-1) and averages its own with those "
     "of i-1, ..., i-2^(K-1) (mod d), each weighted 1/(K+1): an exponential graph (K = 1: a ring), no collective. The "
     "step line prints the replicas' spread. Needs 2^(K-1) < d, --zero 0, no --ep or --offload; a checkpoint holds "
     "replica 0's weights and state, which every replica resumes from (0: off)"},
    {"--auto", NULL, LP_FLAG_SWITCH, LP_FIELD(auto_grid), NULL, NULL, NULL, NULL, NULL,
     "choose the grid with the cluster planner (dev/plan): t, p, v, SP, ZeRO stage, recomputation, offload and -b for "
     "this run's ranks, the fastest simulated step that fits a rank's memory, on this machine (the CUDA build: the "
     "GPU's preset by its name, with its memory; the CPU build: its matmul and copy rates, measured at the start by "
     "every rank at once, and the host's memory shared by its ranks); context parallelism only where no grid without "
     "it fits. A grid flag typed is kept and the search respects it; the choice is printed with its reason in one line"},
    {"--gpu-mem", NULL, LP_FLAG_FLOAT, LP_FIELD(gpu_mem), "0", "0", "GiB", NULL, NULL,
     "with --auto: the memory a rank has, as plan_gpt's --gpu-mem; plans fill 90% of it (0: the GPU's; on the CPU "
     "build the host's shared by its ranks)"},
    {"--print-schedule", NULL, LP_FLAG_SWITCH, LP_FIELD(print_schedule), NULL, NULL, NULL, NULL, NULL,
     "draw the timeline of --pp, --vpp, --schedule and the micro-batches per step (-d / (-b*-t*d)) from the "
     "simulator, with unit costs, and exit"},
    {"--print-flags", NULL, LP_FLAG_SWITCH, LP_FIELD(print_flags), NULL, NULL, NULL, NULL, NULL,
     "print every flag's value as parsed, defaults included, one per line, and exit"},
};
#define LP_NUM_FLAGS (int)(sizeof(lp_flag_specs) / sizeof(lp_flag_specs[0]))

// llm.c's flags with no counterpart here: listed by -h, and a clear error when given.
typedef struct {
    const char* letters;  // llm.c's letters, with its value's name
    const char* meaning;
    const char* here;     // what there is instead, or why not
} LPAbsentFlag;
static const LPAbsentFlag lp_llmc_absent[] = {
    {"-lg N", "log GPU information every N steps", "the CUDA engine prints the GPU memory in use after the first step"},
    {"-nm N", "every Nth checkpoint is major and never removed by -nk", "--keep keeps the newest N, none exempt"},
    {"-sl F", "skip the update of a step whose loss has a z-score above F",
     "--loss-spike F with --on-divergence skip drops a step whose loss is above F times the recent mean (a ratio, not "
     "a z-score)"},
    {"-sg F", "skip the update of a step whose gradient norm has a z-score above F",
     "the divergence guard acts on a gradient norm that is not finite, not on its z-score"},
    {"-h N", "HellaSwag evaluation", "-h prints this help, with or without a number after it; --eval-hellaswag FILE evaluates"},
    {"-a 0|1", "overfit a single batch", "nothing like it"},
    {"-f 0|1", "TF32 matmuls", "the CUDA engine's matmuls take bf16 with fp32 accumulation, the CPU engine's fp32"},
    {"-w 0|1", "keep fp32 master weights for AdamW", "the CUDA engine always keeps them; the CPU engine's weights are fp32"},
    {"-ge N", "GELU fusion: 0 none, 1 forward, 2 forward and backward",
     "the CUDA engine always fuses GELU into the matmul it follows, and GELU's backward into the backward of the "
     "matmul it feeds (cuBLASLt's GELU_AUX and DGELU epilogues, llm.c's 2)"},
    {"-pn -pr -pg -pi -pf -ps", "multi-node set-up: processes, this process's rank, GPUs per node, NCCL's init (mpi, "
     "a shared file or TCP) and its path and server", "mpirun or srun starts the ranks, each picks its GPU from its local "
     "rank, and NCCL's id is broadcast over MPI"},
};

static const char* lp_flag_name(const LPFlagSpec* s) { return s->name ? s->name : s->letter; }

// The name of the flag that sets `field`, for errors: LP_FLAG_NAME(B) is "-b".
static const char* lp_flag_name_of(size_t field) {
    for (int k = 0; k < LP_NUM_FLAGS; k++)
        if (lp_flag_specs[k].field == field) return lp_flag_name(&lp_flag_specs[k]);
    lp_fail("no flag sets field %zu of LPFlags", field);
    return NULL;
}
#define LP_FLAG_NAME(x) lp_flag_name_of(offsetof(LPFlags, x))

// The header names a parallel setting by its LPParallel field (lp_setting_namer); here, by the flag that sets
// it. The micro-batches per step come from -d.
static const char* lp_setting_flag(size_t offset) {
    for (int k = 0; k < LP_NUM_FLAGS; k++)
        if (lp_flag_specs[k].field == offsetof(LPFlags, par) + offset) return lp_flag_name(&lp_flag_specs[k]);
    return offset == offsetof(LPParallel, micro_batches) ? "-d / (-b * -t * d)" : NULL;
}

static const char* lp_flag_default(const LPFlagSpec* s) {
#ifdef LLMPAR_CPU
    return s->cpu;
#else
    return s->cuda;
#endif
}

// How many values llm.c gives the letter of a switch (0, 1) or of a flag with levels.
static int lp_llmc_count(const LPFlagSpec* s) {
    int n = 0;
    if (!s->levels) return 2;
    while (s->levels[n]) n++;
    return n;
}

// The width of -h and where its help column starts.
#define LP_HELP_WIDTH 110
#define LP_HELP_COLUMN 28

// Prints words from column `col`, wrapped at LP_HELP_WIDTH, continuation lines starting at `indent`.
static void lp_print_wrapped(const char* text, int col, int indent) {
    while (*text) {
        int len = (int)strcspn(text, " ");
        if (col > indent && col + 1 + len > LP_HELP_WIDTH) {
            lp_log("\n%*s", indent, "");
            col = indent;
        } else if (col > indent) {
            lp_log(" ");
            col++;
        }
        lp_log("%.*s", len, text);
        col += len;
        text += text[len] ? len + 1 : len;
    }
    lp_log("\n");
}

// One entry of -h: its forms, then the text in the help column (below them when they are too wide).
static void lp_print_entry(const char* forms, const char* text) {
    int col = 2 + (int)strlen(forms);
    lp_log("  %s", forms);
    if (col >= LP_HELP_COLUMN) {
        lp_log("\n");
        col = 0;
    }
    lp_log("%*s", LP_HELP_COLUMN - col, "");
    lp_print_wrapped(text, LP_HELP_COLUMN, LP_HELP_COLUMN);
}

static void lp_usage(void) {
    lp_log("usage: train_gpt [flags]   (train_gpt_cpu and train_gpt_emu take the same)\n");
    lp_print_wrapped("Flags of one or two letters are llm.c's and mean what they mean in llm.c's train_gpt2.cu. "
                     "Defaults in brackets, [CPU, CUDA] where the two builds differ.", 0, 0);
    for (int k = 0; k < LP_NUM_FLAGS; k++) {
        const LPFlagSpec* s = &lp_flag_specs[k];
        char forms[80] = "", text[1024];
        int len = 0;
        if (s->name) len = snprintf(forms, sizeof(forms), "%s%s%s", s->name, s->metavar ? " " : "", s->metavar ? s->metavar : "");
        if (s->letter) {
            len += snprintf(forms + len, sizeof(forms) - len, "%s%s ", len ? ", " : "", s->letter);
            if (s->type == LP_FLAG_SWITCH || s->levels)  // llm.c's number: 0|1, 0|1|2
                for (int j = 0; j < lp_llmc_count(s); j++) len += snprintf(forms + len, sizeof(forms) - len, "%s%d", j ? "|" : "", j);
            else
                snprintf(forms + len, sizeof(forms) - len, "%s", s->metavar);
        }
        if (!s->cpu) snprintf(text, sizeof(text), "%s", s->help);
        else if (strcmp(s->cpu, s->cuda) == 0) snprintf(text, sizeof(text), "%s [%s]", s->help, s->cpu[0] ? s->cpu : "none");
        else snprintf(text, sizeof(text), "%s [%s CPU, %s CUDA]", s->help, s->cpu, s->cuda);
        lp_print_entry(forms, text);
    }
    lp_print_entry("-h, --help", "this help");
    lp_log("llm.c's flags that are not here:\n");
    for (size_t k = 0; k < sizeof(lp_llmc_absent) / sizeof(lp_llmc_absent[0]); k++) {
        char text[1024];
        snprintf(text, sizeof(text), "llm.c: %s. Here: %s.", lp_llmc_absent[k].meaning, lp_llmc_absent[k].here);
        lp_print_entry(lp_llmc_absent[k].letters, text);
    }
}

// An error in the flags a rank was given. Each rank parses its own command line, and an MPMD launch may give
// the ranks different ones, so no rank may stop alone (the others would wait in their first collective): the
// error's line is kept and the parser returns to lp_parse_flags (a jump), and lp_flags_agree prints one line
// for the whole job.
static jmp_buf lp_flag_jump;
static char lp_flag_error[512];
static LP_PRINTF(1, 2) void lp_flag_fail(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(lp_flag_error, sizeof(lp_flag_error), fmt, ap);
    va_end(ap);
    longjmp(lp_flag_jump, 1);
}

static int lp_parse_int(const char* flag, const char* v) {
    char* end;
    long x = strtol(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x < -2147483647L || x > 2147483647L)
        lp_flag_fail("flag %s: '%s' is not an integer", flag, v);
    return (int)x;
}

// A seed: any of the 2^64 values, written in decimal (a sign is refused: strtoull would wrap "-5" around).
static unsigned long long lp_parse_seed(const char* flag, const char* v) {
    char* end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (*v < '0' || *v > '9' || *end != '\0' || errno == ERANGE)
        lp_fail_all("flag %s: '%s' is not a seed (an integer from 0 to 18446744073709551615)", flag, v);
    return x;
}

static float lp_parse_float(const char* flag, const char* v) {
    char* end;
    float x = strtof(v, &end);
    if (*v == '\0' || *end != '\0' || !isfinite(x)) lp_flag_fail("flag %s: '%s' is not a number", flag, v);
    return x;
}

// Stores v, typed after the form `as`, in s's field of f; a switch is on unless v is "0".
static void lp_flag_set(LPFlags* f, const LPFlagSpec* s, const char* as, const char* v) {
    char* p = (char*)f + s->field;
    switch (s->type) {
    case LP_FLAG_INT: *(int*)p = lp_parse_int(as, v); break;
    case LP_FLAG_SEED: *(unsigned long long*)p = lp_parse_seed(as, v); break;
    case LP_FLAG_FLOAT: *(float*)p = lp_parse_float(as, v); break;
    case LP_FLAG_STRING: *(const char**)p = v; break;
    case LP_FLAG_SWITCH: *(int*)p = !v || strcmp(v, "0") != 0; break;
    case LP_FLAG_CHOICE: {
        int k = 0;
        while (s->choices[k] && strcmp(v, s->choices[k]) != 0) k++;
        if (s->choices[k]) {
            *(int*)p = k;
            break;
        }
        char names[256];
        lp_flag_fail("flag %s: must be %s, got '%s'", as, lp_names_text(names, sizeof(names), s->choices), v);
    }
    }
}

// The defaults make a no-flag run a quick, visible lesson: a small model on tinyshakespeare, sized for
// the device the build targets.
static void lp_flags_default(LPFlags* f) {
    memset(f, 0, sizeof(*f));
    if (LP_NUM_FLAGS > (int)sizeof(f->given)) lp_fail("internal: %d flags, room for %d in LPFlags.given", LP_NUM_FLAGS, (int)sizeof(f->given));
    for (int k = 0; k < LP_NUM_FLAGS; k++) {
        const LPFlagSpec* s = &lp_flag_specs[k];
        if (lp_flag_default(s)) lp_flag_set(f, s, lp_flag_name(s), lp_flag_default(s));
    }
}

// The row of the form a ("--zero" or "-z"); *by_letter says which.
static const LPFlagSpec* lp_flag_find(const char* a, int* by_letter) {
    for (int k = 0; k < LP_NUM_FLAGS; k++) {
        const LPFlagSpec* s = &lp_flag_specs[k];
        *by_letter = s->letter && strcmp(a, s->letter) == 0;
        if (*by_letter || (s->name && strcmp(a, s->name) == 0)) return s;
    }
    return NULL;
}

// A flag that is not in the table: one of llm.c's that has no counterpart here, or unknown.
static void lp_flag_unknown(const char* a) {
    for (size_t k = 0; k < sizeof(lp_llmc_absent) / sizeof(lp_llmc_absent[0]); k++) {
        const char* w = strstr(lp_llmc_absent[k].letters, a);
        size_t n = strlen(a);
        if (w && (w == lp_llmc_absent[k].letters || w[-1] == ' ') && (w[n] == ' ' || w[n] == '\0'))
            lp_flag_fail("flag %s is llm.c's (%s) and has no counterpart here: %s", a, lp_llmc_absent[k].meaning,
                        lp_llmc_absent[k].here);
    }
    if (strcmp(a, "--plan") == 0)
        lp_flag_fail("flag --plan is the planner's, a program of its own: make plan_gpt && ./plan_gpt --plan N (dev/plan/plan_gpt.c)");
    lp_flag_fail("unknown flag %s (see -h)", a);
}

// llm.c's number after a letter (-y 1, -r 2) as this flag's value: a switch's 0 or 1, or the level's name.
static const char* lp_llmc_value(const LPFlagSpec* s, const char* as, const char* v) {
    int n = lp_llmc_count(s), k = lp_parse_int(as, v);
    if (k < 0 || k >= n) lp_flag_fail("flag %s: must be 0 .. %d (llm.c's values), got %d", as, n - 1, k);
    return s->levels ? s->levels[k] : k ? "1" : "0";
}

// Returns 1, 0 when -h was given, or -1 for an error (its line in lp_flag_error).
static int lp_parse_flags(LPFlags* f, int argc, char** argv) {
    if (setjmp(lp_flag_jump)) return -1;
    lp_flags_default(f);
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) return 0;
        if (a[0] != '-') lp_flag_fail("unexpected argument '%s' (flags start with -, see -h)", a);
        int by_letter;
        const LPFlagSpec* s = lp_flag_find(a, &by_letter);
        if (!s) lp_flag_unknown(a);
        const char* v = NULL;  // a switch's long form takes no value
        if (s->type != LP_FLAG_SWITCH || by_letter) {
            if (i + 1 >= argc) lp_flag_fail("flag %s needs a value", a);
            v = argv[++i];
        }
        if (by_letter && (s->type == LP_FLAG_SWITCH || s->levels)) v = lp_llmc_value(s, a, v);
        lp_flag_set(f, s, a, v);
        f->given[s - lp_flag_specs] = 1;
    }
    return 1;
}

// Whether the flag of LPFlags field `field` was typed.
static int lp_flag_typed(const LPFlags* f, size_t field) {
    for (int k = 0; k < LP_NUM_FLAGS; k++)
        if (lp_flag_specs[k].field == field) return f->given[k];
    return 0;
}

// The flags' values checked, each against its range and the others; a bad one is one line naming it.
static void lp_trace_window(const LPFlags* f, int* from, int* to);  // (--trace, --trace-steps: with the timeline below)
static void lp_trace_check_path(const LPFlags* f, const LPProcess* proc);

static void lp_check_flags(LPFlags* f) {
    // the flags' names below come from the table: LP_FLAG_NAME(B) is "-b"
    if (f->B < 1) lp_fail_all("flag %s: micro-batch size must be >= 1, got %d", LP_FLAG_NAME(B), f->B);
    if (f->T < 1) lp_fail_all("flag %s: sequence length must be >= 1, got %d", LP_FLAG_NAME(T), f->T);
    if (f->max_steps < 0) lp_fail_all("flag %s: steps must be >= 0, got %d", LP_FLAG_NAME(max_steps), f->max_steps);
    if (f->lr <= 0.0f) lp_fail_all("flag %s: learning rate must be > 0, got %g", LP_FLAG_NAME(lr), f->lr);
    if (f->warmup < 0 || f->val_every < 0 || f->val_batches < 0 || f->sample_every < 0 || f->ckpt_every < 0 || f->gen_tokens < 0 ||
        f->eval_every < 0)
        lp_fail_all("flags %s %s %s %s %s %s %s must not be negative", LP_FLAG_NAME(warmup), LP_FLAG_NAME(val_every),
                    LP_FLAG_NAME(val_batches), LP_FLAG_NAME(sample_every), LP_FLAG_NAME(gen_tokens), LP_FLAG_NAME(ckpt_every),
                    LP_FLAG_NAME(eval_every));
    if (f->eval_every > 0 && f->hellaswag[0] == '\0')
        lp_fail_all("flag %s: evaluates %s FILE, which is not given", LP_FLAG_NAME(eval_every), LP_FLAG_NAME(hellaswag));
    if (f->resume && f->out_dir[0] == '\0')
        lp_fail_all("flag %s needs %s DIR to find checkpoints in", LP_FLAG_NAME(resume), LP_FLAG_NAME(out_dir));
    const LPParallel* par = &f->par;
    if (par->zero < 0 || par->zero > 3) lp_fail_all("flag %s: stage must be 0..3, got %d", LP_FLAG_NAME(par.zero), par->zero);
    if (f->trace_steps[0] && !f->trace[0]) lp_fail_all("flag %s: only with %s FILE", LP_FLAG_NAME(trace_steps), LP_FLAG_NAME(trace));
    if (!(f->gpu_mem >= 0.0f)) lp_fail_all("flag %s: must be >= 0 (0: the machine's), got %g", LP_FLAG_NAME(gpu_mem), f->gpu_mem);
    if (f->gpu_mem > 0.0f && !f->auto_grid) lp_fail_all("flag %s: only with %s", LP_FLAG_NAME(gpu_mem), LP_FLAG_NAME(auto_grid));
    if (f->trace[0]) {
        int from, to;
        lp_trace_window(f, &from, &to);  // (its errors before the set-up)
    }
    if (par->offload == LP_OFFLOAD_NVME && par->offload_dir[0] == '\0')
        lp_fail_all("flag %s nvme: needs %s DIR, where the optimizer state goes", LP_FLAG_NAME(par.offload), LP_FLAG_NAME(par.offload_dir));
    if (par->offload != LP_OFFLOAD_NVME && par->offload_dir[0] != '\0')
        lp_fail_all("flag %s: only with %s nvme", LP_FLAG_NAME(par.offload_dir), LP_FLAG_NAME(par.offload));
    if (!LP_MASTER_COPY && (par->offload == LP_OFFLOAD_OPTIMIZER || par->offload == LP_OFFLOAD_PARAMS))
        lp_fail_all("flag %s %s: moves GPU state to host memory, where the CPU build's already is (use %s nvme)",
                    LP_FLAG_NAME(par.offload), lp_offload_names[par->offload], LP_FLAG_NAME(par.offload));
    if (par->offload == LP_OFFLOAD_PARAMS && par->zero != 3)
        lp_fail_all("flag %s params: needs %s 3 (it moves the weight shard that ZeRO-3 gathers a layer at a time from)",
                    LP_FLAG_NAME(par.offload), LP_FLAG_NAME(par.zero));
    struct stat dir_st;
    if (par->offload_dir[0] && stat(par->offload_dir, &dir_st) != 0)
        lp_fail_all("flag %s: %s: %s", LP_FLAG_NAME(par.offload_dir), par->offload_dir, strerror(errno));
    if (par->offload_dir[0] && !S_ISDIR(dir_st.st_mode))
        lp_fail_all("flag %s: %s is not a directory", LP_FLAG_NAME(par.offload_dir), par->offload_dir);
    if (par->bucket_mb < 0.0f) lp_fail_all("flag %s: must be >= 0, got %g", LP_FLAG_NAME(par.bucket_mb), par->bucket_mb);
    if (!(f->final_lr_frac >= 0.0f && f->final_lr_frac <= 1.0f))
        lp_fail_all("flag %s: the final learning rate is a fraction of %s, 0 .. 1, got %g", LP_FLAG_NAME(final_lr_frac),
                    LP_FLAG_NAME(lr), f->final_lr_frac);
    if (f->weight_decay < 0.0f) lp_fail_all("flag %s: weight decay must be >= 0, got %g", LP_FLAG_NAME(weight_decay), f->weight_decay);
    // beta 1 would divide AdamW's bias corrections by 0
    if (!(f->beta1 >= 0.0f && f->beta1 < 1.0f)) lp_fail_all("flag %s: must be >= 0 and < 1, got %g", LP_FLAG_NAME(beta1), f->beta1);
    if (!(f->beta2 >= 0.0f && f->beta2 < 1.0f)) lp_fail_all("flag %s: must be >= 0 and < 1, got %g", LP_FLAG_NAME(beta2), f->beta2);
    if (!(f->eps > 0.0f)) lp_fail_all("flag %s: must be > 0, got %g", LP_FLAG_NAME(eps), f->eps);
    if (f->grad_clip < 0.0f) lp_fail_all("flag %s: must be >= 0 (0: no clipping), got %g", LP_FLAG_NAME(grad_clip), f->grad_clip);
    if (!(f->moe.capacity >= 0.0f)) lp_fail_all("flag %s: must be >= 0 (0: no token dropped), got %g", LP_FLAG_NAME(moe.capacity), f->moe.capacity);
    if (!(f->moe.aux_coef >= 0.0f)) lp_fail_all("flag %s: must be >= 0, got %g", LP_FLAG_NAME(moe.aux_coef), f->moe.aux_coef);
    if (!(f->moe.z_coef >= 0.0f)) lp_fail_all("flag %s: must be >= 0, got %g", LP_FLAG_NAME(moe.z_coef), f->moe.z_coef);
    if (f->ckpt_every > 0 && f->out_dir[0] == '\0')
        lp_fail_all("flag %s: checkpoints need %s DIR to go in", LP_FLAG_NAME(ckpt_every), LP_FLAG_NAME(out_dir));
    if (f->timeout_minutes < 0.0f)
        lp_fail_all("flag %s: must be >= 0 (0: the default rule), got %g", LP_FLAG_NAME(timeout_minutes), f->timeout_minutes);
    if (!(f->straggler >= 0.0f)) lp_fail_all("flag %s: must be >= 0 (0: off), got %g", LP_FLAG_NAME(straggler), f->straggler);
    if (f->ckpt_minutes < 0.0f) lp_fail_all("flag %s: must be >= 0 (0: off), got %g", LP_FLAG_NAME(ckpt_minutes), f->ckpt_minutes);
    if (f->ckpt_minutes > 0.0f && f->out_dir[0] == '\0')
        lp_fail_all("flag %s: checkpoints need %s DIR to go in", LP_FLAG_NAME(ckpt_minutes), LP_FLAG_NAME(out_dir));
    if (f->keep < 0) lp_fail_all("flag %s: must be >= 0 (0: keep all), got %d", LP_FLAG_NAME(keep), f->keep);
    if (f->shuffle != 0 && f->shuffle != 1)
        lp_fail_all("flag %s: must be 0 (file order) or 1 (shuffled), got %d", LP_FLAG_NAME(shuffle), f->shuffle);
    if (f->on_divergence == LP_ROLLBACK && f->out_dir[0] == '\0')
        lp_fail_all("flag %s rollback: needs %s DIR, for the checkpoints to roll back to", LP_FLAG_NAME(on_divergence),
                    LP_FLAG_NAME(out_dir));
    if (f->loss_spike < 0.0f) lp_fail_all("flag %s: must be >= 0 (0: off), got %g", LP_FLAG_NAME(loss_spike), f->loss_spike);
    if (strcmp(lp_dtype_names[f->dtype], LP_FLOATX_NAME) != 0)
        lp_fail_all("flag %s %s: this engine computes in %s, a choice made when it is built (%s)", LP_FLAG_NAME(dtype),
                    lp_dtype_names[f->dtype], LP_FLOATX_NAME,
                    f->dtype == 0 ? "the CPU engine, make train_gpt_cpu, is the fp32 one" :
                    f->dtype == 1 ? "make train_gpt builds the bf16 engine" : "make train_gpt_fp16 builds the fp16 engine");
    const LPLossScaler* ls = &f->scaler;
    if (!(ls->scale == 0.0f || (ls->scale >= 1.0f && ls->scale <= LP_LOSS_SCALE_MAX)))
        lp_fail_all("flag %s: must be 0 (off) or 1 .. 2^24, got %g", LP_FLAG_NAME(scaler.scale), ls->scale);
    if (!(ls->backoff > 0.0f && ls->backoff < 1.0f))
        lp_fail_all("flag %s: must be > 0 and < 1, got %g", LP_FLAG_NAME(scaler.backoff), ls->backoff);
    if (!(ls->growth >= 1.0f && ls->growth <= LP_LOSS_SCALE_MAX))
        lp_fail_all("flag %s: must be 1 .. 2^24, got %g", LP_FLAG_NAME(scaler.growth), ls->growth);
    if (ls->window < 1) lp_fail_all("flag %s: must be >= 1, got %d", LP_FLAG_NAME(scaler.window), ls->window);
    if (ls->scale == 0.0f && (lp_flag_typed(f, LP_FIELD(scaler.backoff)) || lp_flag_typed(f, LP_FIELD(scaler.growth)) ||
                              lp_flag_typed(f, LP_FIELD(scaler.window))))
        lp_fail_all("flags %s %s %s: only with %s S (loss scaling is off)", LP_FLAG_NAME(scaler.backoff),
                    LP_FLAG_NAME(scaler.growth), LP_FLAG_NAME(scaler.window), LP_FLAG_NAME(scaler.scale));
    if (f->resume_changed && !f->resume)
        lp_fail_all("flag %s: only with %s", LP_FLAG_NAME(resume_changed), LP_FLAG_NAME(resume));
    if (f->resume && f->overwrite)
        lp_fail_all("flags %s and %s: continue the run in %s, or replace it, not both", LP_FLAG_NAME(resume),
                    LP_FLAG_NAME(overwrite), LP_FLAG_NAME(out_dir));
    if (par->tp < 1 || par->tp > 65536 || par->pp < 1 || par->pp > 65536 || par->vpp < 1 || par->vpp > 65536 || par->cp < 1 ||
        par->cp > 65536)
        lp_fail_all("flags %s %s %s %s: sizes must be 1 .. 65536, got %d, %d, %d, %d", LP_FLAG_NAME(par.tp), LP_FLAG_NAME(par.pp),
                    LP_FLAG_NAME(par.vpp), LP_FLAG_NAME(par.cp), par->tp, par->pp, par->vpp, par->cp);
    if (par->cp > 1 && f->T % (2 * par->cp))
        lp_fail_all("flag %s %d: sequence length %s %d does not split into 2*%d = %d chunks of equal length", LP_FLAG_NAME(par.cp),
                    par->cp, LP_FLAG_NAME(T), f->T, par->cp, 2 * par->cp);
    if (par->cp > 1 && f->attention != LP_ATTENTION_FLASH)  // (the ring's blocks run on the flash kernels)
        lp_fail_all("flags %s %s and %s %d: context parallelism's ring runs on the flash kernels; drop one", LP_FLAG_NAME(attention),
                    lp_attention_names[f->attention], LP_FLAG_NAME(par.cp), par->cp);
    if (par->sp && par->tp < 2)
        lp_fail_all("flag %s: sequence parallelism splits rows over the TP group; it needs %s 2 or more", LP_FLAG_NAME(par.sp),
                    LP_FLAG_NAME(par.tp));
    if (!(f->outer.lr > 0.0f))
        lp_fail_all("flag %s: must be > 0, got %g", LP_FLAG_NAME(outer.lr), f->outer.lr);
    if (!(f->outer.momentum >= 0.0f && f->outer.momentum < 1.0f))
        lp_fail_all("flag %s: must be >= 0 and < 1, got %g", LP_FLAG_NAME(outer.momentum), f->outer.momentum);
    if (!par->diloco && (lp_flag_typed(f, LP_FIELD(outer.lr)) || lp_flag_typed(f, LP_FIELD(outer.momentum))))
        lp_fail_all("flags %s %s: only with %s H", LP_FLAG_NAME(outer.lr), LP_FLAG_NAME(outer.momentum), LP_FLAG_NAME(par.diloco));
    if (par->diloco > 0 && f->ckpt_every % par->diloco)
        lp_fail_all("flag %s %d with %s %d: DiLoCo saves between rounds, when its replicas are equal; make %s a multiple of %d",
                    LP_FLAG_NAME(ckpt_every), f->ckpt_every, LP_FLAG_NAME(par.diloco), par->diloco, LP_FLAG_NAME(ckpt_every),
                    par->diloco);
    if (par->sp && f->T % par->tp)
        lp_fail_all("flag %s: sequence length %s %d does not split over %s %d ranks", LP_FLAG_NAME(par.sp), LP_FLAG_NAME(T), f->T,
                    LP_FLAG_NAME(par.tp), par->tp);
}

// A flag's value as parsed, as text in buf: a switch 1 on, 0 off; an empty string ""; a number in as few
// digits as give it back exactly.
static const char* lp_flag_value(const LPFlags* f, const LPFlagSpec* s, char* buf, size_t size) {
    const char* p = (const char*)f + s->field;
    switch (s->type) {
    case LP_FLAG_INT:
    case LP_FLAG_SWITCH: snprintf(buf, size, "%d", *(const int*)p); break;
    case LP_FLAG_SEED: snprintf(buf, size, "%llu", *(const unsigned long long*)p); break;
    case LP_FLAG_FLOAT: {
        float x = *(const float*)p;
        snprintf(buf, size, "%g", x);
        if (strtof(buf, NULL) != x) snprintf(buf, size, "%.9g", x);
        break;
    }
    case LP_FLAG_STRING: snprintf(buf, size, "%s", (*(const char* const*)p)[0] ? *(const char* const*)p : "\"\""); break;
    case LP_FLAG_CHOICE: snprintf(buf, size, "%s", s->choices[*(const int*)p]); break;
    }
    return buf;
}

// Ranks agree or stop. Every rank must be given the same flags (an MPMD launch, or a script that builds
// each rank's command, can give them different ones: with another -b a rank trained on with the wrong
// tokens per step; with another model the job ended in MPI's errors), run the same build, and find the same
// header in -e's model file (the file can differ between machines). At the start, one all-gather of a
// digest (CRC32C) of each flag's value (--offload-dir aside: a folder of each machine's), of the build and of
// the header; where a rank differs from rank 0, every rank stops with one line naming the first such rank and
// what differs, with both values.
static void lp_ranks_agree(const LPFlags* f, const LPProcess* proc) {
    if (proc->world == 1) return;
    enum { BUILD = LP_NUM_FLAGS, HEADER, N };
    struct { char text[LP_PATH_MAX]; int h[LP_HEADER_INTS]; } mine, theirs;
    uint32_t digest[N];
    for (int k = 0; k < LP_NUM_FLAGS; k++) {
        lp_flag_value(f, &lp_flag_specs[k], mine.text, sizeof(mine.text));
        int local = lp_flag_specs[k].field == LP_FIELD(par.offload_dir);
        digest[k] = local ? 0 : lp_crc32c(0, (const unsigned char*)mine.text, strlen(mine.text));
    }
    snprintf(mine.text, sizeof(mine.text), "%s build (%s)", LP_BUILD_GPU ? "CUDA" : "CPU", sizeof(floatX) == 2 ? "bf16" : "fp32");
    digest[BUILD] = lp_crc32c(0, (const unsigned char*)mine.text, strlen(mine.text));
    memset(mine.h, 0, sizeof(mine.h));  // (a preset, or a file this rank cannot read: 0s, and the usual error later)
    FILE* file = fopen(f->init, "rb");
    if (file && fread(mine.h, sizeof(int), LP_HEADER_INTS, file) != LP_HEADER_INTS) memset(mine.h, 0, sizeof(mine.h));
    if (file) fclose(file);
    digest[HEADER] = lp_crc32c(0, (const unsigned char*)mine.h, sizeof(mine.h));
    uint32_t* all = (uint32_t*)lp_host_malloc((size_t)proc->world * sizeof(digest), "the ranks' flag digests");
    lp_world_all_gather(proc, digest, sizeof(digest), all);
    int rank = 0, k = 0;
    for (int r = 1; r < proc->world && !rank; r++)
        for (k = 0; k < N && !rank; k++)
            if (all[(size_t)r * N + k] != all[k]) rank = r;
    free(all);
    if (!rank) return;
    k--;
    if (k < LP_NUM_FLAGS) lp_flag_value(f, &lp_flag_specs[k], mine.text, sizeof(mine.text));
    else if (k == HEADER) snprintf(mine.text, sizeof(mine.text), "%s", f->init);
    theirs = mine;
    lp_world_broadcast(proc, &theirs, sizeof(theirs), rank);
    const char* same = "every rank must be given the same flags (an MPMD launch, or a script, gave them different ones)";
    if (k < LP_NUM_FLAGS)
        lp_fail_all("rank %d was given %s %s, rank 0 %s %s: %s", rank, lp_flag_name(&lp_flag_specs[k]), theirs.text,
                    lp_flag_name(&lp_flag_specs[k]), mine.text, same);
    if (k == BUILD) lp_fail_all("rank %d runs the %s, rank 0 the %s: every rank must run the same program", rank, theirs.text, mine.text);
    LPConfig a, b;  // the header: its first field that differs
    lp_config_of_header(theirs.h, &a);
    lp_config_of_header(mine.h, &b);
    int field = lp_config_differs(&a, &b);
    char what[128] = "its header differs";
    if (theirs.h[0] != mine.h[0] || theirs.h[1] != mine.h[1])
        snprintf(what, sizeof(what), "magic %d version %d there, %d %d on rank 0", theirs.h[0], theirs.h[1], mine.h[0], mine.h[1]);
    else if (field >= 0)
        snprintf(what, sizeof(what), "%s %d there, %d on rank 0", lp_config_fields[field].what, LP_CONFIG_FIELD(&a, field),
                 LP_CONFIG_FIELD(&b, field));
    lp_fail_all("flag -e %s: rank %d reads a model file with another header than rank 0's (%s): the file differs between the "
                "ranks' machines; every rank must read the same model", f->init, rank, what);
}

// The ranks' parses of their flags (lp_parse_flags' results), agreed before anything else: one all-gather of
// each rank's result and error line. An error stops every rank with one line: as a one-rank run prints it
// when every rank met the same, else naming the first rank that met one; so does -h given to some ranks
// only. Returns the result, the same on every rank.
static int lp_flags_agree(const LPProcess* proc, int result) {
    typedef struct { int result; char why[sizeof(lp_flag_error)]; } LPParse;
    LPParse mine, *all = (LPParse*)lp_host_malloc((size_t)proc->world * sizeof(LPParse), "the ranks' flag parses");
    memset(&mine, 0, sizeof(mine));
    mine.result = result;
    if (result < 0) memcpy(mine.why, lp_flag_error, sizeof(mine.why));
    lp_world_all_gather(proc, &mine, sizeof(mine), all);
    int first = -1, differ = -1;  // the first rank with an error, the first whose parse differs from rank 0's
    for (int r = 0; r < proc->world; r++) {
        if (first < 0 && all[r].result < 0) first = r;
        if (differ < 0 && memcmp(&all[r], &all[0], sizeof(LPParse)) != 0) differ = r;
    }
    LPParse theirs = all[first < 0 ? 0 : first];
    free(all);
    const char* same = "every rank must be given the same flags (an MPMD launch, or a script, gave them different ones)";
    if (first >= 0 && differ < 0) lp_fail_all("%s", theirs.why);
    if (first >= 0) lp_fail_all("rank %d: %s; %s", first, theirs.why, same);
    if (differ >= 0) lp_fail_all("rank %d was given -h, rank %d not: %s", result ? differ : 0, result ? 0 : differ, same);
    return result;
}

// --print-flags: every flag's value as parsed, one line each under its name
static void lp_print_flags(const LPFlags* f) {
    char value[LP_PATH_MAX];
    for (int k = 0; k < LP_NUM_FLAGS; k++) lp_log("%-20s %s\n", lp_flag_name(&lp_flag_specs[k]), lp_flag_value(f, &lp_flag_specs[k], value, sizeof(value)));
}

#define LP_STRIKES 3  // --on-divergence skip or rollback: divergences in a row (skip) or back to one checkpoint (rollback)

// A test hook's variable, read in a build with LLMPAR_TEST_HOOKS only (make's train_gpt_*_hooks): "k" or
// "k:rest" gives the step k (0: unset, or not a number) and *rest (NULL without one).
static int lp_hook_step(const char* name, const char** rest) {
#ifdef LLMPAR_TEST_HOOKS
    const char* e = getenv(name);
#else
    const char* e = NULL;
    (void)name;
#endif
    char* end = NULL;
    int k = e ? (int)strtol(e, &end, 10) : 0;
    *rest = e && *end == ':' ? end + 1 : NULL;
    return k;
}

// Test hook for the divergence guard: LLMPAR_LOSS_AT=k:x makes the loss of this process's k-th training step
// read x (nan, 1e9).
static float lp_injected_loss(int k, float loss) {
    static int at = -1;  // the variable is read once, not every step
    static float value;
    if (at < 0) {
        const char* rest;
        at = lp_hook_step("LLMPAR_LOSS_AT", &rest);
        if (rest) value = strtof(rest, NULL);
        else at = 0;
    }
    return k == at ? value : loss;
}

// Test hook for loss scaling: LLMPAR_OVERFLOW_AT=k[:r] makes the gradients of this process's k-th training
// step overflow (on world rank r alone, when given): its loss's gradient seed is infinite there, as the seed
// times a scale too large would be, so backward spreads infs and NaNs through every gradient it reaches.
// Returns the loss scale step k runs with.
static float lp_injected_overflow(int k, int rank, float scale) {
    static int at = -1, on = -1;  // (read once)
    if (at < 0) {
        const char* rest;
        at = lp_hook_step("LLMPAR_OVERFLOW_AT", &rest);
        if (rest) on = (int)strtol(rest, NULL, 10);
    }
    return k == at && (on < 0 || on == rank) ? INFINITY : scale;
}

static void lp_mkdirs(const char* dir) {
    char path[LP_PATH_MAX];
    lp_path(path, "%s", dir);
    for (char* p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        mkdir(path, 0755);
        *p = '/';
    }
    if (mkdir(path, 0755) != 0 && errno != EEXIST) lp_fail("flag -o: cannot create %s: %s", dir, strerror(errno));
}

// seconds as "m:ss", or "h:mm:ss" from an hour on
static const char* lp_duration(char* buf, size_t size, double seconds) {
    long s = (long)(seconds + 0.5);
    if (s >= 3600) snprintf(buf, size, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
    else snprintf(buf, size, "%ld:%02ld", s / 60, s % 60);
    return buf;
}

// "shuffled with --seed N" or "in file order (--shuffle 0)", for messages
static const char* lp_data_order(char* buf, size_t size, int shuffle, unsigned long long seed) {
    if (shuffle) snprintf(buf, size, "shuffled with --seed %llu", seed);
    else snprintf(buf, size, "in file order (--shuffle 0)");
    return buf;
}

// Mean loss over val batches: the whole val set once when n_batches is 0.
static float lp_evaluate(LPStage* st, LPDataLoader* val, int n_batches) {
    size_t n = lp_dataloader_batches_per_epoch(val);
    if (n_batches > 0 && (size_t)n_batches < n) n = (size_t)n_batches;
    lp_dataloader_reset(val);
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) {
        lp_dataloader_next(val);
        sum += lp_stage_forward_only(st, val->inputs, val->targets, val->B, val->T);
    }
    return (float)(sum / n);
}

// HellaSwag as llm.c scores it: every completion after its context through the model, the sum of its
// tokens' losses. right[0]: the examples whose right completion has the lowest sum (acc), right[1]: the
// lowest mean per token (acc_norm), over the whole file, the same on every rank. The data-parallel ranks
// take consecutive shares of the examples (llm.c's split) and put their completions B to a forward; all
// run as many forwards (ZeRO-3 gathers weights in each), a rank out of rows running its first again
// unscored. The losses are on the last pipeline stage (every TP rank of it has all of them): it scores,
// and the counts are summed over the pipeline (the other stages add 0) and over the data-parallel ranks.
// With context parallelism each cp rank has its chunks' losses: put at their positions in zeroed rows and
// summed over the cp group, every cp rank has the whole rows (and scores them alike).
static void lp_hellaswag(LPStage* st, const LPEvalSet* s, int B, const LPGroup* dp, int* right) {
    const LPModel* m = &st->chunks[st->par->vpp - 1];
    int d = st->par->dp, share = (s->num_examples + d - 1) / d, forwards = 0, e0 = 0, e1 = 0, cp = st->cp->size;
    int multiple = st->par->sp ? m->tp_size : 1;  // (SP: the rows split over the TP group)
    if (cp > 1) {  // (a cp rank's T/cp rows do; and T splits into 2cp chunks)
        multiple *= cp;
        if (multiple % (2 * cp)) multiple *= 2;
    }
    for (int k = 0; k < d; k++) {  // rank k's examples; the forwards: enough for the most rows of any share
        int k0 = k * share < s->num_examples ? k * share : s->num_examples, k1 = k0 + share < s->num_examples ? k0 + share : s->num_examples;
        int n = (s->first_row[k1] - s->first_row[k0] + B - 1) / B;
        if (n > forwards) forwards = n;
        if (k == dp->rank) e0 = k0, e1 = k1;
    }
    int r0 = s->first_row[e0], rows = s->first_row[e1] - r0;
    size_t most = (size_t)B * m->T * cp;  // (a forward's tokens: B rows of up to -t; a cp rank's model has T/cp rows)
    int* inputs = (int*)lp_host_malloc(most * sizeof(int), "hellaswag inputs");
    int* targets = (int*)lp_host_malloc(most * sizeof(int), "hellaswag targets");
    double* loss = (double*)lp_host_malloc((size_t)(rows ? rows : 1) * sizeof(double), "hellaswag losses");
    float* whole = cp > 1 ? (float*)lp_host_malloc(most * sizeof(float), "hellaswag rows") : NULL;
    for (int i = 0; i < forwards; i++) {
        int first = i * B, n = rows - first < B ? rows - first : B;
        int T = lp_evalset_batch(s, n > 0 ? r0 + first : 0, n > 0 ? n : 1, multiple, inputs, targets);
        lp_stage_forward_only(st, inputs, targets, n > 0 ? n : 1, T);
        const float* losses = m->losses_host;
        if (m->last && cp > 1) {
            int Tl = T / cp;
            memset(whole, 0, (size_t)(n > 0 ? n : 1) * T * sizeof(float));
            for (int b = 0; b < (n > 0 ? n : 1); b++)
                for (int t = 0; t < Tl; t++) whole[(size_t)b * T + lp_cp_position(t, Tl, st->cp->rank, cp)] = losses[(size_t)b * Tl + t];
            lp_all_reduce_host(st->cp, whole, (n > 0 ? n : 1) * T, 0);
            losses = whole;
        }
        if (m->last)
            for (int b = 0; b < n; b++) loss[first + b] = lp_evalset_row_loss(s, r0 + first + b, losses + (size_t)b * T);
    }
    float counts[2] = {0.0f, 0.0f};  // exact in a float up to 2^24 examples
    if (m->last) {
        int acc, acc_norm;
        lp_evalset_score(s, e0, e1, loss, &acc, &acc_norm);
        counts[0] = (float)acc;
        counts[1] = (float)acc_norm;
    }
    lp_all_reduce_host(st->pp, counts, 2, 0);
    lp_all_reduce_host(dp, counts, 2, 0);
    right[0] = (int)counts[0];
    right[1] = (int)counts[1];
    free(inputs);
    free(targets);
    free(loss);
    free(whole);
}

// Sample from the model, starting from its vocabulary's document start (lp_sample_start: GPT-2's <|endoftext|>,
// Llama 3's <|begin_of_text|>): each token through the model once, the keys and values
// of those before it in the key-value caches (one forward of a row per token), the next drawn from its logits.
// The logits are on the last pipeline stage, and with tensor parallelism each of its ranks has a slice:
// the row is summed over the TP and pipeline groups from zero-padded slices, so every rank draws the same
// token. Sequence parallelism needs the rows to split over the group: each forward runs the block of t rows
// (t the group's size) holding the token, those before it again (the cache takes the same keys and values)
// and those after it the start token (attention is causal, and the next forwards overwrite their keys).
static void lp_sample(LPStage* st, const LPTokenizer* tok, int gen_tokens, uint64_t* rng, int step) {
    const LPModel* m = &st->chunks[st->par->vpp - 1];  // on the last stage: the model's last chunk
    const LPConfig* c = &m->cfg;
    int T = m->T * m->cp_size;  // -t (context parallelism trains on a share of it; each rank samples whole sequences)
    int n = gen_tokens + 1 < T ? gen_tokens + 1 : T, Vl = c->padded_vocab_size / m->tp_size;
    int rows = m->par->sp ? m->tp_size : 1, positions = (n + rows - 1) / rows * rows;  // (the last block whole)
    int* tokens = (int*)lp_host_malloc((size_t)positions * sizeof(int), "sample tokens");
    float* probs = (float*)lp_host_malloc((size_t)c->padded_vocab_size * sizeof(float), "sample logits");
    for (int t = 0; t < positions; t++) tokens[t] = lp_sample_start(c);  // (GPT-2's <|endoftext|>, Llama 3's <|begin_of_text|>)
    LPUtf8 text = {{0}, 0, 0};
    lp_log("--- sample at step %d ---\n", step);
    lp_stage_cache_alloc(st, 1, positions);
#if defined(LLMPAR_CPU) && defined(_OPENMP)
    // one row's forward is too small to share between threads: its ~40 parallel regions a layer cost a barrier
    // each, more than they save (on a loaded machine, a time slice each); the results are the same on any
    int threads = omp_get_max_threads();
    omp_set_num_threads(1);
#endif
    for (int t = 1; t < n; t++) {  // token t from the logits of token t - 1
        int p0 = (t - 1) / rows * rows;
        lp_stage_forward_cached(st, tokens + p0, 1, rows, p0);
        memset(probs, 0, (size_t)c->padded_vocab_size * sizeof(float));
        if (m->last) lp_to_host_float(probs + (size_t)m->tp_rank * Vl, m->act.logits + (size_t)(t - 1 - p0) * Vl, Vl);
        if (m->tp_size > 1) lp_all_reduce_host(m->tp, probs, c->padded_vocab_size, 0);
        lp_all_reduce_host(st->pp, probs, c->padded_vocab_size, 0);
        int next = lp_sample_draw(probs, c->vocab_size, lp_rand_f32(rng));
        tokens[t] = next;
        if (lp_rank == 0) lp_tokenizer_print(tok, next, &text, stdout);
    }
#if defined(LLMPAR_CPU) && defined(_OPENMP)
    omp_set_num_threads(threads);
#endif
    lp_stage_cache_free(st);
    lp_utf8_end(&text, stdout);
    lp_log("\n--- end of sample ---\n");
    free(tokens);
    free(probs);
}

// A default file (the tokenizer) that is not in the working directory is taken from beside the program when
// it is there, so a run from another directory finds the checkout's; else path as it is (its own notice).
static const char* lp_beside_program(const char* path, char* buf, size_t size) {
    char exe[LP_PATH_MAX];
    ssize_t n = access(path, F_OK) == 0 || path[0] == '/' ? -1 : readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) return path;
    exe[n] = '\0';
    snprintf(buf, size, "%.*s/%s", (int)(strrchr(exe, '/') - exe), exe, path);
    return access(buf, F_OK) == 0 ? buf : path;
}

// The model's shape from -e: a dN preset, or an llm.c file's header. Returns 1 for a preset (a new model).
static int lp_model_config(const LPFlags* f, const LPProcess* proc, LPConfig* cfg) {
    int preset = lp_config_from_name(cfg, f->init);
    char source[LP_PATH_MAX];
    lp_path(source, "-e %s", f->init);
    // checked by rank 0 first (lp_fail there stops everyone), so a bad preset or file is reported once
    for (int pass = 0; pass < 2; pass++) {
        if ((proc->rank == 0) == (pass == 0)) {
            int topk_typed = lp_flag_typed(f, LP_FIELD(moe_topk)), every_typed = lp_flag_typed(f, LP_FIELD(moe_every));
            if (preset) {
                if (!f->moe_experts && (topk_typed || every_typed))
                    lp_fail("flag %s: only with %s (-e %s without it is a dense model)", topk_typed ? "--moe-topk" : "--moe-every",
                            "--moe-experts", f->init);
                if (f->moe_experts) {
                    cfg->moe_experts = f->moe_experts;
                    cfg->moe_topk = f->moe_topk;
                    cfg->moe_every = f->moe_every;
                    lp_path(source, "-e %s --moe-experts %d --moe-topk %d --moe-every %d", f->init, f->moe_experts, f->moe_topk,
                            f->moe_every);
                }
                lp_config_validate(cfg, source);
            } else {
                FILE* file = lp_fopen(f->init, "rb");
                lp_model_file_header(f->init, cfg, file);
                fclose(file);
                // a model file's shape is its own: a flag that says otherwise is refused, never overridden
                const char* own = "(a model file's shape is its own: leave the flag out, or give the file's)";
                if (f->moe_experts && f->moe_experts != cfg->moe_experts)
                    lp_fail("flag --moe-experts %d: %s has %d experts per MoE layer %s", f->moe_experts, f->init, cfg->moe_experts, own);
                if ((topk_typed || every_typed) && !cfg->moe_experts)
                    lp_fail("flag %s %d: %s is a dense model %s", topk_typed ? "--moe-topk" : "--moe-every", topk_typed ? f->moe_topk : f->moe_every,
                            f->init, own);
                if (topk_typed && f->moe_topk != cfg->moe_topk)
                    lp_fail("flag --moe-topk %d: %s sends each token to %d experts %s", f->moe_topk, f->init, cfg->moe_topk, own);
                if (every_typed && f->moe_every != cfg->moe_every)
                    lp_fail("flag --moe-every %d: %s has a MoE layer every %d layers %s", f->moe_every, f->init, cfg->moe_every, own);
            }
        }
        lp_barrier(&proc->world_group);
    }
    return preset;
}

// --aux-loss-layers: a list of distinct layers 1 .. L-1 (the output of layer L is the main loss's input).
static int lp_parse_aux_layers(const char* list, int L, int* aux) {
    int n = 0;
    for (const char* q = list; *q;) {
        char* end;
        long x = strtol(q, &end, 10);
        if (end == q || (*end && *end != ',')) lp_fail_all("flag --aux-loss-layers: '%s' is not a list of layers like 4,8", list);
        if (x < 1 || x >= L) lp_fail_all("flag --aux-loss-layers: layer %ld is not an inner layer of the model's %d (1 .. %d)", x, L, L - 1);
        for (int j = 0; j < n; j++)
            if (aux[j] == x) lp_fail_all("flag --aux-loss-layers: layer %ld is listed twice", x);
        if (n == LP_MAX_AUX) lp_fail_all("flag --aux-loss-layers: at most %d layers", LP_MAX_AUX);
        aux[n++] = (int)x;
        q = *end ? end + 1 : end;
    }
    return n;
}

// ----------------------------------------------------------------------------------------------------
// The run: what the step loop works on, set up once (model, data, output, resume), then stepped.

typedef struct {
    const LPFlags* f;
    const LPProcess* proc;
    LPConfig cfg;
    int preset;                  // the model is new, of -e's preset shape (else from -e's file)
    LPStage stage;               // this rank's chunks of the model
    int aux[LP_MAX_AUX];         // --aux-loss-layers
    int total_batch, accum;      // tokens per step; micro-batches per step (the pipeline's m)
    LPDataLoader train, val;
    int has_val;
    LPEvalSet hellaswag;         // --eval-hellaswag, every rank's copy (num_examples 0: none)
    LPTokenizer tok;
    LPAdamW opt;
    LPTrainState state;          // what a checkpoint holds besides weights and optimizer state
    char* identity;              // the run's identity (lp_run_identity), which state.identity points to
    FILE* logf;                  // -o DIR/main.log, rank 0
    int lock_fd;                 // -o DIR/lock, held by rank 0 for the run (lp_dir_lock); -1 on the other ranks
    int first_step;              // 0, or the step resumed from
    int on_disk;                 // the step whose state the newest checkpoint holds (-1: none)
    int rollback, skip;          // --on-divergence
    int strikes, computed;       // divergences since the run last moved on; training steps computed
    LPLossWindow recent;         // the last steps' losses, for spotting spikes
    double step_s[32];           // the last steps' times, for the watchdog's default timeout
    double start_s, last_save_s; // the loop's start; the last save (--ckpt-minutes)
    // reports: the timed steps (all but the first), the TP group's traffic over traffic_steps steps (the
    // stage times its own chunks)
    double flops_per_step, peak, sum_ms, sum_update_ms;
    int timed_steps, traffic_steps;
    LPGroup tp_traffic, cp_traffic, dp_traffic;
    // the straggler check (--straggler): this rank's sums over the window under way; the windows compared,
    // those that named a rank, and the furthest behind a rank was (its name, the window's first step)
    double window_busy_s, window_step_s;
    int window_steps, windows, named_windows;
    double worst_lag_ms, worst_share;
    int worst_rank, worst_from;
    char worst_who[160];
} LPTrainRun;

// The start-up report: engine, grid, model, pipeline, data, batch, schedule and rank 0's memory.
static void lp_report_setup(const LPTrainRun* r, size_t rank_params, double param_bytes, double grad_bytes,
                            double optim_bytes, double offloaded_bytes, double act_bytes) {
    const LPFlags* f = r->f;
    const LPProcess* proc = r->proc;
    const LPParallel* par = proc->par;
    double MiB = 1048576.0;
    lp_log("engine           %s\n", lp_engine_name());
    lp_log("grid             %d ranks: t=%d", proc->world, par->tp);
    if (par->cp > 1) lp_log(" cp=%d", par->cp);
    lp_log(" d=%d p=%d%s", par->dp, par->pp, par->sp ? ", sequence parallel" : "");
    if (par->ep > 1) lp_log(", experts over ep=%d of the d ranks (%d replicas)", par->ep, par->dp / par->ep);
    lp_log("\n");
    if (par->cp > 1) {  // the causal balance: the query-key pairs each rank's chunks score
        double most = 0.0, least = INFINITY;
        for (int i = 0; i < par->cp; i++) {
            double pairs = lp_cp_attention_pairs(f->T, i, par->cp);
            most = pairs > most ? pairs : most;
            least = pairs < least ? pairs : least;
        }
        lp_log("context          each sequence's %d tokens in %d chunks of %d, cp rank i holding chunks i and %d-i; attention's "
               "query-key pairs per rank: busiest %.0f, lightest %.0f (%.3fx)\n", f->T, 2 * par->cp, f->T / (2 * par->cp),
               2 * par->cp - 1, most, least, most / least);
    }
    if (par->diloco)
        lp_log("replicas         DiLoCo: the d=%d replicas train apart (own AdamW state, no gradient all-reduce) for %d steps, "
               "then all-reduce their fp32 weights once and take an outer step (Nesterov, lr %g, momentum %g)\n", par->dp,
               par->diloco, f->outer.lr, f->outer.momentum);
    if (par->gossip) {
        char hops[160] = "";
        for (int k = 0, n = 0; k < par->gossip; k++) n += snprintf(hops + n, sizeof(hops) - n, "%si-%d", k ? ", " : "", 1 << k);
        lp_log("replicas         gossip: the d=%d replicas train apart (own AdamW state, no gradient all-reduce); after each step "
               "replica i averages its fp32 weights with those of %s (mod d), 1/%d each\n", par->dp, hops, par->gossip + 1);
    }
    lp_log("model            L=%d C=%d NH=%d V=%d (padded %d) maxT=%d, %zu parameters (%zu on rank 0)\n", r->cfg.num_layers,
           r->cfg.channels, r->cfg.num_heads, r->cfg.vocab_size, r->cfg.padded_vocab_size, r->cfg.max_seq_len,
           r->stage.chunks[0].total_params, rank_params);
    if (r->cfg.moe_experts) {
        char capacity[32] = "none (no token dropped)";
        if (f->moe.capacity > 0.0f) snprintf(capacity, sizeof(capacity), "%g", f->moe.capacity);
        lp_log("experts          %d per MoE layer (layers 0, %d, ...: %d of %d), top-%d: %zu parameters met by each token; "
               "capacity %s, balance loss %g, z-loss %g\n", r->cfg.moe_experts, r->cfg.moe_every,
               lp_layers_having(&r->cfg, LP_ROUTERW, 0, r->cfg.num_layers), r->cfg.num_layers, r->cfg.moe_topk,
               lp_active_params(&r->cfg), capacity, f->moe.aux_coef, f->moe.z_coef);
    }
    if (par->pp > 1) {
        lp_log("pipeline         %d stages x %d chunks, schedule %s, layers per chunk", par->pp, par->vpp,
               lp_schedule_names[par->schedule]);
        int chunks = par->pp * par->vpp;
        for (int k = 0; k < chunks; k++) lp_log("%s%d", k ? "," : " ", r->stage.layers[k]);
        lp_log("%s\n", par->tp > 1 && !par->sp && par->scatter_gather ? ", boundaries scatter-gathered over TP" : "");
        if (r->stage.layers[chunks - 1] == 0)  // (why a stage may hold no layer: the balanced partition's head)
            lp_log("                 the last chunk holds the final LayerNorm and the LM head alone: 6 Vp C FLOPs a token, "
                   "as many as %.1f layers\n", 6.0 * r->cfg.padded_vocab_size * r->cfg.channels /
                   lp_layer_flops(&r->cfg, f->T, par->recompute, 0));
        lp_log("                 stage 0 keeps activations of up to");
        for (int c = 0; c < par->vpp; c++) lp_log("%s %d", c ? "," : "", r->stage.chunks[c].num_slots);
        lp_log(" micro-batches (per chunk) of %d\n", par->micro_batches);
    }
    if (f->max_steps == 0) lp_log("data             no train shard read (-x 0); %d val shard(s)\n", r->has_val ? r->val.num_files : 0);
    else lp_log("data             %d train shard(s), %zu steps per epoch, %s; %d val shard(s)\n", r->train.num_files,
                lp_dataloader_batches_per_epoch(&r->train) / par->micro_batches, f->shuffle ? "shuffled" : "in file order",
                r->has_val ? r->val.num_files : 0);
    if (r->hellaswag.num_examples)
        lp_log("hellaswag        %s: %d examples, %d completions, the longest %d tokens (context + completion)\n", f->hellaswag,
               r->hellaswag.num_examples, r->hellaswag.num_rows, r->hellaswag.longest_row);
    char share[64] = "";
    if (par->cp > 1) snprintf(share, sizeof(share), " (its cp ranks %d rows each)", f->T / par->cp);
    lp_log("batch            B=%d T=%d per rank%s, %d tokens per step, grad accumulation steps: %d\n", f->B, f->T, share,
           r->total_batch, par->micro_batches);
    lp_log("schedule         %d steps, lr %g, warmup %d, %s decay to %g\n", f->max_steps, f->lr, f->warmup,
           lp_decay_names[f->decay], f->lr * f->final_lr_frac);
    if (f->scaler.scale > 0.0f)
        lp_log("loss scale       dynamic, from %.9g: x%g after a step whose gradients overflow (its update skipped on every "
               "rank), x%g after %d clean steps\n", f->scaler.scale, f->scaler.backoff, f->scaler.growth, f->scaler.window);
    lp_log("memory rank 0    ZeRO-%d: params %.2f MiB, grads %.2f MiB, %s %.2f MiB, activations %.2f MiB"
           " (recompute %s, attention %s)\n", par->zero, param_bytes / MiB, grad_bytes / MiB, LP_MASTER_COPY ? "master+AdamW" : "AdamW",
           optim_bytes / MiB, act_bytes / MiB, lp_recompute_names[par->recompute],
           par->cp > 1 ? "a ring over cp" : lp_attention_materialised(f->attention) ? "materialised" : "flash");
    const LPZero* z = &r->stage.chunks[0].zero;
    const char* io = z->off && z->off->direct ? "O_DIRECT" : "buffered";
    if (z->off && !z->host_state)
        lp_log("offload          AdamW m and v (%.2f MiB on rank 0) in a file in %s, %s I/O, streamed in chunks of %.2f MiB "
               "(the memory above is its two buffers)\n", offloaded_bytes / MiB, par->offload_dir, io,
               2.0 * z->off->chunk * sizeof(float) / MiB);
    if (z->host_state)
        lp_log("offload          fp32 master weights%s and AdamW m and v (%.2f MiB on rank 0) %s%s%s%s%s, updated on the CPU in "
               "chunks of %zu values overlapped with the copies (the memory above is the GPU's)\n",
               z->params_on_host ? ", the bf16 weight shard" : "", offloaded_bytes / MiB,
               z->off ? "on the host (the master weights in pinned memory, m and v in a file in " : "in pinned host memory",
               z->off ? par->offload_dir : "", z->off ? ", " : "", z->off ? io : "", z->off ? " I/O)" : "", z->state_chunk);
}

// An error rank 0 found, its line in why ("" on the other ranks, and where there is none): printed once,
// and every rank stops.
static void lp_fail_all_from_rank0(const LPProcess* proc, const char* why) {
    float bad = proc->rank == 0 && why[0];
    lp_all_reduce_host(&proc->world_group, &bad, 1, 0);
    if (bad != 0.0f) lp_fail_all("%s", why);
}

// The flags of a run's identity: those that shape its trajectory, which a resume keeps unless told
// (--resume-changed). Not among them, as a resume may change them: the grid (checkpoints reshard), -b (the
// same tokens per step, split otherwise), -x (a run may be extended), and the flags of evaluation, logging
// and checkpoints; -t, -d and the data order are checked on their own, and never change.
static const size_t lp_identity_fields[] = {
    LP_FIELD(init), LP_FIELD(train_data), LP_FIELD(lr), LP_FIELD(warmup), LP_FIELD(final_lr_frac), LP_FIELD(decay),
    LP_FIELD(weight_decay), LP_FIELD(beta1), LP_FIELD(beta2), LP_FIELD(eps), LP_FIELD(grad_clip), LP_FIELD(seed),
    LP_FIELD(shuffle), LP_FIELD(aux_layers), LP_FIELD(aux_weight), LP_FIELD(moe.capacity), LP_FIELD(moe.aux_coef),
    LP_FIELD(moe.z_coef), LP_FIELD(par.diloco), LP_FIELD(outer.lr), LP_FIELD(outer.momentum), LP_FIELD(par.gossip)};

// The run's identity as a checkpoint keeps it: a line "FLAG VALUE" for each of lp_identity_fields, and one
// for the train shards -i finds, "-i (N shard(s), M tokens)". -x 0 reads none: its two -i lines end in "(not
// read: -x 0)", which matches any line (the caller frees it).
static const char lp_identity_unread[] = "(not read: -x 0)";
static int lp_identity_unread_line(const char* line, size_t n) {
    size_t k = strlen(lp_identity_unread);
    return n >= k && memcmp(line + n - k, lp_identity_unread, k) == 0;
}
static char* lp_run_identity(const LPTrainRun* r) {
    size_t size = 2 * LP_PATH_MAX + 2048, len = 0;
    char* text = (char*)lp_host_malloc(size, "run identity");
    char value[LP_PATH_MAX];
    for (size_t k = 0; k < sizeof(lp_identity_fields) / sizeof(lp_identity_fields[0]); k++) {
        const LPFlagSpec* s = lp_flag_specs;
        while (s->field != lp_identity_fields[k]) s++;
        int unread = s->field == LP_FIELD(train_data) && r->f->max_steps == 0;
        len += snprintf(text + len, size - len, "%s %s%s%s\n", lp_flag_name(s), lp_flag_value(r->f, s, value, sizeof(value)),
                        unread ? " " : "", unread ? lp_identity_unread : "");
    }
    size_t tokens = 0;
    for (int s = 0; s < r->train.num_files; s++) tokens += r->train.shard_tokens[s];
    if (r->f->max_steps == 0) snprintf(text + len, size - len, "%s %s\n", LP_FLAG_NAME(train_data), lp_identity_unread);
    else snprintf(text + len, size - len, "%s (%d shard(s), %zu tokens)\n", LP_FLAG_NAME(train_data), r->train.num_files, tokens);
    return text;
}

// Compares a checkpoint's identity (was) with this run's (now), line by line. Returns how many lines differ,
// the first in why as "FLAG: ... WAS ..., this run has NOW" (with the other flags that differ), or, with
// `notice`, each printed as a notice.
static int lp_identity_differs(const char* was, const char* now, int step, int notice, char* why, size_t size) {
    int n = 0;
    size_t len = 0;
    while (*was || *now) {
        size_t a = strcspn(was, "\n"), b = strcspn(now, "\n");
        if (!lp_identity_unread_line(was, a) && !lp_identity_unread_line(now, b) && (a != b || memcmp(was, now, a) != 0)) {
            int name = (int)strcspn(now, " \n");
            if (notice) lp_log("notice: %s: checkpoint step %d's run had '%.*s', this run has '%.*s'\n", LP_FLAG_NAME(resume_changed), step,
                               (int)a, was, (int)b, now);
            else if (n == 0) len = snprintf(why, size, "flag %.*s: checkpoint step %d was made by a run with '%.*s', this run has '%.*s'",
                                            name, now, step, (int)a, was, (int)b, now);
            else if (len < size) len += snprintf(why + len, size - len, "%s%.*s", n == 1 ? " (and " : ", ", name, now);
            n++;
        }
        was += a + (was[a] == '\n');
        now += b + (now[b] == '\n');
    }
    if (n > 1 && !notice && len < size) snprintf(why + len, size - len, ")");
    return n;
}

// Loss scaling once a checkpoint is loaded (a resume, a rollback): its scale and counts go on, unless this run
// has scaling off, or the checkpoint had it off (then this run starts from its own first scale).
static void lp_run_scaler_loaded(LPTrainRun* r) {
    LPLossScaler* s = &r->state.scaler;
    if (r->f->scaler.scale == 0.0f) s->scale = 0.0f;
    else if (s->scale == 0.0f) s->scale = r->f->scaler.scale, s->clean = 0;
}

// -o: the directory and its lock (rank 0 holds it for the job: one run per directory), then either the
// newest usable checkpoint (--resume: rank 0 checks it, checksums too; a damaged one is reported once and
// the one before it tried; one of another run identity is refused) or a fresh run's id, the checkpoints of
// an earlier run taken away (--overwrite), and main.log emptied. Whatever stops the run here stops it before
// its first step, with -o as it was.
static void lp_run_open_output(LPTrainRun* r) {
    const LPFlags* f = r->f;
    const LPProcess* proc = r->proc;
    lp_mkdirs(f->out_dir);
    char why[2 * LP_PATH_MAX + 512] = "";
    r->lock_fd = proc->rank == 0 ? lp_dir_lock(f->out_dir, why, sizeof(why)) : -1;
    lp_fail_all_from_rank0(proc, why);
    char path[LP_PATH_MAX];  // main.log, opened now (not through a symbolic link, as the lock) and emptied for a fresh run once it has -o
    lp_path(path, "%s/main.log", f->out_dir);
    int log_fd = proc->rank == 0 ? open(path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_APPEND, 0644) : -1;
    if (proc->rank == 0 && log_fd < 0) snprintf(why, sizeof(why), "cannot write %s: %s", path, errno == ELOOP ? "it is a symbolic link" : strerror(errno));
    lp_fail_all_from_rank0(proc, why);
    r->identity = lp_run_identity(r);
    r->state.identity = r->identity;
    if (f->resume) {
        int latest = lp_checkpoint_latest(f->out_dir, INT_MAX);
        if (latest < 0) lp_fail_all("flag --resume: no complete checkpoint in %s", f->out_dir);
        // a checkpoint of another shape, whole as that shape (sizes and checksums), is not damaged: the flag that
        // makes this run's shape is named
        LPConfig saved;
        int optim_h[LP_HEADER_INTS], state_h[LP_HEADER_INTS];
        int k = proc->rank == 0 && lp_checkpoint_shape(f->out_dir, latest, &saved) == 0 ? lp_config_differs(&saved, &r->cfg) : -1;
        if (k >= 0 && !lp_checkpoint_problem(f->out_dir, latest, &saved, optim_h, state_h, 1, why, sizeof(why))) {
            const char* moe_flags[3] = {"--moe-experts", "--moe-topk", "--moe-every"};
            snprintf(why, sizeof(why), "flag %s: checkpoint step %d holds a model of %d %s, this run's (-e %s) has %d; resume with the "
                     "flags that made it", r->preset && k >= 6 && k < 9 ? moe_flags[k - 6] : "-e", latest, LP_CONFIG_FIELD(&saved, k),
                     lp_config_fields[k].what, f->init, LP_CONFIG_FIELD(&r->cfg, k));
        } else {
            why[0] = '\0';  // (a checkpoint that is not whole is damaged: reported below)
        }
        lp_fail_all_from_rank0(proc, why);
        for (;;) {
            float bad = proc->rank == 0 && lp_checkpoint_problem(f->out_dir, latest, &r->cfg, optim_h, state_h, 1, why, sizeof(why));
            lp_all_reduce_host(&proc->world_group, &bad, 1, 0);
            if (bad == 0.0f) break;
            int before = lp_checkpoint_latest(f->out_dir, latest);
            if (before < 0) lp_fail_all("flag --resume: no usable checkpoint in %s (%s)", f->out_dir, why);
            lp_log("notice: checkpoint step %d is damaged (%s); resuming from step %d\n", latest, why, before);
            latest = before;
        }
        LPTrainState* state = &r->state;
        lp_checkpoint_load(r->stage.chunks, r->stage.par->vpp, state, f->out_dir, latest);
        lp_run_scaler_loaded(r);
        if (state->T != f->T || state->total_batch != r->total_batch)
            lp_fail_all("flag --resume: checkpoint step %d was trained with -t %d and %d tokens per step; this run "
                        "has -t %d and %d", latest, state->T, state->total_batch, f->T, r->total_batch);
        if (state->shuffle != f->shuffle || (state->shuffle && state->data_seed != f->seed)) {
            char was[64], now[64];
            lp_fail_all("flags --shuffle --seed: checkpoint step %d read its data %s; this run reads it %s", latest,
                        lp_data_order(was, sizeof(was), state->shuffle, state->data_seed),
                        lp_data_order(now, sizeof(now), f->shuffle, f->seed));
        }
        why[0] = '\0';
        if (proc->rank == 0) {
            char* was = lp_checkpoint_identity(f->out_dir, latest);
            if (!was) lp_log("notice: checkpoint step %d was saved without its run's identity (an older llmpar): its flags are not "
                             "checked against this run's\n", latest);
            else if (lp_identity_differs(was, r->identity, latest, f->resume_changed, why, sizeof(why)) && !f->resume_changed)
                snprintf(why + strlen(why), sizeof(why) - strlen(why), "; %s continues it with this run's", LP_FLAG_NAME(resume_changed));
            free(was);
        }
        lp_fail_all_from_rank0(proc, why);
        if (f->max_steps > 0) lp_dataloader_seek(&r->train, state->epoch, state->shard, state->pos);
        lp_log("resumed from %s/step_%08d (run %08x)", f->out_dir, latest, state->run_id);
        if (state->scaler.scale > 0.0f) lp_log(", loss scale %.9g, %d step(s) skipped so far", state->scaler.scale, state->scaler.skipped);
        lp_log("\n");
        if (latest >= f->max_steps)
            lp_log("notice: the run has done %d steps, -x asks for %d: nothing left to train (a larger -x trains on)\n",
                   latest, f->max_steps);
    } else {  // a fresh run never mixes its checkpoints with another run's
        int existing = lp_checkpoint_latest(f->out_dir, INT_MAX);
        if (existing >= 0 && !f->overwrite)
            lp_fail_all("flag -o: %s already holds checkpoints (the newest is step %d): continue that run with --resume, "
                        "choose another -o, or pass --overwrite to remove them", f->out_dir, existing);
        if (existing >= 0 && proc->rank == 0) {
            char failed[LP_PATH_MAX];
            int hidden, err = lp_checkpoint_clear(f->out_dir, failed, &hidden);
            if (err && !hidden)
                snprintf(why, sizeof(why), "flag --overwrite: cannot move %s out of the way (to %s.removed): %s; the run in %s is "
                         "left as it was", failed, failed, strerror(err), f->out_dir);
            else if (err)
                lp_log("notice: --overwrite: the checkpoints in %s are out of --resume's sight, but %s cannot be removed: %s\n",
                       f->out_dir, failed, strerror(err));
        }
        lp_fail_all_from_rank0(proc, why);
        uint64_t now = (uint64_t)(lp_time_s() * 1e9) ^ ((uint64_t)getpid() << 32);
        r->state.run_id = (int)(lp_rand_u32(&now) % 0x7fffffffu) + 1;  // 1 .. 2^31-1 (0: a checkpoint from before ids)
        lp_broadcast_host(&proc->world_group, &r->state.run_id, sizeof(r->state.run_id), 0);  // rank 0's
        lp_log("run %08x: a fresh run; its checkpoints carry this id\n", r->state.run_id);
    }
    if (proc->rank == 0 && ((!f->resume && ftruncate(log_fd, 0) != 0) || !(r->logf = fdopen(log_fd, "a"))))
        lp_fail("cannot write %s: %s", path, strerror(errno));
}

// --eval-hellaswag: the file checked against the model (every token in its vocabulary, every row in -t).
static void lp_hellaswag_load(LPTrainRun* r) {
    const LPFlags* f = r->f;
    LPEvalSet* s = &r->hellaswag;
    lp_evalset_load(s, f->hellaswag, "--eval-hellaswag", r->cfg.vocab_size);
    int max = r->cfg.max_seq_len;
    char fits[128];
    if (s->longest_row <= max) snprintf(fits, sizeof(fits), "; -t %d, the model's maximum, fits it", max);
    else snprintf(fits, sizeof(fits), " and than the model's maximum %d", max);
    if (s->longest_row > f->T)
        lp_fail("--eval-hellaswag %s: example %d's context + completion is %d tokens, more than -t %d%s (llm.c refuses such "
                "examples too)", f->hellaswag, s->longest_example, s->longest_row, f->T, fits);
}

// Everything before the first step: the model's shape checked against the grid, the batch, the pipeline's
// partition; this rank's chunks (new, or from an llm.c file read by one rank and broadcast); the data (rank
// 0 checks every token id first, or reads them from manifests); the tokenizer; the report; the output directory and resume.
static void lp_run_setup(LPTrainRun* r, LPFlags* f, const LPProcess* proc) {
    memset(r, 0, sizeof(*r));
    r->f = f;
    r->proc = proc;
    int from_scratch = r->preset = lp_model_config(f, proc, &r->cfg);
    lp_grid_check(proc, &r->cfg);
    if (f->trace[0]) lp_trace_check_path(f, proc);
    if (f->T > r->cfg.max_seq_len) lp_fail_all("flag -t: sequence length %d exceeds the model's maximum %d", f->T, r->cfg.max_seq_len);
    int tokens_per_micro = f->B * f->T * proc->par->dp;
    r->total_batch = f->total_batch ? f->total_batch : tokens_per_micro;
    if (r->total_batch % tokens_per_micro != 0)
        lp_fail_all("flag -d: %d tokens is not a multiple of -b * -t * d = %d", r->total_batch, tokens_per_micro);
    f->par.micro_batches = r->total_batch / tokens_per_micro;
    LPModelOptions chunks = {.proc = proc, .aux = r->aux, .num_aux = lp_parse_aux_layers(f->aux_layers, r->cfg.num_layers, r->aux),
                             .aux_weight = f->aux_weight, .attention = f->attention, .moe = f->moe};
    lp_log("allocating activations for B=%d T=%d\n", f->B, f->T);
    lp_stage_create(&r->stage, &r->cfg, &chunks, f->B, f->T);
    float* weights = NULL;
    if (from_scratch) {
        lp_log("initialising a new depth-%d %s (C=%d, NH=%d) with seed %llu%s\n", r->cfg.num_layers, lp_config_is_gpt2(&r->cfg) ? "GPT-2" : "Llama",
               r->cfg.channels, r->cfg.num_heads, f->seed, f->resume ? " (the newest checkpoint in -o replaces its weights)" : "");
    } else {
        lp_log("loading %s\n", f->init);
        weights = lp_model_file_read_shared(f->init, &r->cfg, &proc->world_group);
    }
    size_t rank_params = 0;
    double param_bytes = 0, grad_bytes = 0, optim_bytes = 0, offloaded_bytes = 0, act_bytes = 0;
    for (int c = 0; c < proc->par->vpp; c++) {
        LPModel* mc = &r->stage.chunks[c];
        if (weights) lp_model_set_weights(mc, weights);
        else lp_model_init_random(mc, f->seed);
        for (int p = 0; p < mc->parts; p++) {  // (its dense tensors; a mixture of experts' experts)
            const LPZero* z = lp_model_part(mc, p);
            rank_params += z->num_params;
            param_bytes += z->param_bytes;
            grad_bytes += z->grad_bytes;
            double shard = (double)z->shard_size, master = LP_MASTER_COPY ? 4.0 * shard : 0.0;  // (fp32 master weights)
            if (z->host_state) {  // the CUDA build's offload: master weights, m and v on the host, none on the GPU
                offloaded_bytes += master + 8.0 * shard + (z->params_on_host ? shard * sizeof(floatX) : 0.0);
            } else if (z->off) {  // the CPU build's: AdamW m and v in a file, in memory its two buffers
                optim_bytes += 4.0 * z->off->chunk * sizeof(float);
                offloaded_bytes += 8.0 * shard;
            } else {
                optim_bytes += master + 8.0 * shard;
            }
        }
        act_bytes += mc->act_bytes;
    }
    free(weights);
    // -x 0 trains on nothing: it reads no train shard, and a val set left at its default that is not there (a run
    // outside the checkout) gives no val loss, with a notice; so a model file is sampled with no data at all
    r->has_val = f->val_data[0] != '\0' && f->val_every > 0;
    if (f->max_steps == 0 && r->has_val && !lp_flag_typed(f, LP_FIELD(val_data))) {
        glob_t g;
        r->has_val = glob(f->val_data, 0, NULL, &g) == 0;
        globfree(&g);
        if (!r->has_val) lp_log("notice: -x 0 without -j: the default val shards %s are not here, no val loss\n", f->val_data);
    }
    for (int pass = 0; pass < 2; pass++) {  // rank 0 checks the shards first (their token ids), as with the model file
        if ((proc->rank == 0) == (pass == 0)) {
            LPDataOptions train = {.pattern = f->train_data, .label = "-i", .B = f->B, .T = f->T, .rank = proc->coord[LP_DP],
                                   .ranks = proc->par->dp, .window = (size_t)r->total_batch, .shuffle = f->shuffle, .seed = f->seed,
                                   .vocab_size = r->cfg.vocab_size, .scan = proc->rank == 0, .check = f->check_data};
            LPDataOptions val = {.pattern = f->val_data, .label = "-j", .B = f->B, .T = f->T, .rank = proc->coord[LP_DP],
                                 .ranks = proc->par->dp, .vocab_size = r->cfg.vocab_size, .scan = proc->rank == 0,
                                 .check = f->check_data};
            if (f->max_steps > 0) lp_dataloader_init(&r->train, &train);
            if (r->has_val) lp_dataloader_init(&r->val, &val);
            if (f->hellaswag[0]) lp_hellaswag_load(r);
        }
        lp_barrier(&proc->world_group);
    }
    char beside[LP_PATH_MAX];
    const char* tokenizer = lp_flag_typed(f, LP_FIELD(tokenizer)) ? f->tokenizer : lp_beside_program(f->tokenizer, beside, sizeof(beside));
    if (f->sample_every > 0 && lp_tokenizer_load(&r->tok, tokenizer) && r->tok.vocab_size != r->cfg.vocab_size) {
        lp_log("notice: tokenizer %s has %d tokens, the model %d: samples print token ids\n", tokenizer,
               r->tok.vocab_size, r->cfg.vocab_size);
        lp_tokenizer_free(&r->tok);
    }
    lp_report_setup(r, rank_params, param_bytes, grad_bytes, optim_bytes, offloaded_bytes, act_bytes);

    r->state.rng = f->seed ^ 0x9E3779B97F4A7C15ull;
    r->state.scaler = f->scaler;  // (a resume takes the checkpoint's scale and counts: lp_run_scaler_loaded)
    if (f->out_dir[0]) lp_run_open_output(r);
    LPAdamW opt = {f->beta1, f->beta2, f->eps, f->weight_decay, f->grad_clip};
    r->opt = opt;
    r->first_step = r->state.step;
    r->on_disk = f->resume ? r->first_step : -1;
    r->rollback = f->on_divergence == LP_ROLLBACK;
    r->skip = f->on_divergence == LP_SKIP;
    // MFU: the model's FLOPs per step over what all the run's GPUs could do in that time
    r->flops_per_step = lp_flops_per_token(&r->cfg, f->T) * r->total_batch;
    r->peak = lp_device_peak_flops() * proc->gpus;
    r->start_s = r->last_save_s = lp_time_s();
}

// A stop asked by a signal keeps the run's progress: SIGTERM (Slurm's preemption and time limit, scancel,
// kill), SIGINT (Ctrl-C) or SIGUSR1 (sbatch --signal=USR1@SECONDS; and the one to send mpirun, which passes
// USR1 on to the ranks but kills them a second after a TERM or INT). The step in progress finishes, the ranks
// agree at its end, and the run saves a checkpoint (with -o), prints its end report and exits 128 + the
// signal, as a shell reports one. A second signal is not caught: it stops the run at once.
static const int lp_stop_signals[3] = {SIGTERM, SIGINT, SIGUSR1};
static const char* const lp_stop_names[3] = {"SIGTERM", "SIGINT", "SIGUSR1"};
static volatile sig_atomic_t lp_stop_asked[3];
static void lp_on_stop_signal(int sig) {
    for (int k = 0; k < 3; k++)
        if (lp_stop_signals[k] == sig) lp_stop_asked[k] = 1;
}
static void lp_catch_stop_signals(void) {
    struct sigaction sa, was;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = lp_on_stop_signal;
    sa.sa_flags = SA_RESTART | SA_RESETHAND;  // system calls go on; the next signal takes its default action
    for (int k = 0; k < 3; k++)  // one ignored stays ignored (a shell starts background jobs ignoring SIGINT)
        if (sigaction(lp_stop_signals[k], NULL, &was) == 0 && was.sa_handler != SIG_IGN) sigaction(lp_stop_signals[k], &sa, NULL);
}
// Which of lp_stop_signals any rank was sent (the first in their order), the same on every rank; -1: none.
static int lp_run_stop_asked(const LPProcess* proc) {
    float asked[3];
    for (int k = 0; k < 3; k++) asked[k] = (float)lp_stop_asked[k];
    lp_all_reduce_host(&proc->world_group, asked, 3, 0);
    for (int k = 0; k < 3; k++)
        if (asked[k] > 0.0f) return k;
    return -1;
}

// Add to sum a group's traffic since its counters read `before`.
static void lp_traffic_since(LPGroup* sum, const LPGroup* now, const LPGroup* before) {
    for (int k = 0; k < 5; k++) {
        sum->calls[k] += now->calls[k] - before->calls[k];
        sum->bytes[k] += now->bytes[k] - before->bytes[k];
    }
}

// Before step `step` (and after the last): val loss, a sample, a checkpoint, each when due; when the run
// stops for a signal (`stopping`), the checkpoint alone.
static void lp_run_between_steps(LPTrainRun* r, int step, int stopping) {
    const LPFlags* f = r->f;
    const LPProcess* proc = r->proc;
    int last = step == f->max_steps;
    LPGroup dp_before = *lp_dp_group(proc);
    if (last || stopping) lp_step_outer(&r->stage, &f->outer);  // --diloco: the round under way ends (its bytes the steps')
    lp_traffic_since(&r->dp_traffic, lp_dp_group(proc), &dp_before);
    if (r->has_val && !stopping && (step % f->val_every == 0 || last)) {
        int ev = lp_trace_begin("step", "val loss", -1, -1);
        float vl = lp_evaluate(&r->stage, &r->val, f->val_batches);
        lp_trace_end(ev);
        lp_all_reduce_host(&proc->group[LP_DP], &vl, 1, 1);
        lp_log("val loss %f\n", vl);
        if (r->logf) fprintf(r->logf, "s:%d tel:%f\n", step, vl);
    }
    int eval_every = f->eval_every ? f->eval_every : f->val_every;  // llm.c: with the val loss, from step 1 on
    if (r->hellaswag.num_examples && !stopping && ((step > 0 && eval_every && step % eval_every == 0) || last)) {
        int n = r->hellaswag.num_examples, right[2];
        lp_hellaswag(&r->stage, &r->hellaswag, f->B, &proc->group[LP_DP], right);
        lp_log("hellaswag acc_norm %.4f (%d/%d) | acc %.4f (%d/%d)\n", (double)right[1] / n, right[1], n, (double)right[0] / n,
               right[0], n);
        if (r->logf) fprintf(r->logf, "s:%d eval:%.4f\n", step, (double)right[1] / n);
    }
    if (f->sample_every > 0 && !stopping && (step > 0 || last) && (step % f->sample_every == 0 || last))  // every rank: ZeRO-3 gathers
        lp_sample(&r->stage, &r->tok, f->gen_tokens, &r->state.rng, step);
    int untrained = step == 0 && f->max_steps > 0 && !r->rollback;  // not worth saving, unless to roll back to
    float due = 0.0f;  // --ckpt-minutes: rank 0's clock decides for everyone
    if (f->ckpt_minutes > 0.0f) {
        due = proc->rank == 0 && lp_time_s() - r->last_save_s >= 60.0 * f->ckpt_minutes;
        lp_broadcast_host(&proc->world_group, &due, sizeof(due), 0);
    }
    int wanted = (f->ckpt_every > 0 && step % f->ckpt_every == 0) || last || due || stopping || (r->rollback && r->on_disk < 0);
    if (!f->out_dir[0] || step == r->on_disk || untrained || !wanted || r->stage.inner) return;  // (--diloco: between rounds)
    LPTrainState* state = &r->state;
    state->step = step;
    state->epoch = r->train.epoch;
    state->shard = r->train.shard;
    state->pos = r->train.pos;
    state->shuffle = f->shuffle;
    state->data_seed = f->seed;
    state->B = f->B;
    state->T = f->T;
    state->total_batch = r->total_batch;
    int ev = lp_trace_begin("io", "checkpoint", -1, -1);
    lp_checkpoint_save(r->stage.chunks, r->stage.par->vpp, state, f->out_dir, &proc->world_group);
    lp_trace_end(ev);
    char failed[LP_PATH_MAX];
    int err = f->keep && proc->rank == 0 ? lp_checkpoint_prune(f->out_dir, f->keep, failed) : 0;
    if (err) lp_log("notice: %s %d: cannot remove %s: %s (the run goes on)\n", LP_FLAG_NAME(keep), f->keep, failed, strerror(err));
    r->last_save_s = lp_time_s();
    r->on_disk = step;
    if (r->rollback) r->strikes = 0;
    lp_log("saved checkpoint %s/step_%08d\n", f->out_dir, step);
}

// A diverged step under --on-divergence (stop, skip, rollback): stops the run, or returns the step the
// loop goes on from (skip: the next; rollback: the checkpoint's, whose state is reloaded while the loader
// keeps its place).
static int lp_run_diverged(LPTrainRun* r, int step, const char* diverged, int bad_weights) {
    const LPFlags* f = r->f;
    if (!r->skip && !r->rollback)
        lp_fail_all("step %d: %s: the run diverged and stops%s (try a lower -l, or --on-divergence skip or rollback)",
                    step + 1, diverged, r->on_disk >= 0 ? "; its newest checkpoint is the last good one" : "");
    if (++r->strikes > LP_STRIKES)
        lp_fail_all("step %d: %s: still diverging after %d %s; the run stops (try a lower -l)", step + 1, diverged,
                    LP_STRIKES, r->skip ? "skipped steps in a row" : "rollbacks to the same checkpoint");
    if (r->skip && bad_weights)  // AdamW's moments have taken the update
        lp_fail_all("step %d: %s; an update already applied cannot be skipped: the run stops (--on-divergence rollback "
                    "can go back to a checkpoint)", step + 1, diverged);
    if (r->skip) {
        lp_log("step %d/%d | skipped, its batch and update dropped: %s\n", step + 1, f->max_steps, diverged);
        return step + 1;
    }
    lp_checkpoint_load(r->stage.chunks, r->stage.par->vpp, &r->state, f->out_dir, r->on_disk);
    lp_run_scaler_loaded(r);
    r->stage.inner = 0;  // (--diloco: a checkpoint is between rounds)
    lp_log("step %d/%d | rolled back to checkpoint step %d, the batches of the %d step(s) since skipped: %s\n", step + 1,
           f->max_steps, r->on_disk, step + 1 - r->on_disk, diverged);
    return r->on_disk;
}

// One step's figures, as the loop gets them.
typedef struct {
    float loss, norm, lr;
    double t0, t1;        // its start; forward-backward's end
    double busy_s;        // forward-backward less its waits for other ranks (the straggler check)
    LPGroup tp_before, cp_before, dp_before;  // the TP, CP and gradient (lp_dp_group) groups' traffic counters at its start
    float spread;         // --gossip: the replicas' spread after it (lp_step_replicas)
    char diverged[200];   // why the divergence guard stopped it, or ""
    int bad_weights;      // the update left a weight that is not finite
    float scale;          // --loss-scale: the loss scale it ran with (0: none)
    int overflow;         // its gradients overflowed: its update skipped, the scale backed off (not the guard's)
} LPStepRecord;

// The step line (and main.log), and the timings and traffic the end report sums.
static void lp_report_step(LPTrainRun* r, int step, const LPStepRecord* s, double ms, double update_ms) {
    const LPFlags* f = r->f;
    const LPProcess* proc = r->proc;
    float loss = s->loss, lr = s->lr, norm = s->norm;
    lp_traffic_since(&r->tp_traffic, &proc->group[LP_TP], &s->tp_before);
    lp_traffic_since(&r->cp_traffic, &proc->group[LP_CP], &s->cp_before);
    lp_traffic_since(&r->dp_traffic, lp_dp_group(proc), &s->dp_before);
    r->traffic_steps++;
    if (step > r->first_step) {  // the first step warms up: leave it out of the means
        r->sum_ms += ms;
        r->sum_update_ms += update_ms;
        r->timed_steps++;
        lp_stage_time_step(&r->stage);
    }
    lp_log("step %d/%d | loss %f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s", step + 1, f->max_steps, loss, lr,
           norm, ms, r->total_batch / (ms / 1000.0));
    if (r->peak > 0.0) lp_log(" | MFU %.1f%%", 100.0 * r->flops_per_step / (ms / 1000.0) / r->peak);
    const LPMoEStats* moe = &r->stage.moe_stats;
    if (moe->passes > 0)
        lp_log(" | moe aux %.4f z %.4f, dropped %.1f%%, busiest %.0f%%", moe->aux, moe->z, 100.0 * moe->dropped / moe->routed,
               100.0 * moe->busiest / moe->passes);
    if (proc->par->gossip) lp_log(" | spread %.3e", s->spread);
    const LPLossScaler* ls = &r->state.scaler;
    if (s->overflow)
        lp_log(" | overflow: update skipped, loss scale %.9g -> %.9g, %d skipped", s->scale, ls->scale, ls->skipped);
    else if (s->scale > 0.0f)
        lp_log(" | loss scale %.9g, %d skipped", s->scale, ls->skipped);
    if (r->stage.num_aux) {
        lp_log(" | aux loss");
        for (int j = 0; j < r->stage.num_aux; j++) lp_log(" %d: %f", r->stage.aux[j], r->stage.aux_loss[j]);
    }
    // the time so far, and the rest at this launch's pace (evaluation, samples and saves included)
    double elapsed = lp_time_s() - r->start_s;
    char took[32], left[32];
    lp_log(" | elapsed %s, ETA %s\n", lp_duration(took, sizeof(took), elapsed),
           lp_duration(left, sizeof(left), elapsed / (step + 1 - r->first_step) * (f->max_steps - step - 1)));
    if (step == r->first_step && lp_device_memory_used_mib() > 0.0)
        lp_log("GPU memory in use: %.0f MiB\n", lp_device_memory_used_mib());
    if (r->logf) {
        fprintf(r->logf, "s:%d trl:%f\n", step + 1, loss);
        if (s->overflow) fprintf(r->logf, "s:%d skip:%d\n", step + 1, ls->skipped);  // (loss scaling's skipped steps so far)
        fflush(r->logf);
    }
}

// The divergence guard, before the update: the loss and the gradient norm (every rank sees the same values,
// so all decide alike). Returns whether the step diverged, saying why in s->diverged.
static int lp_run_diverging(LPTrainRun* r, int step, LPStepRecord* s) {
    const LPFlags* f = r->f;
    float mean = lp_loss_window_mean(&r->recent);
    if (!isfinite(s->loss) || !isfinite(s->norm)) {
        snprintf(s->diverged, sizeof(s->diverged), "loss %g, gradient norm %g is not finite", s->loss, s->norm);
    } else if (f->loss_spike > 0.0f && mean > 0.0f && s->loss > f->loss_spike * mean) {
        snprintf(s->diverged, sizeof(s->diverged), "loss %f is a spike, above %g times the mean %f of the last %d steps",
                 s->loss, f->loss_spike, mean, LP_SPIKE_WINDOW);
        if (!r->skip && !r->rollback) {  // stop: a finite spike is reported, and training goes on
            lp_log("notice: step %d: %s\n", step + 1, s->diverged);
            s->diverged[0] = '\0';
        }
    }
    return s->diverged[0] != '\0';
}

// The straggler check (--straggler). A rank that computes slower than the others (a throttled GPU, a busy
// host) holds every step up while they wait for it. Its compute time is its forward-backward less the
// waits the watchdog marks (lp_watch ... lp_watch_done): time the rank spent itself, so the slow rank
// stands out while its peers' waits are left out. Every LP_STRAGGLER_WINDOW steps (the first step, a
// warm-up, not among them) the ranks share their mean, in one all-reduce of world + 1 floats, and rank 0
// names the slowest rank when it is behind the median rank (of an even count, the lower middle) by more
// than the flag's share of a step, in ms and %; the named rank sends its host and coordinates (a broadcast
// of 160 bytes). On the CUDA build NCCL's collectives wait inside the GPU, where the host does not see
// them: there the waits of tensor and pipeline parallelism count as compute, so a slow rank's TP and PP
// peers look as slow as it (data parallelism's waits come after forward-backward and are left out).
#define LP_STRAGGLER_WINDOW 10
static int lp_compare_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}
static void lp_run_stragglers(LPTrainRun* r, int step, double busy_s, double step_s) {
    const LPProcess* proc = r->proc;
    int n = proc->world;
    r->window_busy_s += busy_s;
    r->window_step_s += step_s;
    if (++r->window_steps < LP_STRAGGLER_WINDOW) return;
    float* ms = (float*)lp_host_malloc(((size_t)n + 1) * sizeof(float), "straggler check");  // each rank's compute per step; the mean step
    double* sorted = (double*)lp_host_malloc((size_t)n * sizeof(double), "straggler check");
    memset(ms, 0, ((size_t)n + 1) * sizeof(float));
    ms[proc->rank] = (float)(1e3 * r->window_busy_s / r->window_steps);
    ms[n] = (float)(1e3 * r->window_step_s / r->window_steps / n);
    lp_all_reduce_host(&proc->world_group, ms, (size_t)n + 1, 0);
    int from = step + 2 - r->window_steps, slowest = 0;
    r->window_busy_s = r->window_step_s = 0.0;
    r->window_steps = 0;
    r->windows++;
    for (int k = 0; k < n; k++) {
        sorted[k] = ms[k];
        if (ms[k] > ms[slowest]) slowest = k;
    }
    qsort(sorted, (size_t)n, sizeof(double), lp_compare_double);
    double median = sorted[(n - 1) / 2], lag = ms[slowest] - median, share = lag / ms[n];
    if (share > r->f->straggler) {
        char who[160] = "";
        if (proc->rank == slowest) {
            char host[64] = "";
            gethostname(host, sizeof(host) - 1);
            snprintf(who, sizeof(who), "host %s, t %d p %d d %d", host, proc->coord[LP_TP], proc->coord[LP_PP], proc->coord[LP_DP]);
            if (proc->par->cp > 1) snprintf(who + strlen(who), sizeof(who) - strlen(who), " cp %d", proc->coord[LP_CP]);
        }
        lp_broadcast_host(&proc->world_group, who, sizeof(who), slowest);
        lp_log("straggler at steps %d-%d: rank %d (%s) computed %.1f ms per step, %.1f ms (%.0f%% of a step) behind the "
               "median rank's %.1f ms\n", from, step + 1, slowest, who, ms[slowest], lag, 100.0 * share, median);
        r->named_windows++;
        if (share > r->worst_share) snprintf(r->worst_who, sizeof(r->worst_who), "%s", who);
    }
    if (share > r->worst_share) {
        r->worst_share = share;
        r->worst_lag_ms = lag;
        r->worst_rank = slowest;
        r->worst_from = from;
    }
    free(sorted);
    free(ms);
}

// After the update (or instead of it): the step reported, or a divergence handled (the weights after the
// update are checked too). Returns the step the loop goes on from (step + 1, or a rollback's checkpoint step).
static int lp_run_step_end(LPTrainRun* r, int step, LPStepRecord* s) {
    lp_device_sync();
    double t2 = lp_time_s();
    r->step_s[(r->computed - 1) % 32] = t2 - s->t0;  // (the watchdog's timeout; computed counts this step already)
    if (s->bad_weights) snprintf(s->diverged, sizeof(s->diverged), "the updated weights are not finite");
    if (s->diverged[0]) return lp_run_diverged(r, step, s->diverged, s->bad_weights);
    if (r->skip) r->strikes = 0;
    lp_loss_window_add(&r->recent, s->loss);
    lp_report_step(r, step, s, (t2 - s->t0) * 1000.0, (t2 - s->t1) * 1000.0);
    if (r->proc->world > 1 && r->f->straggler > 0.0f && step > r->first_step) lp_run_stragglers(r, step, s->busy_s, t2 - s->t0);
    return step + 1;
}

// The end report: mean step time, peak host memory, TP traffic per step, and the pipeline's bubble as
// measured and as the simulator predicts it from the measured costs.
static void lp_report_end(LPTrainRun* r) {
    const LPProcess* proc = r->proc;
    double MiB = 1048576.0;
    if (r->timed_steps > 0)
        lp_log("mean of steps after the first: %.1f ms/step, of which %.1f ms in the optimizer step (gradient "
               "communication and AdamW)\n", r->sum_ms / r->timed_steps, r->sum_update_ms / r->timed_steps);
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);  // ru_maxrss is in KiB on Linux
    lp_log("peak host memory of rank 0 (RSS): %.0f MiB\n", usage.ru_maxrss / 1024.0);
    if (r->state.scaler.scale > 0.0f)
        lp_log("loss scale %.9g at the end; %d step(s) skipped for an overflow of their gradients\n", r->state.scaler.scale,
               r->state.scaler.skipped);
    int steps = r->traffic_steps;  // (fewer than -x asked when a signal stopped the run)
    const LPGroup* tr = &r->tp_traffic;
    if (proc->par->tp > 1 && steps > 0)
        lp_log("tensor-parallel traffic per step and rank: %.1f all-reduces (%.4f MiB), %.1f reduce-scatters (%.4f MiB), "
               "%.1f all-gathers (%.4f MiB)\n", (double)tr->calls[0] / steps, tr->bytes[0] / steps / MiB,
               (double)tr->calls[1] / steps, tr->bytes[1] / steps / MiB, (double)tr->calls[2] / steps, tr->bytes[2] / steps / MiB);
    const LPGroup* ct = &r->cp_traffic;
    if (proc->par->cp > 1 && steps > 0)
        lp_log("context-parallel traffic per step and rank: %.1f sends (%.4f MiB) of the ring's key/value blocks and, in backward, "
               "their gradients\n", (double)ct->calls[LP_SEND] / steps, ct->bytes[LP_SEND] / steps / MiB);
    const LPGroup* dt = &r->dp_traffic;
    int d = lp_dp_group(proc)->size;  // (with context parallelism the gradients' group is its cp x d ranks)
    if (d > 1 && steps > 0) {  // as ring collectives send: an all-reduce 2 (d-1)/d of its buffer, a reduce-scatter
                               // or an all-gather (d-1)/d of the whole, a send all it sends
        double ring = (d - 1.0) / d, params = 0.0;
        double sent = (2.0 * ring * dt->bytes[LP_ALL_REDUCE] + ring * (dt->bytes[LP_REDUCE_SCATTER] + dt->bytes[LP_ALL_GATHER]) +
                       dt->bytes[LP_SEND]) / steps;
        for (int c = 0; c < proc->par->vpp; c++)
            for (int p = 0; p < r->stage.chunks[c].parts; p++) params += (double)lp_model_part(&r->stage.chunks[c], p)->num_params;
        double plain = 2.0 * ring * sizeof(floatX) * params;  // ZeRO-0's all-reduce of this rank's gradients every step
        char mode[96] = "gradients";
        if (proc->par->diloco) snprintf(mode, sizeof(mode), "DiLoCo H=%d: fp32 weights all-reduced once a round", proc->par->diloco);
        if (proc->par->gossip) snprintf(mode, sizeof(mode), "gossip K=%d: fp32 weights sent to %d neighbour(s)", proc->par->gossip, proc->par->gossip);
        lp_log("data-parallel bytes sent per step and rank: %.4f MiB (%s; as ring collectives send them); plain data "
               "parallelism's gradient all-reduce: %.4f MiB, %.2fx this\n", sent / MiB, mode, plain / MiB, sent > 0.0 ? plain / sent : 0.0);
    }
    if (r->named_windows)
        lp_log("stragglers: a rank behind the median by more than %.0f%% of a step in %d of %d windows of %d steps; the "
               "furthest, rank %d (%s) by %.1f ms (%.0f%%) at steps %d-%d\n", 100.0 * r->f->straggler, r->named_windows, r->windows,
               LP_STRAGGLER_WINDOW, r->worst_rank, r->worst_who, r->worst_lag_ms, 100.0 * r->worst_share, r->worst_from,
               r->worst_from + LP_STRAGGLER_WINDOW - 1);
    else if (r->windows)
        lp_log("stragglers: none in %d windows of %d steps (the slowest rank at most %.1f ms, %.0f%% of a step, behind the "
               "median rank)\n", r->windows, LP_STRAGGLER_WINDOW, r->worst_lag_ms, 100.0 * r->worst_share);
    if (proc->par->pp < 2 || r->timed_steps == 0) return;
    LPBubble b = lp_stage_bubble(&r->stage);  // the measured bubble, and the simulator's from the measured costs
    lp_log("pipeline bubble  measured %.1f%% (forward-backward %.2f ms per step, the busiest stage computing %.2f ms); "
           "simulated with the measured costs %.1f%%, with unit costs %.1f%%\n", 100.0 * b.measured, b.wall_s * 1e3,
           b.busy_s * 1e3, 100.0 * b.simulated, 100.0 * b.unit);
}

static void lp_run_free(LPTrainRun* r) {
    if (r->logf) fclose(r->logf);
    free(r->identity);
    if (r->f->out_dir[0] && r->lock_fd >= 0) close(r->lock_fd);
    lp_tokenizer_free(&r->tok);
    if (r->has_val) lp_dataloader_free(&r->val);
    lp_evalset_free(&r->hellaswag);
    lp_dataloader_free(&r->train);
    lp_stage_free(&r->stage);
}

// --- the timeline (--trace): the events llmpar.h's marks record (section 1's lp_trace) during --trace-steps,
// every rank's gathered by rank 0 into one Chrome trace-event file (the JSON object format: traceEvents, each
// a complete event "X" with ts and dur in microseconds; metadata events "M" name each process by its rank
// and t, p, d coordinates). The ranks' clocks share a zero (lp_trace_start): rank 0's time as it left a
// barrier over all ranks, exactly, on rank 0's host (one monotonic clock for all its processes); a rank on
// another host takes its own time as it left that barrier, so it agrees to within the barrier's exit skew
// (a network latency, and any time a process waits for a core). Written to FILE.tmp, then renamed: the
// file is whole or absent.

// --trace-steps A:B, or the default: step 2 (step 1 warms up), or step 1 of a one-step run.
static void lp_trace_window(const LPFlags* f, int* from, int* to) {
    *from = *to = f->max_steps >= 2 ? 2 : 1;
    if (!f->trace_steps[0]) return;
    char end;
    if (sscanf(f->trace_steps, "%d:%d%c", from, to, &end) != 2 || *from < 1 || *to < *from)
        lp_fail_all("flag %s: '%s' is not A:B with 1 <= A <= B (steps counted from 1)", LP_FLAG_NAME(trace_steps), f->trace_steps);
}

// --trace FILE is found writable before the first step, not after the window's steps (a folder, a folder that
// is not there, no permission): rank 0 makes and removes FILE.tmp, as the write will.
static void lp_trace_check_path(const LPFlags* f, const LPProcess* proc) {
    char tmp[LP_PATH_MAX], why[LP_PATH_MAX + 128] = "";
    if (proc->rank == 0) {
        struct stat st;
        FILE* out = NULL;
        lp_path(tmp, "%s.tmp", f->trace);
        if (stat(f->trace, &st) == 0 && S_ISDIR(st.st_mode)) snprintf(why, sizeof(why), "%s is a folder, not a file", f->trace);
        else if (!(out = fopen(tmp, "w"))) snprintf(why, sizeof(why), "cannot write %s: %s", tmp, strerror(errno));
        if (out) fclose(out), remove(tmp);
    }
    lp_broadcast_host(&proc->world_group, why, sizeof(why), 0);
    if (why[0]) lp_fail_all("flag %s: %s", LP_FLAG_NAME(trace), why);
}

static void lp_trace_start(const LPProcess* proc) {
    lp_barrier(&proc->world_group);  // (not itself on the timeline: it is off until the line below)
    struct { double t; char host[64]; } zero = {lp_time_s(), ""}, mine;
    gethostname(zero.host, sizeof(zero.host) - 1);
    mine = zero;
    lp_world_broadcast(proc, &zero, sizeof(zero), 0);
    lp_trace.origin = strcmp(zero.host, mine.host) == 0 ? zero.t : mine.t;
    lp_trace.n = 0;
    lp_trace.wait = 0;
#ifndef LLMPAR_CPU
    lp_trace_clock();  // (the GPU's zero on this clock)
#endif
    lp_trace.on = 1;
}

// A JSON string's characters (the events' names are ours: quote and backslash are the only ones to escape).
static void lp_json_string(FILE* out, const char* s) {
    fputc('"', out);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fputc('\\', out);
        fputc(*s, out);
    }
    fputc('"', out);
}

// How long each blocking collective of the tp, pp, dp and world groups waited for its group's last rank to
// arrive (seconds; -1 where not known: a receive, a launch, a wait for an overlapped collective started
// earlier, a broadcast, whose root need not wait, an ep or edp group; on the CUDA build a collective of
// device tensors, which the host only enqueues: its wait is the GPU's, inside the comm or compute stream's
// event): a group's members call its collectives in one order, so the k-th of each member's on the group
// is one call, and it began for all once the last member's began. A group's members are the ranks whose coordinates
// (t, cp, p, d) differ in its axes alone: tp's in t, dp's in d, dpcp's (gradients under context parallelism) in cp and d.
static int lp_trace_is_collective(const LPTraceEvent* e, const char* group) {
    static const char* const arrivals[] = {"all-reduce", "all-reduce of host values", "reduce-scatter", "all-gather", "all-to-all", "barrier"};
    if (strcmp(e->kind, "comm") || strcmp(e->group, group) || e->track) return 0;  // (the host's blocking calls)
    if (LP_BUILD_GPU && !strstr(e->name, "host values") && strcmp(e->name, "barrier")) return 0;  // (NCCL's wait on the GPU)
    for (int k = 0; k < (int)(sizeof(arrivals) / sizeof(arrivals[0])); k++)
        if (!strcmp(e->name, arrivals[k])) return 1;
    return 0;
}
static double* lp_trace_peer_waits(const LPTraceEvent* all, const int* count, const int* coords, int n) {
    static const char* const groups[] = {"tp", "cp", "pp", "dp", "dpcp", "world"};
    static const int varies[] = {1, 2, 4, 8, 2 | 8, 15};  // the coordinates (bits: t 1, cp 2, p 4, d 8) its members differ in
    size_t total = 0;
    size_t* first = (size_t*)lp_host_malloc((size_t)n * sizeof(size_t), "trace offsets");
    for (int k = 0; k < n; k++) first[k] = total, total += (size_t)count[k];
    double* waited = (double*)lp_host_malloc((total + 1) * sizeof(double), "trace waits");
    for (size_t i = 0; i < total; i++) waited[i] = -1.0;
    size_t* at = (size_t*)lp_host_malloc((size_t)n * sizeof(size_t), "trace cursors");
    int* members = (int*)lp_host_malloc((size_t)n * sizeof(int), "trace group");
    for (int g = 0; g < 6; g++) {
        for (int k = 0; k < n; k++) {
            int size = 0, leader = 1;
            for (int j = 0; j < n; j++) {
                int in = 1;
                for (int a = 0; a < 4; a++) in &= (varies[g] >> a & 1) || coords[4 * j + a] == coords[4 * k + a];
                if (in && j < k) leader = 0;
                if (in) members[size++] = j;
            }
            if (!leader || size < 2) continue;  // (each group once, from its lowest rank)
            for (int q = 0; q < size; q++) at[q] = first[members[q]];
            for (;;) {  // the next call: each member's next collective on g
                double last = -1.0;
                int found = 0;
                for (int q = 0; q < size; q++) {
                    size_t end = first[members[q]] + (size_t)count[members[q]];
                    while (at[q] < end && !lp_trace_is_collective(&all[at[q]], groups[g])) at[q]++;
                    if (at[q] == end) break;
                    found++;
                    if (all[at[q]].t0 > last) last = all[at[q]].t0;
                }
                if (found < size) break;  // (a member recorded fewer: the window's edge)
                for (int q = 0; q < size; q++) waited[at[q]] = last - all[at[q]].t0, at[q]++;
            }
        }
    }
    free(members);
    free(at);
    free(first);
    return waited;
}

// Stop recording and write every rank's events (collective: every rank calls it).
static void lp_trace_finish(const LPTrainRun* r, int from, int to) {
    const LPProcess* proc = r->proc;
    lp_trace.on = 0;
#ifndef LLMPAR_CPU
    lp_trace_device_times();  // (the streams' events on the host's clock)
#endif
    int n = proc->world, mine = lp_trace.n * (int)sizeof(LPTraceEvent);
    int coord[4] = {proc->coord[LP_TP], proc->coord[LP_CP], proc->coord[LP_PP], proc->coord[LP_DP]};
    int* bytes = (int*)lp_host_malloc((size_t)n * sizeof(int), "trace sizes");
    int* coords = (int*)lp_host_malloc((size_t)n * 4 * sizeof(int), "trace coordinates");
    lp_world_all_gather(proc, &mine, sizeof(int), bytes);
    lp_world_all_gather(proc, coord, sizeof(coord), coords);
    size_t total = 0;
    for (int k = 0; k < n; k++) total += (size_t)bytes[k];
    LPTraceEvent* all = (LPTraceEvent*)lp_host_malloc(proc->rank == 0 ? total + 1 : 1, "trace events");
    lp_world_gather(proc, lp_trace.ev, bytes, all);
    if (proc->rank == 0) {
        int* count = (int*)lp_host_malloc((size_t)n * sizeof(int), "trace counts");
        for (int k = 0; k < n; k++) count[k] = bytes[k] / (int)sizeof(LPTraceEvent);
        double* waited = lp_trace_peer_waits(all, count, coords, n);
        char tmp[LP_PATH_MAX];
        lp_path(tmp, "%s.tmp", r->f->trace);
        FILE* out = fopen(tmp, "w");
        if (!out) lp_fail("flag %s: cannot write %s: %s", LP_FLAG_NAME(trace), tmp, strerror(errno));
        fprintf(out, "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"steps\": \"%d:%d\", \"ranks\": %d, \"clock\": \"the monotonic "
                "clock from rank 0's time as it left a barrier over all ranks (on another host: that rank's own)\", \"build\": \"%s\"",
                from, to, n, LP_BUILD_GPU ? "cuda" : "cpu");
        const LPParallel* par = proc->par;
        if (lp_config_is_gpt2(&r->cfg)) {  // the planner's flags for this run's grid (dev/plot.py --trace sets the plan beside it)
            char plan[LP_PATH_MAX + 512], moe[96] = "", cp[24] = "";
            if (par->cp > 1) snprintf(cp, sizeof(cp), " --cp %d", par->cp);
            if (r->preset && r->cfg.moe_experts)
                snprintf(moe, sizeof(moe), " --moe-experts %d --moe-topk %d --moe-every %d --ep %d", r->cfg.moe_experts, r->cfg.moe_topk,
                         r->cfg.moe_every, par->ep);
            char sg[32] = "";  // (the planner takes it where it applies: t > 1 and p > 1 without SP)
            if (par->tp > 1 && par->pp > 1 && !par->sp) snprintf(sg, sizeof(sg), " --pp-scatter-gather %d", par->scatter_gather);
            snprintf(plan, sizeof(plan), "--plan %d -e %s -t %d -d %d -b %d --tp %d --pp %d --vpp %d --zero %d --recompute %s --offload "
                     "%s%s%s%s%s", n, r->f->init, r->f->T, r->total_batch, r->f->B, par->tp, par->pp, par->vpp, par->zero,
                     lp_recompute_names[par->recompute], lp_offload_names[par->offload], sg, par->sp ? " --sp" : "", moe, cp);
            fprintf(out, ", \"plan\": ");
            lp_json_string(out, plan);
        }
        fprintf(out, "},\n \"traceEvents\": [\n");
        for (int k = 0; k < n; k++) {  // (the events follow these, each after a comma)
            char cp[24] = "";  // (with context parallelism only)
            if (par->cp > 1) snprintf(cp, sizeof(cp), " cp%d", coords[4 * k + 1]);
            fprintf(out, "  {\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, \"args\": {\"name\": \"rank %d: t%d%s "
                    "p%d d%d\"}},\n", k, k, coords[4 * k], cp, coords[4 * k + 2], coords[4 * k + 3]);
            fprintf(out, "  {\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, \"args\": {\"sort_index\": %d}},\n", k, k);
            static const char* const tracks[] = {LP_BUILD_GPU ? "host: the work issued, blocking calls" : "compute and communication",
                                                 "GPU: compute stream", "GPU: comm stream", "GPU: the ring's stream (cp)"};
            int nt = !LP_BUILD_GPU ? 1 : par->cp > 1 ? 4 : 3;
            for (int t = 0; t < nt; t++)
                fprintf(out, "  {\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"args\": {\"name\": \"%s\"}}%s\n", k, t,
                        tracks[t], k == n - 1 && t == nt - 1 && total == 0 ? "" : ",");
        }
        const LPTraceEvent* e = all;
        for (int k = 0; k < n; k++)
            for (int i = 0; i < bytes[k] / (int)sizeof(LPTraceEvent); i++, e++) {
                long long t0 = llround(e->t0 * 1e9), t1 = llround(e->t1 * 1e9);  // ns: a child's end never rounds past its parent's
                char name[48];
                if (e->micro >= 0 && e->chunk >= 0) snprintf(name, sizeof(name), "%s%d", e->name, e->micro);  // F3, B3
                else snprintf(name, sizeof(name), "%s", e->name);
                fprintf(out, "%s  {\"name\": ", e == all ? "" : ",\n");
                lp_json_string(out, name);
                fprintf(out, ", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"ts\": %lld.%03lld, \"dur\": %lld.%03lld, "
                        "\"args\": {", e->kind, k, e->track, t0 / 1000, t0 % 1000, (t1 - t0) / 1000, (t1 - t0) % 1000);
                const char* sep = "";
                if (e->micro >= 0) fprintf(out, "\"micro\": %d", e->micro), sep = ", ";
                if (e->chunk >= 0) fprintf(out, "%s\"chunk\": %d", sep, e->chunk), sep = ", ";
                if (e->group[0]) fprintf(out, "%s\"group\": \"%s\", \"bytes\": %.0f", sep, e->group, e->bytes), sep = ", ";
                if (e->peer >= 0) fprintf(out, "%s\"peer\": %d", sep, e->peer), sep = ", ";
                if (waited[e - all] >= 0.0) fprintf(out, "%s\"waited_for_peers_us\": %.3f", sep, waited[e - all] * 1e6);
                fprintf(out, "}}");
            }
        fprintf(out, "\n ]}\n");
        if (fflush(out) != 0 || ferror(out) || fclose(out) != 0) {
            int err = errno;
            remove(tmp);
            lp_fail("flag %s: cannot write %s: %s", LP_FLAG_NAME(trace), tmp, strerror(err));
        }
        if (rename(tmp, r->f->trace) != 0) lp_fail("flag %s: cannot rename %s to %s: %s", LP_FLAG_NAME(trace), tmp, r->f->trace, strerror(errno));
        lp_log("timeline of steps %d-%d: %zu events of %d ranks in %s (Chrome trace: Perfetto, chrome://tracing)\n", from, to,
               total / sizeof(LPTraceEvent), n, r->f->trace);
        free(waited);
        free(count);
    }
    free(all);
    free(coords);
    free(bytes);
}

// The watchdog's timeout: --timeout-minutes, or max(10 minutes, 20 times the median of the last 32 steps).
static double lp_run_timeout_s(const LPTrainRun* r) {
    if (r->f->timeout_minutes > 0.0f) return 60.0 * r->f->timeout_minutes;
    int n = r->computed < 32 ? r->computed : 32;  // the filled slots are the first n
    double sorted[32];
    memcpy(sorted, r->step_s, sizeof(sorted));
    qsort(sorted, (size_t)n, sizeof(double), lp_compare_double);
    double median = n ? sorted[n / 2] : 0.0;
    return 20.0 * median > 600.0 ? 20.0 * median : 600.0;
}

// The training run: set up, then the step loop, then the end report. Returns the signal that stopped it
// early, or 0.

static int lp_train(LPFlags* f, const LPProcess* proc) {
    LPTrainRun r;
    lp_run_setup(&r, f, proc);
    lp_catch_stop_signals();
    int step = r.first_step, stop = -1, trace_from = 0, trace_to = -1, traced = 0;
    if (f->trace[0]) lp_trace_window(f, &trace_from, &trace_to);
    if (proc->world > 1) lp_watchdog_start(lp_run_timeout_s(&r));
    while (step <= f->max_steps) {
        lp_watchdog.step = step + 1;
        lp_watchdog.timeout_s = proc->world > 1 ? lp_run_timeout_s(&r) : 0.0;
        lp_watch_phase("the step");
        stop = lp_run_stop_asked(proc);
        lp_run_between_steps(&r, step, stop >= 0);  // val loss, a sample, a checkpoint: each when due
        if (step == f->max_steps || stop >= 0) break;
        if (f->trace[0] && !lp_trace.on && step + 1 >= trace_from && step + 1 <= trace_to) lp_trace_start(proc);
        // the step: TP and PP communicate inside forward-backward, DP in the reduction, the whole grid in the norm
        LPStepRecord s;
        memset(&s, 0, sizeof(s));
        char name[24];
        snprintf(name, sizeof(name), "step %d", step + 1);
        int ev = lp_trace_begin("step", name, -1, -1);
        s.t0 = lp_time_s();
        double waited = lp_watchdog.waited;
        s.tp_before = proc->group[LP_TP];
        s.cp_before = proc->group[LP_CP];
        s.dp_before = *lp_dp_group(proc);
        s.scale = r.state.scaler.scale;           // --loss-scale: the gradients are of the loss times it
        r.stage.loss_scale = lp_injected_overflow(r.computed + 1, proc->rank, s.scale > 0.0f ? s.scale : 1.0f);
        s.loss = lp_injected_loss(++r.computed, lp_step_forward_backward(&r.stage, &r.train));  // m micro-batches
        s.t1 = lp_time_s();
        s.busy_s = s.t1 - s.t0 - (lp_watchdog.waited - waited);
        lp_step_reduce_grads(&r.stage);           // averaged over DP (ZeRO: onto the shards); the head's copies summed
        s.norm = lp_step_grad_norm(&r.stage);     // the global norm, before clipping (the loss scale divided out)
        s.lr = lp_lr_schedule(step, f->max_steps, f->warmup, f->lr, f->final_lr_frac, f->decay == 0);
        // loss scaling first: gradients not finite under a finite loss are an overflow, the update skipped and
        // the scale backed off (its own skip, apart from the guard's); what it does not take is the guard's
        s.overflow = isfinite(s.loss) && lp_loss_scaler_update(&r.state.scaler, s.norm);
        if (!s.overflow && !lp_run_diverging(&r, step, &s)) {  // the guard: a loss or norm that diverged is never applied
            s.bad_weights = !lp_step_update(&r.stage, s.lr, s.norm, &r.opt);  // clipping, AdamW; ZeRO gathers
            if (!s.bad_weights) s.spread = lp_step_replicas(&r.stage, &f->outer);  // --diloco, --gossip: DP here
        }
        lp_trace_end(ev);
        step = lp_run_step_end(&r, step, &s);     // the step line, or --on-divergence's
        if (lp_trace.on && step >= trace_to) lp_trace_finish(&r, trace_from, trace_to), traced = 1;
    }
    if (lp_trace.on) lp_trace_finish(&r, trace_from, step), traced = 1;  // stopped inside the window: what it recorded
    if (f->trace[0] && !traced)
        lp_log("notice: %s: no step of %d-%d ran in this launch; no timeline written\n", LP_FLAG_NAME(trace), trace_from, trace_to);
    if (stop >= 0 && r.on_disk == step)
        lp_log("stopped by %s after step %d: checkpoint %s/step_%08d saved; --resume continues the run\n",
               lp_stop_names[stop], step, f->out_dir, step);
    else if (stop >= 0)
        lp_log("stopped by %s after step %d, nothing saved (%s)\n", lp_stop_names[stop], step,
               f->out_dir[0] ? "no step trained yet" : "no -o");
    lp_report_end(&r);
    lp_watchdog.timeout_s = 0.0;  // (the ranks may leave at their own pace)
    lp_run_free(&r);
    return stop >= 0 ? lp_stop_signals[stop] : 0;
}

// --print-schedule: the partition of the -e model's layers into chunks, with each chunk's estimated work
// and memory, and the pipeline timeline this configuration would run, from the simulator. Needs no grid:
// d is the ranks / (t p) when that divides, else 1.
static void lp_print_schedule(const LPFlags* f, const LPProcess* proc) {
    LPConfig cfg;
    lp_model_config(f, proc, &cfg);
    LPParallel par = f->par;
    long long tp_pp = (long long)par.tp * par.cp * par.pp;
    par.dp = proc->world % tp_pp == 0 ? (int)(proc->world / tp_pp) : 1;
    int per_micro = f->B * f->T * par.dp, chunks = par.pp * par.vpp, layers[LP_MAX_CHUNKS], first = 0;
    par.micro_batches = f->total_batch ? f->total_batch / per_micro : 1;
    if (f->total_batch % per_micro != 0)
        lp_fail_all("flag -d: %d tokens is not a multiple of -b * -t * d = %d", f->total_batch, per_micro);
    LPPipeShape shape = {&par, f->B, f->T / par.cp, f->attention, LP_BUILD_GPU};  // (a rank's rows: T/cp of each sequence)
    char why[512];
    if (lp_pp_partition(&cfg, &shape, layers, why, sizeof(why))) lp_fail_all("%s", why);
    lp_log("partition %s of %d layers (L=%d C=%d Vp=%d; B=%d T=%d t=%d d=%d ZeRO-%d%s%s), per chunk: training FLOPs per token, "
           "estimated memory per rank (micro-batches in flight)\n", par.partition, cfg.num_layers, cfg.num_layers,
           cfg.channels, cfg.padded_vocab_size, f->B, f->T, par.tp, par.dp, par.zero, par.recompute ? " recompute " : "",
           par.recompute ? lp_recompute_names[par.recompute] : "");
    for (int k = 0; k < chunks; k++) {
        lp_log("  chunk %d on stage %d:%s", k, k % par.pp, k == 0 ? " embedding," : "");
        if (layers[k] == 1) lp_log(" layer %d,", first);
        if (layers[k] > 1) lp_log(" layers %d-%d,", first, first + layers[k] - 1);
        int slots = lp_chunk_slots(&shape, k);
        lp_log("%s %.3g GFLOP, %.0f MiB (%d in flight)\n", k == chunks - 1 ? " final LayerNorm and LM head," : "",
               lp_chunk_flops(&cfg, &shape, k, layers[k]) / 1e9, lp_chunk_memory(&cfg, &shape, k, layers[k], slots) / 1048576.0,
               slots);
        first += layers[k];
    }
    LPSimulation sim;
    if (lp_schedule_simulate(&sim, par.schedule, par.pp, par.vpp, par.micro_batches, 1.0, 2.0, NULL, why, sizeof(why)))
        lp_fail_all("%s", why);
    if (proc->rank == 0) lp_schedule_print(stdout, &sim, par.schedule);
    lp_simulation_free(&sim);
}

// The watchdog's timeout over the set-up, read before the flags are (MPI starts first): --timeout-minutes
// as typed, else 0 (lp_process_init's 10 minutes).
static double lp_setup_timeout_s(int argc, char** argv) {
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--timeout-minutes") == 0) return 60.0 * atof(argv[i + 1]);
    return 0.0;
}

// --auto's machine, as the planner (dev/plan/plan.h) describes one: the CUDA build's GPU by its name (an
// unknown one planned with an H100's speeds) and its memory; the CPU build's planner preset "cpu" with this
// machine's rates, measured now by every rank at once so they share the cores as the run will (a matmul's
// FLOP/s, a copy's bytes read and written per second, each the best of 3, averaged over the ranks), and the
// host's memory shared by its ranks; gpu_mem GiB instead where not 0 (--gpu-mem). ranks_here: the ranks on this
// rank's host (a node of the plan).
static LPPlanMachine lp_auto_machine(const LPProcess* proc, float gpu_mem, int* ranks_here, char* about, size_t size) {
    char host[64] = "", *hosts = (char*)lp_host_malloc((size_t)proc->world * sizeof(host), "host names");
    gethostname(host, sizeof(host) - 1);
    lp_world_all_gather(proc, host, sizeof(host), hosts);
    *ranks_here = 0;
    for (int r = 0; r < proc->world; r++) *ranks_here += strcmp(hosts + r * sizeof(host), host) == 0;
    free(hosts);
    LPPlanMachine m;
#ifdef LLMPAR_CPU
    int N = 256, C = 512, OC = 2048;
    size_t copy = (size_t)32 << 20;  // bytes
    float *a = (float*)lp_host_malloc((size_t)N * C * 4, "--auto"), *w = (float*)lp_host_malloc((size_t)OC * C * 4, "--auto");
    float *out = (float*)lp_host_malloc((size_t)N * OC * 4, "--auto"), *x = (float*)lp_host_malloc(copy, "--auto");
    float* y = (float*)lp_host_malloc(copy, "--auto");
    uint64_t rng = 1;
    for (size_t i = 0; i < (size_t)N * C; i++) a[i] = lp_rand_f32(&rng);
    for (size_t i = 0; i < (size_t)OC * C; i++) w[i] = lp_rand_f32(&rng);
    memset(x, 1, copy);
    float rates[2] = {0.0f, 0.0f};  // FLOP/s, bytes/s
    lp_barrier(&proc->world_group);
    for (int k = 0; k < 3; k++) {
        double t0 = lp_time_s();
        lp_matmul_forward_cpu(out, NULL, a, w, NULL, N, C, OC);
        double t1 = lp_time_s();
        memcpy(y, x, copy);
        double t2 = lp_time_s();
        rates[0] = fmaxf(rates[0], (float)(2.0 * N * C * OC / (t1 - t0)));
        rates[1] = fmaxf(rates[1], (float)(2.0 * copy / (t2 - t1)));
    }
    free(a), free(w), free(out), free(x), free(y);
    lp_all_reduce_host(&proc->world_group, rates, 2, 1);
    double memory = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGE_SIZE) / *ranks_here;
    m = lp_plan_machine(lp_cluster_named("cpu"), NULL, lp_software_named("llmpar"));
    m.gpu.peak_flops = rates[0];
    m.gpu.hbm_bw = rates[1];
    m.gpu_bytes = 0.9 * memory;
    snprintf(about, size, "the CPU engine at %.3g GFLOP/s and %.3g GB/s per rank (measured), %.3g GiB per rank", rates[0] / 1e9,
             rates[1] / 1e9, memory / 1073741824.0);
#else
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    static const struct { const char* in_name; const char* gpu; const char* cluster; } known[] = {
        {"GB200", "gb200", "nvl72"}, {"B200", "b200", "nvl72"}, {"H200", "h200", "dgx-h100"}, {"H100", "h100", "dgx-h100"},
        {"H800", "h100", "dgx-h100"}, {"A100", "a100", "dgx-a100"}, {"A800", "a100", "dgx-a100"}};
    int k = 0, n = (int)(sizeof(known) / sizeof(known[0]));
    while (k < n && !strstr(prop.name, known[k].in_name)) k++;
    const char* gpu = k < n ? known[k].gpu : "h100";
    m = lp_plan_machine(lp_cluster_named(k < n ? known[k].cluster : "dgx-h100"), lp_gpu_named(gpu), lp_software_named("llmpar"));
    m.gpu_bytes = 0.9 * (double)prop.totalGlobalMem;
    snprintf(about, size, "%.128s, planned as %s%s with %.3g GiB", prop.name, gpu, k < n ? "" : " (not among the planner's GPUs)",
             prop.totalGlobalMem / 1073741824.0);
#endif
    if (gpu_mem > 0.0f) {
        m.gpu_bytes = 0.9 * gpu_mem * 1073741824.0;
        snprintf(about + strlen(about), size - strlen(about), ", planned with %.3g GiB per rank (--gpu-mem)", (double)gpu_mem);
    }
    m.gpus_per_node = *ranks_here;
    return m;
}

// --auto: the planner chooses how this run's ranks split the work: every t x p x cp x d grid with its interleaving,
// SP, scatter-gather, ZeRO stage, recomputation, offload and micro-batch -b that fits a rank's memory on this
// machine, each step simulated (lp_plan), the fastest this build runs taken (the CPU build offloads only to
// files; neither offloads to files without --offload-dir). Context parallelism only where no grid without it runs
// within a rank's memory (then the fastest with it): the planner's price of the ring is not checked against runs
// (the CUDA build's ring, its flash kernels, has not been timed on a GPU; the CPU build at d4, T 512 on 4 ranks, with
// the ring's former scalar loops: cp 2 and 4 measured 2.0-2.3x cp 1's step, planned 1.01x), while cp is the one
// axis that splits a sequence's activations where TP cannot (its heads). A grid flag typed (--tp, --pp, --vpp, --ep,
// --cp, --sp, --pp-scatter-gather, --zero, --recompute, --offload, -b) is kept: the search passes only plans that
// have it. The tokens per step are -d's, or -b * -t * the ranks. Rank 0's choice goes to every rank; one line says
// what was chosen and why.
static void lp_auto_grid(LPFlags* f, const LPProcess* proc) {
    LPConfig cfg;
    lp_model_config(f, proc, &cfg);
    if (f->T > cfg.max_seq_len) lp_fail_all("flag -t: sequence length %d exceeds the model's maximum %d", f->T, cfg.max_seq_len);
    int ranks_here;
    char about[256], why[256];
    LPPlanMachine mach = lp_auto_machine(proc, f->gpu_mem, &ranks_here, about, sizeof(about));
    LPPlanModel model = lp_plan_model_of(&cfg);
    long long tokens = f->total_batch ? f->total_batch : (long long)f->B * f->T * proc->world;
    struct { size_t field; unsigned bit; } kept[] = {
        {LP_FIELD(par.tp), LP_FIX_TP}, {LP_FIELD(par.pp), LP_FIX_PP}, {LP_FIELD(par.vpp), LP_FIX_VPP}, {LP_FIELD(par.ep), LP_FIX_EP},
        {LP_FIELD(par.cp), LP_FIX_CP}, {LP_FIELD(par.zero), LP_FIX_ZERO}, {LP_FIELD(par.recompute), LP_FIX_RECOMPUTE}, {LP_FIELD(par.offload), LP_FIX_OFFLOAD},
        {LP_FIELD(par.sp), LP_FIX_SP}, {LP_FIELD(par.scatter_gather), LP_FIX_SG}, {LP_FIELD(B), LP_FIX_B}};
    LPPlanLimits limits = {0, f->par, f->B};
    for (size_t k = 0; k < sizeof(kept) / sizeof(kept[0]); k++)
        if (lp_flag_typed(f, kept[k].field)) limits.fixed |= kept[k].bit;
    unsigned typed = limits.fixed;
    if ((f->par.diloco || f->par.gossip) && !(limits.fixed & LP_FIX_ZERO)) limits.fixed |= LP_FIX_ZERO, limits.par.zero = 0;
    if (!LP_BUILD_GPU && !(limits.fixed & LP_FIX_OFFLOAD)) limits.fixed |= LP_FIX_OFFLOAD, limits.par.offload = LP_OFFLOAD_NONE;
    if (f->attention != LP_ATTENTION_FLASH && !(limits.fixed & LP_FIX_CP)) limits.fixed |= LP_FIX_CP, limits.par.cp = 1;  // (the ring: flash's)
    int cp_free = !(limits.fixed & LP_FIX_CP), cp_needed = 0;  // (cp 1 first; every cp only where none of those runs: see above)
    if (cp_free) limits.fixed |= LP_FIX_CP, limits.par.cp = 1;
    LPPlan* plans = NULL;  // (the fastest 16 simulated: the first that runs here, and the next for the reason)
    int count = 0, best = -1, next = -1;
    for (int pass = 0; pass <= cp_free && best < 0; pass++) {
        if (pass == 1) free(plans), limits.fixed &= ~LP_FIX_CP, cp_needed = 1;
        count = lp_plan(&model, f->T, tokens, proc->world, f->attention, &mach, &limits, 16, &plans);
        for (int k = 0; k < count && next < 0; k++) {
            int off = plans[k].par.offload, runs = plans[k].fits && plans[k].simulated &&
                (off == LP_OFFLOAD_NONE || (off == LP_OFFLOAD_NVME ? f->par.offload_dir[0] != '\0' : LP_BUILD_GPU));
            if (runs && best < 0) best = k;
            else if (runs) next = k;
        }
    }
    if (best < 0) {
        free(plans);
        lp_fail_all("flag --auto: no grid of %d ranks runs -e %s with -t %d and %lld tokens per step within %.3g GiB per rank%s", proc->world,
                    f->init, f->T, tokens, mach.gpu_bytes / 0.9 / 1073741824.0, typed ? " and the grid flags typed" : "");
    }
    int chosen[11];  // (rank 0's, for every rank: the plan is the same everywhere unless a rate differed in its last bit)
    const LPPlan* x = &plans[best];
    int mine[11] = {x->par.tp, x->par.pp, x->par.vpp, x->par.ep, x->par.sp, x->par.scatter_gather, x->par.zero, x->par.recompute,
                    x->par.offload, x->B, x->par.cp};
    memcpy(chosen, mine, sizeof(chosen));
    lp_world_broadcast(proc, chosen, sizeof(chosen), 0);
    LPParallel* p = &f->par;
    p->tp = chosen[0], p->pp = chosen[1], p->vpp = chosen[2], p->ep = chosen[3], p->sp = chosen[4], p->scatter_gather = chosen[5];
    p->zero = chosen[6], p->recompute = chosen[7], p->offload = chosen[8], f->B = chosen[9], p->cp = chosen[10];
    if (p->vpp > 1) p->schedule = LP_SCHEDULE_INTERLEAVED;
    f->total_batch = (int)tokens;
    why[0] = '\0';
    if (next >= 0)
        snprintf(why, sizeof(why), "; the next, t=%d p=%d v=%d d=%d cp=%d ZeRO-%d %s B=%d: %.4g ms", plans[next].par.tp, plans[next].par.pp,
                 plans[next].par.vpp, plans[next].par.dp, plans[next].par.cp, plans[next].par.zero,
                 lp_recompute_names[plans[next].par.recompute], plans[next].B, plans[next].step_s * 1e3);
    char cp_why[128] = "";
    if (cp_needed)
        snprintf(cp_why, sizeof(cp_why), "; cp=%d: no grid without context parallelism runs within %.3g GiB per rank", p->cp,
                 mach.gpu_bytes / 0.9 / 1073741824.0);
    else if (cp_free)
        snprintf(cp_why, sizeof(cp_why), "; cp 1: a grid without context parallelism fits (cp only where none does)");
    char ep[32] = "";
    if (p->cp > 1) snprintf(ep, sizeof(ep), " cp=%d", p->cp);
    if (p->ep > 1) snprintf(ep + strlen(ep), sizeof(ep) - strlen(ep), " ep=%d", p->ep);
    lp_log("auto: t=%d p=%d v=%d d=%d%s%s, ZeRO-%d, recompute %s, offload %s, -b %d (m=%d): the fastest simulated step of %d "
           "configurations of %d ranks%s, %.4g ms, %.3g GiB on the fullest rank of %.3g%s%s; on %s\n", p->tp, p->pp, p->vpp, x->par.dp,
           p->sp ? " SP" : "", ep, p->zero, lp_recompute_names[p->recompute], lp_offload_names[p->offload], f->B, x->par.micro_batches,
           count, proc->world, typed ? " with the grid flags typed" : "", x->step_s * 1e3, x->memory / 1073741824.0,
           mach.gpu_bytes / 0.9 / 1073741824.0, why, cp_why, about);
    free(plans);
}

int main(int argc, char** argv) {
    LPProcess proc;
    lp_watchdog.timeout_s = lp_setup_timeout_s(argc, argv);
    lp_process_init(&proc, &argc, &argv);
    LPFlags flags;
    lp_setting_namer = lp_setting_flag;  // the header's errors name this driver's flags
    int stopped = 0;  // the signal that stopped the run (lp_train)
    int flags_given = lp_flags_agree(&proc, lp_parse_flags(&flags, argc, argv));
    if (flags_given) {
        lp_ranks_agree(&flags, &proc);
        lp_check_flags(&flags);
    }
    if (!flags_given) {
        lp_usage();
    } else if (flags.print_flags) {
        lp_print_flags(&flags);
    } else if (flags.print_schedule) {
        LPParallel alone = lp_parallel_one;  // the world group only: rank 0 reads an -e file before the others
        lp_grid_init(&proc, &alone);
        lp_print_schedule(&flags, &proc);
    } else {
        if (flags.auto_grid) lp_auto_grid(&flags, &proc);
        lp_grid_init(&proc, &flags.par);
        lp_device_init(&proc);
        lp_comm_init(&proc);
        stopped = lp_train(&flags, &proc);
    }
    lp_process_finish(&proc);
    return stopped ? 128 + stopped : 0;
}
