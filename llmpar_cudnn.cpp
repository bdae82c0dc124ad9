// llmpar_cudnn.cpp: --attention cudnn, cuDNN's fused attention (SDPA) forward and backward through
// cudnn-frontend's graphs, as llm.c's USE_CUDNN. Its own translation unit because the frontend is C++
// (header-only, heavy to compile); built and linked only by `make USE_CUDNN=1 train_gpt`, which defines
// LLMPAR_CUDNN for llmpar.h. It runs only on a GPU: the CUDA emulator has no cuDNN.
//
// The layouts are the flash path's (llmpar.h section 6), so either path fills the same activations: qkv as
// the qkv projection writes it, (B, T, 3, NH, HS); out and dout (B, T, NH, HS); lse the logsumexp of each
// row of the scaled, causally masked scores, (B, NH, T) in fp32, which cuDNN calls the softmax stats.
// Each graph is built once per shape and kept. The workspace grows to the largest a graph asks for (the
// first step's calls), then stays.
// defines: lp_cudnn_attention_forward, lp_cudnn_attention_backward, lp_cudnn_free
#include <cuda_runtime.h>
#include <cudnn_frontend.h>  // cudnn-frontend, from PyPI's nvidia-cudnn-frontend (`make cudnn-frontend`)
#include <map>
#include <memory>
#include <string>
#include <tuple>

namespace fe = cudnn_frontend;

static cudnnHandle_t lp_cudnn_handle;
static void* lp_cudnn_workspace;
static size_t lp_cudnn_workspace_size;
static std::map<std::tuple<int, int, int, int, int>, std::shared_ptr<fe::graph::Graph>> lp_cudnn_graphs;  // (B, T, NH, HS, backward)
static char lp_cudnn_error[1024];

enum { LP_Q, LP_K, LP_V, LP_O, LP_LSE, LP_DO, LP_DQ, LP_DK, LP_DV };  // each tensor's uid in a graph's variant pack

static const char* lp_cudnn_fail(const char* what, const std::string& why) {
    snprintf(lp_cudnn_error, sizeof(lp_cudnn_error), "cuDNN attention: %s: %s", what, why.c_str());
    return lp_cudnn_error;
}

// Returns why from the calling function when a frontend call fails (its error_t, which must not be dropped).
#define LP_CUDNN_TRY(what, call)                                    \
    do {                                                            \
        fe::error_t err_ = (call);                                  \
        if (!err_.is_good()) return lp_cudnn_fail(what, err_.get_message()); \
    } while (0)

// A tensor of the graph in one of the layouts above: qkv's q, k or v (a row of 3C), a (B, T, NH, HS) one
// (row of C), or lse.
static std::shared_ptr<fe::graph::Tensor_attributes> lp_cudnn_tensor(fe::graph::Graph& g, int uid, int B, int T, int NH, int HS) {
    int64_t C = (int64_t)NH * HS, row = uid <= LP_V ? 3 * C : C;  // q, k and v: in a row of 3C
    auto a = fe::graph::Tensor_attributes().set_name(std::to_string(uid)).set_uid(uid);
    if (uid == LP_LSE)
        a.set_dim({B, NH, T, 1}).set_stride({(int64_t)NH * T, T, 1, 1}).set_data_type(fe::DataType_t::FLOAT);
    else
        a.set_dim({B, NH, T, HS}).set_stride({T * row, HS, row, 1});
    return g.tensor(a);
}

// The forward (backward = 0) or backward graph of a shape, built once.
static const char* lp_cudnn_graph(int B, int T, int NH, int HS, int backward, std::shared_ptr<fe::graph::Graph>* out) {
    auto key = std::make_tuple(B, T, NH, HS, backward);
    auto it = lp_cudnn_graphs.find(key);
    if (it != lp_cudnn_graphs.end()) {
        *out = it->second;
        return NULL;
    }
    if (!lp_cudnn_handle && cudnnCreate(&lp_cudnn_handle) != CUDNN_STATUS_SUCCESS) return lp_cudnn_fail("cudnnCreate", "no cuDNN handle");
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
    auto q = lp_cudnn_tensor(*g, LP_Q, B, T, NH, HS), k = lp_cudnn_tensor(*g, LP_K, B, T, NH, HS), v = lp_cudnn_tensor(*g, LP_V, B, T, NH, HS);
    float scale = 1.0f / sqrtf((float)HS);
    if (!backward) {
        auto opt = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true).set_causal_mask(true).set_attn_scale(scale);
        auto [o, lse] = g->sdpa(q, k, v, opt);
        o->set_output(true).set_uid(LP_O).set_dim({B, NH, T, HS}).set_stride({(int64_t)T * NH * HS, HS, (int64_t)NH * HS, 1});
        lse->set_output(true).set_uid(LP_LSE).set_data_type(fe::DataType_t::FLOAT);
    } else {
        auto o = lp_cudnn_tensor(*g, LP_O, B, T, NH, HS), dout = lp_cudnn_tensor(*g, LP_DO, B, T, NH, HS);
        auto lse = lp_cudnn_tensor(*g, LP_LSE, B, T, NH, HS);
        auto opt = fe::graph::SDPA_backward_attributes().set_name("attention_backward").set_causal_mask(true).set_attn_scale(scale);
        auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, lse, opt);
        int64_t row = 3 * (int64_t)NH * HS;
        dq->set_output(true).set_uid(LP_DQ).set_dim({B, NH, T, HS}).set_stride({T * row, HS, row, 1});
        dk->set_output(true).set_uid(LP_DK).set_dim({B, NH, T, HS}).set_stride({T * row, HS, row, 1});
        dv->set_output(true).set_uid(LP_DV).set_dim({B, NH, T, HS}).set_stride({T * row, HS, row, 1});
    }
    const char* what = backward ? "building the backward graph" : "building the forward graph";
    LP_CUDNN_TRY(what, g->validate());
    LP_CUDNN_TRY(what, g->build_operation_graph(lp_cudnn_handle));
    LP_CUDNN_TRY(what, g->create_execution_plans({fe::HeurMode_t::A}));
    LP_CUDNN_TRY(what, g->check_support(lp_cudnn_handle));
    LP_CUDNN_TRY(what, g->build_plans(lp_cudnn_handle));
    int64_t need = 0;
    LP_CUDNN_TRY("workspace size", g->get_workspace_size(need));
    if ((size_t)need > lp_cudnn_workspace_size) {
        if (lp_cudnn_workspace) cudaFree(lp_cudnn_workspace);
        cudaError_t err = cudaMalloc(&lp_cudnn_workspace, (size_t)need);
        if (err != cudaSuccess) return lp_cudnn_fail("workspace", cudaGetErrorString(err));
        lp_cudnn_workspace_size = (size_t)need;
    }
    lp_cudnn_graphs[key] = g;
    *out = g;
    return NULL;
}

static const char* lp_cudnn_run(int B, int T, int C, int NH, int backward, std::unordered_map<int64_t, void*>& pack) {
    std::shared_ptr<fe::graph::Graph> g;
    const char* why = lp_cudnn_graph(B, T, NH, C / NH, backward, &g);
    if (why) return why;
    LP_CUDNN_TRY(backward ? "backward" : "forward", g->execute(lp_cudnn_handle, pack, lp_cudnn_workspace));
    return NULL;
}

// out (B, T, C) and lse (B, NH, T) from qkv (B, T, 3C). NULL, or why it failed.
const char* lp_cudnn_attention_forward(void* out, float* lse, const void* qkv, int B, int T, int C, int NH) {
    char* base = (char*)qkv;  // bf16: q, k, v at 0, C, 2C values into a row
    std::unordered_map<int64_t, void*> pack = {{LP_Q, base}, {LP_K, base + 2 * (size_t)C}, {LP_V, base + 4 * (size_t)C},
                                               {LP_O, out}, {LP_LSE, lse}};
    return lp_cudnn_run(B, T, C, NH, 0, pack);
}

// dqkv (B, T, 3C, overwritten) from dout, and the forward's out, qkv and lse.
const char* lp_cudnn_attention_backward(void* dqkv, const void* dout, const void* out, const void* qkv, const float* lse, int B, int T,
                                        int C, int NH) {
    char *base = (char*)qkv, *dbase = (char*)dqkv;
    std::unordered_map<int64_t, void*> pack = {
        {LP_Q, base}, {LP_K, base + 2 * (size_t)C}, {LP_V, base + 4 * (size_t)C}, {LP_O, (void*)out}, {LP_DO, (void*)dout},
        {LP_LSE, (void*)lse}, {LP_DQ, dbase}, {LP_DK, dbase + 2 * (size_t)C}, {LP_DV, dbase + 4 * (size_t)C}};
    return lp_cudnn_run(B, T, C, NH, 1, pack);
}

void lp_cudnn_free(void) {
    lp_cudnn_graphs.clear();
    if (lp_cudnn_workspace) cudaFree(lp_cudnn_workspace);
    lp_cudnn_workspace = NULL;
    lp_cudnn_workspace_size = 0;
    if (lp_cudnn_handle) cudnnDestroy(lp_cudnn_handle);
    lp_cudnn_handle = NULL;
}
