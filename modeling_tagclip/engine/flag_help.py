"""One line of ``tagclip train --help`` for every setting of the training dataclasses (``engine/config.py``).

A setting without a line here fails ``tests/e2e/test_cli.py``: a new field gets its description when it is added.
"""

from __future__ import annotations

HELP: dict[str, str] = {
    # settings of both tasks
    "task": "retrieval (TAG-CLIP, text -> person) or reid (ViSA, image -> person)",
    "seed": "random seed of initialisation, data order and augmentation",
    "output_dir": "folder for best/, checkpoints/, metrics.jsonl, eval_results.json and plots",
    "data_dir": "dataset folder (the synthetic set is rendered there when it is the default location)",
    "render_synthetic": "render the embedded synthetic set into a --data other than the default",
    "init_from": "a saved or converted model folder to start from (default: train from scratch)",
    "model": "model config overrides as YAML (keys of the family's config), e.g. {projection_dim: 256}",
    "num_train_epochs": "passes over the training split",
    "max_steps": "stop after this many optimizer steps (-1: run every epoch)",
    "per_device_batch_size": "training batch per process (the contrastive losses need >= 2)",
    "learning_rate": "peak learning rate",
    "mixed_precision": "no, fp16, bf16 or auto (bf16 where the GPU has it, else fp16; GPU only)",
    "validation_fraction": "identities carved from train for model selection (0: none)",
    "model_selection": "validation (best epoch on the carved split), last (epoch) or test (reference protocol)",
    "save_steps": "checkpoint every N steps, and at every epoch end (0: epoch ends only)",
    "save_total_limit": "checkpoints kept (the oldest are deleted)",
    "eval_every_epochs": "evaluate on the validation split every N epochs",
    "eval_batch_size": "evaluation batch",
    "logging_steps": "log the losses every N steps",
    "num_workers": "DataLoader processes decoding and augmenting images",
    "num_threads": "torch intra-op threads per process; 0: the machine's cores / processes (printed, and in "
    "eval_results.json: metrics depend on it)",
    "pin_memory": "page-locked batches for faster host-to-GPU copies",
    "persistent_workers": "keep the loader processes across epochs (needs --workers > 0)",
    "plots": "write training_curves.png and retrieval_grid.png",
    "weight_decay": "AdamW / SGD weight decay",
    # TAG-CLIP
    "image_dir": "image root (default: DATA_DIR/images)",
    "train_split": "annotation split to train on",
    "test_split": "annotation split to report",
    "synthetic": "settings of the synthetic set rendered into the default --data (YAML mapping)",
    "bad_data": "error, or skip: drop missing/corrupt images and empty captions with a warning",
    "pretrain_clip": "a plain CLIP pre-trained on the training split before a run from scratch "
    "(YAML mapping: epochs (0: off), batch_size, learning_rate, logit_scale_init_value; into OUTPUT/clip-init)",
    "image_size": "input [height, width]",
    "lr_start": "learning rate at the start of the warm-up",
    "lr_end": "learning rate at the end of the cosine decay",
    "warmup_epochs": "epochs of linear warm-up",
    "adam_betas": "AdamW [beta1, beta2]",
    "adam_eps": "AdamW epsilon",
    "tse_lr_ratio": "learning-rate multiplier of the TSE head",
    "softlabel_ratio": "soft-label weight of the ID loss (null: the model config's)",
    "freeze_patch_embedding": "keep the patch embedding fixed (the reference freezes a pretrained one)",
    "augment": "random crop, flip and erasing on training images",
    "text_max_length": "caption tokens (longer captions are cut)",
    "gather_negatives": "with several processes, contrast against the all-gathered batch",
    "grad_cache_chunks": "> 1: compute each batch's loss in this many chunks (gradient caching, same gradients)",
    "max_grad_norm": "clip the global gradient norm (null: no clipping)",
    "eval_routing": "HR-MoE image-level routing of evaluation and the saved model",
    # ViSA
    "dataset": "synthetic, cargo, agreidv2, lagper or market1501",
    "synthetic_identities": "identities of the rendered synthetic re-ID set",
    "preset": "ViSAConfig preset",
    "imagenet_vit": "timm ViT-B/16 state dict for the trunk",
    "num_instances": "K images per identity in a batch (P = batch / K)",
    "optimizer": "sgd (the reference) or adamw",
    "momentum": "SGD momentum",
    "weight_decay_bias": "weight decay of biases",
    "weight_decay_norm": "weight decay of normalisation layers",
    "clip_norm": "per-tensor gradient-norm clip",
    "warmup_iters": "iterations of linear warm-up",
    "warmup_factor": "learning-rate factor at the start of the warm-up",
    "eta_min": "learning rate at the end of the cosine decay",
    "random_erasing": "probability of random erasing on training images",
}

# the values a text setting takes, as its metavar (config.validate and the model configs check them)
CHOICES: dict[str, str] = {
    "task": "retrieval|reid",
    "mixed_precision": "no|fp16|bf16|auto",
    "model_selection": "validation|last|test",
    "bad_data": "error|skip",
    "eval_routing": "argmax|gumbel|soft|label",
    "optimizer": "sgd|adamw",
    "dataset": "synthetic|cargo|agreidv2|lagper|market1501",
}
