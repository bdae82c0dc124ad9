// The second file of dev/examples/two_files_main.cu's program: it includes llmpar.h plain (no
// LLMPAR_IMPLEMENTATION), so it sees the declarations alone and calls the functions two_files_main.cu
// compiled, on the globals that file defines and set up: lp_rank (only rank 0 prints) and, on the CUDA
// build, the cuBLASLt handle and workspace from lp_device_init and the scratch buffers of the forward
// pass. (It compiles in a tenth of a second: no function body or kernel of llmpar.h is compiled here.)
#include "../../llmpar.h"

// Prints (rank 0) the model's mean loss on the first (B, T) batch of the val tokens.
void two_files_eval(LPModel* model, int B, int T) {
    LPDataOptions shards = {.pattern = "dev/data/tinyshakespeare/tiny_shakespeare_val.bin", .B = B, .T = T,
                            .vocab_size = model->cfg.vocab_size, .scan = 1};
    LPDataLoader val;
    lp_dataloader_init(&val, &shards);
    lp_dataloader_next(&val);
    float loss = lp_model_forward(model, val.inputs, val.targets, B, T, 1.0f / (B * T));
    lp_dataloader_free(&val);
    lp_log("val loss %.4f (two_files_eval.cu)\n", loss);
}
