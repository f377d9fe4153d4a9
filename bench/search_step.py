"""The DCS search's training step against the dense model's, and AdamW's step, per model (issue 50).

One process, interleaved, medians: for the DINOv2 ViT-S/14 112-px model (batch 16, the search's batch
on 2,000 images) and the main job's 28-px model (batch 128), under the search's precision (bf16
autocast with the explicit attention where the CPU has native bf16, else fp32):
- ``dense``: the plain model's step (forward, backward, clip, AdamW);
- ``weight_step``: the supernet's weight step (hidden gates, about half closed, hard masks, the gates frozen);
- ``arch_step``: its architecture step (Gumbel-sampled gates, only the gate logits trained);
- ``adamw``: the optimizer step alone over the model's weights, PyTorch's default (a Python loop per
  tensor on a CPU) against the fused kernel.

A change to the library is measured by running this script on the commit before it and on the commit
with it (``--label``: each run is kept in the JSON under its label), e.g.::

    python bench/search_step.py --label after --out bench/results/search_step.json

The library measured is the checkout this script sits in.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

from _common import header  # (first: puts the repository on sys.path)
import timm
import torch
import torch.nn.functional as F

from nascompress import runtime
from nascompress.methods.dcs import DCSConfig, make_supernet
from nascompress.methods.dcs_supernet import arch_parameters
from nascompress.models.build import build_model, custom_vit_spec
from nascompress.runs.json_io import write_json

MODELS = {
    "dinov2": {"batch": 16, "size": 112, "chans": 3},
    "main": {"batch": 128, "size": 28, "chans": 1},
}


def model_of(name: str) -> torch.nn.Module:
    if name == "dinov2":
        return timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=112, num_classes=10)
    spec = dict(img_size=28, patch_size=4, embed_dim=96, depth=6, num_heads=3, in_chans=1, num_classes=10)
    return build_model(custom_vit_spec(**spec))


def step(model, x, y, opt, amp: str, *, sample: bool | None = None) -> None:
    """One training step of ``model`` (a supernet when ``sample`` is given: its weight step with
    ``sample=False``, its architecture step with True), as the training loop runs it."""
    dev = torch.device("cpu")
    if sample is not None:
        model.dcs_state.sample = sample
        arch = {id(p) for p in arch_parameters(model)}
        for p in model.parameters():
            p.requires_grad_((id(p) in arch) == sample)
    with runtime.cpu_attention(model, dev, amp), runtime.autocast(dev, amp):
        loss = F.cross_entropy(model(x).float(), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
    opt.step()


def measure(name: str, amp: str, repeats: int) -> dict:
    torch.manual_seed(0)
    m = MODELS[name]
    dense = model_of(name).train()
    x = torch.randn(m["batch"], m["chans"], m["size"], m["size"])
    y = torch.randint(0, 10, (m["batch"],))
    sup = make_supernet(copy.deepcopy(dense), DCSConfig(qk_mask="static", mlp_gates="hidden"), tau=1.0).train()
    with torch.no_grad():  # about half of every block's hidden neurons closed
        for blk in sup.blocks:
            blk.dcs_alpha[::2] = -5.0
    cases = {
        "dense": lambda o: step(dense, x, y, o, amp),
        "weight_step": lambda o: step(sup, x, y, o, amp, sample=False),
        "arch_step": lambda o: step(sup, x, y, o, amp, sample=True),
    }
    opts = {
        "dense": torch.optim.AdamW(dense.parameters(), lr=1e-5),
        "weight_step": torch.optim.AdamW(sup.parameters(), lr=1e-5),
        "arch_step": torch.optim.AdamW(sup.parameters(), lr=1e-5),
    }
    weights = [p for p in dense.parameters()]
    grads = [torch.randn_like(p) for p in weights]
    adam = {k: torch.optim.AdamW(weights, lr=1e-5, **kw) for k, kw in (("default", {}), ("fused", {"fused": True}))}

    def adam_step(o):
        for p, g in zip(weights, grads):
            p.grad = g
        o.step()

    timers = {
        **{k: (lambda k=k: cases[k](opts[k])) for k in cases},
        **{f"adamw_{k}": (lambda o=o: adam_step(o)) for k, o in adam.items()},
    }
    for f in timers.values():  # warm-up
        f()
        f()
    times = {k: [] for k in timers}
    for _ in range(repeats):
        for k, f in timers.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    ms = {k: round(statistics.median(v) * 1000, 1) for k, v in times.items()}
    return {
        "batch": m["batch"],
        "precision": amp,
        "median_ms": ms,
        "weight_step_over_dense": round(ms["weight_step"] / ms["dense"], 3),
        "arch_step_over_dense": round(ms["arch_step"] / ms["dense"], 3),
        "adamw_fused_speedup": round(ms["adamw_default"] / ms["adamw_fused"], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True, help="what this checkout is (e.g. 'before: 7686331')")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="bench/results/search_step.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    amp = runtime.resolve_amp("auto", torch.device("cpu"))
    out = Path(a.out)
    result = json.loads(out.read_text()) if out.exists() else {"runs": {}}
    result["runs"][a.label] = {
        **header(),
        "threads": a.threads,
        "models": {name: measure(name, amp, a.repeats) for name in MODELS},
    }
    write_json(out, result)
    for name, r in result["runs"][a.label]["models"].items():
        print(
            a.label, name, r["median_ms"], "W/dense", r["weight_step_over_dense"], "A/dense", r["arch_step_over_dense"]
        )


if __name__ == "__main__":
    main()
