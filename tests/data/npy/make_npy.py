#!/usr/bin/python3
"""Writes the small .npy fixtures that tests/runtime/io_test.cpp reads (run once, committed).

Good files: one per dtype, values = np.arange(6).reshape(2, 3) cast to the dtype and then
(floats) * 0.5 - 1; bool = arange % 2 == 1. Plus a scalar, an empty array, a 1-D array and a
format 2.0 file. Bad files: fortran order, big-endian, truncated data, bad magic, bad header,
unsupported dtype (uint16), trailing bytes.
"""
import os

import numpy as np
from numpy.lib import format as npf

D = os.path.dirname(os.path.abspath(__file__))
base = np.arange(6).reshape(2, 3)
for code in ["f4", "f8", "f2", "i8", "i4", "i1", "u1"]:
    a = base.astype(code)
    if a.dtype.kind == "f":
        a = a * a.dtype.type(0.5) - a.dtype.type(1)
    np.save(os.path.join(D, "good_%s.npy" % code), a)
np.save(os.path.join(D, "good_b1.npy"), base % 2 == 1)
np.save(os.path.join(D, "scalar_f8.npy"), np.float64(3.25))
np.save(os.path.join(D, "empty_f4.npy"), np.zeros((0, 3), np.float32))
np.save(os.path.join(D, "vec_i8.npy"), np.array([-5, 7, 1 << 40], np.int64))
with open(os.path.join(D, "v2_f4.npy"), "wb") as f:
    npf.write_array(f, (base.astype(np.float32) * 0.5 - 1), version=(2, 0))
np.save(os.path.join(D, "bad_fortran.npy"), np.asfortranarray(base.astype(np.float32)))
np.save(os.path.join(D, "bad_bigendian.npy"), base.astype(">f4"))
np.save(os.path.join(D, "bad_u2.npy"), base.astype(np.uint16))
raw = open(os.path.join(D, "good_f4.npy"), "rb").read()
open(os.path.join(D, "bad_truncated.npy"), "wb").write(raw[:-5])
open(os.path.join(D, "bad_trailing.npy"), "wb").write(raw + b"\0\0\0\0")
open(os.path.join(D, "bad_magic.npy"), "wb").write(b"\x93NUMPX" + raw[6:])
open(os.path.join(D, "bad_header.npy"), "wb").write(raw[:10] + raw[10:].replace(b"'shape'", b"'shapf'"))
open(os.path.join(D, "bad_short.npy"), "wb").write(raw[:9])
