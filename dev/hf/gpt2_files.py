"""
What export.py and import.py share: llm.c model files, safetensors files (read and written here, with
numpy alone), the names and layouts of Hugging Face's GPT2LMHeadModel, and GPT-2's byte-to-unicode map.

llm.c keeps each layer's tensors stacked over the layers, matrices as (out, in); Hugging Face keeps one
set of names per layer, and its Conv1D matrices as (in, out). Everything else is the same numbers.
"""
import json
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
    want = 1024 + sum(int(np.prod(s)) for s in shapes) * dtype.itemsize
    if size != want:
        raise FileError(f"{path}: {size} bytes, its header's shape needs {want}")
    flat = np.memmap(path, dtype=dtype, mode="r", offset=1024)
    tensors, off = [], 0
    for s in shapes:
        n = int(np.prod(s))
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


def read_safetensors(path):
    """{name: (dtype name, shape, loader)} of a safetensors file; each loader returns the tensor as float32
    (from F32, F16 or BF16), memory-mapped where it can be."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > size - 8:
                raise ValueError
            header = json.loads(f.read(n))
    except OSError as e:
        raise FileError(f"{path}: {e.strerror}") from None
    except (struct.error, ValueError, UnicodeDecodeError):
        raise FileError(f"{path}: not a safetensors file (bad header)") from None
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        dt = ST_DTYPES.get(t.get("dtype"))
        if dt is None:
            raise FileError(f"{path}: {name}: dtype {t.get('dtype')} (want F32, F16 or BF16)")
        begin, end = t["data_offsets"]
        shape = tuple(t["shape"])
        if end - begin != int(np.prod(shape)) * dt.itemsize or 8 + n + end > size:
            raise FileError(f"{path}: {name}: its data_offsets do not fit its shape or the file")

        def load(begin=begin, shape=shape, dt=dt, name=t["dtype"]):
            a = np.memmap(path, dtype=dt, mode="r", offset=8 + n + begin, shape=shape)
            return bf16_to_fp32(a) if name == "BF16" else a.astype("<f4", copy=False)

        out[name] = (t["dtype"], shape, load)
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
