"""The one model loader: a saved TAG-CLIP or ViSA folder (or Hub repo id, or a peft adapter folder) → model.

Importing this package registers its classes with transformers' Auto factories, so a folder of this package's
own model types (``OWN_MODEL_TYPES``) loads with the installed code and never executes code from the folder.
Any other model type is refused with a clear error unless the caller opts in with ``trust_remote_code=True``
(then transformers runs the code the folder ships). A missing local folder is reported as a missing folder.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

import modeling_tagclip
from modeling_tagclip.models.tagclip.processing_tagclip import warn_on_processor_size
from modeling_tagclip.models.tagclip.serving_common import looks_local

from .encode import DTYPES

__all__ = [
    "FAMILIES",
    "OWN_MODEL_TYPES",
    "ModelLoadError",
    "load_model",
    "load_visa",
    "model_dir",
    "read_config",
]

modeling_tagclip.register_auto_classes()

OWN_MODEL_TYPES = {
    "tagclip": "tagclip",
    "tagclip_vision_model": "tagclip",
    "tagclip_text_model": "tagclip",
    "visa": "visa",
}
FAMILIES = ("tagclip", "visa")


class ModelLoadError(ValueError):
    """A model folder or repo that does not exist, is not a model, or is of the wrong family."""


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a local folder or a Hub repo id, with a ``model_type`` (errors name what is missing)."""
    name = str(path)
    if Path(name).is_dir():
        config_file = Path(name) / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{name} is not a saved model folder: it has no config.json")
    elif Path(name).exists() or looks_local(name):
        kind = "is a file, not a model folder" if Path(name).exists() else "does not exist"
        raise ModelLoadError(f"model folder {name} {kind}")
    else:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
        from transformers.utils import cached_file

        try:
            validate_repo_id(
                name
            )  # a missing folder such as "run 1" is named as missing, not as a bad repo id
        except HFValidationError:
            raise ModelLoadError(
                f"model folder {name} does not exist ({name!r} is no Hub repo id either)"
            ) from None
        try:
            config_file = Path(cached_file(name, "config.json"))
        except OSError as error:
            raise ModelLoadError(
                f"model {name!r}: there is no local folder {name} and no reachable Hub repo of that id ({error})"
            ) from error
    try:
        config = json.loads(config_file.read_text())
        config["model_type"] = str(config["model_type"])
        return config
    except (ValueError, KeyError, TypeError) as error:
        raise ModelLoadError(f"{config_file} is not a transformers config with a model_type") from error


def _holds_model(folder: Path) -> bool:
    """Whether ``folder`` is a saved model (a ``config.json`` with a ``model_type``) or a peft adapter."""
    if (folder / "adapter_config.json").is_file():
        return True
    try:
        return "model_type" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def model_dir(path: str | os.PathLike) -> str:
    """The folder that holds the model of a local ``path``: the folder itself, else a training run's ``best/``,
    else a LoRA run's ``adapter/`` (``RUN``, ``RUN/best`` and ``RUN/best/adapter`` all name a LoRA run's model).
    Anything else (a Hub repo id, a folder without a model) is returned as given."""
    folder = Path(path)
    if folder.is_dir() and not _holds_model(folder):
        for candidate in (folder / "best", folder / "adapter", folder / "best" / "adapter"):
            if _holds_model(candidate):
                return str(candidate)
    return str(path)


def _adapter_base(path: Path) -> str | None:
    """The base model of a peft adapter folder, or None if ``path`` is not one."""
    if not (path / "adapter_config.json").is_file():
        return None
    from peft import PeftConfig

    base = PeftConfig.from_pretrained(path).base_model_name_or_path
    beside = path / base if base and not Path(base).is_absolute() else None  # a run's relative "../../base"
    return str(beside.resolve()) if beside is not None and beside.is_dir() else base


def _load_own(path: str, config: dict[str, Any], dtype: Any) -> torch.nn.Module:
    """This package's class for the folder; a ``ViSAForReID`` folder gives its embedding model ``.visa``."""
    from transformers import AutoModel

    kwargs = {"dtype": dtype} if dtype is not None else {}
    if config["model_type"] == "visa" and "ViSAForReID" in (config.get("architectures") or ()):
        return modeling_tagclip.ViSAForReID.from_pretrained(path, **kwargs).visa
    return AutoModel.from_pretrained(path, **kwargs)


def _load_processor(path: str, own: str | None, trust_remote_code: bool):
    """TAG-CLIP: its processor. ViSA: the image processor if the folder has one. Other models: theirs, if any."""
    from transformers import AutoImageProcessor, AutoProcessor

    if own == "tagclip":
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    if own == "visa" and Path(path).is_dir() and not (Path(path) / "preprocessor_config.json").is_file():
        return None
    auto = AutoImageProcessor if own == "visa" else AutoProcessor
    try:
        return auto.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None


def _family(name: str, config: dict[str, Any], family: str | None, trust_remote_code: bool) -> str | None:
    """This package's family of the folder's model type (None: a foreign type, allowed by trust_remote_code)."""
    model_type = config["model_type"]
    own = OWN_MODEL_TYPES.get(model_type)
    if own is None and not trust_remote_code:
        raise ModelLoadError(
            f"{name} holds a {model_type!r} model, not one of this package's ({', '.join(OWN_MODEL_TYPES)}); "
            "pass trust_remote_code=True (--trust-remote-code) to load it with the code it ships"
        )
    if family is not None and own is not None and own != family:
        raise ModelLoadError(f"{name} is a {own} model ({model_type!r}); this needs a {family} model")
    return own


def _torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    return dtype


def _load_adapter(name: str, base: str, device, family, trust_remote_code: bool, dtype) -> tuple:
    """A peft adapter folder: its base model (loaded like any folder) with the adapter merged in."""
    from peft import PeftModel

    model, processor = load_model(
        base, device, family=family, trust_remote_code=trust_remote_code, dtype=dtype
    )
    model = PeftModel.from_pretrained(model, name).merge_and_unload().eval()
    if (Path(name) / "processor_config.json").is_file():  # an adapter folder may carry its own processor
        processor = _load_processor(name, family or "tagclip", trust_remote_code)
    return model, processor


def load_model(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    *,
    family: str | None = None,
    trust_remote_code: bool = False,
    dtype: str | torch.dtype | None = None,
) -> tuple[torch.nn.Module, Any]:
    """(model in eval mode on ``device``, processor or None) from a folder, Hub repo id or peft adapter folder
    (a training run's folder or a LoRA run's ``best/`` is resolved to its model by ``model_dir``).

    ``family`` ("tagclip" / "visa") refuses a model of the other family. A peft adapter is loaded onto its base
    model and merged. ``dtype`` ("bf16", "fp16", "fp32" or a torch dtype) is passed to ``from_pretrained``.
    """
    if family is not None and family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    dtype, name = _torch_dtype(dtype), model_dir(path)
    base = _adapter_base(Path(name)) if Path(name).is_dir() else None
    if base is not None:
        return _load_adapter(name, base, device, family, trust_remote_code, dtype)
    config = read_config(name)
    own = _family(name, config, family, trust_remote_code)
    if own is None:
        from transformers import AutoModel

        kwargs = {"dtype": dtype} if dtype is not None else {}
        model = AutoModel.from_pretrained(name, trust_remote_code=True, **kwargs)
    else:
        model = _load_own(name, config, dtype)
    # the model load has reported the config's unknown keys: once is enough
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"\w+: unknown config key")
        processor = _load_processor(name, own, trust_remote_code)
    if own == "tagclip":
        warn_on_processor_size(processor, model.config, name)
    return model.to(device).eval(), processor


def load_visa(path: str | os.PathLike, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A saved ViSA folder (a ``ViSAModel`` or ``ViSAForReID`` checkpoint) as ``ViSAModel`` in eval mode."""
    return load_model(path, device, family="visa")[0]
