"""The space-file parser: reads a YAML space file and validates every entry into the normalized
:class:`~nascompress.studies.space_entries.Param` / :class:`~nascompress.studies.space_entries.Method`
entries (:class:`~nascompress.studies.space_model.Space` is built from them).

A space file (``search_spaces/*.yaml``)::

    format: nascompress-space/1
    name: evit
    description: EViT keep rate schedule and pruning layers      # optional
    methods:                      # applied in this order
      - name: evit                # a registered method
        group: tokens             # optional: methods sharing a group are alternatives
        optional: false           # optional: the method may be left out
        params:                   # keys are fields of the method's config
          prune_layers: {kind: layers, range: [2, 5], size: [1, 3]}
          keep_rate: {kind: per_layer, layers: prune_layers,
                      value: {kind: float, low: 0.4, high: 1.0, step: 0.05}}
          fuse_token: true        # a constant, passed through unchanged
          mode: {kind: categorical, choices: [unstructured, block]}
          block_size: {kind: int, low: 4, high: 16, when: {mode: block}}

Parameter kinds (any searched entry may carry ``when``):

- a plain value (number, string, bool, null or a list of them): a constant. A constant mapping
  is written ``{kind: const, value: {...}}``.
- ``float``: ``low``, ``high`` (low < high), optional ``step`` (> 0, dividing high - low) or
  ``log: true`` (low > 0), not both.
- ``int``: the same with integers.
- ``categorical``: ``choices``, a non-empty list of distinct scalars (null, bool, number, string).
- ``layers``: a set of 1-based layer numbers, either ``range: [lo, hi]`` (inclusive; ``hi`` < 0
  counts from the model's last block, ``-1`` being the last: ``[2, -2]`` is layers 2-5 of a 6-block
  model and 2-11 of a 12-block one, resolved when the space is loaded for a model, with ``size``
  capped at the layers the range has there) or
  ``candidates: [l1, l2, ...]`` (an explicit list) with ``size: k`` or ``size: [lo, hi]``
  (how many are chosen); or ``choices: [[4, 7, 10], [3, 6, 9]]`` (explicit sets). Optuna sees
  one categorical parameter whose choices are the sets written ``"4,7,10"`` (at most 10,000 sets);
  the config gets the sorted list ``[4, 7, 10]``.
- ``per_layer``: ``layers`` (the name of a sibling ``layers`` parameter or constant list, or a
  literal list) and ``value`` (a float, int or categorical entry): one value per chosen layer,
  Optuna parameters ``<method>.<param>.0``, ``.1``, ...; the config gets the list.
- ``when: {sibling: value}`` (or ``{sibling: [v1, v2]}``): the parameter exists only when the
  sibling (a categorical or constant declared before it in the same method) has that value;
  otherwise it is left out of the config (the method's default applies).

Optuna parameter names: ``<method>.<param>``; ``<method>.<param>.<i>`` for per-layer values;
``<method>.on`` (bool) for an optional method outside a group; ``group.<group>`` (the method
name, or ``none`` when the group's methods are optional) for a group. Methods in a group must
agree on ``optional``. A method appears at most once.

Validation is strict and happens on load: unknown keys, wrong types, empty or inverted ranges,
``step`` with ``log``, unknown kinds, layer numbers < 1, and (through ``method_fields``) unknown
methods or parameters are errors naming the file, the entry (``methods[0].params.keep_rate``)
and the problem. :meth:`Space.check_depth` checks layer numbers against a model's depth.
The hash (:meth:`Space.hash`) covers the normalized ``methods`` only: a changed name or
description does not change it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from ..yaml_io import read_yaml_file
from ..yaml_io import shown
from .space_layers import LayersKind
from .space_entries import Method, Param, is_int, is_layer_const_value, is_num, is_scalar, plain_value
from .space_values import check_grid, check_values, registry_method_fields
from nascompress.models.layers import DEFAULT_ALIGN
from nascompress.methods.dcs import ALIGN_AUTO

FORMAT = "nascompress-space/1"
KINDS = ("const", "float", "int", "categorical", "layers", "per_layer")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_METHOD_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
_TOP_KEYS = {"format", "name", "description", "methods"}
_METHOD_KEYS = {"name", "group", "optional", "params"}
_KEYS = {
    "const": {"kind", "value"},
    "float": {"kind", "low", "high", "step", "log", "when"},
    "int": {"kind", "low", "high", "step", "log", "when"},
    "categorical": {"kind", "choices", "when"},
    "layers": {"kind", "range", "candidates", "size", "choices", "when"},
    "per_layer": {"kind", "layers", "value", "when"},
}

MethodFields = Callable[[str], "set[str] | None"]
# Settings whose values are channel widths: every value a space can give them must be a multiple of
# the method's ``align`` (its constant or every choice of it; default layers.DEFAULT_ALIGN).
WIDTH_PARAMS: dict[str, tuple[str, ...]] = {"mgvit": ("feat_dim",)}


def read_space_file(path: str | Path) -> Any:
    """The parsed YAML of a space file (not validated yet); missing, unreadable or invalid YAML is
    one error naming the file."""
    return read_yaml_file(path, what="search space", mapping=f"a mapping with keys {', '.join(sorted(_TOP_KEYS))}")


class Parser(LayersKind):
    """Validates a parsed space file (errors name ``source``, the entry and the problem); the
    ``layers`` kind is parsed by :class:`~nascompress.studies.space_layers.LayersKind`."""

    def __init__(
        self, source: str, method_fields: MethodFields | None, depth: int | None = None, pyramid: bool = False
    ) -> None:
        self.source = source
        self.method_fields = method_fields
        self.depth = depth  # the model's blocks a range counting from the last block is resolved against
        self.pyramid = pyramid

    def keys(self, d: Mapping[str, Any], allowed: set[str], where: str) -> None:
        unknown = [k for k in d if k not in allowed]
        if unknown:
            raise self.err(where, f"unknown key {shown(unknown[0])} (allowed: {', '.join(sorted(allowed))})")

    def space(self, data: Any) -> tuple[str, str, tuple[Method, ...]]:
        """The space's name, description and normalized methods."""
        if not isinstance(data, Mapping):
            raise self.err("", f"a space file is a mapping with keys {', '.join(sorted(_TOP_KEYS))}")
        self.keys(data, _TOP_KEYS, "")
        if data.get("format") != FORMAT:
            raise self.err("format", f"must be {FORMAT!r}, got {shown(data.get('format'))}")
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise self.err("name", "a non-empty string is required")
        desc = data.get("description", "")
        if not isinstance(desc, str):
            raise self.err("description", f"must be a string, got {type(desc).__name__}")
        methods = data.get("methods")
        if not isinstance(methods, list) or not methods:
            raise self.err("methods", "a non-empty list of methods is required")
        parsed = tuple(self.method(m, f"methods[{i}]") for i, m in enumerate(methods))
        names = [m.name for m in parsed]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise self.err(f"methods[{i}].name", f"method {n!r} appears twice; a method appears at most once")
        groups: dict[str, Method] = {}
        for i, m in enumerate(parsed):
            if m.group is None:
                continue
            first = groups.setdefault(m.group, m)
            if first.optional != m.optional:
                raise self.err(
                    f"methods[{i}].optional",
                    f"the methods of group {m.group!r} must agree on optional "
                    f"({first.name} says {first.optional}, {m.name} says {m.optional})",
                )
            if m.name == "none":
                raise self.err(f"methods[{i}].name", "'none' is reserved in groups")
        return name, desc, parsed

    def method(self, d: Any, where: str) -> Method:
        if not isinstance(d, Mapping):
            raise self.err(where, f"a method is a mapping with keys {', '.join(sorted(_METHOD_KEYS))}")
        self.keys(d, _METHOD_KEYS, where)
        name = d.get("name")
        if not isinstance(name, str) or not _METHOD_RE.match(name):
            raise self.err(f"{where}.name", f"a method name is required (letters, digits, _ or -), got {shown(name)}")
        fields = None
        if self.method_fields is not None:
            fields = self.method_fields(name)
            if fields is None:
                raise self.err(f"{where}.name", f"unknown method {shown(name)} (not in the method registry)")
        group = d.get("group")
        if group is not None and (not isinstance(group, str) or not _NAME_RE.match(group)):
            raise self.err(f"{where}.group", f"a group is a name (letters, digits, _), got {shown(group)}")
        optional = d.get("optional", False)
        if not isinstance(optional, bool):
            raise self.err(f"{where}.optional", f"must be true or false, got {shown(optional)}")
        raw = d.get("params", {}) or {}
        if not isinstance(raw, Mapping):
            raise self.err(f"{where}.params", "must be a mapping of config field -> entry")
        params: list[Param] = []
        for pname, spec in raw.items():
            pw = f"{where}.params.{pname}"
            if not isinstance(pname, str) or not _NAME_RE.match(pname):
                raise self.err(pw, "a parameter name is a config field name (letters, digits, _)")
            if fields is not None and pname not in fields:
                raise self.err(
                    pw,
                    f"unknown parameter {shown(pname)} of method {shown(name)} "
                    f"(its config fields: {', '.join(sorted(fields))})",
                )
            if pname == "on" and optional and group is None:
                raise self.err(pw, "'on' collides with the optional method's on/off parameter")
            params.append(self.param(pname, spec, pw, {p.name: p for p in params}))
            if self.method_fields is registry_method_fields:  # the registry's configs check the values
                why = check_values(name, params[-1])
                if why is not None:
                    raise self.err(pw, why)
        self.check_widths(name, params)
        return Method(name=name, group=group, optional=optional, params=tuple(params), where=where)

    def check_widths(self, method: str, params: list[Param]) -> None:
        """Width settings (:data:`WIDTH_PARAMS`) must only take multiples of the method's ``align``."""
        by = {p.name: p for p in params}
        a = by.get("align")
        aligns = (
            [DEFAULT_ALIGN]
            if a is None
            else list(a.choices)
            if a.kind == "categorical"
            else [a.value]
            if a.kind == "const"
            else list(range(int(a.low), int(a.high) + 1, int(a.step or 1)))
        )
        if ALIGN_AUTO in aligns and not WIDTH_PARAMS.get(method):
            return  # chosen by each search from the device's timings (dcs_search.align); no width here depends on it
        if not all(is_int(v) and v >= 1 for v in aligns):
            raise self.err(a.where, f"align takes integers >= 1, got {aligns}")
        need = math.lcm(*aligns)
        for pname in WIDTH_PARAMS.get(method, ()):
            p = by.get(pname)
            if p is None:
                continue
            if p.kind == "const":
                values = [p.value]
            elif p.kind == "categorical":
                values = list(p.choices)
            elif p.kind == "int" and not p.log:
                values = [p.low, p.high] + ([p.step] if p.step else [1])
            else:
                raise self.err(
                    p.where,
                    f"{pname} is a width: search it as an int with a step (a multiple of align {need}), or as choices",
                )
            bad = [v for v in values if v is not None and (not is_int(v) or v % need)]
            if bad:
                raise self.err(
                    p.where,
                    f"{pname} is a width and must only take multiples of align {need} (its low, "
                    f"high and step too); {bad[0]!r} is not. Use multiples of {need}, or set "
                    f"align: 1 for this method",
                )

    def param(self, pname: str, spec: Any, where: str, earlier: dict[str, Param]) -> Param:
        if not isinstance(spec, Mapping):
            if is_scalar(spec) or (isinstance(spec, list) and all(is_scalar(x) for x in spec)):
                return Param(
                    pname, "const", where, value=plain_value(spec), source={"kind": "const", "value": plain_value(spec)}
                )
            raise self.err(
                where, "a constant is a scalar or a list of scalars; write mappings as {kind: const, value: {...}}"
            )
        kind = spec.get("kind")
        if kind is None:
            raise self.err(
                where,
                f"a mapping needs kind: one of {', '.join(KINDS)} (a constant mapping is "
                "{kind: const, value: {...}})",
            )
        if kind not in KINDS:
            raise self.err(f"{where}.kind", f"unknown kind {shown(kind)} (known: {', '.join(KINDS)})")
        self.keys(spec, _KEYS[kind], where)
        when = self.when(spec.get("when"), where, earlier) if "when" in spec else ()
        src: dict[str, Any] = {}
        if kind == "const":
            if "value" not in spec:
                raise self.err(where, "kind const needs value")
            return Param(
                pname,
                "const",
                where,
                value=plain_value(spec["value"]),
                source={"kind": "const", "value": plain_value(spec["value"])},
            )
        if kind in ("float", "int"):
            p = self.numeric(pname, kind, spec, where)
        elif kind == "categorical":
            p = self.categorical(pname, spec, where)
        elif kind == "layers":
            p = self.layers(pname, spec, where)
        else:
            p = self.per_layer(pname, spec, where, earlier)
        src = dict(p.source)
        if when:
            src["when"] = {k: list(v) for k, v in when}
        return Param(**{**p.__dict__, "when": when, "source": src})

    def numeric(self, pname: str, kind: str, spec: Mapping[str, Any], where: str) -> Param:
        check = is_int if kind == "int" else is_num
        tname = "an integer" if kind == "int" else "a number"
        for k in ("low", "high"):
            if k not in spec:
                raise self.err(where, f"kind {kind} needs {k}")
            if not check(spec[k]) or not math.isfinite(spec[k]):
                raise self.err(f"{where}.{k}", f"must be {tname}, got {shown(spec[k])}")
        low, high = spec["low"], spec["high"]
        if kind == "float":
            low, high = float(low), float(high)
        if not low < high:
            raise self.err(where, f"empty or inverted range: low ({low}) must be < high ({high})")
        step, log = spec.get("step"), spec.get("log", False)
        if not isinstance(log, bool):
            raise self.err(f"{where}.log", f"must be true or false, got {shown(log)}")
        if step is not None and log:
            raise self.err(where, "step and log cannot both be given")
        if step is not None and (not check(step) or step <= 0 or not math.isfinite(step)):
            raise self.err(f"{where}.step", f"must be {tname} > 0, got {shown(step)}")
        if not log:
            too_many = check_grid(low, high, step, kind)
            if too_many:
                raise self.err(f"{where}.step" if step is not None else where, too_many)
        if step is not None:
            n = (high - low) / step
            if abs(n - round(n)) > 1e-9 * max(1.0, abs(n)):
                raise self.err(f"{where}.step", f"high - low ({high - low:g}) must be a multiple of step ({step})")
            if kind == "float":
                step = float(step)
        if log and low <= 0:
            raise self.err(f"{where}.low", f"log: true needs low > 0, got {low}")
        src = {"kind": kind, "low": low, "high": high, "step": step, "log": log}
        return Param(pname, kind, where, low=low, high=high, step=step, log=log, source=src)

    def categorical(self, pname: str, spec: Mapping[str, Any], where: str) -> Param:
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise self.err(f"{where}.choices", "a non-empty list of choices is required")
        for c in choices:
            if not is_scalar(c):
                raise self.err(f"{where}.choices", f"choices are scalars (null, bool, number, string), got {shown(c)}")
        keys = [json.dumps(c) for c in choices]
        if len(set(keys)) != len(keys):
            dup = next(c for i, c in enumerate(choices) if keys[i] in keys[:i])
            raise self.err(f"{where}.choices", f"choice {dup!r} appears twice")
        return Param(
            pname,
            "categorical",
            where,
            choices=tuple(choices),
            source={"kind": "categorical", "choices": list(choices)},
        )

    def per_layer(self, pname: str, spec: Mapping[str, Any], where: str, earlier: dict[str, Param]) -> Param:
        if "layers" not in spec or "value" not in spec:
            raise self.err(where, "kind per_layer needs layers (a sibling layers parameter or a list) and value")
        ref, lst = spec["layers"], None
        if isinstance(ref, str):
            sib = earlier.get(ref)
            if sib is None:
                raise self.err(
                    f"{where}.layers",
                    f"refers to {ref!r}, which must be a parameter declared before {pname!r} in the same method",
                )
            if not (sib.kind == "layers" or is_layer_const_value(sib)):
                raise self.err(
                    f"{where}.layers",
                    f"{ref!r} must be a layers parameter or a constant list of layer numbers, it is {sib.kind}",
                )
        else:
            lst = tuple(self.layer_list(ref, f"{where}.layers"))
            ref = None
        item_spec = spec["value"]
        iw = f"{where}.value"
        if not isinstance(item_spec, Mapping) or item_spec.get("kind") not in ("float", "int", "categorical"):
            raise self.err(iw, "the per-layer value is a float, int or categorical entry")
        if "when" in item_spec:
            raise self.err(f"{iw}.when", "put when on the per_layer entry, not on its value")
        self.keys(item_spec, _KEYS[item_spec["kind"]], iw)
        item = (
            self.categorical(pname, item_spec, iw)
            if item_spec["kind"] == "categorical"
            else self.numeric(pname, item_spec["kind"], item_spec, iw)
        )
        src = {"kind": "per_layer", "layers": ref if ref is not None else list(lst), "value": dict(item.source)}
        return Param(pname, "per_layer", where, layers_ref=ref, layers_list=lst, item=item, source=src)

    def when(self, raw: Any, where: str, earlier: dict[str, Param]) -> tuple[tuple[str, tuple], ...]:
        ww = f"{where}.when"
        if not isinstance(raw, Mapping) or not raw:
            raise self.err(ww, "when is a mapping {sibling: value} (or {sibling: [values]})")
        out = []
        for sib_name, val in raw.items():
            sib = earlier.get(sib_name)
            if sib is None:
                raise self.err(
                    ww, f"refers to {sib_name!r}, which must be a parameter declared before this one in the same method"
                )
            if sib.kind not in ("categorical", "const"):
                raise self.err(ww, f"{sib_name!r} is {sib.kind}; when can only test a categorical or constant")
            vals = tuple(val) if isinstance(val, list) else (val,)
            if not vals:
                raise self.err(ww, f"{sib_name}: give at least one value")
            for v in vals:
                ok = (v in sib.choices) if sib.kind == "categorical" else (v == sib.value)
                if not ok or not is_scalar(v):
                    opts = list(sib.choices) if sib.kind == "categorical" else [sib.value]
                    raise self.err(ww, f"{sib_name} can never be {v!r} (its values: {opts})")
            out.append((sib_name, vals))
        return tuple(out)
