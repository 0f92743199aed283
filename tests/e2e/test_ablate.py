"""Tests for the ablation harness: statistics, study definitions, view filtering and a 2 x 2 micro study."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from modeling_tagclip import ablation as A
from modeling_tagclip.ablation import runner as ablate

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "image_size": [32, 16],
    "synthetic": None,
    "validation_fraction": 0.2,
    "model": {
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": 8,
            "moe_layers": [1],
        },
        "text_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
        "projection_dim": 32,
        "tse_embed_dim": 32,
    },
    "per_device_batch_size": 8,
    "num_train_epochs": 1,
    "learning_rate": 1.0e-3,
    "warmup_epochs": 0.5,
    "freeze_patch_embedding": False,
    "text_max_length": 48,
    "save_steps": 0,
    "save_total_limit": 1,
    "eval_every_epochs": 1,
    "plots": False,
}


# ----------------------------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("df, expected", [(1, 12.7062047), (2, 4.3026527), (4, 2.7764451), (30, 2.0422725)])
def test_t_quantile_matches_tables(df, expected):
    assert A.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-5)


def test_mean_ci_uses_sample_std_and_t():
    stats = A.mean_ci([10.0, 12.0, 17.0])
    assert stats["mean"] == pytest.approx(13.0)
    assert stats["std"] == pytest.approx(math.sqrt(((3**2) + 1 + 4**2) / 2))
    assert stats["ci95"] == pytest.approx(4.3026527 * stats["std"] / math.sqrt(3), rel=1e-6)
    single = A.mean_ci([5.0])
    assert single["mean"] == 5.0 and math.isnan(single["ci95"])
    with pytest.raises(ValueError, match="at least one"):
        A.mean_ci([])
    with pytest.raises(ValueError, match="0.5 < p < 1"):
        A.t_quantile(0.2, 3)


def _result(variant: str, seed: int, r1: float, gallery: str = A.ALL) -> dict:
    return {
        "variant": variant,
        "seed": seed,
        "galleries": {gallery: {"R@1": r1, "R@5": r1, "R@10": r1, "mAP": r1}},
    }


def test_orderings_report_holds_and_separation():
    study = A.Study(
        "s",
        "t",
        (A.Variant("a", "A"), A.Variant("b", "B"), A.Variant("c", "C")),
        claims=(("a", "b", A.ALL), ("c", "a", A.ALL)),
    )
    results = [_result("a", s, v) for s, v in enumerate((50, 51, 52))]
    results += [_result("b", s, v) for s, v in enumerate((10, 11, 12))]
    results += [_result("c", s, v) for s, v in enumerate((40, 55, 58))]
    summary = A.summarize(study, results)
    checks = {(c["better"], c["worse"]): c for c in A.orderings(study, summary)}
    assert checks["a", "b"]["holds"] and checks["a", "b"]["separated"]
    assert checks["a", "b"]["difference"] == pytest.approx(40.0)
    assert not checks["c", "a"]["holds"] and not checks["c", "a"]["separated"]
    # paired over seeds: a - b = 40, 40, 40 (std 0: the CI is 0 wide and excludes 0); c - a = -10, 4, 6
    assert (
        checks["a", "b"]["paired"]["mean"] == pytest.approx(40.0) and checks["a", "b"]["paired_excludes_zero"]
    )
    ca = checks["c", "a"]["paired"]
    assert ca["n"] == 3 and ca["mean"] == pytest.approx(0.0) and not checks["c", "a"]["paired_excludes_zero"]
    assert ca["ci95"] == pytest.approx(4.3026527 * math.sqrt((100 + 16 + 36) / 2) / math.sqrt(3), rel=1e-6)
    table = A.markdown_table(study, summary, wall_time_s=120)
    assert "paired +40.00 ± 0.00 over 3 seeds, excludes 0" in table
    assert "| A | all | 3 | 51.00 ± 2.48 |" in table
    assert "c > a (all gallery): does NOT hold" in table and "2.0 min" in table


def test_studies_cover_the_paper_rows():
    t4 = A.STUDIES["table4"]
    assert len(t4.variants) == 8
    vit = t4.variant("vit").set
    assert vit["model.vision_config.block_type"] == "vit" and vit["model.use_view_loss"] is False
    assert t4.variant("full").set == {} and t4.variant("full_no_tse").set == {"model.use_tse": False}
    t5 = A.STUDIES["table5"]
    assert [v.train_view for v in t5.variants] == ["aerial", "ground", "all"]
    assert t5.galleries == ("aerial", "ground", "all") and t5.multi_view_ids_only
    assert A.STUDIES["init"].variant("clip").pretrained_init
    with pytest.raises(ValueError, match="no variant"):
        t4.variant("nope")


def test_table4_variant_configs_build_the_intended_models(tmp_path):
    from modeling_tagclip.engine import config as T
    from modeling_tagclip.engine.tasks.tagclip import build_model

    args = ablate.parse_args(["--study", "table4", "--out", str(tmp_path), "--data", str(tmp_path)])
    runner = ablate.Runner(args)
    built = {}
    for name in ("vit", "moe", "full_no_tse"):
        variant = runner.study.variant(name)
        argv = runner._train_argv(variant, 0, tmp_path, tmp_path / name)
        _, cfg = T.parse_args(
            argv + ["--set", f"model={json.dumps(TINY['model'])}", "--set", "image_size=[32,16]"]
        )
        built[name] = build_model(cfg, 4).config
    assert built["vit"].vision_config.block_type == "vit" and not built["vit"].vision_config.use_view_token
    assert built["moe"].vision_config.block_type == "moe" and not built["moe"].use_ortho_loss
    assert built["full_no_tse"].vision_config.block_type == "hrmoe" and not built["full_no_tse"].use_tse


def test_studies_select_on_validation_and_render_their_own_set_whatever_the_main_job_does(tmp_path):
    """The main job keeps its last epoch on a larger set; the studies' runs keep the settings their published
    tables were measured with: a 10% validation split, selection on it, the 260-identity embedded set."""
    from modeling_tagclip.engine import config as T

    args = ablate.parse_args(["--study", "table4", "--out", str(tmp_path)])
    assert args.synthetic == {"num_identities": 260, "seed": 0, "image_size": (128, 64)}
    runner = ablate.Runner(args)
    argv = runner._train_argv(runner.study.variant("full"), 0, tmp_path, tmp_path / "run")
    _, cfg = T.parse_args(argv)
    assert (cfg.validation_fraction, cfg.model_selection, cfg.max_steps) == (0.1, "validation", 600)
    assert (cfg.pretrain_clip.epochs, cfg.freeze_patch_embedding) == (0, False)
    _, main = T.parse_args([])
    main_settings = (main.validation_fraction, main.model_selection, main.synthetic["num_identities"])
    assert main_settings == (0, "last", 435)


def test_view_data_keeps_multi_view_identities_and_filters_views(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rec = [
        {"id": i, "file_path": f"{i}_{v}.png", "captions": ["a b c d"], "cam_id": v}
        for i in range(4)
        for v in (0, 1)
    ]
    rec = [r for r in rec if not (r["id"] == 3 and r["cam_id"] == 0)]  # identity 3: ground only
    for split in ("train", "test"):
        (data / f"{split}_reid.json").write_text(json.dumps(rec))
    study = A.STUDIES["table5"]
    folder = ablate.view_data(data, tmp_path / "out", study, study.variant("train_aerial"))
    train = json.loads((folder / "train_reid.json").read_text())
    assert {(r["id"], r["cam_id"]) for r in train} == {(0, 0), (1, 0), (2, 0)}
    assert {r["cam_id"] for r in json.loads((folder / "test_ground_reid.json").read_text())} == {1}
    assert len(json.loads((folder / "test_reid.json").read_text())) == 6  # both views of ids 0-2
    (data / "train_reid.json").write_text(json.dumps([{**rec[0], "cam_id": None}]))
    with pytest.raises(ablate.AblationError, match="cam_id"):
        ablate.view_data(data, tmp_path / "out2", study, study.variant("train_both"))


# ----------------------------------------------------------------------------------------------- micro study
@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> tuple[Path, Path]:
    """(dataset folder, tiny training config) shared by the end-to-end tests."""
    from modeling_tagclip.data.synthetic import generate_dataset

    root = tmp_path_factory.mktemp("ablate")
    generate_dataset(
        root / "data",
        num_identities=24,
        seed=0,
        image_size=(32, 16),
        aerial_only_fraction=0.1,
        ground_only_fraction=0.1,
        progress=False,
    )
    (root / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    return root / "data", root / "tiny.yaml"


@pytest.mark.slow
def test_pretrained_clip_converts_and_loads_as_a_fine_tuning_init(tiny_data, tmp_path):
    from transformers import CLIPModel

    from modeling_tagclip.engine.clip_pretraining import pretrained_tagclip
    from modeling_tagclip.engine.config import load_config
    from modeling_tagclip.engine.tasks.clip_pretraining import clip_config
    from modeling_tagclip.engine.tasks.tagclip import build_model

    data, config = tiny_data
    cfg = load_config(config)
    hf = clip_config(cfg.model, cfg.image_size)
    assert (hf.vision_config.hidden_size, hf.vision_config.image_size, hf.text_config.num_hidden_layers) == (
        32,
        32,
        1,
    )
    init = pretrained_tagclip(data, data / "images", tmp_path, cfg, epochs=1)
    clip = CLIPModel.from_pretrained(tmp_path / "clip-hf")
    token = clip.text_model.embeddings.token_embedding.weight
    assert not torch.equal(
        token, CLIPModel(hf).text_model.embeddings.token_embedding.weight
    )  # it was trained
    model = build_model(load_config(config, {"init_from": str(init)}), num_identities=7)
    assert tuple(model.config.vision_config.image_hw) == (
        32,
        16,
    ) and model.config.vision_config.moe_layers == [1]
    assert model.config.num_identities == 7 and model.config.tse_embed_dim == 32
    assert torch.equal(model.get_input_embeddings().weight, token)
    assert pretrained_tagclip(data, data / "images", tmp_path, cfg) == init  # made once, reused


@pytest.mark.slow
def test_micro_study_writes_table_json_plot_and_resumes(tiny_data, tmp_path, monkeypatch):
    data, config = tiny_data
    out = tmp_path / "out"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = [
        "--study",
        "table5",
        "--variants",
        "train_aerial",
        "train_both",
        "--seeds",
        "2",
        "--data",
        str(data),
        "--out",
        str(out),
        "--config",
        str(config),
        "--set",
        "max_steps=4",
    ]
    payload = ablate.main(argv)
    summary = payload["summary"]
    assert set(summary) == {"train_aerial", "train_both"}
    runs = sorted(out.glob("runs/table5/*/seed*/result.json"))
    assert len(runs) == 4
    results = [json.loads(p.read_text()) for p in runs]
    for r in results:
        assert set(r["galleries"]) == {"aerial", "ground", "all"}
        assert all(0.0 <= r["galleries"][g]["R@1"] <= 100.0 for g in r["galleries"])
    aerial_r1 = [r["galleries"]["aerial"]["R@1"] for r in results if r["variant"] == "train_aerial"]
    stats = summary["train_aerial"]["galleries"]["aerial"]["R@1"]
    assert stats["n"] == 2 and stats["mean"] == pytest.approx(sum(aerial_r1) / 2)
    assert stats["ci95"] == pytest.approx(
        12.7062047 * abs(aerial_r1[0] - aerial_r1[1]) / math.sqrt(2) / math.sqrt(2)
    )
    train_sets = {r["variant"]: r["train_images"] for r in results}
    assert train_sets["train_both"] == 2 * train_sets["train_aerial"]  # same identities, one view vs both
    assert {r["best_step"] for r in results} <= {1, 2, 3, 4}  # the same step budget (max_steps) for every run
    saved = json.loads((out / "table5.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(summary)) and len(saved["runs"]) == 4
    table = (out / "table5.md").read_text()
    assert table.count("| aerial images only |") == 3 and "train_both > train_aerial" in table
    assert (out / "table5.png").read_bytes()[:4] == b"\x89PNG"

    logs = sorted(out.glob("runs/table5/*/seed*/train.log"))
    stamps = {p: p.stat().st_mtime_ns for p in runs + logs}
    again = ablate.main(argv)  # every run is finished: nothing is trained (train.log gets no new command)
    assert {p: p.stat().st_mtime_ns for p in runs + logs} == stamps
    assert again["summary"] == payload["summary"]
    assert not list(out.rglob("*.tmp"))


def test_interrupted_run_resumes_from_its_checkpoint(tmp_path):
    args = ablate.parse_args(["--study", "table4", "--out", str(tmp_path), "--data", str(tmp_path)])
    runner = ablate.Runner(args)
    run = runner.run_dir(runner.study.variant("full"), 1)
    assert run == tmp_path / "runs" / "table4" / "full" / "seed1"
    argv = runner._train_argv(runner.study.variant("full"), 1, tmp_path, run)
    assert "--resume-from-checkpoint" not in argv and argv[argv.index("--seed") + 1] == "1"
    (run / "train" / "checkpoints" / "step_70").mkdir(parents=True)
    argv = runner._train_argv(runner.study.variant("full"), 1, tmp_path, run)
    assert argv[-2:] == ["--resume-from-checkpoint", "latest"]
    assert "max_steps=600" in argv and "plots=false" in argv


def test_bad_options_fail_clearly(tmp_path):
    with pytest.raises(SystemExit):
        ablate.parse_args(["--study", "table4", "--variants", "nope"])
    with pytest.raises(SystemExit):
        ablate.parse_args(["--study", "table4", "--shard", "3/2"])
    with pytest.raises(ablate.AblationError, match="not found"):
        ablate.view_data(
            tmp_path, tmp_path / "out", A.STUDIES["table5"], A.STUDIES["table5"].variant("train_both")
        )


def test_init_scratch_reuses_the_identical_table4_run(tmp_path):
    """`scratch` of the init study is Table 4's `full` run (same config, data, seed): reused, never retrained."""
    init, full = A.STUDIES["init"].variant("scratch"), A.STUDIES["table4"].variant("full")
    assert init.set == full.set and init.train_view == full.train_view and init.same_as == "table4/full"
    result = {
        "study": "table4",
        "variant": "full",
        "seed": 1,
        "wall_time_s": 99.0,
        "galleries": {"all": {m: 12.5 for m in A.METRICS}},
    }
    src = tmp_path / "runs" / "table4" / "full" / "seed1" / "result.json"
    src.parent.mkdir(parents=True)
    src.write_text(json.dumps(result))
    runner = ablate.Runner(
        ablate.parse_args(["--study", "init", "--out", str(tmp_path), "--data", str(tmp_path)])
    )
    got = runner.run(init, 1)  # would train (and fail: no data here) if it did not reuse
    assert got["variant"] == "scratch" and got["study"] == "init" and got["reused_from"] == "table4/full"
    assert got["galleries"] == result["galleries"]
    saved = json.loads((tmp_path / "runs" / "init" / "scratch" / "seed1" / "result.json").read_text())
    assert saved == got
    assert runner.reuse(init, 0) is None  # seed 0 of table4/full has not run: train it
    changed = ablate.Runner(
        ablate.parse_args(
            [
                "--study",
                "init",
                "--out",
                str(tmp_path),
                "--data",
                str(tmp_path),
                "--set",
                "learning_rate=0.002",
            ]
        )
    )
    assert changed.reuse(init, 1) is None  # other overrides: not the same run
