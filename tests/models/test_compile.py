"""`torch.compile(fullgraph=True)` of the towers and the full training loss: no graph break, eager's numbers.

Eager and compiled graphs both run the sparse MoE dispatch (device-side sort, grouped GEMMs through a custom op);
the compiled graphs skip the value-reading input checks. `fullgraph=True` turns any graph break
into an error. The default config's training step uses the `aot_eager` backend, which traces forward and
backward as inductor does without inductor's code generation (minutes on a small CPU); the other cases use
the `eager` backend (dynamo capture only), to keep this file fast.
"""

import pytest
import torch
import torch._dynamo
from fixtures import tiny_config, tiny_pixels, tiny_text, train_inputs

from modeling_tagclip import TagClipModel

BLOCK_TYPES = ["hrmoe", "moe", "vit"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_model(block_type: str = "hrmoe", routing: str = "argmax") -> TagClipModel:
    """Tiny model without router noise or dropout, so eager and compiled runs compute the same thing."""
    torch.manual_seed(0)
    vision = dict(block_type=block_type, routing=routing, router_noise_std=0.0)
    model = TagClipModel(tiny_config(vision=vision, text=dict(attention_dropout=0.0)))
    with torch.no_grad():  # spread the feature routers so tokens take different experts
        for name, param in model.named_parameters():
            if "router.weight" in name:
                param.normal_(std=0.5)
    return model


def compiled(module: torch.nn.Module, backend: str = "eager") -> torch.nn.Module:
    return torch.compile(module, fullgraph=True, backend=backend)


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["argmax", "label"])
def test_vision_tower_compiles_without_graph_breaks(routing):
    """Default argmax routing, and label routing for a batch that is sure to use both expert groups."""
    tower = make_model(routing=routing).vision_model.eval()
    inputs = dict(
        pixel_values=tiny_pixels(4), view_labels=torch.tensor([0, 1, 1, 0]), output_router_logits=True
    )
    with torch.no_grad():
        expected = tower(**inputs)
        actual = compiled(tower)(**inputs)
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state)
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output)
    torch.testing.assert_close(actual.attention_row, expected.attention_row)
    for got, want in zip(actual.view_logits, expected.view_logits, strict=True):
        torch.testing.assert_close(got, want)
    for got, want in zip(actual.router_logits, expected.router_logits, strict=True):
        assert torch.equal(got.expert_mask, want.expert_mask)
    if routing == "label":
        assert torch.equal(expected.router_logits[0].group_weights[:, 1], torch.tensor([0.0, 1.0, 1.0, 0.0]))


@pytest.mark.slow
def test_text_tower_compiles_without_graph_breaks():
    tower = make_model().text_model.eval()
    ids = tiny_text(4)
    with torch.no_grad():
        expected = tower(input_ids=ids)
        actual = compiled(tower)(input_ids=ids)
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state)
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output)
    torch.testing.assert_close(actual.attention_row, expected.attention_row)


def loss_and_grads(model: TagClipModel, forward) -> tuple[dict, dict]:
    """Loss terms and parameter gradients (zeros for parameters the step did not reach) of one training step."""
    model.zero_grad(set_to_none=True)
    out = forward(**train_inputs())
    out.loss.backward()
    terms = {k: v.detach() for k, v in out.items() if k.startswith("loss") and v is not None}
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    return terms, grads


@pytest.mark.slow
@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_full_loss_compiles_without_graph_breaks(block_type):
    model = make_model(block_type).train()
    expected_terms, expected_grads = loss_and_grads(model, model)
    terms, grads = loss_and_grads(model, compiled(model, "aot_eager" if block_type == "hrmoe" else "eager"))
    assert terms.keys() == expected_terms.keys() and "loss_id" in terms
    for name, value in terms.items():
        torch.testing.assert_close(value, expected_terms[name], rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-4, msg=name)
    assert grads["vision_model.embeddings.view_token"].abs().sum() > 0 or block_type == "vit"
    assert grads["logit_scale"].abs() > 0


@pytest.mark.slow
def test_compiled_forward_is_one_graph_running_the_sparse_grouped_dispatch():
    """No dense fallback under compile: one graph, 2 grouped GEMMs per MoE block on exactly B*N*K routed rows."""
    model = make_model()
    tower = model.vision_model.eval()
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    pixels = tiny_pixels(4)
    with torch.no_grad():
        expected = tower(pixel_values=pixels)
        actual = torch.compile(tower, fullgraph=True, backend=backend)(pixel_values=pixels)
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state)
    assert len(graphs) == 1
    nodes = [n for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")]
    names = {n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "") for n in nodes}
    assert not names & {"nonzero", "bincount", "item", "tolist", "unique", "masked_select"}
    grouped = [n for n in nodes if "grouped_mm" in str(n.target)]
    config = model.config.vision_config
    assert len(grouped) == 2 * len(config.active_moe_layers)
    tokens = 4 * (config.num_patches + 2)  # CLS + patches + view token
    assert {n.args[0].meta["example_value"].shape[0] for n in grouped} == {tokens * config.moe_top_k}


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="torch.cuda.set_sync_debug_mode needs a CUDA device"
)
def test_image_forward_has_no_host_sync_on_cuda():
    model = make_model().cuda().eval()
    pixels = tiny_pixels(4).cuda()
    model.get_image_features(pixels)  # warm-up: lazy CUDA init may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model.vision_model.embeddings.check_pixel_values = lambda pixels: None  # eager input check syncs
            model.get_image_features(pixels)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.slow
def test_compiled_training_loop_compiles_once_for_twenty_steps(tmp_path, monkeypatch):
    """`accelerate launch --dynamo_backend ...`: the real training loop runs 22 compiled steps in epoch 0, where
    the N-ITC soft-label weight α changes every step; α is a tensor, so the step compiles once (as a Python float
    it was a guarded constant: a recompile, and one graph per value without automatic dynamic floats)."""
    import yaml
    from accelerate.state import AcceleratorState
    from torch._dynamo.utils import counters

    from modeling_tagclip.data.synthetic import generate_dataset
    from modeling_tagclip.engine.tracker import read_records
    from training.train import main

    generate_dataset(tmp_path / "data", num_identities=64, seed=0, image_size=(64, 32), progress=False)
    recipe = {
        "data_dir": str(tmp_path / "data"),
        "synthetic": None,
        "image_size": [64, 32],
        "plots": False,
        "model": {
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "patch_size": 16,
                "moe_layers": [1],
            },
            "text_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            },
            "projection_dim": 32,
            "tse_embed_dim": 32,
        },
        "per_device_batch_size": 8,
        "max_steps": 22,
        "save_steps": 0,
        "text_max_length": 48,
        "freeze_patch_embedding": False,
        "softlabel_ratio": 0.5,
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "EAGER")
    AcceleratorState._reset_state(True)  # an earlier in-process run's state would keep its (no) dynamo plugin
    torch._dynamo.reset()
    counters.clear()
    try:
        main(["--config", str(tmp_path / "r.yaml"), "--output_dir", str(tmp_path / "out")])
    finally:
        AcceleratorState._reset_state(True)
    steps = read_records(tmp_path / "out" / "metrics.jsonl")
    assert len(steps) == 22 and {r["epoch"] for r in steps.values()} == {0}
    assert len({r["alpha"] for r in steps.values()}) == 22  # a new α every step
    assert counters["stats"]["unique_graphs"] == 1
