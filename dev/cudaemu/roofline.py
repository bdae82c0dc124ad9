#!/usr/bin/env python3
"""A roofline model of one training step on an H100, from the emulator's counts (CUDAEMU_PROFILE files of
train_gpt_emu_prof). It is a model, and prints itself as one: no GPU ran.

Each run is two files, the same training at two micro-batch sizes (measured B1 < B2, same T). One step is
the records between the file's 2nd and 4th cudaDeviceSynchronize (the driver synchronizes twice a step, so
that is step 2). Every count of every launch is taken as affine in B, fitted through the two sizes and
extrapolated to --batch: exact for a launch whose work is linear in B or independent of it (AdamW), which
is all of them at a fixed T save the embedding backward (its distinct tokens grow more slowly than B).
Matmul shapes in names are extrapolated the same way. With --layers LA LB a run is four files, the same
model counted at LA and at LB layers (each at B1 and B2), and every launch's modelled counts and time are
extrapolated linearly in depth to --model's L: exact, since each layer launches the same work and the
rest (embeddings, classifier, AdamW's per-parameter work) is constant or linear in the layers.

Time of a launch on the H100: max(bytes / HBM bandwidth, FLOPs / peak): bytes are the sectors of the
kernel's warp requests (no cache); matmuls move each matrix once and run at GEMM_EFFICIENCY of dense bf16
peak, a kernel's tensor-core products (mma; its other arithmetic is not counted, dev/cudaemu/README.md
says why) at MMA_EFFICIENCY; host copies go at PCIE; an NCCL call LATENCY plus the larger of the bytes it
sends and receives (a ring's) over --link. Launch latency and caches are not modelled.

The step is modelled twice: serial (the sum of every launch's time) and replayed: each stream's work in
its order, a stream's wait for an event after that event's record, work the host queued after one of its
waits after what it waited for, kernels and copies one at a time on the GPU, NCCL calls one at a time on
the link and host copies on PCIe, each started as early as that allows. The replayed step is what
overlapping communication with compute buys (--overlap prints it); CPU time on the host is not modelled.
--accum K adds a step of K micro-batches on one GPU (gradient accumulation): the optimizer's launches
once, everything else K times.
"""
import argparse
import re
import sys
from collections import defaultdict

HBM = 3.35e12           # H100 SXM HBM3, bytes/s
PEAK = 989e12           # H100 SXM dense bf16 tensor cores, FLOP/s
GEMM_EFFICIENCY = 0.70  # the fraction of PEAK a cuBLASLt matmul is taken to reach
MMA_EFFICIENCY = 0.35   # ... and a kernel's own mma products (FlashAttention-2's ~350 TFLOP/s on an H100)
PCIE = 50e9             # host copies over PCIe 5.0 x16, bytes/s (64 GB/s a direction nominal)
LATENCY = 20e-6         # per NCCL call, s (as --plan assumes)


def step_lines(path):
    """The lines of step 2 (between the 2nd and the 4th cudaDeviceSynchronize), in the file's order:
    ("op", kind, name, counts, stream, epoch), ("record", event, gen, stream, epoch),
    ("wait", stream, event, gen, epoch) and ("host", epoch, what)."""
    lines, syncs = [], 0
    with open(path) as f:
        for line in f:
            if line.startswith("# cudaDeviceSynchronize"):
                syncs += 1
                continue
            if not 2 <= syncs < 4:
                continue
            w = line.split()
            if line.startswith("# record"):
                lines.append(("record", int(w[2]), int(w[3]), int(w[4]), int(w[5])))
            elif line.startswith("# wait"):
                lines.append(("wait", int(w[2]), int(w[3]), int(w[4]), int(w[5])))
            elif line.startswith("# host"):
                lines.append(("host", int(w[2]), " ".join(w[3:])))
            elif not line.startswith("#"):
                kind, name, *nums = line.rstrip("\n").split("\t")
                nums += ["0", "0"] * (len(nums) < 7)  # counted before the emulator named streams: all on stream 0
                lines.append(("op", kind, name, [float(x) for x in nums[:5]], int(nums[5]), int(nums[6])))
    if syncs < 4:
        sys.exit(f"{path}: {syncs} cudaDeviceSynchronize marks, 4 expected (two steps, two per step)")
    return lines


def step_records(lines):
    """The step's launches and calls: (kind, name, counts)."""
    return [(x[1], x[2], x[3]) for x in lines if x[0] == "op"]


def keys(recs):
    """Each record's (kind, name without its numbers, occurrence): the same launch at both sizes."""
    seen, out = defaultdict(int), []
    for kind, name, _ in recs:
        shape = (kind, re.sub(r"\d+", "#", name))
        out.append(shape + (seen[shape],))
        seen[shape] += 1
    return out


def keyed(recs):
    """Records by key."""
    return {k: (name, nums) for k, (_, name, nums) in zip(keys(recs), recs)}


def waits(recs):
    """cudaFree calls in the step: each waits for the whole device. Not fitted (scratch that regrows
    depends on the batch's tokens), reported as counted."""
    return sum(1 for kind, _, _ in recs if kind == "wait")


def extrapolate(r1, r2, b1, b2, b):
    """Each launch's name and counts at B=b, by key. A launch at one size only (the embedding backward
    under ZeRO-2/3 runs once per piece of wte that has tokens in the batch, and copies its index up)
    counts 0 at the other; any other difference stops the model."""
    k1, k2 = (keyed([x for x in r if x[0] != "wait"]) for r in (r1, r2))
    odd = [k for k in set(k1) ^ set(k2) if "embedding_backward" not in k[1] and "HtoD" not in k[1]]
    if odd:
        sys.exit("the two batch sizes launch different work: " + str(sorted(odd)[:5]))
    at = lambda x1, x2: x1 + (x2 - x1) * (b - b1) / (b2 - b1)
    out = {}
    for key in k1.keys() | k2.keys():
        n1, v1 = k1.get(key, (None, [0.0] * 5))
        n2, v2 = k2.get(key, (None, [0.0] * 5))
        n1, n2 = n1 or n2, n2 or n1
        p1, p2 = re.split(r"(\d+)", n1), re.split(r"(\d+)", n2)
        name = "".join(str(round(at(int(x), int(y)))) if i % 2 else x for i, (x, y) in enumerate(zip(p1, p2)))
        out[key] = (name, [max(0.0, at(x, y)) for x, y in zip(v1, v2)])
    return out


def at_depth(ma, mb, f):
    """Each launch's modelled row (model()) at a depth a fraction f of the way from the first counted depth
    to the second (f = (L - LA) / (LB - LA)), linear through its rows there."""
    zero = dict(n=0, bytes=0.0, distinct=0.0, flops=0.0, t=0.0, t_low=0.0)
    out = {}
    for name in ma.keys() | mb.keys():
        ra, rb = ma.get(name, zero), mb.get(name, zero)
        r = dict(rb if name in mb else ra)
        for k in zero:
            r[k] = ra[k] + (rb[k] - ra[k]) * f
        r["n"] = round(r["n"])
        out[name] = r
    return out


def by_name(launches):
    """Launches summed by (kind, name): launches, read, written, distinct read, distinct written, FLOPs."""
    rows = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0])
    for key, (name, v) in launches.items():
        row = rows[(key[0], name)]
        row[0] += 1
        for i in range(5):
            row[1 + i] += v[i]
    return rows


def seconds(kind, nbytes, flops, link=None, nccl=None):
    if kind == "pcie":
        return nbytes / PCIE
    if kind == "nccl":  # nccl: (bytes sent, received) over a ring
        return LATENCY + max(nccl) / link
    if kind == "gemm":
        return max(nbytes / HBM, flops / (GEMM_EFFICIENCY * PEAK))
    return max(nbytes / HBM, flops / (MMA_EFFICIENCY * PEAK))  # kernels (their mma FLOPs), device copies, memsets


def launch_seconds(kind, v, link, distinct=False):
    """One launch's modelled time from its counts (read, written, distinct read and written, FLOPs)."""
    rd, wr = (v[2], v[3]) if distinct else (v[0], v[1])
    if kind == "nccl":
        return LATENCY + max(rd, wr) / link
    return seconds(kind, rd + wr, v[4])


def model(rows, link):
    out = {}
    for (kind, name), (n, rd, wr, urd, uwr, fl) in rows.items():
        t = launch_seconds(kind, [rd, wr, urd, uwr, fl], link) + (n - 1) * LATENCY * (kind == "nccl")
        t_low = launch_seconds(kind, [rd, wr, urd, uwr, fl], link, True) + (n - 1) * LATENCY * (kind == "nccl")
        out[name] = dict(kind=kind, n=n, bytes=rd + wr, distinct=urd + uwr, flops=fl, t=t, t_low=t_low,
                         bound="compute" if fl / ((GEMM_EFFICIENCY if kind == "gemm" else MMA_EFFICIENCY) * PEAK) > (rd + wr) / HBM else
                         "PCIe" if kind == "pcie" else "link" if kind == "nccl" else "memory")
    return out


OPTIMIZER = "optimizer (AdamW, gradient norm, ZeRO adds)"
CLASSES = [  # (class, pattern on the launch's name), first match wins
    ("attention", r"flash_attention|softmax|permute|^cublasLt .* x\d+$"),
    ("matmuls (linear layers, LM head)", r"^cublasLt"),
    ("LayerNorm", r"layernorm"),
    ("GELU", r"gelu"),
    ("classifier (softmax, cross-entropy)", r"classifier"),
    ("bias gradients", r"bias_partials"),
    ("two-pass sums (LayerNorm, bias)", r"sum_partials"),
    ("embeddings", r"embedding|positions"),
    (OPTIMIZER, r"adamw|norm_squared|lp_sum_kernel|add_scaled|stochastic"),
    ("memsets and copies", r"^cudaMem"),
    ("NCCL", r"^nccl"),
]


def kernel_class(name):
    return next((c for c, pat in CLASSES if re.search(pat, name)), "other")


RESOURCE = {"kernel": "gpu", "gemm": "gpu", "copy": "gpu", "pcie": "pcie", "nccl": "link"}


def replay(lines, launches, link):
    """The step's time with its streams replayed (see the top): the latest end of any stream, and the
    time spent on the link. lines: one file's step (step_lines); launches: each op's counts at the
    modelled B, by key (extrapolate)."""
    ops = [x for x in lines if x[0] == "op"]
    dur = {}
    for i, key in zip((i for i, x in enumerate(lines) if x[0] == "op"), keys(step_records(lines))):
        dur[i] = 0.0 if key[0] == "wait" else launch_seconds(key[0], launches[key][1], link)
    # each stream's items in order; each host wait's prerequisites: (stream, items before it) pairs
    in_step = {(y[1], y[2]) for y in lines if y[0] == "record"}
    queue, seen, host_needs = defaultdict(list), defaultdict(int), {}
    for i, x in enumerate(lines):
        if x[0] == "op" and x[1] == "wait":
            continue  # cudaFree's wait, on the host: its "# host ... device" line stands for it
        if x[0] in ("op", "record"):
            queue[x[4] if x[0] == "op" else x[3]].append(i)
        elif x[0] == "wait":
            queue[x[1]].append(i)
        else:
            what = x[2].split()
            if what[0] == "stream":
                host_needs[x[1]] = [(int(what[1]), seen[int(what[1])])]
            elif what[0] == "device":
                host_needs[x[1]] = list(seen.items())
            else:
                host_needs[x[1]] = ("event", int(what[1]), int(what[2]))
        if x[0] != "host":
            seen[x[4] if x[0] == "op" else x[3] if x[0] == "record" else x[1]] += 1
    head = {s: 0 for s in queue}      # next item per stream
    t = {s: 0.0 for s in queue}       # when each stream's last item ended
    ends = defaultdict(list)          # per stream, the end time of each item done
    recorded = {}                     # (event, gen): time
    free = defaultdict(float)         # per resource, when it is next free
    link_busy = 0.0

    def host_time(epoch):  # None while what the host waited for has not all run
        need = host_needs.get(epoch)
        if need is None:
            return 0.0  # a wait before the step: the step starts after it
        if need[0] == "event":
            return recorded.get(need[1:]) if need[1:] in in_step else 0.0
        done = [ends[s][n - 1] if n else 0.0 for s, n in need if len(ends[s]) >= n]
        return max(done, default=0.0) if len(done) == len(need) else None

    left = sum(len(q) for q in queue.values())
    while left:
        best = None
        for s, q in queue.items():
            if head[s] == len(q):
                continue
            x = lines[q[head[s]]]
            h = host_time(x[-1])
            if h is None:
                continue
            start = max(t[s], h)
            if x[0] == "wait":
                g = recorded.get((x[2], x[3]), None if (x[2], x[3]) in in_step else 0.0)
                if g is None:
                    continue
                start = max(start, g)
            elif x[0] == "op":
                start = max(start, free[RESOURCE[x[1]]])
            if best is None or start < best[0]:
                best = (start, s, x, q[head[s]])
        if best is None:
            sys.exit("the replay is stuck: a wait for an event whose record never comes")
        start, s, x, i = best
        end = start + (dur[i] if x[0] == "op" else 0.0)
        if x[0] == "op":
            free[RESOURCE[x[1]]] = end
            if x[1] == "nccl":
                link_busy += end - start
        elif x[0] == "record":
            recorded[(x[1], x[2])] = end
        t[s] = end
        ends[s].append(end)
        head[s] += 1
        left -= 1
    return max(t.values(), default=0.0), link_busy


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, required=True, help="B to model")
    ap.add_argument("--seq", type=int, required=True, help="T, as measured")
    ap.add_argument("--measured", type=int, nargs=2, required=True, metavar=("B1", "B2"))
    ap.add_argument("--model", type=int, nargs=3, required=True, metavar=("L", "C", "Vp"),
                    help="layers, channels, padded vocabulary (for MFU's FLOPs per token, as train_gpt counts them)")
    ap.add_argument("--run", nargs="+", action="append", required=True, metavar="LABEL FILE_B1 FILE_B2",
                    help="a label and the counts at B1 and B2; with --layers, at LA layers (B1, B2) then at LB (B1, B2)")
    ap.add_argument("--layers", type=int, nargs=2, metavar=("LA", "LB"),
                    help="the runs were counted at LA and LB layers: extrapolate in depth to --model's L")
    ap.add_argument("--link", type=float, nargs="+", default=[300.0], metavar="GB/s",
                    help="bytes per second each GPU's NCCL calls move each way (300: NVLink in a node; 40: between nodes)")
    ap.add_argument("--accum", type=int, default=1, metavar="K",
                    help="also model a step of K micro-batches (one GPU: the optimizer's launches once, the rest K times)")
    ap.add_argument("--overlap", action="store_true", help="print only each run's serial and replayed step, per --link")
    a = ap.parse_args()
    b1, b2 = a.measured
    runs, frees, replays = [], {}, {}
    for label, *files in a.run:
        if len(files) != (4 if a.layers else 2):
            sys.exit(f"--run {label}: {len(files)} files, {4 if a.layers else 2} expected")
        counted = []  # per depth counted: the model, cudaFree counts, replays per link
        for f1, f2 in zip(files[::2], files[1::2]):
            l1, l2 = step_lines(f1), step_lines(f2)
            r1, r2 = step_records(l1), step_records(l2)
            launches = extrapolate(r1, r2, b1, b2, a.batch)
            counted.append((model(by_name(launches), a.link[0] * 1e9), (waits(r1), waits(r2)),
                            [(link, sum(launch_seconds(k[0], v, link * 1e9) for k, (_, v) in launches.items()),
                              *replay(l2, launches, link * 1e9)) for link in a.link]))
        m, frees[label], replays[label] = counted[0]
        if a.layers:
            (la, lb), depth, (mb, _, rb) = a.layers, a.model[0], counted[1]
            f = (depth - la) / (lb - la)
            m = at_depth(m, mb, f)
            replays[label] = [(ra[0], *(x + (y - x) * f for x, y in zip(ra[1:], rb_[1:]))) for ra, rb_ in zip(replays[label], rb)]
        runs.append((label, m))
    if a.overlap:
        print(f"MODELLED, not measured: training steps at B={a.batch} T={a.seq} per GPU on H100 SXMs, from the CUDA emulator's "
              f"counts at B={b1} and B={b2} (rank 0's), extrapolated linearly in B; NCCL calls {LATENCY * 1e6:.0f} us plus their "
              f"ring's bytes over the link")
        print()
        print("| run | link GB/s | serial ms | replayed ms (streams overlapped) | NCCL ms | NCCL hidden |")
        print("|---|---|---|---|---|---|")
        for label, _ in runs:
            for link, serial, step, busy in replays[label]:
                hidden = (serial - step) / busy if busy else 0.0
                print(f"| {label} | {link:.0f} | {serial * 1e3:.1f} | {step * 1e3:.1f} | {busy * 1e3:.1f} | {100 * hidden:.0f}% |")
        return
    L, C, Vp = a.model
    tokens = a.batch * a.seq
    flops_per_token = 6.0 * (Vp * C + 12 * L * C * C) + 12.0 * L * C * a.seq  # llmpar.h's lp_flops_per_token

    print(f"MODELLED per class of kernel, ms per step at B={a.batch} T={a.seq} (the launches below, summed):")
    print()
    print("| class | " + " | ".join(f"{label} ms" for label, _ in runs) + " |")
    print("|---|" + "---|" * len(runs))
    sums = [defaultdict(float) for _ in runs]
    for (_, m), sm in zip(runs, sums):
        for name, r in m.items():
            sm[kernel_class(name)] += r["t"] * 1e3
    for c in [c for c, _ in CLASSES] + ["other"]:
        if any(sm[c] for sm in sums):
            print(f"| {c} | " + " | ".join(f"{sm[c]:.1f}" for sm in sums) + " |")
    print("| step (serial) | " + " | ".join(f"{sum(sm.values()):.1f}" for sm in sums) + " |")
    print()
    label0, m0 = runs[0]
    others = runs[1:]
    head = ["kernel or call", "launches/step", "MB moved", "MB distinct", "GFLOP", "bound", "MODELLED us", "share"]
    for label, _ in others:
        head += [f"{label}: launches", f"{label}: MODELLED us"]
    total0 = sum(r["t"] for r in m0.values())
    depth = f" and at {a.layers[0]} and {a.layers[1]} layers, extrapolated linearly in depth" if a.layers else ""
    print(f"MODELLED, not measured: a training step of GPT-2 d{L} (C={C}) at B={a.batch} T={a.seq} on one H100 SXM, from the "
          f"CUDA emulator's counts at B={b1} and B={b2}, T={a.seq}, extrapolated linearly in B{depth}")
    print(f"MODELLED with HBM {HBM / 1e12:.2f} TB/s, matmuls at {GEMM_EFFICIENCY:.0%} of {PEAK / 1e12:.0f} TFLOP/s dense "
          f"bf16, kernels' tensor-core products at {MMA_EFFICIENCY:.0%}, host copies at {PCIE / 1e9:.0f} GB/s, NCCL calls {LATENCY * 1e6:.0f} us plus their ring's bytes at "
          f"{a.link[0]:.0f} GB/s; no caches or launch latency; the step serial, and replayed with its streams overlapped")
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in sorted(set(m0) | {n for _, m in others for n in m}, key=lambda n: (-max(m.get(n, {"t": 0})["t"] for _, m in runs), n)):
        r = m0.get(name)
        cells = [name]
        if r:
            cells += [str(r["n"]), f"{r['bytes'] / 1e6:.1f}", f"{r['distinct'] / 1e6:.1f}", f"{r['flops'] / 1e9:.1f}",
                      r["bound"], f"{r['t'] * 1e6:.1f}", f"{100 * r['t'] / total0:.1f}%"]
        else:
            cells += ["0", "", "", "", "", "", ""]
        for _, m in others:
            o = m.get(name)
            cells += [str(o["n"]), f"{o['t'] * 1e6:.1f}"] if o else ["0", ""]
        print("| " + " | ".join(cells) + " |")
    print()
    for label, m in runs:
        t = sum(r["t"] for r in m.values())
        low = sum(r["t_low"] for r in m.values())
        part = lambda kinds: sum(r["t"] for r in m.values() if r["kind"] in kinds) * 1e3
        launches = sum(r["n"] for r in m.values() if r["kind"] in ("kernel", "gemm"))
        step = replays[label][0][2]
        print(f"MODELLED {label}: step {t * 1e3:.1f} ms serial (matmuls {part(['gemm']):.1f}, other kernels {part(['kernel']):.1f}, "
              f"memsets and device copies {part(['copy']):.1f}, host copies {part(['pcie']):.2f}, NCCL {part(['nccl']):.2f}), "
              f"{step * 1e3:.1f} ms replayed; {tokens / t:,.0f} tok/s; "
              f"MFU {100 * flops_per_token * tokens / t / PEAK:.1f}%; {launches} kernel and matmul launches per step; "
              f"cudaFree (a wait for the whole device, not timed) {frees[label][0]} times in the counted step at B={b1}, "
              f"{frees[label][1]} at B={b2}")
        print(f"MODELLED {label}, distinct sectors only (as if every re-read within a launch hit a cache): step "
              f"{low * 1e3:.1f} ms, {tokens / low:,.0f} tok/s")
        if a.accum > 1:  # the optimizer's class once per step, everything else once per micro-batch
            once = sum(r["t"] for n, r in m.items() if kernel_class(n) == OPTIMIZER)
            k = a.accum * (t - once) + once
            print(f"MODELLED {label} with {a.accum} micro-batches per step (gradient accumulation; AdamW and the gradient "
                  f"norm, {once * 1e3:.1f} ms, once): step {k * 1e3:.1f} ms, {a.accum * tokens / k:,.0f} tok/s, "
                  f"MFU {100 * flops_per_token * a.accum * tokens / k / PEAK:.1f}%")


if __name__ == "__main__":
    main()
