"""The IB retraining recipe (:class:`RetrainConfig`), below both the ``retrain`` job
(:mod:`nascompress.retraining.run`, which re-exports it) and the IB hooks that read it
(:mod:`nascompress.dcs_search.ib_hooks`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config, check_settings, setting
from ..errors import NascompressError, SettingError
from ..limits import MAX_IMAGES

LEARNED_DOC = {"pre_logits": "input of model.head (timm forward_head(..., pre_logits=True))"}
INPUT_DOC = {
    "image": "preprocessed image, adaptive-avg-pooled to {p}x{p} per channel, flattened",
    "patch_embed": "token mean of a frozen copy of the {src} patch embedding",
}


@dataclass(frozen=True)
class RetrainConfig(Config):
    """The IB retraining recipe (Algorithm 1 of the DCS paper).

    Args:
        eta: weight of IBB in the loss after the warm-up (paper: 50). 0 (the default) trains on CE
            (+ KD with a teacher) only. Measured with the same retraining of searched DCS models
            (``bench/dcs_generalise.py``, ``ib@T`` units): on DINOv2 ViT-S/14 with 2,000 Fashion-MNIST
            images (0.7x) the bound cost accuracy (best validation 87.3% at eta 0 against 86.7%, the
            start, at 50 with a warm-up of 0, 1 or 2 of the 3 epochs, at 50 ramped linearly and at 5;
            the later it joined, the less it cost); on the from-scratch bases eta 0, 5 and 50 were
            within a few test images of each other. With eta > 0, metrics.json records ``bound_contribution``
            (best validation without the bound, with it, the change).
        warmup_frac: share of the epochs trained on CE only, in [0, 1) (paper: 0.3); the
            number of warm-up epochs is ``round(warmup_frac * epochs)``, at most ``epochs - 1``.
        eta_schedule: how the bound's weight enters after the warm-up: ``step`` (the paper's: eta
            from the first epoch after the warm-up) or ``linear`` (eta * k / n in the k-th of the n
            epochs after the warm-up, so that it reaches eta in the last epoch).
        feature_tap: the learned feature X~: ``pre_logits`` or ``module:<dotted name>`` (that
            submodule's output; token outputs (B, N, C) are mean-pooled over tokens).
        input_tap: the input feature X: ``image`` or ``patch_embed`` (see the module docstring).
        input_pool: side of the pooled image for ``input_tap="image"``.
        kmeans_iters / kmeans_init: Lloyd iterations and seeding (``k-means++`` or ``random``).
        cluster_samples: cluster (and measure IB on) a fixed random subset of this many
            training images instead of all of them (None: all).
        kd_alpha / kd_temperature: with a teacher, loss = (1 - alpha) CE + alpha T^2 KL(t || s).
        feat_kd: with a teacher, add ``feat_kd`` x the relative squared error between the
            student's and the teacher's learned feature (``feature_tap``, e.g. the pre-logits
            feature the head reads): mean over images of ||s - t||^2 / ||t||^2. 0: off. None (the
            default): 1 with a teacher whose feature has the model's width, else 0 (the resolved
            value is recorded in config.json). Why 1: a pruned pretrained model recovers from the
            dense model's features with few images (DINOv2, 3,000 images: +0.85 points over logits
            alone, ``bench/results/pretrained_dcs_retrain_sweep.json``).
        log_ib: cluster and log the IB metrics every epoch (a pass over the cluster set and a
            K-means); None: only when eta > 0 (the bound is then needed anyway).
    """

    # Fields declared with setting() are the user's: `retrain` options and `stages.retrain` keys
    # (help: the CLI's; lo/hi/choices: what the pipeline file checks). The others are internal.
    eta: float = setting(
        0.0,
        lo=0,
        help=("Weight of the IB bound IBB after the warm-up (0 = CE + KD only, the default; the paper's is 50)."),
    )
    warmup_frac: float = setting(
        0.3, lo=0, hi=1, hi_open=True, help=("Share of epochs on CE only before IBB is added, in [0, 1).")
    )
    eta_schedule: str = setting(
        "step",
        choices=("step", "linear"),
        help=(
            "The bound's weight after the warm-up: 'step' (eta at once, the paper's) or 'linear' (ramped to eta "
            "over the remaining epochs)."
        ),
    )
    feature_tap: str = setting("pre_logits", help="Learned feature X~: 'pre_logits' or 'module:<name>'.")
    input_tap: str = setting(
        "image", choices=tuple(INPUT_DOC), help=("Input feature X: 'image' (pooled image) or 'patch_embed'.")
    )
    input_pool: int = 7
    kmeans_iters: int = 20
    kmeans_init: str = "k-means++"
    cluster_samples: int | None = setting(
        None, lo=1, hi=MAX_IMAGES, help=("Cluster a fixed random subset of N training images.")
    )
    kd_alpha: float = setting(0.5, lo=0, hi=1, help="KD weight alpha: (1 - alpha) CE + alpha KD.")
    kd_temperature: float = setting(1.0, lo=0, lo_open=True, help="KD temperature.")
    feat_kd: float | None = setting(
        None,
        lo=0,
        help=(
            "With a teacher: weight of the feature distillation term, ||s - t||^2 / ||t||^2 on the --feature-tap "
            "feature (0: off; default: 1 with a teacher whose feature has the model's width, else 0)."
        ),
    )
    log_ib: bool | None = setting(
        None, help=("Cluster and log the IB metrics every epoch (default: only when --eta > 0).")
    )

    @property
    def measures_ib(self) -> bool:
        return self.eta > 0 if self.log_ib is None else self.log_ib

    def __post_init__(self) -> None:
        check_settings(self)  # every setting() against its declaration; below: what metadata cannot say
        tap = self.feature_tap
        if tap != "pre_logits" and not (tap.startswith("module:") and len(tap) > len("module:")):
            raise SettingError(f"{{feature_tap}} must be 'pre_logits' or 'module:<name>', got {self.feature_tap!r}")
        if self.input_pool < 1 or self.kmeans_iters < 1:
            raise NascompressError("input_pool and kmeans_iters must be at least 1")
        if self.kmeans_init not in ("k-means++", "random"):
            raise NascompressError(f"kmeans_init must be 'k-means++' or 'random', got {self.kmeans_init!r}")

    def warm_epochs(self, epochs: int) -> int:
        return min(int(self.warmup_frac * epochs + 0.5), max(epochs - 1, 0))

    def eta_at(self, epoch: int, epochs: int) -> float:
        """The bound's weight in ``epoch`` (0-based) of ``epochs``: 0 in the warm-up, then eta
        (``step``) or eta * k / n in the k-th of the n epochs after it (``linear``)."""
        warm = self.warm_epochs(epochs)
        if epoch < warm or self.eta <= 0:
            return 0.0
        if self.eta_schedule == "step":
            return self.eta
        return self.eta * min(epoch - warm + 1, epochs - warm) / (epochs - warm)

    def describe(self, *, teacher: bool) -> dict[str, str]:
        """Our reading of the paper's features, recorded in config.json, arch.json and metrics."""
        learned = LEARNED_DOC.get(self.feature_tap, f"output of {self.feature_tap[7:]} (token-mean if (B, N, C))")
        src = "teacher's" if teacher else "starting model's"
        return {
            "learned_feature": f"{self.feature_tap}: {learned}",
            "input_feature": f"{self.input_tap}: " + INPUT_DOC[self.input_tap].format(p=self.input_pool, src=src),
        }


__all__ = ["RetrainConfig", "LEARNED_DOC", "INPUT_DOC"]
