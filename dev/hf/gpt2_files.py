"""
What export.py and import.py share: llm.c model files, safetensors files (read and written here, with
numpy alone), the names and layouts of Hugging Face's GPT2LMHeadModel, and GPT-2's byte-to-unicode map.

llm.c keeps each layer's tensors stacked over the layers, matrices as (out, in); Hugging Face keeps one
set of names per layer, and its Conv1D matrices as (in, out). Everything else is the same numbers.
"""
import json
import math
import os
import struct

import numpy as np

MODEL_MAGIC = 20240326
# llm.c's 16 tensors in file order: (name in this file, Hugging Face name with {l} for the layer, whether
# it is a Conv1D matrix stored transposed). wte's row count is the padded vocabulary in llm.c, the real one
# in Hugging Face.
TENSORS = [
    ("wte", "transformer.wte.weight", False),
    ("wpe", "transformer.wpe.weight", False),
    ("ln1w", "transformer.h.{l}.ln_1.weight", False),
    ("ln1b", "transformer.h.{l}.ln_1.bias", False),
    ("qkvw", "transformer.h.{l}.attn.c_attn.weight", True),
    ("qkvb", "transformer.h.{l}.attn.c_attn.bias", False),
    ("attprojw", "transformer.h.{l}.attn.c_proj.weight", True),
    ("attprojb", "transformer.h.{l}.attn.c_proj.bias", False),
    ("ln2w", "transformer.h.{l}.ln_2.weight", False),
    ("ln2b", "transformer.h.{l}.ln_2.bias", False),
    ("fcw", "transformer.h.{l}.mlp.c_fc.weight", True),
    ("fcb", "transformer.h.{l}.mlp.c_fc.bias", False),
    ("fcprojw", "transformer.h.{l}.mlp.c_proj.weight", True),
    ("fcprojb", "transformer.h.{l}.mlp.c_proj.bias", False),
    ("lnfw", "transformer.ln_f.weight", False),
    ("lnfb", "transformer.ln_f.bias", False),
]


class FileError(Exception):
    """Bad input, reported as one line that names the file."""


def write_whole(out, write):
    """write(f) into OUT.tmp, then renamed to OUT: the file is whole or absent (OUT.tmp removed on any failure,
    an OSError reported as a FileError naming the file)."""
    tmp = out + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, out)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise FileError(f"{e.filename or out}: {e.strerror}") from None
        raise


def llmc_shapes(maxT, L, C, Vp):
    """The shapes of llm.c's 16 tensors, in file order."""
    return [(Vp, C), (maxT, C), (L, C), (L, C), (L, 3 * C, C), (L, 3 * C), (L, C, C), (L, C),
            (L, C), (L, C), (L, 4 * C, C), (L, 4 * C), (L, C, 4 * C), (L, C), (C,), (C,)]


def padded_vocab(V):
    """llm.c pads the vocabulary to a multiple of 128 (50257 -> 50304)."""
    return (V + 127) // 128 * 128


def read_llmc(path):
    """(config, tensors) of an llm.c model file: config has maxT, V, L, NH, C, Vp and version (3: fp32,
    5: bf16); tensors are memory-mapped arrays in file order, float32 for version 3 and uint16 (bf16
    bit patterns) for version 5."""
    try:
        with open(path, "rb") as f:
            header = f.read(1024)
        size = os.path.getsize(path)
    except OSError as e:
        raise FileError(f"{path}: {e.strerror}") from None
    if len(header) < 1024:
        raise FileError(f"{path}: not an llm.c model file (shorter than its 1024-byte header)")
    magic, version, maxT, V, L, NH, C, Vp = struct.unpack("<8i", header[:32])
    if magic == MODEL_MAGIC and version == 6:
        raise FileError(f"{path}: a mixture of experts (llmpar's version 6): GPT-2 in Hugging Face's form has no experts")
    if magic != MODEL_MAGIC or version not in (3, 5):
        raise FileError(f"{path}: not an llm.c model file (magic {magic}, version {version}; "
                        f"want {MODEL_MAGIC}, version 3 or 5)")
    if min(maxT, V, L, NH, C) <= 0 or C % NH or Vp < V:
        raise FileError(f"{path}: bad shape in the header (maxT {maxT} V {V} L {L} NH {NH} C {C} Vp {Vp})")
    shapes = llmc_shapes(maxT, L, C, Vp)
    dtype = np.dtype("<f4") if version == 3 else np.dtype("<u2")
    want = 1024 + sum(math.prod(s) for s in shapes) * dtype.itemsize
    if size != want:
        raise FileError(f"{path}: {size} bytes, its header's shape needs {want}")
    flat = np.memmap(path, dtype=dtype, mode="r", offset=1024)
    tensors, off = [], 0
    for s in shapes:
        n = math.prod(s)
        tensors.append(flat[off:off + n].reshape(s))
        off += n
    return dict(version=version, maxT=maxT, V=V, L=L, NH=NH, C=C, Vp=Vp), tensors


def llmc_header(cfg):
    """The 256-int32 header of an fp32 (version 3) llm.c model file."""
    h = [MODEL_MAGIC, 3, cfg["maxT"], cfg["V"], cfg["L"], cfg["NH"], cfg["C"], cfg["Vp"]]
    return struct.pack("<256i", *h, *[0] * (256 - len(h)))


def bf16_bits(x32):
    """fp32 to bf16 by rounding to nearest, ties to even (as dev/ref/gpt2_ref.py): the 16-bit patterns."""
    u = np.ascontiguousarray(x32, dtype="<f4").view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def bf16_to_fp32(bits):
    """bf16 patterns to the fp32 values they stand for (exact)."""
    return (np.asarray(bits, dtype=np.uint32) << 16).view("<f4")


# safetensors: 8 bytes of little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
# then the raw little-endian tensors (offsets relative to the end of the header).
ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


def write_safetensors(path, tensors, dtype):
    """tensors: (name, array) pairs, arrays already in dtype ("F32": float32, "BF16": uint16 patterns).
    The metadata format "pt" is what transformers asks of the files it loads."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, a in tensors:
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as the safetensors library writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, a in tensors:
            f.write(np.ascontiguousarray(a).tobytes())


def show(x, limit=60):
    """A value as a one-line message shows it: its repr (which escapes line breaks), cut to limit."""
    s = repr(x)
    return s if len(s) <= limit else s[:limit] + "..."


def show_name(name):
    """A name as a one-line message shows it: as it is when printable, else as show gives it."""
    return name if isinstance(name, str) and name.isprintable() and len(name) <= 200 else show(name)


class _Duplicate(Exception):
    pass


def _unique_keys(pairs):
    seen = set()
    for k, _ in pairs:
        if k in seen:
            raise _Duplicate(k)
        seen.add(k)
    return dict(pairs)


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(path, text, what=""):
    """text (bytes or str) as strict JSON: no NaN or Infinity, no key twice in an object (json would keep
    the last silently); else one line naming path."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except _Duplicate as e:
        raise FileError(f"{path}: {show_name(e.args[0])} is named twice") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise FileError(f"{path}: {what}not JSON ({' '.join(str(e).split())[:80]})") from None
    except RecursionError:
        raise FileError(f"{path}: {what}not JSON (nested too deep)") from None


def read_json(path):
    """The strict JSON in the file at path (parse_json); a file that cannot be read is one line too."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise FileError(f"{path}: {e.strerror}") from None
    return parse_json(path, text)


def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def check_safetensors_header(path, header, data_size):
    """{name: (dtype name, shape, begin)} of a parsed safetensors header, after checking every field
    against the data_size bytes after it, before any tensor byte is read: each entry an object with a known
    dtype, a shape of non-negative integers and data_offsets [begin, end] with 0 <= begin <= end <= data_size
    and end - begin = the bytes of dtype x shape; the tensors tile the data exactly, as the safetensors
    library writes and demands (no overlap, no byte of no tensor). Else one line naming path and the cause."""
    if not isinstance(header, dict):
        raise FileError(f"{path}: its header is a JSON {type(header).__name__}, not an object of tensors")
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            if not isinstance(t, dict):
                raise FileError(f"{path}: __metadata__ is {show(t)}, not an object")
            continue
        if not isinstance(t, dict):
            raise FileError(f"{path}: {show_name(name)}: {show(t)}, not an object with dtype, shape and data_offsets")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in t:
                raise FileError(f"{path}: {show_name(name)}: no {key}")
        dtype, shape, offsets = t["dtype"], t["shape"], t["data_offsets"]
        if not isinstance(dtype, str) or dtype not in ST_DTYPES:
            raise FileError(f"{path}: {show_name(name)}: dtype {show(dtype)} (want F32, F16 or BF16)")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise FileError(f"{path}: {show_name(name)}: shape {show(shape)} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_int, offsets))
                and 0 <= offsets[0] <= offsets[1]):
            raise FileError(f"{path}: {show_name(name)}: data_offsets {show(offsets)} are not [begin, end] "
                            f"with 0 <= begin <= end")
        begin, end = offsets
        if end > data_size:
            raise FileError(f"{path}: {show_name(name)}: data_offsets [{begin}, {end}] end beyond the file's "
                            f"{data_size} bytes of data")
        need = math.prod(shape) * ST_DTYPES[dtype].itemsize
        if end - begin != need:
            raise FileError(f"{path}: {show_name(name)}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                            f"its {dtype} shape {tuple(shape)} needs {need}")
        out[name] = (dtype, tuple(shape), begin)
    at, prev = 0, None  # the tensors in data order: each begins where the one before ends
    for name, (begin, end) in sorted(((k, tuple(header[k]["data_offsets"])) for k in out), key=lambda kv: kv[1]):
        if begin < at:
            raise FileError(f"{path}: {show_name(name)}'s data [{begin}, {end}] overlaps {show_name(prev)}'s, which ends at {at}")
        if begin > at:
            raise FileError(f"{path}: bytes [{at}, {begin}) of the data belong to no tensor")
        at, prev = end, name
    if at != data_size:
        raise FileError(f"{path}: bytes [{at}, {data_size}) of the data belong to no tensor")
    return out


def read_safetensors(path):
    """{name: (dtype name, shape, loader)} of a safetensors file, its header checked whole
    (check_safetensors_header) before any tensor byte is read; each loader returns the tensor as float32
    (from F32, F16 or BF16), memory-mapped where it can be."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FileError(f"{path}: {size} bytes, not a safetensors file (its header's length alone is 8)")
            n = struct.unpack("<Q", head)[0]
            if n > size - 8:
                raise FileError(f"{path}: header length {n} is beyond the file's {size} bytes")
            text = f.read(n)
    except OSError as e:
        raise FileError(f"{path}: {e.strerror}") from None
    tensors = check_safetensors_header(path, parse_json(path, text, "its header is "), size - 8 - n)
    out = {}
    for name, (dtype, shape, begin) in tensors.items():
        def load(begin=begin, shape=shape, dtype=dtype):
            a = np.memmap(path, dtype=ST_DTYPES[dtype], mode="r", offset=8 + n + begin, shape=shape)
            return bf16_to_fp32(a) if dtype == "BF16" else a.astype("<f4", copy=False)

        out[name] = (dtype, shape, load)
    return out


def bytes_to_unicode():
    """GPT-2's map of the 256 bytes to printable characters (as in its encoder.py): vocab.json and
    merges.txt spell tokens with it, so that no token holds a space or a control character."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
