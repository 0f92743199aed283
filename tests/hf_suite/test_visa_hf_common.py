"""transformers' common model tests (ModelTesterMixin, ConfigTester) for ViSA.

Like tests/hf_suite/test_tagclip_hf_common.py, this module is NOT collected by the project's own pytest run: it is
copied by tests/hf_suite/setup_suite.py to `tests/models/visa/test_modeling_visa.py` inside the scratch tree built
from the transformers sdist and run from there. The tiny config is the one of tests/fixtures.py (TINY_VISA). Overrides are
limited to places where ViSA legitimately differs from the mixin's assumptions; each carries a one-line reason.
Those shared with TAG-CLIP are in hf_overrides.py.
"""

import unittest

from transformers.testing_utils import require_torch

from ...test_configuration_common import ConfigTester
from ...test_modeling_common import ModelTesterMixin, floats_tensor, ids_tensor
from ..hf_overrides import TRAINING_TESTS, CommonOverrides, PixelInputOverrides, skipped

from modeling_tagclip import ViSAConfig, ViSAModel  # isort: skip  (the project package, on PYTHONPATH)


class ViSAModelTester:
    """Non-square 32x16 image, 8x8 patches with stride 4 (7x3 overlapping grid), 2 blocks, 3 experts of 2 tokens."""

    def __init__(
        self,
        parent,
        batch_size=6,
        image_size=(32, 16),
        patch_size=8,
        patch_stride=(4, 4),
        num_channels=3,
        is_training=True,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        initializer_range=0.02,
        num_experts=3,
        num_prompt_tokens=2,
        expert_top_k=2,
        expert_intermediate_size=24,
        graph_top_k=5,
        fusion_intermediate_size=40,
        view=None,
    ):
        self.parent = parent
        self.batch_size = batch_size
        self.image_size = list(image_size)
        self.patch_size = patch_size
        self.patch_stride = list(patch_stride)
        self.num_channels = num_channels
        self.is_training = is_training
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.initializer_range = initializer_range
        self.num_experts = num_experts
        self.num_prompt_tokens = num_prompt_tokens
        self.expert_top_k = expert_top_k
        self.expert_intermediate_size = expert_intermediate_size
        self.graph_top_k = graph_top_k
        self.fusion_intermediate_size = fusion_intermediate_size
        self.view = view  # None: a mixed batch (both views); 0 / 1: every image aerial / ground

        rows = (image_size[0] - patch_size) // patch_stride[0] + 1
        cols = (image_size[1] - patch_size) // patch_stride[1] + 1
        self.num_patches = rows * cols
        # CLS + view token + patches: the trunk keeps all of them through every block
        self.seq_length = self.num_patches + 2

    def get_config(self):
        return ViSAConfig(
            image_size=self.image_size,
            patch_size=self.patch_size,
            patch_stride=self.patch_stride,
            num_channels=self.num_channels,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            initializer_range=self.initializer_range,
            num_experts=self.num_experts,
            num_prompt_tokens=self.num_prompt_tokens,
            expert_top_k=self.expert_top_k,
            expert_intermediate_size=self.expert_intermediate_size,
            graph_top_k=self.graph_top_k,
            fusion_intermediate_size=self.fusion_intermediate_size,
            drop_path_rate=0.0,
        )

    def prepare_config_and_inputs(self):
        pixel_values = floats_tensor([self.batch_size, self.num_channels, *self.image_size])
        view_labels = ids_tensor([self.batch_size], 2)  # 0 = aerial, 1 = ground
        if self.view is None:
            view_labels[0], view_labels[1] = 0, 1  # both views (and both expert sets) in every batch
        else:
            view_labels.fill_(self.view)
        return self.get_config(), pixel_values, view_labels

    def create_and_check_model(self, config, pixel_values, view_labels):
        import torch
        from transformers.testing_utils import torch_device

        model = ViSAModel(config).to(torch_device).eval()
        with torch.no_grad():
            result = model(pixel_values, view_labels=view_labels)
        batch, dim = self.batch_size, self.hidden_size
        self.parent.assertEqual(result.last_hidden_state.shape, (batch, self.seq_length, dim))
        self.parent.assertEqual(
            result.pooler_output.shape, (batch, 2 * dim)
        )  # [BNNeck(z_inv), BNNeck(f_loc)]
        for name in ("global_features", "invariant_features", "specific_features", "local_features"):
            self.parent.assertEqual(getattr(result, name).shape, (batch, dim), name)

    def prepare_config_and_inputs_for_common(self):
        config, pixel_values, view_labels = self.prepare_config_and_inputs()
        # dual view tokens and view experts need the view of every image, also at test time
        return config, {"pixel_values": pixel_values, "view_labels": view_labels}


NO_LOSS = "ViSAModel has no loss (the losses are ViSAForReID's), as upstream CLIP's towers"


@require_torch
class ViSAModelTest(
    CommonOverrides,
    PixelInputOverrides,  # as upstream CLIP vision: Conv2d input embedding, forward starts with pixel_values
    skipped(TRAINING_TESTS, NO_LOSS),
    skipped(["test_inputs_embeds"], "ViSA does not use inputs_embeds"),  # pixel input only, as ViT
    ModelTesterMixin,
    unittest.TestCase,
):
    all_model_classes = (ViSAModel,)
    test_resize_embeddings = False  # no token embeddings (image-only model, as upstream ViT/CLIP vision)
    additional_model_inputs = ["view_labels"]  # a forward input besides pixel_values, kept by the mixin
    forward_arg_names = ("pixel_values", "view_labels")

    def setUp(self):
        self.model_tester = ViSAModelTester(self)
        # the mixin's default hidden_size=37 is rejected by @strict validation (not a multiple of the 12 heads)
        self.config_tester = ConfigTester(
            self, config_class=ViSAConfig, has_text_modality=False, hidden_size=32, num_attention_heads=4
        )

    # ViSA: the aerial / ground router logits hold one row per image *of that view*, so row 0 of a mixed batch is
    # not image 0's; run the mixin's check on single-view batches, once per view (mixed batches: test_model etc.)
    def test_batching_equivalence(self):
        tester = self.model_tester
        try:
            for view in (0, 1):
                self.model_tester = ViSAModelTester(self, view=view)
                with self.subTest(view=view):
                    super().test_batching_equivalence()
        finally:
            self.model_tester = tester
