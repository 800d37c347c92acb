#!/usr/bin/python3
"""Writes the small ONNX fixtures of the frontend tests to tests/data/bad_models/.

Run with Debian's Python (it has onnx 1.12):  /usr/bin/python3 tools/make_bad_models.py
The output is deterministic (fixed seeds), so the committed files only change when this
script does. Fixtures:

  good_*.onnx    models that must import (built with onnx.helper; checked with
                 onnx.checker where libonnx knows the opset)
  bad_*.onnx     models/files that must fail with a specific one-line error
  *.bin          external-data files used by the external-data fixtures
  *.pb           single serialized TensorProtos (load_tensor_pb)

Value formulas used by good_dtypes.onnx (recomputed independently by the C++ test):
  element i of a float tensor   = (i - 3) * 0.5
  element i of an integer tensor = i - 3   (u8: i)
  element i of a bool tensor     = i % 2
"""
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "bad_models")


def save(model, name, check=True):
    if check:
        onnx.checker.check_model(model)
    path = os.path.join(OUT, name)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


def model(nodes, inputs, outputs, inits=(), opset=17, name="g"):
    g = helper.make_graph(nodes, name, list(inputs), list(outputs), initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="make_bad_models")
    m.ir_version = 8
    return m


def mlp(opset=17):
    """y = Relu(x @ W + b); x: f32[batch, 4]; b also listed as a graph input (old exporters)."""
    rng = np.random.default_rng(0)
    W = rng.standard_normal((4, 3)).astype(np.float32)
    b = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    Wt = numpy_helper.from_array(W, "W")  # raw_data
    bt = helper.make_tensor("b", TensorProto.FLOAT, [3], b.tolist())  # float_data
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"], name="/fc/MatMul"),
        helper.make_node("Add", ["xw", "b"], ["h"], name="/fc/Add"),
        helper.make_node("Relu", ["h"], ["y"], name="/act/Relu"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    b_in = helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    return model(nodes, [x, b_in], [y], [Wt, bt], opset=opset)


def dtypes_model():
    """No nodes: every initializer is a graph output. Typed fields and raw_data for each dtype."""
    inits, outs = [], []
    n = 6
    idx = np.arange(n)
    fl = (idx - 3) * 0.5
    it = idx - 3
    specs = [
        ("f32_typed", TensorProto.FLOAT, helper.make_tensor("f32_typed", TensorProto.FLOAT, [2, 3], fl.tolist())),
        ("f32_raw", TensorProto.FLOAT, numpy_helper.from_array(fl.astype(np.float32).reshape(2, 3), "f32_raw")),
        ("f64_typed", TensorProto.DOUBLE, helper.make_tensor("f64_typed", TensorProto.DOUBLE, [2, 3], fl.tolist())),
        ("f64_raw", TensorProto.DOUBLE, numpy_helper.from_array(fl.astype(np.float64).reshape(2, 3), "f64_raw")),
        ("i64_typed", TensorProto.INT64, helper.make_tensor("i64_typed", TensorProto.INT64, [2, 3], it.tolist())),
        ("i64_raw", TensorProto.INT64, numpy_helper.from_array(it.astype(np.int64).reshape(2, 3), "i64_raw")),
        ("i32_typed", TensorProto.INT32, helper.make_tensor("i32_typed", TensorProto.INT32, [2, 3], it.tolist())),
        ("i32_raw", TensorProto.INT32, numpy_helper.from_array(it.astype(np.int32).reshape(2, 3), "i32_raw")),
        ("i8_typed", TensorProto.INT8, helper.make_tensor("i8_typed", TensorProto.INT8, [2, 3], it.tolist())),
        ("i8_raw", TensorProto.INT8, numpy_helper.from_array(it.astype(np.int8).reshape(2, 3), "i8_raw")),
        ("u8_typed", TensorProto.UINT8, helper.make_tensor("u8_typed", TensorProto.UINT8, [2, 3], idx.tolist())),
        ("u8_raw", TensorProto.UINT8, numpy_helper.from_array(idx.astype(np.uint8).reshape(2, 3), "u8_raw")),
        ("bool_typed", TensorProto.BOOL,
         helper.make_tensor("bool_typed", TensorProto.BOOL, [2, 3], (idx % 2).astype(bool).tolist())),
        ("bool_raw", TensorProto.BOOL, numpy_helper.from_array((idx % 2).astype(bool).reshape(2, 3), "bool_raw")),
        # f16 typed: helper converts floats to uint16 bit patterns in int32_data
        ("f16_typed", TensorProto.FLOAT16, helper.make_tensor("f16_typed", TensorProto.FLOAT16, [2, 3], fl.tolist())),
        ("f16_raw", TensorProto.FLOAT16, numpy_helper.from_array(fl.astype(np.float16).reshape(2, 3), "f16_raw")),
        # bf16 typed: helper stores the bf16 bit patterns in int32_data
        ("bf16_typed", TensorProto.BFLOAT16,
         helper.make_tensor("bf16_typed", TensorProto.BFLOAT16, [2, 3], fl.tolist())),
        ("bf16_raw", TensorProto.BFLOAT16,
         helper.make_tensor("bf16_raw", TensorProto.BFLOAT16, [2, 3],
                            ((fl.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)).tobytes(), raw=True)),
        ("scalar_f32", TensorProto.FLOAT, helper.make_tensor("scalar_f32", TensorProto.FLOAT, [], [2.5])),
        ("empty_i64", TensorProto.INT64, helper.make_tensor("empty_i64", TensorProto.INT64, [0], [])),
    ]
    for name, dt, t in specs:
        assert t.data_type == dt
        inits.append(t)
        dims = list(t.dims)
        outs.append(helper.make_tensor_value_info(name, dt, dims))
    return model([], [], outs, inits)


def constants_model():
    """Constant nodes of every supported form feed Adds: y = x + c_tensor + c_float; z = c_ints + c_int."""
    nodes = [
        helper.make_node("Constant", [], ["c_tensor"], name="/Constant",
                         value=helper.make_tensor("v", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])),
        helper.make_node("Constant", [], ["c_float"], name="/Constant_1", value_float=0.25),
        helper.make_node("Constant", [], ["c_floats"], name="/Constant_2", value_floats=[1.5, -2.5]),
        helper.make_node("Constant", [], ["c_int"], name="/Constant_3", value_int=7),
        helper.make_node("Constant", [], ["c_ints"], name="/Constant_4", value_ints=[1, 2, 3]),
        helper.make_node("Add", ["x", "c_tensor"], ["t"], name="/Add"),
        helper.make_node("Add", ["t", "c_float"], ["y"], name="/Add_1"),
        helper.make_node("Add", ["c_ints", "c_int"], ["z"], name="/Add_2"),
        helper.make_node("Identity", ["c_floats"], ["w"], name="/Identity"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    return model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
                              helper.make_tensor_value_info("z", TensorProto.INT64, [3]),
                              helper.make_tensor_value_info("w", TensorProto.FLOAT, [2])])


def shape_fold_model(opset=17):
    """The reshape subgraph PyTorch exports for x.view(B, -1) and a mask built from the shape:
    s = Shape(x); B = Gather(s, 0); T = Gather(s, 1); BT = Mul(B, T);
    shp = Concat(Unsqueeze(B, [0]), [-1]); y = Reshape(x, shp)          -> f32[B, T*8]
    n = Cast(BT, float); z = Mul(y, n)                                   -> y * (B*T)
    """
    i64 = lambda name, v: numpy_helper.from_array(np.array(v, dtype=np.int64), name)
    inits = [i64("zero", 0), i64("one", 1), i64("axes0", [0]), i64("minus1", [-1])]
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="/Shape"),
        helper.make_node("Gather", ["s", "zero"], ["B"], name="/Gather", axis=0),
        helper.make_node("Gather", ["s", "one"], ["T"], name="/Gather_1", axis=0),
        helper.make_node("Mul", ["B", "T"], ["BT"], name="/Mul"),
        helper.make_node("Unsqueeze", ["B", "axes0"], ["B1"], name="/Unsqueeze"),
        helper.make_node("Concat", ["B1", "minus1"], ["shp"], name="/Concat", axis=0),
        helper.make_node("Reshape", ["x", "shp"], ["y"], name="/Reshape"),
        helper.make_node("Cast", ["BT"], ["n"], name="/Cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["y", "n"], ["z"], name="/Mul_1"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", None])
    return model(nodes, [x], [z], inits, opset=opset)


def external_model(location, fname, write_bin=True):
    """W (f32[2, 3], values 0..5) stored as external data at `location`, offset 8."""
    W = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = TensorProto()
    t.name = "W"
    t.data_type = TensorProto.FLOAT
    t.dims.extend([2, 3])
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "8"), ("length", str(W.nbytes))):
        e = t.external_data.add()
        e.key, e.value = k, v
    if write_bin:
        with open(os.path.join(OUT, location), "wb") as f:
            f.write(b"\x00" * 8 + W.tobytes())
    nodes = [helper.make_node("Add", ["x", "W"], ["y"], name="/Add")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    return save(model(nodes, [x], [y], [t]), fname, check=False)


def torch_fixture():
    """A tiny causal-attention model exported by PyTorch (opset 17, dynamic batch/seq), so the
    file holds the shape subgraphs PyTorch emits (Shape/Gather/Unsqueeze/Concat/Reshape, Range,
    ConstantOfShape, Trilu, Equal, Where, ...). Also writes the input and PyTorch's output for
    batch=2, seq=5 as TensorProto files (torch_tiny_input_0.pb / torch_tiny_output_0.pb)."""
    import math

    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.pos = nn.Embedding(32, 8)
            self.fc = nn.Linear(8, 4)

        def forward(self, idx):  # idx: i64[batch, seq]
            B, T = idx.shape
            pos = torch.arange(T, dtype=torch.long)
            h = self.emb(idx) + self.pos(pos)                    # (B, T, 8)
            mask = torch.tril(torch.ones(T, T)).view(1, T, T)
            att = (h @ h.transpose(1, 2)) / math.sqrt(h.size(-1))
            att = att.masked_fill(mask == 0, float("-inf")).softmax(-1)
            return self.fc(att @ h).view(B * T, -1)              # (B*T, 4)

    torch.manual_seed(0)
    m = Tiny().eval()
    idx = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    path = os.path.join(OUT, "good_torch_tiny.onnx")
    torch.onnx.export(m, (idx,), path, opset_version=17, input_names=["idx"], output_names=["y"],
                      dynamic_axes={"idx": {0: "batch", 1: "seq"}, "y": {0: "batch_seq"}})
    with torch.no_grad():
        y = m(idx).numpy().astype(np.float32)
    for name, arr in (("torch_tiny_input_0.pb", idx.numpy()), ("torch_tiny_output_0.pb", y)):
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(numpy_helper.from_array(arr, name.split("_")[2]).SerializeToString())
    onnx.checker.check_model(onnx.load(path))


def main():
    os.makedirs(OUT, exist_ok=True)
    # ---- models that must import ----
    good = save(mlp(), "good_mlp.onnx")
    # W of good_mlp as a standalone serialized TensorProto (ONNX backend-test format)
    with open(os.path.join(OUT, "good_mlp_W.pb"), "wb") as f:
        f.write(next(t for t in mlp().graph.initializer if t.name == "W").SerializeToString())
    save(mlp(opset=18), "good_mlp_opset18.onnx", check=False)  # libonnx 1.12 does not know opset 18
    save(dtypes_model(), "good_dtypes.onnx")
    save(constants_model(), "good_constants.onnx")
    save(shape_fold_model(), "good_shape_fold.onnx")
    external_model("good_external.bin", "good_external.onnx")
    torch_fixture()

    # ---- files that are not (complete) ONNX models ----
    data = open(good, "rb").read()
    with open(os.path.join(OUT, "bad_truncated.onnx"), "wb") as f:
        f.write(data[: len(data) // 2])
    with open(os.path.join(OUT, "bad_random.onnx"), "wb") as f:
        f.write(np.random.default_rng(1234).integers(0, 256, 512, dtype=np.uint8).tobytes())
    with open(os.path.join(OUT, "bad_text.onnx"), "w") as f:
        f.write("this is a text file, not an ONNX model\nversion: 1\n")
    open(os.path.join(OUT, "bad_empty.onnx"), "wb").close()

    # ---- models with a specific problem ----
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    save(model([helper.make_node("Relu", ["x"], ["h"], name="/layer/Relu"),
                helper.make_node("Foo", ["h"], ["y"], name="/layer/Foo_3")], [x], [y]),
         "bad_unsupported_op.onnx", check=False)
    save(model([helper.make_node("FusedMatMul", ["x", "x"], ["y"], name="/fused", domain="com.microsoft")],
               [x], [y]), "bad_custom_domain.onnx", check=False)
    save(model([helper.make_node("Add", ["x", "w_missing"], ["y"], name="/Add")], [x], [y]),
         "bad_missing_initializer.onnx", check=False)
    relu = [helper.make_node("Relu", ["x"], ["y"], name="/Relu")]
    save(model(relu, [x], [y], opset=12), "bad_opset12.onnx", check=False)
    save(model(relu, [x], [y], opset=29), "bad_opset29.onnx", check=False)
    external_model("/tmp/kiln_weights.bin", "bad_external_absolute.onnx", write_bin=False)
    external_model("../secret/weights.bin", "bad_external_dotdot.onnx", write_bin=False)
    external_model("missing_weights.bin", "bad_external_missing.onnx", write_bin=False)
    # A subgraph attribute (If): kiln does not support control flow.
    then_g = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3])])
    cond = numpy_helper.from_array(np.array(True), "cond")
    save(model([helper.make_node("If", ["cond"], ["y"], name="/If", then_branch=then_g, else_branch=then_g)],
               [x], [y], [cond]), "bad_subgraph.onnx", check=False)
    # A graph-valued attribute on an op kiln knows (opset 18: no libonnx checker in front).
    save(model([helper.make_node("Relu", ["x"], ["y"], name="/Relu", body=then_g)], [x], [y], opset=18),
         "bad_graph_attribute.onnx", check=False)
    # Passes kiln's own checks but not libonnx's checker (unknown attribute on Relu).
    save(model([helper.make_node("Relu", ["x"], ["y"], name="/Relu", foo=1)], [x], [y]),
         "bad_checker.onnx", check=False)
    # Opset 18 (no libonnx checker): kiln's own inference must catch the shape mismatch.
    w = numpy_helper.from_array(np.zeros((4, 5), dtype=np.float32), "w")
    save(model([helper.make_node("MatMul", ["x", "w"], ["y"], name="/MatMul")], [x],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])], [w], opset=18),
         "bad_shape_mismatch.onnx", check=False)
    # Window attributes of 0: libonnx's conv/pool shape inference divides by the stride
    # (SIGFPE, before kiln's own check), so the importer checks them first.
    img = helper.make_tensor_value_info("img", TensorProto.FLOAT, [1, 1, 8, 8])
    pooled = helper.make_tensor_value_info("p", TensorProto.FLOAT, None)
    save(model([helper.make_node("MaxPool", ["img"], ["p"], name="/MaxPool", kernel_shape=[2, 2], strides=[0, 0])],
               [img], [pooled]), "bad_pool_stride0.onnx", check=False)
    wc = numpy_helper.from_array(np.zeros((2, 1, 3, 3), dtype=np.float32), "wc")
    save(model([helper.make_node("Conv", ["img", "wc"], ["p"], name="/Conv", strides=[1, 0])], [img], [pooled], [wc]),
         "bad_conv_stride0.onnx", check=False)
    # A tensor whose byte count overflows 64 bits (kiln run wrote a header-only .npy).
    shape = numpy_helper.from_array(np.array([2**31, 2**31], dtype=np.int64), "shape")
    huge = helper.make_tensor_value_info("huge", TensorProto.FLOAT, [2**31, 2**31])
    save(model([helper.make_node("ConstantOfShape", ["shape"], ["huge"], name="/ConstantOfShape")], [], [huge],
               [shape]), "bad_huge_constant.onnx", check=False)
    # A token model whose sequence length is symbolic: --block_size binds it.
    idx = helper.make_tensor_value_info("input", TensorProto.INT64, ["batch", "seq"])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 256])
    rng = np.random.RandomState(5)
    emb = numpy_helper.from_array((rng.randn(256, 16) * 0.1).astype(np.float32), "emb")
    head = numpy_helper.from_array((rng.randn(16, 256) * 0.1).astype(np.float32), "head")
    save(model([helper.make_node("Gather", ["emb", "input"], ["h"], name="/Gather"),
                helper.make_node("MatMul", ["h", "head"], ["logits"], name="/MatMul")], [idx], [logits], [emb, head]),
         "good_tokens_dynamic_seq.onnx")
    # A bias named 'labels' (the default label input): the labels were fed into it and
    # replaced the trained values. Also an input named like kiln's token-count input.
    x64 = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 64])
    out10 = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])
    w10 = numpy_helper.from_array((rng.randn(64, 10) * 0.1).astype(np.float32), "W")
    b10 = numpy_helper.from_array(np.zeros(10, dtype=np.float32), "labels")
    save(model([helper.make_node("MatMul", ["input", "W"], ["h"], name="/MatMul"),
                helper.make_node("Add", ["h", "labels"], ["logits"], name="/Add")], [x64], [out10], [w10, b10]),
         "bad_labels_initializer.onnx")
    nib = helper.make_tensor_value_info("num_items_in_batch", TensorProto.FLOAT, ["batch", 64])
    save(model([helper.make_node("MatMul", ["num_items_in_batch", "W"], ["logits"], name="/MatMul")], [nib], [out10],
               [w10]), "bad_num_items_input.onnx")
    # A scalar output: mse labels take its shape [], which no rows of data can fill.
    scal = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [])
    save(model([helper.make_node("MatMul", ["input", "W"], ["h"], name="/MatMul"),
                helper.make_node("ReduceSum", ["h"], ["logits"], name="/ReduceSum", keepdims=0)], [x64], [scal], [w10]),
         "bad_scalar_output.onnx")
    # A second head the loss does not reach (its weight gets no gradient, and no decay).
    aux = numpy_helper.from_array((rng.randn(64, 3) * 0.1).astype(np.float32), "aux.weight")
    save(model([helper.make_node("MatMul", ["input", "W"], ["logits"], name="/MatMul"),
                helper.make_node("MatMul", ["input", "aux.weight"], ["aux"], name="/MatMul_1")], [x64],
               [out10, helper.make_tensor_value_info("aux", TensorProto.FLOAT, ["batch", 3])], [w10, aux]),
         "good_unused_head.onnx")
    print("wrote fixtures to", os.path.normpath(OUT))


if __name__ == "__main__":
    main()
