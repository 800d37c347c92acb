#!/usr/bin/python3
"""Prepares kiln's real training data sets from files a Debian 12 machine has.

(a) digits: sklearn.datasets.load_digits() (1797 8x8 grayscale handwritten digits,
    shipped inside python3-sklearn, no network). Seeded 80/20 train/eval split
    (numpy default_rng(0) permutation), pixels scaled to [0, 1] by /16.
      digits/x_train.npy      f32 [N, 64]       (MLP input)
      digits/y_train.npy      i64 [N]
      digits/x_eval.npy, digits/y_eval.npy
      digits/x_train_img.npy  f32 [N, 1, 8, 8]  (CNN input; same rows)
      digits/x_eval_img.npy
      digits/x_train_rgb32.npy f32 [N, 3, 32, 32] (ResNet input: each pixel repeated
      digits/x_eval_rgb32.npy                     4x4 (nearest upsampling), gray copied
                                                  to 3 channels)
(b) text: the Jargon File 4.4.7 (public domain, Eric S. Raymond), plain English prose,
    1.68 MB, from the Debian package `jargon-text`
    (/usr/share/doc/jargon-text/jargon.txt.gz; listed in tools/install_deps.sh).
    Byte-level tokens (vocab 256: token = byte value of the UTF-8 text), split 90/10
    in file order, written nanoGPT-style as a flat little-endian uint16 stream:
      text/train.bin, text/val.bin, text/meta.json (vocab_size, counts, source)
(c) text as variable-length sequences (issue 31), the same bytes cut into rows:
      sentences: each paragraph (below) split after '.', '!' or '?' followed by
                 whitespace (the whitespace dropped);
      paragraphs: blocks separated by blank lines, each block's lines stripped and
                 joined with one space (the text's line wrapping undone);
    empty rows dropped; tokens = the UTF-8 bytes of a row (vocab 256, as text/train.bin);
    the first 90% of the rows (file order) train, the rest eval. Each set is written in
    both formats kiln reads (runtime/sequences.h):
      text/{sentences,paragraphs}_{train,eval}.jsonl     JSON Lines, one
          {"input_ids": [int, ...]} object per line (Hugging Face pre-tokenized rows)
      text/{sentences,paragraphs}_{train,eval}.{idx,bin} Megatron-LM indexed dataset
          (megatron/core/datasets/indexed_dataset.py, as GPT-NeoX and nanotron read it):
          PREFIX.bin holds the tokens of all rows back to back in the index dtype;
          PREFIX.idx, little-endian: b"MMIDIDX\x00\x00", u64 version 1, u8 dtype code
          (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16;
          here 8, Megatron's choice below 65500 ids), u64 sequence count S, u64
          document count D, int32 lengths[S], int64 byte offsets into .bin[S], int64
          document indices[D] (0, then the end of each document: each row is one
          document here, so 0, 1, ..., S)
    and the length statistics (count, tokens, mean, p50, p90, max) of each set, and of
    all sentences and all paragraphs, are printed and stored under "sequences" in
    text/meta.json.

Test fixtures: tools/prepare_data.py --test_fixtures tests/data/seq writes the small
files of kiln's sequence-reader tests (tests/runtime/sequences_test.cpp) with this
independent writer (numpy, struct) instead of the data sets: a few rows in the indexed
format (uint16 and int32 dtypes, several rows per document) and as JSONL (with and
without labels), and expected.json, the token lists they hold.

Usage: tools/prepare_data.py [--out data/]   (idempotent: skips files already written
with the same content; takes a few seconds)
       tools/prepare_data.py --test_fixtures DIR
"""
import argparse
import gzip
import json
import os
import re
import struct
import sys

import numpy as np

JARGON = "/usr/share/doc/jargon-text/jargon.txt.gz"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "data")
SPLIT_SEED = 0


def _save_npy(path, arr):
    """Writes arr unless an identical file already exists (idempotence)."""
    if os.path.exists(path):
        try:
            old = np.load(path)
            if old.dtype == arr.dtype and old.shape == arr.shape and np.array_equal(old, arr):
                return
        except Exception:
            pass
    tmp = path + ".tmp.npy"
    np.save(tmp, arr)
    os.replace(tmp, path)


def _save_bytes(path, data):
    if os.path.exists(path):
        with open(path, "rb") as f:
            if f.read() == data:
                return
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def digits_arrays():
    """Returns dict name -> array of the digits split (deterministic)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data.astype(np.float32) / 16.0).astype(np.float32)  # [1797, 64]
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_train = int(round(0.8 * len(x)))
    tr, ev = perm[:n_train], perm[n_train:]
    out = {}
    for split, idx in (("train", tr), ("eval", ev)):
        xs = np.ascontiguousarray(x[idx])
        img = xs.reshape(-1, 1, 8, 8)
        rgb = np.repeat(np.repeat(img, 4, axis=2), 4, axis=3)  # [N,1,32,32]
        rgb = np.ascontiguousarray(np.repeat(rgb, 3, axis=1))  # [N,3,32,32]
        out["x_%s" % split] = xs
        out["y_%s" % split] = np.ascontiguousarray(y[idx])
        out["x_%s_img" % split] = np.ascontiguousarray(img)
        out["x_%s_rgb32" % split] = rgb
    return out


def prepare_digits(out):
    d = os.path.join(out, "digits")
    os.makedirs(d, exist_ok=True)
    arrs = digits_arrays()
    for k, v in arrs.items():
        _save_npy(os.path.join(d, k + ".npy"), v)
    meta = {
        "source": "sklearn.datasets.load_digits (python3-sklearn)",
        "split": "numpy.random.default_rng(%d).permutation, first 80%% train" % SPLIT_SEED,
        "scale": "pixel / 16 -> [0, 1]",
        "n_train": int(len(arrs["y_train"])),
        "n_eval": int(len(arrs["y_eval"])),
        "num_classes": 10,
    }
    _save_bytes(os.path.join(d, "meta.json"), (json.dumps(meta, indent=2) + "\n").encode())
    return meta


def text_tokens():
    """Byte-level tokens of the Jargon File as uint16, split 90/10 (train, val)."""
    if not os.path.exists(JARGON):
        sys.exit("prepare_data: %s not found; install the Debian package jargon-text "
                 "(tools/install_deps.sh)" % JARGON)
    with gzip.open(JARGON, "rb") as f:
        raw = f.read()
    toks = np.frombuffer(raw, dtype=np.uint8).astype("<u2")
    n = len(toks)
    n_train = int(n * 0.9)
    return toks[:n_train], toks[n_train:], len(raw)


def prepare_text(out):
    d = os.path.join(out, "text")
    os.makedirs(d, exist_ok=True)
    train, val, nbytes = text_tokens()
    _save_bytes(os.path.join(d, "train.bin"), train.tobytes())
    _save_bytes(os.path.join(d, "val.bin"), val.tobytes())
    meta = {
        "source": "The Jargon File 4.4.7 (public domain), Debian package jargon-text, " + JARGON,
        "tokenizer": "bytes of the UTF-8 text, token = byte value",
        "vocab_size": 256,
        "dtype": "uint16 little-endian, flat stream (nanoGPT .bin)",
        "split": "first 90% of the stream train, last 10% val",
        "source_bytes": nbytes,
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
        "sequences": prepare_sequences(out),
    }
    _save_bytes(os.path.join(d, "meta.json"), (json.dumps(meta, indent=2) + "\n").encode())
    return meta


# Megatron-LM's indexed dataset (megatron/core/datasets/indexed_dataset.py): index magic
# and the dtype codes of its DType enum.
MMIDIDX = b"MMIDIDX\x00\x00"
MMIDIDX_DTYPES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7,
                  "uint16": 8}
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def jargon_paragraphs():
    """The Jargon File's paragraphs: blank-line separated blocks, wrapping joined."""
    with gzip.open(JARGON, "rb") as f:
        text = f.read().decode("utf-8")
    paras = []
    for block in re.split(r"\n[ \t]*\n", text):
        p = " ".join(line.strip() for line in block.split("\n") if line.strip())
        if p:
            paras.append(p)
    return paras


def jargon_sentences(paras):
    """Each paragraph split after '.', '!' or '?' followed by whitespace."""
    return [s for p in paras for s in SENTENCE_END.split(p) if s.strip()]


def indexed_bytes(rows, dtype, documents=None):
    """(idx, bin) bytes of a Megatron indexed dataset holding `rows` (lists of ints).

    As Megatron's IndexedDatasetBuilder writes them: tokens back to back in `dtype`,
    pointers = byte offsets of each row, document indices [0] + the end of each document
    (`documents`: number of rows per document; default one row per document)."""
    dt = np.dtype(dtype).newbyteorder("<")
    item = dt.itemsize
    lengths = [len(r) for r in rows]
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * item
    doc_idx, end = [0], 0
    for n in documents or [1] * len(rows):
        end += n
        doc_idx.append(end)
    assert end == len(rows)
    data = b"".join(np.asarray(r, dtype=dt).tobytes() for r in rows)
    idx = MMIDIDX + struct.pack("<Q", 1) + struct.pack("<B", MMIDIDX_DTYPES[np.dtype(dtype).name])
    idx += struct.pack("<Q", len(rows)) + struct.pack("<Q", len(doc_idx))
    idx += np.asarray(lengths, dtype="<i4").tobytes() + np.asarray(pointers, dtype="<i8").tobytes()
    idx += np.asarray(doc_idx, dtype="<i8").tobytes()
    return idx, data


def jsonl_bytes(rows, labels=None):
    """JSON Lines text: one {"input_ids": [...]} (and "labels") object per row."""
    lines = []
    for i, r in enumerate(rows):
        obj = {"input_ids": [int(t) for t in r]}
        if labels is not None:
            obj["labels"] = [int(t) for t in labels[i]]
        lines.append(json.dumps(obj))
    return ("\n".join(lines) + "\n").encode()


def length_stats(rows):
    n = np.array([len(r) for r in rows], dtype=np.int64)
    return {
        "count": int(len(n)),
        "tokens": int(n.sum()),
        "mean": round(float(n.mean()), 2),
        "p50": round(float(np.percentile(n, 50)), 2),
        "p90": round(float(np.percentile(n, 90)), 2),
        "max": int(n.max()),
    }


def prepare_sequences(out):
    """Writes the sentence and paragraph sets in both formats; returns their statistics."""
    if not os.path.exists(JARGON):
        sys.exit("prepare_data: %s not found; install the Debian package jargon-text "
                 "(tools/install_deps.sh)" % JARGON)
    d = os.path.join(out, "text")
    os.makedirs(d, exist_ok=True)
    paras = jargon_paragraphs()
    stats = {}
    for kind, texts in (("sentences", jargon_sentences(paras)), ("paragraphs", paras)):
        rows = [list(t.encode("utf-8")) for t in texts]
        n_train = int(len(rows) * 0.9)
        stats[kind] = length_stats(rows)  # both splits together
        for split, part in (("train", rows[:n_train]), ("eval", rows[n_train:])):
            name = "%s_%s" % (kind, split)
            idx, data = indexed_bytes(part, np.uint16)
            _save_bytes(os.path.join(d, name + ".bin"), data)
            _save_bytes(os.path.join(d, name + ".idx"), idx)
            _save_bytes(os.path.join(d, name + ".jsonl"), jsonl_bytes(part))
            stats[name] = length_stats(part)
    return stats


def write_test_fixtures(d):
    """The sequence-reader test fixtures (tests/data/seq): small indexed and JSONL files
    written here, independently of kiln's writers, and expected.json with their rows."""
    os.makedirs(d, exist_ok=True)
    # 5 rows, one of them empty (the readers allow length 0), ids up to 255; two documents.
    five = [[72, 105, 33], [0], [84, 104, 101, 32, 101, 110, 100, 46], [], [255, 1, 2, 3, 65499, 7]]
    labels = [[-100, 105, 33], [-100], [-100, -100, 101, 32, 101, 110, 100, 46], [], [255, 1, 2, 3, -100, 7]]
    # ids that need int32 (Megatron writes int32 from 65500 on).
    wide = [[65500, 1, 2147483647], [70000], [5, 100000, 65535, 0]]
    idx, data = indexed_bytes(five, np.uint16, documents=[2, 3])
    _save_bytes(os.path.join(d, "five_u16.idx"), idx)
    _save_bytes(os.path.join(d, "five_u16.bin"), data)
    idx, data = indexed_bytes(wide, np.int32)
    _save_bytes(os.path.join(d, "wide_i32.idx"), idx)
    _save_bytes(os.path.join(d, "wide_i32.bin"), data)
    _save_bytes(os.path.join(d, "five.jsonl"), jsonl_bytes(five))
    # With labels, "\r\n" line ends, a blank line and an extra key.
    text = jsonl_bytes(five, labels).decode().rstrip("\n").split("\n")
    text.insert(2, "")
    text[0] = text[0][:-1] + ', "text": "Hi!"}'
    _save_bytes(os.path.join(d, "five_labels.jsonl"), ("\r\n".join(text) + "\r\n").encode())
    expected = {
        "five": five,
        "five_labels": labels,
        "five_labels_lines": [1, 2, 4, 5, 6],
        "wide": wide,
    }
    _save_bytes(os.path.join(d, "expected.json"), (json.dumps(expected) + "\n").encode())


def prepare(out=DEFAULT_OUT, quiet=True):
    """Prepares the data sets under `out`; returns their meta dicts."""
    m1 = prepare_digits(out)
    m2 = prepare_text(out)
    if not quiet:
        print("digits: %d train / %d eval -> %s/digits" % (m1["n_train"], m1["n_eval"], out))
        print("text: %d train / %d val tokens -> %s/text" % (m2["train_tokens"], m2["val_tokens"], out))
        for name, st in m2["sequences"].items():
            files = "text/%s.{jsonl,idx,bin}" % name if "_" in name else "all %s" % name
            print("%s: %d rows, %d tokens, length mean %.1f p50 %g p90 %g max %d" %
                  (files, st["count"], st["tokens"], st["mean"], st["p50"], st["p90"], st["max"]))
    return m1, m2


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: <repo>/data)")
    ap.add_argument("--test_fixtures", metavar="DIR",
                    help="write only the sequence-reader test fixtures into DIR (tests/data/seq)")
    args = ap.parse_args()
    if args.test_fixtures:
        write_test_fixtures(args.test_fixtures)
        print("sequence test fixtures -> %s" % args.test_fixtures)
        return
    prepare(args.out, quiet=False)


if __name__ == "__main__":
    main()
