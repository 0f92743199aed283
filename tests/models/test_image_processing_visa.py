"""ViSA's image processor (image_processing_visa.py) is the reference evaluation transform."""

import pytest
import torch
from fixtures import (
    VISA_LABELS,
    VISA_VIEWS,
    make_visa_model,
    visa_pixels,
)

VIEWS, LABELS, pixels, make_model = VISA_VIEWS, VISA_LABELS, visa_pixels, make_visa_model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


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
