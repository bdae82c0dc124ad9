# llmpar: `make train_gpt` (CUDA), `make train_gpt_cpu` (CPU), `make test`.
#
# The CPU build compiles the same train_gpt.cu as C with mpicc. The CUDA build uses MPI when mpicc is
# found (multi-rank runs) and builds a single-rank binary without it.

NVCC ?= nvcc
MPICC ?= mpicc
CUDA_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
CFLAGS_CPU = -x c -std=gnu11 -O3 -march=native -fopenmp -DLLMPAR_CPU -Wall -Wextra -Werror
NVCC_FLAGS = -O3 -std=c++17 $(CUDA_ARCH) -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror,-fopenmp
NVCC_LIBS = -lcublasLt -lcublas

# NCCL for the CUDA build's collectives when its header is found (with MPI, which carries its ids)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(shell command -v $(NVCC) 2>/dev/null))
NCCL_H := $(wildcard /usr/include/nccl.h $(CUDA_HOME)/include/nccl.h)

# MPI when mpicc exists: the CPU build compiles with it, the CUDA build takes its include and link flags.
# Without it both builds are single-rank and say so when asked for more ranks.
MPI_LIBS := $(shell $(MPICC) --showme:link 2>/dev/null)
ifneq ($(strip $(MPI_LIBS)),)
  CC_CPU = $(MPICC) -DLLMPAR_MPI
  NVCC_MPI = -DLLMPAR_MPI $(filter -I% -D%,$(shell $(MPICC) --showme:compile)) $(filter -L% -l%,$(MPI_LIBS))
  ifneq ($(NCCL_H),)
    NVCC_MPI += -DLLMPAR_NCCL -lnccl
  endif
else
  CC_CPU = $(CC)
endif

.PHONY: all test clean

all: train_gpt_cpu test_gpt_cpu

train_gpt_cpu: train_gpt.cu llmpar.h
	$(CC_CPU) $(CFLAGS_CPU) train_gpt.cu -o $@ -lm

test_gpt_cpu: test_gpt.cu llmpar.h
	$(CC_CPU) $(CFLAGS_CPU) test_gpt.cu -o $@ -lm

train_gpt: train_gpt.cu llmpar.h
	$(NVCC) $(NVCC_FLAGS) $(NVCC_MPI) train_gpt.cu -o $@ $(NVCC_LIBS)

test_gpt: test_gpt.cu llmpar.h
	$(NVCC) $(NVCC_FLAGS) $(NVCC_MPI) test_gpt.cu -o $@ $(NVCC_LIBS)

# Tiers 1-3 on the CPU build; tier 4 with the CUDA build when a GPU is present. Ends with the totals.
test: train_gpt_cpu test_gpt_cpu
	@bash scripts/run_tests.sh

clean:
	rm -f train_gpt train_gpt_cpu test_gpt test_gpt_cpu
