"""Family-specific parts of a training run: data, model, step and evaluation (``tagclip``, ``visa``)."""
