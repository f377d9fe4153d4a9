"""Retraining's IB machinery as training hooks (:class:`IBHooks`, DCS paper, Algorithm 1): CE (+ KD)
for the warm-up epochs, then CE (+ KD) + eta * IBB (eta at once or ramped up), the clusters of the
learned feature X~ and Q(a|y) refreshed over the training set before the first epoch and after
every epoch; and the fixed input-feature map X (:func:`make_input_embed`). The settings are a
:class:`~nascompress.retraining.config.RetrainConfig` (re-exported by :mod:`nascompress.retraining.run`)."""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ..train import distributed
from ..data import InputSpec, Subset, make_loader, preprocess
from ..train.distill import FeatureTap, feature_kd_loss, kd_loss
from ..errors import NascompressError
from ..train.hooks import TrainHooks
from ..retraining.config import RetrainConfig
from .ib import ib_bound, ib_loss, kmeans, lemma_d1_marginal_term, soft_assign, variational_q

IB_KEYS = ("ib", "i_xt_x", "i_xt_y", "ibb_full")


def make_input_embed(
    cfg: RetrainConfig, *, model: nn.Module, teacher: nn.Module | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fixed input-feature map X = f(x): preprocessed images (B, C, H, W) -> (B, D_in)."""
    if cfg.input_tap == "image":
        return lambda x: F.adaptive_avg_pool2d(x, cfg.input_pool).flatten(1)
    pe = copy.deepcopy((teacher if teacher is not None else model).patch_embed).eval().requires_grad_(False)

    def embed(x: torch.Tensor) -> torch.Tensor:
        t = pe.to(x.device)(x)
        return t.flatten(1, -2).mean(1) if t.ndim >= 3 else t

    return embed


def _logits(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class IBHooks(TrainHooks):
    """CE (+ KD) for the warm-up epochs, then CE (+ KD) + eta * IBB; Q and the clusters of X~
    refreshed over the training set before the first epoch and after every epoch."""

    def __init__(
        self,
        cfg: RetrainConfig,
        *,
        train_set: Dataset,
        input_spec: InputSpec,
        num_classes: int,
        epochs: int,
        input_embed: Callable[[torch.Tensor], torch.Tensor],
        teacher: nn.Module | None = None,
        seed: int = 0,
        batch_size: int = 256,
    ):
        self.cfg, self.spec, self.num_classes, self.seed, self.bs = cfg, input_spec, num_classes, seed, batch_size
        self.warm, self.epochs = cfg.warm_epochs(epochs), epochs
        self.input_embed, self.teacher = input_embed, teacher
        if cfg.cluster_samples is not None and cfg.cluster_samples < len(train_set):
            g = torch.Generator().manual_seed(seed)
            keep = torch.randperm(len(train_set), generator=g)[: cfg.cluster_samples].sort().values
            train_set = Subset(train_set, keep)
        self.cluster_set = train_set
        self.c_feat: torch.Tensor | None = None  # (A, D) centroids of X~ (previous epoch)
        self.c_in: torch.Tensor | None = None  # (B, D_in) centroids of X (fixed)
        self.q: torch.Tensor | None = None  # (C, A) Q^{(t-1)}(a | y)
        self.initial: dict[str, float] = {}
        self._tap: FeatureTap | None = None
        self._tapped: nn.Module | None = None
        self._teacher_tap = FeatureTap(teacher, cfg.feature_tap) if teacher is not None and cfg.feat_kd else None
        self._in_emb: torch.Tensor | None = None  # (N, D_in) X of the cluster set
        self._labels: torch.Tensor | None = None  # (N,)

    def _tap_for(self, model: nn.Module) -> FeatureTap:
        if self._tapped is not model:
            if self._tap is not None:
                self._tap.remove()
            self._tap, self._tapped = FeatureTap(model, self.cfg.feature_tap), model
        return self._tap

    def active(self, epoch: int) -> bool:
        return self.cfg.eta_at(epoch, self.epochs) > 0

    def loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epoch: int, cfg: Any, tag: Any = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """x (B, C, H, W) preprocessed, y (B,) -> (CE [+ KD] [+ eta * IBB], logs)."""
        tap = self._tap_for(model)
        logits = _logits(model(x))  # (B, K)
        feat = tap.pop().float()  # (B, D)
        ce = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
        logs: dict[str, Any] = {"ce": ce.detach(), "top1": 100.0 * (logits.argmax(-1) == y).float().mean()}
        loss = ce
        if self.teacher is not None:
            with torch.no_grad():
                t_logits = _logits(self.teacher(x))
            kd = kd_loss(logits, t_logits, tau=self.cfg.kd_temperature)
            loss = (1 - self.cfg.kd_alpha) * ce + self.cfg.kd_alpha * kd
            logs["kd"] = kd.detach()
            if self._teacher_tap is not None:
                fkd = feature_kd_loss(feat, self._teacher_tap.pop().float())
                loss = loss + self.cfg.feat_kd * fkd
                logs["feat_kd"] = fkd.detach()
        if self.c_feat is not None:
            if self.c_feat.device != feat.device:  # state restored from a checkpoint lives on the CPU
                self.c_feat, self.c_in, self.q = (t.to(feat.device) for t in (self.c_feat, self.c_in, self.q))
            with torch.set_grad_enabled(self.active(epoch) and torch.is_grad_enabled()):
                with torch.no_grad():
                    log_phi_in = soft_assign(self.input_embed(x).float(), self.c_in, log=True)  # (B, B_clusters)
                phi_feat = soft_assign(feat, self.c_feat)  # (B, A)
                ibb = ib_bound(phi_feat, log_phi_in.exp(), y, self.q, log_phi_in=log_phi_in)  # scalar
            logs["ibb"] = ibb.detach()
            if self.active(epoch):
                loss = loss + self.cfg.eta_at(epoch, self.epochs) * ibb
        return loss, logs

    @torch.no_grad()
    def refresh(self, model: nn.Module, *, epoch: int) -> dict[str, Any]:
        """Pass the cluster set through ``model``; re-cluster X~, recompute Q; return IB metrics."""
        device = next(model.parameters()).device
        tap, was_training = self._tap_for(model), model.training
        model.eval()
        t0 = time.perf_counter()
        feats, embs, labels, correct = [], [], [], 0
        n_all = len(self.cluster_set)
        if distributed.world().size > 1 and n_all < distributed.world().size:
            raise NascompressError(f"the cluster set ({n_all} images) is smaller than the number of processes")
        mine = self.cluster_set if distributed.world().size == 1 else Subset(self.cluster_set, distributed.part(n_all))
        for imgs, ys in make_loader(mine, batch_size=self.bs, shuffle=False):
            x, ys = preprocess(imgs, self.spec).to(device), ys.to(device)
            correct += (_logits(model(x)).argmax(-1) == ys).sum().item()
            feats.append(tap.pop().float())
            if self._in_emb is None:
                embs.append(self.input_embed(x).float())
                labels.append(ys)
        model.train(was_training)
        feats_t = distributed.gather_rows(torch.cat(feats))  # (N, D), every rank's part in order
        correct = distributed.all_sum([correct])[0]
        if self._in_emb is None:
            self._in_emb = distributed.gather_rows(torch.cat(embs))
            self._labels = distributed.gather_rows(torch.cat(labels))
        _sync(device)
        pass_s = time.perf_counter() - t0
        k = self.num_classes
        stats: dict[str, Any] = {}
        if self.c_in is None:  # X is fixed: cluster it once (seeded)
            t1 = time.perf_counter()
            self.c_in = kmeans(
                self._in_emb,
                k,
                iters=self.cfg.kmeans_iters,
                init=self.cfg.kmeans_init,
                generator=torch.Generator().manual_seed(self.seed),
            ).centroids
            _sync(device)
            stats["kmeans_input_s"] = time.perf_counter() - t1
        self.c_in = self.c_in.to(device)
        t1 = time.perf_counter()
        km = kmeans(
            feats_t,
            k,
            iters=self.cfg.kmeans_iters,
            init=self.cfg.kmeans_init,
            generator=torch.Generator().manual_seed(self.seed * 1009 + epoch + 1),
        )
        distributed.broadcast_(km.centroids, self.c_in)  # every rank holds rank 0's clusters
        _sync(device)
        kmeans_s = time.perf_counter() - t1
        phi_feat = soft_assign(feats_t, km.centroids)  # (N, A)
        log_phi_in = soft_assign(self._in_emb, self.c_in, log=True)  # (N, B)
        phi_in = log_phi_in.exp()
        labels_t = self._labels.to(device)
        q = variational_q(phi_feat, labels_t, k)  # (C, A)
        distributed.broadcast_(q)
        ib = ib_loss(phi_feat, phi_in, labels_t, k)
        self.c_feat, self.q = km.centroids, q
        stats.update(
            ib=ib["ib"],
            i_xt_x=ib["i_xt_x"],
            i_xt_y=ib["i_xt_y"],
            ibb_full=float(ib_bound(phi_feat, phi_in, labels_t, q, log_phi_in=log_phi_in)),
            lemma_d1_term=float(lemma_d1_marginal_term(phi_in)),
            train_top1_eval=100.0 * correct / max(len(labels_t), 1),
            cluster_n=len(labels_t),
            kmeans_s=kmeans_s,
            kmeans_iters=km.iterations,
            feature_pass_s=pass_s,
        )
        return stats

    def on_epoch_start(self, model: nn.Module, *, epoch: int) -> None:
        if self.c_feat is None and self.cfg.measures_ib:  # Q^{(0)} and the first clusters, from the start
            self.initial = self.refresh(model, epoch=-1)

    def on_epoch_end(self, model: nn.Module, *, epoch: int) -> dict[str, Any]:
        if not self.cfg.measures_ib:
            return {"ib_active": False}
        rec = {
            "ib_active": self.active(epoch),
            "eta_now": self.cfg.eta_at(epoch, self.epochs),
            **self.refresh(model, epoch=epoch),
        }
        if epoch == 0 and self.initial:
            rec.update({f"initial_{k}": self.initial[k] for k in IB_KEYS if k in self.initial})
        return rec

    def state_dict(self) -> dict[str, Any]:
        return {"c_feat": self.c_feat, "c_in": self.c_in, "q": self.q, "initial": dict(self.initial)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.c_feat, self.c_in, self.q = state.get("c_feat"), state.get("c_in"), state.get("q")
        self.initial = dict(state.get("initial") or {})
