"""ViSA model: shapes and gradients, Table 2 switches, input checks, reference-formula parity (trunk, ETGM,
DLFM, fusion), the grouped expert mixture, fresh-process custom-code loading."""

import json

import pytest
import torch
import torch.nn.functional as F
from fixtures import (
    FRESH_REMOTE_MODEL,
    VISA_LABELS,
    VISA_VIEWS,
    clean_env,
    make_visa_model,
    perturb_,
    run_python,
    tiny_visa_config,
    visa_pixels,
)

from modeling_tagclip.models.visa.configuration_visa import ViSAConfig
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
