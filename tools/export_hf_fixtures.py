#!/usr/bin/env python3
"""Exports tiny Hugging Face models with current PyTorch exporters and writes PyTorch's
reference numbers for them (tests/data/hf/). Run it through tools/make_hf_fixtures.sh,
which makes the virtual environment it needs (PyPI torch, onnx, onnxscript, transformers);
the test suite only reads what this script wrote and committed.

Models (transformers, built from tiny configs with random weights, nothing downloaded):
  gpt2        GPT2LMHeadModel, lm_head tied to wte            input_ids
  llama       LlamaForCausalLM: RMSNorm, rotary, SwiGLU, 4 query / 2 key-value heads
                                                              input_ids
  bert        BertForSequenceClassification (3 labels)        input_ids, attention_mask
                                                              (one padded row), token_type_ids
  distilbert  DistilBertForSequenceClassification (3 labels)  input_ids, attention_mask
  vit         ViTForImageClassification (16x16 images, 4x4 patches, 5 labels)
                                                              pixel_values
  t5          T5ForConditionalGeneration (eager attention: the SDPA path fails in torch
              2.15's decompositions with dynamic shapes)      input_ids, attention_mask,
                                                              decoder_input_ids
Every parameter gets seeded noise on top of its initial value (std 0.02), as a trained
model's weights would differ: the torch.export-based exporter merges equal-valued
initializers (all LayerNorm weights of a fresh model are ones) and drops all-zero biases,
which a fixture of fresh weights would test instead of the model (kiln's own tests cover
that case with a fresh model exported separately: fresh_gpt2.onnx).

Variants: "logits" (the graph returns logits; kiln attaches the cross-entropy loss, with
labels already shifted for causal LMs) and "loss" (the model computes its loss from a
`labels` input; kiln trains with --loss model).

Routes (all with dynamic axes batch and seq, as users export models they train on
variable-length data; a static export folds parts of parameters into constants, e.g.
GPT-2's wpe[:T]):
  dynamo       torch.onnx.export(..., dynamo=True)             the default opset (20)
  dynamo18     torch.onnx.export(..., dynamo=True, opset_version=18)
  dynamo23     torch.onnx.export(..., dynamo=True, opset_version=23): Attention,
               RMSNormalization, RotaryEmbedding
  torchscript  torch.onnx.export(..., dynamo=False)            the TorchScript exporter at
               its default opset; causal LMs also take attention_mask (all ones): without
               it transformers computes packed-sequence indices with aten::diff, which the
               TorchScript exporter cannot export
A route that fails to export is recorded in manifest.json with the exporter's message.

Per model folder: the ONNX files, one .npy per input (batch 2, sequence 8),
logit_labels.npy (labels for the logits variant: next tokens, -100 at the end, for causal
LMs), reference.json, and grads_<variant>.safetensors (d loss / d parameter, float32,
keyed by PyTorch's parameter names). reference.json holds PyTorch's parameters
(named_parameters(): names and shapes), per variant the loss on the batch, 20 AdamW losses
in float32 and 20 under CPU autocast to bfloat16 (same batch every step; AdamW lr 1e-3,
betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on parameters of rank >= 2, gradients
clipped to norm 1.0, constant rate; losses[i] is the loss before update i), and for the
logits variant logits.npy.

Usage: tools/export_hf_fixtures.py [--only MODEL ...] [--out DIR]
"""
import argparse
import collections
import json
import os
import sys
import traceback
import warnings

import numpy as np
import onnx
import torch
import torch.nn.functional as F
import transformers as T
from safetensors.torch import save_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, S, V = 2, 8, 96
STEPS = 20
ADAMW = {"learning_rate": 1e-3, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
         "weight_decay": 0.01, "max_grad_norm": 1.0, "steps": STEPS}


def causal_lm(base, with_mask):
    """Subclasses returning logits / loss from (input_ids[, attention_mask][, labels])."""
    if with_mask:
        class Logits(base):
            def forward(self, input_ids, attention_mask):
                return super().forward(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

        class Loss(base):
            def forward(self, input_ids, attention_mask, labels):
                return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                       use_cache=False).loss
        return Logits, Loss, ["input_ids", "attention_mask"]

    class Logits(base):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    class Loss(base):
        def forward(self, input_ids, labels):
            return super().forward(input_ids=input_ids, labels=labels, use_cache=False).loss
    return Logits, Loss, ["input_ids"]


def gpt2(with_mask):
    cfg = T.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return (cfg,) + causal_lm(T.GPT2LMHeadModel, with_mask)


def llama(with_mask):
    cfg = T.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return (cfg,) + causal_lm(T.LlamaForCausalLM, with_mask)


def bert(with_mask):
    cfg = T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=0)

    class Logits(T.BertForSequenceClassification):
        def forward(self, input_ids, attention_mask, token_type_ids):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                   token_type_ids=token_type_ids).logits

    class Loss(T.BertForSequenceClassification):
        def forward(self, input_ids, attention_mask, token_type_ids, labels):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                   labels=labels).loss
    return cfg, Logits, Loss, ["input_ids", "attention_mask", "token_type_ids"]


def distilbert(with_mask):
    cfg = T.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64,
                             dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=3, pad_token_id=0)

    class Logits(T.DistilBertForSequenceClassification):
        def forward(self, input_ids, attention_mask):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask).logits

    class Loss(T.DistilBertForSequenceClassification):
        def forward(self, input_ids, attention_mask, labels):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    return cfg, Logits, Loss, ["input_ids", "attention_mask"]


def vit(with_mask):
    cfg = T.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, num_labels=5)

    class Logits(T.ViTForImageClassification):
        def forward(self, pixel_values):
            return super().forward(pixel_values=pixel_values).logits

    class Loss(T.ViTForImageClassification):
        # transformers 5.25's ViT loss path passes the config where a size is expected
        # (TypeError in eager PyTorch); the same cross entropy, written out.
        def forward(self, pixel_values, labels):
            return F.cross_entropy(super().forward(pixel_values=pixel_values).logits, labels)
    return cfg, Logits, Loss, ["pixel_values"]


def t5(with_mask):
    cfg = T.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                     decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    cfg._attn_implementation = "eager"

    class Logits(T.T5ForConditionalGeneration):
        def forward(self, input_ids, attention_mask, decoder_input_ids):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                   decoder_input_ids=decoder_input_ids, use_cache=False).logits

    class Loss(T.T5ForConditionalGeneration):
        def forward(self, input_ids, attention_mask, labels):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                   use_cache=False).loss
    return cfg, Logits, Loss, ["input_ids", "attention_mask", "decoder_input_ids"]


def input_names(names, variant, model):
    """Inputs of the variant before `labels`: T5 makes its decoder inputs from the labels."""
    if variant == "loss" and model == "t5":
        return [n for n in names if n != "decoder_input_ids"]
    return names


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "distilbert": distilbert, "vit": vit, "t5": t5}
CAUSAL = {"gpt2", "llama"}
ROUTES = [("dynamo", dict(dynamo=True)), ("dynamo18", dict(dynamo=True, opset_version=18)),
          ("dynamo23", dict(dynamo=True, opset_version=23)), ("torchscript", dict(dynamo=False))]


def make_data(name, g):
    """The batch (every input any route or variant reads) and the logits variant's labels."""
    d = {}
    if name == "vit":
        d["pixel_values"] = torch.randn(B, 3, 16, 16, generator=g)
        d["labels"] = torch.tensor([1, 4])
        d["logit_labels"] = d["labels"]
        return d
    d["input_ids"] = torch.randint(2, V, (B, S), generator=g)
    d["attention_mask"] = torch.ones(B, S, dtype=torch.long)
    if name in ("bert", "distilbert", "t5"):
        d["attention_mask"][1, 6:] = 0  # one padded row
    if name == "bert":
        d["token_type_ids"] = torch.zeros(B, S, dtype=torch.long)
        d["token_type_ids"][:, 4:] = 1
    if name in CAUSAL:
        d["labels"] = d["input_ids"].clone()  # the model shifts them
        ll = torch.full((B, S), -100, dtype=torch.long)
        ll[:, :-1] = d["input_ids"][:, 1:]
        d["logit_labels"] = ll
    elif name == "t5":
        d["labels"] = torch.randint(2, V, (B, S), generator=g)
        d["decoder_input_ids"] = torch.cat([torch.zeros(B, 1, dtype=torch.long), d["labels"][:, :-1]], 1)
        d["logit_labels"] = d["labels"]
    else:
        d["labels"] = torch.tensor([0, 2])
        d["logit_labels"] = d["labels"]
    return d


def build(name, cls, cfg):
    """The model with seeded weights: initial values plus N(0, 0.02) noise per parameter."""
    torch.manual_seed(0)
    m = cls(cfg)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for _, p in m.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return m


def loss_of(m, variant, names, data):
    args = [data[n] for n in names]
    if variant == "loss":
        return m(*args, data["labels"]), None
    logits = m(*args)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data["logit_labels"].reshape(-1)), logits


def adamw_losses(m, variant, names, data, bf16):
    decay = [p for _, p in m.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in m.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": ADAMW["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=ADAMW["learning_rate"],
                            betas=(ADAMW["adam_beta1"], ADAMW["adam_beta2"]), eps=ADAMW["adam_epsilon"])
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = loss_of(m, variant, names, data)
        loss.float().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), ADAMW["max_grad_norm"])
        opt.step()
        out.append(float(loss.float()))
    return out


def export(m, route_kw, names, data, variant, path):
    args = tuple(data[n] for n in names) + ((data["labels"],) if variant == "loss" else ())
    in_names = names + (["labels"] if variant == "loss" else [])
    dyn = {}
    for n in in_names:
        rank = data[n].dim()
        dyn[n] = {0: "batch", 1: "seq"} if rank == 2 else {0: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, args, path, input_names=in_names, output_names=[variant], dynamic_axes=dyn, **route_kw)
    mp = onnx.load(path)
    opset = [o.version for o in mp.opset_import if o.domain in ("", "ai.onnx")][0]
    ops = collections.Counter(n.op_type for n in mp.graph.node)
    return in_names, opset, dict(sorted(ops.items()))


def one_model(name, out_root, manifest):
    folder = os.path.join(out_root, name)
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(42)
    data = make_data(name, g)
    for k, v in data.items():
        np.save(os.path.join(folder, k + ".npy"), v.numpy())
    ref = {"batch": B, "seq": S, "adamw": ADAMW, "variants": {}}
    for variant in ("logits", "loss"):
        cfg, Logits, Loss, names = MODELS[name](False)
        names = input_names(names, variant, name)
        cls = Logits if variant == "logits" else Loss
        m = build(name, cls, cfg).train()
        ref["parameters"] = [[n, list(p.shape)] for n, p in m.named_parameters()]
        loss, logits = loss_of(m, variant, names, data)
        loss.backward()
        grads = {n: p.grad.detach().clone().contiguous() for n, p in m.named_parameters()}
        save_file(grads, os.path.join(folder, f"grads_{variant}.safetensors"))
        v = {"loss": float(loss)}
        if logits is not None:
            np.save(os.path.join(folder, "logits.npy"), logits.detach().numpy())
        v["adamw_f32"] = adamw_losses(build(name, cls, cfg).train(), variant, names, data, False)
        v["adamw_bf16"] = adamw_losses(build(name, cls, cfg).train(), variant, names, data, True)
        ref["variants"][variant] = v
        for route, kw in ROUTES:
            with_mask = route == "torchscript" and name in CAUSAL
            cfg_r, Logits_r, Loss_r, names_r = MODELS[name](with_mask)
            names_r = input_names(names_r, variant, name)
            mr = build(name, Logits_r if variant == "logits" else Loss_r, cfg_r).eval()
            fname = f"{variant}_{route}.onnx"
            entry = {"model": name, "variant": variant, "route": route, "file": f"{name}/{fname}"}
            try:
                in_names, opset, ops = export(mr, kw, names_r, data, variant, os.path.join(folder, fname))
                entry.update({"exported": True, "inputs": in_names, "opset": opset, "ops": ops})
            except Exception as e:  # the exporter's own failure, recorded
                msg = str(e).strip().splitlines()
                summary = next((l for l in msg if "Error" in l or "not supported" in l), msg[0] if msg else repr(e))
                entry.update({"exported": False, "reason": f"{type(e).__name__}: {summary[:300]}"})
                if os.path.exists(os.path.join(folder, fname)):
                    os.remove(os.path.join(folder, fname))
            print(f"{entry['file']}: " + (f"opset {entry['opset']}, {sum(entry['ops'].values())} nodes"
                                           if entry["exported"] else "not exported: " + entry["reason"]), flush=True)
            manifest.append(entry)
    with open(os.path.join(folder, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)


def fresh_gpt2(out_root):
    """A freshly initialized GPT-2 (no noise) exported with the default exporter (its
    LayerNorm weights (ones) and biases (zeros) are merged or dropped by the exporter) and
    with the TorchScript exporter (which aliases them through Identity nodes)."""
    cfg, Logits, _, names = gpt2(False)
    torch.manual_seed(0)
    m = Logits(cfg).eval()
    data = make_data("gpt2", torch.Generator().manual_seed(42))
    export(m, dict(dynamo=True), names, data, "logits", os.path.join(out_root, "gpt2", "fresh_dynamo.onnx"))
    # The TorchScript exporter deduplicates equal-valued initializers through Identity
    # aliases (named as PyTorch's parameters); same model, same seed.
    cfg_t, Logits_t, _, names_t = gpt2(True)
    torch.manual_seed(0)
    mt = Logits_t(cfg_t).eval()
    export(mt, dict(dynamo=False), names_t, data, "logits", os.path.join(out_root, "gpt2", "fresh_torchscript.onnx"))
    params = [[n, list(p.shape)] for n, p in m.named_parameters()]
    with open(os.path.join(out_root, "gpt2", "fresh_parameters.json"), "w") as f:
        json.dump(params, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=list(MODELS))
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "data", "hf"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    os.makedirs(a.out, exist_ok=True)
    mpath = os.path.join(a.out, "manifest.json")
    manifest = []
    if os.path.exists(mpath):
        with open(mpath) as f:
            manifest = [e for e in json.load(f)["fixtures"] if e["model"] not in a.only]
    for name in a.only:
        one_model(name, a.out, manifest)
    if "gpt2" in a.only:
        fresh_gpt2(a.out)
    versions = {"torch": torch.__version__, "onnx": onnx.__version__, "transformers": T.__version__}
    try:
        import onnxscript
        versions["onnxscript"] = onnxscript.__version__
    except ImportError:
        pass
    manifest.sort(key=lambda e: (e["model"], e["variant"], e["route"]))
    with open(mpath, "w") as f:
        json.dump({"versions": versions, "fixtures": manifest}, f, indent=1)
    n_ok = sum(e["exported"] for e in manifest)
    print(f"{n_ok} of {len(manifest)} exports written to {a.out}")


if __name__ == "__main__":
    main()
