#!/usr/bin/python3
"""Writes the malformed-input corpus to tests/data/malformed/ and its manifest.

Run with Debian's Python (onnx 1.12, numpy), with a built kiln:

    /usr/bin/python3 tools/make_malformed.py --kiln build/bin/kiln            # files + cases.json
    /usr/bin/python3 tools/make_malformed.py --kiln build/bin/kiln --record   # also manifest.json

Each case is a kiln command run in a copy of tests/data/malformed/ (after its setup
steps: symlinks out of the folder, a FIFO, a directory, a JSON file nested a million
levels deep, which git does not hold well). tests/e2e/malformed_corpus_test.cpp runs
every case of manifest.json and checks that stderr is exactly the one recorded line,
the exit code is the recorded one (1 or 2), and that the folder is byte-identical
afterwards (nothing created, nothing modified). --record runs the cases with the given
kiln and writes what it printed into manifest.json: review its diff as a golden file's
(every line must be one clear sentence about the input). The files are deterministic;
the checkpoint cases start from a checkpoint that kiln writes (--kiln).
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
OUT = os.path.join(ROOT, "tests", "data", "malformed")

CASES = []  # dicts: name, args, setup (list of steps)


def case(name, args, setup=()):
    assert all(c["name"] != name for c in CASES), name
    CASES.append({"name": name, "args": list(args), "setup": [list(s) for s in setup]})


def path(*p):
    return os.path.join(OUT, *p)


def write_bytes(rel, data):
    os.makedirs(os.path.dirname(path(rel)), exist_ok=True)
    with open(path(rel), "wb") as f:
        f.write(data)


def save_model(m, rel):
    write_bytes(rel, m.SerializeToString())


def model(nodes, inputs, outputs, inits=(), opset=17, extra_opsets=()):
    g = helper.make_graph(nodes, "g", list(inputs), list(outputs), initializer=list(inits))
    ops = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in extra_opsets]
    m = helper.make_model(g, opset_imports=ops, producer_name="make_malformed")
    m.ir_version = 8
    return m


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
LOGITS = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])


def weights():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((4, 3)) * 0.5).astype(np.float32), np.array([0.1, -0.2, 0.3], dtype=np.float32)


def mlp(W=None, b=None, nodes=None, inits=None, inputs=None, outputs=None, opset=17, extra_opsets=()):
    """logits = x @ W + b: x f32[batch, 4], W f32[4, 3], b f32[3]."""
    W0, b0 = weights()
    W = numpy_helper.from_array(W0 if W is None else W, "W") if not isinstance(W, TensorProto) else W
    b = numpy_helper.from_array(b0 if b is None else b, "b") if not isinstance(b, TensorProto) else b
    if nodes is None:
        nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="/fc/MatMul"),
                 helper.make_node("Add", ["h", "b"], ["logits"], name="/fc/Add")]
    return model(nodes, [X] if inputs is None else inputs, [LOGITS] if outputs is None else outputs,
                 [W, b] if inits is None else inits, opset, extra_opsets)


def train(m, *extra, data=("x=x.npy", "labels=labels.npy"), out="out", batch="4", steps="2"):
    args = ["train", m]
    for d in data:
        args += ["--train_data", d]
    return args + ["--per_device_train_batch_size", batch, "--max_steps", steps, "--output_dir", out] + list(extra)


def inspect(m):
    return ["inspect", m]


def npy_bytes(header_dict_text, payload, magic=b"\x93NUMPY", version=(1, 0)):
    h = header_dict_text.encode("latin1")
    pad = 64 - (10 + len(h) + 1) % 64
    h = h + b" " * pad + b"\n"
    return magic + bytes(version) + struct.pack("<H", len(h)) + h + payload


def external_tensor(name, location, offset="0", length=None, dims=(4, 3)):
    t = TensorProto()
    t.name = name
    t.data_type = TensorProto.FLOAT
    t.dims.extend(dims)
    t.data_location = TensorProto.EXTERNAL
    entries = [("location", location), ("offset", offset)]
    if length is not None:
        entries.append(("length", length))
    for k, v in entries:
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


# --------------------------------------------------------------------------- models
def make_models(kiln):
    base = mlp()
    save_model(base, "mlp.onnx")
    data = base.SerializeToString()
    # Truncations and bit flips of a valid model.
    for frac in (1, 10, 33, 50, 75, 90, 99):
        n = len(data) * frac // 100
        write_bytes(f"model/truncated_{frac:02d}.onnx", data[:n])
        case(f"truncated_{frac:02d}", train(f"model/truncated_{frac:02d}.onnx"))
    # Bit flips at seeded positions; kept are the first 8 that kiln refuses (a flip in a
    # weight's bytes is a valid model).
    rng = np.random.default_rng(36)
    kept = 0
    while kept < 8:
        b = bytearray(data)
        pos = int(rng.integers(0, len(b)))
        b[pos] ^= 1 << int(rng.integers(0, 8))
        write_bytes(f"model/bitflip_{kept}.onnx", bytes(b))
        r = subprocess.run([kiln, "inspect", f"model/bitflip_{kept}.onnx"], cwd=OUT, capture_output=True)
        if r.returncode != 0:
            case(f"bitflip_{kept}", train(f"model/bitflip_{kept}.onnx"))
            kept += 1
    write_bytes("model/empty.onnx", b"")
    case("empty_model", train("model/empty.onnx"))
    write_bytes("model/random.onnx", np.random.default_rng(7).integers(0, 256, 300, dtype=np.uint8).tobytes())
    case("random_model", train("model/random.onnx"))
    write_bytes("model/text.onnx", b"name: not a model\n")
    case("text_model", inspect("model/text.onnx"))

    W0, b0 = weights()
    # Wrong dtypes and shapes.
    save_model(mlp(W=W0.astype(np.int64)), "model/int_weight.onnx")
    case("int_weight", train("model/int_weight.onnx"))
    save_model(mlp(W=np.zeros((5, 3), np.float32)), "model/wrong_weight_shape.onnx")
    case("wrong_weight_shape", train("model/wrong_weight_shape.onnx"))
    t = numpy_helper.from_array(W0, "W")
    t.raw_data = t.raw_data[:-4]
    save_model(mlp(W=t), "model/short_raw_data.onnx")
    case("short_raw_data", train("model/short_raw_data.onnx"))
    t = helper.make_tensor("W", TensorProto.FLOAT, [4, 3], [1.0] * 12)
    del t.float_data[7:]
    save_model(mlp(W=t), "model/short_float_data.onnx")
    case("short_float_data", train("model/short_float_data.onnx"))
    t = TensorProto()
    t.name, t.data_type = "W", 1000
    t.dims.extend([4, 3])
    save_model(mlp(W=t), "model/unknown_dtype.onnx")
    case("unknown_dtype", train("model/unknown_dtype.onnx"))
    t = TensorProto()
    t.name, t.data_type = "W", TensorProto.FLOAT
    t.dims.extend([4, -3])
    save_model(mlp(W=t), "model/negative_dim.onnx")
    case("negative_dim", train("model/negative_dim.onnx"))
    t = TensorProto()
    t.name, t.data_type = "W", TensorProto.FLOAT
    t.dims.extend([2**40, 2**40])
    save_model(mlp(W=t), "model/huge_init_dims.onnx")
    case("huge_init_dims", inspect("model/huge_init_dims.onnx"))
    # NaN / Inf initializers.
    Wn = W0.copy()
    Wn[1, 2] = np.nan
    save_model(mlp(W=Wn), "model/nan_weight.onnx")
    case("nan_weight", train("model/nan_weight.onnx"))
    bi = b0.copy()
    bi[0] = np.inf
    save_model(mlp(b=bi), "model/inf_bias.onnx")
    case("inf_bias", train("model/inf_bias.onnx"))
    # Dims of 2^40: the element counts overflow int64.
    big = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2**40, 2**40])
    save_model(model([helper.make_node("Relu", ["x"], ["y"], name="/Relu")], [big],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2**40, 2**40])]), "model/dims_2e40.onnx")
    case("dims_2e40", inspect("model/dims_2e40.onnx"))
    big3 = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2**40, 2**40, 2**40])
    save_model(model([helper.make_node("Relu", ["x"], ["y"], name="/Relu")], [big3],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2**40, 2**40, 2**40])]),
               "model/dims_2e40_rank3.onnx")
    case("dims_2e40_rank3", inspect("model/dims_2e40_rank3.onnx"))
    shape = numpy_helper.from_array(np.array([2**31, 2**31], dtype=np.int64), "shape")
    save_model(model([helper.make_node("ConstantOfShape", ["shape"], ["huge"], name="/ConstantOfShape")], [],
                     [helper.make_tensor_value_info("huge", TensorProto.FLOAT, [2**31, 2**31])], [shape]),
               "model/huge_constant_of_shape.onnx")
    case("huge_constant_of_shape", inspect("model/huge_constant_of_shape.onnx"))

    # Negative and huge attribute values.
    def attr_model(rel, node, out_shape=None, extra_inits=()):
        W, b = weights()
        nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="/fc/MatMul"), node]
        save_model(mlp(nodes=nodes, inits=[numpy_helper.from_array(W, "W")] + list(extra_inits)), rel)

    attr_model("model/softmax_axis_100.onnx", helper.make_node("Softmax", ["h"], ["logits"], name="/Softmax", axis=100))
    case("softmax_axis_100", train("model/softmax_axis_100.onnx"))
    attr_model("model/softmax_axis_neg.onnx", helper.make_node("Softmax", ["h"], ["logits"], name="/Softmax",
                                                               axis=-(2**62)))
    case("softmax_axis_neg", train("model/softmax_axis_neg.onnx"))
    attr_model("model/transpose_perm_bad.onnx",
               helper.make_node("Transpose", ["h"], ["logits"], name="/Transpose", perm=[0, 5]))
    case("transpose_perm_bad", train("model/transpose_perm_bad.onnx"))
    attr_model("model/transpose_perm_dup.onnx",
               helper.make_node("Transpose", ["h"], ["logits"], name="/Transpose", perm=[1, 1]))
    case("transpose_perm_dup", train("model/transpose_perm_dup.onnx"))
    attr_model("model/concat_axis_huge.onnx",
               helper.make_node("Concat", ["h"], ["logits"], name="/Concat", axis=2**40))
    case("concat_axis_huge", train("model/concat_axis_huge.onnx"))
    attr_model("model/flatten_axis_neg.onnx",
               helper.make_node("Flatten", ["h"], ["logits"], name="/Flatten", axis=-9))
    case("flatten_axis_neg", train("model/flatten_axis_neg.onnx"))
    attr_model("model/gather_axis_7.onnx", helper.make_node("Gather", ["h", "i"], ["logits"], name="/Gather", axis=7),
               extra_inits=[numpy_helper.from_array(np.array([0, 1, 2], np.int64), "i")])
    case("gather_axis_7", train("model/gather_axis_7.onnx"))
    attr_model("model/reshape_minus2.onnx", helper.make_node("Reshape", ["h", "s"], ["logits"], name="/Reshape"),
               extra_inits=[numpy_helper.from_array(np.array([-2, 3], np.int64), "s")])
    case("reshape_minus2", train("model/reshape_minus2.onnx"))
    attr_model("model/reshape_two_minus1.onnx", helper.make_node("Reshape", ["h", "s"], ["logits"], name="/Reshape"),
               extra_inits=[numpy_helper.from_array(np.array([-1, -1], np.int64), "s")])
    case("reshape_two_minus1", train("model/reshape_two_minus1.onnx"))
    attr_model("model/split_negative.onnx",
               helper.make_node("Split", ["h", "sp"], ["logits", "rest"], name="/Split", axis=1),
               extra_inits=[numpy_helper.from_array(np.array([5, -2], np.int64), "sp")])
    case("split_negative", train("model/split_negative.onnx"))
    img = helper.make_tensor_value_info("img", TensorProto.FLOAT, [1, 1, 8, 8])
    p = helper.make_tensor_value_info("p", TensorProto.FLOAT, ["n", "c", "h", "w"])
    save_model(model([helper.make_node("MaxPool", ["img"], ["p"], name="/MaxPool", kernel_shape=[-2, 2])], [img], [p]),
               "model/maxpool_kernel_neg.onnx")
    case("maxpool_kernel_neg", inspect("model/maxpool_kernel_neg.onnx"))
    save_model(model([helper.make_node("MaxPool", ["img"], ["p"], name="/MaxPool", kernel_shape=[2**40, 2])], [img],
                     [p]), "model/maxpool_kernel_huge.onnx")
    case("maxpool_kernel_huge", inspect("model/maxpool_kernel_huge.onnx"))
    save_model(model([helper.make_node("AveragePool", ["img"], ["p"], name="/AveragePool", kernel_shape=[2, 2],
                                       pads=[-1, 0, 0, 0])], [img], [p]), "model/avgpool_pads_neg.onnx")
    case("avgpool_pads_neg", inspect("model/avgpool_pads_neg.onnx"))

    # Graph structure: cycles, duplicates, dangling names.
    save_model(mlp(nodes=[helper.make_node("MatMul", ["x", "W"], ["h"], name="/a"),
                          helper.make_node("Add", ["h", "c"], ["logits"], name="/b"),
                          helper.make_node("Relu", ["logits"], ["c"], name="/c")]), "model/cycle.onnx")
    case("cycle", train("model/cycle.onnx"))
    save_model(mlp(nodes=[helper.make_node("Add", ["x", "h"], ["h"], name="/self"),
                          helper.make_node("MatMul", ["h", "W"], ["logits"], name="/mm")]), "model/self_loop.onnx")
    case("self_loop", train("model/self_loop.onnx"))
    save_model(mlp(nodes=[helper.make_node("MatMul", ["x", "W"], ["h"], name="/a"),
                          helper.make_node("Relu", ["x"], ["h"], name="/dup"),
                          helper.make_node("Add", ["h", "b"], ["logits"], name="/b")]), "model/duplicate_output.onnx")
    case("duplicate_output", train("model/duplicate_output.onnx"))
    W, b = weights()
    save_model(mlp(inits=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(b, "b"),
                          numpy_helper.from_array(b + 1, "b")]), "model/duplicate_initializer.onnx")
    case("duplicate_initializer", train("model/duplicate_initializer.onnx"))
    save_model(mlp(inputs=[X, X]), "model/duplicate_input.onnx")
    case("duplicate_input", train("model/duplicate_input.onnx"))
    save_model(mlp(nodes=[helper.make_node("MatMul", ["x", "W"], ["h"], name="/a"),
                          helper.make_node("Add", ["h", "bias_missing"], ["logits"], name="/b")]),
               "model/undefined_input.onnx")
    case("undefined_input", train("model/undefined_input.onnx"))
    save_model(mlp(outputs=[helper.make_tensor_value_info("nowhere", TensorProto.FLOAT, ["batch", 3])]),
               "model/undefined_output.onnx")
    case("undefined_output", train("model/undefined_output.onnx"))
    save_model(mlp(outputs=[]), "model/no_outputs.onnx")
    case("no_outputs", train("model/no_outputs.onnx"))
    save_model(mlp(nodes=[helper.make_node("MatMul", ["x", "W"], ["h"], name="/a"),
                          helper.make_node("Add", ["h", "b"], ["logits", "extra"], name="/b")]),
               "model/extra_node_output.onnx")
    case("extra_node_output", train("model/extra_node_output.onnx"))
    # Ops and opsets.
    save_model(mlp(nodes=[helper.make_node("MatMul", ["x", "W"], ["h"], name="/a"),
                          helper.make_node("NoSuchOp", ["h", "b"], ["logits"], name="/b")]),
               "model/unsupported_op.onnx")
    case("unsupported_op", train("model/unsupported_op.onnx"))
    save_model(mlp(nodes=[helper.make_node("MatMul", ["x", "W"], ["h"], name="/a"),
                          helper.make_node("BiasGelu", ["h", "b"], ["logits"], name="/b", domain="com.microsoft")],
                   extra_opsets=[("com.microsoft", 1)]), "model/com_microsoft_op.onnx")
    case("com_microsoft_op", train("model/com_microsoft_op.onnx"))
    save_model(mlp(nodes=[helper.make_node("MatMul", ["x", "W"], ["h"], name="/a"),
                          helper.make_node("Foo", ["h", "b"], ["logits"], name="/b", domain="org.example")]),
               "model/custom_domain_no_opset.onnx")
    case("custom_domain_no_opset", train("model/custom_domain_no_opset.onnx"))
    save_model(mlp(opset=99), "model/opset_99.onnx")
    case("opset_99", train("model/opset_99.onnx"))
    m = mlp()
    del m.opset_import[:]
    save_model(m, "model/no_opset.onnx")
    case("no_opset", train("model/no_opset.onnx"))
    then_g = helper.make_graph([helper.make_node("Identity", ["b"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [3])])
    save_model(mlp(nodes=[helper.make_node("MatMul", ["x", "W"], ["h"], name="/a"),
                          helper.make_node("If", ["cond"], ["bb"], name="/If", then_branch=then_g, else_branch=then_g),
                          helper.make_node("Add", ["h", "bb"], ["logits"], name="/b")],
                   inits=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(b, "b"),
                          numpy_helper.from_array(np.array(True), "cond")]), "model/if_subgraph.onnx")
    case("if_subgraph", train("model/if_subgraph.onnx"))
    # A Gather whose index is computed (not a data input): out of range at step 1.
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"])
    emb = numpy_helper.from_array((np.arange(30, dtype=np.float32) / 30).reshape(10, 3), "emb")
    shift = numpy_helper.from_array(np.array(100, dtype=np.int64), "shift")
    save_model(model([helper.make_node("Add", ["ids", "shift"], ["j"], name="/Add"),
                      helper.make_node("Gather", ["emb", "j"], ["logits"], name="/Gather")], [ids],
                     [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], [emb, shift]),
               "model/gather_computed_index.onnx")
    np.save(path("ids.npy"), np.arange(8, dtype=np.int64) % 10)
    case("gather_index_at_step_1", train("model/gather_computed_index.onnx", data=("ids=ids.npy", "labels=labels.npy")))


# --------------------------------------------------------------------------- external data
def make_external():
    W0, _ = weights()
    os.makedirs(path("ext"), exist_ok=True)
    write_bytes("ext/weights.bin", b"\0" * 8 + W0.tobytes())
    write_bytes("ext/sub/weights.bin", W0.tobytes())
    write_bytes("sibling/weights.bin", W0.tobytes())

    def ext(rel, location, **kw):
        save_model(mlp(W=external_tensor("W", location, **kw)), rel)

    ext("ext/ok.onnx", "weights.bin", offset="8")  # the valid one: trains
    ext("ext/absolute.onnx", "/etc/passwd")
    case("ext_absolute", train("ext/absolute.onnx"))
    ext("ext/dotdot.onnx", "../sibling/weights.bin")
    case("ext_dotdot", train("ext/dotdot.onnx"))
    ext("ext/dotdot_inner.onnx", "sub/../../sibling/weights.bin")
    case("ext_dotdot_inner", train("ext/dotdot_inner.onnx"))
    ext("ext/symlink_passwd.onnx", "passwd_link.bin")
    case("ext_symlink_passwd", train("ext/symlink_passwd.onnx"), [["symlink", "ext/passwd_link.bin", "/etc/passwd"]])
    ext("ext/symlink_sibling.onnx", "sibling_link.bin")
    case("ext_symlink_sibling", train("ext/symlink_sibling.onnx"),
         [["symlink", "ext/sibling_link.bin", "../sibling/weights.bin"]])
    ext("ext/symlinked_folder.onnx", "linked_dir/weights.bin")
    case("ext_symlinked_folder", train("ext/symlinked_folder.onnx"), [["symlink", "ext/linked_dir", "../sibling"]])
    ext("ext/dangling.onnx", "dangling.bin")
    case("ext_dangling_symlink", train("ext/dangling.onnx"), [["symlink", "ext/dangling.bin", "no_such_target.bin"]])
    ext("ext/directory.onnx", "sub")
    case("ext_directory", train("ext/directory.onnx"))
    ext("ext/fifo.onnx", "pipe.bin")
    case("ext_fifo", train("ext/fifo.onnx"), [["fifo", "ext/pipe.bin"]])
    ext("ext/missing.onnx", "missing.bin")
    case("ext_missing", train("ext/missing.onnx"))
    ext("ext/offset_12abc.onnx", "weights.bin", offset="12abc")
    case("ext_offset_12abc", train("ext/offset_12abc.onnx"))
    ext("ext/offset_2p64.onnx", "weights.bin", offset=str(2**64 - 1))
    case("ext_offset_2p64", train("ext/offset_2p64.onnx"))
    ext("ext/offset_negative.onnx", "weights.bin", offset="-8")
    case("ext_offset_negative", train("ext/offset_negative.onnx"))
    ext("ext/offset_past_end.onnx", "weights.bin", offset="4096")
    case("ext_offset_past_end", train("ext/offset_past_end.onnx"))
    ext("ext/length_wrong.onnx", "weights.bin", offset="8", length="40")
    case("ext_length_wrong", train("ext/length_wrong.onnx"))
    ext("ext/length_past_end.onnx", "weights.bin", offset="8", length="4000")
    case("ext_length_past_end", train("ext/length_past_end.onnx"))
    ext("ext/no_location.onnx", "", offset="8")
    case("ext_no_location", train("ext/no_location.onnx"))


# --------------------------------------------------------------------------- data (.npy)
def make_data():
    rng = np.random.default_rng(1)
    np.save(path("x.npy"), rng.standard_normal((8, 4)).astype(np.float32))
    np.save(path("labels.npy"), (np.arange(8) % 3).astype(np.int64))
    payload = rng.standard_normal((8, 4)).astype(np.float32).tobytes()

    def npy(name, header, data=payload, **kw):
        write_bytes(f"npy/{name}.npy", npy_bytes(header, data, **kw))
        case(f"npy_{name}", train("mlp.onnx", data=(f"x=npy/{name}.npy", "labels=labels.npy")))

    npy("shape_lies_bigger", "{'descr': '<f4', 'fortran_order': False, 'shape': (100, 4), }")
    npy("shape_lies_smaller", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4), }")
    npy("dtype_lies_f8", "{'descr': '<f8', 'fortran_order': False, 'shape': (8, 4), }")
    npy("shape_2e40", "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 1099511627776), }")
    npy("shape_negative", "{'descr': '<f4', 'fortran_order': False, 'shape': (-8, 4), }")
    npy("fortran_order", "{'descr': '<f4', 'fortran_order': True, 'shape': (8, 4), }")
    npy("big_endian", "{'descr': '>f4', 'fortran_order': False, 'shape': (8, 4), }")
    npy("complex", "{'descr': '<c8', 'fortran_order': False, 'shape': (8, 2), }")
    npy("object", "{'descr': '|O', 'fortran_order': False, 'shape': (8, 4), }")
    npy("header_garbage", "{'descr': <f4 fortran_order shape (8, 4)")
    npy("bad_magic", "{'descr': '<f4', 'fortran_order': False, 'shape': (8, 4), }", magic=b"\x93NUMPX")
    npy("version_9", "{'descr': '<f4', 'fortran_order': False, 'shape': (8, 4), }", version=(9, 0))
    write_bytes("npy/truncated_header.npy", b"\x93NUMPY\x01\x00\xff\x00{'descr'")
    case("npy_truncated_header", train("mlp.onnx", data=("x=npy/truncated_header.npy", "labels=labels.npy")))
    np.save(path("npy/rank1.npy"), np.zeros(8, np.float32))
    case("npy_rank1", train("mlp.onnx", data=("x=npy/rank1.npy", "labels=labels.npy")))
    np.save(path("npy/five_features.npy"), np.zeros((8, 5), np.float32))
    case("npy_five_features", train("mlp.onnx", data=("x=npy/five_features.npy", "labels=labels.npy")))
    np.save(path("npy/labels_out_of_range.npy"), np.array([0, 1, 2, 3, 0, 1, 2, 7], np.int64))
    case("npy_labels_out_of_range", train("mlp.onnx", data=("x=x.npy", "labels=npy/labels_out_of_range.npy")))
    np.save(path("npy/labels_float.npy"), np.zeros(8, np.float32))
    case("npy_labels_float", train("mlp.onnx", data=("x=x.npy", "labels=npy/labels_float.npy")))
    np.save(path("npy/labels_short.npy"), np.zeros(5, np.int64))
    case("npy_labels_rows_differ", train("mlp.onnx", data=("x=x.npy", "labels=npy/labels_short.npy")))
    np.save(path("npy/x_nan.npy"), np.full((8, 4), np.nan, np.float32))
    case("npy_unknown_input", train("mlp.onnx", data=("x=x.npy", "labels=labels.npy", "y=npy/x_nan.npy")))
    case("npy_missing_file", train("mlp.onnx", data=("x=npy/no_such.npy", "labels=labels.npy")))
    case("npy_too_few_rows", train("mlp.onnx", batch="16"))


# --------------------------------------------------------------------------- config JSON
def make_config():
    def cfg(name, text, code_args=()):
        write_bytes(f"config/{name}.json", text.encode())
        case(f"config_{name}", train("mlp.onnx", "--config", f"config/{name}.json", *code_args))

    cfg("invalid", '{"learning_rate": 1e-3,')
    cfg("not_object", "[1, 2, 3]")
    cfg("empty", "")
    cfg("unknown_key", '{"learning_rat": 0.001}')
    cfg("wrong_type", '{"learning_rate": "fast"}')
    cfg("nested_value", '{"learning_rate": ' + "[" * 50 + "]" * 50 + "}")
    cfg("huge_int", '{"max_steps": 1000000000000000000000000}')
    cfg("negative_accumulation", '{"gradient_accumulation_steps": -4}')
    cfg("nan_lr", '{"learning_rate": NaN}')
    cfg("deep_200", "[" * 200 + "]" * 200)
    # A million levels (1 MB): written at test time.
    case("config_deep_million", train("mlp.onnx", "--config", "deep.json"), [["deep_json", "deep.json", 1000000]])


# --------------------------------------------------------------------------- checkpoints
def st_read(p):
    with open(p, "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8:8 + n]), b[8 + n:]


def st_write(p, header, data):
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def make_checkpoints(kiln):
    tmp = path("ckpt_run")  # relative, so that trainer_state.json's config is the same each time
    try:
        r = subprocess.run([kiln] + train("mlp.onnx", "--save_steps", "1", "--no_cache", out="ckpt_run", steps="1"),
                           cwd=OUT, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit("kiln train for the checkpoint failed:\n" + r.stderr)
        src = os.path.join(tmp, "checkpoint-1")
        # The step time is measured: a fixed value keeps the files the same on each run.
        sp = os.path.join(src, "trainer_state.json")
        j = json.load(open(sp))
        j["log_accumulators"]["time_sum"] = 0.01
        json.dump(j, open(sp, "w"), indent=1)
        names = sorted(os.listdir(src))

        def ck(name, mutate):
            d = path("ckpt", name)
            if os.path.exists(d):
                shutil.rmtree(d)
            shutil.copytree(src, d)
            mutate(d)
            case(f"ckpt_{name}", train("mlp.onnx", "--resume_from_checkpoint", f"ckpt/{name}"))

        def state(fn):
            def m(d):
                p = os.path.join(d, "trainer_state.json")
                j = json.load(open(p))
                fn(j)
                json.dump(j, open(p, "w"), indent=1)
            return m

        def tensors(fn, file="model.safetensors"):
            def m(d):
                p = os.path.join(d, file)
                h, data = st_read(p)
                data = fn(h, data)
                st_write(p, h, data)
            return m

        def drop_first(h, data):  # removes the tensor and its bytes
            k = sorted(x for x in h if x != "__metadata__")[0]
            b0, b1 = h.pop(k)["data_offsets"]
            for v in h.values():
                if isinstance(v, dict) and "data_offsets" in v and v["data_offsets"][0] >= b1:
                    v["data_offsets"] = [v["data_offsets"][0] - (b1 - b0), v["data_offsets"][1] - (b1 - b0)]
            return data[:b0] + data[b1:]

        def hole(h, data):  # removes the header entry only: a hole in the data area
            k = sorted(x for x in h if x != "__metadata__")[0]
            del h[k]
            return data

        def add_extra(h, data):
            h["extra.weight"] = {"dtype": "F32", "shape": [1], "data_offsets": [len(data), len(data) + 4]}
            return data + b"\0\0\0\0"

        def wrong_shape(h, data):
            k = sorted(x for x in h if x != "__metadata__")[0]
            n = h[k]["data_offsets"][1] - h[k]["data_offsets"][0]
            h[k]["shape"] = [n // 4]
            return data

        def wrong_dtype(h, data):
            k = sorted(x for x in h if x != "__metadata__")[0]
            h[k]["dtype"] = "I32"
            return data

        def bad_offsets(h, data):
            k = sorted(x for x in h if x != "__metadata__")[0]
            h[k]["data_offsets"] = [0, 10**12]
            return data

        ck("missing_tensor", tensors(drop_first))
        ck("hole_in_data", tensors(hole))
        ck("extra_tensor", tensors(add_extra))
        ck("wrong_shape", tensors(wrong_shape))
        ck("wrong_dtype", tensors(wrong_dtype))
        ck("bad_offsets", tensors(bad_offsets))
        ck("optimizer_missing_tensor", tensors(drop_first, "optimizer.safetensors"))
        ck("truncated_safetensors", lambda d: open(os.path.join(d, "model.safetensors"), "r+b").truncate(20))
        ck("no_model_file", lambda d: os.remove(os.path.join(d, "model.safetensors")))
        ck("no_trainer_state", lambda d: os.remove(os.path.join(d, "trainer_state.json")))
        ck("trainer_state_invalid", lambda d: open(os.path.join(d, "trainer_state.json"), "w").write("{\"global_step\""))
        ck("trainer_state_deep", lambda d: open(os.path.join(d, "trainer_state.json"), "w").write("[" * 5000))
        ck("position_beyond_epoch", state(lambda j: j["data"].update(batch_index=10**9)))
        ck("position_inconsistent", state(lambda j: j["data"].update(epoch=7)))
        ck("global_step_negative", state(lambda j: j.update(global_step=-3)))
        ck("global_step_past_total", state(lambda j: j.update(global_step=10**9)))
        ck("steps_per_epoch_differ", state(lambda j: j["data"].update(steps_per_epoch=5)))
        ck("seed_string", state(lambda j: j["data"].update(seed="x")))
        ck("safetensors_header_deep", lambda d: st_write_raw(os.path.join(d, "model.safetensors"), b"[" * 5000))
        case("ckpt_no_such_dir", train("mlp.onnx", "--resume_from_checkpoint", "ckpt/no_such"))
        case("ckpt_is_file", train("mlp.onnx", "--resume_from_checkpoint", "mlp.onnx"))
        case("ckpt_latest_none", train("mlp.onnx", "--resume_from_checkpoint", "latest"))
        del names
    finally:
        shutil.rmtree(tmp)


def st_write_raw(p, header_bytes):
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)


# --------------------------------------------------------------------------- variable-length data (issue 31)
def make_sequences():
    """A causal LM with a dynamic sequence axis (vocab 16: Gather -> MatMul) and JSON Lines /
    Megatron indexed datasets that are broken in one way each."""
    rng = np.random.default_rng(2)
    wte = numpy_helper.from_array((rng.standard_normal((16, 4)) * 0.1).astype(np.float32), "wte")
    head = numpy_helper.from_array((rng.standard_normal((4, 16)) * 0.1).astype(np.float32), "head")
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 16])
    save_model(model([helper.make_node("Gather", ["wte", "input_ids"], ["h"], name="/wte/Gather"),
                      helper.make_node("MatMul", ["h", "head"], ["logits"], name="/head/MatMul")],
                     [ids], [logits], [wte, head]), "seq/lm.onnx")
    good = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [1, 3, 5], [2, 4, 6, 8], [7, 7, 7]]

    def jsonl(name, text):
        write_bytes(f"seq/{name}.jsonl", text.encode())

    def seq_case(name, data, *extra):
        case(f"seq_{name}", train("seq/lm.onnx", *extra, data=(data,), batch="2"))

    jsonl("good", "".join(json.dumps({"input_ids": r}) + "\n" for r in good))
    jsonl("truncated", "".join(json.dumps({"input_ids": r}) + "\n" for r in good[:3]) + '{"input_ids": [1, 2, 3')
    seq_case("jsonl_truncated", "seq/truncated.jsonl")
    jsonl("not_integers", json.dumps({"input_ids": [1, 2]}) + "\n" + json.dumps({"input_ids": [1, "a", 3]}) + "\n")
    seq_case("jsonl_not_integers", "seq/not_integers.jsonl")
    jsonl("labels_length", json.dumps({"input_ids": [1, 2, 3], "labels": [1, 2]}) + "\n")
    seq_case("jsonl_labels_length", "seq/labels_length.jsonl")
    jsonl("out_of_vocab", "".join(json.dumps({"input_ids": r}) + "\n" for r in good[:4] + [[1, 99, 2]]))
    seq_case("token_out_of_vocab", "seq/out_of_vocab.jsonl")
    seq_case("pad_token_out_of_vocab", "seq/good.jsonl", "--pad_token_id", "16")
    seq_case("shape_mode_unknown", "seq/good.jsonl", "--shape_mode", "dynamic")
    seq_case("shape_buckets_descending", "seq/good.jsonl", "--shape_mode", "buckets", "--shape_buckets", "4,2")
    seq_case("shape_buckets_too_short", "seq/good.jsonl", "--shape_mode", "buckets", "--shape_buckets", "2,3")

    # Megatron-LM indexed dataset: "MMIDIDX\0\0", u64 version 1, u8 dtype (8: uint16), u64
    # sequences, u64 documents, i32 lengths, i64 byte offsets into .bin, i64 document indices.
    def indexed(name, rows, pointers=None, bin_cut=0):
        lengths = [len(r) for r in rows]
        ptrs = pointers or list(np.cumsum([0] + [2 * n for n in lengths[:-1]]))
        idx = (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(rows), len(rows) + 1) +
               np.array(lengths, np.int32).tobytes() + np.array(ptrs, np.int64).tobytes() +
               np.arange(len(rows) + 1, dtype=np.int64).tobytes())
        data = np.array([t for r in rows for t in r], np.uint16).tobytes()
        write_bytes(f"seq/{name}.idx", idx)
        write_bytes(f"seq/{name}.bin", data[:len(data) - bin_cut])

    indexed("bin_truncated", good, bin_cut=4)
    seq_case("idx_beyond_bin", "seq/bin_truncated.idx")
    indexed("pointer_past_end", good, pointers=[0, 8, 14, 24, 30, 4000])
    seq_case("idx_pointer_past_end", "seq/pointer_past_end.idx")


# --------------------------------------------------------------------------- output folders, kiln run
def make_misc():
    write_bytes("existing_out/notes.txt", b"a folder that existed before the run\n")
    case("existing_out_truncated_model", train("model/truncated_50.onnx", out="existing_out"))
    case("existing_out_bad_data", train("mlp.onnx", data=("x=npy/shape_lies_bigger.npy", "labels=labels.npy"),
                                        out="existing_out"))
    case("nested_out_bad_model", train("model/cycle.onnx", out="a/b/c/out"))
    case("run_bad_model", ["run", "model/truncated_50.onnx", "--input", "x=x.npy", "--output_dir", "run_out"])
    case("run_bad_input", ["run", "mlp.onnx", "--input", "x=npy/shape_lies_bigger.npy", "--output_dir", "run_out"])
    case("run_wrong_input_shape", ["run", "mlp.onnx", "--input", "x=npy/five_features.npy", "--output_dir", "run_out"])
    case("run_unknown_input", ["run", "mlp.onnx", "--input", "x=x.npy", "--input", "zz=x.npy", "--output_dir",
                               "run_out"])
    case("inspect_int_weight", inspect("model/int_weight.onnx"))
    case("out_is_file", train("mlp.onnx", out="mlp.onnx"))


def make_fuzz_findings():
    """Every input a fuzz target found (tests/data/fuzz_regressions) that kiln's command
    line reads: the ONNX models through kiln inspect, the --config JSON through kiln train."""
    reg = os.path.join(ROOT, "tests", "data", "fuzz_regressions")
    for f in sorted(os.listdir(os.path.join(reg, "onnx"))):
        with open(os.path.join(reg, "onnx", f), "rb") as src:
            write_bytes("fuzz/" + f, src.read())
        case("fuzz_" + f[:-len(".onnx")], inspect("fuzz/" + f))
    for f in sorted(os.listdir(os.path.join(reg, "config"))):
        with open(os.path.join(reg, "config", f), "rb") as src:
            write_bytes("fuzz/config_" + f, src.read())
        case("fuzz_config_" + f[:-len(".json")],
             ["train", "mlp.onnx", "--config", "fuzz/config_" + f, "--train_data", "x=x.npy", "--train_data",
              "labels=labels.npy", "--output_dir", "out"])


def record(kiln):
    """Runs every case as the test does and writes manifest.json."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    results = []
    bad = 0
    for c in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            work = os.path.join(tmp, "work")
            shutil.copytree(OUT, work, symlinks=True)
            os.remove(os.path.join(work, "manifest.json")) if os.path.exists(os.path.join(work, "manifest.json")) else None
            for s in c["setup"]:
                apply_setup(work, s)
            os.makedirs(os.path.join(work, ".cache"))
            env = dict(os.environ, KILN_CACHE_DIR=os.path.join(work, ".cache"), HOME=work)
            r = subprocess.run([kiln] + c["args"], cwd=work, capture_output=True, text=True, env=env)
            lines = r.stderr.splitlines()
            flag = "" if (len(lines) == 1 and r.returncode in (1, 2)) else "   <-- NOT ONE LINE / BAD EXIT"
            bad += bool(flag)
            print(f"{c['name']}: exit {r.returncode}: {r.stderr.strip()}{flag}")
            results.append(dict(c, stderr=lines[0] if len(lines) == 1 else r.stderr, exit=r.returncode))
    with open(path("manifest.json"), "w") as f:
        json.dump({"comment": "written by tools/make_malformed.py --record; checked by "
                              "tests/e2e/malformed_corpus_test.cpp", "cases": results}, f, indent=1)
        f.write("\n")
    print(f"{len(results)} cases, {bad} not one line with exit 1 or 2")


def apply_setup(work, s):
    kind = s[0]
    if kind == "symlink":
        os.symlink(s[2], os.path.join(work, s[1]))
    elif kind == "fifo":
        os.mkfifo(os.path.join(work, s[1]))
    elif kind == "deep_json":
        with open(os.path.join(work, s[1]), "w") as f:
            f.write("{\"a\":" * s[2] + "1" + "}" * s[2])
    else:
        raise ValueError(kind)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True, help="the kiln binary (writes the checkpoint the cases start from)")
    ap.add_argument("--record", action="store_true", help="run the cases and write manifest.json")
    a = ap.parse_args()
    kiln = os.path.abspath(a.kiln)
    keep = path("manifest.json")
    saved = open(keep).read() if os.path.exists(keep) else None
    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    if saved is not None:
        open(keep, "w").write(saved)
    make_data()
    make_models(kiln)
    make_external()
    make_config()
    make_misc()
    make_sequences()
    make_checkpoints(kiln)
    make_fuzz_findings()
    nfiles = sum(len(f) for _, _, f in os.walk(OUT))
    print(f"wrote {nfiles} files, {len(CASES)} cases to {OUT}")
    if a.record:
        record(kiln)


if __name__ == "__main__":
    main()
