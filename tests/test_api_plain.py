"""The Python API as a library user expects it (issue 69 items 2 and 5): plain timm modules out
where the architecture allows (they unpickle and run where nascompress cannot be imported),
``to_transformers`` decided by shapes, quiet calls with ``progress=False``, errors naming Python
arguments, a second ``save()`` of the same model, ``dir(nc)`` and ``nc.retrain`` a function."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
from timm.layers import Attention
from timm.models.vision_transformer import Block

import nascompress as nc
from nascompress.errors import SettingError, python_errors, python_words
from nascompress.models.layers import nascompress_modules, to_core, to_plain
from nascompress.models.slicing import slice_hidden, slice_qk
from tests.conftest import tiny_gray_vit

TINY = dict(device="cpu", train_limit=64, eval_limit=64)
# a process where nascompress cannot be imported: it loads a pickled model and writes its logits
NO_NASCOMPRESS = textwrap.dedent(
    """
    import sys
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "nascompress":
                raise ImportError("nascompress is not importable here")
    sys.meta_path.insert(0, Refuse())
    import torch
    model = torch.load(sys.argv[1], weights_only=False)
    torch.save(model(torch.load(sys.argv[2])), sys.argv[3])
    assert not any(m.split(".")[0] == "nascompress" for m in sys.modules)
    """
)


def logits_without_nascompress(model: torch.nn.Module, x: torch.Tensor, tmp_path) -> torch.Tensor:
    torch.save(model, tmp_path / "model.pt")
    torch.save(x, tmp_path / "x.pt")
    (tmp_path / "load.py").write_text(NO_NASCOMPRESS)
    r = subprocess.run(
        [sys.executable, "load.py", "model.pt", "x.pt", "y.pt"], cwd=tmp_path, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return torch.load(tmp_path / "y.pt")


def hidden_pruned(widths: list[int], *, qk: int | None = None) -> torch.nn.Module:
    """The tiny ViT with block i keeping its first ``widths[i]`` hidden neurons (a DCS-hidden or a
    uniform model's shape), and each head's first ``qk`` Q/K channels when given."""
    model = to_core(tiny_gray_vit(depth=len(widths)), method="test")
    for blk, w in zip(model.blocks, widths):
        slice_hidden(blk, list(range(w)))
        if qk is not None:
            slice_qk(blk.attn, [list(range(qk))] * blk.attn.num_heads)
    return model.eval()


@pytest.fixture(scope="module")
def materialized():
    """A DCS search of the hidden family (no Q/K mask) on the tiny ViT, materialized by the API."""
    search = nc.dcs.search(
        tiny_gray_vit(), "synthetic", target_flops=0.7, epochs=1, mlp_gates="hidden", qk_mask="none", **TINY
    )
    return nc.materialize(search)


def test_a_dcs_hidden_model_is_timms_classes_and_runs_without_nascompress(materialized, tmp_path):
    model = materialized.model
    assert all(type(b) is Block and type(b.attn) is Attention for b in model.blocks)
    assert nascompress_modules(model) == []
    x = torch.randn(3, 1, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(logits_without_nascompress(model, x, tmp_path), model(x))
        loaded = nc.load(materialized.save(tmp_path / "saved"))
        assert all(type(b) is Block for b in loaded.blocks)  # nc.load gives timm's classes too
        torch.testing.assert_close(loaded(x), model(x))


def test_per_block_widths_stay_timms_classes_and_equal(tmp_path):
    model = hidden_pruned([40, 24, 8])
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        before = model(x)
        assert to_plain(model) == []
        assert [type(b) for b in model.blocks] == [Block] * 3
        assert [b.mlp.fc1.out_features for b in model.blocks] == [40, 24, 8]
        torch.testing.assert_close(model(x), before)
        torch.testing.assert_close(logits_without_nascompress(model, x, tmp_path), before)


def test_a_narrowed_qk_keeps_nascompress_and_says_where():
    model = hidden_pruned([16, 16], qk=8)
    assert to_plain(model) == ["blocks.0.attn", "blocks.1.attn"]
    assert type(model.blocks[0].attn).__name__ == "NCAttention"  # untouched


def test_to_transformers_decides_by_shapes(tmp_path):
    tf = pytest.importorskip("transformers")
    x = torch.randn(2, 1, 16, 16)
    uniform = hidden_pruned([24, 24])  # NCBlock classes, shapes a ViTConfig holds: accepted
    path = nc.to_transformers(uniform, tmp_path / "hf")
    hf = tf.ViTForImageClassification.from_pretrained(str(path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(pixel_values=x).logits, uniform(x), atol=1e-4, rtol=1e-4)
    with pytest.raises(nc.NascompressError, match=r"MLP widths differ \(\[24, 8\]\)"):
        nc.to_transformers(hidden_pruned([24, 8]), tmp_path / "uneven")
    with pytest.raises(nc.NascompressError, match="keeps 8 Q/K channels per head against 16 for V"):
        nc.to_transformers(hidden_pruned([24, 24], qk=8), tmp_path / "qk")


def test_progress_false_prints_nothing(materialized, capfd, monkeypatch):
    monkeypatch.delenv("NASCOMPRESS_PROGRESS", raising=False)  # the suite's "off": the default display
    capfd.readouterr()
    model = tiny_gray_vit()
    search = nc.dcs.search(model, "synthetic", target_flops=0.7, epochs=1, progress=False, **TINY)
    nc.retrain(nc.materialize(search, progress=False), "synthetic", epochs=1, progress=False, **TINY)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_every_stage_function_takes_progress_and_is_a_function():
    for fn in (nc.dcs.search, nc.materialize, nc.retrain, nc.quantize, nc.tokens.apply, nc.compress):
        assert inspect.isfunction(fn) and "progress" in inspect.signature(fn).parameters, fn
    assert "teacher" in inspect.signature(nc.retrain).parameters
    assert "Retrain a compressed model" in inspect.getdoc(nc.retrain)
    assert {"compress", "load", "dcs", "tokens", "retrain", "materialize", "export"} <= set(dir(nc))


def test_errors_name_python_arguments(materialized, monkeypatch):
    assert python_words("set {num_classes} 5") == "set num_classes=5"
    assert python_words("rerun the same command with {force} {target_flops} 0.39", call="nc.dcs.search") == (
        "nc.dcs.search: call the same function again with force=True, target_flops=0.39"
    )

    def refuse(*a, **k):
        raise SettingError("the goal is missed; rerun the same command with {force} {target_flops} 0.39")

    monkeypatch.setattr("nascompress.pyapi.stages.materialize_search", refuse)
    with pytest.raises(SettingError) as e:
        nc.materialize(materialized)
    assert str(e.value) == (
        "nc.materialize: the goal is missed; call the same function again with force=True, target_flops=0.39"
    )
    with pytest.raises(SettingError, match=r"^f: give \{x\} and dataset=PATH$"):
        with python_errors("f"):
            raise SettingError("give {{x}} and {dataset} PATH")


def test_saving_the_same_model_again_returns_it(tmp_path):
    model = tiny_gray_vit(depth=2)
    evit = nc.tokens.apply(model, "evit", keep_rate=0.7, prune_layers=[1])
    first = evit.save(tmp_path / "small")
    assert evit.save(tmp_path / "small") == first  # the notebook cell run again
    other = nc.tokens.apply(model, "evit", keep_rate=0.5, prune_layers=[1])
    with pytest.raises(nc.NascompressError):
        other.save(tmp_path / "small")  # another model there: only with force
    other.save(tmp_path / "small", force=True)


def test_deit_classifiers_come_in_and_go_out_with_equal_logits(tmp_path):
    """issue 68 item 6: DeiT with and without its distillation head, tiny configs built here."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.DeiTConfig(
        image_size=16,
        patch_size=4,
        num_channels=1,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=5,
    )
    x = torch.randn(2, 1, 16, 16)
    for cls in (tf.DeiTForImageClassification, tf.DeiTForImageClassificationWithTeacher):
        hf = cls(cfg).eval()
        hf.save_pretrained(tmp_path / cls.__name__)
        for given in (hf, tmp_path / cls.__name__):
            model = nc.from_transformers(given)
            with torch.no_grad():
                torch.testing.assert_close(model(x), hf(pixel_values=x).logits)
        out = nc.to_transformers(model, tmp_path / f"{cls.__name__}-out")
        back = tf.DeiTForImageClassificationWithTeacher.from_pretrained(str(out)).eval()
        with torch.no_grad():
            torch.testing.assert_close(back(pixel_values=x).logits, model(x))
    with pytest.raises(nc.NascompressError, match="got DeiTModel: a DeiT without a classification head"):
        nc.from_transformers(tf.DeiTModel(cfg))


def test_compress_words_a_stages_advice_as_its_arguments():
    """A stage's advice inside nc.compress's pipeline names the file's keys (step_error: each field's
    key path is data, SettingError.keys): the caller reads them as nc.compress's arguments, the
    stage's dict entry with its value; a key path in the message's text is text, never rewritten."""
    from nascompress.pyapi.compress import argument_of, compress_words

    def advice(template: str, **keys: str) -> SettingError:
        return SettingError(template, keys=keys)

    stands = advice(
        "stands at the target; rerun the same command with {force} {target_flops} 0.39",
        target_flops="stages.dcs.target_flops",
    )
    assert str(stands) == "stands at the target; rerun the same command with force stages.dcs.target_flops 0.39"
    assert compress_words(stands) == (
        "nc.compress: stands at the target; call the same function again with force=True, dcs={'target_flops': 0.39}"
    )
    assert compress_words(
        advice("rerun the same command with {force} {budget} project", budget="stages.dcs.budget")
    ).endswith("force=True, dcs={'budget': 'project'}")
    assert compress_words(advice("give {epochs} a positive value", epochs="stages.retrain.epochs")) == (
        "nc.compress: give retrain={'epochs': ...} a positive value"
    )
    both = advice("{trials} 40 or {epochs} 3", trials="stages.tokens.trials", epochs="stages.dcs.epochs")
    assert compress_words(both) == "nc.compress: tokens={'trials': 40} or dcs={'epochs': 3}"
    other = advice("{dataset} digits, {seed} 3 or {lr} 0.1", dataset="data.dataset", seed="seed")
    assert compress_words(other) == "nc.compress: data.dataset digits, seed 3 or lr=0.1"
    assert compress_words(SettingError("stages.dcs.epochs 3 is text")) == "nc.compress: stages.dcs.epochs 3 is text"
    assert [argument_of(k) for k in ("stages.dcs.epochs", "stages.retrain", "goal.max_flops", "stages.dcs.Foo")] == [
        "dcs['epochs']",
        "stages.retrain",
        "goal.max_flops",
        "stages.dcs.Foo",
    ]


def test_compress_names_a_stage_key_as_its_dict_entry(tiny_run):
    """A pipeline-file check inside nc.compress names the stage's dict entry, not the file's key."""
    import nascompress as nc
    from nascompress import NascompressError

    model = nc.load(tiny_run)
    with pytest.raises(NascompressError) as e:
        nc.compress(model, "digits", target_flops=0.6, dcs={"epochs": -1}, progress=False)
    msg = str(e.value)
    assert "dcs['epochs']" in msg and "stages." not in msg and len(msg.splitlines()) == 1, msg
