#!/usr/bin/env bash
# dev/cudaemu/calibrate_llmc.sh LLMC_DIR OUTDIR: counts, under the CUDA emulator, llm.c's dev/cuda kernels
# whose times on an H100 or an A100 were published (the table KERNELS below, each with its source), and
# compiles them with nvcc for sm_90 and sm_80; then dev/cudaemu/roofline.py models each launch beside its
# published time (dev/docs/figures.md, "Calibration: published kernel timings against the model").
#
#   git clone https://github.com/karpathy/llm.c /tmp/llm.c     # any checkout with dev/cuda/layernorm_forward.cu
#   bash dev/cudaemu/calibrate_llmc.sh /tmp/llm.c out/calib    # prints the table, also in out/calib/table.md
#
# llm.c's code stays the user's: it is copied into OUTDIR/src, each kernel<<<grid, block[, shmem[, stream]]>>>(args)
# rewritten as cudaemu_launch("kernel", kernel, grid, block, shmem, stream, args) (g++ cannot parse the
# chevrons), each extern __shared__ T name[] as T* name = (T*)cudaemu_dynamic_shared(), and marked a system header (llm.c's code is not held to this project's -Wall -Wextra -Werror).
# dev/cudaemu/llmc_driver.cu includes the copy and launches one version once (make llmc_driver: the flags of
# make dev/cudaemu/model_check, the counting build). OUTDIR gets, per kernel, NAME.tsv (CUDAEMU_PROFILE's
# counts) and NAME.log, and per file FILE.sm_90.cubin, FILE.sm_80.cubin (nvcc -cubin -lineinfo, for reading
# their SASS) with ptxas_sm90.txt and ptxas_sm80.txt (nvcc -Xptxas -v: registers per thread), then the
# table (OUTDIR/table.md) of every kernel's published time, modelled time and ratio. The whole run takes
# ~20 s on 2 cores: rerun it whenever roofline.py changes.
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: $0 LLMC_DIR OUTDIR" >&2
    exit 1
fi
llmc=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"

# The kernels: NAME FILE VERSION BLOCK_SIZE B T C GPU PUBLISHED_US SOURCE. Each runs the file's own dispatch
# at its benchmark's shape (dev/cuda/layernorm_forward.cu: B 8, T 1024, C 768, fp32), timed there by CUDA
# events around one launch after a memset of the L2's size (benchmark_kernel in dev/cuda/common.h), so the
# published time includes the launch's own latency, and the write-back of the memset's dirty lines as the
# kernel evicts them (roofline.py check --dirty-l2). GB/s figures are the benchmark's: 2 B T C 4 bytes
# (50331648) over the time.
KERNELS=(
    # PR 600 (H100, kernels 3 and 5 at their best block sizes, 1191.38 and 1244.5 GB/s): 50331648 / GB/s
    "ln_fwd_k3_b256 layernorm_forward 3 256 8 1024 768 H100 42.25 https://github.com/karpathy/llm.c/pull/600"
    "ln_fwd_k5_b256 layernorm_forward 5 256 8 1024 768 H100 40.44 https://github.com/karpathy/llm.c/pull/600"
    # PR 645 ("before the change": kernel 6 as in llm.c's master, on an A100 80GB from Modal), three block sizes
    "ln_fwd_k6_b32 layernorm_forward 6 32 8 1024 768 A100 46.6 https://github.com/karpathy/llm.c/pull/645"
    "ln_fwd_k6_b256 layernorm_forward 6 256 8 1024 768 A100 42.5 https://github.com/karpathy/llm.c/pull/645"
    "ln_fwd_k6_b1024 layernorm_forward 6 1024 8 1024 768 A100 43.7 https://github.com/karpathy/llm.c/pull/645"
)

# 1. llm.c's sources, rewritten for the emulator
mkdir -p "$out/src"
python3 - "$llmc/dev/cuda" "$out/src" <<'EOF'
import os, re, sys
src, dst = sys.argv[1], sys.argv[2]

def close(s, i, o, c):  # the index after the bracket that closes the one at s[i]
    depth = 0
    while i < len(s):
        depth += (s[i] == o) - (s[i] == c)
        i += 1
        if depth == 0:
            return i
    raise SystemExit(f"unbalanced {o}{c}")

def split_top(s):  # s split at its top-level commas
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += ch in "([{" and 1 or ch in ")]}" and -1 or 0
        if ch == "," and depth == 0:
            parts.append(cur.strip()); cur = ""
        else:
            cur += ch
    return parts + [cur.strip()] if cur.strip() else parts

def rewrite(s):
    out, i = [], 0
    for m in re.finditer(r"<<<", s):
        if m.start() < i:
            continue
        j = m.start()  # the kernel: an identifier, maybe with template arguments, just before <<<
        k = j
        if s[k - 1] == ">":
            depth = 0
            while True:
                k -= 1
                depth += (s[k] == ">") - (s[k] == "<")
                if depth == 0:
                    break
        name_start = re.search(r"[A-Za-z_][\w:]*\s*$", s[:k]).start()
        kernel = s[name_start:j].strip()
        end = s.index(">>>", j)
        cfg = split_top(s[j + 3:end])
        cfg += ["0", "0"][:4 - len(cfg)] if len(cfg) < 4 else []
        p = s.index("(", end)
        q = close(s, p, "(", ")")
        args = s[p + 1:q - 1].strip()
        out.append(s[i:name_start])
        out.append(f'cudaemu_launch("{kernel}", {kernel}, ' + ", ".join(cfg) + (", " + args if args else "") + ")")
        i = q
    return "".join(out) + s[i:]

for f in sorted(os.listdir(src)):
    if f.endswith((".cu", ".h")):
        text = open(os.path.join(src, f)).read()
        # dynamic shared memory, extern __shared__ T name[], is the emulator's per-block buffer
        text = re.sub(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:<>]+(?:\s+[\w:<>]+)*?)\s+(\w+)\s*\[\s*\]\s*;",
                      r"\1* \2 = (\1*)cudaemu_dynamic_shared();", text)
        open(os.path.join(dst, f), "w").write("#pragma GCC system_header\n" + rewrite(text))
EOF

# 2. per file: the counting build of the driver, and nvcc's cubins, their SASS (every instruction the
# kernels execute, dev/cudaemu/sass.py) and register reports for sm_90 and sm_80
nvdisasm=$(bash dev/cudaemu/nvdisasm.sh || true)
[ -n "$nvdisasm" ] || echo "no nvdisasm: the issue and latency roofs count only the instructions the emulator sees" >&2
: > "$out/ptxas_sm90.txt"
: > "$out/ptxas_sm80.txt"
files=$(printf '%s\n' "${KERNELS[@]}" | awk '{print $2}' | sort -u)
for f in $files; do
    defs="-DLLMC_$(echo "$f" | tr a-z A-Z)"
    echo "building dev/cudaemu/llmc_driver for $f.cu (counting build) ..." >&2
    make -s llmc_driver LLMC_SRC="$out/src/$f.cu" LLMC_DEFS="$defs" LLMC_BIN="$out/llmc_$f"
    for arch in 90 80; do
        if command -v nvcc > /dev/null; then
            # llm.c's own flags for these files (their headers' compile lines), device code only
            if nvcc -O3 --use_fast_math -std=c++17 -arch=sm_$arch -cubin -lineinfo -Xptxas -v -I"$llmc/dev/cuda" \
                -o "$out/$f.sm_$arch.cubin" "$llmc/dev/cuda/$f.cu" >> "$out/ptxas_sm$arch.txt" 2>&1; then
                [ -n "$nvdisasm" ] && "$nvdisasm" -gi -c "$out/$f.sm_$arch.cubin" > "$out/$f.sm_$arch.sass"
            else
                echo "nvcc for sm_$arch failed on $f.cu (see $out/ptxas_sm$arch.txt)" >&2
            fi
        fi
    done
done

# 3. each kernel launched once, counted. Not under the hazard check: kernel 5 of layernorm_forward.cu has
# every lane of a warp store the same value to one __shared__ word (benign on a GPU), which it stops at
for k in "${KERNELS[@]}"; do
    read -r name f version block B T C gpu us url <<< "$k"
    echo "counting $name ($f.cu version $version, block size $block, B $B T $T C $C) ..." >&2
    rm -f "$out/$name.tsv"
    CUDAEMU_PROFILE="$out/$name.tsv" "$out/llmc_$f" "$version" "$block" "$B" "$T" "$C" > "$out/$name.log" 2>&1 ||
        { tail -n 5 "$out/$name.log" >&2; exit 1; }
done

# 4. the table: each kernel's launches modelled on its published GPU (registers from that GPU's ptxas report)
{
    echo "| kernel (llm.c dev/cuda) | GPU | shape | published us | source | MODELLED us | bound | published / modelled |"
    echo "|---|---|---|---|---|---|---|---|"
    for k in "${KERNELS[@]}"; do
        read -r name f version block B T C gpu us url <<< "$k"
        arch=90
        [ "$gpu" = A100 ] && arch=80
        sass=()
        [ -s "$out/$f.sm_$arch.sass" ] && sass=(--sass "$out/$f.sm_$arch.sass")
        python3 dev/cudaemu/roofline.py check "$out/$name.tsv" --gpu "$gpu" --ptxas "$out/ptxas_sm$arch.txt" ${sass[@]+"${sass[@]}"} --dirty-l2 \
            > "$out/$name.check.md"
        # the launches' rows: name, ..., bound, modelled us (the last two cells); summed over the launches
        awk -F'|' -v name="$name" -v f="$f" -v v="$version" -v bs="$block" -v gpu="$gpu" -v shape="B $B, T $T, C $C" \
            -v us="$us" -v url="$url" '
            /^\| [A-Za-z_]/ && $2 !~ /launch/ { t += $(NF-1); x = $(NF-2); gsub(/ /, "", x); b = b (b ? ", " : "") x }
            END { printf "| %s.cu version %s, block size %s | %s | %s | %s | %s | %.1f | %s | %.2f |\n",
                  f, v, bs, gpu, shape, us, url, t, b, us / t }' "$out/$name.check.md"
    done
} > "$out/table.md"
cat "$out/table.md"
