#!/usr/bin/python3
"""Writes PyTorch CPU-autocast bf16 trajectories for kiln's --bf16 check (issue 4).

For mlp_digits and tiny_gpt (and any --only NAME of export_examples.py's models):
20 AdamW steps with torch.autocast("cpu", dtype=torch.bfloat16) around the forward
pass and the loss, fp32 master weights (the module stays float32; autocast makes the
bf16 copies per op), backward outside the autocast region, fp32 optimizer. Everything
else is exactly the fp32 trajectory of tools/make_fixtures.py (its "adamw" entry):
  * model: export_examples.build_model(name) (the seeded module whose weights are the
    initializers of examples/<name>/model.onnx), then every state_dict entry is loaded
    from those ONNX initializers (and checked equal, make_fixtures.check_against_onnx);
  * mode: model.train() with every Dropout in eval (dropout off, BatchNorm batch stats);
  * data: examples/<name>/fixtures/traj_inputs.npy / traj_labels.npy (batch i at step i);
  * loss: cross_entropy(mean, ignore_index -100); AdamW(lr 1e-3, betas (0.9, 0.999),
    eps 1e-8), weight_decay 0.01 on parameters with dim >= 2, clip_grad_norm_(1.0)
    before each step, constant LR.
losses[i] is the (fp32) loss of batch i before update i.

Output: examples/<name>/fixtures/trajectories_bf16.json.
Usage: /usr/bin/python3 tools/make_autocast_fixture.py [--only NAME]
"""
import argparse
import json
import os
import sys
import warnings

import numpy as np
import onnx
import torch
from onnx import numpy_helper

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import export_examples as ex  # noqa: E402
import make_fixtures as mf  # noqa: E402

MODELS = ["mlp_digits", "tiny_gpt"]


def model_from_onnx(name):
    """build_model(name) with every state_dict tensor taken from the ONNX initializers."""
    model = ex.build_model(name)
    m = onnx.load(os.path.join(REPO, "examples", name, "model.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    sd = model.state_dict()
    for n in list(sd):
        if n in inits:
            sd[n] = torch.from_numpy(np.array(inits[n])).to(sd[n].dtype)
    model.load_state_dict(sd)
    mf.check_against_onnx(name, model)
    return model


def run(name):
    d = os.path.join(REPO, "examples", name, "fixtures")
    xs = np.load(os.path.join(d, "traj_inputs.npy"))
    ys = np.load(os.path.join(d, "traj_labels.npy"))
    cfg = dict(mf.ADAMW)
    model = ex.set_dropout_eval(model_from_onnx(name))
    named = list(model.named_parameters())
    decay = [n for n, p in named if p.dim() >= 2]
    groups = [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": cfg["weight_decay"]},
              {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg["learning_rate"], betas=(cfg["adam_beta1"], cfg["adam_beta2"]),
                            eps=cfg["adam_epsilon"])
    losses, norms = [], []
    for i in range(cfg["steps"]):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(torch.from_numpy(xs[i]))
            loss = mf.loss_fn(logits.float(), torch.from_numpy(ys[i]))
        loss.backward()
        total = torch.norm(torch.stack([p.grad.detach().norm(2) for _, p in named]), 2)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
        opt.step()
        losses.append(float(loss.item()))
        norms.append(float(total.item()))
    ref = json.load(open(os.path.join(d, "trajectories.json")))["adamw"]["losses"]
    out = {
        "model": "examples/%s/model.onnx" % name,
        "precision": "torch.autocast('cpu', dtype=torch.bfloat16) around forward + loss; fp32 master weights, "
                     "fp32 gradients and AdamW",
        "logits_dtype": str(logits.dtype),
        "mode": "model.train() with every Dropout in eval: BatchNorm uses batch statistics, dropout off",
        "data": {"inputs": "traj_inputs.npy [steps, B, ...]", "labels": "traj_labels.npy"},
        "losses_note": "losses[i]: fp32 loss of batch i before update i; grad_norms[i]: global L2 norm before "
                       "clipping",
        "torch": torch.__version__,
        "adamw": dict(cfg, losses=losses, grad_norms=norms, decay_params=decay),
    }
    with open(os.path.join(d, "trajectories_bf16.json"), "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    print("%-11s bf16 adamw %.4f -> %.4f | max rel. diff to fp32 trajectory %.3g" % (name, losses[0], losses[-1],
                                                                                   worst))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    warnings.filterwarnings("ignore", category=UserWarning)
    for name in ([args.only] if args.only else MODELS):
        run(name)


if __name__ == "__main__":
    main()
