"""Gradient caching (``grad_cache_chunks``): a batch's loss in k chunks with the loss, gradients and BatchNorm
statistics of one full-batch step; RNG replay per chunk; config errors; a real run that resumes step-exactly."""

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from fixtures import tiny_config, tiny_pixels, tiny_text

from modeling_tagclip import TagClipModel
from modeling_tagclip.engine import grad_cache
from modeling_tagclip.engine.config import ConfigError, parse_args
from modeling_tagclip.engine.tasks import tagclip as T

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root holds benchmarks/
from benchmarks import bench_grad_cache  # noqa: E402

BATCH = 8
ALPHA = 0.3


def batch_of(size: int = BATCH) -> dict:
    return dict(
        pixel_values=tiny_pixels(size, seed=1),
        input_ids=tiny_text(size, seed=1),
        view_labels=torch.arange(size) % 2,
        person_ids=torch.arange(size) * 7 % 6,
    )


def model_pair(**vision) -> tuple[TagClipModel, TagClipModel]:
    """Two identical tiny models in train mode (BatchNorm on batch statistics), the ortho loss on."""
    torch.manual_seed(0)
    model = TagClipModel(
        tiny_config(vision=vision, text={"attention_dropout": 0.0}, lambda_ortho=0.5)
    ).train()
    return model, copy.deepcopy(model)


def full_step(model, batch: dict) -> tuple[torch.Tensor, dict]:
    loss, logs = T.training_loss(model, batch, ALPHA)
    loss.backward()
    return loss.detach(), logs


def cached_step(model, batch: dict, chunks: int) -> tuple[torch.Tensor, dict]:
    return T.cached_training_loss(model, batch, ALPHA, chunks, backward=torch.Tensor.backward)


def assert_same_step(full: TagClipModel, chunked: TagClipModel, atol: float = 1e-5) -> None:
    """Every parameter's gradient (None in both or equal) and every buffer (BatchNorm statistics) equal."""
    for (name, a), b in zip(full.named_parameters(), chunked.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=atol, rtol=1e-5, msg=name)
    for (name, a), b in zip(full.named_buffers(), chunked.buffers(), strict=True):
        torch.testing.assert_close(b, a, atol=atol, rtol=1e-5, msg=name)


@pytest.mark.parametrize("chunks", [2, 3, 4])  # 3: uneven chunks of 3, 3, 2
def test_chunked_step_equals_the_full_batch_step(chunks):
    full, chunked = model_pair(router_noise_std=0.0)  # deterministic routing: the full batch draws no noise
    loss, logs = full_step(full, batch_of())
    cached_loss, cached_logs = cached_step(chunked, batch_of(), chunks)
    assert not cached_loss.requires_grad
    assert cached_loss.item() == pytest.approx(loss.item(), abs=1e-5)
    assert set(cached_logs) == set(logs) >= {"loss_nitc", "loss_ritc", "loss_id", "loss_view", "loss_ortho"}
    for key in logs:
        assert cached_logs[key].item() == pytest.approx(logs[key].item(), abs=1e-5), key
    assert_same_step(full, chunked)
    # the parameters used only in step 2 got their gradient there; BN statistics moved once, as in one step
    assert chunked.logit_scale.grad.abs().item() > 0 and chunked.classifier.weight.grad.abs().sum() > 0
    assert chunked.visual_tse.mlp_bn.num_batches_tracked.item() == 1


def test_paper_ortho_variant_reaches_the_view_embeddings():
    full, chunked = model_pair(router_noise_std=0.0)
    for model in (full, chunked):
        model.config.ortho_variant = "paper"
    full_loss, _ = full_step(full, batch_of())
    assert cached_step(chunked, batch_of(), 2)[0].item() == pytest.approx(full_loss.item(), abs=1e-5)
    assert_same_step(full, chunked)


def test_tse_batchnorm_couples_the_batch_so_the_cut_is_before_it():
    """A naive per-chunk forward normalises TSE with per-chunk statistics (other embeddings, two updates of the
    running statistics); tower features per chunk, embedded by TSE on the whole batch, give the full batch's."""
    model, naive = model_pair(router_noise_std=0.0)
    cut = copy.deepcopy(model)
    pixels = batch_of()["pixel_values"]
    full = model.get_image_features(pixels).local_embeds
    per_chunk = torch.cat([naive.get_image_features(chunk).local_embeds for chunk in pixels.chunk(2)])
    assert (per_chunk - full).abs().max() > 1e-2
    assert naive.visual_tse.mlp_bn.num_batches_tracked.item() == 2
    fields = grad_cache.concat(
        [{"tse_tokens": cut.image_tower_features(chunk)["tse_tokens"]} for chunk in pixels.chunk(2)]
    )
    torch.testing.assert_close(cut.embed_tse(fields, cut.visual_tse).local_embeds, full, atol=1e-5, rtol=1e-5)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(
            getattr(cut.visual_tse.mlp_bn, name), getattr(model.visual_tse.mlp_bn, name)
        )


def replay_reference(model, batch: dict, chunks: int) -> torch.Tensor:
    """The same chunked computation with every chunk's graph kept (no caching): what GradCache must equal."""
    parts = grad_cache.split_batch(batch, chunks)
    reps = grad_cache.concat([T.encode_towers(model, part) for part in parts])
    image = model.embed_tse(reps["image"], model.visual_tse)
    text = model.embed_tse(reps["text"], model.textual_tse)
    out = model.heads(image, text, batch["view_labels"], batch["person_ids"], True, ALPHA)
    out.loss.backward()
    return out.loss.detach()


def test_randomness_is_replayed_per_chunk(monkeypatch):
    """Router noise, Gumbel routing and text dropout: pass 3 of a chunk draws what pass 1 drew, so the cached
    gradients belong to the same forward; without the RNG replay they do not."""

    def models():
        torch.manual_seed(0)
        config = tiny_config(
            vision={"router_noise_std": 0.5, "routing": "gumbel"}, text={"attention_dropout": 0.2}
        )
        model = TagClipModel(config).train()
        return model, copy.deepcopy(model)

    reference, chunked = models()
    torch.manual_seed(5)
    loss = replay_reference(reference, batch_of(), 2)
    torch.manual_seed(5)
    assert cached_step(chunked, batch_of(), 2)[0].item() == pytest.approx(loss.item(), abs=1e-5)
    assert_same_step(reference, chunked)

    _, unreplayed = models()
    monkeypatch.setattr(grad_cache.RngState, "restore", lambda self: None)
    torch.manual_seed(5)
    cached_step(unreplayed, batch_of(), 2)
    with pytest.raises(AssertionError):
        assert_same_step(reference, unreplayed, atol=1e-3)


def test_activation_memory_is_one_chunk_plus_the_heads():
    peaks = {}
    for chunks in (1, 4, 8):
        model, _ = model_pair(router_noise_std=0.0)
        meter = bench_grad_cache.SavedActivations()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            if chunks == 1:
                full_step(model, batch_of(16))
            else:
                cached_step(model, batch_of(16), chunks)
        peaks[chunks] = meter.peak
    assert peaks[4] < 0.4 * peaks[1] and peaks[8] < 0.75 * peaks[4], peaks


def test_benchmark_script_quick(tmp_path):
    threads = torch.get_num_threads()
    rows = bench_grad_cache.main(["--quick", "--repeats", "1", "--output", str(tmp_path / "gc.json")])["rows"]
    torch.set_num_threads(threads)
    assert [row["chunks"] for row in rows] == [1, 2, 4]
    assert rows[0]["saved_mib"] > rows[1]["saved_mib"] > rows[2]["saved_mib"] > 0
    assert json.loads((tmp_path / "gc.json").read_text())["rows"] == rows


def test_gradient_buckets_bound_the_all_reduce_buffer():
    grads = [torch.zeros(3), torch.zeros(2), torch.zeros(7), torch.zeros(1, dtype=torch.float16)]
    buckets = grad_cache._buckets(grads, limit=5)
    assert [[g.numel() for g in b] for b in buckets] == [[3, 2], [7], [1]]


@pytest.mark.parametrize("value", ["0", "-2", "17"])
def test_bad_chunk_counts_are_config_errors(value):
    with pytest.raises(
        ConfigError, match="grad_cache_chunks must be between 1 .off. and per_device_batch_size"
    ):
        parse_args(["--per_device_batch_size", "16", "--grad_cache_chunks", value])
    assert (
        parse_args(["--per_device_batch_size", "16", "--grad_cache_chunks", "16"])[1].grad_cache_chunks == 16
    )


def test_split_batch_errors_and_uneven_sizes():
    parts = grad_cache.split_batch({"a": torch.arange(5), "b": torch.arange(10).reshape(5, 2), "c": "x"}, 2)
    assert [p["a"].tolist() for p in parts] == [[0, 1, 2], [3, 4]] and parts[1]["c"] == "x"
    with pytest.raises(ValueError, match="cannot split a batch of 5 into 6 chunks"):
        grad_cache.split_batch({"a": torch.arange(5)}, 6)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        grad_cache.split_batch({"a": torch.arange(5), "b": torch.arange(4)}, 2)


# ----------------------------------------------------------------------------- a real run (subprocess)

RUN = {
    "augment": False,
    "model": {"vision_config": {"router_noise_std": 0.0}, "text_config": {"attention_dropout": 0.0}},
    "warmup_epochs": 0,
    "max_steps": 4,
    "save_steps": 2,
    "model_selection": "last",
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from modeling_tagclip.data.synthetic import generate_dataset

    out = tmp_path_factory.mktemp("synthetic")
    generate_dataset(out, num_identities=24, seed=0, image_size=(64, 32), progress=False)
    return out


@pytest.mark.slow
def test_training_run_matches_the_full_batch_and_resumes_exactly(tmp_path, data_dir):
    """``--set grad_cache_chunks=4``: the logged losses of 4 steps are the full-batch run's (deterministic
    routing, no dropout); interrupted after step 2 and resumed, the run repeats itself step for step."""
    from fixtures import records, run_train

    from modeling_tagclip.engine.checkpoint import checkpoint_dirs

    cfg = {**RUN, "data_dir": str(data_dir)}
    run_train(tmp_path, "plain", cfg)
    run_train(tmp_path, "cached", cfg, "--set", "grad_cache_chunks=4")
    run_train(tmp_path, "resumed", cfg, "--set", "grad_cache_chunks=4", "--stop_after_steps", "2")
    assert [p.name for p in checkpoint_dirs(tmp_path / "resumed")] == ["step_2"]
    output = run_train(
        tmp_path, "resumed", cfg, "--set", "grad_cache_chunks=4", "--resume_from_checkpoint", "latest"
    )
    assert "resuming from" in output and "gradient caching: each batch of 16 pairs in 4 chunks" in output
    plain, cached, resumed = (records(tmp_path / name) for name in ("plain", "cached", "resumed"))
    assert sorted(plain) == sorted(cached) == sorted(resumed) == [1, 2, 3, 4]
    for step in range(1, 5):
        for key in ("loss", "loss_nitc", "loss_ritc", "loss_id", "loss_view", "loss_ortho"):
            assert cached[step][key] == pytest.approx(plain[step][key], abs=1e-4), (step, key)
        assert resumed[step]["loss"] == pytest.approx(cached[step]["loss"], abs=1e-6), step
    assert json.loads((tmp_path / "cached" / "config.json").read_text())["grad_cache_chunks"] == 4


@pytest.mark.slow
def test_two_processes_cached_match_two_processes_full_batch(tmp_path, data_dir):
    """DDP on 2 CPU processes: negatives all-gathered in the one loss call, the gradients averaged in one
    all-reduce after the last chunk: the same losses as the plain DDP step (TSE BatchNorm per process in both)."""
    from fixtures import free_port as _free_port
    from fixtures import records, run_train

    accelerate = str(Path(sys.executable).with_name("accelerate"))
    launcher = [
        accelerate,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
    ]
    cfg = {**RUN, "data_dir": str(data_dir), "per_device_batch_size": 8}
    os.environ["ACCELERATE_USE_CPU"] = "1"
    try:
        run_train(tmp_path, "plain", cfg, "--stop_after_steps", "3", launcher=launcher)
        output = run_train(
            tmp_path,
            "cached",
            cfg,
            "--set",
            "grad_cache_chunks=2",
            "--stop_after_steps",
            "3",
            launcher=launcher,
        )
    finally:
        os.environ.pop("ACCELERATE_USE_CPU")
    assert "gradient caching: each batch of 8 pairs in 2 chunks" in output
    plain, cached = records(tmp_path / "plain"), records(tmp_path / "cached")
    assert sorted(plain) == sorted(cached) == [1, 2, 3]
    for step in (1, 2, 3):  # steps 2 and 3 follow updates: the averaged gradients agree
        for key in ("loss", "loss_nitc", "loss_ritc", "loss_id", "loss_view", "loss_ortho"):
            assert cached[step][key] == pytest.approx(plain[step][key], abs=1e-4), (step, key)
