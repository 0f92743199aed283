"""Off the CPU, HR-MoE dispatch never reads its expert offsets on the host: where the grouped GEMM is not
native (fp32 / fp16 on a GPU), `dispatch` takes the dense formula instead of the per-expert loop."""

import pytest
import torch
from fixtures import tiny_config

from modeling_tagclip.models.tagclip import modeling_tagclip as M
from modeling_tagclip.models.tagclip.device_ops import grouped_gemm_syncs
from modeling_tagclip.models.tagclip.modeling_tagclip import TagClipHRMoE
from modeling_tagclip.models.visa import modeling_visa as V


@pytest.mark.parametrize(
    ("dtype", "hidden", "syncs"),
    [
        (torch.float32, 32, True),
        (torch.float16, 32, True),
        (torch.bfloat16, 32, False),
        (torch.bfloat16, 36, True),
    ],
)
def test_the_rule_off_the_cpu(dtype, hidden, syncs):
    widths = (hidden, 4 * hidden)
    assert grouped_gemm_syncs(torch.empty(2, 5, hidden, dtype=dtype, device="meta"), widths) is syncs
    assert grouped_gemm_syncs(torch.empty(2, 5, hidden, dtype=dtype), widths) is False  # CPU: no sync


def test_dispatch_takes_the_dense_formula_where_sparse_would_sync(monkeypatch):
    torch.manual_seed(0)
    moe = TagClipHRMoE(tiny_config().vision_config).eval()
    hidden, gate = torch.randn(3, 10, 32), torch.randn(3, 10, 6)
    with torch.no_grad():
        weights, selected = moe.routing_weights(gate, torch.eye(2)[torch.tensor([0, 1, 0])])
        sparse = moe.dispatch(hidden, weights, selected)
        monkeypatch.setattr(M, "grouped_gemm_syncs", lambda inputs, widths: True)
        monkeypatch.setattr(moe, "dispatch_sparse", lambda *a: pytest.fail("sparse dispatch would sync here"))
        dense = moe.dispatch(hidden, weights, selected)
    assert torch.equal(dense, moe.dispatch_dense(hidden, weights, selected))
    torch.testing.assert_close(dense, sparse, rtol=1e-5, atol=1e-6)


def test_visa_experts_run_densely_where_grouped_gemms_would_sync(monkeypatch):
    """ViSA's expert mixture: the same sum with every expert on every sample, no grouped GEMM called."""
    from fixtures import tiny_visa_config

    torch.manual_seed(0)
    mixture = V.ViSAExpertMixture(tiny_visa_config()).eval()
    features = torch.randn(5, mixture.router.in_features)
    with torch.no_grad():
        sparse, _ = mixture(features)
        monkeypatch.setattr(V, "grouped_gemm_syncs", lambda inputs, widths: True)
        monkeypatch.setattr(
            V, "grouped_prompt_experts", lambda *a: pytest.fail("grouped GEMMs would sync here")
        )
        dense, _ = mixture(features)
    torch.testing.assert_close(dense, sparse, rtol=1e-5, atol=1e-5)


@pytest.fixture
def device_path(monkeypatch):
    """The code a GPU runs, on the CPU: Python never reads tensor values (`on_host` is False everywhere)."""
    from modeling_tagclip.models.tagclip import device_ops

    for module in (device_ops, M):
        monkeypatch.setattr(module, "on_host", lambda tensor: False)


@pytest.mark.parametrize("chunk", [8192, 7])
def test_grouped_dispatch_in_chunks_matches_the_dense_formula(device_path, chunk):
    """The device path (grouped GEMMs over static T x P pairs) in one chunk or several equals TAG-PR Eq. 8 densely."""
    torch.manual_seed(0)
    moe = TagClipHRMoE(tiny_config().vision_config).eval()
    moe.dispatch_chunk_tokens = chunk
    hidden, gate = torch.randn(3, 10, 32), torch.randn(3, 10, 6)
    with torch.no_grad():
        weights, selected = moe.routing_weights(gate, torch.eye(2)[torch.tensor([0, 1, 0])])
        grouped = moe.dispatch_sparse(hidden, weights, selected)
        dense = moe.dispatch_dense(hidden, weights, selected)
    torch.testing.assert_close(grouped, dense, rtol=1e-5, atol=1e-6)


def test_by_expert_dispatch_adds_in_the_dense_formulas_order():
    """On the host each expert runs on its own tokens, summed in expert order: the dense formula's values."""
    torch.manual_seed(0)
    moe = TagClipHRMoE(tiny_config().vision_config).eval()
    hidden, gate = torch.randn(4, 10, 32), torch.randn(4, 10, 6)
    with torch.no_grad():
        weights, selected = moe.routing_weights(gate, torch.eye(2)[torch.tensor([0, 1, 1, 0])])
        assert selected.sum(-1).eq(moe.pairs_per_token).all()
        by_expert = moe.dispatch_sparse(hidden, weights, selected)
        dense = moe.dispatch_dense(hidden, weights, selected)
    torch.testing.assert_close(by_expert, dense, rtol=1e-6, atol=1e-7)


def test_stacked_expert_weights_are_cached_in_eval_and_follow_updates():
    from modeling_tagclip.models.tagclip.device_ops import stacked_weights

    torch.manual_seed(0)
    moe = TagClipHRMoE(tiny_config().vision_config).eval()
    layers = [expert.fc1 for expert in moe.experts]
    with torch.no_grad():
        first, bias = stacked_weights(layers, torch.float32)
        assert stacked_weights(layers, torch.float32)[0] is first  # no re-stacking per call
        assert torch.equal(first, torch.stack([layer.weight.t() for layer in layers]))
        layers[2].weight.add_(1.0)  # an in-place update (optimizer step, load_state_dict) bumps the version
        updated = stacked_weights(layers, torch.float32)[0]
    assert updated is not first and torch.equal(updated[2], layers[2].weight.t())
    assert torch.equal(bias, torch.stack([layer.bias for layer in layers]))
    assert not any("stacked" in key for key in moe.state_dict())  # the checkpoint keys stay per expert


def test_training_stacks_the_expert_weights_once_per_optimizer_step():
    """In training the stack is cached too: every call between two optimizer steps (dispatch chunks, gradient
    accumulation) gets the same tensor, each backward through it reaches every expert's weight exactly as a
    fresh stack would, and the step's in-place update makes the next call stack the new weights."""
    from modeling_tagclip.models.tagclip.device_ops import stacked_weights

    torch.manual_seed(0)
    moe = TagClipHRMoE(tiny_config().vision_config).train()
    layers = [expert.fc1 for expert in moe.experts]
    inputs = [torch.randn(5, layers[0].in_features) for _ in range(2)]
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.1)
    first = stacked_weights(layers, torch.bfloat16)[0]
    for x in inputs:  # two micro-batches through the one cached stack
        weight, bias = stacked_weights(layers, torch.bfloat16)
        assert weight is first and weight.requires_grad
        ((x.bfloat16() @ weight).float().square().sum() + bias.float().sum()).backward()
    cached = [layer.weight.grad.clone() for layer in layers]
    optimizer.zero_grad()
    for x in inputs:  # the same two backward passes through fresh stacks: the same gradients
        weight = torch.stack([layer.weight.t() for layer in layers]).bfloat16()
        bias = torch.stack([layer.bias for layer in layers]).bfloat16()
        ((x.bfloat16() @ weight).float().square().sum() + bias.float().sum()).backward()
    for got, want in zip(cached, [layer.weight.grad for layer in layers], strict=True):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want)
    optimizer.step()
    after = stacked_weights(layers, torch.bfloat16)[0]
    assert after is not first  # the step changed the weights: stacked again, from the updated ones
    torch.testing.assert_close(after[1], layers[1].weight.t().bfloat16())
    assert stacked_weights(layers, torch.bfloat16)[0] is after
    with torch.no_grad():  # a stack made without autograd is not handed to a call that records one
        assert not stacked_weights(layers, torch.bfloat16)[0].requires_grad
    assert stacked_weights(layers, torch.bfloat16)[0].requires_grad
