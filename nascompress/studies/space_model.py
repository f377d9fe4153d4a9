"""The space model: :class:`Space`, a validated search space (its structure, hash and plain form),
:meth:`Space.suggest` (one configuration through Optuna's define-by-run API), :meth:`Space.records`
(params back to method records) and :meth:`Space.distributions` (an unconditional space as Optuna
distributions). Parsing, replay and the grid live in ``space_parser``, ``space_replay`` and
``space_lattice``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence
import warnings

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from ..errors import NascompressError
from . import space_lattice, space_replay
from .space_entries import Method, Param, is_active, decode_layers, encode_layers, is_layer_const, max_len, plain_value
from .space_parser import FORMAT, MethodFields, Parser, read_space_file
from .space_values import registry_method_fields
from .. import methods
from ..models.build import is_pyramid
from ..yaml_io import resolve_file
from .qmc import points

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution


class Space:
    """A validated search space. Build it with :func:`load_space` or :meth:`from_dict`."""

    def __init__(self, *, name: str, description: str, methods: tuple[Method, ...], source: str) -> None:
        self.name = name
        self.description = description
        self.methods = methods
        self.source = source

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        data: Any,
        *,
        source: str = "<dict>",
        method_fields: MethodFields | None = registry_method_fields,
        model: Any = None,
    ) -> Space:
        """Validate a parsed space (as read from YAML, or :meth:`to_dict`'s output).

        Args:
            data: the mapping.
            source: how errors name it (the file path).
            method_fields: ``name -> set of config field names`` (None: unknown method); None
                skips the method and parameter name checks.
            model: the model the space is for: a range of layers counting from the last block
                (``range: [2, -2]``) is resolved against its depth, and every layer number is
                checked against it (:meth:`check_model`). None: no model (such a range is refused).
        """
        pyramid = model is not None and is_pyramid(model)
        depth = None if model is None or pyramid else len(model.blocks)
        name, description, methods = Parser(source, method_fields, depth, pyramid).space(data)
        space = cls(name=name, description=description, methods=methods, source=source)
        if model is not None:
            space.check_model(model)
        return space

    def to_dict(self) -> dict[str, Any]:
        """The normalized space as plain data (``from_dict`` of it gives the same hash)."""
        return {"format": FORMAT, "name": self.name, "description": self.description, "methods": self._methods_dict()}

    def _methods_dict(self) -> list[dict[str, Any]]:
        return [
            {
                "name": m.name,
                "group": m.group,
                "optional": m.optional,
                "params": {p.name: plain_value(p.source) for p in m.params},
            }
            for m in self.methods
        ]

    def hash(self) -> str:
        """A stable 16-hex-digit hash of the normalized methods (name and description excluded)."""
        blob = json.dumps({"format": FORMAT, "methods": self._methods_dict()}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"Space(name={self.name!r}, methods={[m.name for m in self.methods]}, hash={self.hash()})"

    # -- structure ----------------------------------------------------------------------------

    def groups(self) -> dict[str, list[Method]]:
        out: dict[str, list[Method]] = {}
        for m in self.methods:
            if m.group is not None:
                out.setdefault(m.group, []).append(m)
        return out

    def group_choices(self, group: str) -> list[str]:
        members = self.groups()[group]
        return [m.name for m in members] + (["none"] if members[0].optional else [])

    def param_names(self) -> list[str]:
        """Every Optuna parameter name the space can produce, in a fixed order."""
        names: list[str] = []
        seen_groups: set[str] = set()
        for m in self.methods:
            if m.group is not None and m.group not in seen_groups:
                seen_groups.add(m.group)
                names.append(f"group.{m.group}")
            elif m.group is None and m.optional:
                names.append(f"{m.name}.on")
            for p in m.params:
                if p.kind == "const":
                    continue
                if p.kind == "per_layer":
                    names += [f"{m.name}.{p.name}.{i}" for i in range(max_len(m, p))]
                else:
                    names.append(f"{m.name}.{p.name}")
        return names

    def check_model(self, model: Any) -> None:
        """Every method of the space patches ``model``'s kind (a plain or a pyramid ViT), and
        :meth:`check_depth` for it: a plain ViT's block count, None for a pyramid ViT."""
        kind = "pyramid" if is_pyramid(model) else "vit"
        self.check_depth(None if kind == "pyramid" else len(model.blocks))  # layer numbers: the more precise word
        words = {"vit": "a plain ViT (vit_*, deit_*)", "pyramid": "a pyramid ViT (PVT v2)"}
        for m in self.methods:
            try:
                need = methods.get_method(m.name).model_kind
            except NascompressError:
                continue  # not a registered method (a space checked without the registry)
            if need != kind:
                raise NascompressError(
                    f"{self.source}: {m.where}: method {m.name} needs {words[need]}, and the base "
                    f"model is {words[kind]}; use a space for {words[kind]}"
                )

    def check_depth(self, depth: int | None) -> None:
        """Raise if a layer number in the space is beyond a model of ``depth`` blocks (None: a model
        without a plain ViT's block list, a pyramid ViT, which no layer number can address)."""
        for m in self.methods:
            for p in m.params:
                layers: list[int] = []
                if p.kind == "layers":
                    layers = [x for c in p.choices for x in c]
                elif p.kind == "per_layer" and p.layers_list is not None:
                    layers = list(p.layers_list)
                elif p.kind == "const" and is_layer_const(m, p):
                    layers = list(p.value)
                if layers and depth is None:
                    raise NascompressError(
                        f"{self.source}: {p.where}: layer numbers address a plain ViT's blocks, and the base model "
                        "is a pyramid ViT (stages of blocks); use a space without layer settings (e.g. mgvit-h's)"
                    )
                bad = sorted({x for x in layers if x > depth})
                if bad:
                    raise NascompressError(
                        f"{self.source}: {p.where}: layer {bad[0]} is beyond the model's depth {depth} "
                        f"(layers are 1-based, 1..{depth}); narrow the space for this model"
                    )

    # -- sampling -----------------------------------------------------------------------------

    def suggest(self, trial: Any) -> list[dict[str, Any]]:
        """Suggest one configuration with Optuna's define-by-run API.

        Args:
            trial: an ``optuna.Trial`` (or ``FixedTrial``).

        Returns:
            The method records ``[{"name": m, "config": {...}}]`` of the methods that are on,
            in the space's order.
        """
        records: list[dict[str, Any]] = []
        chosen: dict[str, str] = {}
        for m in self.methods:
            if m.group is not None:
                if m.group not in chosen:
                    chosen[m.group] = trial.suggest_categorical(f"group.{m.group}", self.group_choices(m.group))
                if chosen[m.group] != m.name:
                    continue
            elif m.optional and not trial.suggest_categorical(f"{m.name}.on", [False, True]):
                continue
            records.append({"name": m.name, "config": _suggest_method(m, trial)})
        return records

    def records(self, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The method records that the Optuna ``params`` produce (a ``FixedTrial`` replay)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.suggest(optuna.trial.FixedTrial(dict(params)))

    def params_for(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The Optuna params that make :meth:`suggest` return ``records`` (for ``enqueue_trial``).

        Config keys the space does not declare are ignored; a value outside the space is an error
        (see :func:`nascompress.studies.space_replay.params_for`).

        Args:
            records: method records ``[{"name": m, "config": {...}}]``, e.g. the dense model's
                or a paper's configuration.
        """
        return space_replay.params_for(self, records)

    def grid(self, n: int) -> list[dict[str, Any]]:
        """About ``n`` evenly spread configurations, as Optuna params (enqueue-ready): for an
        unconditional space the first ``n`` points of Optuna's QMCSampler over :meth:`distributions`
        (:func:`nascompress.studies.qmc.points`); a conditional space has no fixed set of
        distributions, so its points come from :func:`nascompress.studies.space_lattice.grid`.

        Args:
            n: the number of points (>= 1).
        """
        if isinstance(n, int) and n >= 1 and self.conditional() is None:
            return points(self.distributions(), n)
        return space_lattice.grid(self, n)

    # -- as Optuna distributions --------------------------------------------------------------

    def conditional(self) -> str | None:
        """The first parameter that some trials do not have, and why (one line), or None when
        every trial suggests every parameter of :meth:`param_names` (an unconditional space).

        Conditional: an entry with ``when``, the searched parameters of a method that a group
        with several choices or an optional method's ``on`` may leave out, and the per-layer
        values beyond the smallest layer set of their ``layers`` parameter.
        """
        for m in self.methods:
            gate = None
            if m.group is not None and len(self.group_choices(m.group)) > 1:
                gate = f"group.{m.group} is {m.name!r}"
            elif m.group is None and m.optional:
                gate = f"{m.name}.on is True"
            for p in m.params:
                if p.kind == "const":
                    continue
                name = f"{m.name}.{p.name}"
                if gate is not None:
                    return f"{name} ({p.where}) exists only when {gate}"
                if p.when:
                    cond = " and ".join(f"{k} is {' or '.join(repr(v) for v in vals)}" for k, vals in p.when)
                    return f"{name} ({p.where}) exists only when {cond} (when:)"
                if p.kind == "per_layer" and p.layers_ref is not None:
                    sib = m.param(p.layers_ref)
                    sizes = sorted({len(c) for c in sib.choices}) if sib is not None and sib.kind == "layers" else []
                    if len(sizes) > 1:
                        return (
                            f"{name}.{sizes[0]} ({p.where}) exists only when {m.name}.{p.layers_ref} has at "
                            f"least {sizes[0] + 1} layers (its sets have {sizes[0]} to {sizes[-1]})"
                        )
        return None

    def distributions(self) -> dict[str, BaseDistribution]:
        """The space as Optuna distributions, keyed by the parameter names :meth:`suggest` uses
        (in :meth:`param_names` order): what every trial of an unconditional space suggests.

        Raises:
            NascompressError: the space is conditional (:meth:`conditional`), so no one set of
                distributions describes every trial; the message names the parameter.
        """
        why = self.conditional()
        if why is not None:
            raise NascompressError(
                f"{self.source}: space {self.name!r} is conditional, so it has no fixed set "
                f"of Optuna distributions: {why}"
            )
        out: dict[str, BaseDistribution] = {}
        for m in self.methods:
            if m.group is not None and f"group.{m.group}" not in out:
                out[f"group.{m.group}"] = CategoricalDistribution(self.group_choices(m.group))
            elif m.group is None and m.optional:
                out[f"{m.name}.on"] = CategoricalDistribution([False, True])
            for p in m.params:
                name = f"{m.name}.{p.name}"
                if p.kind == "per_layer":
                    assert p.item is not None
                    for i in range(max_len(m, p)):
                        out[f"{name}.{i}"] = _distribution(p.item)
                elif p.kind != "const":
                    out[name] = _distribution(p)
        return out


def load_space(
    path: str | Path, *, model: Any = None, method_fields: MethodFields | None = registry_method_fields
) -> Space:
    """Load and validate a space file.

    Args:
        path: a YAML file in the format of :mod:`nascompress.studies.space_parser`'s docstring, or
            the name of a shipped space (``evit``: ``nascompress/search_spaces/evit.yaml``).
        method_fields: ``name -> set of config field names`` (None: unknown method); the
            default reads the method registry. None skips the name checks.
        model: the model the space is for (see :meth:`Space.from_dict`): layer ranges counting from
            the last block (the shipped spaces' ``range: [2, -2]``) are resolved against its depth.
    """
    path = resolve_file(path, what="search space")
    return Space.from_dict(read_space_file(path), source=str(path), method_fields=method_fields, model=model)


def _suggest_one(p: Param, name: str, trial: Any) -> Any:
    if p.kind == "float":
        return trial.suggest_float(name, p.low, p.high, step=p.step, log=p.log)
    if p.kind == "int":
        return trial.suggest_int(name, p.low, p.high, step=p.step or 1, log=p.log)
    return trial.suggest_categorical(name, list(p.choices))


def _suggest_method(m: Method, trial: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    for p in m.params:
        if not is_active(p, cfg):
            continue
        name = f"{m.name}.{p.name}"
        if p.kind == "const":
            cfg[p.name] = p.value
        elif p.kind == "layers":
            cfg[p.name] = decode_layers(trial.suggest_categorical(name, [encode_layers(c) for c in p.choices]))
        elif p.kind == "per_layer":
            layers = list(p.layers_list) if p.layers_list is not None else cfg.get(p.layers_ref or "")
            if layers is None:  # its layers parameter is off in this trial
                continue
            assert p.item is not None
            cfg[p.name] = [_suggest_one(p.item, f"{name}.{i}", trial) for i in range(len(layers))]
        else:
            cfg[p.name] = _suggest_one(p, name, trial)
    return cfg


def _distribution(p: Param) -> BaseDistribution:
    """The distribution :func:`_suggest_one` (or a layers entry) gives Optuna for ``p``."""
    if p.kind == "float":
        return FloatDistribution(p.low, p.high, step=p.step, log=p.log)
    if p.kind == "int":
        return IntDistribution(p.low, p.high, step=p.step or 1, log=p.log)
    if p.kind == "layers":
        return CategoricalDistribution([encode_layers(c) for c in p.choices])
    return CategoricalDistribution(list(p.choices))
