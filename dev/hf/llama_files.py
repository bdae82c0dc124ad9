"""
The Llama 3 family both ways (import.py and export.py): Hugging Face's LlamaForCausalLM (config.json and its
safetensors) against llm.c's Llama 3 model file (train_llama3.py's write_model: magic 20240803, which the
engine reads with -e).

llm.c's file: 256 int32 [20240803, version 3 (fp32) or 5 (bf16), block size, V, L, NH, KV heads, C,
multiple_of, use_scaled_rope, major 3, minor 1], 256 float32 [ffn_dim_multiplier, norm_eps, rope_theta], then
wte (V, C); each layer's ln1w (C); qkvw ((NH + 2 KV) HS, C: q's rows, k's, v's); attprojw (C, C); ln2w (C);
every layer's up (c_fc, (H, C)); every layer's gate (c_fc2, (H, C)); fcprojw (C, H); then lnfw (C) and the head
(V, C). Matrices are (out, in) in both formats.

Rotary positions: the engine (as Meta's code and llm.c) turns the pairs of channels (2i, 2i+1) of each head;
Hugging Face's conversion permuted the rows of q_proj and k_proj so that its rotate_half turns the pairs
(i, i + HS/2) instead. So import.py takes each head's rows of q_proj and k_proj back to the interleaved order
(hf_to_meta: the rows HS/2 apart become neighbours) and export.py permutes them again (meta_to_hf); v_proj and
everything else are the same numbers. The MLP's hidden size is written as llm.c computes it: multiple_of =
intermediate_size with ffn_dim_multiplier 1 (or below 1 when 2/3 of 4C exceeds it), which gives it exactly.
"""
import json
import math
import os
import struct

import numpy as np

from gpt2_files import FileError, bf16_to_fp32, write_whole, is_int, read_json, show

LLAMA_MAGIC = 20240803
INT32_MAX = 2**31 - 1


def hf_to_meta(w, heads):
    """Hugging Face's rows of q_proj or k_proj (each head's rotate_half halves) to the interleaved pairs."""
    rows, cols = w.shape
    hs = rows // heads
    return np.ascontiguousarray(w.reshape(heads, 2, hs // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))


def meta_to_hf(w, heads):
    """The inverse of hf_to_meta."""
    rows, cols = w.shape
    hs = rows // heads
    return np.ascontiguousarray(w.reshape(heads, hs // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))


def ffn_hidden(C, multiple_of, multiplier):
    """The SwiGLU hidden size as llm.c's train_llama3.py (and the engine) compute it."""
    h = int(2 * (4 * C) / 3)
    if multiplier:
        h = int(multiplier * h)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


def ffn_params(C, H):
    """(multiple_of, ffn_dim_multiplier) that give hidden size H for width C (lp_ffn_hidden's inputs)."""
    h = int(2 * (4 * C) / 3)
    mult = 1.0 if h <= H else float(np.float32(H / h))
    if ffn_hidden(C, H, mult) != H:  # (float32 rounding past H)
        mult = float(np.nextafter(np.float32(mult), np.float32(0)))
    return H, mult


def read_llama_config(path, c):
    """The engine's Llama shape from a LlamaForCausalLM config.json (c, already read), after checking that the
    engine computes the same model: SiLU, RMSNorm, no biases, an untied head, head_dim C/NH, RoPE (default, or
    Llama 3's scaling with factor 8, low 1, high 4, original context 8192)."""
    sizes = {}
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "max_position_embeddings",
                "intermediate_size"):
        v = c.get(key)
        if not is_int(v) or v <= 0 or v > INT32_MAX:
            raise FileError(f"{path}: {key} {show(v)} is not a positive int32")
        sizes[key] = v
    C, L, NH, V, maxT, H = sizes.values()
    KV = c.get("num_key_value_heads", NH)
    if KV is None:
        KV = NH
    if not is_int(KV) or KV <= 0 or NH % KV:
        raise FileError(f"{path}: num_key_value_heads {show(KV)} does not divide num_attention_heads {NH}")
    # RoPE: transformers 5's rope_parameters {rope_theta, rope_type, ...}, or the older rope_theta and rope_scaling
    rope = c.get("rope_parameters")
    if isinstance(rope, dict):
        theta = rope.get("rope_theta", 10000.0)
        scaling = None if rope.get("rope_type", "default") == "default" else rope
    else:
        theta, scaling = c.get("rope_theta", 10000.0), c.get("rope_scaling")
    eps = c.get("rms_norm_eps", 1e-6)
    problems = []
    if C % NH or (C // NH) % 2:
        problems.append(f"hidden_size {C} is not an even head size times num_attention_heads {NH}")
    if c.get("head_dim", C // NH) != C // NH:
        problems.append(f"head_dim {show(c['head_dim'])} (the engine's is hidden_size / num_attention_heads)")
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {show(c['hidden_act'])} (the engine's SwiGLU is silu)")
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if c.get(key, False) is not False:
            problems.append(f"{key} {show(c[key])} (the engine's Llama has none)")
    if not isinstance(eps, (int, float)) or not 0 < eps < 1:
        problems.append(f"rms_norm_eps {show(eps)} is not in (0, 1)")
    if not isinstance(theta, (int, float)) or not theta > 1:
        problems.append(f"rope_theta {show(theta)} is not above 1")
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if scaling is not None and (not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "llama3"
                                or any(scaling.get(k) != v for k, v in llama3.items()) or rope is not None and rope is not scaling):
        problems.append(f"rope_scaling {show(scaling)} (the engine's is none, or Llama 3's: {llama3})")
    if problems:
        raise FileError(f"{path}: {'; '.join(problems)}")
    multiple_of, mult = ffn_params(C, H)
    return dict(maxT=maxT, V=V, L=L, NH=NH, KV=KV, C=C, H=H, multiple_of=multiple_of, mult=mult, eps=float(eps),
                theta=float(theta), scaled=int(scaling is not None))


def hf_config(cfg, dtype):
    """config.json of a LlamaForCausalLM of cfg's shape."""
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg["C"],
         "intermediate_size": cfg["H"], "num_hidden_layers": cfg["L"], "num_attention_heads": cfg["NH"],
         "num_key_value_heads": cfg["KV"], "head_dim": cfg["C"] // cfg["NH"], "vocab_size": cfg["V"],
         "max_position_embeddings": cfg["maxT"], "rms_norm_eps": cfg["eps"], "hidden_act": "silu", "attention_bias": False,
         "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32" if dtype == "fp32" else "bfloat16"}
    # RoPE as transformers 5 reads it (rope_parameters) and as older versions did (rope_theta, rope_scaling)
    rope = {"rope_type": "default", "rope_theta": cfg["theta"]}
    if cfg["scaled"]:
        rope = {"rope_type": "llama3", "rope_theta": cfg["theta"], "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
    c.update(rope_parameters=rope, rope_theta=cfg["theta"], rope_scaling=rope if cfg["scaled"] else None)
    return json.dumps(c, indent=2) + "\n"


def hf_layout(cfg):
    """(Hugging Face name, shape, the llm.c file's section, layer) of every tensor, in the file's order."""
    C, L, NH, KV, H, V = cfg["C"], cfg["L"], cfg["NH"], cfg["KV"], cfg["H"], cfg["V"]
    HS = C // NH
    out = [("model.embed_tokens.weight", (V, C), "wte", 0)]
    per_layer = [("input_layernorm.weight", "ln1w"), ("qkv", "qkvw"), ("self_attn.o_proj.weight", "attprojw"),
                 ("post_attention_layernorm.weight", "ln2w"), ("mlp.up_proj.weight", "up"),
                 ("mlp.gate_proj.weight", "gate"), ("mlp.down_proj.weight", "fcprojw")]
    shapes = {"ln1w": (C,), "qkvw": ((NH + 2 * KV) * HS, C), "attprojw": (C, C), "ln2w": (C,), "up": (H, C),
              "gate": (H, C), "fcprojw": (C, H)}
    for name, section in per_layer:
        for l in range(L):
            out.append((f"model.layers.{l}.{name}", shapes[section], section, l))
    out += [("model.norm.weight", (C,), "lnfw", 0), ("lm_head.weight", (V, C), "head", 0)]
    return out


def llama_header(cfg, version):
    """The 256 int32 and 256 float32 of an llm.c Llama 3 file."""
    ints = [LLAMA_MAGIC, version, cfg["maxT"], cfg["V"], cfg["L"], cfg["NH"], cfg["KV"], cfg["C"], cfg["multiple_of"],
            cfg["scaled"], 3, 1]
    floats = [cfg["mult"], cfg["eps"], cfg["theta"]]
    return struct.pack("<256i", *ints, *[0] * (256 - len(ints))) + struct.pack("<256f", *floats, *[0.0] * 253)


def write_llama_llmc(out, cfg, loads):
    """The fp32 llm.c Llama 3 file from loads {Hugging Face name: loader of a float32 array}, q_proj's and
    k_proj's rows taken to the interleaved order, via OUT.tmp (write_whole)."""
    NH, KV = cfg["NH"], cfg["KV"]

    def write(f):
        f.write(llama_header(cfg, 3))
        for name, shape, section, l in hf_layout(cfg):
            if section == "qkvw":
                p = f"model.layers.{l}.self_attn."
                t = np.concatenate([hf_to_meta(loads[p + "q_proj.weight"](), NH), hf_to_meta(loads[p + "k_proj.weight"](), KV),
                                    loads[p + "v_proj.weight"]()])
            else:
                t = loads[name]()
            f.write(np.ascontiguousarray(t, dtype="<f4").tobytes())
    write_whole(out, write)


def check_llama_weights(cfg, weights):
    """{Hugging Face name: loader} after checking that the names and shapes are exactly a LlamaForCausalLM of
    cfg's shape (rotary_emb.inv_freq, a buffer older transformers saved, skipped)."""
    C, NH, KV = cfg["C"], cfg["NH"], cfg["KV"]
    HS = C // NH
    want = {}
    for name, shape, section, l in hf_layout(cfg):
        if section == "qkvw":
            p = f"model.layers.{l}.self_attn."
            want.update({p + "q_proj.weight": (NH * HS, C), p + "k_proj.weight": (KV * HS, C), p + "v_proj.weight": (KV * HS, C)})
        else:
            want[name] = shape
    found = {}
    for name, (path, shape, load) in weights.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in want:
            raise FileError(f"{path}: {show(name)}: not a tensor of LlamaForCausalLM with config.json's shape (an untied "
                            f"head, num_hidden_layers {cfg['L']})")
        if tuple(shape) != want[name]:
            raise FileError(f"{path}: {show(name)} has shape {tuple(shape)}, config.json's shape needs {want[name]}")
        found[name] = load
    missing = [k for k in want if k not in found]
    if missing:
        some = next(iter(weights.values()))[0] if weights else "the weights"
        raise FileError(f"{some}: no {missing[0]} (it holds {len(found)} of the {len(want)} tensors of config.json's shape)")
    return found


def read_llama_llmc(path):
    """(config, tensors) of an llm.c Llama 3 file: config as read_llama_config's plus version; tensors the
    hf_layout entries' arrays (float32, or uint16 bf16 patterns for version 5), memory-mapped."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(2048)
    except OSError as e:
        raise FileError(f"{path}: {e.strerror}") from None
    if len(head) < 2048:
        raise FileError(f"{path}: {size} bytes, shorter than a Llama 3 file's header (2048)")
    h = struct.unpack("<256i", head[:1024])
    hf = struct.unpack("<256f", head[1024:])
    if h[0] != LLAMA_MAGIC or h[1] not in (3, 5):
        raise FileError(f"{path}: magic {h[0]} version {h[1]}, not an llm.c Llama 3 file (20240803, version 3 or 5)")
    maxT, V, L, NH, KV, C, multiple_of, scaled = h[2:10]
    if min(maxT, V, L, NH, KV, C, multiple_of) <= 0 or C % NH or NH % KV or (C // NH) % 2:
        raise FileError(f"{path}: header shape maxT={maxT} V={V} L={L} NH={NH} KV={KV} C={C} multiple_of={multiple_of} is "
                        f"not a Llama's")
    mult = float(np.float32(hf[0]))
    cfg = dict(maxT=maxT, V=V, L=L, NH=NH, KV=KV, C=C, H=ffn_hidden(C, multiple_of, mult), multiple_of=multiple_of,
               mult=mult, eps=float(np.float32(hf[1])), theta=float(np.float32(hf[2])), scaled=int(scaled != 0), version=h[1])
    dtype = np.dtype("<f4") if h[1] == 3 else np.dtype("<u2")
    layout = hf_layout(cfg)
    need = 2048 + sum(math.prod(s) for _, s, _, _ in layout) * dtype.itemsize
    if size != need:
        raise FileError(f"{path}: {size} bytes, its header's model needs {need}")
    tensors, off = [], 2048
    for _, shape, _, _ in layout:
        tensors.append(np.memmap(path, dtype=dtype, mode="r", offset=off, shape=shape))
        off += math.prod(shape) * dtype.itemsize
    return cfg, tensors


def hf_tensors(cfg, tensors, dtype):
    """(Hugging Face name, array) of LlamaForCausalLM from read_llama_llmc's tensors, q's and k's rows permuted
    back (meta_to_hf): float32, or bf16 patterns (uint16) for dtype bf16 (fp32 values rounded to nearest even)."""
    from gpt2_files import bf16_bits

    def convert(a):
        bits = cfg["version"] == 5
        if dtype == "bf16":
            return np.ascontiguousarray(a) if bits else bf16_bits(a)
        return bf16_to_fp32(a) if bits else np.ascontiguousarray(a)

    C, NH, KV = cfg["C"], cfg["NH"], cfg["KV"]
    HS = C // NH
    out = []
    for (name, _, section, l), t in zip(hf_layout(cfg), tensors):
        if section != "qkvw":
            out.append((name, convert(t)))
            continue
        p = f"model.layers.{l}.self_attn."
        out += [(p + "q_proj.weight", convert(meta_to_hf(t[:NH * HS], NH))),
                (p + "k_proj.weight", convert(meta_to_hf(t[NH * HS:(NH + KV) * HS], KV))),
                (p + "v_proj.weight", convert(t[(NH + KV) * HS:]))]
    return out
