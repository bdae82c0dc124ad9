#!/usr/bin/env python3
"""
Turn text corpora into token shards for train_gpt: GPT-2 tokens, a val and a train split.

    python3 dev/data/prepare.py book.txt notes/*.txt --out data --name mine
    python3 dev/data/prepare.py 'crawl/*.jsonl.zst' wiki.parquet --name web --workers 8
    ./train_gpt_cpu -i 'data/mine_train_*.bin' -j 'data/mine_val_*.bin' -o out/mine

Inputs: .jsonl, .jsonl.gz and .jsonl.zst hold one document per line (a JSON object; its --text-field is
the text), .parquet one per row (the --text-field column); any other file is UTF-8 text, one document.
A folder stands for its files with those endings (sorted, recursively); a quoted glob for its matches
(sorted).
Documents: each is <|endoftext|> (token 50256) then its tokens. The text "<|endoftext|>" inside a
document is ordinary text, not the special token. A text file's leading byte order mark is dropped.
Empty files and documents are skipped.
Split: the first --val-fraction of all tokens (documents in input order) are the val split, the rest
train (at least one token each).
Shards: each split is cut into equal shards of at most --shard-tokens tokens, NAME_val_000000.bin ...
and NAME_train_000000.bin ..., in llm.c's format: a 256 x int32 header [20240520, 1, token count, 0...],
then the tokens as uint16 (little-endian); with --tokens uint32, llm.c's Llama 3 format: [20240801, 7,
token count, 0...], then uint32 (the engine reads both; GPT-2's 50,257 ids fit either). OUT/manifest.txt lists each shard's size, token count,
largest token id and CRC32C, so that the engine need not read every token to check them.
Workers: the input is read in order and cut into pieces of about 4M characters (at document ends, or
where a long text's tokens do not change); --workers processes encode them, and the pieces' tokens are
joined in input order, so the shards are the same bytes for any number of workers.
Resumable: each piece's tokens go to a file of their own in a staging folder inside --out (written
under a temporary name and renamed, so a file there is a finished piece), and the shards are made there
too; only at the end are they moved into place. Ctrl-C or a kill keeps the staging folder, and the same
command continues from the finished pieces and shards (with other arguments, or inputs whose size or
time changed, it starts afresh), also when it was killed while moving the shards into place, which
leaves some of them there (train_gpt refuses such a set: the manifest lists shards that are missing). A
bad input stops it with one line and leaves nothing. Existing shards of the same name are only replaced
with --force (or by the same command continuing a job that was allowed to replace them). Offline: the
GPT-2 BPE ranks are dev/data/gpt2.tiktoken.
Needs tiktoken and numpy; zstandard for .zst, pyarrow for .parquet.
"""
import argparse
import array
import base64
import codecs
import collections
import glob
import gzip
import io
import json
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RANKS = os.path.join(HERE, "gpt2.tiktoken")
# GPT-2's pre-tokenizer pattern (as in tiktoken's r50k/gpt2 encodings)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = 50256
SHARD_MAGIC = 20240520    # uint16 tokens, version 1
SHARD32_MAGIC = 20240801  # uint32 tokens, version 7
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


def write_shard(path, tokens, width="uint16"):
    """An llm.c token shard: header [20240520, 1, count], then the tokens (a sequence of ids) as uint16;
    width "uint32": header [20240801, 7, count], then uint32."""
    code = "H" if width == "uint16" else "I"
    if sys.byteorder != "little" or not (isinstance(tokens, array.array) and tokens.typecode == code):
        tokens = array.array(code, tokens)  # a copy; OverflowError for an id beyond the width
        if sys.byteorder != "little":
            tokens.byteswap()
    assert tokens.itemsize == (2 if code == "H" else 4)
    write_file(path, [SHARD_MAGIC, 1, len(tokens)] if code == "H" else [SHARD32_MAGIC, 7, len(tokens)], tokens)


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


class Progress:
    """One line on stderr, rewritten in place (only on a terminal): input bytes, tokens, rate."""

    def __init__(self, total_bytes):
        self.total, self.bytes, self.tokens = total_bytes, 0, 0
        self.start = self.shown = time.time()
        self.tty = sys.stderr.isatty()

    def add(self, nbytes):
        self.bytes += nbytes
        if self.tty and time.time() - self.shown > 0.25:
            self.shown = time.time()
            pct = 100 * self.bytes / max(self.total, 1)
            rate = self.bytes / 1e6 / max(time.time() - self.start, 1e-9)
            sys.stderr.write(f"\rreading {self.bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB ({pct:.0f}%), "
                             f"{self.tokens:,} tokens, {rate:.1f} MB/s ")
            sys.stderr.flush()

    def close(self):
        if self.tty and self.shown > self.start:
            sys.stderr.write("\n")


def split_sizes(n, most):
    """n tokens as equal shards of at most `most` tokens."""
    k = -(-n // most)
    return [n // k + (i < n % k) for i in range(k)]


# --- inputs: files, folders and globs; each file's documents as pieces of text

JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst")
KNOWN = JSONL + (".parquet", ".txt")  # what a folder contributes
PIECE_TARGET = 1 << 22  # characters per piece of work (a worker's task, a resumable unit)


def expand_inputs(args):
    """The input files, in order: a folder's files with a known ending (sorted, recursively), a glob's
    matches (sorted), a file as given."""
    files = []
    for arg in args:
        if os.path.isdir(arg):
            found = sorted(os.path.join(d, f) for d, _, names in os.walk(arg) for f in names if f.endswith(KNOWN))
            if not found:
                raise PrepareError(f"{arg}: a folder with no {', '.join(KNOWN)} files")
            files += found
        elif not os.path.exists(arg) and any(c in arg for c in "*?["):
            found = sorted(glob.glob(arg, recursive=True))
            if not found:
                raise PrepareError(f"{arg}: no file matches")
            files += [f for f in found if not os.path.isdir(f)]
        else:
            files.append(arg)
    for path in files:
        try:
            open(path, "rb").close()
        except OSError as e:
            raise PrepareError(f"{path}: {e.strerror}") from None
        if path.endswith(".zst"):
            need("zstandard", path)
        if path.endswith(".parquet"):
            need("pyarrow", path)
    return files


def need(module, path):
    try:
        __import__(module)
    except ImportError:
        raise PrepareError(f"{path}: reading it needs {module}: pip install {module}") from None


def text_documents(path):
    """Yield (starts a document, text, input bytes) for a text file: one document, cut in pieces where
    its tokens do not change (see CUT)."""
    first, carry = True, ""
    for text, nbytes in read_text(path):
        text, start = carry + text, 0
        while (cut := find_cut(text, start, PIECE_CHARS)) >= 0:
            yield first, text[start:cut], 0
            first, start = False, cut
        carry = text[start:]
        yield False, "", nbytes  # the block's bytes, for the progress line
    yield first, carry, 0


def jsonl_documents(path, field):
    """Yield (True, text, input bytes) for each line of a .jsonl(.gz|.zst) file."""
    try:
        yield from jsonl_lines(path, field)
    except PrepareError:
        raise
    except Exception as e:  # gzip's, zstandard's errors for a damaged file
        raise PrepareError(f"{path}: cannot be read: {e}") from None


def jsonl_lines(path, field):
    with open(path, "rb") as raw:
        if path.endswith(".gz"):
            stream = gzip.open(raw)
        elif path.endswith(".zst"):
            import zstandard
            stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        else:
            stream = raw
        stream = io.BufferedReader(stream, 1 << 20) if stream is not raw else raw
        done = 0
        for number, line in enumerate(stream, 1):
            if line.strip():
                try:
                    text = json.loads(line)[field]
                except (ValueError, KeyError, TypeError) as e:
                    raise PrepareError(f"{path}: line {number}: not a JSON object with a {field!r} field "
                                       f"({type(e).__name__})") from None
                if not isinstance(text, str):
                    raise PrepareError(f"{path}: line {number}: {field!r} is not a string")
                yield True, text, raw.tell() - done
                done = raw.tell()


def parquet_documents(path, field):
    """Yield (True, text, input bytes) for each row of a .parquet file's column `field`."""
    import pyarrow.parquet as pq
    try:
        f = pq.ParquetFile(path)
        if field not in f.schema_arrow.names:
            raise PrepareError(f"{path}: no column {field!r} (columns: {', '.join(f.schema_arrow.names)})")
        size, rows = os.path.getsize(path), max(f.metadata.num_rows, 1)
        for batch in f.iter_batches(columns=[field], batch_size=4096):
            for text in batch.column(0).to_pylist():
                if text is not None and not isinstance(text, str):
                    raise PrepareError(f"{path}: column {field!r} is not text")
                yield True, text or "", size / rows
    except PrepareError:
        raise
    except Exception as e:  # pyarrow's errors for a damaged file
        raise PrepareError(f"{path}: not a readable parquet file: {e}") from None


def documents(path, field):
    if path.endswith(JSONL):
        return jsonl_documents(path, field)
    if path.endswith(".parquet"):
        return parquet_documents(path, field)
    return text_documents(path)


def pieces(path, field, progress):
    """Yield the file's pieces of work, lists of (starts a document, text) of about PIECE_TARGET
    characters, and its number of documents when done (a StopIteration value)."""
    items, chars, docs = [], 0, 0
    for start, text, nbytes in documents(path, field):
        progress.add(nbytes)
        if start and not text:  # an empty document
            continue
        docs += start
        if text or start:
            items.append((start, text))
            chars += len(text)
        if chars >= PIECE_TARGET:
            yield items
            items, chars = [], 0
    if items:
        yield items
    return docs


# --- encoding: in this process (on every core, by tiktoken's threads) or in --workers processes

_worker_enc = None


def _worker_init():
    global _worker_enc
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    _worker_enc = gpt2_encoding()


def encode_piece(items, enc=None, threads=1):
    """The tokens of a piece (uint16 bytes, native order), its UTF-8 bytes, seconds spent, process id."""
    t0 = time.time()
    enc = enc or _worker_enc
    encoded = enc.encode_ordinary_batch([text for _, text in items], num_threads=threads)
    tokens = array.array("H")
    for (start, _), ids in zip(items, encoded):
        if start:
            tokens.append(EOT)
        tokens.extend(ids)
    nbytes = sum(len(text.encode("utf-8", "surrogatepass")) for _, text in items)  # JSON may hold lone surrogates
    return tokens.tobytes(), nbytes, time.time() - t0, os.getpid()


class Encoder:
    """Encodes pieces in order: at most 2 per worker in flight, so memory stays small whatever the input."""

    def __init__(self, workers):
        self.workers = workers
        self.pool = multiprocessing.Pool(workers, _worker_init) if workers > 1 else None
        self.enc = None if self.pool else gpt2_encoding()
        self.threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.pending = collections.deque()  # (AsyncResult, on_done)
        self.busy = collections.defaultdict(lambda: [0, 0, 0.0])  # pid -> [bytes, tokens, seconds]

    def submit(self, items, on_done):
        if not self.pool:
            self._done(encode_piece(items, self.enc, self.threads), on_done)
            return
        self.pending.append((self.pool.apply_async(encode_piece, (items,)), on_done))
        while len(self.pending) > 2 * self.workers:
            self._done(*self._pop())

    def _pop(self):
        result, on_done = self.pending.popleft()
        return result.get(), on_done

    def _done(self, result, on_done):
        tokens, nbytes, seconds, pid = result
        busy = self.busy[pid]
        busy[0] += nbytes
        busy[1] += len(tokens) // 2
        busy[2] += seconds
        on_done(tokens)

    def finish(self):
        while self.pending:
            self._done(*self._pop())

    def close(self):
        if self.pool:
            self.pool.terminate()
            self.pool.join()


# --- CRC32C (Castagnoli, lp_crc32c's polynomial): numpy runs many lanes of a long buffer at once, and the
# lanes' CRCs are joined (zlib's crc32_combine: a CRC after n more zero bytes is a linear map of it)

def _crc_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


CRC_TABLE = _crc_table()


def _crc_bytes(crc, data):
    c = ~crc & 0xFFFFFFFF
    for b in data:
        c = CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return ~c & 0xFFFFFFFF


def _gf2_apply(matrix, v):
    r, i = 0, 0
    while v:
        if v & 1:
            r ^= matrix[i]
        v, i = v >> 1, i + 1
    return r


def _zeros(n):
    """The map of a CRC register over n zero bytes, as its 32 columns."""
    step = [CRC_TABLE[(1 << b) & 0xFF] ^ ((1 << b) >> 8) for b in range(32)]
    result = [1 << b for b in range(32)]
    while n:
        if n & 1:
            result = [_gf2_apply(step, c) for c in result]
        step = [_gf2_apply(step, c) for c in step]
        n >>= 1
    return result


def crc32c(data, crc=0):
    """CRC32C of data (bytes-like), continuing crc: crc32c(b, crc32c(a)) == crc32c(a + b)."""
    import numpy as np
    buf = np.frombuffer(data, dtype=np.uint8)
    lanes = min(1 << 14, len(buf) >> 10)
    if lanes < 2:
        return _crc_bytes(crc, buf.tolist())
    n = len(buf) // lanes
    block = np.ascontiguousarray(buf[:lanes * n].reshape(lanes, n).T)
    table = np.array(CRC_TABLE, dtype=np.uint32)
    reg = np.full(lanes, 0xFFFFFFFF, dtype=np.uint32)
    for column in block:
        reg = table[(reg ^ column) & 0xFF] ^ (reg >> 8)
    shift = _zeros(n)
    for lane in (~reg).tolist():
        crc = _gf2_apply(shift, crc) ^ lane
    return _crc_bytes(crc, buf[lanes * n:].tolist())


# --- the manifest: OUT/manifest.txt, "llmpar shards 1", then per shard "NAME BYTES TOKENS MAX_ID CRC32C"
# (CRC32C of the whole file, header included, in hex), sorted by name

MANIFEST = "manifest.txt"
MANIFEST_HEAD = "llmpar shards 1"


def shard_entry(path):
    """A manifest line's fields for the shard at path."""
    import numpy as np
    data = open(path, "rb").read()
    tokens = np.frombuffer(data, dtype="<u4" if struct.unpack("<i", data[:4])[0] == SHARD32_MAGIC else "<u2", offset=1024)
    return [os.path.basename(path), len(data), len(tokens), int(tokens.max()) if len(tokens) else 0, crc32c(data)]


def read_manifest(out):
    """{name: line} of OUT/manifest.txt ({} if absent)."""
    path = os.path.join(out, MANIFEST)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if not lines or lines[0] != MANIFEST_HEAD:
        raise PrepareError(f"{path}: exists and is not a shard manifest (first line {MANIFEST_HEAD!r})")
    return {line.split()[0]: line for line in lines[1:] if line.strip()}


def write_manifest(out, name, entries):
    """OUT/manifest.txt with entries (this name's shards) replacing this name's earlier lines; lines of
    shards that are gone are dropped."""
    ours = re.compile(re.escape(name) + r"_(val|train)_\d+\.bin")
    lines = {k: v for k, v in read_manifest(out).items()
             if not ours.fullmatch(k) and os.path.exists(os.path.join(out, k))}
    for fname, size, count, top, crc in entries:
        lines[fname] = f"{fname} {size} {count} {top} {crc:08x}"
    write_text(os.path.join(out, MANIFEST), "\n".join([MANIFEST_HEAD] + [lines[k] for k in sorted(lines)]) + "\n")


def write_text(path, text):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


# --- prepare: encode the pieces into the staging folder, cut the shards, move them into place

def check_args(args):
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.name):
        raise PrepareError(f"--name {args.name!r}: use letters, digits, '.', '_' and '-' only")
    if not 0 <= args.val_fraction < 1:
        raise PrepareError(f"--val-fraction {args.val_fraction}: must be at least 0 and below 1")
    if args.shard_tokens < 1 or args.shard_tokens >= 1 << 31:
        raise PrepareError(f"--shard-tokens {args.shard_tokens}: must be 1 .. 2^31-1 (the header is int32)")
    if args.workers < 1:
        raise PrepareError(f"--workers {args.workers}: must be at least 1")


def prepare(args):
    check_args(args)
    files = expand_inputs(args.text)
    out, name = args.out, args.name
    patterns = [os.path.join(out, f"{name}_{split}_*.bin") for split in ("val", "train")]
    old = sorted(path for pattern in patterns for path in glob.glob(pattern))  # what the engine's -i/-j would read
    read_manifest(out)  # a foreign manifest.txt stops the run before the work
    sizes = {path: os.path.getsize(path) for path in files}
    if not any(sizes.values()):
        raise PrepareError(f"{files[0]}: empty" if len(files) == 1 else "no text: every input file is empty")
    staging = os.path.join(out, f".{name}.prepare.tmp")
    # what the staging folder's work depends on: a different job starts afresh
    job = json.dumps({"version": 1, "inputs": [[p, sizes[p], os.stat(p).st_mtime_ns] for p in files],
                      "text_field": args.text_field, "piece": PIECE_TARGET, "val_fraction": args.val_fraction,
                      "shard_tokens": args.shard_tokens, "tokens": args.tokens}, indent=1)
    job_path = os.path.join(staging, "job.json")
    same_job = os.path.exists(job_path) and open(job_path).read() == job
    # shards of this name are replaced with --force only; the same job killed while it moved its shards into
    # place (it was allowed to replace them) continues without it
    if old and not args.force and not same_job:
        raise PrepareError(f"{old[0]} exists ({len(old)} shard(s) of this name in {out}): pass --force to "
                           "replace them, or choose another --name or --out")
    gpt2_encoding()  # tiktoken present, before any work
    made_out = not os.path.isdir(out)
    try:
        os.makedirs(out, exist_ok=True)
        if same_job:
            print(f"notice: continuing the interrupted run in {staging}", file=sys.stderr)
        else:
            shutil.rmtree(staging, ignore_errors=True)
            os.mkdir(staging)
            write_text(job_path, job)
    except OSError as e:
        raise PrepareError(f"cannot write to {out}: {e.strerror}") from None
    try:
        stats = encode_all(files, sizes, args, staging)
        shards = cut_shards(args, staging, stats)
        entries = [shard_entry(os.path.join(staging, fname)) for fname, _ in shards]
        write_manifest(out, name, entries)
        for path in old:
            os.remove(path)
        for fname, _ in shards:
            os.replace(os.path.join(staging, fname), os.path.join(out, fname))
        shutil.rmtree(staging)
    except PrepareError:  # bad input: nothing is left
        shutil.rmtree(staging, ignore_errors=True)
        if made_out:
            shutil.rmtree(out, ignore_errors=True)
        raise
    except OSError as e:
        raise PrepareError(f"{e.filename or out}: {e.strerror} (the finished pieces stay in {staging}: "
                           "the same command continues)") from None
    report(args, stats, shards)


def encode_all(files, sizes, args, staging):
    """Encode every file's pieces into staging/FFFFFF_PPPPPP.u16 (file, piece), skipping the finished
    ones; a file whose pieces are all finished gets staging/FFFFFF.done ({pieces, docs}) and is not read
    again. Returns the run's numbers."""
    progress = Progress(sum(sizes.values()))
    encoder = Encoder(args.workers)
    stats = {"files": 0, "docs": 0, "pieces": [0] * len(files), "progress": progress, "encoder": encoder}
    try:
        for i, path in enumerate(files):
            if sizes[path] == 0:
                print(f"notice: {path} is empty, skipped", file=sys.stderr)
                continue
            done_path = os.path.join(staging, f"{i:06d}.done")
            if os.path.exists(done_path):
                done = json.load(open(done_path))
                progress.add(sizes[path])
            else:
                done = encode_file_pieces(i, path, args, staging, encoder, progress, done_path)
            stats["files"] += done["docs"] > 0
            stats["docs"] += done["docs"]
            stats["pieces"][i] = done["pieces"]
        encoder.finish()
        progress.close()
    finally:
        encoder.close()
    return stats


def encode_file_pieces(i, path, args, staging, encoder, progress, done_path):
    """Submit the file's unfinished pieces; its .done is written once they all are (the next files' pieces
    are read meanwhile, so many small files keep every worker busy)."""
    gen, k, left = pieces(path, args.text_field, progress), 0, [0]
    done = {}

    def piece_done(tokens, piece_path):
        write_piece(piece_path, tokens, progress)
        left[0] -= 1
        if done and not left[0]:
            write_text(done_path, json.dumps(done))

    while True:
        try:
            items = next(gen)
        except StopIteration as stop:
            done.update(pieces=k, docs=stop.value)
            if not left[0]:
                write_text(done_path, json.dumps(done))
            return done
        piece_path = os.path.join(staging, f"{i:06d}_{k:06d}.u16")
        if not os.path.exists(piece_path):
            left[0] += 1
            encoder.submit(items, lambda tokens, p=piece_path: piece_done(tokens, p))
        k += 1


def write_piece(path, tokens, progress):
    with open(path + ".tmp", "wb") as f:
        f.write(tokens)
    os.replace(path + ".tmp", path)
    progress.tokens += len(tokens) // 2


def cut_shards(args, staging, stats):
    """Cut the pieces' tokens, in order, into the val and train shards in staging (a shard already there
    is finished: kept). Returns [(file name, tokens)]."""
    piece_paths = [os.path.join(staging, f"{i:06d}_{k:06d}.u16")
                   for i, count in enumerate(stats["pieces"]) for k in range(count)]
    n = sum(os.path.getsize(p) for p in piece_paths) // 2
    stats["tokens"] = n
    if n == stats["docs"]:  # nothing but the documents' <|endoftext|>
        raise PrepareError("no text in the input files")
    n_val = max(1, round(args.val_fraction * n)) if args.val_fraction > 0 else 0
    if n - n_val < 1:
        raise PrepareError(f"{n} tokens are too few to split")
    stats["val"] = n_val
    shards = []  # (file name, tokens): val first, as in the pieces
    for split, count in (("val", n_val), ("train", n - n_val)):
        sizes = split_sizes(count, args.shard_tokens) if count else []
        shards += [(f"{args.name}_{split}_{i:06d}.bin", k) for i, k in enumerate(sizes)]
    stream = TokenStream(piece_paths)
    for fname, count in shards:
        path = os.path.join(staging, fname)
        if os.path.exists(path):
            stream.skip(count)
        else:
            write_shard(path, stream.read(count), args.tokens)
    return shards


class TokenStream:
    """The pieces' tokens as one stream."""

    def __init__(self, paths):
        self.paths, self.file = list(paths), None

    def _next_file(self):
        if self.file:
            self.file.close()
        self.file = open(self.paths.pop(0), "rb")

    def read(self, count):
        tokens = array.array("H")
        while len(tokens) < count:
            data = self.file.read(2 * (count - len(tokens))) if self.file else b""
            if not data:
                self._next_file()
            tokens.frombytes(data)
        return tokens

    def skip(self, count):
        while count:
            left = (os.fstat(self.file.fileno()).st_size - self.file.tell()) // 2 if self.file else 0
            if not left:
                self._next_file()
                continue
            step = min(left, count)
            self.file.seek(2 * step, os.SEEK_CUR)
            count -= step


def report(args, stats, shards):
    progress, encoder, n, n_val = stats["progress"], stats["encoder"], stats["tokens"], stats["val"]
    seconds = max(time.time() - progress.start, 1e-9)
    text_bytes = sum(b for b, _, _ in encoder.busy.values())
    encoded = sum(t for _, t, _ in encoder.busy.values())  # this run's: a continued run counts only its own work
    print(f"{stats['files']} file(s), {stats['docs']:,} documents -> {n:,} tokens; this run encoded {text_bytes:,} "
          f"bytes of text into {encoded:,} tokens in {seconds:.1f} s: {text_bytes / 1e6 / seconds:.2f} MB/s, "
          f"{encoded / seconds:,.0f} tokens/s")
    if encoder.pool:
        rates = ", ".join(f"{b / 1e6 / max(s, 1e-9):.2f} MB/s ({t / max(s, 1e-9):,.0f} tokens/s)"
                          for b, t, s in encoder.busy.values())
        print(f"  {args.workers} workers, each while encoding: {rates}")
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
    ap.add_argument("text", nargs="+", metavar="INPUT",
                    help="text files (one document each), .jsonl, .jsonl.gz, .jsonl.zst, .parquet; folders; quoted globs")
    ap.add_argument("--out", default="data", help="folder for the shards [data]")
    ap.add_argument("--name", help="shard name prefix [the first TEXT's name without its extension]")
    ap.add_argument("--val-fraction", type=float, default=0.1, help="share of the tokens for val (0: none) [0.1]")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="most tokens per shard [100000000]")
    ap.add_argument("--tokens", choices=("uint16", "uint32"), default="uint16",
                    help="the shards' token format: uint16 (GPT-2's, magic 20240520) or uint32 (Llama 3's, 20240801) [uint16]")
    ap.add_argument("--force", action="store_true", help="replace existing shards of the same name")
    ap.add_argument("--text-field", default="text", help="the JSON field or parquet column of the text [text]")
    ap.add_argument("--workers", type=int, default=1,
                    help="processes that encode (the shards are the same for any number) [1: this one, on every core]")
    args = ap.parse_args()
    if args.name is None:  # the first input's name, made safe for the engine's glob
        stem = os.path.basename(os.path.normpath(args.text[0])).split("*")[0]
        ending = next((k for k in KNOWN if stem.endswith(k)), None)
        stem = stem[:-len(ending)] if ending else os.path.splitext(stem)[0]
        args.name = re.sub(r"[^A-Za-z0-9._-]", "_", stem) or "data"
    try:
        prepare(args)
    except PrepareError as e:
        sys.exit(f"prepare.py: error: {e}")
    except KeyboardInterrupt:
        staging = os.path.join(args.out, f".{args.name}.prepare.tmp")
        kept = f"the finished pieces stay in {staging}: the same command continues" if os.path.isdir(staging) else "nothing written"
        sys.exit(f"prepare.py: interrupted; {kept}")
    except BrokenPipeError:  # whoever read the report left (prepare.py ... | head): stop without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
