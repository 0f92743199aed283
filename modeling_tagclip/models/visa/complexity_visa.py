"""ViSA's size as the paper counts it: parameters and forward FLOPs of a config, without building the model.

The paper's count includes reference modules the model does not create (trunk block 12 and its norm,
`view_gcn`, `image_pe`).
"""

from .configuration_visa import ViSAConfig

__all__ = ["visa_complexity"]


def _linear(d_in: int, d_out: int, bias: bool = True) -> int:
    return d_in * d_out + (d_out if bias else 0)


def _block_params(config: ViSAConfig) -> int:
    """Pre-norm ViT block: 2 LayerNorms, q/k/v/out with bias, MLP."""
    dim, inter = config.hidden_size, config.intermediate_size
    return 4 * dim + 4 * _linear(dim, dim) + _linear(dim, inter) + _linear(inter, dim)


def _post_norm_params(config: ViSAConfig, inter: int) -> int:
    """Post-norm block: bias-free q/k/v, out with bias, 2 LayerNorms, MLP."""
    dim = config.hidden_size
    return 3 * dim * dim + _linear(dim, dim) + 4 * dim + _linear(dim, inter) + _linear(inter, dim)


def _expert_params(config: ViSAConfig) -> int:
    dim = config.hidden_size
    cross = 4 * _linear(dim, dim) + 2 * dim  # cross-attention + norm1
    return config.num_prompt_tokens * dim + cross + _post_norm_params(config, config.expert_intermediate_size)


def _num_branches(config: ViSAConfig) -> int:
    return 2 if config.has_view_branch else 1


def _parameter_counts(config: ViSAConfig) -> dict[str, int]:
    """Parameters of this implementation's modules, and those the reference has but never runs."""
    dim, branches = config.hidden_size, _num_branches(config)
    view_tokens = {"dual": 2, "shared": 1, "none": 0}[config.view_tokens]
    embeddings = _linear(config.num_channels * config.patch_size**2, dim) + (1 + view_tokens) * dim
    embeddings += (config.num_prefix_tokens + config.num_patches) * dim
    counts = {"backbone": embeddings + config.num_hidden_layers * _block_params(config) + 2 * dim}
    expert_sets = 3 if config.has_view_branch else 1  # shared (+ aerial, ground), each with its router
    mixture = config.num_experts * (_expert_params(config) + dim + 1)
    counts["etgm"] = expert_sets * mixture if config.use_etgm else 0
    gcns = 1 if config.dlfm_gcn == "shared" else branches
    counts["dlfm"] = (gcns * dim * dim + branches * 2 * dim) if config.use_dlfm else 0
    fusion = _post_norm_params(config, config.fusion_intermediate_size) + dim
    counts["fusion"] = fusion if config.has_local_branch else 0
    counts["bnnecks"] = 2 * dim * (2 if config.has_local_branch else 1)
    unused = 0
    if config.has_local_branch:  # ViSA's trunk keeps its own last block and norm; b1 is the executed copy
        unused = _block_params(config) + 2 * dim + config.num_patches * dim  # ... and image_pe
    if config.use_dlfm and config.dlfm_gcn == "shared" and branches == 2:
        unused += dim * dim  # view_gcn
    counts["reference_unused"] = unused
    return counts


def _forward_macs(config: ViSAConfig) -> int:
    """Linear + Conv multiply-accumulates for one image, as forward hooks on nn.Linear / nn.Conv2d count them
    in the reference (attention matmuls, the functional GCN and the Gram matrices are not counted)."""
    dim, inter, experts = config.hidden_size, config.intermediate_size, config.num_experts
    tokens = config.num_prefix_tokens + config.num_patches
    macs = config.num_patches * config.num_channels * config.patch_size**2 * dim
    macs += config.num_hidden_layers * tokens * (4 * dim * dim + 2 * dim * inter)
    branches, queries = _num_branches(config), config.queries_per_branch
    if config.use_etgm:
        m, inter_e = config.num_prompt_tokens, config.expert_intermediate_size
        expert = (2 * m + 2) * dim * dim + m * (4 * dim * dim + 2 * dim * inter_e)
        macs += branches * (config.expert_top_k * expert + dim * experts)
    if config.has_local_branch:
        macs += (1 + branches * queries) * (4 * dim * dim + 2 * dim * config.fusion_intermediate_size)
    return macs


def visa_complexity(config: ViSAConfig) -> dict[str, float | int]:
    """Parameter and GFLOP report from the config alone (no model is built), in the paper's accounting.

    - `params_reference`: the reference backbone's `parameters()` (271.77 M for the CARGO config), which
      includes modules it never runs (trunk block 12 and norm, `view_gcn`, `image_pe`) and no heads;
    - `params_model` / `params_for_reid`: this implementation's [`ViSAModel`] (executed modules + BNNecks)
      and [`ViSAForReID`] (plus classifiers and the view head);
    - `gflops`: 2 x Linear/Conv MACs for one image (37.5 for CARGO; the paper reports 37.53).
    """
    counts = _parameter_counts(config)
    dim, classes = config.hidden_size, config.num_identities
    model = sum(value for key, value in counts.items() if key != "reference_unused")
    reference = model - counts["bnnecks"] + counts["reference_unused"]
    heads = classes * dim * (2 if config.has_local_branch else 1) if classes > 0 else 0
    heads += 4 * dim if config.has_view_branch else 0
    macs = _forward_macs(config)
    return {
        "params_reference": reference,
        "params_model": model,
        "params_for_reid": model + heads,
        "macs": macs,
        "gflops": 2 * macs / 1e9,
        **{f"params_{key}": value for key, value in counts.items()},
    }
