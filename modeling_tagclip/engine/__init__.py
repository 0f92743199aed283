"""Shared training engine of both model families (TAG-CLIP text-to-person retrieval, ViSA re-ID).

One module per concern: ``config`` (typed recipes, YAML, flags), ``state`` (trainer state as JSON),
``checkpoint`` (atomic save, rotation, verified resume; no pickle), ``accelerator`` (set-up, seeding),
``tracker`` (JSONL metrics), ``samplers`` (epoch-seeded and identity samplers with JSON state), ``loop``
(epochs, progress, model selection, final evaluation). A family's specifics live in ``tasks/``.
This package imports nothing at import time; import the submodules.
"""
