"""Model to metrics: encode an evaluation split and score it (text retrieval, re-ID)."""
