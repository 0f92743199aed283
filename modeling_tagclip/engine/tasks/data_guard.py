"""Where the embedded synthetic sets may be rendered: the default folder, or one the user asked for explicitly.

A ``data_dir`` without annotation files (a typo, or the root of another dataset) is an error naming what was
expected and which loader fits what was found: data is never rendered into a user's folder unasked.
"""

from __future__ import annotations

from pathlib import Path

KNOWN_FILES = {  # annotation file → (dataset, loader)
    "reid_raw.json": ("CUHK-PEDES", "modeling_tagclip.data.text_retrieval.load_cuhk_pedes"),
    "ICFG-PEDES.json": ("ICFG-PEDES", "modeling_tagclip.data.text_retrieval.load_icfg_pedes"),
    "data_captions.json": ("RSTPReid", "modeling_tagclip.data.text_retrieval.load_rstpreid"),
    "train_reid.json": ("TAG-PEDES-style", "modeling_tagclip.data.text_retrieval.load_tagpedes"),
    "dataset_info.json": ("synthetic re-ID", "modeling_tagclip.data.reid.load_reid_dataset"),
}


def found_datasets(root: Path) -> list[str]:
    """Known annotation files in ``root`` and its direct sub-folders, described with their loader."""
    hits = []
    for folder in [root, *sorted(p for p in root.iterdir() if p.is_dir())] if root.is_dir() else []:
        for name, (dataset, loader) in KNOWN_FILES.items():
            if (folder / name).is_file():
                hits.append(f"{folder / name} ({dataset}: --data {folder}, read by {loader})")
    return hits


def may_render(data_dir: str | Path, default_dir: str | Path, explicit: bool, expected: str) -> None:
    """Raise ``FileNotFoundError`` unless the synthetic set may be rendered into ``data_dir``."""
    data_dir = Path(data_dir)
    if explicit or data_dir.resolve() == Path(default_dir).resolve():
        return
    found = found_datasets(data_dir)
    where = "does not exist" if not data_dir.exists() else f"holds no {expected}"
    hint = ("; found: " + "; ".join(found)) if found else ""
    raise FileNotFoundError(
        f"data_dir {data_dir} {where}{hint}. The synthetic set is rendered only into {default_dir} or, when asked "
        f"explicitly, with --render_synthetic true."
    )
