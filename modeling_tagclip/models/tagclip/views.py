"""The view convention of the whole package: input label i is ``VIEW_NAMES[i]`` (view_labels, view heads,
expert groups, datasets, indexes). The ViSA unit, the DTG and ablation packages and the serving files carry generated
copies (``utils/fix_copies.py``)."""

VIEW_NAMES = ("aerial", "ground")
AERIAL, GROUND = 0, 1
