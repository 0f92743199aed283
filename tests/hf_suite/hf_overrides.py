"""ModelTesterMixin overrides shared by the TAG-CLIP and ViSA model test classes of tests/hf_suite.

Not a test module: tests/hf_suite/setup_suite.py copies it to `tests/models/hf_overrides.py` in the scratch tree,
next to the model test packages, which import it as `..hf_overrides`. List these mixins before ModelTesterMixin.
"""

import contextlib
import inspect
import unittest
import unittest.mock
from collections.abc import Sequence

from torch import nn

# ModelTesterMixin's tests that need a loss from the model's forward
TRAINING_TESTS = (
    "test_training",
    "test_training_gradient_checkpointing",
    "test_training_gradient_checkpointing_use_reentrant_false",
    "test_training_gradient_checkpointing_use_reentrant_true",
)


def _skipped_test(self) -> None:
    pass


def skipped(names: Sequence[str], reason: str) -> type:
    """A mixin that replaces each ModelTesterMixin test in `names` by one skipped with `reason`."""
    return type("Skipped", (), {name: unittest.skip(reason=reason)(_skipped_test) for name in names})


class CommonOverrides:
    """The config and model checks every model test class runs, through its config_tester and model_tester."""

    # opt in: the mixin skips this check for files without a "# Copyright <year>" header, ours included
    test_can_init_all_missing_weights_before_2023 = True

    def test_config(self) -> None:
        self.config_tester.run_common_tests()

    def test_model(self) -> None:
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    # upstream tests assume transformers' lenient loading (they reload checkpoints with weights replaced or config
    # attributes such as `rms_norm_eps` added); our models load strictly by default, which our own tests cover
    # (tests/models/test_save_load.py, tests/e2e/test_bad_input_models.py), so the upstream suite runs with strict loading off
    def run(self, result=None):
        with contextlib.ExitStack() as stack:
            for model_class in self.all_model_classes:
                stack.enter_context(unittest.mock.patch.object(model_class, "strict_loading", False))
            return super().run(result)


class PixelInputOverrides:
    """As upstream CLIP vision, for a model whose input is pixels: set `forward_arg_names`, its leading inputs."""

    forward_arg_names: Sequence[str] = ("pixel_values",)

    # the ViT input embedding is a Conv2d and there is no output embedding
    def test_model_get_set_embeddings(self) -> None:
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config)
            self.assertIsInstance(model.get_input_embeddings(), nn.Module)
            x = model.get_output_embeddings()
            self.assertTrue(x is None or isinstance(x, nn.Linear))

    # the forward has no input_ids
    def test_forward_signature(self) -> None:
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        expected = list(self.forward_arg_names)
        for model_class in self.all_model_classes:
            arg_names = [*inspect.signature(model_class(config).forward).parameters.keys()]
            self.assertListEqual(arg_names[: len(expected)], expected)
