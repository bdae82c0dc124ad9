#!/usr/bin/env python3
"""
Download HellaSwag and tokenize it into llm.c's eval file, for train_gpt --eval-hellaswag.

    python3 dev/data/hellaswag.py                                   # val split -> dev/data/hellaswag/hellaswag_val.bin
    python3 dev/data/hellaswag.py --jsonl hellaswag_val.jsonl       # offline, from a copy of the split
    ./train_gpt -e gpt2_124M.bin -x 0 --eval-hellaswag dev/data/hellaswag/hellaswag_val.bin

HellaSwag (Zellers et al. 2019, https://github.com/rowanz/hellaswag): each example is a context and 4
endings, one right. As llm.c's dev/data/hellaswag.py: the context is GPT-2's tokens of "ctx", each ending
the tokens of " " + ending (the space joins it to the context as GPT-2's tokenizer expects), no
<|endoftext|>. The file is llm.c's (its data_common.py write_evalfile), little-endian: a 256 x int32 header
[20240522, 1, examples, the longest example's bytes, 0...], then per example uint16s: 65535, the example's
bytes (these fields included), its index, the label, the number of endings (4), the context's length and
tokens, each ending's length and tokens. The val split is 10,042 examples; GPT-2 124M scores acc_norm
0.2955 on it in llm.c's completion style. Needs tiktoken (the GPT-2 BPE ranks ship in dev/data).
"""
import argparse
import array
import json
import os
import sys
import urllib.request

from prepare import PrepareError, gpt2_encoding, write_file

HERE = os.path.dirname(os.path.abspath(__file__))
URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{}.jsonl"
EVAL_MAGIC = 20240522


def fetch(split, cache):
    """The split's jsonl in the cache folder, downloaded once."""
    path = os.path.join(cache, f"hellaswag_{split}.jsonl")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        print(f"downloading {URL.format(split)}")
        urllib.request.urlretrieve(URL.format(split), path + ".part")
        os.replace(path + ".part", path)
    return path


def example_words(index, label, context, endings):
    """One example as llm.c's stream of uint16s."""
    words = [65535, 0, index, label, len(endings), len(context)] + context
    for ending in endings:
        words += [len(ending)] + ending
    assert all(0 <= w < 65536 for w in words), f"example {index}: a field does not fit in 16 bits"
    words[1] = 2 * len(words)
    assert words[1] < 65536, f"example {index} is too long for the format ({words[1]} bytes)"
    return words


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", default="val", choices=["train", "val"], help="which split [val] (test has no labels)")
    ap.add_argument("--jsonl", help="the split's jsonl file (default: download it)")
    ap.add_argument("--out", default=os.path.join(HERE, "hellaswag"), help="folder for the .bin and the download")
    args = ap.parse_args()
    try:
        enc = gpt2_encoding()
    except PrepareError as e:
        sys.exit(f"hellaswag.py: error: {e}")
    source = args.jsonl or fetch(args.split, args.out)
    stream, examples, longest, longest_row = array.array("H"), 0, 0, 0
    with open(source) as f:
        for line in f:
            ex = json.loads(line)
            context = enc.encode_ordinary(ex["ctx"])
            endings = [enc.encode_ordinary(" " + e) for e in ex["endings"]]
            words = example_words(examples, int(ex["label"]), context, endings)
            stream.extend(words)
            longest = max(longest, words[1])
            longest_row = max(longest_row, max(len(context) + len(e) for e in endings))
            examples += 1
    if sys.byteorder != "little":  # the format is little-endian
        stream.byteswap()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"hellaswag_{args.split}.bin")
    write_file(path, [EVAL_MAGIC, 1, examples, longest], stream.tobytes())
    print(f"wrote {path}: {examples} examples, the longest row {longest_row} tokens (context + ending; -t must hold it)")


if __name__ == "__main__":
    main()
