#!/usr/bin/env python3
"""Selects the ONNX backend node tests of newer ONNX releases that kiln's suite runs
(tests/data/onnx_node/), next to Debian's libonnx-testdata (ONNX 1.12, opsets <= 17).
Run by tools/make_onnx_node_tests.sh, which provides the sources:

  onnx-1.17   the node test data shipped in PyPI's onnx 1.17.0 wheel (opsets <= 22);
  onnx-1.23   the node test cases of PyPI's onnx 1.23 (this venv), generated here from
              onnx.backend.test.case.node (newer wheels ship the generators, not the data):
              each case at its op's newest version (opsets <= 28).

A case is kept when every node is an op of the default domain that kiln imports (`kiln ops
--names`), its graph inputs and outputs are tensors of dtypes kiln has, and no case of the
same name whose nodes have the same ONNX op versions is already in Debian's data or in an
earlier-kept source (onnx-1.23 first, then onnx-1.17): a case at opset 28 of an op that has
not changed since opset 13 tests nothing Debian's does not. Cases over 100 kB (3-D pooling
and loss cases whose ops changed only their type constraints) are left out, counted. The schema history of every default-domain op is also
written (tests/data/onnx_schema_versions.json: tests/frontend/onnx_versions_test.cpp).

Usage: select_onnx_node_tests.py --ops FILE --onnx117 DIR --out DIR
"""
import argparse
import json
import os
import shutil
import tempfile

import onnx
from onnx import TensorProto, defs, numpy_helper

DEBIAN = "/usr/share/libonnx-testdata/data/node"
KILN_DTYPES = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT8,
               TensorProto.INT32, TensorProto.INT64, TensorProto.UINT8, TensorProto.BOOL}


MAX_CASE_BYTES = 100_000


def folder_bytes(d):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def opset_of(m):
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return -1


def op_versions(m):
    """The ONNX schema version each node's op has at the model's opset: a case tests the
    same thing as another when the versions are the same."""
    opset = opset_of(m)
    out = set()
    for n in m.graph.node:
        try:
            out.add((n.op_type, defs.get_schema(n.op_type, opset, "").since_version))
        except Exception:  # not a default-domain op of this release
            out.add((n.op_type, -1))
    return tuple(sorted(out))


def supported(m, ops):
    for n in m.graph.node:
        if n.domain not in ("", "ai.onnx") or n.op_type not in ops:
            return False
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            return False
    for vi in list(m.graph.input) + list(m.graph.output):
        if not vi.type.HasField("tensor_type") or vi.type.tensor_type.elem_type not in KILN_DTYPES:
            return False
    return True


def generate_onnx123(out):
    """Writes the node cases of this onnx release as test folders (as cmd_tools does for models)."""
    import onnx.backend.test.case.node as node_test
    for case in node_test.collect_testcases():
        d = os.path.join(out, case.name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "model.onnx"), "wb") as f:
            f.write(case.model.SerializeToString())
        for i, (inputs, outputs) in enumerate(case.data_sets):
            ds = os.path.join(d, f"test_data_set_{i}")
            os.makedirs(ds, exist_ok=True)
            for kind, values, vis in (("input", inputs, case.model.graph.input),
                                      ("output", outputs, case.model.graph.output)):
                for j, v in enumerate(values):
                    if not vis[j].type.HasField("tensor_type"):
                        continue  # sequences, optionals and maps: such cases are not kept
                    t = v if isinstance(v, TensorProto) else numpy_helper.from_array(v, vis[j].name)
                    with open(os.path.join(ds, f"{kind}_{j}.pb"), "wb") as f:
                        f.write(t.SerializeToString())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", required=True, help="file with kiln's importable ops, one per line")
    ap.add_argument("--onnx117", required=True, help="onnx/backend/test/data/node of the onnx 1.17.0 wheel")
    ap.add_argument("--out", required=True, help="tests/data/onnx_node")
    ap.add_argument("--schemas", required=True, help="tests/data/onnx_schema_versions.json")
    a = ap.parse_args()
    ops = set(open(a.ops).read().split())
    seen = set()
    for name in os.listdir(DEBIAN):
        p = os.path.join(DEBIAN, name, "model.onnx")
        if os.path.exists(p):
            seen.add((name, op_versions(onnx.load(p))))
    if os.path.exists(a.out):
        shutil.rmtree(a.out)
    with tempfile.TemporaryDirectory() as tmp:
        gen = os.path.join(tmp, "onnx-1.23")
        generate_onnx123(gen)
        for label, src in (("onnx-1.23", gen), ("onnx-1.17", a.onnx117)):
            kept = skipped_large = 0
            for name in sorted(os.listdir(src)):
                d = os.path.join(src, name)
                if not os.path.exists(os.path.join(d, "model.onnx")):
                    continue
                m = onnx.load(os.path.join(d, "model.onnx"))
                key = (name, op_versions(m))
                if key in seen or not supported(m, ops):
                    continue
                if folder_bytes(d) > MAX_CASE_BYTES:  # large 3-D pooling / loss cases of older ops
                    skipped_large += 1
                    continue
                seen.add(key)
                shutil.copytree(d, os.path.join(a.out, label, name))
                kept += 1
            print(f"{label}: {kept} node tests kept ({skipped_large} larger than {MAX_CASE_BYTES} bytes left out)")
    allv = {}
    for s in defs.get_all_schemas_with_history():
        if s.domain == "":
            allv.setdefault(s.name, set()).add(s.since_version)
    with open(a.schemas, "w") as f:
        json.dump({"onnx_version": onnx.__version__, "max_opset": defs.onnx_opset_version(),
                   "ops": {k: sorted(v) for k, v in sorted(allv.items())}}, f, indent=0)


if __name__ == "__main__":
    main()
