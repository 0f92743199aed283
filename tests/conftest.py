"""Shared tiny TAG-CLIP configs and inputs for the tests (no downloads)."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY_EOS = 99
TINY_SOT = 98

# Start of a script run in a fresh process (tagclip_tiny.run_python): `model` is the folder's (sys.argv[1])
# custom code loaded by AutoModel, with this checkout's package out of reach.
FRESH_REMOTE_MODEL = """
import sys
from transformers import AutoModel
try:
    import modeling_tagclip  # noqa: F401
    raise SystemExit("modeling_tagclip must not be importable here")
except ImportError:
    pass
folder = sys.argv[1]
model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
"""


def tiny_config(vision: dict | None = None, text: dict | None = None, **kwargs):
    """A small TagClipConfig: 32x16 images, patch 8, 4 vision blocks with MoE in blocks 1-2."""
    from modeling_tagclip import TagClipConfig

    vision_config = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=[32, 16],
        patch_size=8,
        moe_layers=[1, 2],
    )
    text_config = dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=16,
        bos_token_id=TINY_SOT,
        eos_token_id=TINY_EOS,
    )
    vision_config.update(vision or {})
    text_config.update(text or {})
    defaults = dict(projection_dim=16, tse_embed_dim=24, num_identities=6)
    defaults.update(kwargs)
    return TagClipConfig(vision_config=vision_config, text_config=text_config, **defaults)


def tiny_text(batch: int = 4, length: int = 16, words=(3, 5, 7, 9), seed: int = 0) -> torch.Tensor:
    """Caption ids: SOT, random word ids, EOS, then 0-padding."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch, length, dtype=torch.long)
    for row in range(batch):
        count = words[row % len(words)]
        ids[row, 0] = TINY_SOT
        ids[row, 1 : count + 1] = torch.randint(1, 90, (count,), generator=generator)
        ids[row, count + 1] = TINY_EOS
    return ids


def tiny_pixels(batch: int = 4, seed: int = 0, height: int = 32, width: int = 16) -> torch.Tensor:
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


def train_inputs() -> dict:
    """A mixed-view batch of 4 with view and ID labels, asking for the full loss."""
    return dict(
        pixel_values=tiny_pixels(4),
        input_ids=tiny_text(4),
        view_labels=torch.tensor([0, 1, 0, 1]),
        person_ids=torch.tensor([0, 1, 1, 2]),
        return_loss=True,
    )


@pytest.fixture
def config():
    return tiny_config()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is as fast and does not fight the other test processes for cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
