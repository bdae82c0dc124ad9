#!/usr/bin/env python3
"""
An llm.c model file (fp32 version 3 or bf16 version 5) as a Hugging Face GPT-2 directory.

    python3 dev/hf/export.py out/mine/step_00000500/model.bin --out hf/mine [--dtype fp32|bf16]

Writes config.json (GPT2Config), model.safetensors (GPT2LMHeadModel's names; the head is tied to wte, so
there is no lm_head; the padded vocabulary rows are dropped), and GPT-2's tokenizer as GPT2Tokenizer
reads it (vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json), built from the ranks
in dev/data/gpt2.tiktoken. --dtype defaults to the model file's own (v3: fp32, v5: bf16); fp32 to bf16
rounds to nearest, ties to even. Offline, numpy only. Errors are one line; files already written by a
failed run are removed.

An llm.c Llama 3 file (magic 20240803, as ./train_gpt_cpu -e llama:... models are saved) becomes a
LlamaForCausalLM directory: config.json and model.safetensors (q_proj's and k_proj's rows permuted back to
Hugging Face's rotary order: dev/hf/llama_files.py), no tokenizer files.
"""
import argparse
import base64
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_files import TENSORS, FileError, bf16_bits, bf16_to_fp32, bytes_to_unicode, read_llmc, write_safetensors
import llama_files

RANKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "gpt2.tiktoken")
EOT = 50256
EOT_TEXT = "<|endoftext|>"


def hf_tensors(cfg, tensors, dtype):
    """(Hugging Face name, array) in GPT2LMHeadModel's layouts: one tensor per layer, Conv1D matrices
    transposed to (in, out), wte cut to the real vocabulary. Arrays are float32, or uint16 bf16 patterns."""
    def convert(a):
        bits = cfg["version"] == 5  # the file's values are bf16 patterns
        if dtype == "bf16":
            return np.ascontiguousarray(a) if bits else bf16_bits(a)
        return bf16_to_fp32(a) if bits else np.ascontiguousarray(a)

    out = []
    for (name, hf_name, conv1d), t in zip(TENSORS, tensors):
        if name == "wte":
            t = t[:cfg["V"]]
        if "{l}" not in hf_name:
            out.append((hf_name, convert(t)))
            continue
        for layer in range(cfg["L"]):
            out.append((hf_name.format(l=layer), convert(t[layer].T if conv1d else t[layer])))
    return out


def hf_config(cfg, dtype):
    """GPT2Config's fields for this model: tanh GELU (gelu_new), LayerNorm eps 1e-5, tied head, no dropout
    (the engine trains without it)."""
    eot = EOT if cfg["V"] > EOT else None  # GPT-2's <|endoftext|>, when the vocabulary has it
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg["V"],
        "n_positions": cfg["maxT"],
        "n_ctx": cfg["maxT"],
        "n_embd": cfg["C"],
        "n_layer": cfg["L"],
        "n_head": cfg["NH"],
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-05,
        "initializer_range": 0.02,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16" if dtype == "bf16" else "float32",
    }


def read_ranks(path=RANKS):
    """GPT-2's BPE ranks: token bytes -> id (the single bytes are 0..255, merged tokens follow in merge order)."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def merge_pair(ranks, token):
    """The two tokens BPE joins last to make token: BPE on its bytes using only the merges ranked below it
    (each step joins the lowest-ranked adjacent pair) stops at exactly two parts."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, limit), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank >= limit:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    assert len(parts) == 2, f"token {token!r}: BPE with lower ranks ends in {len(parts)} parts"
    return parts


def tokenizer_files(ranks, max_length):
    """{file name: text} of GPT-2's tokenizer as transformers' GPT2Tokenizer loads it, for a model of
    max_length positions."""
    spell = bytes_to_unicode()
    text = {token: "".join(spell[b] for b in token) for token in ranks}
    vocab = {text[t]: i for t, i in sorted(ranks.items(), key=lambda kv: kv[1])}
    vocab[EOT_TEXT] = EOT
    merges = ["#version: 0.2"]
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            merges.append(" ".join(text[p] for p in merge_pair(ranks, token)))
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}
    config = dict(special, tokenizer_class="GPT2Tokenizer", model_max_length=max_length, add_prefix_space=False,
                  errors="replace", added_tokens_decoder={str(EOT): {
                      "content": EOT_TEXT, "lstrip": False, "normalized": True, "rstrip": False,
                      "single_word": False, "special": True}})
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "\n".join(merges) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(special, indent=2) + "\n",
    }


def write_text(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def is_llama_file(path):
    """Whether path starts with the Llama 3 file's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == llama_files.LLAMA_MAGIC.to_bytes(4, "little")
    except OSError:
        return False  # (read_llmc names the problem)


def export(model_path, out_dir, dtype):
    llama = is_llama_file(model_path)
    cfg, tensors = (llama_files.read_llama_llmc if llama else read_llmc)(model_path)
    dtype = dtype or ("bf16" if cfg["version"] == 5 else "fp32")
    if llama:
        named = llama_files.hf_tensors(cfg, tensors, dtype)
        files = {"config.json": llama_files.hf_config(cfg, dtype)}
    else:
        named = hf_tensors(cfg, tensors, dtype)
        files = tokenizer_files(read_ranks(), cfg["maxT"])
        files["config.json"] = json.dumps(hf_config(cfg, dtype), indent=2) + "\n"
    made_dir = not os.path.isdir(out_dir)
    written = []
    try:
        os.makedirs(out_dir, exist_ok=True)

        def write(name, writer):  # via NAME.tmp, so a file is there whole or not at all
            path = os.path.join(out_dir, name)
            written.append(path + ".tmp")
            writer(path + ".tmp")
            os.replace(path + ".tmp", path)
            written.append(path)

        write("model.safetensors", lambda p: write_safetensors(p, named, "BF16" if dtype == "bf16" else "F32"))
        for name, text in files.items():
            write(name, lambda p: write_text(p, text))
    except BaseException as e:
        for path in written:
            if os.path.exists(path):
                os.remove(path)
        if made_dir and os.path.isdir(out_dir) and not os.listdir(out_dir):
            os.rmdir(out_dir)
        if isinstance(e, OSError):
            raise FileError(f"{e.filename or out_dir}: {e.strerror}") from None
        raise
    return cfg, dtype, llama


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="an llm.c model file (version 3 or 5)")
    ap.add_argument("--out", required=True, help="the Hugging Face directory to write (made if absent)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], help="the safetensors' dtype (default: the file's)")
    args = ap.parse_args()
    try:
        cfg, dtype, llama = export(args.model, args.out, args.dtype)
    except FileError as e:
        print(f"export.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    if llama:
        print(f"{args.out}: Llama L={cfg['L']} C={cfg['C']} NH={cfg['NH']} KV={cfg['KV']} H={cfg['H']} V={cfg['V']}, {dtype}; "
              f"load with LlamaForCausalLM.from_pretrained")
        return
    print(f"{args.out}: GPT-2 L={cfg['L']} C={cfg['C']} NH={cfg['NH']} V={cfg['V']} maxT={cfg['maxT']}, {dtype}; "
          f"load with GPT2LMHeadModel.from_pretrained and GPT2Tokenizer.from_pretrained")


if __name__ == "__main__":
    main()
