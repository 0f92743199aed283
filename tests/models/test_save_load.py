"""Save / load: fresh-process Hub custom-code loading, Auto classes, pipelines, bad checkpoints."""

import json

import pytest
import torch
from fixtures import FRESH_REMOTE_MODEL, clean_env, run_python, tiny_config
from PIL import Image
from safetensors.torch import load_file, save_file

from modeling_tagclip import TagClipModel, TagClipProcessor

FRESH_LOAD = (
    FRESH_REMOTE_MODEL
    + """
import json, torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoProcessor, pipeline
processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
inputs = load_file(folder + "/inputs.safetensors")
images = [Image.open(f"{folder}/image{i}.png") for i in range(2)]
fresh = processor(text=["a man in a red jacket", "a woman with a black backpack"], images=images)
with torch.no_grad():
    logits = model(**inputs).logits_per_text
zero_shot = pipeline("zero-shot-image-classification", model=folder, trust_remote_code=True)
scores = zero_shot(images[0], candidate_labels=["red jacket", "black backpack"])
print(json.dumps({
    "model_module": type(model).__module__,
    "processor_module": type(processor).__module__,
    "logits": logits.tolist(),
    "input_ids_equal": bool(torch.equal(fresh["input_ids"], inputs["input_ids"])),
    "pixels_equal": bool(torch.equal(fresh["pixel_values"], inputs["pixel_values"])),
    "zero_shot_labels": sorted(s["label"] for s in scores),
}))
"""
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tagclip")
    torch.manual_seed(0)
    model = TagClipModel(
        tiny_config(
            text=dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=49406, eos_token_id=49407)
        )
    ).eval()
    processor = TagClipProcessor.from_defaults(32, 16)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    images = [Image.new("RGB", (24, 50), (200, 30, 30)), Image.new("RGB", (24, 50), (20, 20, 20))]
    inputs = processor(text=["a man in a red jacket", "a woman with a black backpack"], images=images)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the fresh process (clean_env): a GEMM's rounding may depend on the threads
    try:
        with torch.no_grad():
            logits = model(**inputs).logits_per_text
    finally:
        torch.set_num_threads(threads)
    for index, image in enumerate(images):
        image.save(folder / f"image{index}.png")
    save_file({k: inputs[k] for k in ("input_ids", "pixel_values")}, folder / "inputs.safetensors")
    return folder, logits


def test_saved_folder_is_self_contained(saved):
    folder, _ = saved
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_tagclip.py", "configuration_tagclip.py"} <= names
    assert {"losses_tagclip.py", "processing_tagclip.py", "processor_config.json", "tokenizer.json"} <= names
    siblings = {
        "attention.py",
        "device_ops.py",
        "load_policy.py",
        "precision_tagclip.py",
        "serving_common.py",
    }
    siblings |= {"tse_tagclip.py"}
    assert siblings | {"views.py"} <= names
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"] == "modeling_tagclip.TagClipModel"
    assert auto_map["AutoModelForZeroShotImageClassification"] == "modeling_tagclip.TagClipModel"


@pytest.mark.slow
def test_fresh_process_trust_remote_code_without_package(saved, tmp_path):
    folder, logits = saved
    result = run_python(FRESH_LOAD, [str(folder)], tmp_path, clean_env(tmp_path))
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["model_module"].startswith("transformers_modules.")
    assert report["processor_module"].startswith("transformers_modules.")
    torch.testing.assert_close(torch.tensor(report["logits"]), logits, rtol=0, atol=0)
    assert report["input_ids_equal"] and report["pixels_equal"]
    assert report["zero_shot_labels"] == ["black backpack", "red jacket"]


@pytest.fixture(scope="module")
def saved_before_the_move(saved, tmp_path_factory):
    """The tiny folder as the package wrote it before the model families moved under ``models/`` (the
    TAG-CLIP losses module was ``losses.py``): every pushed Hub folder and trained run of that time."""
    import shutil

    folder = tmp_path_factory.mktemp("old-layout") / "model"
    shutil.copytree(saved[0], folder)
    (folder / "losses_tagclip.py").rename(folder / "losses.py")
    modeling = folder / "modeling_tagclip.py"
    modeling.write_text(modeling.read_text().replace("from .losses_tagclip import", "from .losses import"))
    assert "losses_tagclip" not in "".join(p.read_text() for p in folder.glob("*.py"))
    return folder, saved[1]


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_a_folder_saved_before_the_move_loads_in_process(saved_before_the_move, trust_remote_code):
    folder, logits = saved_before_the_move
    model = TagClipModel.from_pretrained(folder) if not trust_remote_code else None
    if trust_remote_code:
        from transformers import AutoModel

        model = AutoModel.from_pretrained(folder, trust_remote_code=True)  # the registered class wins here
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            got = model.eval()(**load_file(folder / "inputs.safetensors")).logits_per_text
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, logits, rtol=0, atol=0)


@pytest.mark.slow
def test_a_folder_saved_before_the_move_loads_in_a_fresh_process(saved_before_the_move, tmp_path):
    folder, logits = saved_before_the_move
    result = run_python(FRESH_LOAD, [str(folder)], tmp_path, clean_env(tmp_path))
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["model_module"].startswith("transformers_modules.")
    torch.testing.assert_close(torch.tensor(report["logits"]), logits, rtol=0, atol=0)


def test_registered_auto_classes_load_in_process(saved):
    from transformers import AutoConfig, AutoModel, AutoProcessor

    folder, logits = saved
    model = AutoModel.from_pretrained(folder).eval()
    assert type(model) is TagClipModel
    assert type(AutoProcessor.from_pretrained(folder)) is TagClipProcessor
    assert AutoConfig.from_pretrained(folder).model_type == "tagclip"
    inputs = load_file(folder / "inputs.safetensors")
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # the reference logits were computed on one thread (a GEMM's rounding may differ)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(**inputs).logits_per_text, logits, rtol=0, atol=0)
    finally:
        torch.set_num_threads(threads)


def test_mismatched_checkpoint_is_a_clear_error(saved):
    folder, _ = saved
    with pytest.raises(ValueError, match="does not match the model config"):
        TagClipModel.from_pretrained(folder, config=tiny_config(projection_dim=8))


def test_corrupt_checkpoint_is_a_clear_error(saved, tmp_path):
    folder, _ = saved
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    with pytest.raises(ValueError, match="corrupt checkpoint"):
        TagClipModel.from_pretrained(broken)


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(OSError, match="nowhere"):
        TagClipModel.from_pretrained(tmp_path / "nowhere")


def _tampered(saved, tmp_path, edit_state=None, edit_config=None):
    """A copy of the saved folder with its weights and/or config.json edited."""
    folder, _ = saved
    out = tmp_path / "tampered"
    out.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
    state = load_file(folder / "model.safetensors")
    save_file(
        edit_state(state) if edit_state else state, out / "model.safetensors", metadata={"format": "pt"}
    )
    return out


def _drop(state, key="text_projection.weight"):
    return {k: v for k, v in state.items() if k != key}


@pytest.mark.parametrize(
    ("edit_state", "edit_config", "message"),
    [
        (_drop, None, r"missing keys \['text_projection.weight'\]"),
        (lambda s: {**s, "bogus.weight": torch.zeros(2)}, None, r"unexpected keys \['bogus.weight'\]"),
        (
            lambda s: {k: v.long() if k == "visual_projection.weight" else v for k, v in s.items()},
            None,
            "'visual_projection.weight' is stored as I64, not floating point",
        ),
        (
            lambda s: {k: v.clone().fill_(float("nan")) if k == "logit_scale" else v for k, v in s.items()},
            None,
            r"NaN or inf values in \['logit_scale'\]",
        ),
        (
            None,
            lambda c: {**c, "vision_config": {**c["vision_config"], "num_hidden_layers": 5}},  # checkpoint: 4
            r"missing keys \['vision_model.encoder.layers.4.",
        ),
        (
            None,
            lambda c: {**c, "projection_dimm": 8},
            "unknown config key 'projection_dimm' .did you mean 'projection_dim'",
        ),
        (
            None,
            lambda c: {**c, "text_config": {**c["text_config"], "hiden_size": 8}},
            "unknown config key 'text_config.hiden_size' .did you mean 'hidden_size'",
        ),
    ],
    ids=["missing", "unexpected", "int64", "nan", "more-layers", "config-key", "sub-config-key"],
)
def test_strict_load_refuses_broken_checkpoints(saved, tmp_path, edit_state, edit_config, message):
    folder = _tampered(saved, tmp_path, edit_state, edit_config)
    with pytest.raises(ValueError, match=message) as info:
        TagClipModel.from_pretrained(folder)
    assert "strict=False" in str(info.value)


def test_strict_false_allows_partial_load(saved, tmp_path):
    folder = _tampered(saved, tmp_path, _drop)
    model, info = TagClipModel.from_pretrained(folder, strict=False, output_loading_info=True)
    assert info["missing_keys"] == {"text_projection.weight"} and type(model) is TagClipModel


def test_missing_local_folder_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model folder at outputs/typo/best"):
        TagClipModel.from_pretrained("outputs/typo/best")


def _typo_config(saved, tmp_path):
    """A copy of the saved folder whose config.json says `moe_layer` (in vision_config) and `num_hidden_layer`."""
    return _tampered(
        saved,
        tmp_path,
        edit_config=lambda c: {
            **c,
            "num_hidden_layer": 3,
            "vision_config": {**c["vision_config"], "moe_layer": [1]},
        },
    )


def test_a_typo_key_in_config_json_warns_on_config_loads_and_names_the_closest_key(saved, tmp_path):
    from transformers import AutoConfig

    from modeling_tagclip import TagClipConfig
    from modeling_tagclip.models.tagclip.load_policy import UnknownConfigKeyWarning

    folder = _typo_config(saved, tmp_path)
    for load in (
        TagClipConfig.from_pretrained,
        lambda f: AutoConfig.from_pretrained(f, trust_remote_code=True),
    ):
        with pytest.warns(UnknownConfigKeyWarning) as record:
            config = load(folder)
        assert len(record) == 1, [str(r.message) for r in record]  # one warning per load, all keys in it
        message = str(record[0].message)
        assert "'vision_config.moe_layer' (did you mean 'moe_layers'?)" in message
        assert "'num_hidden_layer' (did you mean 'text_config.num_hidden_layers' or" in message
        assert config.vision_config.moe_layers == [
            1,
            2,
        ]  # the typo changed nothing: that is why it is reported
    with pytest.warns(UnknownConfigKeyWarning, match="moe_layer"):  # a lenient model load warns
        TagClipModel.from_pretrained(folder, strict=False)


def test_a_strict_model_load_refuses_a_typo_key_without_a_second_warning(saved, tmp_path):
    import warnings

    folder = _typo_config(saved, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error is the one report
        with pytest.raises(ValueError, match=r"unknown config key 'vision_config.moe_layer' .did you mean"):
            TagClipModel.from_pretrained(folder)


def test_folders_saved_by_transformers_load_without_an_unknown_key_warning(saved, tmp_path):
    """The keys transformers and this project write (architectures, auto_map, dtype, transformers_version,
    custom_pipelines, sub-config model_type) are known: a saved TAG-CLIP and ViSA load silently."""
    import warnings

    from fixtures import make_visa_model
    from transformers import AutoConfig

    from modeling_tagclip.models.tagclip.load_policy import UnknownConfigKeyWarning
    from modeling_tagclip.models.visa.configuration_visa import ViSAConfig
    from modeling_tagclip.models.visa.load_policy import (
        UnknownConfigKeyWarning as ViSAUnknownKey,
    )  # the unit's copy

    visa = tmp_path / "visa"
    make_visa_model().save_pretrained(visa)
    folder, _ = saved
    saved_keys = json.loads((folder / "config.json").read_text())
    assert {"architectures", "transformers_version", "dtype"} <= set(saved_keys)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeyWarning)
        warnings.simplefilter("error", ViSAUnknownKey)
        TagClipModel.from_pretrained(folder)
        AutoConfig.from_pretrained(folder, trust_remote_code=True)
        ViSAConfig.from_pretrained(visa)
    config = json.loads((visa / "config.json").read_text())
    (visa / "config.json").write_text(json.dumps({**config, "num_expert": 4}))
    with pytest.warns(ViSAUnknownKey, match=r"'num_expert' \(did you mean 'num_experts'\?\)"):
        ViSAConfig.from_pretrained(visa)
