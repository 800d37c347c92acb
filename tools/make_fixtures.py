#!/usr/bin/python3
"""Writes PyTorch reference fixtures for kiln's example models (examples/<name>/fixtures/).

For each example (models and seeded weights from export_examples.py; the script checks
that they equal the initializers of examples/<name>/model.onnx):

1. Loss and gradients on one fixed batch, in float64 (model.double()) and float32:
   * batch = the first B rows of the training data in file order (B = 8 for the digits
     models, 4 for tiny_gpt, 8 for resnet18 so that BatchNorm over its 1x1-4x4 late feature maps is well conditioned in float32), stored as batch_input.npy / batch_labels.npy;
   * loss = cross_entropy(mean, ignore_index=-100); for tiny_gpt logits reshaped
     (B*T, 256) against the next-token targets (inputs shifted by one in the stream);
   * mode: model.train() with every nn.Dropout set to eval, i.e. BatchNorm uses the
     batch statistics (biased variance) while dropout is off;
   * grads_f32.safetensors / grads_f64.safetensors: d loss / d param for every trainable
     parameter, keyed by its ONNX initializer name (= state_dict name). The tied GPT
     weight appears once, as transformer.wte.weight, holding the summed gradient of
     its two uses (Gather and lm_head). grads_f64 is skipped when it would push the
     fixture folder over 6 MB (resnet18); grads.json says so.
2. Trajectories (trajectories.json), full float32, same mode as above, on consecutive
   batches of the training data: step i uses rows [i*B, (i+1)*B) (stored in
   traj_inputs.npy [steps, B, ...] / traj_labels.npy):
   * adamw: 20 steps of torch.optim.AdamW(lr 1e-3, betas (0.9, 0.999), eps 1e-8),
     weight_decay 0.01 on parameters with dim >= 2 (decay list stored; this matches
     Hugging Face's grouping here: biases, LayerNorm and BatchNorm weights get none),
     torch.nn.utils.clip_grad_norm_(max_norm=1.0) before each step, constant LR;
   * sgd: 10 steps of torch.optim.SGD(lr 0.05, momentum 0.9), no weight decay, no clip.
   losses[i] is the loss of batch i computed before the i-th update; grad_norms[i] the
   global L2 norm of the gradients before clipping.

Usage: tools/make_fixtures.py [--only NAME]   (needs examples/ from export_examples.py;
prepares data/ itself if missing)
"""
import argparse
import json
import os
import struct
import sys
import warnings

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import export_examples as ex  # noqa: E402
import prepare_data  # noqa: E402

FIXTURE_BUDGET = 6 * 1024 * 1024
BATCH = {"mlp_digits": 8, "cnn_bn": 8, "tiny_gpt": 4, "resnet18": 8}
# Trajectory precision: ResNet-18 with BatchNorm over small batches is chaotic in float32
# (rounding differences between any two correct implementations grow past 1e-4 within
# 20 steps), so its trajectories are recorded and checked in float64.
TRAJ_DTYPE = {"resnet18": "float64"}
ADAMW = dict(optim="adamw_torch", learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
             weight_decay=0.01, weight_decay_rule="params with dim >= 2", max_grad_norm=1.0,
             clip="torch.nn.utils.clip_grad_norm_ (coef = max_norm / (total_norm + 1e-6), applied when < 1)",
             lr_scheduler_type="constant", steps=20)
SGD = dict(optim="sgd", learning_rate=0.05, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0,
           max_grad_norm=None, lr_scheduler_type="constant", steps=10)

_ST_DTYPE = {np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("int64"): "I64"}


def save_safetensors(path, tensors):
    """Minimal safetensors writer (spec: u64 LE header size, JSON header, raw LE data)."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        b = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": _ST_DTYPE[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "pt", "producer": "kiln tools/make_fixtures.py"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def train_arrays(name):
    """(inputs, labels) of the whole training split in file order, as the model eats them."""
    if name == "tiny_gpt":
        tr, _, _ = prepare_data.text_tokens()
        n = (len(tr) - 1) // 64
        return ex._gpt_windows(tr, min(n, 20 * BATCH[name]), 64)
    d = prepare_data.digits_arrays()
    key = {"mlp_digits": "x_train", "cnn_bn": "x_train_img", "resnet18": "x_train_rgb32"}[name]
    return d[key], d["y_train"]


def data_desc(name, B):
    if name == "tiny_gpt":
        return ("data/text/train.bin (tools/prepare_data.py): batch i, row r = window j = i*%d + r; "
                "input tokens[j*64 : j*64+64], labels tokens[j*64+1 : j*64+65]" % B)
    f = {"mlp_digits": "x_train.npy", "cnn_bn": "x_train_img.npy", "resnet18": "x_train_rgb32.npy"}[name]
    return "data/digits/%s, y_train.npy (tools/prepare_data.py): batch i = rows [i*%d, (i+1)*%d)" % (f, B, B)


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="mean")


def check_against_onnx(name, model):
    m = onnx.load(os.path.join(REPO, "examples", name, "model.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    for n, p in model.state_dict().items():
        if n in inits and not np.array_equal(inits[n], p.numpy()):
            raise SystemExit("%s: %s differs from model.onnx; rerun tools/export_examples.py" % (name, n))
    for n in ex.param_names(model):
        if n not in inits:
            raise SystemExit("%s: parameter %s missing from model.onnx" % (name, n))


def grads(model, x, y, dtype):
    model = model.to(dtype)
    ex.set_dropout_eval(model)
    xt = torch.from_numpy(x)
    if xt.is_floating_point():
        xt = xt.to(dtype)
    model.zero_grad()
    loss = loss_fn(model(xt), torch.from_numpy(y))
    loss.backward()
    g = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
    return float(loss.item()), g


def run_trajectory(name, xs, ys, cfg):
    dtype = torch.float64 if TRAJ_DTYPE.get(name) == "float64" else torch.float32
    model = ex.build_model(name).to(dtype)
    ex.set_dropout_eval(model)
    named = list(model.named_parameters())
    if cfg["optim"] == "adamw_torch":
        decay = [n for n, p in named if p.dim() >= 2]
        groups = [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": cfg["weight_decay"]},
                  {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=cfg["learning_rate"], betas=(cfg["adam_beta1"], cfg["adam_beta2"]),
                                eps=cfg["adam_epsilon"])
    else:
        decay = []
        opt = torch.optim.SGD(model.parameters(), lr=cfg["learning_rate"], momentum=cfg["momentum"])
    losses, norms = [], []
    for i in range(cfg["steps"]):
        opt.zero_grad()
        xi = torch.from_numpy(xs[i])
        if xi.is_floating_point():
            xi = xi.to(dtype)
        loss = loss_fn(model(xi), torch.from_numpy(ys[i]))
        loss.backward()
        total = torch.norm(torch.stack([p.grad.detach().norm(2) for _, p in named]), 2)
        if cfg.get("max_grad_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
        opt.step()
        losses.append(float(loss.item()))
        norms.append(float(total.item()))
    final = {n: float(p.detach().double().norm().item()) for n, p in named}
    out = dict(cfg, losses=losses, grad_norms=norms, final_param_l2_norms=final)
    if decay:
        out["decay_params"] = decay
        out["no_decay_params"] = [n for n, _ in named if n not in decay]
    return out


def make(name):
    B = BATCH[name]
    d = os.path.join(REPO, "examples", name, "fixtures")
    os.makedirs(d, exist_ok=True)
    model = ex.build_model(name)
    check_against_onnx(name, model)
    X, Y = train_arrays(name)
    steps = max(ADAMW["steps"], SGD["steps"])
    xs = np.ascontiguousarray(X[:steps * B].reshape((steps, B) + X.shape[1:]))
    ys = np.ascontiguousarray(Y[:steps * B].reshape((steps, B) + Y.shape[1:]))
    x, y = xs[0], ys[0]
    np.save(os.path.join(d, "batch_input.npy"), x)
    np.save(os.path.join(d, "batch_labels.npy"), y)
    np.save(os.path.join(d, "traj_inputs.npy"), xs)
    np.save(os.path.join(d, "traj_labels.npy"), ys)

    loss32, g32 = grads(ex.build_model(name), x, y, torch.float32)
    loss64, g64 = grads(ex.build_model(name), x, y, torch.float64)
    save_safetensors(os.path.join(d, "grads_f32.safetensors"), g32)
    used = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f != "grads_f64.safetensors")
    f64_bytes = sum(a.nbytes for a in g64.values())
    f64_path = os.path.join(d, "grads_f64.safetensors")
    if used + f64_bytes + 4096 <= FIXTURE_BUDGET:
        save_safetensors(f64_path, g64)
        f64_note = "grads_f64.safetensors"
    else:
        if os.path.exists(f64_path):
            os.remove(f64_path)
        f64_note = None
    info = {
        "model": "examples/%s/model.onnx" % name,
        "batch": {"input": "batch_input.npy", "labels": "batch_labels.npy", "rows": [0, B],
                  "source": data_desc(name, B)},
        "loss": "cross_entropy, reduction mean, ignore_index -100" +
                (", logits reshaped (B*64, 256), labels (B*64)" if name == "tiny_gpt" else ""),
        "mode": "model.train() with every Dropout in eval: BatchNorm uses batch statistics, dropout off",
        "loss_f32": loss32,
        "loss_f64": loss64,
        "grads_f32": "grads_f32.safetensors",
        "grads_f64": f64_note,
        "grads_f64_skipped_reason": None if f64_note else
        "float64 gradients (%d bytes) would push the fixtures over 6 MB" % f64_bytes,
        "grad_names": "ONNX initializer names (= state_dict names); tied weights appear once with the summed "
                      "gradient",
        "parameters": list(g32),
        "tied": {"transformer.wte.weight": ["Gather", "lm_head (Transpose->MatMul)"]} if name == "tiny_gpt" else {},
        "torch": torch.__version__,
    }
    with open(os.path.join(d, "grads.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")

    traj = {
        "model": "examples/%s/model.onnx" % name,
        "precision": TRAJ_DTYPE.get(name, "float32"),
        "mode": info["mode"],
        "loss": info["loss"],
        "per_device_train_batch_size": B,
        "gradient_accumulation_steps": 1,
        "data": {"inputs": "traj_inputs.npy [steps, B, ...]", "labels": "traj_labels.npy",
                 "source": data_desc(name, B), "step_i_rows": "[i*%d, (i+1)*%d)" % (B, B)},
        "losses_note": "losses[i]: loss of batch i before update i; grad_norms[i]: global L2 norm before clipping",
        "adamw": run_trajectory(name, xs, ys, ADAMW),
        "sgd": run_trajectory(name, xs, ys, SGD),
    }
    with open(os.path.join(d, "trajectories.json"), "w") as f:
        json.dump(traj, f, indent=2)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    print("%-11s loss f32 %.6f f64 %.6f | adamw %.4f -> %.4f | sgd %.4f -> %.4f | fixtures %.0f KB%s" % (
        name, loss32, loss64, traj["adamw"]["losses"][0], traj["adamw"]["losses"][-1], traj["sgd"]["losses"][0],
        traj["sgd"]["losses"][-1], total / 1024, "" if f64_note else " (no f64 grads)"))
    if total > FIXTURE_BUDGET:
        raise SystemExit("%s: fixtures are %d bytes (> 6 MB)" % (name, total))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    warnings.filterwarnings("ignore", category=UserWarning)
    for name in ([args.only] if args.only else list(BATCH)):
        make(name)


if __name__ == "__main__":
    main()
