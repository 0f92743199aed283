"""The loading policy of every model of the package: strict `from_pretrained` with clear errors, a warning for
unknown keys in a loaded config, and weight init on every module.

The ViSA unit carries a generated copy (``utils/fix_copies.py``).
"""

import difflib
import json
import os
import struct
import warnings

import torch
from safetensors import SafetensorError
from torch import nn
from transformers.utils import cached_file

__all__ = ["ClearLoadErrorsMixin", "OwnInitMixin", "UnknownConfigKeyWarning", "WarnUnknownConfigKeysMixin"]

# keys that transformers or the Hub write into any config.json
GENERIC_CONFIG_KEYS = frozenset(
    {"architectures", "auto_map", "custom_pipelines", "transformers_version", "dtype", "torch_dtype"}
    | {"tie_word_embeddings", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "num_labels"}
)


class UnknownConfigKeyWarning(UserWarning):
    """A loaded config holds a key its class does not define (a typo, most likely): it is kept as an attribute
    that no code reads."""


def _closest(key: str, valid: dict) -> str:
    """' (did you mean ...?)' naming the closest valid key, also among the sub-configs' keys, or ''."""
    places: dict[str, list[str]] = {name: [name] for name in valid}
    for sub, value in valid.items():
        if isinstance(value, dict) and sub.endswith("_config"):
            for name in value:
                places.setdefault(name, []).append(f"{sub}.{name}")
    close = difflib.get_close_matches(key, list(places), n=1, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(p) for p in places[close[0]])}?)" if close else ""


def unknown_config_keys(saved: dict, valid: dict, where: str = "") -> list[str]:
    """The keys of a config dict `saved` that the config whose `to_dict()` is `valid` does not know, as
    "unknown config key 'KEY' (did you mean 'CLOSEST'?)"; sub-configs are checked too."""
    problems = []
    for key, value in saved.items():
        if key in GENERIC_CONFIG_KEYS or key.startswith("_"):
            continue
        if key not in valid:
            problems.append(f"unknown config key '{where}{key}'{_closest(key, valid)}")
        elif isinstance(value, dict) and isinstance(valid[key], dict) and key.endswith("_config"):
            problems += unknown_config_keys(value, valid[key], f"{where}{key}.")
    return problems


class WarnUnknownConfigKeysMixin:
    """`from_dict` (used by `from_pretrained` and `AutoConfig`) warns once per load, with an
    `UnknownConfigKeyWarning`, about the keys the config class does not define, each with the closest valid key.
    transformers keeps such keys as attributes by design, so a config still loads; a model's strict
    `from_pretrained` refuses them."""

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        unknown = unknown_config_keys(config_dict, cls().to_dict())
        if unknown:
            warnings.warn(
                f"{cls.__name__}: "
                + "; ".join(unknown)
                + ". Each is kept as an attribute that nothing reads: "
                "fix its name in config.json.",
                UnknownConfigKeyWarning,
                stacklevel=2,
            )
        return super().from_dict(config_dict, **kwargs)


class ClearLoadErrorsMixin:
    """`from_pretrained` that is strict by default, with clear errors (shared by all models).

    A missing local folder is a FileNotFoundError; a corrupt file, missing or shape-mismatched weights,
    unexpected weights (unless the checkpoint is another architecture, e.g. a head dropped when loading the base
    model), checkpoint tensors that are not floating point where the model has floats (e.g. int64), NaN/inf
    weights and unknown `config.json` keys (with the closest valid key) are ValueErrors. `strict=False` keeps
    transformers' lenient load (a report only), e.g. to fine-tune from a partial checkpoint. Loads without a
    checkpoint path (`from_pretrained(None, state_dict=...)`) are not checked.
    """

    strict_loading = True  # the default of `strict`

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, strict: bool | None = None, **kwargs):
        """transformers' `from_pretrained`, strict unless `strict=False` (see the class docstring)."""
        if pretrained_model_name_or_path is None:
            return super().from_pretrained(None, *args, **kwargs)
        path = str(pretrained_model_name_or_path)
        looks_local = os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1
        if not os.path.isdir(path) and (looks_local or os.path.exists(path)):
            raise FileNotFoundError(f"no model folder at {path}")
        want_info = kwargs.pop("output_loading_info", False)
        strict = cls.strict_loading if strict is None else strict
        try:
            with warnings.catch_warnings():
                if strict:  # the error below names the unknown config keys
                    warnings.simplefilter("ignore", UnknownConfigKeyWarning)
                model, info = super().from_pretrained(path, *args, output_loading_info=True, **kwargs)
        except SafetensorError as error:
            raise ValueError(f"corrupt checkpoint in {path}: {error}") from error
        except RuntimeError as error:
            if "ignore_mismatched_sizes" not in str(error):
                raise
            raise ValueError(
                f"checkpoint {path} does not match the model config (tensor shapes differ; the load report "
                "above lists them). Pass ignore_mismatched_sizes=True to re-initialise them."
            ) from error
        if strict:
            problems = cls._load_problems(model, info, path, kwargs)
            if problems:
                raise ValueError(
                    f"checkpoint {path} does not load cleanly into {cls.__name__}: "
                    + "; ".join(problems)
                    + ". Pass strict=False to load it anyway (e.g. to fine-tune from a partial checkpoint)."
                )
        return (model, info) if want_info else model

    @classmethod
    def _load_problems(cls, model, info: dict, path: str, kwargs: dict) -> list[str]:
        """Why a load is not clean: key mismatches, non-float tensors, non-finite weights, unknown config keys."""
        problems = []
        config_file = cls._checkpoint_file(path, "config.json", kwargs)
        saved = {}
        if config_file is not None:
            with open(config_file, encoding="utf-8") as handle:
                saved = json.load(handle)
        ignored = ("mismatched_keys",) if kwargs.get("ignore_mismatched_sizes") else ()
        if cls.__name__ not in (saved.get("architectures") or [cls.__name__]):
            ignored += ("unexpected_keys",)  # e.g. the base model from a checkpoint with a head
        for name in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            found = sorted(str(key) for key in info.get(name) or ()) if name not in ignored else []
            if found:
                more = f" and {len(found) - 5} more" if len(found) > 5 else ""
                problems.append(f"{name.replace('_', ' ')} {found[:5]}{more}")
        state = model.state_dict()
        for key, dtype in cls._checkpoint_dtypes(path, kwargs).items():
            if key in state and state[key].is_floating_point() and dtype not in ("F16", "BF16", "F32", "F64"):
                problems.append(f"tensor {key!r} is stored as {dtype}, not floating point")
        bad = [
            k
            for k, t in state.items()
            if t.is_floating_point() and t.device.type != "meta" and not bool(torch.isfinite(t).all())
        ]
        if bad:
            problems.append(f"NaN or inf values in {bad[:5]}")
        if saved and "config" not in kwargs:
            problems += unknown_config_keys(saved, model.config.__class__().to_dict())
        return problems

    @staticmethod
    def _checkpoint_file(path: str, filename: str, kwargs: dict) -> str | None:
        """The local path of a checkpoint file (from the folder or the Hub cache), or None if it has none."""
        options = ("revision", "cache_dir", "token", "local_files_only", "subfolder")
        found = cached_file(
            path,
            filename,
            _raise_exceptions_for_missing_entries=False,
            **{k: kwargs[k] for k in options if k in kwargs},
        )
        return str(found) if found else None

    @classmethod
    def _checkpoint_dtypes(cls, path: str, kwargs: dict) -> dict[str, str]:
        """Stored dtype of every tensor of the safetensors checkpoint, read from the file headers only."""
        files = []
        single = cls._checkpoint_file(path, "model.safetensors", kwargs)
        if single is not None:
            files.append(single)
        else:
            index = cls._checkpoint_file(path, "model.safetensors.index.json", kwargs)
            if index is not None:
                with open(index, encoding="utf-8") as handle:
                    shards = sorted(set(json.load(handle)["weight_map"].values()))
                files += [os.path.join(os.path.dirname(index), shard) for shard in shards]
        dtypes = {}
        for file in files:
            with open(file, "rb") as handle:
                header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
            dtypes.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
        return dtypes


class OwnInitMixin:
    """Run `_init_weights` on every module, including those that own no parameters directly.

    For code outside `transformers` (ours, loaded locally or with `trust_remote_code`), transformers 5.x
    skips `_init_weights` on any module without direct parameters, assuming remote code that writes in
    place. Our init uses the guarded `transformers.initialization` functions (loaded weights are never
    overwritten), so the skip is not needed, and it would leave CLIP's std on the attention/MLP/router
    Linears unapplied (they are children of parameter-less modules).
    """

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        super()._initialize_weights(module, is_custom_code=False)
