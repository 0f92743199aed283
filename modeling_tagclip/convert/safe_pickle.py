"""Load pickled torch checkpoints without executing code.

`safe_torch_load` reads `torch.save` files (zip and legacy format) through an unpickler whose `find_class`
resolves only an allowlist: tensor rebuild functions and storages, torch dtypes/devices/sizes, containers,
a few numpy array/scalar helpers, and `easydict.EasyDict` (read as a plain dict, without importing easydict).
Any other global (`os.system`, `builtins.eval`, arbitrary classes) raises `UnsafeCheckpointError` before it
is called. This is the "restricting globals" recipe of the Python pickle docs, with torch's own storage
handling around it. If `TORCH_FORCE_WEIGHTS_ONLY_LOAD` is set, torch's weights-only loader runs instead
(also safe, but it cannot read EasyDict configs).
"""

from __future__ import annotations

import _compat_pickle
import io
import os
import pickle
import types
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import torch

__all__ = ["UnsafeCheckpointError", "safe_torch_load"]


class UnsafeCheckpointError(ValueError):
    """A checkpoint references a global (function or class) outside the allowlist."""


class _EasyDict(dict):
    """Stand-in for `easydict.EasyDict`: keeps the items, ignores the attribute state (a copy of them)."""

    def __setstate__(self, state: Any) -> None:
        pass


_TORCH_FUNCTIONS = {
    "torch._utils": (
        "_rebuild_tensor",
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_parameter",
        "_rebuild_parameter_with_state",
        "_rebuild_device_tensor_from_cpu_tensor",
    ),
    "torch._tensor": ("_rebuild_from_type_v2",),
    "torch.serialization": ("_get_layout",),
}
_FIXED_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("collections", "Counter"): Counter,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("_codecs", "encode"): __import__("_codecs").encode,  # how protocol 2 pickles bytes
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("easydict", "EasyDict"): _EasyDict,
}
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


def _numpy_global(module: str, name: str) -> Any | None:
    """numpy's array/scalar/dtype reconstruction helpers (data only), or None."""
    if module.split(".")[0] != "numpy":
        return None
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    allowed = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }
    for core_name in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(core_name, "_reconstruct")] = core.multiarray._reconstruct
        allowed[(core_name, "scalar")] = core.multiarray.scalar
    if module == "numpy.dtypes" and name.endswith("DType"):
        dtype_cls = getattr(np.dtypes, name, None)
        return None if dtype_cls is None or dtype_cls is np.dtypes.ObjectDType else dtype_cls
    return allowed.get((module, name))


def _allowed_global(module: str, name: str) -> Any | None:
    """The object a pickle may reference as `module.name`, or None if it is not allowlisted."""
    if (module, name) in _compat_pickle.NAME_MAPPING:  # protocol-2 pickles use Python 2 names
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    if (module, name) in _FIXED_GLOBALS:
        return _FIXED_GLOBALS[(module, name)]
    if name in _TORCH_FUNCTIONS.get(module, ()):
        return getattr(__import__(module, fromlist=[name]), name, None)
    if module == "torch":
        value = getattr(torch, name, None)
        if isinstance(value, _TORCH_VALUE_TYPES) or (
            isinstance(value, type) and value in torch._storage_classes
        ):
            return value
        return None
    return _numpy_global(module, name)


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only allowlisted globals."""

    def find_class(self, module: str, name: str) -> Any:
        value = _allowed_global(module, name)
        if value is None:
            raise UnsafeCheckpointError(
                f"refused global '{module}.{name}': the checkpoint would run code or build an object outside "
                "the allowlist (tensors, containers, primitive types, torch dtypes/sizes, numpy arrays, "
                "easydict.EasyDict). Nothing was executed; only load checkpoints from a source you trust."
            )
        return value


def _restricted_load(file: io.IOBase, **kwargs) -> Any:
    return _RestrictedUnpickler(file, **kwargs).load()


_RESTRICTED_PICKLE = types.ModuleType("tagclip_restricted_pickle")
_RESTRICTED_PICKLE.Unpickler = _RestrictedUnpickler
_RESTRICTED_PICKLE.load = _restricted_load
_RESTRICTED_PICKLE.__version__ = "1"


def _plain(obj: Any) -> Any:
    """Replace EasyDict stand-ins by plain dicts, recursively through dicts, lists and tuples."""
    if isinstance(obj, _EasyDict):
        return {key: _plain(value) for key, value in obj.items()}
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            if isinstance(value, (dict, list, tuple)):
                obj[key] = _plain(value)
        return obj
    if type(obj) is list:
        return [_plain(value) for value in obj]
    if type(obj) is tuple:
        return tuple(_plain(value) for value in obj)
    return obj


def _refuse_torchscript(path: Path) -> None:
    """torch.load would hand a TorchScript archive to torch.jit.load, which runs its code: refuse it."""
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"corrupt checkpoint {path}: {err}") from err
    if any(name.count("/") == 1 and name.endswith("/constants.pkl") for name in names):
        raise UnsafeCheckpointError(
            f"{path} is a TorchScript archive (it holds code); extract its state_dict in a trusted "
            "environment (torch.jit.load(path).state_dict()) and torch.save that instead."
        )


def _weights_only_forced() -> bool:
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")


def _torch_load(path: Path) -> Any:
    """torch.load with the restricted unpickler (torch's own weights-only loader if the env forces it)."""
    if _weights_only_forced():
        with torch.serialization.safe_globals([(_EasyDict, "easydict.EasyDict")]):
            return torch.load(path, map_location="cpu", weights_only=True)
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_RESTRICTED_PICKLE)


def safe_torch_load(path: str | os.PathLike) -> Any:
    """Load a `torch.save` checkpoint on CPU without executing code.

    Raises `FileNotFoundError` for a missing file, `UnsafeCheckpointError` (a `ValueError`) naming the refused
    global for a checkpoint that references anything outside the allowlist, and `ValueError("corrupt
    checkpoint ...")` for a truncated or unreadable file. TorchScript archives are refused (they hold code).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    _refuse_torchscript(path)
    try:
        obj = _torch_load(path)
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(f"{path}: {err}") from None  # raised by find_class: nothing was called
    except pickle.UnpicklingError as err:
        if "GLOBAL" in str(err) or "Can only" in str(err):  # torch's weights-only loader (forced by env)
            hint = "TORCH_FORCE_WEIGHTS_ONLY_LOAD is set: torch's loader ran, it cannot read EasyDict configs"
            raise UnsafeCheckpointError(f"{path}: refused ({hint}): {err}") from None
        raise ValueError(f"corrupt checkpoint {path}: {err}") from err
    except Exception as err:  # truncated zip, bad pickle opcodes, EOF, wrong rebuild arguments, ...
        raise ValueError(f"corrupt checkpoint {path}: {type(err).__name__}: {err}") from err
    return _plain(obj)
