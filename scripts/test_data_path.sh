#!/usr/bin/env bash
# The user's data path, end to end: dev/data/prepare.py turns two small texts of our own (non-ASCII
# included) into shards (header, tokens that decode back to the texts, the --val-fraction split, one-line
# errors that leave nothing behind, --force), the command it prints trains ./train_gpt_cpu for two steps,
# dev/plot.py draws that run, the README's own-text block runs as written in a fresh copy of the checkout,
# and tinyshakespeare.py rebuilds the shipped shards byte for byte (when
# ../shared/data holds the text). Needs python3 with tiktoken, else it skips; and ./train_gpt_cpu (make).
# Prints "N passed, N failed" last.
set -u
cd "$(dirname "$0")/.."
root=$PWD
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

tally() {  # tally COMMAND...: count its "PASS ..." and "FAIL ..." lines (and a crash), show the failures
    local log rc
    log=$("$@" 2>&1)
    rc=$?
    passed=$((passed + $(grep -c '^PASS' <<< "$log")))
    failed=$((failed + $(grep -c '^FAIL' <<< "$log")))
    grep '^FAIL' <<< "$log"
    if [ "$rc" != 0 ] && ! grep -q '^FAIL' <<< "$log"; then
        echo "FAIL $1 exited $rc: $(tail -n 3 <<< "$log")"
        failed=$((failed + 1))
    fi
}

if ! python3 -c "import tiktoken" > /dev/null 2>&1; then
    echo "skip: data path tests (needs python3 with tiktoken: pip install -r dev/data/requirements.txt)"
    echo "0 passed, 0 failed"
    exit 0
fi
echo "data path: dev/data/prepare.py, the printed train command, dev/plot.py, the README's own-text block, tinyshakespeare.py"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# two documents: prose with accents, CJK, emoji and a literal "<|endoftext|>" that must stay text
for i in $(seq 60); do
    echo "Line $i: Grüße aus Köln, naïve café — Ünïcödé ✓. The quick brown fox jumps over $i lazy dogs."
    [ $((i % 7)) = 0 ] && printf '\n'
done > "$tmp/one.txt"
for i in $(seq 40); do
    echo "第${i}行: 日本語のテキストと emoji 🙂 and the literal <|endoftext|> as plain text, tab	here."
done > "$tmp/two.txt"

# prepare from inside $tmp, as a user would from their own folder; the printed command runs verbatim
prep() { (cd "$tmp" && python3 "$root/dev/data/prepare.py" "$@"); }
prep one.txt two.txt --out data --name mix --val-fraction 0.25 --shard-tokens 1000 > "$tmp/prep.log" 2> "$tmp/prep.err"
check "prepare.py exits 0 on two UTF-8 files ($(head -c 300 "$tmp/prep.err"))" [ $? = 0 ]

# headers, the decoded text, the split and the shard sizes
tally python3 - "$tmp" <<'EOF'
import array, glob, os, struct, sys
sys.path.insert(0, "dev/data")
import prepare
tmp = sys.argv[1]
enc = prepare.gpt2_encoding()

def check(ok, what):
    print(("PASS " if ok else "FAIL ") + what)

def read(path):
    data = open(path, "rb").read()
    header = struct.unpack("<256i", data[:1024])
    tokens = array.array("H", data[1024:])
    if sys.byteorder != "little":
        tokens.byteswap()
    return header, tokens

val = sorted(glob.glob(f"{tmp}/data/mix_val_*.bin"))
train = sorted(glob.glob(f"{tmp}/data/mix_train_*.bin"))
shards = [read(p) for p in val + train]
check(len(val) >= 1 and len(train) >= 2 and not glob.glob(f"{tmp}/data/.*"),
      f"shards named mix_val_000000.bin, mix_train_00000N.bin, nothing else: {os.listdir(tmp + '/data')}")
check(all(h[:3] == (20240520, 1, len(t)) and not any(h[3:]) for h, t in shards),
      "each shard's header is [20240520, 1, token count, 0...] and the count matches the file size")
tokens = [x for _, t in shards for x in t]
text = "".join("<|endoftext|>" + open(f"{tmp}/{f}", encoding="utf-8").read() for f in ("one.txt", "two.txt"))
check(enc.decode(tokens) == text, "the val then train tokens decode to <|endoftext|> one.txt <|endoftext|> two.txt")
check(tokens.count(50256) == 2, "exactly two <|endoftext|> tokens: the literal text stays text")
n_val = sum(len(t) for p, (_, t) in zip(val + train, shards) if p in val)
check(n_val == round(0.25 * len(tokens)), f"--val-fraction 0.25: {n_val} of {len(tokens)} tokens are val")
sizes = [len(t) for _, t in shards[len(val):]]
check(max(sizes) <= 1000 and max(sizes) - min(sizes) <= 1, f"--shard-tokens 1000: train shards {sizes}")

# streamed encoding: tiny blocks (characters cut between reads) and pieces equal encoding whole
prepare.BLOCK_BYTES, prepare.PIECE_CHARS = 5, 7
for f in ("one.txt", "two.txt"):
    items = [(start, text) for start, text, _ in prepare.text_documents(f"{tmp}/{f}") if start or text]
    got = list(array.array("H", prepare.encode_piece(items, enc, 2)[0]))
    want = [50256] + enc.encode_ordinary(open(f"{tmp}/{f}", encoding="utf-8").read())
    check(got == want, f"{f} read in 5-byte blocks and encoded in 7-character pieces equals encoding it whole")
EOF

# bad input: a non-zero exit, one line naming the problem, and no output folder left behind
printf 'fine text\n' > "$tmp/ok.txt"
printf 'good start\nthen \xc3\x28 bad\n' > "$tmp/bad.txt"  # 0xc3 at byte 16 starts a character 0x28 cannot end
: > "$tmp/empty.txt"
one_error_line() { [ "$(wc -l < "$tmp/err")" = 1 ] && grep -q '^prepare.py: error: ' "$tmp/err" && grep -qF -- "$1" "$tmp/err"; }
bad_input() {  # bad_input WHAT MESSAGE OUT ARGS...: prepare.py ARGS --out OUT fails with MESSAGE, OUT absent after
    prep "${@:4}" --out "$3" > /dev/null 2> "$tmp/err"
    local rc=$?
    check "$1: non-zero exit (got $rc)" [ "$rc" != 0 ]
    check "$1: one line 'prepare.py: error: ...$2...' (got: $(cat "$tmp/err"))" one_error_line "$2"
    check "$1: no $3 left behind" [ ! -e "$tmp/$3" ]
}
bad_input "a missing file" "missing.txt: No such file" bad ok.txt missing.txt
bad_input "bytes that are not UTF-8" "bad.txt: not UTF-8 text: byte offset 16" bad ok.txt bad.txt
bad_input "an empty file" "empty.txt: empty" bad empty.txt
bad_input "an output folder that cannot be made" "cannot write to ok.txt/data" ok.txt/data ok.txt
bad_input "--val-fraction 1" "--val-fraction" bad ok.txt --val-fraction 1
printf '{"text": "fine"}\n{"body": "no text field"}\n' > "$tmp/nofield.jsonl"
printf 'not gzip' > "$tmp/damaged.jsonl.gz"
bad_input "a JSON line without the --text-field" "nofield.jsonl: line 2: not a JSON object with a 'text' field" bad nofield.jsonl
bad_input "a damaged .jsonl.gz" "damaged.jsonl.gz: cannot be read" bad damaged.jsonl.gz

# existing shards are kept unless --force, which replaces all of them (none of the old left to glob)
sums() { (cd "$tmp/data" && md5sum mix_*); }
before=$(sums)
prep one.txt --out data --name mix > /dev/null 2> "$tmp/err"
check "existing shards: non-zero exit and one line suggesting --force (got: $(cat "$tmp/err"))" one_error_line "--force"
check "existing shards: left unchanged" [ "$before" = "$(sums)" ]
prep one.txt --out data --name f --shard-tokens 300 > /dev/null 2>&1
prep ok.txt --out data --name f --force > /dev/null 2>&1
check "--force: the new shards replace all the old ones ($(cd "$tmp/data" && echo f_*))" \
    [ "$(cd "$tmp/data" && echo f_*)" = "f_train_000000.bin f_val_000000.bin" ]

# a prepare.py killed while it moves its shards into place (here: once the val shards and one train shard of
# several are there) leaves a partial set: train_gpt refuses it in one line naming a missing shard, rather
# than train on it; the same command (no --force) then finishes the job, and the set trains
prep_killed_moving() {  # prep_killed_moving ARGS...: prepare.py ARGS, killed (exit 137) once it moved a train shard into --out
    (cd "$tmp" && python3 -c '
import os, sys
sys.path.insert(0, sys.argv[1])
import prepare
replace = os.replace
def killing_replace(src, dst):
    replace(src, dst)
    if "_train_" in dst and ".prepare.tmp" not in dst:
        os._exit(137)
os.replace = killing_replace
sys.argv = sys.argv[1:]
prepare.main()' "$root/dev/data" "$@")
}
prep_killed_moving one.txt two.txt --out data --name k --val-fraction 0.25 --shard-tokens 300 > /dev/null 2>&1
rc=$?
check "prepare.py killed while moving shards: exit 137, one train shard of several in place ($rc: $(cd "$tmp/data" && echo k_*))" \
    [ "$rc" = 137 -a "$(cd "$tmp/data" && echo k_train_*)" = "k_train_000000.bin" ]
train_k() { (cd "$tmp" && "$root/train_gpt_cpu" -e d2 -i 'data/k_train_*.bin' -j 'data/k_val_*.bin' -b 2 -t 32 -x 1 -v 1 -m 1 -s 0); }
train_k > "$tmp/k.log" 2> "$tmp/err"
rc=$?
check "train_gpt on the partial set: non-zero exit, one line naming a missing shard, no step (got $rc: $(cat "$tmp/err"))" \
    [ "$rc" != 0 -a "$(wc -l < "$tmp/err")" = 1 -a -n "$(grep 'llmpar: error: -i data/k_train_\*.bin: data/manifest.txt lists k_train_000001.bin, which is not there' "$tmp/err")" -a -z "$(grep '^step' "$tmp/k.log")" ]
prep one.txt two.txt --out data --name k --val-fraction 0.25 --shard-tokens 300 > /dev/null 2> "$tmp/err"
check "the same command, without --force, finishes the killed job ($(cat "$tmp/err"))" grep -q "continuing the interrupted run" "$tmp/err"
train_k > "$tmp/k.log" 2>&1
check "then the whole set trains ($(tail -n 1 "$tmp/k.log"))" grep -qE '^step 1/1 \| loss' "$tmp/k.log"

# a reader that leaves early (| head -1): no traceback, the shards written all the same
prep ok.txt --out data --name piped 2> "$tmp/err" | head -n 1 > /dev/null
check "prepare.py | head -1: no traceback ($(head -c 200 "$tmp/err"))" [ ! -s "$tmp/err" ]
check "prepare.py | head -1: the shards are written" [ -e "$tmp/data/piped_train_000000.bin" ]

# the command prepare.py printed trains on its shards (two steps of a depth-2 model, small batches)
cmd=$(grep -m 1 'train_gpt_cpu -i ' "$tmp/prep.log")
check "prepare.py prints the train command" [ -n "$cmd" ]
(cd "$tmp" && eval "$cmd -e d2 -b 2 -t 32 -x 2 -v 2 -m 1 -s 0") > "$tmp/train.log" 2>&1
rc=$?
check "the printed command trains: exit 0 (got $rc: $(tail -n 2 "$tmp/train.log"))" [ "$rc" = 0 ]
check "the printed command trains: step 2/2 with a finite loss" grep -qE '^step 2/2 \| loss [0-9]+\.[0-9]+ ' "$tmp/train.log"
check "the printed command trains: a finite val loss" grep -qE '^val loss [0-9]+\.[0-9]+$' "$tmp/train.log"

# --tokens uint32 (llm.c's Llama 3 format, [20240801, 7, count]): the same tokens, and the same steps
steps() { grep -E '^(step|val loss)' "$1" | sed 's/ | [0-9.]* ms .*//'; }
prep one.txt two.txt --out data32 --name mix --val-fraction 0.25 --shard-tokens 1000 --tokens uint32 > /dev/null 2> "$tmp/err"
check "prepare.py --tokens uint32 exits 0 ($(head -c 300 "$tmp/err"))" [ $? = 0 ]
tally python3 - "$tmp" <<'EOF'
import array, glob, os, struct, sys
tmp = sys.argv[1]

def tokens(path, code):
    data = open(path, "rb").read()
    t = array.array(code, data[1024:])
    if sys.byteorder != "little":
        t.byteswap()
    return struct.unpack("<3i", data[:12]), list(t)

narrow = [tokens(p, "H") for p in sorted(glob.glob(f"{tmp}/data/mix_*_*.bin"))]
wide = [tokens(p, "I") for p in sorted(glob.glob(f"{tmp}/data32/mix_*_*.bin"))]
print(("PASS " if len(wide) == len(narrow) and all(h == (20240801, 7, len(t)) for h, t in wide) else "FAIL ") +
      "--tokens uint32: each shard's header is [20240801, 7, token count]")
print(("PASS " if [t for _, t in wide] == [t for _, t in narrow] else "FAIL ") + "--tokens uint32: the uint16 shards' tokens")
EOF
(cd "$tmp" && "$root/train_gpt_cpu" -i 'data32/mix_train_*.bin' -j 'data32/mix_val_*.bin' -e d2 -b 2 -t 32 -x 2 -v 2 -m 1 -s 0) > "$tmp/train32.log" 2>&1
check "uint32 shards train to the uint16 shards' steps ($(steps "$tmp/train32.log" | head -c 300))" \
    [ -n "$(steps "$tmp/train.log")" -a "$(steps "$tmp/train.log")" = "$(steps "$tmp/train32.log")" ]

# the manifest: with it the same steps as reading every token (--check-data full); one that does not match is
# refused in one line naming it
(cd "$tmp" && eval "$cmd -e d2 -b 2 -t 32 -x 2 -v 2 -m 1 -s 0 -o out/full --check-data full") > "$tmp/full.log" 2>&1
check "with the manifest, the steps equal --check-data full's ($(steps "$tmp/train.log" | head -c 300))" \
    [ -n "$(steps "$tmp/train.log")" -a "$(steps "$tmp/train.log")" = "$(steps "$tmp/full.log")" ]
cp "$tmp/data/manifest.txt" "$tmp/manifest.good"
sed -i 's/^\(mix_train_000000\.bin\) \([0-9]*\)/\1 1\2/' "$tmp/data/manifest.txt"
(cd "$tmp" && eval "$cmd -e d2 -b 2 -t 32 -x 2 -v 2 -m 1 -s 0 -o out/bad") > /dev/null 2> "$tmp/err"
check "a manifest whose size differs: one error line naming it ($(cat "$tmp/err"))" \
    [ "$(wc -l < "$tmp/err")" = 1 -a -n "$(grep 'llmpar: error: data/manifest.txt: says mix_train_000000.bin is 1' "$tmp/err")" ]
cp "$tmp/manifest.good" "$tmp/data/manifest.txt"

# the manifest's numbers, computed here independently (CRC32C bit by bit, the polynomial of lp_crc32c)
tally python3 - "$tmp" <<'EOF'
import array, os, random, sys
sys.path.insert(0, "dev/data")
import prepare
tmp = sys.argv[1]

def check(ok, what):
    print(("PASS " if ok else "FAIL ") + what)

def crc_bitwise(data):
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF

check(prepare.crc32c(b"123456789") == 0xE3069283, "crc32c('123456789') is the CRC32C check value e3069283")
data = random.Random(5).randbytes(300_001)
check(prepare.crc32c(data) == crc_bitwise(data) and prepare.crc32c(data[1000:], prepare.crc32c(data[:1000])) == crc_bitwise(data),
      "crc32c in numpy lanes (joined) equals the bitwise CRC, and continues from a given CRC")
lines = open(f"{tmp}/data/manifest.txt").read().splitlines()
shards = sorted(f for f in os.listdir(f"{tmp}/data") if f.endswith(".bin"))
want = []
for f in shards:
    raw = open(f"{tmp}/data/{f}", "rb").read()
    tokens = array.array("H", raw[1024:])
    want.append(f"{f} {len(raw)} {len(tokens)} {max(tokens)} {crc_bitwise(raw):08x}")
check(lines == ["llmpar shards 1"] + want, f"data/manifest.txt: a line per shard in --out, NAME BYTES TOKENS MAX_ID CRC32C: {lines[:2]}")
EOF

# corpora: .jsonl.zst, .jsonl.gz and .parquet documents, a folder and a glob; --workers 2 (small pieces, so
# several are in flight) writes the same bytes as --workers 1; an interrupted run continues from its pieces
if python3 -c "import zstandard, pyarrow" > /dev/null 2>&1; then
    tally python3 - "$tmp" "$root/README.md" "$root/dev/docs/flags.md" <<'EOF'
import filecmp, gzip, json, os, subprocess, sys
import pyarrow, pyarrow.parquet, zstandard
tmp, readmes = sys.argv[1], sys.argv[2:]
corpus = f"{tmp}/corpus"
os.makedirs(f"{corpus}/more")
paras = [p for r in readmes for p in open(r, encoding="utf-8").read().split("\n\n") if p.strip()]
# documents in the field "body" (--text-field body): the paragraphs of the README and of dev/docs/flags.md
# (the README's flags block before it moved there), an empty one, a blank line
lines = [json.dumps({"body": p, "n": i}) for i, p in enumerate(paras)] + ['{"body": ""}', ""]
open(f"{corpus}/a.jsonl.zst", "wb").write(zstandard.ZstdCompressor().compress("\n".join(lines).encode()))
open(f"{corpus}/more/c.jsonl.gz", "wb").write(gzip.compress("\n".join(reversed(lines)).encode()))
pyarrow.parquet.write_table(pyarrow.table({"body": paras[::2]}), f"{corpus}/b.parquet", row_group_size=7)

def check(ok, what):
    print(("PASS " if ok else "FAIL ") + what)

def prep(out, *args, inputs=(corpus,), interrupt_after=0):
    """prepare.py with 2000-character pieces; interrupt_after=k: Ctrl-C once k pieces are written."""
    code = ("import sys; sys.path.insert(0, 'dev/data'); import prepare; prepare.PIECE_TARGET = 2000\n"
            f"k = {interrupt_after}\n"
            "if k:\n"
            "    write = prepare.write_piece\n"
            "    def write_piece(*a):\n"
            "        global k\n"
            "        write(*a); k -= 1\n"
            "        if not k: raise KeyboardInterrupt\n"
            "    prepare.write_piece = write_piece\n"
            "prepare.main()")
    argv = ["python3", "-c", code, *inputs, "--out", out, "--name", "c", "--text-field", "body",
            "--shard-tokens", "3000", *args]
    p = subprocess.run(argv, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr

def same(a, b):
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(filecmp.cmp(f"{a}/{n}", f"{b}/{n}", shallow=False) for n in names)

# the folder's files, in order: a.jsonl.zst, b.parquet, more/c.jsonl.gz
rc1, log1 = prep(f"{tmp}/w1", "--workers", "1")
rc2, log2 = prep(f"{tmp}/w2", "--workers", "2")
check(rc1 == 0 and rc2 == 0, f"prepare.py on a folder of .jsonl.zst, .parquet, .jsonl.gz: exit 0 ({log1[-300:]} {log2[-300:]})")
docs = 2 * len(paras) + len(paras[::2])
check(f"3 file(s), {docs:,} documents" in log1, f"every document once, the empty one skipped: {docs} ({log1[:120]})")
check(same(f"{tmp}/w1", f"{tmp}/w2") and len(os.listdir(f"{tmp}/w1")) > 4,
      f"--workers 2 writes the same shards and manifest, byte for byte, as --workers 1: {sorted(os.listdir(tmp + '/w1'))}")
check("2 workers, each while encoding:" in log2, "--workers 2 reports each worker's rate")
rc3, log3 = prep(f"{tmp}/w3", "--workers", "2", inputs=(f"{corpus}/*.jsonl.zst", f"{corpus}/b.parquet", f"{corpus}/more"))
check(rc3 == 0 and same(f"{tmp}/w1", f"{tmp}/w3"), f"a glob, a file and a folder give the same shards as the folder ({log3[-200:]})")
rc, log = prep(f"{tmp}/w4", "--workers", "2", interrupt_after=5)
staged = os.listdir(f"{tmp}/w4/.c.prepare.tmp") if os.path.isdir(f"{tmp}/w4/.c.prepare.tmp") else []
pieces = [f for f in staged if f.endswith(".u16")]
check(rc != 0 and "the same command continues" in log and len(pieces) >= 5 and not [f for f in os.listdir(f"{tmp}/w4") if f.endswith(".bin")],
      f"interrupted: the finished pieces stay in the staging folder, no shard in place ({len(pieces)} pieces; {log.strip()[-200:]})")
rc, log = prep(f"{tmp}/w4", "--workers", "2")
encoded = int(log.split("into ")[1].split(" tokens")[0].replace(",", "")) if "into " in log else -1
total = int(log1.split("documents -> ")[1].split(" tokens")[0].replace(",", ""))
check(rc == 0 and "continuing the interrupted run" in log and 0 < encoded < total and same(f"{tmp}/w1", f"{tmp}/w4"),
      f"the same command continues (encodes {encoded} of {total} tokens) and writes the same shards ({log[-200:]})")
EOF
else
    echo "skip: prepare.py on .jsonl.zst and .parquet, --workers 2 (needs zstandard and pyarrow: pip install zstandard pyarrow)"
fi

if python3 -c "import matplotlib" > /dev/null 2>&1; then
    python3 dev/plot.py "$tmp/out/mix" -o "$tmp/loss.png" > /dev/null 2> "$tmp/err"
    check "plot.py draws that run into a PNG ($(cat "$tmp/err"))" [ "$(head -c 4 "$tmp/loss.png" 2> /dev/null | tail -c 3)" = PNG ]
else
    echo "skip: dev/plot.py (needs matplotlib: pip install -r dev/data/requirements.txt)"
fi

# the README's "Train on your own text" block, as written, a line at a time, in a fresh copy of this checkout
# (its files as `git ls-files` lists them, plus ./train_gpt_cpu, which the README's setup command builds)
# with two texts of its own in books/; prepare.py prints the block's second and third lines
readme_block() { awk '/^## Train on your own text/ { s = 1 } s && /^```/ { if (b) exit; b = 1; next } b && NF' "$root/README.md"; }
if ! python3 -c "import numpy, matplotlib" > /dev/null 2>&1; then
    echo "skip: the README's own-text block (needs numpy and matplotlib: pip install -r dev/data/requirements.txt)"
elif ! files=$(git -C "$root" ls-files -co --exclude-standard 2> /dev/null); then
    echo "skip: the README's own-text block (not a git checkout: nothing to copy fresh)"
else
    clone=$tmp/clone
    mkdir -p "$clone/books"
    (cd "$root" && while IFS= read -r f; do [ -f "$f" ] && cp --parents "$f" "$clone"; done) <<< "$files"
    cp "$root/train_gpt_cpu" "$clone/"
    cp "$tmp/one.txt" "$clone/books/one.txt"
    cp "$root/dev/docs/parallelism.md" "$clone/books/two.txt"
    n=0
    while IFS= read -r line; do
        n=$((n + 1))
        (cd "$clone" && bash -c "$line") < /dev/null > "$tmp/own_$n.log" 2>&1
        rc=$?
        check "the README's own-text line $n runs as written in a fresh copy: $line (exit $rc: $(tail -n 2 "$tmp/own_$n.log"))" [ "$rc" = 0 ]
    done < <(readme_block)
    check "the README has its own-text block, of at least 3 lines (found $n)" [ "$n" -ge 3 ]
    printed=$(sed -n '/^train on it/,$p' "$tmp/own_1.log" | sed -n '2,$s/^  //p')
    check "prepare.py prints the README block's lines 2 and 3 (it printed: $printed)" [ "$printed" = "$(readme_block | sed -n 2,3p)" ]
    check "the README's train line trains every step it says and saves its checkpoint" \
        grep -qE '^saved checkpoint out/mine/step_00000040$' "$tmp/own_2.log"
    check "the README's plot line writes a PNG" [ "$(head -c 4 "$clone/out/mine/loss.png" 2> /dev/null | tail -c 3)" = PNG ]
    check "the README's sample line prints a sample" grep -q '^--- sample at step 0 ---$' "$tmp/own_4.log"
    check "the README's export line writes a Hugging Face directory" [ -s "$clone/hf/mine/model.safetensors" ]
fi

shared=../shared/data/tinyshakespeare.txt
if [ -f "$shared" ]; then
    python3 dev/data/tinyshakespeare.py --text "$shared" --out "$tmp/ts" --tokenizer "$tmp/ts/gpt2_tokenizer.bin" \
        > /dev/null 2> "$tmp/err"
    for f in dev/data/tinyshakespeare/tiny_shakespeare_val.bin dev/data/tinyshakespeare/tiny_shakespeare_train.bin \
        gpt2_tokenizer.bin; do
        check "tinyshakespeare.py --text $shared rebuilds $f byte for byte ($(cat "$tmp/err"))" \
            cmp -s "$tmp/ts/$(basename "$f")" "$f"
    done
else
    echo "skip: tinyshakespeare.py rebuilding the shipped shards ($shared not found)"
fi

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
