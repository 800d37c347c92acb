#!/usr/bin/python3
"""Exports kiln's example models to ONNX (examples/<name>/) with seeded random weights.

Models (all PyTorch modules defined here; make_fixtures.py imports them):
  mlp_digits   64 -> 128 -> 64 -> 10, ReLU                     input f32 [batch, 64]
  cnn_bn       (Conv3x3-BN-ReLU-MaxPool2) x2 (16, 32 ch), Linear  input f32 [batch, 1, 8, 8]
  tiny_gpt     nanoGPT-style byte-level GPT: vocab 256, block 64, 2 layers, 4 heads,
               n_embd 64, pre-LayerNorm, causal mask (bool buffer + Where), GELU (erf),
               dropout 0.1, lm_head weight tied to the token embedding
                                                             input i64 [batch, 64]
  resnet18     torchvision's ResNet-18 layout (BasicBlock x [2,2,2,2], 7x7/2 stem +
               max pool, same module names as torchvision) at width 8-16-32-64 instead
               of 64-128-256-512, 10 classes                 input f32 [batch, 3, 32, 32]

Export settings (torch 1.13, opset 17, the newest it and libonnx 1.12 know):
  * training=torch.onnx.TrainingMode.TRAINING. EVAL would fold BatchNorm into the Conv
    weights and delete every Dropout; TRAINING keeps BatchNormalization nodes
    (training_mode=1, own scale/bias/mean/var initializers) and Dropout nodes (ratio
    input, training_mode input = constant true). PRESERVE with model.train() gives the
    same graph. This is the export ONNX-based trainers use (ORT training artifacts).
    The graph therefore states train-mode semantics; kiln switches BN/Dropout to
    inference behaviour for eval. output.npy is PyTorch's EVAL-mode output.
  * do_constant_folding=False: with folding on, torch folds Transpose(weight) of
    3-D nn.Linear calls into new initializers ("onnx::MatMul_123"), so the parameters
    would lose their state_dict names (torch itself warns against folding in training
    mode). With it off every parameter initializer is named exactly as in state_dict()
    (checked below), and the tied GPT weight is one initializer used by Gather and by
    Transpose -> MatMul.
  * export_params=True, keep_initializers_as_inputs=False; batch is the symbolic dim
    "batch" (dynamic_axes); the GPT sequence length is fixed at 64.

Per example: model.onnx, input.npy (batch 4 of real eval data), output.npy (f32 eval
output), meta.json. Usage: tools/export_examples.py [--only NAME] [--large] [--bench]
  --large also exports tiny_gpt_4l512 (4 layers, n_embd 512, 8 heads, seq 128) into
  build/examples/ (too big to commit: ~50 MB).
  --bench exports only the benchmark models (BENCH_MODELS, BENCH_IMAGE_MODELS: gpt_4l256 =
  GPT class as tiny_gpt with 4 layers, n_embd 256, 8 heads, seq 128, vocab 256, dropout 0.1;
  gpt_8l256 the same with 8 layers; gpt_6l384 = nanoGPT shakespeare-char size (6 layers, n_embd
  384, 6 heads, seq 256, vocab 65, dropout 0.2); resnet18_64 = ResNet-18 width 16 at 64x64; the dynamic
  GPTs) into build/examples/NAME/model.onnx (not committed) and writes nothing under
  examples/ (tools/prepare_bench_models.sh).
"""
import argparse
import copy
import json
import math
import os
import sys
import warnings

import numpy as np
import onnx
from onnx import numpy_helper
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import prepare_data  # noqa: E402

OPSET = 17
SEED = 1234
MAX_ONNX_BYTES = 8 * 1024 * 1024


# ----------------------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x):  # (B, 64) -> (B, 10)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNNBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x):  # (B, 1, 8, 8)
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)  # (B, 16, 4, 4)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)  # (B, 32, 2, 2)
        return self.fc(torch.flatten(x, 1))  # (B, 10)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block, dropout, dynamic=False):
        super().__init__()
        self.n_head, self.n_embd, self.block, self.dynamic = n_head, n_embd, block, dynamic
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        # Causal mask as a bool buffer (an initializer of the graph, not a parameter); a
        # dynamic model derives it from the sequence length instead (Range and a comparison).
        if not dynamic:
            self.register_buffer("causal_mask", torch.tril(torch.ones(block, block, dtype=torch.bool)))

    def forward(self, x):  # (B, T, C), T == block (or any T <= block when dynamic)
        T, C, nh = (x.size(1) if self.dynamic else self.block), self.n_embd, self.n_head
        hs = C // nh
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.reshape(-1, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.reshape(-1, T, nh, hs).transpose(1, 2)
        v = v.reshape(-1, T, nh, hs).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        if self.dynamic:
            i = torch.arange(T)
            causal = i.unsqueeze(0) <= i.unsqueeze(1)  # (T, T): key position <= query position
        else:
            causal = self.causal_mask
        att = att.masked_fill(~causal, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = torch.matmul(att, v).transpose(1, 2).reshape(-1, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block, dropout, dynamic=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block, dropout, dynamic)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, 4 * n_embd), c_proj=nn.Linear(4 * n_embd, n_embd),
                                      dropout=nn.Dropout(dropout)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        m = self.mlp
        return x + m["dropout"](m["c_proj"](F.gelu(m["c_fc"](self.ln_2(x)))))


class GPT(nn.Module):
    """nanoGPT (Karpathy) layout and parameter names; weight tying wte <-> lm_head."""

    def __init__(self, vocab=256, block=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1, dynamic=False):
        super().__init__()
        self.block, self.dynamic = block, dynamic
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block, n_embd), drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(n_embd, n_head, block, dropout, dynamic) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        if not dynamic:
            self.register_buffer("pos", torch.arange(block, dtype=torch.int64))
        self.apply(self._init)
        for n, p in self.named_parameters():  # GPT-2 scaled init of residual projections
            if n.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx):  # (B, T) int64 -> (B, T, vocab)
        t = self.transformer
        pos = torch.arange(idx.size(1)) if self.dynamic else self.pos  # dynamic: T <= block
        x = t.drop(t.wte(idx) + t.wpe(pos))
        for blk in t.h:
            x = blk(x)
        return self.lm_head(t.ln_f(x))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idn = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + idn)


class ResNet18(nn.Module):
    """torchvision.models.resnet18 structure and names, channel widths scaled by width/64."""

    def __init__(self, num_classes=10, width=8):
        super().__init__()
        w = [width, 2 * width, 4 * width, 8 * width]
        self.conv1 = nn.Conv2d(3, w[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(w[0])
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = w[0]
        for i, c in enumerate(w):
            stride = 1 if i == 0 else 2
            setattr(self, "layer%d" % (i + 1), nn.Sequential(BasicBlock(cin, c, stride), BasicBlock(c, c, 1)))
            cin = c
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(w[3], num_classes)
        for m in self.modules():  # torchvision's init
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):  # (B, 3, 32, 32)
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))  # (B, w0, 8, 8)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))  # (B, w3, 1, 1)
        return self.fc(torch.flatten(self.avgpool(x), 1))  # (B, 10)


# ----------------------------------------------------------------------------- examples
def _digits():
    return prepare_data.digits_arrays()


def _gpt_windows(tokens, n, T, first=0):
    """n consecutive non-overlapping windows: inputs (n, T) and next-token targets (n, T), int64."""
    x = np.stack([tokens[(first + i) * T:(first + i) * T + T] for i in range(n)]).astype(np.int64)
    y = np.stack([tokens[(first + i) * T + 1:(first + i) * T + T + 1] for i in range(n)]).astype(np.int64)
    return x, y


# name -> (constructor, how to get (train_x, train_y, eval_x) arrays, meta)
def example_specs():
    cls_train = {
        "loss": "cross_entropy (mean, ignore_index -100) of logits [B, 10] vs labels",
        "labels": {"name": "labels", "dtype": "int64", "shape": ["batch"]},
    }
    return {
        "mlp_digits": dict(
            make=MLP, input_dtype="float32", input_shape=["batch", 64], output_shape=["batch", 10],
            data=lambda: (lambda d: (d["x_train"], d["y_train"], d["x_eval"]))(_digits()),
            train=dict(cls_train, data="data/digits/x_train.npy, y_train.npy (tools/prepare_data.py)"),
            note="MLP 64-128-64-10 with ReLU"),
        "cnn_bn": dict(
            make=CNNBN, input_dtype="float32", input_shape=["batch", 1, 8, 8], output_shape=["batch", 10],
            data=lambda: (lambda d: (d["x_train_img"], d["y_train"], d["x_eval_img"]))(_digits()),
            train=dict(cls_train, data="data/digits/x_train_img.npy, y_train.npy (tools/prepare_data.py)"),
            note="(Conv3x3-BatchNorm-ReLU-MaxPool2) x2 with 16 and 32 channels, Linear 128->10"),
        "tiny_gpt": dict(
            make=GPT, input_dtype="int64", input_shape=["batch", 64], output_shape=["batch", 64, 256],
            data=_gpt_data,
            train={
                "loss": "cross_entropy (mean, ignore_index -100) of logits reshaped [B*64, 256] vs labels "
                        "reshaped [B*64]; labels = inputs shifted left by one token in the stream",
                "labels": {"name": "labels", "dtype": "int64", "shape": ["batch", 64]},
                "data": "data/text/train.bin, val.bin (uint16 byte tokens, tools/prepare_data.py)",
            },
            note="nanoGPT-style: vocab 256 (bytes), block 64, n_layer 2, n_head 4, n_embd 64, "
                 "dropout 0.1, lm_head.weight tied to transformer.wte.weight"),
        "resnet18": dict(
            make=ResNet18, input_dtype="float32", input_shape=["batch", 3, 32, 32], output_shape=["batch", 10],
            data=lambda: (lambda d: (d["x_train_rgb32"], d["y_train"], d["x_eval_rgb32"]))(_digits()),
            train=dict(cls_train, data="data/digits/x_train_rgb32.npy, y_train.npy (digits upsampled 4x, "
                                       "3 channels; tools/prepare_data.py)"),
            note="torchvision ResNet-18 layout (BasicBlock x [2,2,2,2]) with base widths 8-16-32-64 "
                 "instead of 64-128-256-512 so that model.onnx and the gradient fixtures stay small "
                 "(full width is ~45 MB); module and initializer names match torchvision"),
    }


def _gpt_data():
    tr, va, _ = prepare_data.text_tokens()
    x, y = _gpt_windows(tr, 64, 64)
    xe, _ = _gpt_windows(va, 4, 64)
    return x, y, xe


def build_model(name):
    """The example's PyTorch model with its seeded initial weights (same as model.onnx)."""
    torch.manual_seed(SEED)
    return example_specs()[name]["make"]()


def set_dropout_eval(model):
    """Train mode for BatchNorm (batch statistics) with every Dropout turned off."""
    model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    return model


def param_names(model):
    """Trainable parameter names as they appear as ONNX initializers (tied ones once)."""
    return [n for n, _ in model.named_parameters()]  # named_parameters() skips duplicates


def export(name, out_dir, model=None, seq=None, dynamic_seq=False, image=None):
    """image: (H, W) of an image model's input instead of the example's."""
    spec = example_specs()[name]
    model = model if model is not None else build_model(name)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "model.onnx")
    if spec["input_dtype"] == "int64":
        T = seq or 64
        dummy = torch.zeros(2, T, dtype=torch.int64)
    else:
        dummy = torch.zeros([2] + spec["input_shape"][1:2] + list(image or spec["input_shape"][2:]))
    # Tracing runs the model in train mode, which would update the BatchNorm running
    # stats: export a copy, then write the pristine state_dict values into the file.
    pristine = {k: v.detach().clone() for k, v in model.state_dict().items()}
    traced = copy.deepcopy(model).train()
    torch.onnx.export(
        traced, (dummy,), path, export_params=True, opset_version=OPSET,
        training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
        keep_initializers_as_inputs=False, input_names=["input"], output_names=["logits"],
        dynamic_axes=({"input": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}} if dynamic_seq else
                      {"input": {0: "batch"}, "logits": {0: "batch"}}))
    m = onnx.load(path)
    for init in m.graph.initializer:
        if init.name in pristine:
            init.CopyFrom(numpy_helper.from_array(pristine[init.name].numpy(), init.name))
    onnx.save(m, path)
    onnx.checker.check_model(m)
    onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True)
    inits = {i.name for i in m.graph.initializer}
    params = param_names(model)
    missing = [p for p in params if p not in inits]
    if missing:
        raise SystemExit("export %s: parameters not found as initializers: %s" % (name, missing))
    buffers = sorted(inits - set(params))
    return path, m, params, buffers


def write_example(name, ex_root):
    spec = example_specs()[name]
    out_dir = os.path.join(ex_root, name)
    model = build_model(name)
    path, m, params, buffers = export(name, out_dir, model)
    size = os.path.getsize(path)
    if size > MAX_ONNX_BYTES:
        raise SystemExit("%s: model.onnx is %d bytes (> 8 MB)" % (name, size))
    _, _, x_eval = spec["data"]()
    x = np.ascontiguousarray(x_eval[:4])
    model.eval()
    with torch.no_grad():
        y = model(torch.from_numpy(x)).numpy().astype(np.float32)
    np.save(os.path.join(out_dir, "input.npy"), x)
    np.save(os.path.join(out_dir, "output.npy"), y)
    ops = sorted({n.op_type for n in m.graph.node})
    tied = None
    if name == "tiny_gpt":
        users = [n.op_type for n in m.graph.node if "transformer.wte.weight" in n.input]
        tied = {"initializer": "transformer.wte.weight", "also": "lm_head.weight", "used_by": users}
    meta = {
        "name": name,
        "description": spec["note"],
        "onnx": {"file": "model.onnx", "opset": OPSET, "bytes": size,
                 "export": "torch %s torch.onnx.export, training=TrainingMode.TRAINING (BatchNormalization "
                           "training_mode=1 and Dropout nodes kept), do_constant_folding=False, "
                           "initializer names = state_dict names" % torch.__version__,
                 "ops": ops},
        "inputs": [{"name": "input", "dtype": spec["input_dtype"], "shape": spec["input_shape"]}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": spec["output_shape"]}],
        "symbolic_dims": {"batch": "batch size"},
        "parameters": params,
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
        "buffers": buffers,
        "tied_weights": tied,
        "sample": {"input": "input.npy (first 4 rows of the eval split)",
                   "output": "output.npy: PyTorch eval-mode logits (BatchNorm running stats, dropout off), "
                             "float32", "input_shape": list(x.shape), "output_shape": list(y.shape)},
        "training": dict(spec["train"], note="the label input is not part of model.onnx: kiln attaches the "
                                             "loss and adds a graph input named 'labels'"),
        "seed": SEED,
    }
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return size, meta["num_parameters"]


def export_large(build_root):
    out = os.path.join(build_root, "examples", "tiny_gpt_4l512")
    torch.manual_seed(SEED)
    model = GPT(vocab=256, block=128, n_layer=4, n_head=8, n_embd=512)
    path, _, params, _ = export("tiny_gpt", out, model, seq=128)
    print("tiny_gpt_4l512: %s (%.1f MB, %d params)" % (path, os.path.getsize(path) / 2**20,
                                                        sum(p.numel() for p in model.parameters())))


# Benchmark-only models (build/examples/<name>/model.onnx): name -> GPT constructor args.
BENCH_MODELS = {
    "gpt_4l256": dict(vocab=256, block=128, n_layer=4, n_head=8, n_embd=256),
    # Variable-length training (issue 31, docs/dynamic_shapes.md): a dynamic sequence axis
    # (dim 1 "seq", positions and causal mask from its length), 256 positions.
    "tiny_gpt_dyn": dict(vocab=256, block=256, n_layer=2, n_head=4, n_embd=64, dynamic=True),
    "gpt_4l256_dyn": dict(vocab=256, block=256, n_layer=4, n_head=8, n_embd=256, dynamic=True),
    # Memory-budget recipe search (issue 33, kiln fit): a deeper GPT.
    "gpt_8l256": dict(vocab=256, block=128, n_layer=8, n_head=8, n_embd=256),
    # Peer benchmark (issue 37, tools/bench_peers.sh): nanoGPT's shakespeare-char model size
    # (config/train_shakespeare_char.py: 6 layers, 6 heads, n_embd 384, block 256, vocab 65,
    # dropout 0.2; this GPT class keeps its Linear biases).
    "gpt_6l384": dict(vocab=65, block=256, n_layer=6, n_head=6, n_embd=384, dropout=0.2),
}
# Benchmark-only image models: name -> (ResNet18 constructor args, input (H, W)).
BENCH_IMAGE_MODELS = {
    # kiln fit's convolution network (issue 33): ResNet-18 width 16 at 64x64.
    "resnet18_64": (dict(num_classes=10, width=16), (64, 64)),
}


def build_bench_model(name):
    """A benchmark GPT with its seeded initial weights (same as its model.onnx)."""
    torch.manual_seed(SEED)
    return GPT(**BENCH_MODELS[name])


def export_bench(build_root):
    for name, cfg in BENCH_MODELS.items():
        out = os.path.join(build_root, "examples", name)
        model = build_bench_model(name)
        path, _, params, _ = export("tiny_gpt", out, model, seq=64 if cfg.get("dynamic") else cfg["block"],
                                    dynamic_seq=cfg.get("dynamic", False))
        print("%s: %s (%.1f MB, %d params)" % (name, path, os.path.getsize(path) / 2**20,
                                               sum(p.numel() for p in model.parameters())))
    for name, (args, hw) in BENCH_IMAGE_MODELS.items():
        out = os.path.join(build_root, "examples", name)
        torch.manual_seed(SEED)
        model = ResNet18(**args)
        path, _, params, _ = export("resnet18", out, model, image=hw)
        print("%s: %s (%.1f MB, %d params)" % (name, path, os.path.getsize(path) / 2**20,
                                               sum(p.numel() for p in model.parameters())))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="export one example")
    ap.add_argument("--out", default=os.path.join(REPO, "examples"))
    ap.add_argument("--large", action="store_true", help="also export tiny_gpt_4l512 into build/examples")
    ap.add_argument("--bench", action="store_true",
                    help="export only the benchmark models into build/examples (nothing under examples/)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore", category=UserWarning)  # torch's training-mode export notes
    if args.bench:
        export_bench(os.path.join(REPO, "build"))
        return
    names = [args.only] if args.only else list(example_specs())
    for n in names:
        size, nparam = write_example(n, args.out)
        print("%-12s model.onnx %8.1f KB, %d parameters" % (n, size / 1024, nparam))
    if args.large:
        export_large(os.path.join(REPO, "build"))


if __name__ == "__main__":
    main()
