// llmpar.h as a library: the training loop of llmpar.h's top comment, verbatim (scripts/run_tests.sh checks
// that they match), compiled. A depth-2 GPT-2 from a preset, trained on the shipped tinyshakespeare tokens
// with tensor, pipeline and data parallelism; each step prints its loss, which falls. Run from the repo
// root, `make test` does on each build:
//   CPU:  make dev/examples/train_loop_cpu && dev/examples/train_loop_cpu [steps [t [p]]]
//   CUDA: make dev/examples/train_loop && dev/examples/train_loop [steps [t [p]]]
// One process is the whole world (no mpirun needed). `mpirun -np 8 dev/examples/train_loop_cpu 20 2 2` runs
// the same loop on a 2 x 2 x 2 grid: each layer split over t = 2 ranks, the layers over p = 2 pipeline
// stages, and d = 8 / (t p) = 2 data-parallel replicas, each on its slice of the batch.
#define LLMPAR_IMPLEMENTATION  // this file defines llmpar.h's globals (one file of a program does)
#include "../../llmpar.h"

int main(int argc, char** argv) {
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
    return 0;
}
