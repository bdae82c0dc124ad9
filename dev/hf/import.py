#!/usr/bin/env python3
"""
A Hugging Face GPT-2 directory as an llm.c model file (fp32, version 3) that train_gpt loads with -e.

    python3 dev/hf/import.py hf/gpt2 --out gpt2_124M.bin
    ./train_gpt_cpu -e gpt2_124M.bin ...

Reads config.json and the weights: model.safetensors (F32, F16 or BF16; numpy only), a sharded
model.safetensors.index.json, or pytorch_model.bin (needs torch). Names with or without the
"transformer." prefix (GPT2LMHeadModel or GPT2Model); the attention mask buffers are skipped; an
lm_head.weight must equal wte (llm.c ties them). The vocabulary is padded as llm.c pads it, to a multiple
of 128 with zero rows. Errors are one line naming the file, and leave no output file.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_files import TENSORS, FileError, llmc_header, padded_vocab, read_safetensors

# Activations that are GELU's tanh form, the engine's
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
PREFIX = "transformer."


def read_config(d):
    """The llm.c shape (maxT, V, L, NH, C, Vp) of the GPT-2 in d/config.json, after checking that the
    engine computes the same model: tanh GELU, LayerNorm eps 1e-5, MLP width 4C, tied head, scaled
    attention, no cross-attention."""
    path = os.path.join(d, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
    except OSError as e:
        raise FileError(f"{path}: {e.strerror}") from None
    except ValueError as e:
        raise FileError(f"{path}: not JSON ({e})") from None
    if not isinstance(c, dict):
        raise FileError(f"{path}: not a model config (a JSON object)")
    if c.get("model_type") != "gpt2":
        raise FileError(f"{path}: model_type {c.get('model_type')!r}, not a GPT-2 (want 'gpt2')")
    archs = c.get("architectures") or ["GPT2LMHeadModel"]
    if not set(archs) & {"GPT2LMHeadModel", "GPT2Model"}:
        raise FileError(f"{path}: architectures {archs}: want GPT2LMHeadModel or GPT2Model")
    try:
        C, L, NH, V, maxT = (int(c[k]) for k in ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"))
    except (KeyError, TypeError, ValueError) as e:
        raise FileError(f"{path}: missing or bad {e}") from None
    problems = []
    if min(C, L, NH, V, maxT) <= 0 or C % NH:
        problems.append(f"shape n_embd {C} n_layer {L} n_head {NH} vocab_size {V} n_positions {maxT}")
    if c.get("n_inner") not in (None, 4 * C):
        problems.append(f"n_inner {c['n_inner']} (the engine's MLP is 4 * n_embd = {4 * C})")
    if c.get("activation_function", "gelu_new") not in TANH_GELU:
        problems.append(f"activation_function {c['activation_function']!r} (the engine's is tanh GELU, gelu_new)")
    if abs(c.get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon {c['layer_norm_epsilon']} (the engine's is 1e-5)")
    for key, want in (("tie_word_embeddings", True), ("scale_attn_weights", True),
                      ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False)):
        if c.get(key, want) != want:
            problems.append(f"{key} {c[key]} (the engine needs {want})")
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


def read_weights(d):
    """{name: (file, shape, loader)} of every tensor in d, from the first of model.safetensors,
    model.safetensors.index.json (shards) and pytorch_model.bin that is there."""
    single = os.path.join(d, "model.safetensors")
    index = os.path.join(d, "model.safetensors.index.json")
    torch_bin = os.path.join(d, "pytorch_model.bin")
    if os.path.exists(single):
        files = [single]
    elif os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted({os.path.join(d, v) for v in json.load(f)["weight_map"].values()})
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise FileError(f"{index}: not a safetensors index ({e})") from None
    elif os.path.exists(torch_bin):
        return {k: (torch_bin, shape, load) for k, (_, shape, load) in read_torch(torch_bin).items()}
    else:
        raise FileError(f"{single}: No such file (nor model.safetensors.index.json or pytorch_model.bin)")
    out = {}
    for path in files:
        out.update({k: (path, shape, load) for k, (_, shape, load) in read_safetensors(path).items()})
    return out


def hf_shapes(cfg):
    """{Hugging Face name (without "transformer."): shape} of a GPT2LMHeadModel of this shape (each name
    found by the part of it that tells it from the others)."""
    C, V, maxT = cfg["C"], cfg["V"], cfg["maxT"]
    shapes = {"wte": (V, C), "wpe": (maxT, C), "ln_1": (C,), "c_attn.weight": (C, 3 * C), "c_attn.bias": (3 * C,),
              "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2": (C,), "c_fc.weight": (C, 4 * C),
              "c_fc.bias": (4 * C,), "mlp.c_proj.weight": (4 * C, C), "mlp.c_proj.bias": (C,), "ln_f": (C,)}
    out = {}
    for _, hf_name, _ in TENSORS:
        name = hf_name[len(PREFIX):]
        for layer in range(cfg["L"]) if "{l}" in name else [0]:
            key = name.format(l=layer)
            out[key] = next(s for part, s in shapes.items() if part in key)
    return out


def check_weights(cfg, weights):
    """weights keyed by the names without "transformer.", the buffers dropped, after checking that the
    names and shapes are exactly a GPT-2 of cfg's shape."""
    want = hf_shapes(cfg)
    found = {}
    for name, (path, shape, load) in weights.items():
        key = name[len(PREFIX):] if name.startswith(PREFIX) else name
        if key.endswith((".attn.bias", ".attn.masked_bias")) and key not in want:
            continue  # the causal mask, a buffer older transformers saved
        if key == "lm_head.weight":
            continue  # checked against wte below
        if key not in want:
            raise FileError(f"{path}: {name}: not a tensor of GPT2LMHeadModel with config.json's n_layer {cfg['L']}")
        if tuple(shape) != want[key]:
            raise FileError(f"{path}: {name} has shape {tuple(shape)}, config.json's shape needs {want[key]}")
        found[key] = (path, load)
    missing = [k for k in want if k not in found]
    if missing:
        some = next(iter(weights.values()))[0] if weights else "the weights"
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise FileError(f"{some}: no {PREFIX}{missing[0]}{more}")
    if "lm_head.weight" in weights or PREFIX + "lm_head.weight" in weights:
        path, shape, load = weights.get("lm_head.weight") or weights[PREFIX + "lm_head.weight"]
        if tuple(shape) != want["wte.weight"] or not np.array_equal(load(), found["wte.weight"][1]()):
            raise FileError(f"{path}: lm_head.weight differs from wte.weight: llm.c's head is tied to wte")
    return {k: load for k, (_, load) in found.items()}


def write_llmc(out, cfg, loads):
    """The fp32 llm.c model file, tensor by tensor in its order, via OUT.tmp (removed on any failure)."""
    tmp = out + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(llmc_header(cfg))
            for _, hf_name, conv1d in TENSORS:
                key = hf_name[len(PREFIX):]
                for layer in range(cfg["L"]) if "{l}" in key else [0]:
                    t = loads[key.format(l=layer)]()
                    f.write(np.ascontiguousarray(t.T if conv1d else t, dtype="<f4").tobytes())
                if key == "wte.weight":  # llm.c's padding rows
                    f.write(bytes(4 * (cfg["Vp"] - cfg["V"]) * cfg["C"]))
        os.replace(tmp, out)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise FileError(f"{e.filename or out}: {e.strerror}") from None
        raise


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="a Hugging Face GPT-2 directory (config.json and the weights)")
    ap.add_argument("--out", required=True, help="the llm.c model file to write")
    args = ap.parse_args()
    try:
        if not os.path.isdir(args.dir):
            raise FileError(f"{args.dir}: not a directory")
        cfg = read_config(args.dir)
        write_llmc(args.out, cfg, check_weights(cfg, read_weights(args.dir)))
    except FileError as e:
        print(f"import.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"{args.out}: llm.c fp32 GPT-2 L={cfg['L']} C={cfg['C']} NH={cfg['NH']} V={cfg['V']} (padded {cfg['Vp']}) "
          f"maxT={cfg['maxT']}")


if __name__ == "__main__":
    main()
