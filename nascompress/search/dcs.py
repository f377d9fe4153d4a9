"""``nascompress search dcs``: the DCS differentiable channel search (seed 003 section 3.4, A.2).

Each epoch the training split is cut once (:func:`~nascompress.data.split_indices`, fixed seed)
into 70% for the network weights W and 30% for the architecture parameters alpha (and the
static Q/K theta); W-steps and alpha-steps alternate, spread evenly over the epoch (first
order). W-steps minimise CE; alpha-steps minimise

    CE + lambda * log(cost / dense_cost) + entropy_weight * H(g_hat)

where cost is the analytic FLOPs (MACs, as the profiler counts them) of the network with each
block's MLP width replaced by the soft count sum(g_hat). The temperature starts at 4.5 and is
multiplied by 0.95 every epoch; both AdamW optimizers follow a cosine (weights 1e-3 -> 1e-4; alpha
the same shape from its own peak). With ``target_flops`` lambda is steered after every alpha-step
by :class:`LambdaSteer`, a PI controller on ``ratio / target - 1`` (ratio: the exact FLOPs of the
current hard architecture). lambda then acts as the Lagrange multiplier of the FLOPs target and may
go negative when the architecture falls below it (Adam normalises step sizes, so only the sign of
the cost push really counts). If the last epoch still ends outside the tolerance, the gate
threshold is shifted (logged as ``calibration``) so that the result lands inside it.
"""
from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..api import count_classes, run_data_config
from ..data import DataConfig, InputSpec, Subset, load_data, make_loader, preprocess, split_indices
from ..errors import NascompressError
from ..evaluate import evaluate
from ..io import load_state, load_with_arch, make_arch, save_model, save_state
from ..methods.dcs import DCSConfig, arch_parameters, binary_entropy, make_record, make_supernet
from ..models import ModelSpec, build_model, load_pretrained
from ..profiling import count_flops
from ..progress import make_progress
from ..train import check_classes, decay_groups, input_spec_for
from ..utils import (
    append_jsonl,
    create_out_dir,
    prepare_out_dir,
    recorded_job,
    resolve_device,
    seed_everything,
    write_json,
)

CHECKPOINT_FILE = "checkpoint.safetensors"
LOG_FILE = "log.jsonl"


@dataclass(frozen=True)
class DCSSearchConfig:
    """Search settings (defaults from the paper where it gives them).

    Args:
        epochs: search epochs (the paper: 200).
        lr / min_lr: AdamW cosine for the weights, 1e-3 -> 1e-4.
        arch_lr: peak AdamW lr of alpha (same cosine, scaled); None = ``lr``.
        lam: lambda of ``lambda * log cost`` (paper range 0.1-0.5) when no target is given.
        entropy_weight: weight of the gates' mean binary entropy (pushes g_hat to 0/1).
        tau0 / tau_decay: temperature at epoch 0 and its factor per epoch.
        target_flops: FLOPs of the result as a ratio of the dense model's, in (0, 1].
        tolerance: relative band around the target the result must land in.
        steer_gain / steer_rate: proportional and integral gains of the lambda controller.
        weight_fraction: share of the training split for W (the rest updates alpha).
        round_mlp: 0 (the paper) or k > 0: after the last epoch a block MLP with fewer than k
            kept channels is closed and one with more than C - k is opened fully (see
            :func:`round_blocks`), then the gate threshold is recalibrated to the target.
    """

    epochs: int = 4
    batch_size: int = 128
    lr: float = 1e-3
    min_lr: float = 1e-4
    arch_lr: float | None = None
    weight_decay: float = 0.01
    label_smoothing: float = 0.1
    lam: float = 0.2
    entropy_weight: float = 0.01
    tau0: float = 4.5
    tau_decay: float = 0.95
    target_flops: float | None = None
    tolerance: float = 0.05
    steer_gain: float = 4.0
    steer_rate: float = 0.002
    weight_fraction: float = 0.7
    round_mlp: int = 0
    grad_clip: float = 1.0
    eval_batch_size: int = 256
    seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.target_flops is not None and not 0 < self.target_flops <= 1:
            raise NascompressError(
                f"--target-flops must be in (0, 1] (a ratio of the dense FLOPs), got {self.target_flops}")
        if self.epochs < 1:
            raise NascompressError(f"--epochs must be at least 1, got {self.epochs}")
        if self.lam < 0:
            raise NascompressError(f"--lam must be >= 0, got {self.lam}")
        if not 0 < self.weight_fraction < 1:
            raise NascompressError(f"weight_fraction must be in (0, 1), got {self.weight_fraction}")
        if not (self.tau0 > 0 and 0 < self.tau_decay <= 1):
            raise NascompressError(f"need tau0 > 0 and 0 < tau_decay <= 1, got {self.tau0}, {self.tau_decay}")
        if self.batch_size < 1 or not self.lr > 0:
            raise NascompressError("--batch-size must be >= 1 and --lr > 0")

    @property
    def peak_arch_lr(self) -> float:
        return self.lr if self.arch_lr is None else self.arch_lr


@dataclass(frozen=True)
class DCSSearchJob:
    """Everything ``nascompress search dcs`` needs; written to the run's ``config.json``.

    Args:
        source: a dense run directory (``nascompress train``) or a timm model name.
        weights: local weights for a timm name (``.safetensors``/``.pth``).
        model_kwargs: timm build overrides for a timm name (num_classes defaults to the data's).
        data: the dataset (default: the source run's ``data`` section, else Fashion-MNIST).
    """

    source: str
    out: str
    method: DCSConfig = field(default_factory=DCSConfig)
    search: DCSSearchConfig = field(default_factory=DCSSearchConfig)
    data: DataConfig | None = None
    weights: str | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "out": self.out, "method": self.method.to_dict(), "search": asdict(self.search),
                "data": None if self.data is None else asdict(self.data), "weights": self.weights,
                "model_kwargs": dict(self.model_kwargs)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DCSSearchJob":
        return cls(source=d["source"], out=d["out"], method=DCSConfig.from_dict(d["method"]),
                   search=DCSSearchConfig(**d["search"]), data=DataConfig(**d["data"]) if d.get("data") else None,
                   weights=d.get("weights"), model_kwargs=d.get("model_kwargs") or {})


# ---------------------------------------------------------------------------------------------
# The cost model: exact MACs of the hard architecture, and its differentiable soft estimate


@dataclass
class CostModel:
    """Per-image MACs of a DCS supernet's architectures, calibrated once with the profiler.

    ``fixed`` is everything but the MLPs (theta Linears of the input-dependent mask included),
    ``mlp[j]`` block j's dense MLP MACs, which scale linearly with its kept width.
    """

    dense: float
    fixed: float
    mlp: list[float]
    width: list[int]
    tokens: int

    @classmethod
    def build(cls, dense_model: nn.Module, supernet: nn.Module, x: torch.Tensor) -> "CostModel":
        dense = count_flops(dense_model, x).total
        rep = count_flops(supernet, x)  # gates still all open (alpha_init > 0): full widths
        mlp = [b["mlp"] for b in rep.blocks]
        return cls(dense=dense, fixed=rep.total - sum(mlp), mlp=mlp,
                   width=[blk.mlp.fc1.in_features for blk in supernet.blocks], tokens=supernet.dcs_state.tokens)

    def _qk_saving(self, supernet: nn.Module) -> float:
        """MACs the static Q/K masks remove: q/k rows of qkv, and QK^T at the padded head size."""
        saving = 0.0
        for blk in supernet.blocks:
            attn = blk.attn
            if getattr(attn, "dcs_qk", None) != "static":
                continue
            kept = (attn.dcs_theta.detach().reshape(attn.num_heads, -1) > 0).sum(-1).tolist()
            N, H, kmax = self.tokens, attn.num_heads, max(1, *kept)  # heads padded to the largest count
            saving += N * attn.qkv.in_features * 2 * H * (attn.head_dim - kmax)  # q and k rows of qkv
            saving += N * N * H * (attn.head_dim - kmax)  # QK^T
        return saving

    def _widths(self, supernet: nn.Module, soft: dict[int, torch.Tensor]) -> list[Any]:
        """Per block kept MLP width as a fraction of C: soft counts where given, else hard."""
        out: list[Any] = []
        for j, blk in enumerate(supernet.blocks):
            alpha = getattr(blk, "dcs_alpha", None)
            if alpha is None:
                out.append(1.0)
            elif j in soft:
                out.append(soft[j].sum() / self.width[j])
            else:
                out.append((alpha.detach() > 0).sum().item() / self.width[j])
        return out

    def _macs(self, supernet: nn.Module, soft: dict[int, torch.Tensor]) -> Any:
        widths = self._widths(supernet, soft)
        return self.fixed - self._qk_saving(supernet) + sum(m * w for m, w in zip(self.mlp, widths))

    def hard_macs(self, supernet: nn.Module) -> float:
        """Exact MACs of the materialized model the current gates give (= the profiler's count)."""
        return self._macs(supernet, {})

    def soft_macs(self, supernet: nn.Module) -> torch.Tensor:
        """Differentiable MACs: block MLP widths = sum of the last forward's soft gates g_hat."""
        return self._macs(supernet, supernet.dcs_state.soft_gates)

    @torch.no_grad()
    def expected_macs(self, supernet: nn.Module) -> float:
        """MACs in expectation over the Gumbel noise: P(gate on) = sigmoid(alpha)."""
        soft = {j: torch.sigmoid(blk.dcs_alpha) for j, blk in enumerate(supernet.blocks)
                if getattr(blk, "dcs_alpha", None) is not None}
        return float(self._macs(supernet, soft))


@dataclass
class LambdaSteer:
    """PI controller of lambda toward a FLOPs target (state: the integral, checkpointed).

    ``lam = clip(integral + gain * e)``, ``integral = clip(integral + rate * e)``, with
    ``e = ratio / target - 1`` and both clipped to ``[-lam_max, lam_max]`` (no wind-up).
    """

    target: float
    integral: float
    gain: float = 4.0
    rate: float = 0.002
    lam_max: float = 5.0

    def update(self, ratio: float) -> float:
        e = ratio / self.target - 1
        self.integral = max(-self.lam_max, min(self.lam_max, self.integral + self.rate * e))
        return max(-self.lam_max, min(self.lam_max, self.integral + self.gain * e))


@torch.no_grad()
def round_blocks(supernet: nn.Module, k: int) -> dict[str, list[int]]:
    """Close block MLPs keeping fewer than ``k`` channels, open those keeping more than C - k.

    Not in the paper; why: a block MLP with a handful of channels still pays its whole hidden
    width at run time (fc1's bias and output, GELU over all hidden units), which FLOPs do not
    count, so its few FLOPs buy little speed; a nearly full one pays a gather and a write-back
    for nothing. Closing sets alpha to -30 (no Gumbel sample reopens it); opening sets the
    negative alphas to +1. Returns the block indices changed.
    """
    closed, opened = [], []
    for j, blk in enumerate(supernet.blocks):
        alpha = getattr(blk, "dcs_alpha", None)
        if alpha is None:
            continue
        kept, C = int((alpha > 0).sum()), alpha.numel()
        if 0 < kept < k:
            alpha.clamp_(max=-30.0)
            closed.append(j)
        elif C - k < kept < C:
            alpha.clamp_(min=1.0)
            opened.append(j)
    return {"closed": closed, "opened": opened}


@torch.no_grad()
def calibrate(supernet: nn.Module, cost: CostModel, target: float, *, round_mlp: int = 0) -> float:
    """Shift every alpha by one constant (then :func:`round_blocks` with ``round_mlp``) so that the
    hard ratio is closest to ``target``; return the shift. Kept counts fall monotonically as the
    shift rises (rounding keeps that order), so the shift is bisected."""
    alphas = [blk.dcs_alpha for blk in supernet.blocks if getattr(blk, "dcs_alpha", None) is not None]
    if not alphas:
        return 0.0
    vals = torch.cat([a.flatten() for a in alphas]).sort().values
    cuts = torch.cat([vals[:1] - 1, (vals[1:] + vals[:-1]) / 2, vals[-1:] + 1]).tolist()

    def shifted(b: float) -> None:
        for a in alphas:
            a.sub_(b)
        if round_mlp:
            round_blocks(supernet, round_mlp)

    saved = [a.clone() for a in alphas]
    best, best_err = 0.0, math.inf
    lo, hi = 0, len(cuts) - 1  # ratio decreases as the cut rises: bisect for the target
    while lo <= hi:
        mid = (lo + hi) // 2
        shifted(cuts[mid])
        r = cost.hard_macs(supernet) / cost.dense
        for a, s in zip(alphas, saved):
            a.copy_(s)
        if abs(r / target - 1) < best_err:
            best, best_err = cuts[mid], abs(r / target - 1)
        lo, hi = (mid + 1, hi) if r > target else (lo, mid - 1)
    shifted(best)
    return best


# ---------------------------------------------------------------------------------------------
# The job


def _cosine(step: int, total: int, start: float, end: float) -> float:
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * min(1.0, step / max(1, total))))


def _interleave(n_w: int, n_a: int) -> list[str]:
    """``n_w`` 'w' and ``n_a`` 'a' steps, the alpha-steps spread evenly between the W-steps."""
    keys = [((i + 0.5) / n_w, "w") for i in range(n_w)] + [((j + 1.0) / n_a, "a") for j in range(n_a)]
    return [k for _, k in sorted(keys)]


def _build_source(job: DCSSearchJob) -> tuple[nn.Module, dict[str, Any], DataConfig]:
    src = Path(job.source)
    if src.is_dir():
        model, arch = load_with_arch(src)
        if arch["methods"]:
            raise NascompressError(f"{src} is not a dense run (it has methods {[m['name'] for m in arch['methods']]})")
        return model, arch, job.data or run_data_config(src) or DataConfig()
    if job.weights is None:
        raise NascompressError(f"{job.source} is not a run directory; to search a timm model name give --weights FILE")
    data = job.data or DataConfig()
    spec = ModelSpec(job.source, dict({"num_classes": count_classes(data)}, **job.model_kwargs))
    model = build_model(spec)
    load_pretrained(model, job.weights)
    return model, make_arch(spec, input_spec=input_spec_for(model, data.dataset).to_dict()), data


def search_dcs(job: DCSSearchJob, *, force: bool = False, resume: bool = False) -> dict[str, Any]:
    """Run (or ``resume``) the DCS search; writes the supernet, arch.json, log.jsonl, metrics.json."""
    out = Path(job.out)
    if resume:
        job = recorded_job(out, DCSSearchJob, "nascompress search dcs")
    elif Path(job.source).is_dir():  # recorded absolute: materialize reads the dense run's data section
        job = replace(job, source=str(Path(job.source).resolve()))
    prepare_out_dir(out, force=force, resume=resume)
    cfg = job.search
    device = resolve_device(cfg.device)
    dense, base_arch, data_cfg = _build_source(job)
    spec = InputSpec.from_dict(base_arch["input"])
    data = load_data(data_cfg, img_size=spec.img_size)
    check_classes(dense.num_classes, data)
    seed_everything(cfg.seed)
    supernet = make_supernet(copy.deepcopy(dense), job.method, tau=cfg.tau0)
    x_probe = torch.zeros(1, spec.in_chans, *spec.img_size)
    cost = CostModel.build(dense, supernet, x_probe)
    supernet.to(device)
    del dense

    create_out_dir(out, force=force, resume=resume)
    write_json(out / "config.json", dict(job.to_dict(), data=asdict(data_cfg)))
    arch = copy.deepcopy(base_arch)

    w_idx, a_idx = split_indices(len(data.train), (cfg.weight_fraction, 1 - cfg.weight_fraction), seed=cfg.seed)
    w_data, a_data = Subset(data.train, w_idx), Subset(data.train, a_idx)
    n_w, n_a = math.ceil(len(w_data) / cfg.batch_size), math.ceil(len(a_data) / cfg.batch_size)
    total_steps = cfg.epochs * (n_w + n_a)
    a_params = arch_parameters(supernet)
    a_ids = {id(p) for p in a_params}
    w_groups = [dict(g, params=[p for p in g["params"] if id(p) not in a_ids])
                for g in decay_groups(supernet, cfg.weight_decay)]
    w_params = [p for g in w_groups for p in g["params"]]
    opt_w = torch.optim.AdamW(w_groups, lr=cfg.lr, betas=(0.9, 0.999))
    opt_a = torch.optim.AdamW(a_params, lr=cfg.peak_arch_lr, betas=(0.9, 0.999), weight_decay=0.0)
    lam, start_epoch, search_time = cfg.lam, 0, 0.0
    # With a target, lambda is the controller's output (the integral starts at 0: no wind-up while
    # alpha is still far from the gate threshold); without one it is the paper's constant --lam.
    steer = None if cfg.target_flops is None else LambdaSteer(cfg.target_flops, 0.0, cfg.steer_gain, cfg.steer_rate)
    ckpt_path, log_path = out / CHECKPOINT_FILE, out / LOG_FILE
    if resume and ckpt_path.exists():
        st = load_state(ckpt_path)
        supernet.load_state_dict(st["model"])
        opt_w.load_state_dict(st["opt_w"])
        opt_a.load_state_dict(st["opt_a"])
        torch.set_rng_state(st["rng"])
        lam, start_epoch, search_time = st["lam"], st["epoch"] + 1, st["search_time"]
        if steer is not None:
            steer.integral = st["lam_integral"]
        if log_path.exists():  # drop log lines of an interrupted epoch
            lines = [ln for ln in log_path.read_text().splitlines()
                     if ln and int(json.loads(ln)["epoch"]) < start_epoch]
            log_path.write_text("".join(ln + "\n" for ln in lines))
    elif log_path.exists():
        log_path.unlink()

    def save_supernet() -> None:
        arch["methods"] = list(base_arch["methods"]) + [make_record(supernet, job.method, stage="supernet")]
        save_model(out, supernet, arch)

    with make_progress() as progress:
        ep_task = progress.add_task("search epochs", total=cfg.epochs, completed=start_epoch, info="")
        for epoch in range(start_epoch, cfg.epochs):
            tau = cfg.tau0 * cfg.tau_decay ** epoch
            supernet.dcs_state.tau = tau
            supernet.train()
            w_iter = iter(make_loader(w_data, batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed, epoch=epoch))
            a_iter = iter(make_loader(a_data, batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed + 1, epoch=epoch))
            order = _interleave(n_w, n_a)
            task = progress.add_task(f"epoch {epoch + 1}", total=len(order), info="")
            sums: dict[str, float] = {}
            counts: dict[str, int] = {}
            t0 = time.perf_counter()
            for i, kind in enumerate(order):
                step = epoch * len(order) + i
                for g in opt_w.param_groups:
                    g["lr"] = _cosine(step, total_steps, cfg.lr, cfg.min_lr)
                for g in opt_a.param_groups:  # the same cosine shape, scaled to alpha's peak
                    g["lr"] = _cosine(step, total_steps, cfg.peak_arch_lr, cfg.peak_arch_lr * cfg.min_lr / cfg.lr)
                imgs, labels = next(w_iter if kind == "w" else a_iter)
                x, y = preprocess(imgs, spec).to(device), labels.to(device)
                for p in w_params:  # first order: each step differentiates only what it updates
                    p.requires_grad_(kind == "w")
                for p in a_params:
                    p.requires_grad_(kind == "a")
                loss, logs = step_loss(supernet, x, y, kind=kind, cost=cost, lam=lam, cfg=cfg)
                opt = opt_w if kind == "w" else opt_a
                if not torch.isfinite(loss):
                    raise NascompressError(
                        f"search loss became {loss.item()} at epoch {epoch + 1} step {i}; lower --lr")
                opt_w.zero_grad(set_to_none=True)
                opt_a.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip > 0 and kind == "w":
                    torch.nn.utils.clip_grad_norm_(w_params, cfg.grad_clip)
                opt.step()
                if kind == "a" and steer is not None:
                    lam = steer.update(cost.hard_macs(supernet) / cost.dense)
                for k, v in logs.items():
                    sums[k] = sums.get(k, 0.0) + v
                    counts[k] = counts.get(k, 0) + 1
                ratio = cost.hard_macs(supernet) / cost.dense
                progress.update(task, advance=1, info=f"ce {logs[f'ce_{kind}']:.3f} flops {ratio:.3f} lam {lam:.3g}")
            epoch_time = time.perf_counter() - t0
            search_time += epoch_time
            for p in w_params + a_params:
                p.requires_grad_(True)
            progress.remove_task(task)
            record = epoch_record(supernet, cost, epoch=epoch, tau=tau, lam=lam, epoch_time=epoch_time,
                                  means={k: sums[k] / counts[k] for k in sums})
            final_epoch = epoch == cfg.epochs - 1
            if cfg.round_mlp and final_epoch:  # at the end only: mid-search the widths are still moving
                record["rounded"] = round_blocks(supernet, cfg.round_mlp)
            if final_epoch and not within(cost.hard_macs(supernet) / cost.dense, cfg):  # land inside the band
                record["calibration"] = {
                    "alpha_shift": calibrate(supernet, cost, cfg.target_flops, round_mlp=cfg.round_mlp)}
            record.update(epoch_record(supernet, cost, epoch=epoch, tau=tau, lam=lam, epoch_time=epoch_time, means={}))
            val = evaluate(supernet, data.val, input_spec=spec, device=device, batch_size=cfg.eval_batch_size)
            record.update(val_top1=val["top1"], val_loss=val["loss"])
            save_supernet()
            save_state(ckpt_path, {"model": supernet.state_dict(), "opt_w": opt_w.state_dict(),
                                   "opt_a": opt_a.state_dict(), "rng": torch.get_rng_state(), "lam": lam,
                                   "lam_integral": None if steer is None else steer.integral,
                                   "epoch": epoch, "search_time": search_time})
            append_jsonl(log_path, record)
            progress.update(ep_task, advance=1, info=f"flops {record['flops_ratio']:.3f} val {val['top1']:.2f}%")

    log = [json.loads(ln) for ln in log_path.read_text().splitlines() if ln]
    last = log[-1]
    if cfg.target_flops is not None and not within(last["flops_ratio"], cfg):
        raise NascompressError(f"the search ended at a FLOPs ratio of {last['flops_ratio']:.3f}, outside "
                               f"{cfg.target_flops} +-{cfg.tolerance:.0%}; run more --epochs or raise --arch-lr")
    metrics = {"finished": True, "dense_macs": cost.dense, "macs": last["macs"], "flops_ratio": last["flops_ratio"],
               "target_flops": cfg.target_flops, "lam": lam, "val_top1": last["val_top1"], "epochs": cfg.epochs,
               "search_time_s": search_time, "epoch_time_s": [r["epoch_time_s"] for r in log],
               "mlp_kept": last["mlp_kept"], "calibrated": any("calibration" in r for r in log),
               "train_images": len(data.train), "dataset": data.name}
    write_json(out / "metrics.json", metrics)
    return metrics


def step_loss(supernet: nn.Module, x: torch.Tensor, y: torch.Tensor, *, kind: str, cost: CostModel, lam: float,
              cfg: DCSSearchConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one W-step (``kind="w"``: CE) or alpha-step (``"a"``: CE + lam log cost + entropy)."""
    ce = F.cross_entropy(supernet(x), y, label_smoothing=cfg.label_smoothing)
    if kind == "w":
        return ce, {"ce_w": ce.item()}
    soft = supernet.dcs_state.soft_gates  # this forward's g_hat per block
    log_cost = torch.log(cost.soft_macs(supernet) / cost.dense)
    ent = binary_entropy(torch.cat([soft[j] for j in sorted(soft)])) if soft else torch.zeros((), device=x.device)
    loss = ce + lam * log_cost + cfg.entropy_weight * ent
    return loss, {"ce_a": ce.item(), "log_cost": log_cost.item(), "entropy": ent.item()}


def within(ratio: float, cfg: DCSSearchConfig) -> bool:
    return cfg.target_flops is None or abs(ratio / cfg.target_flops - 1) <= cfg.tolerance


def epoch_record(supernet: nn.Module, cost: CostModel, *, epoch: int, tau: float, lam: float, epoch_time: float,
                 means: dict[str, float]) -> dict[str, Any]:
    """One line of ``log.jsonl``: losses, expected and exact FLOPs, channels kept per block."""
    macs = cost.hard_macs(supernet)
    expected = cost.expected_macs(supernet)
    mlp_kept, qk_kept = [], []
    for blk in supernet.blocks:
        a = getattr(blk, "dcs_alpha", None)
        mlp_kept.append(None if a is None else int((a > 0).sum()))
        if getattr(blk.attn, "dcs_qk", None) == "static":
            qk_kept.append([int(v) for v in (blk.attn.dcs_theta.reshape(blk.attn.num_heads, -1) > 0).sum(-1)])
    rec = {"epoch": epoch, "tau": tau, "lam": lam, "epoch_time_s": epoch_time,
           **{f"train_{k}": v for k, v in means.items()},
           "macs": macs, "flops_ratio": macs / cost.dense, "expected_flops_ratio": expected / cost.dense,
           "mlp_kept": mlp_kept}
    if qk_kept:
        rec["qk_kept"] = qk_kept
    return rec


__all__ = ["DCSSearchConfig", "DCSSearchJob", "CostModel", "search_dcs", "calibrate"]
