"""``mixed_precision: auto`` prefers bf16 where the GPU supports it; no GPU means fp32."""

import pytest
import torch

from modeling_tagclip.engine.accelerator import resolve_mixed_precision
from modeling_tagclip.engine.config import ConfigError, load_config


def test_without_cuda_every_mixed_precision_trains_in_fp32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert [resolve_mixed_precision(v) for v in ("auto", "bf16", "fp16", "no", None)] == [
        "no",
        "no",
        "no",
        "no",
        None,
    ]


@pytest.mark.parametrize(("bf16", "expected"), [(True, "bf16"), (False, "fp16")])
def test_auto_prefers_bf16_where_the_gpu_has_it(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_mixed_precision("auto") == expected
    assert resolve_mixed_precision("fp16") == "fp16" and resolve_mixed_precision("bf16") == "bf16"


def test_config_accepts_auto_and_names_it_in_errors():
    assert load_config(None, {"mixed_precision": "auto"}).mixed_precision == "auto"
    with pytest.raises(ConfigError, match="mixed_precision must be no, fp16, bf16 or auto, got 'fp8'"):
        load_config(None, {"mixed_precision": "fp8"})


def test_a_launcher_setting_the_config_overrides_is_warned(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with caplog.at_level("WARNING"):
        assert resolve_mixed_precision("auto") == "bf16"
    assert "asked for mixed precision fp16, the config's mixed_precision auto gives bf16" in caplog.text
    caplog.clear()
    assert resolve_mixed_precision(None) is None and resolve_mixed_precision("fp16") == "fp16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert resolve_mixed_precision("auto") == "bf16"
    assert not caplog.text  # no config value, or one giving the launcher's: nothing to say
