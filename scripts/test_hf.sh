#!/usr/bin/env bash
# Hugging Face GPT-2 both ways (dev/hf; the Llama 3 family: test_hf.py's check_llama): dev/hf/export.py writes llm.c model files (the reference fixture
# in fp32 and bf16, a depth-2 model made by ./train_gpt_cpu) as Hugging Face directories and import.py
# reads them back; dev/hf/test_hf.py checks what they wrote (logits against dev/ref/gpt2_ref.py, the
# tokenizer files against the shipped shards' tokens, transformers itself when installed); bad input is
# one line naming the file, a non-zero exit and no output left. Needs python3 with numpy and tiktoken,
# else it skips; and ./train_gpt_cpu (make). With an argument, a CUDA engine (./train_gpt_emu, ./train_gpt),
# only check_llama's loss and 30 steps on it, to 1e-2. Prints "N passed, N failed" last.
set -u
cd "$(dirname "$0")/.."
passed=0
failed=0

check() {  # check DESCRIPTION COMMAND...: count the command's success
    if "${@:2}"; then
        passed=$((passed + 1))
    else
        echo "FAIL $1"
        failed=$((failed + 1))
    fi
}

tally() {  # tally COMMAND...: count its "PASS ..." and "FAIL ..." lines (and a crash), show them and its skips
    local log rc
    log=$("$@" 2>&1)
    rc=$?
    passed=$((passed + $(grep -c '^PASS' <<< "$log")))
    failed=$((failed + $(grep -c '^FAIL' <<< "$log")))
    grep -E '^(PASS|FAIL|skip:)' <<< "$log" | sed 's/^PASS/    /'
    if [ "$rc" != 0 ]; then
        echo "FAIL $1 exited $rc: $(tail -n 3 <<< "$log")"
        failed=$((failed + 1))
    fi
}

if ! python3 -c "import numpy, tiktoken" > /dev/null 2>&1; then
    echo "skip: Hugging Face export/import tests (need python3 with numpy and tiktoken: pip install -r dev/data/requirements.txt)"
    echo "0 passed, 0 failed"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ $# -gt 0 ]; then  # bash scripts/test_hf.sh ENGINE: the Llama's checks alone on a CUDA engine (make test: ./train_gpt_emu)
    echo "Hugging Face Llama on $1 (dev/hf/test_hf.py --llama-cuda)"
    tally python3 dev/hf/test_hf.py --llama-cuda "$tmp" "$1"
    echo "$passed passed, $failed failed"
    [ "$failed" = 0 ]
    exit
fi
echo "Hugging Face GPT-2: dev/hf/export.py, dev/hf/import.py"

# a depth-2 GPT-2 as the engine makes it (GPT-2's vocabulary, 1024 positions): its step-0 checkpoint
./train_gpt_cpu -e d2 -x 0 -v 0 -s 0 -o "$tmp/run" > "$tmp/run.log" 2>&1
d2=$tmp/run/step_00000000/model.bin
check "./train_gpt_cpu -e d2 -x 0 -o DIR writes a model ($(tail -n 1 "$tmp/run.log"))" [ -s "$d2" ]

export_ok() {  # export_ok NAME MODEL [--dtype D]: export MODEL to $tmp/NAME
    python3 dev/hf/export.py "$2" --out "$tmp/$1" "${@:3}" > /dev/null 2> "$tmp/err"
    check "export.py $2 ${*:3} exits 0 ($(cat "$tmp/err"))" [ $? = 0 ]
}
export_ok tiny dev/ref/tiny_model.bin
export_ok tiny_bf16 dev/ref/tiny_model.bin --dtype bf16
export_ok tiny_v5 dev/ref/tiny_model_bf16.bin
export_ok d2 "$d2"
export_ok d2_bf16 "$d2" --dtype bf16
check "the bf16 export of tiny_model.bin (rounded from fp32) is byte for byte that of tiny_model_bf16.bin (v5)" \
    cmp -s "$tmp/tiny_bf16/model.safetensors" "$tmp/tiny_v5/model.safetensors"
check "an export holds config.json, model.safetensors, vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json" \
    [ "$(cd "$tmp/d2" && echo *)" = "config.json merges.txt model.safetensors special_tokens_map.json tokenizer_config.json vocab.json" ]
check "merges.txt: a version line and 50000 merges (256 bytes + 50000 merges + <|endoftext|> = 50257 tokens)" \
    [ "$(wc -l < "$tmp/d2/merges.txt")" = 50001 ]

# import(export(model)) is the model, byte for byte (fp32: the padded rows are zero in both)
for name in tiny d2; do
    src=dev/ref/tiny_model.bin
    [ $name = d2 ] && src=$d2
    python3 dev/hf/import.py "$tmp/$name" --out "$tmp/$name.bin" > /dev/null 2> "$tmp/err"
    check "import.py of the export of $src gives it back byte for byte ($(cat "$tmp/err"))" cmp -s "$tmp/$name.bin" "$src"
done
python3 dev/hf/import.py "$tmp/tiny_bf16" --out "$tmp/tiny_bf16.bin" > /dev/null 2>&1

tally python3 dev/hf/test_hf.py "$tmp" "$d2" ./train_gpt_cpu

# bad input: a non-zero exit, one line "TOOL: error: ..." naming the file, and no output left behind
one_error_line() { [ "$(wc -l < "$tmp/err")" = 1 ] && grep -q "^$1: error: " "$tmp/err" && grep -qF -- "$2" "$tmp/err"; }
bad_import() {  # bad_import WHAT MESSAGE DIR: import.py DIR fails with MESSAGE, writing nothing
    python3 dev/hf/import.py "$3" --out "$tmp/bad.bin" > /dev/null 2> "$tmp/err"
    local rc=$?
    check "import.py, $1: non-zero exit (got $rc)" [ "$rc" != 0 ]
    check "import.py, $1: one line naming the problem, '$2' (got: $(cat "$tmp/err"))" one_error_line import.py "$2"
    check "import.py, $1: no bad.bin or bad.bin.tmp left" [ ! -e "$tmp/bad.bin" -a ! -e "$tmp/bad.bin.tmp" ]
}
variant() {  # variant NAME: a copy of the tiny export to spoil
    rm -rf "$tmp/$1"
    cp -r "$tmp/tiny" "$tmp/$1"
}
sed_config() { sed -i "$2" "$tmp/$1/config.json"; }
bad_import "a missing directory" "$tmp/nothing: not a directory" "$tmp/nothing"
variant noconfig && rm "$tmp/noconfig/config.json"
bad_import "no config.json" "noconfig/config.json: No such file" "$tmp/noconfig"
variant mistral && sed_config mistral 's/"model_type": "gpt2"/"model_type": "mistral"/'
bad_import "another model type" "mistral/config.json: model_type 'mistral', not a GPT-2" "$tmp/mistral"
variant bert && sed_config bert 's/"GPT2LMHeadModel"/"BertModel"/'
bad_import "another architecture" "bert/config.json: architectures ['BertModel']" "$tmp/bert"
variant erf && sed_config erf 's/"gelu_new"/"gelu"/'
bad_import "erf GELU" "erf/config.json: activation_function 'gelu'" "$tmp/erf"
variant wide && sed_config wide 's/"n_embd": 32/"n_embd": 64/'
bad_import "shapes that do not match config.json" \
    "wide/model.safetensors: transformer.wte.weight has shape (97, 32), config.json's shape needs (97, 64)" "$tmp/wide"
variant deep && sed_config deep 's/"n_layer": 2/"n_layer": 3/'
bad_import "fewer layers than config.json" "deep/model.safetensors: no transformer.h.2" "$tmp/deep"
variant noweights && rm "$tmp/noweights/model.safetensors"
bad_import "no weights" "noweights/model.safetensors: No such file" "$tmp/noweights"
variant truncated && truncate -s -100 "$tmp/truncated/model.safetensors"
bad_import "a truncated model.safetensors" "truncated/model.safetensors: transformer." "$tmp/truncated"
if ! python3 -c "import torch" > /dev/null 2>&1; then
    variant torchbin && mv "$tmp/torchbin/model.safetensors" "$tmp/torchbin/pytorch_model.bin"
    bad_import "pytorch_model.bin without torch" "torchbin/pytorch_model.bin: reading it needs torch" "$tmp/torchbin"
fi
bad_export() {  # bad_export WHAT MESSAGE MODEL: export.py MODEL fails with MESSAGE, no output directory made
    python3 dev/hf/export.py "$3" --out "$tmp/bad_out" > /dev/null 2> "$tmp/err"
    local rc=$?
    check "export.py, $1: non-zero exit (got $rc)" [ "$rc" != 0 ]
    check "export.py, $1: one line naming the problem, '$2' (got: $(cat "$tmp/err"))" one_error_line export.py "$2"
    check "export.py, $1: no output directory left" [ ! -e "$tmp/bad_out" ]
}
bad_export "a missing file" "$tmp/none.bin: No such file" "$tmp/none.bin"
bad_export "a token shard" "tiny_tokens.bin: not an llm.c model file" dev/ref/tiny_tokens.bin
head -c 5000 dev/ref/tiny_model.bin > "$tmp/short.bin"
bad_export "a truncated model file" "short.bin: 5000 bytes, its header's shape needs" "$tmp/short.bin"
python3 - "$tmp" <<'EOF'
import struct, sys
good = open("dev/ref/tiny_model.bin", "rb").read()
def spoilt(name, index, value, tail=b""):  # tiny_model.bin with header int `index` set to value, tail appended
    open(f"{sys.argv[1]}/{name}", "wb").write(good[:4 * index] + struct.pack("<i", value) + good[4 * index + 4:] + tail)
spoilt("negvocab.bin", 3, -5)
spoilt("hugelayers.bin", 4, 2**31 - 1)
spoilt("long.bin", 0, 20240326, bytes(4))
EOF
bad_export "a negative vocabulary in the header" "negvocab.bin: bad shape in the header (maxT 16 V -5" "$tmp/negvocab.bin"
bad_export "2^31 - 1 layers in the header" "hugelayers.bin: 121344 bytes, its header's shape needs" "$tmp/hugelayers.bin"
bad_export "bytes after the model" "long.bin: 121348 bytes, its header's shape needs 121344" "$tmp/long.bin"

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
