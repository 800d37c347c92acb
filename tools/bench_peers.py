#!/usr/bin/env python3
"""Peer benchmark (issue 37): one training step of each example model in kiln and its peers.

Run it through tools/bench_peers.sh, which makes the virtual environment build/peers-venv
(PyTorch 2.x, onnxruntime-training, JAX + optax, onnx, numpy from PyPI) and runs this file
with it. A measuring tool only: no build step or test uses it.

Rows (model, batch):
  mlp_digits  examples/mlp_digits/model.onnx   batch 32   input f32 [B, 64], 10 classes
  cnn_bn      examples/cnn_bn/model.onnx       batch 32   input f32 [B, 1, 8, 8], 10 classes
  tiny_gpt    examples/tiny_gpt/model.onnx     batch 8    i64 [B, 64], vocab 256, 2 layers x 64
  gpt_4l256   build/examples/gpt_4l256         batch 8    i64 [B, 128], vocab 256, 4 layers x 256
  gpt_6l384   build/examples/gpt_6l384         batch 8    i64 [B, 256], vocab 65, 6 layers x 384
              (nanoGPT shakespeare-char size; both build/ models: tools/prepare_bench_models.sh)
  resnet18    examples/resnet18/model.onnx     batch 4 and 32   f32 [B, 3, 32, 32], 10 classes
each in fp32 and bf16 (autocast: bf16 matmuls/convolutions, fp32 master weights and optimizer).

Engines (each measurement is its own subprocess; in each round every engine runs once per row
in turn, so the machine's load falls on all alike):
  kiln_compiled  build/bin/kiln bench MODEL --backend compiled   (median step time it prints)
  kiln_eager     build/bin/kiln bench MODEL --backend eager
  torch          PyTorch eager, torch.optim.AdamW(fused=True) (foreach where fused is missing)
  torch_compile  torch.compile(forward + loss) (Inductor CPU, default mode) + the same fused
                 AdamW step; the compile happens in the warm-up steps and is not timed
  ort            ONNX Runtime Training: onnxruntime.training.artifacts.generate_artifacts on
                 kiln's own model.onnx (cross-entropy over the logits flattened to [-1, V],
                 onnxblock AdamW switched to adam_mode 0 = PyTorch's AdamW). The graph gets
                 the optional outputs ORT's gradient builders read and torch's export leaves
                 off (LayerNormalization's Mean/InvStdDev, Dropout's mask); no eval model is
                 loaded (ORT's inference check refuses BatchNormalization's training outputs).
                 ORT has no bf16 training: bf16 cells say n/a
  jax            the whole train step under jax.jit (forward, grad, optax.adamw), models
                 re-written in jax.numpy; bf16 = matmul/conv operands cast to bf16 in the
                 forward with fp32 parameters, optimizer and normalizations
Every engine starts from the same initial weights (the model.onnx initializers), trains on
the same fixed batch (N(0, 1) inputs or random tokens, random labels; x.npy and y.npy under
build/peers-work/MODEL_bB, given to kiln bench as --train_data), with dropout and BatchNorm batch statistics active, cross-entropy
(mean), AdamW lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on every parameter,
constant learning rate, no gradient clipping (kiln: --max_grad_norm 0), 2 threads
(OMP_NUM_THREADS=2, MKL_NUM_THREADS=2, torch.set_num_threads(2), ORT intra_op_num_threads=2,
XLA_FLAGS=--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=2; jaxlib accepts the
latter without complaint but has no documented thread-count flag: its pool is the core count,
2 on the benchmark machine). OMP_WAIT_POLICY and other variables pass through from the caller:
on cores shared with other busy jobs, spinning OpenMP threads (kiln, torch) lose badly (seen
here: 10x to over 100x per step during a parallel build), so measure on an otherwise idle machine.

Time: each cell is the median over rounds of each round's median ms per step (--steps timed
steps after --warmup untimed ones); the per-round values are listed below the table.
"kiln vs fastest" = the fastest peer's time / kiln compiled's time (> 1: kiln is faster).

Memory (second table), three figures per engine, "tensors / RSS growth / process" in MiB:
  tensors  kiln: the step peak `kiln bench` measures (weights, optimizer state, the batch,
           step arena and other step allocations; what kiln plans). torch, torch.compile: the
           tensors resident before one more, profiled step (parameters, buffers, AdamW state,
           and the batch it reads: inputs and labels) plus the
           highest allocations-minus-frees of the CPU allocator during it (torch.profiler
           memory events; gradients are allocated inside the step). jax: XLA's buffer
           assignment of the jitted step (arguments + outputs not aliased to the donated
           arguments + temporaries), a plan like kiln's. ort: none (not queryable).
  RSS growth  peers only: the process's peak RSS over the timed steps (VmHWM, reset after the
           warm-up through /proc/self/clear_refs) minus its RSS after the imports, before the
           model was built: tensors plus library pages first touched, thread pools, allocator
           caches and compiled code, without the compile's transient memory.
  process  every engine: the whole process's peak RSS (wait4 ru_maxrss), imports, runtime
           libraries and compilation included (the parent stays small for this: a child's
           ru_maxrss starts from its parent's size at fork).
Losses: each engine prints its first and last step's loss (kiln: a separate `kiln train`
of warmup+steps steps on the peers' batch, not timed; --no_loss_check skips it) so that a
wrong model shows (they differ by dropout and summation order only).

Usage (through the wrapper): tools/bench_peers.sh [--models a,b] [--precisions fp32,bf16]
  [--batches 8,32] [--rounds 3] [--steps 10] [--warmup 3] [--engines kiln_compiled,torch,...]
  [--threads 2] [--out results.md]
"""
import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILN = os.path.join(REPO, "build", "bin", "kiln")
WORK = os.path.join(REPO, "build", "peers-work")

ENGINES = ["kiln_compiled", "kiln_eager", "torch", "torch_compile", "ort", "jax"]
PEERS = ["torch", "torch_compile", "ort", "jax"]
LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8

# name -> (onnx path, kind, default batches, config)
MODELS = {
    "mlp_digits": ("examples/mlp_digits/model.onnx", "mlp", [32], dict(shape=[64], classes=10)),
    "cnn_bn": ("examples/cnn_bn/model.onnx", "cnn_bn", [32], dict(shape=[1, 8, 8], classes=10)),
    "tiny_gpt": ("examples/tiny_gpt/model.onnx", "gpt", [8],
                 dict(vocab=256, block=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1)),
    "gpt_4l256": ("build/examples/gpt_4l256/model.onnx", "gpt", [8],
                  dict(vocab=256, block=128, n_layer=4, n_head=8, n_embd=256, dropout=0.1)),
    "gpt_6l384": ("build/examples/gpt_6l384/model.onnx", "gpt", [8],
                  dict(vocab=65, block=256, n_layer=6, n_head=6, n_embd=384, dropout=0.2)),
    "resnet18": ("examples/resnet18/model.onnx", "resnet18", [4, 32], dict(shape=[3, 32, 32], classes=10, width=8)),
}


def classes_of(kind, cfg):
    return cfg["vocab"] if kind == "gpt" else cfg["classes"]


# ============================================================================ memory helpers
def proc_status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_hwm():
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ============================================================================ child: data
def load_row_data(work):
    import numpy as np
    x = np.load(os.path.join(work, "x.npy"))
    y = np.load(os.path.join(work, "y.npy"))
    with open(os.path.join(work, "spec.json")) as f:
        spec = json.load(f)
    z = np.load(os.path.join(work, "init.npz"))
    inits = {k: z[k] for k in z.files}
    return x, y, spec, inits


# ============================================================================ child: torch
def torch_model(name, kind, cfg):
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import export_examples as ex  # the PyTorch classes the example models were exported from
    if kind == "mlp":
        return ex.MLP()
    if kind == "cnn_bn":
        return ex.CNNBN()
    if kind == "resnet18":
        return ex.ResNet18(num_classes=cfg["classes"], width=cfg["width"])
    return ex.GPT(vocab=cfg["vocab"], block=cfg["block"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                  n_embd=cfg["n_embd"], dropout=cfg["dropout"])


def child_torch(a, compiled):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(a.threads)
    x_np, y_np, spec, inits = load_row_data(a.work)
    name, kind, cfg = spec["model"], spec["kind"], spec["cfg"]
    base_kb = proc_status_kb("VmRSS")
    torch.manual_seed(0)
    model = torch_model(name, kind, cfg)
    sd = model.state_dict()
    loaded = {k: torch.from_numpy(inits[k]).to(v.dtype) for k, v in sd.items() if k in inits}
    model.load_state_dict(loaded, strict=False)
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        raise SystemExit("parameters without an initializer: %s" % missing)
    del inits, loaded
    model.train()
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    fused = True
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    except (RuntimeError, TypeError, ValueError):
        fused = False
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)
    bf16 = a.prec == "bf16"

    def fwd_loss(xb, yb):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(xb)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), yb.reshape(-1))

    fn = torch.compile(fwd_loss) if compiled else fwd_loss

    def step():
        opt.zero_grad(set_to_none=True)
        loss = fn(x, y)
        loss.backward()
        opt.step()
        return loss.item()

    r = run_steps(a, step, base_kb, info={"optimizer": "AdamW fused" if fused else "AdamW foreach",
                                          "torch": torch.__version__})
    peak = torch_tensor_peak(torch, model, opt, step)
    # The batch the step reads is resident too (kiln's and JAX's figures count theirs).
    r["tensor_mem_b"] = None if peak is None else peak + x.numel() * x.element_size() + y.numel() * y.element_size()
    return r


def torch_tensor_peak(torch, model, opt, step):
    """Tensor bytes at the peak of one more (profiled) step: what is resident before it
    (parameters, buffers, optimizer state; gradients dropped first) plus the highest sum of the
    CPU allocator's allocations minus frees during the step (torch.profiler memory events)."""
    from torch.profiler import profile, ProfilerActivity
    opt.zero_grad(set_to_none=True)
    seen, resident = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    for st in opt.state.values():
        tensors += [v for v in st.values() if torch.is_tensor(v)]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            resident += t.numel() * t.element_size()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        evs = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    except Exception:  # noqa: BLE001 -- a profiler without memory events: no figure
        return None
    live = peak = 0
    for _, n in evs:
        live += n
        peak = max(peak, live)
    return resident + peak


def run_steps(a, step, base_kb, info=None):
    """Warm-up, HWM reset, timed steps; returns the child's result dict."""
    losses = []
    t0 = time.perf_counter()
    first_s = None
    for i in range(a.warmup):
        losses.append(step())
        if i == 0:
            first_s = time.perf_counter() - t0
    hwm_reset = reset_hwm()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
    hwm_kb = proc_status_kb("VmHWM")
    if not all(math.isfinite(v) for v in losses):
        raise SystemExit("non-finite loss: %s" % losses)
    r = {"times_s": times, "median_s": statistics.median(times), "loss_first": losses[0], "loss_last": losses[-1],
         "rss_growth_b": (hwm_kb - base_kb) * 1024, "hwm_reset": hwm_reset, "first_step_s": first_s}
    if info:
        r.update(info)
    return r


# ============================================================================ child: ORT
def ort_artifacts(a):
    """Training, eval and optimizer graphs + checkpoint from kiln's model.onnx (run once per model)."""
    import onnx
    from onnxruntime.training import artifacts, onnxblock
    spec = json.load(open(os.path.join(a.work, "spec.json")))
    model = onnx.load(spec["onnx"])
    # ORT's gradient builders read optional outputs that torch's export leaves off (Dropout's
    # mask, LayerNormalization's Mean and InvStdDev): name them (the forward is the same).
    for i, node in enumerate(model.graph.node):
        want = {"Dropout": 2, "LayerNormalization": 3}.get(node.op_type, 0)
        while len(node.output) < want:
            node.output.append("pb_%s_%d_out%d" % (node.op_type, i, len(node.output)))
    V = classes_of(spec["kind"], spec["cfg"])
    params = spec["params"]
    frozen = [i.name for i in model.graph.initializer if i.name not in set(params)]

    class FlatCrossEntropy(onnxblock.Block):
        """Mean cross-entropy of logits [..., V] reshaped [-1, V] against labels [...] reshaped [-1]
        (ONNX SoftmaxCrossEntropyLoss wants the classes on axis 1, a GPT's logits have them last)."""

        def __init__(self):
            super().__init__()
            self.ce = onnxblock.loss.CrossEntropyLoss(reduction="mean")

        def build(self, logits_name):
            g = self.base.graph
            H = onnx.helper
            g.node.append(H.make_node("Constant", [], ["pb_shape_v"], value=H.make_tensor(
                "pb_shape_v_t", onnx.TensorProto.INT64, [2], [-1, V])))
            g.node.append(H.make_node("Constant", [], ["pb_shape_1"], value=H.make_tensor(
                "pb_shape_1_t", onnx.TensorProto.INT64, [1], [-1])))
            g.node.append(H.make_node("Reshape", [logits_name, "pb_shape_v"], ["pb_flat_logits"]))
            dims = ["batch"] + ([spec["cfg"]["block"]] if spec["kind"] == "gpt" else [])
            g.input.append(H.make_tensor_value_info("labels", onnx.TensorProto.INT64, dims))
            g.node.append(H.make_node("Reshape", ["labels", "pb_shape_1"], ["pb_flat_labels"]))
            return self.ce("pb_flat_logits", labels_name="pb_flat_labels")

    out = os.path.join(a.work, "ort")
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    # OptimType.AdamW would take onnxblock's defaults (eps 1e-6, no weight decay): the block
    # with the benchmark's hyperparameters instead.
    adamw = onnxblock.optim.AdamW(bias_correction=True, betas=BETAS, eps=EPS, weight_decay=WD)
    artifacts.generate_artifacts(model, requires_grad=params, frozen_params=frozen, loss=FlatCrossEntropy(),
                                 optimizer=adamw, artifact_directory=out)
    # The block writes adam_mode 1 (Hugging Face's AdamW); 0 is PyTorch's, kiln's and optax's.
    opt_path = os.path.join(out, "optimizer_model.onnx")
    om = onnx.load(opt_path)
    for node in om.graph.node:
        for at in node.attribute:
            if node.op_type == "AdamWOptimizer" and at.name == "adam_mode":
                at.i = 0
    onnx.save(om, opt_path)
    return {"dir": out, "files": sorted(os.listdir(out))}


def child_ort(a):
    import numpy as np
    import onnxruntime as ort
    from onnxruntime.training import api as ortapi
    x, y, spec, _ = load_row_data(a.work)
    art = os.path.join(a.work, "ort")
    base_kb = proc_status_kb("VmRSS")
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.inter_op_num_threads = 1
    state = ortapi.CheckpointState.load_checkpoint(os.path.join(art, "checkpoint"))
    # No eval model: its BatchNormalization nodes keep the training outputs, which ORT's
    # inference shape check refuses; the benchmark only trains.
    module = ortapi.Module(os.path.join(art, "training_model.onnx"), state, None, device="cpu", session_options=so)
    optim = ortapi.Optimizer(os.path.join(art, "optimizer_model.onnx"), module)
    optim.set_learning_rate(LR)
    module.train()
    x = np.ascontiguousarray(x)
    y = np.ascontiguousarray(y.astype(np.int64))

    def step():
        loss = module(x, y)
        optim.step()
        module.lazy_reset_grad()
        return float(np.asarray(loss))

    return run_steps(a, step, base_kb, info={"onnxruntime": ort.__version__})


# ============================================================================ child: JAX
def child_jax(a):
    import jax
    import functools
    import jax.numpy as jnp
    import optax
    x_np, y_np, spec, inits = load_row_data(a.work)
    kind, cfg = spec["kind"], spec["cfg"]
    base_kb = proc_status_kb("VmRSS")
    cdt = jnp.bfloat16 if a.prec == "bf16" else jnp.float32
    f32 = jnp.float32
    params = {k: jnp.asarray(inits[k]) for k in spec["params"]}
    bn_state = {k: jnp.asarray(inits[k]) for k in spec["buffers"]
                if k.endswith("running_mean") or k.endswith("running_var")}
    del inits

    def linear(p, name, h, bias=True):  # torch layout: weight [out, in]
        o = jnp.matmul(h.astype(cdt), p[name + ".weight"].astype(cdt).T)
        if bias:
            o = o + p[name + ".bias"].astype(o.dtype)
        return o

    def conv(p, name, h, stride=1, pad=0, bias=False):
        o = jax.lax.conv_general_dilated(h.astype(cdt), p[name + ".weight"].astype(cdt), (stride, stride),
                                         [(pad, pad), (pad, pad)], dimension_numbers=("NCHW", "OIHW", "NCHW"))
        if bias:
            o = o + p[name + ".bias"].astype(o.dtype)[None, :, None, None]
        return o

    def batchnorm(p, st, new, name, h, eps=1e-5, momentum=0.1):  # train mode: batch statistics
        h = h.astype(f32)
        mean = jnp.mean(h, axis=(0, 2, 3))
        var = jnp.var(h, axis=(0, 2, 3))
        n = h.shape[0] * h.shape[2] * h.shape[3]
        new[name + ".running_mean"] = (1 - momentum) * st[name + ".running_mean"] + momentum * mean
        new[name + ".running_var"] = (1 - momentum) * st[name + ".running_var"] + momentum * var * n / (n - 1)
        hn = (h - mean[None, :, None, None]) * jax.lax.rsqrt(var + eps)[None, :, None, None]
        return hn * p[name + ".weight"][None, :, None, None] + p[name + ".bias"][None, :, None, None]

    def maxpool(h, k, s, pad):
        return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 1, k, k), (1, 1, s, s),
                                     [(0, 0), (0, 0), (pad, pad), (pad, pad)])

    def layernorm(p, name, h, eps=1e-5):
        h = h.astype(f32)
        mu = jnp.mean(h, -1, keepdims=True)
        var = jnp.mean(jnp.square(h - mu), -1, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(var + eps) * p[name + ".weight"] + p[name + ".bias"]

    def dropout(h, rate, key):
        if rate <= 0:
            return h
        keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)
        return jnp.where(keep, h / (1.0 - rate), jnp.zeros_like(h))

    relu = jax.nn.relu

    def forward(p, st, key, xb):
        new = {}
        if kind == "mlp":
            h = relu(linear(p, "fc1", xb))
            h = relu(linear(p, "fc2", h))
            return linear(p, "fc3", h), new
        if kind == "cnn_bn":
            h = maxpool(relu(batchnorm(p, st, new, "bn1", conv(p, "conv1", xb, pad=1, bias=True))), 2, 2, 0)
            h = maxpool(relu(batchnorm(p, st, new, "bn2", conv(p, "conv2", h, pad=1, bias=True))), 2, 2, 0)
            return linear(p, "fc", h.reshape(h.shape[0], -1)), new
        if kind == "resnet18":
            h = maxpool(relu(batchnorm(p, st, new, "bn1", conv(p, "conv1", xb, 2, 3))), 3, 2, 1)
            for li in range(1, 5):
                for bi in range(2):
                    pre = "layer%d.%d." % (li, bi)
                    stride = 2 if (li > 1 and bi == 0) else 1
                    idn = h
                    if pre + "downsample.0.weight" in p:
                        idn = batchnorm(p, st, new, pre + "downsample.1", conv(p, pre + "downsample.0", h, stride))
                    o = relu(batchnorm(p, st, new, pre + "bn1", conv(p, pre + "conv1", h, stride, 1)))
                    o = batchnorm(p, st, new, pre + "bn2", conv(p, pre + "conv2", o, 1, 1))
                    h = relu(o + idn)
            h = jnp.mean(h.astype(f32), axis=(2, 3))
            return linear(p, "fc", h), new
        # GPT (nanoGPT layout, tools/export_examples.py): pre-LayerNorm, causal attention,
        # GELU (erf), dropout, lm_head tied to wte.
        C, nh, rate = cfg["n_embd"], cfg["n_head"], cfg["dropout"]
        hs = C // nh
        B, T = xb.shape
        keys = iter(jax.random.split(key, 1 + 3 * cfg["n_layer"]))
        t = "transformer."
        h = p[t + "wte.weight"][xb] + p[t + "wpe.weight"][jnp.arange(T)][None]
        h = dropout(h, rate, next(keys))
        causal = jnp.tril(jnp.ones((T, T), dtype=bool))
        for i in range(cfg["n_layer"]):
            pre = t + "h.%d." % i
            qkv = linear(p, pre + "attn.c_attn", layernorm(p, pre + "ln_1", h))
            q, k, v = jnp.split(qkv, 3, axis=-1)
            q, k, v = (z.reshape(B, T, nh, hs).transpose(0, 2, 1, 3) for z in (q, k, v))
            att = jnp.matmul(q, k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))
            att = jnp.where(causal, att.astype(f32), -jnp.inf)
            att = dropout(jax.nn.softmax(att, axis=-1), rate, next(keys))
            yv = jnp.matmul(att.astype(cdt), v).transpose(0, 2, 1, 3).reshape(B, T, C)
            h = h + dropout(linear(p, pre + "attn.c_proj", yv), rate, next(keys))
            m = jax.nn.gelu(linear(p, pre + "mlp.c_fc", layernorm(p, pre + "ln_2", h)), approximate=False)
            h = h + dropout(linear(p, pre + "mlp.c_proj", m), rate, next(keys))
        h = layernorm(p, t + "ln_f", h)
        return jnp.matmul(h.astype(cdt), p[t + "wte.weight"].astype(cdt).T), new

    def loss_fn(p, st, key, xb, yb):
        logits, new = forward(p, st, key, xb)
        logits = logits.reshape(-1, logits.shape[-1]).astype(f32)
        loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, yb.reshape(-1)))
        return loss, new

    opt = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    opt_state = opt.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
    def train_step(p, o, st, key, xb, yb):
        key, sub = jax.random.split(key)
        (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, st, sub, xb, yb)
        updates, o = opt.update(grads, o, p)
        p = optax.apply_updates(p, updates)
        st = dict(st, **new)
        return p, o, st, key, loss

    xb, yb = jnp.asarray(x_np), jnp.asarray(y_np)
    carry = [params, opt_state, bn_state, jax.random.PRNGKey(0)]

    def step():
        p, o, st, key, loss = train_step(*carry, xb, yb)
        jax.block_until_ready((p, loss))
        carry[:] = [p, o, st, key]
        return float(loss)

    # XLA's buffer assignment for the step (a plan, as kiln's): arguments (parameters, Adam
    # state, BatchNorm statistics, batch) + outputs not aliased to donated arguments + temps.
    tensor_mem = None
    try:
        ma = train_step.lower(*carry, xb, yb).compile().memory_analysis()
        tensor_mem = int(ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
                         + ma.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 -- no memory analysis in this jaxlib: no figure
        pass
    r = run_steps(a, step, base_kb, info={"jax": jax.__version__, "optax": optax.__version__})
    r["tensor_mem_b"] = tensor_mem
    return r


def child_main(a):
    try:
        if a.child == "prepare":
            r = prepare_row_data(a)
        elif a.child == "ort_artifacts":
            r = ort_artifacts(a)
        elif a.child == "torch":
            r = child_torch(a, compiled=False)
        elif a.child == "torch_compile":
            r = child_torch(a, compiled=True)
        elif a.child == "ort":
            r = child_ort(a)
        elif a.child == "jax":
            r = child_jax(a)
        else:
            raise SystemExit("unknown child " + a.child)
    except SystemExit as e:
        r = {"error": str(e)}
    except Exception as e:  # noqa: BLE001 -- reported as the cell's reason
        import traceback
        traceback.print_exc()
        r = {"error": "%s: %s" % (type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else "")}
    print("RESULT " + json.dumps(r), flush=True)


# ============================================================================ parent
def run_measured(cmd, env, timeout, log):
    """Runs cmd; returns (rc, output text, peak RSS bytes of the process from wait4)."""
    with tempfile.TemporaryFile(mode="w+") as out:
        try:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        except OSError as e:  # e.g. build/bin/kiln being relinked right now
            if log:
                log.write("$ %s\n%s\n" % (" ".join(cmd), e))
            return -1, str(e), 0
        deadline = time.time() + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.time() > deadline:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                status = -9
                break
            time.sleep(0.02)
        p.returncode = 0  # reaped here: keep Popen from waiting again
        out.seek(0)
        text = out.read()
    if log:
        log.write("$ %s\n%s\n" % (" ".join(cmd), text))
        log.flush()
    rc = os.waitstatus_to_exitcode(status) if status != -9 else -9
    return rc, text, ru.ru_maxrss * 1024


def parse_time(s):
    v, unit = s.split()
    return float(v) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[unit]


def kiln_flags(a, batch, prec):
    f = ["--per_device_train_batch_size", str(batch), "--learning_rate", str(LR), "--weight_decay", str(WD),
         "--adam_beta1", str(BETAS[0]), "--adam_beta2", str(BETAS[1]), "--adam_epsilon", str(EPS),
         "--max_grad_norm", "0", "--lr_scheduler_type", "constant", "--optim", "adamw_torch"]
    if prec == "bf16":
        f.append("--bf16")
    return f


def kiln_data(row):
    """The peers' batch (B rows: every step trains on all of it, as the peers do)."""
    return ["--train_data", "input=" + os.path.join(row["work"], "x.npy"),
            "--train_data", "labels=" + os.path.join(row["work"], "y.npy")]


def run_kiln(a, row, engine, env, log):
    import re
    backend = engine.split("_", 1)[1]
    cmd = [KILN, "bench", row["onnx"], "--backend", backend, "--warmup_steps_bench", str(a.warmup),
           "--bench_steps", str(a.steps)] + kiln_data(row) + kiln_flags(a, row["batch"], row["prec"])
    rc, text, maxrss = run_measured(cmd, env, a.timeout, log)
    if rc != 0:
        last = [l for l in text.strip().splitlines() if l.strip()]
        return {"error": "kiln rc %d: %s" % (rc, last[-1][:120] if last else "")}
    m = re.search(r"median step time ([0-9.]+ [a-z]+)", text)
    pk = re.search(r"measured [0-9.]+ [KMGT]?i?B \((\d+) B\)", text) or re.search(r"measured .*?\((\d+) B\)", text)
    cm = re.search(r"^compile \(.*$", text, re.M)
    if not m:
        return {"error": "kiln: no median step time in its output"}
    r = {"median_s": parse_time(m.group(1)), "times_s": None, "proc_mem_b": maxrss,
         "tensor_mem_b": int(pk.group(1)) if pk else None}
    if cm:
        r["compile"] = cm.group(0)
    return r


def kiln_loss_check(a, row, engine, env, log):
    """Losses of `kiln train` on the peers' batch (warmup + steps steps, not timed)."""
    backend = engine.split("_", 1)[1]
    out = os.path.join(row["work"], "kiln_train_" + backend + "_" + row["prec"])
    shutil.rmtree(out, ignore_errors=True)
    cmd = [KILN, "train", row["onnx"]] + kiln_data(row) + ["--backend", backend,
           "--max_steps", str(a.warmup + a.steps), "--logging_steps", "1", "--disable_tqdm", "--output_dir", out,
           "--save_steps", "0"] + kiln_flags(a, row["batch"], row["prec"])
    rc, text, _ = run_measured(cmd, env, a.timeout, log)
    losses = []
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            for line in f:
                d = json.loads(line)
                if "loss" in d and "step" in d:
                    losses.append(d["loss"])
    except OSError:
        pass
    shutil.rmtree(out, ignore_errors=True)
    if rc != 0 or not losses:
        last = [l for l in text.strip().splitlines() if l.strip()]
        return None, "kiln train rc %d: %s" % (rc, last[-1][:100] if last else "")
    return (losses[0], losses[-1]), None


def run_child(a, row, engine, env, log, child=None, extra=()):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", child or engine, "--work", row["work"],
           "--prec", row["prec"], "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads)]
    cmd += list(extra)
    rc, text, maxrss = run_measured(cmd, env, a.timeout, log)
    res = None
    for line in text.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
    if res is None:
        last = [l for l in text.strip().splitlines() if l.strip()]
        reason = "rc %d" % rc if rc != -9 else "timed out after %d s" % a.timeout
        return {"error": "%s: %s" % (reason, last[-1][:120] if last else "no output")}
    res["proc_mem_b"] = maxrss
    return res


def prepare_row_data(a, seed=0):
    """a.work = build/peers-work/<model>_b<batch>: x.npy, y.npy, init.npz, spec.json. A child
    process, so that the parent stays small (a child's wait4 peak RSS starts from its parent's)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper
    name, batch = a.model, a.batch
    path, kind, _, cfg = MODELS[name]
    onnx_path = os.path.join(REPO, path)
    work = a.work
    os.makedirs(work, exist_ok=True)
    rng = np.random.default_rng(seed)
    if kind == "gpt":
        x = rng.integers(0, cfg["vocab"], (batch, cfg["block"]), dtype=np.int64)
        y = rng.integers(0, cfg["vocab"], (batch, cfg["block"]), dtype=np.int64)
    else:
        x = rng.standard_normal([batch] + cfg["shape"]).astype(np.float32)
        y = rng.integers(0, cfg["classes"], (batch,), dtype=np.int64)
    np.save(os.path.join(work, "x.npy"), x)
    np.save(os.path.join(work, "y.npy"), y)
    m = onnx.load(onnx_path)
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    # Trainable = the PyTorch module's parameters (named_parameters skips the tied lm_head).
    params = [n for n, _ in torch_model(name, kind, cfg).named_parameters()]
    missing = [p for p in params if p not in inits]
    if missing:
        raise SystemExit("%s: parameters without an initializer: %s" % (onnx_path, missing))
    np.savez(os.path.join(work, "init.npz"), **inits)
    with open(os.path.join(work, "spec.json"), "w") as f:
        json.dump({"model": name, "kind": kind, "cfg": cfg, "onnx": onnx_path, "params": params,
                   "buffers": sorted(set(inits) - set(params))}, f)
    return {"work": work}


def fmt_ms(s):
    if s is None:
        return "-"
    ms = s * 1e3
    return "%.3g" % ms if ms < 100 else "%.0f" % ms


def fmt_mib(b):
    """MiB with three significant digits below 10 MiB (0.454), one decimal above."""
    if b is None:
        return "-"
    m = b / 2**20
    return "%.3g" % m if m < 10 else "%.1f" % m


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--batches", help="batch sizes for every model (default: each model's own)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (torch.compile, jax.jit compile there)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per subprocess")
    ap.add_argument("--no_loss_check", action="store_true", help="skip the untimed `kiln train` loss runs")
    ap.add_argument("--out", help="also write the tables to this markdown file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--prec", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child_main(a)
    if a.warmup < 1 or a.steps < 1 or a.rounds < 1:
        raise SystemExit("bench_peers: --warmup, --steps and --rounds must be >= 1")
    engines = [e for e in a.engines.split(",") if e]
    bad = [e for e in engines if e not in ENGINES]
    models = [m for m in a.models.split(",") if m]
    badm = [m for m in models if m not in MODELS]
    precs = [p for p in a.precisions.split(",") if p]
    if bad or badm or any(p not in ("fp32", "bf16") for p in precs):
        raise SystemExit("bench_peers: engines are %s; models %s; precisions fp32,bf16" % (ENGINES, list(MODELS)))
    if any(e.startswith("kiln") for e in engines) and not os.access(KILN, os.X_OK):
        raise SystemExit("bench_peers: %s not found (bash tools/build.sh)" % KILN)

    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads),
               XLA_FLAGS=("--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=%d" % a.threads),
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONWARNINGS="ignore")
    os.makedirs(WORK, exist_ok=True)
    log = open(os.path.join(WORK, "last_run.log"), "w")

    # Rows and their data / ORT artifacts.
    rows = []
    for name in models:
        path, kind, batches, cfg = MODELS[name]
        for b in ([int(v) for v in a.batches.split(",")] if a.batches else batches):
            for prec in precs:
                rows.append({"model": name, "batch": b, "prec": prec, "onnx": os.path.join(REPO, path)})
    prepared = {}
    for r in rows:
        key = (r["model"], r["batch"])
        if key not in prepared:
            if not os.path.exists(r["onnx"]):
                prepared[key] = (None, "%s missing (bash tools/prepare_bench_models.sh)" % os.path.relpath(r["onnx"], REPO))
            else:
                work = os.path.join(WORK, "%s_b%d" % key)
                res = run_child(a, {"work": work, "prec": "fp32"}, "prepare", env, log,
                                extra=["--model", r["model"], "--batch", str(r["batch"])])
                if "error" in res:
                    raise SystemExit("bench_peers: preparing %s batch %d: %s" % (key + (res["error"],)))
                ort_err = None
                if "ort" in engines:
                    res = run_child(a, {"work": work, "prec": "fp32"}, "ort", env, log, child="ort_artifacts")
                    ort_err = res.get("error")
                prepared[key] = (work, ort_err)
        r["work"], r["missing"] = prepared[key][0], None
        if r["work"] is None:
            r["missing"] = prepared[key][1]
        r["ort_err"] = prepared[key][1] if r["work"] else None

    results = {}  # (row index, engine) -> list of per-round result dicts
    for rnd in range(a.rounds):
        for i, r in enumerate(rows):
            if r["missing"]:
                continue
            for e in engines:
                if e == "ort" and r["prec"] == "bf16":
                    res = {"error": "n/a (ORT has no bf16 training)"}
                elif e == "ort" and r["ort_err"]:
                    res = {"error": "n/a (artifacts: %s)" % r["ort_err"][:80]}
                elif e.startswith("kiln"):
                    res = run_kiln(a, r, e, env, log)
                    if rnd == 0 and not a.no_loss_check and "error" not in res:
                        lf, err = kiln_loss_check(a, r, e, env, log)
                        if lf:
                            res["loss_first"], res["loss_last"] = lf
                        else:
                            res["loss_err"] = err
                else:
                    res = run_child(a, r, e, env, log)
                results.setdefault((i, e), []).append(res)
                cell = ("%s ms" % fmt_ms(res["median_s"])) if "median_s" in res else res["error"]
                print("round %d  %-10s b%-3d %-4s %-13s %s" % (rnd + 1, r["model"], r["batch"], r["prec"], e, cell),
                      file=sys.stderr, flush=True)

    # Tables.
    lines = []
    hdr = ["model", "batch", "prec"] + engines + ["fastest peer", "kiln vs fastest"]
    lines.append("### Median ms per training step (%d threads, %d rounds x %d timed steps after %d warm-up)"
                 % (a.threads, a.rounds, a.steps, a.warmup))
    lines.append("")
    lines.append("| " + " | ".join(hdr) + " |")
    lines.append("|" + "---|" * len(hdr))
    per_round, mem_lines, loss_lines = [], [], []

    def med(i, e):
        rs = results.get((i, e), [])
        ok = [x["median_s"] for x in rs if "median_s" in x]
        if ok:
            return statistics.median(ok), None
        errs = [x["error"] for x in rs if "error" in x]
        return None, (errs[0] if errs else "-")

    for i, r in enumerate(rows):
        cells = [r["model"], str(r["batch"]), r["prec"]]
        if r["missing"]:
            lines.append("| " + " | ".join(cells + ["n/a (%s)" % r["missing"]] * len(engines) + ["-", "-"]) + " |")
            continue
        meds = {}
        for e in engines:
            m, err = med(i, e)
            meds[e] = m
            c = fmt_ms(m) if m is not None else (err if err.startswith("n/a") else "n/a (%s)" % err)
            cells.append(c.replace("|", "/"))
        peers = [(meds[e], e) for e in engines if e in PEERS and meds[e] is not None]
        if peers:
            best, who = min(peers)
            cells.append("%s (%s ms)" % (who, fmt_ms(best)))
            kc = meds.get("kiln_compiled")
            cells.append("%.3gx" % (best / kc) if kc else "-")
        else:
            cells += ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
        for e in engines:
            rs = results.get((i, e), [])
            vals = [fmt_ms(x["median_s"]) for x in rs if "median_s" in x]
            if vals:
                per_round.append("- %s b%d %s %s: %s ms" % (r["model"], r["batch"], r["prec"], e, " / ".join(vals)))
        mc = [r["model"], str(r["batch"]), r["prec"]]
        for e in engines:
            rs = [x for x in results.get((i, e), []) if "median_s" in x]
            if not rs:
                mc.append("-")
                continue
            def mx(key):
                v = [x[key] for x in rs if x.get(key) is not None]
                return max(v) if v else None
            mc.append("%s / %s / %s" % (fmt_mib(mx("tensor_mem_b")), fmt_mib(mx("rss_growth_b")),
                                        fmt_mib(mx("proc_mem_b"))))
        mem_lines.append("| " + " | ".join(mc) + " |")
        lc = [r["model"], str(r["batch"]), r["prec"]]
        for e in engines:
            rs = results.get((i, e), [])
            x = next((x for x in rs if "loss_first" in x), None)
            if x:
                lc.append("%.4f -> %.4f" % (x["loss_first"], x["loss_last"]))
            else:
                y = next((x for x in rs if "loss_err" in x), None)
                lc.append(("n/a (%s)" % y["loss_err"]).replace("|", "/") if y else "-")
        loss_lines.append("| " + " | ".join(lc) + " |")

    lines += ["", "Per round (median ms of each round's timed steps):", ""] + per_round
    lines += ["", "### Memory, MiB: tensors / RSS growth / process", "",
              "tensors: kiln bench's measured step peak (weights, optimizer state, the batch, step arena and "
              "allocations); torch: resident tensors and the batch + the allocator's peak over a profiled step; "
              "jax: XLA's buffer assignment "
              "(arguments + unaliased outputs + temps); ort: -. RSS growth: peak RSS over the timed steps minus "
              "RSS after the imports (library pages, thread pools and compiled code included). process: "
              "the whole process's peak RSS (compilation included).", "",
              "| model | batch | prec | " + " | ".join(engines) + " |", "|" + "---|" * (3 + len(engines))] + mem_lines
    lines += ["", "### Loss, first -> last step (%d steps; kiln: `kiln train` on the peers' batch)"
              % (a.warmup + a.steps), "",
              "| model | batch | prec | " + " | ".join(engines) + " |", "|" + "---|" * (3 + len(engines))] + loss_lines
    vers = {}
    for rs in results.values():
        for x in rs:
            for k in ("torch", "onnxruntime", "jax", "optax", "optimizer"):
                if k in x:
                    vers[k] = x[k]
    lines += ["", "Versions: " + ", ".join("%s %s" % kv for kv in sorted(vers.items())),
              "Log of every command: %s" % os.path.relpath(os.path.join(WORK, "last_run.log"), REPO)]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    log.close()


if __name__ == "__main__":
    main()
