#!/usr/bin/env python3
"""Every instruction a kernel executes, from nvcc's own machine code (SASS) and the emulator's counts: the
issue roof of roofline.py sees the arithmetic and address instructions the emulator cannot count.

nvdisasm -gi prints each kernel's SASS with the source line of every instruction and the lines it was
inlined at. The emulator counts, per site (its lines, the same way), the warp instructions of the classes
it sees (global and shared loads and stores, shuffles, barriers, mma, special functions: the "site" lines
of a CUDAEMU_PROFILE file). How often each basic block of the SASS ran is solved from those counts: each
SASS instruction of those classes belongs to the site of its class and innermost line whose other lines
it shares most (the two compilers inline differently), and a site's instructions, each weighted by the
bytes a lane moves (vector widths differ between nvcc's code and the emulator's), ran as often as the
emulator counted; each block runs as often as control flows in and out of it; the kernel's entry runs
once per warp. Least squares over the blocks and edges (numpy), with
negative counts taken out and solved again; a branch no count tells apart splits its flow evenly (the
least-norm solution).
Executed instructions are then the sum over blocks of count times length, as Nsight Compute counts them
(a predicated-off instruction issues all the same). Unrolled loops need no care: their copies are
separate instructions, each run as the counts of its own block say.

    python3 dev/cudaemu/sass.py KERNEL.sass COUNTS.tsv      # each kernel's executed instructions
    python3 dev/cudaemu/sass.py --test                      # the solver on a listing written by hand
"""
import re
import sys
from collections import defaultdict

import numpy as np

# LDGSTS (cp.async) is one instruction that the emulator counts as a global load and a shared store at its
# line: it is weighed by the load's count; the store's count joins the rest of its class.
CLASSES = {"LDG": "gld", "LD": "gld", "LDGSTS": "gld", "STG": "gst", "ST": "gst", "LDS": "lds", "LDSM": "lds", "STS": "sts",
           "SHFL": "shfl", "BAR": "bar", "HMMA": "mma", "MUFU": "sfu"}
MATCHED = ("gld", "gst", "lds", "sts", "shfl", "bar", "mma", "sfu")  # the classes both sides count the same way
SPECIAL = {"EX2", "LG2", "RSQ", "SQRT", "TANH", "SIN", "COS"}  # the MUFU functions cudaemu.h's wrappers count


def demangle(mangled):
    """An entry's identifier and integer template arguments, as the emulator names launches: k<64>."""
    m = re.match(r"_Z(\d+)(\w+)", mangled)
    if not m:
        return mangled
    name, rest = m.group(2)[:int(m.group(1))], m.group(2)[int(m.group(1)):]
    args = re.match(r"I((?:Li\d+E)+)E", rest)
    return name + ("<" + ",".join(re.findall(r"Li(\d+)E", args.group(1))) + ">" if args else "")


def width(op, mods):
    """Bytes a lane moves in a load or store (LDSM.16.MT88.4: four 8 x 8 matrices, 16 bytes a lane)."""
    if op == "LDSM":
        return 4 * int(mods[-1]) if mods and mods[-1].isdigit() else 4
    for m in mods:
        if m in ("128", "64"):
            return int(m) // 8
        if m in ("U16", "S16"):
            return 2
        if m in ("U8", "S8"):
            return 1
    return 4


def read_sass(path):
    """Kernels of an nvdisasm -gi listing: name -> list of instructions (opcode, modifiers, predicated,
    target label, source lines: "file:line" and where it was inlined, innermost first) and labels (label
    -> index of the next instruction)."""
    kernels, cur, where, chain = {}, None, ("?",), []
    for line in open(path):
        m = re.match(r"\s*\.text\.(\S+):", line)
        if m:
            cur = kernels.setdefault(demangle(m.group(1)), dict(ins=[], labels={}))
            continue
        if cur is None:
            continue
        m = re.findall(r'"([^"]*)", line (\d+)', line) if "//##" in line else None
        if m:  # nvdisasm -gi: a frame and where it was inlined, then that one's, ...
            chain = chain + m[1:] if chain and chain[-1] == m[0] else m
            continue
        if chain:  # the frames of the program's own code (not of CUDA's headers), as the emulator names them
            own = [f for f in chain if not f[0].startswith("/usr/")] or chain
            where, chain = lines(f[0].rsplit("/", 1)[-1] + ":" + f[1] for f in own), []
        m = re.match(r"(\.L_x_\d+):", line.strip())
        if m:
            cur["labels"][m.group(1)] = len(cur["ins"])
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[\w]+)*)\s*(.*?);", line)
        if m:
            target = re.search(r"`\((\.L_x_\d+)\)", m.group(4))
            cur["ins"].append(dict(op=m.group(2), mods=m.group(3).split(".")[1:], pred=bool(m.group(1)),
                                   target=target.group(1) if target else None, where=where))
    return kernels


def blocks(k):
    """Basic blocks (start, end) and the edges between them (from, to)."""
    ins, labels = k["ins"], k["labels"]
    leaders = {0} | set(labels.values())
    for i, x in enumerate(ins):
        if x["op"] in ("BRA", "BRX", "EXIT", "RET", "JMP"):
            leaders.add(i + 1)
    starts = sorted(s for s in leaders if s < len(ins))
    spans = [(s, e) for s, e in zip(starts, starts[1:] + [len(ins)])]
    index = {s: b for b, (s, _) in enumerate(spans)}
    edges = []
    for b, (s, e) in enumerate(spans):
        last = ins[e - 1]
        if last["op"] in ("BRA", "JMP") and last["target"] in labels:
            edges.append((b, index[labels[last["target"]]]))
        ends = last["op"] in ("EXIT", "RET", "BRA", "JMP", "BRX") and not last["pred"]
        if not ends and e < len(ins):
            edges.append((b, index[e]))
    return spans, edges


def lines(frames):
    """Source lines, innermost first, each once (a frame and its call can name one line)."""
    out = []
    for f in frames:
        if not out or out[-1] != f:
            out.append(f)
    return tuple(out)


def site_of(sites, cls, chain):
    """The emulator's site an instruction belongs to: of its class and innermost line, the one whose other
    lines the instruction's share most (the two compilers inline differently: a function g++ did not inline
    ends its sites' lines, and g++ may name a function's first line between two calls)."""
    best, score = None, None
    for key in sites.get((cls, chain[0]), ()):
        shared = sum(f in chain for f in key[1])
        s = (shared - (len(key[1]) - shared), shared)
        if score is None or s > score:
            best, score = key, s
    return best


def solve(k, sites, warps):
    """How often each block ran (warp executions), from the kernel's site counts: {(class, lines): (n, width)}."""
    ins = k["ins"]
    spans, edges = blocks(k)
    nb, ne = len(spans), len(edges)
    block_of = [0] * len(ins)
    for b, (s, e) in enumerate(spans):
        for i in range(s, e):
            block_of[i] = b
    groups = defaultdict(lambda: defaultdict(float))  # (class, lines) -> block -> lane bytes per run
    innermost = defaultdict(list)
    for key in sites:
        innermost[(key[0], key[1][0])].append(key)
    for i, x in enumerate(ins):
        cls = CLASSES.get(x["op"])
        if cls == "sfu" and not set(x["mods"]) & SPECIAL:
            continue  # a reciprocal: a division's, which the emulator does not see
        if cls in MATCHED:
            key = site_of(innermost, cls, x["where"]) or (cls, x["where"])
            groups[key][block_of[i]] += width(x["op"], x["mods"]) if cls in ("gld", "gst", "lds", "sts") else 1
    rows, rhs = [], []
    big = 100.0

    def row(coeffs, value, weight):
        r = np.zeros(nb + ne)
        for j, c in coeffs:
            r[j] += c * weight
        rows.append(r)
        rhs.append(value * weight)

    for b in range(nb):  # control flows into a block as often as it runs, and out
        into = [(nb + j, -1.0) for j, (f, t) in enumerate(edges) if t == b]
        out = [(nb + j, -1.0) for j, (f, t) in enumerate(edges) if f == b]
        row([(b, 1.0)] + into, warps if b == 0 else 0.0, big / max(warps, 1))
        if out:
            row([(b, 1.0)] + out, 0.0, big / max(warps, 1))
    # A site both sides have is one equation; the rest of a class (what the two compilers name differently)
    # is one more, all its instructions against all its counts
    rest = defaultdict(lambda: [defaultdict(float), 0.0])
    matched = 0
    for (cls, where), per_block in groups.items():
        lane = lambda n, w: n * (w if cls in ("gld", "gst", "lds", "sts") else 1)
        if (cls, where) in sites:
            value = lane(*sites[(cls, where)])
            matched += 1
            row(list(per_block.items()), value, 1.0 / max(value, warps))
        else:
            for b, c in per_block.items():
                rest[cls][0][b] += c
    for (cls, where), (n, w) in sites.items():
        if cls in MATCHED and (cls, where) not in groups:
            rest[cls][1] += n * (w if cls in ("gld", "gst", "lds", "sts") else 1)
    for cls, (per_block, value) in rest.items():
        if per_block and value:  # (none left to count: the lines may be unmatched, not unrun)
            row(list(per_block.items()), value, 1.0 / max(value, warps))
    A, y = np.array(rows), np.array(rhs)  # lstsq's least-norm solution splits what no count decides evenly
    free = np.ones(nb + ne, dtype=bool)
    for _ in range(20):
        x = np.zeros(nb + ne)
        x[free] = np.linalg.lstsq(A[:, free], y, rcond=None)[0]
        if (x >= -1e-6 * warps).all():
            break
        free &= x > 0
    counts = np.maximum(x[:nb], 0)
    return spans, counts, matched, len(groups)


def read_sites(path):
    """A counts file's site lines: kernel -> {(class, lines): (warp instructions, bytes a lane)}."""
    out = defaultdict(dict)
    for line in open(path):
        if line.startswith("site\t"):
            _, kernel, cls, where, n, w = line.rstrip("\n").split("\t")
            key = (cls, lines(where.split("<")))
            n0, w0 = out[kernel].get(key, (0.0, 0))
            out[kernel][key] = (n0 + float(n), max(w0, int(w)))
    return out


def executed(sass, counts_file, launches):
    """Each kernel's executed warp instructions: kernel -> (instructions, groups matched, groups)."""
    kernels, sites = read_sass(sass), read_sites(counts_file)
    out = {}
    for name, warps in launches.items():
        if name not in kernels or name not in sites:
            continue
        spans, n, matched, groups = solve(kernels[name], sites[name], warps)
        out[name] = (float(sum(c * (e - s) for (s, e), c in zip(spans, n))), matched, groups)
    return out


TEST_SASS = """//--------------------- .text._Z4testPf --------------------------
.text._Z4testPf:
	//## File "/src/k.cu", line 5
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   MOV R1, RZ ;
.L_x_0:
	//## File "/src/k.cu", line 7
        /*0020*/                   LDS.64 R2, [R0] ;
	//## File "/usr/local/cuda/include/cuda_bf16.hpp", line 40 inlined at "/src/k.cu", line 8
        /*0030*/                   FADD R1, R1, R2 ;
	//## File "/src/k.cu", line 7
        /*0040*/                   IADD3 R0, R0, 0x8, RZ ;
        /*0050*/                   ISETP.NE.AND P0, PT, R0, 0x40, PT ;
        /*0060*/               @P0 BRA `(.L_x_0) ;
	//## File "/src/k.cu", line 9
        /*0070*/              @!P1 BRA `(.L_x_1) ;
        /*0080*/                   STG.E desc[UR4][R4.64], R1 ;
.L_x_1:
        /*0090*/                   EXIT ;
"""


def test():
    """The solver on a listing written by hand: 10 warps, a loop of 16 runs each (the emulator saw its
    8-byte load as two of 4 bytes), a store by 5 of them: 2 x 10 + 5 x 160 + 10 + 5 + 10 = 845."""
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "t.sass"), "w") as f:
            f.write(TEST_SASS)
        with open(os.path.join(d, "t.tsv"), "w") as f:
            f.write("kernel\ttest\t0\t0\t0\t0\t0\t0\t0\t5\t64\t0\n"
                    "site\ttest\tlds\tk.cu:7\t320\t4\nsite\ttest\tgst\tk.cu:9\t5\t4\n")
        got = executed(os.path.join(d, "t.sass"), os.path.join(d, "t.tsv"), {"test": 10})["test"]
    ok = abs(got[0] - 845) < 1e-6 and got[1:] == (2, 2)
    print(f"{'ok  ' if ok else 'FAIL'} sass.py: executed {got[0]:.3f} instructions (845 expected), {got[1]}/{got[2]} line classes")
    return ok


def main():
    if sys.argv[1:] == ["--test"]:
        sys.exit(0 if test() else 1)
    sass, counts_file = sys.argv[1:3]
    launches = defaultdict(float)
    for line in open(counts_file):
        w = line.rstrip("\n").split("\t")
        if w[0] == "kernel":
            launches[w[1]] += float(w[9]) * -(-int(w[10]) // 32)
    for name, (n, matched, groups) in executed(sass, counts_file, launches).items():
        print(f"{name}\t{n:.0f}\t{matched}/{groups} line classes counted")


if __name__ == "__main__":
    main()
