#!/usr/bin/env python3
"""Writes the bitsandbytes dynamic quantization maps as .npy fixtures for
tests/runtime/adamw8bit_test.cpp (bitsandbytes is not installed here; its
create_dynamic_map is copied verbatim below, computed with torch in float32).

    /usr/bin/python3 tools/make_optim8bit_fixtures.py  # -> tests/data/optim8bit/*.npy
"""
import os

import numpy as np
import torch


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """bitsandbytes.functional.create_dynamic_map (bitsandbytes 0.41, verbatim logic)."""
    data = []
    # these are additional items that come from the case
    # where all the exponent bits are zero and no
    # indicator bit is present
    non_sign_bits = total_bits - (1 if signed else 1)
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(
            2 ** (i + non_sign_bits - max_exponent_bits) + 1
            if signed
            else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        )
        boundaries = torch.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    assert len(data) == 2 ** total_bits
    gap = 256 - len(data)
    for i in range(gap):
        data.append(0)
    data.sort()
    return torch.Tensor(data)


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "optim8bit")
    os.makedirs(out, exist_ok=True)
    for signed, name in ((True, "signed"), (False, "unsigned")):
        m = create_dynamic_map(signed).numpy().astype(np.float32)
        np.save(os.path.join(out, "bnb_dynamic_map_%s.npy" % name), m)
        print(name, m.shape, m.min(), m.max())


if __name__ == "__main__":
    main()
