"""DTG caption generation: strategies, mixing rule, resume, quality check, and the CLI on a tiny random VLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path, PurePosixPath

import pytest
from fixtures import build_tiny_vlm

from modeling_tagclip import dtg
from modeling_tagclip.atomic_io import write_json
from modeling_tagclip.data.synthetic import generate_dataset
from modeling_tagclip.data.text_retrieval import load_tagpedes
from modeling_tagclip.dtg import TEMPLATES
from modeling_tagclip.dtg.cli import main as dtg_main

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- fixtures and fakes


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Path:
    """A tiny synthetic TAG-PEDES tree: images/, train_reid.json (8 images), test_reid.json."""
    root = tmp_path_factory.mktemp("synth")
    generate_dataset(root, num_identities=4, seed=0, image_size=(64, 32), progress=False)
    return root


@pytest.fixture
def items(synth) -> list[dtg.ImageItem]:
    return dtg.load_dataset_items(synth / "train_reid.json")[0]


def _kind(prompt: str) -> str:
    if prompt == dtg.PROMPT_BASED:
        return "prompt"
    return "attribute" if "based on the attribute" in prompt else "template"


class FakeGenerator:
    """Deterministic: the answer depends only on the image pixels and the prompt; can fail after N calls."""

    def __init__(self, fail_after: int | None = None, empty: set[str] | None = None):
        self.calls, self.seen, self.fail_after, self.empty = 0, 0, fail_after, empty or set()

    def __call__(self, images, prompts):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("simulated interruption")
        self.calls += 1
        self.seen += len(images)
        return [self._answer(im, p) for im, p in zip(images, prompts, strict=True)]

    def _answer(self, image, prompt) -> str:
        crc = zlib.crc32(image.tobytes(), zlib.crc32(prompt.encode()))
        if _kind(prompt) in self.empty:
            return "  \n "
        return f"The image shows:  a {_kind(prompt)}   person {crc:08x}."


def _run(items, synth, out, gen, **kw):
    return dtg.generate_captions(items, synth / "images", gen, out, progress=False, **kw)


# ----------------------------------------------------------------------------- strategies and mixing


def test_prompts_are_the_papers():
    assert dtg.PROMPT_BASED.startswith("Don't mention the background of the people in the image.")
    assert "Finally, combine all the details into a single sentence." in dtg.PROMPT_BASED
    assert "in a style similar to the template: {template}. If some requirements" in dtg.TEMPLATE_BASED
    assert dtg.TEMPLATE_BASED.endswith("Do not imagine any contents not in the image.")
    assert "based on the attribute: {attributes}, in a style similar to the template: {template}." in (
        dtg.ATTRIBUTE_BASED
    )
    assert dtg.ATTRIBUTE_BASED.endswith("Do not imagine any contents that are not in the image.")
    assert len(TEMPLATES) >= 20 and len(set(TEMPLATES)) == len(TEMPLATES)


def test_mixing_rule_without_and_with_attributes():
    plain = [dtg.ImageItem(f"{i:03d}.jpg", i) for i in range(40)]
    for item in plain:
        plan = dtg.plan_captions(item, TEMPLATES, seed=1)
        assert [s for s, _ in plan] == ["prompt", "template"]
        assert plan[0][1] == dtg.PROMPT_BASED
        assert any(dtg.TEMPLATE_BASED.replace("{template}", t) == plan[1][1] for t in TEMPLATES)
    labelled = [dtg.ImageItem(f"{i:03d}.jpg", i, attributes="gender: male, backpack") for i in range(40)]
    seconds = []
    for item in labelled:
        (first, p1), (second, p2) = dtg.plan_captions(item, TEMPLATES, seed=1)
        assert first == "attribute" and "based on the attribute: gender: male, backpack, in a style" in p1
        assert any(f"template: {t}. If" in p1 for t in TEMPLATES)
        assert p1 != p2 or second != "template"
        seconds.append(second)
    assert set(seconds) == {"prompt", "template"}  # chosen at random, both happen


def test_plan_is_seeded_per_image():
    items = [dtg.ImageItem(f"{i}.png", i, attributes="young") for i in range(30)]
    plan = [dtg.plan_captions(it, TEMPLATES, seed=3) for it in items]
    assert plan == [dtg.plan_captions(it, TEMPLATES, seed=3) for it in items]
    assert plan[::-1] == [dtg.plan_captions(it, TEMPLATES, seed=3) for it in items[::-1]]
    assert plan != [dtg.plan_captions(it, TEMPLATES, seed=4) for it in items]


def test_format_and_attach_attributes():
    labels = {
        "gender": "female",
        "age": "young",
        "backpack": True,
        "hat": False,
        "upper_color": ["red", "blue"],
    }
    assert dtg.format_attributes(labels) == "gender: female, age: young, backpack, upper color: red blue"
    assert dtg.format_attributes(["male", "", "adult"]) == "male, adult"
    assert dtg.format_attributes(None) == "" and dtg.format_attributes({"hat": 0}) == ""
    items = [
        dtg.ImageItem("a/0001_c1.jpg", 1),
        dtg.ImageItem("b/0002_c2.jpg", 2),
        dtg.ImageItem("c/x.jpg", 3),
    ]
    mapping = {"a/0001_c1.jpg": ["by path"], "0002_c2": ["by stem"], "3": ["by id"], "0001_c1.jpg": ["name"]}
    assert dtg.attach_attributes(items, mapping) == 3
    assert [it.attributes for it in items] == ["by path", "by stem", "by id"]


def test_id_and_view_rules(synth):
    assert dtg.parse_id(PurePosixPath("bounding_box_train/0002_c1s1_000451_03.jpg")) == 2
    assert dtg.parse_id(PurePosixPath("P0101/P0101T02110A0C0F0013.jpg")) == 101
    assert dtg.parse_id(PurePosixPath("0007/img.jpg")) == 7
    assert dtg.parse_id(PurePosixPath("0007/img.jpg"), "file") is None
    assert dtg.parse_id(PurePosixPath("0007/3_x.jpg"), "folder") == 7
    assert dtg.parse_id(PurePosixPath("bounding_box_test/-1_c1.jpg")) is None
    assert dtg.view_from_path(PurePosixPath("UAV/0001/x.jpg")) == 0
    assert dtg.view_from_path(PurePosixPath("ground/x.jpg")) == 1
    assert dtg.view_from_path(PurePosixPath("cam3/x.jpg")) is None
    scanned, skipped = dtg.scan_images(synth / "images")
    truth = {
        e["file_path"]: e["id"]
        for n in ("train", "test")
        for e in json.loads((synth / f"{n}_reid.json").read_text())
    }
    assert {it.file_path: it.id for it in scanned} == truth and not skipped


def test_scan_relative_to_common_root(synth):
    train, _ = dtg.scan_images(synth / "images" / "train", relative_to=synth / "images" / "train" / "..")
    expected = [e["file_path"] for e in json.loads((synth / "train_reid.json").read_text())]
    assert [it.file_path for it in train] == expected
    with pytest.raises(ValueError, match="must contain"):
        dtg.scan_images(synth / "images", relative_to=synth / "images" / "train")


def test_clean_caption():
    assert dtg.clean_caption("  The image shows:  a man\n in a red   coat. ") == "A man in a red coat."
    assert (
        dtg.clean_caption("Sure! Here is a detailed description:\n\n**A woman** with a bag.")
        == "A woman with a bag."
    )
    assert dtg.clean_caption('"In this photo, a girl in jeans."') == "A girl in jeans."
    assert dtg.clean_caption("The person in the image is a man.") == "The person in the image is a man."
    assert dtg.clean_caption(" \n ") == "" and dtg.clean_caption("Certainly.") == ""


# ----------------------------------------------------------------------------- driver, resume, output


def test_generate_writes_loadable_tagpedes(synth, items, tmp_path):
    out = tmp_path / "train_reid.json"
    records, stats = _run(items, synth, out, FakeGenerator())
    entries = dtg.to_tagpedes(records)
    write_json(out, entries)
    source = json.loads((synth / "train_reid.json").read_text())
    assert [e["file_path"] for e in entries] == [s["file_path"] for s in source]
    assert [(e["id"], e["cam_id"]) for e in entries] == [(s["id"], s["cam_id"]) for s in source]
    assert all(
        set(e) == {"id", "file_path", "captions", "cam_id"} and len(e["captions"]) == 2 for e in entries
    )
    assert entries[0]["captions"][0].startswith("A prompt person ")
    assert stats.images == len(source) and stats.captions == 2 * len(source)
    assert stats.by_strategy == {"prompt": len(source), "template": len(source)}
    ds = load_tagpedes(out, synth / "images", "train")
    assert ds.num_rows == len(source) and ds["view"] == [s["cam_id"] for s in source]


def test_attribute_labels_mix_in(synth, items, tmp_path):
    identities = json.loads((synth / "identities.json").read_text())
    mapping = {str(p["id"]): {"gender": p["attributes"].get("gender"), "bag": True} for p in identities}
    assert dtg.attach_attributes(items, mapping) == len(items)
    records, stats = _run(items, synth, tmp_path / "o.json", FakeGenerator())
    assert all(r["strategies"][0] == "attribute" for r in records)
    assert stats.by_strategy["attribute"] == len(items)
    assert all(c.startswith("A attribute person") for r in records for c in r["captions"][:1])


@pytest.mark.parametrize("fail_after", [1, 3])
def test_resume_after_interruption(synth, items, tmp_path, fail_after):
    reference, _ = _run(items, synth, tmp_path / "ref.json", FakeGenerator(), batch_size=2)
    out = tmp_path / "run.json"
    with pytest.raises(KeyboardInterrupt):
        _run(items, synth, out, FakeGenerator(fail_after=fail_after), batch_size=2, settings={"seed": 0})
    partial = out.with_name(out.name + ".partial.jsonl")
    lines = [json.loads(x) for x in partial.read_text().splitlines()]
    assert lines[0] == {"settings": {"seed": 0}} and len(lines) == 1 + fail_after
    with open(partial, "a") as f:
        f.write('{"file_path": "torn')  # a write cut short by the interruption
    second = FakeGenerator()
    records, stats = _run(items, synth, out, second, batch_size=2, settings={"seed": 0})
    assert second.seen == 2 * (len(items) - fail_after) and stats.resumed == fail_after
    assert records == reference
    paths = [json.loads(x)["file_path"] for x in partial.read_text().splitlines()[1:] if x.endswith("}")]
    assert len(paths) == len(set(paths)) == len(items)
    again = FakeGenerator()
    assert _run(items, synth, out, again, settings={"seed": 0})[0] == reference and again.calls == 0


def test_resume_refuses_other_settings(synth, items, tmp_path):
    out = tmp_path / "o.json"
    _run(items, synth, out, FakeGenerator(), limit=2, settings={"seed": 0})
    with pytest.raises(ValueError, match="other settings \\(seed\\)"):
        _run(items, synth, out, FakeGenerator(), settings={"seed": 1})
    records, stats = _run(items, synth, out, FakeGenerator(), settings={"seed": 1}, force_resume=True)
    assert len(records) == len(items) and stats.resumed == 2


def test_limit_batch_size_and_seed(synth, items, tmp_path):
    full, _ = _run(items, synth, tmp_path / "a.json", FakeGenerator(), batch_size=8)
    assert _run(items, synth, tmp_path / "b.json", FakeGenerator(), batch_size=1)[0] == full
    assert _run(items, synth, tmp_path / "c.json", FakeGenerator(), batch_size=5)[0] == full
    assert _run(items, synth, tmp_path / "d.json", FakeGenerator(), limit=3)[0] == full[:3]
    other, _ = _run(items, synth, tmp_path / "e.json", FakeGenerator(), seed=7)
    assert [r["captions"] for r in other] != [r["captions"] for r in full]


class RetryingFake(FakeGenerator):
    """The retry answers every other prompt."""

    def retry(self, images, prompts):
        return ["Retried text." if i % 2 == 0 else "" for i in range(len(images))]


def test_empty_generations_retry_then_drop(synth, items, tmp_path):
    gen = FakeGenerator(empty={"prompt", "template"})
    records, stats = _run(items, synth, tmp_path / "o.json", gen)
    assert gen.seen == 4 * len(items) and stats.retried == 2 * len(items)  # no .retry: called once more
    assert stats.empty_dropped == 2 * len(items) and stats.images_dropped == len(items)
    assert dtg.to_tagpedes(records) == []
    records, stats = _run(items, synth, tmp_path / "p.json", FakeGenerator(empty={"template"}))
    assert all(r["captions"] and r["strategies"] == ["prompt"] for r in records)
    assert stats.empty_dropped == len(items) and stats.images_dropped == 0
    records, stats = _run(items, synth, tmp_path / "q.json", RetryingFake(empty={"template"}))
    fixed = sum(r["captions"][-1] == "Retried text." for r in records)
    assert stats.retried == len(items) and stats.empty_dropped == len(items) - fixed


# ----------------------------------------------------------------------------- quality check and filter


def test_parse_quality():
    assert dtg.parse_quality("Match") == "Match" and dtg.parse_quality(" **match**.") == "Match"
    assert dtg.parse_quality("Contradictory: the shirt is blue") == "Contradictory"
    assert dtg.parse_quality("I would say it is hallucinatory") == "Hallucinatory"
    assert dtg.parse_quality("VACUOUS") == "Vacuous"
    assert dtg.parse_quality("It does not match; contradictory.") == "Contradictory"
    assert dtg.parse_quality("mismatch") is None and dtg.parse_quality("") is None


class FakeJudge:
    """Labels by the caption's strategy word; every 4th answer is unparsable."""

    answers = {"prompt": "Match", "template": "contradictory.", "attribute": "hallucinatory"}

    def __init__(self):
        self.n = 0

    def __call__(self, images, prompts):
        out = []
        for prompt in prompts:
            self.n += 1
            kind = next(k for k in self.answers if f"a {k} person" in prompt.lower())
            out.append("no idea" if self.n % 4 == 0 else self.answers[kind])
        return out


def test_quality_check_proportions_and_filter(synth, items, tmp_path, capsys):
    out = tmp_path / "o.json"
    records, _ = _run(items, synth, out, FakeGenerator())
    summary, labels = dtg.quality_check(
        records, synth / "images", FakeJudge(), out, batch_size=3, progress=False
    )
    total = 2 * len(items)
    assert summary["total"] == total == len(labels) and summary["unparsed"] == total // 4
    assert sum(summary["counts"].values()) == total
    assert summary["counts"]["Vacuous"] == summary["unparsed"]
    assert summary["proportions"]["Match"] == pytest.approx(summary["counts"]["Match"] / total)
    assert summary["by_strategy"]["prompt"]["Contradictory"] == 0
    table = dtg.format_quality_table(summary)
    assert "Match" in table and "Hallucinatory" in table and "unparsed" in table
    kept, counts = dtg.filter_records(records, labels)
    assert all(r["strategies"] == ["prompt"] and len(r["captions"]) == 1 for r in kept)
    assert len(kept) == summary["counts"]["Match"] and counts["images_dropped"] == len(items) - len(kept)
    assert counts["captions_dropped"] == total - len(kept)
    resumed = FakeJudge()
    assert dtg.quality_check(records, synth / "images", resumed, out, progress=False)[1] == labels
    assert resumed.n == 0


# ----------------------------------------------------------------------------- tiny random VLM (no download)


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("tinyvlm"))


def test_hf_generator_on_tiny_vlm(tiny_vlm, synth, items):
    from PIL import Image

    gen = dtg.HFGenerator(str(tiny_vlm), batch_size=2, max_new_tokens=5, device="cpu")
    images = [Image.open(synth / "images" / it.file_path).convert("RGB") for it in items[:3]]
    prompts = [dtg.PROMPT_BASED, dtg.TEMPLATE_BASED, "short"]
    answers = gen(images, prompts)
    assert len(answers) == 3 and all(a.strip() for a in answers)
    assert gen(images, prompts) == answers  # greedy: repeatable
    assert len(gen.retry(images, prompts)) == 3
    judge = gen.with_options(max_new_tokens=2)
    assert judge.model is gen.model and judge.max_new_tokens == 2 and gen.max_new_tokens == 5
    assert isinstance(gen, dtg.CaptionGenerator)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "modeling_tagclip.cli",
        "dtg",
        *args,
        "--max-new-tokens",
        "6",
        "--no-progress",
    ]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_cli_tiny_vlm_images_resume_and_quality(tiny_vlm, synth, tmp_path):
    image_dir = synth / "images" / "train"
    out = tmp_path / "x.json"
    args = ["--images", str(image_dir), "--model", str(tiny_vlm), "--out", str(out), "--batch-size", "4"]
    dtg_main([*args, "--limit", "3", "--max-new-tokens", "6", "--no-progress"])  # in-process: saves an import
    first = json.loads(out.read_text())
    assert len(first) == 3
    result = _cli(*args, "--quality-check")
    entries = json.loads(out.read_text())
    n = len(list(image_dir.rglob("*.png")))
    assert len(entries) == n and entries[:3] == first and "(3 resumed)" in result.stdout
    for e in entries:
        assert set(e) == {"id", "file_path", "captions"} and len(e["captions"]) == 2
        assert (
            e["id"] == int(PurePosixPath(e["file_path"]).name[:5]) and (image_dir / e["file_path"]).is_file()
        )
        assert all(isinstance(c, str) and c.strip() for c in e["captions"])
    lines = out.with_name(out.name + ".partial.jsonl").read_text().splitlines()
    assert len(lines) == 1 + n and "settings" in json.loads(lines[0])
    quality = json.loads(out.with_name(out.name + ".quality.json").read_text())
    assert quality["summary"]["total"] == 2 * n and len(quality["labels"]) == 2 * n
    assert "Quality check" in result.stdout
    ds = load_tagpedes(out, image_dir, "train")
    assert ds.num_rows == n and set(ds["view"]) == {1}  # no cam_id -> ground


@pytest.mark.slow
def test_cli_tiny_vlm_dataset_carries_views(tiny_vlm, synth, tmp_path):
    out = tmp_path / "train_reid.json"
    dataset = str(synth / "train_reid.json")
    dtg_main(
        ["--dataset", dataset, "--model", str(tiny_vlm), "--out", str(out), "--limit", "4", "--no-progress"]
    )
    entries = json.loads(out.read_text())
    source = json.loads((synth / "train_reid.json").read_text())[:4]
    assert [(e["id"], e["file_path"], e["cam_id"]) for e in entries] == [
        (s["id"], s["file_path"], s["cam_id"]) for s in source
    ]
    assert load_tagpedes(out, synth / "images", "train")["view"] == [s["cam_id"] for s in source]


@pytest.mark.parametrize("value", ["0", "-3"])
def test_cli_refuses_a_batch_size_below_one(value, capsys):
    with pytest.raises(SystemExit):
        dtg_main(["--images", "x", "--model", "m", "--out", "o.json", "--batch-size", value])
    assert f"--batch-size: must be a positive integer, got {value!r}" in capsys.readouterr().err
