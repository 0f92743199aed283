"""ViSA, a self-contained Hub custom-code unit: its modules import only each other, transformers and torch.

Building blocks shared with TAG-CLIP are copies marked "Copied from" (kept identical by a test).
"""
