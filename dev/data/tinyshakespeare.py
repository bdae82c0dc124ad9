"""
Tokenize tinyshakespeare with the GPT-2 BPE into llm.c token shards, and write llm.c's tokenizer file.

    python3 dev/data/tinyshakespeare.py                                                # downloads the text
    python3 dev/data/tinyshakespeare.py --text ../shared/data/tinyshakespeare.txt     # offline

Writes dev/data/tinyshakespeare/tiny_shakespeare_{val,train}.bin and gpt2_tokenizer.bin (repo root).
Tokenization: the text is split into paragraphs on blank lines; each paragraph becomes <|endoftext|>
followed by the tokens of the paragraph plus the blank line ("\n\n"), so every paragraph starts a
document. The first 32768 tokens are the val split, the rest train. The text is checked against its
sha256; the encoding and the file writers are prepare.py's (the BPE ranks shipped in dev/data).
Needs: pip install tiktoken.
"""
import argparse
import hashlib
import os
import sys
import urllib.request

from prepare import EOT, PrepareError, gpt2_encoding, write_file, write_shard

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SOURCES = {  # name: (url, sha256)
    "tinyshakespeare.txt": (
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"),
}
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
    ap.add_argument("--out", default=os.path.join(HERE, "tinyshakespeare"), help="shard folder")
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "gpt2_tokenizer.bin"), help="tokenizer file")
    ap.add_argument("--cache", default=os.path.join(HERE, ".cache"), help="download folder")
    args = ap.parse_args()

    text_path = checked(args.text or fetch("tinyshakespeare.txt", args.cache), "tinyshakespeare.txt")
    try:
        enc = gpt2_encoding()
    except PrepareError as e:
        sys.exit(f"error: {e}")

    text = open(text_path, encoding="utf-8").read()
    tokens = []
    for paragraph in text.split("\n\n"):
        tokens.append(EOT)
        tokens.extend(enc.encode_ordinary(paragraph + "\n\n"))
    os.makedirs(args.out, exist_ok=True)
    for name, part in (("tiny_shakespeare_val.bin", tokens[:VAL_TOKENS]),
                       ("tiny_shakespeare_train.bin", tokens[VAL_TOKENS:])):
        write_shard(os.path.join(args.out, name), part)
        print(f"wrote {os.path.join(args.out, name)}: {len(part)} tokens")
    write_tokenizer(args.tokenizer, enc)


if __name__ == "__main__":
    main()
