"""
A plain float64 GPT-2 in numpy, forward, loss and backward, and AdamW training steps: the reference the
CPU engine is tested against.

    python3 dev/ref/gpt2_ref.py loss MODEL.bin TOKENS.bin -b B -t T   # prints "loss <value>"
    python3 dev/ref/gpt2_ref.py gradcheck MODEL.bin TOKENS.bin        # backward vs finite differences
    python3 dev/ref/gpt2_ref.py train MODEL.bin TOKENS.bin -x 6 -l 1e-2 -u 2 -c 0.1 --grad-clip 2 [-o OUT.bin]
    python3 dev/ref/gpt2_ref.py make-fixture dev/ref                  # rebuilds the test fixture
    python3 dev/ref/gpt2_ref.py make-train-fixture dev/ref            # rebuilds the training fixture
    python3 dev/ref/gpt2_ref.py make-moe-fixture dev/ref              # rebuilds the mixture-of-experts fixture
    python3 dev/ref/gpt2_ref.py random-model OUT.bin L C NH           # a model of any shape, GPT-2 initialised
    python3 dev/ref/gpt2_ref.py hellaswag MODEL.bin EVAL.bin          # "acc_norm N/M acc N/M", each example's choices

MODEL.bin is an llm.c model file (version 3 fp32 or 5 bf16), TOKENS.bin an llm.c token shard; the batch
is the shard's first B*T+1 tokens, row b reading tokens b*T .. b*T+T and predicting the next ones.
train takes the engine's flags and prints its step lines (with every digit); its batches follow the
engine's loader through the shard.
"""
import argparse
import os
import struct

import numpy as np


# The parameter tensors of a model file, in its order: llm.c's 16, then a mixture of experts' 5 (version 6
# files; empty in a dense model), and which of them are matrices ("w"), LayerNorm weights ("lnw") or biases ("b").
NAMES = ["wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b", "fcw", "fcb", "fcprojw",
         "fcprojb", "lnfw", "lnfb", "routerw", "expfcw", "expfcb", "expfcprojw", "expfcprojb"]
KINDS = ["w", "w", "lnw", "b", "w", "b", "w", "b", "lnw", "b", "w", "b", "w", "b", "lnw", "b", "w", "w", "b", "w", "b"]


def moe_layers(cfg):
    """Which layers are MoE layers: l % every == 0 when the model has experts."""
    return [cfg.get("E", 0) > 0 and l % cfg["every"] == 0 for l in range(cfg["L"])]


def param_shapes(cfg):
    """Each tensor's shape: a layer tensor stacks the layers that have it (the dense MLP's the dense layers,
    the router's and experts' the MoE layers)."""
    maxT, L, C, Vp, E = cfg["maxT"], cfg["L"], cfg["C"], cfg["Vp"], cfg.get("E", 0)
    Lm = sum(moe_layers(cfg))
    Ld = L - Lm
    return [(Vp, C), (maxT, C), (L, C), (L, C), (L, 3 * C, C), (L, 3 * C), (L, C, C), (L, C),
            (L, C), (L, C), (Ld, 4 * C, C), (Ld, 4 * C), (Ld, C, 4 * C), (Ld, C), (C,), (C,),
            (Lm, E, C), (Lm, E, 4 * C, C), (Lm, E, 4 * C), (Lm, E, C, 4 * C), (Lm, E, C)]


def read_model(path):
    """Return (config dict, list of 21 float64 arrays) from a model file (llm.c's v3, v5; llmpar's MoE v6)."""
    raw = open(path, "rb").read()
    h = struct.unpack("<256i", raw[:1024])
    assert h[0] == 20240326 and h[1] in (3, 5, 6), f"{path}: not an llm.c v3/v5 or llmpar v6 model file"
    maxT, V, L, NH, C, Vp = h[2], h[3], h[4], h[5], h[6], h[7]
    cfg = dict(maxT=maxT, V=V, L=L, NH=NH, C=C, Vp=Vp)
    if h[1] == 6:
        cfg.update(E=h[8], K=h[9], every=h[10])
    if h[1] != 5:
        flat = np.frombuffer(raw[1024:], dtype="<f4").astype(np.float64)
    else:  # bf16: the upper 16 bits of an fp32
        flat = (np.frombuffer(raw[1024:], dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    shapes = param_shapes(cfg)
    params, off = [], 0
    for s in shapes:
        n = int(np.prod(s))
        params.append(flat[off:off + n].reshape(s))
        off += n
    assert off == flat.size, f"{path}: {flat.size} values, the header's shape needs {off}"
    return cfg, params


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


# A mixture of experts' training settings (the engine's --moe-capacity, --moe-aux-coef, --moe-z-coef).
MOE = dict(capacity=0.0, aux_coef=0.01, z_coef=0.0)


def moe_forward(cfg, params, q, x, moe):
    """MoE layer q's MLP on x (B,T,C): the router's softmax over the E experts, each token's top-K (ties to the
    lower index), their gates (renormalised for K >= 2, the probability itself for K = 1), an expert taking at
    most ceil(capacity K N / E) of the rows that chose it in token order (capacity 0: all), each expert's
    MLP on its rows, the gated sum. Returns the output and what the backward pass reads, with the layer's
    balance loss aux_coef E sum_e f_e P_e and z-loss z_coef mean(lse^2)."""
    routerw, expfcw, expfcb, expfcpw, expfcpb = (p[q] for p in params[16:21])
    E, K, C = cfg["E"], cfg["K"], cfg["C"]
    X = x.reshape(-1, C)
    N = X.shape[0]
    logits = X @ routerw.T
    mx = logits.max(-1, keepdims=True)
    lse = (np.log(np.exp(logits - mx).sum(-1, keepdims=True)) + mx)[:, 0]
    probs = np.exp(logits - lse[:, None])
    expert = np.argsort(-probs, axis=-1, kind="stable")[:, :K]
    chosen = np.take_along_axis(probs, expert, -1)
    gate = chosen if K == 1 else chosen / chosen.sum(-1, keepdims=True)
    counts = np.bincount(expert.ravel(), minlength=E)
    cap = int(np.ceil(float(np.float32(moe["capacity"])) * K * N / E)) if moe["capacity"] > 0 else N
    keep, taken = np.zeros((N, K), bool), np.zeros(E, int)
    for t in range(N):
        for k in range(K):
            if taken[expert[t, k]] < cap:
                keep[t, k] = True
                taken[expert[t, k]] += 1
    y, experts = np.zeros_like(X), []
    for e in range(E):
        rows, ks = np.nonzero((expert == e) & keep)  # (token order)
        h = X[rows] @ expfcw[e].T + expfcb[e]
        g = gelu(h)
        o = g @ expfcpw[e].T + expfcpb[e]
        y[rows] += gate[rows, ks][:, None] * o
        experts.append((rows, ks, h, g, o))
    f = counts / (N * K)
    a = dict(X=X, probs=probs, lse=lse, expert=expert, chosen=chosen, gate=gate, f=f, experts=experts,
             aux=moe["aux_coef"] * E * (f * probs.mean(0)).sum(), z=moe["z_coef"] * (lse ** 2).mean(),
             dropped=int(N * K - keep.sum()))
    return y.reshape(x.shape), a


def moe_backward(cfg, params, grads, q, a, dy, moe):
    """The gradient of MoE layer q's input from its output's dy (B,T,C), its tensors' into grads; the balance
    and z-losses' gradients (weight 1: one micro-batch) reach the router's logits."""
    routerw, expfcw, expfcb, expfcpw, expfcpb = (p[q] for p in params[16:21])
    drouterw, dexpfcw, dexpfcb, dexpfcpw, dexpfcpb = (g[q] for g in grads[16:21])
    E, K, C = cfg["E"], cfg["K"], cfg["C"]
    dY = dy.reshape(-1, C)
    X, probs, lse, expert, gate = a["X"], a["probs"], a["lse"], a["expert"], a["gate"]
    N = X.shape[0]
    dX, dgate = np.zeros_like(X), np.zeros_like(gate)
    for e, (rows, ks, h, g, o) in enumerate(a["experts"]):
        dO = gate[rows, ks][:, None] * dY[rows]
        dgate[rows, ks] = (dY[rows] * o).sum(-1)
        dexpfcpw[e] += dO.T @ g
        dexpfcpb[e] += dO.sum(0)
        dh = (dO @ expfcpw[e]) * gelu_grad(h)
        dexpfcw[e] += dh.T @ X[rows]
        dexpfcb[e] += dh.sum(0)
        dX[rows] += dh @ expfcw[e]
    dp = np.zeros_like(probs)
    if K == 1:
        np.put_along_axis(dp, expert, dgate, -1)
    else:
        dot = (dgate * gate).sum(-1, keepdims=True)
        np.put_along_axis(dp, expert, (dgate - dot) / a["chosen"].sum(-1, keepdims=True), -1)
    dp += moe["aux_coef"] * E * a["f"] / N
    dlogits = probs * (dp - (probs * dp).sum(-1, keepdims=True)) + moe["z_coef"] * 2 * lse[:, None] * probs / N
    drouterw += dlogits.T @ X
    dX += dlogits @ routerw
    return dX.reshape(dy.shape)


def gpt2_forward(cfg, params, inputs, targets, moe=MOE):
    """Mean cross-entropy of targets (B,T) given inputs (B,T), and what the backward pass reads (a mixture of
    experts' balance and z-losses summed over its MoE layers: cache["aux"], cache["z"])."""
    wte, wpe, ln1w, ln1b, qkvw, qkvb, attw, attb, ln2w, ln2b, fcw, fcb, fcpw, fcpb, lnfw, lnfb = params[:16]
    B, T = inputs.shape
    C, NH, V = cfg["C"], cfg["NH"], cfg["V"]
    hs = C // NH
    x = wte[inputs] + wpe[:T]
    causal = np.tril(np.ones((T, T), dtype=bool))
    layers, is_moe = [], moe_layers(cfg)
    for l in range(cfg["L"]):
        a = dict(x=x, ln1=layernorm(x, ln1w[l], ln1b[l]))
        qkv = a["ln1"] @ qkvw[l].T + qkvb[l]
        q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, NH, hs).transpose(0, 2, 1, 3) for i in range(3))
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hs), -np.inf)
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        a.update(q=q, k=k, v=v, att=att, y=(att @ v).transpose(0, 2, 1, 3).reshape(B, T, C))
        x = a["xmid"] = x + a["y"] @ attw[l].T + attb[l]
        a["ln2"] = layernorm(x, ln2w[l], ln2b[l])
        a["mlp"] = sum(is_moe[:l]) if is_moe[l] else l - sum(is_moe[:l])  # its place among the MoE or dense layers
        if is_moe[l]:
            y, a["moe"] = moe_forward(cfg, params, a["mlp"], a["ln2"], moe)
            x = x + y
        else:
            d = a["mlp"]
            a["h"] = a["ln2"] @ fcw[d].T + fcb[d]
            a["gelu"] = gelu(a["h"])
            x = x + a["gelu"] @ fcpw[d].T + fcpb[d]
        layers.append(a)
    lnf = layernorm(x, lnfw, lnfb)
    logits = lnf @ wte[:V].T  # tied head over the real vocabulary only
    m = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    cache = dict(inputs=inputs, targets=targets, layers=layers, x=x, lnf=lnf, probs=np.exp(logits - logz[..., None]),
                 losses=logz - picked, moe=moe, aux=sum(a["moe"]["aux"] for a in layers if "moe" in a),
                 z=sum(a["moe"]["z"] for a in layers if "moe" in a),
                 dropped=sum(a["moe"]["dropped"] for a in layers if "moe" in a))
    return float((logz - picked).mean()), cache


def read_eval(path):
    """The examples of an llm.c multiple-choice eval file (HellaSwag's): a list of (label, context tokens,
    [completion tokens, ...])."""
    raw = open(path, "rb").read()
    h = struct.unpack("<256i", raw[:1024])
    assert h[0] == 20240522 and h[1] == 1, f"{path}: not an llm.c eval file"
    words = np.frombuffer(raw[1024:], dtype="<u2").astype(np.int64)
    examples, at = [], 0
    for e in range(h[2]):
        start, nbytes, index, label, n, ctx_len = words[at:at + 6]
        assert start == 65535 and index == e, f"{path}: example {e} is not where it should be"
        ctx = words[at + 6:at + 6 + ctx_len]
        k, completions = at + 6 + ctx_len, []
        for _ in range(n):
            completions.append(words[k + 1:k + 1 + words[k]])
            k += 1 + words[k]
        assert k == at + nbytes // 2, f"{path}: example {e} is not {nbytes} bytes"
        examples.append((int(label), ctx, completions))
        at = k
    return examples


def hellaswag(cfg, params, examples):
    """(acc, acc_norm, each example's choice by sum, by mean) as llm.c's HellaSwag evaluation scores: each completion after its context, alone
    through the model; the summed loss of the completion's tokens picks for acc, its mean per token for acc_norm
    (the first lowest wins a tie)."""
    acc = acc_norm = 0
    choices, choices_norm = [], []
    for label, ctx, completions in examples:
        sums, means = [], []
        for comp in completions:
            row = np.concatenate([ctx, comp])
            losses = gpt2_forward(cfg, params, row[None, :-1], row[None, 1:])[1]["losses"][0]
            sums.append(losses[len(ctx) - 1:].sum())
            means.append(sums[-1] / len(comp))
        choices.append(int(np.argmin(sums)))
        choices_norm.append(int(np.argmin(means)))
        acc += choices[-1] == label
        acc_norm += choices_norm[-1] == label
    return acc, acc_norm, choices, choices_norm


def gpt2_loss(cfg, params, inputs, targets):
    return gpt2_forward(cfg, params, inputs, targets)[0]


def gpt2_objective(cfg, params, inputs, targets, moe=MOE):
    """What training minimises: the loss plus a mixture of experts' balance and z-losses."""
    loss, cache = gpt2_forward(cfg, params, inputs, targets, moe)
    return loss + cache["aux"] + cache["z"]


def layernorm_backward(x, w, dout):
    """(dx, dw, db) of layernorm(x, w, b) given the gradient of its output."""
    mean = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
    xhat = (x - mean) * rstd
    dxhat = dout * w
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    return dx, (dout * xhat).reshape(-1, x.shape[-1]).sum(0), dout.reshape(-1, x.shape[-1]).sum(0)


def gelu_grad(x):
    c = np.sqrt(2.0 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)


def gpt2_backward(cfg, params, cache):
    """The gradient of the training objective (gpt2_objective) with respect to each tensor (the same shapes)."""
    wte, wpe, ln1w, ln1b, qkvw, qkvb, attw, attb, ln2w, ln2b, fcw, fcb, fcpw, fcpb, lnfw, lnfb = params[:16]
    grads = [np.zeros_like(p) for p in params]
    dwte, dwpe, dln1w, dln1b, dqkvw, dqkvb, dattw, dattb, dln2w, dln2b, dfcw, dfcb, dfcpw, dfcpb, dlnfw, dlnfb = grads[:16]
    inputs, targets = cache["inputs"], cache["targets"]
    B, T = inputs.shape
    C, NH, V = cfg["C"], cfg["NH"], cfg["V"]
    hs = C // NH

    def mm(dout, inp):  # the weight gradient of inp @ W.T, summed over the batch and positions
        return dout.reshape(-1, dout.shape[-1]).T @ inp.reshape(-1, inp.shape[-1])

    def rows(d):  # the bias gradient: summed over the batch and positions
        return d.reshape(-1, d.shape[-1]).sum(0)

    dlogits = cache["probs"].copy()
    np.put_along_axis(dlogits, targets[..., None], np.take_along_axis(dlogits, targets[..., None], -1) - 1.0, -1)
    dlogits /= B * T
    dwte[:V] += mm(dlogits, cache["lnf"])
    dx, dlnfw[:], dlnfb[:] = layernorm_backward(cache["x"], lnfw, dlogits @ wte[:V])
    for l in reversed(range(cfg["L"])):
        a = cache["layers"][l]
        # MLP branch: x = xmid + gelu(ln2 @ fcw.T + fcb) @ fcpw.T + fcpb (a MoE layer: its experts' gated sum)
        d = a["mlp"]
        if "moe" in a:
            dln2 = moe_backward(cfg, params, grads, d, a["moe"], dx, cache["moe"])
        else:
            dfcpw[d], dfcpb[d] = mm(dx, a["gelu"]), rows(dx)
            dh = (dx @ fcpw[d]) * gelu_grad(a["h"])
            dfcw[d], dfcb[d] = mm(dh, a["ln2"]), rows(dh)
            dln2 = dh @ fcw[d]
        dln, dln2w[l], dln2b[l] = layernorm_backward(a["xmid"], ln2w[l], dln2)
        dx = dx + dln
        # attention branch: xmid = x + y @ attw.T + attb
        dattw[l], dattb[l] = mm(dx, a["y"]), rows(dx)
        dy = (dx @ attw[l]).reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
        att = a["att"]
        datt = dy @ a["v"].transpose(0, 1, 3, 2)
        dv = att.transpose(0, 1, 3, 2) @ dy
        dscores = att * (datt - (datt * att).sum(-1, keepdims=True)) / np.sqrt(hs)  # masked entries: att = 0
        dq, dk = dscores @ a["k"], dscores.transpose(0, 1, 3, 2) @ a["q"]
        dqkv = np.concatenate([d.transpose(0, 2, 1, 3).reshape(B, T, C) for d in (dq, dk, dv)], -1)
        dqkvw[l], dqkvb[l] = mm(dqkv, a["ln1"]), rows(dqkv)
        dln, dln1w[l], dln1b[l] = layernorm_backward(a["x"], ln1w[l], dqkv @ qkvw[l])
        dx = dx + dln
    np.add.at(dwte, inputs.ravel(), dx.reshape(-1, C))
    dwpe[:T] = dx.sum(0)
    return grads


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
    tensors = []
    for s, kind in zip(param_shapes(cfg), KINDS):
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


# The tensors that get weight decay: the matrices (wte, wpe, qkvw, attprojw, fcw, fcprojw, and a mixture of
# experts' routerw, expfcw, expfcprojw), not the biases or LayerNorm parameters.
DECAYS = [kind == "w" for kind in KINDS]


def lr_at(step, s):
    """The learning rate of step (0-based): linear warmup to s["lr"], then cosine down to lr * final_frac."""
    if step < s["warmup"]:
        return s["lr"] * (step + 1) / s["warmup"]
    floor = s["lr"] * s["final_frac"]
    progress = min(1.0, (step - s["warmup"]) / (s["steps"] - s["warmup"])) if s["steps"] > s["warmup"] else 1.0
    return floor + 0.5 * (s["lr"] - floor) * (1.0 + np.cos(np.pi * progress))


def train(cfg, params, tokens, B, T, s, moe=MOE):
    """s["steps"] steps of AdamW as the engine takes them: each step's (loss, grad norm, lr), the loss and
    norm before its update, and the final params. Batches come in the engine's loader order: B*T+1 tokens
    from position 0, B*T further each step, back to 0 when the next would run past the shard's end. The
    gradient is scaled by clip / norm when its global norm is above s["clip"] (0: never); AdamW's moments
    are bias corrected (1 - beta^t), and its weight decay is decoupled (lr * wd * w, matrices only). A mixture
    of experts adds its balance and z-losses to what is minimised; each step's log then has (aux + z, dropped)."""
    params = [p.copy() for p in params]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    log, pos = [], 0
    for step in range(s["steps"]):
        if pos + B * T + 1 > tokens.size:
            pos = 0
        inputs, targets = batch(tokens[pos:], B, T)
        pos += B * T
        loss, cache = gpt2_forward(cfg, params, inputs, targets, moe)
        grads = gpt2_backward(cfg, params, cache)
        norm = np.sqrt(sum((g * g).sum() for g in grads))  # wte once: its embedding and head gradients summed
        lr = lr_at(step, s)
        scale = s["clip"] / norm if s["clip"] > 0 and norm > s["clip"] else 1.0
        t = step + 1
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g * scale
            m[i] = s["beta1"] * m[i] + (1 - s["beta1"]) * g
            v[i] = s["beta2"] * v[i] + (1 - s["beta2"]) * g * g
            mhat, vhat = m[i] / (1 - s["beta1"] ** t), v[i] / (1 - s["beta2"] ** t)
            p -= lr * (mhat / (np.sqrt(vhat) + s["eps"]) + (s["wd"] if DECAYS[i] else 0.0) * p)
        log.append((loss, norm, lr, cache["aux"] + cache["z"], cache["dropped"]))
    return log, params


def gradcheck(cfg, params, inputs, targets, per_tensor=4, h=1e-5, moe=MOE):
    """Central differences of the training objective against gpt2_backward at a few random entries of each
    tensor (a mixture of experts: its routing stays put for steps this small, so its choices and loads are
    constants, as the backward pass takes them)."""
    grads = gpt2_backward(cfg, params, gpt2_forward(cfg, params, inputs, targets, moe)[1])
    rng = np.random.default_rng(7)
    worst = 0.0
    for name, p, g in zip(NAMES, params, grads):
        if p.size == 0:
            continue
        errs = []
        for _ in range(per_tensor):
            idx = tuple(int(rng.integers(0, n)) for n in p.shape)
            if name == "wte":  # a real row: the padding rows never reach the loss
                idx = (int(rng.integers(0, cfg["V"])),) + idx[1:]
            keep = p[idx]
            p[idx] = keep + h
            up = gpt2_objective(cfg, params, inputs, targets, moe)
            p[idx] = keep - h
            down = gpt2_objective(cfg, params, inputs, targets, moe)
            p[idx] = keep
            fd = (up - down) / (2 * h)
            errs.append(abs(fd - g[idx]) / max(abs(fd), 1e-3))  # relative, or absolute for the small ones
        worst = max(worst, max(errs))
        print(f"{name:9s} max |fd - analytic| / max(|fd|, 1e-3) = {max(errs):.1e}")
    return worst


def random_model(path, L, C, NH, maxT=1024, V=50257, Vp=50304):
    """An llm.c fp32 model file of any shape, initialised as GPT-2 is (matrices N(0, 0.02), LayerNorm weights 1,
    biases 0): for shapes no dN preset has (scripts/bench_gpu.sh emu large counts GPT-2 774M's and 1.5B's
    layers one and two at a time). Written a tensor at a time, in fp32."""
    rng = np.random.default_rng(0)
    cfg = dict(maxT=maxT, V=V, L=L, NH=NH, C=C, Vp=Vp)
    header = [20240326, 3, maxT, V, L, NH, C, Vp]
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *(header + [0] * (256 - len(header)))))
        for s, kind in zip(param_shapes(cfg), KINDS):
            if kind == "w":
                t = rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)
            else:
                t = np.full(s, 1.0 if kind == "lnw" else 0.0, dtype=np.float32)
            f.write(t.astype("<f4").tobytes())


def write_model(path, cfg, params):
    """An llm.c model file (version 3: fp32; a mixture of experts: llmpar's version 6) of params."""
    flat32 = np.concatenate([p.ravel() for p in params]).astype("<f4")
    header = [20240326, 3, cfg["maxT"], cfg["V"], cfg["L"], cfg["NH"], cfg["C"], cfg["Vp"]]
    if cfg.get("E", 0):
        header[1:2] = [6]
        header += [cfg["E"], cfg["K"], cfg["every"]]
    write_file(path, header, flat32.tobytes())


# The fixture's training run: 6 steps, each of which tells a feature apart. lr 1e-2 with 2 warmup steps, then
# cosine to 0.1 lr: a schedule off anywhere moves the weights ~1e-3. Weight decay 0.1: decaying the biases
# and LayerNorms too, or nothing, moves them ~4e-3. Clipping at 2.0: the norms are 3.38, 2.45, 2.34, then
# 1.71, 1.53, 1.14, so steps 1-3 are scaled and 4-6 not (AdamW ignores a scale that every step shares;
# this one changes), and none is near 2.0; without it the weights move ~1e-2.
FIXTURE_TRAIN = dict(steps=6, lr=1e-2, warmup=2, final_frac=0.1, wd=0.1, clip=2.0, beta1=0.9, beta2=0.95, eps=1e-8)


def train_flags(s, B, T):
    """The engine's flags for settings s (its betas and eps are fixed: 0.9, 0.95, 1e-8)."""
    return (f"-b {B} -t {T} -x {s['steps']} -l {s['lr']:g} -u {s['warmup']} -k cosine -q {s['final_frac']:g} "
            f"-c {s['wd']:g} --grad-clip {s['clip']:g}")


def make_train_fixture(outdir):
    """The fixture model's training run, FIXTURE_TRAIN on the fixture tokens: tiny_train_ref.txt (the
    engine's flags for it, then each step's lr, norm and loss) and tiny_train_ref.bin (the final weights)."""
    cfg, params = read_model(os.path.join(outdir, "tiny_model.bin"))
    tokens = read_tokens(os.path.join(outdir, "tiny_tokens.bin"))
    B, T = 2, 16
    x, y = batch(tokens, B, T)
    worst = gradcheck(cfg, params, x, y)
    assert worst < 1e-6, f"the backward pass disagrees with finite differences ({worst:.1e})"
    s = FIXTURE_TRAIN
    log, final = train(cfg, params, tokens, B, T, s)
    write_model(os.path.join(outdir, "tiny_train_ref.bin"), cfg, final)
    with open(os.path.join(outdir, "tiny_train_ref.txt"), "w") as f:
        f.write("# float64 AdamW steps of tiny_model.bin on tiny_tokens.bin (gpt2_ref.py make-train-fixture); the final\n"
                "# weights, rounded to fp32, are tiny_train_ref.bin. The engine's flags for the same run:\n")
        f.write(f"flags {train_flags(s, B, T)}\n")
        for step, (loss, norm, lr, *_) in enumerate(log):
            f.write(f"step {step + 1} lr {lr:.17g} norm {norm:.17g} loss {loss:.17g}\n")
    print(f"train fixture in {outdir}: {s['steps']} steps, loss {log[0][0]:.6f} -> {log[-1][0]:.6f}")


# The mixture-of-experts fixture: the tiny shape with 3 layers, layers 0 and 2 MoE (4 experts each, top-2),
# layer 1 dense; its top-1 twin (the same weights); their losses at capacity 0 (nothing dropped) and 1.0
# (some experts' rows dropped); a training run that drops rows and weights the balance and z-losses so
# either going wrong shows (0.1 and 0.01; an ordinary run's are 0.01 and 0).
FIXTURE_MOE_TRAIN = dict(FIXTURE_TRAIN, capacity=1.0, aux_coef=0.1, z_coef=0.01)


def moe_flags(moe):
    return f"--moe-capacity {moe['capacity']:g} --moe-aux-coef {moe['aux_coef']:g} --moe-z-coef {moe['z_coef']:g}"


def make_moe_fixture(outdir):
    """tiny_moe_model.bin, tiny_moe_top1_model.bin, tiny_moe_ref.txt (losses, balance + z-losses, rows dropped),
    tiny_moe_train_ref.txt and .bin (a training run), each backward pass checked against finite differences."""
    rng = np.random.default_rng(4321)
    cfg = dict(maxT=16, V=97, L=3, NH=4, C=32, Vp=128, E=4, K=2, every=2)
    params = []
    for s, kind in zip(param_shapes(cfg), KINDS):
        scale = {"w": 0.2, "lnw": 0.1, "b": 0.1}[kind]
        params.append((1.0 if kind == "lnw" else 0.0) + rng.normal(0.0, scale, s))
    params[NAMES.index("routerw")] *= 4.0  # decisive routing: no two experts' probabilities within fp32's rounding
    params[0][cfg["V"]:] = 0.0
    files = {"tiny_moe_model.bin": cfg, "tiny_moe_top1_model.bin": dict(cfg, K=1)}
    for name, c in files.items():
        write_model(os.path.join(outdir, name), c, params)
    x, y = batch(read_tokens(os.path.join(outdir, "tiny_tokens.bin")), 2, 16)
    with open(os.path.join(outdir, "tiny_moe_ref.txt"), "w") as f:
        f.write("# gpt2_ref.py make-moe-fixture: each MoE model's loss on tiny_tokens.bin (B 2, T 16) under the settings\n"
                "# named, its balance + z-losses (summed over the MoE layers) and the rows its capacity dropped\n")
        for name in files:
            c, ps = read_model(os.path.join(outdir, name))
            for capacity in (0.0, 1.0):
                moe = dict(capacity=capacity, aux_coef=0.1, z_coef=0.01)
                worst = gradcheck(c, ps, x, y, moe=moe)
                assert worst < 1e-6, f"{name}: the backward pass disagrees with finite differences ({worst:.1e})"
                loss, cache = gpt2_forward(c, ps, x, y, moe)
                f.write(f"model {name} {moe_flags(moe)} loss {loss:.17g} aux {cache['aux'] + cache['z']:.17g} "
                        f"dropped {cache['dropped']}\n")
    s = FIXTURE_MOE_TRAIN
    c, ps = read_model(os.path.join(outdir, "tiny_moe_model.bin"))
    log, final = train(c, ps, read_tokens(os.path.join(outdir, "tiny_tokens.bin")), 2, 16, s, s)
    write_model(os.path.join(outdir, "tiny_moe_train_ref.bin"), c, final)
    with open(os.path.join(outdir, "tiny_moe_train_ref.txt"), "w") as f:
        f.write("# float64 AdamW steps of tiny_moe_model.bin on tiny_tokens.bin (gpt2_ref.py make-moe-fixture): lr, norm,\n"
                "# loss, the balance + z-losses and the rows dropped of each; the final weights, rounded to fp32, are\n"
                "# tiny_moe_train_ref.bin. The engine's flags for the same run:\n")
        f.write(f"flags {train_flags(s, 2, 16)} {moe_flags(s)}\n")
        for step, (loss, norm, lr, aux, dropped) in enumerate(log):
            f.write(f"step {step + 1} lr {lr:.17g} norm {norm:.17g} loss {loss:.17g} aux {aux:.17g} dropped {dropped}\n")
    print(f"MoE fixture in {outdir}: {s['steps']} steps, loss {log[0][0]:.6f} -> {log[-1][0]:.6f}, "
          f"dropped {[d for *_, d in log]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    lo = sub.add_parser("loss", help="print the loss of a model on a token shard's first batch")
    gc = sub.add_parser("gradcheck", help="compare the backward pass with finite differences on the first batch")
    tr = sub.add_parser("train", help="AdamW steps with the engine's flags and semantics")
    for p in (lo, gc, tr):
        p.add_argument("model")
        p.add_argument("tokens")
        p.add_argument("-b", type=int, default=2)
        p.add_argument("-t", type=int, default=16)
    d = FIXTURE_TRAIN
    tr.add_argument("-x", type=int, default=d["steps"], help="steps")
    tr.add_argument("-l", type=float, default=d["lr"], help="peak learning rate")
    tr.add_argument("-u", type=int, default=d["warmup"], help="warmup steps")
    tr.add_argument("-q", type=float, default=d["final_frac"], help="final learning rate as a fraction of -l")
    tr.add_argument("-c", type=float, default=d["wd"], help="weight decay")
    tr.add_argument("--grad-clip", type=float, default=d["clip"], help="clip the global gradient norm (0: off)")
    tr.add_argument("-o", help="write the final weights here (an llm.c fp32 model file)")
    for p in (lo, gc, tr):
        p.add_argument("--moe-capacity", type=float, default=MOE["capacity"], help="a mixture of experts' capacity factor")
        p.add_argument("--moe-aux-coef", type=float, default=MOE["aux_coef"], help="its balance loss's coefficient")
        p.add_argument("--moe-z-coef", type=float, default=MOE["z_coef"], help="its z-loss's coefficient")
    rm = sub.add_parser("random-model", help="write an llm.c fp32 model file of the given shape, GPT-2's initialisation")
    rm.add_argument("out")
    for name in ("layers", "channels", "heads"):
        rm.add_argument(name, type=int)
    hs = sub.add_parser("hellaswag", help="llm.c's HellaSwag scoring of an eval file: acc_norm and acc counts")
    hs.add_argument("model")
    hs.add_argument("eval")
    for name in ("make-fixture", "make-train-fixture", "make-moe-fixture"):
        sub.add_parser(name, help=f"write the {name[5:].replace('-', ' ')}").add_argument("outdir")
    args = ap.parse_args()
    if args.cmd in ("loss", "gradcheck", "train"):
        moe = dict(capacity=args.moe_capacity, aux_coef=args.moe_aux_coef, z_coef=args.moe_z_coef)
    if args.cmd in ("loss", "gradcheck"):
        cfg, params = read_model(args.model)
        x, y = batch(read_tokens(args.tokens), args.b, args.t)
        if args.cmd == "loss":
            loss, cache = gpt2_forward(cfg, params, x, y, moe)
            print(f"loss {loss:.17g}" + (f" aux {cache['aux'] + cache['z']:.17g} dropped {cache['dropped']}" if cfg.get("E") else ""))
        else:
            print(f"worst {gradcheck(cfg, params, x, y, moe=moe):.1e}")
    elif args.cmd == "train":
        cfg, params = read_model(args.model)
        s = dict(d, steps=args.x, lr=args.l, warmup=args.u, final_frac=args.q, wd=args.c, clip=args.grad_clip)
        log, final = train(cfg, params, read_tokens(args.tokens), args.b, args.t, s, moe)
        for step, (loss, norm, lr, aux, dropped) in enumerate(log):
            print(f"step {step + 1}/{s['steps']} | loss {loss:.17g} | lr {lr:.17g} | norm {norm:.17g}" +
                  (f" | moe aux {aux:.17g}, dropped {dropped}" if cfg.get("E") else ""))
        if args.o:
            write_model(args.o, cfg, final)
    elif args.cmd == "hellaswag":
        cfg, params = read_model(args.model)
        examples = read_eval(args.eval)
        acc, acc_norm, choices, choices_norm = hellaswag(cfg, params, examples)
        print(f"acc_norm {acc_norm}/{len(examples)} acc {acc}/{len(examples)}")
        print("choices_norm " + " ".join(map(str, choices_norm)))
        print("choices " + " ".join(map(str, choices)))
    elif args.cmd == "random-model":
        random_model(args.out, args.layers, args.channels, args.heads)
    elif args.cmd == "make-fixture":
        make_fixture(args.outdir)
    elif args.cmd == "make-train-fixture":
        make_train_fixture(args.outdir)
    else:
        make_moe_fixture(args.outdir)


if __name__ == "__main__":
    main()
