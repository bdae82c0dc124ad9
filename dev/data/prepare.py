#!/usr/bin/env python3
"""
Turn UTF-8 text files into token shards for train_gpt: GPT-2 tokens, a val and a train split.

    python3 dev/data/prepare.py book.txt notes/*.txt --out data --name mine
    ./train_gpt_cpu -i 'data/mine_train_*.bin' -j 'data/mine_val_*.bin' -o out/mine

Documents: each input file is one document, <|endoftext|> (token 50256) then the file's tokens. The
text "<|endoftext|>" inside a file is ordinary text, not the special token. A leading byte order mark
is dropped. Empty files are skipped.
Split: the first --val-fraction of all tokens (files in the order given) are the val split, the rest
train (at least one token each).
Shards: each split is cut into equal shards of at most --shard-tokens tokens, NAME_val_000000.bin ...
and NAME_train_000000.bin ..., in llm.c's format: a 256 x int32 header [20240520, 1, token count, 0...],
then the tokens as uint16 (little-endian).
Files are read in blocks and their tokens go to a temporary file, so memory holds one shard at most,
whatever the size of the corpus. Everything is written in a staging folder inside --out and moved into
place at the end: an error or Ctrl-C leaves nothing behind. Existing shards of the same name are only
replaced with --force. Offline: the GPT-2 BPE ranks are dev/data/gpt2.tiktoken. Needs tiktoken.
"""
import argparse
import array
import base64
import codecs
import glob
import os
import re
import shlex
import shutil
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RANKS = os.path.join(HERE, "gpt2.tiktoken")
# GPT-2's pre-tokenizer pattern (as in tiktoken's r50k/gpt2 encodings)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = 50256
SHARD_MAGIC = 20240520
# A cut before a space or newline that follows a non-space character leaves GPT-2's tokens unchanged: no
# piece of the pattern above runs on from a non-space character into whitespace, and the pattern looks
# at nothing before a piece's start. So long texts are encoded in pieces cut there.
CUT = re.compile(r"\S[ \n]")
BLOCK_BYTES = 1 << 22  # read per step
PIECE_CHARS = 1 << 18  # encoded per task, several tasks in parallel


class PrepareError(Exception):
    """A problem with the user's input, reported as one line."""


def gpt2_encoding(ranks_path=RANKS):
    """GPT-2's tiktoken Encoding from the local ranks file (read here: tiktoken's loader would also
    cache a copy in the temp folder)."""
    try:
        import tiktoken
    except ImportError:
        raise PrepareError("needs tiktoken: pip install -r dev/data/requirements.txt") from None
    ranks = {}
    with open(ranks_path, "rb") as f:
        for line in f:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT})


def write_file(path, header, payload):
    """A 256 x int32 little-endian header, then payload (bytes-like), written to path.tmp and renamed:
    path is either whole or absent."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<256i", *header, *[0] * (256 - len(header))))
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_shard(path, tokens):
    """An llm.c token shard: header [20240520, 1, count], then the tokens (a sequence of ids) as uint16."""
    if sys.byteorder != "little" or not (isinstance(tokens, array.array) and tokens.typecode == "H"):
        tokens = array.array("H", tokens)  # a copy; OverflowError for an id beyond uint16
        if sys.byteorder != "little":
            tokens.byteswap()
    write_file(path, [SHARD_MAGIC, 1, len(tokens)], tokens)


def read_text(path):
    """Yield (text, bytes read) for the file's blocks, decoded as UTF-8; bad bytes are a PrepareError
    naming their offset in the file."""
    offset, pending = 0, b""  # offset: where pending (a character cut by the block's end) starts
    with open(path, "rb") as f:
        while True:
            data = f.read(BLOCK_BYTES)
            buf = pending + data
            try:
                text, used = codecs.utf_8_decode(buf, "strict", not data)
            except UnicodeDecodeError as e:
                where = offset + e.start
                raise PrepareError(f"{path}: not UTF-8 text: byte offset {where}: {e.reason}") from None
            if offset == 0 and text.startswith("\ufeff"):
                text = text[1:]
            pending, offset = buf[used:], offset + used
            yield text, len(data)
            if not data:
                return


def find_cut(text, start, piece):
    """A cut after start (see CUT), the last one within piece characters, else the first beyond; -1 if
    there is none."""
    hi = min(start + piece, len(text))
    lo = max(start, hi - 4096)
    while True:  # look back from hi in growing windows: the last cut is usually near
        last = -1
        for m in CUT.finditer(text, lo, hi):
            last = m.start() + 1
        if last >= 0:
            return last
        if lo == start:
            break
        lo = max(start, hi - 16 * (hi - lo))
    m = CUT.search(text, max(start, hi - 1))
    return m.start() + 1 if m else -1


def encode_file(path, enc, threads, on_block):
    """Yield the token lists of one document: [EOT], then the file's text, encoded in pieces in parallel
    (equal to encoding it whole). on_block(bytes) is called after each block."""
    yield [EOT]
    carry = ""  # text after the block's last cut, continued by the next block
    for text, nbytes in read_text(path):
        text, start, parts = carry + text, 0, []
        while (cut := find_cut(text, start, PIECE_CHARS)) >= 0:
            parts.append(text[start:cut])
            start = cut
        carry = text[start:]
        yield from enc.encode_ordinary_batch(parts, num_threads=threads)
        on_block(nbytes)
    yield enc.encode_ordinary(carry)


class Progress:
    """One line on stderr, rewritten in place (only on a terminal): bytes, tokens, rate."""

    def __init__(self, total_bytes):
        self.total, self.bytes, self.tokens = total_bytes, 0, 0
        self.start = self.shown = time.time()
        self.tty = sys.stderr.isatty()

    def rate(self):
        return self.bytes / 1e6 / max(time.time() - self.start, 1e-9)

    def add(self, nbytes):
        self.bytes += nbytes
        if self.tty and time.time() - self.shown > 0.25:
            self.shown = time.time()
            pct = 100 * self.bytes / max(self.total, 1)
            sys.stderr.write(f"\rtokenizing {self.bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB ({pct:.0f}%), "
                             f"{self.tokens:,} tokens, {self.rate():.1f} MB/s ")
            sys.stderr.flush()

    def close(self):
        if self.tty and self.shown > self.start:
            sys.stderr.write("\n")


def split_sizes(n, most):
    """n tokens as equal shards of at most `most` tokens."""
    k = -(-n // most)
    return [n // k + (i < n % k) for i in range(k)]


def check_inputs(args):
    for path in args.text:
        if os.path.isdir(path):
            raise PrepareError(f"{path}: is a folder (give the text files in it)")
        try:
            open(path, "rb").close()
        except OSError as e:
            raise PrepareError(f"{path}: {e.strerror}") from None
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.name):
        raise PrepareError(f"--name {args.name!r}: use letters, digits, '.', '_' and '-' only")
    if not 0 <= args.val_fraction < 1:
        raise PrepareError(f"--val-fraction {args.val_fraction}: must be at least 0 and below 1")
    if args.shard_tokens < 1 or args.shard_tokens >= 1 << 31:
        raise PrepareError(f"--shard-tokens {args.shard_tokens}: must be 1 .. 2^31-1 (the header is int32)")


def prepare(args):
    check_inputs(args)
    out, name = args.out, args.name
    patterns = [os.path.join(out, f"{name}_{split}_*.bin") for split in ("val", "train")]
    old = sorted(path for pattern in patterns for path in glob.glob(pattern))  # what the engine's -i/-j would read
    if old and not args.force:
        raise PrepareError(f"{old[0]} exists ({len(old)} shard(s) of this name in {out}): pass --force to "
                           "replace them, or choose another --name or --out")
    enc = gpt2_encoding()
    made_out = not os.path.isdir(out)
    staging = os.path.join(out, f".{name}.prepare.tmp")
    try:
        os.makedirs(out, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a killed run
        os.mkdir(staging)
    except OSError as e:
        raise PrepareError(f"cannot write to {out}: {e.strerror}") from None
    done = False
    try:
        tokens_path = os.path.join(staging, "tokens.u16")
        files, n, progress = tokenize(args.text, enc, tokens_path)
        n_val = max(1, round(args.val_fraction * n)) if args.val_fraction > 0 else 0
        if n - n_val < 1:
            raise PrepareError(f"{n} tokens are too few to split")
        shards = []  # (file name, tokens): val first, as in the token file
        for split, count in (("val", n_val), ("train", n - n_val)):
            sizes = split_sizes(count, args.shard_tokens) if count else []
            shards += [(f"{name}_{split}_{i:06d}.bin", k) for i, k in enumerate(sizes)]
        with open(tokens_path, "rb") as f:
            for fname, count in shards:
                tokens = array.array("H")
                tokens.fromfile(f, count)
                write_shard(os.path.join(staging, fname), tokens)
        for path in old:
            os.remove(path)
        for fname, _ in shards:
            os.replace(os.path.join(staging, fname), os.path.join(out, fname))
        done = True
    except OSError as e:
        raise PrepareError(f"{e.filename or out}: {e.strerror}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if made_out and not done:
            try:
                os.rmdir(out)
            except OSError:
                pass
    report(args, files, progress, n, n_val, shards)


def tokenize(paths, enc, tokens_path):
    """Encode the files as documents into tokens_path (uint16, native order); return the number of
    documents, of tokens, and the Progress."""
    sizes = {path: os.path.getsize(path) for path in paths}
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not any(sizes.values()):
        raise PrepareError(f"{paths[0]}: empty" if len(paths) == 1 else "no text: every input file is empty")
    progress = Progress(sum(sizes.values()))
    files = n = 0
    with open(tokens_path, "wb") as f:
        for path in paths:
            if sizes[path] == 0:
                print(f"notice: {path} is empty, skipped", file=sys.stderr)
                continue
            files += 1
            for tokens in encode_file(path, enc, threads, progress.add):
                array.array("H", tokens).tofile(f)
                n += len(tokens)
                progress.tokens = n
    progress.close()
    if n == files:  # nothing but the documents' <|endoftext|>
        raise PrepareError("no text in the input files")
    return files, n, progress


def report(args, files, progress, n, n_val, shards):
    seconds = time.time() - progress.start
    print(f"{files} file(s), {progress.bytes:,} bytes -> {n:,} tokens in {seconds:.1f} s "
          f"({progress.rate():.1f} MB/s)")
    for split, count in (("val", n_val), ("train", n - n_val)):
        names = [os.path.join(args.out, f) for f, _ in shards if f.startswith(f"{args.name}_{split}_")]
        if names:
            where = names[0] if len(names) == 1 else f"{names[0]} .. {os.path.basename(names[-1])}"
            print(f"  {split:5s} {count:>12,} tokens ({100 * count / n:.1f}%), {len(names)} shard(s): {where}")
    smallest = min(k for _, k in shards)
    if smallest < 16 * 1024 + 1:  # the engine refuses a shard smaller than one batch
        print(f"notice: the smallest shard holds {smallest:,} tokens; a run needs B*T*ranks+1 in every shard "
              "(CPU defaults B=4 T=64: 257, CUDA defaults B=16 T=1024: 16385): lower -b or -t if needed")
    pattern = {split: shlex.quote(os.path.join(args.out, f"{args.name}_{split}_*.bin")) for split in ("val", "train")}
    val = pattern["val"] if n_val else "''"
    run = os.path.join("out", args.name)
    print("train on it (the CUDA engine ./train_gpt takes the same flags), then plot its losses:")
    print(f"  {shown(ROOT, 'train_gpt_cpu')} -i {pattern['train']} -j {val} -o {run}")
    print(f"  python3 {shown(ROOT, 'dev', 'plot.py')} {run} -o {run}/loss.png")


def shown(*parts):
    """A repository path as a command line names it from here: relative below the current folder, else
    absolute."""
    rel = os.path.relpath(os.path.join(*parts))
    return shlex.quote(os.path.join(*parts) if rel.startswith("..") else os.path.join(".", rel))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("text", nargs="+", metavar="TEXT", help="UTF-8 text files, one document each")
    ap.add_argument("--out", default="data", help="folder for the shards [data]")
    ap.add_argument("--name", help="shard name prefix [the first TEXT's name without its extension]")
    ap.add_argument("--val-fraction", type=float, default=0.1, help="share of the tokens for val (0: none) [0.1]")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="most tokens per shard [100000000]")
    ap.add_argument("--force", action="store_true", help="replace existing shards of the same name")
    args = ap.parse_args()
    if args.name is None:  # the first file's name, made safe for the engine's glob
        stem = os.path.splitext(os.path.basename(args.text[0]))[0]
        args.name = re.sub(r"[^A-Za-z0-9._-]", "_", stem) or "data"
    try:
        prepare(args)
    except PrepareError as e:
        sys.exit(f"prepare.py: error: {e}")
    except KeyboardInterrupt:
        sys.exit("prepare.py: interrupted; nothing written")
    except BrokenPipeError:  # whoever read the report left (prepare.py ... | head): stop without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
