# llmpar: `make train_gpt` (CUDA), `make train_gpt_cpu` (CPU), `make train_gpt_emu` (CUDA emulated on the
# CPU; train_gpt_emu_prof also counts each kernel's bytes), `make train_gpt_fp16` (CUDA in fp16), `make test`,
# `make test-emu`.
#
# The CPU build compiles the same train_gpt.cu as C with mpicc, its matmuls through OpenBLAS when
# pkg-config finds it (see BLAS below). The CUDA build uses MPI when mpicc is
# found (multi-rank runs) and builds a single-rank binary without it. The emulated build compiles the
# CUDA sources as host C++ with dev/cudaemu in place of the GPU, cuBLASLt and NCCL (needs only the CUDA
# toolkit's headers, no GPU or driver).

NVCC ?= nvcc
MPICC ?= mpicc
CUDA_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
# No -ffast-math: it lets the compiler assume no NaN or infinity, which would remove the engine's
# non-finite checks (the divergence guard, model files). -fno-math-errno only drops errno from sqrtf and
# co, so loops that call them (AdamW) vectorise.
CFLAGS_CPU = -x c -std=gnu11 -O3 -march=native -fno-math-errno -fopenmp -DLLMPAR_CPU -Wall -Wextra -Werror
NVCC_FLAGS = -O3 -std=c++17 $(CUDA_ARCH) -Werror all-warnings -Xcompiler -Wall,-Wextra,-Wno-missing-field-initializers,-Werror,-fopenmp
NVCC_LIBS = -lcublasLt -lcublas

# NCCL for the CUDA build's collectives when its header is found (with MPI, which carries its ids)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(shell command -v $(NVCC) 2>/dev/null))
NCCL_H := $(wildcard /usr/include/nccl.h $(CUDA_HOME)/include/nccl.h)

EMU_CXX ?= g++
# (-Wno-unknown-pragmas: g++ does not know nvcc's #pragma unroll. -Wno-missing-field-initializers, here and
# in NVCC_FLAGS: C++ compilers warn of the fields a designated initialiser leaves 0 on purpose; C does not)
EMU_FLAGS = -std=c++17 -O2 -Wall -Wextra -Wno-missing-field-initializers -Werror -Wno-unknown-pragmas -fopenmp -pthread -I$(CUDA_HOME)/include
EMU_MPI =

# MPI when mpicc exists: the CPU build compiles with it, the CUDA build takes its include and link flags.
# Without it both builds are single-rank and say so when asked for more ranks.
MPI_LIBS := $(shell $(MPICC) --showme:link 2>/dev/null)
ifneq ($(strip $(MPI_LIBS)),)
  CC_CPU = $(MPICC) -DLLMPAR_MPI
  NVCC_MPI = -DLLMPAR_MPI $(filter -I% -D%,$(shell $(MPICC) --showme:compile)) $(filter -L% -l%,$(MPI_LIBS))
  EMU_MPI = -DLLMPAR_MPI $(filter -I% -D%,$(shell $(MPICC) --showme:compile))
  EMU_LIBS = $(filter -L% -l%,$(MPI_LIBS))
  ifneq ($(NCCL_H),)
    NVCC_MPI += -DLLMPAR_NCCL -lnccl
    EMU_MPI += -DLLMPAR_NCCL
  else
    NCCL_NOTICE = @echo "notice: no nccl.h (libnccl-dev): train_gpt's collectives between GPUs go over MPI"
  endif
else
  CC_CPU = $(CC)
endif

# A BLAS for the CPU build's matmuls, found by pkg-config like MPI by mpicc: OpenBLAS, best its OpenMP
# build (Debian: libopenblas-openmp-dev), whose threads are the engine's OpenMP threads, so the two never
# oversubscribe the cores. Without one the plain loops run (the engine line says which); `make BLAS=none`
# builds with the loops alone.
BLAS ?= openblas
ifneq ($(BLAS),none)
  BLAS_LIBS := $(shell pkg-config --libs $(BLAS) 2>/dev/null)
endif
ifneq ($(strip $(BLAS_LIBS)),)
  BLAS_CFLAGS := -DLLMPAR_BLAS $(shell pkg-config --cflags $(BLAS))
endif

# cuDNN's fused attention (--attention cudnn), as llm.c's USE_CUDNN: `make cudnn-frontend` once (cudnn-frontend's
# C++ headers from PyPI's nvidia-cudnn-frontend into .cudnn-frontend/, ignored by git), then `make USE_CUDNN=1
# train_gpt`. cuDNN 9 itself ships with the CUDA toolkit. Its code is llmpar_cudnn.cpp, a translation unit of its own
# and host code only (graphs built, then executed from the host), so the host compiler builds it: nvcc would parse
# the frontend's heavy C++ once per architecture (4m17s here, against 1m15s for g++ -O2 alone).
USE_CUDNN ?= 0
CUDNN_FRONTEND ?= .cudnn-frontend/include
ifeq ($(USE_CUDNN),1)
  ifeq ($(wildcard $(CUDNN_FRONTEND)/cudnn_frontend.h),)
    $(error USE_CUDNN=1: no cudnn_frontend.h in $(CUDNN_FRONTEND); run make cudnn-frontend first, or set CUDNN_FRONTEND)
  endif
  CUDNN_OBJ = llmpar_cudnn.o
  NVCC_CUDNN = -DLLMPAR_CUDNN $(CUDNN_OBJ) -lcudnn -lnvrtc  # (NVRTC: cudnn-frontend compiles some engines at run time)
endif

llmpar_cudnn.o: llmpar_cudnn.cpp
	$(CXX) -std=c++17 -O2 -Wall -Wextra -Werror -I$(CUDA_HOME)/include -isystem $(CUDNN_FRONTEND) -c $< -o $@  # (-isystem: the frontend's own warnings are not ours)

cudnn-frontend:
	rm -rf .cudnn-frontend && python3 -m pip download -q --no-deps nvidia-cudnn-frontend -d .cudnn-frontend/wheel && \
	    python3 -c "import glob, zipfile; zipfile.ZipFile(glob.glob('.cudnn-frontend/wheel/*.whl')[0]).extractall('.cudnn-frontend')" && \
	    cd .cudnn-frontend && rm -rf wheel cudnn *.dist-info && cd .. && \
	    test -f $(CUDNN_FRONTEND)/cudnn_frontend.h && echo "cudnn-frontend's headers in $(CUDNN_FRONTEND)"

.PHONY: all test test-emu flags-doc readme-flags clean llmc_driver cudnn-frontend

all: train_gpt_cpu test_gpt_cpu plan_gpt

# no function of the engine keeps over 128 KiB on the stack, so it runs on a 512 KiB one (ulimit -s 512, tested)
train_gpt_cpu: train_gpt.cu llmpar.h dev/plan/plan.h
	$(CC_CPU) $(CFLAGS_CPU) -Wframe-larger-than=131072 $(BLAS_CFLAGS) train_gpt.cu -o $@ $(BLAS_LIBS) -lm

test_gpt_cpu: test_gpt.cu llmpar.h dev/plan/plan.h
	$(CC_CPU) $(CFLAGS_CPU) $(BLAS_CFLAGS) test_gpt.cu -o $@ $(BLAS_LIBS) -lm

# The engines with the tests' hooks (LLMPAR_TEST_HOOKS: a crash at the k-th checkpoint file operation or
# offloaded chunk, an injected loss or gradient overflow, small offload chunks, each asked for by an environment
# variable), for the tests that use them; the engines users run have none. One for each build: _cpu_hooks,
# _emu_hooks, _hooks (and train_gpt_fp16_emu_hooks, below).
train_gpt_cpu_hooks: train_gpt.cu llmpar.h dev/plan/plan.h
	$(CC_CPU) $(CFLAGS_CPU) -DLLMPAR_TEST_HOOKS $(BLAS_CFLAGS) train_gpt.cu -o $@ $(BLAS_LIBS) -lm

train_gpt_hooks: train_gpt.cu llmpar.h dev/plan/plan.h $(CUDNN_OBJ)
	$(NVCC) $(NVCC_FLAGS) -DLLMPAR_TEST_HOOKS $(NVCC_MPI) train_gpt.cu $(NVCC_CUDNN) -o $@ $(NVCC_LIBS)

train_gpt_emu_hooks: train_gpt.cu llmpar.h dev/plan/plan.h dev/cudaemu/cudaemu.o
	$(EMU_CXX) $(EMU_FLAGS) -DLLMPAR_TEST_HOOKS $(EMU_MPI) -x c++ -include dev/cudaemu/cudaemu.h train_gpt.cu -x none dev/cudaemu/cudaemu.o -o $@ $(EMU_LIBS)

# The cluster planner (dev/plan): one build, plain C without MPI; it plans GPUs on any machine. For the
# machine's own code (no -march=native) and no contracted multiply-adds, so every machine prints the same
# plans to the last digit (dev/plan/plans.txt, checked by make test).
plan_gpt: dev/plan/plan_gpt.c dev/plan/plan.h llmpar.h
	$(CC) $(filter-out -march=native,$(CFLAGS_CPU)) -ffp-contract=off -Wframe-larger-than=131072 dev/plan/plan_gpt.c -o $@ -lm

train_gpt: train_gpt.cu llmpar.h dev/plan/plan.h $(CUDNN_OBJ)
	$(NCCL_NOTICE)
	$(NVCC) $(NVCC_FLAGS) $(NVCC_MPI) train_gpt.cu $(NVCC_CUDNN) -o $@ $(NVCC_LIBS)

test_gpt: test_gpt.cu llmpar.h dev/plan/plan.h
	$(NVCC) $(NVCC_FLAGS) $(NVCC_MPI) test_gpt.cu -o $@ $(NVCC_LIBS)

dev/cudaemu/cudaemu.o: dev/cudaemu/cudaemu.cpp dev/cudaemu/cudaemu.h
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_MPI) -c $< -o $@

train_gpt_emu: train_gpt.cu llmpar.h dev/plan/plan.h dev/cudaemu/cudaemu.o
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_MPI) -x c++ -include dev/cudaemu/cudaemu.h train_gpt.cu -x none dev/cudaemu/cudaemu.o -o $@ $(EMU_LIBS)

test_gpt_emu: test_gpt.cu llmpar.h dev/plan/plan.h dev/cudaemu/cudaemu.o
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_MPI) -x c++ -include dev/cudaemu/cudaemu.h test_gpt.cu -x none dev/cudaemu/cudaemu.o -o $@ $(EMU_LIBS)

# Counting builds (dev/cudaemu/README.md): GCC's -fsanitize=thread makes every load and store call a hook,
# which cudaemu.o defines; compiled, then linked without it, so libtsan is not linked in. The emulator's
# tests are one, to check the counts. DWARF 4: binutils 2.40's addr2line names the wrong file for some
# inlined lines of GCC 12's DWARF 5 (the including .cu for a line of llmpar.h), and the counts per line
# need the right one. No NVTX: its header's atomics would call libtsan's hooks, which cudaemu.o does not define.
EMU_COUNT = -fsanitize=thread --param=tsan-instrument-func-entry-exit=0 -g1 -gdwarf-4 -DLLMPAR_NO_NVTX
train_gpt_emu_prof: train_gpt.cu llmpar.h dev/plan/plan.h dev/cudaemu/cudaemu.o
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_COUNT) $(EMU_MPI) -x c++ -include dev/cudaemu/cudaemu.h -c $< -o $@.o
	$(EMU_CXX) $(EMU_FLAGS) $@.o dev/cudaemu/cudaemu.o -o $@ $(EMU_LIBS) && rm -f $@.o

# The fp16 engine (llm.c's PRECISION=FP16): the same sources with LLMPAR_FP16, so floatX is fp16 (weights,
# gradients and activations; fp32 master weights and AdamW state) and --loss-scale is on by default, for GPUs
# and recipes without bf16. A build of its own, with binaries of their own, so make never takes one build's
# binary for the other's (llm.c's one name for both rebuilds nothing when only PRECISION changes). No cuDNN
# attention (llmpar_cudnn.cpp is bf16's). _emu runs it under the emulator, _emu_hooks with the tests' hooks.
FP16 = -DLLMPAR_FP16
train_gpt_fp16: train_gpt.cu llmpar.h
	$(NVCC) $(NVCC_FLAGS) $(FP16) $(NVCC_MPI) train_gpt.cu -o $@ $(NVCC_LIBS)

test_gpt_fp16: test_gpt.cu llmpar.h dev/plan/plan.h
	$(NVCC) $(NVCC_FLAGS) $(FP16) $(NVCC_MPI) test_gpt.cu -o $@ $(NVCC_LIBS)

train_gpt_fp16_emu: train_gpt.cu llmpar.h dev/cudaemu/cudaemu.o
	$(EMU_CXX) $(EMU_FLAGS) $(FP16) $(EMU_MPI) -x c++ -include dev/cudaemu/cudaemu.h train_gpt.cu -x none dev/cudaemu/cudaemu.o -o $@ $(EMU_LIBS)

train_gpt_fp16_emu_hooks: train_gpt.cu llmpar.h dev/cudaemu/cudaemu.o
	$(EMU_CXX) $(EMU_FLAGS) $(FP16) -DLLMPAR_TEST_HOOKS $(EMU_MPI) -x c++ -include dev/cudaemu/cudaemu.h train_gpt.cu -x none dev/cudaemu/cudaemu.o -o $@ $(EMU_LIBS)

test_gpt_fp16_emu: test_gpt.cu llmpar.h dev/plan/plan.h dev/cudaemu/cudaemu.o
	$(EMU_CXX) $(EMU_FLAGS) $(FP16) $(EMU_MPI) -x c++ -include dev/cudaemu/cudaemu.h test_gpt.cu -x none dev/cudaemu/cudaemu.o -o $@ $(EMU_LIBS)

dev/cudaemu/test_cudaemu: dev/cudaemu/test_cudaemu.cu dev/cudaemu/cudaemu.o
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_COUNT) $(EMU_MPI) -x c++ -include dev/cudaemu/cudaemu.h -c $< -o $@.o
	$(EMU_CXX) $(EMU_FLAGS) $@.o dev/cudaemu/cudaemu.o -o $@ $(EMU_LIBS) && rm -f $@.o

# The launches scripts/bench_gpu.sh emu check models one by one (dev/cudaemu/model_check.cu), counted.
dev/cudaemu/model_check: dev/cudaemu/model_check.cu llmpar.h dev/cudaemu/cudaemu.o
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_COUNT) $(EMU_MPI) -x c++ -include dev/cudaemu/cudaemu.h -c $< -o $@.o
	$(EMU_CXX) $(EMU_FLAGS) $@.o dev/cudaemu/cudaemu.o -o $@ $(EMU_LIBS) && rm -f $@.o

# The library's usage example (llmpar.h's top comment, compiled): one source for every build, like
# train_gpt.cu. _nompi is the CPU build without MPI (what _cpu is where mpicc is missing), for the tests.
EXAMPLE = dev/examples/train_loop.cu
dev/examples/train_loop_cpu: $(EXAMPLE) llmpar.h
	$(CC_CPU) $(CFLAGS_CPU) $(BLAS_CFLAGS) $(EXAMPLE) -o $@ $(BLAS_LIBS) -lm

dev/examples/train_loop_nompi: $(EXAMPLE) llmpar.h
	$(CC) $(CFLAGS_CPU) $(BLAS_CFLAGS) $(EXAMPLE) -o $@ $(BLAS_LIBS) -lm

dev/examples/train_loop: $(EXAMPLE) llmpar.h
	$(NVCC) $(NVCC_FLAGS) $(NVCC_MPI) $(EXAMPLE) -o $@ $(NVCC_LIBS)

dev/examples/train_loop_emu: $(EXAMPLE) llmpar.h dev/cudaemu/cudaemu.o
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_MPI) -x c++ -include dev/cudaemu/cudaemu.h $(EXAMPLE) -x none dev/cudaemu/cudaemu.o -o $@ $(EMU_LIBS)

# The library from two files (dev/examples/two_files_main.cu defines LLMPAR_IMPLEMENTATION, two_files_eval.cu
# includes llmpar.h plain), the same builds; the CPU one with llmpar.h's opt-outs (no watchdog, no re-execution).
TWO_FILES = dev/examples/two_files_main.cu dev/examples/two_files_eval.cu
dev/examples/two_files_cpu: $(TWO_FILES) llmpar.h
	$(CC_CPU) $(CFLAGS_CPU) -DLLMPAR_NO_WATCHDOG -DLLMPAR_NO_REEXEC $(BLAS_CFLAGS) $(TWO_FILES) -o $@ $(BLAS_LIBS) -lm

dev/examples/two_files_nompi: $(TWO_FILES) llmpar.h
	$(CC) $(CFLAGS_CPU) $(BLAS_CFLAGS) $(TWO_FILES) -o $@ $(BLAS_LIBS) -lm

dev/examples/two_files: $(TWO_FILES) llmpar.h
	$(NVCC) $(NVCC_FLAGS) $(NVCC_MPI) $(TWO_FILES) -o $@ $(NVCC_LIBS)

dev/examples/two_files_emu: $(TWO_FILES) llmpar.h dev/cudaemu/cudaemu.o
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_MPI) -x c++ -include dev/cudaemu/cudaemu.h $(TWO_FILES) -x none dev/cudaemu/cudaemu.o -o $@ $(EMU_LIBS)

# dev/cudaemu/calibrate_llmc.sh: one of llm.c's dev/cuda files (LLMC_SRC, its launches rewritten for the
# emulator; LLMC_DEFS names which) with dev/cudaemu/llmc_driver.cu, counted as model_check is.
LLMC_BIN ?= dev/cudaemu/llmc_driver
llmc_driver: dev/cudaemu/llmc_driver.cu dev/cudaemu/cudaemu.o
	$(EMU_CXX) $(EMU_FLAGS) $(EMU_COUNT) $(EMU_MPI) -x c++ -include dev/cudaemu/cudaemu.h $(LLMC_DEFS) -DLLMC_FILE='"$(abspath $(LLMC_SRC))"' -c $< -o $(LLMC_BIN).o
	$(EMU_CXX) $(EMU_FLAGS) $(LLMC_BIN).o dev/cudaemu/cudaemu.o -o $(LLMC_BIN) $(EMU_LIBS) && rm -f $(LLMC_BIN).o

# Tiers 1-3 on the CPU build; tier 4 with the CUDA build on a GPU, or else under the emulator. Ends with
# the totals.
# (run_tests.sh builds what it runs, several binaries side by side, one a core)
test:
	@bash scripts/run_tests.sh

# Tier 4 under the emulator alone (and the emulator's own tests).
test-emu: train_gpt_cpu train_gpt_emu train_gpt_emu_hooks test_gpt_emu dev/cudaemu/test_cudaemu test_gpt_fp16_emu train_gpt_fp16_emu_hooks
	@bash scripts/run_tests.sh emu

# dev/docs/flags.md's flags block is `./train_gpt_cpu -h` verbatim, between its two marker lines: this
# rewrites it (tier 1 fails while they differ). awk fails when the markers are missing. readme-flags: its
# name before the block left the README.
FLAGS_DOC = dev/docs/flags.md
flags-doc readme-flags: train_gpt_cpu
	./train_gpt_cpu -h > $(FLAGS_DOC).help && awk -v help=$(FLAGS_DOC).help \
	    '/^<!-- flags: end/ { skip = 0 } !skip { print } /^<!-- flags: begin/ { print "```text"; \
	     while ((getline line < help) > 0) print line; print "```"; skip = 1; found = 1 } END { exit !found }' \
	    $(FLAGS_DOC) > $(FLAGS_DOC).new && mv $(FLAGS_DOC).new $(FLAGS_DOC); rc=$$?; rm -f $(FLAGS_DOC).help $(FLAGS_DOC).new; exit $$rc

clean:
	rm -f llmpar_cudnn.o plan_gpt train_gpt train_gpt_cpu test_gpt test_gpt_cpu train_gpt_emu train_gpt_emu_prof test_gpt_emu dev/cudaemu/cudaemu.o dev/cudaemu/test_cudaemu dev/cudaemu/model_check
	rm -f train_gpt_hooks train_gpt_cpu_hooks train_gpt_emu_hooks
	rm -f train_gpt_fp16 test_gpt_fp16 train_gpt_fp16_emu train_gpt_fp16_emu_hooks test_gpt_fp16_emu
	rm -f dev/examples/train_loop dev/examples/train_loop_cpu dev/examples/train_loop_nompi dev/examples/train_loop_emu
	rm -f dev/examples/two_files dev/examples/two_files_cpu dev/examples/two_files_nompi dev/examples/two_files_emu
