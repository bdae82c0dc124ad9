// llmpar.h as a library: the training loop of llmpar.h's top comment, verbatim (scripts/run_tests.sh checks
// that they match), compiled. A depth-2 GPT-2 from a preset, trained on the shipped tinyshakespeare tokens;
// each step prints its loss, which falls. Run from the repo root, `make test` does on each build:
//   CPU:  make dev/examples/train_loop_cpu && dev/examples/train_loop_cpu [steps]
//   CUDA: make dev/examples/train_loop && dev/examples/train_loop [steps]
// One process is the whole world (no mpirun needed); `mpirun -np 2 dev/examples/train_loop_cpu` runs the
// same loop data-parallel: each rank on its slice of the batch, gradients averaged over the ranks.
#define LLMPAR_IMPLEMENTATION  // this file defines llmpar.h's globals (one file of a program does)
#include "../../llmpar.h"

int main(int argc, char** argv) {
    int B = 4, T = 64, steps = argc > 1 ? atoi(argv[1]) : 20;
    LPProcess proc;                             // alone, a process is the whole world; under mpirun,
    lp_process_init(&proc, &argc, &argv);       //   MPI starts and each rank is a data-parallel replica
    lp_grid_init(&proc, 1, 1);                  // tp = pp = 1
    lp_device_init(&proc);                      // CUDA: the rank's GPU, cuBLASLt (CPU build: nothing)
    lp_comm_init(&proc, "auto");                // NCCL between GPUs, else MPI
    LPConfig cfg;
    lp_config_from_depth(&cfg, "d2");           // a preset: d12 is GPT-2 124M; dN: N layers, 64N channels
    cfg.max_seq_len = T;
    LPSplit split;                              // how the model is split over the ranks: DP only
    memset(&split, 0, sizeof(split));
    split.dp = &proc.dp_group;
    LPModel model;                              // or from an llm.c file: lp_model_load(&model, path, &split)
    lp_model_create(&model, &cfg, &split);
    lp_model_init_random(&model, 1337);
    lp_model_alloc_activations(&model, B, T, 1);
    LPDataLoader data;                          // llm.c shards; this rank's (B, T) slice of each batch
    lp_dataloader_init(&data, "dev/data/tinyshakespeare/tiny_shakespeare_train.bin", "train data", B, T,
                       proc.dp_rank, proc.dp, 0, 0, 0, cfg.vocab_size, 1);  // windows of one batch, file
                                                // order (shuffle 0, seed 0), every token checked (1)
    LPAdamW opt = {0.9f, 0.95f, 1e-8f, 0.1f, 1.0f};  // beta1, beta2, eps, weight decay, grad-norm clip (train_gpt's)
    for (int step = 1; step <= steps; step++) {
        lp_dataloader_next(&data);              // data.inputs, data.targets: the same tokens one ahead
        lp_model_zero_grad(&model);
        float loss = lp_model_forward(&model, data.inputs, data.targets, B, T, 1.0f / (B * T));  // mean loss
        lp_model_backward(&model, 1);           // 1: the step's last micro-batch
        float norm = lp_models_grad_norm(&model, 1, NULL);    // averages the gradients over dp; their norm
        lp_models_adamw(&model, 1, NULL, 1e-3f, norm, &opt);  // clips, then AdamW at lr 1e-3
        lp_log("step %d/%d | loss %.4f | norm %.4f\n", step, steps, loss, norm);  // rank 0 prints its loss
    }
    lp_dataloader_free(&data); lp_model_free(&model); lp_process_finish(&proc);
    return 0;
}
