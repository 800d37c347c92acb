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

Usage: tools/prepare_data.py [--out data/]   (idempotent: skips files already written
with the same content; takes about a second)
"""
import argparse
import gzip
import json
import os
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
    }
    _save_bytes(os.path.join(d, "meta.json"), (json.dumps(meta, indent=2) + "\n").encode())
    return meta


def prepare(out=DEFAULT_OUT, quiet=True):
    """Prepares both data sets under `out`; returns their meta dicts."""
    m1 = prepare_digits(out)
    m2 = prepare_text(out)
    if not quiet:
        print("digits: %d train / %d eval -> %s/digits" % (m1["n_train"], m1["n_eval"], out))
        print("text: %d train / %d val tokens -> %s/text" % (m2["train_tokens"], m2["val_tokens"], out))
    return m1, m2


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: <repo>/data)")
    args = ap.parse_args()
    prepare(args.out, quiet=False)


if __name__ == "__main__":
    main()
