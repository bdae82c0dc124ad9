"""
A plain float64 GPT-2 forward pass and loss in numpy: the reference the CPU engine is tested against.

    python3 dev/ref/gpt2_ref.py loss MODEL.bin TOKENS.bin -b B -t T   # prints "loss <value>"
    python3 dev/ref/gpt2_ref.py make-fixture dev/ref                  # rebuilds the test fixture

MODEL.bin is an llm.c model file (version 3 fp32 or 5 bf16), TOKENS.bin an llm.c token shard; the batch
is the shard's first B*T+1 tokens, row b reading tokens b*T .. b*T+T and predicting the next ones.
"""
import argparse
import os
import struct

import numpy as np


def read_model(path):
    """Return (config dict, list of 16 float64 arrays) from an llm.c model file."""
    raw = open(path, "rb").read()
    h = struct.unpack("<256i", raw[:1024])
    assert h[0] == 20240326 and h[1] in (3, 5), f"{path}: not an llm.c v3/v5 model file"
    maxT, V, L, NH, C, Vp = h[2], h[3], h[4], h[5], h[6], h[7]
    if h[1] == 3:
        flat = np.frombuffer(raw[1024:], dtype="<f4").astype(np.float64)
    else:  # bf16: the upper 16 bits of an fp32
        flat = (np.frombuffer(raw[1024:], dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    shapes = [(Vp, C), (maxT, C), (L, C), (L, C), (L, 3 * C, C), (L, 3 * C), (L, C, C), (L, C),
              (L, C), (L, C), (L, 4 * C, C), (L, 4 * C), (L, C, 4 * C), (L, C), (C,), (C,)]
    params, off = [], 0
    for s in shapes:
        n = int(np.prod(s))
        params.append(flat[off:off + n].reshape(s))
        off += n
    assert off == flat.size, f"{path}: {flat.size} values, the header's shape needs {off}"
    return dict(maxT=maxT, V=V, L=L, NH=NH, C=C, Vp=Vp), params


def read_tokens(path):
    raw = open(path, "rb").read()
    h = struct.unpack("<256i", raw[:1024])
    assert h[0] == 20240520 and h[1] == 1, f"{path}: not an llm.c token shard"
    return np.frombuffer(raw[1024:], dtype="<u2")[:h[2]].astype(np.int64)


def layernorm(x, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)  # biased, as GPT-2
    return (x - mean) / np.sqrt(var + 1e-5) * w + b


def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def gpt2_loss(cfg, params, inputs, targets):
    """Mean cross-entropy of targets (B,T) given inputs (B,T)."""
    wte, wpe, ln1w, ln1b, qkvw, qkvb, attw, attb, ln2w, ln2b, fcw, fcb, fcpw, fcpb, lnfw, lnfb = params
    B, T = inputs.shape
    C, NH, V = cfg["C"], cfg["NH"], cfg["V"]
    hs = C // NH
    x = wte[inputs] + wpe[:T]
    causal = np.tril(np.ones((T, T), dtype=bool))
    for l in range(cfg["L"]):
        qkv = layernorm(x, ln1w[l], ln1b[l]) @ qkvw[l].T + qkvb[l]
        q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, NH, hs).transpose(0, 2, 1, 3) for i in range(3))
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hs), -np.inf)
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + y @ attw[l].T + attb[l]
        x = x + gelu(layernorm(x, ln2w[l], ln2b[l]) @ fcw[l].T + fcb[l]) @ fcpw[l].T + fcpb[l]
    logits = layernorm(x, lnfw, lnfb) @ wte[:V].T  # tied head over the real vocabulary only
    m = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float((logz - picked).mean())


def batch(tokens, B, T):
    assert tokens.size >= B * T + 1, "shard too small for the batch"
    return tokens[:B * T].reshape(B, T), tokens[1:B * T + 1].reshape(B, T)


def write_file(path, header, payload):
    header = header + [0] * (256 - len(header))
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(payload)


def to_bf16_bits(x32):
    """Round fp32 to bf16 (nearest, ties to even); return the 16-bit patterns."""
    u = x32.view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16)


def make_fixture(outdir):
    """A tiny deterministic llm.c model (L=2, C=32, NH=4, maxT=16, V=97, Vp=128), 33 tokens, and its loss."""
    rng = np.random.default_rng(1234)
    L, C, NH, maxT, V, Vp, B, T = 2, 32, 4, 16, 97, 128, 2, 16
    cfg = dict(maxT=maxT, V=V, L=L, NH=NH, C=C, Vp=Vp)
    shapes = [(Vp, C), (maxT, C), (L, C), (L, C), (L, 3 * C, C), (L, 3 * C), (L, C, C), (L, C),
              (L, C), (L, C), (L, 4 * C, C), (L, 4 * C), (L, C, 4 * C), (L, C), (C,), (C,)]
    kinds = ["w", "w", "lnw", "b", "w", "b", "w", "b", "lnw", "b", "w", "b", "w", "b", "lnw", "b"]
    tensors = []
    for s, kind in zip(shapes, kinds):
        if kind == "w":  # large enough that every layer changes the activations visibly
            t = rng.normal(0.0, 0.2, s)
        elif kind == "lnw":
            t = 1.0 + rng.normal(0.0, 0.1, s)
        else:
            t = rng.normal(0.0, 0.1, s)
        tensors.append(t)
    tensors[0][V:] = 0.0  # padding rows of wte are zero, as in llm.c
    flat32 = np.concatenate([t.ravel() for t in tensors]).astype("<f4")
    header = [20240326, 3, maxT, V, L, NH, C, Vp]
    write_file(os.path.join(outdir, "tiny_model.bin"), header, flat32.tobytes())
    header[1] = 5
    write_file(os.path.join(outdir, "tiny_model_bf16.bin"), header, to_bf16_bits(flat32).astype("<u2").tobytes())
    tokens = rng.integers(0, V, B * T + 1).astype("<u2")
    write_file(os.path.join(outdir, "tiny_tokens.bin"), [20240520, 1, tokens.size], tokens.tobytes())
    # the losses of exactly what was written (params as read back from the files)
    x, y = batch(read_tokens(os.path.join(outdir, "tiny_tokens.bin")), B, T)
    l32 = gpt2_loss(cfg, read_model(os.path.join(outdir, "tiny_model.bin"))[1], x, y)
    l16 = gpt2_loss(cfg, read_model(os.path.join(outdir, "tiny_model_bf16.bin"))[1], x, y)
    with open(os.path.join(outdir, "tiny_ref.txt"), "w") as f:
        f.write(f"B {B} T {T} loss {l32:.17g}\nbf16 B {B} T {T} loss {l16:.17g}\n")
    print(f"fixture in {outdir}: fp32 loss {l32:.17g}, bf16 loss {l16:.17g}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    lo = sub.add_parser("loss", help="print the loss of a model on a token shard's first batch")
    lo.add_argument("model")
    lo.add_argument("tokens")
    lo.add_argument("-b", type=int, default=2)
    lo.add_argument("-t", type=int, default=16)
    fx = sub.add_parser("make-fixture", help="write the tiny test fixture")
    fx.add_argument("outdir")
    args = ap.parse_args()
    if args.cmd == "loss":
        cfg, params = read_model(args.model)
        x, y = batch(read_tokens(args.tokens), args.b, args.t)
        print(f"loss {gpt2_loss(cfg, params, x, y):.17g}")
    else:
        make_fixture(args.outdir)


if __name__ == "__main__":
    main()
