"""One config system for both families: typed dataclasses ← YAML recipe ← command-line flags / ``--set``.

Flags are generated from the dataclass fields (``num_train_epochs`` -> ``--num-train-epochs``; a few take the name
every verb uses for the idea: ``output_dir`` -> ``--output``, ``FLAG_NAMES``; the field's name stays a hidden alias);
unknown keys in a file, a flag or a ``--set a.b=v`` override are errors naming the key and the closest valid
one. Recipes ship inside the package (``modeling_tagclip/recipes/NAME.yaml``): ``--config NAME`` or a path.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
TASKS = ("retrieval", "reid")
DEFAULT_RECIPES = {"retrieval": "default", "reid": "visa-synthetic"}
SELECTION = ("validation", "last", "test")


class ConfigError(ValueError):
    """An unknown key, a wrong type or an invalid value in a recipe, a flag or an override."""


class RecipeNotFoundError(ConfigError, FileNotFoundError):
    """``--config`` names neither a file nor a shipped recipe."""


@dataclass
class LoraArguments:
    """peft LoRA adapters instead of full fine-tuning."""

    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_experts: bool = False  # TAG-CLIP: also the experts' fc1/fc2
    merge: bool = False  # TAG-CLIP: also save a merged model in best/ (ViSA always saves a merged model)


@dataclass
class ClipPretrainArguments:
    """A short plain-CLIP pre-training phase on the training split before a run from scratch (0 epochs: off)."""

    epochs: int = 0
    batch_size: int = 32
    learning_rate: float = 1.0e-3
    logit_scale_init_value: float | None = None  # ln of the initial similarity scale; None: the model's


@dataclass
class TrainArguments:
    """Settings of every run (both families)."""

    task: str = "retrieval"  # retrieval (TAG-CLIP, text -> person) or reid (ViSA, image -> person)
    seed: int = 0
    output_dir: str = "outputs/tagclip-synthetic"
    data_dir: str = "data/synthetic"
    render_synthetic: bool = False  # render the embedded synthetic set into a data_dir other than the default
    init_from: str | None = None  # a saved / converted model folder to start from
    model: dict[str, Any] = field(
        default_factory=dict
    )  # model config overrides (keys of the family's config)
    num_train_epochs: int = 10
    max_steps: int = -1  # > 0: stop after this many steps
    per_device_batch_size: int = 64
    learning_rate: float = 1.0e-4
    mixed_precision: str | None = (
        None  # no / fp16 / bf16 / auto (bf16 where the GPU has it, else fp16; GPU only)
    )
    validation_fraction: float = 0.1  # identities carved from train for model selection; 0: none
    model_selection: str = "validation"  # validation / last (epoch) / test (reference protocol, labelled so)
    save_steps: int = 500  # also at every epoch end; 0: epoch ends only
    save_total_limit: int = 2
    eval_every_epochs: int = 1
    eval_batch_size: int = 64
    logging_steps: int = 1
    num_threads: int = (
        0  # torch intra-op threads per process; 0: the CPU's cores / processes (stated in results)
    )
    num_workers: int = 0  # loader processes decoding / augmenting images
    pin_memory: bool = False  # page-locked batches for faster host-to-GPU copies
    persistent_workers: bool = False  # keep the loader processes across epochs (needs num_workers > 0)
    plots: bool = True
    lora: LoraArguments = field(default_factory=LoraArguments)


@dataclass
class TagClipTrainConfig(TrainArguments):
    """TAG-CLIP text-to-person retrieval (``--task retrieval``)."""

    image_dir: str | None = None
    train_split: str = "train"
    test_split: str = "test"
    synthetic: dict[str, Any] | None = None  # render the embedded set into data_dir (default location only)
    bad_data: str = "error"  # or skip: drop missing/corrupt images and empty captions with a warning
    image_size: list[int] = field(default_factory=lambda: [128, 64])  # [height, width]
    lr_start: float = 1.0e-6
    lr_end: float = 5.0e-6
    warmup_epochs: float = 1.0
    weight_decay: float = 0.02
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    adam_eps: float = 1.0e-8
    tse_lr_ratio: float = 10.0
    softlabel_ratio: float | None = None  # None: the model config's
    freeze_patch_embedding: bool = True
    augment: bool = True
    text_max_length: int = 77
    gather_negatives: bool = True
    grad_cache_chunks: int = (
        1  # > 1: each batch's loss in this many chunks (gradient caching), same gradients
    )
    max_grad_norm: float | None = None
    eval_routing: str = "argmax"  # image-level routing for evaluation and the saved best/ model
    pretrain_clip: ClipPretrainArguments = field(default_factory=ClipPretrainArguments)


@dataclass
class ViSATrainConfig(TrainArguments):
    """ViSA aerial-ground image re-ID (``--task reid``)."""

    output_dir: str = "outputs/visa-synthetic"
    data_dir: str = "data/synthetic_reid"
    dataset: str = "synthetic"  # synthetic, cargo, agreidv2, lagper, market1501
    synthetic_identities: int = 200
    preset: str = "cargo"  # ViSAConfig preset
    imagenet_vit: str | None = None  # timm ViT-B/16 state dict for the trunk
    num_instances: int = 4  # K images per identity in a batch (P = batch / K)
    optimizer: str = "adamw"  # sgd (reference) or adamw
    momentum: float = 0.9
    weight_decay: float = 1.0e-4
    weight_decay_bias: float = 5.0e-4
    weight_decay_norm: float = 5.0e-4
    clip_norm: float = 5.0  # per-tensor gradient-norm clip
    warmup_iters: int = 50
    warmup_factor: float = 0.01
    eta_min: float = 1.6e-6
    random_erasing: float = 0.0


CONFIG_CLASSES: dict[str, type[TrainArguments]] = {"retrieval": TagClipTrainConfig, "reid": ViSATrainConfig}


# ----------------------------------------------------------------------------- validation helpers


def _closest(key: str, valid: Sequence[str]) -> str:
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def unknown_key_error(key: str, valid: Sequence[str], where: str) -> ConfigError:
    return ConfigError(f"{where}: unknown key {key!r}{_closest(key.split('.')[-1], valid)}")


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def model_config_keys(task: str) -> dict[str, set[str] | None]:
    """Valid ``model`` keys of a family: top level → sub-config keys (or None for a plain value)."""
    if task == "reid":
        from modeling_tagclip.models.visa.configuration_visa import ViSAConfig

        return {f.name: None for f in dataclasses.fields(ViSAConfig)}
    from modeling_tagclip.models.tagclip.configuration_tagclip import (
        TagClipConfig,
        TagClipTextConfig,
        TagClipVisionConfig,
    )

    keys: dict[str, set[str] | None] = {f.name: None for f in dataclasses.fields(TagClipConfig)}
    keys["vision_config"] = {f.name for f in dataclasses.fields(TagClipVisionConfig)}
    keys["text_config"] = {f.name for f in dataclasses.fields(TagClipTextConfig)}
    return keys


def model_config_classes(task: str) -> dict[str, type]:
    """The config class of the ``model`` overrides of a family (``""``) and of each of its sub-configs."""
    if task == "reid":
        from modeling_tagclip.models.visa.configuration_visa import ViSAConfig

        return {"": ViSAConfig}
    from modeling_tagclip.models.tagclip import configuration_tagclip as tc

    return {
        "": tc.TagClipConfig,
        "vision_config": tc.TagClipVisionConfig,
        "text_config": tc.TagClipTextConfig,
    }


def _check_model_value(cls: type, name: str, value: Any, key: str, where: str) -> None:
    """Run the config class's own field validators on ``value`` (``hidden_size=abc`` is a ConfigError)."""
    for validator in getattr(cls, "__validators__", {}).get(name, ()):
        try:
            validator(value)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{where}: {key}: {error}") from None


def check_model_keys(model: dict[str, Any], task: str, where: str) -> None:
    """Every ``model`` key is a field of the family's config (or sub-config) and its value has the field's type."""
    valid, classes = model_config_keys(task), model_config_classes(task)
    for key, value in model.items():
        if key not in valid:
            raise unknown_key_error(f"model.{key}", list(valid), where)
        if valid[key] is None:
            _check_model_value(classes[""], key, value, f"model.{key}", where)
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: model.{key} must be a mapping, got {value!r}")
        for sub, sub_value in value.items():
            if sub not in valid[key]:
                raise unknown_key_error(f"model.{key}.{sub}", sorted(valid[key]), where)
            _check_model_value(classes[key], sub, sub_value, f"model.{key}.{sub}", where)


def _synthetic_keys() -> list[str]:
    import inspect

    from modeling_tagclip.data.synthetic import generate_dataset

    return [n for n in inspect.signature(generate_dataset).parameters if n not in ("out_dir", "progress")]


def _coerce(value: Any, annotation: Any, key: str, where: str) -> Any:
    """Check / convert a value to a field's type (YAML reads ``1e-3`` as a string: it becomes a float)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    expected = origin or annotation
    if expected is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    elif expected is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif expected is bool and isinstance(value, bool):
        return value
    elif expected is str and isinstance(value, str):
        return value
    elif expected is list and isinstance(value, (list, tuple)):
        return [_coerce(v, args[0], key, where) for v in value] if args else list(value)
    elif expected is dict and isinstance(value, dict):
        return dict(value)
    name = getattr(expected, "__name__", str(expected))
    raise ConfigError(f"{where}: {key} must be {name}, got {value!r}")


# ----------------------------------------------------------------------------- building a config


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        both = isinstance(out.get(key), dict) and isinstance(value, dict)
        out[key] = _merge(out[key], value) if both else value
    return out


def _apply(values: dict, dotted: str, value: Any, cls, where: str, prefix: str = "") -> None:
    """Set ``a.b.c`` in ``values`` after checking the key against the dataclass (and the model config)."""
    key, _, rest = dotted.partition(".")
    hints = _field_types(cls)
    if key not in hints:
        raise unknown_key_error(prefix + key, list(hints), where)
    if key == "model" and rest:
        nested: dict = value
        for part in reversed(rest.split(".")):
            nested = {part: nested}
        values["model"] = _merge(values.get("model") or {}, nested)
        return
    if dataclasses.is_dataclass(hints[key]) and (rest or isinstance(value, dict)):
        update = {rest: value} if rest else value
        sub = values.setdefault(key, {})
        for sub_key, sub_value in update.items():
            _apply(sub, sub_key, sub_value, hints[key], where, f"{key}.")
        return
    if rest:
        if key == "synthetic":
            values[key] = _merge(values.get(key) or {}, {rest: value})
            return
        raise ConfigError(f"{where}: {key} is not a mapping; cannot set {dotted!r}")
    values[key] = _merge(values[key], value) if key == "model" and isinstance(value, dict) else value


def _build(cls, values: dict, where: str):
    hints = _field_types(cls)
    kwargs = {}
    for key, value in values.items():
        if dataclasses.is_dataclass(hints[key]):
            kwargs[key] = _build(hints[key], value if isinstance(value, dict) else asdict(value), where)
        else:
            kwargs[key] = _coerce(value, hints[key], key, where)
    return cls(**kwargs)


def validate(cfg: TrainArguments, where: str = "config") -> TrainArguments:
    """Value checks that types cannot express."""
    if cfg.task not in TASKS:
        raise ConfigError(f"{where}: task must be one of {TASKS}, got {cfg.task!r}")
    if cfg.per_device_batch_size < 2:
        raise ConfigError(f"{where}: per_device_batch_size must be >= 2 (contrastive losses and BatchNorm)")
    if not 0 <= cfg.validation_fraction < 1:
        raise ConfigError(f"{where}: validation_fraction must be in [0, 1), got {cfg.validation_fraction}")
    if cfg.model_selection not in SELECTION:
        raise ConfigError(f"{where}: model_selection must be one of {SELECTION}, got {cfg.model_selection!r}")
    if cfg.mixed_precision not in (None, "no", "fp16", "bf16", "auto"):
        raise ConfigError(
            f"{where}: mixed_precision must be no, fp16, bf16 or auto, got {cfg.mixed_precision!r}"
        )
    for name in (
        "num_train_epochs",
        "eval_every_epochs",
        "eval_batch_size",
        "logging_steps",
        "save_total_limit",
    ):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{where}: {name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.save_steps < 0 or cfg.num_workers < 0 or cfg.num_threads < 0:
        raise ConfigError(f"{where}: save_steps, num_workers and num_threads must be >= 0")
    if cfg.persistent_workers and cfg.num_workers == 0:
        raise ConfigError(f"{where}: persistent_workers needs num_workers > 0")
    check_model_keys(cfg.model, cfg.task, where)
    if isinstance(cfg, TagClipTrainConfig):
        if cfg.bad_data not in ("error", "skip"):
            raise ConfigError(f"{where}: bad_data must be 'error' or 'skip', got {cfg.bad_data!r}")
        if len(cfg.image_size) != 2 or len(cfg.adam_betas) != 2:
            raise ConfigError(f"{where}: image_size and adam_betas take two values each")
        if not 1 <= cfg.grad_cache_chunks <= cfg.per_device_batch_size:
            raise ConfigError(
                f"{where}: grad_cache_chunks must be between 1 (off) and per_device_batch_size "
                f"{cfg.per_device_batch_size}, got {cfg.grad_cache_chunks}"
            )
        pretrain = cfg.pretrain_clip
        if pretrain.epochs < 0 or pretrain.batch_size < 2 or not pretrain.learning_rate > 0:
            raise ConfigError(f"{where}: pretrain_clip needs epochs >= 0, batch_size >= 2, learning_rate > 0")
        scale = pretrain.logit_scale_init_value
        if scale is not None and not 0 <= scale <= math.log(100):
            raise ConfigError(
                f"{where}: pretrain_clip.logit_scale_init_value is ln of the scale, between 0 and "
                f"ln 100 = 4.605 (CLIP clamps the scale at 100), got {scale}"
            )
        if cfg.synthetic:
            for key in cfg.synthetic:
                if key not in _synthetic_keys():
                    raise unknown_key_error(f"synthetic.{key}", _synthetic_keys(), where)
    if isinstance(cfg, ViSATrainConfig):
        if cfg.optimizer not in ("sgd", "adamw"):
            raise ConfigError(f"{where}: optimizer must be 'sgd' or 'adamw', got {cfg.optimizer!r}")
        if cfg.per_device_batch_size % cfg.num_instances:
            raise ConfigError(
                f"{where}: per_device_batch_size {cfg.per_device_batch_size} must be a multiple of "
                f"num_instances {cfg.num_instances}"
            )
    return cfg


def check_init_from(cfg: TrainArguments) -> None:
    """``init_from`` names an existing model folder or a Hub repo id; a missing folder is a ConfigError saying so
    (not the Hub's "Repo id must be in the form ...")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from modeling_tagclip.models.tagclip.serving_common import looks_local

    path = cfg.init_from
    if not path or Path(path).is_dir():
        return
    if Path(path).exists():
        raise ConfigError(f"init_from: {path} is a file, not a model folder")
    try:
        validate_repo_id(path)
    except HFValidationError:
        raise ConfigError(f"init_from: no such folder: {path}") from None
    if looks_local(path):
        raise ConfigError(f"init_from: no such folder: {path}")


def list_recipes() -> dict[str, str]:
    """The shipped recipes: name -> its header comment's first phrase."""
    recipes = {}
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        first = path.read_text().splitlines()[0] if path.stat().st_size else ""
        recipes[path.stem] = re.split(r" \(|:", first.lstrip("# "))[0].strip().rstrip(".")
    return recipes


def recipe_path(name_or_path: str | Path) -> Path:
    """``--config``: a YAML file, or the name of a shipped recipe (``default``, ``tag-pedes``, ...)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = path.name.removesuffix(".yaml")
    if str(name_or_path) in (name, f"{name}.yaml") and (RECIPE_DIR / f"{name}.yaml").is_file():
        return RECIPE_DIR / f"{name}.yaml"
    if path.exists():
        raise RecipeNotFoundError(
            f"--config {name_or_path} is not a regular file: give a YAML recipe file or a "
            f"shipped recipe ({', '.join(list_recipes())})"
        )
    raise RecipeNotFoundError(f"no config file {name_or_path} (shipped recipes: {', '.join(list_recipes())})")


def read_recipe(path: str | Path) -> dict[str, Any]:
    path = recipe_path(path)
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})".replace("\n", " ")) from err
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(loaded).__name__}")
    return loaded


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None, task: str | None = None
) -> TrainArguments:
    """Defaults ← YAML recipe (a path or a shipped name; default: the task's) ← dotted ``overrides``; validated.

    The task comes from ``task``, else the recipe's ``task`` key, else ``retrieval``.
    """
    return validate(*_merge_config(path, overrides, task))


def _merge_config(
    path: str | Path | None, overrides: dict[str, Any] | None, task: str | None
) -> tuple[TrainArguments, str]:
    """``load_config`` before its value checks (which import the model configs): (config, where it came from)."""
    if task is not None and task not in TASKS:
        raise ConfigError(f"task must be one of {TASKS}, got {task!r}")
    recipe = read_recipe(path) if path is not None else {}
    task = task or recipe.get("task") or "retrieval"
    path = recipe_path(DEFAULT_RECIPES[task] if path is None else path)
    if not recipe:
        recipe = read_recipe(path)
    cls = CONFIG_CLASSES.get(task)
    if cls is None:
        raise ConfigError(f"{path}: task must be one of {TASKS}, got {task!r}")
    values = asdict(cls())
    for key, value in recipe.items():
        _apply(values, key, value, cls, str(path))
    values["task"] = task
    for key, value in (overrides or {}).items():
        _apply(values, key, value, cls, "override")
    where = (
        f"{path} + overrides ({', '.join(overrides)})" if overrides else str(path)
    )  # a value may come from either
    return _build(cls, values, where), where


# ----------------------------------------------------------------------------- command line

PATH_FIELDS = ("output_dir", "data_dir", "init_from", "image_dir", "imagenet_vit")


def _all_fields() -> dict[str, tuple[Any, str]]:
    """Every flag-able field of both tasks → (type, which task: 'shared' (both) or the one task that has it)."""
    per_task = {task: _field_types(cls) for task, cls in CONFIG_CLASSES.items()}
    out: dict[str, tuple[Any, str]] = {}
    for task, hints in per_task.items():
        for name, kind in hints.items():
            if name == "lora":
                continue
            shared = all(name in other for other in per_task.values())
            out[name] = (kind, "shared" if shared else task)
    return out


def _metavar(name: str, annotation: Any) -> str:
    """What a flag's value looks like: its choices, N, X, PATH, TEXT, true|false, [A,B] or {YAML}."""
    from modeling_tagclip.engine.flag_help import CHOICES

    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # X | None: the X
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    kind = typing.get_origin(annotation) or annotation
    if name in CHOICES or name in PATH_FIELDS:
        return CHOICES.get(name, "PATH")
    return {int: "N", float: "X", bool: "true|false", list: "[A,B]", dict: "{YAML}"}.get(kind, "TEXT")


def _recipe_defaults() -> dict[str, dict[str, Any]]:
    """The values each task's default recipe runs (what ``--help`` shows; the shipped recipes are validated by
    the tests, so ``--help`` skips the checks that import the model configs)."""
    return {task: asdict(_merge_config(None, None, task)[0]) for task in TASKS}


def _shown(value: Any) -> str:
    """A default as ``--help`` shows it (a long mapping is left to the recipe file)."""
    text = "null" if value is None else repr(value)
    return "the recipe file's (see --list-configs)" if isinstance(value, dict) and len(text) > 40 else text


def _default_text(name: str, where: str, defaults: dict[str, dict[str, Any]]) -> str:
    """``default: V`` (the default recipe's value), and the ViSA recipe's when it differs."""
    retrieval, reid = defaults["retrieval"].get(name), defaults["reid"].get(name)
    if where == "reid":
        return f"default: {_shown(reid)}"
    if where == "retrieval" or retrieval == reid:
        return f"default: {_shown(retrieval)}"
    return f"default: {_shown(retrieval)}; with --task reid: {_shown(reid)}"


# setting -> its flag where the flag's name is not the setting's (the setting's own name stays a hidden alias,
# flags.RENAMED["train"]): the names every verb uses for the same idea
FLAG_NAMES = {
    "output_dir": "output",
    "data_dir": "data",
    "per_device_batch_size": "batch-size",
    "num_workers": "workers",
    "model": "model-config",
}
DESCRIPTION = (
    "Train TAG-CLIP (--task retrieval, default) or ViSA (--task reid) with accelerate. Settings: the task's recipe "
    "(--config) <- flags / --set (dotted keys). The defaults shown are what the default recipes run "
    f"({DEFAULT_RECIPES['retrieval']}; {DEFAULT_RECIPES['reid']} with --task reid)."
)


def flag_of(setting: str) -> str:
    """The flag of a setting: ``output_dir`` -> ``--output``, ``num_train_epochs`` -> ``--num-train-epochs``."""
    return "--" + FLAG_NAMES.get(setting, setting.replace("_", "-"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of both tasks, generated from the dataclasses; ``--help`` shows the default recipes' values."""
    from modeling_tagclip.engine.flag_help import HELP
    from modeling_tagclip.flags import positive_int

    p.description = DESCRIPTION
    p.add_argument(
        "--config",
        default=None,
        metavar="NAME|PATH",
        help=f"recipe: a shipped name ({', '.join(list_recipes())}) or a YAML file",
    )
    p.add_argument(
        "--list-configs",
        action="store_true",
        help="list the shipped recipes with the settings each one sets, and exit",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any setting, dotted (model.vision_config.hidden_size=64, lora.r=8)",
    )
    p.add_argument(
        "--resume-from-checkpoint",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH|latest",
        help="resume from a checkpoint folder or the newest one in OUTPUT that verifies",
    )
    p.add_argument("--eval-only", action="store_true", help="evaluate OUTPUT/best on the test split")
    p.add_argument(
        "--stop-after-steps",
        type=positive_int,
        default=None,
        metavar="N",
        help="stop after N steps as if interrupted (to try --resume-from-checkpoint)",
    )
    p.add_argument(
        "--lora", action="store_true", help="train LoRA adapters (same as --set lora.enabled=true)"
    )
    p.add_argument(
        "--merge-lora",
        action="store_true",
        help="also save a merged model in best/ (same as --set lora.merge=true)",
    )
    groups = {
        "shared": p.add_argument_group("settings of both tasks"),
        "retrieval": p.add_argument_group("TAG-CLIP settings (--task retrieval)"),
        "reid": p.add_argument_group("ViSA settings (--task reid)"),
    }
    defaults = _recipe_defaults()
    for name, (kind, where) in _all_fields().items():
        groups[where].add_argument(
            flag_of(name),
            dest=name,
            default=None,
            metavar=_metavar(name, kind),
            help=f"{HELP[name]} [{_default_text(name, where, defaults)}]".replace("%", "%%"),
        )


def build_parser(prog: str = "tagclip train") -> argparse.ArgumentParser:
    """The parser of ``tagclip train`` (and of ``training/train.py``, under its own name)."""
    from modeling_tagclip.flags import finish

    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    add_arguments(parser)
    return finish(parser, "train")


def _value(text: str, flag: str) -> Any:
    """A flag or ``--set`` value, read as YAML (numbers, booleans, lists, mappings, ``null``)."""
    if text.lower() in ("null", "none"):
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{flag}: cannot read the value {text!r} ({err})".replace("\n", " ")) from err


def _dotted(settings: dict[str, Any], prefix: str = "") -> list[str]:
    """A recipe's settings as the ``KEY=VALUE`` words ``--set`` takes (nested keys dotted)."""
    words = []
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            words += _dotted(value, f"{prefix}{key}.")
        else:
            words.append(
                f"{prefix}{key}={value if isinstance(value, str) else json.dumps(value, separators=(',', ':'))}"
            )
    return words


def recipe_listing() -> str:
    """``--list-configs``: each shipped recipe, its description, then the settings it sets (``KEY=VALUE``)."""
    recipes = list_recipes()
    width = max(map(len, recipes), default=0)
    lines = []
    for name, about in recipes.items():
        lines.append(f"{name:<{width}}  {about}")
        words = " ".join(_dotted(read_recipe(RECIPE_DIR / f"{name}.yaml")))
        lines += textwrap.wrap(
            words, 110, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False
        )
    tail = "(in {}; use one with --config NAME, or pass a YAML file; any setting: --set KEY=VALUE)"
    return "\n".join([*lines, tail.format(RECIPE_DIR)])


def parse_args(
    argv: Sequence[str] | None = None,
    prog: str = "tagclip train",
    announce: Callable[[TrainArguments], None] | None = None,
) -> tuple[argparse.Namespace, TrainArguments | None]:
    """Command line → (special flags, validated config); the config is None after ``--list-configs``.
    ``announce(config)`` runs before the checks that import the model code (seconds on a busy machine)."""
    from modeling_tagclip.flags import unknown_option

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ConfigError(unknown_option(parser, unknown[0]))
    return args, config_from_args(args, announce)


def config_from_args(
    args: argparse.Namespace, announce: Callable[[TrainArguments], None] | None = None
) -> TrainArguments | None:
    """The validated config the parsed flags of ``tagclip train`` describe (None after ``--list-configs``,
    which prints the recipes)."""
    if args.list_configs:
        print(recipe_listing())
        return None
    overrides: dict[str, Any] = {}
    fields_ = _all_fields()
    for name in fields_:
        text = getattr(args, name)
        if text is not None:
            overrides[name] = _value(text, flag_of(name))
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = _value(text, f"--set {key}")
    if args.lora:
        overrides["lora.enabled"] = True
    if args.merge_lora:
        overrides["lora.merge"] = True
    task = overrides.pop("task", None)
    task = task or (read_recipe(args.config).get("task") if args.config else None) or "retrieval"
    for key in overrides:
        owner = fields_.get(key.split(".")[0], (None, "shared"))[1]
        if owner not in ("shared", task):
            flag = flag_of(key) if key in fields_ else f"--set {key}"
            raise ConfigError(f"{flag} is a setting of --task {owner}, not of --task {task}")
    if announce is not None:
        announce(_merge_config(args.config, overrides, task)[0])
    return load_config(args.config, overrides, task=task)
