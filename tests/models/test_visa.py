"""ViSA model: config validation, shapes and gradients, reference-formula parity (trunk, ETGM, DLFM, fusion),
Table 2 switches, losses, parameter/FLOP accounting, fresh-process custom-code loading."""

import json

import pytest
import torch
import torch.nn.functional as F
from fixtures import (
    FRESH_REMOTE_MODEL,
    TINY_VISA,
    VISA_LABELS,
    VISA_VIEWS,
    clean_env,
    make_visa_model,
    perturb_,
    run_python,
    tiny_visa_config,
    visa_pixels,
)

from modeling_tagclip.models.visa.complexity_visa import visa_complexity
from modeling_tagclip.models.visa.configuration_visa import ViSAConfig
from modeling_tagclip.models.visa.losses_visa import (
    etgm_balance_loss,
    load_balance_loss,
    orthogonal_loss,
    triplet_loss,
)
from modeling_tagclip.models.visa.modeling_visa import (
    ViSADLFM,
    ViSAExpertMixture,
    ViSAForReID,
    ViSAModel,
    ViSAPromptExpert,
    query_graph_readout,
)

VIEWS, LABELS, pixels, make_model = VISA_VIEWS, VISA_LABELS, visa_pixels, make_visa_model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# --- config ----------------------------------------------------------------------------------------------


def test_reference_config_geometry():
    config = ViSAConfig()
    assert config.grid_size == (21, 10) and config.num_patches == 210 and config.embedding_dim == 1536
    assert ViSAConfig.from_preset("lagper").num_patches == 252
    vdt = ViSAConfig.from_preset("vdt")
    assert vdt.num_patches == 128 and vdt.embedding_dim == 768 and vdt.view_tokens == "shared"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(hidden_size=30), "multiple of num_attention_heads"),
        (dict(view_tokens="triple"), "view_tokens must be one of"),
        (dict(dlfm_gcn="none"), "dlfm_gcn must be one of"),
        (dict(graph_top_k=22), "graph_top_k"),
        (dict(expert_top_k=4), "expert_top_k"),
        (dict(image_size=[4, 16]), "smaller than patch_size"),
        (dict(patch_stride=[0, 4]), "positive"),
        (dict(view_tokens="none", subtract_last_block=True), "subtract_last_block"),
        (dict(num_identities=-1), "num_identities"),
        (dict(image_size=[32, 16, 3]), "pair"),
    ],
)
def test_bad_config_is_a_clear_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_visa_config(**kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        ViSAConfig.from_preset("market")


# --- shapes, gradients, switches ---------------------------------------------------------------------------


def test_output_shapes_and_hidden_states():
    model = make_model()
    model.set_attn_implementation("eager")
    out = model(pixels(), view_labels=VIEWS, output_hidden_states=True, output_attentions=True)
    assert out.pooler_output.shape == (6, 64)
    assert out.last_hidden_state.shape == (6, 2 + 21, 32)
    assert out.invariant_queries.shape == out.specific_queries.shape == (6, 2, 32)
    assert len(out.hidden_states) == 4 and len(out.attentions) == 3
    assert out.attentions[0].shape == (6, 4, 23, 23)
    shared, aerial, ground = out.router_logits
    assert shared.shape == (6, 3) and aerial.shape == (3, 3) and ground.shape == (3, 3)
    torch.testing.assert_close(out.invariant_features, out.global_features - out.specific_features)


def test_all_losses_backprop_to_every_used_parameter():
    model = make_model(cls=ViSAForReID).train()
    out = model(pixels(), view_labels=VIEWS, labels=LABELS)
    names = ("loss_id", "loss_triplet", "loss_local_id", "loss_local_triplet", "loss_view", "loss_ortho")
    for name in (*names, "loss_balance"):
        assert torch.isfinite(getattr(out, name)), name
    torch.testing.assert_close(out.loss, sum(getattr(out, n) for n in (*names, "loss_balance")))
    out.loss.backward()
    params = dict(model.named_parameters())
    for name in (
        "visa.embeddings.patch_embedding.weight",
        "visa.embeddings.view_token_aerial",
        "visa.embeddings.view_token_ground",
        "visa.encoder.layers.2.mlp.fc2.weight",
        "visa.etgm.shared.router.weight",
        "visa.dlfm.shared_gcn.weight",
        "visa.dlfm.norm_view.weight",
        "visa.fusion.out_token",
        "visa.local_bnneck.weight",
        "classifier.weight",
        "view_classifier.weight",
    ):
        assert params[name].grad is not None and params[name].grad.abs().sum() > 0, name
    assert params["visa.global_bnneck.bias"].grad is None  # BNNeck bias frozen at 0


def test_gradient_checkpointing_gives_the_same_gradients():
    model = make_model(cls=ViSAForReID).train()
    model(pixels(), view_labels=VIEWS, labels=LABELS).loss.backward()
    plain = model.visa.encoder.layers[0].mlp.fc1.weight.grad.clone()
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(pixels(), view_labels=VIEWS, labels=LABELS).loss.backward()
    torch.testing.assert_close(model.visa.encoder.layers[0].mlp.fc1.weight.grad, plain)


def test_bnneck_running_stats_also_see_the_global_feature_in_training():
    model = make_model().train()
    model(pixels(), view_labels=VIEWS)
    assert (
        int(model.global_bnneck.num_batches_tracked) == 2 and int(model.local_bnneck.num_batches_tracked) == 1
    )
    model = make_model(bnneck_global_update=False).train()
    model(pixels(), view_labels=VIEWS)
    assert int(model.global_bnneck.num_batches_tracked) == 1


@pytest.mark.parametrize("view_tokens", ["dual", "shared", "none"])
@pytest.mark.parametrize("use_etgm,use_dlfm", [(True, True), (False, True), (True, False), (False, False)])
def test_table2_switches_and_vdt(view_tokens, use_etgm, use_dlfm):
    model = make_model(cls=ViSAForReID, view_tokens=view_tokens, use_etgm=use_etgm, use_dlfm=use_dlfm).train()
    out = model(pixels(), view_labels=VIEWS, labels=LABELS)
    local = use_etgm or use_dlfm
    assert out.embeddings.shape == (6, 64 if local else 32)
    assert (out.loss_view is None) == (view_tokens == "none")
    assert (out.loss_balance is None) == (not use_etgm)
    out.loss.backward()
    assert (model.visa.dlfm is None) == (not use_dlfm) and (model.visa.etgm is None) == (not use_etgm)


def test_view_labels_needed_only_where_used():
    with pytest.raises(ValueError, match="needs view_labels"):
        make_model()(pixels())
    with pytest.raises(ValueError, match="needs view_labels"):
        make_model(view_tokens="shared")(pixels())  # the view experts still need them
    assert make_model(view_tokens="shared", use_etgm=False)(pixels()).pooler_output.shape == (6, 64)
    assert make_model(view_tokens="none")(pixels()).pooler_output.shape == (6, 64)


def test_view_label_selects_view_token_and_experts():
    model = make_model()
    x = pixels(2)
    a = model(x, view_labels=torch.tensor([0, 0])).pooler_output
    g = model(x, view_labels=torch.tensor([1, 1])).pooler_output
    assert (a - g).abs().max() > 1e-3
    mixed = model(x, view_labels=torch.tensor([0, 1])).pooler_output
    torch.testing.assert_close(mixed, torch.stack([a[0], g[1]]), atol=1e-5, rtol=1e-5)


def test_inference_is_per_sample_independent():
    model = make_model()
    x = pixels()
    batch = model(x, view_labels=VIEWS).pooler_output
    single = torch.cat([model(x[i : i + 1], view_labels=VIEWS[i : i + 1]).pooler_output for i in range(6)])
    torch.testing.assert_close(batch, single, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda m: m(torch.randn(2, 3, 30, 16), view_labels=torch.tensor([0, 1])),
            "pixel_values must have shape",
        ),
        (lambda m: m(pixels(2), view_labels=torch.tensor([0, 2])), "must be 0 \\(aerial\\) or 1"),
        (lambda m: m(pixels(2), view_labels=torch.tensor([0])), "1 entries for a batch of 2"),
        (
            lambda m: m(pixels(2), view_labels=torch.tensor([0, 1]), labels=torch.tensor([0, 9])),
            "labels must lie",
        ),
        (lambda m: m(pixels(2), view_labels=torch.tensor([0, 1]), return_loss=True), "need labels"),
    ],
)
def test_bad_inputs_are_clear_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(make_model(cls=ViSAForReID))


def test_view_label_conventions():
    model = make_model(cls=ViSAForReID)
    assert model.view_targets(torch.tensor([0, 1])).tolist() == [1, 0]  # reference: aerial = 1
    model = make_model(cls=ViSAForReID, view_label_convention="project")
    assert model.view_targets(torch.tensor([0, 1])).tolist() == [0, 1]


# --- reference formulas ------------------------------------------------------------------------------------


def reference_dlfm_branch(patches, features, queries, weight, norm, k):
    """docs/visa-reference.md §3 literally: per sample and per query, a (1 + k)-node graph, Â (A V W), node 0,
    LN + residual."""
    batch, num_queries, _ = queries.shape
    out = torch.empty_like(queries)
    for b in range(batch):
        scores = F.normalize(features[b], dim=-1) @ F.normalize(patches[b], dim=-1).t()
        neighbours = patches[b, scores.topk(k).indices]
        for m in range(num_queries):
            nodes = torch.cat([queries[b, m : m + 1], neighbours])
            unit = F.normalize(nodes, dim=-1)
            adj = (unit @ unit.t()).clamp(min=0) + torch.eye(len(nodes))
            d_inv_sqrt = adj.sum(-1).pow(-0.5)
            adj_hat = d_inv_sqrt[:, None] * adj * d_inv_sqrt[None, :]
            graph = torch.tanh(adj_hat @ (nodes @ weight))[0]
            out[b, m] = norm(graph) + queries[b, m]
    return out


@pytest.mark.parametrize("dlfm_gcn", ["shared", "per_branch"])
@pytest.mark.parametrize("k", [5, 21])
def test_dlfm_vectorised_equals_per_sample_per_query_reference(dlfm_gcn, k):
    torch.manual_seed(0)
    config = tiny_visa_config(dlfm_gcn=dlfm_gcn, graph_top_k=k)
    dlfm = ViSADLFM(config)
    with torch.no_grad():
        for norm in (dlfm.norm_shared, dlfm.norm_view):
            norm.weight.normal_()
            norm.bias.normal_()
    patches, z_inv, z_spe = torch.randn(3, 21, 32), torch.randn(3, 32), torch.randn(3, 32)
    q_inv, q_spe = torch.randn(3, 4, 32), torch.randn(3, 4, 32)
    got_inv, got_spe = dlfm(patches, z_inv, z_spe, q_inv, q_spe)
    view_gcn = dlfm.shared_gcn if dlfm_gcn == "shared" else dlfm.view_gcn
    expected_inv = reference_dlfm_branch(
        patches, z_inv, q_inv, dlfm.shared_gcn.weight.t(), dlfm.norm_shared, k
    )
    expected_spe = reference_dlfm_branch(patches, z_spe, q_spe, view_gcn.weight.t(), dlfm.norm_view, k)
    torch.testing.assert_close(got_inv, expected_inv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_spe, expected_spe, atol=1e-5, rtol=1e-5)


def test_graph_readout_is_row_zero_of_normalised_adjacency_times_nodes():
    queries, neighbours = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    nodes = torch.cat([queries[1, 2:3], neighbours[1]])
    unit = F.normalize(nodes, dim=-1)
    adj = (unit @ unit.t()).clamp(min=0) + torch.eye(5)
    d = adj.sum(-1).pow(-0.5)
    torch.testing.assert_close(
        query_graph_readout(queries, neighbours)[1, 2], ((d[:, None] * adj * d) @ nodes)[0]
    )


@pytest.mark.parametrize("no_grad", [True, False])
def test_dlfm_graph_gradient_flag(no_grad):
    dlfm = ViSADLFM(tiny_visa_config(dlfm_graph_no_grad=no_grad))
    patches = torch.randn(2, 21, 32, requires_grad=True)
    q_inv = torch.randn(2, 2, 32, requires_grad=True)
    refined, _ = dlfm(patches, torch.randn(2, 32), None, q_inv, None)
    refined.pow(2).sum().backward()
    assert dlfm.shared_gcn.weight.grad.abs().sum() > 0 and q_inv.grad is not None
    assert (patches.grad is None) == no_grad  # reference: the graph input is built under no_grad


def test_expert_mixture_equals_per_sample_top_k_loop():
    torch.manual_seed(0)
    mixture = ViSAExpertMixture(tiny_visa_config()).eval()
    with torch.no_grad():
        mixture.router.weight.normal_()
    features = torch.randn(5, 32)
    tokens, logits = mixture(features)
    for i in range(5):
        top = mixture.router(features[i]).topk(2)
        weights = F.softmax(top.values, dim=-1)
        expected = sum(
            w * mixture.experts[int(e)](features[i : i + 1])[0]
            for w, e in zip(weights, top.indices, strict=True)
        )
        torch.testing.assert_close(tokens[i], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, mixture.router(features))


def test_expert_cross_attention_over_one_token_is_out_proj_of_v_proj():
    torch.manual_seed(0)
    expert = ViSAPromptExpert(tiny_visa_config()).eval()
    features = torch.randn(3, 32)
    prompt = expert.prompt.expand(3, -1, -1)
    attn = expert.cross_attn
    torch.testing.assert_close(
        attn(prompt, features[:, None]), attn.out_proj(attn.v_proj(features))[:, None].expand(-1, 2, -1)
    )
    assert expert(features).shape == (3, 2, 32)


def reference_forward(model: ViSAModel, x: torch.Tensor, views: torch.Tensor) -> dict:
    """docs/visa-reference.md §0-3 written out, using the model's weights: per-sample experts, looped DLFM."""
    emb, layers = model.embeddings, model.encoder.layers
    tokens = torch.stack([emb.view_token_aerial[0] if v == 0 else emb.view_token_ground[0] for v in views])
    patches = emb.patch_embedding(x).flatten(2).transpose(1, 2)
    h = torch.cat([emb.cls_token.expand(len(x), -1, -1), tokens, patches], 1) + emb.position_embedding
    for block in layers[:-1]:
        h = block(h)
        h[:, 0] = h[:, 0] - h[:, 1]
    top = model.final_layer_norm(layers[-1](h))
    g, spe = top[:, 0], top[:, 1]
    inv = g - spe

    def mix(mixture, z):
        scores = mixture.router(z).topk(model.config.expert_top_k)
        w = F.softmax(scores.values, dim=-1)
        return sum(wj * mixture.experts[int(j)](z[None])[0] for wj, j in zip(w, scores.indices, strict=True))

    etgm = model.etgm
    q_inv = torch.stack([mix(etgm.shared, inv[i]) for i in range(len(x))])
    q_spe = torch.stack([mix(etgm.aerial if v == 0 else etgm.ground, spe[i]) for i, v in enumerate(views)])
    dlfm, k, weight = model.dlfm, model.config.graph_top_k, model.dlfm.shared_gcn.weight.t()
    q_inv = reference_dlfm_branch(h[:, 2:], inv, q_inv, weight, dlfm.norm_shared, k)
    q_spe = reference_dlfm_branch(h[:, 2:], spe, q_spe, weight, dlfm.norm_view, k)
    fusion = model.fusion
    t = torch.cat([fusion.out_token.expand(len(x), 1, -1), q_inv, q_spe], 1)
    t = fusion.norm2(t + fusion.self_attn(t)[0])
    f_loc = fusion.norm3(t + fusion.mlp(t))[:, 0]
    return {
        "inv": inv,
        "spe": spe,
        "embedding": torch.cat([model.global_bnneck(inv), model.local_bnneck(f_loc)], 1),
    }


def test_model_matches_spec_pseudo_code():
    model = make_model()
    x = pixels()
    with torch.no_grad():
        out = model(x, view_labels=VIEWS)
        ref = reference_forward(model, x, VIEWS)
    torch.testing.assert_close(out.invariant_features, ref["inv"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.specific_features, ref["spe"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.pooler_output, ref["embedding"], atol=1e-4, rtol=1e-4)


# --- losses ------------------------------------------------------------------------------------------------


def test_load_balance_known_answers():
    assert load_balance_loss(torch.zeros(5, 8)).item() == pytest.approx(1.0, abs=1e-5)
    collapsed = torch.full((5, 8), -1e4)
    collapsed[:, 3] = 0
    assert load_balance_loss(collapsed).item() == pytest.approx(8.0, abs=1e-4)
    total = etgm_balance_loss(torch.zeros(4, 8), collapsed[:1], None, batch_size=4)
    assert total.item() == pytest.approx(1.0 + 8.0 / 4, abs=1e-4)
    assert etgm_balance_loss(None, None, None, 4) is None


def test_soft_margin_batch_hard_triplet_known_answer():
    features = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 1.0], [0.0, 5.0]])
    labels = torch.tensor([0, 0, 1, 1])
    # anchor 0: d_ap = 3 (to 1), d_an = 1 (to 2); anchor 1: 3 / sqrt(10); anchor 2: 4 / 1; anchor 3: 4 / 5
    d_ap = torch.tensor([3.0, 3.0, 4.0, 4.0])
    d_an = torch.tensor([1.0, 10**0.5, 1.0, 5.0])
    expected = F.softplus(-(d_an - d_ap)).mean()
    torch.testing.assert_close(triplet_loss(features, labels), expected, atol=1e-4, rtol=1e-4)
    hinge = F.relu(d_ap - d_an + 0.3).mean()
    torch.testing.assert_close(triplet_loss(features, labels, margin=0.3), hinge, atol=1e-4, rtol=1e-4)


def test_orthogonal_loss_known_answer():
    inv = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    spe = torch.tensor([[0.0, 2.0], [-1.0, -1.0]])
    assert orthogonal_loss(inv, spe).item() == pytest.approx(0.5)


# --- accounting ---------------------------------------------------------------------------------------------


def test_paper_params_and_gflops_at_reference_configs():
    cargo = visa_complexity(ViSAConfig())
    assert cargo["params_reference"] == 271_772_184  # 271.77 M (paper Table 5)
    assert cargo["gflops"] == pytest.approx(37.50, abs=0.02)  # paper 37.53 ≈ 2 x Linear/Conv MACs
    full = visa_complexity(ViSAConfig(num_identities=2500))
    assert full["params_reference"] + full["params_for_reid"] - full["params_model"] == pytest.approx(
        275.62e6, abs=0.01e6
    )
    lagper = visa_complexity(ViSAConfig.from_preset("lagper"))
    assert round(lagper["params_reference"] / 1e6, 2) == 271.69 and round(lagper["gflops"], 2) == 44.27
    assert round(visa_complexity(ViSAConfig.from_preset("vdt"))["params_reference"] / 1e6, 2) == 85.75


@pytest.mark.parametrize(
    "kwargs",
    [{}, dict(dlfm_gcn="per_branch"), dict(view_tokens="none"), dict(view_tokens="shared", use_dlfm=False)],
)
def test_analytic_count_matches_instantiated_tiny_model(kwargs):
    config = tiny_visa_config(**kwargs)
    report = visa_complexity(config)
    assert report["params_model"] == sum(p.numel() for p in ViSAModel(config).parameters())
    assert report["params_for_reid"] == sum(p.numel() for p in ViSAForReID(config).parameters())


# --- save / fresh-process load -------------------------------------------------------------------------------

FRESH_LOAD = (
    FRESH_REMOTE_MODEL
    + """
import json, torch
from safetensors.torch import load_file
inputs = load_file(folder + "/inputs.safetensors")
with torch.no_grad():
    out = model(pixel_values=inputs["pixel_values"], view_labels=inputs["view_labels"]).pooler_output
print(json.dumps({"module": type(model).__module__, "class": type(model).__name__, "embedding": out.tolist()}))
"""
)


@pytest.mark.slow
def test_save_then_fresh_process_auto_model_load(tmp_path):
    from safetensors.torch import save_file

    from modeling_tagclip.models.visa.modeling_visa import ViSAPreTrainedModel

    ViSAConfig.register_for_auto_class()
    ViSAModel.register_for_auto_class("AutoModel")
    ViSAForReID.register_for_auto_class("AutoModelForImageClassification")
    model = make_model(cls=ViSAForReID)
    folder = tmp_path / "visa"
    model.save_pretrained(folder)
    x = pixels()
    with torch.no_grad():
        expected = model(x, view_labels=VIEWS).embeddings
    save_file({"pixel_values": x, "view_labels": VIEWS}, folder / "inputs.safetensors")
    names = {p.name for p in folder.iterdir()}
    assert {"modeling_visa.py", "configuration_visa.py", "losses_visa.py"} <= names
    assert {"attention.py", "device_ops.py", "load_policy.py", "views.py"} <= names  # generated siblings
    assert not any("tagclip" in name for name in names), (
        f"a ViSA folder must hold only ViSA code: {sorted(names)}"
    )
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"] == "modeling_visa.ViSAModel"
    result = run_python(FRESH_LOAD, [str(folder)], tmp_path, clean_env(tmp_path))
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["module"].startswith("transformers_modules.") and report["class"] == "ViSAModel"
    torch.testing.assert_close(torch.tensor(report["embedding"]), expected, rtol=0, atol=0)
    reloaded = ViSAForReID.from_pretrained(folder).eval()  # heads too, in process
    assert isinstance(reloaded, ViSAPreTrainedModel)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x, view_labels=VIEWS).embeddings, expected, rtol=0, atol=0)


# --- converter ----------------------------------------------------------------------------------------------------


def official_layout(config: ViSAConfig, classes: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict in the official fast-reid layout (docs/visa-reference.md §7 key list), random values,
    for `config`."""
    g = torch.Generator().manual_seed(seed)
    dim, inter, p = config.hidden_size, config.intermediate_size, config.patch_size
    sd: dict[str, torch.Tensor] = {}

    def add(name, *shape):
        sd[name] = torch.randn(*shape, generator=g)

    def block(prefix, mlp, qkv_bias=True, norms=("norm1", "norm2")):
        add(f"{prefix}.attn.qkv.weight", 3 * dim, dim)
        if qkv_bias:
            add(f"{prefix}.attn.qkv.bias", 3 * dim)
        add(f"{prefix}.attn.proj.weight", dim, dim)
        add(f"{prefix}.attn.proj.bias", dim)
        add(f"{prefix}.mlp.fc1.weight", mlp, dim)
        add(f"{prefix}.mlp.fc1.bias", mlp)
        add(f"{prefix}.mlp.fc2.weight", dim, mlp)
        add(f"{prefix}.mlp.fc2.bias", dim)
        for norm in norms:
            add(f"{prefix}.{norm}.weight", dim)
            add(f"{prefix}.{norm}.bias", dim)

    base = "backbone.base"
    for name in ("cls_token", "view_token_sky", "view_token_ground"):
        add(f"{base}.{name}", 1, 1, dim)
    add(f"{base}.pos_embed", 1, 2 + config.num_patches, dim)
    add(f"{base}.patch_embed.proj.weight", dim, 3, p, p)
    add(f"{base}.patch_embed.proj.bias", dim)
    for i in range(config.num_hidden_layers):
        block(f"{base}.blocks.{i}", inter)
    add(f"{base}.norm.weight", dim)
    add(f"{base}.norm.bias", dim)
    block("backbone.b1.0", inter)
    add("backbone.b1.1.weight", dim)
    add("backbone.b1.1.bias", dim)
    for group in ("share", "sky", "ground"):
        add(f"backbone.{group}_router.gate.weight", config.num_experts, dim)
        add(f"backbone.{group}_router.gate.bias", config.num_experts)
        for e in range(config.num_experts):
            prefix = f"backbone.{group}_experts.{e}"
            add(f"{prefix}.prompt", 1, config.num_prompt_tokens, dim)
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                add(f"{prefix}.prm.cross_attn.{proj}.weight", dim, dim)
                add(f"{prefix}.prm.cross_attn.{proj}.bias", dim)
            block(f"{prefix}.prm", config.expert_intermediate_size, False, ("norm1", "norm2", "norm3"))
    add("backbone.share_gcn.gcn_weights", dim, dim)
    add("backbone.view_gcn.gcn_weights", dim, dim)
    for name in ("norm_share", "norm_view"):
        add(f"backbone.{name}.weight", dim)
        add(f"backbone.{name}.bias", dim)
    block("backbone.final_attn_token_to_image", config.fusion_intermediate_size, False, ("norm2", "norm3"))
    add("backbone.out_token", 1, dim)
    add("backbone.image_pe", 1, config.num_patches, dim)
    for head, n in (("heads", classes), ("local_heads", classes), ("view_heads", 2)):
        add(f"{head}.weight", n, dim)
        add(f"{head}.bottleneck.0.weight", dim)
        sd[f"{head}.bottleneck.0.bias"] = torch.zeros(dim)
        add(f"{head}.bottleneck.0.running_mean", dim)
        sd[f"{head}.bottleneck.0.running_var"] = torch.rand(dim, generator=g) + 0.5
        sd[f"{head}.bottleneck.0.num_batches_tracked"] = torch.tensor(1234)
    return sd


GEOMETRY = {
    k: TINY_VISA[k]
    for k in ("image_size", "patch_size", "patch_stride", "num_attention_heads", "graph_top_k")
}


@pytest.fixture(scope="module")
def official_checkpoint(tmp_path_factory):
    config = tiny_visa_config()
    sd = official_layout(config)
    path = tmp_path_factory.mktemp("official") / "model_best.pth"
    torch.save({"model": {f"module.{k}": v for k, v in sd.items()}, "epoch": 3, "metric": 0.5}, path)
    return path, sd


def timm_block(sd: dict, prefix: str, x: torch.Tensor, heads: int) -> torch.Tensor:
    """timm `Block.forward` on the official fused tensors (qkv rows [q; k; v], heads contiguous)."""
    batch, tokens, dim = x.shape
    h = F.layer_norm(x, (dim,), sd[f"{prefix}.norm1.weight"], sd[f"{prefix}.norm1.bias"], eps=1e-6)
    qkv = (h @ sd[f"{prefix}.attn.qkv.weight"].t() + sd[f"{prefix}.attn.qkv.bias"]).reshape(
        batch, tokens, 3, heads, -1
    )
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    attn = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(-1)
    x = x + (attn @ v).transpose(1, 2).reshape(batch, tokens, dim) @ sd[f"{prefix}.attn.proj.weight"].t()
    x = x + sd[f"{prefix}.attn.proj.bias"]
    h = F.layer_norm(x, (dim,), sd[f"{prefix}.norm2.weight"], sd[f"{prefix}.norm2.bias"], eps=1e-6)
    h = F.gelu(h @ sd[f"{prefix}.mlp.fc1.weight"].t() + sd[f"{prefix}.mlp.fc1.bias"])
    return x + h @ sd[f"{prefix}.mlp.fc2.weight"].t() + sd[f"{prefix}.mlp.fc2.bias"]


def test_converter_places_official_tensors(official_checkpoint, tmp_path):
    from modeling_tagclip.convert.visa import convert_checkpoint, to_official_state_dict

    path, sd = official_checkpoint
    model, report = convert_checkpoint(path, tmp_path / "converted", **GEOMETRY)
    assert model.config.num_identities == 4 and model.config.num_prompt_tokens == 2
    assert report["dropped_never_executed"] == sorted(
        [k for k in sd if k.startswith(("backbone.base.blocks.2.", "backbone.base.norm."))]
        + ["backbone.image_pe", "backbone.view_gcn.gcn_weights"]
    )
    state, dim = model.state_dict(), 32
    assert torch.equal(
        state["visa.encoder.layers.2.self_attn.q_proj.weight"], sd["backbone.b1.0.attn.qkv.weight"][:dim]
    )
    assert torch.equal(
        state["visa.encoder.layers.0.self_attn.k_proj.bias"],
        sd["backbone.base.blocks.0.attn.qkv.bias"][dim : 2 * dim],
    )
    assert torch.equal(
        state["visa.etgm.aerial.experts.1.self_attn.v_proj.weight"],
        sd["backbone.sky_experts.1.prm.attn.qkv.weight"][2 * dim :],
    )
    assert torch.equal(state["visa.dlfm.shared_gcn.weight"], sd["backbone.share_gcn.gcn_weights"].t())
    assert int(state["visa.global_bnneck.num_batches_tracked"]) == 1234
    assert torch.equal(state["view_classifier.weight"], sd["view_heads.weight"])
    # semantics: our trunk block == timm's block on the fused official tensors
    x = torch.randn(2, 23, dim)
    with torch.no_grad():
        torch.testing.assert_close(
            model.visa.encoder.layers[0](x),
            timm_block(sd, "backbone.base.blocks.0", x, 4),
            atol=1e-4,
            rtol=1e-4,
        )
    # round trip: back to the official layout, every executed tensor identical
    back = to_official_state_dict(model)
    dropped = set(report["dropped_never_executed"])
    assert set(back) == set(sd) - dropped
    assert all(torch.equal(back[k], sd[k]) for k in back)
    # the saved folder reloads with identical outputs
    reloaded = ViSAForReID.from_pretrained(tmp_path / "converted").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(pixels(), view_labels=VIEWS).embeddings, model(pixels(), view_labels=VIEWS).embeddings
        )


def test_converter_bad_checkpoints(official_checkpoint, tmp_path):
    from modeling_tagclip.convert.safe_pickle import UnsafeCheckpointError
    from modeling_tagclip.convert.visa import convert_checkpoint, convert_state_dict

    _, sd = official_checkpoint
    config = tiny_visa_config()
    with pytest.raises(ValueError, match="missing 'backbone.b1.1.weight'"):
        convert_state_dict({k: v for k, v in sd.items() if k != "backbone.b1.1.weight"}, config)
    with pytest.raises(ValueError, match="unexpected keys"):
        convert_state_dict({**sd, "backbone.extra.weight": torch.zeros(1)}, config)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil.pth"
    torch.save({"model": {"x": Evil()}}, evil)
    with pytest.raises(UnsafeCheckpointError):
        convert_checkpoint(evil)


def test_imagenet_vit_init_with_position_quirk():
    from modeling_tagclip.convert.visa import load_imagenet_vit

    config = tiny_visa_config()
    timm = {
        k.removeprefix("backbone.base."): v
        for k, v in official_layout(config).items()
        if k.startswith("backbone.base.")
    }
    timm["pos_embed"] = torch.randn(1, 1 + 16, 32)  # a 4x4 grid
    timm["head.weight"] = torch.zeros(10, 32)
    model = ViSAModel(config)
    report = load_imagenet_vit(model, timm)
    assert not report["unexpected"]
    assert all(
        k.startswith(("etgm", "dlfm", "fusion", "global_bnneck", "local_bnneck", "embeddings.view"))
        for k in report["missing"]
    )
    pos = model.embeddings.position_embedding[0]
    assert torch.equal(pos[0], timm["pos_embed"][0, 0]) and torch.equal(pos[1], timm["pos_embed"][0, 1])
    assert pos.shape == (2 + 21, 32)
    assert torch.equal(model.encoder.layers[2].mlp.fc1.weight, timm["blocks.2.mlp.fc1.weight"])
    assert torch.equal(model.final_layer_norm.weight, timm["norm.weight"])


def test_converter_infers_depth_of_an_executed_only_export(tmp_path):
    """Regression: a 4-block model exported by `to_official_state_dict` (no never-executed block) came back
    with 3 blocks; a geometry the converter cannot read is refused with the fields to pass."""
    from modeling_tagclip.convert.visa import convert_checkpoint, infer_config, to_official_state_dict

    torch.manual_seed(0)
    source = perturb_(ViSAForReID(tiny_visa_config(num_hidden_layers=4))).eval()
    official = to_official_state_dict(source)
    path = tmp_path / "export.pth"
    torch.save({"model": official}, path)
    model, _ = convert_checkpoint(path, **GEOMETRY)
    assert model.config.num_hidden_layers == 4
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(pixels(), view_labels=VIEWS).embeddings,
            source(pixels(), view_labels=VIEWS).embeddings,
        )
    with pytest.raises(ValueError, match="cannot infer the input geometry.*image_size and patch_stride"):
        infer_config(official, num_attention_heads=4)
    with pytest.raises(ValueError, match="cannot infer num_attention_heads: width 32"):
        infer_config(official, image_size=[32, 16], patch_stride=[4, 4])
    with pytest.raises(ValueError, match="the config gives 8 patches .* has 21"):
        infer_config(official, **{**GEOMETRY, "patch_stride": [8, 8]})
    gap = {k: v for k, v in official.items() if not k.startswith("backbone.base.blocks.1.")}
    with pytest.raises(ValueError, match=r"trunk blocks \[0, 2\] are not contiguous"):
        infer_config(gap, **GEOMETRY)


def _naive_mixture(mixture, features: torch.Tensor) -> torch.Tensor:
    """The reference formula: every expert on every sample, mixed with the dense top-k weights."""
    from modeling_tagclip.models.visa.modeling_visa import topk_routing

    weights = topk_routing(mixture.router(features).float(), mixture.top_k)
    return sum(weights[:, j, None, None] * expert(features) for j, expert in enumerate(mixture.experts))


def test_grouped_expert_mixture_equals_the_dense_formula_eager_bf16_compiled_and_in_gradients():
    from modeling_tagclip.models.visa.modeling_visa import ViSAExpertMixture

    torch.manual_seed(0)
    mixture = ViSAExpertMixture(tiny_visa_config(num_experts=4, expert_top_k=2, hidden_size=32)).eval()
    perturb_(mixture)
    with torch.no_grad():
        for expert in mixture.experts:
            expert.prompt.normal_()
    features = torch.randn(7, 32, requires_grad=True)
    expected = _naive_mixture(mixture, features)
    torch.testing.assert_close(mixture(features)[0], expected, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = mixture(features)[0].float()
    assert F.cosine_similarity(low.flatten(1), expected.flatten(1)).min() > 0.99
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(mixture, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(features)[0], expected, rtol=1e-5, atol=1e-5)
    assert len(graphs) == 1
    grads = []
    for output in (mixture(features)[0], expected):
        features.grad = None
        (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum().backward(retain_graph=True)
        grads.append(features.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


def test_view_experts_follow_the_labels_without_per_view_subsets():
    """q_spe of each image comes from its view's mixture, as the per-view loop of the reference."""
    torch.manual_seed(0)
    etgm = ViSAForReID(tiny_visa_config()).visa.etgm.eval()
    specific, invariant = torch.randn(6, 32), torch.randn(6, 32)
    with torch.no_grad():
        _, q_spe, (_, aerial, ground) = etgm(invariant, specific, VIEWS)
        for row, view in enumerate(VIEWS.tolist()):
            mixture = etgm.aerial if view == 0 else etgm.ground
            torch.testing.assert_close(q_spe[row], _naive_mixture(mixture, specific[row : row + 1])[0])
    assert aerial.shape[0] == int((VIEWS == 0).sum()) and ground.shape[0] == int((VIEWS == 1).sum())


def test_saved_image_processor_is_the_reference_eval_transform(tmp_path):
    """A ViSA folder's image processor (AutoImageProcessor, no custom code) equals ReIDTransform's test path."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor

    from modeling_tagclip.data.reid import ReIDTransform
    from modeling_tagclip.models.visa.image_processing_visa import build_visa_image_processor

    build_visa_image_processor(256, 128).save_pretrained(tmp_path)
    processor = AutoImageProcessor.from_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(300, 140), (97, 61)]
    ]
    got = processor(images=images, return_tensors="pt")["pixel_values"]
    expected = torch.stack([ReIDTransform((256, 128))(image) for image in images])
    assert got.shape == (2, 3, 256, 128)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
