"""
Tokenize tinyshakespeare with the GPT-2 BPE into llm.c token shards, and write llm.c's tokenizer file.

    python3 dev/data/tinyshakespeare.py                      # downloads the text and the BPE ranks
    python3 dev/data/tinyshakespeare.py --text ../shared/data/tinyshakespeare.txt \
                                        --ranks ../shared/data/gpt2.tiktoken   # offline

Writes dev/data/tinyshakespeare/tiny_shakespeare_{val,train}.bin and gpt2_tokenizer.bin (repo root).
Tokenization: the text is split into paragraphs on blank lines; each paragraph becomes <|endoftext|>
followed by the tokens of the paragraph plus the blank line ("\n\n"), so every paragraph starts a
document. The first 32768 tokens are the val split, the rest train. Needs: pip install tiktoken.
"""
import argparse
import hashlib
import os
import struct
import sys
import urllib.request

import tiktoken
import tiktoken.load

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SOURCES = {  # name: (url, sha256)
    "tinyshakespeare.txt": (
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"),
    "gpt2.tiktoken": (
        "https://raw.githubusercontent.com/openai/whisper/main/whisper/assets/gpt2.tiktoken",
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"),
}
# GPT-2's pre-tokenizer pattern (as in tiktoken's r50k/gpt2 encodings)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = 50256
VAL_TOKENS = 32768


def checked(path, name):
    """Return path after checking its sha256 against the known one."""
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    if digest != SOURCES[name][1]:
        sys.exit(f"error: {path}: sha256 {digest} is not the expected {SOURCES[name][1]}")
    return path


def fetch(name, cache):
    """Download a source into the cache folder (once) and return its path."""
    path = os.path.join(cache, name)
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        print(f"downloading {SOURCES[name][0]}")
        urllib.request.urlretrieve(SOURCES[name][0], path + ".part")
        os.replace(path + ".part", path)
    return path


def write_file(path, header, payload):
    """256 x int32 header then payload, written to path.tmp and renamed."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    header = header + [0] * (256 - len(header))
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(payload)
    os.replace(path + ".tmp", path)


def write_shard(path, tokens):
    assert all(0 <= t < 65536 for t in tokens)
    write_file(path, [20240520, 1, len(tokens)], struct.pack(f"<{len(tokens)}H", *tokens))
    print(f"wrote {path}: {len(tokens)} tokens")


def write_tokenizer(path, enc):
    """llm.c tokenizer file, version 2: per token one length byte and the token's bytes."""
    body = bytearray()
    for i in range(enc.n_vocab):
        b = enc.decode_single_token_bytes(i)
        assert len(b) < 256, f"token {i} is {len(b)} bytes"
        body += bytes([len(b)]) + b
    write_file(path, [20240328, 2, enc.n_vocab, EOT], bytes(body))
    print(f"wrote {path}: {enc.n_vocab} tokens")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", help="tinyshakespeare text (default: download)")
    ap.add_argument("--ranks", help="GPT-2 BPE ranks, tiktoken format (default: download)")
    ap.add_argument("--out", default=os.path.join(HERE, "tinyshakespeare"), help="shard folder")
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "gpt2_tokenizer.bin"), help="tokenizer file")
    ap.add_argument("--cache", default=os.path.join(HERE, ".cache"), help="download folder")
    args = ap.parse_args()

    text_path = checked(args.text or fetch("tinyshakespeare.txt", args.cache), "tinyshakespeare.txt")
    ranks_path = checked(args.ranks or fetch("gpt2.tiktoken", args.cache), "gpt2.tiktoken")
    enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN,
                            mergeable_ranks=tiktoken.load.load_tiktoken_bpe(ranks_path),
                            special_tokens={"<|endoftext|>": EOT})

    text = open(text_path, encoding="utf-8").read()
    tokens = []
    for paragraph in text.split("\n\n"):
        tokens.append(EOT)
        tokens.extend(enc.encode_ordinary(paragraph + "\n\n"))
    write_shard(os.path.join(args.out, "tiny_shakespeare_val.bin"), tokens[:VAL_TOKENS])
    write_shard(os.path.join(args.out, "tiny_shakespeare_train.bin"), tokens[VAL_TOKENS:])
    write_tokenizer(args.tokenizer, enc)


if __name__ == "__main__":
    main()
