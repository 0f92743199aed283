"""ViSA's evaluation preprocessing as a standard transformers image processor (no custom code needed to load it).

The reference test transform: Resize((256, 128), bicubic) on the RGB image, then (x - 127.5) / 127.5, which is
(x / 255 - 0.5) / 0.5. A ViSA folder saves it, so `AutoImageProcessor.from_pretrained(folder)` reproduces it.
"""

from transformers import ViTImageProcessorPil
from transformers.image_utils import PILImageResampling


def build_visa_image_processor(height: int = 256, width: int = 128) -> ViTImageProcessorPil:
    """The reference evaluation transform at `height` x `width` (the config's `image_size`)."""
    return ViTImageProcessorPil(
        do_resize=True,
        size={"height": height, "width": width},
        resample=PILImageResampling.BICUBIC,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_convert_rgb=True,
    )
