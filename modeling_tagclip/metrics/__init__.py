"""Ranking metrics: text-to-image retrieval (R@K, mAP, mINP, per view) and re-ID (CMC, mAP, mINP, protocols)."""
