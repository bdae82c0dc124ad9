#!/usr/bin/env python3
"""
A Hugging Face GPT-2 directory as an llm.c model file (fp32, version 3) that train_gpt loads with -e.

    python3 dev/hf/import.py hf/gpt2 --out gpt2_124M.bin
    ./train_gpt_cpu -e gpt2_124M.bin ...

Reads config.json and the weights: model.safetensors (F32, F16 or BF16; numpy only), a sharded
model.safetensors.index.json, or pytorch_model.bin (needs torch). A LlamaForCausalLM (model_type llama)
becomes an llm.c Llama 3 file (magic 20240803, fp32), q_proj's and k_proj's rows taken from Hugging Face's
rotary order to the interleaved one the engine turns (dev/hf/llama_files.py). Names with or without the
"transformer." prefix (GPT2LMHeadModel or GPT2Model); the attention mask buffers are skipped; an
lm_head.weight must equal wte (llm.c ties them). The vocabulary is padded as llm.c pads it, to a multiple
of 128 with zero rows. Errors are one line naming the file, and leave no output file.
"""
import argparse
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_files import (TENSORS, FileError, write_whole, is_int, llmc_header, padded_vocab, read_json, read_safetensors, show,
                        show_name)
import llama_files

# Activations that are GELU's tanh form, the engine's
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
PREFIX = "transformer."
INT32_MAX = 2**31 - 1


def read_config(d):
    """The llm.c shape (maxT, V, L, NH, C, Vp) of the GPT-2 in d/config.json, after checking each field's
    type and that the engine computes the same model: tanh GELU, LayerNorm eps 1e-5, MLP width 4C, tied
    head, scaled attention, no cross-attention. The sizes must fit the llm.c header's int32s; what the
    weights hold bounds them further (check_weights)."""
    path = os.path.join(d, "config.json")
    c = read_json(path)
    if not isinstance(c, dict):
        raise FileError(f"{path}: not a model config (a JSON object)")
    if c.get("model_type") != "gpt2":
        raise FileError(f"{path}: model_type {show(c.get('model_type'))}, not a GPT-2 (want 'gpt2') or a Llama ('llama')")
    archs = c.get("architectures") or ["GPT2LMHeadModel"]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise FileError(f"{path}: architectures {show(archs)} is not a list of names")
    if not set(archs) & {"GPT2LMHeadModel", "GPT2Model"}:
        raise FileError(f"{path}: architectures {show(archs)}: want GPT2LMHeadModel or GPT2Model")
    sizes = {}
    for key in ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"):
        v = c.get(key)
        if key not in c:
            raise FileError(f"{path}: no {key}")
        if not is_int(v) or v <= 0:
            raise FileError(f"{path}: {key} {show(v)} is not a positive integer")
        if v > INT32_MAX:
            raise FileError(f"{path}: {key} {v} is beyond the llm.c header's int32 ({INT32_MAX})")
        sizes[key] = v
    C, L, NH, V, maxT = sizes.values()
    if padded_vocab(V) > INT32_MAX:
        raise FileError(f"{path}: vocab_size {V} padded to {padded_vocab(V)} is beyond the llm.c header's int32")
    eps = c.get("layer_norm_epsilon", 1e-5)
    if not (is_int(eps) or isinstance(eps, float)):
        raise FileError(f"{path}: layer_norm_epsilon {show(eps)} is not a number")
    problems = []
    if C % NH:
        problems.append(f"n_embd {C} is not a multiple of n_head {NH}")
    if c.get("n_inner") not in (None, 4 * C):
        problems.append(f"n_inner {show(c['n_inner'])} (the engine's MLP is 4 * n_embd = {4 * C})")
    if c.get("activation_function", "gelu_new") not in TANH_GELU:
        problems.append(f"activation_function {show(c['activation_function'])} (the engine's is tanh GELU, gelu_new)")
    if abs(eps - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon {eps} (the engine's is 1e-5)")
    for key, want in (("tie_word_embeddings", True), ("scale_attn_weights", True),
                      ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False)):
        if c.get(key, want) is not want:
            problems.append(f"{key} {show(c[key])} (the engine needs {want})")
    if problems:
        raise FileError(f"{path}: {'; '.join(problems)}")
    return dict(maxT=maxT, V=V, L=L, NH=NH, C=C, Vp=padded_vocab(V))


def read_torch(path):
    """{name: (dtype, shape, loader)} of a pytorch_model.bin."""
    try:
        import torch
    except ImportError:
        raise FileError(f"{path}: reading it needs torch, which is not installed (pip install torch, or save "
                        f"the model as model.safetensors)") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FileError(f"{path}: torch cannot read it ({why})") from None
    return {k: (str(v.dtype), tuple(v.shape), lambda v=v: v.float().numpy()) for k, v in state.items()}


def read_index(index):
    """{tensor name: shard file} of a model.safetensors.index.json: plain file names in its directory."""
    index_json = read_json(index)
    weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
    if not isinstance(weight_map, dict):
        raise FileError(f"{index}: no weight_map object (not a safetensors index)")
    for name, file in weight_map.items():
        if not isinstance(file, str) or file in ("", ".", "..") or os.path.basename(file) != file:
            raise FileError(f"{index}: {show_name(name)}: {show(file)} is not a file name in its directory")
    return weight_map


def read_weights(d):
    """{name: (file, shape, loader)} of every tensor in d, from the first of model.safetensors,
    model.safetensors.index.json (shards) and pytorch_model.bin that is there. Each shard holds exactly
    the tensors its index gives it."""
    single = os.path.join(d, "model.safetensors")
    index = os.path.join(d, "model.safetensors.index.json")
    torch_bin = os.path.join(d, "pytorch_model.bin")
    if os.path.exists(single):
        return {k: (single, shape, load) for k, (_, shape, load) in read_safetensors(single).items()}
    if not os.path.exists(index):
        if os.path.exists(torch_bin):
            return {k: (torch_bin, shape, load) for k, (_, shape, load) in read_torch(torch_bin).items()}
        raise FileError(f"{single}: No such file (nor model.safetensors.index.json or pytorch_model.bin)")
    weight_map = read_index(index)
    out = {}
    for file in sorted(set(weight_map.values())):
        path = os.path.join(d, file)
        for k, (_, shape, load) in read_safetensors(path).items():
            if weight_map.get(k) != file:
                raise FileError(f"{path}: {show_name(k)}: {index} puts it "
                                + (f"in {show(weight_map[k])}" if k in weight_map else "in no file"))
            out[k] = (path, shape, load)
    missing = [k for k in weight_map if k not in out]
    if missing:
        raise FileError(f"{os.path.join(d, weight_map[missing[0]])}: no {show_name(missing[0])}, which {index} puts there")
    return out


def gpt2_names(L):
    """The names (without "transformer.") of a GPT2LMHeadModel with L layers, in llm.c's file order."""
    for _, hf_name, _ in TENSORS:
        name = hf_name[len(PREFIX):]
        for layer in range(L) if "{l}" in name else [0]:
            yield name.format(l=layer)


def gpt2_shape(cfg, key):
    """The shape of the tensor key (a name without "transformer.") in a GPT2LMHeadModel of cfg's shape, or
    None when that model has no such tensor."""
    C = cfg["C"]
    top = {"wte.weight": (cfg["V"], C), "wpe.weight": (cfg["maxT"], C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    layer = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,),
             "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
             "mlp.c_fc.weight": (C, 4 * C), "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.weight": (4 * C, C),
             "mlp.c_proj.bias": (C,)}
    m = re.fullmatch(r"h\.(0|[1-9][0-9]*)\.(.+)", key)
    if m is None:
        return top.get(key)
    return layer.get(m[2]) if len(m[1]) <= 10 and int(m[1]) < cfg["L"] else None  # L < 2^31: 10 digits


def check_weights(cfg, weights):
    """weights keyed by the names without "transformer.", the buffers dropped, after checking that the
    names and shapes are exactly a GPT-2 of cfg's shape: every name known, none twice (with and without
    "transformer."), every shape config.json's, none missing. The config's n_layer is bounded by the file:
    the names are never built beyond the first missing one."""
    found, names = {}, {}
    for name, (path, shape, load) in weights.items():
        key = name[len(PREFIX):] if name.startswith(PREFIX) else name
        want = gpt2_shape(cfg, key)
        if want is None and key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # the causal mask, a buffer older transformers saved
        if key in names:
            raise FileError(f"{path}: {show_name(name)} and {show_name(names[key])} are the same tensor")
        names[key] = name
        if key == "lm_head.weight":
            continue  # checked against wte below
        if want is None:
            raise FileError(f"{path}: {show_name(name)}: not a tensor of GPT2LMHeadModel with config.json's n_layer {cfg['L']}")
        if tuple(shape) != want:
            raise FileError(f"{path}: {show_name(name)} has shape {tuple(shape)}, config.json's shape needs {want}")
        found[key] = (path, load)
    total = 12 * cfg["L"] + 4
    if len(found) < total:
        missing = next(k for k in gpt2_names(cfg["L"]) if k not in found)
        some = next(iter(weights.values()))[0] if weights else "the weights"
        raise FileError(f"{some}: no {PREFIX}{missing} (it holds {len(found)} of the {total} tensors of "
                        f"config.json's n_layer {cfg['L']})")
    if "lm_head.weight" in names:
        path, shape, load = weights[names["lm_head.weight"]]
        if tuple(shape) != gpt2_shape(cfg, "wte.weight") or not np.array_equal(load(), found["wte.weight"][1]()):
            raise FileError(f"{path}: lm_head.weight differs from wte.weight: llm.c's head is tied to wte")
    return {k: load for k, (_, load) in found.items()}


def write_llmc(out, cfg, loads):
    """The fp32 llm.c model file, tensor by tensor in its order, via OUT.tmp (write_whole)."""
    def write(f):
        f.write(llmc_header(cfg))
        for _, hf_name, conv1d in TENSORS:
            key = hf_name[len(PREFIX):]
            for layer in range(cfg["L"]) if "{l}" in key else [0]:
                t = loads[key.format(l=layer)]()
                f.write(np.ascontiguousarray(t.T if conv1d else t, dtype="<f4").tobytes())
            if key == "wte.weight":  # llm.c's padding rows
                f.write(bytes(4 * (cfg["Vp"] - cfg["V"]) * cfg["C"]))
    write_whole(out, write)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="a Hugging Face GPT-2 directory (config.json and the weights)")
    ap.add_argument("--out", required=True, help="the llm.c model file to write")
    args = ap.parse_args()
    try:
        if not os.path.isdir(args.dir):
            raise FileError(f"{args.dir}: not a directory")
        path = os.path.join(args.dir, "config.json")
        c = read_json(path)
        if isinstance(c, dict) and c.get("model_type") == "llama":
            cfg = llama_files.read_llama_config(path, c)
            llama_files.write_llama_llmc(args.out, cfg, llama_files.check_llama_weights(cfg, read_weights(args.dir)))
            print(f"{args.out}: llm.c Llama 3 fp32 L={cfg['L']} C={cfg['C']} NH={cfg['NH']} KV={cfg['KV']} H={cfg['H']} "
                  f"V={cfg['V']} maxT={cfg['maxT']}")
            return
        cfg = read_config(args.dir)
        write_llmc(args.out, cfg, check_weights(cfg, read_weights(args.dir)))
    except FileError as e:
        print(f"import.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"{args.out}: llm.c fp32 GPT-2 L={cfg['L']} C={cfg['C']} NH={cfg['NH']} V={cfg['V']} (padded {cfg['Vp']}) "
          f"maxT={cfg['maxT']}")


if __name__ == "__main__":
    main()
