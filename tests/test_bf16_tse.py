"""bf16 TSE: near-tied token selections are re-selected from an fp32 forward, so bf16 keeps fp32's tokens."""

import math

import pytest
import torch
from conftest import tiny_config, tiny_pixels, tiny_text

from modeling_tagclip import TagClipModel
from modeling_tagclip.tagclip.modeling_tagclip import (
    image_tse_scores,
    log_score_spread,
    select_tokens,
    selection_margin,
)


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
    swapped = [[-1.0, wide[1], wide[0], wide[2]], [-1.0, narrow[1], narrow[0], narrow[2]]]
    fp32 = torch.tensor(swapped)
    requested = []

    def fp32_scores(rows):
        requested.append(rows.tolist())
        return fp32[rows]

    index = select_tokens(scores, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.recheck_tse_in_fp32(index.clone(), scores, None, fp32_scores)
    assert requested == [[0]]
    assert out.tolist() == [[2], [1]]  # row 0 takes fp32's token, row 1 keeps its own
    model.tse_recheck_eps = 1.01 * 0.8 / math.log(2)  # more conservative: covers the narrow row's 0.8 eps
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.recheck_tse_in_fp32(index.clone(), scores, None, fp32_scores)
    assert requested[-1] == [0, 1]


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
                model.tse_recheck_eps = 0.0
                plain = features(alpha)
                model.tse_recheck_eps = 1.0
                rechecked = features(alpha)
        plain_differs |= not torch.equal(picks(plain), picks(fp32))
        assert torch.equal(picks(rechecked), picks(fp32))
        # the global embedding stays the bf16 one; TSE embeds the bf16 tokens at fp32's positions
        torch.testing.assert_close(rechecked.pooler_output, plain.pooler_output)
        cosine = torch.nn.functional.cosine_similarity(rechecked.local_embeds.float(), fp32.local_embeds)
        assert cosine.min() > 0.999
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

    model.tse_recheck_eps = 0.0
    plain_differs = False
    for alpha in bisect_change(features):
        with torch.no_grad():
            fp32 = picks(features(alpha))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model.tse_recheck_eps = 0.0
                plain = picks(features(alpha))
                model.tse_recheck_eps = 1.0
                rechecked = picks(features(alpha))
        plain_differs |= not torch.equal(plain, fp32)
        assert torch.equal(rechecked, fp32)
    assert plain_differs


@pytest.mark.parametrize("case", ["fp32", "training", "off"])
def test_recheck_runs_only_under_autocast_at_inference(case):
    """No second tower forward in fp32, in training mode or with `tse_recheck_eps = 0` (every margin flagged)."""
    model = make_model()
    model.tse_recheck_eps = 1e9 if case != "off" else 0.0
    model.train(case == "training")
    calls = []
    model.vision_model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(1), with_kwargs=True
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=case != "fp32"):
        model.get_image_features(pixel_values=tiny_pixels(4))
    assert len(calls) == 1
    model.eval().tse_recheck_eps = 1e9
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model.get_image_features(pixel_values=tiny_pixels(4))
    assert len(calls) == 3  # under autocast at inference: the forward and its fp32 re-check
