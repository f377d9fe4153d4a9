"""The settings of ``nascompress search dcs``: :class:`DCSSearchConfig` (the search's own settings),
the search's W optimisation recipe (:data:`SEARCH_TRAIN` and the training settings a user sets,
:data:`SEARCH_TRAIN_SETTINGS`) and :class:`DCSSearchJob` (everything a search needs, written to the
run's ``config.json``). The search itself, and what its settings mean:
:mod:`nascompress.dcs_search.search`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import Config, StageSettings, check_bool, check_int, check_range, check_settings, setting
from ..data import DataConfig
from ..limits import MAX_LR
from ..errors import SettingError
from ..methods.dcs import SEARCH_DCS, DCSConfig
from ..train.auto_batch import AUTO_BATCH_NOTE
from ..train.config import TrainConfig
from ..train.run import recipe_config

INIT_IMPORTANCE = ("auto", "weight", "activation")
ARCH_LOSSES = ("kd", "ce")
BUDGETS = ("project", "steer")
COSTS = ("flops", "latency")
W_GATES = ("hard", "sampled")


@dataclass(frozen=True)
class DCSSearchConfig(Config):
    """The search's own settings (the optimisation of W is the job's TrainConfig).

    Args:
        arch_lr: peak AdamW lr of the architecture parameters (alpha, static theta); None: sized
            from the budget so that the median gate logit reaches the threshold after about 40% of
            the architecture steps (``alpha_init / (0.4 x arch steps)``, within [0.01, 0.5]).
        arch_lr_end: their lr at the end, as a share of ``arch_lr`` (a cosine between).
        arch_beta1: their Adam momentum (shorter than the weights' 0.9: less lag, less overshoot).
        lam: lambda of ``lambda * log cost`` (paper range 0.1-0.5) when no target is given.
        entropy_weight: weight of the gates' mean binary entropy (pushes the soft gates to 0/1).
        tau0 / tau_decay: temperature at epoch 0 and its factor per epoch.
        target_flops: FLOPs of the result as a ratio of the dense model's, in (0, 1].
        cost: what the search's cost and target measure: ``flops`` (MACs, attention matmuls counted)
            or ``latency`` (the latency predicted from the device's lookup table,
            :mod:`~nascompress.dcs_search.latency_cost`: blocks, heads and widths cost what they cost
            on the device, at ``latency_batch`` in ``latency_dtype``).
        target_latency: with ``cost="latency"``: the predicted latency of the result as a ratio of
            the dense model's, in (0, 1] (``target_flops`` is then not given).
        latency_batch / latency_dtype: the batch size and dtype the latency table is measured at
            (on the search's device; cached, ``nascompress latency-table``).
        target_ramp: share of the architecture steps over which the controller's target moves
            linearly from 1.0 down to ``target_flops`` (0: the target from the first step). The
            model then loses its channels progressively while the weights follow (UPop's
            progressive shrinking), instead of the controller pulling every gate at once.
        budget: how the target is held while the search trains. ``project`` (default): after every
            architecture step, where the hard architecture is more than ``project_band`` off the
            current (moving) target, every unprotected gate logit is shifted by one constant so that
            it sits on it (:func:`~nascompress.dcs_search.cost.calibrate`, the projection of the
            gates onto the budget): the gradients order the channels, the projection sets how many
            stay, and the weights train at the architecture the search will end with for the last
            ``1 - target_ramp`` of the search (``at_target_share`` in metrics.json). ``steer``: the
            lambda controller alone (the former default), which lags behind the target on
            pretrained models (it ended at 0.711 for a 0.6 target on DINOv2 ViT-S/14 with 2,000
            images, and the untrained end-of-search shift that made the rest of the cut broke the
            model). In both modes the controller's lambda keeps the cost's push on the gates.
        max_calibration: the end-of-search guard. A search that ends outside ``tolerance`` is
            shifted onto the target only if that moves its FLOPs ratio by at most this much (the
            move is ``calibration_move`` in metrics.json); a larger, untrained cut is a failed
            search (:class:`SearchOffTarget`), never applied silently.
        w_gates: what the weight steps train under. ``hard`` (default): the aligned architecture the
            gates give at that step, the one the search would materialize (with ``budget="project"``
            the final one for the last ``1 - target_ramp`` of the search); the architecture steps
            still draw Gumbel samples, whose gradients order the gates. ``sampled``: a Gumbel sample
            per step (the paper's), so the weights train on random sub-networks around the
            threshold, a different network from the one materialized.
        project_band: relative distance from the current target beyond which ``project`` shifts.
        tolerance: relative band around the target the result must land in.
        steer_gain / steer_rate: proportional and integral gains of the lambda controller.
        weight_fraction: share of the training split for W (the rest updates the architecture).
        round_mlp: 0 (the paper) or k > 0: a block MLP keeping fewer than k channels is closed and
            one keeping more than C - k is opened fully (:func:`round_blocks`); the controller
            steers the rounded architecture, and the rounding is applied after the last epoch.
        distill: weight of KL(dense || supernet) on the logits (0: off).
        feat_distill: weight of the relative squared error between the supernet's and the dense
            model's pre-logits feature (the feature the head reads), ||s - t||^2 / ||t||^2 (0: off).
        arch_loss: the architecture steps' task loss: ``kd`` (``distill`` x KL + ``feat_distill``
            x the feature error: what the dense model computes, not a few labels, decides which
            channels matter) or ``ce`` (the paper's). The weight steps always add both to CE.
        protect_ratio: fix open the gates of outlier channels, whose activation exceeds this many
            times their block's median (at most 5% of a block's gates, the largest;
            :mod:`~nascompress.dcs_search.protect`; 0: off). 5: on DINOv2 ViT-S/14 the residual
            channel that carries its largest activations (278) stands 5-10x above the median in
            blocks 3-11, where no channel reaches 20x.
        block_weights: weight every block's differentiable cost by its measured sensitivity (a
            block whose pruning hurts more feels less of the cost's push; the controller still
            steers the real FLOPs).
        max_val_drop: stop spending time on the gates when validation top-1 falls more than this many
            points below the dense model's, judged only on an epoch that ran at the target from its start
            and only if validation did not rise over the previous epoch (a search on its way back is not
            stopped). The epochs of the ramp, and the one in which the target arrives, are not judged:
            the weights dip there and recover at the final architecture (``bench/dcs_dip.py``). A stopped search is
            not an error where ``baseline`` is on: it is compared with the baseline like a finished one (if
            its architecture stands at the target) and the better model is kept.
        baseline: build the magnitude-pruned model at the same FLOPs (:mod:`~nascompress.dcs_search.baseline`),
            give it and the searched model the same short recovery, score both on the validation split and
            keep the better (``comparison`` in metrics.json); the user never gets less than the free
            alternative, and never an error instead of a model.
        recovery_images: training images of that recovery, each candidate (one pass, the search's batch
            size and peak lr, the same seeded batches).
        calibrate: if the last epoch ends outside the band, shift the gate threshold to land inside
            it (reported); False: fail instead.
        at_most: the target is a limit: a search that ends above it, inside the band, has its gate
            threshold shifted to land at or just under it (an untrained cut of a few channels, reported
            as ``calibration`` with reason ``at_most``); the landing of a search outside the band lands
            under it too. A pipeline key of its DCS stage as well (off by default: on the main job it
            gave 88.22% at 0.585x against 88.63% at 0.596x without, one run each;
            bench/results/pipeline_fashion_mnist_at_most.json).
        grad_balance: with a target, measure lambda in units of the task gradient: at the first
            architecture step of every epoch the median |d task / d logit| over every gate (CE at
            the first: the distillation loss is 0 while the supernet is the dense model) is compared
            with the median |d log cost / d logit|, and where the task is the larger by r > 1 the
            cost term is multiplied by r (``lam_scale``, logged). Re-measured every epoch because the
            distillation gradient grows as the model departs from the dense one: with the scale of
            the start, it outweighed every lambda in range and the search stopped short of its
            target. Why at all: the controller's lambda range was set on
            a small model trained from scratch, where the cost gradient per gate is about twice the
            CE gradient (r = 0.55 on the Fashion-MNIST base: scale 1, unchanged); on a pretrained
            model CE outweighs it (r = 49.7 on DINOv2 ViT-S/14 at 112 px), so no lambda in range
            moved a gate and the search did nothing.
        init_importance: what orders the gates' initial logits (the order in which channels reach
            the threshold): ``weight`` (weight magnitude), ``activation`` (measured on
            ``init_images`` training images, :func:`~nascompress.methods.dcs.activation_importance`)
            or ``auto``: both orders drop their 20% and their 40% least important gates of every
            MLP, and the activation order is used where its summed KL to the dense model (on those
            images) is below 0.9x the weight order's, else weight magnitude (logged as ``init`` and
            ``init_kl``). Why: on DINOv2 the weight-magnitude order closes the channels the model
            depends on first (``bench/dcs_init_order.py``); on the Fashion-MNIST base trained from
            scratch the two KLs are within 2% and weight magnitude, the former default, stays.
        init_images: training images the pre-search measurements use.
        init_seed: the seed that draws them (None: the job's seed). Study trials give the study's
            seed, so every trial's search measures the same base model on the same images and the
            process reuses the measurements (:mod:`~nascompress.dcs_search.prepare`).
        auto_batch: choose the batch size from the number of training images
            (:func:`~nascompress.retraining.run.auto_batch_size`: 16 for 2,000 images, 128 from 12,800),
            so a small dataset still gets enough architecture steps; the chosen size replaces the
            job's ``train.batch_size`` in the recorded job. The default, as ``search dcs`` and
            ``stages.dcs`` without a batch size; False: ``train.batch_size`` as given.
    """

    # Fields declared with setting() are the user's: `search dcs` options and `stages.dcs` keys
    # (help: the CLI's; lo/hi/choices: what the pipeline file checks). The others are internal.
    arch_lr: float | None = setting(
        None,
        lo=0,
        lo_open=True,
        hi=MAX_LR,
        help=("Peak AdamW lr of the architecture parameters (default: sized from the number of arch steps)."),
    )
    arch_lr_end: float = 0.1
    arch_beta1: float = 0.5
    lam: float = setting(
        0.2, lo=0, help=("lambda of lambda*log(cost) (paper range 0.1-0.5); with --target-flops it is steered instead.")
    )
    entropy_weight: float = setting(0.01, lo=0, help="Weight of the gates' entropy penalty.")
    tau0: float = setting(4.5, lo=0, lo_open=True, help="Initial Gumbel temperature (x0.95 per epoch).")
    tau_decay: float = 0.95
    target_flops: float | None = setting(
        None, lo=0, hi=1, lo_open=True, help=("Land within +-5% of this FLOPs ratio of the dense model, in (0, 1].")
    )
    cost: str = setting(
        "flops",
        choices=COSTS,
        help=(
            "What the search's cost and target measure: flops, or latency (predicted from a lookup table of block "
            "latencies measured on this device, cached; nascompress latency-table)."
        ),
    )
    target_latency: float | None = setting(
        None,
        lo=0,
        hi=1,
        lo_open=True,
        help="With --cost latency: land within +-5% of this ratio of the dense model's predicted latency, in (0, 1].",
    )
    latency_batch: int = setting(
        1, lo=1, hi=4096, help="With --cost latency: the batch size the latency is measured at (1: one image)."
    )
    latency_dtype: str = setting(
        "fp32", choices=("fp32", "bf16"), help="With --cost latency: the dtype the latency is measured in."
    )
    target_ramp: float = setting(
        0.5,
        lo=0,
        hi=1,
        help=("Share of the search over which the target moves from 1.0 down to --target-flops (0: at once)."),
    )
    budget: str = setting(
        "project",
        choices=BUDGETS,
        help=(
            "How the search holds its FLOPs target while it trains: project (after every architecture step the "
            "gate threshold moves so the architecture sits on the moving target, and the weights train at it) "
            "or steer (the lambda controller alone)."
        ),
    )
    max_calibration: float = setting(
        0.02,
        lo=0,
        hi=1,
        help=(
            "The end-of-search guard: the largest FLOPs-ratio move the untrained threshold shift may make when "
            "the search ends off target; a larger one fails the search."
        ),
    )
    w_gates: str = setting(
        "hard",
        choices=W_GATES,
        help=(
            "The gates the weight steps train under: hard (the aligned architecture the search would materialize "
            "at that step) or sampled (a Gumbel sample per step, the paper's)."
        ),
    )
    project_band: float = 0.01
    tolerance: float = 0.05
    steer_gain: float = 2.0
    steer_rate: float = 0.05
    weight_fraction: float = 0.7
    round_mlp: int = setting(
        0,
        lo=0,
        help=("Not in the paper: close block MLPs left with < K channels, open those with > C-K (steered for)."),
    )
    distill: float = setting(0.5, lo=0, help="Weight of KL to the dense model's logits (0: off).")
    feat_distill: float = setting(
        1.0, lo=0, help=("Weight of the relative error to the dense model's pre-logits feature (0: off).")
    )
    arch_loss: str = setting(
        "kd",
        choices=ARCH_LOSSES,
        help=("The architecture steps' task loss: kd (the distillation terms) or ce (the paper's)."),
    )
    protect_ratio: float = setting(
        5.0,
        lo=0,
        help=(
            "Fix open the gates of outlier channels (activation > this x the block median, at most 5% of a "
            "block's gates; 0: off)."
        ),
    )
    block_weights: bool = setting(
        True, flag="--no-block-weights", help=("Do not weight each block's cost by its measured sensitivity.")
    )
    max_val_drop: float = setting(
        15.0,
        lo=0,
        help=(
            "Stop when validation top-1 falls more than this many points below the dense model's, judged once the "
            "search runs at its target and is not rising (the dip while the target moves is not judged)."
        ),
    )
    calibrate: bool = setting(
        True,
        flag="--no-calibrate",
        help=("Fail instead of shifting the gate threshold when the search ends off target."),
    )
    at_most: bool = setting(
        False,
        help=(
            "Treat the target as a limit: a search that ends just above it is shifted to land at or under it "
            "(a few untrained channels; reported as calibration)."
        ),
    )
    grad_balance: bool = setting(
        True,
        flag="--no-grad-balance",
        help=(
            "Keep lambda in absolute units (by default, with --target-flops, the cost term is scaled up where the "
            "CE gradient per gate outweighs it, as on pretrained models)."
        ),
    )
    init_importance: str = setting(
        "auto",
        choices=INIT_IMPORTANCE,
        help=(
            "What orders the gates' start: weight (magnitude), activation (measured on 256 training images) or auto "
            "(activation where its 20%- and 40%-pruned models are clearly closer to the dense model, else weight)."
        ),
    )
    baseline: bool = setting(
        True,
        flag="--no-baseline",
        help=(
            "Do not build the magnitude-pruned model at the same FLOPs (global magnitude pruning of the MLP hidden "
            "neurons, Torch-Pruning's rule) to compare the searched model with; a search that falls apart then ends "
            "in an error instead of the baseline's model."
        ),
    )
    recovery_images: int = setting(
        1024,
        lo=1,
        hi=10_000_000,
        help=(
            "Training images of the short recovery the searched and the baseline model both get before they are "
            "compared on the validation split (at most the training split)."
        ),
    )
    init_images: int = 256
    init_seed: int | None = None
    auto_batch: bool = True

    def __post_init__(self) -> None:
        check_settings(self)  # every setting() against its declaration; below: the internal fields
        check_range("project_band", self.project_band, 0, 1, lo_open=True)
        check_int("init_images", self.init_images, 1)
        check_range("arch_lr_end", self.arch_lr_end, 0, 1)
        check_range("arch_beta1", self.arch_beta1, 0, 1, hi_open=True)
        check_range("tau_decay", self.tau_decay, 0, 1, lo_open=True)
        check_range("tolerance", self.tolerance, 0, 1, lo_open=True)
        check_range("weight_fraction", self.weight_fraction, 0, 1, lo_open=True, hi_open=True)
        check_bool("auto_batch", self.auto_batch)
        if self.cost == "latency" and self.target_flops is not None:
            raise SettingError("{cost} latency searches for {target_latency}: give it instead of {target_flops}")
        if self.cost == "flops" and self.target_latency is not None:
            raise SettingError("{target_latency} is a latency target: give {cost} latency with it")
        if self.arch_loss == "kd" and self.distill == 0 and self.feat_distill == 0:
            raise SettingError(
                "{arch_loss} kd distils from the dense model: give {distill} or {feat_distill} "
                "a positive weight, or use {arch_loss} ce"
            )

    @property
    def target(self) -> float | None:
        """The target ratio of the search's cost: ``target_latency`` with ``cost="latency"``, else
        ``target_flops``."""
        return self.target_latency if self.cost == "latency" else self.target_flops

    @property
    def cost_name(self) -> str:
        """The cost's name in messages: ``FLOPs`` or ``latency`` (predicted)."""
        return "latency" if self.cost == "latency" else "FLOPs"

    def target_at(self, progress: float) -> float | None:
        """The controller's target after ``progress`` (0..1) of the architecture steps."""
        if self.target is None:
            return None
        if self.target_ramp <= 0:
            return self.target
        return 1.0 - (1.0 - self.target) * min(1.0, progress / self.target_ramp)


# The search's W optimisation: a fine-tuning lr (the weights must follow the cut; see the module
# docstring of nascompress.dcs_search.search for the measurement), short warm-up, no layer decay
# (1: off), keep the last epoch.
SEARCH_TRAIN = TrainConfig(
    epochs=4,
    batch_size=128,
    lr=None,
    base_lr=1e-3,
    min_lr=1e-6,
    warmup_epochs=0.2,
    weight_decay=0.01,
    layer_decay=1.0,
    keep="last",
)


# The search's training settings a user sets (`search dcs` options, `stages.dcs` keys): the recipe's
# defaults, but batch_size (None: from the training images) and base_lr (None: the recipe's)
SEARCH_TRAIN_SETTINGS = StageSettings(
    TrainConfig,
    ("epochs", "batch_size", "lr", "base_lr", "min_lr", "warmup_epochs", "layer_decay"),
    recipe=SEARCH_TRAIN,
    no_default=("batch_size", "base_lr"),
    notes={
        "batch_size": AUTO_BATCH_NOTE,
        "base_lr": f"Default: {SEARCH_TRAIN.base_lr:g} (the weights follow the cut).",
    },
)


def search_train_config(**given: Any) -> TrainConfig:
    """The search's TrainConfig: :data:`SEARCH_TRAIN` with the values ``given`` (None: the recipe's)."""
    return recipe_config(SEARCH_TRAIN, **given)


@dataclass(frozen=True)
class DCSSearchJob(Config):
    """Everything ``nascompress search dcs`` needs; written to the run's ``config.json``.

    Args:
        source: a dense run directory (``nascompress train`` / ``import``) or a timm model name.
        weights: local weights for a timm name (``.safetensors``/``.pth``).
        model_kwargs: timm build overrides for a timm name (num_classes defaults to the data's).
        data: the dataset (default: the source run's ``data`` section, else Fashion-MNIST).
    """

    source: str
    out: str
    method: DCSConfig = SEARCH_DCS
    search: DCSSearchConfig = field(default_factory=DCSSearchConfig)
    train: TrainConfig = field(default_factory=search_train_config)
    data: DataConfig | None = None
    weights: str | None = None
    model_kwargs: dict = field(default_factory=dict)


__all__ = [
    "INIT_IMPORTANCE",
    "ARCH_LOSSES",
    "BUDGETS",
    "W_GATES",
    "DCSSearchConfig",
    "SEARCH_TRAIN",
    "SEARCH_TRAIN_SETTINGS",
    "search_train_config",
    "DCSSearchJob",
]
