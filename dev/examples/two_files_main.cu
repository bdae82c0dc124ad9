// llmpar.h used from two files, as a program of several files uses it: this one defines
// LLMPAR_IMPLEMENTATION before the include, so it compiles the library (its functions, kernels and
// globals); two_files_eval.cu includes the header plain and evaluates the model with them. One model alone
// (no grid, no pipeline stage: the model's own forward, backward and AdamW of sections 8-9), whose val
// loss, measured by the other file, falls over the steps. scripts/run_tests.sh checks that on each build,
// and that the program without the define fails to link.
//   CPU:  make dev/examples/two_files_cpu && dev/examples/two_files_cpu [steps]
//   CUDA: make dev/examples/two_files && dev/examples/two_files [steps]
#define LLMPAR_IMPLEMENTATION  // this file defines llmpar.h's globals (one file of a program does)
#include "../../llmpar.h"

void two_files_eval(LPModel* model, int B, int T);  // two_files_eval.cu: prints the val loss

int main(int argc, char** argv) {
    int B = 4, T = 64, steps = argc > 1 ? atoi(argv[1]) : 20;
    LPProcess proc;
    lp_process_init(&proc, &argc, &argv);  // lp_rank: under mpirun each rank trains alone, rank 0 prints
    lp_device_init(&proc);                 // CUDA: the cuBLASLt handle and workspace, used in both files
    LPConfig cfg;
    lp_config_from_name(&cfg, "d2");
    cfg.max_seq_len = T;
    LPModel model;
    lp_model_create(&model, &cfg, NULL);   // the whole model on this rank
    lp_model_init_random(&model, 1337);
    lp_model_alloc_activations(&model, B, T, 1);
    LPDataOptions shards = {.pattern = "dev/data/tinyshakespeare/tiny_shakespeare_train.bin", .B = B, .T = T,
                            .vocab_size = cfg.vocab_size, .scan = 1};
    LPDataLoader data;
    lp_dataloader_init(&data, &shards);
    LPAdamW opt = {0.9f, 0.95f, 1e-8f, 0.1f, 1.0f};
    two_files_eval(&model, B, T);
    for (int step = 1; step <= steps; step++) {
        lp_dataloader_next(&data);
        lp_model_zero_grad(&model);
        float loss = lp_model_forward(&model, data.inputs, data.targets, B, T, 1.0f / (B * T));
        lp_model_backward(&model, 1);
        float norm = lp_models_grad_norm(&model, 1, NULL);  // (one model: nothing to reduce first)
        lp_models_adamw(&model, 1, NULL, 1e-3f, norm, &opt);
        lp_log("step %d/%d | loss %.4f | norm %.4f\n", step, steps, loss, norm);
    }
    two_files_eval(&model, B, T);
    lp_dataloader_free(&data); lp_model_free(&model); lp_process_finish(&proc);
    return 0;
}
