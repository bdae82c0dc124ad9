#!/usr/bin/env python3
"""A roofline model of one training step on an H100, from the emulator's counts (CUDAEMU_PROFILE files of
train_gpt_emu_prof). It is a model, and prints itself as one: no GPU ran.

Each run is two files, the same training at two micro-batch sizes (measured B1 < B2, same T). One step is
the records between the file's 2nd and 4th cudaDeviceSynchronize (the driver synchronizes twice a step, so
that is step 2). Every count of every launch is taken as affine in B, fitted through the two sizes and
extrapolated to --batch: exact for a launch whose work is linear in B or independent of it (AdamW), which
is all of them at a fixed T save the embedding backward (its distinct tokens grow more slowly than B).
Matmul shapes in names are extrapolated the same way.

Time of a launch on the H100: max(bytes / HBM bandwidth, FLOPs / peak): bytes are the sectors of the
kernel's warp requests (no cache); matmuls move each matrix once and run at GEMM_EFFICIENCY of dense bf16
peak; host copies go at PCIE. Kernels' own FLOPs are not counted (dev/cudaemu/README.md says why). Launch
latency, overlap between kernels and caches are not modelled.
"""
import argparse
import re
import sys
from collections import defaultdict

HBM = 3.35e12           # H100 SXM HBM3, bytes/s
PEAK = 989e12           # H100 SXM dense bf16 tensor cores, FLOP/s
GEMM_EFFICIENCY = 0.70  # the fraction of PEAK a cuBLASLt matmul is taken to reach
PCIE = 50e9             # host copies over PCIe 5.0 x16, bytes/s (64 GB/s a direction nominal)


def step_records(path):
    """The records of step 2: between the 2nd and the 4th cudaDeviceSynchronize."""
    recs, syncs = [], 0
    with open(path) as f:
        for line in f:
            if line.startswith("# cudaDeviceSynchronize"):
                syncs += 1
                continue
            if line.startswith("#"):
                continue
            if 2 <= syncs < 4:
                kind, name, *nums = line.rstrip("\n").split("\t")
                recs.append((kind, name, [float(x) for x in nums]))
    if syncs < 4:
        sys.exit(f"{path}: {syncs} cudaDeviceSynchronize marks, 4 expected (two steps, two per step)")
    return recs


def keyed(recs):
    """Records by (kind, name without its numbers, occurrence): the same launch at both sizes."""
    seen, out = defaultdict(int), {}
    for kind, name, nums in recs:
        shape = (kind, re.sub(r"\d+", "#", name))
        out[shape + (seen[shape],)] = (name, nums)
        seen[shape] += 1
    return out


def waits(recs):
    """cudaFree calls in the step: each waits for the whole device. Not fitted (scratch that regrows
    depends on the batch's tokens), reported as counted."""
    return sum(1 for kind, _, _ in recs if kind == "wait")


def extrapolate(r1, r2, b1, b2, b):
    k1, k2 = (keyed([x for x in r if x[0] != "wait"]) for r in (r1, r2))
    if k1.keys() != k2.keys():
        sys.exit("the two batch sizes launch different work: " + str(sorted(set(k1) ^ set(k2))[:5]))
    at = lambda x1, x2: x1 + (x2 - x1) * (b - b1) / (b2 - b1)
    rows = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0])  # (kind, name): launches, read, written, distinct r, w, FLOPs
    for key, (n1, v1) in k1.items():
        n2, v2 = k2[key]
        p1, p2 = re.split(r"(\d+)", n1), re.split(r"(\d+)", n2)
        name = "".join(str(round(at(int(x), int(y)))) if i % 2 else x for i, (x, y) in enumerate(zip(p1, p2)))
        row = rows[(key[0], name)]
        row[0] += 1
        for i in range(5):
            row[1 + i] += max(0.0, at(v1[i], v2[i]))
    return rows


def seconds(kind, nbytes, flops):
    if kind == "pcie":
        return nbytes / PCIE
    if kind == "gemm":
        return max(nbytes / HBM, flops / (GEMM_EFFICIENCY * PEAK))
    return nbytes / HBM  # kernels (FLOPs not counted), device copies and memsets


def model(rows):
    out = {}
    for (kind, name), (n, rd, wr, urd, uwr, fl) in rows.items():
        out[name] = dict(kind=kind, n=n, bytes=rd + wr, distinct=urd + uwr, flops=fl,
                         t=seconds(kind, rd + wr, fl), t_low=seconds(kind, urd + uwr, fl),
                         bound="compute" if kind == "gemm" and fl / (GEMM_EFFICIENCY * PEAK) > (rd + wr) / HBM else
                         "PCIe" if kind == "pcie" else "memory")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, required=True, help="B to model")
    ap.add_argument("--seq", type=int, required=True, help="T, as measured")
    ap.add_argument("--measured", type=int, nargs=2, required=True, metavar=("B1", "B2"))
    ap.add_argument("--model", type=int, nargs=3, required=True, metavar=("L", "C", "Vp"),
                    help="layers, channels, padded vocabulary (for MFU's FLOPs per token, as train_gpt counts them)")
    ap.add_argument("--run", nargs=3, action="append", required=True, metavar=("LABEL", "FILE_B1", "FILE_B2"))
    a = ap.parse_args()
    b1, b2 = a.measured
    runs, frees = [], {}
    for label, f1, f2 in a.run:
        r1, r2 = step_records(f1), step_records(f2)
        runs.append((label, model(extrapolate(r1, r2, b1, b2, a.batch))))
        frees[label] = (waits(r1), waits(r2))
    L, C, Vp = a.model
    tokens = a.batch * a.seq
    flops_per_token = 6.0 * (Vp * C + 12 * L * C * C) + 12.0 * L * C * a.seq  # llmpar.h's lp_flops_per_token

    label0, m0 = runs[0]
    others = runs[1:]
    head = ["kernel or call", "launches/step", "MB moved", "MB distinct", "GFLOP", "bound", "MODELLED us", "share"]
    for label, _ in others:
        head += [f"{label}: launches", f"{label}: MODELLED us"]
    total0 = sum(r["t"] for r in m0.values())
    print(f"MODELLED, not measured: a training step of GPT-2 d{L} (C={C}) at B={a.batch} T={a.seq} on one H100 SXM, from the "
          f"CUDA emulator's counts at B={b1} and B={b2}, T={a.seq}, extrapolated linearly in B")
    print(f"MODELLED with HBM {HBM / 1e12:.2f} TB/s, matmuls at {GEMM_EFFICIENCY:.0%} of {PEAK / 1e12:.0f} TFLOP/s dense "
          f"bf16, host copies at {PCIE / 1e9:.0f} GB/s; no caches, launch latency or overlap")
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
        print(f"MODELLED {label}: step {t * 1e3:.1f} ms (matmuls {part(['gemm']):.1f}, other kernels {part(['kernel']):.1f}, "
              f"memsets and device copies {part(['copy']):.1f}, host copies {part(['pcie']):.2f}); {tokens / t:,.0f} tok/s; "
              f"MFU {100 * flops_per_token * tokens / t / PEAK:.1f}%; {launches} kernel and matmul launches per step; "
              f"cudaFree (a wait for the whole device, not timed) {frees[label][0]} times in the counted step at B={b1}, "
              f"{frees[label][1]} at B={b2}")
        print(f"MODELLED {label}, distinct sectors only (as if every re-read within a launch hit a cache): step "
              f"{low * 1e3:.1f} ms, {tokens / low:,.0f} tok/s")


if __name__ == "__main__":
    main()
