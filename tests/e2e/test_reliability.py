"""Nothing the user did not name is replaced or deleted: output writers replace regular files only (a symlink is
written through to its target), checkpoints resume only from one that verifies, and rotation never deletes a
checkpoint newer than the one it keeps."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
import torch
from fixtures import OneProcess
from fixtures import model_and_optimizer as _model_and_optimizer

from modeling_tagclip import atomic_io
from modeling_tagclip.engine import checkpoint as ckpt
from modeling_tagclip.engine.state import TrainState


def _null_device(folder: Path) -> Path:
    """A character device with /dev/null's numbers in ``folder`` (skipped where mknod is not permitted)."""
    node = folder / "null"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, AttributeError) as error:
        pytest.skip(f"cannot create a device node here ({error})")
    return node


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# ----------------------------------------------------------------------------- output writers


def test_writers_refuse_a_device_node_and_leave_it_a_device(tmp_path):
    node = _null_device(tmp_path)
    with pytest.raises(atomic_io.NotRegularFileError, match=r"refusing to replace .*null: it is a character"):
        atomic_io.write_json(node, {"a": 1})
    with pytest.raises(OSError, match=r"cannot write --output .*null.*character device.*printed above"):
        atomic_io.write_results(node, {"R@1": 1.0})
    assert stat.S_ISCHR(os.lstat(node).st_mode) and os.lstat(node).st_rdev == os.makedev(1, 3)
    assert _leftovers(tmp_path) == []


def test_writers_refuse_a_fifo_and_a_directory(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(atomic_io.NotRegularFileError, match="it is a FIFO"):
        atomic_io.atomic_write(fifo, b"x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    folder = tmp_path / "results"
    (folder / "inner").mkdir(parents=True)
    with pytest.raises(atomic_io.NotRegularFileError, match="it is a directory"):
        atomic_io.write_json(folder, {"a": 1})
    assert (folder / "inner").is_dir() and _leftovers(tmp_path) == []


def test_symlinks_are_written_through_and_stay_symlinks(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target.name)
    atomic_io.write_json(link, {"a": 1})
    assert link.is_symlink() and json.loads(target.read_text()) == {"a": 1}
    dangling = tmp_path / "new.json"
    dangling.symlink_to("made.json")
    atomic_io.write_json(dangling, [2])
    assert dangling.is_symlink() and json.loads((tmp_path / "made.json").read_text()) == [2]
    node = _null_device(tmp_path)
    via = tmp_path / "stdout-like"
    via.symlink_to(node)
    with pytest.raises(atomic_io.NotRegularFileError, match=r"stdout-like \(a symlink to .*null\)"):
        atomic_io.write_json(via, {"a": 1})
    assert via.is_symlink() and stat.S_ISCHR(os.lstat(node).st_mode)


def test_a_new_file_gets_the_umask_permissions_and_a_missing_folder_is_named(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_io.write_json(tmp_path / "r.json", {})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "r.json").st_mode) == 0o644
    with pytest.raises(FileNotFoundError, match=r"cannot write .*r.json: no folder .*nope"):
        atomic_io.write_json(tmp_path / "nope" / "r.json", {})


def test_one_checksum_helper(tmp_path):
    import hashlib

    from modeling_tagclip.retrieval.embedded import index_store

    path = tmp_path / "blob"
    path.write_bytes(os.urandom(5 << 20))
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    assert atomic_io.sha256_file(path) == index_store.sha256_file(path) == expected
    assert ckpt.sha256_file is atomic_io.sha256_file


@pytest.mark.slow
def test_evaluate_output_refuses_a_device_node(tmp_path, data_dir, model_dir, capsys):
    """`evaluate --output NODE` prints the metrics, then refuses to replace the device (it stays a device)."""
    from modeling_tagclip.evaluation import text_retrieval

    node = _null_device(tmp_path)
    args = ["--model", str(model_dir), "--data", str(data_dir), "--batch_size", "8", "--no_probe"]
    with pytest.raises((SystemExit, OSError)) as info:
        text_retrieval.main([*args, "--output", str(node)])
    assert "character device" in str(info.value) or "character device" in capsys.readouterr().err
    assert stat.S_ISCHR(os.lstat(node).st_mode)


# ----------------------------------------------------------------------------- checkpoints


def _save(tmp_path, steps, keep=3):
    model, opt = _model_and_optimizer()
    for step in steps:
        ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=step), tmp_path, keep=keep)
    return model, opt


def _corrupt(folder: Path) -> None:
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (folder / "model.safetensors").write_bytes(bytes(data))


def test_resume_latest_with_only_corrupt_checkpoints_is_an_error_listing_them(tmp_path):
    _save(tmp_path, (2, 4))
    for step in (2, 4):
        _corrupt(tmp_path / "checkpoints" / f"step_{step}")
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.select_checkpoint(tmp_path, "latest")
    message = str(info.value)
    assert "step_4: model.safetensors does not match its checksum" in message
    assert "step_2: model.safetensors does not match" in message and "to start fresh" in message
    assert ckpt.select_checkpoint(tmp_path / "empty", "latest") is None  # no checkpoint yet: a first start


@pytest.mark.slow
def test_train_resume_with_no_valid_checkpoint_fails_and_keeps_metrics(tmp_path):
    """`train.py --resume_from_checkpoint latest` over corrupt checkpoints: an error, metrics.jsonl untouched."""
    from training.train import main

    _save(tmp_path, (2,))
    _corrupt(tmp_path / "checkpoints" / "step_2")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    with pytest.raises(ckpt.CheckpointError, match="no usable checkpoint.*step_2"):
        main(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])
    assert metrics.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    assert (tmp_path / "checkpoints" / "step_2").is_dir()


def test_rotation_never_deletes_a_checkpoint_newer_than_the_one_it_keeps(tmp_path):
    """Corrupt step_6 and step_8 from an earlier run; resuming from step_4 and saving step_5 keeps step_5."""
    model, opt = _save(tmp_path, (4, 6, 8))
    for step in (6, 8):
        _corrupt(tmp_path / "checkpoints" / f"step_{step}")
    assert ckpt.select_checkpoint(tmp_path, "latest").name == "step_4"
    ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=5), tmp_path, keep=2)
    names = [p.name for p in ckpt.checkpoint_dirs(tmp_path)]
    assert names == ["step_4", "step_5", "step_6", "step_8"]
    assert ckpt.select_checkpoint(tmp_path, "latest").name == "step_5"
    ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=7), tmp_path, keep=2)
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == [
        "step_6",
        "step_7",
        "step_8",
    ]  # 2 at or below 7
    assert ckpt.select_checkpoint(tmp_path, "latest").name == "step_7"


def test_a_state_step_edited_by_hand_is_detected(tmp_path):
    _save(tmp_path, (3,))
    folder = tmp_path / "checkpoints" / "step_3"
    state = json.loads((folder / "trainer_state.json").read_text())
    (folder / "trainer_state.json").write_text(json.dumps({**state, "step": 300}))
    assert ckpt.verify_checkpoint(folder) == "trainer_state.json does not match its checksum"
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["trainer_state.json"] = atomic_io.sha256_file(folder / "trainer_state.json")
    (folder / "manifest.json").write_text(json.dumps(manifest))  # the manifest edited to match
    assert ckpt.verify_checkpoint(folder) == "trainer_state.json says step 300, the folder step 3"
    with pytest.raises(ckpt.CheckpointError, match="says step 300"):
        ckpt.select_checkpoint(tmp_path, str(folder))


def test_a_safetensors_error_during_save_leaves_no_temporary_folder(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    model, opt = _save(tmp_path, (2,))

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    with pytest.raises(ckpt.CheckpointError, match=r"could not write checkpoint .*step_4: .*No space left"):
        ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=4), tmp_path, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]


@pytest.mark.slow
def test_a_full_tmpfs_during_save_is_one_checkpoint_error(tiny_disk):
    """A real full disk: the save fails with CheckpointError, leaves no .tmp_step_N, keeps step_1."""
    disk = tiny_disk(64)
    model = torch.nn.Linear(64, 64)  # 16 KiB of weights + 32 KiB of Adam moments: the second save overflows
    opt = torch.optim.AdamW(model.parameters())
    ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=1), disk, keep=3)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    with pytest.raises(ckpt.CheckpointError, match=r"step_2: .*(No space left|IoError|Errno 28)"):
        ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=2), disk, keep=3)
    assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["step_1"]
    assert ckpt.verify_checkpoint(disk / "checkpoints" / "step_1") is None


# ----------------------------------------------------------------------------- clear errors at the commands


@pytest.fixture(scope="module")
def gallery(tmp_path_factory):
    """A tiny model, its synthetic gallery and an index built with ``tagclip index``."""
    from fixtures import save_tiny_model, synthetic_gallery

    root = tmp_path_factory.mktemp("gallery")
    model = save_tiny_model(root / "model")
    images = synthetic_gallery(root / "data") / "images"
    assert (
        _tagclip(
            "index",
            "--model",
            str(model),
            "--images",
            str(images),
            "--out",
            str(root / "idx"),
            "--quiet",
            "--workers",
            "0",
        )
        == 0
    )
    return {"root": root, "model": model, "images": images, "index": root / "idx"}


def _tagclip(*argv: str) -> int:
    from modeling_tagclip.retrieval.cli import main

    return main(list(argv))


@pytest.fixture
def read_only_dir(tiny_disk):
    """A read-only filesystem (a tmpfs remounted read-only; root may write anywhere else)."""
    import subprocess

    disk = tiny_disk(256)
    (disk / "old.html").write_text("old")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    return disk


def _one_line_error(capsys, command: str, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"tagclip {command}: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(needle in lines[0] for needle in needles), lines[0]
    return lines[0]


@pytest.mark.slow
def test_search_html_and_png_on_a_read_only_disk_are_one_line(gallery, read_only_dir, capsys):
    for flag, name in (("--html", "old.html"), ("--png", "hits.png")):
        status = _tagclip(
            "search", "--index", str(gallery["index"]), "a man", flag, str(read_only_dir / name)
        )
        assert status == 1
        _one_line_error(capsys, "search", f"{read_only_dir / name}: Read-only file system")
    assert sorted(p.name for p in read_only_dir.iterdir()) == ["old.html"]
    assert (read_only_dir / "old.html").read_text() == "old"


@pytest.mark.slow
def test_search_png_on_a_full_disk_keeps_the_old_file_and_no_temporary(gallery, tiny_disk, capsys):
    disk = tiny_disk(16)  # a 16 KiB tmpfs: a contact sheet of 10 hits does not fit
    (disk / "hits.png").write_bytes(b"old")
    assert _tagclip("search", "--index", str(gallery["index"]), "a man", "--png", str(disk / "hits.png")) == 1
    _one_line_error(capsys, "search", f"{disk / 'hits.png'}: No space left on device")
    assert [p.name for p in disk.iterdir()] == ["hits.png"] and (disk / "hits.png").read_bytes() == b"old"


@pytest.mark.slow
def test_search_html_refuses_a_device_node(gallery, tmp_path, capsys):
    node = _null_device(tmp_path)
    assert _tagclip("search", "--index", str(gallery["index"]), "a man", "--html", str(node)) == 1
    _one_line_error(capsys, "search", "refusing to replace", "character device")
    assert stat.S_ISCHR(os.lstat(node).st_mode)


@pytest.mark.slow
def test_a_hit_replaced_by_a_non_image_gets_a_placeholder(gallery, tmp_path, capsys):
    import shutil

    images = tmp_path / "images"
    shutil.copytree(gallery["images"], images)
    for path in images.rglob("*.png"):
        path.write_bytes(b"this is not an image any more")
    out = tmp_path / "hits.html"
    args = ["--index", str(gallery["index"]), "--image-root", str(images), "-k", "3", "a man"]
    assert _tagclip("search", *args, "--html", str(out), "--png", str(tmp_path / "hits.png")) == 0
    err = capsys.readouterr().err
    assert "tagclip search: warning:" in err and "not a readable image" in err and "Traceback" not in err
    assert out.read_text().count("<figure>") == 3 and (tmp_path / "hits.png").stat().st_size > 0


@pytest.mark.slow
def test_index_into_a_read_only_folder_is_one_line_naming_it(gallery, read_only_dir, capsys):
    out = read_only_dir / "idx"
    status = _tagclip(
        "index",
        "--model",
        str(gallery["model"]),
        "--images",
        str(gallery["images"]),
        "--out",
        str(out),
        "--quiet",
        "--workers",
        "0",
    )
    assert status == 1
    _one_line_error(capsys, "index", str(read_only_dir), "Read-only file system")


@pytest.mark.slow
def test_index_onto_a_full_disk_is_one_line_and_leaves_no_temporary_file(gallery, tiny_disk, capsys):
    disk = tiny_disk(48)
    status = _tagclip(
        "index",
        "--model",
        str(gallery["model"]),
        "--images",
        str(gallery["images"]),
        "--out",
        str(disk / "idx"),
        "--quiet",
        "--workers",
        "0",
    )
    assert status in (1, 2)
    line = _one_line_error(capsys, "index", str(disk / "idx"))
    assert re.search("full|No space left", line), line
    assert [p for p in disk.rglob("*") if p.name.endswith(".tmp")] == []


def _front_door(*argv: str) -> int:
    from modeling_tagclip.cli import main

    return main(list(argv))


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from fixtures import tiny_clip_config
    from transformers import CLIPModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("clip")
    CLIPModel(tiny_clip_config()).save_pretrained(path)
    return path


@pytest.mark.slow
def test_convert_onto_a_read_only_or_full_disk_is_one_line(clip_dir, read_only_dir, tiny_disk, capsys):
    assert _front_door("convert", "hf-clip", str(clip_dir), str(read_only_dir / "out")) == 1
    _one_line_error(capsys, "convert", str(read_only_dir), "Read-only file system")
    full = tiny_disk(32)
    assert _front_door("convert", "hf-clip", str(clip_dir), str(full / "out")) == 1
    line = _one_line_error(capsys, "convert")
    assert "no space left" in line.lower() and str(full / "out") in line, line
    assert list(full.iterdir()) == []  # nothing partial left behind


@pytest.mark.slow
def test_train_into_a_read_only_output_dir_is_one_line(read_only_dir, capsys):
    from modeling_tagclip.engine.cli import command

    assert command(["--output_dir", str(read_only_dir / "run")], prog="tagclip train") == 1
    err = capsys.readouterr().err
    assert (
        err.count("tagclip train: error:") == 1 and "Read-only file system" in err and "Traceback" not in err
    )


# ----------------------------------------------------------------------------- unclear messages made clear


def test_config_that_is_a_device_says_so():
    from modeling_tagclip.engine.config import parse_args

    with pytest.raises((FileNotFoundError, SystemExit, ValueError), match="/dev/null is not a regular file"):
        parse_args(["--config", "/dev/null"])


def test_metadata_csv_with_a_utf8_bom_is_read(tmp_path):
    from modeling_tagclip.retrieval.embedded.index_build import read_sidecar

    path = tmp_path / "crops.csv"
    path.write_bytes("path,camera\r\na/1.png,3\r\n".encode("utf-8-sig"))
    assert read_sidecar(path) == {"a/1.png": {"path": "a/1.png", "camera": "3"}}
    path = tmp_path / "crops.json"
    path.write_bytes('[{"path": "b.png", "view": "aerial"}]'.encode("utf-8-sig"))
    assert read_sidecar(path) == {"b.png": {"path": "b.png", "view": "aerial"}}


def test_a_symlink_in_the_data_folder_pointing_outside_is_refused_like_dotdot(tmp_path):
    from fixtures import make_tagpedes, tag_entry

    from modeling_tagclip.data.text_retrieval import load_tagpedes

    secret = tmp_path / "secret.png"
    secret.write_bytes(b"x")
    root = make_tagpedes(tmp_path / "data", [tag_entry(1, "a"), tag_entry(2, "b")], [])
    (root / "images" / "link.png").symlink_to(secret)
    (root / "images" / "inner.png").symlink_to(root / "images" / "link.png")  # a chain that ends outside too
    atomic_io.write_json(
        root / "anno_dir" / "train_reid.json", [{**tag_entry(1, "a"), "file_path": "inner.png"}]
    )
    with pytest.raises(ValueError, match="points outside the image folder"):
        load_tagpedes(root / "anno_dir", root / "images", "train", check_files=False)
    rows = load_tagpedes(
        root / "anno_dir", root / "images", "train", check_files=False, allow_outside_root=True
    )
    assert rows["image_path"] == [str(root / "images" / "inner.png")]
    (root / "images" / "inner.png").unlink()
    (root / "images" / "inner.png").symlink_to("a.png")  # a symlink that stays inside is fine
    rows = load_tagpedes(root / "anno_dir", root / "images", "train", check_files=False)
    assert rows["image_path"] == [str(root / "images" / "inner.png")]


def test_an_image_under_two_ids_is_refused_and_a_repeated_entry_warned(tmp_path, caplog):
    from fixtures import make_tagpedes, tag_entry

    from modeling_tagclip.data.text_retrieval import load_tagpedes

    root = make_tagpedes(tmp_path / "data", [tag_entry(1, "a"), tag_entry(2, "b")], [])
    first, other = tag_entry(1, "a"), {**tag_entry(2, "b"), "file_path": tag_entry(1, "a")["file_path"]}
    atomic_io.write_json(root / "anno_dir" / "train_reid.json", [first, other])
    with pytest.raises(ValueError, match=r"train_reid.json \[train\]: image .* two person ids \(1 and 2\)"):
        load_tagpedes(root / "anno_dir", root / "images", "train", check_files=False)
    atomic_io.write_json(root / "anno_dir" / "train_reid.json", [first, first, tag_entry(2, "b")])
    with caplog.at_level("WARNING"):
        rows = load_tagpedes(root / "anno_dir", root / "images", "train", check_files=False)
    assert len(rows) == 3 and "1 entries repeat an earlier entry's image and id" in caplog.text


def _temporary_files(folder: Path) -> list[str]:
    """Every file or folder under ``folder`` named like a temporary (``*.tmp*``, ``tmp*``, ``.tmp*``)."""
    return sorted(str(p) for p in folder.rglob("*") if ".tmp" in p.name or p.name.startswith("tmp"))


def _fill(ballast: Path) -> None:
    """Fill the disk that holds ``ballast`` to its last byte."""
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 1024):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


@pytest.mark.slow
def test_add_onto_a_full_disk_is_one_line_and_keeps_the_index(gallery, tiny_disk, capsys):
    import shutil

    disk = tiny_disk(256)
    images, later = disk.parent / "images", disk.parent / "later"
    shutil.copytree(gallery["images"], images)
    later.mkdir()
    for path in sorted(images.rglob("*.png"))[::2]:  # half of the images are added later
        shutil.move(path, later / path.name)
    index = disk / "idx"
    assert (
        _tagclip(
            "index",
            "--model",
            str(gallery["model"]),
            "--images",
            str(images),
            "--out",
            str(index),
            "--quiet",
            "--workers",
            "0",
        )
        == 0
    )
    query = ("search", "--index", str(index), "a man", "--json", "-k", "100")
    capsys.readouterr()
    assert _tagclip(*query) == 0
    hits = capsys.readouterr().out
    assert len(json.loads(hits)[0]["hits"]) == 10
    for path in later.iterdir():
        shutil.move(path, images / path.name)
    _fill(disk / "ballast")
    status = _tagclip(
        "index",
        "--add",
        "--model",
        str(gallery["model"]),
        "--images",
        str(images),
        "--out",
        str(index),
        "--quiet",
        "--workers",
        "0",
    )
    assert status == 1
    line = _one_line_error(capsys, "index", str(index))
    assert re.search("full|No space left", line), line
    assert _temporary_files(index) == []
    (disk / "ballast").unlink()
    assert _tagclip(*query) == 0
    assert capsys.readouterr().out == hits


@pytest.mark.slow
def test_an_invalid_utf8_file_name_is_skipped_with_a_warning_naming_it(gallery, tmp_path, capsys):
    import shutil

    images = tmp_path / "images"
    shutil.copytree(gallery["images"], images)
    first = sorted(images.rglob("*.png"))[0]
    with open(os.path.join(os.fsencode(str(images)), b"bad\xff.png"), "wb") as f:
        f.write(first.read_bytes())
    out = tmp_path / "idx"
    assert (
        _tagclip(
            "index",
            "--model",
            str(gallery["model"]),
            "--images",
            str(images),
            "--out",
            str(out),
            "--quiet",
            "--workers",
            "0",
        )
        == 0
    )
    err = capsys.readouterr().err
    assert repr("bad\udcff.png") in err and "skipped" in err, err
    assert "Traceback" not in err
    assert _tagclip("search", "--index", str(out), "a man", "--json", "-k", "100") == 0
    hits = json.loads(capsys.readouterr().out)[0]["hits"]
    assert len(hits) == 20 and not any("bad" in str(hit) for hit in hits), hits
    assert (
        _tagclip("search", "--index", str(out), "a man", "-k", "3", "--html", str(tmp_path / "hits.html"))
        == 0
    )
    assert (tmp_path / "hits.html").read_text().count("<figure>") == 3


@pytest.fixture
def dtg_images(tmp_path, monkeypatch):
    """Twelve synthetic person crops for ``tagclip dtg``, captioned by a fake VLM (no model download)."""
    from modeling_tagclip.data.synthetic import generate_dataset
    from modeling_tagclip.dtg import cli as dtg_cli

    generate_dataset(tmp_path / "synth", num_identities=4, seed=0, image_size=(64, 32), progress=False)
    fake = lambda images, prompts: [f"a person in a red coat, prompt {len(p)}." for p in prompts]  # noqa: E731
    monkeypatch.setattr(dtg_cli, "_generator", lambda args: fake)
    return tmp_path / "synth" / "images"


def _dtg(images: Path, out: Path, *extra: str) -> int:
    return _front_door(
        "dtg", "--images", str(images), "--model", "unused", "--out", str(out), "--no-progress", *extra
    )


def test_dtg_writes_with_the_fake_vlm(dtg_images, tmp_path):
    assert _dtg(dtg_images, tmp_path / "out.json") == 0
    entries = json.loads((tmp_path / "out.json").read_text())
    assert len(entries) == 12 and all(e["captions"] for e in entries)


@pytest.mark.slow
def test_dtg_onto_a_read_only_or_full_disk_is_one_line(dtg_images, read_only_dir, tiny_disk, capsys):
    assert _dtg(dtg_images, read_only_dir / "out.json") == 1
    _one_line_error(capsys, "dtg", str(read_only_dir / "out.json"), "Read-only file system")
    assert sorted(p.name for p in read_only_dir.iterdir()) == ["old.html"]
    disk = tiny_disk(64)
    _fill(disk / "ballast")
    assert _dtg(dtg_images, disk / "out.json") == 1
    _one_line_error(capsys, "dtg", str(disk / "out.json"), "No space left on device")
    assert _temporary_files(disk) == [] and not (disk / "out.json").exists()


def test_dtg_bad_json_names_the_file(dtg_images, tmp_path, capsys):
    for name, data in (
        ("attrs.json", b'{"0001_0.png": ["red coat"],}'),
        ("latin1.json", b'{"a": "caf\xe9"}'),
    ):
        (tmp_path / name).write_bytes(data)
        assert _dtg(dtg_images, tmp_path / "out.json", "--attributes", str(tmp_path / name)) == 1
        _one_line_error(
            capsys, "dtg", str(tmp_path / name), "not valid JSON" if name == "attrs.json" else "UTF-8"
        )
    (tmp_path / "templates.json").write_text('["a {attributes}"')
    assert _dtg(dtg_images, tmp_path / "out.json", "--templates", str(tmp_path / "templates.json")) == 1
    _one_line_error(capsys, "dtg", str(tmp_path / "templates.json"), "not valid JSON", "line 1")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_a_processor_saved_at_another_size_warns_at_load_and_the_error_names_both_sizes(
    gallery, tmp_path, capsys
):
    import shutil

    from modeling_tagclip import TagClipProcessor
    from modeling_tagclip.models.tagclip.processing_tagclip import ProcessorSizeWarning
    from modeling_tagclip.retrieval.loading import load_model

    folder = tmp_path / "model"
    shutil.copytree(gallery["model"], folder)
    TagClipProcessor.from_defaults(224, 224).save_pretrained(folder)  # the model is 32x16
    with pytest.warns(ProcessorSizeWarning) as caught:
        load_model(folder)
    messages = [str(w.message) for w in caught if w.category is ProcessorSizeWarning]
    assert len(messages) == 1, messages
    assert all(s in messages[0] for s in (str(folder), "224x224", "32x16", "from_defaults(32, 16)")), (
        messages[0]
    )
    capsys.readouterr()
    argv = ("search", "--index", str(gallery["index"]), "--model", str(folder), "a man", "--json")
    assert _tagclip(*argv) == 0  # text search with the folder still works, with one warning line
    out, err = capsys.readouterr()
    assert len(json.loads(out)[0]["hits"]) == 10
    warned = [line for line in err.splitlines() if "224x224" in line]
    assert len(warned) == 1 and warned[0].startswith("tagclip search: warning:") and "32x16" in warned[0], err
    status = _tagclip(
        "index",
        "--model",
        str(folder),
        "--images",
        str(gallery["images"]),
        "--out",
        str(tmp_path / "idx"),
        "--quiet",
        "--workers",
        "0",
    )
    assert status == 2
    _one_line_error(capsys, "index", "224x224", "32x16", "from_defaults(32, 16)")


def test_a_processor_of_the_models_size_does_not_warn(tmp_path, recwarn):
    from fixtures import save_tiny_model

    from modeling_tagclip.models.tagclip.processing_tagclip import ProcessorSizeWarning
    from modeling_tagclip.retrieval.loading import load_model

    load_model(save_tiny_model(tmp_path / "model"))
    assert not [w for w in recwarn if w.category is ProcessorSizeWarning]


@pytest.mark.slow
def test_the_retrieval_pipeline_built_from_a_folder_warns_about_the_processor_size(tmp_path):
    """`transformers.pipeline(..., trust_remote_code=True)` (the folder's own code) and the pipeline class
    built from the loaded parts warn as `load_model` does, and text search still answers."""
    import warnings

    from fixtures import save_tiny_model
    from transformers import AutoModel, pipeline

    from modeling_tagclip import TagClipProcessor
    from modeling_tagclip.retrieval.pipeline_tagclip import TASK, TagClipRetrievalPipeline

    folder = save_tiny_model(tmp_path / "model")
    TagClipProcessor.from_defaults(224, 224).save_pretrained(folder)  # the model is 32x16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        retrieve = pipeline(TASK, model=str(folder), trust_remote_code=True)
        direct = TagClipRetrievalPipeline(
            model=AutoModel.from_pretrained(folder).eval(), processor=TagClipProcessor.from_pretrained(folder)
        )
    messages = [str(w.message) for w in caught if w.category.__name__ == "ProcessorSizeWarning"]
    assert len(messages) == 2, [str(w.message) for w in caught]
    assert all("224x224" in m and "32x16" in m and "from_defaults(32, 16)" in m for m in messages), messages
    gallery = [__import__("PIL.Image").Image.new("RGB", (16, 32), (200, 10, 10))]
    with pytest.raises(ValueError, match="224x224.*32x16"):
        retrieve("a man in red", gallery=gallery, top_k=1)  # encoding an image names both sizes
    assert direct.encode_text("a man in red")["global"].shape[0] == 1  # text still encodes
