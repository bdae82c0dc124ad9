#!/bin/bash
# Prints the path of an nvdisasm, the CUDA toolkit's SASS disassembler (dev/cudaemu/sass.py reads its
# listings): the one on PATH or beside nvcc, or else PyPI's (the nvidia-cuda-nvdisasm wheel, fetched once
# into out/tools). Prints nothing and fails when there is none to be had.
#     nvdisasm=$(bash dev/cudaemu/nvdisasm.sh) && "$nvdisasm" -gi -c FILE.cubin > FILE.sass
cd "$(dirname "$0")/../.."
found=$(command -v nvdisasm || ls "$(dirname "$(command -v nvcc 2>/dev/null || echo /nonexistent)")/nvdisasm" 2>/dev/null ||
        ls out/tools/nvidia/*/bin/nvdisasm 2>/dev/null | head -n 1)
if [ -z "$found" ] && python3 -m pip download -q --no-deps -d out/tools nvidia-cuda-nvdisasm >&2; then
    python3 -c "import glob, zipfile; zipfile.ZipFile(sorted(glob.glob('out/tools/nvidia_cuda_nvdisasm-*.whl'))[-1]).extractall('out/tools')"
    found=$(ls out/tools/nvidia/*/bin/nvdisasm 2>/dev/null | head -n 1)
    [ -n "$found" ] && chmod +x "$found"
fi
[ -n "$found" ] || exit 1
case "$found" in /*) echo "$found" ;; *) echo "$PWD/$found" ;; esac
