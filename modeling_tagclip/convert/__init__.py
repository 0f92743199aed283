"""Checkpoint conversion from local files: HF CLIP and official TAG-PR (`tagclip`), ViSA (`visa`), the CLIP vocabulary."""
