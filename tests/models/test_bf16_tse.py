"""bf16 autocast: rows near a tie of TSE's token selection or of the aerial/ground routing are re-run in fp32 and
take its outputs, so bf16 keeps fp32's tokens and routing."""

import math

import pytest
import torch
import torch.nn.functional as F
from fixtures import tiny_config, tiny_pixels, tiny_text

from modeling_tagclip import TagClipModel
from modeling_tagclip.models.tagclip.modeling_tagclip import image_tse_scores
from modeling_tagclip.models.tagclip.precision_tagclip import log_score_spread, selection_margin


def make_model(seed: int = 0) -> TagClipModel:
    torch.manual_seed(seed)
    return TagClipModel(tiny_config()).eval()


def picks(out) -> torch.Tensor:
    return out.tse_indices.sort(dim=1).values


def bisect_change(features, lo: float = 0.0, hi: float = 1.0, steps: int = 20) -> tuple[float, float]:
    """Bracket [lo, hi], about 1e-6 wide, across which fp32's TSE token set of `features(alpha)` changes."""
    with torch.no_grad():
        start = picks(features(lo))
        assert not torch.equal(start, picks(features(hi))), "no change of the token set to bracket"
        for _ in range(steps):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if torch.equal(picks(features(mid)), start) else (lo, mid)
    return lo, hi


def test_selection_margin_numbers():
    scores = torch.tensor([[0.5, 0.3, 0.29, 0.1], [0.4, 0.4, 0.2, -1.0]])
    torch.testing.assert_close(selection_margin(scores, 2), torch.tensor([0.01 / 0.3, 0.5]))
    # n = counts capped at k: a caption with 1 word is compared with its next (padding) score
    torch.testing.assert_close(selection_margin(scores, 2, torch.tensor([1, 5])), torch.tensor([0.4, 0.5]))
    assert torch.isinf(selection_margin(scores, 4)).all()


def test_log_score_spread_numbers():
    scores = torch.tensor([[-1.0, 0.5, 0.25, 0.0625], [-1.0, 0.4, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(log_score_spread(scores), torch.tensor([math.log(8.0), 0.0, 0.0]))


def test_recheck_threshold_scales_with_the_rows_log_score_spread():
    """Regression (issue 14): a fixed 1-epsilon threshold missed an image whose bf16 margin was 3.9 epsilons; the
    threshold is now `tse_recheck_eps` x eps x ln(max / min score), so a wide row (spread ln 2^12 = 8.3, as the
    main job's images) is re-checked at 2 epsilons, a narrow one (spread ln 2, as its captions) is not at 0.8."""
    model = make_model()
    eps = torch.finfo(torch.bfloat16).eps
    wide = [1.0, 1.0 - 2 * eps, 2.0**-12]  # margin 2 eps, spread ln 4096
    narrow = [1.0, 1.0 - 0.8 * eps, 0.5]  # margin 0.8 eps, spread ln 2
    scores = torch.tensor([[-1.0, *wide], [-1.0, *narrow]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.precision_policy.near_ties("cpu", (scores, 1, None)).tolist() == [True, False]
        model.precision_policy.tse_recheck_eps = (
            1.01 * 0.8 / math.log(2)
        )  # more conservative: covers the narrow row's 0.8 eps
        assert model.precision_policy.near_ties("cpu", (scores, 1, None)).tolist() == [True, True]
        model.precision_policy.tse_recheck_eps = 0.0
        assert model.precision_policy.near_ties("cpu", (scores, 1, None)) is None


def test_rerun_replaces_only_the_near_rows_tensors():
    """Near rows take every tensor of the fp32 re-run (cast to the autocast dtype); tuples and other rows stay."""
    model = make_model()
    fields = {
        "dense": torch.zeros(3, 2, dtype=torch.bfloat16),
        "index": torch.tensor([[0], [1], [2]]),
        "view_logits": (torch.zeros(3, 2),),
    }
    requested = []

    def fp32_fields(rows):
        requested.append(rows.tolist())
        return {"dense": torch.full((len(rows), 2), 0.5), "index": torch.tensor([[7]] * len(rows))}

    near = torch.tensor([False, True, False])
    out = model.precision_policy.rerun(fields, near, fp32_fields)
    assert requested == [[1]]
    assert out["dense"].dtype == torch.bfloat16 and out["dense"].tolist() == [[0, 0], [0.5, 0.5], [0, 0]]
    assert out["index"].tolist() == [[0], [7], [2]] and out["view_logits"] is fields["view_logits"]
    assert model.precision_policy.rerun(fields, ~near & False, fp32_fields) is fields and len(requested) == 1


def test_view_margin_numbers():
    """|l_a - l_g| / (sum_i |(w_a - w_g)_i x_i| + |b_a - b_g|): logits (2.5, 3) of x = (2, 3) -> 0.5 / 5.5."""
    moe = make_model().vision_model.encoder.layers[1].mlp
    with torch.no_grad():
        moe.img_router.weight.zero_()
        moe.img_router.weight[0, 0], moe.img_router.weight[1, 1] = 1.0, 1.0
        moe.img_router.bias.copy_(torch.tensor([0.5, 0.0]))
        x = torch.zeros(2, moe.config.hidden_size)
        x[:, 0], x[:, 1] = torch.tensor([2.0, -1.0]), torch.tensor([3.0, -1.0])
        margin = moe.view_margin(x, moe.img_router(x))
    torch.testing.assert_close(
        margin, torch.tensor([0.5 / 5.5, 0.5 / 2.5])
    )  # (-0.5, -1): gap 0.5 of 1 + 1 + 0.5
    moe.train()
    assert moe.view_margin(x, moe.img_router(x)) is None  # not computed in training
    moe.eval().config.routing = "soft"
    assert moe.view_margin(x, moe.img_router(x)) is None  # no argmax decision to flip


@pytest.mark.slow
def test_near_tied_image_keeps_fp32_tokens_under_bf16():
    """Two images 1e-6 apart on both sides of a change of fp32's top-k set: plain bf16 (which cannot tell
    them apart) disagrees with fp32 on one of them; with the fp32 re-check both get fp32's tokens."""
    model = make_model()
    plain_differs = False
    for seed in (3, 4, 5):  # a few of the ~1e-6 steps round a pixel differently in bf16: more than one pair
        a, b = tiny_pixels(2, seed=seed).split(1)
        plain_differs |= _check_pair(model, lambda alpha, a=a, b=b: a + alpha * (b - a))
    assert plain_differs


def _check_pair(model, pixels) -> bool:
    """Asserts bf16 + re-check = fp32 on both sides of the bracket; returns whether plain bf16 differed."""
    features = lambda alpha: model.get_image_features(pixel_values=pixels(alpha))  # noqa: E731
    plain_differs = False
    for alpha in bisect_change(features):
        with torch.no_grad():
            fp32 = features(alpha)
            row = model.vision_model(pixel_values=pixels(alpha)).attention_row
            assert selection_margin(image_tse_scores(row), model.image_tse_k) < 1e-4
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model.precision_policy.tse_recheck_eps = 0.0
                plain = features(alpha)
                model.precision_policy.tse_recheck_eps = 1.0
                rechecked = features(alpha)
        plain_differs |= not torch.equal(picks(plain), picks(fp32))
        assert torch.equal(picks(rechecked), picks(fp32))
        # a re-run row takes fp32's outputs: its global embedding is fp32's rounded to bf16
        assert F.cosine_similarity(rechecked.pooler_output.float(), fp32.pooler_output).min() > 0.99999
        assert F.cosine_similarity(rechecked.local_embeds.float(), fp32.local_embeds).min() > 0.999
    return plain_differs


def test_near_tied_caption_keeps_fp32_tokens_under_bf16():
    """Same for text, the tie made by moving one word's embedding between two vectors."""
    model = make_model()
    ids = tiny_text(1, words=(12,), seed=1)
    table = model.text_model.embeddings.token_embedding.weight
    word = int(ids[0, 3])
    start = table[word].clone()
    end = -3 * start

    def features(alpha):
        with torch.no_grad():
            table[word] = start + alpha * (end - start)
        return model.get_text_features(input_ids=ids)

    model.precision_policy.tse_recheck_eps = 0.0
    plain_differs = False
    for alpha in bisect_change(features):
        with torch.no_grad():
            fp32 = picks(features(alpha))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model.precision_policy.tse_recheck_eps = 0.0
                plain = picks(features(alpha))
                model.precision_policy.tse_recheck_eps = 1.0
                rechecked = picks(features(alpha))
        plain_differs |= not torch.equal(plain, fp32)
        assert torch.equal(rechecked, fp32)
    assert plain_differs


def test_near_tied_routing_takes_fp32_outputs_under_bf16():
    """Regression (issue 14: a seed-1 test image whose aerial/ground decision flipped under bf16, `view_margin`
    0.25 eps, global cosine 0.996): image 0's router bias is set 0.05 bf16 epsilons of `view_margin` either side
    of fp32's decision boundary. Plain bf16 routes both sides alike, so on one side its routing and embeddings
    differ from fp32's; with the re-run both sides get fp32's outputs, and image 1, far from a tie, keeps plain
    bf16's exactly."""
    model = make_model()
    model.precision_policy.tse_recheck_eps = 0.0  # the routing part alone
    router = model.vision_model.encoder.layers[1].mlp.img_router
    with torch.no_grad():
        router.weight.mul_(1000)  # the tiny model's view logits are ~0.01: spread the two images' gaps apart
        model.vision_model.encoder.layers[2].mlp.img_router.bias[0] += 1  # no tie in the second HR-MoE block
    pixels, bias = tiny_pixels(2, seed=1), router.bias.detach().clone()

    def routed(shift: float, amp: bool = False, routing_eps: float = 0.0):
        """(first HR-MoE block's routing, image features) with the aerial logit moved by `shift`."""
        model.precision_policy.routing_recheck_eps = routing_eps
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            router.bias.copy_(bias + torch.tensor([shift, 0.0]))
            out = model.vision_model(pixel_values=pixels, output_router_logits=True)
            return out.router_logits[0], model.get_image_features(pixel_values=pixels)

    routing = routed(0.0)[0]
    with torch.no_grad():
        gap = model.vision_model(pixel_values=pixels).view_logits[0].diff(dim=-1)[:, 0].neg()  # l_a - l_g
    eps = torch.finfo(torch.bfloat16).eps
    delta = 0.05 * eps * float(gap[0].abs() / routing.view_margin[0])
    plain_cos, fp32_groups, bf16_groups = [], [], []
    for shift in (float(-gap[0]) - delta, float(-gap[0]) + delta):
        fp32_routing, fp32 = routed(shift)
        bf16_routing, plain = routed(shift, amp=True)
        assert fp32_routing.view_margin[0] < 0.06 * eps and bf16_routing.view_margin[1] > 4 * eps
        _, rerun = routed(shift, amp=True, routing_eps=2.0)
        fp32_groups.append(int(fp32_routing.group_weights[0].argmax()))
        bf16_groups.append(int(bf16_routing.group_weights[0].argmax()))
        plain_cos.append(float(F.cosine_similarity(plain.pooler_output.float(), fp32.pooler_output)[0]))
        assert F.cosine_similarity(rerun.pooler_output.float(), fp32.pooler_output)[0] > 0.99999
        assert F.cosine_similarity(rerun.local_embeds.float(), fp32.local_embeds)[0] > 0.9999
        assert torch.equal(rerun.tse_indices[0], fp32.tse_indices[0])
        assert torch.equal(rerun.pooler_output[1], plain.pooler_output[1])
        assert torch.equal(rerun.local_embeds[1], plain.local_embeds[1])
    assert fp32_groups in ([0, 1], [1, 0]) and bf16_groups[0] == bf16_groups[1]
    assert min(plain_cos) < 0.9999  # plain bf16 took the other group on one side (0.9994)


@pytest.mark.parametrize("case", ["fp32", "training", "off"])
def test_recheck_runs_only_under_autocast_at_inference(case):
    """No second tower forward in fp32, in training mode or with both re-run constants 0 (every row flagged)."""
    model = make_model()
    model.precision_policy.tse_recheck_eps = model.precision_policy.routing_recheck_eps = (
        1e9 if case != "off" else 0.0
    )
    model.train(case == "training")
    calls = []
    model.vision_model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(1), with_kwargs=True
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=case != "fp32"):
        model.get_image_features(pixel_values=tiny_pixels(4))
    assert len(calls) == 1
    model.eval().precision_policy.tse_recheck_eps = 1e9
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model.get_image_features(pixel_values=tiny_pixels(4))
    assert len(calls) == 3  # under autocast at inference: the forward and its fp32 re-run


def test_the_policy_is_outside_the_towers():
    """The towers return their fields and the evidence of their choices; the model's `precision_policy` alone
    decides about re-runs: `None` gives plain bf16 (equal to the policy with both thresholds 0), and a policy
    object of the caller's sees each tower call with its tensor arguments."""
    model, pixels, ids = make_model(), tiny_pixels(3), tiny_text(2, seed=1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model.precision_policy.tse_recheck_eps = model.precision_policy.routing_recheck_eps = 0.0
        off = model(input_ids=ids, pixel_values=pixels)
        model.precision_policy = None
        plain = model(input_ids=ids, pixel_values=pixels)
        seen = []

        def recording(model_, tower, arguments):
            seen.append((tower.__name__, sorted(k for k, v in arguments.items() if torch.is_tensor(v))))
            fields = tower(model_, **arguments)
            assert set(fields.pop("selection").__dict__) == {"tse", "routing"}
            return fields

        model.precision_policy = recording
        recorded = model(input_ids=ids, pixel_values=pixels)
    torch.testing.assert_close(plain.logits_per_text, off.logits_per_text, rtol=0, atol=0)
    torch.testing.assert_close(recorded.logits_per_text, off.logits_per_text, rtol=0, atol=0)
    assert seen == [("image_tower_features", ["pixel_values"]), ("text_tower_features", ["input_ids"])]
    assert "selection" not in plain.vision_model_output and "selection" not in plain.text_model_output
