"""Detectors: bounded output, the motion detector (known answer and the synthetic footage), a tiny random
RT-DETR loaded by path (person class, batching, errors), and detections files."""

import json

import numpy as np
import pytest
import torch

from modeling_tagclip.video.detect import (
    DetectionFileError,
    DetectorError,
    MotionDetector,
    TransformersDetector,
    bound,
    load_detections,
    load_detector,
)
from modeling_tagclip.video.footage import render_footage
from modeling_tagclip.video.mot_eval import detection_scores, read_gt


def test_bound_drops_non_finite_clips_and_keeps_the_best():
    rng = np.random.default_rng(0)
    many = np.column_stack(
        [rng.uniform(0, 40, (10_000, 2)), rng.uniform(50, 90, (10_000, 2)), rng.random(10_000)]
    )
    many[:5, 4] = [2.0, 3.0, 4.0, 5.0, 6.0]  # the five best
    many[5] = [np.nan, 0, 10, 10, 9.0]
    many[6] = [0, 0, np.inf, 10, 8.0]
    out = bound(many, (64, 80, 3), threshold=0.0, min_size=1, max_boxes=5)
    assert out.dtype == np.float32 and out.shape == (5, 5)
    assert out[:, 4].tolist() == [6.0, 5.0, 4.0, 3.0, 2.0]
    assert (out[:, 2] <= 80).all() and (out[:, 3] <= 64).all()
    small = bound(
        [[0, 0, 3, 30, 0.9], [0, 0, 30, 30, 0.2], [-5, -5, 20, 20, 0.9]],
        (64, 80),
        threshold=0.5,
        min_size=4,
        max_boxes=10,
    )
    assert small.tolist() == [[0, 0, 20, 20, 0.9]] or np.allclose(small, [[0, 0, 20, 20, 0.9]])
    assert bound([], (10, 10), threshold=0, min_size=0, max_boxes=3).shape == (0, 5)


def _scene(rng, h=60, w=90):
    return rng.integers(60, 200, (h, w, 3)).astype(np.float64)


def test_motion_detector_finds_a_moving_block():
    """A 12 x 24 block moving over a fixed noisy scene: its box, to the pixel, in every frame of the batch."""
    rng = np.random.default_rng(1)
    scene = _scene(rng)
    frames, truth = [], []
    for i in range(8):
        frame = scene + rng.normal(0, 2, scene.shape)
        x = 5 + 9 * i
        frame[20:44, x : x + 12] = (230, 20, 20)
        frames.append(np.clip(frame, 0, 255).astype(np.uint8))
        truth.append([x, 20, x + 12, 44])
    detector = MotionDetector(min_size=4)
    found = detector(frames)
    for boxes, box in zip(found, truth, strict=True):
        assert len(boxes) == 1 and np.allclose(boxes[0, :4], box, atol=1), (boxes, box)
        assert boxes[0, 4] > 0.9  # the block fills its box
    still = np.clip(scene, 0, 255).astype(np.uint8)
    assert all(len(b) == 0 for b in detector([still] * 4))  # the scene it learnt: nothing moves
    detector.reset()
    assert len(detector.history) == 0


@pytest.fixture(scope="module")
def footage(tmp_path_factory):
    return render_footage(
        tmp_path_factory.mktemp("footage"),
        seed=1,
        ground_cameras=1,
        aerial_cameras=0,
        people=3,
        people_per_camera=3,
        seconds=4.0,
        fps=5.0,
        size=(120, 200),
    )


def test_motion_detector_on_the_synthetic_footage(footage):
    """Recall and precision at IoU 0.5 (motmetrics) on a ground camera."""
    import av

    with av.open(str(footage.videos[0])) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    detector = load_detector("motion")
    found = {}
    for start in range(0, len(frames), 8):
        for i, boxes in enumerate(detector(frames[start : start + 8]), start=start):
            found[i + 1] = boxes
    scores = detection_scores(read_gt(footage.gt[0]), found, range(1, len(frames) + 1))
    assert scores["num_objects"] > 20
    assert scores["recall"] >= 0.7 and scores["precision"] >= 0.7, scores


def _tiny_rtdetr(path, id2label):
    from transformers import ResNetConfig, RTDetrConfig, RTDetrForObjectDetection, RTDetrImageProcessor

    backbone = ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16, 32, 64],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        out_features=["stage2", "stage3", "stage4"],
    )
    config = RTDetrConfig(
        backbone_config=backbone,
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        d_model=32,
        encoder_hidden_dim=32,
        encoder_in_channels=[16, 32, 64],
        decoder_in_channels=[32, 32, 32],
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_queries=20,
        decoder_layers=1,
        encoder_layers=1,
        decoder_attention_heads=2,
        encoder_attention_heads=2,
        num_denoising=0,
        num_labels=len(id2label),
        id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
    )
    torch.manual_seed(0)
    RTDetrForObjectDetection(config).eval().save_pretrained(path)
    RTDetrImageProcessor(size={"height": 64, "width": 64}).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rtdetr(tmp_path_factory):
    return _tiny_rtdetr(tmp_path_factory.mktemp("rtdetr"), {0: "car", 1: "Person"})


def _images(n):
    return [np.random.default_rng(i).integers(0, 255, (48, 80, 3), dtype=np.uint8) for i in range(n)]


def test_transformers_detector_keeps_the_person_class(rtdetr):
    """The detector equals the model + processor run by hand, person rows only, best first, bounded."""
    detector = load_detector(rtdetr, threshold=0.0, min_size=0, max_boxes=7, batch_size=2)
    assert isinstance(detector, TransformersDetector) and detector.person == 1
    images = _images(3)
    found = detector(images)
    inputs = detector.processor(images=images, return_tensors="pt")
    with torch.no_grad():
        outputs = detector.model(**inputs)
    results = detector.processor.post_process_object_detection(
        outputs, threshold=0.0, target_sizes=[(48, 80)] * 3
    )
    for boxes, result in zip(found, results, strict=True):
        keep = result["labels"].numpy() == 1
        expected = np.column_stack([result["boxes"].numpy()[keep], result["scores"].numpy()[keep]])
        expected = expected[np.argsort(-expected[:, 4], kind="stable")][:7]
        expected[:, [0, 2]] = expected[:, [0, 2]].clip(0, 80)
        expected[:, [1, 3]] = expected[:, [1, 3]].clip(0, 48)
        assert boxes.shape == (min(7, int(keep.sum())), 5) and boxes.shape[0] > 0
        np.testing.assert_allclose(boxes, expected, atol=1e-4)
    detector.batch_size = 1
    for a, b in zip(found, detector(images), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)  # batching changes nothing
    detector.threshold = 0.99
    assert all(len(b) == 0 for b in detector(images))  # random weights score far below 0.99


def test_transformers_detector_errors(tmp_path):
    no_person = _tiny_rtdetr(tmp_path / "cars", {0: "car", 1: "bus"})
    with pytest.raises(DetectorError, match=r"id2label has no person class \(car, bus\)"):
        load_detector(no_person)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DetectorError, match="not a transformers checkpoint"):
        load_detector(str(tmp_path / "empty"))


def test_load_detections_mot_and_json(tmp_path):
    mot = tmp_path / "det.txt"
    mot.write_text("1,-1,10,20,30,40,0.9,-1,-1,-1\n1,-1,0,0,5,5,0.2,-1,-1,-1\n\n3,-1,1.5,2.5,10,10,0.7\n")
    det = load_detections(mot)
    assert det.boxes(0).tolist() == [[10, 20, 40, 60, pytest.approx(0.9)], [0, 0, 5, 5, pytest.approx(0.2)]]
    assert det.boxes(1).shape == (0, 5) and len(det) == 3
    np.testing.assert_allclose(det.boxes(2), [[1.5, 2.5, 11.5, 12.5, 0.7]], rtol=1e-6)
    js = tmp_path / "det.json"
    js.write_text(
        json.dumps([{"frame": 2, "box": [1, 2, 3, 4], "score": 0.5}, {"frame": 2, "box": [5, 6, 7, 8]}])
    )
    np.testing.assert_allclose(load_detections(js).boxes(1), [[1, 2, 3, 4, 0.5], [5, 6, 7, 8, 1.0]])


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.txt", "1,-1,10,20,30\n", r"a.txt:1: a MOTChallenge line needs frame,id,x,y,w,h,score"),
        (
            "b.txt",
            "1,-1,10,20,30,40,0.9\n0,-1,1,1,1,1,1\n",
            r"b.txt:2: frame '0' must be a whole number >= 1",
        ),
        ("c.txt", "1,-1,10,20,nan,40,0.9\n", r"c.txt:1: 'nan' is not a finite number"),
        ("d.txt", "1,-1,10,20,-3,40,0.9\n", r"d.txt:1: width and height must be > 0"),
        ("e.json", '{"frame": 1}', r"e.json: JSON detections must be a list"),
        ("f.json", '[{"frame": 1, "box": [5, 5, 1, 9]}]', r"f.json: item 0: box \[5, 5, 1, 9\] has no area"),
        ("g.json", '[{"frame": 1, "box": [1, 2, 3]}]', r"g.json: item 0: box must be \[x1, y1, x2, y2\]"),
        ("h.json", "not json", r"h.json: not valid JSON"),
    ],
)
def test_bad_detections_files(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(DetectionFileError, match=message) as error:
        load_detections(tmp_path / name)
    assert "\n" not in str(error.value)


def test_missing_detections_file(tmp_path):
    with pytest.raises(DetectionFileError, match=r"--detections .*missing.txt: cannot read it"):
        load_detections(tmp_path / "missing.txt")


def test_zero_shot_detector_is_asked_for_a_person(tmp_path):
    """A tiny random OWLv2 (AutoModelForZeroShotObjectDetection) loaded by path: prompted "a person", every
    box kept (no id2label needed), the same boxes as the processor's own post-processing of that prompt."""
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    from modeling_tagclip.models.tagclip.processing_tagclip import build_tokenizer

    config = Owlv2Config(
        text_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 16,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 64,
            "patch_size": 16,
        },
        projection_dim=32,
    )
    torch.manual_seed(0)
    Owlv2ForObjectDetection(config).eval().save_pretrained(tmp_path)
    tokenizer = build_tokenizer(model_max_length=16)
    Owlv2Processor(Owlv2ImageProcessor(size={"height": 64, "width": 64}), tokenizer).save_pretrained(tmp_path)
    detector = load_detector(str(tmp_path), threshold=0.0, min_size=0, max_boxes=4, batch_size=2)
    assert isinstance(detector, TransformersDetector) and detector.zero_shot and detector.person is None
    assert load_detector(str(tmp_path)).threshold == 0.2  # zero-shot scores run lower than 0.5
    images = _images(3)
    found = detector(images)
    assert all(b.shape[1] == 5 and len(b) <= 4 for b in found) and sum(len(b) for b in found) > 0
    inputs = detector.processor(text=[["a person"]] * 3, images=images, return_tensors="pt")
    with torch.no_grad():
        outputs = detector.model(**inputs)
    results = detector.processor.post_process_grounded_object_detection(
        outputs, threshold=0.0, target_sizes=[(48, 80)] * 3
    )
    for boxes, result in zip(found, results, strict=True):
        expected = np.column_stack([result["boxes"].numpy(), result["scores"].numpy()])
        expected = bound(expected, (48, 80), threshold=0.0, min_size=0, max_boxes=4)
        np.testing.assert_allclose(boxes, expected, atol=1e-4)


def test_motion_detector_takes_frames_of_several_sizes():
    """A frame folder may mix sizes: each run of one size is its own scene, nothing crashes."""
    rng = np.random.default_rng(3)
    small = [np.clip(_scene(rng, 40, 60), 0, 255).astype(np.uint8)] * 3
    large = [np.clip(_scene(rng, 60, 90), 0, 255).astype(np.uint8)] * 3
    found = MotionDetector()([*small, *large, small[0]])
    assert len(found) == 7 and all(b.shape == (0, 5) for b in found)


def test_motion_detector_is_bounded_on_a_frame_of_specks():
    """A shaking camera: a frame of salt-and-pepper specks against the learnt scene gives at most max_boxes
    boxes, quickly."""
    import time

    rng = np.random.default_rng(4)
    scene = np.full((240, 320, 3), 128, dtype=np.uint8)
    detector = MotionDetector(min_size=0, max_boxes=50, threshold=0.0)
    detector([scene] * 8)
    specks = scene.copy()
    specks[::3, ::3] = rng.choice([0, 255], size=specks[::3, ::3].shape)
    specks[::3, 1::3] = specks[::3, ::3][:, : specks[::3, 1::3].shape[1]]
    start = time.perf_counter()
    (boxes,) = detector([specks])
    assert len(boxes) <= 50 and time.perf_counter() - start < 5
