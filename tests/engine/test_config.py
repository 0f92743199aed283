"""One config system: typed recipes for both tasks, YAML files, generated flags, one spelling, clear key errors."""

import math
import warnings
from pathlib import Path

import pytest

from modeling_tagclip.engine.config import (
    RECIPE_DIR,
    ConfigError,
    TagClipTrainConfig,
    ViSATrainConfig,
    build_parser,
    load_config,
    parse_args,
)

RECIPES = sorted(RECIPE_DIR.glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_as_its_task(recipe):
    cfg = load_config(recipe)
    assert isinstance(cfg, {"retrieval": TagClipTrainConfig, "reid": ViSATrainConfig}[cfg.task])


def test_no_arguments_is_the_main_job():
    args, cfg = parse_args([])
    assert isinstance(cfg, TagClipTrainConfig) and args.resume_from_checkpoint is None
    assert (cfg.output_dir, cfg.data_dir, cfg.per_device_batch_size, cfg.learning_rate) == (
        "outputs/tagclip-synthetic",
        "data/synthetic",
        16,
        1.0e-3,
    )
    assert cfg.model["vision_config"]["moe_layers"] == [2, 3] and cfg.synthetic["num_identities"] == 435
    assert cfg.synthetic["images_per_view"] == 3 and cfg.warmup_epochs == 0.33
    assert (cfg.num_train_epochs, cfg.validation_fraction, cfg.model_selection) == (6, 0, "last")
    assert (cfg.pretrain_clip.epochs, cfg.freeze_patch_embedding) == (8, True)
    assert cfg.pretrain_clip.logit_scale_init_value == pytest.approx(math.log(50), abs=1e-3)


def test_pretraining_clip_config_takes_the_recipe_scale_else_transformers_default():
    from transformers import CLIPConfig

    from modeling_tagclip.engine.tasks.clip_pretraining import clip_config

    sizes = {"hidden_size": 32, "num_attention_heads": 2}
    model = {"vision_config": sizes, "text_config": sizes, "projection_dim": 16}
    assert clip_config(model, [64, 32]).logit_scale_init_value == CLIPConfig().logit_scale_init_value
    assert clip_config(model, [64, 32], 3.912).logit_scale_init_value == 3.912
    with pytest.raises(ConfigError, match="pretrain_clip"):
        load_config(None, {"pretrain_clip.logit_scale_init_value": "big"})
    for bad in (float("nan"), -1.0, 5.0):  # 5.0: a scale of 148, past CLIP's clamp at 100
        with pytest.raises(ConfigError, match="logit_scale_init_value is ln of the scale"):
            load_config(None, {"pretrain_clip.logit_scale_init_value": bad})


def test_reference_recipe_trains_with_gumbel_and_evaluates_with_argmax():
    cfg = load_config("tag-pedes")  # a shipped recipe by name
    assert cfg.model["vision_config"]["routing"] == "gumbel" and cfg.eval_routing == "argmax"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--set", "model.vision_config.hiden_size=64"],
            "'model.vision_config.hiden_size'; did you mean 'hidden_size'",
        ),
        (["--set", "model.lamda_id=1"], "'model.lamda_id'; did you mean 'lambda_id'"),
        (["--set", "lerning_rate=1"], "'lerning_rate'; did you mean 'learning_rate'"),
        (["--set", "lora.rank=4"], "unknown key 'lora.rank'; valid keys: alpha, dropout, enabled"),
        (["--set", "synthetic.num_identites=9"], "'synthetic.num_identites'; did you mean 'num_identities'"),
        (["--lerning_rate", "1"], "unknown option '--lerning_rate'; did you mean '--learning_rate'"),
        (["--learning_rate", "fast"], "learning_rate must be float, got 'fast'"),
        (["--num_instances", "8"], "--num-instances is a setting of --task reid, not of --task retrieval"),
        (["--task", "reid", "--eval_routing", "argmax"], "setting of --task retrieval, not of --task reid"),
        (["--task", "ranking"], "task must be one of"),
        (["--validation_fraction", "1.5"], "validation_fraction must be in [0, 1)"),
        (["--set", "learning_rate"], "--set expects KEY=VALUE"),
    ],
)
def test_typos_and_bad_values_are_errors_naming_the_key(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert message in str(err.value)


def test_typo_in_a_recipe_file_names_the_file_and_the_key(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model:\n  vision_config: {num_hiden_layers: 2}\n")
    with pytest.raises(
        ConfigError,
        match=r"mine.yaml: unknown key 'model.vision_config.num_hiden_layers'.*"
        r"did you mean 'num_hidden_layers'",
    ):
        load_config(recipe)


def test_flags_files_and_overrides_merge_in_order(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1e-3\nmodel: {projection_dim: 32, text_config: {hidden_size: 32}}\n")
    args, cfg = parse_args(
        [
            "--config",
            str(recipe),
            "--learning_rate",
            "2e-3",
            "--set",
            "model.tse_embed_dim=48",
            "--set",
            "lora.r=4",
            "--lora",
            "--augment",
            "false",
            "--max_grad_norm",
            "null",
        ]
    )
    assert cfg.learning_rate == 2e-3 and isinstance(
        cfg.learning_rate, float
    )  # YAML's "1e-3" string is a float
    assert cfg.model == {"projection_dim": 32, "text_config": {"hidden_size": 32}, "tse_embed_dim": 48}
    assert (cfg.lora.enabled, cfg.lora.r, cfg.augment, cfg.max_grad_norm) == (True, 4, False, None)


def test_both_spellings_work_silently_and_removed_aliases_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args, cfg = parse_args(
            ["--output-dir", "X", "--resume-from-checkpoint", "--per-device-batch-size", "8"]
        )
    assert (cfg.output_dir, args.resume_from_checkpoint, cfg.per_device_batch_size) == ("X", "latest", 8)
    for removed in ("--resume", "--lr", "--recipe", "--lora-rank"):  # former aliases
        with pytest.raises(ConfigError, match=f"unknown option '{removed}'"):
            parse_args([removed, "1"])
    with pytest.raises(ConfigError, match="unknown option '--max-stpes'; did you mean '--max-steps'"):
        parse_args(["--max-stpes", "3"])
    with pytest.raises(ConfigError, match="unknown option '--max_stpes'; did you mean '--max_steps'"):
        parse_args(["--max_stpes", "3"])


def test_renamed_flags_keep_their_old_names_and_the_recipe_keys():
    new = parse_args(
        [
            "--output",
            "X",
            "--data",
            "D",
            "--batch-size",
            "8",
            "--workers",
            "1",
            "--model-config",
            "{projection_dim: 32}",
        ]
    )[1]
    old = parse_args(
        [
            "--output_dir",
            "X",
            "--data-dir",
            "D",
            "--per_device_batch_size",
            "8",
            "--num-workers",
            "1",
            "--model",
            "{projection_dim: 32}",
        ]
    )[1]
    assert new == old
    assert (new.output_dir, new.data_dir, new.per_device_batch_size, new.num_workers) == ("X", "D", 8, 1)
    assert new.model["projection_dim"] == 32


def test_a_setting_of_both_task_classes_is_a_flag_of_both_tasks():
    _, cfg = parse_args(["--weight_decay", "0.05"])
    assert (cfg.task, cfg.weight_decay) == ("retrieval", 0.05)
    _, cfg = parse_args(["--task", "reid", "--weight_decay", "0.03"])
    assert (cfg.task, cfg.weight_decay) == ("reid", 0.03)


def test_help_lists_every_option_of_both_tasks():
    text = build_parser().format_help()
    for option in (
        "--task",
        "--output",
        "--resume-from-checkpoint",
        "--set",
        "--eval-routing",
        "--batch-size",
        "--text-max-length",
        "--num-instances",
        "--optimizer",
        "--clip-norm",
        "--model-selection",
    ):
        assert option in text, option
    assert "TAG-CLIP settings (--task retrieval)" in text and "ViSA settings (--task reid)" in text


def test_train_py_help_runs(capsys):
    from training.train import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "--num-instances" in capsys.readouterr().out


def test_recipes_live_in_the_package():
    assert RECIPE_DIR == Path(__file__).resolve().parents[2] / "modeling_tagclip" / "recipes"
    assert {"default", "tag-pedes", "visa-cargo", "visa-synthetic"} <= {p.stem for p in RECIPES}


def test_unreadable_yaml_is_an_error_naming_the_file_or_flag(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("learning_rate: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match=r"--set model: cannot read the value '\[1, 2'"):
        parse_args(["--set", "model=[1, 2"])
