"""Round three of hostile input, each case through the entry point a user calls: unknown config keys warn once on
stderr; a forged checkpoint step, a wrongly typed ``--set``, a TAG-CLIP folder given to ``convert hf-clip``, a
garbage faiss file with a matching checksum, a truncated image and an empty batch are one clear error each, and
the documented ``accelerate launch`` training command ends in the project's error line alone."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from fixtures import (
    REPO_ROOT,
    OneProcess,
    make_visa_model,
    model_and_gallery,
    one_error_line,
    repo_env,
    tiny_text,
)
from fixtures import model_and_optimizer as _model_and_optimizer
from fixtures import optimizer_steps as _steps
from PIL import Image

from modeling_tagclip import TagClipModel, TagClipProcessor
from modeling_tagclip.cli import MAIN_JOB
from modeling_tagclip.cli import main as tagclip
from modeling_tagclip.engine import checkpoint as ckpt
from modeling_tagclip.engine.state import TrainState

TYPO = "unknown config key"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A saved tiny TAG-CLIP, a copy whose config.json has misspelt keys, and a small image folder."""
    found = model_and_gallery(tmp_path_factory.mktemp("round3"))
    typo = found["root"] / "typo"
    shutil.copytree(found["model"], typo)
    config = json.loads((typo / "config.json").read_text())
    config["rouitng"] = "label"
    config["vision_config"]["hiden_size"] = 32
    (typo / "config.json").write_text(json.dumps(config))
    return {**found, "typo": typo, "images": found["images"] / "test"}


# ----------------------------------------------------------------------------- silent: unknown config keys


def test_misspelt_config_keys_warn_once_per_load_through_load_model_and_the_handler(folders):
    from handler import EndpointHandler
    from modeling_tagclip.retrieval.loading import load_model

    for load in (lambda: load_model(folders["typo"]), lambda: EndpointHandler(str(folders["typo"]))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # no deduplication by the warnings module: count every warning
            load()
        typos = [str(w.message) for w in caught if TYPO in str(w.message)]
        assert len(typos) == 1, typos  # the model load reports it; the processor load does not repeat it
        assert "'rouitng' (did you mean 'vision_config.routing'?)" in typos[0]
        assert "'vision_config.hiden_size' (did you mean 'hidden_size'?)" in typos[0]


@pytest.mark.slow
def test_misspelt_config_keys_are_one_stderr_warning_of_tagclip_eval(folders, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "modeling_tagclip.cli",
            "eval",
            "--model",
            str(folders["typo"]),
            "--data",
            str(folders["data"]),
        ],
        cwd=tmp_path,
        env=repo_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count(TYPO + " 'rouitng'") == 1, result.stderr  # users see it, once


# ----------------------------------------------------------------------------- silent: a forged checkpoint step


def test_a_forged_step_with_a_renamed_folder_and_a_rewritten_checksum_is_refused(tmp_path):
    model, opt = _model_and_optimizer("adamw")
    _steps(model, opt, 3)
    folder = ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=3), tmp_path, keep=2)
    assert ckpt.verify_checkpoint(folder) is None
    state = json.loads((folder / "trainer_state.json").read_text())
    (folder / "trainer_state.json").write_text(json.dumps({**state, "step": 300}))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["trainer_state.json"] = hashlib.sha256((folder / "trainer_state.json").read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    forged = folder.rename(folder.with_name("step_300"))  # folder name, state and manifest all agree
    problem = "trainer_state.json says step 300, the optimizer state optimizer.safetensors has taken 3 steps"
    assert ckpt.verify_checkpoint(forged) == problem
    with pytest.raises(ckpt.CheckpointError, match=problem):
        ckpt.select_checkpoint(tmp_path, str(forged))  # --resume_from_checkpoint PATH
    with pytest.raises(ckpt.CheckpointError, match=f"no usable checkpoint.*{problem}"):
        ckpt.select_checkpoint(tmp_path, "latest")


def test_a_lower_step_is_refused_unless_a_grad_scaler_may_have_skipped_steps(tmp_path):
    model, opt = _model_and_optimizer("adamw")
    _steps(model, opt, 4)
    low = ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=5), tmp_path, keep=3)
    assert ckpt.verify_checkpoint(low) == (
        "trainer_state.json says step 5, the optimizer state optimizer.safetensors has taken 4 steps"
    )
    scaled = TrainState(
        step=6, scaler={"scale": 1024.0, "growth_tracker": 0}
    )  # fp16: an overflow skips a step
    assert (
        ckpt.verify_checkpoint(ckpt.save_checkpoint(OneProcess(), model, opt, scaled, tmp_path, keep=3))
        is None
    )


# ----------------------------------------------------------------------------- raw tracebacks, now one line


def test_train_set_a_value_of_the_wrong_type_is_one_line(capsys):
    assert tagclip(["train", "--set", "model.vision_config.hidden_size=abc"]) == 2
    err = one_error_line(capsys, "train")
    assert "model.vision_config.hidden_size: Field 'hidden_size' expected int, got str (value: 'abc')" in err
    assert tagclip(["train", "--task", "reid", "--set", "model.num_experts=1.5"]) == 2
    assert "model.num_experts: Field 'num_experts' expected int, got float" in one_error_line(capsys, "train")


def test_convert_hf_clip_given_a_tagclip_folder_is_one_line(folders, capsys):
    out = folders["root"] / "converted"
    assert tagclip(["convert", "hf-clip", str(folders["model"]), str(out)]) == 1
    err = one_error_line(capsys, "convert")
    assert "holds a 'tagclip' model, not a transformers CLIPModel (model_type 'clip')" in err
    assert not out.exists()


def test_a_garbage_faiss_file_with_a_rewritten_checksum_is_one_line(folders, capsys, monkeypatch):
    from modeling_tagclip.retrieval.embedded import ann

    pytest.importorskip("faiss")
    monkeypatch.setattr(ann, "ANN_MIN_SIZE", 4)  # an ANN index for the 8-image gallery
    index = folders["root"] / "ann-index"
    argv = [
        "index",
        "--model",
        str(folders["model"]),
        "--images",
        str(folders["images"]),
        "--out",
        str(index),
    ]
    assert tagclip([*argv, "--ann", "HNSW8", "--quiet"]) == 0
    capsys.readouterr()
    manifest = json.loads((index / "manifest.json").read_text())
    faiss_file = index / manifest["segments"][0]["ann_file"]
    faiss_file.write_bytes(b"garbage" * 64)
    manifest["segments"][0]["ann_sha256"] = hashlib.sha256(faiss_file.read_bytes()).hexdigest()
    (index / "manifest.json").write_text(json.dumps(manifest))
    assert tagclip(["search", "--index", str(index), "a man in a red jacket"]) == 2
    err = one_error_line(capsys, "search")
    assert f"gallery index file {faiss_file} is not a faiss index (Index type" in err


def _truncated_png(path: Path | None = None) -> bytes:
    buffer = io.BytesIO()
    Image.effect_noise((64, 128), 60).convert("RGB").save(buffer, "PNG")
    data = buffer.getvalue()[: len(buffer.getvalue()) // 2]
    if path is not None:
        path.write_bytes(data)
    return data


def test_the_processor_given_a_truncated_image_says_so(folders, tmp_path):
    processor = TagClipProcessor.from_pretrained(folders["model"])
    opened = Image.open(io.BytesIO(_truncated_png()))  # PIL opens lazily: the header reads fine
    with pytest.raises(
        ValueError, match=r"cannot decode image \(PngImageFile\): image file is truncated .*corrupt"
    ):
        processor(images=opened)
    _truncated_png(tmp_path / "cut.png")
    with pytest.raises(ValueError, match=r"cannot decode image '.*cut.png': image file is truncated"):
        processor(images=str(tmp_path / "cut.png"))


def test_a_model_call_with_an_empty_batch_says_so(folders):
    model = TagClipModel.from_pretrained(folders["model"]).eval()
    no_images, no_texts = torch.zeros(0, 3, 32, 16), tiny_text(batch=0)
    with torch.no_grad():
        with pytest.raises(
            ValueError, match=r"pixel_values is an empty batch \(shape \(0, 3, 32, 16\)\): give at"
        ):
            model.get_image_features(pixel_values=no_images)
        with pytest.raises(ValueError, match=r"input_ids is an empty batch .*give at least one text"):
            model.get_text_features(input_ids=no_texts)
        with pytest.raises(ValueError, match="is an empty batch"):
            model(pixel_values=no_images, input_ids=no_texts)
        visa = make_visa_model().eval()
        with pytest.raises(ValueError, match=r"pixel_values is an empty batch"):
            visa(pixel_values=torch.zeros(0, 3, *visa.config.image_size))


@pytest.mark.slow
def test_the_documented_accelerate_command_ends_in_the_projects_line_alone(tmp_path):
    command = [
        *MAIN_JOB.split(),
        "--set",
        "model.vision_config.hidden_size=abc",
        "--output_dir",
        str(tmp_path),
    ]
    accelerate = Path(sys.executable).with_name("accelerate")
    result = subprocess.run(
        [str(accelerate), *command[1:]],
        cwd=REPO_ROOT,
        env=repo_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("train.py: error: ") and "expected int" in lines[-1], result.stderr
    assert "Traceback" not in result.stderr and "CalledProcessError" not in result.stderr, result.stderr
    assert not any(tmp_path.iterdir()) or list(tmp_path.iterdir()) == [tmp_path / "hf"]  # nothing written


# ----------------------------------------------------------------------------- unclear messages, now clear


def test_a_missing_local_folder_is_named_as_missing_by_the_handler_and_train_init_from(capsys, tmp_path):
    from handler import EndpointHandler

    for missing in (str(tmp_path / "no" / "such"), "./no-such-folder"):
        with pytest.raises(FileNotFoundError, match=f"^no such folder: {re.escape(missing)}$"):
            EndpointHandler(missing)
        assert tagclip(["train", "--init_from", missing, "--output_dir", str(tmp_path / "out")]) == 2
        assert (
            one_error_line(capsys, "train") == f"tagclip train: error: init_from: no such folder: {missing}"
        )
    assert not (tmp_path / "out").exists()


def test_a_visa_folder_given_to_the_handler_says_what_it_is(tmp_path):
    from handler import EndpointHandler

    make_visa_model().save_pretrained(tmp_path / "visa")
    with pytest.raises(
        ValueError, match=r"holds a ViSA re-identification model \('visa'\): the endpoint handler"
    ):
        EndpointHandler(str(tmp_path / "visa"))


def test_a_million_unknown_parameters_is_a_short_400(folders):
    from handler import EndpointHandler, RequestError

    handler = EndpointHandler(str(folders["model"]))
    request = {"inputs": "a man", "parameters": {f"k{i}": 1 for i in range(1_000_000)}}
    with pytest.raises(RequestError) as caught:
        handler(request)
    message = str(caught.value)
    assert message == (
        "unknown parameters ['k0', 'k1', 'k10', 'k100', 'k1000'] and 999995 more; allowed: ['top_k', 'filters', "
        "'text_weight', 'set_rule']"
    )
    with pytest.raises(
        RequestError, match=r"unknown keys \['a', 'b', 'c', 'd', 'e'\] and 3 more$"
    ):  # 'inputs'
        handler({"inputs": dict.fromkeys("abcdefgh", 1)})


def _clip_folder(path: Path) -> Path:
    from fixtures import tiny_clip_config
    from transformers import CLIPModel

    CLIPModel(tiny_clip_config()).save_pretrained(path)
    return path


def test_a_fifo_or_a_device_as_convert_or_index_output_folder_is_named(folders, tmp_path, capsys):
    clip = _clip_folder(tmp_path / "clip")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    outputs = [(fifo, "a FIFO (named pipe)")]
    try:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        outputs.append((tmp_path / "null", "a character device"))
    except PermissionError:
        pass  # a device node needs root; the FIFO takes the same path through the check
    index = ["index", "--model", str(folders["model"]), "--images", str(folders["images"]), "--quiet"]
    for out, kind in outputs:
        for verb, argv in (
            ("convert", ["convert", "hf-clip", str(clip), str(out)]),
            ("index", [*index, "--out", str(out)]),
        ):
            assert tagclip(argv) == 1
            assert one_error_line(capsys, verb) == (
                f"tagclip {verb}: error: {out} is {kind}, not a folder: name a new or an existing folder"
            )
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["clip", "pipe", *(["null"] if len(outputs) == 2 else [])]
    )  # nothing created beside them


def test_an_empty_annotation_list_and_a_link_to_a_device_are_named(folders, tmp_path, capsys):
    empty = shutil.copytree(folders["data"], tmp_path / "empty")
    (empty / "test_reid.json").write_text("[]")
    linked = shutil.copytree(folders["data"], tmp_path / "linked")
    (linked / "test_reid.json").unlink()
    (linked / "test_reid.json").symlink_to("/dev/urandom")
    for data, expected in (
        (
            empty,
            f"{empty / 'test_reid.json'}: no entries to load (an empty list, or every entry skipped as bad)",
        ),
        (
            linked,
            f"{linked / 'test_reid.json'} (a symlink to /dev/urandom) is a character device, not an annotation file",
        ),
    ):
        assert tagclip(["eval", "--model", str(folders["model"]), "--data", str(data)]) == 1
        assert one_error_line(capsys, "eval") == f"tagclip eval: error: {expected}"


@pytest.mark.slow
def test_train_reid_json_linked_to_a_device_is_named_not_missing(folders, tmp_path, capsys):
    data = shutil.copytree(folders["data"], tmp_path / "data")
    (data / "train_reid.json").unlink()
    (data / "train_reid.json").symlink_to("/dev/urandom")
    argv = [
        "train",
        "--data_dir",
        str(data),
        "--set",
        "synthetic=null",
        "--output_dir",
        str(tmp_path / "out"),
    ]
    assert tagclip(argv) == 1
    err = one_error_line(capsys, "train")
    assert err.endswith(
        "train_reid.json (a symlink to /dev/urandom) is a character device, not an annotation file"
    )


def test_dtg_given_a_tagclip_folder_names_its_model_type(folders, tmp_path, capsys):
    out = tmp_path / "captions.jsonl"
    argv = ["dtg", "--images", str(folders["images"]), "--model", str(folders["model"]), "--out", str(out)]
    assert tagclip(argv) == 1
    err = one_error_line(capsys, "dtg")
    assert (
        "holds a 'tagclip' model, not an image-text-to-text model: dtg needs a local vision-language" in err
    )
    assert len(err) < 300 and not out.exists() and not list(tmp_path.iterdir())
