"""Faults on the serving write path: a full disk while saving a model folder (``save_with_pipeline``, used by
training's ``best/``, the converters and the Hub push) leaves nothing partial behind, leaves an existing folder
intact and loadable, and says that the disk is full.

The disk is a real tmpfs of a few MB where this process may mount one (root); otherwise, and in addition, the
weights writer is made to fail with ENOSPC halfway through its file.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch
from fixtures import tiny_model

from modeling_tagclip import TagClipModel
from modeling_tagclip.retrieval.pipeline_tagclip import save_with_pipeline


@pytest.fixture
def half_written_weights(monkeypatch):
    """The safetensors writer writes half of its file, then fails as a full disk does."""
    import transformers.modeling_utils as modeling_utils

    real = modeling_utils.safe_save_file

    def failing(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as handle:
            handle.truncate(Path(filename).stat().st_size // 2)
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(modeling_utils, "safe_save_file", failing)


def _assert_disk_full_error(info, target: Path) -> None:
    assert info.value.errno == errno.ENOSPC
    assert "no space left on the device while saving to" in str(info.value) and str(target) in str(info.value)


@pytest.mark.slow
def test_full_tmpfs_leaves_no_partial_folder(tiny_disk):
    disk = tiny_disk(4096)  # config, code and tokenizer fit; the 6.7 MB weights do not
    model, processor = tiny_model()
    with pytest.raises(OSError) as info:
        save_with_pipeline(model, processor, disk / "best")
    _assert_disk_full_error(info, disk / "best")
    assert list(disk.iterdir()) == [] or [p.name for p in disk.iterdir()] == ["best"]
    assert not (disk / "best").exists() or list((disk / "best").iterdir()) == []
    assert shutil.disk_usage(disk).used < 64 * 1024  # the staging copy was removed


@pytest.mark.slow
def test_full_tmpfs_keeps_the_previous_save_loadable(tiny_disk):
    disk = tiny_disk(16384)  # one save (about 10.5 MB) fits, a second one beside it does not
    model, processor = tiny_model(seed=0)
    save_with_pipeline(model, processor, disk / "best")
    before = {p.name: p.read_bytes() for p in (disk / "best").iterdir()}
    other, _ = tiny_model(seed=1)
    with pytest.raises(OSError) as info:
        save_with_pipeline(other, processor, disk / "best")
    _assert_disk_full_error(info, disk / "best")
    assert {p.name: p.read_bytes() for p in (disk / "best").iterdir()} == before
    assert [p.name for p in disk.iterdir()] == ["best"]
    reloaded = TagClipModel.from_pretrained(disk / "best")
    torch.testing.assert_close(reloaded.text_projection.weight, model.text_projection.weight)


def test_enospc_mid_weights_leaves_target_untouched(tmp_path, half_written_weights):
    model, processor = tiny_model()
    target = tmp_path / "best"
    target.mkdir()
    (target / "notes.txt").write_text("kept")
    with pytest.raises(OSError) as info:
        save_with_pipeline(model, processor, target)
    _assert_disk_full_error(info, target)
    assert [p.name for p in target.iterdir()] == ["notes.txt"]  # no config.json beside half a weights file
    assert [p.name for p in tmp_path.iterdir()] == ["best"]  # no staging folder left


def test_save_replaces_files_and_keeps_others(tmp_path):
    model, processor = tiny_model(seed=0)
    target = tmp_path / "best"
    save_with_pipeline(model, processor, target)
    (target / "eval_results.json").write_text("{}")
    (target / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    other, _ = tiny_model(seed=1)
    save_with_pipeline(other, processor, target)
    assert (target / "eval_results.json").read_text() == "{}"
    assert not (target / "model-00001-of-00002.safetensors").exists()
    reloaded = TagClipModel.from_pretrained(target)
    torch.testing.assert_close(reloaded.text_projection.weight, other.text_projection.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
