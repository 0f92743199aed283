"""A saved TAG-CLIP folder loads in sentence-transformers (custom input module via modules.json) where this
package is not importable; ``model.similarity`` of the text and image vectors is the project's TAG-PR Eq. 14 score."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fixtures import clean_env, run_python, save_tiny_model, synthetic_gallery, tiny_model

pytest.importorskip("sentence_transformers")

TEXTS = ["a man in a red coat", "a woman with a black backpack", "a child"]
ENCODE = """
import json, sys
from PIL import Image
from sentence_transformers import SentenceTransformer
model = SentenceTransformer(sys.argv[1], trust_remote_code=True, device="cpu")
texts = model.encode(json.loads(sys.argv[2]))
images = model.encode([Image.open(path) for path in sys.argv[3:]])
print(json.dumps({"similarity": model.similarity(texts, images).tolist(), "dim": texts.shape[1],
                  "norms": [float((row ** 2).sum() ** 0.5) for row in images]}))
"""


@pytest.mark.slow
def test_sentence_transformer_on_a_saved_folder_gives_eq14_scores(tmp_path):
    from modeling_tagclip.retrieval.embedded.gallery_index import list_images
    from modeling_tagclip.retrieval.encode import encode_images, encode_texts, eq14_similarity

    folder = save_tiny_model(tmp_path / "model")
    assert json.loads((folder / "modules.json").read_text())[0]["type"] == (
        "sentence_transformers_tagclip.TagClipSentenceEncoder"
    )
    assert (
        json.loads((folder / "config_sentence_transformers.json").read_text())["similarity_fn_name"] == "dot"
    )
    images = list_images(synthetic_gallery(tmp_path / "data"))[:5]
    result = run_python(
        ENCODE, [str(folder), json.dumps(TEXTS), *map(str, images)], tmp_path, clean_env(tmp_path)
    )
    answer = json.loads(result.stdout.strip().splitlines()[-1])

    model, processor = tiny_model()
    text, image = encode_texts(model, processor, TEXTS), encode_images(model, processor, images)
    expected = eq14_similarity(text["global"], image["global"], text["local"], image["local"])
    assert answer["dim"] == text["global"].shape[1] + text["local"].shape[1]
    assert answer["norms"] == pytest.approx([1.0] * len(images), abs=1e-5)  # sqrt(1/2) |[g, l]| = 1
    assert torch.allclose(torch.tensor(answer["similarity"]), expected, atol=1e-5)
    assert float((expected - expected.mean()).abs().max()) > 1e-3 and not math.isnan(float(expected.sum()))
