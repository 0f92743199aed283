"""ViSA, a self-contained Hub custom-code unit: its modules import only each other, transformers and torch.

Building blocks shared with TAG-CLIP (attention, loading policy, grouped-GEMM ops, the view convention) are
generated copies of the TAG-CLIP unit's files (``python utils/fix_copies.py``).
"""
