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

Time of a kernel launch on the GPU (--gpu, H100 SXM by default): the largest of its roofs, each what one
unit would take if it alone were busy (kernel_roofs): HBM (its distinct sectors: every re-read within the
launch is taken to hit L2), L2 (the sectors of its warp requests; both at most the L2's share of a clock
into each SM that runs its blocks), tensor cores (its mma FLOPs at the rate mma.sync reaches), issue (its
warp instructions at 4 per clock per SM), latency (each warp at one instruction every WARP_CPI clocks, the
blocks in rounds of as many as fit an SM: occupancy from threads, shared memory and the registers of
nvcc's own report, --ptxas), shared memory (its wavefronts at one per clock per SM) and the SFU (its
special functions at 16 lanes per clock per SM); the SMs' own units on the SM given the most blocks. The
instructions are those nvcc's machine code executes (--sass: dev/cudaemu/sass.py weighs each basic block
by how often the emulator's counts say it ran), arithmetic and addresses included; without --sass, only
those the emulator counts. The units work side by side, on different warps, so the busiest sets the pace;
the calibration (dev/docs/figures.md) says how far measured kernels are from it. Matmuls move each matrix
once and run at GEMM_EFFICIENCY of dense bf16 peak; host copies go at PCIE; an NCCL call LATENCY plus the
larger of the bytes it sends and receives (a ring's) over --link. Launch latency and caches are not
modelled (but for check --dirty-l2: the written lines a benchmark's L2 flush leaves behind).

The step is modelled twice: serial (the sum of every launch's time) and replayed: each stream's work in
its order, a stream's wait for an event after that event's record, work the host queued after one of its
waits after what it waited for, kernels and copies one at a time on the GPU, NCCL calls one at a time on
the link and host copies on PCIe, each started as early as that allows. The replayed step is what
overlapping communication with compute buys (--overlap prints it); CPU time on the host is not modelled.
--accum K adds a step of K micro-batches on one GPU (gradient accumulation): the optimizer's launches
once, everything else K times.
"""
import argparse
import math
import re
import sys
from collections import defaultdict

# The GPUs modelled. clock: the SM clock the dense bf16 peak is quoted at (H100 SXM: 989.4 TFLOP/s =
# 132 SMs x 4096 FLOP/clock at 1.83 GHz; A100 SXM: 312 = 108 x 2048 at 1.41 GHz). mma: the fraction of
# that peak mma.sync (a kernel's own tensor-core products) can reach: on an H100 about two thirds, the
# rest needs Hopper's wgmma (the FlashAttention-3 post, pytorch.org/blog/flashattention-3, 2024-07-11,
# note 1, citing Luo et al., arXiv 2402.13499); on an A100 all of it. l2: the L2's bandwidth in bytes a
# clock (A100 whitepaper: 5120; NVIDIA gives none for the H100: taken as the A100's 47.4 a clock per SM).
# The H200 is an H100 with HBM3e at 4.8 TB/s (NVIDIA's H200 datasheet), here for the kernels timed on one.
# l2size: the L2's bytes as cudaDeviceProp.l2CacheSize gives them (50 MiB on the H100 and H200, 40 on the A100),
# for --dirty-l2.
# Per SM: 65536 registers, at most 2048 threads and 32 blocks, shared memory for blocks (each also takes
# 1 KiB the system reserves), and per clock 4 warp instructions issued (a scheduler each), one
# shared-memory wavefront of 128 bytes (32 banks of 4 bytes), 16 special-function lanes (the same post,
# note 2, for the H100; the CUDA C Programming Guide's throughput table for 8.0 and 9.0).
GPUS = {
    "H100": dict(name="H100 SXM", sms=132, clock=1.83e9, hbm=3.35e12, l2=5120 * 132 / 108, peak=989.4e12, mma=2 / 3,
                 smem=228 * 1024, l2size=50 << 20),
    "H200": dict(name="H200 SXM", sms=132, clock=1.83e9, hbm=4.8e12, l2=5120 * 132 / 108, peak=989.4e12, mma=2 / 3,
                 smem=228 * 1024, l2size=50 << 20),
    "A100": dict(name="A100 SXM 80GB", sms=108, clock=1.41e9, hbm=2.039e12, l2=5120, peak=312e12, mma=1.0, smem=164 * 1024,
                 l2size=40 << 20),
}
GPU = GPUS["H100"]      # --gpu sets it
DIRTY_L2 = False        # check --dirty-l2 sets it
REGISTERS, THREADS, BLOCKS, RESERVED = 65536, 2048, 32, 1024
ISSUE, WAVEFRONTS, SFU_LANES = 4, 1, 16  # per SM per clock
# Cycles a warp waits, on average, between two of its instructions when nothing else delays it (its
# dependences on loads, shared memory, mma and arithmetic): a scheduler with w resident warps issues at most
# w / WARP_CPI instructions a clock. Nsight Compute's "warp cycles per issued instruction" of our kernels
# that few warps run (dev/gpu_results.md, 2026-11-26: H200, 2-8 warps a scheduler) is 8.6-13.6.
WARP_CPI = 12
GEMM_EFFICIENCY = 0.70  # the fraction of the peak a cuBLASLt matmul is taken to reach
PCIE = 50e9             # host copies over PCIe 5.0 x16, bytes/s (64 GB/s a direction nominal)
LATENCY = 20e-6         # per NCCL call, s (as --plan assumes)
# A record's counts, as CUDAEMU_PROFILE writes them (dev/cudaemu/README.md); kernels have them all, the rest
# the first five. EXTENSIVE: the counts that grow with the work (scaled by --scale; not threads or shmem).
COUNTS = ["read", "written", "distinct_read", "distinct_written", "flops", "blocks", "threads", "shmem", "global_loads",
          "global_stores", "shared_loads", "shared_stores", "waves_ld", "waves_st", "waves_ideal", "shuffles", "syncs",
          "tensor", "sfu"]
C = {name: i for i, name in enumerate(COUNTS)}
EXTENSIVE = [i for i, name in enumerate(COUNTS) if name not in ("threads", "shmem")]


def counts(nums):
    """A record's COUNTS from its numeric fields (stream and host epoch, fields 5 and 6, left out); records
    other than kernels have the first five."""
    v = [float(x) for x in nums[:5] + nums[7:]]
    return v + [0.0] * (len(COUNTS) - len(v))


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
                lines.append(("op", kind, name, counts(nums), int(nums[5]), int(nums[6])))
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


EMU_SMS, LN_SM_THREADS = 132, 1024  # the emulator's SMs; llmpar.h's LP_LN_SM_THREADS


def ln_blocks(threads):
    """Where a LayerNorm kernel's grid stops growing with the rows (llmpar.h's lp_ln_blocks): enough blocks
    of `threads` to give each of the emulator's SMs LN_SM_THREADS."""
    return EMU_SMS * (LN_SM_THREADS // int(threads))


def extrapolate(r1, r2, b1, b2, b):
    """Each launch's name and counts at B=b, by key. A launch at one size only (the embedding backward
    under ZeRO-2/3 runs once per piece of wte that has tokens in the batch, and copies its index up)
    counts 0 at the other; any other difference stops the model. The LayerNorm kernels' grid grows with
    B up to ln_blocks blocks, and the sums of their partials (lp_sum_partials_kernel, a row per block) grow
    with it: their blocks, and those sums' counts, stop where the grid does."""
    k1, k2 = (keyed([x for x in r if x[0] != "wait"]) for r in (r1, r2))
    odd = [k for k in set(k1) ^ set(k2) if "embedding_backward" not in k[1] and "HtoD" not in k[1]]
    if odd:
        sys.exit("the two batch sizes launch different work: " + str(sorted(odd)[:5]))
    at = lambda x1, x2, b: x1 + (x2 - x1) * (b - b1) / (b2 - b1)
    ln = [(k1[k][1][C["blocks"]], k2[k][1][C["blocks"]], ln_blocks(k2[k][1][C["threads"]])) for k in k1
          if "layernorm" in k[1] and k in k2]
    grows = [(x, y, cap) for x, y, cap in ln if y > x]
    capped = min([b] + [b1 + (cap - x) * (b2 - b1) / (y - x) for x, y, cap in grows])  # the B where the grid stops
    out = {}
    for key in k1.keys() | k2.keys():
        n1, v1 = k1.get(key, (None, [0.0] * len(COUNTS)))
        n2, v2 = k2.get(key, (None, [0.0] * len(COUNTS)))
        n1, n2 = n1 or n2, n2 or n1
        p1, p2 = re.split(r"(\d+)", n1), re.split(r"(\d+)", n2)
        name = "".join(str(round(at(int(x), int(y), b))) if i % 2 else x for i, (x, y) in enumerate(zip(p1, p2)))
        v = [max(0.0, at(x, y, capped if "sum_partials" in key[1] else b)) for x, y in zip(v1, v2)]
        for i in (C["threads"], C["shmem"]):  # a block's shape, not its work: as counted (a launch at one size has it once)
            v[i] = max(v1[i], v2[i])
        if "layernorm" in key[1]:
            v[C["blocks"]] = min(v[C["blocks"]], max(ln_blocks(v[C["threads"]]), v2[C["blocks"]]))
        out[key] = (name, v)
    return out


def at_depth(la, lb, f):
    """The launches at a depth a fraction f of the way from the first counted depth to the second (f = (L -
    LA) / (LB - LA)), each with a weight. A kind of launch made as often at both depths spans the layers
    (AdamW over a flat buffer) or does not depend on them: each one's counts are extrapolated linearly in
    depth (weight 1). A kind made more often at the second depth is made per layer, each layer's the same:
    its launches' times are extrapolated, those of the first depth weighted 1 - f and of the second f.
    Each launch is then modelled on its own counts, which the busiest SM and rounds of blocks make nonlinear in them."""
    out = {}
    for kind in {k[:2] for k in la} | {k[:2] for k in lb}:
        ka, kb = [k for k in la if k[:2] == kind], [k for k in lb if k[:2] == kind]
        if len(ka) == len(kb):
            for k in kb:
                out[k] = (lb[k][0], [max(0.0, x + (y - x) * f) for x, y in zip(la[k][1], lb[k][1])], 1.0)
        else:
            out.update({k + ("first depth",): (la[k][0], la[k][1], 1.0 - f) for k in ka})
            out.update({k: (lb[k][0], lb[k][1], f) for k in kb})
    return out


def read_ptxas(path):
    """Registers and static shared bytes per kernel, from nvcc -Xptxas -v's report (the kernels' names
    demangled to their identifiers and integer template arguments, as the emulator names them)."""
    out, name = {}, None
    with open(path) as f:
        for line in f:
            m = re.search(r"Compiling entry function '_Z(\d+)(\w+)'", line)
            if m:
                name, rest = m.group(2)[:int(m.group(1))], m.group(2)[int(m.group(1)):]
                args = re.match(r"I((?:Li\d+E)+)E", rest)  # a template's integer arguments: lp_kernel<64>
                name += "<" + ",".join(re.findall(r"Li(\d+)E", args.group(1))) + ">" if args else ""
                continue
            m = re.search(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?", line)
            if m and name:
                regs, smem = out.get(name, (0, 0))
                out[name] = (max(regs, int(m.group(1))), max(smem, int(m.group(2) or 0)))
                name = None
    return out


PTXAS = {}  # --ptxas: kernel identifier -> (registers per thread, static shared bytes)
EXECUTED = {}  # --sass: kernel -> SASS instructions it executes per instruction the emulator counts


def inst_counted(v):
    """The warp instructions the emulator counts (memory, shuffles, barriers, mma, special functions)."""
    return sum(v[C[k]] for k in ("global_loads", "global_stores", "shared_loads", "shared_stores", "shuffles", "syncs", "tensor", "sfu"))


def read_executed(sass_listing, files):
    """EXECUTED from nvdisasm -gi's listing and counts files with site lines (dev/cudaemu/sass.py): per kernel,
    its SASS weighted by how often each block ran, over the instructions the emulator counted."""
    import sass  # numpy, only for --sass
    warps, counted, out = defaultdict(float), defaultdict(float), {}
    for path in files:
        with open(path) as f:
            for line in f:
                if line.startswith("kernel\t"):
                    _, name, *nums = line.rstrip("\n").split("\t")
                    v = counts(nums)
                    warps[name] += v[C["blocks"]] * -(-int(v[C["threads"]]) // 32)
                    counted[name] += inst_counted(v)
    sites = defaultdict(dict)
    for path in files:
        for kernel, per in sass.read_sites(path).items():
            for key, (n, w) in per.items():
                n0, w0 = sites[kernel].get(key, (0.0, 0))
                sites[kernel][key] = (n0 + n, max(w0, w))
    kernels = sass.read_sass(sass_listing)
    for name in warps:
        if name in kernels and name in sites and counted[name]:
            spans, n, _, _ = sass.solve(kernels[name], sites[name], warps[name])
            out[name] = sum(c * (e - s) for (s, e), c in zip(spans, n)) / counted[name]
    return out


def occupancy(threads, shmem, regs):
    """Blocks of one launch resident on an SM at once, and what limits them (registers are allocated per
    warp in steps of 256)."""
    warps = -(-int(threads) // 32)
    limits = {"threads": THREADS // (32 * warps), "blocks": BLOCKS, "shared memory": GPU["smem"] // (int(shmem) + RESERVED)}
    if regs:
        limits["registers"] = REGISTERS // (warps * (-(-regs * 32 // 256) * 256))
    limit = min(limits, key=limits.get)
    return limits[limit], limit


def kernel_roofs(name, v):
    """One kernel launch on the GPU: its roofs (seconds each unit would take alone), the occupancy, and its
    time, the largest roof. Blocks are spread evenly over the SMs, so the SMs' own units (tensor, issue,
    shared, SFU) wait for the SM given the most (ceil(blocks / SMs)); HBM and L2 serve whichever SMs run.
    Latency: a warp issues at most one instruction every WARP_CPI clocks, so a block takes as long as its
    warps' instructions times WARP_CPI, and that SM runs its blocks in rounds of as many as fit at once.
    With DIRTY_L2 the launch starts with the L2 full of another's written lines (a benchmark's flush by a
    memset of the L2's size): each line the launch brings in takes the place of one, which the L2 (write-back)
    must first write to HBM, so HBM also carries the smaller of the L2's size and the launch's distinct bytes."""
    kernel = re.match(r"\w+(<[\d,]*>)?", name).group(0)
    regs, static = PTXAS.get(kernel, (0, 0))
    sm_clocks = GPU["sms"] * GPU["clock"]
    blocks, threads = v[C["blocks"]], v[C["threads"]]
    inst = inst_counted(v) * EXECUTED.get(kernel, 1.0)
    active = min(GPU["sms"], blocks) if blocks else GPU["sms"]
    l2 = GPU["l2"] * GPU["clock"] * active / GPU["sms"]  # blocks on few SMs reach only their share of it
    busiest = math.ceil(blocks / GPU["sms"]) if blocks else 0
    spread = busiest / (blocks / GPU["sms"]) if blocks else 1.0
    distinct = v[C["distinct_read"]] + v[C["distinct_written"]]
    roofs = {"HBM": (distinct + (min(GPU["l2size"], distinct) if DIRTY_L2 else 0)) / min(GPU["hbm"], l2),
             "L2": (v[C["read"]] + v[C["written"]]) / l2, "tensor": spread * v[C["flops"]] / (GPU["mma"] * GPU["peak"]),
             "issue": spread * inst / (ISSUE * sm_clocks),
             "shared": spread * (v[C["waves_ld"]] + v[C["waves_st"]]) / (WAVEFRONTS * sm_clocks),
             "SFU": spread * v[C["sfu"]] * 32 / (SFU_LANES * sm_clocks), "latency": 0.0}
    r = dict(roofs=roofs, regs=regs, static=static, per_sm=0, limit="", rounds=0, inst=inst)
    if threads:
        r["per_sm"], r["limit"] = occupancy(threads, v[C["shmem"]] + static, regs)
        if r["per_sm"] == 0:
            sys.exit(f"{name}: a block of {threads:.0f} threads, {v[C['shmem']] + static:.0f} bytes of shared memory and "
                     f"{regs} registers per thread does not fit an SM of the {GPU['name']}")
        r["rounds"] = math.ceil(busiest / r["per_sm"])
        roofs["latency"] = r["rounds"] * inst / (blocks * -(-int(threads) // 32)) * WARP_CPI / GPU["clock"]
    r["bound"] = max(roofs, key=roofs.get)
    r["t"] = roofs[r["bound"]]
    return r


def launch_seconds(kind, name, v, link):
    """One launch's modelled time from its counts (COUNTS)."""
    rd, wr = v[0], v[1]
    if kind == "pcie":
        return (rd + wr) / PCIE
    if kind == "nccl":  # bytes sent, received over a ring
        return LATENCY + max(rd, wr) / link
    if kind == "gemm":
        return max((rd + wr) / GPU["hbm"], v[4] / (GEMM_EFFICIENCY * GPU["peak"]))
    if kind == "kernel":
        return kernel_roofs(name, v)["t"]
    return (rd + wr) / GPU["hbm"]  # memsets and device copies


def model(launches, link):
    """Each name's launches summed (launches: key -> (name, counts) or (name, counts, weight)): count,
    bytes, FLOPs, time, and the roof that binds the most of its time."""
    out = {}
    for key, (name, v, *weight) in launches.items():
        kind, w = key[0], weight[0] if weight else 1.0
        r = out.setdefault(name, dict(kind=kind, n=0.0, bytes=0.0, distinct=0.0, flops=0.0, t=0.0, bounds=defaultdict(float)))
        t = w * launch_seconds(kind, name, v, link)
        r["n"] += w
        r["bytes"] += w * (v[0] + v[1])
        r["distinct"] += w * (v[2] + v[3])
        r["flops"] += w * v[4]
        r["t"] += t
        bound = (kernel_roofs(name, v)["bound"] if kind == "kernel" else "tensor" if kind == "gemm" and
                 v[4] / (GEMM_EFFICIENCY * GPU["peak"]) > (v[0] + v[1]) / GPU["hbm"] else
                 {"pcie": "PCIe", "nccl": "link"}.get(kind, "HBM"))
        r["bounds"][bound] += t
    for r in out.values():
        r["bound"] = max(r.pop("bounds").items(), key=lambda x: x[1])[0]
        r["n"] = round(r["n"])
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
        dur[i] = 0.0 if key[0] == "wait" else launch_seconds(key[0], *launches[key], link)
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


def set_gpu(gpu, ptxas, sass=None, files=()):
    global GPU
    GPU = GPUS[gpu]
    PTXAS.clear()
    EXECUTED.clear()
    if ptxas:
        PTXAS.update(read_ptxas(ptxas))
    if sass:
        EXECUTED.update(read_executed(sass, files))


def check(argv):
    """roofline.py check FILE: every kernel and matmul line of a counts file (all of them, not a step), each
    name's launches modelled one by one and summed, with every roof, on each --gpu; --scale 'REGEX=K'
    multiplies the work of the launches whose names match (counted at a small shape, modelled at one K
    times larger: as many more blocks, bytes and instructions, the same block). Ends with the ratio of the
    shared-memory test kernels' times (dev/cudaemu/model_check.cu), on the first GPU."""
    ap = argparse.ArgumentParser(prog="roofline.py check", description=check.__doc__)
    ap.add_argument("file")
    ap.add_argument("--gpu", nargs="+", choices=sorted(GPUS), default=["H100"])
    ap.add_argument("--ptxas", nargs="*", default=[], help="nvcc -Xptxas -v's report for each --gpu's architecture")
    ap.add_argument("--sass", nargs="*", default=[], help="nvdisasm -gi's listing of the same build, for each --gpu")
    ap.add_argument("--scale", action="append", default=[], metavar="REGEX=K")
    ap.add_argument("--measured", help="launches timed on GPUs: lines 'GPU<TAB>launch<TAB>us per launch<TAB>source'")
    ap.add_argument("--dirty-l2", action="store_true", help="each launch timed after a memset of the L2's size "
                    "(llm.c's benchmark_kernel): the L2's dirty lines are written back as the launch evicts them")
    a = ap.parse_args(argv)
    global DIRTY_L2
    DIRTY_L2 = a.dirty_l2
    measured = defaultdict(dict)
    if a.measured:
        with open(a.measured) as f:
            for line in f:
                if line.strip() and not line.startswith("#"):
                    gpu, name, us, *_ = line.rstrip("\n").split("\t")
                    measured[gpu][name] = float(us)
    launches = []
    with open(a.file) as f:
        for line in f:
            if line.startswith("#"):
                continue
            kind, name, *nums = line.rstrip("\n").split("\t")
            if kind not in ("kernel", "gemm"):
                continue
            v = counts(nums)
            k = next((float(x.rpartition("=")[2]) for x in a.scale if re.search(x.rpartition("=")[0], name)), 1.0)
            launches.append((kind, name, [x * k if i in EXTENSIVE else x for i, x in enumerate(v)]))
    ratio = None
    for gpu, ptxas, listing in zip(a.gpu, a.ptxas + [None] * len(a.gpu), a.sass + [None] * len(a.gpu)):
        set_gpu(gpu, ptxas, listing, [a.file])
        rows = {}
        for kind, name, v in launches:
            r = kernel_roofs(name, v) if kind == "kernel" else None
            row = rows.setdefault(name, dict(n=0, t=0.0, roofs=defaultdict(float), r=r, v=v))
            row["n"] += 1
            row["t"] += r["t"] if r else launch_seconds(kind, name, v, 0)
            for roof, x in (r["roofs"].items() if r else ()):
                row["roofs"][roof] += x
        print(f"MODELLED on the {GPU['name']} ({GPU['sms']} SMs at {GPU['clock'] / 1e9:.2f} GHz) from the CUDA emulator's counts: "
              f"each roof is what one unit would take alone, the largest binds; instructions "
              + ("executed (nvcc's SASS, each block as often as the counts say)" if EXECUTED else "counted by the emulator alone")
              + f"; latency at one instruction per warp every {WARP_CPI} clocks")
        print()
        roofs = ["HBM", "L2", "tensor", "issue", "latency", "shared", "SFU"]
        mine = measured.get(gpu, {})
        print("| launch | launches | blocks | threads | regs | smem KiB | blocks/SM (limit) | rounds | M instructions | " +
              " | ".join(f"{x} us" for x in roofs) + " | bound | MODELLED us |" + (" measured us | measured / modelled |" if mine else ""))
        print("|" + "---|" * (12 + len(roofs) + 2 * bool(mine)))
        for name, row in rows.items():
            r, v = row["r"], row["v"]
            if r:
                cells = [f"{v[C['blocks']]:.0f}", f"{v[C['threads']]:.0f}", str(r["regs"] or "?"),
                         f"{(v[C['shmem']] + r['static']) / 1024:.1f}", f"{r['per_sm']} ({r['limit']})", str(r["rounds"]),
                         f"{r['inst'] / 1e6:.1f}"] + [f"{row['roofs'][x] * 1e6:.1f}" for x in roofs] + [
                         max(row["roofs"], key=row["roofs"].get)]
            else:
                cells = [""] * (7 + len(roofs)) + ["cuBLASLt"]
            tail = ""
            if mine:
                us = mine.get(name)
                tail = f" {us:,.0f} | {us / (row['t'] * 1e6 / row['n']):.2f} |" if us else " | |"
            print(f"| {name} | {row['n']} | " + " | ".join(cells) + f" | {row['t'] * 1e6:.1f} |" + tail)
        print()
        free, conflicted = rows.get("shared_conflict_free"), rows.get("shared_conflict_32way")
        if free and conflicted and ratio is None:
            ratio = conflicted["t"] / free["t"]
    if ratio is not None:
        print(f"conflicted/conflict-free shared-memory time: {ratio:.1f}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "check":
        return check(sys.argv[2:])
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
    ap.add_argument("--gpu", choices=sorted(GPUS), default="H100")
    ap.add_argument("--ptxas", help="nvcc -Xptxas -v's report for the GPU's architecture (registers per thread)")
    ap.add_argument("--sass", help="nvdisasm -gi's listing of the same build (the instructions each kernel executes)")
    a = ap.parse_args()
    set_gpu(a.gpu, a.ptxas, a.sass, [f for run in a.run for f in run[1:]])
    b1, b2 = a.measured
    runs, frees, replays = [], {}, {}
    for label, *files in a.run:
        if len(files) != (4 if a.layers else 2):
            sys.exit(f"--run {label}: {len(files)} files, {4 if a.layers else 2} expected")
        counted = []  # per depth counted: the launches at --batch, cudaFree counts, replays per link
        for f1, f2 in zip(files[::2], files[1::2]):
            l1, l2 = step_lines(f1), step_lines(f2)
            r1, r2 = step_records(l1), step_records(l2)
            launches = extrapolate(r1, r2, b1, b2, a.batch)
            counted.append((launches, (waits(r1), waits(r2)),
                            [(link, sum(launch_seconds(k[0], name, v, link * 1e9) for k, (name, v) in launches.items()),
                              *replay(l2, launches, link * 1e9)) for link in a.link]))
        launches, frees[label], replays[label] = counted[0]
        if a.layers:  # the replays in depth are the one linear extrapolation of times (rounds of blocks make them approximate)
            (la, lb), depth, (lb_launches, _, rb) = a.layers, a.model[0], counted[1]
            f = (depth - la) / (lb - la)
            launches = at_depth(launches, lb_launches, f)
            replays[label] = [(ra[0], *(x + (y - x) * f for x, y in zip(ra[1:], rb_[1:]))) for ra, rb_ in zip(replays[label], rb)]
        m = model(launches, a.link[0] * 1e9)
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
    print(f"MODELLED on the {GPU['name']}: kernels at the largest of their roofs (HBM {GPU['hbm'] / 1e12:.2f} TB/s, mma.sync at "
          f"{GPU['mma']:.0%} of {GPU['peak'] / 1e12:.0f} TFLOP/s dense bf16, issue, latency ({WARP_CPI} clocks a warp instruction), "
          f"shared-memory wavefronts, SFU; {GPU['sms']} SMs at {GPU['clock'] / 1e9:.2f} GHz; instructions "
          f"{'executed, from nvcc' + chr(39) + 's SASS' if EXECUTED else 'as the emulator counts them (no --sass)'}), matmuls at {GEMM_EFFICIENCY:.0%} of the peak, host "
          f"copies at {PCIE / 1e9:.0f} GB/s, NCCL calls {LATENCY * 1e6:.0f} us plus their ring's bytes at {a.link[0]:.0f} GB/s; "
          f"no caches or launch latency; the step serial, and replayed with its streams overlapped")
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
        part = lambda kinds: sum(r["t"] for r in m.values() if r["kind"] in kinds) * 1e3
        launches = sum(r["n"] for r in m.values() if r["kind"] in ("kernel", "gemm"))
        step = replays[label][0][2]
        print(f"MODELLED {label}: step {t * 1e3:.1f} ms serial (matmuls {part(['gemm']):.1f}, other kernels {part(['kernel']):.1f}, "
              f"memsets and device copies {part(['copy']):.1f}, host copies {part(['pcie']):.2f}, NCCL {part(['nccl']):.2f}), "
              f"{step * 1e3:.1f} ms replayed; {tokens / t:,.0f} tok/s; "
              f"MFU {100 * flops_per_token * tokens / t / GPU['peak']:.1f}%; {launches} kernel and matmul launches per step; "
              f"cudaFree (a wait for the whole device, not timed) {frees[label][0]} times in the counted step at B={b1}, "
              f"{frees[label][1]} at B={b2}")
        if a.accum > 1:  # the optimizer's class once per step, everything else once per micro-batch
            once = sum(r["t"] for n, r in m.items() if kernel_class(n) == OPTIMIZER)
            k = a.accum * (t - once) + once
            print(f"MODELLED {label} with {a.accum} micro-batches per step (gradient accumulation; AdamW and the gradient "
                  f"norm, {once * 1e3:.1f} ms, once): step {k * 1e3:.1f} ms, {a.accum * tokens / k:,.0f} tok/s, "
                  f"MFU {100 * flops_per_token * a.accum * tokens / k / GPU['peak']:.1f}%")


if __name__ == "__main__":
    main()
