#!/usr/bin/python3
"""PyTorch-eager baseline for `kiln bench`: times full training steps of the same model.

The model is the PyTorch class of tools/export_examples.py (MLP, GPT, ResNet18) with its
weights loaded from the example's model.onnx initializers (onnx.numpy_helper), so that
PyTorch and kiln start from identical parameters and buffers:
  mlp_digits  examples/mlp_digits/model.onnx        input f32 [B, 64], 10 classes
  tiny_gpt    examples/tiny_gpt/model.onnx          input i64 [B, 64], vocab 256
  gpt_4l256   build/examples/gpt_4l256/model.onnx   input i64 [B, 128], vocab 256
              (tools/prepare_bench_models.sh)
  resnet18    examples/resnet18/model.onnx          input f32 [B, 3, 32, 32], 10 classes

One training step, as kiln's default training program (runtime/train_config.h):
  model.train() (dropout and BatchNorm batch statistics active), forward, cross-entropy
  (mean; GPT: next-token labels of random tokens, classifiers: random class labels,
  inputs N(0, 1) as kiln bench's synthetic batch), backward, global-norm gradient
  clipping to --max_grad_norm (kiln default 1.0; 0 disables), torch.optim.AdamW
  (betas 0.9/0.999, eps 1e-8 as kiln), linear LR schedule stepped per step.
  --learning_rate / --weight_decay default to kiln's defaults (5e-5, 0.0); pass the same
  values to both tools (docs/performance.md uses 1e-3 and 0.01 for both).
  bf16: torch.autocast('cpu', dtype=torch.bfloat16) around forward + loss with fp32
  master weights and fp32 optimizer (what kiln's --bf16 does).

Prints one machine-readable line:
  torch model=tiny_gpt batch=8 precision=fp32 threads=2 warmup=3 steps=10 median_s=0.012345

Usage: /usr/bin/python3 tools/bench_torch.py MODEL [--batch 8] [--precision fp32|bf16]
       [--threads 2] [--warmup 3] [--steps 10]   (Debian python3-torch 1.13)
"""
import argparse
import os
import statistics
import sys
import time
import warnings

import onnx
from onnx import numpy_helper
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import export_examples as ex  # noqa: E402


def model_spec(name):
    """(constructor, onnx path, kind, input trailing shape or seq, classes)."""
    if name == "mlp_digits":
        return ex.MLP, os.path.join(REPO, "examples", name, "model.onnx"), "cls", [64], 10
    if name == "resnet18":
        return ex.ResNet18, os.path.join(REPO, "examples", name, "model.onnx"), "cls", [3, 32, 32], 10
    if name == "tiny_gpt":
        return ex.GPT, os.path.join(REPO, "examples", name, "model.onnx"), "gpt", [64], 256
    if name in ex.BENCH_MODELS:
        cfg = ex.BENCH_MODELS[name]
        return (lambda: ex.GPT(**cfg)), os.path.join(REPO, "build", "examples", name, "model.onnx"), "gpt", \
            [cfg["block"]], cfg["vocab"]
    raise SystemExit("bench_torch: unknown model '%s' (mlp_digits, tiny_gpt, gpt_4l256, resnet18)" % name)


def load_model(name):
    make, path, kind, shape, classes = model_spec(name)
    if not os.path.exists(path):
        raise SystemExit("bench_torch: %s not found (run tools/prepare_bench_models.sh for gpt_4l256)" % path)
    torch.manual_seed(ex.SEED)
    model = make()
    inits = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in onnx.load(path).graph.initializer}
    sd = model.state_dict()
    loaded = {}
    for k, v in sd.items():
        if k in inits:
            if tuple(inits[k].shape) != tuple(v.shape):
                raise SystemExit("bench_torch: %s: initializer %s has shape %s, model %s"
                                 % (path, k, tuple(inits[k].shape), tuple(v.shape)))
            loaded[k] = inits[k].to(v.dtype)
    model.load_state_dict(loaded, strict=False)
    missing = [n for n, _ in model.named_parameters() if n not in loaded]  # tied lm_head shares wte
    if missing:
        raise SystemExit("bench_torch: %s: parameters without an initializer: %s" % (path, missing))
    return model, kind, shape, classes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (kiln bench --warmup_steps_bench)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (kiln bench --bench_steps)")
    ap.add_argument("--learning_rate", type=float, default=5e-5)
    ap.add_argument("--weight_decay", type=float, default=0.0)
    ap.add_argument("--max_grad_norm", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    if args.batch < 1 or args.steps < 1 or args.warmup < 0 or args.threads < 1:
        raise SystemExit("bench_torch: --batch, --steps, --threads must be >= 1 and --warmup >= 0")
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(args.threads)

    model, kind, shape, classes = load_model(args.model)
    model.train()
    g = torch.Generator().manual_seed(args.seed)
    if kind == "gpt":
        T = shape[0]
        tok = torch.randint(0, classes, (args.batch, T + 1), generator=g)
        x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
    else:
        x = torch.randn([args.batch] + shape, generator=g)
        y = torch.randint(0, classes, (args.batch,), generator=g)

    total = args.warmup + args.steps
    opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (total - s) / max(1, total)))
    bf16 = args.precision == "bf16"

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        sched.step()
        return loss

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    if not torch.isfinite(loss.detach().float()):
        raise SystemExit("bench_torch: non-finite loss %s" % loss.item())
    print("torch model=%s batch=%d precision=%s threads=%d warmup=%d steps=%d median_s=%.6f"
          % (args.model, args.batch, args.precision, torch.get_num_threads(), args.warmup, args.steps,
             statistics.median(times)))


if __name__ == "__main__":
    main()
