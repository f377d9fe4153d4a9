"""Search-space files: the shipped ones load, every kind of bad entry is named, suggest/grid/params_for."""

from __future__ import annotations

import glob
import os
import warnings
from types import SimpleNamespace

import optuna
import pytest
from optuna.trial import FixedTrial

from nascompress.errors import NascompressError
from nascompress.studies import space_lattice
from nascompress.studies.space_model import Space, load_space

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(glob.glob(os.path.join(ROOT, "nascompress", "search_spaces", "*.yaml")))  # package data
SIX = SimpleNamespace(blocks=[None] * 6)  # what loading a space for a model reads of it: its blocks


def shipped(name: str, model=SIX):
    """A shipped space by name, sized for ``model`` (default: the project's 6-block ViT)."""
    return load_space(name, model=model, method_fields=fake_fields)


# The config fields the shipped files assume (the method registry's config_cls is being rebuilt).
FIELDS = {
    "evit": {"keep_rate", "prune_layers", "fuse_token"},
    "dynamicvit": {"rho", "prune_layers"},
    "sparsifiner": {"attn_keep_ratio", "mode", "kernel", "n_down", "block_size", "budget"},
    "mgvit": {"r_h", "r_t", "r_pos", "r_neg", "ppsm_layers", "epsilon"},
    "mgvit-h": {"variant", "r_h", "r_t", "r_pos", "r_neg", "epsilon"},
    "dcs": {"target_flops", "qk_mask"},
    "tome": {"r", "merge_layers", "prop_attn"},
}


def fake_fields(name: str) -> set[str] | None:
    return FIELDS.get(name)


def write(tmp_path, text: str):
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return p


def sample(space: Space, n: int, seed: int = 0) -> list[optuna.trial.FrozenTrial]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
        out = []
        for _ in range(n):
            t = study.ask()
            recs = space.suggest(t)
            study.tell(t, 0.0)
            out.append((recs, study.trials[-1].params))
    return out


def test_shipped_files_exist():
    names = {os.path.basename(p) for p in SHIPPED}
    assert {
        "evit.yaml",
        "dynamicvit.yaml",
        "sparsifiner.yaml",
        "mgvit.yaml",
        "mgvit-h.yaml",
        "dcs-target.yaml",
        "joint.yaml",
        "tome.yaml",
    } <= names


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_file_loads_samples_and_round_trips(path):
    depth = 12 if path.endswith("-12.yaml") else 6  # the default ViT; *-12.yaml: 12 blocks
    # (mgvit-h patches a pyramid ViT: loaded without a model, as its layers do not count blocks)
    model = None if path.endswith("mgvit-h.yaml") else SimpleNamespace(blocks=[None] * depth)
    space = load_space(path, model=model, method_fields=fake_fields)
    assert Space.from_dict(space.to_dict(), method_fields=fake_fields).hash() == space.hash()
    for recs, params in sample(space, 12):
        assert space.params_for(recs) == params
        assert space.records(params) == recs
    grid = space.grid(8)
    assert 1 <= len(grid) <= 8
    for params in grid:
        assert space.params_for(space.records(params)) == params


BAD = {
    "unknown top-level key": ("extra: 1\n", "space.yaml: unknown key 'extra'"),
    "unknown method key": ("  - name: evit\n    grup: x\n", "methods[1]: unknown key 'grup'"),
    "unknown param key": (
        "      p: {kind: float, low: 0, high: 1, stepp: 0.1}\n",
        "methods[1].params.p: unknown key 'stepp'",
    ),
    "inverted range": ("      p: {kind: float, low: 1, high: 0}\n", "methods[1].params.p: empty or inverted range"),
    "empty range": ("      p: {kind: int, low: 3, high: 3}\n", "methods[1].params.p: empty or inverted range"),
    "wrong type": ("      p: {kind: float, low: a, high: 1}\n", "methods[1].params.p.low: must be a number"),
    "bool is not int": ("      p: {kind: int, low: true, high: 3}\n", "methods[1].params.p.low: must be an integer"),
    "step and log": ("      p: {kind: float, low: 0.1, high: 1, step: 0.1, log: true}\n", "step and log cannot both"),
    "step not dividing": ("      p: {kind: float, low: 0, high: 1, step: 0.3}\n", "must be a multiple of step"),
    "log with low 0": ("      p: {kind: float, low: 0, high: 1, log: true}\n", "log: true needs low > 0"),
    "unknown kind": (
        "      p: {kind: gaussian, low: 0, high: 1}\n",
        "methods[1].params.p.kind: unknown kind 'gaussian'",
    ),
    "mapping without kind": ("      p: {low: 0, high: 1}\n", "methods[1].params.p: a mapping needs kind"),
    "empty choices": ("      p: {kind: categorical, choices: []}\n", "methods[1].params.p.choices: a non-empty list"),
    "duplicate choice": ("      p: {kind: categorical, choices: [a, a]}\n", "choice 'a' appears twice"),
    "layer 0": ("      p: {kind: layers, candidates: [0, 2], size: 1}\n", "layer numbers are integers >= 1"),
    "size too big": ("      p: {kind: layers, candidates: [2, 11], size: [1, 3]}\n", "size 3 exceeds the 2 candidate"),
    "layers without size": ("      p: {kind: layers, range: [2, 5]}\n", "needs size"),
    "per_layer bad ref": (
        "      p: {kind: per_layer, layers: q, value: {kind: float, low: 0, high: 1}}\n",
        "methods[1].params.p.layers: refers to 'q'",
    ),
    "when undeclared": ("      p: {kind: int, low: 1, high: 4, when: {mode: block}}\n", "when: refers to 'mode'"),
    "unknown method": ("  - name: nope\n", "methods[1].name: unknown method 'nope'"),
    "unknown parameter": ("      foo: 1\n", "methods[1].params.foo: unknown parameter 'foo' of method 'mgvit'"),
    "duplicate yaml key": ("      p: 1\n      p: 2\n", "duplicate key 'p'"),
}


@pytest.mark.parametrize("case", sorted(BAD), ids=str)
def test_bad_entry_names_file_entry_and_problem(tmp_path, case):
    snippet, expected = BAD[case]
    base = "format: nascompress-space/1\nname: t\nmethods:\n  - name: dcs\n    params:\n      target_flops: 0.5\n"
    if snippet.startswith("  - name:"):
        text = base + snippet
    elif snippet.startswith("      "):
        text = base + "  - name: mgvit\n    params:\n" + snippet
    else:
        text = base + snippet
    fields = dict(FIELDS, mgvit=FIELDS["mgvit"] | {"p", "mode"})
    with pytest.raises(NascompressError) as e:
        load_space(write(tmp_path, text), method_fields=lambda n: fields.get(n))
    assert expected in str(e.value)
    assert "space.yaml" in str(e.value)


def test_when_value_must_be_a_choice(tmp_path):
    text = (
        "format: nascompress-space/1\nname: t\nmethods:\n  - name: sparsifiner\n    params:\n"
        "      mode: {kind: categorical, choices: [unstructured, block]}\n"
        "      kernel: {kind: categorical, choices: [gather, flex], when: {mode: blocky}}\n"
    )
    with pytest.raises(NascompressError, match=r"params.kernel.when: mode can never be 'blocky'"):
        load_space(write(tmp_path, text), method_fields=fake_fields)


def test_group_members_must_agree_on_optional(tmp_path):
    text = (
        "format: nascompress-space/1\nname: t\nmethods:\n  - {name: evit, group: tokens, optional: true}\n"
        "  - {name: dynamicvit, group: tokens}\n"
    )
    with pytest.raises(NascompressError, match=r"methods\[1\].optional: the methods of group 'tokens' must agree"):
        load_space(write(tmp_path, text), method_fields=fake_fields)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(NascompressError, match="does not exist"):
        load_space(tmp_path / "nope.yaml", method_fields=fake_fields)
    with pytest.raises(NascompressError, match="not valid YAML at line 2"):
        load_space(write(tmp_path, "format: x\n  bad: [\n"), method_fields=fake_fields)


def test_check_depth():
    space = shipped("evit")
    space.check_depth(5)
    with pytest.raises(
        NascompressError,
        match=r"methods\[0\].params.prune_layers: layer 5 is beyond the model's "
        r"depth 4",
    ):
        space.check_depth(4)


def test_suggest_respects_conditions_groups_and_per_layer_lengths():
    space = shipped("joint")
    seen_groups, seen_modes = set(), set()
    for recs, params in sample(space, 60, seed=1):
        names = [r["name"] for r in recs]
        assert names[0] == "dcs" and len({"evit", "dynamicvit", "tome"} & set(names)) <= 1
        assert names[-1] in ("dcs", "sparsifiner", params["group.tokens"])  # the token method last
        seen_groups.add(params["group.tokens"])
        for r in recs:
            cfg = r["config"]
            if r["name"] in ("evit", "dynamicvit"):
                rates = cfg["keep_rate" if r["name"] == "evit" else "rho"]
                assert len(rates) == len(cfg["prune_layers"]) and cfg["prune_layers"] == sorted(cfg["prune_layers"])
            if r["name"] == "sparsifiner":
                seen_modes.add(cfg["mode"])
        assert ("sparsifiner" in names) == params["sparsifiner.on"]
        assert ("evit.keep_rate.0" in params) == (params["group.tokens"] == "evit")
    assert seen_groups == {"evit", "dynamicvit", "tome", "none"} and seen_modes == {"unstructured", "block"}

    sp = shipped("sparsifiner")
    base = {"sparsifiner.attn_keep_ratio": 0.25, "sparsifiner.n_down": 16}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        off = sp.suggest(FixedTrial({**base, "sparsifiner.mode": "unstructured"}))[0]["config"]
        on = sp.suggest(FixedTrial({**base, "sparsifiner.mode": "block", "sparsifiner.kernel": "flex"}))[0]["config"]
    assert "kernel" not in off and on["kernel"] == "flex"


def test_grid_size_and_spacing(tmp_path):
    text = (
        "format: nascompress-space/1\nname: g\nmethods:\n  - name: sparsifiner\n    params:\n"
        "      attn_keep_ratio: {kind: float, low: 0.1, high: 0.8}\n"
    )
    space = load_space(write(tmp_path, text), method_fields=fake_fields)
    grid = space_lattice.grid(space, 7)  # the lattice (what a conditional space's grid uses)
    xs = sorted(p["sparsifiner.attn_keep_ratio"] for p in grid)
    assert len(grid) == 7
    assert xs == pytest.approx([0.1 + 0.7 * (k + 0.5) / 7 for k in range(7)])
    assert grid[0]["sparsifiner.attn_keep_ratio"] == pytest.approx(0.45)  # the first point is the middle
    two = space_lattice.grid(
        load_space(
            write(tmp_path, text + "      mode: {kind: categorical, choices: [unstructured, block]}\n"),
            method_fields=fake_fields,
        ),
        10,
    )
    assert len(two) == 10 and {p["sparsifiner.mode"] for p in two} == {"unstructured", "block"}
    assert len({p["sparsifiner.attn_keep_ratio"] for p in two}) == 10  # evenly spread in each coordinate
    cat = load_space(
        write(
            tmp_path,
            "format: nascompress-space/1\nname: c\nmethods:\n  - name: sparsifiner\n"
            "    params:\n      mode: {kind: categorical, choices: [unstructured, block]}\n",
        ),
        method_fields=fake_fields,
    )
    assert len(cat.grid(10)) == 2  # only two distinct configurations exist
    with pytest.raises(NascompressError):
        cat.grid(0)


def test_an_unconditional_spaces_grid_is_optunas_qmc_sequence(tmp_path):
    """An unconditional space's spread points are the first points of Optuna's QMCSampler (the
    sequence a ``--sampler qmc`` study walks), not the home-made lattice."""

    from nascompress.studies.qmc import qmc_sampler

    text = (
        "format: nascompress-space/1\nname: g\nmethods:\n  - name: sparsifiner\n    params:\n"
        "      attn_keep_ratio: {kind: float, low: 0.1, high: 0.8}\n"
        "      mode: {kind: categorical, choices: [unstructured, block]}\n"
    )
    space = load_space(write(tmp_path, text), method_fields=fake_fields)
    assert space.conditional() is None
    grid = space.grid(8)
    study = optuna.create_study(sampler=qmc_sampler(space.distributions(), study_seed=0, seed=0))
    walked = []
    for _ in range(8):
        t = study.ask(space.distributions())
        walked.append(dict(t.params))
        study.tell(t, 0.0)
    assert grid == walked and len(grid) == 8
    assert grid != space_lattice.grid(space, 8)
    xs = [p["sparsifiner.attn_keep_ratio"] for p in grid]
    assert all(0.1 <= x <= 0.8 for x in xs) and len(set(xs)) == 8
    assert {p["sparsifiner.mode"] for p in grid} == {"unstructured", "block"}
    evit = shipped("evit")
    assert evit.conditional() is not None and evit.grid(5) == space_lattice.grid(evit, 5)


def test_params_for_dense_and_paper_configs_and_errors():
    space = shipped("evit")
    paper = [{"name": "evit", "config": {"keep_rate": [0.7, 0.7], "prune_layers": [2, 4], "fuse_token": True}}]
    params = space.params_for(paper)
    assert params == {"evit.prune_layers": "2,4", "evit.keep_rate.0": 0.7, "evit.keep_rate.1": 0.7}
    assert space.records(params) == paper
    with pytest.raises(NascompressError, match=r"evit.config.keep_rate\[0\]: 0.3 is outside the space's range"):
        space.params_for([{"name": "evit", "config": {"keep_rate": [0.3], "prune_layers": [2]}}])
    with pytest.raises(NascompressError, match="expected 2 values"):
        space.params_for([{"name": "evit", "config": {"keep_rate": [0.7], "prune_layers": [2, 4]}}])
    with pytest.raises(NascompressError, match="not one of the space's layer sets"):
        space.params_for([{"name": "evit", "config": {"keep_rate": [0.7], "prune_layers": [9]}}])
    with pytest.raises(NascompressError, match="fixes it to True"):
        space.params_for([{"name": "evit", "config": {"keep_rate": [0.7], "prune_layers": [2], "fuse_token": False}}])
    joint = shipped("joint")
    dense = joint.params_for([{"name": "dcs", "config": {"target_flops": 1.0, "qk_mask": "static"}}])
    assert dense == {"dcs.target_flops": 1.0, "group.tokens": "none", "sparsifiner.on": False}
    with pytest.raises(NascompressError, match="alternatives"):
        joint.params_for(
            [
                {"name": "dcs", "config": {"target_flops": 1.0}},
                {"name": "evit", "config": {"keep_rate": [1.0], "prune_layers": [2]}},
                {"name": "dynamicvit", "config": {"rho": [1.0], "prune_layers": [2]}},
            ]
        )


def test_hash_is_stable_and_ignores_name_and_description(tmp_path):
    text = (
        "format: nascompress-space/1\nname: a\ndescription: one\nmethods:\n  - name: dcs\n    params:\n"
        "      target_flops: {kind: float, low: 0.4, high: 0.9, step: 0.05}\n"
    )
    h1 = load_space(write(tmp_path, text), method_fields=fake_fields).hash()
    h2 = load_space(
        write(tmp_path, text.replace("name: a", "name: b").replace("one", "two")), method_fields=fake_fields
    ).hash()
    h3 = load_space(write(tmp_path, text.replace("0.9", "0.8")), method_fields=fake_fields).hash()
    assert h1 == h2 != h3 and len(h1) == 16


# Every kind of parameter, none conditional: the per-layer lists have a fixed length, the group has one
# member, the optional method has no searched parameter.
UNCONDITIONAL = """
format: nascompress-space/1
name: flat
methods:
  - name: alpha
    params:
      rate: {kind: float, low: 0.1, high: 0.9, step: 0.1}
      lr: {kind: float, low: 0.0001, high: 0.1, log: true}
      x: {kind: float, low: -1, high: 1}
      width: {kind: int, low: 8, high: 64, step: 8}
      heads: {kind: int, low: 1, high: 16, log: true}
      mode: {kind: categorical, choices: [a, b, null, 3]}
      layers: {kind: layers, range: [1, 4], size: 2}
      keep: {kind: per_layer, layers: layers, value: {kind: float, low: 0.5, high: 1.0, step: 0.05}}
      fixed: [2, 5]
      bits: {kind: per_layer, layers: fixed, value: {kind: categorical, choices: [4, 8]}}
      lit: {kind: per_layer, layers: [1, 3, 6], value: {kind: int, low: 0, high: 3}}
      sets: {kind: layers, choices: [[1, 2], [3, 4]]}
      note: constant
  - name: beta
    group: only
    params:
      r: {kind: float, low: 0.0, high: 1.0}
  - name: gamma
    optional: true
    params:
      c: 1
"""


def test_distributions_equal_what_a_real_trial_suggests(tmp_path):
    for space in (
        load_space(write(tmp_path, UNCONDITIONAL), method_fields=None),
        shipped("mgvit"),
        shipped("dcs-target"),
    ):
        assert space.conditional() is None
        dists = space.distributions()
        assert list(dists) == space.param_names()
        for seed in range(3):
            optuna.logging.set_verbosity(optuna.logging.WARNING)
            study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
            trial = study.ask()
            space.suggest(trial)
            study.tell(trial, 0.0)
            assert study.trials[-1].distributions == dists
    flat = load_space(write(tmp_path, UNCONDITIONAL), method_fields=None).distributions()
    assert [k for k in flat if k.startswith("alpha.keep.")] == ["alpha.keep.0", "alpha.keep.1"]
    assert flat["group.only"].single() and flat["alpha.layers"].choices[0] == "1,2"


@pytest.mark.parametrize(
    "name,param",
    [
        ("sparsifiner.yaml", "sparsifiner.kernel (methods[0].params.kernel) exists only when mode is 'block' (when:)"),
        (
            "evit.yaml",
            "evit.keep_rate.1 (methods[0].params.keep_rate) exists only when evit.prune_layers has at "
            "least 2 layers (its sets have 1 to 3)",
        ),
        (
            "joint.yaml",
            "sparsifiner.attn_keep_ratio (methods[1].params.attn_keep_ratio) exists only when sparsifiner.on is True",
        ),
    ],
)
def test_a_conditional_space_has_no_distributions(name, param):
    space = shipped(name)
    with pytest.raises(NascompressError) as e:
        space.distributions()
    msg = str(e.value)
    assert "\n" not in msg and param in msg and f"space {space.name!r} is conditional" in msg


def test_an_optional_method_with_searched_params_is_conditional(tmp_path):
    text = UNCONDITIONAL.replace("      c: 1\n", "      c: {kind: int, low: 1, high: 4}\n")
    space = load_space(write(tmp_path, text), method_fields=None)
    assert space.conditional() == "gamma.c (methods[2].params.c) exists only when gamma.on is True"


@pytest.mark.parametrize("name", ["evit", "joint", "dynamicvit"])
def test_default_spaces_are_sized_by_the_model_depth(name):
    """The default spaces' layer ranges count from the last block: a 4-block model gets layers
    within its depth, a 12-block one the whole model (no longer layers 2-5 of the 6-block default)."""

    def layer_sets(depth):
        sp = shipped(name, model=SimpleNamespace(blocks=[None] * depth))
        return [c for m in sp.methods for p in m.params if p.kind == "layers" for c in p.choices], sp

    four, _ = layer_sets(4)
    assert four and max(x for c in four for x in c) <= 4 and min(x for c in four for x in c) == 2
    twelve, _ = layer_sets(12)
    assert max(x for c in twelve for x in c) >= 11 and {x for c in twelve for x in c} >= set(range(2, 12))
    if name == "evit":  # on the 6-block default ViT: the former layers 2-5, the same hash as before
        six = layer_sets(6)[1]
        assert {x for m in six.methods for p in m.params if p.kind == "layers" for c in p.choices for x in c} == {
            2,
            3,
            4,
            5,
        } and six.hash() == "22c74247533dd81a"
    if name != "dynamicvit":  # EViT's range ends at the last block but one: none on 2 blocks
        with pytest.raises(NascompressError, match="selects no layer of this 2-block model"):
            layer_sets(2)


def test_a_range_counting_from_the_last_block_needs_a_model(tmp_path):
    text = (
        "format: nascompress-space/1\nname: rel\nmethods:\n  - name: evit\n    params:\n"
        "      prune_layers: {kind: layers, range: [2, -2], size: [1, 3]}\n"
    )
    with pytest.raises(
        NascompressError,
        match=r"range \[2, -2\] counts from the model's last block: load the "
        r"space for a model",
    ):
        load_space(write(tmp_path, text), method_fields=fake_fields)
    with pytest.raises(NascompressError, match=r"layer numbers are 1-based .* got \[-3, 4\]"):
        load_space(write(tmp_path, text.replace("[2, -2]", "[-3, 4]")), model=SIX, method_fields=fake_fields)
    sp = load_space(write(tmp_path, text), model=SimpleNamespace(blocks=[None] * 4), method_fields=fake_fields)
    assert sp.methods[0].params[0].source == {"kind": "layers", "range": [2, 3], "size": [1, 2]}  # size capped


def test_shipped_spaces_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shipped("tome").name == "tome" and shipped("evit.yaml").name == "evit"
    with pytest.raises(
        NascompressError,
        match=r"search space nope does not exist: give a YAML file or the name "
        r"of a shipped search space \(dcs-target, dynamicvit, evit",
    ):
        load_space("nope", method_fields=fake_fields)
