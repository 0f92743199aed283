"""The tests' shared helpers, in one place: tiny TAG-CLIP and ViSA configs and inputs, tiny saved models and
synthetic galleries, and fresh-process runners (no downloads).

Fixtures that pytest injects by name (``config``, ``one_thread``) stay in ``conftest.py``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]

# The main job shrunk to seconds: 12 identities at 32x16, 2 vision blocks (MoE in one), 1 text block, batch 4, no
# plots. Callers add how long it runs (``--max-steps``, ``--num-train-epochs``) and where it writes.
TINY_TRAIN_ARGS = [
    "--set",
    "synthetic.num_identities=12",
    "--set",
    "synthetic.image_size=[32,16]",
    "--image-size",
    "[32,16]",
    "--set",
    "model.vision_config.num_hidden_layers=2",
    "--set",
    "model.vision_config.moe_layers=[1]",
    "--set",
    "model.text_config.num_hidden_layers=1",
    "--per-device-batch-size",
    "4",
    "--plots",
    "false",
]

# ----------------------------------------------------------------------------------------------------------
# TAG-CLIP: tiny configs and inputs
# ----------------------------------------------------------------------------------------------------------

TINY_EOS = 99
TINY_SOT = 98
REAL_TEXT = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=49406, eos_token_id=49407)


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


def eval_config():
    """The evaluator tests' TagClipConfig: 64x32 images, patch 16, 3 blocks with HR-MoE in block 1, the real
    CLIP vocabulary."""
    vision = dict(
        num_hidden_layers=3, num_attention_heads=2, image_size=[64, 32], patch_size=16, moe_layers=[1]
    )
    return tiny_config(vision=vision, text=dict(num_attention_heads=2, **REAL_TEXT), num_identities=0)


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
    """Random ``(batch, 3, height, width)`` images."""
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


# ----------------------------------------------------------------------------------------------------------
# transformers CLIP: the converters' tiny input
# ----------------------------------------------------------------------------------------------------------

CLIP_VOCAB, CLIP_EOS, CLIP_SOT = 99, 98, 97
# tiny widths (32) are not multiples of 64: heads must be given to the official-layout converter
CLIP_HEADS = 4


def tiny_clip_config(**text):
    """A tiny transformers CLIPConfig (the converters' input): 32-wide towers, 32x32 images, patch 8; ``text``
    overrides text settings."""
    from transformers import CLIPConfig

    return CLIPConfig(
        text_config=dict(
            vocab_size=CLIP_VOCAB,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=CLIP_HEADS,
            max_position_embeddings=16,
            eos_token_id=CLIP_EOS,
            bos_token_id=CLIP_SOT,
            pad_token_id=1,
            **text,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=3,
            num_attention_heads=CLIP_HEADS,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=16,
    )


# ----------------------------------------------------------------------------------------------------------
# ViSA: tiny config and inputs
# ----------------------------------------------------------------------------------------------------------

TINY_VISA = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=[32, 16],
    patch_size=8,
    patch_stride=[4, 4],
    num_experts=3,
    num_prompt_tokens=2,
    expert_top_k=2,
    expert_intermediate_size=24,
    graph_top_k=5,
    fusion_intermediate_size=40,
    num_identities=4,
    drop_path_rate=0.0,
)
VISA_VIEWS = torch.tensor([0, 1, 0, 1, 1, 0])
VISA_LABELS = torch.tensor([0, 0, 1, 1, 2, 2])


def tiny_visa_config(**kwargs):
    """A ViSAConfig with 7x3 = 21 patches of a 32x16 image, 3 blocks, 3 experts of M = 2 tokens, top-5 graphs."""
    from modeling_tagclip.models.visa.configuration_visa import ViSAConfig

    return ViSAConfig(**{**TINY_VISA, **kwargs})


def visa_pixels(batch: int = 6, seed: int = 0) -> torch.Tensor:
    """Random ``(batch, 3, 32, 16)`` images for the tiny ViSA."""
    return tiny_pixels(batch, seed)


def perturb_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Randomise zero-initialised tokens (view tokens) and BN statistics so nothing is trivially equal."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "view_token" in name or "bnneck" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5 + ("weight" in name))
        for name, buffer in model.named_buffers():
            if "running_mean" in name:
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
            elif "running_var" in name:
                buffer.copy_(torch.rand(buffer.shape, generator=generator) + 0.5)
    return model


def make_visa_model(seed: int = 0, cls=None, **kwargs) -> torch.nn.Module:
    """A tiny ViSA (``cls``, default ``ViSAModel``) in eval mode, seeded and `perturb_`-ed; ``kwargs`` override
    `TINY_VISA`."""
    from modeling_tagclip.models.visa.modeling_visa import ViSAModel

    torch.manual_seed(seed)
    return perturb_((cls or ViSAModel)(tiny_visa_config(**kwargs)), seed).eval()


def init_rule(name: str, config) -> tuple[str, float]:
    """The init each parameter of a fresh model must follow: ("normal", std), ("uniform", bound), ("const", v).

    CLIP layers: transformers' CLIP init. TSE `proj`/`mlp_fc1`/`mlp_fc2`: PyTorch's default `nn.Linear` init,
    which the reference keeps (kaiming-uniform a=sqrt(5) = U(+-1/sqrt(fan_in)), bias U(+-1/sqrt(fan_in))).
    """
    vision, text = config.vision_config, config.text_config
    tower = vision if name.startswith("vision_model") else text
    width, depth = tower.hidden_size, tower.num_hidden_layers
    leaf = name.rsplit(".", 1)[-1]
    if "_tse." in name:
        if "mlp_bn" in name:
            return ("const", 1.0) if leaf == "weight" else ("const", 0.0)
        fan_in = config.projection_dim
        return "uniform", fan_in**-0.5
    if "norm" in name or "layrnorm" in name:
        return ("const", 1.0) if leaf == "weight" else ("const", 0.0)
    if leaf == "bias":
        return "const", 0.0
    if "router" in name:
        return "normal", vision.router_init_std
    if name == "logit_scale":
        return "const", config.logit_scale_init_value
    if name.startswith("classifier"):
        return "normal", 0.001
    if name in ("visual_projection.weight", "text_projection.weight"):
        return "normal", width**-0.5
    if leaf in ("class_embedding", "view_token"):
        return "normal", width**-0.5
    if name.startswith("vision_model.embeddings."):
        return "normal", vision.initializer_range
    if name.startswith("text_model.embeddings."):
        return "normal", 0.02
    if any(p in name for p in ("q_proj", "k_proj", "v_proj")):
        return "normal", width**-0.5 * (2 * depth) ** -0.5
    if "out_proj" in name:
        return "normal", width**-0.5
    if "fc1" in name:
        return "normal", (2 * width) ** -0.5
    if "fc2" in name:
        return "normal", width**-0.5 * (2 * depth) ** -0.5
    raise AssertionError(f"no init rule for {name}")


def assert_follows_init_rule(name: str, param: torch.Tensor, rule: tuple[str, float]) -> None:
    """``param``'s statistics match ``rule`` (`init_rule`): its std and mean, its bound if uniform."""
    kind, value = rule
    param = param.detach().float()
    if kind == "const":
        assert torch.all(param == value), name
        return
    tolerance = 0.1 if param.numel() >= 1000 else 0.3
    std = value if kind == "normal" else value / math.sqrt(3)
    assert abs(float(param.std()) / std - 1) < tolerance, (
        f"{name}: std {float(param.std()):.4g}, want {std:.4g}"
    )
    assert abs(float(param.mean())) < 4 * std / math.sqrt(param.numel()), name
    if kind == "uniform":
        assert float(param.abs().max()) <= value, name


# ----------------------------------------------------------------------------------------------------------
# Saved models and synthetic data
# ----------------------------------------------------------------------------------------------------------


def tiny_model(seed: int = 0):
    """(model, processor): the tiny config with the real CLIP vocabulary, 32x16 images."""
    from modeling_tagclip import TagClipModel, TagClipProcessor

    torch.manual_seed(seed)
    return TagClipModel(tiny_config(text=REAL_TEXT)).eval(), TagClipProcessor.from_defaults(32, 16)


def save_tiny_model(folder: Path, seed: int = 0) -> Path:
    """Save a tiny model with the retrieval pipeline code (as the push and the training code do)."""
    from modeling_tagclip.retrieval.pipeline_tagclip import save_with_pipeline

    model, processor = tiny_model(seed)
    return save_with_pipeline(model, processor, folder)


def save_eval_model(folder: Path) -> Path:
    """A tiny 64x32 TAG-CLIP (`eval_config`) and its processor saved in ``folder``, for evaluator runs."""
    from modeling_tagclip import TagClipModel, TagClipProcessor

    torch.manual_seed(0)
    TagClipModel(eval_config()).save_pretrained(folder)
    TagClipProcessor.from_defaults(64, 32).save_pretrained(folder)
    return folder


def synthetic_gallery(folder: Path, identities: int = 6) -> Path:
    """A tiny synthetic aerial-ground dataset (TAG-PEDES layout); returns its root."""
    from modeling_tagclip.data.synthetic import generate_dataset

    generate_dataset(folder, num_identities=identities, seed=3, image_size=(64, 32), progress=False)
    return folder


def model_and_gallery(root: Path) -> dict[str, Path]:
    """A saved tiny TAG-CLIP (``model``) and a synthetic gallery (``data``; its crops: ``images``) under ``root``."""
    data = synthetic_gallery(root / "data")
    return {"root": root, "model": save_tiny_model(root / "model"), "data": data, "images": data / "images"}


def one_error_line(capsys, verb: str | None = None) -> str:
    """What a command printed on stderr, checked to be one error line without a traceback (``tagclip VERB:
    error: ...`` when ``verb`` is given)."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    if verb is not None:
        assert err.startswith(f"tagclip {verb}: error: "), err
    return err


def synthetic_eval_set(folder: Path) -> Path:
    """The 16-identity 64x32 synthetic set the evaluator tests score."""
    from modeling_tagclip.data.synthetic import generate_dataset

    generate_dataset(folder, num_identities=16, seed=1, image_size=(64, 32), progress=False)
    return folder


def write_png(path: Path) -> None:
    """A 4x8 single-colour PNG at ``path`` (folders created)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 8), (10, 20, 30)).save(path)


def write_annotations(path: Path, entries: list) -> Path:
    """``entries`` as a JSON annotation file at ``path`` (folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries))
    return path


def make_tagpedes(root: Path, train: list[dict], test: list[dict]) -> Path:
    """TAG-PEDES layout: root/anno_dir/{train,test}_reid.json, root/images/<file_path>."""
    for name, entries in [("train", train), ("test", test)]:
        write_annotations(root / "anno_dir" / f"{name}_reid.json", entries)
        for e in entries:
            write_png(root / "images" / e["file_path"])
    return root


def tag_entry(pid: int, name: str, cam_id=None, n_captions: int = 2) -> dict:
    """A TAG-PEDES entry of person ``pid`` with image ``pid/name.png`` and ``n_captions`` captions."""
    entry = {
        "id": pid,
        "file_path": f"{pid}/{name}.png",
        "captions": [f"person {pid} {i}" for i in range(n_captions)],
    }
    if cam_id is not None:
        entry["cam_id"] = cam_id
    return entry


def build_tiny_vlm(path: Path) -> Path:
    """Save a random 2-layer LLaVA (CLIP vision + Llama) with an in-memory byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    chat = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' }}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{{ '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    )
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=chat,
        image_token="<image>",
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    text = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>")
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    letters = torch.tensor(tok.convert_tokens_to_ids(list(string.ascii_letters)))
    with torch.no_grad():  # only letters can win the argmax: never EOS, never blank -> stable plumbing checks
        head = model.lm_head.weight
        keep = head[letters].clone()
        head.zero_()
        head[letters] = keep
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------------------
# Retrieval metrics
# ----------------------------------------------------------------------------------------------------------


def assert_metrics_close(got, expected):
    """The same metric keys, each value within 1e-9."""
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key


def argsort_reference(sim, q_ids, g_ids, g_views, ks=(1, 5, 10)):
    """The evaluator before streaming: stable argsort of every full row, the breakdown by re-sorting groups."""
    from modeling_tagclip.metrics.retrieval import MATCH_VIEW_GROUPS

    sim, q_ids, g_ids, g_views = map(np.asarray, (sim, q_ids, g_ids, g_views))

    def metrics(rows):
        order = np.argsort(-sim[rows], axis=1, kind="stable")
        matches = g_ids[order] == q_ids[rows][:, None]
        first = matches.argmax(1)
        last = matches.shape[1] - 1 - matches[:, ::-1].argmax(1)
        precision = matches.cumsum(1) / np.arange(1, matches.shape[1] + 1)
        out = {f"R@{k}": 100 * float(np.mean(first < k)) for k in ks}
        out["mAP"] = 100 * float(np.mean((precision * matches).sum(1) / matches.sum(1)))
        out["mINP"] = 100 * float(np.mean(matches.sum(1) / (last + 1.0)))
        return out

    aerial, ground = set(g_ids[g_views == 0].tolist()), set(g_ids[g_views == 1].tolist())
    groups = np.array([2 if q in aerial and q in ground else 0 if q in aerial else 1 for q in q_ids.tolist()])
    breakdown = {
        name: {**metrics(np.flatnonzero(groups == g)), "num_queries": int((groups == g).sum())}
        for g, name in enumerate(MATCH_VIEW_GROUPS)
        if (groups == g).any()
    }
    return metrics(np.arange(len(q_ids))), breakdown


# ----------------------------------------------------------------------------------------------------------
# Fresh processes
# ----------------------------------------------------------------------------------------------------------

# Start of a script run in a fresh process (`run_python`): `model` is the folder's (sys.argv[1]) custom code
# loaded by AutoModel, with this checkout's package out of reach.
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

# `python -I` keeps the checkout off sys.path, but an editable install still finds the packages: mark them
# missing so the subprocess is a user who has only transformers (an import of them raises ImportError).
HIDE_PROJECT = "import sys\nsys.modules.update({'modeling_tagclip': None, 'training': None})\n"


def clean_env(tmp: Path, **extra: str) -> dict[str, str]:
    """Environment for a fresh subprocess: no package on the path, private HF cache, one thread."""
    env = {"PATH": "/usr/bin:/bin", "HF_HOME": str(tmp / "hf"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.update(extra)
    return env


def repo_env(tmp: Path, **extra: str) -> dict[str, str]:
    """Environment for a subprocess that runs project code from the repository root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHON"))}
    env.update({"PYTHONPATH": str(REPO_ROOT), "HF_HOME": str(tmp / "hf"), "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def run_python(code: str, args: list[str], cwd: Path, env: dict[str, str], timeout: int = 300):
    """Run ``code`` with ``python -I`` where this project's packages are not importable; return the result."""
    result = subprocess.run(
        [sys.executable, "-I", "-c", HIDE_PROJECT + code, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


# ----------------------------------------------------------------------------------------------------------
# Milvus Lite: `tagclip index` runs into a collection "g", and its rows
# ----------------------------------------------------------------------------------------------------------

TAGCLIP_CLI = ["-m", "modeling_tagclip.cli"]
MILVUS_INDEX = [
    "index",
    "--batch-size",
    "2",
    "--shard-size",
    "3",
    "--workers",
    "0",
    "--quiet",
    "--device",
    "cpu",
]


def milvus_index_cli(
    prefix: list[str], model: Path, images: Path, uri: str, *extra: str
) -> subprocess.CompletedProcess:
    """``tagclip index`` of ``images`` into collection "g" at ``uri``, started with ``prefix`` (a python, torchrun
    or ``python -c CODE`` command line)."""
    args = [
        *MILVUS_INDEX,
        "--model",
        str(model),
        "--images",
        str(images),
        "--milvus-uri",
        uri,
        "--collection",
        "g",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [*prefix, *args, *extra],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )


def milvus_rows(uri: str) -> list[dict]:
    """Every row of collection "g" at ``uri``, by id."""
    from modeling_tagclip.retrieval.milvus import MilvusGallery

    with MilvusGallery(uri, "g") as gallery:
        rows = gallery.client.query("g", filter="", output_fields=["*"], limit=16384)
    return sorted(rows, key=lambda row: row["id"])


def assert_same_milvus_rows(a: list[dict], b: list[dict], count: int = 20) -> None:
    """``count`` rows in each, equal field by field (vectors within 1e-6)."""
    assert len(a) == len(b) == count
    for x, y in zip(a, b, strict=True):
        assert {k: v for k, v in x.items() if k != "vector"} == {k: v for k, v in y.items() if k != "vector"}
        assert torch.allclose(torch.tensor(x["vector"]), torch.tensor(y["vector"]), atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# Training runs (a fresh process each) and the engine's stand-ins
# ----------------------------------------------------------------------------------------------------------

TRAIN_SCRIPT = REPO_ROOT / "training" / "train.py"

TINY_TRAIN = {  # the settings of the training runs: a 3-block TAG-CLIP at 64x32
    "image_size": [64, 32],
    "synthetic": None,
    "model": {
        "vision_config": {
            "initializer_range": 0.05,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "patch_size": 8,
            "moe_layers": [1],
        },
        "text_config": {
            "initializer_range": 0.05,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
        },
        "projection_dim": 64,
        "tse_embed_dim": 64,
        "logit_scale_init_value": 2.6593,
        "lambda_ortho": 0.01,
    },
    "per_device_batch_size": 16,
    "num_train_epochs": 2,
    "learning_rate": 1.0e-3,
    "lr_end": 1.0e-4,
    "warmup_epochs": 1,
    "freeze_patch_embedding": False,
    "text_max_length": 48,
    "save_steps": 0,
    "eval_every_epochs": 2,
    "eval_batch_size": 64,
    "plots": False,
    "num_threads": 1,  # as the tests' OMP_NUM_THREADS: the job's default is every core
}

EXACT_TRAIN = {  # settings under which one process and two train alike
    "augment": False,
    "model": {
        "use_tse": False,  # TSE BatchNorm statistics are per process (no SyncBatchNorm on CPU)
        "vision_config": {"router_noise_std": 0.0},
        "text_config": {"attention_dropout": 0.0},
    },
    "warmup_epochs": 0,
}

TINY_VISA_TRAIN = {  # the model settings of the ViSA training runs
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "image_size": [32, 16],
    "patch_size": 8,
    "patch_stride": [4, 4],
    "num_experts": 3,
    "num_prompt_tokens": 2,
    "expert_intermediate_size": 64,
    "graph_top_k": 8,
    "fusion_intermediate_size": 64,
}


def merge_settings(base: dict, update: dict) -> dict:
    """``base`` with ``update`` merged in, nested mappings key by key."""
    out = dict(base)
    for key, value in update.items():
        out[key] = (
            merge_settings(out[key], value)
            if isinstance(out.get(key), dict) and isinstance(value, dict)
            else value
        )
    return out


def train_env() -> dict[str, str]:
    """The environment of a training run's process: one thread, offline, the repository importable."""
    env = dict(os.environ)
    env.update(
        {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    )
    return env


def run_train(tmp: Path, name: str, config: dict, *args: str, launcher: list[str] | None = None) -> str:
    """Run train.py in a subprocess with ``config`` (merged into TINY_TRAIN); return stdout+stderr."""
    cfg_file = tmp / f"{name}.yaml"
    cfg_file.write_text(yaml.safe_dump(merge_settings(TINY_TRAIN, config)))
    cmd = (launcher or [sys.executable]) + [
        str(TRAIN_SCRIPT),
        "--config",
        str(cfg_file),
        "--output",
        str(tmp / name),
    ]
    # own session, so a timeout kills the launcher *and* its ranks (no orphans holding the cores)
    proc = subprocess.Popen(
        [*cmd, *args],
        cwd=REPO_ROOT,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=1800)  # a hang guard, not a time budget (runs share the CPU)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{name} timed out; output so far:\n{output}"[-4000:])
    assert proc.returncode == 0, output[-4000:]
    return output


def records(out_dir: Path, kind: str = "train") -> dict[int, dict]:
    """A run's ``metrics.jsonl`` records of ``kind``, by step."""
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r.get("kind") == kind}


def render_train_set(folder: Path, identities: int, image_size: tuple[int, int] = (64, 32)) -> Path:
    """The embedded synthetic set rendered into ``folder`` (the training runs' data)."""
    from modeling_tagclip.data.synthetic import generate_dataset

    generate_dataset(folder, num_identities=identities, seed=0, image_size=image_size, progress=False)
    return folder


def free_port() -> int:
    """A TCP port free on this machine now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OneProcess:
    """The accelerator surface ``save_checkpoint`` / ``load_checkpoint`` use, for one process."""

    is_main_process = True
    device = torch.device("cpu")
    scaler = None

    def wait_for_everyone(self) -> None:
        pass

    def unwrap_model(self, model, keep_torch_compile: bool = True):
        return model


def model_and_optimizer(kind: str = "adamw"):
    """A tiny Linear-BatchNorm-Linear model and its AdamW (or SGD with momentum) optimizer, seeded."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if kind == "adamw"
        else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    )
    return model, opt


def optimizer_steps(model, opt, n: int, seed: int = 1) -> list[float]:
    """``n`` optimizer steps on seeded random batches; the losses."""
    losses = []
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        loss = model(torch.randn(8, 4, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


CLIP_SIZE = 32  # convert_tiny_clip's input size: the converted init is square, 32x32 (as a 224x224 CLIP ViT-B/16); the recipe trains at 64x32


def save_tiny_hf_clip(folder: Path) -> Path:
    """A transformers ``CLIPModel`` with a tiny config and the real CLIP vocabulary, saved as a user downloads it."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = CLIPConfig(
        vision_config={**sizes, "image_size": CLIP_SIZE, "patch_size": 8},
        text_config={
            **sizes,
            "vocab_size": 49408,
            "max_position_embeddings": 77,
            "bos_token_id": 49406,
            "eos_token_id": 49407,
        },
        projection_dim=32,
    )
    CLIPModel(config).save_pretrained(folder)
    return folder


def saved_size(folder: Path) -> list[int]:
    """[H, W] that ``config.json`` records (a square size may be saved as one int)."""
    size = json.loads((folder / "config.json").read_text())["vision_config"]["image_size"]
    return [size, size] if isinstance(size, int) else size


def convert_tiny_clip(root: Path) -> Path:
    """``convert hf-clip`` of the tiny CLIP into ``root/tagclip-init``, kept at its own 32x32 grid (no --image-size)."""
    from modeling_tagclip.convert.tagclip import convert_hf_clip

    convert_hf_clip(save_tiny_hf_clip(root / "hf-clip"), root / "tagclip-init", tse_embed_dim=32)
    assert saved_size(root / "tagclip-init") == [CLIP_SIZE, CLIP_SIZE]
    return root / "tagclip-init"
