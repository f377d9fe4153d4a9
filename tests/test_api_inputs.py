"""The Python API's inputs refused in one line naming the argument: a caller's Dataset with labels
that are no class indices, a failing ``__getitem__``, images of another dtype, channels or size than
the model's, a DataLoader without a batch size, one too large to read for its labels; a CUDA device
on a machine without one; Hugging Face folders in and out (``to_transformers`` never writes into a
nascompress output, replaces only a folder it wrote, and leaves no half-written folder)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import nascompress as nc
from nascompress.errors import NascompressError, SettingError
from nascompress.pyapi.common import StageResult, model_and_arch

N = 60  # images of the tiny datasets: 3 classes, 20 each


def tiny_model(in_chans: int = 1, img: int = 16) -> torch.nn.Module:
    from nascompress.models.build import build_model, custom_vit_spec

    torch.manual_seed(0)
    return build_model(
        custom_vit_spec(
            img_size=img, patch_size=4, embed_dim=16, depth=1, num_heads=1, num_classes=3, in_chans=in_chans
        )
    ).eval()


class Items(Dataset):
    """A map-style Dataset of the given (image, label) items."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class WithTargets(TensorDataset):
    """A TensorDataset with a ``targets`` attribute (and ``classes`` when given)."""

    def __init__(self, images, labels, targets, classes=None):
        super().__init__(images, labels)
        self.targets = targets
        if classes is not None:
            self.classes = classes


def images(n: int = N, c: int = 1, size: int = 16) -> torch.Tensor:
    return torch.rand(n, c, size, size, generator=torch.Generator().manual_seed(0))


def labels(n: int = N) -> torch.Tensor:
    return torch.arange(n) % 3


def refused(data, match: str, **kw) -> str:
    """The one-line error nc.tokens.apply gives for ``data`` (the data check every stage runs)."""
    with pytest.raises(NascompressError, match=match) as e:
        nc.tokens.apply(tiny_model(), "evit", data, keep_rate=0.7, device="cpu", **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    "items, match",
    [
        ([(x, "cat") for x in images()], r"data\[0\] has label 'cat' \(str\); labels must be integer class indices"),
        ([(x, torch.tensor([1, 2])) for x in images()], r"data\[0\] has label a Tensor of shape \(2,\)"),
        ([(x, 0.5 + i % 2) for i, x in enumerate(images())], r"data\[0\] has label 0.5 \(float\)"),
        ([(x, complex(1, 2)) for x in images()], r"data\[0\] has label \(1\+2j\) \(complex\)"),
        ([(x, -1) for x in images()], r"data\[0\] has label -1 \(int\)"),
    ],
    ids=["str", "two-values", "float", "complex", "negative"],
)
def test_labels_that_are_no_class_indices_are_refused(items, match):
    refused(Items(items), match)


def test_targets_that_are_no_class_indices_are_refused_and_integral_ones_taken():
    x, y = images(), labels()
    refused(WithTargets(x, y, ["cat"] * N), r"data\.targets\[0\] is 'cat' \(str\)")
    refused(WithTargets(x, y, torch.full((N,), 1.5)), r"data\.targets\[0\] is 1.5 \(float\)")
    refused(WithTargets(x, y, torch.zeros(3, dtype=torch.long)), "data.targets has 3 labels but data has 60 items")
    refused(WithTargets(x, y, y, classes=["a", "b"]), r"data has label 2 but data\.classes names 2 classes")
    from nascompress.data.memory import CallerDataset

    x = images(6)
    ds = CallerDataset(
        Items([(x[i], v) for i, v in enumerate([0, 1.0, np.int64(2), np.float32(1), torch.tensor(2), True])])
    )
    assert ds.labels.tolist() == [0, 1, 2, 1, 2, 1] and ds.classes == ["0", "1", "2"]
    assert CallerDataset(WithTargets(x, labels(6), np.array([0.0, 1, 2, 0, 1, 2]))).labels.tolist() == [0, 1, 2] * 2


def test_val_labels_beyond_the_training_classes_are_refused():
    refused(
        TensorDataset(images(), labels()),
        r"val has label 7 but data's classes names 3 classes",
        val=Items([(images(1)[0], 7)] * 6),
    )


def test_a_failing_getitem_is_one_line_naming_the_item():
    class Broken(Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            if i == 3:
                raise OSError("Input/output error\nsecond line")
            return images(1)[0], i % 3

    msg = refused(Broken(), r"data\[3\] raised OSError: Input/output error; fix the dataset's __getitem__")
    assert "second line" not in msg


def test_images_of_another_dtype_are_refused():
    refused(TensorDataset(images().to(torch.complex64), labels()), "data gives torch.complex64 images")
    refused(TensorDataset((images() * 255).long(), labels()), "data gives torch.int64 images")


def test_a_dataloader_without_a_batch_size_is_refused():
    loader = DataLoader(TensorDataset(images(), labels()), batch_size=None)
    refused(loader, "data is a DataLoader without a batch size .*give the DataLoader a batch_size")


@pytest.mark.parametrize("c, size", [(3, 16), (1, 8)])
def test_images_of_other_channels_or_size_than_the_models_are_refused(c, size):
    ds = TensorDataset(images(c=c, size=size), labels())
    refused(ds, rf"the images of data are \({c}, {size}, {size}\) \(C, H, W\) but the model takes \(1, 16, 16\)")


def test_compress_names_its_train_argument():
    with pytest.raises(NascompressError, match=r"train\[0\] has label 'cat'"):
        nc.compress(tiny_model(), Items([(x, "cat") for x in images()]), methods=("evit",), progress=False)


def test_the_label_pass_is_bounded(monkeypatch):
    reads = []

    class Huge(Dataset):
        def __len__(self):
            return 10**8

        def __getitem__(self, i):
            reads.append(i)
            return images(1)[0], 0

    refused(
        Huge(),
        r"data.s length .* is 100,000,000, above the limit of 1,000,000 \(max_label_scan\); give data a targets",
    )
    assert reads == []  # refused before any item is read
    monkeypatch.setenv("NASCOMPRESS_MAX_LABEL_SCAN", "50")
    refused(TensorDataset(images(), labels()), "NASCOMPRESS_MAX_LABEL_SCAN=N")
    from nascompress.pyapi.common import data_config

    assert data_config(WithTargets(images(), labels(), labels())).dataset.startswith("python:")  # no pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_cuda_device_without_cuda_is_one_line(tmp_path):
    m, arch = model_and_arch(tiny_model())
    run = StageResult(model=m, arch=arch).save(tmp_path / "run")
    with pytest.raises(SettingError, match="map_location 'cuda' needs CUDA, .*use map_location 'cpu'"):
        nc.load(run, map_location="cuda")
    with pytest.raises(SettingError, match="map_location 'gpu' is not a device"):
        nc.load(run, map_location="gpu")
    with pytest.raises(SettingError, match="device 'cuda' requested but CUDA is not available"):
        nc.tokens.apply(tiny_model(), "evit", TensorDataset(images(), labels()), keep_rate=0.7, device="cuda")


# ---------------------------------------------------------------------------------------------
# Hugging Face folders


@pytest.fixture()
def hf_vit():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        intermediate_size=32,
        num_labels=3,
    )
    return tf.ViTForImageClassification(cfg).eval()


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_to_transformers_refuses_a_file_and_never_writes_into_a_nascompress_output(tmp_path, hf_vit):
    model = nc.from_transformers(hf_vit)
    (tmp_path / "file").write_text("mine")
    with pytest.raises(SettingError, match="directory .*file is a file, not a folder"):
        nc.to_transformers(model, tmp_path / "file")
    with pytest.raises(SettingError, match="directory .*sub is inside .*file, a file"):
        nc.to_transformers(model, tmp_path / "file" / "sub")
    assert (tmp_path / "file").read_text() == "mine"
    m, arch = model_and_arch(model)
    run = StageResult(model=m, arch=arch).save(tmp_path / "run")
    before = _files(run)
    for force in (False, True):
        with pytest.raises(
            SettingError, match=r"is a nascompress run or output; to_transformers never writes into one"
        ):
            nc.to_transformers(model, run, force=force)
    assert _files(run) == before  # its model.safetensors and config.json untouched


def test_to_transformers_replaces_only_a_folder_it_wrote_and_only_with_force(tmp_path, hf_vit):
    model = nc.from_transformers(hf_vit)
    m, arch = model_and_arch(model)
    out = tmp_path / "hf"
    nc.to_transformers(model, out, arch=arch.to_dict())
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "preprocessor_config.json"]
    with pytest.raises(SettingError, match="already exists and is not empty; pass force=True"):
        nc.to_transformers(model, out)
    nc.to_transformers(model, out, force=True)  # no arch this time: its preprocessor file goes
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temp folder left beside it
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SettingError, match=r"is not a folder to_transformers wrote \(it holds config.json, model"):
        nc.to_transformers(model, out, force=True)
    assert (out / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert nc.to_transformers(model, empty) == empty and (empty / "model.safetensors").is_file()


def test_to_transformers_leaves_no_half_written_folder(tmp_path, hf_vit, monkeypatch):
    import nascompress.pyapi.hf_folder as hf_mod

    model = nc.from_transformers(hf_vit)
    arch = model_and_arch(model)[1].to_dict()

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_mod, "write_json", full_disk)  # after save_pretrained wrote the weights
    with pytest.raises(NascompressError, match="no space is left"):
        nc.to_transformers(model, tmp_path / "new", arch=arch)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    nc.to_transformers(model, tmp_path / "old")
    before = _files(tmp_path / "old")
    monkeypatch.setattr(hf_mod, "write_json", full_disk)
    with pytest.raises(NascompressError, match="no space is left"):
        nc.to_transformers(model, tmp_path / "old", arch=arch, force=True)
    assert _files(tmp_path / "old") == before and sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_from_transformers_refuses_a_nascompress_run_and_other_modules(tmp_path, hf_vit):
    model = nc.from_transformers(hf_vit)
    m, arch = model_and_arch(model)
    run = StageResult(model=m, arch=arch).save(tmp_path / "run")
    with pytest.raises(
        NascompressError,
        match=r"is a nascompress run or output, not a Hugging Face folder: load its model with nascompress.load\('/",
    ):
        nc.from_transformers(run)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NascompressError, match="holds no config.json: it is not a Hugging Face model folder"):
        nc.from_transformers(tmp_path / "empty")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text("{}")
    with pytest.raises(NascompressError, match="is not a Hugging Face ViT or DINOv2 folder transformers can read"):
        nc.from_transformers(tmp_path / "odd")
    with pytest.raises(
        NascompressError, match="ViTForImageClassification, DeiT classifier or Dinov2Model .*got Linear"
    ):
        nc.from_transformers(torch.nn.Linear(2, 2))
    with pytest.raises(NascompressError, match="this VisionTransformer is timm's already"):
        nc.from_transformers(model)
