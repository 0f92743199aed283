"""benchmarks/bench_serving.py: the serving RAM of an index, from a baseline and a served fresh process."""

import sys
from pathlib import Path

import pytest
import torch
from fixtures import REAL_TEXT, tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root holds benchmarks/

from benchmarks import bench_serving


def test_a_folder_that_is_no_index_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_serving.parse_args([str(tmp_path)])
    assert f"{tmp_path} is not a gallery index folder" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_served_process_holds_about_the_index(tmp_path):
    """A 10k-row exact index (fp32, 1536-d: 59 MiB of vectors) served by a tiny model of the same widths."""
    from modeling_tagclip import TagClipModel, TagClipProcessor
    from modeling_tagclip.retrieval.embedded.index_build import index_embeddings

    torch.manual_seed(0)
    model = tiny_config(text=REAL_TEXT, projection_dim=512, tse_embed_dim=1024)
    TagClipModel(model).save_pretrained(tmp_path / "model")
    TagClipProcessor.from_defaults(32, 16).save_pretrained(tmp_path / "model")
    rows = 10_000
    embeds = {
        key: torch.nn.functional.normalize(torch.randn(rows, dim), dim=-1)
        for key, dim in (("global", 512), ("local", 1024))
    }
    index_embeddings(tmp_path / "index", embeds, [f"{i}.jpg" for i in range(rows)], tmp_path)
    out = tmp_path / "serving.json"
    payload = bench_serving.main(
        [str(tmp_path / "index"), "--model", str(tmp_path / "model"), "--queries", "3", "--output", str(out)]
    )
    (row,) = payload["rows"]
    disk = sum(f.stat().st_size for f in (tmp_path / "index").rglob("*") if f.is_file()) / 2**20
    assert row["size"] == rows and row["index_mib"] == pytest.approx(disk, abs=0.1) and disk > 59
    assert row["added_peak_mib"] > 0.8 * rows * 1536 * 4 / 2**20 and row["added_rss_mib"] > 0
    assert 0.8 < row["peak_over_index"] < 4 and 0.5 < row["rss_over_index"] <= row["peak_over_index"] + 0.05
    assert out.is_file() and payload["model"] == str(tmp_path / "model")
