"""TAG-CLIP, a self-contained Hub custom-code unit: its modules import only each other, transformers and torch."""
