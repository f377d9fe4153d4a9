"""How long the whole pipeline has left: each step's work as a prior estimate in seconds
(:func:`step_estimates`), scaled by the rate this run has measured so far (:class:`PipelineEta`).

The priors only set how the steps weigh against one another; the measured rate (seconds of the
steps run in this process against their estimates, the running one by its fraction done) turns
them into this machine's time, so a slower CPU or a larger model is read off the run itself. Steps
already complete before this run (a resumed pipeline) count neither way.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from ..progress import clock_text

# Seconds per image pass of each step kind, from the README main job's bench run
# (bench/results/pipeline_fashion_mnist.json: stage_seconds, 2-core AMD EPYC, bf16): base 308.5 s
# for 8 epochs x 54,000 images; dcs_search 51.0 s for 2 epochs x 24,000; the two token studies
# 20.5 + 24.2 s for 2 x 30 trials x (2,000 + 2,000) images; retrain 80.9 s for 3 epochs x 30,000.
PER_IMAGE_S = {
    "base": 308.5 / (8 * 54_000),
    "dcs_search": 51.0 / (2 * 24_000),
    "tokens": (20.5 + 24.2) / (2 * 30 * 4_000),
    "retrain": 80.9 / (3 * 30_000),
}
# steps whose time does not grow with images: the same run's seconds (report: its wall time less
# the steps', 506 - 489.8 s)
FIXED_S = {"dcs_mat": 0.06, "tokens_pick": 1.0, "confirm": 0.0, "export": 3.7, "report": 16.0}
BASE_GIVEN_S = 10.0  # a base that is given (base.run) or imported, not trained here
OTHER_S = 1.0  # a step of a kind not listed above
NOMINAL_TRAIN_IMAGES = 54_000  # the training split when data.train_limit does not say (Fashion-MNIST's)


def _limited(limit: int | None, n: int) -> int:
    return n if limit is None else min(int(limit), n)


def step_estimates(cfg: Any, names: list[str]) -> dict[str, float]:
    """Prior seconds of each named step of a pipeline config (image passes x the bench's seconds
    per image of its kind, or the bench's fixed seconds), in the order given."""
    n = cfg.data.train_limit or NOMINAL_TRAIN_IMAGES
    st = cfg.stages
    out: dict[str, float] = {}
    for name in names:
        if name == "base":
            t = cfg.base.train if cfg.base.run is None else None
            out[name] = BASE_GIVEN_S if t is None else t.epochs * n * PER_IMAGE_S["base"]
        elif name == "dcs_search" and st.dcs is not None:
            out[name] = st.dcs.epochs * _limited(st.dcs.train_limit, n) * PER_IMAGE_S["dcs_search"]
        elif name.startswith("tokens_search") and st.tokens is not None:
            tk = st.tokens
            per_trial = tk.train_images * max(1, tk.finetune_epochs) + tk.eval_images
            out[name] = tk.trials * per_trial * PER_IMAGE_S["tokens"]
        elif name in ("retrain", "retrain_dense") and st.retrain is not None:
            out[name] = st.retrain.epochs * _limited(st.retrain.train_limit, n) * PER_IMAGE_S["retrain"]
        else:
            out[name] = FIXED_S.get(name, OTHER_S)
    return out


class PipelineEta:
    """The whole pipeline's time left, from prior step estimates and the rate measured in this run.

    Args:
        estimates: prior seconds of every step this run still has to do, in order (complete steps
            left out, or dropped with :meth:`skip`).
        clock: seconds, monotonic (injected by tests).
    """

    def __init__(self, estimates: Mapping[str, float], *, clock: Callable[[], float] = time.perf_counter):
        self._todo = dict(estimates)
        self._clock = clock
        self._current: str | None = None
        self._t0 = 0.0
        self._since = 0.0  # the fraction of the running step already done before this process began it
        self._done_prior = 0.0  # estimated seconds of the work measured in finished steps
        self._done_s = 0.0  # its measured seconds

    def skip(self, name: str) -> None:
        """A step found complete (or skipped): not part of what is left."""
        self._todo.pop(name, None)

    def start(self, name: str) -> None:
        self._current, self._t0, self._since = name, self._clock(), 0.0

    def finish(self, name: str) -> None:
        prior = self._todo.pop(name, 0.0)
        if name == self._current:
            self._done_prior += prior * (1.0 - self._since)
            self._done_s += self._clock() - self._t0
            self._current = None

    def left(self, fraction: float = 0.0, since: float | None = None) -> float | None:
        """Seconds the pipeline has left with ``fraction`` of the running step done (``since``:
        the fraction it had when this process began it, a resumed training); None before any work
        has been measured."""
        if since is not None:
            self._since = min(max(since, 0.0), 1.0)
        fraction = min(max(fraction, 0.0), 1.0)
        measured_prior, measured_s = self._done_prior, self._done_s
        cur = self._todo.get(self._current, 0.0) if self._current is not None else 0.0
        if self._current is not None:
            measured_prior += cur * max(0.0, fraction - self._since)
            measured_s += self._clock() - self._t0
        if measured_prior <= 0 or measured_s <= 0:
            return None
        rest = sum(v for k, v in self._todo.items() if k != self._current) + cur * (1.0 - fraction)
        return rest * measured_s / measured_prior

    def text(self, fraction: float = 0.0, since: float | None = None) -> str:
        """``pipeline: about 6:10 left``; empty before anything is measured or when nothing is left."""
        s = self.left(fraction, since)
        others = self._todo.keys() - {self._current}
        if s is None or (not others and (self._current is None or fraction >= 1.0)):
            return ""
        return f"pipeline: about {clock_text(s)} left"


__all__ = ["PipelineEta", "step_estimates", "PER_IMAGE_S", "FIXED_S", "NOMINAL_TRAIN_IMAGES"]
